//! The agent: a sampling loop that takes one [`Round`](crate::sampler::Round) every `interval`
//! into the bounded [`SendQueue`], and a sender task that delivers the queue to the server.
//!
//! Sampling never waits for the network: while the server is slow or down the queue merges
//! rounds into bigger batches and, past its bound, drops the oldest batch, counted in
//! [`AgentStats`] and logged. On shutdown the agent stops sampling and gives the sender
//! `drain_timeout` to deliver what is queued; anything left is counted as dropped.
//!
//! This module and the sender are the only places that read the wall clock.

use crate::error::{CollectorError, Result};
pub use crate::gpu::{GpuDetection, NvmlMode, detect_gpus};
use crate::jobs::{JobRegistry, JobSpec};
use crate::queue::SendQueue;
use crate::sampler::{Round, Sampler, SamplerConfig};
use crate::sender::encode;
use crate::sender::{Backoff, Sender, SenderShared, lock, run_sender};
use crate::spool::Spool;
use perch_model::Batch;
use perch_model::NodeId;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;
use tokio::time::MissedTickBehavior;

/// Everything the agent needs. Build it with [`AgentConfig::new`] and adjust fields.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Base URL of the server, e.g. `http://127.0.0.1:7300`: the one used first.
    pub server: String,
    /// Every server the agent may follow (`agent.servers`): a leader and its standbys. The
    /// agent talks to whichever leads ([`crate::servers`]), starting with `server`. Used only
    /// when it holds `server` (or `server` is empty); otherwise (empty, or a caller replaced
    /// `server`) `server` alone is used.
    pub servers: Vec<String>,
    pub node: NodeId,
    /// Time between sampling rounds.
    pub interval: Duration,
    /// Directory whose filesystem's free space is reported (and home of a future spool).
    pub data_dir: PathBuf,
    /// Simulated GPUs added after any real ones (0 = none).
    pub simulate_gpus: u32,
    /// Simulate the host and NICs too (`perch demo`).
    pub simulate_host: bool,
    pub nvml: NvmlMode,
    /// How often NVML's costly fields (energy counter, per-process utilization, PCIe
    /// throughput) are read; 0: every round (`agent.nvml_slow_interval_ms`).
    pub nvml_slow_interval: Duration,
    /// Seed of the simulators.
    pub seed: u64,
    /// Most sampling rounds merged into one batch while the server is slow or down.
    pub max_batch_rounds: usize,
    /// Bound of the in-memory queue, in batches; the oldest is dropped past it.
    pub max_queue_batches: usize,
    /// How long to keep delivering queued batches after shutdown is requested.
    pub drain_timeout: Duration,
    /// Limit of one HTTP request.
    pub request_timeout: Duration,
    /// Retry delays after a failed delivery.
    pub backoff: Backoff,
    /// Root of `/proc` and `/sys` (`/`; tests point it at a fixture tree).
    pub root: PathBuf,
    /// Bound of the disk spool under `data_dir/agent-spool/<node>`, in bytes; 0 turns it off.
    /// Batches evicted from the memory queue, or still queued at shutdown, go there and are
    /// replayed in order, also after a restart.
    pub spool_max_bytes: u64,
    /// The jobs on this node; clones share it, so a job launcher can register jobs while the
    /// agent runs (also through [`AgentHandle::jobs`]).
    pub jobs: JobRegistry,
    /// Run the jobs the server places on this node (see [`crate::control_loop`]).
    pub run_jobs: bool,
    /// Bearer token (role `agent`) for servers that require authentication.
    pub token: Option<String>,
    /// PEM certificates of a CA to trust for an `https://` server, besides the system's.
    pub ca_file: Option<PathBuf>,
    /// The node's rack or switch label, for packing gangs close together (`agent.rack`).
    pub rack: Option<String>,
    /// The address other nodes reach this one at (`agent.advertise_addr`); `None`: the local
    /// address of the route to the server.
    pub advertise_addr: Option<String>,
    /// Take jobs asking for a part of a GPU (off by default: shared GPUs need MPS, or trust
    /// between the jobs, to keep one from starving the others).
    pub gpu_sharing: bool,
    /// NVLink islands to report instead of what NVML says (`agent.nvlink_islands`).
    pub nvlink_islands: Option<Vec<Vec<u32>>>,
    /// Whether jobs run as their submitting user (`agent.run_as_user`).
    pub run_as_user: crate::launcher::RunAsUser,
    /// Where job cgroups go (`agent.cgroups`).
    pub cgroups: crate::launcher::CgroupMode,
    /// Which users jobs may run as (`agent.min_uid`, `agent.allowed_system_users`).
    pub uids: crate::launcher::UidPolicy,
    /// The program that supervises each job: the `perch` binary, which runs it as
    /// `perch __job-shim` (see [`crate::launcher::shim`]).
    pub supervisor: Option<PathBuf>,
    /// On a graceful stop, leave supervised jobs running: an agent started again within the
    /// node's lease takes them over (an upgrade or restart stops no training run); past the
    /// lease their supervisors stop them. `false`: stop them (`perch up`, `perch demo`, whose
    /// server stops too).
    pub keep_jobs_on_exit: bool,
    /// Time between syncs with the server's control plane (reports, orders, lease renewal).
    pub sync_interval: Duration,
    /// Most output (stdout and stderr together) a job may write on this node, bytes; the
    /// agent stops a job that writes more (`agent.max_job_output_mb`, default 4 GiB).
    pub max_job_output_bytes: u64,
}

