#!/usr/bin/env bash
# Checks perch against the real GPUs of this machine, as an operator would on a new node:
#
#   scripts/gpu-check.sh ./target/release/perch [REPORT_DIR]
#
# It starts `perch up` on a non-default port with NVML (no simulated GPUs), compares what perch
# recorded with what nvidia-smi reads, runs a CUDA job through `perch submit` (PyTorch matrix
# products on one GPU for BURN_SECONDS), checks that the job saw only its GPU, that its process
# was attributed to it and that its usage (GPU-seconds, utilization, memory, energy) was
# accounted, then validates the node with perch's built-in check (`perch validate`: NVML health
# of every GPU, a GPU burn and a memory check through torch; docs/validation.md) and checks that
# it burned every GPU and resumed the node, and writes everything it saw to REPORT_DIR (default
# ./gpu-check). MIG and MPS (docs/mig.md) are checked where the machine has them: on a GPU
# already in MIG mode, that perch lists the instances nvidia-smi lists and that a
# `--gpu-profile` job sees its instance's UUID; where nvidia-cuda-mps-control is installed,
# whether its daemon runs and that a shared job gets the MPS limits. It never enables MIG,
# creates or removes instances, starts or stops the MPS daemon, or resets a GPU: what it
# cannot check it writes as a SKIP line with the reason. It needs nvidia-smi and python3 with
# torch. Exit status 0 when every check passed; each failed check is
# one `FAIL` line in REPORT_DIR/summary.txt.
set -u
PERCH=$(realpath "${1:?usage: gpu-check.sh PERCH_BINARY [REPORT_DIR]}")
R=$(mkdir -p "${2:-./gpu-check}" && realpath "${2:-./gpu-check}")
PORT=${PORT:-17391} # 0: free ports, read back from the server (as the tests run it)
BURN_SECONDS=${BURN_SECONDS:-45}
UP_ARGS=${UP_ARGS:-} # e.g. "--nvml off --simulate-gpus 1" to try the script without GPUs
# perch never runs a job as root, nor as nobody: as root, the job runs as JOB_USER (default
# perch-gpu-check, an ordinary user made here if missing).
JOB_USER=${JOB_USER:-$(id -un)}
if [ "$JOB_USER" = root ]; then
  JOB_USER=perch-gpu-check
  id -u "$JOB_USER" >/dev/null 2>&1 || useradd --no-create-home --shell /usr/sbin/nologin "$JOB_USER"
fi
WORK=$(mktemp -d)
chmod 755 "$WORK"
export PERCH_SERVER=http://127.0.0.1:$PORT
SUMMARY=$R/summary.txt
: >"$SUMMARY"
failed=0
say() { echo "$*" | tee -a "$SUMMARY"; }
check() { # check NAME COMMAND...: runs the command, records PASS or FAIL
  local name=$1
  shift
  if "$@" >>"$R/checks.log" 2>&1; then say "PASS $name"; else say "FAIL $name"; failed=1; fi
}
sql() { "$PERCH" sql --format csv "$1"; }

nvidia-smi >"$R/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version \
  --format=csv,noheader,nounits >"$R/smi-gpus.csv" 2>&1
say "nvidia-smi: $(head -1 "$R/smi-gpus.csv")"

# Non-default port; job usage folded every 10 s (not 300) so the check needs no long wait.
cat >"$WORK/perch.toml" <<EOF
[server]
listen = "127.0.0.1:$PORT"
data_dir = "$WORK/data"
flush_interval_secs = 2
pg_listen = "127.0.0.1:$((PORT == 0 ? 0 : PORT + 1))"
[agent]
interval_ms = 1000
gpu_sharing = true
[accounting]
fold_interval_secs = 10
settle_secs = 5
[validation]
burn_secs = 10
timeout_secs = 600
EOF
cp "$WORK/perch.toml" "$R/"
export PERCH_CONFIG=$WORK/perch.toml
"$PERCH" up $UP_ARGS >"$R/perch-up.log" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null; rm -rf "$WORK"' EXIT
# The address the server bound (PORT=0 asks for a free one).
for _ in $(seq 60); do [ -s "$WORK/data/server.addr" ] && break; sleep 0.5; done
export PERCH_SERVER=http://$(head -1 "$WORK/data/server.addr" 2>/dev/null || echo "127.0.0.1:$PORT")
for _ in $(seq 60); do curl -sf "$PERCH_SERVER/healthz" >/dev/null && break; sleep 0.5; done
sleep 6

