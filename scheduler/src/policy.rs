//! Policy configuration and the multifactor priority.
//!
//! One [`Config`] selects the policy; the same scheduling pass runs all of them:
//!
//! - [`PolicyKind::Fifo`]: submit order; the first job that does not fit blocks all behind it.
//! - [`PolicyKind::Backfill`]: submit order with EASY backfill: the first blocked job gets a
//!   reservation at the earliest time the time limits of running jobs say its gang frees up;
//!   a later job may start now only if it ends (by its time limit) before that time, or uses
//!   GPUs the reservation does not need.
//! - [`PolicyKind::Perch`]: multifactor priority (below) + EASY backfill + per-account quotas
//!   with borrowing of idle GPUs and gang-aware reclaim + idle detection + starvation reclaim
//!   ([`Config::starved_reclaim`]).
//! - [`PolicyKind::Srtf`]: shortest remaining (oracle) time first, preemptive, greedy fill; a
//!   reference point that needs true durations, so only simulators can run it. Unbounded by
//!   default ([`Config::srtf`]); [`Config::srtf_once`] preempts each job at most once, the
//!   oracle held to the preemption bound the scorecard holds perch to.
//! - [`PolicyKind::Las`]: Tiresias' discretized two-dimensional least attained service, which
//!   needs no duration at all: a job's attained service is the GPU-time it has run so far
//!   (GPUs x run time, over all its runs); jobs under [`Config::las_threshold_gpu_seconds`] go
//!   first, the others after them, first come first served within each of the two queues, with
//!   EASY backfill. A waiting job of the first queue preempts running jobs of the second (most
//!   served first), each at most [`Config::max_order_preemptions`] times.
//! - [`PolicyKind::Gittins`]: Tiresias' 2D-Gittins with the distribution learned online: the
//!   job with the highest Gittins index of its attained GPU-time over the GPU-time finished
//!   jobs used runs first (`gittins.rs`), with EASY backfill. Before 20 jobs have finished it
//!   runs as LAS, preemption included; after, a higher index does not preempt (with the
//!   preemption cost on, preempting for an index under half, or an eighth, of the waiting
//!   job's lost more than it won on the scorecard).
//! - [`PolicyKind::Themis`]: Themis' finish-time fairness (Mahajan et al., NSDI'20) over jobs:
//!   the job with the highest `rho = T_shared / T_ideal` runs first, where `T_shared` is the
//!   time since its submission plus what is left of its expected run, and `T_ideal` its
//!   expected run on an equal part of the cluster (the GPUs over the accounts with unfinished
//!   jobs, as Themis divides among apps; a job asking for more than that part is slowed in
//!   proportion, as Themis' linear model has it).
//!   The expected run is the time limit, or the shorter run the user's recent jobs predict
//!   (perch's `finish` factor reads the same ratio); EASY backfill and the starvation bound as
//!   perch's, and no lease preemption (scheduler/BENCHMARKS.md).
//!
//! Perch priority (each factor in `[0, 1]`, weighted and summed, higher runs first):
//! `finish = rho / (1 + rho)`, Themis' finish-time fairness above (the weight perch leans on
//! by default: it ranks short requests first and raises a waiting job in proportion to what it
//! asked for); `fairshare = 2^(-(usage_a / usage_total) / share_a)` with usage decayed with a
//! half-life (Slurm's classic formula); `qos` from [`crate::Qos`]; and, weighted 0 by default,
//! `age = min(wait / age_max, 1)` and `size = 1 - ln(1 + gpu_seconds_expected) / ln(1 +
//! size_max)`. Every duration read is declared or predicted, never the true one.

use crate::ids::{Account, DAY, GpuModel, MINUTE, Millis};
use serde::{Deserialize, Serialize};

/// Which ordering and rules a pass applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PolicyKind {
    /// Strict first-in first-out.
    Fifo,
    /// FIFO order with EASY backfill.
    Backfill,
    /// Shortest remaining oracle time first, preemptive (reference only).
    Srtf,
    /// Multifactor priority, EASY backfill, quotas with borrowing and reclaim, idle detection.
    Perch,
    /// Discretized two-dimensional least attained service (Tiresias), preemptive.
    Las,
    /// The Gittins index of attained service over the service of finished jobs (Tiresias'
    /// 2D-Gittins, learned as jobs finish).
    Gittins,
    /// Themis' finish-time fairness: the job furthest behind the finish an equal part of the
    /// cluster would give it runs first.
    Themis,
}

impl PolicyKind {
    /// The policy's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Fifo => "fifo",
            PolicyKind::Backfill => "backfill",
            PolicyKind::Srtf => "srtf",
            PolicyKind::Perch => "perch",
            PolicyKind::Las => "las",
            PolicyKind::Gittins => "gittins",
            PolicyKind::Themis => "themis",
        }
    }
}

