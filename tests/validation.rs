//! Validation end to end: the real server and agents, the agents reading their GPUs from the
//! stand-in NVML library (nvml-wrapper's real code path), the built-in check run by the agent
//! as `perch __validate-gpus`. An operator's validation of a healthy node resumes it (and
//! never lifts another operator's drain); a faulty GPU keeps the node drained with the reason;
//! an ordinary user is refused; a hanging command times out and the node stays drained while
//! the server answers; perch's remediation resumes the node it drained only after a
//! validation passed.

mod common;

use common::standin::{self, Agent};
use common::{AGENT, ALICE, OPERATOR, Perch, client, role_tokens, wait_for};
use serde_json::{Value, json};
use std::path::Path;

/// Two H100s; `faulty` GPU 1 has uncorrected ECC errors since the driver loaded; `xid_at`
/// makes GPU 0 report XID 79 that many seconds after NVML opens.
fn scenario(node: &str, faulty: bool, xid_at: Option<f64>) -> Value {
    let gpu = |i: usize| {
        let mut set = json!({
            "util_gpu": 0, "util_memory": 0,
            "memory_used_bytes": 0, "memory_total_bytes": 85_520_809_984_u64,
            "power_mw": 70_000, "temperature_c": 35, "sm_clock_mhz": 1980,
            "ecc_uncorrected_volatile": 0
        });
        if faulty && i == 1 {
            set["ecc_uncorrected_volatile"] = json!(2);
        }
        let events = match xid_at {
            Some(at) if i == 0 => json!([{"at": at, "kind": "xid", "xid": 79}]),
            _ => json!([]),
        };
        json!({
            "uuid": format!("GPU-VALIDATE-{node}-{i}"),
            "name": "NVIDIA H100 80GB HBM3",
            "timeline": [{"at": 0, "set": set}],
            "events": events,
        })
    };
    json!({"clock": "seconds", "gpus": [gpu(0), gpu(1)]})
}

/// `perch agent` for `node` on the stand-in playing `scenario`, with `token` if any; killed
/// when dropped.
fn standin_agent(
    dir: &Path,
    server: &str,
    node: &str,
    scenario: &Value,
    token: Option<&str>,
) -> Agent {
    let env: Vec<(&str, &str)> = token.map(|t| ("PERCH_TOKEN", t)).into_iter().collect();
    Agent::start_named(dir, server, node, &standin::library(), scenario, &env)
}

/// `perch server` with `config` (TOML) in `dir/perch.toml`, plus a tokens file with the
/// common test tokens when `tokens` (the agent's bound to `gpu-0`).
fn server(dir: &Path, config: &str, tokens: bool) -> Perch {
    let mut text = String::from("[server]\npg_listen = \"\"\n");
    if tokens {
        let file = dir.join("tokens.toml");
        std::fs::write(&file, role_tokens("gpu-0")).expect("tokens");
        text.push_str(&format!("tokens_file = \"{}\"\n", file.display()));
    }
    text.push_str(config);
    common::server_with_config(dir, &text, &[])
}

/// Nothing but what a test asks for: no rule drains a node under a test's feet.
const NO_REMEDIATION: &str = "[alerts.remediation]\nenabled = false\n";

/// (state, reason) of `node` in the `nodes` table, read with `token`.
fn node(perch: &Perch, token: Option<&str>, node: &str) -> (String, Option<String>) {
    node_if_known(perch, token, node).unwrap_or_else(|| panic!("no node {node}"))
}

fn node_if_known(
    perch: &Perch,
    token: Option<&str>,
    node: &str,
) -> Option<(String, Option<String>)> {
    let rows = sql(
        perch,
        token,
        &format!("SELECT state, reason FROM nodes WHERE node = '{node}'"),
    );
    let row = rows.first()?;
    Some((
        row["state"].as_str().unwrap_or_default().to_owned(),
        row["reason"].as_str().map(str::to_owned),
    ))
}

fn sql(perch: &Perch, token: Option<&str>, query: &str) -> Vec<Value> {
    let mut request = reqwest::blocking::Client::new()
        .post(format!("{}/v1/sql", perch.url))
        .json(&json!({ "sql": query }));
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    let response = request.send().expect("POST /v1/sql");
    let status = response.status();
    let body: Value = response.json().expect("JSON");
    assert!(status.is_success(), "{query}: {status} {body}");
    body["rows"].as_array().expect("rows").clone()
}

