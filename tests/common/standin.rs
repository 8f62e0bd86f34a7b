//! Agents that read their GPUs through the stand-in NVML library (nvml-wrapper's real code
//! path), playing a scenario: a two-node gang whose GPU can be throttled.

use super::PERCH;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Builds the stand-in NVML library once per test binary and returns its path.
pub fn library() -> PathBuf {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvml-standin");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "-p", "nvml-standin", "--manifest-path"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("cargo build -p nvml-standin");
    assert!(status.success(), "building nvml-standin failed");
    target.join("debug/libnvml_standin.so")
}

/// Two busy H100s; with `throttled`, GPU 1 runs hot and slow from the start (SM clock 1100
/// MHz against 1980, 380 W against 620, hardware and thermal slowdown reported).
pub fn busy_pair(node: usize, throttled: bool) -> Value {
    let gpu = |i: usize| {
        let mut timeline = vec![json!({"at": 0, "set": {
            "util_gpu": 95, "util_memory": 40,
            "memory_used_bytes": 8_589_934_592_u64, "memory_total_bytes": 85_520_809_984_u64,
            "power_mw": 620_000, "temperature_c": 60, "sm_clock_mhz": 1980, "throttle_reasons": 0,
            "pcie_tx_kbps": 2_000_000, "pcie_rx_kbps": 2_000_000
        }})];
        if throttled && i == 1 {
            // hw_slowdown (0x8) and hw_thermal_slowdown (0x40).
            timeline.push(json!({"at": 0, "set": {
                "sm_clock_mhz": 1100, "power_mw": 380_000, "temperature_c": 91, "util_gpu": 98,
                "throttle_reasons": 0x48
            }}));
        }
        json!({
            "uuid": format!("GPU-STANDIN-{node}-{i}"),
            "name": "NVIDIA H100 80GB HBM3",
            "timeline": timeline,
        })
    };
    json!({"clock": "seconds", "gpus": [gpu(0), gpu(1)]})
}

/// Two idle A100s, GPU 0 in MIG mode as a 3g.40gb and a 4g.40gb instance (UUIDs
/// [`mig_uuid`] 0 and 1), GPU 1 not.
pub fn mig_pair() -> Value {
    let gpu = |i: usize, mig: bool| {
        let mut set = json!({
            "util_gpu": 0, "util_memory": 0,
            "memory_used_bytes": 0, "memory_total_bytes": 85_899_345_920_u64,
            "power_mw": 60_000, "temperature_c": 35, "sm_clock_mhz": 1410,
            "mig_mode": mig,
        });
        if mig {
            set["mig_profiles"] = json!(["3g.40gb", "4g.40gb"]);
        }
        json!({
            "uuid": format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"),
            "name": "NVIDIA A100-SXM4-80GB",
            "timeline": [{"at": 0, "set": set}],
        })
    };
    json!({"clock": "seconds", "gpus": [gpu(0, true), gpu(1, false)]})
}

/// The UUID the stand-in gives MIG instance `index` of [`mig_pair`]'s GPU 0.
pub fn mig_uuid(index: usize) -> String {
    format!("MIG-00000000-aaaa-bbbb-cccc-dddddddddddd-{index}")
}

/// Agent `gpu-<node>` reading its GPUs from the stand-in playing `scenario`; killed when
/// dropped.
pub struct Agent(Child);

impl Agent {
    pub fn start(dir: &Path, server: &str, node: usize, lib: &Path, scenario: &Value) -> Agent {
        Agent::start_with(dir, server, node, lib, scenario, &[])
    }

    /// [`Agent::start`] with `env` added to the agent's environment (`PERCH_GPU_SHARING`).
    pub fn start_with(
        dir: &Path,
        server: &str,
        node: usize,
        lib: &Path,
        scenario: &Value,
        env: &[(&str, &str)],
    ) -> Agent {
        Agent::start_named(dir, server, &format!("gpu-{node}"), lib, scenario, env)
    }

    /// Agent for node `name`, with `env` added (`PERCH_TOKEN` for a server with tokens: the
    /// agent's own is removed).
    pub fn start_named(
        dir: &Path,
        server: &str,
        name: &str,
        lib: &Path,
        scenario: &Value,
        env: &[(&str, &str)],
    ) -> Agent {
        let data = dir.join(format!("agent-{name}"));
        std::fs::create_dir_all(&data).expect("agent dir");
        let file = data.join("scenario.json");
        std::fs::write(&file, scenario.to_string()).expect("scenario");
        let child = Command::new(PERCH)
            .args(["agent", "--server", server, "--node", name])
            .arg("--nvml")
            .arg(lib)
            .args(["--interval-ms", "500", "--data-dir"])
            .arg(&data)
            .env("PERCH_NVML_STANDIN_SCENARIO", &file)
            .env("PERCH_RUN_AS_USER", "never")
            .env_remove("PERCH_TOKEN")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(data.join("agent.log")).expect("log"))
            .spawn()
            .expect("spawn perch agent");
        Agent(child)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The place of `node`'s GPU `gpu` in job `job`'s placement (its `RANK`), from the job's API
/// answer.
pub fn rank_of(job: &Value, node: &str, gpu: u64) -> Option<usize> {
    job["placement"]
        .as_array()?
        .iter()
        .flat_map(|p| {
            let n = p["node"].as_str().unwrap_or_default().to_owned();
            p["gpus"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |g| (n.clone(), g.as_u64()))
        })
        .position(|(n, g)| n == node && g == Some(gpu))
}
