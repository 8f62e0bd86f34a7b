//! The discrete-event loop: trace submissions, job exits and utilization changes go into the
//! core as events; the core's actions come back as scheduled exits and utilization changes.

use super::cluster::SimCluster;
use super::metrics::{JobOutcome, Recorder, Sample, Summary};
use super::trace::{LimitModel, TraceJob, user_time_limit};
use crate::PolicyKind;
use crate::error::{Error, Result};
use crate::ids::{Account, GpuModel, JobId, MINUTE, Millis, SECOND, Time, User};
use crate::job::{EndState, GpuShare, JobSpec};
use crate::policy::{Config, IdleAction, Weights};
use crate::scheduler::{Action, Event, Scheduler};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A policy as the simulator runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimPolicy {
    /// Strict FIFO.
    Fifo,
    /// FIFO + EASY backfill on user time limits.
    Backfill,
    /// Preemptive SRTF on true durations (oracle).
    Srtf,
    /// The same oracle preempting each job at most once: within the scorecard's preemption
    /// bound.
    SrtfOnce,
    /// perch default (idle GPUs reported, not reclaimed), with quotas from the trace (each
    /// account's part of its GPU-time) and so quota reclaim.
    Perch,
    /// perch default as a server runs it with no quotas configured (no reclaim).
    PerchNoQuotas,
    /// perch default with idle reclaim: jobs idle for the window while others wait are ended.
    PerchIdleReclaim,
    /// Tiresias' discretized two-dimensional least attained service (no durations needed).
    Las,
    /// Tiresias' 2D-Gittins, the distribution of service learned as jobs finish.
    Gittins,
    /// Themis' finish-time fairness over jobs, on the run perch expects.
    Themis,
    /// perch without quotas and without history prediction: its finish factor reads the
    /// declared time limits alone (history prediction is the default since 2026-11-26; the
    /// scorecard's ablation).
    PerchLimitsOnly,
}

impl SimPolicy {
    /// Every policy, in table order.
    pub const ALL: [SimPolicy; 11] = [
        SimPolicy::Fifo,
        SimPolicy::Backfill,
        SimPolicy::Srtf,
        SimPolicy::SrtfOnce,
        SimPolicy::Perch,
        SimPolicy::PerchNoQuotas,
        SimPolicy::PerchIdleReclaim,
        SimPolicy::Las,
        SimPolicy::Gittins,
        SimPolicy::Themis,
        SimPolicy::PerchLimitsOnly,
    ];

    /// Name on the command line and in tables.
    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Fifo => "fifo",
            SimPolicy::Backfill => "backfill",
            SimPolicy::Srtf => "srtf",
            SimPolicy::SrtfOnce => "srtf-once",
            SimPolicy::Perch => "perch",
            SimPolicy::PerchNoQuotas => "perch-noquota",
            SimPolicy::PerchIdleReclaim => "perch+idle-reclaim",
            SimPolicy::Las => "las",
            SimPolicy::Gittins => "gittins",
            SimPolicy::Themis => "themis",
            SimPolicy::PerchLimitsOnly => "perch-limits",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<SimPolicy> {
        SimPolicy::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// What stopping a running job costs it, as a real cluster would charge it.
///
/// Defaults: a checkpoint every 30 minutes of progress (a job stopped loses what it did since
/// its last one, 15 minutes on average; jobs that save on the stop signal are
/// `checkpoint_every: 0`) and 60 s to restart (start the processes, load the checkpoint,
/// rebuild the communicators: the tens of seconds to a minute or two that Tiresias and Gandiva
/// report for deep-learning jobs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreemptionCost {
    /// Progress between two checkpoints; 0: the job saves when it is stopped, losing nothing.
    pub checkpoint_every: Millis,
    /// GPU time a restarted job spends before it makes progress again.
    pub restart_delay: Millis,
}

impl PreemptionCost {
    /// Preemption as a real cluster sees it (see the type's documentation).
    pub const DEFAULT: PreemptionCost = PreemptionCost {
        checkpoint_every: 30 * MINUTE,
        restart_delay: 60 * SECOND,
    };
    /// No cost at all: every stop is a perfect checkpoint, every restart instant.
    pub const FREE: PreemptionCost = PreemptionCost {
        checkpoint_every: 0,
        restart_delay: 0,
    };
}

/// Cluster shape and replay knobs.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// The nodes.
    pub cluster: SimCluster,
    /// Seed of every random draw (time-limit factors, idle-tail choice).
    pub seed: u64,
    /// Time limit = duration x a factor uniform in this range (rounded by `limits`).
    pub limit_factor: (f64, f64),
    /// How users declare time limits.
    pub limits: LimitModel,
    /// Idle window before an idle job is acted on.
    pub idle_window: Millis,
    /// perch's priority weights and the wait at which the age factor tops out.
    pub perch_weights: Weights,
    /// See `perch_weights`.
    pub perch_age_max: Millis,
    /// What a preemption costs the job stopped.
    pub preemption: PreemptionCost,
}