"$PERCH" nodes >"$R/nodes.txt" 2>&1
sql "SELECT gpu, uuid, model, simulated, memory_total_bytes FROM gpu_samples
     WHERE time = (SELECT max(time) FROM gpu_samples) ORDER BY gpu" >"$R/gpus.csv" 2>&1
n_smi=$(grep -c . "$R/smi-gpus.csv")
check "perch found every GPU nvidia-smi lists ($n_smi)" \
  test "$(grep -c ',false,' "$R/gpus.csv")" -eq "$n_smi"
check "no simulated GPU" bash -c "! grep -q ',true,' '$R/gpus.csv'"
uuid0=$(head -1 "$R/smi-gpus.csv" | cut -d, -f2 | tr -d ' ')
check "GPU 0's UUID matches nvidia-smi ($uuid0)" grep -q "^0,$uuid0," "$R/gpus.csv"
mib0=$(head -1 "$R/smi-gpus.csv" | cut -d, -f4 | tr -d ' ')
check "GPU 0's memory matches nvidia-smi (${mib0} MiB)" \
  grep -q "^0,$uuid0,.*,false,$((mib0 * 1048576))$" "$R/gpus.csv"

# Which fields this GPU and driver give (an absent one is NULL, never 0).
cols=$(sql "SELECT * FROM gpu_samples LIMIT 0" | head -1)
exprs=$(echo "$cols" | tr ',' '\n' | grep -vE '^(time|node|gpu|uuid|model|simulated)$' |
  sed 's/.*/count("&") AS "&"/' | paste -sd,)
sql "SELECT $exprs FROM gpu_samples" >"$R/fields-present.csv" 2>&1
sql "SELECT * FROM gpu_samples ORDER BY time DESC LIMIT 1" >"$R/last-sample.csv" 2>&1

