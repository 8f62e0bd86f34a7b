//! `[scheduler]`: the scheduling policy the server runs (and reads again on SIGHUP) and
//! `perch simulate --config` replays. [`SchedulerSection::policy`] turns the section into the
//! scheduler core's [`perch_scheduler::Config`], naming the key of any value it cannot take;
//! [`SchedulerSection::from_policy`] goes the other way (`perch simulate --show-config`).

use anyhow::Result;
use perch_scheduler::{Account, Config as Policy, IdleAction};
use serde::{Deserialize, Serialize};

/// `[scheduler]`: which policy orders and places jobs, with its weights, quotas and idle
/// rules. The server runs it (SIGHUP reads it again; queued and running jobs stay) and
/// `perch simulate --config` replays a trace under it: one policy, two entry points.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSection {
    /// `perch` (multifactor priority, EASY backfill, quotas with borrowing and reclaim, idle
    /// detection), `backfill` (submit order with EASY backfill) or `fifo`.
    pub policy: String,
    /// Weights of the priority factors (policy `perch`).
    pub weights: WeightsSection,
    /// Waiting time at which the age factor reaches 1.
    pub age_max: perch_alerts::HumanDuration,
    /// Half-life of past usage in the fair-share factor.
    pub usage_half_life: perch_alerts::HumanDuration,
    /// Requested GPU-hours (GPUs x time limit) at which the size factor reaches 0.
    pub size_max_gpu_hours: f64,
    /// Priorities are recomputed at most this often (Slurm's PriorityCalcPeriod).
    pub priority_period: perch_alerts::HumanDuration,
    /// GPUs each account may hold (`vision = 32`). Empty: no quotas. Otherwise an account
    /// not listed has a quota of 0 (it runs only on borrowed GPUs).
    pub quotas: std::collections::BTreeMap<String, u32>,
    /// Per-model caps (`[scheduler.model_quotas.vision]` with `"NVIDIA H100 80GB HBM3" = 8`):
    /// the account may hold at most that many GPUs of the model (the name as `perch nodes`
    /// shows it), within its quota in all if it has one. Models not named are limited only by
    /// that quota; a job without a model constraint goes to the models where it has room.
    pub model_quotas: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u32>>,
    /// An account at its quota may run preemptible jobs on idle GPUs; they can be reclaimed.
    /// A job that may not be preempted never borrows, and one that asks for more than its
    /// account's quota on its own is refused unless it may be (always, borrowing off).
    pub borrowing: bool,
    /// An account within its quota preempts borrowers (their checkpoint signal, then their
    /// grace) to get its GPUs back: those it has stopped least often first, then the least
    /// work at stake.
    pub reclaim: bool,
    /// Most running jobs one scheduling pass may examine as reclaim victims.
    pub max_reclaims_per_pass: usize,
    /// The longest checkpoint grace a job gets when the scheduler stops it for another job
    /// (quota reclaim, the starvation bound, idle reclaim, an eviction): its own `grace_secs`,
    /// at most this, so a borrower declaring an hour's grace cannot hold an account's
    /// guaranteed GPUs for that hour. A cancel or a time limit keeps the job's own grace.
    pub preemption_grace_max: perch_alerts::HumanDuration,
    /// A job that has waited longer than this many times its time limit (twice that for QOS
    /// low) goes before every job that has not, the longest-waiting first (policy `perch`);
    /// 0: never.
    pub starved_after_limits: f64,
    /// A one-node job past that bound that still cannot fit stops running preemptible jobs
    /// that declared longer time limits and are on their first run (checkpoint signal, then
    /// their grace), the least work at stake first; each job is stopped this way at most once.
    /// An account past its quota does not reclaim this way, and a user has one run begun this
    /// way at a time.
    pub starved_reclaim: bool,
    /// The finish factor reads a job's time limit scaled by the part of their limits its user's
    /// recent finished jobs ran (their median, over the user's last 32 completed or timed-out
    /// runs of the same GPU request, or of any, from 3 on), so a user who always declares the
    /// maximum is not ranked by it. The limit itself still ends the run and bounds backfill.
    /// At start the server rebuilds it from the finished jobs of its database (policy `perch`).
    pub predict_from_history: bool,
    /// Allocated-but-idle GPUs.
    pub idle: IdleSection,
}

