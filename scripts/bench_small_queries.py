#!/usr/bin/env python3
"""Median latency of small dashboard queries over HTTP against a running perch server.

    python3 scripts/bench_small_queries.py 127.0.0.1:7300 [RUNS] [TOKEN]

Each query is sent RUNS times (default 200) over one keep-alive connection to POST /v1/sql;
the figure is the median time from sending the request to reading the whole answer. The
queries are (e) and (f) of `perch bench query` (one GPU's 5-minute mean, one node's 1-minute
buckets over 30 minutes), on the second day of the benchmark's dataset, and two EXPLAINs
(planning only). Serve the benchmark's store to try it:

    perch server --listen 127.0.0.1:7399 --data-dir <perch-bench-data>/dataset-.../store
"""
import http.client
import json
import statistics
import sys
import time

T0 = "TIMESTAMP '2025-06-03 01:00:00'"
QUERIES = {
    "(e) one GPU, 5 min": "SELECT avg(utilization_gpu_pct) FROM gpu_samples WHERE node = 'node-007' AND gpu = 3 "
    f"AND time >= {T0} AND time < {T0} + INTERVAL '5 minutes'",
    "(f) one node, 30 x 1 min": "SELECT date_trunc('minute', time) AS minute, avg(power_watts) FROM gpu_samples "
    f"WHERE node = 'node-007' AND time >= {T0} AND time < {T0} + INTERVAL '30 minutes' GROUP BY 1 ORDER BY 1",
    "EXPLAIN of a join": "EXPLAIN SELECT j.user_name, sum(a.gpu_seconds_allocated) FROM job_allocations a "
    "JOIN jobs j ON a.job = j.job GROUP BY 1 ORDER BY 2 DESC LIMIT 10",
    "EXPLAIN of a catalog query": "EXPLAIN SELECT * FROM information_schema.columns WHERE table_name = 'gpu_samples'",
}


def main() -> int:
    host, port = sys.argv[1].split(":")
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    headers = {"content-type": "application/json"}
    if len(sys.argv) > 3:
        headers["authorization"] = f"Bearer {sys.argv[3]}"
    conn = http.client.HTTPConnection(host, int(port))
    for name, sql in QUERIES.items():
        body = json.dumps({"sql": sql}).encode()
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            conn.request("POST", "/v1/sql", body, headers)
            answer = conn.getresponse()
            data = answer.read()
            times.append((time.perf_counter() - started) * 1000)
            if answer.status != 200:
                print(f"{name}: HTTP {answer.status}: {data[:300]!r}", file=sys.stderr)
                return 1
        print(f"{name:28s} median {statistics.median(times):6.2f} ms, p90 {sorted(times)[int(runs * 0.9)]:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
