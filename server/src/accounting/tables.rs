//! The accounting tables and views SQL sees: `jobs`, `job_allocations`, `nodes` and
//! `node_states` are live tables read from the control plane at each query;
//! `cluster_utilization_daily` is computed from them in Rust (splitting intervals across days
//! is clearer here than in SQL); `job_costs`, `user_usage`, `top_users` and `account_usage`
//! are SQL views over `jobs`. Columns are documented in `docs/schema.md`.

use super::daily::{self, Availability, Held, Span};
use super::{AccountingConfig, GpuFigures, gpu_figures};
use crate::jobs::JobService;
use crate::jobs::control::Control;
use crate::jobs::record::{JobRecord, NodeState};
use arrow::array::{
    ArrayRef, BooleanArray, Float64Array, Int32Array, RecordBatch, StringArray,
    TimestampMillisecondArray, UInt32Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use perch_query::{LiveTable, SqlEngine};
use std::sync::Arc;

fn ts(name: &str, nullable: bool) -> Field {
    Field::new(
        name,
        DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
        nullable,
    )
}

fn col(name: &str, t: DataType, nullable: bool) -> Field {
    Field::new(name, t, nullable)
}

fn batch(schema: &SchemaRef, columns: Vec<ArrayRef>) -> Result<Vec<RecordBatch>, String> {
    RecordBatch::try_new(schema.clone(), columns)
        .map(|b| vec![b])
        .map_err(|e| e.to_string())
}

fn strings<'a>(v: impl Iterator<Item = Option<&'a str>>) -> ArrayRef {
    Arc::new(v.collect::<StringArray>())
}

fn times(v: impl Iterator<Item = Option<i64>>) -> ArrayRef {
    Arc::new(
        v.collect::<TimestampMillisecondArray>()
            .with_timezone("UTC"),
    )
}

fn f64s(v: impl Iterator<Item = Option<f64>>) -> ArrayRef {
    Arc::new(v.collect::<Float64Array>())
}

fn u64s(v: impl Iterator<Item = Option<u64>>) -> ArrayRef {
    Arc::new(v.collect::<UInt64Array>())
}

fn u32s(v: impl Iterator<Item = Option<u32>>) -> ArrayRef {
    Arc::new(v.collect::<UInt32Array>())
}

fn bools(v: impl Iterator<Item = Option<bool>>) -> ArrayRef {
    Arc::new(v.collect::<BooleanArray>())
}

/// Sums of per-GPU figures; `None` stays `None` only when every GPU's is.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    pub(crate) allocated: f64,
    pub(crate) accounted: Option<f64>,
    pub(crate) used: Option<f64>,
    pub(crate) peak: Option<f64>,
    pub(crate) memory: Option<u64>,
    pub(crate) energy: Option<f64>,
    pub(crate) cost_allocated: f64,
    pub(crate) cost_used: Option<f64>,
}

/// One job's figures over all its allocations and GPUs at `now`: what the `jobs` table
/// shows and what `/metrics` sums per account.
pub(crate) fn job_totals(j: &JobRecord, now: i64, prices: &crate::accounting::Prices) -> Totals {
    let mut totals = Totals::default();
    for a in &j.allocations {
        for g in 0..a.gpus.len() {
            totals.add(&gpu_figures(a, g, now, prices));
        }
    }
    totals
}

fn add(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x + y),
        (x, y) => x.or(y),
    }
}

impl Totals {
    fn add(&mut self, f: &GpuFigures) {
        self.allocated += f.allocated_seconds;
        self.accounted = add(self.accounted, f.accounted_seconds);
        self.used = add(self.used, f.used_seconds);
        self.peak = match (self.peak, f.util_peak_pct) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        self.memory = self.memory.max(f.memory_peak_bytes);
        self.energy = add(self.energy, f.energy_joules);
        self.cost_allocated += f.cost_allocated;
        self.cost_used = add(self.cost_used, f.cost_used);
    }

    /// Time-weighted mean utilization over the accounted GPU-time.
    fn mean_pct(&self) -> Option<f64> {
        match (self.used, self.accounted) {
            (Some(u), Some(a)) if a > 0.0 => Some(100.0 * u / a),
            _ => None,
        }
    }
}

/// Telemetry up to this time is in a job's accounting: the earliest checkpoint of its
/// allocations (an ended and fully folded one counts as its end).
fn accounted_until(job: &JobRecord) -> Option<i64> {
    job.allocations.iter().map(|a| a.folded_end_ms()).min()
}

