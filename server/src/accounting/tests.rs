//! Accounting through the real control plane, store and SQL engine, on virtual time: a job
//! runs on a node whose telemetry is ingested with chosen timestamps, folds run at chosen
//! instants, and the answers are compared with the definition computed by hand from the
//! samples. One job crosses midnight and has its first day's raw samples dropped by retention
//! between two folds.

use super::history::History;
use super::*;
use perch_control::JobsConfig;
use perch_model::Batch;
use perch_model::control::SyncRequest;
use perch_query::{QueryLimits, Room, StoreConfig, Table};
use serde_json::json;

/// Every column of every accounting table and view is documented in docs/schema.md under its
/// heading (the stored tables are checked by the query crate).
#[tokio::test]
async fn schema_doc_covers_every_accounting_column() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = crate::AppState::open(crate::ServerConfig::new(StoreConfig::new(dir.path())))
        .expect("open");
    state.sql.check_views().await.expect("every view plans");
    let doc = include_str!("../../../docs/schema.md");
    let names = state.sql.table_names();
    for name in [
        "jobs",
        "job_allocations",
        "nodes",
        "node_states",
        "node_validations",
        "cluster_utilization_daily",
        "job_costs",
        "user_usage",
        "top_users",
        "account_usage",
        "job_stragglers",
        "job_provenance",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} is registered");
        let heading = format!("## `{name}`");
        let start = doc
            .find(&heading)
            .unwrap_or_else(|| panic!("docs/schema.md lacks {heading}"));
        let section = &doc[start + heading.len()..];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        let schema = state
            .sql
            .describe(&format!("SELECT * FROM {name}"))
            .await
            .expect("describe");
        for field in schema.fields() {
            let row = format!("| `{}` |", field.name());
            assert!(
                section.contains(&row),
                "docs/schema.md: {name} lacks a row for {}",
                field.name()
            );
        }
    }
}

#[test]
fn a_shared_gpu_is_allocated_its_fraction_and_its_use_is_unknown() {
    let mut a =
        perch_control::record::Allocation::new(1, "n".into(), vec![0], "H100".into(), 0, false);
    a.end_ms = Some(3_600_000);
    a.folded_until_ms = 3_600_000;
    a.usage[0].merge(&GpuUsage {
        samples: 10,
        util_samples: 10,
        util_sum: 800.0,
        util_max: Some(90.0),
        ..GpuUsage::default()
    });
    let prices = Prices::default();
    let whole = gpu_figures(&a, 0, 0, &prices);
    assert_eq!(whole.allocated_seconds, 3600.0);
    assert_eq!(whole.used_seconds, Some(2880.0));
    a.share_percent = Some(25);
    let shared = gpu_figures(&a, 0, 0, &prices);
    assert_eq!(shared.allocated_seconds, 900.0);
    assert_eq!(
        shared.used_seconds, None,
        "the GPU's use cannot be split among its jobs"
    );
    assert_eq!(shared.util_peak_pct, None);
    assert!((shared.cost_allocated - 0.25 * 0.95).abs() < 1e-12);
}

const HOUR: i64 = 3_600_000;
/// 2025-06-01 22:00 UTC: the job runs three hours, across midnight.
const T0: i64 = 1_748_815_200_000;
const NODE: &str = "gpu-a";

struct Harness {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    jobs: History,
    sql: SqlEngine,
    events: tokio::sync::mpsc::UnboundedReceiver<Vec<ClusterEvent>>,
    seq: u64,
}

impl Harness {
    fn open(dir: tempfile::TempDir) -> Harness {
        Harness::open_with(dir, JobsConfig::default(), AccountingConfig::default())
    }

    fn open_with(
        dir: tempfile::TempDir,
        jobs_config: JobsConfig,
        accounting: AccountingConfig,
    ) -> Harness {
        let mut config = StoreConfig::new(dir.path());
        config
            .retention
            .insert(Table::GpuSamples, Duration::from_secs(3600));
        let store = Store::open(config).expect("store");
        let (tx, events) = JobService::event_channel();
        let jobs = History::open(&dir.path().join("control"), None, jobs_config, tx).expect("jobs");
        let sql = tables::register(
            SqlEngine::new(store.clone(), QueryLimits::default()),
            &jobs,
            accounting,
        );
        Harness {
            _dir: dir,
            store,
            jobs,
            sql,
            events,
            seq: 0,
        }
    }

    async fn sync(&self, at: i64, running: &[u64], exited: &[u64]) {
        let req: SyncRequest = serde_json::from_value(json!({
            "node": NODE, "gpus": 2, "gpu_model": "Test H100",
            "running": running.iter().map(|j| json!({"job": j, "attempt": 1})).collect::<Vec<_>>(),
            "exited": exited.iter().map(|j| json!({"job": j, "attempt": 1, "code": 0})).collect::<Vec<_>>(),
        }))
        .expect("sync request");
        self.jobs
            .run(move |c, _| c.sync(req, at))
            .await
            .expect("sync");
    }

    async fn ingest(&mut self, samples: &[Sample]) {
        self.seq += 1;
        let gpus: Vec<_> = samples
            .iter()
            .map(|s| {
                json!({"time_ms": s.time, "gpu": s.gpu, "uuid": format!("GPU-T-{}", s.gpu),
                    "model": "Test H100", "simulated": false, "utilization_gpu_pct": s.util,
                    "memory_used_bytes": s.memory, "energy_joules": s.energy,
                    "power_watts": s.power})
            })
            .collect();
        let body = serde_json::to_vec(&json!({"node": NODE, "seq": self.seq, "gpus": gpus}))
            .expect("json");
        let batch: Batch = serde_json::from_slice(&body).expect("batch");
        self.store
            .ingest(bytes::Bytes::from(body), &batch)
            .await
            .expect("ingest");
    }

    async fn fold(&self, until: i64) -> usize {
        fold_once(&self.jobs, &self.sql, until, until)
            .await
            .expect("fold")
    }

    async fn row(&self, query: &str) -> serde_json::Value {
        let out = self.sql.query(query).await.expect("query");
        let mut w = arrow::json::ArrayWriter::new(Vec::new());
        for b in &out.batches {
            w.write(b).expect("write");
        }
        w.finish().expect("finish");
        let rows: serde_json::Value = serde_json::from_slice(&w.into_inner()).unwrap_or(json!([]));
        rows[0].clone()
    }

    /// Drops everything but the data directory (the store and the job database close).
    fn close(self) -> tempfile::TempDir {
        self._dir
    }

    fn events(&mut self) -> Vec<ClusterEvent> {
        let mut out = Vec::new();
        while let Ok(batch) = self.events.try_recv() {
            out.extend(batch);
        }
        out
    }
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    time: i64,
    gpu: u32,
    util: Option<f64>,
    memory: u64,
    energy: f64,
    power: f64,
}

