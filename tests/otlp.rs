//! OpenTelemetry end to end: a job using the real Python OpenTelemetry SDK, with no endpoint
//! in its code, exports its metrics to perch because the agent set `OTEL_*` in its
//! environment; they land in `job_metrics` keyed by job and user. Also the OTLP/JSON encoding
//! and the answer to a malformed body.

mod common;

use common::{Perch, wait_for};
use serde_json::{Value, json};

const SCRIPT: &str = r#"
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

# No endpoint here: OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_RESOURCE_ATTRIBUTES come from perch.
reader = PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=60000)
# One export only (the force_flush below), so the test knows exactly what was sent.
provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
metrics.set_meter_provider(provider)
meter = metrics.get_meter("train")
loss = meter.create_gauge("loss", unit="1")
step_time = meter.create_histogram("step_seconds", unit="s")
samples = meter.create_counter("samples", unit="{sample}")
for step in range(4):
    loss.set(1.0 / (step + 1), {"phase": "train"})
    step_time.record(0.5 + step)
    samples.add(32)
provider.force_flush()
print("exported")
"#;

fn cli(perch: &Perch, args: &[&str]) -> (bool, String, String) {
    perch.cli_as("ada", args)
}

fn job_state(perch: &Perch, id: u64) -> Value {
    reqwest::blocking::get(format!("{}/v1/jobs/{id}", perch.url))
        .expect("GET job")
        .json::<Value>()
        .expect("json")["state"]
        .clone()
}

#[test]
fn a_job_using_the_python_sdk_lands_in_job_metrics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("train.py");
    std::fs::write(&script, SCRIPT).expect("write script");
    let perch = Perch::start(
        &dir.path().join("data"),
        &["up", "--simulate-gpus", "1", "--interval-ms", "200"],
    );
    let script = script.to_string_lossy().into_owned();
    let (ok, out, err) = cli(&perch, &["submit", "--gpus", "1", "--", "python3", &script]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "Submitted job 1");
    let state = wait_for("job 1 to end", || {
        let s = job_state(&perch, 1);
        (s == "completed" || s == "failed").then_some(s)
    });
    let (_, stdout, _) = cli(&perch, &["logs", "1"]);
    let (_, stderr, _) = cli(&perch, &["logs", "1", "--stderr"]);
    assert_eq!(state, "completed", "stdout: {stdout}\nstderr: {stderr}");

    let rows = perch.sql(
        "SELECT metric, kind, unit, value, count, sum, user_name, node, service_name, attributes \
         FROM job_metrics WHERE job = '1' ORDER BY metric",
    );
    let by_name = |name: &str| -> &Value {
        rows.iter()
            .find(|r| r["metric"] == name)
            .unwrap_or_else(|| panic!("no {name} in {rows:?}"))
    };
    assert_eq!(rows.len(), 3, "{rows:?}");
    let loss = by_name("loss");
    assert_eq!(loss["kind"], "gauge");
    assert_eq!(loss["value"].as_f64(), Some(0.25));
    assert_eq!(loss["attributes"], r#"{"phase":"train"}"#);
    let samples = by_name("samples");
    assert_eq!(samples["kind"], "sum");
    assert_eq!(samples["value"].as_f64(), Some(128.0));
    let steps = by_name("step_seconds");
    assert_eq!(steps["kind"], "histogram");
    assert_eq!(steps["count"].as_u64(), Some(4));
    assert_eq!(steps["sum"].as_f64(), Some(8.0));
    assert_eq!(steps["value"].as_f64(), Some(2.0));
    assert_eq!(steps["unit"], "s");
    for row in &rows {
        assert_eq!(row["user_name"], "ada");
        assert_eq!(row["service_name"], "perch-job-1");
        assert_ne!(
            row["node"], "otlp",
            "host.name should name the agent's node"
        );
    }
}

/// A job that exports every second for a minute, as a training loop with the SDK's periodic
/// reader does.
const EVERY_SECOND: &str = r#"
import time
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