/// `[scheduler.weights]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WeightsSection {
    pub age: f64,
    pub fairshare: f64,
    pub qos: f64,
    pub size: f64,
    /// Finish-time fairness (Themis' `rho`, scheduler/README.md).
    pub finish: f64,
}

/// `[scheduler.idle]`: a job whose GPUs all stay below `below_percent` for `after` is
/// reported (its timeline, the `JobIdle` alert to its user); with `action` `requeue` or
/// `stop`, a preemptible one still idle `grace` later is preempted when other jobs wait.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IdleSection {
    /// `off`, `report`, `requeue` or `stop`.
    pub action: String,
    pub below_percent: f64,
    pub after: perch_alerts::HumanDuration,
    pub grace: perch_alerts::HumanDuration,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        let perch = perch_scheduler::Config::perch(Vec::new());
        let human = perch_alerts::HumanDuration::from_ms;
        SchedulerSection {
            policy: "perch".into(),
            weights: WeightsSection {
                age: perch.weights.age,
                fairshare: perch.weights.fairshare,
                qos: perch.weights.qos,
                size: perch.weights.size,
                finish: perch.weights.finish,
            },
            age_max: human(perch.age_max),
            usage_half_life: human(perch.usage_half_life),
            size_max_gpu_hours: perch.size_max_gpu_seconds / 3600.0,
            priority_period: human(perch.priority_period),
            quotas: Default::default(),
            model_quotas: Default::default(),
            borrowing: perch.borrowing,
            reclaim: perch.reclaim,
            max_reclaims_per_pass: perch.max_reclaims_per_pass,
            preemption_grace_max: human(perch.preemption_grace_max),
            starved_after_limits: perch.starved_after_limits,
            starved_reclaim: perch.starved_reclaim,
            predict_from_history: perch.predict_from_history,
            idle: IdleSection::default(),
        }
    }
}

impl Default for WeightsSection {
    fn default() -> Self {
        SchedulerSection::default().weights
    }
}

impl Default for IdleSection {
    fn default() -> Self {
        let perch = perch_scheduler::Config::perch(Vec::new());
        IdleSection {
            action: "report".into(),
            below_percent: f64::from(perch.idle.threshold_pct),
            after: perch_alerts::HumanDuration::from_ms(perch.idle.window),
            grace: perch_alerts::HumanDuration::from_ms(perch.idle.grace),
        }
    }
}

impl SchedulerSection {
    /// The section that describes `policy` (`perch simulate --show-config`: start a config from
    /// what a replay ran); `None` for the simulator's reference policies: SRTF, which needs
    /// true durations no server has, and the scorecard's anchors: LAS and Gittins, which need
    /// no duration, and Themis' finish-time fairness.
    pub fn from_policy(policy: &perch_scheduler::Config) -> Option<SchedulerSection> {
        use perch_scheduler::PolicyKind;
        let human = perch_alerts::HumanDuration::from_ms;
        let name = match policy.kind {
            PolicyKind::Perch => "perch",
            PolicyKind::Backfill => "backfill",
            PolicyKind::Fifo => "fifo",
            PolicyKind::Srtf | PolicyKind::Las | PolicyKind::Gittins | PolicyKind::Themis => {
                return None;
            }
        };
        Some(SchedulerSection {
            policy: name.into(),
            weights: WeightsSection {
                age: policy.weights.age,
                fairshare: policy.weights.fairshare,
                qos: policy.weights.qos,
                size: policy.weights.size,
                finish: policy.weights.finish,
            },
            age_max: human(policy.age_max),
            usage_half_life: human(policy.usage_half_life),
            size_max_gpu_hours: policy.size_max_gpu_seconds / 3600.0,
            priority_period: human(policy.priority_period),
            quotas: policy
                .quotas
                .iter()
                .map(|(a, q)| (a.0.clone(), *q))
                .collect(),
            model_quotas: policy.model_quotas.iter().fold(
                std::collections::BTreeMap::new(),
                |mut all, (a, m, q)| {
                    all.entry(a.0.clone())
                        .or_insert_with(std::collections::BTreeMap::new)
                        .insert(m.0.clone(), *q);
                    all
                },
            ),
            borrowing: policy.borrowing,
            reclaim: policy.reclaim,
            max_reclaims_per_pass: policy.max_reclaims_per_pass,
            preemption_grace_max: human(policy.preemption_grace_max),
            starved_after_limits: policy.starved_after_limits,
            starved_reclaim: policy.starved_reclaim,
            predict_from_history: policy.predict_from_history,
            idle: IdleSection {
                action: match policy.idle.action {
                    IdleAction::Off => "off",
                    IdleAction::Report => "report",
                    IdleAction::Reclaim { requeue: true } => "requeue",
                    IdleAction::Reclaim { requeue: false } => "stop",
                }
                .into(),
                below_percent: f64::from(policy.idle.threshold_pct),
                after: human(policy.idle.window),
                grace: human(policy.idle.grace),
            },
        })
    }

