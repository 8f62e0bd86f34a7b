//! Accounting and cost: what each job allocated and actually used, per GPU and in total, and
//! what that cost; cluster utilization per day; and the server tasks that keep it current.
//!
//! The numbers come from two places. The control plane's records say who held which GPUs
//! when ([`perch_control::record::Allocation`]) and what state each node was in
//! ([`perch_control::record::NodeSpan`]). Raw telemetry says what the GPUs did: [`run`]
//! periodically folds the settled samples of every open allocation into partial aggregates
//! ([`usage::GpuUsage`]) through one grouped SQL query ([`fold`]), committed with the
//! allocation's checkpoint in the job database. Folding from raw samples long before
//! retention drops them (and never from rollups) is what keeps a job exact across retention
//! and rollup boundaries. SQL reads the result as live tables and views ([`tables`]).
//! `docs/schema.md` defines every column.

pub mod daily;
pub mod fold;
pub mod history;
pub(crate) mod settled;
pub(crate) mod stragglers;
pub mod tables;
pub use perch_control::usage;

pub use usage::GpuUsage;

use perch_control::JobService;
use perch_model::ClusterEvent;
use perch_query::{SqlEngine, Store};
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

pub use perch_control::cost::{GpuFigures, Prices, gpu_figures};

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
