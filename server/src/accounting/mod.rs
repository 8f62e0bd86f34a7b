//! Accounting and cost: what each job allocated and actually used, per GPU and in total, and
//! what that cost; cluster utilization per day; and the server tasks that keep it current.
//!
//! The numbers come from two places. The control plane's records say who held which GPUs
//! when ([`crate::jobs::record::Allocation`]) and what state each node was in
//! ([`crate::jobs::record::NodeSpan`]). Raw telemetry says what the GPUs did: [`run`]
//! periodically folds the settled samples of every open allocation into partial aggregates
//! ([`usage::GpuUsage`]) through one grouped SQL query ([`fold`]), committed with the
//! allocation's checkpoint in the job database. Folding from raw samples long before
//! retention drops them (and never from rollups) is what keeps a job exact across retention
//! and rollup boundaries. SQL reads the result as live tables and views ([`tables`]).
//! `docs/schema.md` defines every column.

pub mod daily;
pub mod fold;
pub(crate) mod settled;
pub mod tables;
pub mod usage;

pub use usage::GpuUsage;

use crate::jobs::JobService;
use crate::jobs::record::Allocation;
use perch_model::ClusterEvent;
use perch_query::{SqlEngine, Store};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Prices and the folding schedule (`[accounting]` in perch.toml).
#[derive(Debug, Clone, PartialEq)]
pub struct AccountingConfig {
    /// How often running jobs' telemetry is folded (ended jobs are folded as soon as their
    /// last samples have settled).
    pub fold_interval: Duration,
    /// Samples are folded only once this old: later arrivals (a batch delayed longer than
    /// this, an agent's spool replayed after an outage) are not counted.
    pub settle: Duration,
    pub prices: Prices,
}

impl Default for AccountingConfig {
    fn default() -> Self {
        AccountingConfig {
            fold_interval: Duration::from_secs(300),
            settle: Duration::from_secs(120),
            prices: Prices::default(),
        }
    }
}

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
}

/// One GPU of one allocation, as the tables show it.
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
    pub cost_used: Option<f64>,
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
    GpuFigures {
        allocated_seconds,
        accounted_seconds: used_seconds.map(|_| folded),
        used_seconds,
        util_peak_pct: u.util_max,
        memory_peak_bytes: u.memory_max_bytes,
        energy_joules,
        samples: u.samples,
        cost_allocated,
        cost_used,
    }
}

/// Folds the settled telemetry (before `until_ms`) of every allocation that needs it and
/// commits the result; returns how many windows were applied.
pub async fn fold_once(
    jobs: &JobService,
    sql: &SqlEngine,
    until_ms: i64,
    now_ms: i64,
) -> Result<usize, String> {
    let windows = jobs.read(|c| c.fold_windows(until_ms));
    if windows.is_empty() {
        return Ok(0);
    }
    let folded = fold::fold(sql, windows).await.map_err(|e| e.to_string())?;
    jobs.run(move |c, _| c.apply_fold(folded, now_ms))
        .await
        .map_err(|e| e.to_string())
}

/// Keeps accounting current until `shutdown`: folds every `fold_interval`, and as soon as an
/// ended job's last samples have settled.
pub async fn run(
    jobs: JobService,
    sql: Arc<SqlEngine>,
    config: AccountingConfig,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let settle = i64::try_from(config.settle.as_millis()).unwrap_or(i64::MAX / 4);
    let wakeup = jobs.read(|c| c.fold_wakeup());
    tokio::pin!(shutdown);
    loop {
        let now = jobs.now_ms();
        let mut wait = config.fold_interval;
        match fold_once(&jobs, &sql, now.saturating_sub(settle), now).await {
            Ok(n) if n > 0 => tracing::debug!(windows = n, "accounting folded"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "accounting fold failed; it will be retried"),
        }
        if let Some(due) = jobs.read(|c| c.next_settled_end(settle)) {
            let until = u64::try_from(due - jobs.now_ms()).unwrap_or(0);
            wait = wait.min(Duration::from_millis(until));
        }
        // Never spin: a fold that keeps failing waits at least a second between tries.
        wait = wait.max(Duration::from_secs(1));
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(wait) => {}
            _ = wakeup.notified() => {}
        }
    }
}

/// Appends the control plane's audit events to the store's `events` table, in order, until
/// the job service is dropped.
pub async fn append_events(
    store: Arc<Store>,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Vec<ClusterEvent>>,
) {
    while let Some(mut batch) = events.recv().await {
        while let Ok(more) = events.try_recv() {
            batch.extend(more);
        }
        if let Err(e) = store.append_events(&batch).await {
            tracing::error!(error = %e, events = batch.len(), "could not append job and node events to the events table");
        }
    }
}

#[cfg(test)]
mod tests;
