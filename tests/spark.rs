//! Apache Spark reads perch's history straight from the files and answers the accounting
//! questions as perch's SQL does. A server in virtual time (its clock set by the test, so
//! jobs settle in seconds, not hours) runs two and a half days of a small cluster: four nodes
//! of two GPU models, six (account, user) pairs, jobs of one to four GPUs, one on two nodes,
//! one requeued (two attempts), one cancelled before it ran, failures, a node drained for five
//! hours and one silent long enough to be marked down. The test plays the agents (syncs and
//! telemetry over HTTP, one GPU that never reports utilization, two nodes without an energy
//! counter). Once every job has settled into the settled rows' files it asks perch's SQL, stops
//! the server (the last flush), and runs the Spark recipe (tests/accounting_spark.py,
//! docs/spark.md) on the data directory. Every figure must agree: per allocated GPU (used
//! GPU-seconds, utilization, memory, energy, samples, costs), per job (`job_costs`), per
//! account and user (`account_usage`, `user_usage`, `top_users`) and per day
//! (`cluster_utilization_daily`), both as Spark recomputes them from raw telemetry and as it
//! reads them from the settled rows. Spark missing fails the test.

use perch_control::JobsConfig;
use perch_query::StoreConfig;
use perch_server::accounting::{AccountingConfig, Prices};
use perch_server::clock::Clock;
use perch_server::{AppState, ServerConfig};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const MINUTE: i64 = 60_000;
/// Virtual time between two rounds of syncs.
const STEP: i64 = 10 * MINUTE;
/// Between two samples of a GPU.
const SAMPLE: i64 = MINUTE;
/// 2026-03-02T18:00:00Z: the history crosses three midnights.
const T0: i64 = 1_772_474_400_000;
/// Jobs arrive in the first 55 hours.
const ARRIVAL_STEPS: i64 = 330;
/// Node n3 is drained over these steps, and n4's agent is silent over the next range; both
/// again once every job has ended (while busy, their GPUs are mostly held: allocated).
const DRAINED: std::ops::Range<i64> = 150..180;
const SILENT: std::ops::Range<i64> = 250..256;
/// The steps after the last job ended: past the settling of samples (an hour) and of jobs
/// (ten minutes after that). n3 is drained and n4 silent over the given ranges of them.
const TAIL: i64 = 14;
const TAIL_DRAINED: std::ops::Range<i64> = 1..12;
const TAIL_SILENT: std::ops::Range<i64> = 2..9;

const NODES: [(&str, u32, &str); 4] = [
    ("n1", 4, "Sim H100"),
    ("n2", 4, "Sim H100"),
    ("n3", 2, "Sim A100"),
    ("n4", 2, "Sim A100"),
];
/// (user, account): alice charges two accounts; erin her own (the default).
const CHARGES: [(&str, &str); 6] = [
    ("alice", "vision"),
    ("alice", "nlp"),
    ("bob", "nlp"),
    ("chen", "nlp"),
    ("dana", "speech"),
    ("erin", "erin"),
];
const H100_PRICE: f64 = 3.25;
const DEFAULT_PRICE: f64 = 1.5;
const ENERGY_PRICE: f64 = 0.2;

/// A seeded xorshift: the same history on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What a job does once started, chosen at submission.
#[derive(Clone, Copy)]
struct Plan {
    steps: i64,
    /// 0 steady, 1 bursty, 2 idle.
    profile: u64,
    code: i32,
    /// Its first attempt loses its node (a fenced exit): requeued.
    fence_first: bool,
}

/// An attempt running on one node, as its agent sees it.
struct Running {
    job: u64,
    attempt: u32,
    gpus: Vec<u32>,
    end: i64,
    profile: u64,
    code: i32,
    fenced: bool,
}