/// A sample every 10 s on both GPUs from a minute before `T0` to 3.5 h after it; GPU 0
/// (the job's) busy in a varying way, GPU 1 idle. The energy counter of GPU 0 rises with
/// its power; some samples miss utilization.
fn samples() -> Vec<Sample> {
    let mut out = Vec::new();
    let mut energy = 5.0e6;
    let mut t = T0 - 60_000;
    let mut i = 0u64;
    while t < T0 + 3 * HOUR + HOUR / 2 {
        let util = (!i.is_multiple_of(13)).then(|| ((i * 37) % 101) as f64);
        let power = 100.0 + util.unwrap_or(0.0) * 3.0;
        energy += power * 10.0;
        out.push(Sample {
            time: t,
            gpu: 0,
            util,
            memory: 1_000_000_000 + (i * 7919) % 50_000_000_000,
            energy,
            power,
        });
        out.push(Sample {
            time: t,
            gpu: 1,
            util: Some(0.0),
            memory: 0,
            energy: 1.0e6,
            power: 60.0,
        });
        t += 10_000;
        i += 1;
    }
    out
}

/// The definition, computed from the samples of GPU 0 in [from, to).
fn expected(all: &[Sample], from: i64, to: i64) -> (f64, f64, f64, u64, f64) {
    let s: Vec<&Sample> = all
        .iter()
        .filter(|s| s.gpu == 0 && s.time >= from && s.time < to)
        .collect();
    let utils: Vec<f64> = s.iter().filter_map(|s| s.util).collect();
    let mean = utils.iter().sum::<f64>() / utils.len() as f64;
    let seconds = (to - from) as f64 / 1000.0;
    let peak = utils.iter().copied().fold(f64::MIN, f64::max);
    let memory = s.iter().map(|s| s.memory).max().unwrap_or(0);
    // The counter's rise between its first and last reading, plus the mean power over the
    // part of the window those readings do not span.
    let rise = s.iter().map(|s| s.energy).fold(f64::MIN, f64::max)
        - s.iter().map(|s| s.energy).fold(f64::MAX, f64::min);
    let span = (s.iter().map(|s| s.time).max().unwrap_or(0)
        - s.iter().map(|s| s.time).min().unwrap_or(0)) as f64
        / 1000.0;
    let power = s.iter().map(|s| s.power).sum::<f64>() / s.len() as f64;
    let energy = rise + power * (seconds - span);
    (seconds * mean / 100.0, mean, peak, memory, energy)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[tokio::test]
async fn a_job_across_midnight_and_retention_accounts_exactly() {
    let mut h = Harness::open(tempfile::tempdir().expect("tempdir"));
    let all = samples();
    h.sync(T0 - 1000, &[], &[]).await;
    let request: perch_control::spec::JobRequest = serde_json::from_value(json!({
        "command": ["train"], "user": "alice", "account": "vision", "name": "train",
        "time_limit_secs": 36_000
    }))
    .expect("request");
    let records = h
        .jobs
        .run(move |c, _| c.submit(request, T0))
        .await
        .expect("submit");
    let id = records[0].id;
    assert_eq!(
        records[0].allocations.len(),
        1,
        "started at once: {records:?}"
    );
    h.sync(T0 + 1000, &[], &[]).await; // the launch is delivered
    for chunk in all.chunks(100) {
        h.ingest(chunk).await;
    }
    // First fold: the first hour only.
    assert_eq!(h.fold(T0 + HOUR).await, 1);
    // Second fold to 00:30 the next day, then day one's raw samples are flushed and dropped.
    h.sync(T0 + 2 * HOUR, &[id], &[]).await;
    assert_eq!(h.fold(T0 + 2 * HOUR + HOUR / 2).await, 1);
    h.store.flush().await.expect("flush");
    let stats = h
        .store
        .maintain(T0 + 3 * HOUR + HOUR / 2)
        .await
        .expect("maintain");
    assert!(stats.files_expired > 0, "{stats:?}");
    let day_one = format!(
        "SELECT count(*) AS n FROM gpu_samples WHERE time < to_timestamp_millis({})",
        T0 + 2 * HOUR
    );
    assert_eq!(
        h.row(&day_one).await["n"],
        0,
        "day one's raw samples are gone"
    );
    // The job ends at 01:00; the last fold covers 00:30 to 01:00.
    let end = T0 + 3 * HOUR;
    h.sync(end, &[], &[id]).await;
    assert_eq!(h.fold(end + 120_000).await, 1);
    assert_eq!(h.fold(end + 999_000).await, 0, "nothing left to fold");

    let (used, mean, peak, memory, energy) = expected(&all, T0, end);
    let j = h
        .row(&format!(
            "SELECT state, gpu_seconds_allocated, gpu_seconds_accounted, gpu_seconds_used, utilization_mean_pct, utilization_peak_pct, memory_peak_bytes, energy_joules, cost_allocated, cost_used, accounted_until, end_time, simulated FROM jobs WHERE job = {id}"
        ))
        .await;
    assert_eq!(j["state"], "completed", "{j}");
    assert_eq!(j["gpu_seconds_allocated"], 10_800.0);
    assert_eq!(j["gpu_seconds_accounted"], 10_800.0);
    let f = |k: &str| j[k].as_f64().unwrap_or(f64::NAN);
    assert!(close(f("gpu_seconds_used"), used), "{j} vs {used}");
    assert!(close(f("utilization_mean_pct"), mean), "{j} vs {mean}");
    assert_eq!(f("utilization_peak_pct"), peak);
    assert_eq!(j["memory_peak_bytes"], memory);
    assert!(close(f("energy_joules"), energy), "{j} vs {energy}");
    assert!(close(f("cost_allocated"), 3.0 * 0.95), "{j}");
    assert!(close(f("cost_used"), used / 3600.0 * 0.95), "{j}");
    assert_eq!(j["accounted_until"], j["end_time"]);
    assert_eq!(j["simulated"], false);

    // Cluster utilization: the node joined at 21:59:59, so day one has 2 GPUs x 2 h + 1 s.
    let d = h
        .row("SELECT * FROM cluster_utilization_daily ORDER BY day LIMIT 1")
        .await;
    let g = |k: &str| d[k].as_f64().unwrap_or(f64::NAN);
    assert!(
        close(g("capacity_gpu_hours"), 2.0 * (2.0 + 1.0 / 3600.0)),
        "{d}"
    );
    assert!(close(g("allocated_gpu_hours"), 2.0), "{d}");
    assert!(close(
        g("allocated_gpu_hours")
            + g("idle_gpu_hours")
            + g("drained_gpu_hours")
            + g("down_gpu_hours"),
        g("capacity_gpu_hours")
    ));
    let (used_day_one, ..) = expected(&all, T0, T0 + 2 * HOUR);
    // Used GPU-hours are spread over the folded time in proportion, so a day gets its share
    // of the job's mean, not its own samples' mean.
    assert!(
        close(g("used_gpu_hours"), used / 3.0 * 2.0 / 3600.0),
        "{d} vs {used_day_one}"
    );

    let a = h.row("SELECT account, user_name, jobs, gpu_hours_allocated, efficiency, idle_cost FROM account_usage").await;
    assert_eq!(a["account"], "vision");
    assert_eq!(a["user_name"], "alice");
    assert_eq!(a["jobs"], 1);
    assert!(
        close(
            a["efficiency"].as_f64().unwrap_or(f64::NAN),
            used / 10_800.0
        ),
        "{a}"
    );
    assert!(
        close(
            a["idle_cost"].as_f64().unwrap_or(f64::NAN),
            (10_800.0 - used) / 3600.0 * 0.95
        ),
        "{a}"
    );

    let kinds: Vec<(String, Option<String>)> = h
        .events()
        .into_iter()
        .map(|e| (e.kind, e.outcome))
        .collect();
    for want in [
        ("node_joined", None),
        ("job_submitted", None),
        ("job_started", None),
        ("job_ended", Some("completed")),
    ] {
        assert!(
            kinds
                .iter()
                .any(|(k, o)| k == want.0 && o.as_deref() == want.1),
            "{want:?} in {kinds:?}"
        );
    }

    // A restarted server has the same books.
    let before = h.row(&format!("SELECT * FROM jobs WHERE job = {id}")).await;
    let h = Harness::open(h.close());
    let after = h.row(&format!("SELECT * FROM jobs WHERE job = {id}")).await;
    assert_eq!(before, after);
}

#[tokio::test]
async fn node_states_and_events_follow_drain_down_and_requeue() {
    let mut h = Harness::open(tempfile::tempdir().expect("tempdir"));
    h.sync(T0, &[], &[]).await;
    let request: perch_control::spec::JobRequest = serde_json::from_value(json!({
        "command": ["train"], "user": "bob", "max_requeues": 1, "gpus_per_node": 2
    }))
    .expect("request");
    let id = h
        .jobs
        .run(move |c, _| c.submit(request, T0 + 1000))
        .await
        .expect("submit")[0]
        .id;
    h.sync(T0 + 2000, &[], &[]).await;
    h.jobs
        .run(|c, _| c.set_drained(NODE, true, "carol", Some("fan noise".into()), T0 + 60_000))
        .await
        .expect("drain");
    let n = h.row("SELECT state, reason, drained_by FROM nodes").await;
    assert_eq!(
        n,
        json!({"state": "drained", "reason": "fan noise", "drained_by": "carol"})
    );
    // The agent goes silent: after the heartbeat timeout the node is down, and once its lease
    // has run out the job is requeued.
    h.sync(T0 + 70_000, &[id], &[]).await;
    h.jobs
        .run(|c, _| c.tick(T0 + 70_000 + 31_000))
        .await
        .expect("tick");
    let j = h
        .row(&format!("SELECT state FROM jobs WHERE job = {id}"))
        .await;
    assert_eq!(j["state"], "running", "its lease has not run out");
    h.jobs
        .run(|c, _| c.tick(T0 + 70_000 + 301_000))
        .await
        .expect("tick");
    let j = h
        .row(&format!(
            "SELECT state, requeues, gpu_seconds_allocated FROM jobs WHERE job = {id}"
        ))
        .await;
    assert_eq!(j["state"], "pending");
    assert_eq!(j["requeues"], 1);
    assert_eq!(
        j["gpu_seconds_allocated"],
        2.0 * 370.0,
        "two GPUs from +1 s to +371 s (the lease ran out)"
    );
    h.sync(T0 + 400_000, &[], &[]).await;
    let states = h
        .row("SELECT string_agg(state, ',' ORDER BY start_time) AS s, count(*) FILTER (WHERE end_time IS NULL) AS open FROM node_states")
        .await;
    assert_eq!(states, json!({"s": "up,drained,down,drained", "open": 1}));
    let events: Vec<String> = h
        .events()
        .into_iter()
        .map(|e| format!("{}:{}", e.kind, e.actor))
        .collect();
    for want in [
        "node_drained:carol",
        "node_down:perch",
        "job_requeued:perch",
        "node_up:perch",
    ] {
        assert!(events.iter().any(|e| e == want), "{want} in {events:?}");
    }
    h.jobs
        .run(move |c, _| c.cancel(id, "bob", T0 + 300_000))
        .await
        .expect("cancel");
    let ended = h.events();
    assert!(
        ended.iter().any(|e| e.kind == "job_ended"
            && e.actor == "bob"
            && e.outcome.as_deref() == Some("cancelled")),
        "{ended:?}"
    );
}

/// The `jobs` and `job_allocations` tables and `/metrics`' usage read the history a chunk at
/// a time ([`perch_control::SCAN_CHUNK`]), letting the control lock go between chunks: across
/// chunks every job is still in them exactly once, each with its own figures.
#[tokio::test]
async fn the_history_is_read_a_chunk_at_a_time_and_every_job_is_in_it_once() {
    let h = Harness::open(tempfile::tempdir().expect("tempdir"));
    let n = perch_control::SCAN_CHUNK as u64 * 2 + 5;
    h.sync(T0, &[], &[]).await;
    for (user, count) in [("alice", n - 3), ("bob", 3)] {
        let request: perch_control::spec::JobRequest = serde_json::from_value(
            json!({ "command": ["x"], "user": user, "array": count, "time_limit_secs": 7200 }),
        )
        .expect("request");
        h.jobs
            .run(move |c, _| c.submit(request, T0))
            .await
            .expect("submit");
    }
    // Jobs 1 and 2 get the node's two GPUs and run an hour.
    h.sync(T0, &[], &[]).await;
    h.sync(T0 + HOUR, &[], &[1, 2]).await;
    let row = h
        .row(
            "SELECT count(*) AS n, count(DISTINCT job) AS d, min(job) AS lo, max(job) AS hi, \
              sum(CASE WHEN state = 'completed' THEN 1 ELSE 0 END) AS done FROM jobs",
        )
        .await;
    assert_eq!(row, json!({ "n": n, "d": n, "lo": 1, "hi": n, "done": 2 }));
    // Two of bob's (fair share puts them first, in the last chunk) took the GPUs next and
    // still run.
    let row = h
        .row(
            "SELECT count(*) AS n, sum(CASE WHEN job <= 2 THEN gpu_seconds_allocated END) AS s \
              FROM job_allocations",
        )
        .await;
    assert_eq!(row, json!({ "n": 4, "s": 7200.0 }));
    let usage = h.jobs.usage(&crate::accounting::Prices::default());
    let users: Vec<(&str, bool)> = usage
        .iter()
        .map(|u| (u.user.as_str(), u.gpu_seconds_allocated >= 7200.0))
        .collect();
    assert_eq!(users, vec![("alice", true), ("bob", true)]);
}

/// Settled jobs' rows, once in the settled rows' files, answer SQL as their records did:
/// every accounting table and view, the same after a restart, and again after an interrupted
/// write (half a pair of files), whose jobs are read from the job database and recorded
/// anew; costs follow the prices of the moment, not those of the write. Queries running
/// while files are removed, damaged and written again answer as before, each of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_rows_answer_sql_as_the_records_did() {
    use crate::clock::Clock;
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = Clock::manual(T0);
    let prices = |gpu_hour: f64| Prices {
        gpu_per_hour: [("Test H100".to_owned(), gpu_hour)].into(),
        energy_per_kwh: 0.3,
        ..Prices::default()
    };
    let open = |prices: Prices| {
        let store = Store::open(StoreConfig::new(dir.path())).expect("store");
        let (tx, _events) = JobService::event_channel();
        let config = JobsConfig {
            clock: clock.clone(),
            ..JobsConfig::default()
        };
        let jobs = History::open(&dir.path().join("control"), None, config, tx).expect("jobs");
        let accounting = AccountingConfig {
            prices,
            ..AccountingConfig::default()
        };
        let sql = tables::register(
            SqlEngine::new(store, QueryLimits::default()),
            &jobs,
            accounting,
        );
        (jobs, sql)
    };
    let answers = |sql: SqlEngine| async move {
        let mut out = Vec::new();
        for query in [
            "SELECT * FROM jobs ORDER BY job",
            "SELECT count(*) AS n, count(DISTINCT job) AS d FROM jobs",
            "SELECT * FROM job_allocations ORDER BY job, attempt, node, gpu",
            "SELECT * FROM cluster_utilization_daily ORDER BY day",
            "SELECT * FROM job_costs ORDER BY job",
            "SELECT * FROM account_usage ORDER BY account, user_name",
            // Fewer columns than the table's: only those are read.
            "SELECT count(*) AS n FROM jobs",
            "SELECT sum(cost_allocated) AS a, sum(cost_used) AS u FROM jobs",
            "SELECT job, gpu, cost_used FROM job_allocations ORDER BY job, gpu",
            // Filters, judged as each table's rows are made (and again by the query), on
            // stored columns, priced ones and a qualified name.
            "SELECT job, state FROM jobs WHERE user_name = 'bob' ORDER BY job",
            "SELECT j.job FROM jobs AS j WHERE j.job IN (1, 3) OR j.state = 'failed' ORDER BY 1",
            "SELECT job, gpu FROM job_allocations WHERE cost_allocated > 1 AND gpu = 1 ORDER BY job",
            "SELECT day, allocated_pct FROM cluster_utilization_daily WHERE allocated_pct > 0",
            // Filters the files' statistics judge (a literal of another type, NULLs, a range,
            // a join's side, a subquery) and one they cannot (a cast, a volatile function).
            "SELECT count(*) AS n FROM jobs WHERE job = -1 OR job > 18446744073709551615",
            "SELECT count(*) AS n FROM jobs WHERE NOT (job > 2) OR end_time IS NULL",
            "SELECT count(*) AS n FROM job_allocations WHERE end_time IS NOT NULL AND gpu BETWEEN 0 AND 1",
            "SELECT j.job, a.gpu FROM jobs j JOIN job_allocations a ON a.job = j.job WHERE j.job < 3 AND a.gpu = 1 ORDER BY 1",
            "SELECT count(*) AS n FROM jobs WHERE job IN (SELECT job FROM job_allocations WHERE gpu = 1)",
            "SELECT count(*) AS n FROM jobs WHERE job::VARCHAR LIKE '2%' AND random() < 2",
            // A range of job ids: jobs outside it are not made into rows at all.
            "SELECT job, state FROM jobs WHERE job BETWEEN 2 AND 3 AND user_name <> '' ORDER BY job",
            "SELECT job, gpu FROM job_allocations WHERE 3 <= job ORDER BY job, gpu",
            "SELECT count(*) AS n FROM jobs WHERE job > 2 AND job < 2",
        ] {
            let result = sql.query(query).await.expect("query");
            let mut w = arrow::json::ArrayWriter::new(Vec::new());
            for b in &result.batches {
                w.write(b).expect("write");
            }
            w.finish().expect("finish");
            out.push(String::from_utf8(w.into_inner()).expect("utf-8"));
        }
        out
    };
    let (jobs, sql) = open(prices(2.5));
    let sync = |at: i64, exited: Vec<(u64, i32)>| {
        let req: SyncRequest = serde_json::from_value(json!({
            "node": NODE, "gpus": 2, "gpu_model": "Test H100", "running": [],
            "exited": exited.iter().map(|(j, c)| json!({"job": j, "attempt": 1, "code": c})).collect::<Vec<_>>(),
        }))
        .expect("sync request");
        let jobs = jobs.clone();
        async move { jobs.run(move |c, _| c.sync(req, at)).await.expect("sync") }
    };
    sync(T0, vec![]).await;
    let submit = |user: &str, account: &str, gpus: u32| {
        let request: perch_control::spec::JobRequest = serde_json::from_value(json!({
            "command": ["x"], "user": user, "account": account, "gpus_per_node": gpus,
            "time_limit_secs": 7200,
        }))
        .expect("request");
        let jobs = jobs.clone();
        async move {
            jobs.run(move |c, _| c.submit(request, T0))
                .await
                .expect("submit")[0]
                .id
        }
    };
    let (one, failed) = (
        submit("alice", "nlp", 1).await,
        submit("alice", "nlp", 1).await,
    );
    let (two, never) = (
        submit("bob", "vision", 2).await,
        submit("bob", "vision", 2).await,
    );
    jobs.run(move |c, now| c.cancel(never, "bob", now).map(|_| ()))
        .await
        .expect("cancel");
    sync(T0 + 1000, vec![]).await;
    sync(T0 + HOUR, vec![(one, 0), (failed, 1)]).await;
    sync(T0 + 2 * HOUR, vec![(two, 0)]).await;
    let usage = GpuUsage {
        samples: 5,
        util_samples: 5,
        util_sum: 400.0,
        util_max: Some(90.0),
        memory_max_bytes: Some(1 << 30),
        energy_min_joules: Some(10.0),
        energy_max_joules: Some(510_000.0),
        power_samples: 5,
        power_sum_watts: 1000.0,
        ..GpuUsage::default()
    };
    let until = T0 + 3 * HOUR;
    jobs.fold_all(until, usage).await;
    clock.set(until + 11 * 60 * 1000);
    let held = answers(sql.clone()).await;
    assert!(held[0].contains("\"state\":\"failed\""), "{}", held[0]);
    assert!(held[1].contains("\"n\":4,\"d\":4"), "{}", held[1]);
    // A walk bounded to ids 2 to 3 visits those two of the four held in memory.
    let bounded = |jobs: &History, ids| {
        jobs.accounting_of(ids, |n: &mut Vec<u64>, j| n.push(j.id), |_, _| Ok(()))
            .expect("scan")
    };
    assert_eq!(bounded(&jobs, Some((2, 3))), [2, 3]);
    assert_eq!(bounded(&jobs, Some((3, 2))), Vec::<u64>::new());
    assert_eq!(bounded(&jobs, None), [1, 2, 3, 4]);
    // Out of memory (read from the job database), then recorded (read from the files).
    jobs.tick().await.expect("tick");
    jobs.tick().await.expect("tick");
    assert_eq!(
        bounded(&jobs, Some((2, 3))),
        [2, 3],
        "read from the job database"
    );
    assert_eq!(jobs.read(|c| c.settled_count()), 4);
    assert_eq!(
        answers(sql.clone()).await,
        held,
        "read from the job database"
    );
    assert_eq!(jobs.record_settled().expect("record"), 4);
    assert_eq!(jobs.record_settled().expect("record"), 0, "each job once");
    let walked = |jobs: &History| {
        jobs.accounting(|n: &mut usize, _| *n += 1, |_, _| Ok(()))
            .expect("scan")
    };
    assert_eq!(
        walked(&jobs),
        0,
        "no record read back for SQL once recorded"
    );
    // The files hold them all now; the walk over memory and the job database visits none.
    // Before they were written, one bounded to ids 2 to 3 visited those two alone (below).
    assert_eq!(
        answers(sql.clone()).await,
        held,
        "read from the settled rows"
    );
    // A query with no room in its memory for the rows is refused with the limit's message;
    // the files are not taken for lost.
    let tight = tables::register(
        SqlEngine::new(
            Store::open(StoreConfig::new(dir.path().join("tight"))).expect("store"),
            QueryLimits {
                memory_bytes: 1024,
                ..QueryLimits::default()
            },
        ),
        &jobs,
        AccountingConfig::default(),
    );
    for query in [
        "SELECT * FROM jobs",
        "SELECT * FROM job_allocations",
        "SELECT * FROM cluster_utilization_daily",
    ] {
        let err = tight.query(query).await.expect_err(query);
        assert!(
            matches!(err, perch_query::Error::ResourcesExhausted { .. }),
            "{query}: {err:?}"
        );
    }
    // The rows a filter rejects are dropped as they are made: a query that keeps none of
    // them answers within the same 1 KiB.
    for query in [
        "SELECT * FROM jobs WHERE user_name = 'nobody'",
        "SELECT * FROM job_allocations WHERE job > 1000000",
    ] {
        let result = tight.query(query).await.expect(query);
        assert_eq!(result.rows, 0, "{query}");
    }
    assert_eq!(walked(&jobs), 0, "the files are still read");
    drop(tight);
    drop((jobs, sql));
    let (jobs, sql) = open(prices(2.5));
    assert_eq!(jobs.record_settled().expect("record"), 0, "found at start");
    assert_eq!(answers(sql.clone()).await, held, "after a restart");
    // Files removed under the running server (an operator's cleanup), then one damaged: the
    // query that finds it answers from the job database, as do those after it, until the
    // files are written again.
    let settled = dir.path().join("control/settled");
    let files = |suffix: &str| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&settled)
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.to_string_lossy().ends_with(suffix))
            .collect()
    };
    for path in files(".parquet") {
        std::fs::remove_file(path).expect("remove");
    }
    assert_eq!(answers(sql.clone()).await, held, "files removed");
    assert_eq!(walked(&jobs), 4, "read from the job database meanwhile");
    assert_eq!(jobs.record_settled().expect("record"), 4, "written again");
    assert_eq!(walked(&jobs), 0);
    assert_eq!(
        answers(sql.clone()).await,
        held,
        "from the files written again"
    );
    // The files deleted and every job marked unwritten after a query's walk took them as
    // written: the query walks again (the four settled jobs, from the job database) rather
    // than open the new, empty files and miss them all.
    assert_eq!(jobs.accounting_across_a_start_over().expect("scan"), 4);
    assert_eq!(jobs.record_settled().expect("record"), 4, "written again");
    for path in files(".allocations.parquet") {
        std::fs::write(path, b"damaged").expect("damage");
    }
    assert_eq!(answers(sql.clone()).await, held, "a file damaged");
    assert_eq!(jobs.record_settled().expect("record"), 4, "written again");
    assert_eq!(answers(sql.clone()).await, held);
    assert_eq!(files(".parquet").len(), 2, "the damaged pair deleted");
    // The same while queries run: two loops of the nine queries, each answer compared, while
    // the files are removed, then damaged, and written again under them (the epoch moves
    // under a query's walk; a query reads a pair a rewrite deletes).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loops: Vec<_> = (0..2)
        .map(|_| {
            let (sql, held, stop) = (sql.clone(), held.clone(), stop.clone());
            tokio::spawn(async move {
                let mut asked = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    assert_eq!(answers(sql.clone()).await, held, "while attacked");
                    asked += 1;
                }
                asked
            })
        })
        .collect();
    for round in 0..6 {
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        for path in files(".parquet") {
            if round % 2 == 0 {
                std::fs::remove_file(path).expect("remove");
            } else {
                std::fs::write(path, b"damaged").expect("damage");
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        let writer = jobs.clone();
        tokio::task::spawn_blocking(move || writer.record_settled())
            .await
            .expect("task")
            .expect("record");
    }
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for asked in loops {
        assert!(asked.await.expect("a query loop") > 0);
    }
    assert_eq!(
        jobs.record_settled().expect("record"),
        0,
        "all written again"
    );
    assert_eq!(walked(&jobs), 0);
    drop((jobs, sql));
    // Files another version wrote (other columns): deleted at start, written again.
    let (jobs_file, allocations_file) = (files(".jobs.parquet"), files(".allocations.parquet"));
    std::fs::copy(&jobs_file[0], &allocations_file[0]).expect("copy");
    let (jobs, sql) = open(prices(2.5));
    assert_eq!(files(".parquet").len(), 0, "not today's columns");
    assert_eq!(answers(sql.clone()).await, held);
    assert_eq!(jobs.record_settled().expect("record"), 4, "written again");
    drop((jobs, sql));
    // An interrupted write: the jobs file without its allocations.
    for entry in std::fs::read_dir(&settled).expect("dir") {
        let path = entry.expect("entry").path();
        if path.to_string_lossy().ends_with(".allocations.parquet") {
            std::fs::remove_file(path).expect("remove");
        }
    }
    let (jobs, sql) = open(prices(4.0));
    let repriced = answers(sql.clone()).await;
    assert_ne!(
        repriced[0], held[0],
        "costs follow the prices of the moment"
    );
    assert_eq!(repriced[1], held[1]);
    assert_ne!(repriced[2], held[2], "allocations' costs too");
    assert_eq!(repriced[3], held[3]);
    assert_eq!(repriced[6], held[6]);
    assert_ne!(repriced[7..], held[7..]);
    assert_eq!(jobs.record_settled().expect("record"), 4, "recorded anew");
    assert_eq!(answers(sql.clone()).await, repriced, "priced when read");
    drop((jobs, sql));
    // The files beside a job database that has not run those jobs (one restored from an
    // older copy, here an empty one): not shown as jobs, deleted at start.
    let other = tempfile::tempdir().expect("tempdir");
    let copied = other.path().join("control/settled");
    std::fs::create_dir_all(&copied).expect("dir");
    for path in files(".parquet") {
        std::fs::copy(&path, copied.join(path.file_name().expect("name"))).expect("copy");
    }
    let (tx, _events) = JobService::event_channel();
    let fresh = History::open(
        &other.path().join("control"),
        None,
        JobsConfig::default(),
        tx,
    )
    .expect("jobs");
    assert_eq!(
        std::fs::read_dir(&copied).expect("dir").count(),
        0,
        "another database's rows deleted"
    );
    assert_eq!(
        fresh
            .accounting(
                |n: &mut usize, _| *n += 1,
                |n, view| {
                    let mut unlimited = |_| Ok(());
                    view.allocation_columns(&[], &mut Room::new(&mut unlimited), |b| {
                        *n += b.num_rows()
                    })
                }
            )
            .expect("scan"),
        0
    );
}

/// No answer of SQL's live tables or `/metrics`' snapshot shows a change that a crash could
/// still lose: a job submitted and a node registered by another request, changed in memory
/// and queued, are durable before the answer that shows them returns.
#[tokio::test]
async fn live_tables_and_metrics_show_only_durable_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("store");
    let (tx, _events) = JobService::event_channel();
    let jobs =
        History::open(&dir.path().join("control"), None, JobsConfig::default(), tx).expect("jobs");
    let sql = tables::register(
        SqlEngine::new(store, QueryLimits::default()),
        &jobs,
        AccountingConfig::default(),
    );
    let count = |sql: SqlEngine, query: &'static str| async move {
        let out = sql.query(query).await.expect(query);
        let column = out.batches[0].column(0).clone();
        arrow::array::downcast_array::<arrow::array::Int64Array>(column.as_ref()).value(0)
    };
    let request: perch_control::spec::JobRequest =
        serde_json::from_value(json!({"command": ["x"], "user": "alice"})).expect("request");
    let now = jobs.now_ms();
    for (query, change) in [
        (
            "SELECT count(*) FROM jobs",
            Box::new(move |c: &mut perch_control::control::Control| {
                c.submit(request, now).expect("submit");
            }) as Box<dyn FnOnce(&mut perch_control::control::Control)>,
        ),
        (
            "SELECT count(*) FROM nodes",
            Box::new(move |c: &mut perch_control::control::Control| {
                let req: SyncRequest = serde_json::from_value(
                    json!({"node": NODE, "gpus": 2, "gpu_model": "Test H100", "running": []}),
                )
                .expect("sync");
                c.sync(req, now).expect("sync");
            }),
        ),
    ] {
        let seq = jobs.change_uncommitted(change);
        assert!(!jobs.durable(seq));
        assert_eq!(count(sql.clone(), query).await, 1, "{query}");
        assert!(jobs.durable(seq), "{query} showed a change not yet durable");
    }
    let sync = move |node: String| {
        move |c: &mut perch_control::control::Control| {
            let req: SyncRequest = serde_json::from_value(
                json!({"node": node, "gpus": 1, "gpu_model": "Test H100", "running": []}),
            )
            .expect("sync");
            c.sync(req, now).expect("sync");
        }
    };
    for (i, query) in [
        "SELECT count(*) FROM job_allocations",
        "SELECT count(*) FROM node_states",
        "SELECT count(*) FROM cluster_utilization_daily",
    ]
    .into_iter()
    .enumerate()
    {
        let seq = jobs.change_uncommitted(sync(format!("n{i}")));
        let _ = count(sql.clone(), query).await;
        assert!(jobs.durable(seq), "{query} read a change not yet durable");
    }
    let seq = jobs.change_uncommitted(sync("other".into()));
    let snapshot = jobs.snapshot().expect("snapshot");
    assert_eq!(snapshot.nodes.len(), 5);
    assert!(
        jobs.durable(seq),
        "/metrics showed a change not yet durable"
    );
}

