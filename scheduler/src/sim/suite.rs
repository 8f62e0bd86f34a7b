//! The scorecard: every policy on a matrix of traces, cluster sizes and seeds, one table, and
//! the targets below checked on each case where queues form.
//!
//! Targets for perch (durations unknown, preemption cost on), per case, scored for perch as a
//! server runs it by default (`perch-noquota`) and with quotas derived from the trace
//! (`perch`, whose quota reclaim preempts for guarantees):
//! average JCT at most 1.25x the oracle SRTF's and at most backfill's; p99 JCT at most
//! backfill's; allocation no lower than backfill's (to the printed tenth of a point);
//! preemptions at most [`PREEMPTIONS_PER_JOB`] per job. A case where backfill's average wait
//! is under a minute has no queue to speak of and is shown but not scored.
//!
//! Beside the first target, each policy's average JCT is also set against `srtf-once`, the
//! oracle that preempts each job at most once: plain SRTF preempts about once per job where
//! gangs queue, twice the bound perch is held to, and this is the oracle within it.

use super::cluster::SimCluster;
use super::engine::{SimOptions, SimPolicy, simulate};
use super::metrics::Summary;
use super::synth::{MIXED_CLUSTER, SynthKind, generate};
use super::trace::{LimitModel, Trace, TraceJob, parse};
use crate::error::{Error, Result};

/// The preemption bound perch is held to: preemptions per job of the trace, on average.
pub const PREEMPTIONS_PER_JOB: f64 = 0.5;

/// The policies a scorecard compares (the idle-reclaim variant answers another question).
pub const POLICIES: [SimPolicy; 10] = [
    SimPolicy::Fifo,
    SimPolicy::Backfill,
    SimPolicy::Srtf,
    SimPolicy::SrtfOnce,
    SimPolicy::PerchNoQuotas,
    SimPolicy::Perch,
    SimPolicy::Las,
    SimPolicy::Gittins,
    SimPolicy::Themis,
    SimPolicy::PerchLimitsOnly,
];

/// The policies the targets are checked for, case by case.
pub const SCORED: [SimPolicy; 2] = [SimPolicy::PerchNoQuotas, SimPolicy::Perch];

/// The policies whose standing on the targets the closing table compares: perch's two rows,
/// the duration-free anchors (Tiresias' LAS, and 2D-Gittins over the service jobs used), Themis'
/// finish-time fairness on perch's expected runs, perch without its history prediction (the
/// declared limits alone) and the oracle itself, unbounded and preempting each job at most
/// once, which shows what the targets ask of a policy that knows every duration.
pub const COMPARED: [SimPolicy; 8] = [
    SimPolicy::PerchNoQuotas,
    SimPolicy::Perch,
    SimPolicy::Las,
    SimPolicy::Gittins,
    SimPolicy::Themis,
    SimPolicy::PerchLimitsOnly,
    SimPolicy::Srtf,
    SimPolicy::SrtfOnce,
];

/// The names of the targets, in [`CaseResult::targets`] order.
pub const TARGETS: [&str; 5] = [
    "JCT<=1.25xSRTF",
    "JCT<=BF",
    "p99<=BF",
    "alloc>=BF",
    "preempt",
];

/// How one policy fares over the cases where queues form.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tally {
    /// Cases where queues form.
    pub cases: usize,
    /// Of those, how many meet each target, in [`TARGETS`] order.
    pub met: [usize; 5],
    /// Of those, how many have an average JCT at most 1.25x `srtf-once`'s.
    pub within_srtf_once: usize,
    /// Geometric mean of its average JCT over SRTF's.
    pub jct_over_srtf: f64,
    /// Geometric mean of its average JCT over `srtf-once`'s.
    pub jct_over_srtf_once: f64,
    /// Geometric mean of its p99 JCT over backfill's.
    pub p99_over_backfill: f64,
    /// Of those cases, how many it meets every target in at once.
    pub all_met: usize,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 1.0 }
}

