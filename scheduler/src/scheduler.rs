//! The scheduler's state and its one entry point: feed an [`Event`] at a time, get [`Action`]s.
//!
//! `step(now, event)` = `handle(now, event)` (book-keeping: a job exits, a node fails) followed
//! by `schedule(now)` (a pass: start, reserve, preempt). Nothing here reads a clock, touches a
//! file or draws a random number, so the live server and the simulator run exactly this code.
//! Jobs are forgotten once they end; the caller keeps history.

use crate::cluster::{Cluster, GpuHealth, NodeSpec, NodeState, Placement};
use crate::error::{Error, Result};
use crate::ids::{Account, GpuModel, JobId, Millis, NodeId, Time};
use crate::job::{EndState, JobSpec, PendingReason, PreemptReason, RequeueReason};
use crate::policy::{Config, IdleAction, PolicyKind};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};

/// Something that happened, fed to [`Scheduler::step`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// A new job.
    Submit(JobSpec),
    /// A user cancels a pending or running job.
    Cancel(JobId),
    /// A running job's processes exited.
    JobExited {
        /// The job.
        job: JobId,
        /// Its exit code.
        code: i32,
    },
    /// A node came back (heartbeats resumed).
    NodeUp(NodeId),
    /// A node stopped reporting but its jobs may still run (its lease has not run out): it
    /// takes no new jobs, its running jobs stay.
    NodeSilent(NodeId),
    /// A node is gone (its lease ran out): its jobs end or are requeued.
    NodeDown(NodeId),
    /// An operator drains a node: running jobs stay, no new ones.
    Drain(NodeId),
    /// An operator resumes a drained node.
    Resume(NodeId),
    /// A GPU's health changed.
    GpuHealth {
        /// The node.
        node: NodeId,
        /// The GPU index.
        gpu: u32,
        /// The new health.
        health: GpuHealth,
    },
    /// Measured utilization and memory of one GPU (idle detection, victim choice, and
    /// whether a shared job fits there).
    GpuUtilization {
        /// The node.
        node: NodeId,
        /// The GPU index.
        gpu: u32,
        /// Percent busy.
        percent: f32,
        /// GPU memory in use, MiB, when measured (absent keeps the last value).
        #[serde(default)]
        memory_used_mb: Option<u64>,
        /// GPU memory in all, MiB, when measured (absent keeps the last value).
        #[serde(default)]
        memory_total_mb: Option<u64>,
    },
    /// Measured utilization of all of a job's GPUs at once, percent.
    JobUtilization {
        /// The job.
        job: JobId,
        /// Percent busy (the busiest of its GPUs).
        percent: f32,
    },
    /// Time passed; lets time limits and idle windows act.
    Tick,
    /// A node joined the cluster (a live server learns nodes as their agents appear).
    AddNode(NodeSpec),
    /// A node's NVLink islands or its sharing setting changed (its agent says so); running
    /// jobs stay, later placements follow.
    UpdateNode {
        /// The node.
        node: NodeId,
        /// See [`NodeSpec::nvlink_islands`].
        nvlink_islands: Vec<Vec<u32>>,
        /// See [`NodeSpec::sharing`].
        sharing: bool,
        /// A new topology label ([`NodeSpec::rack`]); `None` leaves it.
        rack: Option<String>,
    },
    /// An operator or the automatic remediation moves a running job off its node (a GPU
    /// went bad, the node is drained for repair): it is stopped with its checkpoint signal and
    /// grace period and goes back to the queue, without using up its requeue budget (which is
    /// for the job's own failures). A pending or unknown job is an error.
    Evict(JobId),
    /// A running job's processes vanished without an exit status (its agent restarted): like
    /// a node failure for that one job, it is requeued while requeues are left.
    JobLost(JobId),
    /// A job that was already running when the server restarted, put back as it was. No
    /// `Start` action follows: its processes never stopped.
    Restore {
        /// The job.
        spec: JobSpec,
        /// Its GPUs.
        placement: Placement,
        /// When this run started.
        start: Time,
        /// Requeues so far.
        requeues: u32,
    },
    /// Every account's fair-share usage as the caller's accounting knows it: GPU-milliseconds
    /// (a shared GPU counts its fraction), decayed to `now` with the policy's half-life,
    /// running jobs included up to `now`. Replaces the core's own tally (accounts not listed
    /// have none), so fair share survives a restart and follows the real history.
    AccountUsage(Vec<(Account, f64)>),
}

/// What the caller must do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Action {
    /// Start the job on these GPUs.
    Start {
        /// The job.
        job: JobId,
        /// Its GPUs, per node.
        placement: Placement,
    },
    /// Stop the job (checkpoint signal, grace, kill). Its GPUs are already free in the core's
    /// books: the agent must finish the grace period before launching anything on them.
    Preempt {
        /// The job.
        job: JobId,
        /// Why.
        reason: PreemptReason,
        /// It went back to the queue; else it has ended as `Preempted`.
        requeued: bool,
    },
    /// The job went back to the queue for a reason other than preemption.
    Requeue {
        /// The job.
        job: JobId,
        /// Why.
        reason: RequeueReason,
    },
    /// The job reached a final state (kill it if it still runs: timeout, cancel, node fail).
    End {
        /// The job.
        job: JobId,
        /// Its final state.
        state: EndState,
    },
    /// The job's GPUs have been idle since `since`.
    IdleReport {
        /// The job.
        job: JobId,
        /// Start of the idle spell.
        since: Time,
    },
}