reader = PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=1000)
provider = MeterProvider(metric_readers=[reader])
metrics.set_meter_provider(provider)
loss = metrics.get_meter("train").create_gauge("loss")
start = time.time()
step = 0
while time.time() - start < 60:
    step += 1
    loss.set(1.0 / step)
    time.sleep(0.1)
provider.shutdown()
"#;

/// One OTLP export from a job stopped its node's telemetry for good (the receiver's
/// clock-sized batch numbers shadowed the agent's). While a job exports every second for a
/// minute, the node's GPU samples must keep growing, every 5 s, and the node must stay up in
/// `perch nodes` and on `/metrics`, with no batch answered as a duplicate.
#[test]
fn a_job_exporting_every_second_never_stops_its_nodes_telemetry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("train.py");
    std::fs::write(&script, EVERY_SECOND).expect("write script");
    let perch = Perch::start(
        &dir.path().join("data"),
        &["up", "--simulate-gpus", "1", "--interval-ms", "250"],
    );
    let script = script.to_string_lossy().into_owned();
    let (ok, _, err) = cli(&perch, &["submit", "--gpus", "1", "--", "python3", &script]);
    assert!(ok, "{err}");
    let exported = |perch: &Perch| perch.scalar("SELECT count(*) FROM job_metrics WHERE job = '1'");
    wait_for("the job's first export", || {
        (exported(&perch) > 0).then_some(())
    });
    let node = perch.sql("SELECT node FROM job_metrics WHERE job = '1' LIMIT 1")[0]["node"]
        .as_str()
        .expect("node")
        .to_owned();
    let samples = |perch: &Perch| {
        perch.scalar(&format!(
            "SELECT count(*) FROM gpu_samples WHERE node = '{node}'"
        ))
    };
    let mut last = (samples(&perch), exported(&perch));
    for round in 0..11 {
        std::thread::sleep(std::time::Duration::from_secs(5));
        let now = (samples(&perch), exported(&perch));
        assert!(
            now.0 > last.0,
            "round {round}: gpu_samples of {node} stuck at {} while the job exported ({} -> {} points)\n{}",
            now.0,
            last.1,
            now.1,
            perch.log()
        );
        assert!(
            now.1 > last.1,
            "round {round}: the job's exports stopped arriving"
        );
        last = now;
    }
    let nodes = perch.get("/v1/nodes");
    let shown = nodes["nodes"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["name"] == node.as_str()))
        .unwrap_or_else(|| panic!("{node} missing from {nodes}"));
    assert_eq!(shown["state"], "up", "{shown}");
    let metrics = reqwest::blocking::get(format!("{}/metrics", perch.url))
        .expect("GET /metrics")
        .text()
        .expect("text");
    assert!(
        metrics.contains(&format!("perch_node_up{{node=\"{node}\"}} 1")),
        "perch_node_up is not 1 for {node}"
    );
    assert!(
        !metrics.lines().any(|l| l
            .starts_with("perch_ingest_requests_total{outcome=\"duplicate\"}")
            && !l.ends_with(" 0")),
        "agent batches were answered as duplicates:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("perch_ingest"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A minimal OTLP/JSON export: one gauge point for job `job`.
fn gauge(job: &str, value: f64) -> Value {
    json!({"resourceMetrics": [{
        "resource": {"attributes": [{"key": "perch.job.id", "value": {"stringValue": job}}]},
        "scopeMetrics": [{"metrics": [{"name": "loss", "gauge": {"dataPoints": [{
            "timeUnixNano": (common::now_ms() as u64 * 1_000_000).to_string(),
            "asDouble": value
        }]}}]}]
    }]})
}

fn post(perch: &Perch, body: &Value) {
    let response = reqwest::blocking::Client::new()
        .post(format!("{}/v1/metrics", perch.url))
        .json(body)
        .send()
        .expect("POST /v1/metrics");
    assert_eq!(response.status(), 200);
}

/// An answered export is in the write-ahead log, and the receiver's batch numbers keep rising
/// across a restart, so exports after it are not taken for duplicates.
#[test]
fn exports_survive_kill_9_and_later_ones_are_not_deduplicated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut perch = Perch::start(dir.path(), &["server"]);
    post(&perch, &gauge("5", 1.0));
    post(&perch, &gauge("5", 2.0));
    perch.kill();
    let perch = Perch::start(dir.path(), &["server"]);
    post(&perch, &gauge("5", 3.0));
    let rows = perch.sql("SELECT value FROM job_metrics WHERE job = '5' ORDER BY value");
    let values: Vec<f64> = rows.iter().filter_map(|r| r["value"].as_f64()).collect();
    assert_eq!(values, vec![1.0, 2.0, 3.0]);
}

