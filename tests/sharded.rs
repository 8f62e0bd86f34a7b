//! Telemetry spread over several servers (server/src/cluster.rs, docs/scale.md): one control
//! server and three ingest servers of the same binary. Each node's sync answer names its
//! ingest server; the ingest servers store what they take, each in its own data directory, and
//! push every node's latest state to the control server; the control server's SQL reads every
//! store and answers exactly as one server fed the same samples does, also after an ingest
//! server is killed mid-stream (its nodes move to the others, it comes back and replays its
//! log). A real agent follows its sync answer, and an ingest server refuses what only the
//! control server does.

mod common;

use common::{AGENT, OPERATOR, Perch, metric, wait_for};
use reqwest::blocking::Client;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Agents and the ingest servers' pushes use one agent token bound to no node; people, the
/// operator's.
fn tokens(dir: &Path) -> std::path::PathBuf {
    let file = dir.join("tokens.toml");
    std::fs::write(
        &file,
        format!(
            "[[tokens]]\ntoken = \"{OPERATOR}\"\nuser = \"ops\"\nrole = \"operator\"\n\
             [[tokens]]\ntoken = \"{AGENT}\"\nuser = \"fleet\"\nrole = \"agent\"\n\
             [[tokens]]\ntoken = \"{NODE_TOKEN}\"\nuser = \"node-1\"\nrole = \"agent\"\nnodes = [\"real-1\"]\n"
        ),
    )
    .expect("tokens");
    file
}

fn start(dir: &Path, name: &str, config: &str) -> Perch {
    let file = dir.join(format!("{name}.toml"));
    std::fs::write(&file, config).expect("config");
    Perch::start(
        &dir.join(name),
        &["server", "--config", file.to_str().expect("utf-8")],
    )
}

/// An agent token bound to one node.
const NODE_TOKEN: &str = "node-token-0123456789abc";

const INGEST: [&str; 3] = ["ingest-a", "ingest-b", "ingest-c"];

fn ingest_config(dir: &Path, control: &str) -> String {
    let token = dir.join("push.token");
    std::fs::write(&token, AGENT).expect("token");
    format!(
        "[server]\ntokens_file = \"{}\"\npg_listen = \"\"\n[cluster]\nrole = \"ingest\"\ncontrol = \"{control}\"\ntoken_file = \"{}\"\npush_interval_ms = 200\n",
        dir.join("tokens.toml").display(),
        token.display()
    )
}

fn start_ingest(dir: &Path, name: &str, control: &str) -> Perch {
    let config = ingest_config(dir, control).replace(
        "role = \"ingest\"\n",
        &format!("role = \"ingest\"\nname = \"{name}\"\n"),
    );
    start(dir, name, &config)
}

/// The agent id a test node syncs and sends with.
fn agent_id(node: &str) -> String {
    format!(
        "{:0>16x}",
        node.bytes().fold(7u64, |h, b| h * 31 + u64::from(b))
    )
}

/// The ingest server the control server names for `node` (`None`: itself).
fn sync(http: &Client, control: &str, node: &str) -> Option<String> {
    let answer: Value = http
        .post(format!("{control}/v1/agent/sync"))
        .bearer_auth(AGENT)
        .json(&json!({"node": node, "gpus": 4, "gpu_model": "Test", "agent_id": agent_id(node)}))
        .send()
        .expect("sync")
        .error_for_status()
        .expect("sync answered")
        .json()
        .expect("json");
    answer["ingest_url"].as_str().map(str::to_owned)
}

