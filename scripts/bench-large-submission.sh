#!/usr/bin/env bash
# How long agents' syncs wait while one request adds, then cancels, a large array: a probe
# syncs as a node every 200 ms throughout. Results go in BENCHMARKS.md ("Control plane under
# load").
#
#   PERCH=target/release/perch scripts/bench-large-submission.sh [ENV_BYTES] [TASKS]
#
# ENV_BYTES (default 65000) of environment per task and TASKS (default 256) tasks: the
# defaults are the most bytes one submission may hold (16 MiB). Binds port 0 on loopback.
# Needs python3.
set -euo pipefail
PERCH=$(realpath "${PERCH:-target/release/perch}")
ENV_BYTES=${1:-65000}
TASKS=${2:-256}
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; wait; rm -rf "$work"' EXIT
cd "$work"
cat > perch.toml <<EOT
[server]
pg_listen = ""
node_stale_after_secs = 3
node_lease_secs = 10
EOT
PERCH_RUN_AS_USER=never "$PERCH" server --config perch.toml --data-dir "$work/server" \
  --listen 127.0.0.1:0 > server.log 2>&1 & echo $! > server.pid
for _ in $(seq 300); do [ -s server/server.addr ] && break; sleep 0.1; done
url=http://$(cat server/server.addr)
PERCH_RUN_AS_USER=never "$PERCH" agent --server "$url" --node gpu-a --nvml off \
  --simulate-gpus 1 --interval-ms 200 --data-dir "$work/agent" > agent.log 2>&1 &
echo $! > agent.pid

cat > probe.py <<'EOT'
import json, sys, threading, time, urllib.request
url, env_bytes, tasks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, json.loads(r.read())

for _ in range(600):
    try:
        nodes = json.load(urllib.request.urlopen(url + "/v1/nodes"))["nodes"]
        if nodes and nodes[0]["state"] == "up":
            break
    except OSError:
        pass
    time.sleep(0.1)
else:
    sys.exit("the agent's node never came up")

def during(what, request):
    syncs, done = [], threading.Event()
    def probe():
        while not done.is_set():
            t = time.monotonic()
            post("/v1/agent/sync", {"node": "probe", "gpus": 0, "gpu_model": "none"})
            syncs.append((t, time.monotonic() - t))
            time.sleep(0.2)
    thread = threading.Thread(target=probe)
    thread.start()
    start = time.monotonic()
    status, body = request()
    took = time.monotonic() - start
    done.set()
    thread.join()
    # Every sync that was waiting at some moment of the request, begun before it or not.
    waits = sorted(d for t, d in syncs if t <= start + took and t + d >= start)
    print(f"{what}: {status} in {took:.2f} s; {len(waits)} syncs meanwhile, "
          f"p50 {1000 * waits[len(waits) // 2]:.1f} ms, max {1000 * waits[-1]:.1f} ms")
    return body

job = during(f"{tasks} tasks with {env_bytes} bytes of environment each",
             lambda: post("/v1/jobs", {"command": ["true"], "gpus_per_node": 2,
                                       "array": tasks, "hold_until_fits": True,
                                       "env": {"PAYLOAD": "x" * env_bytes}}))
during("cancelling the array", lambda: post("/v1/jobs/cancel", {"array": job["id"]}))
EOT
python3 probe.py "$url" "$ENV_BYTES" "$TASKS"
