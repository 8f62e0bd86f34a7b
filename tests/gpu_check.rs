//! `scripts/gpu-check.sh`, the check an operator runs on a new GPU node, cannot pass here (no
//! GPU), but it must keep working against the current CLI and tables, and it must never pass on
//! simulated GPUs. With a stand-in `nvidia-smi` naming the simulated GPU and `perch up
//! --simulate-gpus 1`, the script runs every step (server on spare ports, SQL, a job through
//! `perch submit`, show, logs, /metrics), fails, and says which checks failed and why.

mod common;

use common::{PERCH, free_port};
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
        .env("PORT", free_port().to_string())
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
    assert!(
        read("validate.txt").contains("1 simulated GPU: nothing to check (simulated)"),
        "{}",
        read("validate.txt")
    );
}
