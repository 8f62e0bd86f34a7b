//! What the core needs to know about a job (its spec), and the states and reasons it reports.
//!
//! The server's richer spec (command, environment, logs, dependencies) stays in the server; the
//! core sees only what decides placement and order.

use crate::error::{Error, Result};
use crate::ids::{Account, GpuModel, JobId, Millis, Time, User};
use serde::{Deserialize, Serialize};

/// A gang: `nodes` nodes with `gpus_per_node` GPUs on each, all granted at once or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape {
    /// Number of nodes.
    pub nodes: u32,
    /// GPUs on each of those nodes.
    pub gpus_per_node: u32,
}

impl Shape {
    /// Total GPUs of the gang.
    pub fn gpus(&self) -> u32 {
        self.nodes * self.gpus_per_node
    }

    /// The fewest-nodes shape for `gpus` GPUs on nodes of `node_gpus` GPUs: one node when it
    /// fits, else `ceil(gpus / node_gpus)` nodes with the GPUs spread evenly (rounded up, so a
    /// count that does not divide evenly asks for slightly more GPUs than `gpus`).
    pub fn fewest_nodes(gpus: u32, node_gpus: u32) -> Shape {
        let node_gpus = node_gpus.max(1);
        if gpus <= node_gpus {
            return Shape {
                nodes: 1,
                gpus_per_node: gpus.max(1),
            };
        }
        let nodes = gpus.div_ceil(node_gpus);
        Shape {
            nodes,
            gpus_per_node: gpus.div_ceil(nodes),
        }
    }
}

/// Quality of service: a priority tier, as Slurm's QOS priority factor.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
pub enum Qos {
    /// Scavenger work.
    Low,
    /// The default.
    #[default]
    Normal,
    /// Urgent work.
    High,
}

impl Qos {
    /// The QOS factor in `[0, 1]` of the multifactor priority.
    pub fn factor(self) -> f64 {
        match self {
            Qos::Low => 0.0,
            Qos::Normal => 0.5,
            Qos::High => 1.0,
        }
    }
}

/// A part of one GPU, for a job that shares its GPU with others (NVIDIA MPS style): the job
/// gets `percent` of the GPU's compute and needs `memory_mb` of its memory.
///
/// Fractions are whole percents because that is the unit MPS enforces
/// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), and integers keep "the shares of a GPU never add up
/// to more than 100" exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuShare {
    /// Percent of the GPU's compute, 1 to 99 (a whole GPU is an ordinary job).
    pub percent: u32,
    /// GPU memory the job needs, in MiB; placed only where that much is free.
    pub memory_mb: u64,
}

/// The part of a job spec the scheduling core decides on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The job's id, unique for the scheduler's life.
    pub id: JobId,
    /// Who submitted it.
    pub user: User,
    /// Who pays and whose quota it draws on.
    pub account: Account,
    /// The gang it needs.
    pub shape: Shape,
    /// Only GPUs of this model, when set.
    pub gpu_model: Option<GpuModel>,
    /// The wall-clock limit the user declared; the job is ended as `Timeout` past it and
    /// backfill plans with it.
    pub time_limit: Millis,
    /// Priority tier.
    pub qos: Qos,
    /// May be preempted (quota reclaim, idle reclaim, SRTF).
    pub preemptible: bool,
    /// How many times a job may be requeued after node failure or preemption.
    pub max_requeues: u32,
    /// When it was submitted.
    pub submit: Time,
    /// The true run time, known only to simulators; only the SRTF reference policy reads it.
    pub oracle_duration: Option<Millis>,
    /// A part of one GPU instead of whole GPUs; then `shape` is one node with one GPU.
    #[serde(default)]
    pub share: Option<GpuShare>,
    /// Runs the job had before this scheduler learned of it: a restarted server resubmits a
    /// job that was preempted or requeued earlier with them, so that starvation reclaim, which
    /// stops only jobs on their first run, still stops each job at most once.
    #[serde(default)]
    pub earlier_runs: u32,
    /// A MIG instance of this profile (`3g.40gb`) instead of whole GPUs; then `shape` is one
    /// node with one GPU and `share` is unset. Placed only on a free instance of the profile.
    #[serde(default)]
    pub gpu_profile: Option<String>,
}

