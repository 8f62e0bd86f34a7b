//! What a job's GPUs cost and did: prices, the figures of one GPU of one allocation, a
//! job's totals, and the windows of telemetry folded into allocations. Pure functions of job
//! records, shared by the control plane (which keeps the folded usage), the server's
//! accounting tables and `/metrics`.

use crate::record::{Allocation, JobRecord};
use crate::usage::GpuUsage;
use std::collections::BTreeMap;

/// What GPU time and energy cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Prices {
    /// Per GPU-hour for models not in `gpu_per_hour` (OpenCost's default, $0.95).
    pub default_gpu_per_hour: f64,
    /// Per GPU-hour by GPU model, as the model is named in `gpu_samples.model` and
    /// `perch nodes`.
    pub gpu_per_hour: BTreeMap<String, f64>,
    /// Per kWh of GPU energy, added to both allocated and used cost (0: energy is included in
    /// the GPU price).
    pub energy_per_kwh: f64,
}

impl Default for Prices {
    fn default() -> Self {
        Prices {
            default_gpu_per_hour: 0.95,
            gpu_per_hour: BTreeMap::new(),
            energy_per_kwh: 0.0,
        }
    }
}

impl Prices {
    pub fn gpu_hour(&self, model: &str) -> f64 {
        self.gpu_per_hour
            .get(model)
            .copied()
            .unwrap_or(self.default_gpu_per_hour)
    }

    /// What one GPU of `model` cost, allocated and used, given its figures: the one
    /// definition, for figures worked out from a record ([`gpu_figures`]) and for those read
    /// back from the settled rows ([`settled`]), which are stored unpriced.
    pub fn gpu_costs(
        &self,
        model: &str,
        allocated_seconds: f64,
        used_seconds: Option<f64>,
        energy_joules: Option<f64>,
    ) -> (f64, Option<f64>) {
        let price = self.gpu_hour(model);
        let energy_cost = energy_joules.unwrap_or(0.0) / 3.6e6 * self.energy_per_kwh;
        (
            allocated_seconds / 3600.0 * price + energy_cost,
            used_seconds.map(|s| s / 3600.0 * price + energy_cost),
        )
    }

    /// What one GPU of `model` cost by allocation over its accounted window: `accounted_seconds`
    /// (the allocated seconds whose telemetry is folded) and the energy drawn in them; `None`
    /// when nothing is accounted. The energy is the same as in the cost by use, so the idle
    /// cost, this less the cost by use, is the idle GPU-seconds' price alone.
    pub fn accounted_cost(
        &self,
        model: &str,
        accounted_seconds: Option<f64>,
        energy_joules: Option<f64>,
    ) -> Option<f64> {
        accounted_seconds.map(|s| self.gpu_costs(model, s, None, energy_joules).0)
    }
}

/// The idle cost of an accounted window: its cost by allocation less its cost by use, never
/// below 0 (the two differ by the idle GPU-seconds' price; rounding must not make it negative).
pub fn idle_cost(cost_accounted: Option<f64>, cost_used: Option<f64>) -> Option<f64> {
    match (cost_accounted, cost_used) {
        (Some(a), Some(u)) => Some((a - u).max(0.0)),
        _ => None,
    }
}

/// One GPU of one allocation, as the tables show it.
///
/// Two windows: `allocated_seconds` and `cost_allocated` run to now; everything from telemetry
/// covers the *accounted window*, from the allocation's start to its checkpoint
/// ([`Allocation::folded_end_ms`]), and so do `accounted_seconds` (the allocated seconds of
/// that window) and `cost_accounted`. Efficiency (used / accounted) and idle cost
/// (`cost_accounted - cost_used`) are worked out within the accounted window only.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuFigures {
    pub allocated_seconds: f64,
    /// Seconds of the allocation whose samples are folded and reported utilization: what
    /// `used_seconds` is measured over.
    pub accounted_seconds: Option<f64>,
    pub used_seconds: Option<f64>,
    pub util_peak_pct: Option<f64>,
    pub memory_peak_bytes: Option<u64>,
    pub energy_joules: Option<f64>,
    pub samples: u64,
    pub cost_allocated: f64,
    /// Cost by allocation of `accounted_seconds` (and the energy drawn in them).
    pub cost_accounted: Option<f64>,
    pub cost_used: Option<f64>,
}

impl GpuFigures {
    /// `cost_accounted - cost_used`: what the idle GPU-seconds of the accounted window cost.
    pub fn idle_cost(&self) -> Option<f64> {
        idle_cost(self.cost_accounted, self.cost_used)
    }

    /// Used / accounted GPU-seconds (0 to 1), within the accounted window.
    pub fn efficiency(&self) -> Option<f64> {
        efficiency(self.used_seconds, self.accounted_seconds)
    }
}

