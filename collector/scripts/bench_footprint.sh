#!/usr/bin/env bash
# Footprint of the perch agent next to Prometheus node_exporter, on the same machine, at the
# same interval, in the same run.
#
# The agent (release build of collector/examples/agent_bench.rs) samples 8 GPUs through the
# stand-in NVML (collector/tests/fixtures/nvml/eight_h100.json: 18 NVLinks, one process each, an
# XID), the host, every NIC and InfiniBand port once a second, and sends to a perch server.
# node_exporter (Debian prometheus-node-exporter, default collectors) is scraped once a second.
# CPU is utime+stime from /proc/<pid>/stat over the measuring window, as a share of one core;
# memory is VmRSS at the end and VmHWM (peak RSS) over the run.
#
# usage: collector/scripts/bench_footprint.sh PERCH_BINARY [SECONDS]
#   PERCH_BINARY: a perch build, used only as the server the agent sends to.
set -euo pipefail
PERCH=${1:?usage: bench_footprint.sh PERCH_BINARY [SECONDS]}
SECONDS_MEASURED=${2:-120}
WARMUP=10
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
command -v prometheus-node-exporter >/dev/null || apt-get install -y prometheus-node-exporter >/dev/null

cargo build --release --quiet -p nvml-standin --manifest-path "$ROOT/Cargo.toml"
cargo build --release --quiet -p perch-collector --example agent_bench --manifest-path "$ROOT/Cargo.toml"
AGENT=$TARGET/release/examples/agent_bench
LIB=$TARGET/release/libnvml_standin.so
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK" || true
}
trap cleanup EXIT

"$PERCH" server --listen 127.0.0.1:0 --data-dir "$WORK/server" >"$WORK/server.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do [ -s "$WORK/server/server.addr" ] && break; sleep 0.1; done
URL="http://$(cat "$WORK/server/server.addr")"

TOTAL=$((WARMUP + SECONDS_MEASURED + 5))
PERCH_NVML_STANDIN_SCENARIO=$ROOT/collector/tests/fixtures/nvml/eight_h100.json \
  "$AGENT" "$URL" "$LIB" "$TOTAL" >"$WORK/agent.out" 2>"$WORK/agent.log" &
AGENT_PID=$!
PIDS+=($AGENT_PID)
prometheus-node-exporter --web.listen-address=127.0.0.1:19100 >"$WORK/ne.log" 2>&1 &
NE_PID=$!
PIDS+=($NE_PID)
( while kill -0 "$NE_PID" 2>/dev/null; do curl -s -o /dev/null http://127.0.0.1:19100/metrics; sleep 1; done ) &
PIDS+=($!)

ticks() { awk '{ n = split($0, a, ") "); split(a[n], f, " "); print f[12] + f[13] }' "/proc/$1/stat"; }
mem() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }
HZ=$(getconf CLK_TCK)
sleep "$WARMUP"
A0=$(ticks "$AGENT_PID"); N0=$(ticks "$NE_PID"); T0=$(date +%s.%N)
sleep "$SECONDS_MEASURED"
A1=$(ticks "$AGENT_PID"); N1=$(ticks "$NE_PID"); T1=$(date +%s.%N)
report() {
  awk -v name="$1" -v t="$(($3 - $2))" -v hz="$HZ" -v s0="$T0" -v s1="$T1" -v rss="$4" -v hwm="$5" 'BEGIN {
    printf "| %s | %.2f%% | %.1f MB | %.1f MB |\n", name, 100 * t / hz / (s1 - s0), rss / 1024, hwm / 1024 }'
}
echo "window: $(awk -v a="$T0" -v b="$T1" 'BEGIN { printf "%.1f", b - a }') s, $(nproc) CPUs, $(uname -r)"
echo "| process | CPU (share of one core) | RSS at end | peak RSS |"
echo "|---|---|---|---|"
report "perch agent (8 stand-in GPUs, all NICs, 1 s)" "$A0" "$A1" "$(mem "$AGENT_PID" VmRSS)" "$(mem "$AGENT_PID" VmHWM)"
report "node_exporter $(prometheus-node-exporter --version 2>&1 | awk 'NR==1 { print $3 }') (scraped every 1 s)" "$N0" "$N1" "$(mem "$NE_PID" VmRSS)" "$(mem "$NE_PID" VmHWM)"
wait "$AGENT_PID" || true
echo "agent: $(cat "$WORK/agent.out")"