/// One line of `perch queue`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueEntry {
    /// The job.
    pub job: JobId,
    /// Why it waits.
    pub reason: PendingReason,
    /// Its priority at the last recomputation.
    pub priority: f64,
}

#[derive(Clone, Debug)]
pub(crate) enum JobState {
    Pending(PendingReason),
    Running { placement: Placement, start: Time },
}

#[derive(Clone, Debug)]
pub(crate) struct Job {
    pub(crate) spec: JobSpec,
    pub(crate) account: usize,
    pub(crate) model: Option<usize>,
    pub(crate) state: JobState,
    pub(crate) requeues: u32,
    /// Run time accumulated over earlier runs.
    pub(crate) progress: Millis,
    /// Times SRTF or LAS preempted it for a job ahead in their order
    /// (`Config::max_order_preemptions` bounds them).
    pub(crate) order_preemptions: u32,
    /// Times quota reclaim stopped it (the victims stopped least often go first).
    pub(crate) reclaim_stops: u32,
    pub(crate) priority: f64,
    pub(crate) idle_since: Option<Time>,
    pub(crate) idle_reported: bool,
    /// Usage charged to the account up to this time.
    pub(crate) charged_until: Time,
    /// Its current run began by starvation reclaim: while it runs, its user's other starved
    /// jobs stop nobody (one such run per user at a time).
    pub(crate) rescued: bool,
    /// [`Scheduler::passes`] when it was last queued: a pass after that one may have stopped
    /// before reaching it (the cluster full and the reservation taken).
    pub(crate) queued_in: u64,
}

impl Job {
    /// The time limit of a run. Every run gets the whole declared limit, a run after a
    /// requeue too (as Slurm's requeue, and as the agent enforces it on each launch): a job the
    /// scheduler stopped is not charged the restart and the work since its last checkpoint
    /// the stop cost it, and so is never killed for a limit its own work would have kept.
    pub(crate) fn run_limit(&self) -> Millis {
        self.spec.time_limit
    }
}

#[derive(Clone, Debug)]
pub(crate) struct AccountState {
    /// GPUs.
    pub(crate) quota: Option<u32>,
    /// Held now, in hundredths of a GPU (a shared job holds its percent).
    pub(crate) alloc: u32,
    /// Per-model caps in GPUs (the models the policy names for this account).
    pub(crate) model_quota: Vec<(GpuModel, u32)>,
    /// Held now per model (by the cluster's model index), in hundredths of a GPU.
    pub(crate) model_alloc: Vec<u32>,
    /// GPU-milliseconds, decayed.
    pub(crate) usage: f64,
    /// Its jobs pending or running.
    pub(crate) unfinished: u32,
}

impl AccountState {
    /// Whether holding `more` hundredths of a GPU on top of what it holds keeps the account
    /// within its quota (always, without one).
    pub(crate) fn within(&self, more: u32) -> bool {
        self.quota
            .is_none_or(|q| u64::from(self.alloc) + u64::from(more) <= u64::from(q) * 100)
    }

    /// Held now of the model with index `m`, in hundredths of a GPU.
    pub(crate) fn held_of(&self, m: usize) -> u32 {
        self.model_alloc.get(m).copied().unwrap_or(0)
    }
}

/// A job that asks, on its own, for more than its account may hold (see
/// [`Scheduler::beyond_quota`]). It can only ever run on GPUs borrowed from other accounts,
/// which take them back when they need them: so it must be preemptible, and borrowing on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BeyondQuota {
    /// Its account.
    pub account: Account,
    /// What it asks for, in hundredths of a GPU.
    pub asks: u32,
    /// The quota it asks past.
    pub limit: QuotaLimit,
}

/// Which of an account's quotas a job asks past, in GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuotaLimit {
    /// Its quota in all.
    Total(u32),
    /// Its cap on the model the job is constrained to.
    Model(GpuModel, u32),
    /// Its caps on every model of the cluster (the job takes any model): the largest.
    EveryModel(u32),
}

impl std::fmt::Display for BeyondQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let asks = if self.asks.is_multiple_of(100) {
            format!("{} GPU(s)", self.asks / 100)
        } else {
            format!("{:.2} of a GPU", f64::from(self.asks) / 100.0)
        };
        let account = &self.account.0;
        match &self.limit {
            QuotaLimit::Total(q) => {
                write!(
                    f,
                    "asks for {asks}, more than account {account}'s quota of {q} GPU(s)"
                )
            }
            QuotaLimit::Model(m, q) => write!(
                f,
                "asks for {asks} of model {}, more than account {account}'s cap of {q} on it",
                m.0
            ),
            QuotaLimit::EveryModel(q) => write!(
                f,
                "asks for {asks}, more than account {account}'s cap on any model of this \
                 cluster (at most {q})"
            ),
        }
    }
}

