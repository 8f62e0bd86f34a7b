//! Slow-rank detection end to end: two agents read their GPUs through the stand-in NVML
//! library (nvml-wrapper's real code path), a two-node gang of four GPUs runs on them, and the
//! stand-in throttles one GPU (SM clock and power down, thermal and hardware slowdown reasons
//! set). `JobStraggler` fires within a minute of the job starting and names that GPU's rank
//! only, `job_stragglers` lists the evidence, and the rule's optional remediation drains the
//! node with a reason that names the job and the rank, while the job runs on.

mod common;

use common::standin::{self, Agent};
use common::{Perch, wait_for};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn stragglers_alerts(perch: &Perch) -> Vec<Value> {
    perch.get("/v1/alerts")["alerts"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|a| a["labels"]["alertname"] == "JobStraggler")
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_throttled_gpu_of_a_two_node_gang_is_flagged_within_a_minute_as_its_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        r#"
[alerts]
evaluation_interval = "1s"
[alerts.builtin]
disable = ["StoreDiskFull", "GpuThrottled"]
[alerts.builtin.actions]
JobStraggler = ["drain_node"]
[alerts.remediation]
max_fraction_out = 0.5
"#,
        &[],
    );
    let lib = standin::library();
    let _agents: Vec<Agent> = (0..2)
        .map(|n| {
            Agent::start(
                dir.path(),
                &perch.url,
                n,
                &lib,
                &standin::busy_pair(n, n == 1),
            )
        })
        .collect();
    perch.wait_nodes_up(2);
    let submitted: Value = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", perch.url))
        .json(
            &json!({"name": "train", "command": ["sleep", "600"], "nodes": 2,
                      "gpus_per_node": 2, "user": "alice", "time_limit_secs": 3600}),
        )
        .send()
        .expect("submit")
        .json()
        .expect("json");
    let id = submitted["id"].as_u64().expect("job id");
    wait_for("the gang to run", || {
        (perch.job(id)["state"] == "running").then_some(())
    });
    let started = Instant::now();
    // RANK as perch starts it: the place of gpu-1's GPU 1 in the placement, node by node.
    let rank = standin::rank_of(&perch.job(id), "gpu-1", 1).expect("gpu-1's GPU 1 is the job's");
    let alert = wait_for("JobStraggler firing", || {
        stragglers_alerts(&perch)
            .into_iter()
            .find(|a| a["state"] == "firing")
    });
    let took = started.elapsed();
    eprintln!("JobStraggler fired {took:?} after the gang started running");
    assert!(took <= Duration::from_secs(60), "flagged after {took:?}");
    let labels = &alert["labels"];
    assert_eq!(labels["job"], id.to_string(), "{alert}");
    assert_eq!(labels["node"], "gpu-1", "{alert}");
    assert_eq!(labels["gpu"], "1", "{alert}");
    assert_eq!(labels["rank"], rank.to_string(), "{alert}");
    assert_eq!(labels["user"], "alice", "{alert}");
    assert!(
        alert["values"]["measures_behind"].as_f64() >= Some(2.0),
        "{alert}"
    );
    assert_eq!(alert["values"]["slowdown_percent"], 100.0, "{alert}");
    // The evidence, and no other rank.
    let rows = perch.sql(&format!(
        "SELECT rank, node, gpu, metric, value, gang_median, throttle_reasons FROM job_stragglers \
         WHERE job = {id} ORDER BY metric"
    ));
    assert!(!rows.is_empty());
    for r in &rows {
        assert_eq!(r["rank"], rank, "{r}");
        assert_eq!(r["node"], "gpu-1", "{r}");
        assert!(
            r["throttle_reasons"]
                .as_str()
                .is_some_and(|t| t.contains("hw_slowdown")),
            "{r}"
        );
    }
    let clock = rows
        .iter()
        .find(|r| r["metric"] == "sm_clock_mhz")
        .expect("the SM clock is behind");
    assert_eq!(clock["value"], 1100.0, "{clock}");
    assert_eq!(clock["gang_median"], 1980.0, "{clock}");
    assert_eq!(stragglers_alerts(&perch).len(), 1, "one rank is slow");
    // The remediation: gpu-1 is drained, the reason names the job and the rank, the job runs on.
    let node = wait_for("gpu-1 drained", || {
        perch
            .sql("SELECT state, reason FROM nodes WHERE node = 'gpu-1'")
            .into_iter()
            .find(|n| n["state"] == "drained")
    });
    let reason = node["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("JobStraggler")
            && reason.contains(&format!("Job {id}"))
            && reason.contains(&format!("rank {rank} (gpu-1 GPU 1)")),
        "{node}"
    );
    assert_eq!(perch.job(id)["state"], "running");
}
