//! The accounting tables and views SQL sees: `jobs`, `job_allocations`, `nodes` and
//! `node_states` are live tables read from the control plane at each query;
//! `cluster_utilization_daily` is computed from them in Rust (splitting intervals across days
//! is clearer here than in SQL); `job_costs`, `user_usage`, `top_users` and `account_usage`
//! are SQL views over `jobs`; `job_stragglers` is a SQL view over those and the telemetry
//! (`stragglers.rs`). Columns are documented in `docs/schema.md`.

use super::daily::{self, Availability, Held, Span};
use super::history::History as JobService;
use super::settled::{Unread, View};
use super::{AccountingConfig, GpuFigures, Prices, gpu_figures};
use arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int32Array, RecordBatch, StringArray,
    TimestampMillisecondArray, UInt32Array, UInt64Array, downcast_array,
};
use arrow::datatypes::{Field, Schema, SchemaRef};
use perch_control::cost::{Totals, job_totals};
use perch_control::db::NodeRecord;
use perch_control::provenance::{
    ContainerProvenance, GitProvenance, ProvenanceRecord, PythonProvenance, RunProvenance,
};
use perch_control::record::{JobRecord, NodeSpan, NodeState};
use perch_control::validation::Run;
use perch_query::{LiveTable, Room, SqlEngine, project};
use std::sync::{Arc, LazyLock};

/// A live table's columns, each declared once: name, nullability and values together (the
/// type follows from the values). The schema is what a build over no rows gives, so the two
/// cannot drift apart.
struct Columns<'a, R> {
    rows: &'a [R],
    fields: Vec<Field>,
    arrays: Vec<ArrayRef>,
}

impl<'a, R> Columns<'a, R> {
    fn new(rows: &'a [R]) -> Self {
        Columns {
            rows,
            fields: Vec::new(),
            arrays: Vec::new(),
        }
    }

    fn push(mut self, name: &str, nullable: bool, array: ArrayRef) -> Self {
        self.fields
            .push(Field::new(name, array.data_type().clone(), nullable));
        self.arrays.push(array);
        self
    }

    fn str(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<&'a str>) -> Self {
        self.values::<_, StringArray>(name, nullable, f)
    }

    fn time(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<i64>) -> Self {
        let array = self
            .rows
            .iter()
            .map(f)
            .collect::<TimestampMillisecondArray>();
        self.push(name, nullable, Arc::new(array.with_timezone("UTC")))
    }

    /// A column of `A` values, one per row.
    fn values<T, A>(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<T>) -> Self
    where
        A: FromIterator<Option<T>> + Array + 'static,
    {
        let array: A = self.rows.iter().map(f).collect();
        self.push(name, nullable, Arc::new(array))
    }

    fn f64(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<f64>) -> Self {
        self.values::<_, Float64Array>(name, nullable, f)
    }

    fn u64(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<u64>) -> Self {
        self.values::<_, UInt64Array>(name, nullable, f)
    }

    fn u32(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<u32>) -> Self {
        self.values::<_, UInt32Array>(name, nullable, f)
    }

    fn i32(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<i32>) -> Self {
        self.values::<_, Int32Array>(name, nullable, f)
    }

