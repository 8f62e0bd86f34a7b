//! Fractional GPU sharing end to end: `perch submit --gpu-fraction` on a node that allows
//! sharing packs shared jobs onto one GPU, the agent gives each the MPS limits, and a node that
//! does not share never takes them.

mod common;

use common::{Perch, wait_for};
use serde_json::Value;

fn cli(perch: &Perch, args: &[&str]) -> (bool, String, String) {
    perch.cli_as("alice", args)
}

fn job(perch: &Perch, id: u64) -> Value {
    perch.job(id)
}

fn submit_share(perch: &Perch, fraction: &str, script: &str) {
    let (ok, out, err) = cli(
        perch,
        &[
            "submit",
            "--gpu-fraction",
            fraction,
            "--gpu-memory-gb",
            "4",
            "--time",
            "5m",
            // Simulated GPUs then show the job as holding memory at 0% utilization.
            "--sim-profile",
            "idle",
            "--",
            "sh",
            "-c",
            script,
        ],
    );
    assert!(ok && out.starts_with("Submitted job"), "{out}{err}");
}

#[test]
fn shared_jobs_pack_onto_one_gpu_with_their_mps_limits() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Free simulated GPUs play phases of load (training, bursty, idle) on their own, and a
    // share only goes where the measured load leaves room: with 8 GPUs some always does.
    let perch = Perch::start(
        dir.path(),
        &[
            "up",
            "--simulate-gpus",
            "8",
            "--interval-ms",
            "200",
            "--gpu-sharing",
        ],
    );
    // Both quarter-GPU jobs run at once on one GPU (the first waits until the second started).
    let script = "echo $CUDA_VISIBLE_DEVICES $PERCH_GPU_FRACTION $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; \
                  for i in $(seq 100); do [ -e ../2/stdout ] && break; sleep 0.1; done";
    submit_share(&perch, "0.25", script);
    // The second share is placed by the GPU's measured load: wait until the telemetry of job
    // 1's GPU shows job 1 (its `idle` profile: 0%), not the load phase the free GPU played
    // before, whose bursts could leave no room for a second quarter.
    let first = wait_for("job 1 to run", || {
        let j = job(&perch, 1);
        (j["state"] == "running").then_some(j)
    });
    let gpu = first["placement"][0]["gpus"][0].as_u64().expect("its GPU");
    let since = first["start_ms"].as_i64().expect("started");
    wait_for("job 1's GPU to show job 1", || {
        let idle = perch.scalar(&format!(
            "SELECT count(*) FROM gpu_samples WHERE gpu = {gpu} AND utilization_gpu_pct = 0 \
             AND time > to_timestamp_millis({since}) + INTERVAL '500 milliseconds'"
        ));
        (idle >= 2).then_some(())
    });
    submit_share(&perch, "0.25", script);
    let mut ended = Vec::new();
    for id in [1, 2] {
        let j = wait_for(&format!("job {id} to complete"), || {
            let j = job(&perch, id);
            j["state"]
                .as_str()
                .filter(|s| *s != "pending" && *s != "running")?;
            Some(j)
        });
        assert_eq!(j["state"], "completed", "{j}");
        let gpus = j["placement"][0]["gpus"].clone();
        let gpu = gpus[0].as_u64().expect("one GPU");
        assert_eq!(gpus.as_array().map(Vec::len), Some(1), "{j}");
        let out = wait_for("stdout to arrive", || {
            let (_, out, _) = cli(&perch, &["logs", &id.to_string()]);
            (!out.is_empty()).then_some(out)
        });
        assert_eq!(out, format!("{gpu} 0.25 25 0=4096M\n"));
        ended.push(j);
    }
    assert_eq!(
        ended[0]["placement"][0]["gpus"], ended[1]["placement"][0]["gpus"],
        "packed onto one GPU"
    );
    assert!(
        ended[1]["start_ms"].as_i64() < ended[0]["end_ms"].as_i64(),
        "they ran at the same time"
    );
    let (ok, listing, err) = cli(&perch, &["jobs", "--all"]);
    assert!(ok, "{err}");
    assert!(
        listing.contains("0.25"),
        "the GPUS column shows the fraction: {listing}"
    );
}

#[test]
fn a_node_that_does_not_share_leaves_shared_jobs_waiting_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    // Wait for the node to register, so the reason is about the node, not its absence.
    wait_for("the node to register", || {
        let (_, out, _) = cli(&perch, &["nodes"]);
        out.contains("up").then_some(())
    });
    submit_share(&perch, "0.5", "true");
    let j = wait_for("a pending reason", || {
        let j = job(&perch, 1);
        j["reason"]
            .as_str()
            .filter(|r| r.contains("no node"))
            .map(|_| j.clone())
    });
    assert_eq!(j["state"], "pending", "{j}");
    // Bad requests are refused with the field named.
    let (ok, _, err) = cli(
        &perch,
        &[
            "submit",
            "--gpu-fraction",
            "0.333",
            "--gpu-memory-gb",
            "1",
            "--",
            "true",
        ],
    );
    assert!(!ok && err.contains("gpu_share.fraction"), "{err}");
}
