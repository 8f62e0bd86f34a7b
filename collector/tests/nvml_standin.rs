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
use perch_model::catalogue::{self, Cadence, Column, Read};
use perch_model::{GpuEventKind, GpuSample, NodeId};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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

/// A sampler of the stand-in library at `lib`, reading the costly NVML fields every
/// `slow_interval`.
fn sampler(lib: &Path, slow_interval: Duration) -> Sampler {
    Sampler::new(&SamplerConfig {
        node: NodeId::new("standin").expect("valid"),
        root: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1"),
        data_dir: std::env::temp_dir(),
        nvml: NvmlMode::Path(lib.to_path_buf()),
        nvml_slow_interval: slow_interval,
        simulate_gpus: 0,
        simulate_host: false,
        seed: 0,
        jobs: Default::default(),
    })
}

/// `n` rounds, one second apart, reading the costly NVML fields every `slow_interval`.
fn rounds_reading_slow_fields_every(lib: &Path, n: usize, slow_interval: Duration) -> Vec<Round> {
    let mut sampler = sampler(lib, slow_interval);
    (1..=n as i64)
        .map(|i| sampler.sample(1_800_000_000_000 + i * 1000))
        .collect()
}

fn rounds(lib: &Path, n: usize) -> Vec<Round> {
    rounds_reading_slow_fields_every(lib, n, Duration::ZERO)
}

/// In the child run of `test` (with `fixture`'s scenario loaded): the stand-in library's
/// path. In the parent: `None`, after running the child and checking that it passed.
fn in_scenario(test: &str, fixture: &str) -> Option<String> {
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/nvml")
        .join(fixture);
    in_scenario_file(test, || scenario)
}