/// The scheduling core. See the crate docs for how a server drives it.
#[derive(Clone, Debug)]
pub struct Scheduler {
    pub(crate) config: Config,
    pub(crate) cluster: Cluster,
    pub(crate) jobs: FxHashMap<JobId, Job>,
    /// Pending jobs in priority order (may hold ids of jobs no longer pending; skipped).
    pub(crate) queue: Vec<JobId>,
    /// Running jobs by (deadline from time limit, id).
    pub(crate) deadlines: BTreeSet<(Time, JobId)>,
    /// Running jobs with an idle spell under way.
    pub(crate) idle: BTreeSet<JobId>,
    pub(crate) accounts: Vec<AccountState>,
    pub(crate) account_names: Vec<Account>,
    pub(crate) account_index: HashMap<Account, usize>,
    pub(crate) next_priority_at: Time,
    /// Strict FIFO stopped at a blocked job in the last pass: jobs not reached wait behind it.
    pub(crate) fifo_blocked: bool,
    /// The job the last pass reserved GPUs for (EASY backfill's one reservation).
    pub(crate) reserved_for: Option<JobId>,
    pub(crate) usage_decayed_at: Option<Time>,
    /// Each user's recent finished runs ([`Config::predict_from_history`]).
    pub(crate) history: crate::history::History,
    /// The GPU-time finished jobs used ([`crate::PolicyKind::Gittins`]).
    pub(crate) service: crate::gittins::Service,
    /// Scheduling passes run so far.
    pub(crate) passes: u64,
    /// Each active account's equal part of the cluster's GPUs, as of the last priority refresh
    /// or submission (finish-time fairness: perch's `finish` factor and
    /// [`crate::PolicyKind::Themis`]).
    pub(crate) fair_gpus: f64,
}

impl Scheduler {
    /// A scheduler over `cluster` with `config`.
    pub fn new(cluster: Cluster, config: Config) -> Self {
        let mut s = Scheduler {
            config,
            cluster,
            jobs: FxHashMap::default(),
            queue: Vec::new(),
            deadlines: BTreeSet::new(),
            idle: BTreeSet::new(),
            accounts: Vec::new(),
            account_names: Vec::new(),
            account_index: HashMap::new(),
            next_priority_at: Time::MIN,
            fifo_blocked: false,
            reserved_for: None,
            usage_decayed_at: None,
            history: crate::history::History::default(),
            service: crate::gittins::Service::default(),
            passes: 0,
            fair_gpus: 0.0,
        };
        let config = s.config.clone();
        s.reconfigure(config);
        s
    }

    /// The cluster as the core sees it.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Replaces a node's MIG instances with what its agent reports (see
    /// [`Cluster::set_mig`]); the next pass places on them.
    pub fn set_mig(&mut self, node: NodeId, mig: Vec<crate::cluster::MigInstance>) -> Result<()> {
        self.cluster.set_mig(node, mig)
    }

    /// The policy configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Pending jobs with their reasons, highest priority first.
    pub fn queue(&self) -> Vec<QueueEntry> {
        self.queue
            .iter()
            .filter_map(|id| self.jobs.get(id).map(|j| (id, j)))
            .filter_map(|(id, j)| match j.state {
                JobState::Pending(reason) => Some(QueueEntry {
                    job: *id,
                    reason: self.shown_reason(j, reason),
                    priority: j.priority,
                }),
                JobState::Running { .. } => None,
            })
            .collect()
    }

    /// Number of pending jobs.
    pub fn pending_len(&self) -> usize {
        self.jobs.len() - self.deadlines.len()
    }

    /// Number of running jobs.
    pub fn running_len(&self) -> usize {
        self.deadlines.len()
    }

    /// What a pending job is up against, for a reason in words: (nodes it needs, GPUs on each,
    /// nodes with that many of its model free now, GPUs of its model free in all). From the
    /// free-GPU histogram: cheap enough for every pending job of a listing.
    pub fn room_for(&self, job: JobId) -> Option<(u32, u32, u32, u32)> {
        let j = self.jobs.get(&job)?;
        let shape = j.spec.shape;
        Some((
            shape.nodes,
            shape.gpus_per_node,
            self.cluster.nodes_with_free(j.model, shape.gpus_per_node),
            self.cluster.free_of(j.model),
        ))
    }

    /// An account's GPU quota, if quotas are in force.
    pub fn account_quota(&self, account: &Account) -> Option<u32> {
        if self.config.quotas.is_empty() {
            return None;
        }
        Some(
            self.config
                .quotas
                .iter()
                .find(|(a, _)| a == account)
                .map_or(0, |(_, q)| *q),
        )
    }

    /// The quota `spec` asks past on its own, when quotas are in force: its account's quota in
    /// all, its cap on the model it is constrained to, or (a job free to take any model) its
    /// caps on every model the cluster has. Such a job can only ever run on borrowed GPUs, so
    /// a server refuses it unless it may be preempted and borrowing is on (see
    /// [`BeyondQuota`]); once accepted it waits `QuotaExceeded` until it may borrow.
    pub fn beyond_quota(&self, spec: &JobSpec) -> Option<BeyondQuota> {
        let asks = spec.gpu_hundredths();
        let past = |cap: u32| u64::from(asks) > u64::from(cap) * 100;
        let account = &spec.account;
        let beyond = |limit| BeyondQuota {
            account: account.clone(),
            asks,
            limit,
        };
        if let Some(quota) = self.account_quota(account)
            && past(quota)
        {
            return Some(beyond(QuotaLimit::Total(quota)));
        }
        let cap = |model: &GpuModel| {
            self.config
                .model_quotas
                .iter()
                .find(|(a, m, _)| a == account && m == model)
                .map(|(_, _, q)| *q)
        };
        match &spec.gpu_model {
            Some(model) => cap(model)
                .filter(|&q| past(q))
                .map(|q| beyond(QuotaLimit::Model(model.clone(), q))),
            None => {
                let caps: Option<Vec<u32>> = self.cluster.models.iter().map(cap).collect();
                let largest = caps?.into_iter().max()?;
                past(largest).then(|| beyond(QuotaLimit::EveryModel(largest)))
            }
        }
    }

