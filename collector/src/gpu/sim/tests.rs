//! The simulated GPU model: deterministic, in range, energy monotone, labelled simulated, and
//! showing every workload kind over a day.

use super::*;
use std::collections::HashSet;

const T0: i64 = 1_800_000_000_000;

fn node(name: &str) -> NodeId {
    NodeId::new(name).expect("valid node name")
}

fn run(seed: u64, gpus: u32, steps: i64, step_ms: i64) -> Vec<Vec<GpuSample>> {
    let mut sim = SimGpus::new(&node("sim-node-1"), gpus, 0, seed);
    (0..steps).map(|i| sim.sample(T0 + i * step_ms)).collect()
}

#[test]
fn deterministic_for_a_seed() {
    assert_eq!(run(7, 4, 500, 1000), run(7, 4, 500, 1000));
    assert_ne!(run(7, 4, 500, 1000), run(8, 4, 500, 1000));
}

#[test]
fn values_are_in_range_and_labelled() {
    for round in run(42, 8, 3 * 3600, 1000) {
        for s in round {
            assert!(s.simulated);
            assert!(s.uuid.starts_with("GPU-SIM-sim-node-1-"), "{}", s.uuid);
            assert!(s.model.contains("Simulated"));
            let util = s.utilization_gpu_pct.expect("util");
            assert!((0.0..=100.0).contains(&util), "{util}");
            let mem_util = s.utilization_memory_pct.expect("mem util");
            assert!((0.0..=100.0).contains(&mem_util), "{mem_util}");
            let power = s.power_watts.expect("power");
            assert!((60.0..=720.0).contains(&power), "{power}");
            let temp = s.temperature_celsius.expect("temp");
            assert!((25.0..=90.0).contains(&temp), "{temp}");
            assert!(s.memory_used_bytes.expect("used") <= s.memory_total_bytes.expect("total"));
        }
    }
}

#[test]
fn a_batch_of_simulated_samples_passes_server_validation() {
    let samples = run(1, 4, 10, 1000).concat();
    let batch = perch_model::Batch {
        gpus: samples,
        ..perch_model::Batch::new(node("sim-node-1"), 1)
    };
    assert_eq!(batch.validate(T0 + 10_000), Ok(()));
}

#[test]
fn energy_is_monotone_and_integrates_power() {
    let rounds = run(3, 2, 1200, 1000);
    for gpu in 0..2 {
        let series: Vec<&GpuSample> = rounds.iter().map(|r| &r[gpu]).collect();
        let energy: Vec<f64> = series
            .iter()
            .map(|s| s.energy_joules.expect("energy"))
            .collect();
        assert!(energy.windows(2).all(|w| w[1] >= w[0]), "energy went down");
        let mean_power: f64 = series
            .iter()
            .map(|s| s.power_watts.expect("power"))
            .sum::<f64>()
            / series.len() as f64;
        let seconds = (series.len() - 1) as f64;
        let last = energy[energy.len() - 1];
        // The trapezoid integral of the rounded powers is close to mean power x time.
        assert!(
            (last - mean_power * seconds).abs() < 0.02 * last + 700.0,
            "{last} vs {mean_power}"
        );
    }
}

