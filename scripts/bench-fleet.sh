#!/usr/bin/env bash
# What one `perch server` holds as the fleet grows (docs/scale.md): `perch bench fleet` for
# each fleet size at 1 s and at 10 s telemetry, the server pinned to CPU 0 and the generator
# to CPU 1, each run on a fresh server.
#
#   cargo build --release -p perch -p perch-bench && scripts/bench-fleet.sh [SECONDS] [SIZES...]
#
# SECONDS measured per run (default 60); SIZES default to 1000 2000 5000 10000; INTERVALS (ms)
# to 1000 10000. PERCH_BENCH
# names the bench binary (default $CARGO_TARGET_DIR/release/perch-bench); the perch beside it
# runs the server. Prints each run's table, then one JSON line per run. Results go in
# BENCHMARKS.md ("Fleet size").
set -euo pipefail
seconds=${1:-60}
shift || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(1000 2000 5000 10000)
bench=${PERCH_BENCH:-${CARGO_TARGET_DIR:-$HOME/.cache/perch-target}/release/perch-bench}
[ -x "$bench" ] || { echo "no perch-bench at $bench: cargo build --release -p perch -p perch-bench" >&2; exit 1; }
cpus=$(nproc)
pin=()
[ "$cpus" -ge 2 ] && pin=(--server-cpus 0 --generator-cpus 1-$((cpus - 1)))
# Two connections a node: raise the descriptor limit for the server (it inherits it).
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
work=$(mktemp -d /tmp/perch-fleet-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
for interval in ${INTERVALS:-1000 10000}; do
  for n in "${sizes[@]}"; do
    "$bench" fleet --nodes "$n" --interval-ms "$interval" --seconds "$seconds" \
      --ramp-seconds $((n / 500 + 10)) --dir "$work" --json "${pin[@]}" | tee "$work/run.txt" ||
      echo "{\"nodes\": $n, \"interval_ms\": $interval, \"error\": \"the run failed (above)\"}" >"$work/run.txt"
    tail -1 "$work/run.txt" >>"$work/all.jsonl"
  done
done
cat "$work/all.jsonl"