/// The in-process server on a manual clock, and the agents the test plays.
struct Cluster {
    url: String,
    http: reqwest::blocking::Client,
    clock: Clock,
    state: AppState,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<std::thread::JoinHandle<std::io::Result<()>>>,
    /// What jobs arrive and do; `noise`, what their GPUs show (apart, so that one does not
    /// change the other).
    rng: Rng,
    noise: Rng,
    plans: HashMap<u64, Plan>,
    ends: HashMap<(u64, u32), i64>,
    running: BTreeMap<&'static str, Vec<Running>>,
    energy: HashMap<(&'static str, u32), f64>,
    seq: u64,
}

impl Cluster {
    fn start(data: &Path) -> Cluster {
        let clock = Clock::manual(T0);
        let mut store = StoreConfig::new(data);
        // Many small files and compactions (replaced files leave the manifest at once).
        store.flush_interval = Duration::from_secs(2);
        store.maintenance_interval = Duration::from_secs(3);
        store.compact_min_files = 3;
        let mut config = ServerConfig::new(store);
        config.clock = clock.clone();
        config.jobs = JobsConfig {
            // Longer than a step: the agents sync once a step. A silent hour marks a node down.
            heartbeat_timeout: Duration::from_secs(1800),
            lease: Duration::from_secs(4 * 3600),
            ..JobsConfig::default()
        };
        config.accounting = AccountingConfig {
            fold_interval: Duration::from_secs(1),
            // Longer than a step: a step's samples are sent before the fold reaches them.
            settle: Duration::from_secs(3600),
            prices: Prices {
                default_gpu_per_hour: DEFAULT_PRICE,
                gpu_per_hour: [("Sim H100".to_owned(), H100_PRICE)].into(),
                energy_per_kwh: ENERGY_PRICE,
            },
        };
        config.alerts.enabled = false;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let state = runtime
            .block_on(async { AppState::open(config) })
            .expect("open the server");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = state.clone();
        let server = std::thread::spawn(move || {
            runtime.block_on(perch_server::serve(listener, serving, async move {
                let _ = stopped.await;
            }))
        });
        Cluster {
            url,
            http: reqwest::blocking::Client::new(),
            clock,
            state,
            stop: Some(stop),
            server: Some(server),
            rng: Rng(0x5eed_5ba2_c0ff_ee11),
            noise: Rng(0x0dd_ba11_5eed_f00d),
            plans: HashMap::new(),
            ends: HashMap::new(),
            running: NODES.iter().map(|n| (n.0, Vec::new())).collect(),
            energy: HashMap::new(),
            seq: 0,
        }
    }

    fn post(&self, path: &str, body: &Value) -> Value {
        let response = self
            .http
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let status = response.status();
        let answer: Value = response.json().unwrap_or(Value::Null);
        assert!(status.is_success(), "POST {path} {body}: {status} {answer}");
        answer
    }

    fn sql(&self, query: &str) -> Vec<Value> {
        let answer = self.post("/v1/sql", &json!({ "sql": query }));
        answer["rows"].as_array().expect("rows").clone()
    }

    fn submit(&mut self, request: Value, plan: Plan) -> u64 {
        let answer = self.post("/v1/jobs", &request);
        let id = answer["id"].as_u64().expect("job id");
        self.plans.insert(id, plan);
        id
    }

    /// One job of a random shape, user and profile.
    fn submit_random(&mut self) -> u64 {
        let (user, account) = CHARGES[self.rng.below(CHARGES.len() as u64) as usize];
        let gpus = [1, 1, 1, 2, 2, 4][self.rng.below(6) as usize];
        let plan = Plan {
            steps: 2 + self.rng.below(35) as i64,
            profile: self.rng.below(3),
            code: if self.rng.below(10) == 0 { 1 } else { 0 },
            fence_first: false,
        };
        let request = json!({
            "command": ["python3", "train.py"], "user": user, "account": account,
            "gpus_per_node": gpus, "time_limit_secs": 3 * 86_400,
        });
        self.submit(request, plan)
    }

