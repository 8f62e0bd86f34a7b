//! The agent's NVML path against the workspace's stand-in NVML library (`nvml-standin`), loaded
//! through nvml-wrapper's `lib_path`: values over time, unsupported metrics, an XID and an ECC
//! event, and a GPU that falls off the bus.
//!
//! The library reads its scenario from an environment variable at `nvmlInit`, and environment
//! changes are process-wide (and `unsafe` in Rust 2024), so the test re-runs itself as a child
//! process with the variable set. The library is built by `cargo build -p nvml-standin` into
//! `CARGO_TARGET_TMPDIR/nvml-standin`, which works under any `CARGO_TARGET_DIR`.

use perch_collector::gpu::NvmlMode;
use perch_collector::sampler::{Round, Sampler, SamplerConfig};
use perch_model::{GpuEventKind, NodeId};
use std::path::{Path, PathBuf};
use std::process::Command;

const SCENARIO_ENV: &str = "PERCH_NVML_STANDIN_SCENARIO";
const LIB_ENV: &str = "PERCH_TEST_NVML_STANDIN_LIB";

/// Builds the stand-in NVML library and returns its path.
fn standin_library() -> PathBuf {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvml-standin");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "-p", "nvml-standin", "--manifest-path"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("run cargo build -p nvml-standin");
    assert!(status.success(), "building nvml-standin failed");
    target.join("debug/libnvml_standin.so")
}

fn rounds(lib: &Path, n: usize) -> Vec<Round> {
    let mut sampler = Sampler::new(&SamplerConfig {
        node: NodeId::new("standin").expect("valid"),
        root: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1"),
        data_dir: std::env::temp_dir(),
        nvml: NvmlMode::Path(lib.to_path_buf()),
        simulate_gpus: 0,
        simulate_host: false,
        seed: 0,
        jobs: Default::default(),
    });
    (1..=n as i64)
        .map(|i| sampler.sample(1_800_000_000_000 + i * 1000))
        .collect()
}

#[test]
fn standin_scenario() {
    let Ok(lib) = std::env::var(LIB_ENV) else {
        let lib = standin_library();
        let scenario =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvml/two_gpus.json");
        let exe = std::env::current_exe().expect("own path");
        let status = Command::new(exe)
            .args([
                "--exact",
                "standin_scenario",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(SCENARIO_ENV, scenario)
            .env(LIB_ENV, lib)
            .status()
            .expect("re-run this test");
        assert!(
            status.success(),
            "the scenario run failed (see its output above)"
        );
        return;
    };
    let detection = perch_collector::detect_gpus(&NvmlMode::Path(lib.clone().into()));
    assert_eq!(
        detection.message,
        "found 2 NVIDIA GPUs: NVIDIA H100 80GB HBM3 x1, NVIDIA A100-SXM4-40GB x1"
    );
    let rounds = rounds(Path::new(&lib), 6);

    // Values over time: round i runs at scenario time i.
    let util0: Vec<Option<f64>> = rounds
        .iter()
        .map(|r| {
            r.gpus
                .iter()
                .find(|g| g.gpu.0 == 0)
                .and_then(|g| g.utilization_gpu_pct)
        })
        .collect();
    assert_eq!(util0, [10.0, 90.0, 90.0, 90.0, 90.0, 90.0].map(Some));

    // Everything the scenario sets arrives, in perch's units.
    let g = &rounds[0].gpus[0];
    assert_eq!(
        (g.uuid.as_str(), g.power_watts, g.energy_joules),
        ("GPU-STANDIN-0", Some(120.0), Some(5000.0))
    );
    assert_eq!(g.throttle_reasons, Some(68));
    assert_eq!(
        (
            g.ecc_corrected_volatile,
            g.ecc_uncorrected_volatile,
            g.ecc_corrected_aggregate,
            g.ecc_uncorrected_aggregate
        ),
        (Some(3), Some(0), Some(30), Some(1))
    );
    assert_eq!(
        (g.retired_pages_single_bit, g.retired_pages_double_bit),
        (Some(2), Some(1))
    );
    assert_eq!(
        (
            g.pcie_tx_bytes_per_second,
            g.pcie_rx_bytes_per_second,
            g.pcie_replay_total
        ),
        (Some(1_024_000.0), Some(2_048_000.0), Some(4))
    );
    assert_eq!(
        (g.nvlink_links, g.nvlink_links_up, g.nvlink_errors_total),
        (Some(3), Some(2), Some(3))
    );
    assert_eq!(
        (g.nvlink_rx_bytes, g.nvlink_tx_bytes),
        (Some(600), Some(60))
    );
    assert_eq!(
        (g.processes, g.mig_enabled, g.mig_instances),
        (Some(2), Some(false), None)
    );
    let procs: Vec<_> = rounds[0]
        .gpu_processes
        .iter()
        .map(|p| {
            (
                p.gpu.0,
                p.pid,
                p.used_memory_bytes,
                p.sm_utilization_pct,
                p.rogue,
            )
        })
        .collect();
    assert_eq!(
        procs,
        vec![
            (0, 4242, Some(1_048_576), Some(40.0), false),
            (0, 4343, None, None, false)
        ]
    );

    // What the second GPU does not support is absent, not zero.
    let g1 = &rounds[0].gpus[1];
    assert_eq!(
        (g1.utilization_gpu_pct, g1.mig_enabled, g1.mig_instances),
        (Some(50.0), Some(true), Some(3))
    );
    assert_eq!(
        (
            g1.power_watts,
            g1.energy_joules,
            g1.ecc_corrected_volatile,
            g1.nvlink_links,
            g1.processes,
            g1.throttle_reasons
        ),
        (None, None, None, None, None, None)
    );

    // Events: one XID 79 and one double-bit ECC error on GPU 0, GPU 1 lost once; counted.
    let events: Vec<_> = rounds
        .iter()
        .flat_map(|r| r.gpu_events.iter())
        .map(|e| (e.gpu.0, e.kind, e.xid))
        .collect();
    assert_eq!(
        events,
        vec![
            (0, GpuEventKind::Xid, Some(79)),
            (1, GpuEventKind::GpuLost, None),
            (0, GpuEventKind::EccDoubleBit, None),
        ]
    );
    let last = rounds.last().expect("rounds");
    assert_eq!(
        last.gpus.len(),
        1,
        "the lost GPU has no samples; the other carries on"
    );
    assert_eq!(
        (
            last.gpus[0].xid_errors_total,
            last.gpus[0].ecc_error_events_total
        ),
        (Some(1), Some(1))
    );
    assert_eq!(rounds[0].gpus[0].xid_errors_total, Some(0));
}