#[test]
fn otlp_json_is_stored_and_malformed_bodies_get_400() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(dir.path(), &["server"]);
    let client = reqwest::blocking::Client::new();
    let now_ns = (common::now_ms() as u64 * 1_000_000).to_string();
    let body = json!({
        "resourceMetrics": [{
            "resource": {"attributes": [
                {"key": "perch.job.id", "value": {"stringValue": "77"}},
                {"key": "perch.user", "value": {"stringValue": "bob"}},
                {"key": "service.name", "value": {"stringValue": "trainer"}}
            ]},
            "scopeMetrics": [{
                "scope": {"name": "hand"},
                "metrics": [{
                    "name": "tokens_per_second",
                    "unit": "1/s",
                    "gauge": {"dataPoints": [{
                        "timeUnixNano": now_ns,
                        "asDouble": 1500.5,
                        "attributes": [{"key": "rank", "value": {"intValue": "3"}}]
                    }]}
                }]
            }]
        }]
    });
    let response = client
        .post(format!("{}/v1/metrics", perch.url))
        .json(&body)
        .send()
        .expect("POST /v1/metrics");
    assert_eq!(response.status(), 200);
    assert!(
        response
            .headers()
            .get("content-type")
            .is_some_and(|v| v == "application/json")
    );
    let answer: Value = response.json().expect("JSON answer");
    assert!(answer.get("partialSuccess").is_none(), "{answer}");

    let rows = perch.sql(
        "SELECT node, user_name, service_name, metric, kind, value, attributes FROM job_metrics WHERE job = '77'",
    );
    assert_eq!(
        rows,
        vec![json!({
            "node": "otlp", "user_name": "bob", "service_name": "trainer",
            "metric": "tokens_per_second", "kind": "gauge", "value": 1500.5,
            "attributes": "{\"rank\":3}"
        })]
    );

    for (content_type, body) in [
        ("application/x-protobuf", &b"\xff\xff\xff not protobuf"[..]),
        ("application/json", &b"{\"resourceMetrics\": 5}"[..]),
    ] {
        let response = client
            .post(format!("{}/v1/metrics", perch.url))
            .header("content-type", content_type)
            .body(body.to_vec())
            .send()
            .expect("POST /v1/metrics");
        assert_eq!(response.status(), 400, "{content_type}");
        let answer: Value = response.json().expect("JSON error");
        assert_eq!(answer["error"]["code"], "malformed_otlp", "{answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("ExportMetricsServiceRequest")),
            "{answer}"
        );
    }
    let response = client
        .post(format!("{}/v1/metrics", perch.url))
        .header("content-type", "text/plain")
        .body("loss 1")
        .send()
        .expect("POST /v1/metrics");
    assert_eq!(response.status(), 415);
}

