//! One user's heavy request made the server fail everyone's jobs. A CPU-heavy query
//! left health probes unanswered for 36 s, and a maximal array submission held agent syncs for
//! 55 s, so the server marked nodes down and requeued their jobs. Here a CPU-heavy query, two
//! memory-heavy ones and a maximal array submission run at once while a probe syncs as a node
//! every 200 ms: every sync and health probe is answered within a second, no node goes down,
//! and each heavy request ends with an answer that says what happened.

mod common;

use common::{Agent, wait_for};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Every request to the server must be answered within this while the heavy ones run.
const PROMPT: Duration = Duration::from_secs(1);

#[test]
fn heavy_queries_and_a_maximal_submission_do_not_starve_agent_syncs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nnode_stale_after_secs = 3\nnode_lease_secs = 10\n\
         [query]\ntimeout_secs = 12\nmemory_mb = 768\ntotal_memory_mb = 1024\nmax_concurrent = 3\n\
         spill_mb = 0\n",
        &[],
    );
    let _agent = Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        None,
        &["--interval-ms", "200"],
    );
    wait_for("the node up", || {
        (perch.get("/v1/nodes")["nodes"][0]["state"] == "up").then_some(())
    });
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let url = perch.url.clone();
    let sql = |text: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            let r = http
                .post(format!("{url}/v1/sql"))
                .json(&serde_json::json!({ "sql": text }))
                .send()
                .expect("sql");
            let status = r.status().as_u16();
            let body: serde_json::Value = r.json().expect("json");
            (status, body, started.elapsed())
        })
    };
    // Four billion rows, each computed: runs until the timeout, on every core the SQL
    // runtime has.
    let cpu = sql(
        "SELECT sum((x.value * y.value) % 7) FROM generate_series(1, 20000) AS x \
         CROSS JOIN generate_series(1, 200000) AS y",
    );
    std::thread::sleep(Duration::from_millis(200));
    // Two queries each wanting 2 GB of distinct strings: more memory than any query may have,
    // and together more than the server's budget.
    let wide =
        "SELECT count(DISTINCT concat(repeat('x', 1000), value)) FROM generate_series(1, 2000000)";
    let memory = [sql(wide), sql(wide)];
    // A fourth query waits for one of the three slots.
    let queued = sql("SELECT 42 AS answer");
    // The largest array one request may make: 10,000 tasks, each with its own copy of the
    // environment, up to the 16 MiB the server keeps per submission. Two GPUs per task on a
    // node of one, so they all stay pending (held until nodes that fit join: a shape no node
    // seen could run is refused otherwise).
    let submit = {
        let (http, url) = (http.clone(), url.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            let r = http
                .post(format!("{url}/v1/jobs"))
                .json(&serde_json::json!({
                    "command": ["true"],
                    "gpus_per_node": 2,
                    "array": 10000,
                    "hold_until_fits": true,
                    "env": {"PAYLOAD": "x".repeat(1500)},
                }))
                .send()
                .expect("submit");
            (
                r.status().as_u16(),
                r.text().expect("text"),
                started.elapsed(),
            )
        })
    };

    // Meanwhile a node syncs and a load balancer probes health, five times a second.
    let done = Arc::new(AtomicBool::new(false));
    let probe = {
        let (http, url, done) = (http.clone(), url.clone(), done.clone());
        std::thread::spawn(move || {
            let mut slowest = (Duration::ZERO, Duration::ZERO);
            let mut rounds = 0;
            while !done.load(Ordering::SeqCst) {
                let started = Instant::now();
                let sync = http
                    .post(format!("{url}/v1/agent/sync"))
                    .json(&serde_json::json!({"node": "probe", "gpus": 0, "gpu_model": "none"}))
                    .send()
                    .expect("sync");
                assert!(sync.status().is_success(), "sync: {}", sync.status());
                slowest.0 = slowest.0.max(started.elapsed());
                let started = Instant::now();
                let health = http.get(format!("{url}/healthz")).send().expect("healthz");
                assert!(health.status().is_success());
                slowest.1 = slowest.1.max(started.elapsed());
                rounds += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            (slowest, rounds)
        })
    };

    let (status, body, took) = cpu.join().expect("cpu query");
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (422, Some("query_timeout")),
        "{body}"
    );
    assert!(took < Duration::from_secs(16), "the timeout held: {took:?}");
    for query in memory {
        let (status, body, _) = query.join().expect("memory query");
        assert!(
            [(422, Some("query_memory_limit")), (503, Some("sql_busy"))]
                .contains(&(status, body["error"]["code"].as_str())),
            "{status} {body}"
        );
    }
    let (status, body, _) = queued.join().expect("queued query");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["rows"][0]["answer"], 42);
    let (status, text, took) = submit.join().expect("submission");
    assert_eq!(status, 201, "{text}");
    eprintln!("the maximal array was accepted in {took:?}");
    done.store(true, Ordering::SeqCst);
    let ((sync, health), rounds) = probe.join().expect("probe");
    eprintln!("{rounds} rounds; slowest sync {sync:?}, slowest health probe {health:?}");
    assert!(rounds >= 20, "only {rounds} probes");
    assert!(sync < PROMPT, "a sync took {sync:?}");
    assert!(health < PROMPT, "a health probe took {health:?}");

    // No node was ever marked down, and the array's tasks are all there.
    let nodes = perch.get("/v1/nodes");
    for node in nodes["nodes"].as_array().expect("nodes") {
        assert_eq!(node["state"], "up", "{node}");
    }
    assert_eq!(
        perch.scalar(
            "SELECT count(*) FROM events WHERE kind IN ('node_down', 'node_lease_expired')"
        ),
        0
    );
    assert_eq!(
        perch.scalar("SELECT count(*) FROM jobs WHERE state = 'pending'"),
        10_000
    );
}