    fn bool(self, name: &str, nullable: bool, f: impl Fn(&'a R) -> Option<bool>) -> Self {
        self.values::<_, BooleanArray>(name, nullable, f)
    }

    fn schema(&self) -> SchemaRef {
        Arc::new(Schema::new(self.fields.clone()))
    }

    fn batches(self) -> Result<Vec<RecordBatch>, String> {
        RecordBatch::try_new(self.schema(), self.arrays)
            .map(|b| vec![b])
            .map_err(|e| e.to_string())
    }
}

/// Telemetry up to this time is in a job's accounting: the earliest checkpoint of its
/// allocations still being folded; once every one is final (ended and folded to its end), the
/// latest end. An allocation that ended earlier and is final does not hold it back: a
/// requeued job's first attempt, folded whole, says nothing of how far the running one is.
fn accounted_until(job: &JobRecord) -> Option<i64> {
    job.allocations
        .iter()
        .filter(|a| !a.is_final())
        .map(|a| a.folded_end_ms())
        .min()
        .or_else(|| job.allocations.iter().map(|a| a.folded_end_ms()).max())
}

/// `jobs`: sacct's fields plus what sacct cannot tell.
#[derive(Debug)]
pub struct JobsTable {
    jobs: JobService,
    config: Arc<AccountingConfig>,
}

/// What the `jobs` table shows of a record: only that is copied under the control lock (a
/// whole record, command, environment and timeline, cost ten times as much).
struct JobRow {
    id: u64,
    name: Option<String>,
    user: String,
    account: String,
    queue: Option<String>,
    qos: Option<String>,
    state: &'static str,
    exit_code: Option<i32>,
    reason: Option<String>,
    submit_ms: i64,
    start_ms: Option<i64>,
    end_ms: Option<i64>,
    node_count: u32,
    gpus_per_node: u32,
    attempts: u32,
    preemptions: u32,
    requeues: u32,
    time_limit_secs: u64,
    accounted_until: Option<i64>,
    simulated: bool,
    totals: Totals,
    elapsed_seconds: Option<f64>,
    nodes: String,
    gpu_model: Option<String>,
    gpu_profile: Option<String>,
    gpu_fraction: Option<f64>,
}

fn job_row(j: &JobRecord, prices: &Prices, now: i64) -> JobRow {
    let r = &j.request;
    JobRow {
        id: j.id,
        name: r.name.clone(),
        user: r.user().to_owned(),
        account: r.account().to_owned(),
        queue: r.queue.clone(),
        qos: r.qos.clone(),
        state: j.state.as_str(),
        exit_code: j.exit_code,
        reason: j.reason.clone(),
        submit_ms: j.submit_ms,
        start_ms: j.start_ms,
        end_ms: j.end_ms,
        node_count: r.nodes,
        gpus_per_node: r.gpus_per_node,
        attempts: j.attempts,
        preemptions: j.preemptions,
        requeues: j.requeues,
        time_limit_secs: r.time_limit_secs,
        accounted_until: accounted_until(j),
        simulated: j.allocations.iter().any(|a| a.simulated),
        totals: job_totals(j, now, prices),
        elapsed_seconds: j
            .start_ms
            .map(|s| (j.end_ms.unwrap_or(now) - s).max(0) as f64 / 1000.0),
        nodes: j.node_list(),
        gpu_model: j
            .allocations
            .last()
            .map(|a| a.gpu_model.clone())
            .or_else(|| r.gpu_model.clone()),
        gpu_profile: r.gpu_profile.clone(),
        gpu_fraction: r.gpu_share.as_ref().map(|s| s.fraction),
    }
}

impl JobsTable {
    fn columns(rows: &[JobRow]) -> Columns<'_, JobRow> {
        Columns::new(rows)
            .u64("job", false, |r| Some(r.id))
            .str("name", true, |r| r.name.as_deref())
            .str("user_name", false, |r| Some(r.user.as_str()))
            .str("account", false, |r| Some(r.account.as_str()))
            .str("queue", true, |r| r.queue.as_deref())
            .str("qos", false, |r| Some(r.qos.as_deref().unwrap_or("normal")))
            .str("state", false, |r| Some(r.state))
            .i32("exit_code", true, |r| r.exit_code)
            .str("reason", true, |r| r.reason.as_deref())
            .time("submit_time", false, |r| Some(r.submit_ms))
            .time("start_time", true, |r| r.start_ms)
            .time("end_time", true, |r| r.end_ms)
            .f64("elapsed_seconds", true, |r| r.elapsed_seconds)
            .str("nodes", false, |r| Some(r.nodes.as_str()))
            .u32("node_count", false, |r| Some(r.node_count))
            .u32("gpus", false, |r| {
                Some(r.node_count.saturating_mul(r.gpus_per_node))
            })
            .str("gpu_model", true, |r| r.gpu_model.as_deref())
            .str("gpu_profile", true, |r| r.gpu_profile.as_deref())
            .f64("gpu_fraction", true, |r| r.gpu_fraction)
            .u32("attempts", false, |r| Some(r.attempts))
            .u32("preemptions", false, |r| Some(r.preemptions))
            .u32("requeues", false, |r| Some(r.requeues))
            .u64("time_limit_seconds", false, |r| Some(r.time_limit_secs))
            .f64("gpu_seconds_allocated", false, |r| Some(r.totals.allocated))
            .f64("gpu_seconds_accounted", true, |r| r.totals.accounted)
            .f64("gpu_seconds_used", true, |r| r.totals.used)
            .f64("utilization_mean_pct", true, |r| r.totals.mean_pct())
            .f64("utilization_peak_pct", true, |r| r.totals.peak)
            .u64("memory_peak_bytes", true, |r| r.totals.memory)
            .f64("energy_joules", true, |r| r.totals.energy)
            .f64("cost_allocated", false, |r| Some(r.totals.cost_allocated))
            .f64("cost_used", true, |r| r.totals.cost_used)
            .f64("cost_accounted", true, |r| r.totals.cost_accounted)
            .f64("idle_cost", true, |r| r.totals.idle_cost())
            .time("accounted_until", true, |r| r.accounted_until)
            .bool("simulated", false, |r| Some(r.simulated))
    }
}

