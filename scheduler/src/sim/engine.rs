//! The discrete-event loop: trace submissions, job exits and utilization changes go into the
//! core as events; the core's actions come back as scheduled exits and utilization changes.

use super::metrics::{Recorder, Sample, Summary};
use super::trace::{TraceJob, user_time_limit};
use crate::error::{Error, Result};
use crate::ids::{Account, JobId, MINUTE, Millis, Time, User};
use crate::job::{EndState, JobSpec, Qos, Shape};
use crate::policy::{Config, IdleAction, Weights};
use crate::scheduler::{Action, Event, Scheduler};
use crate::{Cluster, PolicyKind};
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
    /// perch default (idle GPUs reported, not reclaimed).
    Perch,
    /// perch default with idle reclaim: jobs idle for the window while others wait are ended.
    PerchIdleReclaim,
}

impl SimPolicy {
    /// Every policy, in table order.
    pub const ALL: [SimPolicy; 5] = [
        SimPolicy::Fifo,
        SimPolicy::Backfill,
        SimPolicy::Srtf,
        SimPolicy::Perch,
        SimPolicy::PerchIdleReclaim,
    ];

    /// Name on the command line and in tables.
    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Fifo => "fifo",
            SimPolicy::Backfill => "backfill",
            SimPolicy::Srtf => "srtf",
            SimPolicy::Perch => "perch",
            SimPolicy::PerchIdleReclaim => "perch+idle-reclaim",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<SimPolicy> {
        SimPolicy::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// Cluster shape and replay knobs.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// Nodes.
    pub nodes: u32,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Nodes per rack label.
    pub nodes_per_rack: u32,
    /// Seed of every random draw (time-limit factors, idle-tail choice).
    pub seed: u64,
    /// Time limit = duration x a factor uniform in this range.
    pub limit_factor: (f64, f64),
    /// Idle window before an idle job is acted on.
    pub idle_window: Millis,
    /// perch's priority weights and the wait at which the age factor tops out.
    pub perch_weights: Weights,
    /// See `perch_weights`.
    pub perch_age_max: Millis,
}

impl Default for SimOptions {
    fn default() -> Self {
        let perch = Config::perch(Vec::new());
        SimOptions {
            nodes: 64,
            gpus_per_node: 8,
            nodes_per_rack: 8,
            seed: 1,
            limit_factor: (1.5, 5.0),
            idle_window: 30 * MINUTE,
            perch_weights: perch.weights,
            perch_age_max: perch.age_max,
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
    /// Work done before the current run.
    done: Millis,
    start: Option<Time>,
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
    if opts.nodes == 0 || opts.gpus_per_node == 0 || opts.gpus_per_node > crate::MAX_GPUS_PER_NODE {
        return Err(Error::SimConfig {
            option: "nodes/gpus-per-node",
            message: "need at least one node of 1 to 64 GPUs".into(),
        });
    }
    if !(opts.limit_factor.0 >= 1.0 && opts.limit_factor.1 >= opts.limit_factor.0) {
        return Err(Error::SimConfig {
            option: "limit_factor",
            message: "need 1 <= low <= high".into(),
        });
    }
    Ok(())
}

/// Refuses a trace with jobs the cluster can never start: the replay would run to its end
/// with them pending and report the rest as if all were well.
fn check_fits(jobs: &[TraceJob], opts: &SimOptions) -> Result<()> {
    let too_big: Vec<&TraceJob> = jobs
        .iter()
        .filter(|j| Shape::fewest_nodes(j.gpus, opts.gpus_per_node).nodes > opts.nodes)
        .collect();
    let Some(first) = too_big.first() else {
        return Ok(());
    };
    let largest = too_big.iter().map(|j| j.gpus).max().unwrap_or(first.gpus);
    Err(Error::SimConfig {
        option: "nodes",
        message: format!(
            "{} job(s) of the trace ask for more GPUs than the cluster has ({} nodes x {} = {} GPUs), \
             so they could never start: the first is job {} (the trace's {}th by submission) with {} \
             GPUs, the largest asks for {}; give at least {} nodes, or leave them out of the trace",
            too_big.len(),
            opts.nodes,
            opts.gpus_per_node,
            opts.nodes * opts.gpus_per_node,
            first.id,
            first.id + 1,
            first.gpus,
            largest,
            largest.div_ceil(opts.gpus_per_node),
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
    let cluster = Cluster::uniform(opts.nodes, opts.gpus_per_node, "sim", opts.nodes_per_rack)?;
    let total_gpus = opts.nodes * opts.gpus_per_node;
    let mut sched = Scheduler::new(cluster, config);
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
                Ev::Submit { job } => actions
                    .extend(sched.handle(now, Event::Submit(spec(&jobs[job], oracle, opts)))?),
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
                    let pct = jobs[job].utilization[segment].1;
                    rec.set_busy(now, &mut runs[job].busy, pct > 0.0, jobs[job].gpus);
                    actions.extend(sched.handle(
                        now,
                        Event::JobUtilization {
                            job: JobId(job as u64),
                            percent: pct,
                        },
                    )?);
                    if let Some(&(off, _)) = jobs[job].utilization.get(segment + 1) {
                        let at = runs[job].start.unwrap_or(now) + off - runs[job].done;
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
            apply(now, a, jobs, &mut runs, &mut heap, &mut rec);
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
    Ok(SimReport {
        summary,
        series: rec.series,
    })
}

fn apply(
    now: Time,
    a: Action,
    jobs: &[TraceJob],
    runs: &mut [Run],
    heap: &mut BinaryHeap<Reverse<(Time, Ev)>>,
    rec: &mut Recorder,
) {
    match a {
        Action::Start { job, .. } => {
            let i = job.0 as usize;
            let r = &mut runs[i];
            r.start = Some(now);
            r.generation += 1;
            let t = &jobs[i];
            rec.start(now, i, t.gpus);
            heap.push(Reverse((
                now + (t.duration - r.done).max(0),
                Ev::Exit {
                    job: i,
                    generation: r.generation,
                },
            )));
            // The segment in force at `done`, and the next boundary.
            let seg = t.utilization.iter().rposition(|&(off, _)| off <= r.done);
            match seg {
                Some(s) => heap.push(Reverse((
                    now,
                    Ev::Util {
                        job: i,
                        generation: r.generation,
                        segment: s,
                    },
                ))),
                None => rec.set_busy(now, &mut r.busy, true, t.gpus),
            }
        }
        Action::Preempt {
            job,
            requeued,
            reason,
        } => {
            let i = job.0 as usize;
            stop(now, i, jobs, runs, rec);
            rec.preempted(matches!(reason, crate::PreemptReason::Idle));
            if !requeued {
                rec.end(now, i);
            }
        }
        Action::Requeue { job, .. } => stop(now, job.0 as usize, jobs, runs, rec),
        Action::End { job, state } => {
            let i = job.0 as usize;
            if runs[i].start.is_some() {
                stop(now, i, jobs, runs, rec);
            }
            if state != EndState::Cancelled {
                rec.end(now, i);
            }
        }
        Action::IdleReport { .. } => rec.idle_report(),
    }
}

fn stop(now: Time, i: usize, jobs: &[TraceJob], runs: &mut [Run], rec: &mut Recorder) {
    let r = &mut runs[i];
    if let Some(s) = r.start.take() {
        r.done += now - s;
        r.generation += 1;
        rec.set_busy(now, &mut r.busy, false, jobs[i].gpus);
        rec.stop(now, jobs[i].gpus);
    }
}

fn spec(t: &TraceJob, oracle: bool, opts: &SimOptions) -> JobSpec {
    JobSpec {
        id: JobId(t.id),
        user: User(t.user.clone()),
        account: Account(t.account.clone()),
        shape: Shape::fewest_nodes(t.gpus, opts.gpus_per_node),
        gpu_model: None,
        time_limit: user_time_limit(t, opts.seed, opts.limit_factor.0, opts.limit_factor.1),
        qos: Qos::Normal,
        preemptible: true,
        max_requeues: 3,
        submit: t.submit,
        oracle_duration: oracle.then_some(t.duration),
        share: None,
    }
}

/// The core configuration of a built-in simulated policy. perch's quotas: each account gets
/// the part of the cluster equal to its part of the trace's GPU-time (rounded down).
pub fn policy_config(policy: SimPolicy, jobs: &[TraceJob], opts: &SimOptions) -> Config {
    let total_gpus = opts.nodes * opts.gpus_per_node;
    let mut c = match policy {
        SimPolicy::Fifo => Config::fifo(),
        SimPolicy::Backfill => Config::backfill(),
        SimPolicy::Srtf => Config::srtf(),
        SimPolicy::Perch | SimPolicy::PerchIdleReclaim => {
            let mut demand: HashMap<&str, f64> = HashMap::new();
            for j in jobs {
                *demand.entry(&j.account).or_default() += j.duration as f64 * j.gpus as f64;
            }
            let total: f64 = demand.values().sum();
            let mut quotas: Vec<(Account, u32)> = demand
                .into_iter()
                .map(|(a, d)| {
                    (
                        Account(a.to_string()),
                        if total > 0.0 {
                            (d / total * total_gpus as f64).floor() as u32
                        } else {
                            0
                        },
                    )
                })
                .collect();
            quotas.sort();
            let mut c = Config::perch(quotas);
            c.weights = opts.perch_weights;
            c.age_max = opts.perch_age_max;
            c
        }
    };
    c.idle.window = opts.idle_window;
    if policy == SimPolicy::PerchIdleReclaim {
        c.idle.action = IdleAction::Reclaim { requeue: false };
        c.idle.grace = 0;
    }
    debug_assert!(c.kind != PolicyKind::Srtf || policy == SimPolicy::Srtf);
    c
}