/// [`in_scenario`] with the scenario file `scenario` makes (in the parent only).
fn in_scenario_file(test: &str, scenario: impl FnOnce() -> PathBuf) -> Option<String> {
    if let Ok(lib) = std::env::var(LIB_ENV) {
        return Some(lib);
    }
    let lib = standin_library();
    let scenario = scenario();
    let exe = std::env::current_exe().expect("own path");
    let status = Command::new(exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(SCENARIO_ENV, scenario)
        .env(LIB_ENV, lib)
        .status()
        .expect("re-run this test");
    assert!(
        status.success(),
        "the scenario run of {test} failed (see its output above)"
    );
    None
}

#[test]
fn standin_scenario() {
    let Some(lib) = in_scenario("standin_scenario", "two_gpus.json") else {
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

/// The costly fields (energy counter, PCIe throughput and replays, MIG mode, per-process
/// utilization) are read every 3 s here: between reads PCIe and MIG repeat their reading,
/// per-process utilization is absent, and the energy counter advances by the power each round
/// measured, holding (never going back) when the driver's next reading is below that estimate.
#[test]
fn costly_fields_are_read_at_their_own_interval() {
    let Some(lib) = in_scenario(
        "costly_fields_are_read_at_their_own_interval",
        "slow_reads.json",
    ) else {
        return;
    };
    let rounds = rounds_reading_slow_fields_every(Path::new(&lib), 6, Duration::from_secs(3));
    let gpu = |r: &Round| {
        let g = &r.gpus[0];
        (g.power_watts, g.energy_joules, g.pcie_tx_bytes_per_second)
    };
    let repeated: Vec<_> = rounds
        .iter()
        .map(|r| (r.gpus[0].pcie_replay_total, r.gpus[0].mig_enabled))
        .collect();
    assert_eq!(
        repeated,
        [1, 1, 1, 3, 3, 3].map(|replays| (Some(replays), Some(false)))
    );
    let seen: Vec<_> = rounds.iter().map(gpu).collect();
    assert_eq!(
        seen,
        [
            // t=1: read (the driver's 1,000 J).
            (Some(100.0), Some(1000.0), Some(1_024_000.0)),
            // t=2, t=3: 300 W for a second each; PCIe repeats.
            (Some(300.0), Some(1300.0), Some(1_024_000.0)),
            (Some(300.0), Some(1600.0), Some(1_024_000.0)),
            // t=4: read; the driver says 1,500 J, below the estimate: hold at 1,600.
            (Some(300.0), Some(1600.0), Some(3_072_000.0)),
            // t=5: 1,500 + 300 = 1,800 passes the hold; t=6: 2,100.
            (Some(300.0), Some(1800.0), Some(3_072_000.0)),
            (Some(300.0), Some(2100.0), Some(3_072_000.0)),
        ]
        .map(|(p, e, x)| (p, e, x))
    );
    let process_util: Vec<_> = rounds
        .iter()
        .map(|r| {
            let p = &r.gpu_processes[0];
            (p.pid, p.used_memory_bytes, p.sm_utilization_pct)
        })
        .collect();
    assert_eq!(
        process_util,
        [
            (7, Some(1_048_576), Some(30.0)),
            (7, Some(1_048_576), None),
            (7, Some(1_048_576), None),
            (7, Some(1_048_576), Some(30.0)),
            (7, Some(1_048_576), None),
            (7, Some(1_048_576), None),
        ]
    );
}

/// Whether `row` has a value in `column`.
fn present<R>(column: &Column<R>, row: &R) -> bool {
    match &column.read {
        Read::Text(f) => f(row).is_some(),
        read => read.number(row).is_some(),
    }
}

/// Between slow reads a GPU reports the same columns as at them: each column the catalogue
/// marks slow is repeated from its last reading, and each it does not is read every round (a
/// line whose cadence disagrees with the agent's reading of it leaves gaps here).
#[test]
fn every_column_is_in_every_round_between_slow_reads() {
    let Some(lib) = in_scenario(
        "every_column_is_in_every_round_between_slow_reads",
        "two_gpus.json",
    ) else {
        return;
    };
    let rounds = rounds_reading_slow_fields_every(Path::new(&lib), 6, Duration::from_secs(3));
    let reported = |g: &GpuSample| -> Vec<&str> {
        catalogue::GPU
            .iter()
            .filter(|c| present(c, g))
            .map(|c| c.name)
            .collect()
    };
    let first = reported(&rounds[0].gpus[0]);
    for (i, round) in rounds.iter().enumerate() {
        assert_eq!(reported(&round.gpus[0]), first, "round {}", i + 1);
    }
    // The fixture's GPU reports repeated columns, so their repetition is what is checked.
    let repeated = catalogue::GPU
        .iter()
        .filter(|c| c.cadence == Cadence::Slow && c.name != "energy_joules")
        .filter(|c| first.contains(&c.name))
        .count();
    assert!(repeated >= 3, "{first:?}");
}

mod probe {
    perch_model::probe_gpu_catalogue!();
}

/// The scenario a catalogue's NVML fields make: a GPU reporting every field the catalogue
/// reads, each its own value (2^60 + 1 on, which only an exact integer path keeps) and another
/// from time 2, and a GPU reporting none. A fixture built from the catalogue: a new line is
/// in it without an edit.
fn fields_scenario<R>(columns: &[Column<R>], dir: &Path) -> PathBuf {
    let fields = |base: u64| -> serde_json::Map<String, serde_json::Value> {
        columns
            .iter()
            .filter_map(|c| c.nvml_field)
            .zip(base..)
            .map(|(id, value)| (id.to_string(), value.into()))
            .collect()
    };
    let scenario = serde_json::json!({"gpus": [
        {
            "uuid": "GPU-FIELDS", "name": "NVIDIA Fields",
            "timeline": [
                {"at": 0, "set": {"fields": fields((1 << 60) + 1)}},
                {"at": 2, "set": {"fields": fields((1 << 61) + 1)}}
            ]
        },
        {"uuid": "GPU-BARE", "name": "NVIDIA Bare"}
    ]});
    let path = dir.join("fields.json");
    std::fs::write(&path, scenario.to_string()).expect("write the scenario");
    path
}

/// One line more in the GPU catalogue, naming an NVML field, is read by the agent through the
/// stand-in NVML at its own cadence, exactly, with no code of its own in either: the reading
/// the agent's sampler does for the real catalogue (`gpu::nvml::fields::read`) takes it from
/// the catalogue, and the stand-in answers the field from a scenario built from the catalogue.
#[test]
fn a_gpu_line_with_an_nvml_field_is_read_with_no_code_of_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = in_scenario_file(
        "a_gpu_line_with_an_nvml_field_is_read_with_no_code_of_its_own",
        || fields_scenario(probe::GPU, dir.path()),
    ) else {
        return;
    };
    use perch_collector::gpu::nvml::fields;
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new(&lib))
        .init()
        .expect("the stand-in NVML");
    // Scenario time 0: the first request for GPU 0's handle.
    let device = nvml.device_by_index(0).expect("GPU 0");
    let mut row = probe::GpuSample::default();
    fields::read(&device, probe::GPU, Cadence::EverySample, &mut row);
    assert_eq!(
        row.probe_rollovers_total, None,
        "a slow line waits for the slow read"
    );
    fields::read(&device, probe::GPU, Cadence::Slow, &mut row);
    assert_eq!(row.probe_rollovers_total, Some((1 << 60) + 1));
    for _ in 0..2 {
        nvml.device_by_index(0).expect("GPU 0");
    }
    fields::read(&device, probe::GPU, Cadence::Slow, &mut row);
    assert_eq!(row.probe_rollovers_total, Some((1 << 61) + 1));
    // Every line of the catalogue that names a field arrives, the probe's and any real one.
    for c in probe::GPU.iter().filter(|c| c.nvml_field.is_some()) {
        assert!(present(c, &row), "{} read through the stand-in", c.name);
    }
    // A field the GPU does not report is absent, not zero.
    let bare = nvml.device_by_index(1).expect("GPU 1");
    let mut row = probe::GpuSample {
        probe_rollovers_total: Some(7),
        ..probe::GpuSample::default()
    };
    fields::read(&bare, probe::GPU, Cadence::Slow, &mut row);
    assert_eq!(row.probe_rollovers_total, None);
}

/// A runtime with a single worker, as a small agent would have: a blocked worker shows.
fn one_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

/// An agent sampling the stand-in at `lib` every 200 ms, running no jobs, sending to a port
/// where nothing listens (its batches queue, which is all these tests need).
fn wedged_agent(lib: &str, data_dir: &Path) -> perch_collector::AgentConfig {
    let mut config = perch_collector::AgentConfig::new(
        "http://127.0.0.1:9".into(),
        NodeId::new("wedged").expect("valid"),
    );
    config.interval = Duration::from_millis(200);
    config.nvml = NvmlMode::Path(lib.into());
    config.data_dir = data_dir.to_path_buf();
    config.run_jobs = false;
    config.drain_timeout = Duration::from_millis(100);
    config
}

/// A wedged driver (the stand-in blocks one call for 2.5 s) pauses sampling, not the agent: a
/// task on the agent's single runtime worker keeps running through the hang, and sampling
/// resumes after it. Before, the round ran on the runtime's worker and blocked it (under
/// `perch up`, a worker of the server's runtime).
#[test]
fn a_wedged_gpu_driver_does_not_stop_the_agents_runtime() {
    let Some(lib) = in_scenario(
        "a_wedged_gpu_driver_does_not_stop_the_agents_runtime",
        "hang.json",
    ) else {
        return;
    };
    use std::sync::{Arc, Mutex};
    use std::time::Instant;
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = one_worker_runtime();
    let (stats, beats) = runtime.block_on(async {
        let beats: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let heart = tokio::spawn({
            let beats = beats.clone();
            async move {
                loop {
                    beats.lock().expect("beats").push(Instant::now());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
        let config = wedged_agent(&lib, dir.path());
        // On a worker, as `spawn_agent` (so `perch up`) runs it.
        let stats = tokio::spawn(perch_collector::run_agent(
            config,
            tokio::time::sleep(Duration::from_secs(5)),
        ))
        .await
        .expect("agent task")
        .expect("agent");
        heart.abort();
        let beats = beats.lock().expect("beats").clone();
        (stats, beats)
    });
    let longest = beats.windows(2).map(|w| w[1] - w[0]).max().expect("beats");
    assert!(
        longest < Duration::from_millis(1000),
        "the runtime stalled for {longest:?} while the driver hung"
    );
    // Rounds before and after the 2.5 s hang: about 12 of the 25 a 5 s run would have.
    assert!(stats.rounds_sampled >= 8, "{stats:?}");
}

/// A GPU that cannot be opened when the agent starts (GPU 1 of 3) keeps its place: the node
/// still has 3 GPUs, GPU 2 is still GPU 2 (the index CUDA_VISIBLE_DEVICES names), and GPU 1
/// is reported lost, so no job is placed on it. Before, it was skipped: the node had 2 GPUs,
/// the scheduler's GPU 1 was NVML's broken GPU 1, and GPU 2 was never used.
#[test]
fn a_gpu_unreachable_at_start_keeps_its_index_and_is_reported_lost() {
    let Some(lib) = in_scenario(
        "a_gpu_unreachable_at_start_keeps_its_index_and_is_reported_lost",
        "lost_at_start.json",
    ) else {
        return;
    };
    let detection = perch_collector::detect_gpus(&NvmlMode::Path(lib.clone().into()));
    assert_eq!(
        detection.message,
        "found 3 NVIDIA GPUs: NVIDIA H100 80GB HBM3 x2, a GPU not answering x1"
    );
    let mut sampler = sampler(Path::new(&lib), Duration::ZERO);
    assert_eq!(
        sampler.gpu_inventory(),
        (3, "NVIDIA H100 80GB HBM3".to_owned())
    );
    let rounds: Vec<Round> = (1..=3)
        .map(|i| sampler.sample(1_800_000_000_000 + i * 1000))
        .collect();
    let sampled: Vec<(u32, &str)> = rounds[0]
        .gpus
        .iter()
        .map(|g| (g.gpu.0, g.uuid.as_str()))
        .collect();
    assert_eq!(sampled, [(0, "GPU-STANDIN-OK-0"), (2, "GPU-STANDIN-OK-2")]);
    let lost: Vec<_> = rounds
        .iter()
        .flat_map(|r| &r.gpu_events)
        .map(|e| (e.gpu.0, e.kind))
        .collect();
    assert_eq!(lost, [(1, GpuEventKind::GpuLost)], "reported once");
}

/// An agent told to stop while its driver is wedged (a call blocked for a minute) stops at once,
/// instead of waiting for the driver.
#[test]
fn an_agent_stops_while_its_gpu_driver_is_wedged() {
    let Some(lib) = in_scenario(
        "an_agent_stops_while_its_gpu_driver_is_wedged",
        "hang_long.json",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = one_worker_runtime();
    let started = std::time::Instant::now();
    let stats = runtime.block_on(async {
        let config = wedged_agent(&lib, dir.path());
        tokio::spawn(perch_collector::run_agent(
            config,
            tokio::time::sleep(Duration::from_secs(2)),
        ))
        .await
        .expect("agent task")
        .expect("agent")
    });
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "stopping took {took:?}");
    assert!(stats.rounds_sampled >= 1, "{stats:?}");
    // The runtime goes without waiting for the thread still stuck in the driver.
    runtime.shutdown_background();
}
