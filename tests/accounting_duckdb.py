"""Job accounting recomputed independently with DuckDB, from the store's raw Parquet files.

    python3 tests/accounting_duckdb.py <data-dir> <job_allocations.csv>

Reads every gpu_samples Parquet file under <data-dir>/tables/gpu_samples/ and the allocations
exported with `perch sql --format csv 'SELECT * FROM job_allocations'`, applies the definition
of docs/schema.md ("Accounting and cost") and prints one JSON object: {"jobs": {"<job>": {...}}, "gpus": {"<job>/<node>/<gpu>": {...}}},
each with gpu_seconds_used, utilization_mean_pct, utilization_peak_pct, memory_peak_bytes,
energy_joules and samples. tests/accounting.rs compares it with perch's
own answer. Exits non-zero (never skips) when duckdb is not installed.
"""

import csv
import datetime
import json
import sys

import duckdb


def ms(text):
    """Unix milliseconds of an RFC 3339 timestamp as arrow's CSV writer prints it."""
    if not text:
        return None
    return round(datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def energy(seconds, counter, span, power):
    """docs/schema.md's energy: the counter's rise between its first and last reading plus mean
    power (else the rise's own rate) over the seconds those readings do not span; mean power x
    time when the counter was read once or never; None when neither is known."""
    if counter is not None and span is not None and span > 0:
        rate = power if power is not None else counter / span
        return max(counter, 0.0) + rate * max(seconds - span, 0.0)
    return None if power is None else power * seconds


def main():
    data_dir, allocations_csv = sys.argv[1], sys.argv[2]
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE allocs (job UBIGINT, node VARCHAR, gpu UINTEGER, start_ms BIGINT, end_ms BIGINT)"
    )
    with open(allocations_csv, newline="") as f:
        rows = [
            (int(r["job"]), r["node"], int(r["gpu"]), ms(r["start_time"]), ms(r["end_time"]))
            for r in csv.DictReader(f)
        ]
    if any(r[4] is None for r in rows):
        sys.exit("an allocation has not ended; export only ended jobs")
    con.executemany("INSERT INTO allocs VALUES (?, ?, ?, ?, ?)", rows)
    files = f"{data_dir}/tables/gpu_samples/**/*.parquet"
    # One row per allocated GPU: the aggregates of its samples in [start, end).
    per_gpu = f"""
        SELECT a.job, a.node, a.gpu, (a.end_ms - a.start_ms) / 1000.0 AS seconds,
               count(s.time) AS samples,
               avg(s.utilization_gpu_pct) AS util_mean,
               max(s.utilization_gpu_pct) AS util_peak,
               max(s.memory_used_bytes) AS memory_peak,
               max(s.energy_joules) - min(s.energy_joules) AS energy_counter,
               (max(CASE WHEN s.energy_joules IS NOT NULL THEN epoch_ms(s.time) END)
                 - min(CASE WHEN s.energy_joules IS NOT NULL THEN epoch_ms(s.time) END))
                 / 1000.0 AS energy_span,
               avg(s.power_watts) AS power_mean
        FROM allocs a
        LEFT JOIN read_parquet('{files}') s
          ON s.node = a.node AND s.gpu = a.gpu
         AND epoch_ms(s.time) >= a.start_ms AND epoch_ms(s.time) < a.end_ms
        GROUP BY ALL
    """
    con.execute(f"CREATE TABLE per_gpu AS {per_gpu}")
    gpus = {}
    energy_of_job = {}
    for job, node, gpu, seconds, samples, mean, peak, memory, counter, span, power in con.execute(
        "SELECT * FROM per_gpu"
    ).fetchall():
        gpu_energy = energy(seconds, counter, span, power)
        if gpu_energy is not None:
            energy_of_job[str(job)] = energy_of_job.get(str(job), 0.0) + gpu_energy
        gpus[f"{job}/{node}/{gpu}"] = {
            "gpu_seconds_used": None if mean is None else seconds * mean / 100,
            "utilization_mean_pct": mean,
            "utilization_peak_pct": peak,
            "memory_peak_bytes": memory,
            "energy_joules": gpu_energy,
            "samples": samples,
        }
    jobs = {}
    for job, used, accounted, peak, memory, samples in con.execute(
        """
        SELECT job,
               sum(seconds * util_mean / 100) AS used,
               sum(CASE WHEN util_mean IS NOT NULL THEN seconds END) AS accounted,
               max(util_peak) AS peak,
               max(memory_peak) AS memory,
               sum(samples) AS samples
        FROM per_gpu GROUP BY job ORDER BY job
        """
    ).fetchall():
        jobs[str(job)] = {
            "gpu_seconds_used": used,
            "utilization_mean_pct": None if not accounted else 100.0 * used / accounted,
            "utilization_peak_pct": peak,
            "memory_peak_bytes": memory,
            "energy_joules": energy_of_job.get(str(job)),
            "samples": samples,
        }
    print(json.dumps({"jobs": jobs, "gpus": gpus}))


if __name__ == "__main__":
    main()