impl Default for SimOptions {
    fn default() -> Self {
        let perch = Config::perch(Vec::new());
        SimOptions {
            cluster: SimCluster::uniform(64, 8, 8),
            seed: 1,
            limit_factor: (1.5, 5.0),
            limits: LimitModel::Uniform,
            idle_window: 30 * MINUTE,
            perch_weights: perch.weights,
            perch_age_max: perch.age_max,
            preemption: PreemptionCost::DEFAULT,
        }
    }
}

impl SimOptions {
    /// The defaults on `nodes` identical nodes of `gpus_per_node` GPUs.
    pub fn uniform(nodes: u32, gpus_per_node: u32) -> SimOptions {
        SimOptions {
            cluster: SimCluster::uniform(nodes, gpus_per_node, 8),
            ..SimOptions::default()
        }
    }
}

/// What one replay produced.
#[derive(Clone, Debug)]
pub struct SimReport {
    /// The headline numbers.
    pub summary: Summary,
    /// Queue length and utilization over time, one sample per event time.
    pub series: Vec<Sample>,
    /// Each job's start and end, in trace order.
    pub jobs: Vec<JobOutcome>,
    /// Jobs the trace marks not preemptible that ask, on their own, for more than their
    /// account's quota ([`Scheduler::beyond_quota`]): a server refuses them (they could only
    /// ever run on borrowed GPUs), so they are replayed preemptible, as their users would
    /// resubmit them.
    pub made_preemptible: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A job's process exits (valid if its run generation still matches).
    Exit {
        job: usize,
        generation: u32,
    },
    /// A job's utilization steps to segment `segment`.
    Util {
        job: usize,
        generation: u32,
        segment: usize,
    },
    Submit {
        job: usize,
    },
    Wake,
}

struct Run {
    /// Work kept from earlier runs (up to their last checkpoint).
    done: Millis,
    start: Option<Time>,
    /// When the current run makes progress again (its start plus a restart's delay).
    work_from: Time,
    /// Runs started so far (every one after the first pays the restart delay).
    runs: u32,
    generation: u32,
    busy: bool,
}

/// Replays `jobs` under `policy`.
pub fn simulate(jobs: &[TraceJob], policy: SimPolicy, opts: &SimOptions) -> Result<SimReport> {
    check(opts)?;
    let config = policy_config(policy, jobs, opts);
    simulate_with(jobs, config, policy.name(), opts)
}

fn check(opts: &SimOptions) -> Result<()> {
    if opts.cluster.nodes.is_empty()
        || opts
            .cluster
            .nodes
            .iter()
            .any(|n| n.gpus == 0 || n.gpus > crate::MAX_GPUS_PER_NODE)
    {
        return Err(Error::SimConfig {
            option: "nodes/gpus-per-node",
            message: "need at least one node of 1 to 64 GPUs".into(),
        });
    }
    if opts.preemption.checkpoint_every < 0 || opts.preemption.restart_delay < 0 {
        return Err(Error::SimConfig {
            option: "preemption",
            message: "checkpoint interval and restart delay cannot be negative".into(),
        });
    }
    // At most 1,000: a limit of 1e308 runs overflowed the millisecond clock (a panic).
    if !(opts.limit_factor.0 >= 1.0
        && opts.limit_factor.1 >= opts.limit_factor.0
        && opts.limit_factor.1 <= 1000.0)
    {
        return Err(Error::SimConfig {
            option: "limit_factor",
            message: "need 1 <= low <= high <= 1000".into(),
        });
    }
    Ok(())
}