    /// The GPU samples of `node` over [from, to), by what the agent knows runs there.
    fn telemetry(&mut self, node: &'static str, gpus: u32, model: &str, from: i64, to: i64) {
        let mut samples = Vec::new();
        let mut at = from;
        while at < to {
            for gpu in 0..gpus {
                let held = self.running[node]
                    .iter()
                    .find(|r| r.gpus.contains(&gpu))
                    .map(|r| r.profile);
                let noise = self.noise.unit();
                let util = match held {
                    None => 0.0,
                    Some(0) => 80.0 + 20.0 * noise,
                    Some(1) if (at / SAMPLE) % 4 < 2 => 90.0 + 10.0 * noise,
                    Some(1) => 5.0 * noise,
                    Some(_) => 2.0 * noise,
                };
                // n4's second GPU never reports utilization; others miss one sample in 20.
                let reported = !(node == "n4" && gpu == 1) && self.noise.below(20) != 0;
                let memory = match held {
                    Some(_) => 20_000_000_000 + self.noise.below(40_000_000_000),
                    None => 500_000_000,
                };
                let power = 60.0 + 3.0 * util;
                let mut sample = json!({
                    "time_ms": at, "gpu": gpu, "uuid": format!("GPU-SIM-{node}-{gpu}"),
                    "model": model, "simulated": true, "memory_used_bytes": memory,
                    "memory_total_bytes": 80_000_000_000u64, "power_watts": power,
                });
                if reported {
                    sample["utilization_gpu_pct"] = json!(util);
                }
                // The H100 nodes report the energy counter; the A100 nodes power alone.
                if model == "Sim H100" {
                    let counter = self.energy.entry((node, gpu)).or_insert(1.0e6);
                    *counter += power * (SAMPLE / 1000) as f64;
                    sample["energy_joules"] = json!(*counter);
                }
                samples.push(sample);
            }
            at += SAMPLE;
        }
        self.seq += 1;
        let batch = json!({ "node": node, "seq": self.seq, "gpus": samples });
        self.post("/v1/ingest", &batch);
    }

    /// `node`'s agent syncs at `now`: reports exits due and what runs, takes its orders.
    fn sync(&mut self, node: &'static str, gpus: u32, model: &str, now: i64) {
        let (done, still): (Vec<Running>, Vec<Running>) =
            std::mem::take(self.running.get_mut(node).expect("node"))
                .into_iter()
                .partition(|r| r.end <= now);
        let exited: Vec<Value> = done
            .iter()
            .map(|r| {
                json!({ "job": r.job, "attempt": r.attempt, "code": r.code, "fenced": r.fenced })
            })
            .collect();
        let running: Vec<Value> = still
            .iter()
            .map(|r| json!({ "job": r.job, "attempt": r.attempt }))
            .collect();
        *self.running.get_mut(node).expect("node") = still;
        let answer = self.post(
            "/v1/agent/sync",
            &json!({ "node": node, "gpus": gpus, "gpu_model": model,
                     "running": running, "exited": exited }),
        );
        let acknowledged = answer["acknowledged"].as_array().map_or(0, Vec::len);
        assert_eq!(acknowledged, done.len(), "{node} at {now}: {answer}");
        // A stop of what ended here is the server making sure; nothing running is stopped.
        for stop in answer["stop"].as_array().into_iter().flatten() {
            assert!(
                !self.running[node]
                    .iter()
                    .any(|r| json!(r.job) == stop["job"]),
                "{node} at {now}: nothing running is stopped in this history: {stop}"
            );
        }
        for start in answer["start"].as_array().expect("start") {
            let job = start["job"].as_u64().expect("job");
            let attempt = start["attempt"].as_u64().expect("attempt") as u32;
            let plan = self.plans[&job];
            let fenced = plan.fence_first && attempt == 1;
            let steps = if fenced { 3 } else { plan.steps };
            // The ranks of a job on several nodes end together.
            let end = *self
                .ends
                .entry((job, attempt))
                .or_insert(now + steps * STEP);
            let gpus = start["gpus"]
                .as_array()
                .expect("gpus")
                .iter()
                .map(|g| g.as_u64().expect("gpu") as u32)
                .collect();
            self.running.get_mut(node).expect("node").push(Running {
                job,
                attempt,
                gpus,
                end,
                profile: plan.profile,
                code: if fenced { 137 } else { plan.code },
                fenced,
            });
        }
    }

    /// One step at `step`: time moves on, each agent sends the samples of the step just over
    /// and syncs (n4's not when `silent`).
    fn step(&mut self, step: i64, silent: bool) {
        let now = T0 + step * STEP;
        self.clock.set(now);
        for (node, gpus, model) in NODES {
            if step > 0 {
                self.telemetry(node, gpus, model, now - STEP, now);
            }
            if !(node == "n4" && silent) {
                self.sync(node, gpus, model, now);
            }
        }
    }

    /// Waits for the ticker to mark `node` down (silent past the heartbeat timeout).
    fn wait_down(&self, node: &str) {
        wait_for(
            &format!("{node} marked down"),
            Duration::from_secs(30),
            || {
                let rows = self.sql(&format!("SELECT state FROM nodes WHERE node = '{node}'"));
                (rows[0]["state"] == "down").then_some(())
            },
        );
    }

    fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server
                .join()
                .expect("server thread")
                .expect("the server stops cleanly");
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

fn wait_for<T>(what: &str, patience: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < patience, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Equal within float rounding (sums in another order), NULL only where NULL.
fn close(perch: &Value, spark: &Value) -> bool {
    match (perch.as_f64(), spark.as_f64()) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0),
        _ => perch.is_null() && spark.is_null(),
    }
}

/// Each row of perch's `rows`, keyed by `key`, against Spark's row of the same key in
/// `spark`, on `fields`; and no row more or less.
fn agree(
    what: &str,
    rows: &[Value],
    key: impl Fn(&Value) -> String,
    spark: &Value,
    fields: &[&str],
) {
    let spark = spark
        .as_object()
        .unwrap_or_else(|| panic!("{what}: no object in Spark's answer"));
    let keys: Vec<String> = rows.iter().map(&key).collect();
    let mut theirs: Vec<&String> = spark.keys().collect();
    let mut ours: Vec<&String> = keys.iter().collect();
    theirs.sort();
    ours.sort();
    assert_eq!(ours, theirs, "{what}: perch's rows and Spark's differ");
    for (row, k) in rows.iter().zip(&keys) {
        let theirs = &spark[k];
        for field in fields {
            assert!(
                close(&row[field], &theirs[field]),
                "{what} {k} {field}: perch {} vs Spark {}\nperch: {row}\nSpark: {theirs}",
                row[field],
                theirs[field]
            );
        }
    }
}

const USAGE: [&str; 9] = [
    "jobs",
    "gpu_hours_allocated",
    "gpu_hours_accounted",
    "gpu_hours_used",
    "efficiency",
    "cost_allocated",
    "cost_accounted",
    "cost_used",
    "idle_cost",
];

#[test]
fn spark_recomputes_perchs_accounting_from_the_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let mut cluster = Cluster::start(&data);

    // The history: arrivals over 55 hours, the special cases at fixed steps.
    let mut dependent = None;
    let mut step = 0;
    loop {
        cluster.step(step, SILENT.contains(&step));
        let now = T0 + step * STEP;
        if step < ARRIVAL_STEPS {
            let arrivals = if step == 0 {
                6
            } else {
                u64::from(cluster.rng.below(4) == 0)
            };
            for _ in 0..arrivals {
                cluster.submit_random();
            }
        }
        match step {
            3 => {
                let plan = Plan {
                    steps: 20,
                    profile: 0,
                    code: 0,
                    fence_first: false,
                };
                let request = json!({ "command": ["torchrun", "train.py"], "user": "bob",
                    "account": "nlp", "nodes": 2, "gpus_per_node": 2, "time_limit_secs": 86_400 });
                cluster.submit(request, plan);
            }
            5 => {
                let plan = Plan {
                    steps: 12,
                    profile: 1,
                    code: 0,
                    fence_first: true,
                };
                let request = json!({ "command": ["train"], "user": "dana", "account": "speech",
                    "gpus_per_node": 1, "max_requeues": 1, "time_limit_secs": 86_400 });
                let id = cluster.submit(request, plan);
                // Waits on the requeued job, and is cancelled before it runs.
                let request = json!({ "command": ["eval"], "user": "chen", "account": "nlp",
                    "gpus_per_node": 1, "after_ok": [id], "time_limit_secs": 3600 });
                dependent = Some(cluster.submit(request, plan));
            }
            7 => {
                let id = dependent.expect("submitted");
                cluster.post(&format!("/v1/jobs/{id}/cancel"), &json!({}));
            }
            _ => {}
        }
        if step == SILENT.start + 4 {
            cluster.wait_down("n4");
        }
        if step == DRAINED.start {
            cluster.post("/v1/nodes/n3/drain", &json!({}));
        }
        if step == DRAINED.end {
            cluster.post("/v1/nodes/n3/resume", &json!({}));
        }
        step += 1;
        if step >= ARRIVAL_STEPS
            && cluster.running.values().all(Vec::is_empty)
            && cluster.sql("SELECT count(*) AS n FROM jobs WHERE end_time IS NULL")[0]["n"] == 0
        {
            break;
        }
        assert!(
            step < ARRIVAL_STEPS + 200,
            "the queue never drained by {now}"
        );
    }
    for i in 0..TAIL {
        cluster.step(step, TAIL_SILENT.contains(&i));
        if i == TAIL_SILENT.start + 4 {
            cluster.wait_down("n4");
        }
        if i == TAIL_DRAINED.start {
            cluster.post("/v1/nodes/n3/drain", &json!({}));
        }
        if i == TAIL_DRAINED.end {
            cluster.post("/v1/nodes/n3/resume", &json!({}));
        }
        step += 1;
    }
    // Every job's rows are in the settled rows' files: no job is held whole or unrecorded.
    // The control plane looks for settled jobs every 30 s of its time: time goes on meanwhile
    // (the agents syncing), and the answers are as of where it stops.
    let until = wait_for(
        "every job in the settled rows' files",
        Duration::from_secs(120),
        || {
            let now = cluster.clock.now_ms() + 31_000;
            cluster.clock.set(now);
            for (node, gpus, model) in NODES {
                cluster.sync(node, gpus, model, now);
            }
            let mut left = 0;
            cluster
                .state
                .jobs
                .walk_for_accounting(0, false, |_| {
                    left += 1;
                    true
                })
                .expect("walk");
            (left == 0).then_some(now)
        },
    );