cat >"$WORK/burn.py" <<'EOF'
import os, sys, time
import torch
print("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
print("device_count", torch.cuda.device_count(), flush=True)
print("device", torch.cuda.get_device_name(0), flush=True)
print("uuid GPU-%s" % torch.cuda.get_device_properties(0).uuid, flush=True)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
hold = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")  # 8 GiB more, to be seen
end, n, t0 = time.time() + float(sys.argv[1]), 0, time.time()
while time.time() < end:
    for _ in range(50):
        a @ b
    torch.cuda.synchronize()
    n += 50
print("tflops %.0f" % (n * 2 * 8192**3 / (time.time() - t0) / 1e12), flush=True)
EOF
chmod 644 "$WORK/burn.py"
# The driver's own energy counter around the job, to check perch's figure (nvidia-ml-py).
energy() {
  python3 -c "import pynvml as n; n.nvmlInit(); print(n.nvmlDeviceGetTotalEnergyConsumption(n.nvmlDeviceGetHandleByIndex(0)) / 1000)" 2>/dev/null
}
E_BEFORE=$(energy)
"$PERCH" submit --user "$JOB_USER" --gpus 1 --time 10m -J gpu-check -D "$WORK" -- "$(command -v python3)" "$WORK/burn.py" \
  "$BURN_SECONDS" >"$R/submit.txt" 2>&1
JOB=$(grep -oE '[0-9]+' "$R/submit.txt" | head -1)
say "job: $(cat "$R/submit.txt")"
# A process on the GPU that no job started: perch must flag it (rogue), not bill it to the job.
python3 -c "import torch, time; x = torch.ones(1 << 28, device='cuda'); time.sleep($((BURN_SECONDS / 2)))" \
  >"$R/rogue.log" 2>&1 &
ROGUE=$!
sleep $((BURN_SECONDS / 2))
"$PERCH" show "$JOB" >"$R/show-running.txt" 2>&1
nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader \
  >"$R/smi-apps-running.csv" 2>&1
curl -s "$PERCH_SERVER/metrics" | grep -E '^perch_gpu|^perch_job' >"$R/metrics-running.txt"
"$PERCH" nodes >"$R/nodes-running.txt" 2>&1
for _ in $(seq $((BURN_SECONDS + 60))); do
  "$PERCH" show "$JOB" 2>&1 | grep -qiE 'state: *(completed|failed|cancelled)|State=(COMPLETED|FAILED)' && break
  sleep 1
done
E_AFTER=$(energy)
sleep 25 # settle_secs and one fold
"$PERCH" show "$JOB" >"$R/show-done.txt" 2>&1
"$PERCH" logs "$JOB" >"$R/job-log.txt" 2>&1
"$PERCH" logs --stderr "$JOB" >"$R/job-stderr.txt" 2>&1
sql "SELECT job, state, gpus, gpu_seconds_used, utilization_mean_pct, memory_peak_bytes,
            energy_joules FROM jobs WHERE job = $JOB" >"$R/job-usage.csv" 2>&1
sql "SELECT * FROM gpu_processes WHERE job = $JOB ORDER BY time DESC LIMIT 5" \
  >"$R/gpu-processes.csv" 2>&1
sql "SELECT * FROM gpu_processes WHERE job IS NULL ORDER BY time DESC LIMIT 5" \
  >"$R/gpu-processes-rogue.csv" 2>&1
sql "SELECT count(*) AS samples, max(utilization_gpu_pct) AS util_max, max(power_watts) AS
     power_max, max(memory_used_bytes) AS mem_max, max(sm_clock_mhz) AS sm_max FROM gpu_samples
     WHERE gpu = 0" >"$R/gpu0-peaks.csv" 2>&1

check "the job saw exactly one GPU" grep -q '^device_count 1$' "$R/job-log.txt"
# The GPU CUDA gave the job is the one perch placed it on (index order: CUDA_DEVICE_ORDER).
placed=$(grep -oE 'Placement=[^ ]*\[[0-9]+\]' "$R/show-done.txt" | grep -oE '[0-9]+\]$' | tr -d ']')
placed_uuid=$(awk -F, -v g="$placed" '$1 == g {print $2}' "$R/gpus.csv")
check "the job ran on the GPU perch placed it on (GPU $placed, $placed_uuid)" \
  grep -qx "uuid $placed_uuid" "$R/job-log.txt"
check "the job ran at real speed" grep -qE '^tflops [0-9]{3}' "$R/job-log.txt"
check "the job ended completed" grep -qi 'completed' "$R/show-done.txt"
check "perch saw GPU 0 busy (>= 90%)" \
  awk -F, 'NR==2 && $2 >= 90 {ok=1} END {exit !ok}' "$R/gpu0-peaks.csv"
check "the job's process was attributed to it" \
  awk -F, -v j="$JOB" 'NR==1 {for (i=1;i<=NF;i++) if ($i=="job") c=i} NR>1 && $c==j {ok=1} END {exit !ok}' \
  "$R/gpu-processes.csv"
check "the job's usage was accounted (utilization >= 50%, memory >= 8 GiB, energy > 0)" \
  awk -F, 'NR==2 && $5 >= 50 && $6 >= 8*2^30 && $7 > 0 {ok=1} END {exit !ok}' "$R/job-usage.csv"
if [ -n "$E_BEFORE" ] && [ -n "$E_AFTER" ]; then
  say "driver's energy counter rose $(awk -v a="$E_BEFORE" -v b="$E_AFTER" 'BEGIN { print b - a }') J from submit to end"
  check "the job's energy is the driver's counter rise around it (95-103%: a second of samples at each edge)" \
    awk -F, -v d="$(awk -v a="$E_BEFORE" -v b="$E_AFTER" 'BEGIN { print b - a }')" \
    'NR==2 && d > 0 && $7 >= 0.95 * d && $7 <= 1.03 * d {ok=1} END {exit !ok}' "$R/job-usage.csv"
else
  say "SKIP the job's energy against the driver's counter (no python3 nvidia-ml-py)"
fi
check "a process outside perch was flagged rogue (pid $ROGUE)" \
  grep -qE "^[^,]*,[^,]*,[^,]*,[^,]*,[^,]*,$ROGUE,.*,true$" "$R/gpu-processes-rogue.csv"
check "the Prometheus endpoint has real GPU series" grep -q 'simulated="false"' "$R/metrics-running.txt"

# The state of job $1 once it matches the regex $2 (perch show), waiting up to $3 seconds; the
# last state seen otherwise.
wait_state() {
  local state=
  for _ in $(seq "$3"); do
    state=$("$PERCH" show "$1" 2>/dev/null | grep -oE 'State=[a-z_]+' | head -1)
    echo "$state" | grep -qE "$2" && break
    sleep 1
  done
  echo "$state"
}

# MIG (docs/mig.md): GPUs an operator put in MIG mode are placed only as their instances. Only
# read here: MIG mode, the instances and the GPUs are left as they are.
nvidia-smi --query-gpu=index,mig.mode.current --format=csv,noheader >"$R/smi-mig-mode.csv" 2>&1
mig_gpus=$(awk -F', *' '$2 == "Enabled" {print $1}' "$R/smi-mig-mode.csv" | paste -sd' ')
if [ -z "$mig_gpus" ]; then
  say "SKIP MIG: not enabled on any GPU (nvidia-smi's mig.mode.current; this script never enables it)"
else
  say "MIG: enabled on GPU(s) $mig_gpus"
  nvidia-smi -L >"$R/smi-list.txt" 2>&1
  grep -oE 'MIG-[^) ]+' "$R/smi-list.txt" | sort >"$R/smi-mig-uuids.txt"
  "$PERCH" nodes >"$R/nodes-mig.txt" 2>&1
  # `MIG <node> GPU <index> <profile> <uuid> free|job <id> (<user>)`
  awk '$1 == "MIG" {print $6}' "$R/nodes-mig.txt" | sort >"$R/perch-mig-uuids.txt"
  check "perch lists the MIG instances nvidia-smi lists ($(grep -c . "$R/smi-mig-uuids.txt"))" \
    bash -c "test -s '$R/smi-mig-uuids.txt' && diff '$R/smi-mig-uuids.txt' '$R/perch-mig-uuids.txt'"
  profile=$(awk '$1 == "MIG" && $7 == "free" {print $5; exit}' "$R/nodes-mig.txt")
  if [ -z "$profile" ]; then
    say "SKIP the MIG job: perch lists no free MIG instance"
  else
    "$PERCH" submit --user "$JOB_USER" --gpu-profile "$profile" --time 5m -J gpu-check-mig -D "$WORK" \
      -- sh -c 'echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES PERCH_GPU_PROFILE=$PERCH_GPU_PROFILE
        python3 -c "import torch; print(\"device_count\", torch.cuda.device_count())" 2>&1 | tail -1
        sleep 5' >"$R/submit-mig.txt" 2>&1
    MJOB=$(grep -oE '[0-9]+' "$R/submit-mig.txt" | head -1)
    say "MIG job ($profile): $(cat "$R/submit-mig.txt")"
    wait_state "$MJOB" 'running|completed|failed|cancelled' 60 >/dev/null
    "$PERCH" nodes >"$R/nodes-mig-running.txt" 2>&1
    held=$(awk -v j="$MJOB" '$1 == "MIG" && $7 == "job" && $8 == j {print $6; exit}' "$R/nodes-mig-running.txt")
    wait_state "$MJOB" 'completed|failed|cancelled|timeout' 60 >/dev/null
    "$PERCH" logs "$MJOB" >"$R/job-mig-log.txt" 2>&1
    check "the $profile job held a $profile instance (${held:-none listed})" \
      grep -qE "^MIG [^ ]+ GPU [0-9]+ $profile ${held:-none} job $MJOB " "$R/nodes-mig-running.txt"
    check "the $profile job saw CUDA_VISIBLE_DEVICES=its MIG UUID" \
      grep -qx "CUDA_VISIBLE_DEVICES=${held:-none} PERCH_GPU_PROFILE=$profile" "$R/job-mig-log.txt"
    if grep -q '^device_count' "$R/job-mig-log.txt"; then
      check "CUDA in the $profile job saw one device" grep -qx 'device_count 1' "$R/job-mig-log.txt"
    else
      say "SKIP CUDA in the MIG job: no python3 with torch as $JOB_USER"
    fi
  fi
fi

# MPS (docs/mig.md): a shared job (--gpu-fraction) gets the MPS limits in its environment; the
# MPS control daemon, which enforces them, is the operator's to start (never done here).
if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  say "SKIP MPS: nvidia-cuda-mps-control is not installed (shares would run without MPS's limits)"
else
  if pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1; then
    say "MPS: the control daemon is running (shares' limits are enforced)"
  else
    say "MPS: nvidia-cuda-mps-control is installed but its daemon is not running (shares' limits are not enforced; nvidia-cuda-mps-control -d starts it)"
  fi
  "$PERCH" submit --user "$JOB_USER" --gpu-fraction 0.25 --gpu-memory-gb 1 --time 5m -J gpu-check-mps \
    -D "$WORK" -- sh -c 'env | grep -E "^(CUDA_VISIBLE_DEVICES|CUDA_MPS_|PERCH_GPU_)" | sort' \
    >"$R/submit-mps.txt" 2>&1
  SJOB=$(grep -oE '[0-9]+' "$R/submit-mps.txt" | head -1)
  say "shared job: $(cat "$R/submit-mps.txt")"
  state=$(wait_state "$SJOB" 'completed|failed|cancelled|timeout' 60)
  "$PERCH" show "$SJOB" >"$R/show-mps.txt" 2>&1
  "$PERCH" logs "$SJOB" >"$R/job-mps-log.txt" 2>&1
  if [ -z "$state" ] || echo "$state" | grep -q pending; then
    say "SKIP the shared job's environment: it did not start in 60 s ($(grep -oE 'Reason=.* ExitCode' "$R/show-mps.txt" | head -1 | sed 's/ ExitCode$//'))"
  else
    check "the shared job got CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" \
      grep -qx 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25' "$R/job-mps-log.txt"
    check "the shared job got CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M" \
      grep -qx 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M' "$R/job-mps-log.txt"
  fi
fi

# The built-in validation (docs/validation.md): the node drained, every GPU's NVML health, then
# a 10 s burn and a memory check per GPU through torch, and the node resumed when all pass.
NODE=$(sql "SELECT node FROM nodes ORDER BY node LIMIT 1" | sed -n 2p)
"$PERCH" validate "$NODE" >"$R/validate.txt" 2>&1
say "validation: $(tail -1 "$R/validate.txt")"
sql "SELECT * FROM node_validations ORDER BY id" >"$R/node-validations.csv" 2>&1
check "the node's validation passed and resumed it ($NODE)" \
  grep -q "validation passed, exit code 0; up$" "$R/validate.txt"
check "the validation burned and memory-checked every GPU ($n_smi)" \
  test "$(grep -cE '^  GPU [0-9]+: burn [0-9]+ matmuls .* memory check passed$' "$R/validate.txt")" -eq "$n_smi"

exit $failed