    /// Checks the keys of `[scheduler]`; the message names the key.
    pub fn check(&self) -> Result<()> {
        self.policy().map(|_| ())
    }

    /// The scheduler core's policy this section describes, or what to change (naming the key).
    pub fn policy(&self) -> Result<Policy> {
        let mut c = self.base()?;
        self.set_weights(&mut c)?;
        self.set_factors(&mut c)?;
        self.set_quotas(&mut c)?;
        self.set_preemption(&mut c)?;
        self.idle.set(&mut c.idle)?;
        Ok(c)
    }

    /// The named policy with its own defaults.
    fn base(&self) -> Result<Policy> {
        match self.policy.as_str() {
            "perch" => Ok(Policy::perch(Vec::new())),
            "backfill" => Ok(Policy::backfill()),
            "fifo" => Ok(Policy::fifo()),
            "srtf" => Err(bad(
                "policy",
                "srtf needs every job's true duration, which only a trace replay knows (perch simulate --policy srtf); choose perch, backfill or fifo".into(),
            )),
            other => Err(bad(
                "policy",
                format!("{other:?} is not a policy; choose perch, backfill or fifo"),
            )),
        }
    }

    /// `[scheduler.weights]`: each a number of at least 0.
    fn set_weights(&self, c: &mut Policy) -> Result<()> {
        for (key, w) in [
            ("age", self.weights.age),
            ("fairshare", self.weights.fairshare),
            ("qos", self.weights.qos),
            ("size", self.weights.size),
            ("finish", self.weights.finish),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(bad(
                    &format!("weights.{key}"),
                    format!("{w} is not a weight; give a number of at least 0"),
                ));
            }
        }
        c.weights = perch_scheduler::Weights {
            age: self.weights.age,
            fairshare: self.weights.fairshare,
            qos: self.weights.qos,
            size: self.weights.size,
            finish: self.weights.finish,
        };
        Ok(())
    }

    /// The priority factors' scales (`age_max`, `usage_half_life`, `size_max_gpu_hours`), how
    /// often priorities are computed, and the starvation bound (policy `perch` only).
    fn set_factors(&self, c: &mut Policy) -> Result<()> {
        for (key, d) in [
            ("age_max", self.age_max),
            ("usage_half_life", self.usage_half_life),
            ("priority_period", self.priority_period),
        ] {
            if d.is_zero() {
                return Err(bad(
                    key,
                    "must be longer than 0, like \"7d\" or \"5m\"".into(),
                ));
            }
        }
        c.age_max = self.age_max.as_ms();
        c.usage_half_life = self.usage_half_life.as_ms();
        c.priority_period = self.priority_period.as_ms();
        if !(self.size_max_gpu_hours.is_finite() && self.size_max_gpu_hours > 0.0) {
            return Err(bad(
                "size_max_gpu_hours",
                format!(
                    "{} must be a number of GPU-hours above 0",
                    self.size_max_gpu_hours
                ),
            ));
        }
        c.size_max_gpu_seconds = self.size_max_gpu_hours * 3600.0;
        if !(self.starved_after_limits.is_finite() && self.starved_after_limits >= 0.0) {
            return Err(bad(
                "starved_after_limits",
                format!(
                    "{} must be a number of time limits of at least 0 (0: never)",
                    self.starved_after_limits
                ),
            ));
        }
        if self.policy == "perch" {
            c.starved_after_limits = self.starved_after_limits;
            c.starved_reclaim = self.starved_reclaim;
            c.predict_from_history = self.predict_from_history;
        }
        Ok(())
    }

    /// `quotas` and `model_quotas`: account names, model names and GPU counts a cluster can
    /// have.
    fn set_quotas(&self, c: &mut Policy) -> Result<()> {
        for (account, gpus) in &self.quotas {
            if account.trim().is_empty() || account.len() > 128 {
                return Err(bad(
                    "quotas",
                    format!("{account:?} is not an account name (1 to 128 characters)"),
                ));
            }
            if *gpus > 1_000_000 {
                return Err(bad(
                    &format!("quotas.{account}"),
                    format!("{gpus} GPUs is more than any cluster has"),
                ));
            }
        }
        c.quotas = self
            .quotas
            .iter()
            .map(|(a, q)| (Account(a.clone()), *q))
            .collect();
        for (account, caps) in &self.model_quotas {
            if account.trim().is_empty() || account.len() > 128 {
                return Err(bad(
                    "model_quotas",
                    format!("{account:?} is not an account name (1 to 128 characters)"),
                ));
            }
            for (model, gpus) in caps {
                let key = format!("model_quotas.{account}.{model:?}");
                if model.trim().is_empty() || model.len() > 256 {
                    return Err(bad(
                        &key,
                        "a GPU model is named as `perch nodes` shows it (1 to 256 characters)"
                            .into(),
                    ));
                }
                if *gpus > 1_000_000 {
                    return Err(bad(
                        &key,
                        format!("{gpus} GPUs is more than any cluster has"),
                    ));
                }
                c.model_quotas.push((
                    Account(account.clone()),
                    perch_scheduler::GpuModel(model.clone()),
                    *gpus,
                ));
            }
        }
        Ok(())
    }

    /// Borrowing, reclaim and the longest grace a preempted job gets.
    fn set_preemption(&self, c: &mut Policy) -> Result<()> {
        c.borrowing = self.borrowing;
        c.reclaim = self.reclaim;
        if self.max_reclaims_per_pass == 0 || self.max_reclaims_per_pass > 10_000 {
            return Err(bad(
                "max_reclaims_per_pass",
                format!("{} must be 1 to 10000", self.max_reclaims_per_pass),
            ));
        }
        c.max_reclaims_per_pass = self.max_reclaims_per_pass;
        if self.preemption_grace_max.as_ms() > 3600 * 1000 {
            return Err(bad(
                "preemption_grace_max",
                "must be at most \"1h\", the longest grace a job may declare".into(),
            ));
        }
        c.preemption_grace_max = self.preemption_grace_max.as_ms();
        Ok(())
    }
}