/// `perch validate <args>` against `perch` with `token`: (success, stdout, stderr).
fn validate(perch: &Perch, token: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let mut cmd = client();
    cmd.args(["validate", "--server", &perch.url]).args(args);
    if let Some(t) = token {
        cmd.args(["--token", t]);
    }
    let out = cmd.output().expect("perch validate");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn wait_synced(perch: &Perch, token: Option<&str>, name: &str) {
    wait_for(&format!("{name} to sync"), || {
        (sql(
            perch,
            token,
            &format!("SELECT node FROM nodes WHERE node = '{name}' AND state = 'up'"),
        )
        .len()
            == 1)
            .then_some(())
    });
}

/// The latest run on `node` as `node_validations` has it, once it has a result.
fn finished_run(perch: &Perch, token: Option<&str>, node: &str) -> Value {
    wait_for(&format!("the validation of {node} to finish"), || {
        sql(
            perch,
            token,
            &format!(
                "SELECT * FROM node_validations WHERE node = '{node}' AND result IS NOT NULL \
                 ORDER BY id DESC LIMIT 1"
            ),
        )
        .into_iter()
        .next()
    })
}

#[test]
fn an_operator_validates_a_healthy_node_and_it_is_resumed_but_a_user_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), NO_REMEDIATION, true);
    let _agent = standin_agent(
        dir.path(),
        &perch.url,
        "gpu-0",
        &scenario("gpu-0", false, None),
        Some(AGENT),
    );
    wait_synced(&perch, Some(OPERATOR), "gpu-0");

    // An ordinary user may not: 403 from the route, and the CLI says so.
    let refused = reqwest::blocking::Client::new()
        .post(format!("{}/v1/nodes/gpu-0/validate", perch.url))
        .bearer_auth(ALICE)
        .send()
        .expect("POST validate");
    assert_eq!(refused.status(), 403);
    let (ok, _, err) = validate(&perch, Some(ALICE), &["gpu-0"]);
    assert!(!ok && err.contains("403"), "{err}");
    assert_eq!(node(&perch, Some(OPERATOR), "gpu-0").0, "up", "untouched");

    let (ok, out, err) = validate(&perch, Some(OPERATOR), &["gpu-0"]);
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("GPU 0 (NVIDIA H100 80GB HBM3): healthy"),
        "{out}"
    );
    assert!(
        out.contains("GPU 1 (NVIDIA H100 80GB HBM3): healthy"),
        "{out}"
    );
    assert!(out.contains("validation passed, exit code 0; up"), "{out}");
    assert_eq!(node(&perch, Some(OPERATOR), "gpu-0"), ("up".into(), None));
    let run = finished_run(&perch, Some(OPERATOR), "gpu-0");
    assert_eq!(
        (&run["trigger"], &run["requested_by"], &run["exit_code"]),
        (&json!("operator"), &json!("ops"), &json!(0))
    );
    let mut events: Vec<String> = sql(
        &perch,
        Some(OPERATOR),
        "SELECT kind, outcome FROM events WHERE kind LIKE 'validation%' \
         OR kind IN ('node_drained', 'node_resumed')",
    )
    .iter()
    .map(|e| format!("{} {}", e["kind"], e["outcome"]))
    .collect();
    events.sort();
    assert_eq!(
        events,
        [
            "\"node_drained\" null",
            "\"node_resumed\" null",
            "\"validation_finished\" \"passed\"",
            "\"validation_started\" null",
        ]
    );

    // An operator's drain for another reason stays, whatever the validation says.
    let drained = reqwest::blocking::Client::new()
        .post(format!("{}/v1/nodes/gpu-0/drain", perch.url))
        .bearer_auth(OPERATOR)
        .json(&json!({"reason": "fan noise"}))
        .send()
        .expect("drain");
    assert!(drained.status().is_success());
    let (ok, out, err) = validate(&perch, Some(OPERATOR), &["gpu-0"]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("stays drained by whoever drained it"), "{out}");
    assert_eq!(
        node(&perch, Some(OPERATOR), "gpu-0"),
        ("drained".into(), Some("fan noise".into()))
    );
}

#[test]
fn a_faulty_gpu_keeps_the_node_drained_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = server(dir.path(), NO_REMEDIATION, false);
    let _agent = standin_agent(
        dir.path(),
        &perch.url,
        "gpu-0",
        &scenario("gpu-0", true, None),
        None,
    );
    wait_synced(&perch, None, "gpu-0");
    let (ok, out, err) = validate(&perch, None, &["gpu-0"]);
    assert!(!ok, "a failed validation fails the command: {out}");
    assert!(err.contains("did not pass: failed"), "{err}");
    let reason = "validation failed: exit code 1: GPU 1 (NVIDIA H100 80GB HBM3): 2 uncorrected ECC errors since the driver loaded";
    assert!(out.contains(reason), "{out}");
    assert_eq!(
        node(&perch, None, "gpu-0"),
        ("drained".into(), Some(reason.into()))
    );
    let run = finished_run(&perch, None, "gpu-0");
    assert_eq!(
        (&run["result"], &run["exit_code"]),
        (&json!("failed"), &json!(1))
    );
    assert!(
        run["output"]
            .as_str()
            .is_some_and(|o| o.contains("GPU 0 (NVIDIA H100 80GB HBM3): healthy")),
        "{run}"
    );
    // No job is placed there.
    let submitted: Value = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(&json!({"command": ["true"], "gpus_per_node": 1, "user": "alice"}))
        .send()
        .expect("submit")
        .json()
        .expect("JSON");
    let id = submitted["id"].as_u64().expect("id");
    assert_eq!(perch.job(id)["state"], "pending");
}