/// One round of `node`: a host sample and 4 GPUs, values from `seq`.
fn round(node: &str, seq: u64, t0: i64) -> Value {
    let t = t0 + seq as i64 * 1_000;
    let gpus: Vec<Value> = (0..4u64)
        .map(|g| {
            json!({
                "time_ms": t, "gpu": g, "uuid": format!("GPU-{node}-{g}"), "model": "Test",
                "simulated": true, "utilization_gpu_pct": ((seq * 7 + g * 13) % 101) as f64,
                "power_watts": 100.0 + (seq % 50) as f64 + g as f64, "sm_clock_mhz": 1000 + seq,
                "memory_used_bytes": (seq % 16) << 30
            })
        })
        .collect();
    json!({
        "node": node, "seq": seq,
        "hosts": [{"time_ms": t, "simulated": true, "memory_available_bytes": (seq % 8) << 30, "cpu_user_seconds": seq as f64}],
        "gpus": gpus
    })
}

fn post(http: &Client, base: &str, node: &str, batch: &Value) {
    let answer = http
        .post(format!("{base}/v1/ingest"))
        .bearer_auth(AGENT)
        .header("x-perch-agent", agent_id(node))
        .json(batch)
        .send()
        .expect("ingest");
    let status = answer.status();
    assert!(
        status.is_success(),
        "{base}: {status} {}",
        answer.text().unwrap_or_default()
    );
}

