#!/usr/bin/env bash
# 100,000 pending jobs held in memory (no node to run them, so none settles), then filtered SQL
# over jobs, each query three times, for each binary given in turn (the build before, this one):
#
#   scripts/bench-held-filters.sh PEER_BINARY THIS_BINARY
#
# Needs python3 and curl. Listens on 127.0.0.1:17947; works in /tmp/filt.
set -uo pipefail
PORT=17947
for bin in "$@"; do
  mkdir -p /tmp/filt; work=/tmp/filt/held-$(basename $bin); rm -rf "$work"; mkdir -p "$work"
  printf '[server]\nlisten = "127.0.0.1:%s"\ndata_dir = "%s/data"\npg_listen = ""\nmax_pending_jobs_per_user = 200000\n' $PORT "$work" > "$work/perch.toml"
  "$bin" --config "$work/perch.toml" server > "$work/server.log" 2>&1 & pid=$!
  for i in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break; sleep 0.1; done
  for first in 0 1 2 3 4 5 6 7 8 9; do
    curl -sf -o /dev/null -H 'content-type: application/json' -d '{"command":["x"],"user":"alice","account":"a","gpus_per_node":1,"array":10000}' "http://127.0.0.1:$PORT/v1/jobs"
  done
  echo "== $bin: RSS $(( $(ps -o rss= -p $pid) / 1024 )) MB with 100,000 pending"
  for q in "SELECT count(*) AS n FROM jobs" "SELECT * FROM jobs WHERE job = 5" "SELECT job, state FROM jobs WHERE job > 99990 ORDER BY job" "SELECT count(*) AS n FROM jobs WHERE job BETWEEN 50000 AND 50999" "SELECT count(*) AS n FROM jobs WHERE user_name = 'bob'"; do
    body=$(python3 -c 'import json,sys; print(json.dumps({"sql": sys.argv[1]}))' "$q")
    for _ in 1 2 3; do curl -s -o "$work/out.json" -w "%{http_code} %{time_total}\n" -H 'content-type: application/json' -d "$body" "http://127.0.0.1:$PORT/v1/sql"; done > "$work/t.txt"
    printf '%s\n  HTTP %s, %s s, %s\n' "$q" "$(tail -1 $work/t.txt | cut -d' ' -f1)" "$(cut -d' ' -f2 $work/t.txt | sort -n | tr '\n' ' ')" "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d.get("rows", d))' $work/out.json | cut -c1-80)"
  done
  echo "panics: $(grep -c panicked $work/server.log)"
  kill $pid; while kill -0 $pid 2>/dev/null; do sleep 0.1; done
done
