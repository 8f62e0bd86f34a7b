//! `perch bench query`: forty accounting, monitoring and dashboard queries over a week of a
//! 512-GPU cluster, and a twenty-panel dashboard refreshed at once, timed in perch and in
//! DuckDB on the same Parquet files in the same run, warm and cold.
//!
//! perch answers through [`SqlEngine`], the path `POST /v1/sql` takes (a fresh session per
//! query, the read-only check, the memory pool and the timeout) without HTTP. DuckDB reads the
//! store's `gpu_samples` files with `read_parquet` over a glob, and the job tables from their
//! Parquet files; perch serves the same job rows as live tables, as the server serves its job
//! database. Both engines get the same threads (the machine's cores) and the same memory limit.
//! Each query runs once per engine to warm up, then `--runs` times per engine, alternating, so
//! a noisy neighbour slows both alike; the medians are compared. The results must agree (row
//! for row, numbers within a float tolerance) or the benchmark fails. Before the warm runs each
//! query also runs cold, as the first query of a freshly started engine, `--runs` starts per
//! engine alternating (medians compared): perch with a new store and session template (what a
//! server builds before it listens), DuckDB with a new database. The dashboard sends its panels at once and times the last answer.

use super::dataset::{self, Dataset, Spec};
use super::duckdb::DuckDb;
use super::results;
use anyhow::{Context, Result};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use clap::Args;
use perch_query::{LiveTable, QueryLimits, SqlEngine, Store, Table};
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
    /// Timed runs of each query in each engine, after one warm-up run; also the number of
    /// cold starts per engine.
    #[arg(long, default_value_t = 5)]
    runs: u32,
    /// Run only these queries (a to an, and `dashboard` for the 20 panels refreshed together).
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

impl Query {
    /// The query with its estimates made exact, when it estimates (`approx_count_distinct`):
    /// the two engines' sketches differ, so each engine's answer is checked against this
    /// one's instead of against the other's.
    fn exact_sql(&self) -> Option<String> {
        self.sql.contains("approx_count_distinct(").then(|| {
            self.sql
                .replace("approx_count_distinct(", "count(DISTINCT ")
        })
    }

    /// How far the engines' numbers may differ, relative.
    fn tolerance(&self) -> f64 {
        if self.sql.contains("percentile_cont") {
            results::PERCENTILE_TOLERANCE
        } else {
            results::TOLERANCE
        }
    }
}

/// The four accounting queries (a to d), two small dashboard lookups on the second day
/// (where a query's fixed cost, its session and planning, is most of its time), then shapes
/// operators write: a selective filter, an exact median, a count distinct, a
/// window over each GPU's series, top-k, one job's samples, a time filter over the fleet and
/// a sum over the week.
/// `iv` is the sampling interval in seconds, so one sample of
/// one GPU stands for `iv / 3600` GPU-hours. A sample belongs to an allocation when it is on
/// the allocation's node and GPU and its time is in `[start_time, end_time)`, `end_time` being
/// NULL while the job runs (as in the server's `job_allocations`).
fn queries(iv: u32, days: u32) -> Vec<Query> {
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
        Query {
            name: "r",
            title: "exact 95th percentile of power per GPU of one node over a day",
            sql: "SELECT gpu, percentile_cont(0.95) WITHIN GROUP (ORDER BY power_watts) AS p95_power_watts
FROM gpu_samples
WHERE node = 'node-012'
  AND time >= TIMESTAMP '2025-06-06 00:00:00' AND time < TIMESTAMP '2025-06-07 00:00:00'
GROUP BY gpu
ORDER BY gpu"
                .to_owned(),
        },
        Query {
            name: "s",
            title: "each node's memory in 5-minute buckets over 6 hours (Grafana's $__timeGroup)",
            sql: "SELECT floor(extract(epoch FROM time) / 300) * 300 AS time_sec, node,
       max(memory_used_bytes) AS memory_used_bytes
FROM gpu_samples
WHERE time BETWEEN '2025-06-08T18:00:00Z' AND '2025-06-08T23:59:59Z'
GROUP BY 1, 2
ORDER BY 1, 2"
                .to_owned(),
        },
        Query {
            name: "t",
            title: "each node's hourly peak temperature and mean power over the week (the 1-hour rollup view)",
            sql: "SELECT node, time AS hour, max(temperature_celsius_max) AS hottest,
       sum(power_watts_sum) / sum(power_watts_count) AS power_watts
FROM gpu_samples_1h
GROUP BY node, time
ORDER BY node, hour"
                .to_owned(),
        },
    ]
    .into_iter()
    .chain(operator_queries(iv, days))
    .collect()
}