    /// Why a pending job waits, or `None` when it is not pending.
    pub fn pending_reason(&self, job: JobId) -> Option<PendingReason> {
        let j = self.jobs.get(&job)?;
        match j.state {
            JobState::Pending(r) => Some(self.shown_reason(j, r)),
            JobState::Running { .. } => None,
        }
    }

    /// The reason a user is shown. A pass stops where nothing more can start, so a job queued
    /// before it that it did not reach still says `New`: it waits behind the jobs the pass
    /// did reach (or, under strict FIFO, behind the blocked one).
    fn shown_reason(&self, j: &Job, r: PendingReason) -> PendingReason {
        match r {
            PendingReason::New if self.fifo_blocked => PendingReason::FifoBlocked,
            PendingReason::New if j.queued_in < self.passes => PendingReason::Priority,
            r => r,
        }
    }

    /// Where a running job runs.
    pub fn placement(&self, job: JobId) -> Option<&Placement> {
        match &self.jobs.get(&job)?.state {
            JobState::Running { placement, .. } => Some(placement),
            JobState::Pending(_) => None,
        }
    }

    /// An account's per-model caps: (model, GPUs of it held now, cap), a part of a GPU
    /// counting as a whole one.
    pub fn model_quota_use(&self, account: &Account) -> Vec<(GpuModel, u32, u32)> {
        let Some(&i) = self.account_index.get(account) else {
            return Vec::new();
        };
        let a = &self.accounts[i];
        a.model_quota
            .iter()
            .map(|(model, cap)| {
                let held = self
                    .cluster
                    .models
                    .iter()
                    .position(|m| m == model)
                    .map_or(0, |m| a.held_of(m).div_ceil(100));
                (model.clone(), held, *cap)
            })
            .collect()
    }

    /// GPUs an account holds now (a part of a GPU counts as a whole one here).
    pub fn account_alloc(&self, account: &Account) -> u32 {
        self.account_index
            .get(account)
            .map_or(0, |&i| self.accounts[i].alloc.div_ceil(100))
    }

