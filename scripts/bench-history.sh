#!/usr/bin/env bash
# A server with a long history: JOBS one-GPU jobs (default 100,000) run and completed on 100
# fake nodes of 8 GPUs (this script syncs as their agents), then SQL over the live tables
# (`jobs`, `job_allocations`, `cluster_utilization_daily`), a /metrics scrape and job listings
# (GET /v1/jobs, one page, then four at once), one at a time, while a
# client times GET /v1/nodes every 20 ms: the slowest of those is how long the query held the
# control plane, which agents' syncs wait for. Results go in BENCHMARKS.md ("Control plane
# under load").
#
#   PERCH=target/release/perch scripts/bench-history.sh [PORT] [JOBS]
#
# With SETTLE_WAIT=SECONDS (say 780), it then waits that long, until the jobs have settled and
# their records left memory (ten minutes after their end, once accounting has folded them:
# every 60 s here), measures again, and restarts the server on the same history (its memory
# then, and the time it took to start). With WAVES=N as well, N - 1 more waves of JOBS jobs run
# after that measure, each followed by the same wait (the server's memory after each). With
# PEER=/path/to/another/perch as well, that binary is then started on a copy of the same job
# database (without the settled rows' files, which it would not read) and measured the same way,
# and then this build again on the peer's copy (as after an upgrade: it writes the files anew).
# Each of those starts ends with the server's memory after the queries and 40 s later, idle
# (freed memory handed back, src/memory.rs).
#
# With KEEP_DATA=DIR, the history's data directory is copied to DIR before the script ends (for
# scripts/bench-filters.sh).
#
# Needs python3. Listens on 127.0.0.1:PORT (default 7397).
set -euo pipefail
PERCH=$(realpath "${PERCH:-target/release/perch}")
PORT=${1:-7397}
JOBS=${2:-100000}
SETTLE_WAIT=${SETTLE_WAIT:-0}
WAVES=${WAVES:-1}
PEER=${PEER:+$(realpath "$PEER")}
work=$(mktemp -d)
stop() {
  if [ -f "$work/server.pid" ]; then
    kill "$(cat "$work/server.pid")" 2>/dev/null || true
    wait 2>/dev/null || true
  fi
  if [ -n "${KEEP_DATA:-}" ]; then
    rm -rf "$KEEP_DATA" && cp -r "$work/data" "$KEEP_DATA"
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
[accounting]
fold_interval_secs = 60
settle_secs = 5
EOT
"$PERCH" --config "$work/perch.toml" server > "$work/server.log" 2>&1 &
echo $! > "$work/server.pid"
python3 - "$PORT" "$JOBS" "$(cat "$work/server.pid")" "$SETTLE_WAIT" "$PERCH" "$work" "$WAVES" "$PEER" <<'PY'
import json, shutil, subprocess, sys, threading, time, urllib.error, urllib.request
base, jobs, pid = f"http://127.0.0.1:{sys.argv[1]}", int(sys.argv[2]), sys.argv[3]
settle_wait, perch, work = int(sys.argv[4]), sys.argv[5], sys.argv[6]
waves, peer = int(sys.argv[7]), sys.argv[8]
def healthy():
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/healthz")
            return
        except OSError:
            time.sleep(0.1)
healthy()
def post(path, body, timeout=600):
    r = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                               headers={"content-type": "application/json"}, method="POST")
    return json.load(urllib.request.urlopen(r, timeout=timeout))
nodes = [f"fake-{i:03}" for i in range(100)]
def sync(node, exited):
    return post("/v1/agent/sync", {"node": node, "gpus": 8, "gpu_model": "Fake H100",
                                   "exited": exited})
for n in nodes:
    sync(n, [])
def run_jobs():
    t = time.time()
    for first in range(0, jobs, 10000):
        post("/v1/jobs", {"command": ["python3", "train.py"], "user": f"user{first // 10000 % 7}",
                          "account": f"team{first // 10000 % 3}", "gpus_per_node": 1,
                          "array": min(10000, jobs - first)})
    print(f"submitted {jobs} jobs in {time.time() - t:.1f} s", flush=True)
    t, running, done = time.time(), {n: [] for n in nodes}, 0
    while done < jobs:
        for n in nodes:
            exited = [{"job": j, "attempt": a, "code": 0} for j, a in running[n]]
            done += len(exited)
            r = sync(n, exited)
            running[n] = [(s["job"], s["attempt"]) for s in r["start"]]
        print(f"  {done} done, {sum(map(len, running.values()))} running, {time.time() - t:.1f} s", file=sys.stderr, flush=True)
        if not any(running.values()) and done < jobs:
            time.sleep(1.1)  # the next pass (the ticker's) hands out the GPUs
    print(f"ran and completed them in {time.time() - t:.1f} s", flush=True)