/// Job `j`'s row of the `jobs` table as JSON (the one definition, without a scan of every
/// job: `GET /v1/jobs/{id}` ran `SELECT ... FROM jobs WHERE job = N`, which read the whole
/// history, settled jobs' records from the job database, for one row).
pub(crate) fn job_json(
    j: &JobRecord,
    config: &AccountingConfig,
    now: i64,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let rows = [job_row(j, &config.prices, now)];
    let batches = JobsTable::columns(&rows).batches()?;
    let mut buf = Vec::new();
    {
        let mut writer = arrow::json::WriterBuilder::new()
            .with_explicit_nulls(true)
            .build::<_, arrow::json::writer::JsonArray>(&mut buf);
        for batch in &batches {
            writer.write(batch).map_err(|e| e.to_string())?;
        }
        writer.finish().map_err(|e| e.to_string())?;
    }
    let rows: Vec<serde_json::Map<String, serde_json::Value>> =
        serde_json::from_slice(&buf).map_err(|e| e.to_string())?;
    rows.into_iter()
        .next()
        .ok_or_else(|| "no row for the job".to_owned())
}

impl LiveTable for JobsTable {
    fn schema(&self) -> SchemaRef {
        jobs_schema()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        Room::unlimited(|room| self.snapshot_of(None, room))
    }

    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
        room: &mut Room<'_>,
    ) -> Result<Vec<RecordBatch>, String> {
        let (now, prices) = (self.jobs.now_ms(), &self.config.prices);
        let schema = projected(&self.schema(), projection)?;
        history_rows(
            &self.jobs,
            projection,
            room,
            |j, rows| rows.push(job_row(j, prices, now)),
            |view, room| view.jobs(prices, &schema, room),
            |rows| Self::columns(rows).batches(),
        )
    }
}

/// A table of the job history (`jobs`, `job_allocations`): `rows` of the jobs the walk
/// visits ([`JobService::accounting`]), made into `batches`, after `settled`'s rows of the
/// rest read from the settled rows' files; the columns at `projection`, each batch counted in
/// `room` as it is made.
fn history_rows<R>(
    jobs: &JobService,
    projection: Option<&[usize]>,
    room: &mut Room<'_>,
    mut rows: impl FnMut(&JobRecord, &mut Vec<R>),
    mut settled: impl FnMut(&View, &mut Room<'_>) -> Result<Vec<RecordBatch>, Unread>,
    batches: impl Fn(&[R]) -> Result<Vec<RecordBatch>, String>,
) -> Result<Vec<RecordBatch>, String> {
    // The job ids the query's filters can keep: jobs held in memory outside them are not
    // made into rows at all.
    let ids = room.pruning().and_then(|p| p.range_u64("job"));
    let (made, mut out) = jobs
        .accounting_of(
            ids,
            |(made, _): &mut (Vec<R>, Vec<RecordBatch>), j| rows(j, made),
            |(_, out), view| {
                *out = settled(view, room)?;
                Ok(())
            },
        )
        .map_err(|e| e.to_string())?;
    out.extend(room.keep(project(batches(&made)?, projection)?)?);
    Ok(out)
}

/// `schema`'s columns at `projection` (all if `None`).
fn projected(schema: &SchemaRef, projection: Option<&[usize]>) -> Result<SchemaRef, String> {
    match projection {
        None => Ok(schema.clone()),
        Some(p) => schema.project(p).map(Arc::new).map_err(|e| e.to_string()),
    }
}

/// The columns of a table that hold prices: settled rows are stored without them
/// ([`super::settled`]) and priced when read.
pub(crate) const PRICED: [&str; 4] = ["cost_allocated", "cost_used", "cost_accounted", "idle_cost"];

/// `batch` less its priced columns.
fn unpriced(batch: &RecordBatch) -> Result<RecordBatch, String> {
    let keep: Vec<usize> = (0..batch.num_columns())
        .filter(|&i| !PRICED.contains(&batch.schema().field(i).name().as_str()))
        .collect();
    batch.project(&keep).map_err(|e| e.to_string())
}

/// The `jobs` table's columns, priced ones included.
pub(crate) fn jobs_schema() -> SchemaRef {
    static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| JobsTable::columns(&[]).schema());
    SCHEMA.clone()
}