    /// The earliest time at which a [`Event::Tick`] would do something (a time limit or an idle
    /// window runs out). A simulator jumps there; a server may just tick every few seconds.
    pub fn next_wakeup(&self) -> Option<Time> {
        let deadline = self.deadlines.first().map(|&(t, _)| t);
        let idle = if self.config.idle.action == IdleAction::Off {
            None
        } else {
            self.idle
                .iter()
                .filter_map(|id| self.jobs.get(id))
                .filter_map(|j| {
                    let since = j.idle_since?;
                    if !j.idle_reported {
                        Some(since + self.config.idle.window)
                    } else if matches!(self.config.idle.action, IdleAction::Reclaim { .. }) {
                        Some(since + self.config.idle.window + self.config.idle.grace)
                    } else {
                        None
                    }
                })
                .min()
        };
        match (deadline, idle) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Replaces the policy (an operator changed it): quotas apply to every account from now
    /// on, priorities are recomputed at the next pass; queued and running jobs stay. Running
    /// jobs are never stopped by the change itself; a pass may then reclaim or preempt under
    /// the new rules as it would have under them all along.
    pub fn reconfigure(&mut self, config: Config) {
        self.config = config;
        let quotas: HashMap<&Account, u32> =
            self.config.quotas.iter().map(|(a, q)| (a, *q)).collect();
        let limited = !quotas.is_empty();
        for (i, name) in self.account_names.iter().enumerate() {
            self.accounts[i].quota = match quotas.get(name) {
                Some(&q) => Some(q),
                None if limited => Some(0),
                None => None,
            };
        }
        let missing: Vec<(Account, u32)> = self
            .config
            .quotas
            .iter()
            .filter(|(a, _)| !self.account_index.contains_key(a))
            .cloned()
            .collect();
        for (a, q) in missing {
            let i = self.account(&a);
            self.accounts[i].quota = Some(q);
        }
        for a in &mut self.accounts {
            a.model_quota.clear();
        }
        let caps = self.config.model_quotas.clone();
        for (a, model, q) in caps {
            let i = self.account(&a);
            self.accounts[i].model_quota.push((model, q));
        }
        self.next_priority_at = Time::MIN;
    }

    /// Running jobs whose GPUs are idle now: (job, idle since, already reported).
    pub fn idle_jobs(&self) -> Vec<(JobId, Time, bool)> {
        self.idle
            .iter()
            .filter_map(|id| {
                let j = self.jobs.get(id)?;
                Some((*id, j.idle_since?, j.idle_reported))
            })
            .collect()
    }

    /// Applies `event` and runs a scheduling pass.
    pub fn step(&mut self, now: Time, event: Event) -> Result<Vec<Action>> {
        let mut actions = self.handle(now, event)?;
        actions.extend(self.schedule(now));
        Ok(actions)
    }

    pub(crate) fn account(&mut self, a: &Account) -> usize {
        if let Some(&i) = self.account_index.get(a) {
            return i;
        }
        let quota = if self.config.quotas.is_empty() {
            None
        } else {
            Some(0)
        };
        self.accounts.push(AccountState {
            quota,
            model_quota: Vec::new(),
            model_alloc: Vec::new(),
            alloc: 0,
            usage: 0.0,
            unfinished: 0,
        });
        self.account_names.push(a.clone());
        self.account_index
            .insert(a.clone(), self.accounts.len() - 1);
        self.accounts.len() - 1
    }

    /// Applies `event` without a scheduling pass (a simulator batches same-time events, then
    /// calls [`Scheduler::schedule`] once).
    pub fn handle(&mut self, now: Time, event: Event) -> Result<Vec<Action>> {
        let mut out = Vec::new();
        match event {
            Event::Submit(spec) => self.submit(now, spec)?,
            Event::Cancel(job) => {
                let j = self.jobs.get(&job).ok_or(Error::UnknownJob(job))?;
                if matches!(j.state, JobState::Running { .. }) {
                    self.stop_running(now, job);
                }
                self.forget(job);
                out.push(Action::End {
                    job,
                    state: EndState::Cancelled,
                });
            }
            Event::JobExited { job, code } => {
                match self.jobs.get(&job).map(|j| &j.state) {
                    Some(JobState::Running { .. }) => {}
                    _ => return Err(Error::UnknownJob(job)),
                }
                self.stop_running(now, job);
                if code == 0 {
                    self.remember_run(job);
                }
                self.forget(job);
                let state = if code == 0 {
                    EndState::Completed
                } else {
                    EndState::Failed { code }
                };
                out.push(Action::End { job, state });
            }
            Event::NodeSilent(node) => {
                if matches!(
                    self.cluster.state(node),
                    Some(NodeState::Up | NodeState::Drained)
                ) {
                    self.set_node_state(node, NodeState::Unreachable)?;
                }
            }
            Event::NodeDown(node) => {
                self.set_node_state(node, NodeState::Down)?;
                for job in self.jobs_on(node) {
                    out.extend(self.fail_running(now, job));
                }
            }
            // A drain is the operator's (or remediation's) and outlives a node's absence: a
            // drained node that goes down comes back drained, and resuming a node that is down
            // leaves it down until its agent reports again.
            Event::NodeUp(node) => {
                let drained = self.cluster.node_mut(node)?.drained;
                let state = if drained {
                    NodeState::Drained
                } else {
                    NodeState::Up
                };
                self.set_node_state(node, state)?
            }
            Event::Resume(node) => {
                self.cluster.node_mut(node)?.drained = false;
                if self.cluster.state(node) == Some(NodeState::Drained) {
                    self.set_node_state(node, NodeState::Up)?;
                }
            }
            Event::Drain(node) => {
                self.cluster.node_mut(node)?.drained = true;
                if self.cluster.state(node) == Some(NodeState::Up) {
                    self.set_node_state(node, NodeState::Drained)?;
                }
            }
            Event::GpuHealth { node, gpu, health } => {
                let n = self.cluster.node_mut(node)?;
                if gpu >= n.spec.gpus {
                    return Err(Error::UnknownNode {
                        node,
                        gpu: Some(gpu),
                    });
                }
                let bit = 1u64 << gpu;
                self.cluster.modify(node.0 as usize, |n| {
                    n.health[gpu as usize] = health;
                    if health == GpuHealth::Healthy {
                        n.unhealthy &= !bit
                    } else {
                        n.unhealthy |= bit
                    }
                });
            }
            Event::GpuUtilization {
                node,
                gpu,
                percent,
                memory_used_mb,
                memory_total_mb,
            } => {
                let n = self.cluster.node_mut(node)?;
                let i = gpu as usize;
                let Some(slot) = n.util.get_mut(i) else {
                    return Err(Error::UnknownNode {
                        node,
                        gpu: Some(gpu),
                    });
                };
                *slot = percent;
                if memory_used_mb.is_some() {
                    n.mem_used[i] = memory_used_mb;
                }
                if memory_total_mb.is_some() {
                    n.mem_total[i] = memory_total_mb;
                }
                // A shared GPU's load is every sharer's: each is busy or idle with it.
                for job in self.cluster.holders(node, gpu) {
                    let busiest = self.job_gpu_max_util(job);
                    self.set_job_util(now, job, busiest);
                }
            }
            Event::JobUtilization { job, percent } => {
                if !matches!(
                    self.jobs.get(&job).map(|j| &j.state),
                    Some(JobState::Running { .. })
                ) {
                    return Err(Error::UnknownJob(job));
                }
                self.set_job_util(now, job, percent);
            }
            Event::Tick => {}
            Event::Evict(job) => {
                match self.jobs.get(&job).map(|j| &j.state) {
                    Some(JobState::Running { .. }) => {}
                    _ => return Err(Error::UnknownJob(job)),
                }
                out.push(self.preempt(now, job, PreemptReason::Evicted, true));
            }
            Event::JobLost(job) => {
                match self.jobs.get(&job).map(|j| &j.state) {
                    Some(JobState::Running { .. }) => {}
                    _ => return Err(Error::UnknownJob(job)),
                }
                out.extend(self.fail_running(now, job));
            }
            Event::UpdateNode {
                node,
                nvlink_islands,
                sharing,
                rack,
            } => self
                .cluster
                .set_features(node, nvlink_islands, sharing, rack)?,
            Event::AddNode(spec) => {
                self.cluster.add_node(spec)?;
                // More GPUs make a larger equal part of the cluster (the finish factor): every
                // priority is recomputed at the next pass, so a job queued before the node came
                // is not ranked against the cluster it was queued on.
                self.next_priority_at = Time::MIN;
                // Jobs asking for a model no node had are satisfiable now if this node has it.
                for job in self.jobs.values_mut() {
                    if job.model == Some(usize::MAX) {
                        job.model = self
                            .cluster
                            .model_index(job.spec.gpu_model.as_ref())
                            .unwrap_or(Some(usize::MAX));
                    }
                }
            }
            Event::Restore {
                spec,
                placement,
                start,
                requeues,
            } => {
                let id = spec.id;
                for a in &placement {
                    let n = self.cluster.node_mut(a.node)?;
                    if let Some(profile) = &spec.gpu_profile {
                        let gpu = a.mask.trailing_zeros();
                        let free = n
                            .spec
                            .mig
                            .iter()
                            .zip(&n.mig_holder)
                            .any(|(m, h)| h.is_none() && m.gpu == gpu && &m.profile == profile);
                        if a.mask.count_ones() != 1 || !free {
                            return Err(Error::InvalidNode {
                                name: n.spec.name.0.clone(),
                                message: format!(
                                    "cannot restore job {id}: no free {profile} instance on GPU {gpu}"
                                ),
                            });
                        }
                        continue;
                    }
                    let taken = match spec.share {
                        None => n.alloc & a.mask != 0 || n.shared & a.mask != 0,
                        Some(s) => {
                            a.mask.count_ones() != 1
                                || n.alloc & a.mask != 0
                                || (a.mask & n.all != 0
                                    && n.share_percent(a.mask.trailing_zeros() as usize)
                                        + s.percent
                                        > 100)
                        }
                    };
                    if taken || a.mask & !n.all != 0 {
                        return Err(Error::InvalidNode {
                            name: n.spec.name.0.clone(),
                            message: format!(
                                "cannot restore job {id}: its GPUs are taken or missing"
                            ),
                        });
                    }
                }
                self.submit(start, spec)?;
                self.queue.retain(|j| *j != id);
                if let Some(j) = self.jobs.get_mut(&id) {
                    j.requeues = requeues;
                }
                self.start(start, id, placement);
            }
            Event::AccountUsage(usage) => {
                for a in &mut self.accounts {
                    a.usage = 0.0;
                }
                for (account, gpu_ms) in usage {
                    let i = self.account(&account);
                    self.accounts[i].usage = if gpu_ms.is_finite() {
                        gpu_ms.max(0.0)
                    } else {
                        0.0
                    };
                }
                // The tally includes running jobs up to now and is decayed to now.
                self.usage_decayed_at = Some(now);
                for j in self.jobs.values_mut() {
                    if matches!(j.state, JobState::Running { .. }) {
                        j.charged_until = now;
                    }
                }
            }
        }
        out.extend(self.expire(now));
        Ok(out)
    }

    /// A running job lost its node or its processes: back to the queue while requeues are
    /// left, else it ends as `NodeFail`.
    fn fail_running(&mut self, now: Time, job: JobId) -> Option<Action> {
        self.stop_running(now, job);
        let j = self.jobs.get_mut(&job)?;
        if j.requeues < j.spec.max_requeues {
            j.requeues += 1;
            self.enqueue(job);
            Some(Action::Requeue {
                job,
                reason: RequeueReason::NodeFail,
            })
        } else {
            self.forget(job);
            Some(Action::End {
                job,
                state: EndState::NodeFail,
            })
        }
    }

    fn submit(&mut self, now: Time, spec: JobSpec) -> Result<()> {
        spec.validate()?;
        if self.jobs.contains_key(&spec.id) {
            return Err(Error::DuplicateJob(spec.id));
        }
        let account = self.account(&spec.account);
        // An unknown model can never be satisfied; usize::MAX matches no node.
        let model = self
            .cluster
            .model_index(spec.gpu_model.as_ref())
            .unwrap_or(Some(usize::MAX));
        let id = spec.id;
        let mut job = Job {
            spec,
            account,
            model,
            state: JobState::Pending(PendingReason::New),
            requeues: 0,
            progress: 0,
            order_preemptions: 0,
            reclaim_stops: 0,
            priority: 0.0,
            idle_since: None,
            idle_reported: false,
            charged_until: now,
            rescued: false,
            queued_in: self.passes,
        };
        self.accounts[account].unfinished += 1;
        if matches!(self.config.kind, PolicyKind::Perch | PolicyKind::Themis) {
            self.fair_gpus = self.equal_part();
        }
        job.priority = self.priority_of(&job, now);
        self.jobs.insert(id, job);
        self.insert_in_queue(id);
        Ok(())
    }

    /// Drops a job that ended (or was cancelled) from the scheduler's books.
    fn forget(&mut self, id: JobId) {
        if let Some(j) = self.jobs.remove(&id) {
            self.accounts[j.account].unfinished -= 1;
        }
    }

    /// Puts a job that ran back in the queue at its priority's place (a new one goes in
    /// through [`Scheduler::insert_in_queue`]: it has no entry to replace).
    pub(crate) fn enqueue(&mut self, id: JobId) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        j.state = JobState::Pending(PendingReason::New);
        j.queued_in = self.passes;
        j.idle_since = None;
        j.idle_reported = false;
        self.idle.remove(&id);
        // During a pass its old entry is in the pass's order: the pass drops it then.
        self.drop_stale_entry(id);
        self.insert_in_queue(id);
    }