/// `jobs`: sacct's fields plus what sacct cannot tell.
#[derive(Debug)]
pub struct JobsTable {
    jobs: JobService,
    config: Arc<AccountingConfig>,
}

impl JobsTable {
    fn schema_ref() -> SchemaRef {
        use DataType::*;
        Arc::new(Schema::new(vec![
            col("job", UInt64, false),
            col("name", Utf8, true),
            col("user_name", Utf8, false),
            col("account", Utf8, false),
            col("queue", Utf8, true),
            col("qos", Utf8, false),
            col("state", Utf8, false),
            col("exit_code", Int32, true),
            col("reason", Utf8, true),
            ts("submit_time", false),
            ts("start_time", true),
            ts("end_time", true),
            col("elapsed_seconds", Float64, true),
            col("nodes", Utf8, false),
            col("node_count", UInt32, false),
            col("gpus", UInt32, false),
            col("gpu_model", Utf8, true),
            col("attempts", UInt32, false),
            col("preemptions", UInt32, false),
            col("requeues", UInt32, false),
            col("time_limit_seconds", UInt64, false),
            col("gpu_seconds_allocated", Float64, false),
            col("gpu_seconds_accounted", Float64, true),
            col("gpu_seconds_used", Float64, true),
            col("utilization_mean_pct", Float64, true),
            col("utilization_peak_pct", Float64, true),
            col("memory_peak_bytes", UInt64, true),
            col("energy_joules", Float64, true),
            col("cost_allocated", Float64, false),
            col("cost_used", Float64, true),
            ts("accounted_until", true),
            col("simulated", Boolean, false),
        ]))
    }
}

struct JobRow {
    record: JobRecord,
    totals: Totals,
    now: i64,
}

fn job_rows(c: &Control, config: &AccountingConfig, now: i64) -> Vec<JobRow> {
    c.records()
        .map(|j| JobRow {
            record: j.clone(),
            totals: job_totals(j, now, &config.prices),
            now,
        })
        .collect()
}