    // perch's answers.
    let jobs = cluster.sql("SELECT job, attempts, state FROM jobs ORDER BY job");
    let job_costs = cluster.sql("SELECT * FROM job_costs ORDER BY job");
    let account_usage = cluster.sql("SELECT * FROM account_usage ORDER BY account, user_name");
    let user_usage = cluster.sql("SELECT * FROM user_usage ORDER BY user_name");
    let top_users = cluster.sql("SELECT user_name FROM top_users");
    let days = cluster.sql(
        "SELECT CAST(day AS BIGINT) AS day_ms, capacity_gpu_hours, allocated_gpu_hours, \
         accounted_gpu_hours, used_gpu_hours, idle_gpu_hours, drained_gpu_hours, down_gpu_hours, allocated_pct \
         FROM cluster_utilization_daily ORDER BY day",
    );
    let allocations = cluster.sql("SELECT * FROM job_allocations ORDER BY job, attempt, node, gpu");
    let node_events = cluster.sql(
        "SELECT kind, count(*) AS n FROM events WHERE kind LIKE 'node_%' \
         GROUP BY kind ORDER BY kind",
    );
    cluster.stop(); // the last flush

    // The history has what the recipe must get right.
    let count = |f: &dyn Fn(&Value) -> bool| jobs.iter().filter(|j| f(j)).count();
    assert!(jobs.len() > 60, "{} jobs", jobs.len());
    assert_eq!(
        count(&|j| j["attempts"] == 0),
        1,
        "one cancelled before it ran"
    );
    assert_eq!(count(&|j| j["attempts"] == 2), 1, "one requeued");
    assert!(count(&|j| j["state"] == "failed") > 0);
    assert_eq!(job_costs.len(), jobs.len() - 1);
    assert_eq!(account_usage.len(), CHARGES.len(), "{account_usage:?}");
    assert!(days.len() >= 3, "{days:?}");
    let total = |k: &str| {
        days.iter()
            .map(|d| d[k].as_f64().unwrap_or(0.0))
            .sum::<f64>()
    };
    for k in [
        "allocated_gpu_hours",
        "used_gpu_hours",
        "idle_gpu_hours",
        "drained_gpu_hours",
        "down_gpu_hours",
    ] {
        assert!(total(k) > 0.0, "{k}: {days:?}");
    }
    assert!(
        allocations.iter().any(|a| a["gpu_seconds_used"].is_null()),
        "a GPU with no utilization reported"
    );
    assert!(
        node_events.iter().any(|e| e["kind"] == "node_down"),
        "{node_events:?}"
    );