    /// Drops the entry a requeued job kept in the queue: a job that started keeps its entry
    /// until the queue is next cleaned, so one requeued before that (a borrower reclaimed,
    /// say) was listed twice by `perch queue` and reached twice by a pass, once at its old
    /// place (found running the release binary). A scan, so only for requeued jobs: a fresh
    /// submission has no entry.
    pub(crate) fn drop_stale_entry(&mut self, id: JobId) {
        if let Some(at) = self.queue.iter().position(|&q| q == id) {
            self.queue.remove(at);
        }
    }

    /// Inserts a pending job into the queue at its priority's place.
    pub(crate) fn insert_in_queue(&mut self, id: JobId) {
        let key = self.order_key(id);
        let jobs = &self.jobs;
        let this = &self.config;
        let pos = self.queue.partition_point(|other| match jobs.get(other) {
            Some(o) => crate::pass::order_key(this, o) <= key,
            None => true,
        });
        self.queue.insert(pos, id);
    }

    fn order_key(&self, id: JobId) -> crate::pass::OrderKey {
        self.jobs
            .get(&id)
            .map_or(crate::pass::OrderKey::default(), |j| {
                crate::pass::order_key(&self.config, j)
            })
    }

    fn set_node_state(&mut self, node: NodeId, state: NodeState) -> Result<()> {
        self.cluster.node_mut(node)?;
        self.cluster.modify(node.0 as usize, |n| n.state = state);
        Ok(())
    }

