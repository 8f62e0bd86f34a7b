//! The control plane: the one place where job records, nodes and the pure scheduling core
//! meet. Every operation (submit, cancel, an agent's sync, a tick) takes the lock, feeds the
//! core an event with the current time, carries out the actions it returns (launch and stop
//! orders queued for agents, record changes), and commits the changed records to the job
//! database before it returns. The core itself stays pure; this module is its I/O.

mod apply;
mod archive;
pub use archive::{Brief, Found, Settled};
mod cancel;
#[cfg(test)]
mod fleet_model;
mod ledger;
mod logs;
pub use logs::LOG_PAGE;
mod observe;
mod output_usage;
mod provenance;
mod remediation;
mod restore;
mod scrape;
mod submit;
mod sync;
#[cfg(test)]
mod tests;
mod validation;
mod views;

pub use cancel::{CancelOutcome, CancelSelection, EndedJob, OwnedJob};
pub use scrape::{AllocationView, ControlSnapshot, NodeView, PassStats, PendingView, UsageView};
pub use views::{NodeDetail, QueuePage};

use super::db::{Dirty, Loaded, NodeRecord};
use super::job_token::JobTokens;
use super::record::{ArrayTask, JobRecord, JobState, NodeGpus, StoppingRun};
use super::spec::{FieldError, JobRequest};
use perch_model::AgentLiveness;
use perch_model::control::{
    JobAttempt, JobExit, JobLaunch, JobStop, LaunchHost, LaunchShare, LogChunk, LogStream,
    MasterPort, SyncRequest, SyncResponse,
};
use perch_scheduler::{
    Account, Action, Cluster, Config, EndState, Event, GpuModel, GpuShare, IdleAction, JobId,
    JobSpec, NodeAlloc, NodeId, NodeName, NodeSpec, PendingReason, Qos, Scheduler, Shape, User,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Why an operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}")]
    Invalid(#[from] FieldError),
    #[error("no job {0}; `perch jobs` lists them")]
    NoSuchJob(u64),
    #[error(
        "job {0} is not an array: an array's id is its first task's, as `perch submit --array` printed it (`perch show` gives a task's array)"
    )]
    NoSuchArray(u64),
    #[error("job {id} already ended ({state})")]
    AlreadyEnded { id: u64, state: &'static str },
    #[error("no node {0:?}; `perch nodes` lists them")]
    NoSuchNode(String),
    #[error("{0}")]
    Forbidden(String),
    #[error(
        "{user} has {pending} pending jobs and this submission adds {adding}: at most {limit} per user (server.max_pending_jobs_per_user); wait for some to start or cancel some"
    )]
    TooManyPending {
        user: String,
        pending: usize,
        adding: usize,
        limit: usize,
    },
    #[error(
        "{user}'s pending jobs hold {pending} bytes of command and environment and this submission adds {adding}: at most {limit} per user (server.max_pending_job_mb_per_user); wait for some to start, cancel some, or move large values into files the jobs read"
    )]
    TooManyPendingBytes {
        user: String,
        pending: usize,
        adding: usize,
        limit: usize,
    },
    #[error(
        "node {node} is served by another agent{}, which synced {silent_secs:.1} s ago: two agents under one node name would each report what runs there and have the other's jobs killed. Give this agent a name of its own (agent.node, --node), or stop the other one; if it is gone for good, this agent takes the node once the other has been silent for {timeout_secs} s (server.node_stale_after_secs)",
        other.as_deref().map(|a| format!(" (at {a})")).unwrap_or_default()
    )]
    NodeClaimed {
        node: String,
        other: Option<String>,
        silent_secs: f64,
        timeout_secs: i64,
    },
    #[error("scheduler: {0}")]
    Scheduler(#[from] perch_scheduler::Error),
    #[error("{0}")]
    Db(#[from] super::db::DbError),
    /// A commit failed (a full disk): nothing changes until the job database is reopened
    /// ([`crate::JobService::recover`]).
    #[error(
        "the job database cannot be written now ({0}); nothing was changed. perch reopens it by itself once its disk has room again: try again in a moment"
    )]
    Unavailable(String),
    #[error("job logs: {0}")]
    Logs(std::io::Error),
    /// A request that cannot be answered as asked (the message says what to change).
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "the output of job {job} was deleted {days} days after the job ended (server.job_output_days); `perch show {job}` still has its record"
    )]
    OutputDeleted { job: u64, days: i64 },
    #[error("settled jobs' rows: {0}")]
    SettledRows(String),
    /// The blocking task running an operation failed (it panicked or was cancelled).
    #[error("the control plane's task failed: {0}")]
    TaskFailed(String),
    /// The server is shutting down: what was asked cannot be done now.
    #[error("{0}")]
    ShuttingDown(String),
    /// Job listings not yet read by their clients hold all the memory they may: retry.
    #[error("{0}")]
    ListingBusy(String),
}