/// The `job_allocations` table's columns, priced ones included.
pub(crate) fn allocations_schema() -> SchemaRef {
    static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| AllocationsTable::columns(&[]).schema());
    SCHEMA.clone()
}

/// The schema of settled `jobs` rows as stored.
pub(crate) fn stored_jobs_schema() -> SchemaRef {
    static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
        let empty = JobsTable::columns(&[]).batches().expect("an empty batch");
        unpriced(&empty[0]).expect("project").schema()
    });
    SCHEMA.clone()
}

/// The schema of settled `job_allocations` rows as stored.
pub(crate) fn stored_allocations_schema() -> SchemaRef {
    static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
        let empty = AllocationsTable::columns(&[])
            .batches()
            .expect("an empty batch");
        unpriced(&empty[0]).expect("project").schema()
    });
    SCHEMA.clone()
}

/// The `jobs` and `job_allocations` rows of settled jobs `records`, unpriced: what
/// [`settled`] stores.
pub(crate) fn stored_batches(records: &[JobRecord]) -> Result<(RecordBatch, RecordBatch), String> {
    let prices = Prices::default();
    let mut jobs = Vec::with_capacity(records.len());
    let mut allocations = Vec::new();
    for j in records {
        // Settled: ended, every allocation too, so `now` changes nothing; their end it is.
        let now = j.end_ms.unwrap_or(j.submit_ms);
        jobs.push(job_row(j, &prices, now));
        allocation_rows(j, &prices, now, &mut allocations);
    }
    let jobs = JobsTable::columns(&jobs).batches()?;
    let allocations = AllocationsTable::columns(&allocations).batches()?;
    Ok((unpriced(&jobs[0])?, unpriced(&allocations[0])?))
}

/// `job_allocations`: one row per GPU per allocation (attempt and node) of every job.
#[derive(Debug)]
pub struct AllocationsTable {
    jobs: JobService,
    config: Arc<AccountingConfig>,
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

impl AllocationsTable {
    fn columns(rows: &[AllocRow]) -> Columns<'_, AllocRow> {
        Columns::new(rows)
            .u64("job", false, |a| Some(a.job))
            .u32("attempt", false, |a| Some(a.attempt))
            .str("user_name", false, |a| Some(a.user.as_str()))
            .str("account", false, |a| Some(a.account.as_str()))
            .str("node", false, |a| Some(a.node.as_str()))
            .u32("gpu", false, |a| Some(a.gpu))
            .str("gpu_model", false, |a| Some(a.model.as_str()))
            .time("start_time", false, |a| Some(a.start))
            .time("end_time", true, |a| a.end)
            .f64("gpu_seconds_allocated", false, |a| {
                Some(a.f.allocated_seconds)
            })
            .f64("gpu_seconds_accounted", true, |a| a.f.accounted_seconds)
            .f64("gpu_seconds_used", true, |a| a.f.used_seconds)
            .f64("utilization_mean_pct", true, |a| {
                match (a.f.used_seconds, a.f.accounted_seconds) {
                    (Some(u), Some(s)) if s > 0.0 => Some(100.0 * u / s),
                    _ => None,
                }
            })
            .f64("utilization_peak_pct", true, |a| a.f.util_peak_pct)
            .u64("memory_peak_bytes", true, |a| a.f.memory_peak_bytes)
            .f64("energy_joules", true, |a| a.f.energy_joules)
            .u64("samples", false, |a| Some(a.f.samples))
            .f64("cost_allocated", false, |a| Some(a.f.cost_allocated))
            .f64("cost_used", true, |a| a.f.cost_used)
            .f64("cost_accounted", true, |a| a.f.cost_accounted)
            .f64("idle_cost", true, |a| a.f.idle_cost())
            .time("accounted_until", false, |a| Some(a.accounted_until))
            .bool("simulated", false, |a| Some(a.simulated))
    }
}

