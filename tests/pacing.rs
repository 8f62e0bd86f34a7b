//! Syncs paced to the fleet (`server.max_syncs_per_second`, `SyncResponse::next_sync_ms`): a
//! large fleet's agents sync less often, so their syncs stay within what the server takes,
//! but an agent whose job exited reports it at once instead of waiting for its next turn.

mod common;

use common::{Agent, Perch, wait_for};
use reqwest::blocking::Client;
use serde_json::{Value, json};

#[test]
fn a_paced_agent_syncs_less_often_but_reports_an_exit_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    // 100 nodes at 10 syncs a second: one sync per node every 10 s.
    std::fs::write(
        &config,
        "[server]\npg_listen = \"\"\nmax_syncs_per_second = 10\n",
    )
    .expect("config");
    let perch = Perch::start(
        &dir.path().join("server"),
        &["server", "--config", config.to_str().expect("utf-8")],
    );
    let http = Client::new();
    let sync = |node: &str, gpus: u32| -> Value {
        http.post(format!("{}/v1/agent/sync", perch.url))
            .json(&json!({"node": node, "gpus": gpus, "gpu_model": "none", "agent_id": format!("{:016x}", node.len() as u64 * 7919 + u64::from(node.as_bytes()[node.len() - 1]))}))
            .send()
            .expect("sync")
            .error_for_status()
            .expect("answered")
            .json()
            .expect("json")
    };
    // 99 nodes of one GPU (the job below needs two: it runs on the real agent's node).
    for i in 0..99 {
        sync(&format!("quiet-{i:02}"), 1);
    }
    let _agent = Agent::start(&perch.url, "real", &dir.path().join("agent"), 2, None, &[]);
    wait_for("the agent's node up", || {
        let nodes = perch.get("/v1/nodes");
        nodes["nodes"]
            .as_array()?
            .iter()
            .find(|n| {
                n["name"] == "real" && n["state"] == "up" && !n["last_sync_secs_ago"].is_null()
            })
            .map(drop)
    });
    assert_eq!(sync("quiet-00", 1)["next_sync_ms"], 10_000);
    // The agent keeps the pace: at some point its last sync is over 2 s old (at its own
    // 500 ms it never would be).
    wait_for("a paced gap between the agent's syncs", || {
        let nodes = perch.get("/v1/nodes");
        let ago = nodes["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == "real")?["last_sync_secs_ago"]
            .as_f64()?;
        (ago >= 2.0).then_some(())
    });
    // A job's exit is reported at once, not at the next paced sync.
    let ended = dir.path().join("ended");
    let job: Value = http
        .post(format!("{}/v1/jobs", perch.url))
        .json(&json!({
            "command": ["sh", "-c", format!("sleep 1; date +%s%3N > {}", ended.display())],
            "gpus_per_node": 2,
            "user": "alice",
        }))
        .send()
        .expect("submit")
        .json()
        .expect("json");
    let id = job["id"].as_u64().expect("id");
    let end_ms = wait_for("the job's end recorded", || {
        perch.job(id)["end_ms"].as_i64()
    });
    let wrote: i64 = std::fs::read_to_string(&ended)
        .expect("the job ran")
        .trim()
        .parse()
        .expect("ms");
    assert!(
        end_ms - wrote < 3_000,
        "the exit was recorded {} ms after the job ended; the pace is 10 s",
        end_ms - wrote
    );
}