    fn jobs_on(&self, node: NodeId) -> Vec<JobId> {
        let Some(n) = self.cluster.nodes.get(node.0 as usize) else {
            return Vec::new();
        };
        let set: BTreeSet<JobId> = n
            .owner
            .iter()
            .flatten()
            .copied()
            .chain(n.sharers.iter().flatten().map(|(j, _)| *j))
            .collect();
        set.into_iter().collect()
    }

    fn job_gpu_max_util(&self, job: JobId) -> f32 {
        let Some(placement) = self.placement(job) else {
            return 0.0;
        };
        let mut max = 0.0f32;
        for a in placement {
            let n = &self.cluster.nodes[a.node.0 as usize];
            for (i, u) in n.util.iter().enumerate() {
                if a.mask & (1 << i) != 0 {
                    max = max.max(*u);
                }
            }
        }
        max
    }

    fn set_job_util(&mut self, now: Time, job: JobId, percent: f32) {
        let threshold = self.config.idle.threshold_pct;
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        if percent < threshold {
            if j.idle_since.is_none() {
                j.idle_since = Some(now);
                self.idle.insert(job);
            }
        } else {
            j.idle_since = None;
            j.idle_reported = false;
            self.idle.remove(&job);
        }
    }

    /// Frees a running job's GPUs and books its usage; it stays in `jobs` (pending state is
    /// set by the caller, or the caller removes it).
    /// Tells the core of a job that finished before it started (completed, or ended at its
    /// time limit), `ran` milliseconds over all its runs: a server restoring its state gives
    /// the jobs of its database, oldest end first, so history prediction
    /// ([`Config::predict_from_history`]) survives a restart.
    pub fn remember_finished(&mut self, spec: &JobSpec, ran: Millis) {
        self.remember_finished_run(&spec.user, spec.gpu_hundredths(), ran, spec.time_limit);
    }

    /// [`Scheduler::remember_finished`] from a job's user, GPUs (in hundredths,
    /// [`JobSpec::gpu_hundredths`]) and time limit alone.
    pub fn remember_finished_run(
        &mut self,
        user: &crate::User,
        gpu_hundredths: u32,
        ran: Millis,
        limit: Millis,
    ) {
        self.history.record(user, gpu_hundredths, ran, limit);
        self.service
            .record(f64::from(gpu_hundredths) / 100.0 * ran as f64 / 1000.0);
    }

    /// Adds a finished job's run time (all its runs) to its user's history.
    fn remember_run(&mut self, job: JobId) {
        if let Some(j) = self.jobs.get(&job) {
            self.history.record(
                &j.spec.user,
                j.spec.gpu_hundredths(),
                j.progress,
                j.run_limit(),
            );
            self.service
                .record(f64::from(j.spec.gpu_hundredths()) / 100.0 * j.progress as f64 / 1000.0);
        }
    }