impl AgentConfig {
    /// Defaults: 1 s interval, `./perch-data`, NVML auto-detected, no simulation, up to 60
    /// rounds per batch and 60 queued batches (an hour at 1 s while the server is down).
    pub fn new(server: String, node: NodeId) -> Self {
        Self {
            server,
            servers: Vec::new(),
            node,
            interval: Duration::from_secs(1),
            data_dir: PathBuf::from("./perch-data"),
            simulate_gpus: 0,
            simulate_host: false,
            nvml: NvmlMode::Auto,
            nvml_slow_interval: Duration::from_millis(
                crate::gpu::nvml::DEFAULT_SLOW_INTERVAL_MS as u64,
            ),
            seed: 0,
            max_batch_rounds: 60,
            max_queue_batches: 60,
            drain_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            backoff: Backoff::default(),
            root: PathBuf::from("/"),
            spool_max_bytes: 256 * 1024 * 1024,
            run_jobs: true,
            token: None,
            ca_file: None,
            rack: None,
            advertise_addr: None,
            gpu_sharing: false,
            nvlink_islands: None,
            run_as_user: crate::launcher::RunAsUser::IfPossible,
            cgroups: crate::launcher::CgroupMode::Auto,
            keep_jobs_on_exit: false,
            sync_interval: Duration::from_millis(500),
            max_job_output_bytes: crate::launcher::DEFAULT_OUTPUT_LIMIT,
            uids: crate::launcher::UidPolicy::default(),
            supervisor: None,
            jobs: JobRegistry::default(),
        }
    }

    /// [`AgentConfig::new`] with several servers, the first tried first.
    pub fn with_servers(servers: Vec<String>, node: NodeId) -> Self {
        let first = servers.first().cloned().unwrap_or_default();
        Self {
            servers,
            ..Self::new(first, node)
        }
    }

    /// The servers the agent follows (see [`AgentConfig::servers`]), checked: each a URL,
    /// none twice.
    pub fn server_list(&self) -> Result<crate::servers::Servers> {
        use crate::servers::{Servers, normalise};
        let server = normalise(&self.server);
        let listed = self.servers.iter().any(|s| normalise(s) == server);
        if !self.servers.is_empty() && (server.is_empty() || listed) {
            Servers::starting_at(&self.servers, server)
        } else {
            Servers::one(&self.server)
        }
    }

    fn check(&self) -> Result<()> {
        if self.interval.is_zero() {
            return Err(CollectorError::Config(
                "interval must be above zero, e.g. 1s".into(),
            ));
        }
        if self.max_batch_rounds == 0 || self.max_queue_batches == 0 {
            return Err(CollectorError::Config(
                "max_batch_rounds and max_queue_batches must be at least 1".into(),
            ));
        }
        if let Some(islands) = &self.nvlink_islands {
            check_islands(islands)?;
        }
        Ok(())
    }
}

