//! `perch bench query`: four accounting and monitoring queries over a week of a 512-GPU
//! cluster, timed in perch and in DuckDB on the same Parquet files in the same run.
//!
//! perch answers through [`SqlEngine`], the path `POST /v1/sql` takes (a fresh session per
//! query, the read-only check, the memory pool and the timeout) without HTTP. DuckDB reads the
//! store's `gpu_samples` files with `read_parquet` over a glob, and the job tables from their
//! Parquet files; perch serves the same job rows as live tables, as the server serves its job
//! database. Both engines get the same threads (the machine's cores) and the same memory limit.
//! Each query runs once per engine to warm up, then `--runs` times per engine, alternating, so
//! a noisy neighbour slows both alike; the medians are compared. The results must agree (row
//! for row, numbers within a float tolerance) or the benchmark fails.

use super::dataset::{self, Dataset, Spec};
use super::duckdb::DuckDb;
use super::results;
use anyhow::{Context, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use clap::Args;
use perch_query::{LiveTable, QueryLimits, SqlEngine, Store};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub(super) struct QueryArgs {
    /// Directory for cached datasets: generated on first use, reused by later runs.
    #[arg(long, default_value = "perch-bench-data")]
    dir: PathBuf,
    #[arg(long, default_value_t = 64)]
    nodes: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    #[arg(long, default_value_t = 7)]
    days: u32,
    /// Seconds between an agent's samples.
    #[arg(long, default_value_t = 10)]
    interval_secs: u32,
    /// Seed of the generated workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Timed runs of each query in each engine, after one warm-up run.
    #[arg(long, default_value_t = 5)]
    runs: u32,
    /// Run only these queries (a to q).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Print each engine's EXPLAIN ANALYZE of each query, after the timings.
    #[arg(long)]
    explain: bool,
    /// Python interpreter that has the duckdb package.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Per-query limits for perch (the server's defaults unless given); DuckDB gets the same
    /// memory limit.
    #[arg(long, default_value_t = QueryLimits::default().memory_bytes >> 20)]
    memory_mb: usize,
    #[arg(long, default_value_t = QueryLimits::default().timeout.as_secs())]
    timeout_secs: u64,
}

/// One benchmark query: a name, what it answers, and SQL both engines accept.
struct Query {
    name: &'static str,
    title: &'static str,
    sql: String,
}

/// The four accounting queries of issue 4, two small dashboard lookups on the second day
/// (where a query's fixed cost, its session and planning, is most of its time), then shapes
/// operators write (issue 20): a selective filter, an exact median, a count distinct, a
/// window over each GPU's series, top-k, one job's samples, a time filter over the fleet and
/// a sum over the week.
/// `iv` is the sampling interval in seconds, so one sample of
/// one GPU stands for `iv / 3600` GPU-hours. A sample belongs to an allocation when it is on
/// the allocation's node and GPU and its time is in `[start_time, end_time)`, `end_time` being
/// NULL while the job runs (as in the server's `job_allocations`).
fn queries(iv: u32) -> Vec<Query> {
    let hours = format!("{iv}.0 / 3600.0");
    let held = "s.node = a.node AND s.gpu = a.gpu
 AND s.time >= a.start_time AND (a.end_time IS NULL OR s.time < a.end_time)";
    vec![
        Query {
            name: "a",
            title: "GPU-hours and mean utilization per account per day",
            sql: format!(
                "SELECT a.account, CAST(date_trunc('day', s.time) AS DATE) AS day,
       count(*) * {hours} AS gpu_hours,
       avg(s.utilization_gpu_pct) AS mean_utilization_pct
FROM job_allocations a
JOIN gpu_samples s ON {held}
GROUP BY a.account, CAST(date_trunc('day', s.time) AS DATE)
ORDER BY a.account, day"
            ),
        },
        Query {
            name: "b",
            title: "idle GPU-hours per node (utilization < 5%), and how many of them allocated",
            sql: format!(
                "SELECT s.node,
       count(*) * {hours} AS idle_gpu_hours,
       count(a.job) * {hours} AS idle_allocated_gpu_hours
FROM gpu_samples s
LEFT JOIN job_allocations a ON {held}
WHERE s.utilization_gpu_pct < 5
GROUP BY s.node
ORDER BY s.node"
            ),
        },
        Query {
            name: "c",
            title: "the 10 jobs that wasted the most GPU-hours (allocated - used)",
            sql: format!(
                "WITH per_job AS (
  SELECT a.job, count(*) AS samples, sum(s.utilization_gpu_pct) / 100.0 AS busy_samples
  FROM job_allocations a
  JOIN gpu_samples s ON {held}
  GROUP BY a.job)
SELECT j.job, j.name, j.user_name, j.account,
       p.samples * {hours} AS allocated_gpu_hours,
       p.busy_samples * {hours} AS used_gpu_hours,
       (p.samples - p.busy_samples) * {hours} AS wasted_gpu_hours
FROM per_job p
JOIN jobs j ON j.job = p.job
ORDER BY wasted_gpu_hours DESC, j.job
LIMIT 10"
            ),
        },
        Query {
            name: "d",
            title: "last value per GPU (latest utilization and memory of every GPU)",
            sql: "SELECT s.node, s.gpu, s.time, s.utilization_gpu_pct, s.memory_used_bytes
FROM gpu_samples s
JOIN (SELECT node, gpu, max(time) AS time FROM gpu_samples GROUP BY node, gpu) latest
  ON s.node = latest.node AND s.gpu = latest.gpu AND s.time = latest.time
ORDER BY s.node, s.gpu"
                .to_owned(),
        },
        Query {
            name: "e",
            title: "one GPU's mean utilization over 5 minutes (a Grafana stat panel)",
            sql: "SELECT avg(utilization_gpu_pct) AS mean_utilization_pct
FROM gpu_samples
WHERE node = 'node-007' AND gpu = 3
  AND time >= TIMESTAMP '2025-06-03 01:00:00' AND time < TIMESTAMP '2025-06-03 01:05:00'"
                .to_owned(),
        },
        Query {
            name: "f",
            title: "one node's power in 1-minute buckets over 30 minutes (a Grafana time series)",
            sql: "SELECT date_trunc('minute', time) AS minute, avg(power_watts) AS power_watts
FROM gpu_samples
WHERE node = 'node-007'
  AND time >= TIMESTAMP '2025-06-03 01:00:00' AND time < TIMESTAMP '2025-06-03 01:30:00'
GROUP BY date_trunc('minute', time)
ORDER BY minute"
                .to_owned(),
        },
        Query {
            name: "g",
            title: "power and temperature of each GPU while busy and full (a selective filter)",
            sql: "SELECT node, gpu, avg(power_watts) AS power_watts, max(temperature_celsius) AS hottest
FROM gpu_samples
WHERE utilization_gpu_pct > 90 AND memory_used_bytes > 60000000000
GROUP BY node, gpu
ORDER BY node, gpu"
                .to_owned(),
        },
        Query {
            name: "h",
            title: "exact median utilization per node",
            sql: "SELECT node, median(utilization_gpu_pct) AS median_utilization_pct
FROM gpu_samples
GROUP BY node
ORDER BY node"
                .to_owned(),
        },
        Query {
            name: "i",
            title: "GPUs per node that were ever fully idle (count distinct over a filter)",
            sql: "SELECT node, count(DISTINCT gpu) AS gpus_idle
FROM gpu_samples
WHERE utilization_gpu_pct < 1
GROUP BY node
ORDER BY node"
                .to_owned(),
        },
        Query {
            name: "j",
            title: "power change between samples of each GPU of one node over 6 hours (a window)",
            sql: "SELECT gpu, time,
       power_watts - lag(power_watts) OVER (PARTITION BY gpu ORDER BY time) AS power_change
FROM gpu_samples
WHERE node = 'node-007'
  AND time >= TIMESTAMP '2025-06-03 00:00:00' AND time < TIMESTAMP '2025-06-03 06:00:00'
ORDER BY gpu, time"
                .to_owned(),
        },
        Query {
            name: "k",
            title: "the 10 hottest GPUs of the week (top-k)",
            sql: "SELECT node, gpu, max(temperature_celsius) AS hottest
FROM gpu_samples
GROUP BY node, gpu
ORDER BY hottest DESC, node, gpu
LIMIT 10"
                .to_owned(),
        },
        Query {
            name: "l",
            title: "one job's hourly utilization on its GPUs (samples joined to its allocations)",
            sql: format!(
                "SELECT date_trunc('hour', s.time) AS hour, avg(s.utilization_gpu_pct) AS utilization_pct
FROM job_allocations a
JOIN gpu_samples s ON {held}
WHERE a.job = 199
GROUP BY date_trunc('hour', s.time)
ORDER BY hour"
            ),
        },
        Query {
            name: "m",
            title: "the fleet's hourly mean utilization over 6 hours (Grafana's $__timeFilter)",
            sql: "SELECT date_trunc('hour', time) AS hour, avg(utilization_gpu_pct) AS utilization_pct
FROM gpu_samples
WHERE time >= TIMESTAMP '2025-06-05 12:00:00' AND time < TIMESTAMP '2025-06-05 18:00:00'
GROUP BY date_trunc('hour', time)
ORDER BY hour"
                .to_owned(),
        },
        Query {
            name: "n",
            title: "energy per day from power, kWh (a sum over the week)",
            sql: format!(
                "SELECT CAST(date_trunc('day', time) AS DATE) AS day,
       sum(power_watts) * {iv}.0 / 3600000.0 AS kwh
FROM gpu_samples
GROUP BY CAST(date_trunc('day', time) AS DATE)
ORDER BY day"
            ),
        },
        Query {
            name: "o",
            title: "each GPU's latest sample in the last hour of the week (row_number over a window)",
            sql: "SELECT node, gpu, time, utilization_gpu_pct
FROM (SELECT node, gpu, time, utilization_gpu_pct,
             row_number() OVER (PARTITION BY node, gpu ORDER BY time DESC) AS newest
      FROM gpu_samples
      WHERE time >= TIMESTAMP '2025-06-08 23:00:00')
WHERE newest = 1
ORDER BY node, gpu"
                .to_owned(),
        },
        Query {
            name: "p",
            title: "samples per node per hour over one day (a heatmap)",
            sql: "SELECT node, date_trunc('hour', time) AS hour, count(*) AS samples
FROM gpu_samples
WHERE time >= TIMESTAMP '2025-06-04 00:00:00' AND time < TIMESTAMP '2025-06-05 00:00:00'
GROUP BY node, date_trunc('hour', time)
ORDER BY node, hour"
                .to_owned(),
        },
        Query {
            name: "q",
            title: "jobs and GPU allocations per user (the job tables alone)",
            sql: "SELECT j.user_name, count(DISTINCT j.job) AS jobs, count(*) AS gpu_allocations,
       count(a.end_time) AS ended
FROM jobs j
JOIN job_allocations a ON a.job = j.job
GROUP BY j.user_name
ORDER BY j.user_name"
                .to_owned(),
        },
    ]
}