/// With tokens configured, `POST /v1/metrics` took anyone's points (an anonymous
/// caller stored a forged `job_metrics` row). Now a job pushes with the token perch hands it in
/// `OTEL_EXPORTER_OTLP_HEADERS` (the SDK sends it unasked), its points are filed under its job
/// and user whatever its attributes claim, the token opens nothing else, and a user's token
/// pushes as that user only.
#[test]
fn with_tokens_a_job_pushes_with_its_own_token_and_nobody_pushes_for_others() {
    const ALICE: &str = "alice-token-0123456789";
    const BOB: &str = "bob-token-0123456789ab";
    const AGENT: &str = "agent-token-0123456789";
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_tokens(
        dir.path(),
        &format!(
            "[[tokens]]\ntoken = \"{ALICE}\"\nuser = \"alice\"\nrole = \"user\"\n\
             [[tokens]]\ntoken = \"{BOB}\"\nuser = \"bob\"\nrole = \"user\"\n\
             [[tokens]]\ntoken = \"{AGENT}\"\nuser = \"agent\"\nrole = \"agent\"\nnodes = [\"gpu-a\"]\n"
        ),
    );
    let _agent = common::Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        Some(AGENT),
        &["--interval-ms", "200"],
    );
    let script = dir.path().join("train.py");
    std::fs::write(
        &script,
        format!("import os\nprint(os.environ['OTEL_EXPORTER_OTLP_HEADERS'], flush=True)\n{SCRIPT}"),
    )
    .expect("script");
    let client = reqwest::blocking::Client::new();
    let submitted = client
        .post(format!("{}/v1/jobs", perch.url))
        .bearer_auth(ALICE)
        .json(&json!({"command": ["python3", script.to_str().expect("utf-8")], "gpus_per_node": 1}))
        .send()
        .expect("submit");
    assert_eq!(submitted.status().as_u16(), 201);
    let get = |path: &str, token: &str| -> Value {
        client
            .get(format!("{}{path}", perch.url))
            .bearer_auth(token)
            .send()
            .expect("get")
            .json()
            .expect("json")
    };
    let state = wait_for("the job to end", || {
        let s = get("/v1/jobs/1", ALICE)["state"].clone();
        (s == "completed" || s == "failed").then_some(s)
    });
    let printed = client
        .get(format!("{}/v1/jobs/1/logs", perch.url))
        .bearer_auth(ALICE)
        .send()
        .expect("logs")
        .text()
        .expect("text");
    assert_eq!(state, "completed", "{printed}");
    let sql = |query: &str| -> Vec<Value> {
        let r: Value = client
            .post(format!("{}/v1/sql", perch.url))
            .bearer_auth(ALICE)
            .json(&json!({"sql": query}))
            .send()
            .expect("sql")
            .json()
            .expect("json");
        r["rows"].as_array().cloned().unwrap_or_default()
    };
    let rows = sql("SELECT DISTINCT job, user_name FROM job_metrics");
    assert_eq!(
        rows,
        vec![json!({"job": "1", "user_name": "alice"})],
        "the SDK's export"
    );

    // The token the job was given, as it printed it.
    let token = printed
        .split("Bearer%20")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no token in the job's output: {printed}"))
        .to_owned();
    let push = |token: Option<&str>, job: &str, user: &str| {
        let mut body = gauge(job, 9.0);
        body["resourceMetrics"][0]["resource"]["attributes"]
            .as_array_mut()
            .expect("attributes")
            .push(json!({"key": "perch.user", "value": {"stringValue": user}}));
        let mut request = client.post(format!("{}/v1/metrics", perch.url)).json(&body);
        if let Some(t) = token {
            request = request.bearer_auth(t);
        }
        request.send().expect("push").status().as_u16()
    };
    assert_eq!(push(None, "1", "alice"), 401, "anonymous");
    // The job's token (within its grace after the end) files a forged claim under its own job.
    assert_eq!(push(Some(&token), "99", "bob"), 200);
    // Bob's token can neither push as alice nor into her job.
    assert_eq!(push(Some(BOB), "1", "alice"), 403);
    let rows = sql("SELECT job, user_name FROM job_metrics WHERE value = 9.0 ORDER BY user_name");
    assert_eq!(rows, vec![json!({"job": "1", "user_name": "alice"})]);
    // The job's token opens nothing else; a made-up one nothing at all.
    let r = client
        .get(format!("{}/v1/jobs", perch.url))
        .bearer_auth(&token)
        .send()
        .expect("get");
    assert_eq!(r.status().as_u16(), 403);
    let forged = format!("perch-job.1.1.{}", "0".repeat(64));
    assert_eq!(push(Some(&forged), "1", "alice"), 401);
}