/// `p`'s tally over `results`.
pub fn tally(results: &[CaseResult], p: SimPolicy) -> Tally {
    let mut t = Tally {
        cases: 0,
        met: [0; 5],
        within_srtf_once: 0,
        jct_over_srtf: 1.0,
        jct_over_srtf_once: 1.0,
        p99_over_backfill: 1.0,
        all_met: 0,
    };
    let (mut log_srtf, mut log_once, mut log_p99) = (0.0, 0.0, 0.0);
    for r in results.iter().filter(|r| r.queued()) {
        let (b, s, x) = (r.get(SimPolicy::Backfill), r.get(SimPolicy::Srtf), r.get(p));
        let once = r.get(SimPolicy::SrtfOnce);
        t.cases += 1;
        log_srtf += ratio(x.avg_jct_s, s.avg_jct_s).ln();
        log_once += ratio(x.avg_jct_s, once.avg_jct_s).ln();
        t.within_srtf_once += usize::from(x.avg_jct_s <= 1.25 * once.avg_jct_s);
        log_p99 += ratio(x.p99_jct_s, b.p99_jct_s).ln();
        let targets = r.targets(p);
        for (i, (_, ok)) in targets.into_iter().enumerate() {
            t.met[i] += usize::from(ok);
        }
        t.all_met += usize::from(r.meets_all(p));
    }
    if t.cases > 0 {
        t.jct_over_srtf = (log_srtf / t.cases as f64).exp();
        t.jct_over_srtf_once = (log_once / t.cases as f64).exp();
        t.p99_over_backfill = (log_p99 / t.cases as f64).exp();
    }
    t
}

/// One line per policy of [`COMPARED`]: how many cases where queues form meet each target.
pub fn comparison(results: &[CaseResult]) -> String {
    let mut out = format!(
        "every policy against the targets, of the cases where queues form:
{:<14} {:>5}",
        "policy", "cases"
    );
    for name in TARGETS {
        out += &format!(" {name:>14}");
    }
    out += "  JCT/SRTF  p99/BF JCT<=1.25xSRTF1 JCT/SRTF1   all\n";
    for p in COMPARED {
        let t = tally(results, p);
        out += &format!("{:<14} {:>5}", p.name(), t.cases);
        for n in t.met {
            out += &format!(" {n:>14}");
        }
        out += &format!(
            "  {:>8.3}  {:>6.3} {:>14} {:>9.3} {:>5}\n",
            t.jct_over_srtf,
            t.p99_over_backfill,
            t.within_srtf_once,
            t.jct_over_srtf_once,
            t.all_met
        );
    }
    let queued = results.iter().filter(|r| r.queued()).count();
    out += &format!(
        "every target at once: met by some policy of the harness (the oracles and backfill \
         included) in {} of {queued} cases\n",
        reachable(results)
    );
    out += "(JCT/SRTF, p99/BF: geometric means of the average JCT over SRTF's and the p99 JCT over \
            backfill's; SRTF1: srtf-once, the oracle preempting each job at most once; all: cases \
            where the policy meets every target at once; srtf knows every duration, las none, perch the declared time limits scaled by the part of its \
            limits each user's recent jobs ran, perch-limits the limits alone)\n";
    out
}

/// Of the cases where queues form, how many some policy of [`POLICIES`] (the oracles and
/// backfill included) meets every target in at once: what the targets ask is reachable there,
/// by one policy or another.
pub fn reachable(results: &[CaseResult]) -> usize {
    results
        .iter()
        .filter(|r| r.queued() && !r.all_met_by().is_empty())
        .count()
}

/// One cell of the matrix: a trace on a cluster under a seed.
#[derive(Clone, Debug)]
pub struct Case {
    /// The trace's name.
    pub trace: String,
    /// Its jobs.
    pub jobs: Vec<TraceJob>,
    /// The options (cluster, seed, preemption cost).
    pub opts: SimOptions,
}

/// A case's replays, one summary per policy of [`POLICIES`].
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// The trace's name.
    pub trace: String,
    /// Its seed.
    pub seed: u64,
    /// How its users declared time limits.
    pub limits: LimitModel,
    /// Jobs.
    pub jobs: usize,
    /// Per policy, in [`POLICIES`] order.
    pub rows: Vec<Summary>,
}

impl CaseResult {
    /// The summary of policy `p` (one of [`POLICIES`]).
    pub fn get(&self, p: SimPolicy) -> &Summary {
        let i = POLICIES.iter().position(|x| *x == p).unwrap_or(0);
        &self.rows[i]
    }

    /// Whether queues formed (backfill's average wait is a minute or more).
    pub fn queued(&self) -> bool {
        self.get(SimPolicy::Backfill).avg_wait_s >= 60.0
    }

    /// Whether `p` meets every target at once in this case.
    pub fn meets_all(&self, p: SimPolicy) -> bool {
        self.targets(p).iter().all(|(_, ok)| *ok)
    }

    /// The policies of [`POLICIES`] that meet every target at once in this case.
    pub fn all_met_by(&self) -> Vec<SimPolicy> {
        POLICIES
            .into_iter()
            .filter(|&p| self.meets_all(p))
            .collect()
    }