/// Whether a job's dependencies let it be scheduled.
#[derive(Debug, PartialEq, Eq)]
enum Deps {
    Met,
    Waiting,
    Never(String),
}

/// Settings of the control plane.
#[derive(Debug, Clone)]
pub struct JobsConfig {
    /// A node whose agent has not synced for this long is down: it takes no new jobs and
    /// alerts fire, but its jobs count as running until its lease runs out.
    pub heartbeat_timeout: Duration,
    /// How long a node's jobs count as running after its last sync (the lease each sync
    /// renews): only then are they requeued or end as node_fail. The agent stops them before
    /// its lease runs out, so a job never runs on two nodes at once. Longer than
    /// `heartbeat_timeout`.
    pub lease: Duration,
    pub policy: Config,
    /// Which users may charge which accounts, at which QOS (`[accounts]`).
    pub accounts: super::accounts::AccountRules,
    /// Most pending (and held) jobs one user may have; a submission past it is refused whole.
    pub max_pending_per_user: usize,
    /// Most bytes of command and environment one user's pending (and held) jobs may hold; a
    /// submission past it is refused whole.
    pub max_pending_bytes_per_user: usize,
    /// The clock every operation and tick reads "now" from.
    pub clock: perch_model::clock::Clock,
    /// How long after a job ended its stored output is kept (`server.job_output_days`);
    /// `None`: for ever.
    pub output_retention: Option<Duration>,
    /// Most bytes of disk one user's jobs' stored output may occupy
    /// (`server.max_job_output_mb_per_user`); past it, new output of their jobs is not stored.
    /// `None`: no bound.
    pub max_output_bytes_per_user: Option<u64>,
    /// Most bytes of disk all stored job output may occupy (`server.max_job_output_total_mb`);
    /// past it, no new output is stored. `None`: no bound.
    pub max_output_bytes_total: Option<u64>,
}

impl Default for JobsConfig {
    fn default() -> Self {
        JobsConfig {
            heartbeat_timeout: Duration::from_secs(30),
            lease: DEFAULT_LEASE,
            policy: Config::perch(vec![]),
            accounts: Default::default(),
            max_pending_per_user: DEFAULT_MAX_PENDING_PER_USER,
            max_pending_bytes_per_user: DEFAULT_MAX_PENDING_BYTES_PER_USER,
            clock: perch_model::clock::Clock::system(),
            output_retention: Some(DEFAULT_OUTPUT_RETENTION),
            max_output_bytes_per_user: Some(DEFAULT_MAX_OUTPUT_BYTES_PER_USER),
            max_output_bytes_total: Some(DEFAULT_MAX_OUTPUT_BYTES_TOTAL),
        }
    }
}

/// The default of [`JobsConfig::output_retention`]: 30 days, as the store keeps raw samples.
pub const DEFAULT_OUTPUT_RETENTION: Duration = Duration::from_secs(30 * 86_400);

/// The default of [`JobsConfig::max_output_bytes_per_user`]: 10 GiB, two jobs' worth at the
/// agents' default per-job limit (`agent.max_job_output_mb`, 4 GiB plus its slack), kept for
/// `server.job_output_days`.
pub const DEFAULT_MAX_OUTPUT_BYTES_PER_USER: u64 = 10 << 30;

/// The default of [`JobsConfig::max_output_bytes_total`]: 100 GiB, ten users at their bound. A
/// fixed size, not a share of the disk: the disk holds the store and the job database too,
/// and a bound that moves with what else is there could not be planned for.
pub const DEFAULT_MAX_OUTPUT_BYTES_TOTAL: u64 = 100 << 30;

/// The default of [`JobsConfig::max_pending_per_user`].
pub const DEFAULT_MAX_PENDING_PER_USER: usize = 10_000;

/// The default of [`JobsConfig::max_pending_bytes_per_user`]: 256 MiB. 10,000 pending jobs
/// (the count cap) of 320 KiB of command and environment each (the most one job may carry)
/// were 3.2 GB of one user's in memory; a typical job carries a few hundred bytes.
pub const DEFAULT_MAX_PENDING_BYTES_PER_USER: usize = 256 << 20;

