#!/usr/bin/env bash
# Footprint of the perch agent on real GPUs (the driver's NVML), twice (reading the costly NVML
# fields at the default `agent.nvml_slow_interval_ms`, 30 s, and every sample), next to two peers
# sampling the same GPUs once a second in the same run:
#   - `nvidia-smi --query-gpu=... -l 1` (the usual hand-made script's source);
#   - a Python loop over NVML (nvidia-ml-py, as a hand-made exporter reads it) asking for what
#     the agent asks: utilization, memory, power, energy, temperature, clocks, throttle reasons,
#     ECC counts, PCIe throughput and replays, and the processes with their utilization.
# A PyTorch process keeps GPU 0 busy throughout, so there is a process to list. CPU is
# utime+stime from /proc/<pid>/stat over the window, as a share of one core; memory is VmRSS at
# the end and VmHWM (peak RSS) over the run.
#
# With ALONE=1 only the agent at the default runs (beside the server and the PyTorch load), so
# its figure is not raised by the others' calls waiting on its own in the driver.
#
# usage: [ALONE=1] collector/scripts/bench_real_nvml.sh PERCH_BINARY AGENT_BENCH [SECONDS]
#   PERCH_BINARY: a perch build, used only as the server the agent sends to.
#   AGENT_BENCH: a release build of collector/examples/agent_bench.rs.
set -euo pipefail
PERCH=${1:?usage: bench_real_nvml.sh PERCH_BINARY AGENT_BENCH [SECONDS]}
AGENT=${2:?usage: bench_real_nvml.sh PERCH_BINARY AGENT_BENCH [SECONDS]}
SECONDS_MEASURED=${3:-120}
ALONE=${ALONE:-0}
WARMUP=${WARMUP:-10}
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK" || true
}
trap cleanup EXIT
TOTAL=$((WARMUP + SECONDS_MEASURED + 5))

python3 -c "
import time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
end = time.time() + $TOTAL + 5
while time.time() < end:
    a @ a; torch.cuda.synchronize()
" >"$WORK/burn.log" 2>&1 &
PIDS+=($!)

"$PERCH" server --listen 127.0.0.1:0 --data-dir "$WORK/server" >"$WORK/server.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do [ -s "$WORK/server/server.addr" ] && break; sleep 0.1; done
URL="http://$(cat "$WORK/server/server.addr")"

"$AGENT" "$URL" libnvidia-ml.so.1 "$TOTAL" 1000 >"$WORK/agent.out" 2>"$WORK/agent.log" &
AGENT_PID=$!
PIDS+=($AGENT_PID)
if [ "$ALONE" != 1 ]; then
"$AGENT" "$URL" libnvidia-ml.so.1 "$TOTAL" 1000 0 >"$WORK/every.out" 2>"$WORK/every.log" &
EVERY_PID=$!
PIDS+=($EVERY_PID)
nvidia-smi --format=csv,noheader -l 1 --query-gpu=timestamp,index,uuid,utilization.gpu,\
utilization.memory,memory.used,memory.total,power.draw,temperature.gpu,clocks.sm,clocks.mem,\
clocks_throttle_reasons.active,ecc.errors.corrected.volatile.total,\
ecc.errors.uncorrected.volatile.total >"$WORK/smi.csv" 2>&1 &
SMI_PID=$!
PIDS+=($SMI_PID)
cat >"$WORK/loop.py" <<'EOF'
import time
import pynvml as n
n.nvmlInit()
devs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
def get(f, *a):
    try:
        return f(*a)
    except n.NVMLError:
        return None
