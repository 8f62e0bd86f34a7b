#!/usr/bin/env bash
# The control plane under load: how fast a node's sync and a health probe are
# answered, idle and while one user runs a CPU-heavy query, two memory-heavy queries and a
# maximal array submission (10,000 tasks), all over TLS with tokens. Results go in
# BENCHMARKS.md ("Control plane under load").
#
#   PERCH=target/release/perch scripts/bench-control-plane.sh
#
# Needs openssl, curl and python3. Uses ports 7394 (HTTP) and 7494 (PostgreSQL) on loopback.
set -euo pipefail
PERCH=$(realpath "${PERCH:-target/release/perch}")
work=$(mktemp -d)
trap 'kill $(cat "$work"/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
cd "$work"

# A throwaway CA and a certificate for 127.0.0.1.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key \
  -out ca.pem -days 1 -subj "/CN=bench CA" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key \
  -out server.csr -subj "/CN=perch" 2>/dev/null
printf "subjectAltName=IP:127.0.0.1\n" > ext.cnf
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem \
  -days 1 -extfile ext.cnf 2>/dev/null
export PERCH_CA_FILE=$work/ca.pem

USER_TOKEN=$("$PERCH" token create --user alice --role user --append tokens.toml 2>/dev/null)
AGENT_TOKEN=$("$PERCH" token create --user agents --role agent --node gpu-a --node probe \
  --append tokens.toml 2>/dev/null)
cat > perch.toml <<EOT
[server]
listen = "127.0.0.1:7394"
pg_listen = "127.0.0.1:7494"
data_dir = "$work/data"
tokens_file = "$work/tokens.toml"
tls_cert = "$work/server.pem"
tls_key = "$work/server.key"
node_stale_after_secs = 5
node_lease_secs = 20
[query]
timeout_secs = 15
max_concurrent = 2
EOT
"$PERCH" server --config perch.toml > server.log 2>&1 & echo $! > server.pid
sleep 2
PERCH_TOKEN=$AGENT_TOKEN "$PERCH" agent --server https://127.0.0.1:7394 --node gpu-a \
  --simulate-gpus 2 --nvml off --data-dir "$work/agent" --interval-ms 500 > agent.log 2>&1 &
echo $! > agent.pid
sleep 3

cat > probe.py <<'EOT'
import json, os, ssl, sys, time, urllib.request
secs = float(sys.argv[1]); token = os.environ["AGENT_TOKEN"]
ctx = ssl.create_default_context(cafile=os.environ["PERCH_CA_FILE"])
base = "https://127.0.0.1:7394"
syncs, healths = [], []
end = time.time() + secs
while time.time() < end:
    t = time.time()
    body = json.dumps({"node": "probe", "gpus": 0, "gpu_model": "none"}).encode()
    req = urllib.request.Request(base + "/v1/agent/sync", data=body, headers={
        "Authorization": "Bearer " + token, "Content-Type": "application/json"})
    urllib.request.urlopen(req, context=ctx, timeout=60).read()
    syncs.append(time.time() - t)
    t = time.time()
    urllib.request.urlopen(base + "/healthz", context=ctx, timeout=60).read()
    healths.append(time.time() - t)
    time.sleep(0.2)
def q(v, p):
    v = sorted(v); return v[min(len(v) - 1, int(p * len(v)))] * 1000
print(f"  {len(syncs)} syncs: p50 {q(syncs, .5):.1f} ms, p99 {q(syncs, .99):.1f} ms, "
      f"max {max(syncs) * 1000:.1f} ms; health probes: p50 {q(healths, .5):.1f} ms, "
      f"max {max(healths) * 1000:.1f} ms")
EOT
export AGENT_TOKEN
sql() {
  curl -s --cacert ca.pem -H "Authorization: Bearer $USER_TOKEN" -H 'content-type: application/json' \
    -o /dev/null -w "%{http_code} in %{time_total} s\n" https://127.0.0.1:7394/v1/sql \
    -d "{\"sql\": \"$1\"}"
}
echo "idle (each request a new TLS connection):"
python3 probe.py 5
echo "under load:"
load=()
(sql "SELECT sum((x.value * y.value) % 7) FROM generate_series(1, 100000) AS x CROSS JOIN generate_series(1, 200000) AS y" | sed 's/^/  CPU-heavy query: /') &
load+=($!)
sleep 0.3
wide="SELECT count(DISTINCT concat(repeat('x', 1000), value)) FROM generate_series(1, 2000000)"
(sql "$wide" | sed 's/^/  memory-heavy query 1: /') &
load+=($!)
(sql "$wide" | sed 's/^/  memory-heavy query 2: /') &
load+=($!)
(sql "SELECT 42" | sed 's/^/  SELECT 42 behind them: /') &
load+=($!)
python3 -c "import json; print(json.dumps({'command': ['true'], 'gpus_per_node': 4, 'array': 10000, 'env': {'PAYLOAD': 'x' * 1500}}))" > array.json
(curl -s --cacert ca.pem -H "Authorization: Bearer $USER_TOKEN" -H 'content-type: application/json' \
  -o /dev/null -w "  10,000-task array: %{http_code} in %{time_total} s\n" \
  https://127.0.0.1:7394/v1/jobs -d @array.json) &
load+=($!)
python3 probe.py 16
wait "${load[@]}"
down=$(PERCH_SERVER=https://127.0.0.1:7394 PERCH_TOKEN=$USER_TOKEN "$PERCH" sql --format csv \
  "SELECT count(*) AS n FROM events WHERE kind IN ('node_down', 'node_lease_expired')" | tail -1)
echo "nodes marked down or leases expired: $down"
