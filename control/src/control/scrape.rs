//! What `/metrics` shows of the control plane: node states, GPU allocation, the queue and
//! which job holds which GPU. Taken in one pass under the control lock, so the numbers of one
//! scrape agree with each other.

use super::{Control, ControlError};
use crate::record::JobState;
use perch_model::AgentLiveness;
use perch_scheduler::PendingReason;
use std::collections::BTreeMap;
use std::time::Duration;

/// A running job the scheduler has reported idle (`[scheduler.idle]`), for the JobIdle alert.
#[derive(Debug, Clone)]
pub struct IdleJobView {
    pub job: u64,
    pub user: String,
    pub account: String,
    /// Its nodes, comma-separated.
    pub nodes: String,
    pub idle_since_ms: i64,
    /// What perch does next, in words.
    pub consequence: String,
    /// When perch acts on it, if it will.
    pub action_at_ms: Option<i64>,
}

/// One node as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub name: String,
    /// Down, drained, and since when it reports. Its state also needs its telemetry:
    /// `perch_server::node_status` is the one place that puts the two together.
    pub liveness: AgentLiveness,
    pub gpus: u32,
    /// GPUs held by a job, whole or shared.
    pub allocated: u32,
    /// Jobs running on the node.
    pub running_jobs: usize,
    /// When its agent last synced (server clock, Unix ms).
    pub last_sync_ms: i64,
}

/// A job waiting in the queue.
#[derive(Debug, Clone)]
pub struct PendingView {
    pub account: String,
    pub reason: &'static str,
    pub gpus: u32,
    pub wait_secs: f64,
}

/// One GPU held by a running job.
#[derive(Debug, Clone)]
pub struct AllocationView {
    pub job: u64,
    pub name: String,
    pub user: String,
    pub account: String,
    pub node: String,
    pub gpu: u32,
}

/// The control plane at one instant, for a scrape.
#[derive(Debug, Clone, Default)]
pub struct ControlSnapshot {
    pub nodes: Vec<NodeView>,
    /// Jobs per state (every state present, zero included).
    pub jobs_by_state: BTreeMap<&'static str, u64>,
    pub pending: Vec<PendingView>,
    pub allocations: Vec<AllocationView>,
    /// Scheduling passes since the server started.
    pub passes: PassStats,
}

/// Scheduling passes over the queue since the server started: how many, their time in all
/// and the slowest, for `/metrics` and `perch bench fleet`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PassStats {
    pub count: u64,
    pub total: Duration,
    pub max: Duration,
}

impl PassStats {
    pub(crate) fn record(&mut self, took: Duration) {
        self.count += 1;
        self.total += took;
        self.max = self.max.max(took);
    }
}

/// A label value for a pending reason: short, stable, low cardinality.
pub fn reason_label(reason: &PendingReason) -> &'static str {
    match reason {
        PendingReason::New => "new",
        PendingReason::Priority => "priority",
        PendingReason::Reserved { .. } => "reserved",
        PendingReason::Resources => "resources",
        PendingReason::QuotaExceeded => "quota",
        PendingReason::FifoBlocked => "fifo_blocked",
        PendingReason::Unsatisfiable => "unsatisfiable",
    }
}

const STATES: [JobState; 8] = [
    JobState::Pending,
    JobState::Running,
    JobState::Completed,
    JobState::Failed,
    JobState::Cancelled,
    JobState::Timeout,
    JobState::Preempted,
    JobState::NodeFail,
];

impl crate::JobService {
    /// The control plane as it is now, for `/metrics`, once what it shows is durable.
    pub fn snapshot(&self) -> Result<ControlSnapshot, ControlError> {
        self.read_durable(|c| c.snapshot(self.now_ms()))
    }

    /// The control plane as memory holds it, durable or not: for `/metrics` once the job
    /// database has failed (nothing will be durable again).
    pub fn snapshot_held(&self) -> ControlSnapshot {
        self.read(|c| c.snapshot(self.now_ms()))
    }

    /// The nodes only, for the alert engine's every-second round.
    pub fn node_views(&self) -> Vec<NodeView> {
        self.read(Control::node_views)
    }

    /// Running jobs the scheduler has reported idle.
    pub fn idle_jobs(&self) -> Vec<IdleJobView> {
        self.read(Control::idle_jobs)
    }
}

impl Control {
    /// Running jobs the scheduler has reported idle, with what comes next.
    pub fn idle_jobs(&self) -> Vec<IdleJobView> {
        self.scheduler
            .idle_jobs()
            .into_iter()
            .filter(|(_, _, reported)| *reported)
            .filter_map(|(id, since, _)| {
                let j = self.jobs.get(&id.0)?;
                let (consequence, action_at_ms) = self.idle_consequence(j, since);
                Some(IdleJobView {
                    job: j.id,
                    user: j.request.user().to_owned(),
                    account: j.request.account().to_owned(),
                    nodes: j.node_list(),
                    idle_since_ms: since,
                    consequence,
                    action_at_ms,
                })
            })
            .collect()
    }

