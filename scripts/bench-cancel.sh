#!/usr/bin/env bash
# Cancelling a large array: 100,000 pending tasks (a server without nodes, so none starts),
# then three rounds of 2,000 cancels one request per task from 8 clients, each round followed
# by a GET /v1/nodes to see the control plane answer; then the rest in two batch cancels
# (POST /v1/jobs/cancel: one array of 10,000, then every task left, by user), while a client
# times GET /v1/nodes every 50 ms. Results go in BENCHMARKS.md ("Jobs").
#
#   PERCH=target/release/perch scripts/bench-cancel.sh [PORT]
#
# Needs python3. Listens on 127.0.0.1:PORT (default 7396). The priority period is 10 s so the
# queue is re-sorted by priority before the cancels, as it is on a server up for minutes.
set -euo pipefail
PERCH=$(realpath "${PERCH:-target/release/perch}")
PORT=${1:-7396}
work=$(mktemp -d)
stop() {
  if [ -f "$work/server.pid" ]; then
    kill "$(cat "$work/server.pid")" 2>/dev/null || true
    wait 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap stop EXIT
cat > "$work/perch.toml" <<EOT
[server]
listen = "127.0.0.1:$PORT"
data_dir = "$work/data"
pg_listen = ""
max_pending_jobs_per_user = 200000
[scheduler]
priority_period = "10s"
EOT
"$PERCH" --config "$work/perch.toml" server > "$work/server.log" 2>&1 &
echo $! > "$work/server.pid"
python3 - "$PORT" <<'PY'
import concurrent.futures, json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(100):
    try:
        urllib.request.urlopen(base + "/healthz")
        break
    except OSError:
        time.sleep(0.1)
def post(path, body, timeout=60):
    r = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                               headers={"content-type": "application/json"}, method="POST")
    try:
        return json.load(urllib.request.urlopen(r, timeout=timeout))
    except Exception as e:
        return {"failed": str(e)}
t = time.time()
for _ in range(10):
    post("/v1/jobs", {"command": ["python3", "train.py"], "user": "alice",
                      "gpus_per_node": 1, "array": 10000})
print(f"submit 100000 tasks: {time.time() - t:.1f} s", flush=True)
time.sleep(12)
for first in (1, 2001, 4001):
    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda i: post(f"/v1/jobs/{i}/cancel", {}), range(first, first + 2000)))
    took = time.time() - t
    t = time.time()
    urllib.request.urlopen(base + "/v1/nodes").read()
    print(f"cancel 2000 (ids {first}-{first + 1999}): {took:.2f} s, {took / 2:.2f} ms each; "
          f"GET /v1/nodes after: {time.time() - t:.3f} s", flush=True)
import threading
def batch(what, body):
    gaps, done = [], threading.Event()
    def poll():
        while not done.is_set():
            t = time.time()
            urllib.request.urlopen(base + "/v1/nodes").read()
            gaps.append(time.time() - t)
            time.sleep(0.05)
    poller = threading.Thread(target=poll)
    poller.start()
    t = time.time()
    out = post("/v1/jobs/cancel", body, timeout=600)
    took = time.time() - t
    done.set()
    poller.join()
    if "cancelled" not in out:
        print(f"batch cancel of {what}: {out}", flush=True)
        return
    gaps = sorted(gaps) or [0.0]
    print(f"batch cancel of {what}: {len(out['cancelled'])} cancelled in {took:.2f} s; "
          f"GET /v1/nodes meanwhile ({len(gaps)} calls): median {gaps[len(gaps) // 2] * 1000:.0f} ms, "
          f"max {gaps[-1] * 1000:.0f} ms", flush=True)
batch("the array 90001", {"array": 90001})
batch("every task left", {"user": "alice"})
PY