/// The default node lease: minutes, so that a server restart or a short network cut stops no
/// job, at the price of a dead node's jobs waiting that long to be requeued.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(300);

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

struct Node {
    record: NodeRecord,
    last_sync_ms: i64,
    /// Silent past the heartbeat timeout (its jobs may still run until its lease runs out).
    down: bool,
    /// Silent past its lease: its jobs were requeued or ended.
    lease_expired: bool,
    /// Since when it has synced without a break (joined, came back, or this server started).
    reporting_since_ms: i64,
    /// The address its agent advertises to peers (a multi-node job's `MASTER_ADDR`); `None`
    /// until it says, then its name is used.
    addr: Option<String>,
}

impl Node {
    fn liveness(&self) -> AgentLiveness {
        AgentLiveness {
            down: self.down,
            drained: self.record.drained,
            reporting_since_ms: self.reporting_since_ms,
        }
    }
}

#[derive(Default)]
struct Outbox {
    start: Vec<JobLaunch>,
    stop: Vec<JobStop>,
}

pub struct Control {
    scheduler: Scheduler,
    jobs: BTreeMap<u64, JobRecord>,
    nodes: Vec<Node>,
    node_index: HashMap<String, usize>,
    next_id: u64,
    outbox: HashMap<usize, Outbox>,
    /// (job, node) launches handed to an agent; a running job is only missed once delivered.
    /// Ordered by node, so that a sync reads its own node's as a range.
    delivered: BTreeSet<(usize, u64)>,
    dirty_jobs: BTreeSet<u64>,
    dirty_nodes: BTreeSet<usize>,
    /// Pending jobs whose dependencies are not met yet; the scheduler does not see them.
    held: BTreeSet<u64>,
    /// Jobs with an earlier attempt told to stop and not yet confirmed gone
    /// ([`JobRecord::stopping`]).
    stopping_jobs: BTreeSet<u64>,
    /// Names of the nodes the scheduler knows, readable without the control lock (ingest
    /// checks it before handing telemetry over).
    pub(crate) known_nodes: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    /// Which agent speaks for each node ([`super::claims`]), shared with ingest.
    pub(crate) claims: Arc<super::claims::NodeClaims>,
    /// The time of the latest operation, for texts relative to now.
    now: i64,
    logs_dir: PathBuf,
    pub(crate) config: JobsConfig,
    /// Node state history, allocations' bookkeeping and audit events ([`ledger`]).
    ledger: ledger::Ledger,
    /// Who the current operation acts for, when a person asked for it (a cancel).
    acting: Option<String>,
    /// Makes and checks the tokens jobs push their metrics with.
    job_tokens: JobTokens,
    /// Scheduling passes so far, timed ([`Control::step`]).
    passes: PassStats,
    /// Pending jobs per user, for the pending cap without a scan of every job: kept in step
    /// by [`Control::take_dirty`], through which every change of a job passes.
    pending: PendingCount,
    /// Array tasks checked against the pending caps and not added yet (an array is added in
    /// steps), per user, with their bytes: counted by the caps, so concurrent arrays cannot
    /// each pass them.
    reserved: HashMap<String, Held>,
    /// Settled jobs, whose records are read back from the job database ([`archive`]).
    archive: archive::Archive,
    /// Settled jobs whose stored output was deleted, for the next commit.
    deleted_output: Vec<(u64, i64)>,
    /// Provenance to record with the next commit ([`crate::provenance`]).
    provenance: Vec<crate::provenance::ProvenanceChange>,
    /// Disk used by stored job output, for its bounds ([`output_usage`]).
    output_usage: output_usage::OutputUsage,
    /// Validation runs: in progress per node, and the latest finished ([`validation`]).
    validations: crate::validation::Validations,
}

/// Which jobs are pending, and how many per user, with the bytes of command and environment
/// they hold.
#[derive(Default)]
struct PendingCount {
    jobs: HashSet<u64>,
    by_user: HashMap<String, Held>,
}

/// Jobs, and their bytes of command and environment ([`JobRequest::kept_bytes`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub jobs: usize,
    pub bytes: usize,
}

