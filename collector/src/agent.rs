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
pub use crate::gpu::NvmlMode;
use crate::gpu::nvml::NvmlGpus;
use crate::queue::SendQueue;
use crate::sampler::{Sampler, SamplerConfig};
use crate::sender::{Backoff, Sender, SenderShared, lock, run_sender};
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
    /// Base URL of the server, e.g. `http://127.0.0.1:7300`.
    pub server: String,
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
}

impl AgentConfig {
    /// Defaults: 1 s interval, `./perch-data`, NVML auto-detected, no simulation, up to 60
    /// rounds per batch and 60 queued batches (an hour at 1 s while the server is down).
    pub fn new(server: String, node: NodeId) -> Self {
        Self {
            server,
            node,
            interval: Duration::from_secs(1),
            data_dir: PathBuf::from("./perch-data"),
            simulate_gpus: 0,
            simulate_host: false,
            nvml: NvmlMode::Auto,
            seed: 0,
            max_batch_rounds: 60,
            max_queue_batches: 60,
            drain_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            backoff: Backoff::default(),
            root: PathBuf::from("/"),
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
        Ok(())
    }
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
    /// Batches waiting in the queue right now.
    pub batches_queued: AtomicU64,
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
}

impl AgentCounters {
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
        }
    }
}

/// A running agent (from [`spawn_agent`]).
#[derive(Debug)]
pub struct AgentHandle {
    counters: Arc<AgentCounters>,
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

    /// Waits for the agent to finish (after its shutdown future completes).
    pub async fn join(self) -> Result<AgentStats> {
        self.task
            .await
            .map_err(|e| CollectorError::Config(format!("agent task failed: {e}")))?
    }
}

/// Starts the agent on the current tokio runtime and returns at once.
pub fn spawn_agent(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> AgentHandle {
    let counters = Arc::new(AgentCounters::default());
    let task = tokio::spawn(run_agent_with(config, shutdown, counters.clone()));
    AgentHandle { counters, task }
}

/// Runs the agent until `shutdown` completes, then drains the queue for at most
/// `drain_timeout` and returns the final counters.
pub async fn run_agent(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<AgentStats> {
    run_agent_with(config, shutdown, Arc::new(AgentCounters::default())).await
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

/// [`run_agent`] with caller-supplied counters.
pub async fn run_agent_with(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    counters: Arc<AgentCounters>,
) -> Result<AgentStats> {
    config.check()?;
    let sender = Sender::new(&config.server, config.request_timeout)?;
    // NVML calls and /proc reads block briefly (well under a millisecond per source); the
    // sampler runs inline on this task rather than paying a thread hop per round.
    let mut sampler = Sampler::new(&SamplerConfig {
        node: config.node.clone(),
        root: config.root.clone(),
        data_dir: config.data_dir.clone(),
        nvml: config.nvml.clone(),
        simulate_gpus: config.simulate_gpus,
        simulate_host: config.simulate_host,
        seed: config.seed,
    });
    let first_seq = now_micros();
    let shared = SenderShared {
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
    tracing::info!(node = %config.node, url = %sender.url(), interval = ?config.interval, first_seq, "agent started");
    let mut sender_task = tokio::spawn(run_sender(sender, shared.clone(), config.backoff));

    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            _ = ticker.tick() => {
                let round = sampler.sample(now_ms());
                let (outcome, queued) = {
                    let mut q = lock(&shared.queue);
                    (q.push(round), q.len())
                };
                counters.rounds_sampled.fetch_add(1, Relaxed);
                counters.batches_queued.store(queued as u64, Relaxed);
                if let Some(d) = outcome.dropped {
                    let total = counters.batches_dropped.fetch_add(1, Relaxed) + 1;
                    counters.samples_dropped.fetch_add(d.samples as u64, Relaxed);
                    tracing::warn!(seq = d.seq, samples = d.samples, dropped_batches_total = total, max_queue_batches = config.max_queue_batches, "send queue full, dropped the oldest batch");
                }
                shared.wake.notify_one();
            }
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
    if !left.is_empty() {
        let samples: usize = left.iter().map(|b| b.sample_count()).sum();
        counters
            .batches_dropped
            .fetch_add(left.len() as u64, Relaxed);
        counters.samples_dropped.fetch_add(samples as u64, Relaxed);
        tracing::warn!(
            batches = left.len(),
            samples,
            "shutdown: server did not take these batches in time, dropping them"
        );
    }
    counters.batches_queued.store(0, Relaxed);
    let stats = counters.snapshot();
    tracing::info!(?stats, "agent stopped");
    Ok(stats)
}

/// What `perch up` needs to tell the user about GPUs on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDetection {
    pub nvml_available: bool,
    pub count: u32,
    pub models: Vec<String>,
    /// One line for the user, e.g. "found 8 NVIDIA GPUs: NVIDIA H100 80GB HBM3 x8" or
    /// "no NVIDIA GPUs found (NVML not available: ...)".
    pub message: String,
}

/// Probes NVML once (without logging) and describes what it found.
pub fn detect_gpus(nvml: &NvmlMode) -> GpuDetection {
    match NvmlGpus::open(nvml) {
        Ok(Some(gpus)) => {
            let models: Vec<String> = gpus.devices().iter().map(|d| d.model.clone()).collect();
            let count = models.len() as u32;
            let message = if count == 0 {
                "no NVIDIA GPUs found (NVML loaded, but it reports no devices)".to_string()
            } else {
                let mut distinct: Vec<&String> = Vec::new();
                for m in &models {
                    if !distinct.contains(&m) {
                        distinct.push(m);
                    }
                }
                let kinds: Vec<String> = distinct
                    .iter()
                    .map(|m| format!("{m} x{}", models.iter().filter(|x| x == m).count()))
                    .collect();
                format!(
                    "found {count} NVIDIA GPU{}: {}",
                    if count == 1 { "" } else { "s" },
                    kinds.join(", ")
                )
            };
            GpuDetection {
                nvml_available: true,
                count,
                models,
                message,
            }
        }
        Ok(None) => GpuDetection {
            nvml_available: false,
            count: 0,
            models: vec![],
            message: "no NVIDIA GPUs sampled (NVML is turned off)".to_string(),
        },
        Err(e) => GpuDetection {
            nvml_available: false,
            count: 0,
            models: vec![],
            message: format!("no NVIDIA GPUs found ({e})"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_without_nvml_says_so() {
        let d = detect_gpus(&NvmlMode::Off);
        assert!(!d.nvml_available && d.count == 0);
        assert!(d.message.contains("turned off"), "{}", d.message);
        let d = detect_gpus(&NvmlMode::Path("/nonexistent/libnvidia-ml.so.1".into()));
        assert!(!d.nvml_available);
        assert!(
            d.message.starts_with("no NVIDIA GPUs found (NVML:"),
            "{}",
            d.message
        );
    }

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
    }
}