/// Job `j`'s rows of `job_allocations` at `now`, onto `rows`.
fn allocation_rows(j: &JobRecord, prices: &Prices, now: i64, rows: &mut Vec<AllocRow>) {
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

impl LiveTable for AllocationsTable {
    fn schema(&self) -> SchemaRef {
        allocations_schema()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        Room::unlimited(|room| self.snapshot_of(None, room))
    }

    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
        room: &mut Room<'_>,
    ) -> Result<Vec<RecordBatch>, String> {
        let (now, prices) = (self.jobs.now_ms(), &self.config.prices);
        let schema = projected(&self.schema(), projection)?;
        history_rows(
            &self.jobs,
            projection,
            room,
            |j, rows| allocation_rows(j, prices, now, rows),
            |view, room| view.allocations(prices, &schema, room),
            |rows| Self::columns(rows).batches(),
        )
    }
}

/// `nodes`: every node the control plane knows, as it is now.
#[derive(Debug)]
pub struct NodesTable {
    jobs: JobService,
}

/// A row of `nodes`: the node, its state, when it was last seen, and why it is not up.
type NodeRow = (NodeRecord, NodeState, i64, Option<String>);

impl NodesTable {
    fn columns(rows: &[NodeRow]) -> Columns<'_, NodeRow> {
        Columns::new(rows)
            .str("node", false, |n| Some(n.0.name.as_str()))
            .str("state", false, |n| Some(n.1.as_str()))
            .u32("gpus", false, |n| Some(n.0.gpus))
            .str("gpu_model", false, |n| Some(n.0.model.as_str()))
            .str("rack", false, |n| Some(n.0.rack.as_str()))
            .time("last_seen", false, |n| Some(n.2))
            .str("reason", true, |n| n.3.as_deref())
            .str("drained_by", true, |n| {
                n.0.drained.then_some(n.0.drained_by.as_deref()).flatten()
            })
            .bool("simulated", false, |n| Some(n.0.simulated))
    }
}

impl LiveTable for NodesTable {
    fn schema(&self) -> SchemaRef {
        static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| NodesTable::columns(&[]).schema());
        SCHEMA.clone()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let now = self.jobs.now_ms();
        let rows: Vec<NodeRow> = self
            .jobs
            .read_durable(|c| {
                c.node_records()
                    .map(|(n, state, last)| {
                        let reason = match state {
                            NodeState::Up => None,
                            NodeState::Down => Some(format!(
                                "its agent has not synced for {} s",
                                (now - last).max(0) / 1000
                            )),
                            NodeState::Drained => {
                                Some(n.drain_reason.clone().unwrap_or_else(|| {
                                    format!(
                                        "drained by {}",
                                        n.drained_by.as_deref().unwrap_or("an operator")
                                    )
                                }))
                            }
                        };
                        (n.clone(), state, last, reason)
                    })
                    .collect()
            })
            .map_err(|e| e.to_string())?;
        Self::columns(&rows).batches()
    }
}

/// `node_states`: the history of every node's state, one row per stretch.
#[derive(Debug)]
pub struct NodeStatesTable {
    jobs: JobService,
}

impl NodeStatesTable {
    fn columns(spans: &[NodeSpan]) -> Columns<'_, NodeSpan> {
        Columns::new(spans)
            .str("node", false, |s| Some(s.node.as_str()))
            .str("state", false, |s| Some(s.state.as_str()))
            .u32("gpus", false, |s| Some(s.gpus))
            .time("start_time", false, |s| Some(s.start_ms))
            .time("end_time", true, |s| s.end_ms)
    }
}

impl LiveTable for NodeStatesTable {
    fn schema(&self) -> SchemaRef {
        static SCHEMA: LazyLock<SchemaRef> =
            LazyLock::new(|| NodeStatesTable::columns(&[]).schema());
        SCHEMA.clone()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let spans: Vec<NodeSpan> = self
            .jobs
            .read_durable(|c| c.node_spans().cloned().collect())
            .map_err(|e| e.to_string())?;
        Self::columns(&spans).batches()
    }
}

/// `node_validations`: the validation runs kept by the control plane (the latest 10,000
/// since the server started; `events` keeps every run), those in progress last.
#[derive(Debug)]
pub struct NodeValidationsTable {
    jobs: JobService,
}

impl NodeValidationsTable {
    fn columns(runs: &[Run]) -> Columns<'_, Run> {
        Columns::new(runs)
            .u64("id", false, |r| Some(r.id))
            .str("node", false, |r| Some(r.node.as_str()))
            .str("trigger", false, |r| Some(r.trigger.as_str()))
            .str("requested_by", false, |r| Some(r.by.as_str()))
            .str("command", false, |r| Some(r.command.as_str()))
            .time("started", false, |r| Some(r.started_ms))
            .time("finished", true, |r| r.finished_ms)
            .str("result", true, |r| r.verdict.map(|v| v.as_str()))
            .i32("exit_code", true, |r| r.exit_code)
            .str("output", false, |r| Some(r.output.as_str()))
    }
}

