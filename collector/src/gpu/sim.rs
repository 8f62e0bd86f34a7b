//! Simulated GPUs for `perch up --simulate-gpus N`, `perch demo` and tests.
//!
//! A deterministic model with no clock of its own: every value is a function of the seed, the
//! node, the GPU index and the `now_ms` the caller passes in, plus two integrators (energy and a
//! lagging temperature) over the sequence of sample times. A GPU shows the workload it is pinned
//! to ([`SimGpus::set_profile`]): the agent's sampler pins each GPU to its job's load (steady
//! training at 90-100% utilization, bursty, or allocated-but-idle: 0% utilization with memory
//! held, the pattern that makes up about a third of GPU time in public traces; a bursty job's
//! GPUs burst together, on every node, as a data-parallel gang's ranks do) and a GPU no job
//! holds to idle (0%, no memory, idle power). An unpinned GPU moves through those phases on its
//! own, a few minutes each (the model's tests, nothing the agent reports). Power follows utilization from ~70 W to ~700 W like an H100 SXM. The columns the model
//! does not compute take the value their catalogue line gives simulated GPUs, if any. Every
//! sample says `simulated: true`, its UUID starts with `GPU-SIM-` and its model with
//! `Simulated`.

use perch_model::catalogue::{self, Number};
use perch_model::{GpuIndex, GpuSample, NodeId};
use std::sync::LazyLock;

/// The model name every simulated GPU reports.
pub const SIM_MODEL: &str = "Simulated H100 80GB";
const MEMORY_TOTAL_BYTES: u64 = 81_559 * 1024 * 1024;
const IDLE_WATTS: f64 = 70.0;
const MAX_WATTS: f64 = 700.0;
/// Thermal time constant of the temperature lag, in seconds.
const THERMAL_TAU_S: f64 = 30.0;

/// The sample with the value of each catalogue line that gives one for simulated GPUs
/// ([`catalogue::Column::simulated`]: zero errors, all NVLinks up...); the lines the model
/// computes are set over it, and the others stay absent.
static HEALTHY: LazyLock<GpuSample> = LazyLock::new(|| {
    let mut sample = GpuSample::default();
    for column in catalogue::GPU {
        if let Some(value) = column.simulated {
            column.set(&mut sample, Some(Number::F64(value)));
        }
    }
    sample
});

/// What a simulated GPU is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Workload {
    Idle,
    Training,
    Bursty,
    /// Allocated to a job that holds memory but runs no kernels.
    AllocatedIdle,
}

/// SplitMix64: a tiny, well-mixed, stable hash so the model never changes with a crate upgrade.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Hashes several words into one.
pub(crate) fn mix_all(words: &[u64]) -> u64 {
    words.iter().fold(0x5EED_u64, |acc, w| mix(acc ^ mix(*w)))
}

/// A hash mapped to `[0, 1)`.
pub(crate) fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// FNV-1a of a name: a stable word for a node or a job.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    })
}

/// A stable key for one simulated device, from the seed, node name and a per-node number.
pub(crate) fn device_key(seed: u64, node: &NodeId, n: u32) -> u64 {
    mix_all(&[seed, name_key(node.as_str()), u64::from(n)])
}

/// The phase a GPU with `key` is in at `now_ms`, and a per-phase random number.
pub fn workload_at(key: u64, now_ms: i64) -> (Workload, u64) {
    let slot_ms = 120_000 + (key % 5) as i64 * 60_000; // 2 to 6 minutes per phase
    let offset = (key % slot_ms as u64) as i64;
    let slot = (now_ms + offset).div_euclid(slot_ms);
    let h = mix_all(&[key, slot as u64]);
    let kind = match h % 100 {
        0..20 => Workload::Idle,
        20..55 => Workload::Training,
        55..75 => Workload::Bursty,
        _ => Workload::AllocatedIdle,
    };
    (kind, mix(h))
}

/// Instantaneous values of one GPU, before integration.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Instant {
    util: f64,
    memory_used: u64,
    power: f64,
}

/// `rhythm` sets when a bursty GPU is on: its job's key, so the GPUs of one job (a gang's
/// ranks, on every node) burst together as a data-parallel job's do; its own key otherwise.
fn instant(key: u64, rhythm: u64, workload: Workload, phase: u64, now_ms: i64) -> Instant {
    let second = now_ms.div_euclid(1000) as u64;
    let noise = unit(mix_all(&[key, second]));
    // Memory held by the phase's job: a fixed amount for the whole phase.
    let held =
        |lo: f64, hi: f64| ((lo + (hi - lo) * unit(phase)) * MEMORY_TOTAL_BYTES as f64) as u64;
    let (util, memory_used) = match workload {
        Workload::Idle => (0.0, 0),
        Workload::Training => ((90.0 + 10.0 * noise).min(100.0), held(0.6, 0.95)),
        Workload::Bursty => {
            let on = mix_all(&[rhythm, second / 10]).is_multiple_of(2);
            let util = if on { 60.0 + 40.0 * noise } else { 5.0 * noise };
            (util, held(0.25, 0.75))
        }
        Workload::AllocatedIdle => (0.0, held(0.35, 0.9)),
    };
    let util = (util * 10.0).round() / 10.0;
    let mut power = IDLE_WATTS + (MAX_WATTS - IDLE_WATTS) * util / 100.0;
    if memory_used > 0 {
        power += 5.0 + 10.0 * noise; // a context and held memory cost a little
    }
    Instant {
        util,
        memory_used,
        power,
    }
}