/// Used / accounted GPU-seconds, `None` when either is unknown or nothing is accounted.
pub fn efficiency(used: Option<f64>, accounted: Option<f64>) -> Option<f64> {
    match (used, accounted) {
        (Some(u), Some(a)) if a > 0.0 => Some(u / a),
        _ => None,
    }
}

/// The figures of GPU `g` (position in `a.gpus`) of allocation `a` at `now_ms`.
///
/// A job on a share of a GPU is allocated its fraction of the time; what it used, its peaks
/// and its energy are unknown (NULL): the GPU's telemetry covers every job sharing it and
/// cannot be split among them.
pub fn gpu_figures(a: &Allocation, g: usize, now_ms: i64, prices: &Prices) -> GpuFigures {
    let allocated_seconds = a.held_ms(now_ms) as f64 / 1000.0 * a.gpu_fraction();
    if a.share_percent.is_some() {
        let (cost_allocated, _) = prices.gpu_costs(&a.gpu_model, allocated_seconds, None, None);
        return GpuFigures {
            allocated_seconds,
            samples: a.usage.get(g).map_or(0, |u| u.samples),
            cost_allocated,
            ..GpuFigures::default()
        };
    }
    let u = a.usage.get(g).cloned().unwrap_or_default();
    let folded = a.folded_ms() as f64 / 1000.0;
    let used_seconds = u.used_seconds(folded);
    let energy_joules = u.energy_joules(folded);
    let (cost_allocated, cost_used) =
        prices.gpu_costs(&a.gpu_model, allocated_seconds, used_seconds, energy_joules);
    let accounted_seconds = used_seconds.map(|_| folded);
    GpuFigures {
        allocated_seconds,
        accounted_seconds,
        cost_accounted: prices.accounted_cost(&a.gpu_model, accounted_seconds, energy_joules),
        used_seconds,
        util_peak_pct: u.util_max,
        memory_peak_bytes: u.memory_max_bytes,
        energy_joules,
        samples: u.samples,
        cost_allocated,
        cost_used,
    }
}

/// Telemetry of `gpus` of `node` in [from_ms, to_ms), for one allocation of one job.
#[derive(Debug, Clone, PartialEq)]
pub struct FoldWindow {
    pub job: u64,
    pub attempt: u32,
    pub node: String,
    pub gpus: Vec<u32>,
    pub from_ms: i64,
    pub to_ms: i64,
}

/// A window and what its samples add up to, one [`GpuUsage`] per GPU in the window's order.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    pub window: FoldWindow,
    pub usage: Vec<GpuUsage>,
    /// Some of its samples came from simulated GPUs.
    pub simulated: bool,
}

/// Sums of per-GPU figures; `None` stays `None` only when every GPU's is.
#[derive(Debug, Default)]
pub struct Totals {
    pub allocated: f64,
    pub accounted: Option<f64>,
    pub used: Option<f64>,
    pub peak: Option<f64>,
    pub memory: Option<u64>,
    pub energy: Option<f64>,
    pub cost_allocated: f64,
    pub cost_accounted: Option<f64>,
    pub cost_used: Option<f64>,
}

/// One job's figures over all its allocations and GPUs at `now`: what the `jobs` table
/// shows and what `/metrics` sums per account.
pub fn job_totals(j: &JobRecord, now: i64, prices: &Prices) -> Totals {
    let mut totals = Totals::default();
    for a in &j.allocations {
        for g in 0..a.gpus.len() {
            totals.add(&gpu_figures(a, g, now, prices));
        }
    }
    totals
}

fn add(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x + y),
        (x, y) => x.or(y),
    }
}

impl Totals {
    pub fn add(&mut self, f: &GpuFigures) {
        self.allocated += f.allocated_seconds;
        self.accounted = add(self.accounted, f.accounted_seconds);
        self.used = add(self.used, f.used_seconds);
        self.peak = match (self.peak, f.util_peak_pct) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        self.memory = self.memory.max(f.memory_peak_bytes);
        self.energy = add(self.energy, f.energy_joules);
        self.cost_allocated += f.cost_allocated;
        self.cost_accounted = add(self.cost_accounted, f.cost_accounted);
        self.cost_used = add(self.cost_used, f.cost_used);
    }

    /// `cost_accounted - cost_used`, within the accounted window.
    pub fn idle_cost(&self) -> Option<f64> {
        idle_cost(self.cost_accounted, self.cost_used)
    }

    /// Used / accounted GPU-seconds (0 to 1), within the accounted window.
    pub fn efficiency(&self) -> Option<f64> {
        efficiency(self.used, self.accounted)
    }

    /// Time-weighted mean utilization over the accounted GPU-time.
    pub fn mean_pct(&self) -> Option<f64> {
        match (self.used, self.accounted) {
            (Some(u), Some(a)) if a > 0.0 => Some(100.0 * u / a),
            _ => None,
        }
    }
}