impl JobSpec {
    /// Checks every field, naming the first that is wrong and what is allowed.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, message: &str| Error::InvalidJob {
            job: self.id,
            field,
            message: message.to_string(),
        };
        if self.shape.nodes == 0 {
            return Err(bad("nodes", "must be at least 1"));
        }
        if self.shape.gpus_per_node == 0 || self.shape.gpus_per_node > 64 {
            return Err(bad("gpus_per_node", "must be between 1 and 64"));
        }
        if self.time_limit <= 0 {
            return Err(bad("time_limit", "must be positive"));
        }
        if self.account.0.is_empty() {
            return Err(bad("account", "must not be empty"));
        }
        if matches!(self.oracle_duration, Some(d) if d < 0) {
            return Err(bad("oracle_duration", "must not be negative"));
        }
        if let Some(share) = self.share {
            if !(1..=99).contains(&share.percent) {
                return Err(bad(
                    "share.percent",
                    "must be between 1 and 99 (a whole GPU is a job without a share)",
                ));
            }
            if share.memory_mb == 0 {
                return Err(bad("share.memory_mb", "must be at least 1"));
            }
            if self.shape.nodes != 1 || self.shape.gpus_per_node != 1 {
                return Err(bad(
                    "share",
                    "a shared job runs on part of one GPU: nodes and gpus_per_node must be 1",
                ));
            }
        }
        if let Some(profile) = &self.gpu_profile {
            if crate::cluster::mig_slices(profile).is_none() {
                return Err(bad(
                    "gpu_profile",
                    "must be a MIG profile of the form <n>g.<m>gb, n from 1 to 7 (e.g. 3g.40gb)",
                ));
            }
            if self.share.is_some() {
                return Err(bad(
                    "gpu_profile",
                    "a MIG instance is not shared: ask for a profile or a share, not both",
                ));
            }
            if self.shape.nodes != 1 || self.shape.gpus_per_node != 1 {
                return Err(bad(
                    "gpu_profile",
                    "a job on a MIG instance runs on one instance: nodes and gpus_per_node must be 1",
                ));
            }
        }
        Ok(())
    }

    /// What the job holds, in hundredths of a GPU: its share's percent, its MIG profile's
    /// compute slices over 7 (rounded), or 100 per GPU. Quotas and fair-share usage count this,
    /// so a quarter-GPU job is charged a quarter.
    pub fn gpu_hundredths(&self) -> u32 {
        if let Some(part) = self
            .gpu_profile
            .as_deref()
            .and_then(crate::cluster::mig_hundredths)
        {
            return part;
        }
        match self.share {
            Some(s) => s.percent,
            None => self.shape.gpus().saturating_mul(100),
        }
    }
}

/// Why a pending job is not running, in the words `perch queue` shows (Slurm's `squeue` reasons).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PendingReason {
    /// Not yet considered by a scheduling pass.
    New,
    /// Higher-priority jobs come first.
    Priority,
    /// The highest-priority waiting job: the GPUs it needs are reserved for it from `at`.
    Reserved {
        /// The time its reservation starts (the planned start, from time limits).
        at: Time,
    },
    /// Not enough free GPUs of the right shape, model and health.
    Resources,
    /// The account is at its quota and borrowing is off, nothing is idle to borrow, or the
    /// job may not be preempted (only preemptible jobs borrow: borrowed GPUs are reclaimed).
    QuotaExceeded,
    /// Strict FIFO: a job ahead of it is blocked.
    FifoBlocked,
    /// No node of the cluster, even empty and healthy, can run this gang.
    Unsatisfiable,
}

/// How a job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EndState {
    /// Exit code 0.
    Completed,
    /// Non-zero exit code.
    Failed {
        /// The exit code.
        code: i32,
    },
    /// Cancelled by a user or operator.
    Cancelled,
    /// Ran past its time limit.
    Timeout,
    /// Its node went down and it has no requeues left.
    NodeFail,
    /// Preempted without requeue (idle reclaim, or requeues exhausted).
    Preempted,
}

/// Why a running job is being preempted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PreemptReason {
    /// An account within its quota reclaims capacity this job borrowed.
    QuotaReclaim {
        /// The job the GPUs go to.
        for_job: JobId,
    },
    /// Its GPUs were measured idle for the configured time while other jobs waited.
    Idle,
    /// SRTF reference policy: a job with less remaining time needs the GPUs.
    ShorterJob {
        /// The job the GPUs go to.
        for_job: JobId,
    },
    /// LAS policy: a job that has run less GPU-time than this one needs the GPUs.
    LessServed {
        /// The job the GPUs go to.
        for_job: JobId,
    },
    /// perch: a one-node job past its starvation bound needs the GPUs, and this job declared
    /// a longer time limit (`Config::starved_reclaim`).
    Starved {
        /// The job the GPUs go to.
        for_job: JobId,
    },
    /// Moved off its node by an operator or the automatic remediation (a GPU went bad, the
    /// node is drained for repair): see [`crate::Event::Evict`].
    Evicted,
}

/// In words, as a job's timeline shows it ("preempted (quota reclaim for job 7)").
impl std::fmt::Display for PreemptReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PreemptReason::QuotaReclaim { for_job } => write!(f, "quota reclaim for job {for_job}"),
            PreemptReason::Idle => f.write_str("its GPUs idle while other jobs waited"),
            PreemptReason::ShorterJob { for_job } => write!(f, "for job {for_job}, shorter"),
            PreemptReason::LessServed { for_job } => write!(f, "for job {for_job}, less served"),
            PreemptReason::Starved { for_job } => {
                write!(f, "for job {for_job}, past its starvation bound")
            }
            PreemptReason::Evicted => f.write_str("evicted from its node"),
        }
    }
}

/// Why a job was put back in the queue without the user asking.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RequeueReason {
    /// Its node went down.
    NodeFail,
}

impl std::fmt::Display for RequeueReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequeueReason::NodeFail => f.write_str("its node failed"),
        }
    }
}
