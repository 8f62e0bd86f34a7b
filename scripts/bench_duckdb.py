#!/usr/bin/env python3
"""DuckDB's side of `perch bench query`.

`perch bench query` starts this script (embedded in the binary, run with `python3 -c`) and
talks to it in JSON lines on stdin/stdout, so that both engines are timed in the same run, one
query at a time, on the same Parquet files:

  -> {"threads": 2, "memory_mb": 1024, "views": {"gpu_samples": "read_parquet('...')", ...}}
  <- {"ok": true, "version": "2.0.0"}
  -> {"sql": "SELECT ..."}                  (or {"sql": ..., "explain": true})
  <- {"ok": true, "seconds": 0.123, "rows": [[...], ...]}   (or {"ok": true, "plan": "..."})
  -> {"together": ["SELECT ...", ...]}      every statement at once, one cursor and thread each
  <- {"ok": true, "seconds": 0.456, "results": [[[...], ...], ...]}   (until the last answer)
  -> {"reconnect": true}                    a new database with the same settings and views
  <- {"ok": true}
  <- {"error": "..."}                       on any failure

The time is measured around `execute(...).fetchall()`: planning, execution and fetching the
(small) result. Numbers come back as JSON numbers, dates as ISO strings, and timestamps with
a time zone as Unix milliseconds (the query is wrapped in a projection that converts them, so
no time-zone package is needed in Python). Requires the `duckdb` package:
`PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install duckdb`.
"""

import datetime
import decimal
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def reply(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def cell(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (datetime.date, datetime.datetime, datetime.time)):
        return v.isoformat()
    return str(v)


def quote(name):
    return '"' + name.replace('"', '""') + '"'


def wrap(con, sql):
    """The query, with any TIMESTAMP WITH TIME ZONE column turned into Unix milliseconds."""
    rel = con.sql(sql)
    columns = list(zip(rel.columns, (str(t) for t in rel.types)))
    if not any(t == "TIMESTAMP WITH TIME ZONE" for _, t in columns):
        return sql
    select = ", ".join(
        f"epoch_ms({quote(n)}) AS {quote(n)}" if t == "TIMESTAMP WITH TIME ZONE" else quote(n)
        for n, t in columns
    )
    return f"SELECT {select} FROM ({sql}) AS q"


def connect(duckdb, setup):
    """A new in-memory database with the benchmark's settings and views."""
    con = duckdb.connect()
    con.execute(f"SET threads = {int(setup['threads'])}")
    con.execute(f"SET memory_limit = '{int(setup['memory_mb'])}MB'")
    con.execute("SET TimeZone = 'UTC'")
    # The progress bar would write to stdout, which carries the answers.
    con.execute("SET enable_progress_bar = false")
    for name, source in setup["views"].items():
        con.execute(f"CREATE VIEW {quote(name)} AS SELECT * FROM {source}")
    return con


def main():
    try:
        import duckdb
    except ImportError as e:
        reply(
            error=f"the Python package duckdb is missing ({e}); install it with "
            "PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install duckdb"
        )
        return 1
    try:
        setup = json.loads(sys.stdin.readline())
        con = connect(duckdb, setup)
    except Exception as e:  # noqa: BLE001 - every failure goes back to perch as a message
        reply(error=f"setting up DuckDB: {e}")
        return 1
    reply(ok=True, version=duckdb.__version__)
    wrapped = {}
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if request.get("reconnect"):
                con.close()
                con = connect(duckdb, setup)
                reply(ok=True)
                continue
            if "together" in request:
                sqls = request["together"]
                for sql in sqls:
                    if sql not in wrapped:
                        wrapped[sql] = wrap(con, sql)
                cursors = [con.cursor() for _ in sqls]
                with ThreadPoolExecutor(max_workers=max(1, len(sqls))) as pool:
                    started = time.perf_counter()
                    futures = [
                        pool.submit(lambda c, q: c.execute(wrapped[q]).fetchall(), c, q)
                        for c, q in zip(cursors, sqls)
                    ]
                    results = [f.result() for f in futures]
                    seconds = time.perf_counter() - started
                for c in cursors:
                    c.close()
                reply(
                    ok=True,
                    seconds=seconds,
                    results=[[[cell(v) for v in row] for row in rows] for rows in results],
                )
                continue
            sql = request["sql"]
            if request.get("explain"):
                rows = con.execute("EXPLAIN ANALYZE " + sql).fetchall()
                reply(ok=True, plan="\n".join(str(r[-1]) for r in rows))
                continue
            if sql not in wrapped:
                wrapped[sql] = wrap(con, sql)
            started = time.perf_counter()
            rows = con.execute(wrapped[sql]).fetchall()
            seconds = time.perf_counter() - started
            reply(ok=True, seconds=seconds, rows=[[cell(v) for v in row] for row in rows])
        except Exception as e:  # noqa: BLE001
            reply(error=str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