/// Refuses a trace with jobs the cluster can never start: the replay would run to its end
/// with them pending and report the rest as if all were well.
fn check_fits(jobs: &[TraceJob], opts: &SimOptions) -> Result<()> {
    let misfits: Vec<(&TraceJob, String)> = jobs
        .iter()
        .filter_map(|j| opts.cluster.misfit(j).map(|why| (j, why)))
        .collect();
    let Some((first, why)) = misfits.first() else {
        return Ok(());
    };
    let largest = misfits
        .iter()
        .map(|(j, _)| j.gpus)
        .max()
        .unwrap_or(first.gpus);
    let node = &opts.cluster.nodes[0];
    let uniform = opts.cluster.nodes.iter().all(|n| n.gpus == node.gpus);
    let remedy = if uniform && misfits.iter().all(|(j, _)| j.gpu_model.is_none()) {
        format!("give at least {} nodes", largest.div_ceil(node.gpus))
    } else {
        "give a cluster file with enough nodes of the models asked for".to_string()
    };
    Err(Error::SimConfig {
        option: "nodes",
        message: format!(
            "{} job(s) of the trace could never start on this cluster ({}, {} GPUs): the first is \
             job {} (the trace's {}th by submission), which {why}; the largest asks for {} GPUs; \
             {remedy}, or leave them out of the trace",
            misfits.len(),
            opts.cluster.describe(),
            opts.cluster.total_gpus(),
            first.id,
            first.id + 1,
            largest,
        ),
    })
}

/// Replays `jobs` under the core configuration `config` (an operator's `[scheduler]`, say),
/// reported as `name`. [`simulate`] is this with [`policy_config`].
pub fn simulate_with(
    jobs: &[TraceJob],
    config: Config,
    name: &str,
    opts: &SimOptions,
) -> Result<SimReport> {
    check(opts)?;
    check_fits(jobs, opts)?;
    let oracle = config.kind == PolicyKind::Srtf;
    let total_gpus = opts.cluster.total_gpus();
    let borrowing = config.borrowing;
    let mut sched = Scheduler::new(opts.cluster.build()?, config);
    for ev in opts.cluster.memory_events() {
        sched.handle(0, ev)?;
    }
    let beyond = beyond_quota(jobs, &sched, borrowing, opts)?;
    let mut heap: BinaryHeap<Reverse<(Time, Ev)>> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| Reverse((j.submit, Ev::Submit { job: i })))
        .collect();
    let mut runs: Vec<Run> = jobs
        .iter()
        .map(|_| Run {
            done: 0,
            start: None,
            work_from: 0,
            runs: 0,
            generation: 0,
            busy: false,
        })
        .collect();
    let mut rec = Recorder::new(jobs, total_gpus);
    let mut wake_at: Option<Time> = None;
    let mut batch = Vec::new();
    while let Some(Reverse((now, _))) = heap.peek().copied() {
        batch.clear();
        while let Some(Reverse((t, ev))) = heap.peek().copied() {
            if t != now {
                break;
            }
            heap.pop();
            batch.push(ev);
        }
        if wake_at == Some(now) {
            wake_at = None;
        }
        let mut actions = Vec::new();
        for &ev in &batch {
            match ev {
                Ev::Submit { job } => {
                    let mut spec = spec(&jobs[job], oracle, opts);
                    spec.preemptible |= beyond[job];
                    actions.extend(sched.handle(now, Event::Submit(spec))?);
                }
                Ev::Exit { job, generation }
                    if runs[job].generation == generation && runs[job].start.is_some() =>
                {
                    actions.extend(sched.handle(
                        now,
                        Event::JobExited {
                            job: JobId(job as u64),
                            code: 0,
                        },
                    )?);
                }
                Ev::Util {
                    job,
                    generation,
                    segment,
                } if runs[job].generation == generation && runs[job].start.is_some() => {
                    let steps = profile(&jobs[job]);
                    let pct = steps[segment].1;
                    rec.set_busy(now, &mut runs[job].busy, pct > 0.0, jobs[job].hundredths());
                    actions.extend(sched.handle(
                        now,
                        Event::JobUtilization {
                            job: JobId(job as u64),
                            percent: pct,
                        },
                    )?);
                    if let Some(&(off, _)) = steps.get(segment + 1) {
                        let at = runs[job].work_from + off - runs[job].done;
                        heap.push(Reverse((
                            at.max(now),
                            Ev::Util {
                                job,
                                generation,
                                segment: segment + 1,
                            },
                        )));
                    }
                }
                Ev::Exit { .. } | Ev::Util { .. } => {}
                Ev::Wake => actions.extend(sched.handle(now, Event::Tick)?),
            }
        }
        actions.extend(sched.schedule(now));
        for a in actions {
            apply(
                now,
                a,
                jobs,
                opts.preemption,
                &mut runs,
                &mut heap,
                &mut rec,
            );
        }
        if let Some(w) = sched.next_wakeup()
            && w > now
            && wake_at.is_none_or(|cur| w < cur)
        {
            wake_at = Some(w);
            heap.push(Reverse((w, Ev::Wake)));
        }
        rec.sample(now, sched.pending_len());
    }
    let summary = rec.summary(name);
    let outcomes = rec.outcomes();
    Ok(SimReport {
        summary,
        series: rec.series,
        jobs: outcomes,
        made_preemptible: beyond.iter().filter(|b| **b).count(),
    })
}