#[test]
fn a_hanging_validation_times_out_and_the_node_stays_drained_while_the_server_answers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "{NO_REMEDIATION}[validation]\ncommand = [\"sh\", \"-c\", \"echo checking; sleep 600\"]\ntimeout_secs = 5\n"
    );
    let perch = server(dir.path(), &config, false);
    let _agent = common::Agent::start(
        &perch.url,
        "gpu-0",
        &dir.path().join("agent"),
        2,
        None,
        &["--interval-ms", "200"],
    );
    wait_synced(&perch, None, "gpu-0");
    let (ok, out, err) = validate(&perch, None, &["gpu-0", "--no-wait"]);
    assert!(ok, "{out}\n{err}");
    // While it runs: the node is drained as validating, a second one is refused, the server
    // answers.
    let (state, reason) = node(&perch, None, "gpu-0");
    assert_eq!(state, "drained");
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.starts_with("validating (asked by ")),
        "{reason:?}"
    );
    let again = reqwest::blocking::Client::new()
        .post(format!("{}/v1/nodes/gpu-0/validate", perch.url))
        .send()
        .expect("POST validate");
    let status = again.status();
    let body: Value = again.json().expect("JSON");
    assert_eq!(
        (status.as_u16(), &body["error"]["code"]),
        (409, &json!("validation_running")),
        "{body}"
    );
    let run = finished_run(&perch, None, "gpu-0");
    assert_eq!(run["result"], "timed_out");
    assert_eq!(
        node(&perch, None, "gpu-0"),
        (
            "drained".into(),
            Some("validation failed: timed out after 5 s".into())
        )
    );
    let health = reqwest::blocking::get(format!("{}/healthz", perch.url)).expect("healthz");
    assert!(health.status().is_success());
}

#[test]
fn remediation_resumes_the_node_it_drained_only_after_a_validation_passed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = r#"
[alerts]
evaluation_interval = "1s"

[alerts.builtin]
disable = ["StoreDiskFull"]
event_window = "10s"

[alerts.remediation]
max_concurrent_drains = 10
max_fraction_out = 1.0
resume_after = "1s"
cooldown = "2s"
"#;
    let perch = server(dir.path(), config, false);
    // GPU 0 reports XID 79 (fallen off the bus) 3 s after the agent opens NVML; the
    // validation's own NVML, opened later, plays the scenario from its start.
    let _agent = standin_agent(
        dir.path(),
        &perch.url,
        "gpu-0",
        &scenario("gpu-0", false, Some(3.0)),
        None,
    );
    wait_for("gpu-0 drained by perch's remediation", || {
        let (state, reason) = node_if_known(&perch, None, "gpu-0")?;
        (state == "drained" && reason.is_some_and(|r| r.starts_with("alert"))).then_some(())
    });
    wait_for("gpu-0 resumed", || {
        (node(&perch, None, "gpu-0") == ("up".to_owned(), None)).then_some(())
    });
    let run = finished_run(&perch, None, "gpu-0");
    assert_eq!(
        (&run["trigger"], &run["requested_by"], &run["result"]),
        (&json!("remediation"), &json!("perch"), &json!("passed"))
    );
    let order: Vec<String> = sql(
        &perch,
        None,
        "SELECT kind, action, message FROM events WHERE kind LIKE 'validation%' \
         OR (kind = 'remediation' AND action = 'drain_node') ORDER BY time",
    )
    .iter()
    .map(|e| {
        format!(
            "{}:{}:{}",
            e["kind"].as_str().unwrap_or(""),
            e["action"].as_str().unwrap_or(""),
            e["message"].as_str().unwrap_or("")
        )
    })
    .collect();
    assert_eq!(order.len(), 3, "{order:?}");
    assert!(order[0].starts_with("remediation:drain_node:"), "{order:?}");
    assert!(
        order[1].starts_with("validation_started:remediation:"),
        "{order:?}"
    );
    assert_eq!(
        order[2],
        "validation_finished:remediation:validation of gpu-0 (remediation): passed; resumed"
    );
}