impl PendingCount {
    /// Follows `job`'s state.
    fn update(&mut self, job: &JobRecord) {
        let pending = job.state == JobState::Pending;
        if pending == self.jobs.contains(&job.id) {
            return;
        }
        let user = job.request.user();
        let bytes = job.request.kept_bytes();
        if pending {
            self.jobs.insert(job.id);
            let held = self.by_user.entry(user.to_owned()).or_default();
            held.jobs += 1;
            held.bytes += bytes;
        } else {
            self.jobs.remove(&job.id);
            if let Some(held) = self.by_user.get_mut(user) {
                held.jobs -= 1;
                held.bytes = held.bytes.saturating_sub(bytes);
                if held.jobs == 0 {
                    self.by_user.remove(user);
                }
            }
        }
    }

    fn of(&self, user: &str) -> Held {
        self.by_user.get(user).copied().unwrap_or_default()
    }
}

fn qos(req: &JobRequest) -> Qos {
    match req.qos.as_deref() {
        Some("low") => Qos::Low,
        Some("high") => Qos::High,
        _ => Qos::Normal,
    }
}

fn spec_of(id: u64, req: &JobRequest, submit_ms: i64) -> JobSpec {
    JobSpec {
        id: JobId(id),
        user: User(req.user().to_owned()),
        account: Account(req.account().to_owned()),
        shape: Shape {
            nodes: req.nodes,
            gpus_per_node: req.gpus_per_node,
        },
        gpu_model: req.gpu_model.clone().map(GpuModel),
        time_limit: i64::try_from(req.time_limit_secs).unwrap_or(i64::MAX / 2) * 1000,
        qos: qos(req),
        preemptible: req.preemptible,
        max_requeues: req.max_requeues,
        submit: submit_ms,
        oracle_duration: None,
        share: req.gpu_share.as_ref().map(|s| GpuShare {
            percent: s.percent(),
            memory_mb: s.memory_mb(),
        }),
        earlier_runs: 0,
        gpu_profile: req.gpu_profile.clone(),
    }
}

fn signal_of(req: &JobRequest) -> String {
    req.checkpoint_signal
        .clone()
        .unwrap_or_else(|| "SIGTERM".into())
}

pub fn reason_text(reason: &PendingReason, now: i64) -> String {
    match reason {
        PendingReason::New => "submitted, waiting for the next scheduling pass".into(),
        PendingReason::Priority => "waiting behind higher-priority jobs".into(),
        PendingReason::Reserved { at } => {
            let mins = ((at - now).max(0) + 59_999) / 60_000;
            format!(
                "next in line: its GPUs are reserved, at the latest in {mins} min (when running jobs reach their time limits)"
            )
        }
        PendingReason::Resources => "waiting for free GPUs of the requested shape and model".into(),
        PendingReason::QuotaExceeded => "the account is at its GPU quota".into(),
        PendingReason::FifoBlocked => "a job ahead of it is blocked (FIFO)".into(),
        PendingReason::Unsatisfiable => {
            "no node in the cluster can ever run this shape or GPU model; cancel it or add nodes"
                .into()
        }
    }
}

impl Control {
    /// The records changed since the last call, for the job service to commit.
    pub fn take_dirty(&mut self) -> Dirty {
        let changed = std::mem::take(&mut self.dirty_jobs);
        self.unmark(&changed);
        let jobs: Vec<JobRecord> = changed
            .into_iter()
            .filter_map(|id| self.jobs.get(&id).cloned())
            .collect();
        for job in &jobs {
            self.pending.update(job);
        }
        let nodes = std::mem::take(&mut self.dirty_nodes)
            .into_iter()
            .filter_map(|i| self.nodes.get(i).map(|n| (i as u64, n.record.clone())))
            .collect();
        Dirty {
            jobs,
            nodes,
            node_spans: self.ledger.take_spans(),
            events: std::mem::take(&mut self.ledger.events),
            output_deleted: std::mem::take(&mut self.deleted_output),
            provenance: std::mem::take(&mut self.provenance),
        }
    }

    /// Drains node `name` (no new jobs; running ones stay) or resumes it, on behalf of `by`
    /// (a user, or `perch` for automatic remediation), for `reason` when one was given.
    pub fn set_drained(
        &mut self,
        name: &str,
        drained: bool,
        by: &str,
        reason: Option<String>,
        now: i64,
    ) -> Result<(), ControlError> {
        let &idx = self
            .node_index
            .get(name)
            .ok_or_else(|| ControlError::NoSuchNode(name.to_owned()))?;
        let event = if drained {
            Event::Drain(NodeId(idx as u32))
        } else {
            Event::Resume(NodeId(idx as u32))
        };
        let actions = self.step(now, event)?;
        self.apply(now, actions);
        let record = &mut self.nodes[idx].record;
        let changed = record.drained != drained;
        record.drained = drained;
        if drained {
            record.drained_by = Some(by.to_owned());
            record.drain_reason = reason.clone();
        } else {
            record.drained_by = None;
            record.drain_reason = None;
        }
        self.dirty_nodes.insert(idx);
        if changed {
            self.track_node_state(idx, now);
            let (kind, verb) = if drained {
                ("node_drained", "drained")
            } else {
                ("node_resumed", "resumed")
            };
            let why = reason.map(|r| format!(": {r}")).unwrap_or_default();
            self.node_event(now, idx, kind, by, format!("{name} {verb} by {by}{why}"));
        }
        Ok(())
    }