/// Which jobs the trace marks not preemptible yet ask for more than their account's quota on
/// their own: a server refuses them, and their users resubmit them preemptible, so the replay
/// runs them so. With borrowing off such a job could never start, preemptible or not: an
/// error, as a server refuses it.
fn beyond_quota(
    jobs: &[TraceJob],
    sched: &Scheduler,
    borrowing: bool,
    opts: &SimOptions,
) -> Result<Vec<bool>> {
    let mut beyond = Vec::with_capacity(jobs.len());
    for t in jobs {
        let over = sched.beyond_quota(&spec(t, false, opts));
        if let Some(over) = &over
            && !borrowing
        {
            return Err(Error::SimConfig {
                option: "quotas",
                message: format!(
                    "job {} (the trace's {}th by submission) {over}, and borrowing is off, so it \
                     could never start: raise the quota, turn borrowing on, or leave the job \
                     out of the trace",
                    t.id,
                    t.id + 1
                ),
            });
        }
        beyond.push(over.is_some() && !t.preemptible);
    }
    Ok(beyond)
}

/// A job's utilization steps; a trace that gives none means busy throughout.
fn profile(t: &TraceJob) -> &[(Millis, f32)] {
    const BUSY: &[(Millis, f32)] = &[(0, 100.0)];
    if t.utilization.is_empty() {
        BUSY
    } else {
        &t.utilization
    }
}

fn apply(
    now: Time,
    a: Action,
    jobs: &[TraceJob],
    cost: PreemptionCost,
    runs: &mut [Run],
    heap: &mut BinaryHeap<Reverse<(Time, Ev)>>,
    rec: &mut Recorder,
) {
    match a {
        Action::Start { job, .. } => {
            let i = job.0 as usize;
            let r = &mut runs[i];
            let delay = if r.runs > 0 { cost.restart_delay } else { 0 };
            r.runs += 1;
            r.start = Some(now);
            r.work_from = now + delay;
            r.generation += 1;
            let t = &jobs[i];
            rec.start(now, i, t.hundredths());
            heap.push(Reverse((
                r.work_from + (t.duration - r.done).max(0),
                Ev::Exit {
                    job: i,
                    generation: r.generation,
                },
            )));
            // The segment in force at `done`, from when the job works again (idle before).
            let seg = profile(t)
                .iter()
                .rposition(|&(off, _)| off <= r.done)
                .unwrap_or(0);
            heap.push(Reverse((
                r.work_from,
                Ev::Util {
                    job: i,
                    generation: r.generation,
                    segment: seg,
                },
            )));
        }
        Action::Preempt {
            job,
            requeued,
            reason,
        } => {
            let i = job.0 as usize;
            let idle = matches!(reason, crate::PreemptReason::Idle);
            stop(now, i, jobs, Some(cost), runs, rec);
            rec.preempted(idle);
            if !requeued {
                // An idle reclaim ends a job whose useful work is done; any other stop
                // without requeue ends it with work left.
                rec.end(now, i, idle || runs[i].done >= jobs[i].duration);
            }
        }
        Action::Requeue { job, .. } => stop(now, job.0 as usize, jobs, Some(cost), runs, rec),
        Action::End { job, state } => {
            let i = job.0 as usize;
            let finished = runs[i].start.is_some_and(|_| {
                runs[i].done + (now - runs[i].work_from).max(0) >= jobs[i].duration
            });
            if runs[i].start.is_some() {
                stop(now, i, jobs, None, runs, rec);
            }
            if state != EndState::Cancelled {
                rec.end(now, i, finished && state == EndState::Completed);
            }
        }
        Action::IdleReport { .. } => rec.idle_report(),
    }
}