last = {}
while True:
    t = time.time()
    rows = []
    for i, d in enumerate(devs):
        row = [get(n.nvmlDeviceGetUtilizationRates, d), get(n.nvmlDeviceGetMemoryInfo, d),
               get(n.nvmlDeviceGetPowerUsage, d), get(n.nvmlDeviceGetTotalEnergyConsumption, d),
               get(n.nvmlDeviceGetTemperature, d, n.NVML_TEMPERATURE_GPU),
               get(n.nvmlDeviceGetClockInfo, d, n.NVML_CLOCK_SM),
               get(n.nvmlDeviceGetClockInfo, d, n.NVML_CLOCK_MEM),
               get(n.nvmlDeviceGetCurrentClocksThrottleReasons, d),
               get(n.nvmlDeviceGetPcieThroughput, d, n.NVML_PCIE_UTIL_TX_BYTES),
               get(n.nvmlDeviceGetPcieThroughput, d, n.NVML_PCIE_UTIL_RX_BYTES),
               get(n.nvmlDeviceGetPcieReplayCounter, d),
               get(n.nvmlDeviceGetComputeRunningProcesses, d),
               get(n.nvmlDeviceGetProcessUtilization, d, last.get(i, 0))]
        for err in (n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
            for c in (n.NVML_VOLATILE_ECC, n.NVML_AGGREGATE_ECC):
                row.append(get(n.nvmlDeviceGetTotalEccErrors, d, err, c))
        last[i] = int(t * 1e6) - 1_000_000
        rows.append(row)
    time.sleep(max(0.0, 1.0 - (time.time() - t)))
EOF
python3 "$WORK/loop.py" >"$WORK/loop.log" 2>&1 &
PY_PID=$!
PIDS+=($PY_PID)

fi

ticks() { awk '{ n = split($0, a, ") "); split(a[n], f, " "); print f[12] + f[13] }' "/proc/$1/stat"; }
mem() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }
HZ=$(getconf CLK_TCK)
# ticks/mem of a process, or 0 when it was not started (ALONE=1)
pticks() { if [ -n "${1:-}" ]; then ticks "$1"; else echo 0; fi; }
pmem() { if [ -n "${1:-}" ]; then mem "$1" "$2"; else echo 0; fi; }
EVERY_PID=${EVERY_PID:-}; SMI_PID=${SMI_PID:-}; PY_PID=${PY_PID:-}
sleep "$WARMUP"
A0=$(ticks "$AGENT_PID"); E0=$(pticks "$EVERY_PID"); S0=$(pticks "$SMI_PID"); P0=$(pticks "$PY_PID"); T0=$(date +%s.%N)
sleep "$SECONDS_MEASURED"
A1=$(ticks "$AGENT_PID"); E1=$(pticks "$EVERY_PID"); S1=$(pticks "$SMI_PID"); P1=$(pticks "$PY_PID"); T1=$(date +%s.%N)
report() {
  awk -v name="$1" -v t="$(($3 - $2))" -v hz="$HZ" -v s0="$T0" -v s1="$T1" -v rss="$4" -v hwm="$5" 'BEGIN {
    printf "| %s | %.2f%% | %.1f MB | %.1f MB |\n", name, 100 * t / hz / (s1 - s0), rss / 1024, hwm / 1024 }'
}
GPUS=$(nvidia-smi -L | grep -c '^GPU' || true)
echo "window: $(awk -v a="$T0" -v b="$T1" 'BEGIN { printf "%.1f", b - a }') s, $(nproc) CPUs, $(uname -r), $(nvidia-smi -L | head -1), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
echo "| process | CPU (share of one core) | RSS at end | peak RSS |"
echo "|---|---|---|---|"
report "perch agent ($GPUS real GPUs, host, all NICs, 1 s, sending; costly fields every 30 s, the default)" "$A0" "$A1" "$(mem "$AGENT_PID" VmRSS)" "$(mem "$AGENT_PID" VmHWM)"
if [ "$ALONE" != 1 ]; then
  report "perch agent, costly fields every sample (nvml_slow_interval_ms = 0)" "$E0" "$E1" "$(pmem "$EVERY_PID" VmRSS)" "$(pmem "$EVERY_PID" VmHWM)"
  report "nvidia-smi --query-gpu (14 fields) -l 1" "$S0" "$S1" "$(pmem "$SMI_PID" VmRSS)" "$(pmem "$SMI_PID" VmHWM)"
  report "Python NVML loop (nvidia-ml-py, the agent's GPU reads, not sending)" "$P0" "$P1" "$(pmem "$PY_PID" VmRSS)" "$(pmem "$PY_PID" VmHWM)"
  wait "$AGENT_PID" "$EVERY_PID" || true
  echo "agent: $(cat "$WORK/agent.out")"
  echo "agent, every sample: $(cat "$WORK/every.out")"
  echo "nvidia-smi rows: $(wc -l <"$WORK/smi.csv"); python loop errors: $(grep -c . "$WORK/loop.log" || true)"
  tail -n 3 "$WORK/loop.log" "$WORK/burn.log"
else
  wait "$AGENT_PID" || true
  echo "agent: $(cat "$WORK/agent.out")"
  tail -n 3 "$WORK/burn.log"
fi