#[test]
fn a_day_shows_every_workload_and_idle_gpus_hold_memory() {
    let mut sim = SimGpus::new(&node("n"), 8, 0, 11);
    let mut seen = HashSet::new();
    let mut allocated_idle_with_memory = false;
    for minute in 0..24 * 60 {
        let now = T0 + minute * 60_000;
        let kinds = sim.workloads(now);
        let samples = sim.sample(now);
        for (kind, s) in kinds.iter().zip(&samples) {
            seen.insert(*kind);
            if *kind == Workload::AllocatedIdle {
                assert_eq!(s.utilization_gpu_pct, Some(0.0));
                allocated_idle_with_memory |= s.memory_used_bytes.unwrap_or(0) > 10 << 30;
            }
            if *kind == Workload::Training {
                assert!(s.utilization_gpu_pct.unwrap_or(0.0) >= 90.0);
            }
        }
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
    assert!(allocated_idle_with_memory);
}

#[test]
fn temperature_lags_power() {
    let mut sim = SimGpus::new(&node("n"), 1, 0, 5);
    assert!(sim.set_profile(0, Some(Workload::Idle)));
    let mut t = T0;
    for _ in 0..600 {
        sim.sample(t);
        t += 1000;
    }
    let cool = sim.sample(t)[0].temperature_celsius.expect("temp");
    assert!(sim.set_profile(0, Some(Workload::Training)));
    t += 1000;
    let first_hot = sim.sample(t)[0].temperature_celsius.expect("temp");
    for _ in 0..600 {
        t += 1000;
        sim.sample(t);
    }
    let hot = sim.sample(t + 1000)[0].temperature_celsius.expect("temp");
    assert!(
        first_hot < cool + 5.0,
        "jumped from {cool} to {first_hot} in one second"
    );
    assert!(hot > cool + 30.0, "{cool} -> {hot}");
    assert!(!sim.set_profile(9, None));
}

#[test]
fn indices_follow_real_gpus() {
    let mut sim = SimGpus::new(&node("n"), 2, 4, 0);
    let s = sim.sample(T0);
    assert_eq!(s.iter().map(|g| g.gpu.0).collect::<Vec<_>>(), [4, 5]);
    assert_eq!(s[1].uuid, "GPU-SIM-n-5");
}

/// What the model does not compute comes from the catalogue: each line that gives simulated
/// GPUs a value has it in every sample, and a line that gives none, and that the model does not
/// compute, is absent (a new line needs no edit here).
#[test]
fn the_values_the_model_does_not_compute_come_from_the_catalogue() {
    use perch_model::catalogue::{self, Number};
    let modelled = [
        "utilization_gpu_pct",
        "utilization_memory_pct",
        "memory_used_bytes",
        "memory_total_bytes",
        "power_watts",
        "energy_joules",
        "temperature_celsius",
        "sm_clock_mhz",
        "memory_clock_mhz",
        "throttle_reasons",
        "throttle_reason_names",
        "pcie_tx_bytes_per_second",
        "pcie_rx_bytes_per_second",
        "nvlink_rx_bytes",
        "nvlink_tx_bytes",
    ];
    for s in run(5, 2, 30, 1000).concat() {
        for c in catalogue::GPU {
            let mut expected = GpuSample::default();
            c.set(&mut expected, c.simulated.map(Number::F64));
            match (c.simulated, modelled.contains(&c.name)) {
                (Some(_), true) => panic!("{}: the model computes it; drop .simulated()", c.name),
                (Some(_), false) => assert_eq!(
                    c.read.number(&s),
                    c.read.number(&expected),
                    "{}: the catalogue's value",
                    c.name
                ),
                (None, true) => assert!(
                    c.read.number(&s).is_some() || matches!(c.read, catalogue::Read::Text(_)),
                    "{}: modelled",
                    c.name
                ),
                (None, false) => assert_eq!(c.read.number(&s), None, "{}: not simulated", c.name),
            }
        }
    }
}

/// A bursty job's GPUs burst together (a data-parallel gang's ranks wait for each other), on
/// every node it runs on; two jobs' GPUs do not.
#[test]
fn a_bursty_jobs_gpus_burst_together() {
    let mut a = SimGpus::new(&node("a"), 1, 0, 5);
    let mut b = SimGpus::new(&node("b"), 1, 0, 5);
    for sim in [&mut a, &mut b] {
        assert!(sim.set_profile(0, Some(Workload::Bursty)));
    }
    let on = |sim: &mut SimGpus, t: i64| sim.sample(t)[0].utilization_gpu_pct > Some(30.0);
    let differ = |a: &mut SimGpus, b: &mut SimGpus| {
        (0..600)
            .map(|s| T0 + s * 1000)
            .filter(|&t| on(a, t) != on(b, t))
            .count()
    };
    assert!(differ(&mut a, &mut b) > 100, "two jobs burst apart");
    assert!(a.set_job(0, Some("7")) && b.set_job(0, Some("7")));
    assert_eq!(differ(&mut a, &mut b), 0, "one job's GPUs burst together");
    assert!(!a.set_job(3, None));
}