    pub(crate) fn stop_running(&mut self, now: Time, job: JobId) {
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        let JobState::Running { placement, start } =
            std::mem::replace(&mut j.state, JobState::Pending(PendingReason::New))
        else {
            return;
        };
        let held = j.spec.gpu_hundredths();
        let deadline = start + j.run_limit();
        j.progress += (now - start).max(0);
        let charged = (now - j.charged_until.max(start)).max(0) as f64 * f64::from(held) / 100.0;
        j.charged_until = now;
        j.idle_since = None;
        let acct = &mut self.accounts[j.account];
        acct.alloc = acct.alloc.saturating_sub(held);
        acct.usage += charged;
        let share = j.spec.share.map(|s| s.percent);
        for a in &placement {
            let m = self.cluster.nodes[a.node.0 as usize].model;
            let h = share.unwrap_or(a.mask.count_ones() * 100);
            if let Some(x) = acct.model_alloc.get_mut(m) {
                *x = x.saturating_sub(h);
            }
        }
        self.deadlines.remove(&(deadline, job));
        self.idle.remove(&job);
        self.cluster.release(job, &placement);
    }

    /// Starts a pending job on `placement`.
    pub(crate) fn start(&mut self, now: Time, job: JobId, placement: Placement) -> Action {
        let share = self.jobs.get(&job).and_then(|j| j.spec.share);
        match self.jobs.get(&job).and_then(|j| j.spec.gpu_profile.clone()) {
            Some(profile) => {
                for a in &placement {
                    let booked =
                        self.cluster
                            .allocate_mig(job, a.node, a.mask.trailing_zeros(), &profile);
                    debug_assert!(booked, "no free {profile} instance where placed");
                }
            }
            None => self.cluster.allocate(job, &placement, share),
        }
        if let Some(j) = self.jobs.get_mut(&job) {
            j.state = JobState::Running {
                placement: placement.clone(),
                start: now,
            };
            j.charged_until = now;
            j.rescued = false;
            let acct = &mut self.accounts[j.account];
            acct.alloc += j.spec.gpu_hundredths();
            let share = j.spec.share.map(|s| s.percent);
            for a in &placement {
                let m = self.cluster.nodes[a.node.0 as usize].model;
                if acct.model_alloc.len() <= m {
                    acct.model_alloc.resize(m + 1, 0);
                }
                acct.model_alloc[m] += share.unwrap_or(a.mask.count_ones() * 100);
            }
            self.deadlines.insert((now + j.run_limit(), job));
        }
        Action::Start { job, placement }
    }

    /// Ends jobs past their time limit; acts on idle spells past the window.
    fn expire(&mut self, now: Time) -> Vec<Action> {
        let mut out = Vec::new();
        while let Some(&(deadline, job)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.stop_running(now, job);
            self.remember_run(job);
            self.forget(job);
            out.push(Action::End {
                job,
                state: EndState::Timeout,
            });
        }
        if self.config.idle.action == IdleAction::Off {
            return out;
        }
        let window = self.config.idle.window;
        let due: Vec<(JobId, Time)> = self
            .idle
            .iter()
            .filter_map(|id| self.jobs.get(id).map(|j| (id, j)))
            .filter_map(|(id, j)| {
                j.idle_since
                    .filter(|s| s + window <= now && !j.idle_reported)
                    .map(|s| (*id, s))
            })
            .collect();
        for (job, since) in due {
            if let Some(j) = self.jobs.get_mut(&job) {
                j.idle_reported = true;
            }
            out.push(Action::IdleReport { job, since });
        }
        out
    }

    /// Whole GPUs that releasing running job `v` would free, as (node index, mask): all of a
    /// whole-GPU job's; a shared GPU only once its last sharer goes. `left` counts, per
    /// (node, GPU), the sharers not yet released in this what-if (filled on first use);
    /// `release == false` undoes an earlier release of `v` and returns what it gives back.
    pub(crate) fn freed_by(
        &self,
        v: JobId,
        left: &mut FxHashMap<(usize, usize), usize>,
        release: bool,
    ) -> Vec<(usize, u64)> {
        let Some(j) = self.jobs.get(&v) else {
            return Vec::new();
        };
        let JobState::Running { placement, .. } = &j.state else {
            return Vec::new();
        };
        if j.spec.gpu_profile.is_some() {
            // A MIG instance frees no whole GPU.
            return Vec::new();
        }
        if j.spec.share.is_none() {
            return placement
                .iter()
                .map(|a| (a.node.0 as usize, a.mask))
                .collect();
        }
        let mut out = Vec::new();
        for a in placement {
            let ni = a.node.0 as usize;
            let Some(n) = self.cluster.nodes.get(ni) else {
                continue;
            };
            let gi = a.mask.trailing_zeros() as usize;
            let Some(sharers) = n.sharers.get(gi) else {
                continue;
            };
            let count = left.entry((ni, gi)).or_insert(sharers.len());
            if release {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    out.push((ni, a.mask));
                }
            } else {
                if *count == 0 {
                    out.push((ni, a.mask));
                }
                *count += 1;
            }
        }
        out
    }

    /// Preempts a running job: requeued when its policy allows, else ended.
    pub(crate) fn preempt(
        &mut self,
        now: Time,
        job: JobId,
        reason: PreemptReason,
        requeue: bool,
    ) -> Action {
        self.stop_running(now, job);
        // Preemption is the scheduler's doing: it does not use up the job's requeue budget,
        // which is for failures.
        let requeued = requeue && self.jobs.contains_key(&job);
        if requeued {
            self.enqueue(job);
        } else {
            self.forget(job);
        }
        Action::Preempt {
            job,
            reason,
            requeued,
        }
    }
}
