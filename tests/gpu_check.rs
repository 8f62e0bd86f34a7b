//! `scripts/gpu-check.sh`, the check an operator runs on a new GPU node, cannot pass here (no
//! GPU), but it must keep working against the current CLI and tables, and it must never pass on
//! simulated GPUs. With a stand-in `nvidia-smi` naming the simulated GPU and `perch up
//! --simulate-gpus 1`, the script runs every step (server on spare ports, SQL, a job through
//! `perch submit`, show, logs, /metrics), fails, and says which checks failed and why.

mod common;

use common::PERCH;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;

#[test]
fn gpu_check_runs_every_step_and_fails_on_simulated_gpus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("bin dir");
    let smi = bin.join("nvidia-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\ncase \"$*\" in\n*query-gpu*) echo '0, GPU-SIM-gpucheck-0, Simulated H100 80GB, 81559, 580.00';;\n*) echo 'stand-in nvidia-smi';;\nesac\n",
    )
    .expect("write nvidia-smi");
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let report = dir.path().join("report");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-check.sh");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .arg(&script)
        .arg(PERCH)
        .arg(&report)
        .env("PATH", path)
        .env("PORT", "0")
        .env("BURN_SECONDS", "4")
        .env("UP_ARGS", "--nvml off --simulate-gpus 1 --node gpucheck")
        .env("XDG_CONFIG_HOME", dir.path().join("no-user-config"))
        .env_remove("PERCH_SERVER")
        .env_remove("PERCH_TOKEN")
        .output()
        .expect("run gpu-check.sh");
    let summary = std::fs::read_to_string(report.join("summary.txt")).unwrap_or_default();
    assert_eq!(
        out.status.code(),
        Some(1),
        "it must fail: {out:?}\n{summary}"
    );

    // Every step ran against the server it started.
    let read = |f: &str| std::fs::read_to_string(report.join(f)).unwrap_or_default();
    assert!(
        read("perch-up.log").contains("Simulating 1 GPUs"),
        "{}",
        read("perch-up.log")
    );
    assert!(summary.contains("job: Submitted job 1"), "{summary}");
    assert!(
        read("gpus.csv")
            .starts_with("gpu,uuid,model,simulated,memory_total_bytes\n0,GPU-SIM-gpucheck-0,"),
        "{}",
        read("gpus.csv")
    );
    assert!(
        read("show-done.txt").contains("JobId=1 Name=gpu-check"),
        "{}",
        read("show-done.txt")
    );
    assert!(
        read("job-usage.csv").starts_with("job,state,gpus,gpu_seconds_used"),
        "{}",
        read("job-usage.csv")
    );
    assert!(
        read("metrics-running.txt").contains("perch_gpu_info{node=\"gpucheck\""),
        "{}",
        read("metrics-running.txt")
    );
    assert!(
        read("fields-present.csv").contains("energy_joules"),
        "{}",
        read("fields-present.csv")
    );
    assert!(
        read("perch.toml").contains("[accounting]") && !read("perch.toml").contains(":7300"),
        "a config on spare ports: {}",
        read("perch.toml")
    );

    // Simulated GPUs never pass; the UUID (the stand-in names the simulated one) does.
    for line in [
        "FAIL no simulated GPU",
        "FAIL perch found every GPU nvidia-smi lists (1)",
        "FAIL the Prometheus endpoint has real GPU series",
        "PASS GPU 0's UUID matches nvidia-smi (GPU-SIM-gpucheck-0)",
        // The built-in validation runs; simulated GPUs pass its health but are never burned.
        "PASS the node's validation passed and resumed it (gpucheck)",
        "FAIL the validation burned and memory-checked every GPU (1)",
    ] {
        assert!(
            summary.lines().any(|l| l == line),
            "no {line:?} in:\n{summary}"
        );
    }
    assert!(!summary.contains("PASS no simulated GPU"), "{summary}");
    // Nothing in MIG mode: said, not failed; and MPS's state (skipped without its tools).
    assert!(
        summary
            .lines()
            .any(|l| l.starts_with("SKIP MIG: not enabled on any GPU")),
        "{summary}"
    );
    assert!(
        summary
            .lines()
            .any(|l| l.starts_with("SKIP MPS: ") || l.starts_with("MPS: ")),
        "{summary}"
    );
    assert!(
        read("validate.txt").contains("1 simulated GPU: nothing to check (simulated)"),
        "{}",
        read("validate.txt")
    );
}