/// Checks `agent.nvlink_islands`: every island non-empty, no GPU in two of them.
fn check_islands(islands: &[Vec<u32>]) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for island in islands {
        if island.is_empty() {
            return Err(CollectorError::Config(
                "nvlink_islands: an island must list at least one GPU index, e.g. [[0, 1, 2, 3], [4, 5, 6, 7]]".into(),
            ));
        }
        for &g in island {
            if !seen.insert(g) {
                return Err(CollectorError::Config(format!(
                    "nvlink_islands: GPU {g} is in two islands; each GPU belongs to one"
                )));
            }
        }
    }
    Ok(())
}

/// Live counters, readable while the agent runs (see [`AgentHandle::stats`]).
#[derive(Debug, Default)]
pub struct AgentCounters {
    pub rounds_sampled: AtomicU64,
    pub batches_sent: AtomicU64,
    pub samples_sent: AtomicU64,
    /// Batches the server already had (a retry after a lost reply); harmless.
    pub batches_duplicate: AtomicU64,
    /// Batches the server refused with a 4xx.
    pub batches_rejected: AtomicU64,
    /// Batches dropped by the queue bound or left undelivered at shutdown.
    pub batches_dropped: AtomicU64,
    /// Samples in rejected or dropped batches.
    pub samples_dropped: AtomicU64,
    /// Failed delivery attempts (connection errors, 5xx, timeouts).
    pub send_errors: AtomicU64,
    /// Batches waiting in the memory queue right now.
    pub batches_queued: AtomicU64,
    /// Batches written to the disk spool.
    pub batches_spooled: AtomicU64,
    /// Bytes in the disk spool right now.
    pub spool_bytes: AtomicU64,
    /// The latest round, for the node-local `/metrics` ([`crate::serve_metrics`]).
    latest_round: Mutex<Option<Round>>,
}

/// A snapshot of [`AgentCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentStats {
    pub rounds_sampled: u64,
    pub batches_sent: u64,
    pub samples_sent: u64,
    pub batches_duplicate: u64,
    pub batches_rejected: u64,
    pub batches_dropped: u64,
    pub samples_dropped: u64,
    pub send_errors: u64,
    pub batches_queued: u64,
    pub batches_spooled: u64,
    pub spool_bytes: u64,
}

impl AgentCounters {
    /// A copy of the latest round the agent took, if any.
    pub fn latest_round(&self) -> Option<Round> {
        lock(&self.latest_round).clone()
    }

    /// Records the latest round (the sampling loop calls this).
    pub fn set_latest_round(&self, round: Round) {
        *lock(&self.latest_round) = Some(round);
    }

    pub fn snapshot(&self) -> AgentStats {
        AgentStats {
            rounds_sampled: self.rounds_sampled.load(Relaxed),
            batches_sent: self.batches_sent.load(Relaxed),
            samples_sent: self.samples_sent.load(Relaxed),
            batches_duplicate: self.batches_duplicate.load(Relaxed),
            batches_rejected: self.batches_rejected.load(Relaxed),
            batches_dropped: self.batches_dropped.load(Relaxed),
            samples_dropped: self.samples_dropped.load(Relaxed),
            send_errors: self.send_errors.load(Relaxed),
            batches_queued: self.batches_queued.load(Relaxed),
            batches_spooled: self.batches_spooled.load(Relaxed),
            spool_bytes: self.spool_bytes.load(Relaxed),
        }
    }
}

/// A running agent (from [`spawn_agent`]).
#[derive(Debug)]
pub struct AgentHandle {
    counters: Arc<AgentCounters>,
    jobs: JobRegistry,
    task: tokio::task::JoinHandle<Result<AgentStats>>,
}

impl AgentHandle {
    /// The counters as they are now.
    pub fn stats(&self) -> AgentStats {
        self.counters.snapshot()
    }

    /// The shared counters, e.g. to export them as metrics.
    pub fn counters(&self) -> Arc<AgentCounters> {
        self.counters.clone()
    }

    /// The registry of jobs on this node, shared with the running agent.
    pub fn jobs(&self) -> &JobRegistry {
        &self.jobs
    }

    /// Starts sampling a job (a job launcher calls this when it starts one).
    pub fn register_job(&self, spec: JobSpec) {
        self.jobs.register(spec);
    }