impl LiveTable for NodeValidationsTable {
    fn schema(&self) -> SchemaRef {
        static SCHEMA: LazyLock<SchemaRef> =
            LazyLock::new(|| NodeValidationsTable::columns(&[]).schema());
        SCHEMA.clone()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let runs: Vec<Run> = self
            .jobs
            .read_durable(|c| c.validation_runs())
            .map_err(|e| e.to_string())?;
        Self::columns(&runs).batches()
    }
}

/// `cluster_utilization_daily`: sreport's cluster utilization, per UTC day.
#[derive(Debug)]
pub struct DailyTable {
    jobs: JobService,
    config: Arc<AccountingConfig>,
}

impl DailyTable {
    fn columns(days: &[daily::Day]) -> Columns<'_, daily::Day> {
        let hours = |ms: i64| Some(ms as f64 / 3.6e6);
        Columns::new(days)
            .time("day", false, |d| Some(d.start_ms))
            .f64("capacity_gpu_hours", false, move |d| hours(d.capacity_ms))
            .f64("allocated_gpu_hours", false, move |d| hours(d.allocated_ms))
            .f64("accounted_gpu_hours", false, |d| {
                Some(d.accounted_seconds / 3600.0)
            })
            .f64("used_gpu_hours", false, |d| Some(d.used_seconds / 3600.0))
            .f64("idle_gpu_hours", false, move |d| hours(d.idle_ms))
            .f64("drained_gpu_hours", false, move |d| hours(d.drained_ms))
            .f64("down_gpu_hours", false, move |d| hours(d.down_ms))
            .f64("allocated_pct", true, |d| {
                (d.capacity_ms > 0).then(|| 100.0 * d.allocated_ms as f64 / d.capacity_ms as f64)
            })
    }
}

/// The days of the control plane's history at `now`: node spans under one hold of the
/// control lock, allocations a chunk at a time ([`JobService::accounting`]), the days
/// themselves worked out with the lock let go.
pub(crate) fn days(
    jobs: &JobService,
    config: &AccountingConfig,
    now: i64,
    room: &mut Room<'_>,
) -> Result<Vec<daily::Day>, String> {
    let node_spans: Vec<perch_control::record::NodeSpan> = jobs
        .read_durable(|c| c.node_spans().cloned().collect())
        .map_err(|e| e.to_string())?;
    let spans: Vec<Span<'_>> = node_spans
        .iter()
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
    let columns = [
        "node",
        "gpu",
        "start_time",
        "end_time",
        "gpu_seconds_used",
        "accounted_until",
    ];
    // Each GPU held, with its node's name owned (the records are not held on to).
    let owned: Vec<(String, Held<'static>)> = jobs
        .accounting(
            |owned: &mut Vec<_>, j| {
                for a in &j.allocations {
                    for (g, &gpu) in a.gpus.iter().enumerate() {
                        let held = Held {
                            node: "",
                            gpu,
                            start_ms: a.start_ms,
                            end_ms: a.end_ms,
                            used_seconds: gpu_figures(a, g, now, &config.prices).used_seconds,
                            used_until_ms: a.folded_end_ms(),
                        };
                        owned.push((a.node.clone(), held));
                    }
                }
            },
            |owned, settled| {
                settled.allocation_columns(&columns, room, |batch| {
                    let [node, gpu, start, end, used, until] =
                        columns.map(|name| batch.column_by_name(name).expect("projected").clone());
                    let node: StringArray = downcast_array(node.as_ref());
                    let gpu: UInt32Array = downcast_array(gpu.as_ref());
                    let [start, end, until]: [TimestampMillisecondArray; 3] =
                        [start, end, until].map(|c| downcast_array(c.as_ref()));
                    let used: Float64Array = downcast_array(used.as_ref());
                    for i in 0..batch.num_rows() {
                        let held = Held {
                            node: "",
                            gpu: gpu.value(i),
                            start_ms: start.value(i),
                            end_ms: end.is_valid(i).then(|| end.value(i)),
                            used_seconds: used.is_valid(i).then(|| used.value(i)),
                            used_until_ms: until.value(i),
                        };
                        owned.push((node.value(i).to_owned(), held));
                    }
                })
            },
        )
        .map_err(|e| e.to_string())?;
    let held: Vec<Held<'_>> = owned
        .iter()
        .map(|(node, h)| Held { node, ..h.clone() })
        .collect();
    Ok(daily::daily(&spans, &held, now, daily::DAY_MS))
}

impl LiveTable for DailyTable {
    fn schema(&self) -> SchemaRef {
        static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| DailyTable::columns(&[]).schema());
        SCHEMA.clone()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        Room::unlimited(|room| self.snapshot_of(None, room))
    }

    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
        room: &mut Room<'_>,
    ) -> Result<Vec<RecordBatch>, String> {
        let now = self.jobs.now_ms();
        let days = days(&self.jobs, &self.config, now, room)?;
        room.keep(project(Self::columns(&days).batches()?, projection)?)
    }
}

