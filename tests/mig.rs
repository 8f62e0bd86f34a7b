//! MIG instances end to end: an agent reads its GPUs through the stand-in NVML library
//! (nvml-wrapper's real code path) with GPU 0 in MIG mode as a 3g.40gb and a 4g.40gb instance
//! and GPU 1 whole. `perch submit --gpu-profile 3g.40gb` lands on the free 3g instance with
//! `CUDA_VISIBLE_DEVICES` naming its UUID; a second job for that profile waits while the only
//! instance is held, then starts on it; a profile no node has is refused at submit with the
//! reason; whole-GPU jobs never land on the MIG GPU.

mod common;

use common::standin::{self, Agent};
use common::{Perch, wait_for};
use serde_json::{Value, json};

/// Node `gpu-0`: two A100s, GPU 0 in MIG mode as 3g.40gb + 4g.40gb, GPU 1 not.
fn mig_node() -> Value {
    standin::mig_pair()
}

/// The UUID the stand-in gives instance `index` of GPU 0.
fn instance_uuid(index: usize) -> String {
    standin::mig_uuid(index)
}

fn submit(perch: &Perch, args: &[&str]) -> (bool, String) {
    let (ok, out, err) = perch.cli_as("alice", &[&["submit", "--time", "10m"], args].concat());
    (ok, format!("{out}{err}"))
}