/// The second twenty (u to an), written from what operators ask beyond the first twenty:
/// windows over each GPU's series (changes, gaps, running sums, moving averages, first and
/// last values, ranks), exact and approximate distinct counts over the series key, several
/// percentiles at once, energy per job and per user, histograms, top-k per group and jobs
/// joined to their samples. Queries over "the last day" and "one node" take the dataset's
/// last day and `node-001`, so a dataset of two nodes and one day (the smoke test's) answers
/// them with rows for both engines to agree on.
fn operator_queries(iv: u32, days: u32) -> Vec<Query> {
    let at = |day: u32| {
        let ms = dataset::EPOCH_MS + i64::from(day) * 86_400_000;
        perch_model::timefmt::utc(ms)
            .trim_end_matches(" UTC")
            .to_owned()
    };
    let last_day = days.saturating_sub(1);
    let day = format!(
        "time >= TIMESTAMP '{}' AND time < TIMESTAMP '{}'",
        at(last_day),
        at(last_day + 1)
    );
    let end = at(days);
    let six_hours_before_end =
        perch_model::timefmt::utc(dataset::EPOCH_MS + i64::from(days) * 86_400_000 - 6 * 3_600_000)
            .trim_end_matches(" UTC")
            .to_owned();
    let kwh = format!("{iv}.0 / 3600000.0");
    let held = "s.node = a.node AND s.gpu = a.gpu
 AND s.time >= a.start_time AND (a.end_time IS NULL OR s.time < a.end_time)";
    let q = |name: &'static str, title: &'static str, sql: String| Query { name, title, sql };
    vec![
        q("u", "each GPU's idle-to-busy and busy-to-idle changes over the last day (lag, then a conditional count per series)", format!(
            "SELECT node, gpu,
       count(*) FILTER (WHERE utilization_gpu_pct >= 50 AND previous < 50) AS became_busy,
       count(*) FILTER (WHERE utilization_gpu_pct < 50 AND previous >= 50) AS became_idle
FROM (SELECT node, gpu, utilization_gpu_pct,
             lag(utilization_gpu_pct) OVER (PARTITION BY node, gpu ORDER BY time) AS previous
      FROM gpu_samples
      WHERE {day}) s
GROUP BY node, gpu
ORDER BY node, gpu")),
        q("v", "GPUs that ever ran at 70 C or more over the week (an exact distinct count of an expression of the series key)",
            "SELECT count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) AS hot_gpus
FROM gpu_samples
WHERE temperature_celsius >= 70".to_owned()),
        q("w", "GPUs busy over 90% each day, approximately (approx_count_distinct)",
            "SELECT CAST(date_trunc('day', time) AS DATE) AS day,
       approx_count_distinct(node || '/' || CAST(gpu AS VARCHAR)) AS busy_gpus
FROM gpu_samples
WHERE utilization_gpu_pct > 90
GROUP BY CAST(date_trunc('day', time) AS DATE)
ORDER BY day".to_owned()),
        q("x", "GPUs busy over 90% each day, exactly (count distinct per group)",
            "SELECT CAST(date_trunc('day', time) AS DATE) AS day,
       count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) AS busy_gpus
FROM gpu_samples
WHERE utilization_gpu_pct > 90
GROUP BY CAST(date_trunc('day', time) AS DATE)
ORDER BY day".to_owned()),
        q("y", "gaps in each GPU's series over the last day (lead: the longest gap, and gaps over two intervals)", format!(
            "SELECT node, gpu, max(gap_secs) AS longest_gap_secs,
       count(*) FILTER (WHERE gap_secs > 2 * {iv}) AS gaps
FROM (SELECT node, gpu,
             extract(epoch FROM lead(time) OVER (PARTITION BY node, gpu ORDER BY time))
               - extract(epoch FROM time) AS gap_secs
      FROM gpu_samples
      WHERE {day}) s
GROUP BY node, gpu
ORDER BY node, gpu")),
        q("z", "one node's energy so far on the last day, per GPU by hour (a running sum over an aggregate)", format!(
            "SELECT gpu, date_trunc('hour', time) AS hour,
       sum(sum(power_watts)) OVER (PARTITION BY gpu ORDER BY date_trunc('hour', time)) * {kwh} AS kwh_so_far
FROM gpu_samples
WHERE node = 'node-001' AND {day}
GROUP BY gpu, date_trunc('hour', time)
ORDER BY gpu, hour")),
        q("aa", "each GPU's first and last memory used on the last day (first_value, last_value)", format!(
            "SELECT DISTINCT node, gpu,
       first_value(memory_used_bytes) OVER (PARTITION BY node, gpu ORDER BY time
         ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) AS first_memory_bytes,
       last_value(memory_used_bytes) OVER (PARTITION BY node, gpu ORDER BY time
         ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) AS last_memory_bytes
FROM gpu_samples
WHERE {day}
ORDER BY node, gpu")),
        q("ab", "each node's 3 GPUs drawing the most power over the week (top-k per group)",
            "SELECT node, gpu, power_watts
FROM (SELECT node, gpu, avg(power_watts) AS power_watts,
             row_number() OVER (PARTITION BY node ORDER BY avg(power_watts) DESC, gpu) AS place
      FROM gpu_samples
      GROUP BY node, gpu) ranked
WHERE place <= 3
ORDER BY node, place".to_owned()),
        q("ac", "exact 50th, 90th and 99th percentiles of utilization per node over the last day", format!(
            "SELECT node,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY utilization_gpu_pct) AS p50,
       percentile_cont(0.9) WITHIN GROUP (ORDER BY utilization_gpu_pct) AS p90,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY utilization_gpu_pct) AS p99
FROM gpu_samples
WHERE {day}
GROUP BY node
ORDER BY node")),
        q("ad", "the 10 jobs that used the most energy, kWh (samples joined to allocations)", format!(
            "SELECT a.job, sum(s.power_watts) * {kwh} AS kwh
FROM job_allocations a
JOIN gpu_samples s ON {held}
GROUP BY a.job
ORDER BY kwh DESC, a.job
LIMIT 10")),
        q("ae", "energy per user per day, kWh (samples, allocations and jobs)", format!(
            "SELECT j.user_name, CAST(date_trunc('day', s.time) AS DATE) AS day,
       sum(s.power_watts) * {kwh} AS kwh
FROM job_allocations a
JOIN gpu_samples s ON {held}
JOIN jobs j ON j.job = a.job
GROUP BY j.user_name, CAST(date_trunc('day', s.time) AS DATE)
ORDER BY j.user_name, day")),
        q("af", "histogram of power over the week, 50 W buckets",
            "SELECT floor(power_watts / 50) * 50 AS watts, count(*) AS samples
FROM gpu_samples
GROUP BY floor(power_watts / 50) * 50
ORDER BY watts".to_owned()),
        q("ag", "histogram of jobs by their mean utilization, 10% buckets", format!(
            "WITH per_job AS (
  SELECT a.job, avg(s.utilization_gpu_pct) AS utilization_pct
  FROM job_allocations a
  JOIN gpu_samples s ON {held}
  GROUP BY a.job)
SELECT floor(utilization_pct / 10) * 10 AS bucket, count(*) AS jobs
FROM per_job
GROUP BY floor(utilization_pct / 10) * 10
ORDER BY bucket")),
        q("ah", "how often each GPU's memory use changed over the last day (changes in a series)", format!(
            "SELECT node, gpu, count(*) AS memory_changes
FROM (SELECT node, gpu, memory_used_bytes,
             lag(memory_used_bytes) OVER (PARTITION BY node, gpu ORDER BY time) AS previous
      FROM gpu_samples
      WHERE {day}) s
WHERE memory_used_bytes <> previous
GROUP BY node, gpu
ORDER BY node, gpu")),
        q("ai", "allocated GPU-hours and jobs per account and user (an sreport-style report from the job tables)", format!(
            "SELECT a.account, j.user_name,
       sum(extract(epoch FROM coalesce(a.end_time, TIMESTAMP '{end}'))
           - extract(epoch FROM a.start_time)) / 3600.0 AS gpu_hours,
       count(DISTINCT a.job) AS jobs
FROM job_allocations a
JOIN jobs j ON j.job = a.job
GROUP BY a.account, j.user_name
ORDER BY a.account, j.user_name")),
        q("aj", "jobs still running whose GPUs averaged under 5% over the last 6 hours (stalled or idle)", format!(
            "SELECT a.job, j.user_name, avg(s.utilization_gpu_pct) AS utilization_pct,
       count(DISTINCT s.node || '/' || CAST(s.gpu AS VARCHAR)) AS gpus
FROM job_allocations a
JOIN jobs j ON j.job = a.job
JOIN gpu_samples s ON s.node = a.node AND s.gpu = a.gpu AND s.time >= a.start_time
WHERE a.end_time IS NULL AND s.time >= TIMESTAMP '{six_hours_before_end}'
GROUP BY a.job, j.user_name
HAVING avg(s.utilization_gpu_pct) < 5
ORDER BY a.job")),
        q("ak", "one node's highest 5-sample moving average of power per GPU over the last day (a sliding frame)", format!(
            "SELECT gpu, max(smoothed) AS peak_smoothed_power_watts
FROM (SELECT gpu,
             avg(power_watts) OVER (PARTITION BY gpu ORDER BY time
               ROWS BETWEEN 4 PRECEDING AND CURRENT ROW) AS smoothed
      FROM gpu_samples
      WHERE node = 'node-001' AND {day}) s
GROUP BY gpu
ORDER BY gpu")),
        q("al", "nodes ranked by energy over the week, with each one's share (rank and a sum over all groups)", format!(
            "SELECT node, sum(power_watts) * {kwh} AS kwh,
       sum(power_watts) / sum(sum(power_watts)) OVER () AS share,
       rank() OVER (ORDER BY sum(power_watts) DESC) AS place
FROM gpu_samples
GROUP BY node
ORDER BY place, node")),
        q("am", "the 10 multi-GPU jobs with the widest spread between their busiest and idlest GPU", format!(
            "WITH per_gpu AS (
  SELECT a.job, a.node, a.gpu, avg(s.utilization_gpu_pct) AS utilization_pct
  FROM job_allocations a
  JOIN gpu_samples s ON {held}
  GROUP BY a.job, a.node, a.gpu)
SELECT job, count(*) AS gpus, round(max(utilization_pct) - min(utilization_pct), 6) AS spread_pct
FROM per_gpu
GROUP BY job
HAVING count(*) > 1
ORDER BY spread_pct DESC, job
LIMIT 10")),
        q("an", "jobs that kept a GPU of each node busy over 50% (count distinct over a join)", format!(
            "SELECT s.node, count(DISTINCT a.job) AS jobs
FROM job_allocations a
JOIN gpu_samples s ON {held}
WHERE s.utilization_gpu_pct > 50
GROUP BY s.node
ORDER BY s.node")),
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
    let engine_on = |store: Arc<Store>| {
        SqlEngine::new(store, limits)
            .with_table("jobs", Arc::new(Rows(data.jobs.clone())))
            .with_table("job_allocations", Arc::new(Rows(data.allocations.clone())))
    };
    let mut duckdb = DuckDb::start(&args.python, threads, args.memory_mb, &duckdb_views(&data)?)?;

    let selected: Vec<Query> = queries(args.interval_secs, args.days)
        .into_iter()
        .filter(|q| args.only.is_empty() || args.only.iter().any(|o| o == q.name))
        .collect();
    let names: Vec<&str> = queries(args.interval_secs, args.days)
        .iter()
        .map(|q| q.name)
        .collect();
    if let Some(unknown) = args
        .only
        .iter()
        .find(|o| *o != "dashboard" && !names.contains(&o.as_str()))
    {
        anyhow::bail!(
            "--only {unknown}: no such query; use some of {}, dashboard",
            names.join(", ")
        );
    }
    let with_dashboard = args.only.is_empty() || args.only.iter().any(|o| o == "dashboard");
    // Cold first: each query as the first one after a start, before anything has warmed
    // either engine's caches of file metadata (the files themselves are in the OS page cache
    // for both alike). perch opens the store and builds its session template as the server
    // does before it listens (`check_views`); DuckDB opens a new in-memory database and
    // creates its views. Neither start is timed, only the query.
    // One start is one sample of a few milliseconds' noise: each query starts `--runs` times
    // per engine, alternating, and the medians are compared.
    let mut cold = Vec::new();
    for q in &selected {
        let (mut perch, mut duck) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            let engine = engine_on(Store::open(data.store_config())?);
            rt.block_on(engine.check_views())?;
            perch.push(run_perch(&rt, &engine, q)?.0);
            drop(engine);
            duckdb.reconnect()?;
            duck.push(duckdb.run(&q.sql)?.0);
        }
        cold.push((q.name, perch, duck));
    }

    let engine = engine_on(Store::open(data.store_config())?);
    print_header(&rt, &engine, &data, &duckdb, threads, &args)?;
    let mut timings = Vec::new();
    for q in &selected {
        let perch_rows = run_perch(&rt, &engine, q)?.1;
        let duckdb_rows = duckdb.run(&q.sql)?.1;
        let exact = match q.exact_sql() {
            Some(sql) => Some(duckdb.run(&sql)?.1),
            None => None,
        };
        let agree = |perch: &[Vec<results::Cell>], duck: &[Vec<results::Cell>]| match &exact {
            Some(exact) => results::estimates_near(q.name, perch, duck, exact),
            None => results::compare(q.name, perch, duck, q.tolerance()),
        };
        agree(&perch_rows, &duckdb_rows)?;
        let mut t = Timing {
            rows: perch_rows.len(),
            checksum: results::checksum(&perch_rows),
            perch: Vec::new(),
            duckdb: Vec::new(),
        };
        for _ in 0..args.runs {
            let (elapsed, rows) = run_perch(&rt, &engine, q)?;
            agree(&rows, &duckdb_rows)?;
            t.perch.push(elapsed);
            let (elapsed, rows) = duckdb.run(&q.sql)?;
            agree(&perch_rows, &rows)?;
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
    if !timings.is_empty() {
        println!("target: no query slower than DuckDB: {}", verdict(&slower));
        print_cold(&cold);
    }
    if with_dashboard {
        dashboard(
            &rt,
            &engine,
            &mut duckdb,
            args.runs,
            limits.max_concurrent,
            args.interval_secs,
        )?;
    }
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

fn duckdb_views(data: &Dataset) -> Result<Vec<(&'static str, String)>> {
    let quote = |p: PathBuf| p.to_string_lossy().replace('\'', "''");
    Ok(vec![
        (
            "gpu_samples",
            format!(
                "read_parquet('{}', hive_partitioning = false)",
                quote(data.table_glob(Table::GpuSamples))
            ),
        ),
        // perch's merging view over the same partial rows, from the same files.
        (
            "gpu_samples_1h",
            format!(
                "({})",
                Table::GpuSamples1h
                    .rollup_view_sql(&format!(
                        "read_parquet('{}', hive_partitioning = false)",
                        quote(data.table_glob(Table::GpuSamples1h))
                    ))
                    .context("gpu_samples_1h is a rollup")?
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
    ])
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `median (min-max)` of `times`, in milliseconds.
fn span(times: &[Duration]) -> String {
    let lo = times.iter().min().copied().unwrap_or_default();
    let hi = times.iter().max().copied().unwrap_or_default();
    format!("{:.1} ({:.1}-{:.1})", ms(median(times)), ms(lo), ms(hi))
}

fn print_row(q: &Query, t: &Timing) {
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

fn verdict(slower: &[&str]) -> String {
    if slower.is_empty() {
        "met".to_owned()
    } else {
        format!("missed on {}", slower.join(", "))
    }
}

fn print_cold(cold: &[(&str, Vec<Duration>, Vec<Duration>)]) {
    let starts = cold.first().map_or(0, |(_, p, _)| p.len());
    println!(
        "cold: each query as the first after a start (perch: a new store and session template, as a server starts; DuckDB: a new database and its views), {starts} starts per engine, alternating, ms, median (min-max)"
    );
    println!(
        "{:<4}{:>24}  {:>24}  {:>8}",
        "", "perch", "DuckDB", "perch/D"
    );
    for (name, perch, duckdb) in cold {
        println!(
            "({name}) {:>24}  {:>24}  {:>8.2}",
            span(perch),
            span(duckdb),
            ms(median(perch)) / ms(median(duckdb)).max(1e-9)
        );
    }
    let slower: Vec<&str> = cold
        .iter()
        .filter(|(_, p, d)| median(p) > median(d))
        .map(|(name, _, _)| *name)
        .collect();
    println!("cold: no query slower than DuckDB: {}", verdict(&slower));
}

/// The last six hours of the dataset's week, as a dashboard's time picker sends them.
const SIX_HOURS: &str =
    "time >= TIMESTAMP '2025-06-08 18:00:00' AND time < TIMESTAMP '2025-06-09 00:00:00'";

/// Twenty panels of a fleet dashboard over the last six hours, refreshed together: time
/// series by minute and by Grafana's `$__timeGroup`, stat panels, tables, top-k, a
/// histogram, one node's GPUs, an exact percentile and GPU-hours per account. `iv` is the
/// sampling interval in seconds, as in [`queries`].
fn panels(iv: u32) -> Vec<Query> {
    let w = SIX_HOURS;
    let sw = SIX_HOURS.replace("time", "s.time");
    let panel = |name: &'static str, title: &'static str, sql: String| Query { name, title, sql };
    vec![
        panel("1", "fleet utilization by minute", format!(
            "SELECT date_trunc('minute', time) AS minute, avg(utilization_gpu_pct) AS utilization_pct
FROM gpu_samples WHERE {w}
GROUP BY date_trunc('minute', time) ORDER BY minute")),
        panel("2", "fleet power by minute", format!(
            "SELECT date_trunc('minute', time) AS minute, sum(power_watts) * {iv}.0 / 60.0 AS power_watts
FROM gpu_samples WHERE {w}
GROUP BY date_trunc('minute', time) ORDER BY minute")),
        panel("3", "hottest GPU by minute", format!(
            "SELECT date_trunc('minute', time) AS minute, max(temperature_celsius) AS hottest
FROM gpu_samples WHERE {w}
GROUP BY date_trunc('minute', time) ORDER BY minute")),
        panel("4", "memory used per node, 5-minute buckets", format!(
            "SELECT floor(extract(epoch FROM time) / 300) * 300 AS time_sec, node,
       sum(memory_used_bytes) * {iv}.0 / 300.0 AS memory_used_bytes
FROM gpu_samples WHERE {w}
GROUP BY 1, 2 ORDER BY 1, 2")),
        panel("5", "stat: mean utilization", format!(
            "SELECT avg(utilization_gpu_pct) AS utilization_pct FROM gpu_samples WHERE {w}")),
        panel("6", "stat: GPUs busy in the last minute", format!(
            "SELECT count(*) AS busy_gpus FROM (
  SELECT node, gpu FROM gpu_samples
  WHERE {w} AND time >= TIMESTAMP '2025-06-08 23:59:00'
  GROUP BY node, gpu HAVING avg(utilization_gpu_pct) > 50) busy")),
        panel("7", "stat: energy, kWh", format!(
            "SELECT sum(power_watts) * {iv}.0 / 3600000.0 AS kwh FROM gpu_samples WHERE {w}")),
        panel("8", "stat: hottest GPU", format!(
            "SELECT max(temperature_celsius) AS hottest FROM gpu_samples WHERE {w}")),
        panel("9", "table: the 10 GPUs drawing the most power", format!(
            "SELECT node, gpu, avg(power_watts) AS power_watts FROM gpu_samples WHERE {w}
GROUP BY node, gpu ORDER BY power_watts DESC, node, gpu LIMIT 10")),
        panel("10", "table: idle GPUs per node", format!(
            "SELECT node, count(*) AS idle_gpus FROM (
  SELECT node, gpu FROM gpu_samples WHERE {w}
  GROUP BY node, gpu HAVING avg(utilization_gpu_pct) < 5) idle
GROUP BY node ORDER BY node")),
        panel("11", "bar gauge: mean utilization per node", format!(
            "SELECT node, avg(utilization_gpu_pct) AS utilization_pct FROM gpu_samples WHERE {w}
GROUP BY node ORDER BY node")),
        panel("12", "one node: utilization of each GPU by minute", format!(
            "SELECT date_trunc('minute', time) AS minute, gpu, avg(utilization_gpu_pct) AS utilization_pct
FROM gpu_samples WHERE node = 'node-007' AND {w}
GROUP BY date_trunc('minute', time), gpu ORDER BY minute, gpu")),
        panel("13", "one node: power of each GPU by minute", format!(
            "SELECT date_trunc('minute', time) AS minute, gpu, avg(power_watts) AS power_watts
FROM gpu_samples WHERE node = 'node-007' AND {w}
GROUP BY date_trunc('minute', time), gpu ORDER BY minute, gpu")),
        panel("14", "one node: temperature of each GPU by minute", format!(
            "SELECT date_trunc('minute', time) AS minute, gpu, max(temperature_celsius) AS temperature_celsius
FROM gpu_samples WHERE node = 'node-007' AND {w}
GROUP BY date_trunc('minute', time), gpu ORDER BY minute, gpu")),
        panel("15", "histogram of utilization, 10% buckets", format!(
            "SELECT floor(utilization_gpu_pct / 10) * 10 AS bucket, count(*) AS samples
FROM gpu_samples WHERE {w}
GROUP BY 1 ORDER BY 1")),
        panel("16", "fleet memory utilization by minute", format!(
            "SELECT date_trunc('minute', time) AS minute, avg(utilization_memory_pct) AS memory_utilization_pct
FROM gpu_samples WHERE {w}
GROUP BY date_trunc('minute', time) ORDER BY minute")),
        panel("17", "exact 95th percentile of utilization per node", format!(
            "SELECT node, percentile_cont(0.95) WITHIN GROUP (ORDER BY utilization_gpu_pct) AS p95_utilization_pct
FROM gpu_samples WHERE {w}
GROUP BY node ORDER BY node")),
        panel("18", "GPUs at 80 C or more, 5-minute buckets", format!(
            "SELECT floor(extract(epoch FROM time) / 300) * 300 AS time_sec,
       count(*) FILTER (WHERE temperature_celsius >= 80) * {iv}.0 / 300.0 AS hot_gpus
FROM gpu_samples WHERE {w}
GROUP BY 1 ORDER BY 1")),
        panel("19", "table: each GPU's latest sample", format!(
            "SELECT s.node, s.gpu, s.utilization_gpu_pct, s.temperature_celsius
FROM gpu_samples s
JOIN (SELECT node, gpu, max(time) AS time FROM gpu_samples WHERE {w} GROUP BY node, gpu) latest
  ON s.node = latest.node AND s.gpu = latest.gpu AND s.time = latest.time
WHERE {sw}
ORDER BY s.node, s.gpu")),
        panel("20", "GPU-hours and mean utilization per account", format!(
            "SELECT a.account, count(*) * {iv}.0 / 3600.0 AS gpu_hours, avg(s.utilization_gpu_pct) AS utilization_pct
FROM job_allocations a
JOIN gpu_samples s ON s.node = a.node AND s.gpu = a.gpu
 AND s.time >= a.start_time AND (a.end_time IS NULL OR s.time < a.end_time)
WHERE {sw}
GROUP BY a.account ORDER BY a.account")),
    ]
}

/// The dashboard case: every panel's query sent at once, as Grafana does on a refresh, to
/// each engine in turn; the time until the last answer. Checked equal like the queries.
fn dashboard(
    rt: &tokio::runtime::Runtime,
    engine: &SqlEngine,
    duckdb: &mut DuckDb,
    runs: u32,
    slots: usize,
    iv: u32,
) -> Result<()> {
    let panels = panels(iv);
    let sqls: Vec<String> = panels.iter().map(|p| p.sql.clone()).collect();
    let perch_refresh = || -> Result<(Duration, Vec<Vec<Vec<results::Cell>>>)> {
        let started = Instant::now();
        let outs = rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for (i, sql) in sqls.iter().enumerate() {
                let engine = engine.clone();
                let sql = sql.clone();
                set.spawn(async move { (i, engine.query(&sql).await) });
            }
            let mut outs: Vec<Option<_>> = (0..sqls.len()).map(|_| None).collect();
            while let Some(done) = set.join_next().await {
                let (i, out) = done?;
                outs[i] = Some(out);
            }
            anyhow::Ok(outs)
        })?;
        let elapsed = started.elapsed();
        let rows = outs
            .into_iter()
            .zip(&panels)
            .map(|(out, p)| {
                let out = out
                    .context("a panel's task did not answer")?
                    .with_context(|| format!("perch, panel {}", p.name))?;
                anyhow::ensure!(!out.truncated, "panel {}: cut at the row limit", p.name);
                results::from_batches(&out.batches)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((elapsed, rows))
    };
    let check = |perch: &[Vec<Vec<results::Cell>>], duck: &[Vec<Vec<results::Cell>>]| {
        panels
            .iter()
            .zip(perch.iter().zip(duck))
            .try_for_each(|(p, (a, b))| {
                results::compare(&format!("panel {}", p.name), a, b, p.tolerance())
            })
    };
    // A warm-up refresh each, compared.
    let (_, expected) = perch_refresh()?;
    check(&expected, &duckdb.run_together(&sqls)?.1)?;
    let mut perch_times = Vec::new();
    let mut duck_times = Vec::new();
    for _ in 0..runs {
        let (t, rows) = perch_refresh()?;
        check(&rows, &expected)?;
        perch_times.push(t);
        let (t, rows) = duckdb.run_together(&sqls)?;
        check(&expected, &rows)?;
        duck_times.push(t);
    }
    println!(
        "dashboard: {} panels over the last 6 hours sent at once (perch through its {slots} SQL slots, DuckDB one cursor per panel), until the last answer; median (min-max) of {runs} refreshes in ms",
        panels.len()
    );
    println!(
        "  perch {}   DuckDB {}   perch/D {:.2}",
        span(&perch_times),
        span(&duck_times),
        ms(median(&perch_times)) / ms(median(&duck_times)).max(1e-9)
    );
    println!(
        "dashboard: refresh no slower than DuckDB's: {}",
        if median(&perch_times) <= median(&duck_times) {
            "met"
        } else {
            "missed"
        }
    );
    Ok(())
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
        for q in queries(10, 7).into_iter().chain(panels(10)) {
            assert!(
                doc.contains(&format!("```sql\n{}\n```", q.sql)),
                "BENCHMARKS.md lacks the SQL of query {}:\n{}",
                q.name,
                q.sql
            );
        }
    }

    /// Every query and panel plans in perch against the dataset's tables (an empty store and
    /// empty job tables of the real schemas), so a typo fails here, not in a 10-minute
    /// benchmark.
    #[tokio::test]
    async fn every_query_and_panel_plans_in_perch() {
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
        // An aggregate without GROUP BY answers one row (a NULL mean, a zero count) even over
        // nothing.
        let ungrouped = ["e", "v", "5", "6", "7", "8"];
        for q in queries(10, 7).into_iter().chain(panels(10)) {
            let out = engine
                .query(&q.sql)
                .await
                .unwrap_or_else(|e| panic!("query {}: {e}", q.name));
            let expected = usize::from(ungrouped.contains(&q.name));
            assert_eq!(out.rows, expected, "query {} on empty tables", q.name);
        }
    }
}