    /// Every node as the scheduler sees it (cheap: no job is visited).
    pub fn node_views(&self) -> Vec<NodeView> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let (allocated, jobs) = self.occupancy(i);
                NodeView {
                    name: n.record.name.clone(),
                    liveness: n.liveness(),
                    gpus: n.record.gpus,
                    allocated: allocated as u32,
                    running_jobs: jobs.len(),
                    last_sync_ms: n.last_sync_ms,
                }
            })
            .collect()
    }

    pub fn snapshot(&self, now: i64) -> ControlSnapshot {
        let nodes = self.node_views();
        let mut jobs_by_state: BTreeMap<&'static str, u64> =
            STATES.iter().map(|s| (s.as_str(), 0)).collect();
        let mut allocations = Vec::new();
        for (state, n) in self.settled_by_state() {
            *jobs_by_state.entry(state.as_str()).or_default() += n;
        }
        for job in self.jobs.values() {
            *jobs_by_state.entry(job.state.as_str()).or_default() += 1;
            if job.state == JobState::Running {
                for place in &job.placement {
                    for &gpu in &place.gpus {
                        allocations.push(AllocationView {
                            job: job.id,
                            name: job.request.name.clone().unwrap_or_default(),
                            user: job.request.user().to_owned(),
                            account: job.request.account().to_owned(),
                            node: place.node.clone(),
                            gpu,
                        });
                    }
                }
            }
        }
        let pending = self
            .scheduler
            .queue()
            .into_iter()
            .filter_map(|q| {
                let job = self.jobs.get(&q.job.0)?;
                Some(PendingView {
                    account: job.request.account().to_owned(),
                    reason: reason_label(&q.reason),
                    gpus: job.request.nodes * job.request.gpus_per_node,
                    wait_secs: (now - job.submit_ms).max(0) as f64 / 1000.0,
                })
            })
            .chain(self.held.iter().filter_map(|id| {
                let job = self.jobs.get(id)?;
                Some(PendingView {
                    account: job.request.account().to_owned(),
                    reason: "dependency",
                    gpus: job.request.nodes * job.request.gpus_per_node,
                    wait_secs: (now - job.submit_ms).max(0) as f64 / 1000.0,
                })
            }))
            .collect();
        ControlSnapshot {
            nodes,
            jobs_by_state,
            pending,
            allocations,
            passes: self.passes,
        }
    }
}

/// GPU-seconds and cost of one (account, user), every job and attempt so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageView {
    pub account: String,
    pub user: String,
    /// To now.
    pub gpu_seconds_allocated: f64,
    /// Of those, the ones within each job's accounted window (telemetry folded) on GPUs
    /// whose use is known: what `gpu_seconds_used` is measured against.
    pub gpu_seconds_accounted: f64,
    /// Utilization-weighted, over the telemetry folded so far.
    pub gpu_seconds_used: f64,
    /// To now.
    pub cost_allocated: f64,
    /// Cost by allocation of `gpu_seconds_accounted`.
    pub cost_accounted: f64,
    pub cost_used: f64,
}

impl UsageView {
    /// Accounted but unused GPU time at the price: what idle allocations cost, within the
    /// accounted window (the allocation to now would count minutes whose use is not folded
    /// yet as idle).
    pub fn cost_idle(&self) -> f64 {
        (self.cost_accounted - self.cost_used).max(0.0)
    }
}

impl crate::JobService {
    /// Usage and cost per (account, user), for `/metrics`: the same figures as the `jobs`
    /// and `account_usage` tables.
    pub fn usage(&self, prices: &crate::cost::Prices) -> Vec<UsageView> {
        let now = self.now_ms();
        // Settled jobs from their running totals: a scrape every 15 s reads no history.
        self.read(|c| {
            let mut by: BTreeMap<(String, String), UsageView> = BTreeMap::new();
            for u in c.settled_usage(prices) {
                by.insert((u.account.clone(), u.user.clone()), u);
            }
            for job in c.jobs.values().filter(|j| !j.allocations.is_empty()) {
                let (account, user) = (job.request.account(), job.request.user());
                let t = crate::cost::job_totals(job, now, prices);
                let key = (account.to_owned(), user.to_owned());
                let u = by.entry(key).or_insert_with(|| UsageView {
                    account: account.to_owned(),
                    user: user.to_owned(),
                    ..UsageView::default()
                });
                u.gpu_seconds_allocated += t.allocated;
                u.gpu_seconds_accounted += t.accounted.unwrap_or(0.0);
                u.gpu_seconds_used += t.used.unwrap_or(0.0);
                u.cost_allocated += t.cost_allocated;
                u.cost_accounted += t.cost_accounted.unwrap_or(0.0);
                u.cost_used += t.cost_used.unwrap_or(0.0);
            }
            by.into_values().collect()
        })
    }
}