/// One simulated GPU and its integrators.
#[derive(Debug, Clone)]
struct SimGpu {
    key: u64,
    index: u32,
    uuid: String,
    profile: Option<Workload>,
    /// The key of the job holding it ([`SimGpus::set_job`]).
    job: Option<u64>,
    last: Option<(i64, f64)>,
    energy_joules: f64,
    temperature: f64,
}

/// A node's simulated GPUs.
#[derive(Debug, Clone)]
pub struct SimGpus {
    gpus: Vec<SimGpu>,
}

impl SimGpus {
    /// `count` GPUs with indices `first_index..first_index + count` (after any real GPUs, so
    /// indices never collide), deterministic for (`seed`, `node`).
    pub fn new(node: &NodeId, count: u32, first_index: u32, seed: u64) -> Self {
        let gpus = (first_index..first_index + count)
            .map(|index| SimGpu {
                key: device_key(seed, node, index),
                index,
                uuid: format!("GPU-SIM-{node}-{index}"),
                profile: None,
                job: None,
                last: None,
                energy_joules: 0.0,
                temperature: 0.0,
            })
            .collect();
        Self { gpus }
    }

    pub fn len(&self) -> usize {
        self.gpus.len()
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// Pins GPU `index` to a workload (a scheduler placing a job with a synthetic profile), or
    /// gives it back to the built-in phase model with `None`. Returns false for an unknown index.
    pub fn set_profile(&mut self, index: u32, profile: Option<Workload>) -> bool {
        match self.gpus.iter_mut().find(|g| g.index == index) {
            Some(g) => {
                g.profile = profile;
                true
            }
            None => false,
        }
    }

    /// Names the job holding GPU `index` (`None`: none), whose GPUs burst together. Returns
    /// false for an unknown index.
    pub fn set_job(&mut self, index: u32, job: Option<&str>) -> bool {
        match self.gpus.iter_mut().find(|g| g.index == index) {
            Some(g) => {
                g.job = job.map(name_key);
                true
            }
            None => false,
        }
    }

    /// Indices of the simulated GPUs.
    pub fn indices(&self) -> Vec<u32> {
        self.gpus.iter().map(|g| g.index).collect()
    }

    /// The workload each GPU is running at `now_ms`.
    pub fn workloads(&self, now_ms: i64) -> Vec<Workload> {
        self.gpus
            .iter()
            .map(|g| g.profile.unwrap_or(workload_at(g.key, now_ms).0))
            .collect()
    }

    /// One sample per GPU at `now_ms`. Times should not go backwards; if they do, the
    /// integrators simply do not advance.
    pub fn sample(&mut self, now_ms: i64) -> Vec<GpuSample> {
        self.gpus.iter_mut().map(|g| g.sample(now_ms)).collect()
    }
}

impl SimGpu {
    fn sample(&mut self, now_ms: i64) -> GpuSample {
        let (auto, phase) = workload_at(self.key, now_ms);
        let workload = self.profile.unwrap_or(auto);
        let now = instant(
            self.key,
            self.job.unwrap_or(self.key),
            workload,
            phase,
            now_ms,
        );
        let target_temp = 28.0 + 0.07 * now.power;
        match self.last {
            None => self.temperature = target_temp,
            Some((last_ms, last_power)) => {
                let dt = (now_ms - last_ms).max(0) as f64 / 1000.0;
                self.energy_joules += (last_power + now.power) / 2.0 * dt;
                let alpha = 1.0 - (-dt / THERMAL_TAU_S).exp();
                self.temperature += (target_temp - self.temperature) * alpha;
            }
        }
        self.last = Some((now_ms.max(self.last.map_or(now_ms, |l| l.0)), now.power));
        let busy = now.util > 0.0;
        GpuSample {
            time_ms: now_ms,
            gpu: GpuIndex(self.index),
            uuid: self.uuid.clone(),
            model: SIM_MODEL.to_string(),
            simulated: true,
            utilization_gpu_pct: Some(now.util),
            utilization_memory_pct: Some((now.util * 0.55 * 10.0).round() / 10.0),
            memory_used_bytes: Some(now.memory_used),
            memory_total_bytes: Some(MEMORY_TOTAL_BYTES),
            power_watts: Some((now.power * 100.0).round() / 100.0),
            energy_joules: Some(self.energy_joules),
            temperature_celsius: Some((self.temperature * 10.0).round() / 10.0),
            sm_clock_mhz: Some(if busy {
                1755 + (225.0 * now.util / 100.0) as u32
            } else {
                345
            }),
            memory_clock_mhz: Some(2619),
            // Traffic follows the load. NVLink bytes grow with the energy integrator, so they
            // are counters like the real ones.
            throttle_reasons: Some(if busy { 0 } else { 0x1 }),
            pcie_tx_bytes_per_second: Some((now.util * 2.0e8).round()),
            pcie_rx_bytes_per_second: Some((now.util * 3.0e8).round()),
            nvlink_rx_bytes: Some((self.energy_joules * 1.0e8) as u64),
            nvlink_tx_bytes: Some((self.energy_joules * 1.0e8) as u64),
            // The rest is a healthy GPU's, as the catalogue gives it.
            ..HEALTHY.clone()
        }
    }
}

#[cfg(test)]
mod tests;