    /// One scheduling step: `event`, then a pass ([`Scheduler::step`]).
    fn step(&mut self, now: i64, event: Event) -> Result<Vec<Action>, perch_scheduler::Error> {
        let mut actions = self.scheduler.handle(now, event)?;
        actions.extend(self.pass(now));
        Ok(actions)
    }

    /// A scheduling pass over the queue, timed ([`PassStats`]).
    fn pass(&mut self, now: i64) -> Vec<Action> {
        let started = std::time::Instant::now();
        let actions = self.scheduler.schedule(now);
        self.passes.record(started.elapsed());
        actions
    }

    /// Puts a new scheduling policy in force (SIGHUP): queued and running jobs stay, and a
    /// pass runs under the new rules at once. Returns whether anything changed.
    pub fn set_policy(&mut self, policy: Config, now: i64) -> Result<bool, ControlError> {
        if policy == self.config.policy {
            return Ok(false);
        }
        self.now = now;
        self.config.policy = policy.clone();
        self.scheduler.reconfigure(policy);
        let actions = self.step(now, Event::Tick)?;
        self.apply(now, actions);
        self.release_held(now)?;
        Ok(true)
    }

    /// Marks nodes whose agents went silent as down (no new jobs) and, once their lease has
    /// run out, fails their jobs; then lets time limits act.
    #[tracing::instrument(name = "scheduler.tick", skip_all)]
    pub fn tick(&mut self, now: i64) -> Result<(), ControlError> {
        self.now = now;
        let timeout = millis(self.config.heartbeat_timeout);
        let lease = millis(self.config.lease);
        for idx in 0..self.nodes.len() {
            let node = NodeId(idx as u32);
            let silent = now - self.nodes[idx].last_sync_ms;
            if !self.nodes[idx].down && silent > timeout {
                self.nodes[idx].down = true;
                let name = self.nodes[idx].record.name.clone();
                let left = (lease - silent).max(0) / 1000;
                tracing::warn!(node = %name, lease_left_secs = left, "node stopped reporting; marking it down (its jobs count as running until its lease runs out)");
                let actions = self.step(now, Event::NodeSilent(node))?;
                self.apply(now, actions);
                self.track_node_state(idx, now);
                let jobs: Vec<u64> = self
                    .jobs
                    .values()
                    .filter(|j| self.runs_here(j.id, &name))
                    .map(|j| j.id)
                    .collect();
                for id in jobs {
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.note(
                            now,
                            format!("{name} stopped reporting; the job counts as running there until the node's lease runs out in {left} s"),
                        );
                        self.dirty_jobs.insert(id);
                    }
                }
                self.node_event(
                    now,
                    idx,
                    "node_down",
                    "perch",
                    format!(
                        "{name}'s agent has not synced for {} s; its jobs are requeued if it stays silent {left} s more (its lease)",
                        silent / 1000
                    ),
                );
            }
            if !self.nodes[idx].lease_expired && silent > lease {
                self.nodes[idx].lease_expired = true;
                let name = self.nodes[idx].record.name.clone();
                tracing::warn!(node = %name, "node's lease ran out; requeueing its jobs");
                let actions = self.step(now, Event::NodeDown(node))?;
                self.apply(now, actions);
                // Its supervisors have stopped everything there: no attempt waits on it.
                self.confirm_stops(idx, None, now);
                self.node_event(
                    now,
                    idx,
                    "node_lease_expired",
                    "perch",
                    format!(
                        "{name} has not synced for {} s, past its lease: its jobs were stopped there and are requeued",
                        silent / 1000
                    ),
                );
            }
        }
        let actions = self.step(now, Event::Tick)?;
        self.apply(now, actions);
        self.release_held(now)?;
        Ok(())
    }
}

/// Whether a submission runs a scheduling pass at once or leaves it to its caller (an array
/// runs one pass for all its tasks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Now,
    Later,
}