/// Stops job `i`'s run. A preemption (`cost` given) keeps the progress up to the last
/// checkpoint; what the run held beyond the progress it kept is booked as wasted GPU time.
fn stop(
    now: Time,
    i: usize,
    jobs: &[TraceJob],
    cost: Option<PreemptionCost>,
    runs: &mut [Run],
    rec: &mut Recorder,
) {
    let r = &mut runs[i];
    if let Some(s) = r.start.take() {
        let reached = (r.done + (now - r.work_from).max(0)).min(jobs[i].duration);
        let kept = match cost {
            Some(c) if c.checkpoint_every > 0 => r
                .done
                .max(reached / c.checkpoint_every * c.checkpoint_every),
            _ => reached,
        };
        // What the run held without keeping: its restart delay, and the work since the last
        // checkpoint when it is preempted.
        rec.wasted(((now - s) - (kept - r.done)).max(0), jobs[i].hundredths());
        r.done = kept;
        r.generation += 1;
        rec.set_busy(now, &mut r.busy, false, jobs[i].hundredths());
        rec.stop(now, jobs[i].hundredths());
    }
}

fn spec(t: &TraceJob, oracle: bool, opts: &SimOptions) -> JobSpec {
    let share = t.fraction.map(|percent| GpuShare {
        percent,
        memory_mb: opts.cluster.share_memory_mb(t),
    });
    JobSpec {
        id: JobId(t.id),
        user: User(t.user.clone()),
        account: Account(t.account.clone()),
        shape: opts.cluster.shape(t),
        gpu_model: t.gpu_model.clone().map(GpuModel),
        time_limit: user_time_limit(
            t,
            opts.seed,
            opts.limit_factor.0,
            opts.limit_factor.1,
            opts.limits,
        ),
        qos: t.qos,
        preemptible: t.preemptible,
        max_requeues: 3,
        submit: t.submit,
        oracle_duration: oracle.then_some(t.duration),
        share,
        earlier_runs: 0,
        gpu_profile: None,
    }
}

/// Each account's quota: its part of the trace's GPU-time times the cluster's GPUs, by the
/// largest-remainder method, so the quotas add up to every GPU of the cluster (rounding each
/// down left ten small accounts on 8 GPUs with 2 GPUs among them).
pub fn trace_quotas(jobs: &[TraceJob], total_gpus: u32) -> Vec<(Account, u32)> {
    let mut demand: HashMap<&str, f64> = HashMap::new();
    for j in jobs {
        *demand.entry(&j.account).or_default() += j.duration as f64 * j.gpu_amount();
    }
    let total: f64 = demand.values().sum();
    let mut quotas: Vec<(Account, u32, f64)> = demand
        .into_iter()
        .map(|(a, d)| {
            let exact = if total > 0.0 {
                d / total * f64::from(total_gpus)
            } else {
                0.0
            };
            (Account(a.to_string()), exact.floor() as u32, exact.fract())
        })
        .collect();
    let given: u32 = quotas.iter().map(|q| q.1).sum();
    // The GPUs rounding left over go to the largest remainders (ties: by name, for
    // determinism).
    quotas.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    let left = total_gpus.saturating_sub(given) as usize;
    for q in quotas.iter_mut().take(left) {
        q.1 += 1;
    }
    let mut quotas: Vec<(Account, u32)> = quotas.into_iter().map(|(a, q, _)| (a, q)).collect();
    quotas.sort();
    quotas
}