/// The MIG and MPS checks of `scripts/gpu-check.sh` on the stand-in NVML library (GPU 0 in MIG
/// mode as a 3g.40gb and a 4g.40gb instance, GPU 1 whole), with a stand-in `nvidia-smi` that
/// says so and lists the same MIG UUIDs, and a stand-in `nvidia-cuda-mps-control` (its daemon
/// not running): perch lists the instances nvidia-smi lists, the `--gpu-profile` job sees its
/// instance's UUID, the shared job gets the MPS limits, and the daemon is said to be stopped.
#[test]
fn gpu_check_checks_mig_instances_and_mps_limits_on_the_stand_in_nvml() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("bin dir");
    let (uuid0, uuid1) = (common::standin::mig_uuid(0), common::standin::mig_uuid(1));
    let tools = [
        (
            "nvidia-smi",
            format!(
                "#!/bin/sh\ncase \"$*\" in\n*mig.mode.current*) echo '0, Enabled'; echo '1, Disabled';;\n\
                 *query-gpu*) echo '0, GPU-00000000-aaaa-bbbb-cccc-dddddddddddd, NVIDIA A100-SXM4-80GB, 81920, 560.35.03'; \
                 echo '1, GPU-00000001-aaaa-bbbb-cccc-dddddddddddd, NVIDIA A100-SXM4-80GB, 81920, 560.35.03';;\n\
                 -L) echo 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-00000000-aaaa-bbbb-cccc-dddddddddddd)'; \
                 echo '  MIG 3g.40gb     Device  0: (UUID: {uuid0})'; echo '  MIG 4g.40gb     Device  1: (UUID: {uuid1})'; \
                 echo 'GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-00000001-aaaa-bbbb-cccc-dddddddddddd)';;\n\
                 *) echo 'stand-in nvidia-smi';;\nesac\n"
            ),
        ),
        (
            "nvidia-cuda-mps-control",
            "#!/bin/sh\necho 'stand-in: not to be run' >&2\nexit 1\n".to_owned(),
        ),
    ];
    for (name, text) in tools {
        let path = bin.join(name);
        std::fs::write(&path, text).expect("write tool");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let scenario = dir.path().join("scenario.json");
    std::fs::write(&scenario, common::standin::mig_pair().to_string()).expect("scenario");
    let lib = common::standin::library();
    let report = dir.path().join("report");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-check.sh");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .arg(&script)
        .arg(PERCH)
        .arg(&report)
        .env("PATH", path)
        .env("PORT", "0")
        .env("BURN_SECONDS", "2")
        .env(
            "UP_ARGS",
            format!("--nvml {} --node migcheck", lib.display()),
        )
        .env("PERCH_NVML_STANDIN_SCENARIO", &scenario)
        .env("XDG_CONFIG_HOME", dir.path().join("no-user-config"))
        .env_remove("PERCH_SERVER")
        .env_remove("PERCH_TOKEN")
        .output()
        .expect("run gpu-check.sh");
    let summary = std::fs::read_to_string(report.join("summary.txt")).unwrap_or_default();
    let read = |f: &str| std::fs::read_to_string(report.join(f)).unwrap_or_default();
    // No torch burn can pass on the stand-in; the MIG and MPS checks must.
    assert_eq!(out.status.code(), Some(1), "{out:?}\n{summary}");
    for line in [
        "MIG: enabled on GPU(s) 0",
        "PASS perch lists the MIG instances nvidia-smi lists (2)",
        &format!("PASS the 3g.40gb job held a 3g.40gb instance ({uuid0})"),
        "PASS the 3g.40gb job saw CUDA_VISIBLE_DEVICES=its MIG UUID",
        "MPS: nvidia-cuda-mps-control is installed but its daemon is not running (shares' limits are not enforced; nvidia-cuda-mps-control -d starts it)",
        "PASS the shared job got CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "PASS the shared job got CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M",
    ] {
        assert!(
            summary.lines().any(|l| l == line),
            "no {line:?} in:\n{summary}\nnodes: {}\nMIG job: {}\nshared job: {}{}",
            read("nodes-mig-running.txt"),
            read("job-mig-log.txt"),
            read("show-mps.txt"),
            read("job-mps-log.txt"),
        );
    }
    assert!(
        read("job-mps-log.txt").contains("CUDA_VISIBLE_DEVICES=1\n"),
        "the share is on GPU 1, never on the MIG GPU: {}",
        read("job-mps-log.txt")
    );
}