/// Per-job cost, OpenCost's split: by allocation (to now), and within the accounted window
/// (up to `accounted_until`) by allocation, by use, and the idle difference, with the
/// efficiency of that same window.
const JOB_COSTS: &str =
    "SELECT job, name, user_name, account, state, gpu_model, start_time, end_time,
  gpu_seconds_allocated / 3600 AS gpu_hours_allocated,
  gpu_seconds_accounted / 3600 AS gpu_hours_accounted,
  gpu_seconds_used / 3600 AS gpu_hours_used,
  gpu_seconds_used / nullif(gpu_seconds_accounted, 0) AS efficiency,
  energy_joules / 3600000 AS energy_kwh,
  cost_allocated, cost_accounted, cost_used, idle_cost, accounted_until, simulated
FROM jobs WHERE attempts > 0";

/// The sums the per-user and per-account views share: allocated to now; the rest within each
/// job's accounted window, so efficiency and idle cost compare like with like.
/// `accounted_until` is the earliest of the jobs still being folded (NULL when none is).
const SUMS: &str = "count(*) AS jobs,
  sum(gpu_seconds_allocated) / 3600 AS gpu_hours_allocated,
  sum(gpu_seconds_accounted) / 3600 AS gpu_hours_accounted,
  sum(gpu_seconds_used) / 3600 AS gpu_hours_used,
  sum(gpu_seconds_used) / nullif(sum(gpu_seconds_accounted), 0) AS efficiency,
  sum(cost_allocated) AS cost_allocated,
  sum(cost_accounted) AS cost_accounted,
  sum(cost_used) AS cost_used,
  CASE WHEN sum(cost_accounted) < sum(cost_used) THEN 0.0
    ELSE sum(cost_accounted) - sum(cost_used) END AS idle_cost,
  min(accounted_until) FILTER (WHERE end_time IS NULL OR accounted_until < end_time) AS accounted_until";

/// `job_provenance`: what each job ran, one row per job (its latest node report's
/// environment and versions), read from the job store at each query. Private: a user who is
/// not an operator sees only rows of their own jobs ([`perch_query::Caller`]).
#[derive(Debug)]
pub struct ProvenanceTable {
    jobs: JobService,
}

impl ProvenanceTable {
    fn columns(rows: &[ProvenanceRecord]) -> Columns<'_, ProvenanceRecord> {
        fn git(r: &ProvenanceRecord) -> Option<&GitProvenance> {
            r.submit.as_ref()?.git.as_ref()
        }
        fn container(r: &ProvenanceRecord) -> Option<&ContainerProvenance> {
            r.submit.as_ref()?.container.as_ref()
        }
        fn python(r: &ProvenanceRecord) -> Option<&PythonProvenance> {
            r.submit.as_ref()?.python.as_ref()
        }
        fn last(r: &ProvenanceRecord) -> Option<&RunProvenance> {
            r.runs.last()
        }
        Columns::new(rows)
            .u64("job", false, |r| Some(r.job))
            .str("user_name", false, |r| Some(r.user.as_str()))
            .time("submit_time", false, |r| Some(r.submit_ms))
            .str("submit_dir", true, |r| {
                r.submit.as_ref()?.submit_dir.as_deref()
            })
            .str("submit_host", true, |r| {
                r.submit.as_ref()?.submit_host.as_deref()
            })
            .str("git_root", true, |r| git(r).map(|g| g.root.as_str()))
            .str("git_commit", true, |r| git(r).map(|g| g.commit.as_str()))
            .str("git_branch", true, |r| git(r)?.branch.as_deref())
            .bool("git_dirty", true, |r| git(r).map(|g| g.dirty))
            .str("git_diff", true, |r| {
                git(r).filter(|g| g.dirty).map(|g| g.diff.as_str())
            })
            .u64("git_diff_bytes", true, |r| git(r).map(|g| g.diff_bytes))
            .bool("git_diff_truncated", true, |r| {
                git(r).map(|g| g.diff_truncated)
            })
            .u32("untracked_files", true, |r| {
                git(r).map(|g| g.untracked.len() as u32)
            })
            .str("container_runtime", true, |r| {
                container(r).map(|c| c.runtime.as_str())
            })
            .str("image", true, |r| container(r).map(|c| c.image.as_str()))
            .str("image_digest", true, |r| container(r)?.digest.as_deref())
            .str("python_version", true, |r| python(r)?.version.as_deref())
            .str("python_packages", true, |r| {
                python(r).map(|p| p.packages.as_str())
            })
            .u64("rerun_of", true, |r| r.submit.as_ref()?.rerun_of)
            .u32("runs", false, |r| Some(r.runs.len() as u32))
            .u32("last_attempt", true, |r| last(r).map(|x| x.attempt))
            .str("last_node", true, |r| last(r).map(|x| x.node.as_str()))
            .time("last_start_time", true, |r| last(r).map(|x| x.start_ms))
            .str("driver_version", true, |r| {
                last(r)?.driver_version.as_deref()
            })
            .str("cuda_version", true, |r| last(r)?.cuda_version.as_deref())
            .bool("simulated", true, |r| last(r).map(|x| x.simulated))
    }
}