impl IdleSection {
    /// Sets the scheduler core's idle policy from `[scheduler.idle]`.
    fn set(&self, target: &mut perch_scheduler::IdlePolicy) -> Result<()> {
        target.action = match self.action.as_str() {
            "off" => IdleAction::Off,
            "report" => IdleAction::Report,
            "requeue" => IdleAction::Reclaim { requeue: true },
            "stop" => IdleAction::Reclaim { requeue: false },
            other => {
                return Err(bad(
                    "idle.action",
                    format!("{other:?} is not an idle action; choose off, report, requeue or stop"),
                ));
            }
        };
        if !(0.0..=100.0).contains(&self.below_percent) {
            return Err(bad(
                "idle.below_percent",
                format!("{} is not a percentage (0 to 100)", self.below_percent),
            ));
        }
        target.threshold_pct = self.below_percent as f32;
        if self.after.as_ms() < 10 * perch_scheduler::SECOND {
            return Err(bad(
                "idle.after",
                "must be at least \"10s\" (minutes are usual: shorter spells are a job's normal pauses)".into(),
            ));
        }
        target.window = self.after.as_ms();
        target.grace = self.grace.as_ms();
        Ok(())
    }
}

/// The error about one key of `[scheduler]`: `config key scheduler.<key>: <why>`.
fn bad(key: &str, why: String) -> anyhow::Error {
    anyhow::anyhow!("config key scheduler.{key}: {why}")
}