    /// Each target and whether `scored` meets it, in table order.
    pub fn targets(&self, scored: SimPolicy) -> [(&'static str, bool); 5] {
        let (p, b, s) = (
            self.get(scored),
            self.get(SimPolicy::Backfill),
            self.get(SimPolicy::Srtf),
        );
        let tenth = |x: f64| (x * 10.0).round();
        let met = [
            p.avg_jct_s <= 1.25 * s.avg_jct_s,
            p.avg_jct_s <= b.avg_jct_s,
            p.p99_jct_s <= b.p99_jct_s,
            tenth(p.alloc_pct) >= tenth(b.alloc_pct),
            p.preemptions as f64 <= PREEMPTIONS_PER_JOB * self.jobs as f64,
        ];
        std::array::from_fn(|i| (TARGETS[i], met[i]))
    }
}

/// The built-in matrix. `philly`: the Philly trace when at hand (replayed at 384, 512 and 768
/// GPUs, seeds 1 and 2); the synthetic kinds at seeds 1 to 3 (`quick`: seed 1, and no Philly);
/// all with [`LimitModel::Uniform`] time limits, then again with [`LimitModel::Habits`] (Philly
/// at 512 GPUs, seed 1, only: a Philly replay of every policy takes half a minute), the trace's
/// name marked `/h`.
pub fn builtin(philly: Option<&Trace>, quick: bool) -> Result<Vec<Case>> {
    let seeds: &[u64] = if quick { &[1] } else { &[1, 2, 3] };
    let mut cases = Vec::new();
    let uniform = |nodes: u32, seed: u64| SimOptions {
        seed,
        ..SimOptions::uniform(nodes, 8)
    };
    if let (Some(t), false) = (philly, quick) {
        for nodes in [48, 64, 96] {
            for seed in [1, 2] {
                cases.push(Case {
                    trace: "philly".into(),
                    jobs: t.jobs.clone(),
                    opts: uniform(nodes, seed),
                });
            }
        }
    }
    let (mixed, _) = SimCluster::parse("mixed-cluster.csv", MIXED_CLUSTER)?;
    for kind in SynthKind::ALL {
        for &seed in seeds {
            let jobs = parse(kind.name(), &generate(kind, seed), None)?.jobs;
            let clusters: Vec<SimOptions> = match kind {
                SynthKind::Small => vec![uniform(1, seed), uniform(2, seed)],
                SynthKind::Fractional => vec![SimOptions {
                    cluster: mixed.clone(),
                    seed,
                    ..SimOptions::default()
                }],
                SynthKind::Gangs => vec![uniform(12, seed), uniform(16, seed)],
                SynthKind::HeavyTail => vec![uniform(6, seed), uniform(8, seed)],
            };
            for opts in clusters {
                cases.push(Case {
                    trace: kind.name().into(),
                    jobs: jobs.clone(),
                    opts,
                });
            }
        }
    }
    let habits: Vec<Case> = cases
        .iter()
        .filter(|c| c.trace != "philly" || (c.opts.cluster.total_gpus() == 512 && c.opts.seed == 1))
        .map(|c| Case {
            trace: format!("{}/h", c.trace),
            jobs: c.jobs.clone(),
            opts: SimOptions {
                limits: LimitModel::Habits,
                ..c.opts.clone()
            },
        })
        .collect();
    cases.extend(habits);
    Ok(cases)
}

/// Replays one case under every policy of [`POLICIES`].
pub fn run_case(case: &Case) -> Result<CaseResult> {
    let rows = POLICIES
        .iter()
        .map(|&p| simulate(&case.jobs, p, &case.opts).map(|r| r.summary))
        .collect::<Result<Vec<_>>>()?;
    // The averages count finished jobs only: a policy that never starts (or never ends) some
    // jobs would look better for it, so the scorecard refuses to score it.
    if let Some(s) = rows.iter().find(|s| s.unfinished > 0) {
        return Err(Error::SimConfig {
            option: "suite",
            message: format!(
                "{} seed {} on {} GPUs: {} left {} of {} jobs unfinished (never started or \
                 never ended); its averages would count only the others",
                case.trace,
                case.opts.seed,
                s.gpus,
                s.policy,
                s.unfinished,
                case.jobs.len()
            ),
        });
    }
    Ok(CaseResult {
        trace: case.trace.clone(),
        seed: case.opts.seed,
        limits: case.opts.limits,
        jobs: case.jobs.len(),
        rows,
    })
}

/// For each way of declaring time limits in `results`: the scorecard of every policy of
/// [`SCORED`], one after the other, then the [`comparison`].
pub fn scorecards(results: &[CaseResult]) -> String {
    let mut out = Vec::new();
    for (model, what) in [
        (
            LimitModel::Uniform,
            "each job's time limit its run times a factor uniform in [1.5, 5]",
        ),
        (
            LimitModel::Habits,
            "users' habits: 30% of users always declare 7 days, the others round up to 15 min, \
             30 min, 1, 2, 4, 8, 12, 24, 48 or 72 h",
        ),
    ] {
        let part: Vec<CaseResult> = results
            .iter()
            .filter(|r| r.limits == model)
            .cloned()
            .collect();
        if part.is_empty() {
            continue;
        }
        out.push(format!("== time limits: {} ({what})\n", model.name()));
        out.extend(SCORED.iter().map(|&p| scorecard(&part, p)));
        out.push(comparison(&part));
    }
    out.join("\n")
}

/// The scorecard of `scored`: one line per case, then how many cases where queues form meet
/// each target.
pub fn scorecard(results: &[CaseResult], scored: SimPolicy) -> String {
    let mut out = format!("{}:\n", scored.name());
    out += &format!(
        "{:<14} {:>5} {:>4} {:>5} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>7} {:>7} {:>7} {:>6} {:>7} {:>5}  {}\n",
        "trace",
        "GPUs",
        "seed",
        "jobs",
        "fifo JCT",
        "bf JCT",
        "srtf JCT",
        "JCT",
        "p/srtf",
        "p/srtf1",
        "p/bf",
        "p99 p/bf",
        "alloc-bf",
        "pre/job",
        "waste%",
        "bf Jain",
        "Jain",
        "targets missed"
    );
    for r in results {
        let (f, b, s, p) = (
            r.get(SimPolicy::Fifo),
            r.get(SimPolicy::Backfill),
            r.get(SimPolicy::Srtf),
            r.get(scored),
        );
        let allocated_h = p.alloc_pct / 100.0 * f64::from(p.gpus) * p.makespan_s / 3600.0;
        let missed = if r.queued() {
            let names: Vec<&str> = r
                .targets(scored)
                .into_iter()
                .filter(|(_, ok)| !ok)
                .map(|(name, _)| name)
                .collect();
            let by: Vec<&str> = r.all_met_by().into_iter().map(SimPolicy::name).collect();
            match (names.is_empty(), by.is_empty()) {
                (true, _) => "none".to_string(),
                (false, true) => format!("{} (no policy meets all)", names.join(" ")),
                (false, false) => format!("{} (all met by {})", names.join(" "), by.join(", ")),
            }
        } else {
            "(no queue: not scored)".to_string()
        };
        out += &format!(
            "{:<14} {:>5} {:>4} {:>5} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>7.2} {:>7.2} {:>6.2} {:>8.2} {:>+7.1} {:>7.2} {:>6.1} {:>7.3} {:>5.3}  {}\n",
            r.trace,
            p.gpus,
            r.seed,
            r.jobs,
            f.avg_jct_s,
            b.avg_jct_s,
            s.avg_jct_s,
            p.avg_jct_s,
            ratio(p.avg_jct_s, s.avg_jct_s),
            ratio(p.avg_jct_s, r.get(SimPolicy::SrtfOnce).avg_jct_s),
            ratio(p.avg_jct_s, b.avg_jct_s),
            ratio(p.p99_jct_s, b.p99_jct_s),
            p.alloc_pct - b.alloc_pct,
            p.preemptions as f64 / r.jobs.max(1) as f64,
            if allocated_h > 0.0 {
                100.0 * p.wasted_gpu_h / allocated_h
            } else {
                0.0
            },
            b.jain,
            p.jain,
            missed
        );
    }
    let t = tally(results, scored);
    let count = t.cases;
    out += &format!(
        "\n{} meets, of {count} cases where queues form:",
        scored.name()
    );
    for (name, n) in TARGETS.iter().zip(t.met) {
        out += &format!(" {name} {n}/{count};");
    }
    out.pop();
    if count > 0 {
        out += &format!(
            "\ngeometric means over those cases: average JCT {:.3}x SRTF's, p99 JCT {:.3}x backfill's\n\
             against srtf-once (the oracle preempting each job at most once): average JCT within \
             1.25x its {}/{count}, {:.3}x its in geometric mean",
            t.jct_over_srtf, t.p99_over_backfill, t.within_srtf_once, t.jct_over_srtf_once
        );
    }
    out += &format!(
        "\n(JCT in seconds, the last one {0}'s; p/srtf, p/bf: {0}'s average JCT over SRTF's and \
         backfill's; p/srtf1: over srtf-once's; alloc-bf: its allocation minus backfill's, points; pre/job: its preemptions \
         per job (bound {PREEMPTIONS_PER_JOB}); waste%: its GPU-time lost to preemption, of its \
         allocation; Jain: fairness across accounts of each one's mean run time / JCT, 1 = equal; \
         after the targets missed, the policies of the harness that meet every target in that \
         case, if any)\n",
        scored.name()
    );
    out
}