/// The one JSON text of a run's environment, for the `environment` column.
fn env_json(r: &ProvenanceRecord) -> Option<String> {
    r.runs
        .last()
        .and_then(|x| serde_json::to_string(&x.env).ok())
}

impl LiveTable for ProvenanceTable {
    fn schema(&self) -> SchemaRef {
        static SCHEMA: LazyLock<SchemaRef> =
            LazyLock::new(|| ProvenanceTable::table(&[], &[]).schema());
        SCHEMA.clone()
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        Room::unlimited(|room| self.snapshot_of(None, room))
    }

    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
        room: &mut Room<'_>,
    ) -> Result<Vec<RecordBatch>, String> {
        let ids = room
            .pruning()
            .and_then(|p| p.range_u64("job"))
            .map_or(0..=u64::MAX, |(a, b)| a..=b);
        // A user's query sees that user's rows; perch's own and operators' see every row.
        let only = room
            .caller()
            .filter(|c| !c.operator)
            .map(|c| c.user.clone());
        let mut out = Vec::new();
        let mut rows = Vec::new();
        let mut failed = None;
        self.jobs
            .jobs()
            .for_each_provenance(ids, only.as_deref(), &mut |r| {
                rows.push(r);
                if rows.len() < 1024 {
                    return true;
                }
                let envs: Vec<Option<String>> = rows.iter().map(env_json).collect();
                match Self::table(&rows, &envs)
                    .batches()
                    .and_then(|b| project(b, projection))
                    .and_then(|b| room.keep(b))
                {
                    Ok(b) => out.extend(b),
                    Err(e) => failed = Some(e),
                }
                rows.clear();
                failed.is_none()
            })
            .map_err(|e| e.to_string())?;
        if let Some(e) = failed {
            return Err(e);
        }
        let envs: Vec<Option<String>> = rows.iter().map(env_json).collect();
        out.extend(room.keep(project(Self::table(&rows, &envs).batches()?, projection)?)?);
        Ok(out)
    }
}

impl ProvenanceTable {
    /// [`ProvenanceTable::columns`] with the `environment` column (a JSON object) after them.
    fn table<'a>(
        rows: &'a [ProvenanceRecord],
        envs: &'a [Option<String>],
    ) -> Columns<'a, ProvenanceRecord> {
        let array: StringArray = envs.iter().map(|e| e.as_deref()).collect();
        Self::columns(rows).push("environment", true, Arc::new(array))
    }
}

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
        "node_validations",
        Arc::new(NodeValidationsTable { jobs: jobs.clone() }),
    )
    .with_table(
        "cluster_utilization_daily",
        Arc::new(DailyTable {
            jobs: jobs.clone(),
            config,
        }),
    )
    .with_table(
        "job_provenance",
        Arc::new(ProvenanceTable { jobs: jobs.clone() }),
    )
    .with_view("job_costs", JOB_COSTS)
    .with_view("user_usage", &user_usage)
    .with_view(
        "top_users",
        "SELECT * FROM user_usage ORDER BY gpu_hours_allocated DESC, user_name LIMIT 10",
    )
    .with_view("account_usage", &account_usage)
    .with_view("job_stragglers", &super::stragglers::view())
}