/// Weights of the multifactor priority.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Weights {
    /// Weight of waiting time.
    pub age: f64,
    /// Weight of fair share.
    pub fairshare: f64,
    /// Weight of QOS.
    pub qos: f64,
    /// Weight of (small) size.
    pub size: f64,
    /// Weight of finish-time fairness: Themis' `rho` as `rho / (1 + rho)`.
    #[serde(default)]
    pub finish: f64,
}

/// What to do with a job whose GPUs are measured idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IdleAction {
    /// Nothing.
    Off,
    /// Emit [`crate::Action::IdleReport`] once per idle spell.
    Report,
    /// Report, and preempt the job when it is preemptible, still idle `grace` after the
    /// report, and other jobs wait.
    Reclaim {
        /// Put it back in the queue (else it ends as `Preempted`).
        requeue: bool,
    },
}

/// Allocated-but-idle detection.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct IdlePolicy {
    /// A job is idle while all its GPUs are under this utilization, percent.
    pub threshold_pct: f32,
    /// How long it must stay idle before it is reported.
    pub window: Millis,
    /// With [`IdleAction::Reclaim`]: how much longer after the report (the warning to its
    /// user) before it is preempted.
    pub grace: Millis,
    /// The action.
    pub action: IdleAction,
}

/// Everything a pass needs to know about policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// The policy.
    pub kind: PolicyKind,
    /// Priority weights (Perch).
    pub weights: Weights,
    /// Waiting time at which the age factor reaches 1.
    pub age_max: Millis,
    /// Half-life of past usage in the fair-share factor.
    pub usage_half_life: Millis,
    /// Requested GPU-seconds at which the size factor reaches 0.
    pub size_max_gpu_seconds: f64,
    /// Priorities are recomputed at most this often (Slurm's PriorityCalcPeriod); jobs
    /// submitted in between are placed by the priority they had at submission.
    pub priority_period: Millis,
    /// GPU quota per account. Empty: no quotas. Non-empty: unlisted accounts have quota 0.
    pub quotas: Vec<(Account, u32)>,
    /// Per-model caps: the account may hold at most this many GPUs of the model (on top of its
    /// quota in all, if any). Models not named are limited only by the quota in all. A job
    /// without a model constraint runs on the models where its account has room.
    pub model_quotas: Vec<(Account, GpuModel, u32)>,
    /// Accounts over quota may use idle GPUs (the jobs become reclaimable).
    pub borrowing: bool,
    /// Accounts within quota preempt borrowers to get their GPUs back.
    pub reclaim: bool,
    /// Idle detection.
    pub idle: IdlePolicy,
    /// Jobs whose reclaim a pass may attempt (bounds the pass time).
    pub max_reclaims_per_pass: usize,
    /// Starvation bound (perch, LAS): a waiting job that has waited longer than this many
    /// times its time limit (twice that at Low QOS) goes before every job that has not, the
    /// longest-waiting first, so a stream of smaller jobs cannot hold a large one back without
    /// end.
    /// 0: never.
    pub starved_after_limits: f64,
    /// LAS: attained service (GPU-seconds) at which a job moves from the first queue to the
    /// second.
    #[serde(default = "default_las_threshold")]
    pub las_threshold_gpu_seconds: f64,
    /// SRTF, LAS (and Gittins before it has an index): how many times one job may be
    /// preempted for a job ahead of it in the policy's order (a shorter one, a less-served
    /// one); after that it runs to its end. 1 by default; plain SRTF, `u32::MAX`.
    #[serde(
        default = "default_max_order_preemptions",
        alias = "las_max_preemptions"
    )]
    pub max_order_preemptions: u32,
    /// perch: a one-node job past its starvation bound that cannot fit preempts running jobs
    /// that declared a longer time limit, are not starved themselves and are on their first
    /// run (so each job is stopped this way at most once), the least work at stake first. A
    /// user has one such rescued run at a time: their other starved jobs wait for it to end.
    #[serde(default)]
    pub starved_reclaim: bool,
    /// perch (and Themis): the finish and size factors read the run time predicted from the
    /// user's recent finished jobs where that is shorter than the time limit (`history.rs`);
    /// the limit still bounds the run and every reservation.
    #[serde(default)]
    pub predict_from_history: bool,
    /// The longest checkpoint grace a job the scheduler stops for another job gets (quota
    /// reclaim, the starvation bound, idle reclaim, an eviction): a server caps the job's own
    /// grace at it, so a borrower that declares an hour's grace cannot hold an account's
    /// guaranteed GPUs for that hour (Slurm's `GraceTime`, set by the operator). The replay
    /// does not model graces.
    #[serde(default = "default_preemption_grace_max")]
    pub preemption_grace_max: Millis,
}

/// 16 GPU-hours: the best of 0.25 to 64 GPU-hours on the scorecard's synthetic matrix
/// (scheduler/BENCHMARKS.md); Tiresias tunes its thresholds per cluster as well.
fn default_las_threshold() -> f64 {
    16.0 * 3600.0
}

fn default_max_order_preemptions() -> u32 {
    1
}

/// 5 minutes: long enough to save a large model's checkpoint to a parallel file system, short
/// enough that an account's quota comes back within minutes.
fn default_preemption_grace_max() -> Millis {
    5 * MINUTE
}

