//! The workload `perch demo` runs on its simulated cluster, so every view has something to
//! show: jobs from a few users and accounts filling about three quarters of the GPUs, two
//! gangs of whole nodes waiting in the queue (no quarter of the nodes can hold them), one allocated-but-idle job per account, and simulated trainers
//! that push loss and throughput over OpenTelemetry the way a real training script would.
//!
//! The jobs are real processes (`sleep`) started by the agents; their GPUs are simulated and
//! follow each job's `sim_profile`. The pushed metrics carry `perch.simulated = true`, so
//! they are stored and exported as simulated.

use serde_json::{Value, json};
use std::time::Duration;

const USERS: [(&str, &str); 4] = [
    ("alice", "vision"),
    ("bob", "nlp"),
    ("chen", "nlp"),
    ("dana", "speech"),
];
const PROFILES: [&str; 3] = ["steady", "bursty", "idle"];

/// Submits the workload once the `nodes` agents have registered, then pushes simulated
/// training metrics for the running jobs every two seconds until the task is dropped.
pub async fn run(base: String, nodes: u32, gpus_per_node: u32) {
    perch_model::tls::use_ring();
    let client = reqwest::Client::new();
    if let Err(e) = submit(&client, &base, nodes, gpus_per_node).await {
        tracing::warn!(error = %e, "demo workload: could not submit the demo jobs");
        return;
    }
    let mut step: u64 = 0;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        step += 1;
        if let Err(e) = push(&client, &base, step).await {
            tracing::debug!(error = %e, "demo workload: pushing simulated training metrics failed");
        }
    }
}

async fn submit(
    client: &reqwest::Client,
    base: &str,
    nodes: u32,
    gpus_per_node: u32,
) -> Result<(), String> {
    // The scheduler learns a node when its agent first syncs (a node whose telemetry came
    // first is listed without a sync). The demo waits for every node to, so that its jobs
    // spread over the whole fleet, but a large fleet on a small machine may take longer: its
    // jobs then go in anyway, each asking to wait for nodes that could run it
    // (`hold_until_fits`: a gang of whole nodes is otherwise refused as wider than the
    // nodes seen so far).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let known = client
            .get(format!("{base}/v1/nodes"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status);
        if let Ok(r) = known
            && let Ok(v) = r.json::<Value>().await
            && v["nodes"].as_array().is_some_and(|n| {
                n.iter()
                    .filter(|n| !n["last_sync_secs_ago"].is_null())
                    .count() as u32
                    >= nodes
            })
        {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            tracing::info!(
                nodes,
                "demo workload: not every simulated node has synced after 60 s; submitting, jobs wait for the nodes they need"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let total = nodes * gpus_per_node;
    let mut planned = 0;
    let mut i = 0usize;
    // Fill about three quarters...
    while planned < total * 3 / 4 {
        let (user, account) = USERS[i % USERS.len()];
        let profile = PROFILES[i % PROFILES.len()];
        let gpus = if i % 4 == 3 { gpus_per_node.min(2) } else { 1 };
        let request = json!({
            "name": format!("demo-{profile}-{i}"),
            "command": ["sleep", "86400"],
            "gpus_per_node": gpus,
            "user": user,
            "account": account,
            "time_limit_secs": 86400,
            "sim_profile": profile,
            "preemptible": i.is_multiple_of(2),
        });
        post_job(client, base, &request).await?;
        planned += gpus;
        i += 1;
    }
    // ... then queue two gangs of whole nodes that cannot start while those run: with at
    // most a quarter of the GPUs free, at most a quarter of the nodes are free.
    let gang_nodes = nodes / 4 + 1;
    for (k, (user, account)) in USERS.iter().take(2).enumerate() {
        let request = json!({
            "name": format!("demo-gang-{k}"),
            "command": ["sleep", "86400"],
            "nodes": gang_nodes,
            "gpus_per_node": gpus_per_node,
            "user": user,
            "account": account,
            "time_limit_secs": 86400,
            "sim_profile": "steady",
        });
        post_job(client, base, &request).await?;
        i += 1;
    }
    tracing::info!(
        jobs = i,
        "demo workload submitted (simulated GPUs follow each job's profile)"
    );
    Ok(())
}

async fn post_job(client: &reqwest::Client, base: &str, request: &Value) -> Result<(), String> {
    let mut request = request.clone();
    request["hold_until_fits"] = json!(true);
    client
        .post(format!("{base}/v1/jobs"))
        .json(&request)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map(|_| ())
        .map_err(|e| format!("submitting {request}: {e}"))
}

/// One OTLP/JSON export per running, busy job: a falling loss and a throughput.
async fn push(client: &reqwest::Client, base: &str, step: u64) -> Result<(), String> {
    let jobs: Value = client
        .get(format!("{base}/v1/jobs?state=running"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    for job in jobs["jobs"].as_array().into_iter().flatten() {
        let profile = job["request"]["sim_profile"].as_str().unwrap_or("steady");
        if profile == "idle" {
            continue; // allocated but idle: it reports nothing, which is the point
        }
        let id = job["id"].as_u64().unwrap_or_default();
        let attr = |k: &str, v: String| json!({"key": k, "value": {"stringValue": v}});
        let progress = (step + id * 7) as f64;
        let loss = 0.2 + 2.3 / (1.0 + progress / 40.0);
        let throughput = 900.0 + 100.0 * ((progress / 5.0).sin());
        let point = |v: f64| json!({"timeUnixNano": now_ns.to_string(), "asDouble": v});
        let body = json!({"resourceMetrics": [{
            "resource": {"attributes": [
                attr("service.name", "perch-demo-simulated-trainer".into()),
                attr("perch.job.id", id.to_string()),
                attr("perch.user", job["request"]["user"].as_str().unwrap_or("").to_owned()),
                attr("perch.simulated", "true".into()),
            ]},
            "scopeMetrics": [{"scope": {"name": "perch-demo"}, "metrics": [
                {"name": "loss", "unit": "1", "gauge": {"dataPoints": [point(loss)]}},
                {"name": "samples_per_second", "unit": "1/s", "gauge": {"dataPoints": [point(throughput)]}},
            ]}],
        }]});
        client
            .post(format!("{base}/v1/metrics"))
            .json(&body)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}