/// Rows kept in memory and served to SQL like the server's job-database tables.
#[derive(Debug)]
struct Rows(RecordBatch);

impl LiveTable for Rows {
    fn schema(&self) -> SchemaRef {
        self.0.schema()
    }

    fn snapshot(&self) -> std::result::Result<Vec<RecordBatch>, String> {
        Ok(vec![self.0.clone()])
    }
}

struct Timing {
    rows: usize,
    checksum: f64,
    perch: Vec<Duration>,
    duckdb: Vec<Duration>,
}

fn median(times: &[Duration]) -> Duration {
    let mut sorted = times.to_vec();
    sorted.sort();
    sorted.get(sorted.len() / 2).copied().unwrap_or_default()
}

pub(super) fn query(args: QueryArgs) -> Result<()> {
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    let spec = Spec {
        nodes: args.nodes,
        gpus_per_node: args.gpus,
        days: args.days,
        interval_secs: args.interval_secs,
        seed: args.seed,
    };
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let data = rt.block_on(dataset::open_or_generate(&args.dir, spec))?;
    let limits = QueryLimits {
        memory_bytes: args.memory_mb << 20,
        timeout: Duration::from_secs(args.timeout_secs),
        ..QueryLimits::default()
    };
    let store = Store::open(data.store_config())?;
    let engine = SqlEngine::new(store.clone(), limits)
        .with_table("jobs", Arc::new(Rows(data.jobs.clone())))
        .with_table("job_allocations", Arc::new(Rows(data.allocations.clone())));
    let mut duckdb = DuckDb::start(&args.python, threads, args.memory_mb, &duckdb_views(&data))?;
    print_header(&rt, &engine, &data, &duckdb, threads, &args)?;

    let selected: Vec<Query> = queries(args.interval_secs)
        .into_iter()
        .filter(|q| args.only.is_empty() || args.only.iter().any(|o| o == q.name))
        .collect();
    anyhow::ensure!(
        !selected.is_empty(),
        "--only names no query; use some of {}",
        queries(args.interval_secs)
            .iter()
            .map(|q| q.name)
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut timings = Vec::new();
    for q in &selected {
        let perch_rows = run_perch(&rt, &engine, q)?.1;
        let duckdb_rows = duckdb.run(&q.sql)?.1;
        results::compare(q.name, &perch_rows, &duckdb_rows)?;
        let mut t = Timing {
            rows: perch_rows.len(),
            checksum: results::checksum(&perch_rows),
            perch: Vec::new(),
            duckdb: Vec::new(),
        };
        for _ in 0..args.runs {
            let (elapsed, rows) = run_perch(&rt, &engine, q)?;
            results::compare(q.name, &rows, &duckdb_rows)?;
            t.perch.push(elapsed);
            let (elapsed, rows) = duckdb.run(&q.sql)?;
            results::compare(q.name, &perch_rows, &rows)?;
            t.duckdb.push(elapsed);
        }
        print_row(q, &t);
        timings.push((q, t, perch_rows));
    }
    let slower: Vec<&str> = timings
        .iter()
        .filter(|(_, t, _)| median(&t.perch) > median(&t.duckdb))
        .map(|(q, _, _)| q.name)
        .collect();
    println!(
        "target: no query slower than DuckDB: {}",
        if slower.is_empty() {
            "met".to_owned()
        } else {
            format!("missed on {}", slower.join(", "))
        }
    );
    for (q, _, rows) in &timings {
        println!(
            "\n({}) {}: first rows (both engines agree)",
            q.name, q.title
        );
        for row in rows.iter().take(5) {
            let cells: Vec<String> = row.iter().map(ToString::to_string).collect();
            println!("  {}", cells.join(" | "));
        }
    }
    if args.explain {
        for q in &selected {
            let plan = rt.block_on(engine.query(&format!("EXPLAIN ANALYZE {}", q.sql)))?;
            println!(
                "\n({}) perch EXPLAIN ANALYZE:\n{}",
                q.name,
                plan_text(&plan.batches)?
            );
            println!(
                "\n({}) DuckDB EXPLAIN ANALYZE:\n{}",
                q.name,
                duckdb.explain(&q.sql)?
            );
        }
    }
    Ok(())
}

fn run_perch(
    rt: &tokio::runtime::Runtime,
    engine: &SqlEngine,
    q: &Query,
) -> Result<(Duration, Vec<Vec<results::Cell>>)> {
    let started = Instant::now();
    let out = rt
        .block_on(engine.query(&q.sql))
        .with_context(|| format!("perch, query {}", q.name))?;
    let elapsed = started.elapsed();
    anyhow::ensure!(
        !out.truncated,
        "query {}: perch's result was cut at the row limit",
        q.name
    );
    Ok((elapsed, results::from_batches(&out.batches)?))
}

fn duckdb_views(data: &Dataset) -> Vec<(&'static str, String)> {
    let quote = |p: PathBuf| p.to_string_lossy().replace('\'', "''");
    vec![
        (
            "gpu_samples",
            format!(
                "read_parquet('{}', hive_partitioning = false)",
                quote(data.gpu_samples_glob())
            ),
        ),
        (
            "jobs",
            format!("read_parquet('{}')", quote(data.jobs_path())),
        ),
        (
            "job_allocations",
            format!("read_parquet('{}')", quote(data.allocations_path())),
        ),
    ]
}

fn print_header(
    rt: &tokio::runtime::Runtime,
    engine: &SqlEngine,
    data: &Dataset,
    duckdb: &DuckDb,
    threads: usize,
    args: &QueryArgs,
) -> Result<()> {
    let count = rt.block_on(engine.query("SELECT count(*) FROM gpu_samples"))?;
    let rows = results::checksum(&results::from_batches(&count.batches)?);
    let (files, bytes) = engine_files(data);
    let s = data.spec;
    println!(
        "queries over {} nodes x {} GPUs, {} days at {} s: {:.0} GPU rows in {files} Parquet files ({} MiB), {} jobs, {} allocations",
        s.nodes,
        s.gpus_per_node,
        s.days,
        s.interval_secs,
        rows,
        bytes >> 20,
        data.jobs.num_rows(),
        data.allocations.num_rows()
    );
    println!("  dataset {} ({})", data.dir.display(), data.origin);
    println!(
        "  perch: SqlEngine (DataFusion, as POST /v1/sql without HTTP); DuckDB {} (Python); {threads} threads and {} MiB per query each",
        duckdb.version, args.memory_mb
    );
    println!(
        "  1 warm-up + {} timed runs per query and engine, alternating; median (min-max) in ms",
        args.runs
    );
    println!(
        "{:<4}{:>6}  {:>24}  {:>24}  {:>8}  {:>18}",
        "", "rows", "perch", "DuckDB", "perch/D", "checksum"
    );
    Ok(())
}

/// Files and bytes of `gpu_samples` as both engines see them (every file under the glob).
fn engine_files(data: &Dataset) -> (usize, u64) {
    let mut files = 0;
    let mut bytes = 0;
    let mut stack = vec![data.store_dir().join("tables").join("gpu_samples")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                files += 1;
                bytes += entry.metadata().map_or(0, |m| m.len());
            }
        }
    }
    (files, bytes)
}

