//! The control plane: the one place where job records, nodes and the pure scheduling core
//! meet. Every operation (submit, cancel, an agent's sync, a tick) takes the lock, feeds the
//! core an event with the current time, carries out the actions it returns (launch and stop
//! orders queued for agents, record changes), and commits the changed records to the job
//! database before it returns. The core itself stays pure; this module is its I/O.

mod ledger;
mod remediation;
mod scrape;
#[cfg(test)]
mod tests;

pub use scrape::{AllocationView, ControlSnapshot, NodeView, PendingView, UsageView};

use super::db::{Dirty, Loaded, NodeRecord};
use super::job_token::JobTokens;
use super::record::{JobRecord, JobState, NodeGpus};
use super::spec::{FieldError, JobRequest};
use perch_model::AgentLiveness;
use perch_model::control::{
    JobAttempt, JobExit, JobLaunch, JobStop, LaunchHost, LaunchShare, LogChunk, LogStream,
    SyncRequest, SyncResponse,
};
use perch_scheduler::{
    Account, Action, Cluster, Config, EndState, Event, GpuModel, GpuShare, IdleAction, JobId,
    JobSpec, NodeAlloc, NodeId, NodeName, NodeSpec, PendingReason, Qos, Scheduler, Shape, User,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Write;
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
    #[error("scheduler: {0}")]
    Scheduler(#[from] perch_scheduler::Error),
    #[error("{0}")]
    Db(#[from] super::db::DbError),
    #[error("job logs: {0}")]
    Logs(std::io::Error),
    /// A request that cannot be answered as asked (the message says what to change).
    #[error("{0}")]
    BadRequest(String),
    /// The blocking task running an operation failed (it panicked or was cancelled).
    #[error("the control plane's task failed: {0}")]
    TaskFailed(String),
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
    /// The clock every operation and tick reads "now" from.
    pub clock: crate::clock::Clock,
}

impl Default for JobsConfig {
    fn default() -> Self {
        JobsConfig {
            heartbeat_timeout: Duration::from_secs(30),
            lease: DEFAULT_LEASE,
            policy: Config::perch(vec![]),
            accounts: Default::default(),
            max_pending_per_user: DEFAULT_MAX_PENDING_PER_USER,
            clock: crate::clock::Clock::system(),
        }
    }
}

/// The default of [`JobsConfig::max_pending_per_user`].
pub const DEFAULT_MAX_PENDING_PER_USER: usize = 10_000;

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

pub(crate) struct Control {
    scheduler: Scheduler,
    jobs: BTreeMap<u64, JobRecord>,
    nodes: Vec<Node>,
    node_index: HashMap<String, usize>,
    next_id: u64,
    outbox: HashMap<usize, Outbox>,
    /// (job, node) launches handed to an agent; a running job is only missed once delivered.
    delivered: HashSet<(u64, usize)>,
    dirty_jobs: BTreeSet<u64>,
    dirty_nodes: BTreeSet<usize>,
    /// Pending jobs whose dependencies are not met yet; the scheduler does not see them.
    held: BTreeSet<u64>,
    /// Names of the nodes the scheduler knows, readable without the control lock (ingest
    /// checks it before handing telemetry over).
    pub(crate) known_nodes: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    /// The time of the latest operation, for texts relative to now.
    now: i64,
    logs_dir: PathBuf,
    config: JobsConfig,
    /// Node state history, allocations' bookkeeping and audit events ([`ledger`]).
    ledger: ledger::Ledger,
    /// Who the current operation acts for, when a person asked for it (a cancel).
    acting: Option<String>,
    /// Makes and checks the tokens jobs push their metrics with.
    job_tokens: JobTokens,
    /// Pending jobs per user, for the pending cap without a scan of every job: kept in step
    /// by [`Control::take_dirty`], through which every change of a job passes.
    pending: PendingCount,
    /// Array tasks checked against the pending cap and not added yet (an array is added in
    /// steps), per user: counted by the cap, so concurrent arrays cannot each pass it.
    reserved: HashMap<String, usize>,
}

/// Which jobs are pending, and how many per user.
#[derive(Default)]
struct PendingCount {
    jobs: HashSet<u64>,
    by_user: HashMap<String, usize>,
}

impl PendingCount {
    /// Follows `job`'s state.
    fn update(&mut self, job: &JobRecord) {
        let pending = job.state == JobState::Pending;
        if pending == self.jobs.contains(&job.id) {
            return;
        }
        let user = job.request.user();
        if pending {
            self.jobs.insert(job.id);
            *self.by_user.entry(user.to_owned()).or_default() += 1;
        } else {
            self.jobs.remove(&job.id);
            if let Some(n) = self.by_user.get_mut(user) {
                *n -= 1;
                if *n == 0 {
                    self.by_user.remove(user);
                }
            }
        }
    }

    fn of(&self, user: &str) -> usize {
        self.by_user.get(user).copied().unwrap_or(0)
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
    }
}

fn signal_of(req: &JobRequest) -> String {
    req.checkpoint_signal
        .clone()
        .unwrap_or_else(|| "SIGTERM".into())
}

pub(crate) fn reason_text(reason: &PendingReason, now: i64) -> String {
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
    /// Rebuilds the control plane from the records of the job database; `dir` holds job logs.
    pub(crate) fn open(
        dir: &std::path::Path,
        config: JobsConfig,
        now_ms: i64,
        loaded: Loaded,
    ) -> Result<Control, ControlError> {
        let Loaded {
            jobs,
            nodes,
            node_spans,
        } = loaded;
        let mut c = Control {
            scheduler: Scheduler::new(Cluster::new(), config.policy.clone()),
            jobs: BTreeMap::new(),
            nodes: Vec::new(),
            node_index: HashMap::new(),
            next_id: 1,
            outbox: HashMap::new(),
            delivered: HashSet::new(),
            dirty_jobs: BTreeSet::new(),
            dirty_nodes: BTreeSet::new(),
            held: BTreeSet::new(),
            known_nodes: Arc::default(),
            now: now_ms,
            logs_dir: dir.join("logs"),
            config,
            ledger: ledger::Ledger::default(),
            acting: None,
            job_tokens: JobTokens::load_or_create(dir).map_err(ControlError::Logs)?,
            pending: PendingCount::default(),
            reserved: HashMap::new(),
        };
        for record in nodes {
            // Agents get one heartbeat timeout from now to come back.
            c.add_node(record, now_ms)?;
        }
        c.restore_spans(node_spans);
        for idx in 0..c.nodes.len() {
            // Up from now (the state the control plane starts them in), unless already so.
            c.track_node_state(idx, now_ms);
        }
        for mut job in jobs {
            c.next_id = c.next_id.max(job.id + 1);
            let spec = spec_of(job.id, &job.request, job.submit_ms);
            let result = match job.state {
                JobState::Pending if c.dependencies(&job.request) != Deps::Met => {
                    c.held.insert(job.id);
                    Ok(())
                }
                JobState::Pending => c.scheduler.handle(now_ms, Event::Submit(spec)).map(|_| ()),
                JobState::Running => {
                    let placement = c.placement_of(&job);
                    let start = job.start_ms.unwrap_or(now_ms);
                    let restored = c.scheduler.handle(
                        now_ms,
                        Event::Restore {
                            spec,
                            placement,
                            start,
                            requeues: job.requeues,
                        },
                    );
                    for p in job.placement.iter().filter(|p| p.delivered) {
                        if let Some(&n) = c.node_index.get(&p.node) {
                            c.delivered.insert((job.id, n));
                        }
                    }
                    restored.map(|_| ())
                }
                _ => Ok(()),
            };
            let failed = result.err().map(|e| e.to_string());
            if let Some(e) = &failed {
                job.state = JobState::Failed;
                job.reason = Some(format!("could not be restored after a server restart: {e}"));
                job.end_ms = Some(now_ms);
                c.dirty_jobs.insert(job.id);
            }
            let resend = job.state == JobState::Running;
            let id = job.id;
            c.jobs.insert(id, job);
            if let Some(e) = failed {
                c.close_allocations(id, now_ms);
                c.job_event(
                    now_ms,
                    id,
                    "job_ended",
                    "perch",
                    Some("failed"),
                    format!("job {id} could not be restored after a server restart: {e}"),
                );
            }
            if resend {
                c.ensure_allocations(id);
                // Launch orders the old process queued but never handed over go out again.
                c.queue_launches(id);
            }
        }
        c.refresh_fair_share(now_ms)?;
        for job in c.jobs.values() {
            c.pending.update(job);
        }
        Ok(c)
    }

    fn add_node(&mut self, record: NodeRecord, now_ms: i64) -> Result<usize, ControlError> {
        let spec = NodeSpec {
            name: NodeName(record.name.clone()),
            gpus: record.gpus,
            model: GpuModel(record.model.clone()),
            rack: record.rack.clone(),
            nvlink_islands: record.nvlink_islands.clone(),
            sharing: record.gpu_sharing,
        };
        self.scheduler.handle(now_ms, Event::AddNode(spec))?;
        let idx = self.nodes.len();
        if record.drained {
            self.scheduler
                .handle(now_ms, Event::Drain(NodeId(idx as u32)))?;
        }
        self.node_index.insert(record.name.clone(), idx);
        self.known_nodes
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(record.name.clone());
        self.nodes.push(Node {
            record,
            last_sync_ms: now_ms,
            down: false,
            lease_expired: false,
            reporting_since_ms: now_ms,
            addr: None,
        });
        Ok(idx)
    }

    fn placement_of(&self, job: &JobRecord) -> Vec<NodeAlloc> {
        job.placement
            .iter()
            .filter_map(|p| {
                let &n = self.node_index.get(&p.node)?;
                let mask = p.gpus.iter().fold(0u64, |m, g| m | (1u64 << g));
                Some(NodeAlloc {
                    node: NodeId(n as u32),
                    mask,
                })
            })
            .collect()
    }

    /// The records changed since the last call, for the job service to commit.
    pub(crate) fn take_dirty(&mut self) -> Dirty {
        let jobs: Vec<JobRecord> = std::mem::take(&mut self.dirty_jobs)
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
        }
    }

    fn stop_everywhere(&mut self, id: u64) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let stop = JobStop {
            job: id,
            attempt: job.attempts,
            signal: signal_of(&job.request),
            grace_secs: job.request.grace_secs,
        };
        let nodes: Vec<usize> = job
            .placement
            .iter()
            .filter_map(|p| self.node_index.get(&p.node).copied())
            .collect();
        for n in nodes {
            let out = self.outbox.entry(n).or_default();
            out.start.retain(|l| l.job != id);
            out.stop.push(stop.clone());
            self.delivered.remove(&(id, n));
        }
    }

    fn apply(&mut self, now: i64, actions: Vec<Action>) {
        for action in actions {
            tracing::debug!(?action, "scheduler action");
            match action {
                Action::Start { job, placement } => self.start(now, job.0, &placement),
                Action::Preempt {
                    job,
                    reason,
                    requeued,
                } => {
                    self.stop_everywhere(job.0);
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        j.preemptions += 1;
                        j.note(
                            now,
                            format!(
                                "preempted ({reason:?}){}",
                                if requeued { ", requeued" } else { "" }
                            ),
                        );
                        if requeued {
                            j.state = JobState::Pending;
                        } else {
                            j.state = JobState::Preempted;
                            j.end_ms = Some(now);
                            j.reason = Some(format!("preempted: {reason:?}"));
                        }
                    }
                    self.dirty_jobs.insert(job.0);
                    self.close_allocations(job.0, now);
                    let outcome = if requeued { "requeued" } else { "ended" };
                    self.job_event(
                        now,
                        job.0,
                        "job_preempted",
                        "perch",
                        Some(outcome),
                        format!("job {} preempted ({reason:?}), {outcome}", job.0),
                    );
                    if !requeued {
                        self.job_event(
                            now,
                            job.0,
                            "job_ended",
                            "perch",
                            Some(JobState::Preempted.as_str()),
                            format!("job {} ended: preempted ({reason:?})", job.0),
                        );
                    }
                }
                Action::Requeue { job, reason } => {
                    self.stop_everywhere(job.0);
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        j.requeues += 1;
                        j.state = JobState::Pending;
                        j.note(now, format!("requeued ({reason:?})"));
                    }
                    self.dirty_jobs.insert(job.0);
                    self.close_allocations(job.0, now);
                    self.job_event(
                        now,
                        job.0,
                        "job_requeued",
                        "perch",
                        None,
                        format!("job {} requeued ({reason:?})", job.0),
                    );
                }
                Action::End { job, state } => {
                    let was_running = self
                        .jobs
                        .get(&job.0)
                        .is_some_and(|j| j.state == JobState::Running);
                    if was_running {
                        self.stop_everywhere(job.0);
                    }
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        let (s, reason, code) = match state {
                            EndState::Completed => (JobState::Completed, None, Some(0)),
                            EndState::Failed { code } => (
                                JobState::Failed,
                                Some(format!("exited with code {code}")),
                                Some(code),
                            ),
                            EndState::Cancelled => {
                                (JobState::Cancelled, Some("cancelled".to_owned()), None)
                            }
                            EndState::Timeout => (
                                JobState::Timeout,
                                Some(format!(
                                    "ran past its time limit of {} s",
                                    j.request.time_limit_secs
                                )),
                                None,
                            ),
                            EndState::NodeFail => (
                                JobState::NodeFail,
                                Some(
                                    "its node stopped reporting and no requeues were left"
                                        .to_owned(),
                                ),
                                None,
                            ),
                            EndState::Preempted => {
                                (JobState::Preempted, Some("preempted".to_owned()), None)
                            }
                        };
                        j.state = s;
                        j.reason = reason;
                        if j.exit_code.is_none() {
                            j.exit_code = code;
                        }
                        j.end_ms = Some(now);
                        j.note(now, s.as_str());
                    }
                    self.dirty_jobs.insert(job.0);
                    if was_running {
                        self.close_allocations(job.0, now);
                    }
                    self.job_ended_event(now, job.0, state == EndState::Cancelled);
                }
                Action::IdleReport { job, since } => {
                    let Some(record) = self.jobs.get(&job.0) else {
                        continue;
                    };
                    let (next, _) = self.idle_consequence(record, since);
                    let since_text = perch_alerts::rfc3339(since);
                    let what = format!("all its GPUs idle since {since_text}. {next}");
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        j.note(now, what.clone());
                    }
                    self.dirty_jobs.insert(job.0);
                    self.job_event(
                        now,
                        job.0,
                        "job_idle",
                        "perch",
                        None,
                        format!("job {}: {what}", job.0),
                    );
                }
            }
        }
    }

    fn start(&mut self, now: i64, id: u64, placement: &[NodeAlloc]) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        job.state = JobState::Running;
        job.start_ms = Some(now);
        job.end_ms = None;
        job.attempts += 1;
        job.reason = None;
        job.master_port = None;
        job.placement = placement
            .iter()
            .filter_map(|a| {
                self.nodes.get(a.node.0 as usize).map(|n| NodeGpus {
                    node: n.record.name.clone(),
                    gpus: a.gpu_indices(),
                    delivered: false,
                    exit_code: None,
                })
            })
            .collect();
        let where_ = job
            .placement
            .iter()
            .map(|p| format!("{}{:?}", p.node, p.gpus))
            .collect::<Vec<_>>()
            .join(" ");
        let attempt = job.attempts;
        job.note(now, format!("started on {where_} (attempt {attempt})"));
        self.dirty_jobs.insert(id);
        self.open_allocations(id, now);
        self.job_event(
            now,
            id,
            "job_started",
            "perch",
            None,
            format!("job {id} started on {where_} (attempt {attempt})"),
        );
        self.queue_launches(id);
    }

    /// What distributed training needs on rank `rank` of job `id`, without a wrapper: for
    /// `torch.distributed` (`env://`), DeepSpeed and Horovod `MASTER_ADDR` (rank 0's advertised
    /// address), `MASTER_PORT`, `WORLD_SIZE` (GPUs in the job: one process per GPU),
    /// `NODE_RANK`, `RANK` (the global rank of this node's first process),
    /// `LOCAL_WORLD_SIZE` (GPUs here); `PERCH_NODELIST` (the nodes, comma-separated, rank
    /// order) and `PERCH_NODE_ADDRS` (their addresses); and `torchrun`'s own `PET_*` defaults,
    /// so `torchrun train.py` starts the right number of processes on every node.
    ///
    /// The port is `port` ([`Control::rendezvous_port`]); without one (rank 0, whose agent
    /// picks it) `MASTER_PORT` is left to the agent.
    fn distributed_env(&self, id: u64, rank: usize, port: Option<String>) -> Vec<(String, String)> {
        let Some(job) = self.jobs.get(&id) else {
            return Vec::new();
        };
        let addr_of = |node: &str| {
            self.node_index
                .get(node)
                .and_then(|&i| self.nodes[i].addr.clone())
                .unwrap_or_else(|| node.to_owned())
        };
        let names: Vec<&str> = job.placement.iter().map(|p| p.node.as_str()).collect();
        let addrs: Vec<String> = names.iter().map(|n| addr_of(n)).collect();
        let local = job.placement.get(rank).map_or(0, |p| p.gpus.len());
        let world: usize = job.placement.iter().map(|p| p.gpus.len()).sum();
        let first_rank: usize = job.placement[..rank.min(job.placement.len())]
            .iter()
            .map(|p| p.gpus.len())
            .sum();
        let master = addrs.first().cloned().unwrap_or_else(|| "127.0.0.1".into());
        let nnodes = job.placement.len();
        [
            ("MASTER_ADDR", Some(master.clone())),
            ("MASTER_PORT", port.clone()),
            ("WORLD_SIZE", Some(world.to_string())),
            ("NODE_RANK", Some(rank.to_string())),
            ("RANK", Some(first_rank.to_string())),
            ("LOCAL_WORLD_SIZE", Some(local.to_string())),
            ("PERCH_NODELIST", Some(names.join(","))),
            ("PERCH_NODE_ADDRS", Some(addrs.join(","))),
            ("PET_NNODES", Some(nnodes.to_string())),
            ("PET_NODE_RANK", Some(rank.to_string())),
            ("PET_NPROC_PER_NODE", Some(local.max(1).to_string())),
            ("PET_MASTER_ADDR", Some(master)),
            ("PET_MASTER_PORT", port),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_owned(), v?)))
        .collect()
    }

    /// Job `id`'s rendezvous port: its own `MASTER_PORT`, or the one its rank-0 node picked
    /// ([`JobRecord::master_port`]); `None` while that node has not reported it.
    fn rendezvous_port(&self, id: u64) -> Option<String> {
        let job = self.jobs.get(&id)?;
        match job.request.env.get("MASTER_PORT") {
            Some(own) => Some(own.clone()),
            None => job.master_port.map(|p| p.to_string()),
        }
    }

    /// The hostfile of job `id` (MPI's `addr slots=N`, rank order).
    fn hosts(&self, id: u64) -> Vec<LaunchHost> {
        let Some(job) = self.jobs.get(&id) else {
            return Vec::new();
        };
        job.placement
            .iter()
            .map(|p| LaunchHost {
                addr: self
                    .node_index
                    .get(&p.node)
                    .and_then(|&i| self.nodes[i].addr.clone())
                    .unwrap_or_else(|| p.node.clone()),
                slots: u32::try_from(p.gpus.len()).unwrap_or(u32::MAX).max(1),
            })
            .collect()
    }

    /// Queues the launch orders of a running job for every node of its placement whose
    /// agent has not been handed one yet. Unless the job chose its own `MASTER_PORT`, rank 0
    /// goes first and its agent picks a free port there; the other ranks are queued once
    /// that port is known (their agents' next sync after rank 0's).
    fn queue_launches(&mut self, id: u64) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let port = self.rendezvous_port(id);
        let hosts = self.hosts(id);
        for (rank, p) in job.placement.iter().enumerate() {
            let Some(&node) = self.node_index.get(&p.node) else {
                continue;
            };
            let queued = self.outbox.get(&node).is_some_and(|o| {
                o.start
                    .iter()
                    .any(|l| l.job == id && l.attempt == job.attempts)
            });
            if p.delivered || queued || (rank > 0 && port.is_none()) {
                continue;
            }
            let mut env = job.request.env.clone();
            env.insert("PERCH_JOB_ID".into(), id.to_string());
            env.insert("PERCH_JOB_ATTEMPT".into(), job.attempts.to_string());
            // The SDK's header syntax percent-encodes values: "Bearer%20<token>".
            let token = self.job_tokens.token(id, job.attempts);
            env.insert(
                "OTEL_EXPORTER_OTLP_HEADERS".into(),
                format!("authorization=Bearer%20{token}"),
            );
            if let Some(name) = &job.request.name {
                env.insert("PERCH_JOB_NAME".into(), name.clone());
            }
            for (key, value) in self.distributed_env(id, rank, port.clone()) {
                // The job's own value wins (a port of its choosing, say).
                env.entry(key).or_insert(value);
            }
            let launch = JobLaunch {
                job: id,
                attempt: job.attempts,
                command: job.request.command.clone(),
                env,
                workdir: job.request.workdir.clone(),
                gpus: p.gpus.clone(),
                user: job.request.user().to_owned(),
                node_rank: rank as u32,
                nodes: job.request.nodes,
                time_limit_secs: job.request.time_limit_secs,
                checkpoint_signal: signal_of(&job.request),
                grace_secs: job.request.grace_secs,
                sim_profile: job.request.sim_profile.clone(),
                gpu_share: job.request.gpu_share.as_ref().map(|s| LaunchShare {
                    percent: s.percent(),
                    memory_mb: s.memory_mb(),
                }),
                cpus: job.request.cpus,
                memory_mb: job.request.memory_mb,
                pick_master_port: port.is_none(),
                hosts: hosts.clone(),
            };
            self.outbox.entry(node).or_default().start.push(launch);
        }
    }

    /// Submits a job, or `array` copies of it, in one step; returns the records in id order.
    /// The server submits through [`Control::start_array`] and steps of
    /// [`Control::submit_array_tasks`] (see `JobService::submit`); tests at a chosen time
    /// through this.
    #[cfg(test)]
    pub(crate) fn submit(
        &mut self,
        request: JobRequest,
        now: i64,
    ) -> Result<Vec<JobRecord>, ControlError> {
        let Some(count) = request.array else {
            self.check_submission(&request, now)?;
            let id = self.next_id;
            self.submit_one(request, id, now, Pass::Now)?;
            self.next_id += 1;
            self.release_held(now)?;
            return Ok(self.view(id).into_iter().collect());
        };
        let first = self.start_array(&request, now)?;
        self.submit_array_tasks(&request, first, 0..count, now)?;
        Ok((first..first + u64::from(count))
            .filter_map(|id| self.view(id))
            .collect())
    }

    /// Checks a submission of `request` (and all its array tasks) and reserves ids for it;
    /// returns the first. The tasks are then added by [`Control::submit_array_tasks`], in one
    /// or more steps: a 10,000-task array added at once held the control plane, and every
    /// agent's sync, for seconds.
    pub(crate) fn start_array(
        &mut self,
        request: &JobRequest,
        now: i64,
    ) -> Result<u64, ControlError> {
        self.check_submission(request, now)?;
        let count = request.array.unwrap_or(1);
        *self.reserved.entry(request.user().to_owned()).or_default() += count as usize;
        let first = self.next_id;
        self.next_id += u64::from(count);
        Ok(first)
    }

    /// Gives back `n` of `user`'s reserved array tasks (added, or never to be).
    pub(crate) fn release_reservation(&mut self, user: &str, n: usize) {
        if let Some(r) = self.reserved.get_mut(user) {
            *r = r.saturating_sub(n);
            if *r == 0 {
                self.reserved.remove(user);
            }
        }
    }

    /// Adds array tasks `tasks` of `request`, whose ids start at `first` (from
    /// [`Control::start_array`]), with one scheduling pass for all of them. A request with no
    /// `array` is one job, task 0.
    pub(crate) fn submit_array_tasks(
        &mut self,
        request: &JobRequest,
        first: u64,
        tasks: std::ops::Range<u32>,
        now: i64,
    ) -> Result<(), ControlError> {
        self.now = now;
        let user = request.user().to_owned();
        for task in tasks.clone() {
            let mut r = request.clone();
            let added = if r.array.take().is_none() {
                // A single job: no array variables, no task name.
                self.submit_one(r, first, now, Pass::Later)
            } else {
                r.env.insert("PERCH_ARRAY_JOB_ID".into(), first.to_string());
                r.env.insert("PERCH_ARRAY_TASK_ID".into(), task.to_string());
                r.name = Some(format!(
                    "{}[{task}]",
                    request.name.as_deref().unwrap_or("array")
                ));
                self.submit_one(r, first + u64::from(task), now, Pass::Later)
            };
            match added {
                // Pending now (counted once this operation's changes are taken).
                Ok(()) => self.release_reservation(&user, 1),
                Err(e) => {
                    self.release_reservation(&user, (tasks.end - task) as usize);
                    return Err(e);
                }
            }
        }
        let actions = self.scheduler.schedule(now);
        self.apply(now, actions);
        self.release_held(now)
    }

    /// Refuses a submission that is invalid, names a job that does not exist, or would take
    /// its user past the pending cap.
    fn check_submission(&mut self, request: &JobRequest, now: i64) -> Result<(), ControlError> {
        request.validate()?;
        self.now = now;
        for (field, deps) in [
            ("after_ok", &request.after_ok),
            ("after_any", &request.after_any),
        ] {
            if let Some(missing) = deps.iter().find(|d| !self.jobs.contains_key(d)) {
                return Err(ControlError::Invalid(FieldError {
                    field,
                    message: format!("no job {missing}; `perch jobs --all` lists them"),
                }));
            }
        }
        let adding = request.array.map_or(1, |n| n as usize);
        let user = request.user();
        let pending = self.pending.of(user) + self.reserved.get(user).copied().unwrap_or(0);
        if pending + adding > self.config.max_pending_per_user {
            return Err(ControlError::TooManyPending {
                user: user.to_owned(),
                pending,
                adding,
                limit: self.config.max_pending_per_user,
            });
        }
        Ok(())
    }

    /// Whether a job's dependencies allow it to be scheduled.
    fn dependencies(&self, request: &JobRequest) -> Deps {
        let state = |id: &u64| self.jobs.get(id).map(|j| j.state);
        for id in &request.after_ok {
            match state(id) {
                Some(JobState::Completed) => {}
                Some(s) if s.is_final() => {
                    return Deps::Never(format!("job {id} ended {} (after_ok)", s.as_str()));
                }
                _ => return Deps::Waiting,
            }
        }
        if request
            .after_any
            .iter()
            .any(|id| !state(id).is_some_and(JobState::is_final))
        {
            return Deps::Waiting;
        }
        Deps::Met
    }

    /// Hands held jobs whose dependencies are now met to the scheduler, and cancels those
    /// whose dependencies can never be met.
    fn release_held(&mut self, now: i64) -> Result<(), ControlError> {
        let held: Vec<u64> = self.held.iter().copied().collect();
        for id in held {
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            match self.dependencies(&job.request) {
                Deps::Waiting => {}
                Deps::Met => {
                    self.held.remove(&id);
                    let spec = spec_of(id, &job.request, job.submit_ms);
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.note(now, "dependencies met");
                    }
                    let actions = self.scheduler.step(now, Event::Submit(spec))?;
                    self.apply(now, actions);
                }
                Deps::Never(why) => {
                    self.held.remove(&id);
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.state = JobState::Cancelled;
                        j.reason = Some(format!("dependency can never be met: {why}"));
                        j.end_ms = Some(now);
                        j.note(now, "cancelled: dependency can never be met");
                    }
                    self.dirty_jobs.insert(id);
                    self.job_ended_event(now, id, false);
                }
            }
        }
        Ok(())
    }

    /// Adds one job with id `id` (reserved by the caller).
    fn submit_one(
        &mut self,
        mut request: JobRequest,
        id: u64,
        now: i64,
        pass: Pass,
    ) -> Result<(), ControlError> {
        // Record who runs it and who pays explicitly, so listings and accounting never guess.
        let user = request.user().to_owned();
        let account = request.account().to_owned();
        request.user = Some(user);
        request.account = Some(account);
        let spec = spec_of(id, &request, now);
        spec.validate()?;
        let mut record = JobRecord {
            id,
            request,
            state: JobState::Pending,
            reason: None,
            submit_ms: now,
            start_ms: None,
            end_ms: None,
            placement: Vec::new(),
            attempts: 0,
            requeues: 0,
            preemptions: 0,
            exit_code: None,
            timeline: Vec::new(),
            allocations: Vec::new(),
            master_port: None,
        };
        record.note(now, "submitted");
        let waits = self.dependencies(&record.request) != Deps::Met;
        let user = record.request.user().to_owned();
        let what = match &record.request.name {
            Some(name) => format!("job {id} ({name}) submitted by {user}"),
            None => format!("job {id} submitted by {user}"),
        };
        self.jobs.insert(id, record);
        self.dirty_jobs.insert(id);
        self.job_event(now, id, "job_submitted", &user, None, what);
        if waits {
            self.held.insert(id);
        } else {
            let mut actions = self.scheduler.handle(now, Event::Submit(spec))?;
            if pass == Pass::Now {
                actions.extend(self.scheduler.schedule(now));
            }
            self.apply(now, actions);
        }
        Ok(())
    }

    /// Cancels job `id` at the request of user `by` (who is named in the audit trail).
    pub(crate) fn cancel(
        &mut self,
        id: u64,
        by: &str,
        now: i64,
    ) -> Result<JobRecord, ControlError> {
        self.acting = Some(by.to_owned());
        let result = self.cancel_as_acting(id, now);
        self.acting = None;
        result
    }

    fn cancel_as_acting(&mut self, id: u64, now: i64) -> Result<JobRecord, ControlError> {
        self.now = now;
        let job = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        if job.state.is_final() {
            return Err(ControlError::AlreadyEnded {
                id,
                state: job.state.as_str(),
            });
        }
        if self.held.remove(&id) {
            if let Some(j) = self.jobs.get_mut(&id) {
                j.state = JobState::Cancelled;
                j.reason = Some("cancelled".into());
                j.end_ms = Some(now);
                j.note(now, "cancelled");
            }
            self.dirty_jobs.insert(id);
            self.job_ended_event(now, id, true);
        } else {
            let actions = self.scheduler.step(now, Event::Cancel(JobId(id)))?;
            self.apply(now, actions);
        }
        self.release_held(now)?;
        self.view(id).ok_or(ControlError::NoSuchJob(id))
    }

    /// A record with its live pending reason filled in.
    pub(crate) fn view(&self, id: u64) -> Option<JobRecord> {
        let mut job = self.jobs.get(&id)?.clone();
        if self.held.contains(&id) {
            let r = &job.request;
            job.reason = Some(format!(
                "waiting for dependencies: after_ok {:?}, after_any {:?}",
                r.after_ok, r.after_any
            ));
        } else if job.state == JobState::Pending {
            let shared = job.request.gpu_share.is_some();
            job.reason = self
                .scheduler
                .pending_reason(JobId(id))
                .as_ref()
                .map(|r| match r {
                    PendingReason::Unsatisfiable if shared => "no node in the cluster takes shared GPU jobs (agent.gpu_sharing) with that much GPU memory; cancel it or enable sharing on a node".into(),
                    PendingReason::Resources if shared => "waiting for a GPU whose shares, measured utilization and free memory leave room".into(),
                    r => {
                        let text = reason_text(r, self.now);
                        match self.reason_detail(&job, r) {
                            Some(detail) => format!("{text}: {detail}"),
                            None => text,
                        }
                    }
                });
        }
        Some(job)
    }

    /// What a pending job waits for, in numbers ("needs 2 nodes x 8 GPUs; 1 node has 8 free,
    /// 12 free in all"; "account vision holds 32 of its quota of 32").
    fn reason_detail(&self, job: &JobRecord, reason: &PendingReason) -> Option<String> {
        let id = JobId(job.id);
        match reason {
            PendingReason::QuotaExceeded => {
                let account = Account(job.request.account().to_owned());
                let mut held = Vec::new();
                if let Some(quota) = self.scheduler.account_quota(&account) {
                    let holds = self.scheduler.account_alloc(&account);
                    held.push(format!("{holds} of its quota of {quota} GPUs"));
                }
                let wanted = job.request.gpu_model.as_deref();
                for (model, holds, cap) in self.scheduler.model_quota_use(&account) {
                    if wanted.is_none_or(|w| w == model.0) {
                        held.push(format!("{holds} of its {cap} {} GPUs", model.0));
                    }
                }
                if held.is_empty() {
                    return None;
                }
                Some(format!(
                    "account {} holds {}{}",
                    account.0,
                    held.join(", "),
                    if self.config.policy.borrowing {
                        "; no idle GPUs to borrow"
                    } else {
                        " (borrowing is off)"
                    }
                ))
            }
            PendingReason::Resources
            | PendingReason::Reserved { .. }
            | PendingReason::Priority
            | PendingReason::FifoBlocked => {
                let (nodes, per_node, fitting, free) = self.scheduler.room_for(id)?;
                let model = job
                    .request
                    .gpu_model
                    .as_deref()
                    .map(|m| format!(" {m}"))
                    .unwrap_or_default();
                let gpus = if per_node == 1 { "GPU" } else { "GPUs" };
                let shape = if nodes == 1 {
                    format!("{per_node}{model} {gpus} on one node")
                } else {
                    format!("{nodes} nodes x {per_node}{model} {gpus}")
                };
                let nodes_word = if fitting == 1 {
                    "node has"
                } else {
                    "nodes have"
                };
                Some(format!(
                    "needs {shape}; {fitting} {nodes_word} {per_node} free now, {free} GPUs free in all"
                ))
            }
            PendingReason::New | PendingReason::Unsatisfiable => None,
        }
    }

    pub(crate) fn list(&self, filter: impl Fn(&JobRecord) -> bool, limit: usize) -> Vec<JobRecord> {
        self.jobs
            .values()
            .rev()
            .filter(|j| filter(j))
            .take(limit)
            .filter_map(|j| self.view(j.id))
            .collect()
    }

    /// The job and user a job metrics token speaks for: the token must be this server's, for
    /// the job's current attempt, and the job running or ended less than a minute ago.
    pub(crate) fn job_of_token(&self, token: &str, now: i64) -> Option<(u64, String)> {
        let (id, attempt) = self.job_tokens.verify(token)?;
        let job = self.jobs.get(&id)?;
        let live = job.state == JobState::Running
            || job
                .end_ms
                .is_some_and(|end| now - end <= super::job_token::GRACE_MS);
        (job.attempts == attempt && live).then(|| (id, job.request.user().to_owned()))
    }

    /// Why no set of today's nodes could ever run `req`, naming the largest shape that fits,
    /// or `None` when one could (or no node has joined yet: the cluster is still forming).
    /// Such a job is still accepted (nodes may join), but its submitter is told at once.
    pub(crate) fn shape_warning(&self, req: &JobRequest) -> Option<String> {
        if self.nodes.is_empty() || req.gpu_share.is_some() {
            return None;
        }
        let model_ok = |n: &Node| req.gpu_model.as_ref().is_none_or(|m| *m == n.record.model);
        let fitting = self
            .nodes
            .iter()
            .filter(|n| model_ok(n) && n.record.gpus >= req.gpus_per_node)
            .count();
        if fitting >= req.nodes as usize {
            return None;
        }
        let model = req
            .gpu_model
            .as_ref()
            .map_or(String::new(), |m| format!(" {m}"));
        let widest = self
            .nodes
            .iter()
            .filter(|n| model_ok(n))
            .map(|n| n.record.gpus)
            .max()
            .unwrap_or(0);
        Some(format!(
            "no set of this cluster's {} nodes can run {} node(s) x {}{model} GPUs: {fitting} node(s) have {} or more{model} GPUs, and the largest has {widest}; the job waits until enough nodes join (cancel it, or ask for at most {fitting} node(s) x {} GPUs, or {} GPUs on one node)",
            self.nodes.len(),
            req.nodes,
            req.gpus_per_node,
            req.gpus_per_node,
            req.gpus_per_node,
            widest,
        ))
    }

    /// The queue in the scheduler's order with each job's priority, then the jobs held back
    /// for their dependencies (not in line yet, so no priority), oldest first: every pending
    /// job `perch jobs` shows.
    pub(crate) fn queue(&self) -> Vec<(JobRecord, Option<f64>)> {
        let in_line = self
            .scheduler
            .queue()
            .into_iter()
            .filter_map(|q| self.view(q.job.0).map(|j| (j, Some(q.priority))));
        let held = self
            .held
            .iter()
            .filter_map(|&id| self.view(id).map(|j| (j, None)));
        in_line.chain(held).collect()
    }

    /// (name, gpus, model, rack, allocated GPUs, running job ids, seconds since last sync) per
    /// node; its state needs its telemetry too and is [`crate::node_status`]'s to say.
    pub(crate) fn nodes(&self, now: i64) -> Vec<serde_json::Value> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let id = NodeId(i as u32);
                let cluster = self.scheduler.cluster();
                let allocated = (0..n.record.gpus).filter(|g| !cluster.holders(id, *g).is_empty()).count();
                let jobs: BTreeSet<u64> = (0..n.record.gpus).flat_map(|g| cluster.holders(id, g)).map(|j| j.0).collect();
                serde_json::json!({
                    "name": n.record.name, "gpus": n.record.gpus, "gpu_model": n.record.model,
                    "rack": n.record.rack, "allocated_gpus": allocated, "jobs": jobs,
                    "gpu_sharing": n.record.gpu_sharing, "nvlink_islands": cluster.nvlink_islands(id),
                    "last_sync_secs_ago": (now - n.last_sync_ms) as f64 / 1000.0,
                })
            })
            .collect()
    }

    /// Drains node `name` (no new jobs; running ones stay) or resumes it, on behalf of `by`
    /// (a user, or `perch` for automatic remediation), for `reason` when one was given.
    pub(crate) fn set_drained(
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
        let actions = self.scheduler.step(now, event)?;
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

    pub(crate) fn sync(
        &mut self,
        req: SyncRequest,
        now: i64,
    ) -> Result<SyncResponse, ControlError> {
        self.now = now;
        let name = req.node.as_str().to_owned();
        let mut response = SyncResponse::default();
        if let Err(e) = self.store_logs(&name, &req.logs, &mut response) {
            // Job output is kept by the agent and sent again (it moves on only when the answer
            // says where to continue from): a full or broken log disk must not fail the sync,
            // or the node would go down and its jobs be requeued.
            tracing::warn!(node = %name, error = %e, "cannot store job output; the agent sends it again");
            response.log_offsets.clear();
        }
        if req.gpus == 0 {
            // A node without GPUs is monitored but runs no jobs; anything it runs is stray.
            response.stop = req
                .running
                .iter()
                .map(|r| JobStop {
                    job: r.job,
                    attempt: r.attempt,
                    signal: "SIGTERM".into(),
                    grace_secs: 10,
                })
                .collect();
            response.acknowledged = req.exited.iter().map(JobExit::id).collect();
            return Ok(response);
        }
        let idx = match self.node_index.get(&name) {
            Some(&i) => i,
            None => {
                let record = NodeRecord {
                    name: name.clone(),
                    gpus: req.gpus,
                    model: req.gpu_model.clone(),
                    rack: reported_rack(&req),
                    drained: false,
                    nvlink_islands: reported_islands(&req),
                    gpu_sharing: req.gpu_sharing,
                    drained_by: None,
                    drain_reason: None,
                    simulated: false,
                };
                let i = self.add_node(record, now)?;
                self.dirty_nodes.insert(i);
                self.track_node_state(i, now);
                let what = format!("{name} joined with {} {} GPUs", req.gpus, req.gpu_model);
                self.node_event(now, i, "node_joined", "perch", what);
                i
            }
        };
        self.nodes[idx].last_sync_ms = now;
        self.nodes[idx].lease_expired = false;
        self.nodes[idx].addr = req
            .advertise_addr
            .clone()
            .filter(|a| perch_model::control::is_host_address(a));
        response.lease_ms = self.config.lease.as_millis().try_into().unwrap_or(u64::MAX);
        self.update_node_features(idx, &req, now)?;
        if self.nodes[idx].down {
            self.nodes[idx].down = false;
            self.nodes[idx].reporting_since_ms = now;
            let actions = self
                .scheduler
                .step(now, Event::NodeUp(NodeId(idx as u32)))?;
            self.apply(now, actions);
            self.track_node_state(idx, now);
            self.node_event(
                now,
                idx,
                "node_up",
                "perch",
                format!("{name}'s agent reports again"),
            );
        }
        for note in &req.notes {
            if let Some(j) = self.jobs.get_mut(&note.job) {
                j.note(now, format!("{name}: {}", note.text));
                self.dirty_jobs.insert(note.job);
            }
        }
        for exit in &req.exited {
            response.acknowledged.push(exit.id());
            let JobExit {
                job,
                attempt,
                code,
                stopped,
                fenced,
                error,
            } = exit;
            let current = self.runs_here(*job, &name).then(|| self.jobs[job].attempts);
            if current != Some(*attempt) || !self.delivered.contains(&(*job, idx)) {
                // An earlier attempt's exit (it was stopped after the job was requeued): it
                // never ends the attempt that runs now.
                if let Some(j) = self.jobs.get_mut(job) {
                    j.note(
                        now,
                        format!("attempt {attempt} ended on {name} with code {code}"),
                    );
                    self.dirty_jobs.insert(*job);
                }
                continue;
            }
            if *fenced {
                // It did not end: it lost its node (the server restarted too, so its lease
                // had not run out here). Like a node failure for this one job.
                if let Some(j) = self.jobs.get_mut(job) {
                    j.note(
                        now,
                        format!("stopped on {name} by its supervisor: the node's lease ran out while it could not reach the server"),
                    );
                }
                let actions = self.scheduler.step(now, Event::JobLost(JobId(*job)))?;
                self.apply(now, actions);
                continue;
            }
            let Some(j) = self.jobs.get_mut(job) else {
                continue;
            };
            j.note(
                now,
                format!(
                    "exited with code {code} on {name}{}",
                    if *stopped { " (stopped by perch)" } else { "" }
                ),
            );
            self.dirty_jobs.insert(*job);
            // A job on several nodes ends when all its ranks have ended, or at once when
            // one fails: perch stops the others and names the failing rank.
            let ranks = j.placement.len();
            let rank = j.placement.iter().position(|p| p.node == name);
            let mut failed_rank = None;
            if let (true, Some(rank)) = (ranks > 1, rank) {
                j.placement[rank].exit_code = Some(*code);
                if *code == 0 {
                    let left = j.placement.iter().filter(|p| p.exit_code.is_none()).count();
                    if left > 0 {
                        j.note(
                            now,
                            format!("rank {rank} finished on {name}; waiting for {left} more of {ranks} ranks"),
                        );
                        continue;
                    }
                } else {
                    failed_rank = Some(format!(
                        "rank {rank} of {ranks} (on {name}) {}; perch stopped the other ranks",
                        match error {
                            Some(why) => format!("could not start: {why}"),
                            None => format!("exited with code {code}"),
                        }
                    ));
                }
            }
            j.exit_code = Some(*code);
            let actions = self.scheduler.step(
                now,
                Event::JobExited {
                    job: JobId(*job),
                    code: *code,
                },
            )?;
            self.apply(now, actions);
            let Some(j) = self.jobs.get_mut(job) else {
                continue;
            };
            if let Some(why) = failed_rank {
                j.reason = Some(why);
            } else if let Some(why) = error {
                j.reason = Some(format!("could not start on {name}: {why}"));
            }
        }
        let exited: HashSet<JobAttempt> = req.exited.iter().map(JobExit::id).collect();
        let reported: HashSet<JobAttempt> = req.running.iter().copied().collect();
        // Processes the server does not expect here (a job that ended or moved, an attempt
        // that is not the current one) are stopped: no job runs twice.
        for run in &req.running {
            let expected = self.runs_here(run.job, &name)
                && self.jobs.get(&run.job).map(|j| j.attempts) == Some(run.attempt);
            if !expected {
                let (signal, grace) = self.jobs.get(&run.job).map_or_else(
                    || ("SIGTERM".to_owned(), 10),
                    |j| (signal_of(&j.request), j.request.grace_secs),
                );
                response.stop.push(JobStop {
                    job: run.job,
                    attempt: run.attempt,
                    signal,
                    grace_secs: grace,
                });
            }
        }
        // Jobs the agent was given but no longer has: it restarted and lost them.
        let lost: Vec<u64> = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Running && j.placement.iter().any(|p| p.node == name))
            .filter(|j| {
                let run = JobAttempt {
                    job: j.id,
                    attempt: j.attempts,
                };
                // A rank that ended (and whose exit the server has) is not lost.
                let ended_here = j
                    .placement
                    .iter()
                    .any(|p| p.node == name && p.exit_code.is_some());
                self.delivered.contains(&(j.id, idx))
                    && !reported.contains(&run)
                    && !exited.contains(&run)
                    && !ended_here
            })
            .map(|j| j.id)
            .collect();
        for job in lost {
            if let Some(j) = self.jobs.get_mut(&job) {
                j.note(
                    now,
                    format!("processes lost on {name} (its agent restarted without them)"),
                );
            }
            let actions = self.scheduler.step(now, Event::JobLost(JobId(job)))?;
            self.apply(now, actions);
        }
        for mp in &req.master_ports {
            let Some(j) = self.jobs.get_mut(&mp.job) else {
                continue;
            };
            let rank0_here = j.placement.first().is_some_and(|p| p.node == name);
            if j.state != JobState::Running
                || j.attempts != mp.attempt
                || !rank0_here
                || j.master_port.is_some()
                || mp.port == 0
            {
                continue;
            }
            j.master_port = Some(mp.port);
            j.note(now, format!("rendezvous port {} picked on {name}", mp.port));
            self.dirty_jobs.insert(mp.job);
            self.queue_launches(mp.job);
        }
        if let Some(out) = self.outbox.remove(&idx) {
            for launch in &out.start {
                self.delivered.insert((launch.job, idx));
                if let Some(j) = self.jobs.get_mut(&launch.job) {
                    for p in j.placement.iter_mut().filter(|p| p.node == name) {
                        p.delivered = true;
                    }
                    self.dirty_jobs.insert(launch.job);
                }
            }
            response.start = out.start;
            // The stop that ended or moved the job goes first: it is the one whose signal the
            // job asked for (its checkpoint signal), and the first of a pair is kept below.
            let found = std::mem::replace(&mut response.stop, out.stop);
            response.stop.extend(found);
        }
        // One stop per attempt (a requeue's stop and a report of the same run can meet here).
        let mut seen = HashSet::new();
        response.stop.retain(|s| seen.insert((s.job, s.attempt)));
        self.release_held(now)?;
        Ok(response)
    }

    /// A snapshot for estimating the first `max` pending jobs' starts, off the lock; with
    /// `upto`, only as far as that job.
    pub(crate) fn start_plan(
        &self,
        now: i64,
        max: usize,
        upto: Option<u64>,
    ) -> perch_scheduler::StartPlan {
        self.scheduler.start_plan(now, max, upto.map(JobId))
    }

    /// What perch does with job `job`, idle since `since`, under the idle policy: in words, and
    /// when (if it acts at all).
    pub(crate) fn idle_consequence(&self, job: &JobRecord, since: i64) -> (String, Option<i64>) {
        let idle = &self.config.policy.idle;
        match idle.action {
            IdleAction::Reclaim { requeue } if job.request.preemptible => {
                let at = since + idle.window + idle.grace;
                let what = if requeue { "requeues" } else { "stops" };
                (
                    format!(
                        "Unless its GPUs get busy, perch {what} it from {} when other jobs wait ({}, then SIGKILL after {} s).",
                        perch_alerts::rfc3339(at),
                        signal_of(&job.request),
                        job.request.grace_secs,
                    ),
                    Some(at),
                )
            }
            IdleAction::Reclaim { .. } => (
                "It is not preemptible, so perch only reports it.".to_owned(),
                None,
            ),
            IdleAction::Report | IdleAction::Off => (
                "perch only reports it ([scheduler.idle] action = \"report\").".to_owned(),
                None,
            ),
        }
    }

    /// Puts a new scheduling policy in force (SIGHUP): queued and running jobs stay, and a
    /// pass runs under the new rules at once. Returns whether anything changed.
    pub(crate) fn set_policy(&mut self, policy: Config, now: i64) -> Result<bool, ControlError> {
        if policy == self.config.policy {
            return Ok(false);
        }
        self.now = now;
        self.config.policy = policy.clone();
        self.scheduler.reconfigure(policy);
        let actions = self.scheduler.step(now, Event::Tick)?;
        self.apply(now, actions);
        self.release_held(now)?;
        Ok(true)
    }

    /// Whether the request's user (not an operator) may charge its account at its QOS
    /// ([`super::accounts`]).
    pub(crate) fn may_charge(&self, request: &JobRequest) -> Result<(), ControlError> {
        let qos = request.qos.as_deref().unwrap_or("normal");
        super::accounts::may_charge(
            &self.config.accounts,
            request.user(),
            request.account(),
            qos,
        )
        .map_err(ControlError::Forbidden)
    }

    /// Whether job `job` is running with part of its placement on node `name`.
    fn runs_here(&self, job: u64, name: &str) -> bool {
        self.jobs.get(&job).is_some_and(|j| {
            j.state == JobState::Running && j.placement.iter().any(|p| p.node == name)
        })
    }

    /// Follows an agent's report of its node's NVLink islands and sharing setting (they may
    /// change when the agent restarts with new settings, or become known later).
    fn update_node_features(
        &mut self,
        idx: usize,
        req: &SyncRequest,
        now: i64,
    ) -> Result<(), ControlError> {
        let islands = reported_islands(req);
        let rack = reported_rack(req);
        let record = &self.nodes[idx].record;
        if record.nvlink_islands == islands
            && record.gpu_sharing == req.gpu_sharing
            && record.rack == rack
        {
            return Ok(());
        }
        let moved = (record.rack != rack).then(|| (record.rack.clone(), rack.clone()));
        self.scheduler.handle(
            now,
            Event::UpdateNode {
                node: NodeId(idx as u32),
                nvlink_islands: islands.clone(),
                sharing: req.gpu_sharing,
                rack: Some(rack.clone()),
            },
        )?;
        let record = &mut self.nodes[idx].record;
        record.nvlink_islands = islands;
        record.gpu_sharing = req.gpu_sharing;
        record.rack = rack;
        if let Some((from, to)) = moved {
            let name = self.nodes[idx].record.name.clone();
            self.node_event(
                now,
                idx,
                "node_topology_changed",
                "perch",
                format!(
                    "{name}'s agent reports rack {to} (was {from}); later placements follow it"
                ),
            );
        }
        self.dirty_nodes.insert(idx);
        Ok(())
    }

    /// Feeds what a node's telemetry says to the scheduler, without a scheduling pass (the
    /// next tick or operation runs one): measured GPU utilization (for idle detection and
    /// victim choice), XIDs that need a GPU reset or a reboot, uncorrectable ECC errors and
    /// lost GPUs (never placed on until healthy again), and rogue processes.
    pub(crate) fn observe(
        &mut self,
        batch: &perch_model::Batch,
        now: i64,
    ) -> Result<(), ControlError> {
        use perch_model::GpuEventKind as Kind;
        use perch_scheduler::GpuHealth;
        self.now = now;
        let Some(&idx) = self.node_index.get(batch.node.as_str()) else {
            return Ok(());
        };
        let node = NodeId(idx as u32);
        let gpus = self.nodes[idx].record.gpus;
        if !batch.gpus.is_empty() {
            self.note_simulated(idx, batch.gpus.iter().any(|g| g.simulated));
        }
        let mut events = Vec::new();
        for g in batch.gpus.iter().filter(|g| g.gpu.0 < gpus) {
            if let Some(pct) = g.utilization_gpu_pct {
                events.push(Event::GpuUtilization {
                    node,
                    gpu: g.gpu.0,
                    percent: pct as f32,
                    memory_used_mb: g.memory_used_bytes.map(|b| b >> 20),
                    memory_total_mb: g.memory_total_bytes.map(|b| b >> 20),
                });
            }
        }
        for e in batch.gpu_events.iter().filter(|e| e.gpu.0 < gpus) {
            let health = match (e.kind, e.xid) {
                (Kind::Xid, Some(code)) if xid_needs_reset(code) => GpuHealth::Xid(code as u32),
                (Kind::EccDoubleBit, _) => GpuHealth::UncorrectableEcc,
                (Kind::GpuLost, _) => GpuHealth::Xid(79),
                (Kind::GpuRecovered, _) => GpuHealth::Healthy,
                _ => continue,
            };
            tracing::warn!(node = %batch.node, gpu = e.gpu.0, ?health, "GPU health changed; the scheduler will not place jobs on it until it is healthy");
            events.push(Event::GpuHealth {
                node,
                gpu: e.gpu.0,
                health,
            });
        }
        for p in batch
            .gpu_processes
            .iter()
            .filter(|p| p.rogue && p.gpu.0 < gpus)
        {
            events.push(Event::GpuHealth {
                node,
                gpu: p.gpu.0,
                health: GpuHealth::RogueProcess,
            });
        }
        for event in events {
            let actions = self.scheduler.handle(now, event)?;
            self.apply(now, actions);
        }
        Ok(())
    }

    /// Marks nodes whose agents went silent as down (no new jobs) and, once their lease has
    /// run out, fails their jobs; then lets time limits act.
    #[tracing::instrument(name = "scheduler.tick", skip_all)]
    pub(crate) fn tick(&mut self, now: i64) -> Result<(), ControlError> {
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
                let actions = self.scheduler.step(now, Event::NodeSilent(node))?;
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
                let actions = self.scheduler.step(now, Event::NodeDown(node))?;
                self.apply(now, actions);
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
        let actions = self.scheduler.step(now, Event::Tick)?;
        self.apply(now, actions);
        self.release_held(now)?;
        Ok(())
    }

    /// Where node `node`'s output of attempt `attempt` of job `job` is kept: one file per
    /// attempt, node and stream, so the ranks of a multi-node job and the attempts of a
    /// requeued one never write over each other.
    fn log_path(&self, job: u64, attempt: u32, node: &str, stream: LogStream) -> PathBuf {
        self.logs_dir
            .join(job.to_string())
            .join(format!("a{attempt}"))
            .join(format!("{node}.{}", stream.as_str()))
    }

    /// Stores the output chunks node `node` sent (at the offsets it says, so a chunk sent
    /// twice is stored once) and tells it where each stream now ends.
    fn store_logs(
        &self,
        node: &str,
        chunks: &[LogChunk],
        response: &mut SyncResponse,
    ) -> Result<(), ControlError> {
        let mut offsets: BTreeMap<(u64, LogStream), u64> = BTreeMap::new();
        for c in chunks {
            let Some(job) = self.jobs.get(&c.job) else {
                continue;
            };
            let attempt = if c.attempt == 0 {
                job.attempts
            } else {
                c.attempt
            };
            // Only attempts that ran here: an agent cannot write another node's output.
            let ran_here = job
                .allocations
                .iter()
                .any(|a| a.attempt == attempt && a.node == node);
            if !ran_here {
                continue;
            }
            let path = self.log_path(c.job, attempt, node, c.stream);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(ControlError::Logs)?;
            }
            let have = std::fs::metadata(&path).map_or(0, |m| m.len());
            let data = c.data.as_bytes();
            let end = c.offset + data.len() as u64;
            if c.offset <= have && end > have {
                let skip = usize::try_from(have - c.offset).unwrap_or(0);
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(ControlError::Logs)?;
                f.write_all(&data[skip.min(data.len())..])
                    .map_err(ControlError::Logs)?;
            }
            let len = std::fs::metadata(&path).map_or(0, |m| m.len());
            offsets.insert((c.job, c.stream), len);
        }
        response.log_offsets = offsets.into_iter().map(|((j, s), o)| (j, s, o)).collect();
        Ok(())
    }

    /// `offset..` of a job's stream as stored on the server: rank `rank` (default 0) of attempt
    /// `attempt` (default the latest). Returns the bytes and the attempt they are from.
    pub(crate) fn read_log(
        &self,
        job: u64,
        stream: LogStream,
        offset: u64,
        attempt: Option<u32>,
        rank: Option<usize>,
    ) -> Result<(Vec<u8>, u32), ControlError> {
        let record = self.jobs.get(&job).ok_or(ControlError::NoSuchJob(job))?;
        let attempt = attempt.unwrap_or(record.attempts);
        let rank = rank.unwrap_or(0);
        if attempt > record.attempts {
            return Err(ControlError::BadRequest(format!(
                "job {job} has run {} attempt(s); there is no attempt {attempt}",
                record.attempts
            )));
        }
        let nodes: Vec<&str> = record
            .allocations
            .iter()
            .filter(|a| a.attempt == attempt)
            .map(|a| a.node.as_str())
            .collect();
        let path = match nodes.get(rank) {
            Some(node) => self.log_path(job, attempt, node, stream),
            None if attempt == 0 => return Ok((Vec::new(), 0)),
            None => {
                return Err(ControlError::BadRequest(format!(
                    "attempt {attempt} of job {job} ran on {} node(s): ranks 0 to {}",
                    nodes.len(),
                    nodes.len().saturating_sub(1)
                )));
            }
        };
        // Output stored before logs were kept per attempt and node: one file per stream.
        let legacy = self.logs_dir.join(job.to_string()).join(stream.as_str());
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::read(&legacy) {
                Ok(d) if rank == 0 && attempt == record.attempts => d,
                _ => Vec::new(),
            },
            Err(e) => return Err(ControlError::Logs(e)),
        };
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        Ok((data[start..].to_vec(), attempt))
    }

    /// Refuses unless `who` owns job `id` or is an operator.
    pub(crate) fn check_owner(
        &self,
        id: u64,
        who: &crate::auth::Identity,
    ) -> Result<(), ControlError> {
        let job = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        let owner = job.request.user();
        if who.may_act_on(owner) {
            Ok(())
        } else {
            Err(ControlError::Forbidden(format!(
                "job {id} belongs to {owner}; only its owner or an operator may do that"
            )))
        }
    }

    pub(crate) fn job(&self, id: u64) -> Option<&JobRecord> {
        self.jobs.get(&id)
    }
}

