#!/usr/bin/env bash
# Filters on the history tables (`jobs`, `job_allocations`) of a settled job history, the build
# before and this one in the same run, each started on its own copy of the same data directory:
# each query three times (HTTP status, the three times sorted, rows or error), the rows the
# settled rows' files gave each query (PERCH_LOG debug, builds that log it), peak RSS; then the
# answers of both builds compared. HISTORY: a data directory with settled jobs, say from
#
#   KEEP_DATA=/tmp/history SETTLE_WAIT=800 scripts/bench-history.sh 7397 100000
#
#   MEMORY_MB=8 scripts/bench-filters.sh HISTORY PEER_BINARY THIS_BINARY [PORT]
#
# Needs python3 and curl. Listens on 127.0.0.1:PORT (default 7941).
set -uo pipefail
hist=$(realpath "$1"); shift
bins=("$(realpath "$1")" "$(realpath "$2")")
PORT=${3:-7941}
MEMORY_MB=${MEMORY_MB:-8}
queries=(
  "SELECT count(*) AS n FROM jobs"
  "SELECT * FROM jobs WHERE job = 99999"
  "SELECT job, user_name, state, cost_allocated FROM jobs WHERE job > 99000 ORDER BY job"
  "SELECT * FROM job_allocations WHERE job > 99000 ORDER BY job, gpu"
  "SELECT * FROM job_allocations WHERE gpu = 99"
  "SELECT job, user_name, end_time, cost_allocated FROM jobs WHERE end_time >= ${SINCE:-now() - INTERVAL '1 hour'} ORDER BY job"
  "SELECT * FROM job_allocations WHERE end_time >= ${SINCE:-now() - INTERVAL '1 hour'} ORDER BY job, gpu"
  "SELECT * FROM jobs WHERE user_name = 'nobody'"
  "SELECT user_name, sum(gpu_seconds_allocated) AS s FROM jobs WHERE job BETWEEN 50000 AND 50999 GROUP BY user_name ORDER BY 1"
  "SELECT * FROM jobs ORDER BY job"
)
for b in 0 1; do
  bin=${bins[$b]}
  work=$(mktemp -d); cp -r "$hist" "$work/data"
  cat > "$work/perch.toml" <<EOT
[server]
listen = "127.0.0.1:$PORT"
data_dir = "$work/data"
pg_listen = ""
[query]
memory_mb = $MEMORY_MB
total_memory_mb = $((MEMORY_MB * 2))
EOT
  PERCH_LOG=info,perch_server=debug "$bin" --config "$work/perch.toml" server > "$work/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/healthz" > /dev/null && break; sleep 0.1; done
  sleep 5
  echo "== $bin (query.memory_mb $MEMORY_MB): RSS $(( $(ps -o rss= -p $pid) / 1024 )) MB after its start"
  n=0
  for q in "${queries[@]}"; do
    n=$((n + 1))
    body=$(python3 -c 'import json,sys; print(json.dumps({"sql": sys.argv[1]}))' "$q")
    for _ in 1 2 3; do
      curl -s -o "$work/out.json" -w "%{http_code} %{time_total}\n" -H 'content-type: application/json' \
        -d "$body" "http://127.0.0.1:$PORT/v1/sql"
    done > "$work/t.txt"
    python3 - "$work/out.json" "$work/answer$b-$n.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
json.dump(d.get("rows", d), open(sys.argv[2], "w"), sort_keys=True)
PY
    said=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["row_count"] if "row_count" in d else d.get("code", d))' "$work/out.json")
    printf '%s\n  HTTP %s, %s s, %s\n' "$q" "$(tail -1 "$work/t.txt" | cut -d' ' -f1)" \
      "$(cut -d' ' -f2 "$work/t.txt" | sort -n | tr '\n' ' ' | sed 's/ $//')" "$said"
  done
  echo "settled rows read per query: $(grep -o 'rows=[0-9]*' "$work/server.log" | cut -d= -f2 | tr '\n' ' ')"
  echo "peak RSS $(( $(grep VmHWM /proc/$pid/status | awk '{print $2}') / 1024 )) MB; panics: $(grep -c panicked "$work/server.log")"
  kill $pid; while kill -0 $pid 2> /dev/null; do sleep 0.1; done
  mkdir -p "${TMPDIR:-/tmp}/bench-filters"; cp "$work"/answer*.json "${TMPDIR:-/tmp}/bench-filters/"
  rm -rf "$work"
done
echo "== answers, the build before against this one:"
for n in $(seq ${#queries[@]}); do
  a=${TMPDIR:-/tmp}/bench-filters/answer0-$n.json; b=${TMPDIR:-/tmp}/bench-filters/answer1-$n.json
  if cmp -s "$a" "$b"; then echo "  query $n: same ($(wc -c < "$b") bytes)"
  elif grep -q '"error"' "$a" || grep -q '"error"' "$b"; then
    echo "  query $n: $(grep -q '"error"' "$a" && echo refused || echo answered) before, $(grep -q '"error"' "$b" && echo refused || echo answered) now"
  else echo "  query $n: DIFFER"; fi
done
rm -rf "${TMPDIR:-/tmp}/bench-filters"