impl LiveTable for JobsTable {
    fn schema(&self) -> SchemaRef {
        Self::schema_ref()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let now = self.jobs.now_ms();
        let rows = self.jobs.read(|c| job_rows(c, &self.config, now));
        let r = || rows.iter().map(|r| &r.record);
        let t = || rows.iter().map(|r| &r.totals);
        let nodes: Vec<String> = r()
            .map(|j| {
                j.placement
                    .iter()
                    .map(|p| p.node.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect();
        let qos: Vec<&str> = r()
            .map(|j| j.request.qos.as_deref().unwrap_or("normal"))
            .collect();
        let model = |j: &JobRecord| {
            j.allocations
                .last()
                .map(|a| a.gpu_model.clone())
                .or_else(|| j.request.gpu_model.clone())
        };
        let models: Vec<Option<String>> = r().map(model).collect();
        let elapsed = rows.iter().map(|row| {
            let j = &row.record;
            j.start_ms
                .map(|s| (j.end_ms.unwrap_or(row.now) - s).max(0) as f64 / 1000.0)
        });
        batch(
            &Self::schema_ref(),
            vec![
                u64s(r().map(|j| Some(j.id))),
                strings(r().map(|j| j.request.name.as_deref())),
                strings(r().map(|j| Some(j.request.user()))),
                strings(r().map(|j| Some(j.request.account()))),
                strings(r().map(|j| j.request.queue.as_deref())),
                strings(qos.iter().map(|q| Some(*q))),
                strings(r().map(|j| Some(j.state.as_str()))),
                Arc::new(r().map(|j| j.exit_code).collect::<Int32Array>()),
                strings(r().map(|j| j.reason.as_deref())),
                times(r().map(|j| Some(j.submit_ms))),
                times(r().map(|j| j.start_ms)),
                times(r().map(|j| j.end_ms)),
                f64s(elapsed),
                strings(nodes.iter().map(|n| Some(n.as_str()))),
                u32s(r().map(|j| Some(j.request.nodes))),
                u32s(r().map(|j| Some(j.request.nodes.saturating_mul(j.request.gpus_per_node)))),
                strings(models.iter().map(|m| m.as_deref())),
                u32s(r().map(|j| Some(j.attempts))),
                u32s(r().map(|j| Some(j.preemptions))),
                u32s(r().map(|j| Some(j.requeues))),
                u64s(r().map(|j| Some(j.request.time_limit_secs))),
                f64s(t().map(|t| Some(t.allocated))),
                f64s(t().map(|t| t.accounted)),
                f64s(t().map(|t| t.used)),
                f64s(t().map(Totals::mean_pct)),
                f64s(t().map(|t| t.peak)),
                u64s(t().map(|t| t.memory)),
                f64s(t().map(|t| t.energy)),
                f64s(t().map(|t| Some(t.cost_allocated))),
                f64s(t().map(|t| t.cost_used)),
                times(r().map(accounted_until)),
                bools(r().map(|j| Some(j.allocations.iter().any(|a| a.simulated)))),
            ],
        )
    }
}

/// `job_allocations`: one row per GPU per allocation (attempt and node) of every job.
#[derive(Debug)]
pub struct AllocationsTable {
    jobs: JobService,
    config: Arc<AccountingConfig>,
}

impl AllocationsTable {
    fn schema_ref() -> SchemaRef {
        use DataType::*;
        Arc::new(Schema::new(vec![
            col("job", UInt64, false),
            col("attempt", UInt32, false),
            col("user_name", Utf8, false),
            col("account", Utf8, false),
            col("node", Utf8, false),
            col("gpu", UInt32, false),
            col("gpu_model", Utf8, false),
            ts("start_time", false),
            ts("end_time", true),
            col("gpu_seconds_allocated", Float64, false),
            col("gpu_seconds_accounted", Float64, true),
            col("gpu_seconds_used", Float64, true),
            col("utilization_mean_pct", Float64, true),
            col("utilization_peak_pct", Float64, true),
            col("memory_peak_bytes", UInt64, true),
            col("energy_joules", Float64, true),
            col("samples", UInt64, false),
            col("cost_allocated", Float64, false),
            col("cost_used", Float64, true),
            ts("accounted_until", false),
            col("simulated", Boolean, false),
        ]))
    }
}

struct AllocRow {
    job: u64,
    attempt: u32,
    user: String,
    account: String,
    node: String,
    gpu: u32,
    model: String,
    start: i64,
    end: Option<i64>,
    accounted_until: i64,
    simulated: bool,
    f: GpuFigures,
}

impl LiveTable for AllocationsTable {
    fn schema(&self) -> SchemaRef {
        Self::schema_ref()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let now = self.jobs.now_ms();
        let prices = &self.config.prices;
        let rows: Vec<AllocRow> = self.jobs.read(|c| {
            let mut rows = Vec::new();
            for j in c.records() {
                for a in &j.allocations {
                    for (g, &gpu) in a.gpus.iter().enumerate() {
                        rows.push(AllocRow {
                            job: j.id,
                            attempt: a.attempt,
                            user: j.request.user().to_owned(),
                            account: j.request.account().to_owned(),
                            node: a.node.clone(),
                            gpu,
                            model: a.gpu_model.clone(),
                            start: a.start_ms,
                            end: a.end_ms,
                            accounted_until: a.folded_end_ms(),
                            simulated: a.simulated,
                            f: gpu_figures(a, g, now, prices),
                        });
                    }
                }
            }
            rows
        });
        let r = || rows.iter();
        batch(
            &Self::schema_ref(),
            vec![
                u64s(r().map(|a| Some(a.job))),
                u32s(r().map(|a| Some(a.attempt))),
                strings(r().map(|a| Some(a.user.as_str()))),
                strings(r().map(|a| Some(a.account.as_str()))),
                strings(r().map(|a| Some(a.node.as_str()))),
                u32s(r().map(|a| Some(a.gpu))),
                strings(r().map(|a| Some(a.model.as_str()))),
                times(r().map(|a| Some(a.start))),
                times(r().map(|a| a.end)),
                f64s(r().map(|a| Some(a.f.allocated_seconds))),
                f64s(r().map(|a| a.f.accounted_seconds)),
                f64s(r().map(|a| a.f.used_seconds)),
                f64s(
                    r().map(|a| match (a.f.used_seconds, a.f.accounted_seconds) {
                        (Some(u), Some(s)) if s > 0.0 => Some(100.0 * u / s),
                        _ => None,
                    }),
                ),
                f64s(r().map(|a| a.f.util_peak_pct)),
                u64s(r().map(|a| a.f.memory_peak_bytes)),
                f64s(r().map(|a| a.f.energy_joules)),
                u64s(r().map(|a| Some(a.f.samples))),
                f64s(r().map(|a| Some(a.f.cost_allocated))),
                f64s(r().map(|a| a.f.cost_used)),
                times(r().map(|a| Some(a.accounted_until))),
                bools(r().map(|a| Some(a.simulated))),
            ],
        )
    }
}

/// `nodes`: every node the control plane knows, as it is now.
#[derive(Debug)]
pub struct NodesTable {
    jobs: JobService,
}

impl NodesTable {
    fn schema_ref() -> SchemaRef {
        use DataType::*;
        Arc::new(Schema::new(vec![
            col("node", Utf8, false),
            col("state", Utf8, false),
            col("gpus", UInt32, false),
            col("gpu_model", Utf8, false),
            col("rack", Utf8, false),
            ts("last_seen", false),
            col("reason", Utf8, true),
            col("drained_by", Utf8, true),
            col("simulated", Boolean, false),
        ]))
    }
}

impl LiveTable for NodesTable {
    fn schema(&self) -> SchemaRef {
        Self::schema_ref()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let now = self.jobs.now_ms();
        let rows: Vec<_> = self.jobs.read(|c| {
            c.node_records()
                .map(|(n, state, last)| {
                    let reason = match state {
                        NodeState::Up => None,
                        NodeState::Down => Some(format!(
                            "its agent has not synced for {} s",
                            (now - last).max(0) / 1000
                        )),
                        NodeState::Drained => Some(n.drain_reason.clone().unwrap_or_else(|| {
                            format!(
                                "drained by {}",
                                n.drained_by.as_deref().unwrap_or("an operator")
                            )
                        })),
                    };
                    (n.clone(), state, last, reason)
                })
                .collect()
        });
        let r = || rows.iter();
        batch(
            &Self::schema_ref(),
            vec![
                strings(r().map(|n| Some(n.0.name.as_str()))),
                strings(r().map(|n| Some(n.1.as_str()))),
                u32s(r().map(|n| Some(n.0.gpus))),
                strings(r().map(|n| Some(n.0.model.as_str()))),
                strings(r().map(|n| Some(n.0.rack.as_str()))),
                times(r().map(|n| Some(n.2))),
                strings(r().map(|n| n.3.as_deref())),
                strings(r().map(|n| {
                    if n.0.drained {
                        n.0.drained_by.as_deref()
                    } else {
                        None
                    }
                })),
                bools(r().map(|n| Some(n.0.simulated))),
            ],
        )
    }
}

/// `node_states`: the history of every node's state, one row per stretch.
#[derive(Debug)]
pub struct NodeStatesTable {
    jobs: JobService,
}

impl NodeStatesTable {
    fn schema_ref() -> SchemaRef {
        use DataType::*;
        Arc::new(Schema::new(vec![
            col("node", Utf8, false),
            col("state", Utf8, false),
            col("gpus", UInt32, false),
            ts("start_time", false),
            ts("end_time", true),
        ]))
    }
}

impl LiveTable for NodeStatesTable {
    fn schema(&self) -> SchemaRef {
        Self::schema_ref()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let spans: Vec<_> = self.jobs.read(|c| c.node_spans().cloned().collect());
        let r = || spans.iter();
        batch(
            &Self::schema_ref(),
            vec![
                strings(r().map(|s| Some(s.node.as_str()))),
                strings(r().map(|s| Some(s.state.as_str()))),
                u32s(r().map(|s| Some(s.gpus))),
                times(r().map(|s| Some(s.start_ms))),
                times(r().map(|s| s.end_ms)),
            ],
        )
    }
}

/// `cluster_utilization_daily`: sreport's cluster utilization, per UTC day.
#[derive(Debug)]
pub struct DailyTable {
    jobs: JobService,
    config: Arc<AccountingConfig>,
}

impl DailyTable {
    fn schema_ref() -> SchemaRef {
        use DataType::*;
        Arc::new(Schema::new(vec![
            ts("day", false),
            col("capacity_gpu_hours", Float64, false),
            col("allocated_gpu_hours", Float64, false),
            col("used_gpu_hours", Float64, false),
            col("idle_gpu_hours", Float64, false),
            col("drained_gpu_hours", Float64, false),
            col("down_gpu_hours", Float64, false),
            col("allocated_pct", Float64, true),
        ]))
    }
}

/// The days of the control plane's history at `now`.
pub(crate) fn days(c: &Control, config: &AccountingConfig, now: i64) -> Vec<daily::Day> {
    let spans: Vec<Span<'_>> = c
        .node_spans()
        .map(|s| Span {
            node: &s.node,
            gpus: s.gpus,
            state: match s.state {
                NodeState::Up => Availability::Up,
                NodeState::Drained => Availability::Drained,
                NodeState::Down => Availability::Down,
            },
            start_ms: s.start_ms,
            end_ms: s.end_ms,
        })
        .collect();
    let mut held = Vec::new();
    for j in c.records() {
        for a in &j.allocations {
            for (g, &gpu) in a.gpus.iter().enumerate() {
                held.push(Held {
                    node: &a.node,
                    gpu,
                    start_ms: a.start_ms,
                    end_ms: a.end_ms,
                    used_seconds: gpu_figures(a, g, now, &config.prices).used_seconds,
                    used_until_ms: a.folded_end_ms(),
                });
            }
        }
    }
    daily::daily(&spans, &held, now, daily::DAY_MS)
}

impl LiveTable for DailyTable {
    fn schema(&self) -> SchemaRef {
        Self::schema_ref()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let now = self.jobs.now_ms();
        let days = self.jobs.read(|c| days(c, &self.config, now));
        let h = |ms: i64| Some(ms as f64 / 3.6e6);
        let r = || days.iter();
        batch(
            &Self::schema_ref(),
            vec![
                times(r().map(|d| Some(d.start_ms))),
                f64s(r().map(|d| h(d.capacity_ms))),
                f64s(r().map(|d| h(d.allocated_ms))),
                f64s(r().map(|d| Some(d.used_seconds / 3600.0))),
                f64s(r().map(|d| h(d.idle_ms))),
                f64s(r().map(|d| h(d.drained_ms))),
                f64s(r().map(|d| h(d.down_ms))),
                f64s(r().map(|d| {
                    (d.capacity_ms > 0)
                        .then(|| 100.0 * d.allocated_ms as f64 / d.capacity_ms as f64)
                })),
            ],
        )
    }
}

/// Per-job cost, OpenCost's split: by allocation, by use, and the idle difference.
const JOB_COSTS: &str =
    "SELECT job, name, user_name, account, state, gpu_model, start_time, end_time,
  gpu_seconds_allocated / 3600 AS gpu_hours_allocated,
  gpu_seconds_used / 3600 AS gpu_hours_used,
  gpu_seconds_used / nullif(gpu_seconds_accounted, 0) AS efficiency,
  energy_joules / 3600000 AS energy_kwh,
  cost_allocated, cost_used, cost_allocated - cost_used AS idle_cost, simulated
FROM jobs WHERE attempts > 0";

/// The sums the per-user and per-account views share.
const SUMS: &str = "count(*) AS jobs,
  sum(gpu_seconds_allocated) / 3600 AS gpu_hours_allocated,
  sum(gpu_seconds_used) / 3600 AS gpu_hours_used,
  sum(gpu_seconds_used) / nullif(sum(gpu_seconds_accounted), 0) AS efficiency,
  sum(cost_allocated) AS cost_allocated,
  sum(cost_used) AS cost_used,
  sum(cost_allocated) - sum(cost_used) AS idle_cost";

/// Registers the accounting tables and views on `sql`.
pub fn register(sql: SqlEngine, jobs: &JobService, config: AccountingConfig) -> SqlEngine {
    let config = Arc::new(config);
    let user_usage =
        format!("SELECT user_name, {SUMS} FROM jobs WHERE attempts > 0 GROUP BY user_name");
    let account_usage = format!(
        "SELECT account, user_name, {SUMS} FROM jobs WHERE attempts > 0 GROUP BY account, user_name"
    );
    sql.with_table(
        "jobs",
        Arc::new(JobsTable {
            jobs: jobs.clone(),
            config: config.clone(),
        }),
    )
    .with_table(
        "job_allocations",
        Arc::new(AllocationsTable {
            jobs: jobs.clone(),
            config: config.clone(),
        }),
    )
    .with_table("nodes", Arc::new(NodesTable { jobs: jobs.clone() }))
    .with_table(
        "node_states",
        Arc::new(NodeStatesTable { jobs: jobs.clone() }),
    )
    .with_table(
        "cluster_utilization_daily",
        Arc::new(DailyTable {
            jobs: jobs.clone(),
            config,
        }),
    )
    .with_view("job_costs", JOB_COSTS)
    .with_view("user_usage", &user_usage)
    .with_view(
        "top_users",
        "SELECT * FROM user_usage ORDER BY gpu_hours_allocated DESC, user_name LIMIT 10",
    )
    .with_view("account_usage", &account_usage)
}