/// The core configuration of a built-in simulated policy. perch's quotas come from
/// [`trace_quotas`].
pub fn policy_config(policy: SimPolicy, jobs: &[TraceJob], opts: &SimOptions) -> Config {
    let mut c = match policy {
        SimPolicy::Fifo => Config::fifo(),
        SimPolicy::Backfill => Config::backfill(),
        SimPolicy::Srtf => Config::srtf(),
        SimPolicy::SrtfOnce => Config::srtf_once(),
        SimPolicy::Las => Config::las(),
        SimPolicy::Gittins => Config::gittins(),
        SimPolicy::Themis => Config::themis(),
        SimPolicy::Perch | SimPolicy::PerchIdleReclaim => {
            let quotas = trace_quotas(jobs, opts.cluster.total_gpus());
            let mut c = Config::perch(quotas);
            c.weights = opts.perch_weights;
            c.age_max = opts.perch_age_max;
            c
        }
        SimPolicy::PerchNoQuotas | SimPolicy::PerchLimitsOnly => {
            let mut c = Config::perch(Vec::new());
            c.weights = opts.perch_weights;
            c.age_max = opts.perch_age_max;
            c.predict_from_history = policy != SimPolicy::PerchLimitsOnly;
            c
        }
    };
    c.idle.window = opts.idle_window;
    if policy == SimPolicy::PerchIdleReclaim {
        c.idle.action = IdleAction::Reclaim { requeue: false };
        c.idle.grace = 0;
    }
    debug_assert!(
        c.kind != PolicyKind::Srtf || matches!(policy, SimPolicy::Srtf | SimPolicy::SrtfOnce)
    );
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounding each account's share down left ten small accounts on 8 GPUs with 2 GPUs among
    /// them; the largest remainders get the rest, so the quotas cover the cluster.
    #[test]
    fn trace_quotas_add_up_to_the_cluster() {
        let jobs: Vec<TraceJob> = (0..10)
            .map(|i| TraceJob::new(0, 1000 + i * 10, 1, &format!("a{i}"), "u"))
            .collect();
        let q = trace_quotas(&jobs, 8);
        assert_eq!(q.iter().map(|(_, g)| g).sum::<u32>(), 8, "{q:?}");
        // The two smallest demands get nothing; no account gets two.
        assert!(q.iter().all(|(_, g)| *g <= 1));
        assert_eq!(q.iter().filter(|(_, g)| *g == 0).count(), 2);
        assert!(q.iter().any(|(a, g)| a.0 == "a9" && *g == 1));
        // One dominant account: everything, nobody else starved below their rounding.
        let mut skew = jobs.clone();
        skew[0].duration = 1_000_000;
        let q = trace_quotas(&skew, 64);
        assert_eq!(q.iter().map(|(_, g)| g).sum::<u32>(), 64);
    }

    /// SRTF stops an 8-GPU, 2-hour job at 45 minutes for a 10-minute one: with checkpoints every
    /// 30 minutes it keeps 30 minutes of work and loses 15, then restarts in 60 s; both are
    /// charged as waste, and the long job ends at 45 + 10 + 1 + 90 = 146 minutes.
    #[test]
    fn a_preemption_loses_the_work_since_the_checkpoint_and_the_restart() -> Result<()> {
        let jobs = vec![TraceJob::new(0, 120 * MINUTE, 8, "a", "a"), {
            let mut j = TraceJob::new(45 * MINUTE, 10 * MINUTE, 8, "a", "a");
            j.id = 1;
            j
        }];
        let costly = SimOptions::uniform(1, 8);
        let r = simulate(&jobs, SimPolicy::Srtf, &costly)?.summary;
        assert_eq!(r.preemptions, 1);
        assert!(
            (r.wasted_gpu_h - 8.0 * (15.0 + 1.0) / 60.0).abs() < 1e-9,
            "{r:?}"
        );
        assert!(
            (r.avg_jct_s - (10.0 + 146.0) / 2.0 * 60.0).abs() < 1e-6,
            "{r:?}"
        );
        assert_eq!(r.incomplete, 0);
        let free = SimOptions {
            preemption: PreemptionCost::FREE,
            ..SimOptions::uniform(1, 8)
        };
        let r = simulate(&jobs, SimPolicy::Srtf, &free)?.summary;
        assert_eq!(r.wasted_gpu_h, 0.0);
        assert!(
            (r.avg_jct_s - (10.0 + 130.0) / 2.0 * 60.0).abs() < 1e-6,
            "{r:?}"
        );
        // A job that saves on the signal loses only the restart.
        let on_signal = SimOptions {
            preemption: PreemptionCost {
                checkpoint_every: 0,
                restart_delay: 60 * SECOND,
            },
            ..SimOptions::uniform(1, 8)
        };
        let r = simulate(&jobs, SimPolicy::Srtf, &on_signal)?.summary;
        assert!((r.wasted_gpu_h - 8.0 / 60.0).abs() < 1e-9, "{r:?}");
        Ok(())
    }

    /// The bounded oracle stops a job at most once: a second short job that plain SRTF would
    /// stop the long one for again waits for it instead.
    #[test]
    fn srtf_once_stops_each_job_at_most_once() -> Result<()> {
        let at = |i: u64, submit: Millis, duration: Millis| {
            let mut j = TraceJob::new(submit, duration, 8, "a", "a");
            j.id = i;
            j
        };
        let jobs = vec![
            at(0, 0, 120 * MINUTE),
            at(1, 45 * MINUTE, 10 * MINUTE),
            at(2, 75 * MINUTE, 10 * MINUTE),
        ];
        let opts = SimOptions::uniform(1, 8);
        let plain = simulate(&jobs, SimPolicy::Srtf, &opts)?.summary;
        let once = simulate(&jobs, SimPolicy::SrtfOnce, &opts)?.summary;
        assert_eq!((plain.preemptions, once.preemptions), (2, 1));
        assert_eq!((plain.incomplete, once.incomplete), (0, 0));
        // The long job was stopped once, so the second short one waits for its end.
        let third = simulate(&jobs, SimPolicy::SrtfOnce, &opts)?.jobs[2];
        assert!(third.first_start > Some(120 * MINUTE), "{third:?}");
        Ok(())
    }

    /// A job that may not be preempted is not, whatever SRTF would gain.
    #[test]
    fn a_job_that_is_not_preemptible_runs_to_its_end() -> Result<()> {
        let mut long = TraceJob::new(0, 120 * MINUTE, 8, "a", "a");
        long.preemptible = false;
        let mut short = TraceJob::new(45 * MINUTE, 10 * MINUTE, 8, "a", "a");
        short.id = 1;
        let r = simulate(&[long, short], SimPolicy::Srtf, &SimOptions::uniform(1, 8))?.summary;
        assert_eq!((r.preemptions, r.wasted_gpu_h), (0, 0.0));
        Ok(())
    }

    /// Fractions share GPUs: four half-GPU jobs run at once on two GPUs, and the GPU-time
    /// booked is their fractions, not whole GPUs.
    #[test]
    fn fractions_share_gpus_and_are_booked_as_fractions() -> Result<()> {
        let jobs: Vec<TraceJob> = (0..4)
            .map(|i| {
                let mut j = TraceJob::new(0, 60 * MINUTE, 1, "a", "a");
                j.id = i;
                j.fraction = Some(50);
                j
            })
            .collect();
        let r = simulate(&jobs, SimPolicy::Backfill, &SimOptions::uniform(1, 2))?.summary;
        assert_eq!((r.finished, r.incomplete), (4, 0));
        assert!(
            (r.avg_jct_s - 3600.0).abs() < 1e-6,
            "all four at once: {r:?}"
        );
        assert!((r.alloc_pct - 100.0).abs() < 1e-9, "{r:?}");
        // Memory: a share asking for more than a GPU has never starts, and is refused up front.
        let mut big = jobs[0].clone();
        big.gpu_memory_mb = Some(100 * 1024);
        let err = simulate(&[big], SimPolicy::Backfill, &SimOptions::uniform(1, 2));
        assert!(err.is_err_and(|e| e.to_string().contains("MiB")));
        Ok(())
    }
}