/// Within `tolerance` of each other (relative, or absolute near 0).
fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// What the agent of `NODE` says at `at`: the job's open allocation there runs, or has exited
/// with 0 when `exit`; nothing when `silent`.
async fn agent_sync(h: &Harness, at: i64, id: u64, exit: bool) {
    let open = h.jobs.read(|c| {
        c.record(id).ok().flatten().and_then(|j| {
            j.allocations
                .last()
                .filter(|a| a.end_ms.is_none())
                .map(|a| a.attempt)
        })
    });
    let (running, exited) = match open {
        Some(attempt) if exit => (
            vec![],
            vec![json!({"job": id, "attempt": attempt, "code": 0})],
        ),
        Some(attempt) => (vec![json!({"job": id, "attempt": attempt})], vec![]),
        None => (vec![], vec![]),
    };
    let req: SyncRequest = serde_json::from_value(json!({
        "node": NODE, "gpus": 2, "gpu_model": "Test H100",
        "running": running, "exited": exited,
    }))
    .expect("sync request");
    h.jobs.run(move |c, _| c.sync(req, at)).await.expect("sync");
}

/// A job queried every 10 s of virtual time from its start to its end, through a requeue (two
/// allocations of two GPUs each) and with folds on the server's schedule (every 5 min, samples
/// 2 min old): at every moment efficiency, idle cost and the hours beside them agree, in
/// `jobs`, `job_allocations`, `job_costs`, `account_usage` and `GET /v1/jobs/{id}`'s row. Used
/// is measured against the accounted window, never against the allocation to now; once the job
/// is complete every figure equals the allocation totals.
#[tokio::test]
async fn figures_agree_at_every_moment_of_a_jobs_life() {
    use crate::clock::Clock;
    const SETTLE: i64 = 120_000;
    const FOLD_EVERY: i64 = 300_000;
    let clock = Clock::manual(T0 - 10_000);
    let price = 2.0;
    let accounting = AccountingConfig {
        prices: Prices {
            gpu_per_hour: [("Test H100".to_owned(), price)].into(),
            energy_per_kwh: 0.3,
            ..Prices::default()
        },
        ..AccountingConfig::default()
    };
    let mut h = Harness::open_with(
        tempfile::tempdir().expect("tempdir"),
        JobsConfig {
            clock: clock.clone(),
            ..JobsConfig::default()
        },
        accounting.clone(),
    );
    // Every figure is declared a float where it is one (a CASE mixing an integer 0 with a
    // float was declared Int64, and clients reading the declared type printed its bits).
    for view in ["job_costs", "account_usage", "user_usage", "top_users"] {
        let schema = h
            .sql
            .describe(&format!("SELECT * FROM {view}"))
            .await
            .expect("describe");
        for column in [
            "efficiency",
            "cost_accounted",
            "idle_cost",
            "gpu_hours_accounted",
        ] {
            assert_eq!(
                schema
                    .field_with_name(column)
                    .map(|f| f.data_type().clone())
                    .ok(),
                Some(arrow::datatypes::DataType::Float64),
                "{view}.{column}"
            );
        }
    }
    h.sync(T0 - 10_000, &[], &[]).await;
    let request: perch_control::spec::JobRequest = serde_json::from_value(json!({
        "command": ["train"], "user": "alice", "account": "vision", "gpus_per_node": 2,
        "max_requeues": 1, "time_limit_secs": 36_000
    }))
    .expect("request");
    let id = h
        .jobs
        .run(move |c, _| c.submit(request, T0))
        .await
        .expect("submit")[0]
        .id;
    // The agent is silent from 20 min to 26 min (its node goes down and the job is requeued),
    // then the job runs again and exits at 45 min.
    let (silent, back, exit_at) = (T0 + 20 * 60_000, T0 + 26 * 60_000, T0 + 45 * 60_000);
    let mut energy = [1.0e6, 2.0e6];
    let mut checked = 0;
    let mut complete_at = None;
    let mut t = T0;
    while complete_at.is_none_or(|c: i64| t <= c + 60_000) {
        assert!(t < T0 + 2 * HOUR, "the job never completed its accounting");
        clock.set(t);
        let step = (t - T0) / 10_000;
        // Telemetry: GPU 0's utilization varies, GPU 1 runs at 30 %; power follows.
        let util0 = ((step * 37) % 101) as f64;
        let samples: Vec<Sample> = [(0, util0), (1, 30.0)]
            .into_iter()
            .map(|(gpu, util)| {
                let power = 80.0 + 5.0 * util;
                energy[gpu as usize] += power * 10.0;
                Sample {
                    time: t,
                    gpu,
                    util: Some(util),
                    memory: 1 << 30,
                    energy: energy[gpu as usize],
                    power,
                }
            })
            .collect();
        h.ingest(&samples).await;
        if !(silent..back).contains(&t) {
            agent_sync(&h, t, id, t == exit_at).await;
        }
        h.jobs.run(move |c, _| c.tick(t)).await.expect("tick");
        let record = h
            .jobs
            .read(|c| c.record(id).ok().flatten().map(|r| r.into_owned()))
            .expect("the job");
        let settled_end = record
            .end_ms
            .is_some_and(|e| t >= e + SETTLE && !record.allocations.iter().all(|a| a.is_final()));
        if (t - T0) % FOLD_EVERY == 0 || settled_end {
            h.fold(t - SETTLE).await;
        }
        let record = h
            .jobs
            .read(|c| c.record(id).ok().flatten().map(|r| r.into_owned()))
            .expect("the job");

        let j = h
            .row(&format!(
                "SELECT j.*, c.gpu_hours_allocated, c.gpu_hours_accounted, c.gpu_hours_used, \
                 c.efficiency, c.idle_cost AS view_idle_cost, c.cost_accounted AS view_cost_accounted, \
                 CAST(j.accounted_until AS BIGINT) AS accounted_until_ms \
                 FROM jobs j JOIN job_costs c ON c.job = j.job WHERE j.job = {id}"
            ))
            .await;
        let f = |k: &str| j[k].as_f64();
        let at = format!("at +{} s: {j}", (t - T0) / 1000);
        let allocated = f("gpu_seconds_allocated").expect("allocated");
        let cost_allocated = f("cost_allocated").expect("cost allocated");
        // Allocated to now: every allocation's GPUs x time held.
        let held: f64 = record
            .allocations
            .iter()
            .map(|a| a.held_ms(t) as f64 / 1000.0 * a.gpus.len() as f64)
            .sum();
        assert!(near(allocated, held), "{at}");
        match (f("gpu_seconds_accounted"), f("gpu_seconds_used")) {
            (Some(accounted), Some(used)) => {
                // The accounted window: each allocation from its start to its checkpoint.
                let window: f64 = record
                    .allocations
                    .iter()
                    .map(|a| a.folded_ms() as f64 / 1000.0 * a.gpus.len() as f64)
                    .sum();
                assert!(near(accounted, window), "{at}");
                assert!(accounted <= allocated + 1e-9, "{at}");
                assert!(used >= 0.0 && used <= accounted + 1e-9, "{at}");
                let efficiency = f("efficiency").expect("efficiency");
                assert!((0.0..=1.0).contains(&efficiency), "{at}");
                assert!(near(efficiency, used / accounted), "{at}");
                assert!(near(
                    f("utilization_mean_pct").expect("mean"),
                    100.0 * efficiency
                ));
                let energy_cost = f("energy_joules").unwrap_or(0.0) / 3.6e6 * 0.3;
                let cost_accounted = f("cost_accounted").expect("cost accounted");
                let cost_used = f("cost_used").expect("cost used");
                let idle = f("idle_cost").expect("idle cost");
                assert!(
                    near(cost_accounted, accounted / 3600.0 * price + energy_cost),
                    "{at}"
                );
                assert!(cost_accounted <= cost_allocated + 1e-9, "{at}");
                assert!(idle >= 0.0, "{at}");
                assert!(near(idle, cost_accounted - cost_used), "{at}");
                assert!(near(idle, (accounted - used) / 3600.0 * price), "{at}");
                assert!(near(f("view_idle_cost").expect("view"), idle), "{at}");
                assert!(near(
                    f("view_cost_accounted").expect("view"),
                    cost_accounted
                ));
                assert!(near(
                    f("gpu_hours_accounted").expect("hours") * 3600.0,
                    accounted
                ));
                // The account's view, of this one job, says the same.
                let a = h
                    .row("SELECT * FROM account_usage WHERE account = 'vision'")
                    .await;
                let g = |k: &str| a[k].as_f64().unwrap_or(f64::NAN);
                assert!(
                    near(g("gpu_hours_accounted") * 3600.0, accounted),
                    "{at} {a}"
                );
                assert!(near(g("efficiency"), efficiency), "{at} {a}");
                assert!(near(g("idle_cost"), idle), "{at} {a}");
                assert!(near(g("cost_accounted"), cost_accounted), "{at} {a}");
                // The days' accounted and used GPU-hours add up to the job's (its only job).
                let d = h
                    .row(
                        "SELECT sum(accounted_gpu_hours) AS a, sum(used_gpu_hours) AS u \
                         FROM cluster_utilization_daily",
                    )
                    .await;
                assert!(
                    near(d["a"].as_f64().unwrap_or(f64::NAN) * 3600.0, accounted),
                    "{at} {d}"
                );
                assert!(
                    near(d["u"].as_f64().unwrap_or(f64::NAN) * 3600.0, used),
                    "{at} {d}"
                );
                // `/metrics`' counters for the account agree, idle cost included.
                let metrics = h.jobs.usage(&accounting.prices);
                let m = metrics
                    .iter()
                    .find(|u| u.account == "vision")
                    .expect("usage");
                assert!(near(m.gpu_seconds_accounted, accounted), "{at} {m:?}");
                assert!(near(m.gpu_seconds_used, used), "{at} {m:?}");
                assert!(near(m.cost_accounted, cost_accounted), "{at} {m:?}");
                assert!(near(m.cost_idle(), idle), "{at} {m:?}");
                // GET /v1/jobs/{id}'s usage is the same row.
                let usage = tables::job_json(&record, &accounting, t).expect("row");
                for k in [
                    "gpu_seconds_accounted",
                    "cost_accounted",
                    "idle_cost",
                    "cost_used",
                ] {
                    assert_eq!(usage[k], j[k], "{k} {at}");
                }
                // Per GPU, the same rules; the GPUs add up to the job.
                let rows = h
                    .sql
                    .query(&format!("SELECT * FROM job_allocations WHERE job = {id}"))
                    .await
                    .expect("allocations");
                let mut sums = [0.0; 3];
                for b in &rows.batches {
                    let col = |name: &str| -> arrow::array::Float64Array {
                        arrow::array::downcast_array(
                            b.column_by_name(name).expect("column").as_ref(),
                        )
                    };
                    let (acc, used, c_acc, c_used, idle) = (
                        col("gpu_seconds_accounted"),
                        col("gpu_seconds_used"),
                        col("cost_accounted"),
                        col("cost_used"),
                        col("idle_cost"),
                    );
                    for i in 0..b.num_rows() {
                        assert!(used.value(i) <= acc.value(i) + 1e-9, "{at}");
                        assert!(idle.value(i) >= 0.0, "{at}");
                        assert!(
                            near(idle.value(i), c_acc.value(i) - c_used.value(i)),
                            "{at}"
                        );
                        sums[0] += acc.value(i);
                        sums[1] += used.value(i);
                        sums[2] += idle.value(i);
                    }
                }
                assert!(near(sums[0], accounted) && near(sums[1], used), "{at}");
                assert!(near(sums[2], idle), "{at}");
                checked += 1;
            }
            (None, None) => {
                assert!(
                    f("idle_cost").is_none() && f("efficiency").is_none(),
                    "{at}"
                );
            }
            _ => panic!("accounted and used are known together: {at}"),
        }
        // `accounted_until`: the earliest checkpoint of the allocations still being folded.
        let until = record
            .allocations
            .iter()
            .filter(|a| !a.is_final())
            .map(|a| a.folded_end_ms())
            .min();
        let complete = record.end_ms.is_some() && until.is_none();
        if complete && complete_at.is_none() {
            complete_at = Some(t);
        }
        if let Some(until) = until {
            assert_eq!(j["accounted_until_ms"], until, "{at}");
        }
        if complete {
            // Everything equals the allocation totals.
            assert_eq!(j["accounted_until"], j["end_time"], "{at}");
            assert!(
                near(f("gpu_seconds_accounted").expect("acc"), allocated),
                "{at}"
            );
            assert!(
                near(f("cost_accounted").expect("acc"), cost_allocated),
                "{at}"
            );
            assert!(
                near(
                    f("idle_cost").expect("idle"),
                    cost_allocated - f("cost_used").expect("used")
                ),
                "{at}"
            );
            let a = h
                .row("SELECT accounted_until FROM account_usage WHERE account = 'vision'")
                .await;
            assert_eq!(
                a["accounted_until"],
                serde_json::Value::Null,
                "nothing lags: {a}"
            );
        }
        t += 10_000;
    }
    assert_eq!(record_attempts(&h, id), 2, "the job was requeued once");
    assert!(checked > 100, "{checked} moments with figures");
}