/// The rack (topology label) a node's agent reports; "default" when it names none.
fn reported_rack(req: &SyncRequest) -> String {
    // A label must be a name (letters, digits, '.', '_', '-'); anything else is ignored, as
    // the agent's own configuration check would have refused it.
    req.rack
        .clone()
        .filter(|r| perch_model::NodeId::new(r.as_str()).is_ok())
        .unwrap_or_else(|| "default".into())
}

/// The NVLink islands an agent reported, or none (one island) when they name a GPU the node
/// does not have or a GPU twice: a bad report must not keep the node out of the cluster.
fn reported_islands(req: &SyncRequest) -> Vec<Vec<u32>> {
    let islands = req.nvlink_islands.clone().unwrap_or_default();
    let mut seen = BTreeSet::new();
    let valid = islands
        .iter()
        .all(|i| !i.is_empty() && i.iter().all(|&g| g < req.gpus && seen.insert(g)));
    if valid {
        islands
    } else {
        tracing::warn!(node = %req.node, ?islands, gpus = req.gpus, "agent reported invalid NVLink islands; treating the node as one island");
        Vec::new()
    }
}

/// Whether an XID takes its GPU out of scheduling until it is healthy again: NVIDIA's catalog
/// resolves it by a GPU reset or a reboot. The classes are `perch_alerts::xid`'s, the same
/// table the XID alert rules use, so the scheduler and the alerts cannot disagree.
fn xid_needs_reset(code: u64) -> bool {
    use perch_alerts::xid::{XidClass, xid_class};
    matches!(xid_class(code), XidClass::ResetGpu | XidClass::Reboot)
}

/// Whether a submission runs a scheduling pass at once or leaves it to its caller (an array
/// runs one pass for all its tasks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Now,
    Later,
}