fn sql(http: &Client, base: &str, query: &str) -> Vec<Value> {
    let answer = http
        .post(format!("{base}/v1/sql"))
        .bearer_auth(OPERATOR)
        .json(&json!({ "sql": query }))
        .send()
        .expect("sql");
    let status = answer.status();
    let text = answer.text().expect("text");
    assert!(status.is_success(), "{query}: {status} {text}");
    serde_json::from_str::<Value>(&text).expect("json")["rows"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn metrics(http: &Client, base: &str) -> String {
    http.get(format!("{base}/metrics"))
        .send()
        .expect("metrics")
        .text()
        .expect("text")
}

/// The queries both answers must agree on, over the test's nodes (`n..`).
const QUERIES: &[&str] = &[
    "SELECT node, count(*) AS n, sum(utilization_gpu_pct) AS u, min(time) AS first, max(time) AS last FROM gpu_samples WHERE node LIKE 'n%' GROUP BY node ORDER BY node",
    "SELECT node, gpu, sum(samples) AS s, sum(utilization_gpu_pct_sum) AS u, max(power_watts_max) AS p FROM gpu_samples_1m WHERE node LIKE 'n%' GROUP BY node, gpu ORDER BY node, gpu",
    "SELECT node, count(*) AS n, max(memory_available_bytes) AS m FROM host_samples WHERE node LIKE 'n%' GROUP BY node ORDER BY node",
    "SELECT date_trunc('minute', time) AS minute, count(DISTINCT node) AS nodes, avg(power_watts) AS w, median(utilization_gpu_pct) AS med FROM gpu_samples WHERE node LIKE 'n%' GROUP BY minute ORDER BY minute",
    "SELECT node, sum(samples) AS s FROM host_samples_1h WHERE node LIKE 'n%' GROUP BY node ORDER BY node",
];

#[test]
fn three_ingest_servers_and_a_control_server_answer_as_one_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let tokens = tokens(dir);
    let stores: String = INGEST
        .iter()
        .map(|n| {
            format!(
                "[[cluster.ingest]]\nname = \"{n}\"\nstore = \"{}\"\n",
                dir.join(n).display()
            )
        })
        .collect();
    let control = start(
        dir,
        "control",
        &format!(
            "[server]\ntokens_file = \"{}\"\npg_listen = \"\"\n[cluster]\nrole = \"control\"\ningest_timeout_secs = 2\n{stores}",
            tokens.display()
        ),
    );
    let single = start(
        dir,
        "single",
        &format!(
            "[server]\ntokens_file = \"{}\"\npg_listen = \"\"\n",
            tokens.display()
        ),
    );
    let mut ingest: BTreeMap<&str, Perch> = INGEST
        .iter()
        .map(|n| (*n, start_ingest(dir, n, &control.url)))
        .collect();
    let http = Client::new();
    let up = |text: &str, name: &str| {
        metric(
            text,
            &format!("perch_cluster_ingest_up{{ingest=\"{name}\"}}"),
        ) == Some(1.0)
    };
    wait_for("every ingest server to push", || {
        let text = metrics(&http, &control.url);
        INGEST.iter().all(|n| up(&text, n)).then_some(())
    });

    // An ingest server does what only the control server does nowhere: it names it.
    let refused = http
        .post(format!("{}/v1/jobs", ingest["ingest-a"].url))
        .bearer_auth(OPERATOR)
        .json(&json!({"command": ["true"], "gpus": 1}))
        .send()
        .expect("submit");
    assert_eq!(refused.status().as_u16(), 421);
    assert_eq!(
        refused.headers()["x-perch-control"]
            .to_str()
            .expect("ascii"),
        control.url
    );
    let text = refused.text().expect("text");
    assert!(
        text.contains("ingest_only") && text.contains(&control.url),
        "{text}"
    );
    // Its /metrics carries no fleet series (the control server's do): nothing counted twice.
    assert!(!metrics(&http, &ingest["ingest-a"].url).contains("perch_gpu_"));

    // Twelve nodes, spread over the three by their sync answers.
    let nodes: Vec<String> = (0..12).map(|i| format!("n{i:02}")).collect();
    let urls: BTreeMap<&str, String> = ingest.iter().map(|(n, p)| (*n, p.url.clone())).collect();
    let mut target: BTreeMap<String, String> = nodes
        .iter()
        .map(|n| {
            (
                n.clone(),
                sync(&http, &control.url, n).expect("an ingest server"),
            )
        })
        .collect();
    let used: BTreeSet<&String> = target.values().collect();
    assert_eq!(
        used.len(),
        3,
        "every ingest server takes a share: {target:?}"
    );
    assert!(
        used.iter().all(|u| urls.values().any(|x| x == *u)),
        "{target:?} {urls:?}"
    );

    let t0 = common::now_ms() - 3_600_000;
    let rounds = 90;
    for seq in 1..=rounds / 2 {
        for n in &nodes {
            let batch = round(n, seq, t0);
            post(&http, &target[n], n, &batch);
            post(&http, &single.url, n, &batch);
        }
    }
    // The control server sees every node's latest state through the pushes, without storing it.
    wait_for("the control server to show every node's GPUs", || {
        let text = metrics(&http, &control.url);
        nodes
            .iter()
            .all(|n| {
                text.contains(&format!(
                    "perch_gpu_utilization_ratio{{node=\"{n}\",gpu=\"3\""
                ))
            })
            .then_some(())
    });
    let stored_here = sql(
        &http,
        &control.url,
        "SELECT count(*) AS n FROM gpu_samples WHERE node LIKE 'n%'",
    );
    assert_eq!(
        stored_here[0]["n"], 0,
        "the control server stores nothing of the ingest servers' nodes before they flush"
    );

    // kill -9 one ingest server mid-stream: its nodes move to the others once it is silent.
    let victim = "ingest-b";
    let victim_url = urls[victim].clone();
    ingest.get_mut(victim).expect("victim").kill();
    let moved: Vec<String> = target
        .iter()
        .filter(|(_, u)| **u == victim_url)
        .map(|(n, _)| n.clone())
        .collect();
    assert!(!moved.is_empty());
    wait_for("the victim's nodes to be sent elsewhere", || {
        moved
            .iter()
            .all(|n| sync(&http, &control.url, n).is_some_and(|u| u != victim_url))
            .then_some(())
    });
    for n in &moved {
        let now = sync(&http, &control.url, n).expect("an ingest server");
        target.insert(n.clone(), now);
    }
    for seq in rounds / 2 + 1..=rounds {
        for n in &nodes {
            let batch = round(n, seq, t0);
            post(&http, &target[n], n, &batch);
            post(&http, &single.url, n, &batch);
        }
    }
    // It comes back on its data directory: what it acknowledged is in its log.
    let back = start_ingest(dir, victim, &control.url);
    ingest.insert(victim, back);

    // Every writer flushes as it stops; the control server reads their stores within a refresh.
    for (_, mut p) in std::mem::take(&mut ingest) {
        assert!(p.terminate().success());
    }
    let expected = (rounds * 12 * 4) as i64;
    let single_count = sql(
        &http,
        &single.url,
        "SELECT count(*) AS n FROM gpu_samples WHERE node LIKE 'n%'",
    );
    assert_eq!(single_count[0]["n"], expected);
    wait_for("the control server to read every store", || {
        let got = sql(
            &http,
            &control.url,
            "SELECT count(*) AS n FROM gpu_samples WHERE node LIKE 'n%'",
        );
        (got[0]["n"] == expected).then_some(())
    });
    for q in QUERIES {
        let (a, b) = (sql(&http, &control.url, q), sql(&http, &single.url, q));
        assert!(!a.is_empty(), "{q}");
        assert_eq!(a, b, "{q}");
    }
    let text = metrics(&http, &control.url);
    for n in INGEST {
        let files = metric(&text, &format!("perch_store_peer_files{{peer=\"{n}\"}}"));
        assert!(files.is_some_and(|f| f > 0.0), "{n}: {files:?}");
    }
}

#[test]
fn a_real_agent_sends_its_telemetry_where_its_sync_answer_says() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let tokens = tokens(dir);
    let control = start(
        dir,
        "control",
        &format!(
            "[server]\ntokens_file = \"{}\"\npg_listen = \"\"\n[cluster]\nrole = \"control\"\n[[cluster.ingest]]\nname = \"ingest-a\"\nstore = \"{}\"\n",
            tokens.display(),
            dir.join("ingest-a").display()
        ),
    );
    let mut ingest = start_ingest(dir, "ingest-a", &control.url);
    let http = Client::new();
    let _agent = common::Agent::start(
        &control.url,
        "real-1",
        &dir.join("agent"),
        2,
        Some(AGENT),
        &["--interval-ms", "200"],
    );
    // Its samples are stored by the ingest server...
    wait_for("the agent's samples on the ingest server", || {
        let rows = sql(
            &http,
            &ingest.url,
            "SELECT count(*) AS n FROM gpu_samples WHERE node = 'real-1'",
        );
        (rows[0]["n"].as_i64() > Some(10)).then_some(())
    });
    // ... and the control server knows the node's GPUs, through the pushes.
    wait_for("the control server to show the agent's GPUs", || {
        let text = metrics(&http, &control.url);
        text.contains("perch_gpu_utilization_ratio{node=\"real-1\",gpu=\"1\"")
            .then_some(())
    });
    let nodes: Value = http
        .get(format!("{}/v1/nodes", control.url))
        .bearer_auth(OPERATOR)
        .send()
        .expect("nodes")
        .json()
        .expect("json");
    assert_eq!(common::nodes_up(&nodes), 1, "{nodes}");
    // A node's token (a compromised node) cannot pose as an ingest server and send every
    // node's telemetry, and token, elsewhere; a user's neither.
    for token in [NODE_TOKEN, OPERATOR.replace("operator", "nobody").as_str()] {
        let hijack = http
            .post(format!("{}/v1/cluster/latest", control.url))
            .bearer_auth(token)
            .json(&json!({"from": "ingest-a", "url": "http://attacker:1", "batches": []}))
            .send()
            .expect("push");
        assert!(
            matches!(hijack.status().as_u16(), 401 | 403),
            "{}",
            hijack.status()
        );
    }
    let sync_url = sync(&http, &control.url, "real-2");
    assert_eq!(sync_url.as_deref(), Some(ingest.url.as_str()));
    // An ingest server that is not configured is refused, naming where to add it.
    let stranger = start_ingest(dir, "ingest-x", &control.url);
    wait_for("the stranger's refusal in its log", || {
        stranger
            .log()
            .contains("is not one of this control server's [[cluster.ingest]]")
            .then_some(())
    });
    assert!(ingest.terminate().success());
}