fn record_attempts(h: &Harness, id: u64) -> usize {
    h.jobs.read(|c| {
        c.record(id)
            .ok()
            .flatten()
            .map_or(0, |j| j.allocations.len())
    })
}

/// A job shorter than the sample interval has one sample per GPU: the energy counter has no
/// rise to read, so its energy is mean power x time (not a false 0); a GPU reporting the
/// counter but no power has unknown energy (NULL, not 0).
#[tokio::test]
async fn a_short_jobs_energy_is_not_a_false_zero() {
    let mut h = Harness::open(tempfile::tempdir().expect("tempdir"));
    h.sync(T0 - 1000, &[], &[]).await;
    let request: perch_control::spec::JobRequest = serde_json::from_value(json!({
        "command": ["x"], "user": "alice", "gpus_per_node": 2, "time_limit_secs": 600
    }))
    .expect("request");
    let id = h
        .jobs
        .run(move |c, _| c.submit(request, T0))
        .await
        .expect("submit")[0]
        .id;
    h.sync(T0 + 1000, &[], &[]).await; // the launch is delivered
    // One sample per GPU, 3 s into the 8 s job: GPU 0 reports power, GPU 1 only the counter.
    h.ingest(&[Sample {
        time: T0 + 3000,
        gpu: 0,
        util: Some(80.0),
        memory: 1 << 30,
        energy: 7.0e6,
        power: 450.0,
    }])
    .await;
    h.seq += 1;
    let body = serde_json::to_vec(&json!({"node": NODE, "seq": h.seq, "gpus": [
        {"time_ms": T0 + 3000, "gpu": 1, "uuid": "GPU-T-1", "model": "Test H100",
         "simulated": false, "utilization_gpu_pct": 80.0, "energy_joules": 9.0e6}]}))
    .expect("json");
    let batch: Batch = serde_json::from_slice(&body).expect("batch");
    h.store
        .ingest(bytes::Bytes::from(body), &batch)
        .await
        .expect("ingest");
    h.sync(T0 + 8000, &[], &[id]).await;
    assert_eq!(h.fold(T0 + 8000 + 120_000).await, 1);
    let rows = h
        .sql
        .query(&format!(
            "SELECT gpu, gpu_seconds_used, energy_joules FROM job_allocations WHERE job = {id} ORDER BY gpu"
        ))
        .await
        .expect("query");
    let mut w = arrow::json::ArrayWriter::new(Vec::new());
    for b in &rows.batches {
        w.write(b).expect("write");
    }
    w.finish().expect("finish");
    let rows: serde_json::Value = serde_json::from_slice(&w.into_inner()).expect("json");
    assert_eq!(rows[0]["gpu_seconds_used"], 6.4, "{rows}");
    assert_eq!(
        rows[0]["energy_joules"],
        450.0 * 8.0,
        "mean power x 8 s: {rows}"
    );
    assert_eq!(
        rows[1]["energy_joules"],
        serde_json::Value::Null,
        "one counter reading and no power: unknown, not 0: {rows}"
    );
    let j = h
        .row(&format!("SELECT energy_joules FROM jobs WHERE job = {id}"))
        .await;
    assert_eq!(j["energy_joules"], 3600.0, "{j}");
}