/// Alice's token naming bob's job (`perch.job.id`) filed rows under it, and 210
/// metric names filled its series limit, so bob's own metric was dropped. Now points for a job
/// are taken only from its owner (or an operator, or the job's own token): alice's are refused,
/// 403 when nothing of her export is left and as a partial success when some is, and nothing of
/// hers lands under bob's job, while bob's own points do.
#[test]
fn a_users_token_cannot_write_metrics_into_another_users_job() {
    use common::{ALICE, BOB, OPERATOR};
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_tokens(dir.path(), &common::role_tokens("gpu-a"));
    let client = reqwest::blocking::Client::new();
    let submit = |token: &str| -> String {
        let r = client
            .post(format!("{}/v1/jobs", perch.url))
            .bearer_auth(token)
            .json(&json!({"command": ["true"]}))
            .send()
            .expect("submit");
        assert_eq!(r.status().as_u16(), 201);
        r.json::<Value>().expect("json")["id"].to_string()
    };
    let bobs = submit(BOB);
    let alices = submit(ALICE);
    let export = |token: &str, body: &Value| -> (u16, Value) {
        let r = client
            .post(format!("{}/v1/metrics", perch.url))
            .bearer_auth(token)
            .json(body)
            .send()
            .expect("POST /v1/metrics");
        (r.status().as_u16(), r.json().unwrap_or(Value::Null))
    };
    let count = |job: &str| -> i64 {
        let r: Value = client
            .post(format!("{}/v1/sql", perch.url))
            .bearer_auth(OPERATOR)
            .json(&json!({"sql": format!("SELECT count(*) AS n FROM job_metrics WHERE job = '{job}'")}))
            .send()
            .expect("sql")
            .json()
            .expect("json");
        r["rows"][0]["n"].as_i64().unwrap_or_else(|| panic!("{r}"))
    };
    // 210 metric names from alice, naming bob's job.
    let mut flood = gauge(&bobs, 1.0);
    let one = flood["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0].clone();
    flood["resourceMetrics"][0]["scopeMetrics"][0]["metrics"] = (0..210)
        .map(|i| {
            let mut m = one.clone();
            m["name"] = format!("alice_{i}").into();
            m
        })
        .collect();
    let (status, answer) = export(ALICE, &flood);
    assert_eq!(status, 403, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "210 data point(s) refused: job \"{bobs}\" belongs to bob, not alice"
        )),
        "{answer}"
    );
    // A job that does not exist yet cannot be filled ahead of its owner either.
    let (status, answer) = export(ALICE, &gauge("999", 1.0));
    assert_eq!(status, 403, "{answer}");
    assert!(
        answer.to_string().contains("names no job of this server"),
        "{answer}"
    );
    // One export with a resource for each job: hers is stored, the other refused and said so.
    let mut both = gauge(&alices, 2.0);
    let theirs = gauge(&bobs, 2.0)["resourceMetrics"][0].clone();
    both["resourceMetrics"]
        .as_array_mut()
        .expect("resources")
        .push(theirs);
    let (status, answer) = export(ALICE, &both);
    assert_eq!(status, 200, "{answer}");
    // An int64, which OTLP/JSON may write as a string.
    assert_eq!(
        answer["partialSuccess"]["rejectedDataPoints"]
            .to_string()
            .trim_matches('"'),
        "1",
        "{answer}"
    );
    assert!(
        answer["partialSuccess"]["errorMessage"]
            .as_str()
            .is_some_and(|m| m.contains("belongs to bob")),
        "{answer}"
    );
    assert_eq!(count(&bobs), 0, "alice's points landed under bob's job");
    assert_eq!(count(&alices), 1);
    // Bob's own points, and an operator's, land.
    let (status, answer) = export(BOB, &gauge(&bobs, 3.0));
    assert_eq!(
        (status, answer.get("partialSuccess")),
        (200, None),
        "{answer}"
    );
    let (status, _) = export(OPERATOR, &gauge(&bobs, 4.0));
    assert_eq!(status, 200);
    assert_eq!(count(&bobs), 2);
}