run_jobs()
def timed(what, call):
    gaps, stop = [], threading.Event()
    def poll():
        while not stop.is_set():
            s = time.time()
            urllib.request.urlopen(base + "/v1/nodes").read()
            gaps.append(time.time() - s)
            time.sleep(0.02)
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.1)
    s = time.time()
    out = call()
    took = time.time() - s
    time.sleep(0.1)
    stop.set()
    poller.join()
    print(f"{what}: {took:.2f} s ({out}); GET /v1/nodes meanwhile: slowest {max(gaps) * 1000:.0f} ms "
          f"of {len(gaps)}", flush=True)
def sql(q):
    return lambda: post("/v1/sql", {"sql": q})["rows"][0]
def queries():
    timed("SELECT count(*) FROM jobs", sql("SELECT count(*) AS n FROM jobs"))
    timed("GPU-hours by account from jobs",
          sql("SELECT account, sum(gpu_seconds_allocated) / 3600 AS h FROM jobs GROUP BY account ORDER BY account"))
    timed("cost by user from jobs",
          sql("SELECT user_name, sum(cost_allocated) AS c FROM jobs GROUP BY user_name ORDER BY user_name"))
    timed("every column of one job from jobs", sql(f"SELECT * FROM jobs WHERE job = {jobs // 2}"))
    timed("SELECT count(*) FROM job_allocations", sql("SELECT count(*) AS n FROM job_allocations"))
    timed("SELECT count(*) FROM cluster_utilization_daily", sql("SELECT count(*) AS n FROM cluster_utilization_daily"))
    timed("GET /metrics", lambda: len(urllib.request.urlopen(base + "/metrics").read()))
    timed(f"GET /v1/jobs/1", lambda: len(urllib.request.urlopen(base + "/v1/jobs/1").read()))
queries()
def listings(n, limit):
    def one(out):
        try:
            out.append(len(urllib.request.urlopen(base + f"/v1/jobs?limit={limit}", timeout=600).read()))
        except urllib.error.HTTPError as e:
            out.append(f"HTTP {e.code}")
    def call():
        out = []
        threads = [threading.Thread(target=one, args=(out,)) for _ in range(n)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return ", ".join(map(str, out))
    return call
def memory(what, field="VmHWM"):
    with open(f"/proc/{pid}/status") as f:
        rss = [l.split()[1] for l in f if l.startswith(field)][0]
    name = "peak RSS" if field == "VmHWM" else "RSS"
    print(f"server {name}{what}: {int(rss) // 1024} MB", flush=True)
def pages():
    timed("GET /v1/jobs?limit=10000", listings(1, 10000))
    timed("4 x GET /v1/jobs?limit=10000 at once", listings(4, 10000))
    timed("4 x GET /v1/jobs?limit=100000 at once", listings(4, 100000))
memory(" before the listings")
pages()
memory("")
if settle_wait:
    memory(" now", "VmRSS")
    print(f"waiting {settle_wait} s for the jobs to settle", flush=True)
    time.sleep(settle_wait)
    memory(" once settled", "VmRSS")
    queries()
    pages()
    memory(" once settled, after the listings", "VmRSS")
    for wave in range(2, waves + 1):
        run_jobs()
        memory(f" after wave {wave}", "VmRSS")
        time.sleep(settle_wait)
        memory(f" after wave {wave}, settled", "VmRSS")
    def idle():
        # Freed memory handed back (a build that trims does so every 30 s).
        memory(" after the queries", "VmRSS")
        time.sleep(40)
        memory(" 40 s later, idle", "VmRSS")
    def stop_server():
        subprocess.run(["kill", pid], capture_output=True)
        while subprocess.run(["kill", "-0", pid], capture_output=True).returncode == 0:
            time.sleep(0.1)
    def restart(binary, config, log):
        global pid
        stop_server()
        t = time.time()
        server = subprocess.Popen([binary, "--config", config, "server"],
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
        pid = str(server.pid)
        open(f"{work}/server.pid", "w").write(pid)
        healthy()
        return time.time() - t
    def measure_start(binary, config, log, what, label):
        took = restart(binary, config, log)
        print(f"{what} in {took:.1f} s", flush=True)
        time.sleep(5)
        memory(f"{label} after its start", "VmRSS")
        queries()
        memory(f"{label}, peak")
        idle()
    measure_start(perch, f"{work}/perch.toml", f"{work}/server2.log",
                  "restarted on the history", " (restarted)")
    if peer:
        stop_server()
        shutil.copytree(f"{work}/data", f"{work}/peer-data",
                        ignore=lambda d, names: ["settled"] if d.endswith("/control") else [])
        config = open(f"{work}/perch.toml").read().replace(f"{work}/data", f"{work}/peer-data")
        open(f"{work}/peer.toml", "w").write(config)
        measure_start(peer, f"{work}/peer.toml", f"{work}/peer.log",
                      f"PEER {peer} started on a copy of the history", " (peer)")
        # This build on the history the peer left (no settled rows' files): it writes them
        # while it serves, 10,000 jobs a step.
        took = restart(perch, f"{work}/peer.toml", f"{work}/upgrade.log")
        print(f"this build started on the peer's history in {took:.1f} s", flush=True)
        queries()
        time.sleep(20)
        print("20 s later:", flush=True)
        queries()
        memory(" (upgraded), peak")
        idle()
PY