    // Spark, on the data directory of the stopped server, with the server's prices.
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        format!(
            "[accounting]\ngpu_price_per_hour = {DEFAULT_PRICE}\n\
             energy_price_per_kwh = {ENERGY_PRICE}\n\
             [accounting.gpu_prices]\n\"Sim H100\" = {H100_PRICE}\n"
        ),
    )
    .expect("config");
    let started = Instant::now();
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/accounting_spark.py"
        ))
        .arg(&data)
        .args(["--config", config.to_str().expect("utf-8")])
        .args(["--until", &until.to_string(), "--usage", "both"])
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "the Spark recipe failed (are pyspark and a Java runtime installed? scripts/test.sh \
         installs them): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let spark: Value = serde_json::from_slice(&out.stdout).expect("JSON from the Spark recipe");
    eprintln!(
        "Spark recipe: {:.1} s in all; {} (history: {} jobs, {} allocated GPUs, {} days)",
        started.elapsed().as_secs_f64(),
        spark["timing"],
        jobs.len(),
        allocations.len(),
        days.len()
    );
    assert_eq!(
        spark["inputs"]["settled_jobs"],
        jobs.len(),
        "{}",
        spark["inputs"]
    );

    for usage in ["telemetry", "settled"] {
        let s = &spark[usage];
        let gpu_key = |a: &Value| {
            format!(
                "{}/{}/{}/{}",
                a["job"],
                a["attempt"],
                a["node"].as_str().unwrap_or(""),
                a["gpu"]
            )
        };
        agree(
            &format!("{usage}: job_allocations"),
            &allocations,
            gpu_key,
            &s["allocations"],
            &[
                "samples",
                "gpu_seconds_allocated",
                "gpu_seconds_accounted",
                "gpu_seconds_used",
                "utilization_mean_pct",
                "utilization_peak_pct",
                "memory_peak_bytes",
                "energy_joules",
                "cost_allocated",
                "cost_used",
                "cost_accounted",
                "idle_cost",
            ],
        );
        agree(
            &format!("{usage}: job_costs"),
            &job_costs,
            |j| j["job"].to_string(),
            &s["job_costs"],
            &[
                "gpu_hours_allocated",
                "gpu_hours_accounted",
                "gpu_hours_used",
                "efficiency",
                "energy_kwh",
                "cost_allocated",
                "cost_accounted",
                "cost_used",
                "idle_cost",
            ],
        );
        agree(
            &format!("{usage}: account_usage"),
            &account_usage,
            |u| {
                format!(
                    "{}/{}",
                    u["account"].as_str().unwrap_or(""),
                    u["user_name"].as_str().unwrap_or("")
                )
            },
            &s["account_usage"],
            &USAGE,
        );
        agree(
            &format!("{usage}: user_usage"),
            &user_usage,
            |u| u["user_name"].as_str().unwrap_or("").to_owned(),
            &s["user_usage"],
            &USAGE,
        );
        let top: Vec<&Value> = top_users.iter().map(|u| &u["user_name"]).collect();
        let spark_top: Vec<&Value> = s["top_users"]
            .as_array()
            .expect("top_users")
            .iter()
            .collect();
        assert_eq!(top, spark_top, "{usage}: top_users");
        agree(
            &format!("{usage}: cluster_utilization_daily"),
            &days,
            |d| d["day_ms"].to_string(),
            &s["cluster_utilization_daily"],
            &[
                "capacity_gpu_hours",
                "allocated_gpu_hours",
                "accounted_gpu_hours",
                "used_gpu_hours",
                "idle_gpu_hours",
                "drained_gpu_hours",
                "down_gpu_hours",
                "allocated_pct",
            ],
        );
    }
}

/// docs/spark.md shows the recipe's statements: each of its SQL blocks is in the script the
/// test above runs, word for word (spacing aside).
#[test]
fn every_sql_block_of_the_spark_doc_is_in_the_recipe() {
    let read = |path: &str| {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let words = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let (doc, recipe) = (
        read("docs/spark.md"),
        words(&read("tests/accounting_spark.py")),
    );
    // Spark SQL is fenced `sql spark`: the `sql` blocks of docs/ are perch's own, which
    // tests/psql.rs runs through psql.
    let blocks: Vec<&str> = doc
        .split("```sql spark\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap_or(""))
        .collect();
    assert!(
        blocks.len() >= 10,
        "{} SQL blocks in docs/spark.md",
        blocks.len()
    );
    for block in blocks {
        assert!(
            recipe.contains(&words(block)),
            "docs/spark.md shows SQL that tests/accounting_spark.py does not run:\n{block}"
        );
    }
}