fn print_row(q: &Query, t: &Timing) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let span = |times: &[Duration]| {
        let lo = times.iter().min().copied().unwrap_or_default();
        let hi = times.iter().max().copied().unwrap_or_default();
        format!("{:.1} ({:.1}-{:.1})", ms(median(times)), ms(lo), ms(hi))
    };
    println!(
        "({}) {:>6}  {:>24}  {:>24}  {:>8.2}  {:>18.6}   {}",
        q.name,
        t.rows,
        span(&t.perch),
        span(&t.duckdb),
        ms(median(&t.perch)) / ms(median(&t.duckdb)).max(1e-9),
        t.checksum,
        q.title
    );
}

fn plan_text(batches: &[RecordBatch]) -> Result<String> {
    Ok(arrow::util::pretty::pretty_format_batches(batches)?.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BENCHMARKS.md shows the exact SQL that was timed.
    #[test]
    fn benchmarks_md_shows_every_query() {
        let doc = include_str!("../../BENCHMARKS.md");
        for q in queries(10) {
            assert!(
                doc.contains(&format!("```sql\n{}\n```", q.sql)),
                "BENCHMARKS.md lacks the SQL of query {}:\n{}",
                q.name,
                q.sql
            );
        }
    }

    /// Every query plans in perch against the dataset's tables (an empty store and empty job
    /// tables of the real schemas), so a typo fails here, not in a 10-minute benchmark.
    #[tokio::test]
    async fn every_query_plans_in_perch() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = Store::open(perch_query::StoreConfig::new(dir.path())).expect("store");
        let engine = SqlEngine::new(store, QueryLimits::default())
            .with_table(
                "jobs",
                Arc::new(Rows(RecordBatch::new_empty(dataset::jobs_schema()))),
            )
            .with_table(
                "job_allocations",
                Arc::new(Rows(RecordBatch::new_empty(dataset::allocations_schema()))),
            );
        for q in queries(10) {
            let out = engine
                .query(&q.sql)
                .await
                .unwrap_or_else(|e| panic!("query {}: {e}", q.name));
            // An aggregate without GROUP BY answers one row (a NULL mean) even over nothing.
            let expected = usize::from(q.name == "e");
            assert_eq!(out.rows, expected, "query {} on empty tables", q.name);
        }
    }
}