    /// Stops sampling a job; false when it was not registered.
    pub fn unregister_job(&self, job: &str) -> bool {
        self.jobs.unregister(job)
    }

    /// Waits for the agent to finish (after its shutdown future completes).
    pub async fn join(self) -> Result<AgentStats> {
        self.task
            .await
            .map_err(|e| CollectorError::Task(e.to_string()))?
    }
}

/// Starts the agent on the current tokio runtime and returns at once.
pub fn spawn_agent(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> AgentHandle {
    let counters = Arc::new(AgentCounters::default());
    let jobs = config.jobs.clone();
    let task = tokio::spawn(run_agent_with(config, shutdown, counters.clone()));
    AgentHandle {
        counters,
        jobs,
        task,
    }
}

/// Runs the agent until `shutdown` completes, then drains the queue for at most
/// `drain_timeout` and returns the final counters.
pub async fn run_agent(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<AgentStats> {
    run_agent_with(config, shutdown, Arc::new(AgentCounters::default())).await
}

/// A sampling round unfinished after this long is reported in the log, and again each time as
/// long again passes.
const SLOW_ROUND: Duration = Duration::from_secs(10);

/// The sampler on a thread of its own. NVML and `/proc` reads block, and a wedged GPU driver
/// can block an NVML call for minutes: on the async runtime that would stop the agent's
/// sending and job control too (and, under `perch up`, a worker of the server's runtime).
/// Here it pauses only this node's telemetry, and the agent can still stop.
struct SamplerThread {
    requests: std::sync::mpsc::Sender<(i64, tokio::sync::oneshot::Sender<Round>)>,
}

impl SamplerThread {
    fn start(mut sampler: Sampler) -> Result<Self> {
        let (requests, rounds) =
            std::sync::mpsc::channel::<(i64, tokio::sync::oneshot::Sender<Round>)>();
        std::thread::Builder::new()
            .name("perch-sampler".into())
            .spawn(move || {
                for (now_ms, reply) in rounds {
                    let _ = reply.send(sampler.sample(now_ms));
                }
            })
            .map_err(|e| CollectorError::Task(format!("starting the sampler thread: {e}")))?;
        Ok(Self { requests })
    }

    /// One round at `now_ms`; `None` once the thread is gone (it panicked).
    fn round(&self, now_ms: i64) -> Option<tokio::sync::oneshot::Receiver<Round>> {
        let (reply, round) = tokio::sync::oneshot::channel();
        self.requests.send((now_ms, reply)).ok().map(|()| round)
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn open_spool(config: &AgentConfig) -> Option<Spool> {
    if config.spool_max_bytes == 0 {
        return None;
    }
    let dir = config
        .data_dir
        .join("agent-spool")
        .join(config.node.as_str());
    match Spool::open(&dir, config.spool_max_bytes) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot open the disk spool; batches past the memory queue will be dropped");
            None
        }
    }
}

/// Puts a batch that left the memory queue undelivered into the spool, or counts and logs it
/// as dropped when there is no spool, the spool fails, or the spool bound pushes batches out.
fn spill_or_drop(shared: &SenderShared, batch: Batch, why: &'static str) {
    let counters = &shared.counters;
    let samples = batch.sample_count() as u64;
    let drop_one = |seq: u64, samples: u64, reason: &str| {
        let total = counters.batches_dropped.fetch_add(1, Relaxed) + 1;
        counters.samples_dropped.fetch_add(samples, Relaxed);
        tracing::warn!(
            seq,
            samples,
            dropped_batches_total = total,
            reason,
            "dropped undelivered batch"
        );
    };
    let Some(spool) = &shared.spool else {
        drop_one(batch.seq, samples, why);
        return;
    };
    let pushed = encode(&batch).and_then(|body| lock(spool).push(batch.seq, samples, &body));
    match pushed {
        Ok(evicted) => {
            let spooled = counters.batches_spooled.fetch_add(1, Relaxed) + 1;
            if spooled == 1 {
                tracing::info!(
                    reason = why,
                    "writing undelivered batches to the disk spool"
                );
            }
            for e in evicted {
                drop_one(e.seq, e.samples, "disk spool full");
            }
        }
        Err(e) => drop_one(batch.seq, samples, &format!("{why}; spool failed: {e}")),
    }
    counters.spool_bytes.store(lock(spool).bytes(), Relaxed);
}

/// [`run_agent`] with caller-supplied counters.
pub async fn run_agent_with(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    counters: Arc<AgentCounters>,
) -> Result<AgentStats> {
    config.check()?;
    let servers = Arc::new(config.server_list()?);
    // A second agent on this data directory for the node stops before it sends anything in
    // the node's name; the id goes with every sync and batch ([`crate::agent_claim`]).
    let jobs_dir = config.data_dir.join("jobs").join(config.node.as_str());
    let claim = Arc::new(crate::agent_claim::claim(&jobs_dir, config.node.as_str())?);
    let sender = Sender::with_servers(
        servers.clone(),
        config.request_timeout,
        config.ca_file.as_deref(),
    )?
    .with_token(config.token.clone())
    .with_agent_id(claim.id.clone());
    // Loading NVML can take a second on a big node: keep it off the async threads. Later NVML
    // calls and /proc reads block well under a millisecond per source, so each round runs
    // inline on this task rather than paying a thread hop.
    let sampler_config = SamplerConfig {
        node: config.node.clone(),
        root: config.root.clone(),
        data_dir: config.data_dir.clone(),
        nvml: config.nvml.clone(),
        nvml_slow_interval: config.nvml_slow_interval,
        simulate_gpus: config.simulate_gpus,
        simulate_host: config.simulate_host,
        seed: config.seed,
        jobs: config.jobs.clone(),
    };
    let sampler = tokio::task::spawn_blocking(move || Sampler::new(&sampler_config))
        .await
        .map_err(|e| CollectorError::Task(format!("opening the samplers: {e}")))?;
    let spool = open_spool(&config);
    // Number new batches above anything spooled by an earlier run, even if the clock stepped
    // back, so the server never takes them for duplicates.
    let spooled_max = spool.as_ref().and_then(Spool::max_seq).unwrap_or(0);
    let first_seq = now_micros().max(spooled_max + 1);
    if let Some(s) = &spool {
        counters.spool_bytes.store(s.bytes(), Relaxed);
        if !s.is_empty() {
            tracing::info!(batches = s.len(), bytes = s.bytes(), dir = %s.dir().display(), "replaying batches spooled by an earlier run");
        }
    }
    let shared = SenderShared {
        spool: spool.map(|s| Arc::new(Mutex::new(s))),
        queue: Arc::new(Mutex::new(SendQueue::new(
            config.node.clone(),
            first_seq,
            config.max_batch_rounds,
            config.max_queue_batches,
        ))),
        wake: Arc::new(Notify::new()),
        draining: Arc::new(AtomicBool::new(false)),
        counters: counters.clone(),
    };
    tracing::info!(node = %config.node, url = %sender.url(), servers = ?servers.list(), interval = ?config.interval, first_seq, "agent started");
    let (control_stop, control_stopped) = tokio::sync::watch::channel(false);
    let control_task = config.run_jobs.then(|| {
        let (gpus, gpu_model) = sampler.gpu_inventory();
        let nvlink_islands = config
            .nvlink_islands
            .clone()
            .or_else(|| sampler.nvlink_islands());
        if let Some(bad) = nvlink_islands.iter().flatten().flatten().find(|&&g| g >= gpus) {
            tracing::warn!(gpu = bad, gpus, "agent.nvlink_islands names a GPU this node does not have; the server will treat the node as one island");
        }
        let control = crate::control_loop::ControlConfig {
            servers: servers.clone(),
            node: config.node.clone(),
            gpus,
            gpu_model,
            rack: config.rack.clone(),
            nvlink_islands,
            gpu_sharing: config.gpu_sharing,
            mig_instances: sampler.mig_instances(),
            isolation: crate::launcher::Isolation {
                run_as_user: config.run_as_user,
                cgroups: config.cgroups.clone(),
                root: config.root.clone(),
                uids: config.uids.clone(),
            },
            jobs_dir,
            claim: claim.clone(),
            interval: config.sync_interval,
            request_timeout: config.request_timeout,
            shutdown_grace: config.drain_timeout,
            registry: config.jobs.clone(),
            token: config.token.clone(),
            ca_file: config.ca_file.clone(),
            advertise_addr: config.advertise_addr.clone(),
            supervisor: config.supervisor.clone(),
            keep_jobs_on_exit: config.keep_jobs_on_exit,
            max_job_output_bytes: config.max_job_output_bytes,
            versions: sampler.node_versions(),
            validation: crate::validation::Builtin {
                program: config
                    .supervisor
                    .clone()
                    .or_else(|| std::env::current_exe().ok())
                    .unwrap_or_else(|| std::path::PathBuf::from("perch")),
                nvml: config.nvml.clone(),
                gpus,
                simulated_gpus: config.simulate_gpus,
            },
        };
        let mut stopped = control_stopped.clone();
        tokio::spawn(crate::control_loop::run_control(control, async move {
            let _ = stopped.wait_for(|s| *s).await;
        }))
    });
    let mut sender_task = tokio::spawn(run_sender(sender, shared.clone(), config.backoff));
    let sampler = SamplerThread::start(sampler)?;

    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            _ = ticker.tick() => {
                let Some(mut pending) = sampler.round(now_ms()) else {
                    tracing::error!("the sampler thread is gone (it panicked); the agent stops");
                    break;
                };
                let started = std::time::Instant::now();
                let round = loop {
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break None,
                        round = &mut pending => break Some(round),
                        () = tokio::time::sleep(SLOW_ROUND) => tracing::warn!(
                            secs = started.elapsed().as_secs(),
                            "a sampling round has not finished: a GPU driver (NVML) or /proc may be hung; this node's telemetry pauses until it returns, job control and sending go on"
                        ),
                    }
                };
                let round = match round {
                    Some(Ok(round)) => round,
                    Some(Err(_)) => {
                        tracing::error!("the sampler thread panicked; the agent stops");
                        break;
                    }
                    None => break,
                };
                if started.elapsed() >= SLOW_ROUND {
                    tracing::info!(secs = started.elapsed().as_secs(), "the slow sampling round finished; telemetry resumes");
                }
                counters.set_latest_round(round.clone());
                let (outcome, queued) = {
                    let mut q = lock(&shared.queue);
                    (q.push(round), q.len())
                };
                counters.rounds_sampled.fetch_add(1, Relaxed);
                counters.batches_queued.store(queued as u64, Relaxed);
                if let Some(batch) = outcome.evicted {
                    spill_or_drop(&shared, batch, "send queue full");
                }
                shared.wake.notify_one();
            }
        }
    }

    let _ = control_stop.send(true);
    if let Some(task) = control_task {
        match task.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "job control stopped with an error"),
            Err(e) => tracing::warn!(error = %e, "job control task failed"),
            Ok(Ok(())) => {}
        }
    }
    shared.draining.store(true, Relaxed);
    shared.wake.notify_one();
    let pending = lock(&shared.queue).len();
    if pending > 0 {
        tracing::info!(batches = pending, timeout = ?config.drain_timeout, "shutting down, delivering queued batches");
    }
    if tokio::time::timeout(config.drain_timeout, &mut sender_task)
        .await
        .is_err()
    {
        sender_task.abort();
    }
    let left = lock(&shared.queue).drain();
    for batch in left {
        spill_or_drop(&shared, batch, "shutdown before delivery");
    }
    counters.batches_queued.store(0, Relaxed);
    let stats = counters.snapshot();
    tracing::info!(?stats, "agent stopped");
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bad_configs_are_refused() {
        let node = NodeId::new("n").expect("valid");
        let mut c = AgentConfig::new("http://127.0.0.1:1".into(), node.clone());
        c.interval = Duration::ZERO;
        assert!(matches!(
            run_agent(c, async {}).await,
            Err(CollectorError::Config(_))
        ));
        let c = AgentConfig::new("localhost:7300".into(), node);
        let err = run_agent(c, async {}).await.expect_err("not a URL");
        assert!(err.to_string().contains("must be a URL"), "{err}");
        let mut c = AgentConfig::new(
            "http://127.0.0.1:1".into(),
            NodeId::new("n").expect("valid"),
        );
        c.nvlink_islands = Some(vec![vec![0, 1], vec![1, 2]]);
        let err = run_agent(c, async {}).await.expect_err("GPU 1 twice");
        assert!(err.to_string().contains("GPU 1 is in two islands"), "{err}");
    }
}