impl Config {
    /// Whether any quota (in all or per model) is in force.
    pub fn has_quotas(&self) -> bool {
        !self.quotas.is_empty() || !self.model_quotas.is_empty()
    }

    /// The defaults shared by every policy.
    fn base(kind: PolicyKind) -> Self {
        Config {
            kind,
            weights: Weights {
                age: 0.0,
                fairshare: 1000.0,
                qos: 1000.0,
                size: 0.0,
                finish: 4000.0,
            },
            age_max: 7 * DAY,
            usage_half_life: 7 * DAY,
            size_max_gpu_seconds: 64.0 * 30.0 * 86_400.0,
            priority_period: 5 * MINUTE,
            preemption_grace_max: default_preemption_grace_max(),
            quotas: Vec::new(),
            model_quotas: Vec::new(),
            borrowing: true,
            reclaim: false,
            idle: IdlePolicy {
                threshold_pct: 1.0,
                window: 30 * MINUTE,
                grace: 0,
                action: IdleAction::Off,
            },
            max_reclaims_per_pass: 8,
            starved_after_limits: 0.0,
            las_threshold_gpu_seconds: default_las_threshold(),
            max_order_preemptions: default_max_order_preemptions(),
            starved_reclaim: false,
            predict_from_history: false,
        }
    }

    /// Strict FIFO.
    pub fn fifo() -> Self {
        Self::base(PolicyKind::Fifo)
    }

    /// FIFO with EASY backfill.
    pub fn backfill() -> Self {
        Self::base(PolicyKind::Backfill)
    }

    /// Preemptive SRTF with oracle durations, as often as it gains.
    pub fn srtf() -> Self {
        let mut c = Self::base(PolicyKind::Srtf);
        c.max_order_preemptions = u32::MAX;
        c
    }

    /// Preemptive SRTF with oracle durations, each job preempted at most once: the oracle
    /// within the bound of half a preemption per job the scorecard holds perch to (plain SRTF
    /// preempts about once per job on the `gangs` trace, scheduler/BENCHMARKS.md).
    pub fn srtf_once() -> Self {
        let mut c = Self::base(PolicyKind::Srtf);
        c.max_order_preemptions = 1;
        c
    }

    /// Tiresias' 2D-LAS: two queues by attained GPU-time, preemptive, EASY backfill, the
    /// starvation bound of perch.
    pub fn las() -> Self {
        let mut c = Self::base(PolicyKind::Las);
        c.starved_after_limits = 4.0;
        c
    }

    /// 2D-Gittins learned online: the Gittins index of attained GPU-time, EASY backfill, the
    /// starvation bound of perch.
    pub fn gittins() -> Self {
        let mut c = Self::base(PolicyKind::Gittins);
        c.starved_after_limits = 4.0;
        c
    }

    /// Themis' finish-time fairness over jobs, on the run perch expects (history prediction),
    /// EASY backfill, the starvation bound of perch.
    pub fn themis() -> Self {
        let mut c = Self::base(PolicyKind::Themis);
        c.starved_after_limits = 4.0;
        c.predict_from_history = true;
        c
    }

    /// perch's default: multifactor priority, EASY backfill, quotas with borrowing and reclaim,
    /// idle GPUs reported.
    pub fn perch(quotas: Vec<(Account, u32)>) -> Self {
        let mut c = Self::base(PolicyKind::Perch);
        c.quotas = quotas;
        c.reclaim = true;
        c.idle.action = IdleAction::Report;
        c.idle.grace = 10 * MINUTE;
        c.starved_after_limits = 4.0;
        c.starved_reclaim = true;
        c.predict_from_history = true;
        c
    }
}

/// Slurm's classic fair-share factor: 1 with no usage, 0.5 at exactly the fair share.
pub(crate) fn fairshare_factor(usage: f64, total_usage: f64, share: f64) -> f64 {
    if total_usage <= 0.0 || share <= 0.0 {
        return if share <= 0.0 { 0.0 } else { 1.0 };
    }
    (-(usage / total_usage) / share).exp2()
}

/// The size factor: 1 for the smallest request, 0 at `max` GPU-seconds and beyond.
pub(crate) fn size_factor(gpu_seconds: f64, max: f64) -> f64 {
    (1.0 - (1.0 + gpu_seconds.max(0.0)).ln() / (1.0 + max).ln()).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fairshare_is_half_at_the_share() {
        assert!((fairshare_factor(25.0, 100.0, 0.25) - 0.5).abs() < 1e-12);
        assert_eq!(fairshare_factor(0.0, 0.0, 0.25), 1.0);
        assert!(fairshare_factor(90.0, 100.0, 0.1) < fairshare_factor(10.0, 100.0, 0.1));
    }

    #[test]
    fn size_favours_small() {
        assert!(size_factor(60.0, 1e9) > size_factor(6000.0, 1e9));
        assert_eq!(size_factor(2e9, 1e9), 0.0);
    }
}