fn state(perch: &Perch, id: u64) -> String {
    perch.job(id)["state"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn logs(perch: &Perch, id: u64) -> String {
    wait_for(&format!("job {id}'s output"), || {
        let (_, out, _) = perch.cli_as("alice", &["logs", &id.to_string()]);
        (!out.is_empty()).then_some(out)
    })
}

#[test]
fn jobs_asking_for_a_mig_profile_get_a_free_instance_of_it_and_whole_gpu_jobs_never_the_mig_gpu() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(dir.path(), "", &[]);
    let lib = standin::library();
    let _agent = Agent::start(dir.path(), &perch.url, 0, &lib, &mig_node());
    perch.wait_nodes_up(1);
    // The node page's data lists both instances of GPU 0, free.
    let nodes = perch.get("/v1/nodes");
    let instances = nodes["nodes"][0]["gpu_status"][0]["mig_instances"].clone();
    let profiles: Vec<&str> = instances
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["profile"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(profiles, ["3g.40gb", "4g.40gb"], "{nodes}");
    assert_eq!(instances[0]["uuid"], instance_uuid(0).as_str());
    assert_eq!(instances[0]["memory_mb"], 40 * 1024);
    assert!(nodes["nodes"][0]["gpu_status"][1]["mig_instances"].is_null());

    // Job 1: the 3g instance, seen as its UUID, until told to end.
    let release = dir.path().join("release");
    let hold = format!(
        "echo $CUDA_VISIBLE_DEVICES $PERCH_GPU_PROFILE; while [ ! -e {} ]; do sleep 0.1; done",
        release.display()
    );
    let (ok, out) = submit(
        &perch,
        &["--gpu-profile", "3g.40gb", "--", "sh", "-c", &hold],
    );
    assert!(ok, "{out}");
    wait_for("job 1 to run", || {
        (state(&perch, 1) == "running").then_some(())
    });
    assert_eq!(logs(&perch, 1), format!("{} 3g.40gb\n", instance_uuid(0)));
    let job1 = perch.job(1);
    assert_eq!(job1["placement"][0]["gpus"], json!([0]), "{job1}");
    let nodes = perch.get("/v1/nodes");
    assert_eq!(
        nodes["nodes"][0]["gpu_status"][0]["mig_instances"][0]["job"], 1,
        "{nodes}"
    );
    let (_, listing, _) = perch.cli_as("alice", &["nodes"]);
    assert!(
        listing.contains(&format!(
            "MIG gpu-0 GPU 0 3g.40gb {} job 1 (alice)",
            instance_uuid(0)
        )),
        "{listing}"
    );

    // Job 2, same profile: waits with the reason while job 1 holds the only 3g instance.
    let (ok, out) = submit(
        &perch,
        &[
            "--gpu-profile",
            "3g.40gb",
            "--",
            "sh",
            "-c",
            "echo $CUDA_VISIBLE_DEVICES",
        ],
    );
    assert!(ok, "{out}");
    let reason = wait_for("job 2's reason", || {
        let j = perch.job(2);
        j["reason"]
            .as_str()
            .filter(|r| r.contains("3g.40gb"))
            .map(str::to_owned)
    });
    assert!(
        reason.contains("waiting for a free 3g.40gb MIG instance"),
        "{reason}"
    );
    assert_eq!(state(&perch, 2), "pending");

    // Whole-GPU jobs: one gets GPU 1; the second waits, though GPU 0 has no whole-GPU job.
    for _ in [3, 4] {
        let (ok, out) = submit(&perch, &["--gpus", "1", "--", "sleep", "600"]);
        assert!(ok, "{out}");
    }
    wait_for("job 3 to run", || {
        (state(&perch, 3) == "running").then_some(())
    });
    assert_eq!(perch.job(3)["placement"][0]["gpus"], json!([1]));
    assert_eq!(state(&perch, 4), "pending");
    // A 2-GPU job could never run on this node: one of its GPUs is only MIG instances.
    let (ok, out) = submit(&perch, &["--gpus", "2", "--", "true"]);
    assert!(ok, "{out}");

    // Job 1 ends: job 2 gets the instance.
    std::fs::write(&release, "").expect("release job 1");
    wait_for("job 1 to complete", || {
        (state(&perch, 1) == "completed").then_some(())
    });
    wait_for("job 2 to complete", || {
        (state(&perch, 2) == "completed").then_some(())
    });
    assert_eq!(logs(&perch, 2), format!("{}\n", instance_uuid(0)));
    assert_eq!(state(&perch, 4), "pending", "never placed on the MIG GPU");
    assert_eq!(perch.job(4)["placement"], json!([]));

    // Accounting charges job 1 its slices (3 of 7: 43%), not the whole GPU; the GPU's
    // telemetry is every instance's, so what it used is unknown (NULL), as for a share.
    let rows = perch.sql(
        "SELECT gpu_seconds_allocated / elapsed_seconds AS part, gpu_seconds_used, gpu_profile \
         FROM jobs WHERE job = 1",
    );
    let part = rows[0]["part"].as_f64().expect("part");
    assert!((part - 0.43).abs() < 1e-9, "{rows:?}");
    assert!(rows[0]["gpu_seconds_used"].is_null(), "{rows:?}");
    assert_eq!(rows[0]["gpu_profile"], "3g.40gb", "{rows:?}");
}

#[test]
fn a_profile_no_node_has_is_refused_at_submit_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(dir.path(), "", &[]);
    let lib = standin::library();
    let _agent = Agent::start(dir.path(), &perch.url, 0, &lib, &mig_node());
    perch.wait_nodes_up(1);
    let (ok, out) = submit(&perch, &["--gpu-profile", "1g.10gb", "--", "true"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("no node of the 1 node(s) this cluster has seen reports a MIG instance of profile 1g.10gb: ask for one of the profiles they have: 3g.40gb, 4g.40gb"),
        "{out}"
    );
    // A malformed profile is refused before anything is sent, naming the form.
    let (ok, out) = submit(&perch, &["--gpu-profile", "3g", "--", "true"]);
    assert!(!ok && out.contains("<n>g.<m>gb"), "{out}");
    // With more GPUs, or a share: refused, saying what to change.
    let (ok, out) = submit(
        &perch,
        &["--gpu-profile", "3g.40gb", "--gpus", "2", "--", "true"],
    );
    assert!(!ok && out.contains("drop --gpus and --nodes"), "{out}");
    let (ok, out) = submit(
        &perch,
        &[
            "--gpu-profile",
            "3g.40gb",
            "--gpu-fraction",
            "0.5",
            "--gpu-memory-gb",
            "1",
            "--",
            "true",
        ],
    );
    assert!(!ok && out.contains("cannot be used with"), "{out}");
    // The server refuses a request file combining them too.
    let file = dir.path().join("job.toml");
    std::fs::write(
        &file,
        "command = [\"true\"]\ngpu_profile = \"3g.40gb\"\ngpus_per_node = 2\n",
    )
    .expect("job file");
    let (ok, out) = submit(&perch, &["--file", file.to_str().expect("path")]);
    assert!(
        !ok && out.contains("leave gpus_per_node and nodes at 1"),
        "{out}"
    );
    // Nothing was queued.
    let (_, jobs, _) = perch.cli_as("alice", &["jobs", "--all"]);
    assert!(!jobs.contains("true"), "{jobs}");
}
