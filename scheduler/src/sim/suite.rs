//! The scorecard: every policy on a matrix of traces, cluster sizes and seeds, one table, and
//! the targets below checked on each case where queues form.
//!
//! Targets for perch as a server runs it (`perch-noquota`: durations unknown, preemption cost
//! on), per case where queues form (backfill's average wait a minute or more):
//!
//! 1. average JCT no worse than backfill's;
//! 2. average JCT within [`JCT_OVER_SRTF_ONCE`]x `srtf-once`'s (the oracle that knows every
//!    duration, held to the same preemption bound: each job preempted at most once);
//! 3. p99 JCT within [`P99_OVER_BACKFILL`]x backfill's;
//! 4. allocation while jobs wait (the share of GPUs allocated while some job waits: GPUs left
//!    idle with work queued are what a scheduler wastes) no more than [`ALLOC_BELOW_BACKFILL`]
//!    points below backfill's. Allocation over the whole makespan is printed too (`alloc-bf`) but
//!    not held: it rewards starting long jobs first, so that the last hours are full, which is
//!    the opposite of short average JCT. On an overloaded trace the oracle `srtf-once` is 15 to
//!    20 points below backfill on it while within 2 points on allocation while jobs wait;
//! 5. at most [`PREEMPTIONS_PER_JOB`] preemptions per job;
//! 6. not dominated: no duration-free policy of the harness ([`DURATION_FREE`]) better on
//!    average JCT, p99 and allocation all at once by more than 2%, 2% and 1 point.
//!
//! A case where no policy of the harness, the oracles included, meets 1 to 5 together asks
//! more than any policy gives there: it is reported as such and not scored. Across the scored
//! cases, the geometric mean of the average JCT over SRTF's is held to at most
//! [`GEOMEAN_JCT_OVER_SRTF`]x.
//!
//! Seeds come in two sets: [`TUNING_SEEDS`], which policy changes are measured on while they are
//! made, and [`HELD_OUT_SEEDS`], which are only ever scored: their figures are recorded with each
//! change and never used to choose one, so a policy tuned to the first set is seen on traces it
//! was not tuned on. The scorecard prints the two sets apart.

use super::cluster::SimCluster;
use super::engine::{SimOptions, SimPolicy, simulate};
use super::metrics::Summary;
use super::synth::{MIXED_CLUSTER, SynthKind, generate};
use super::trace::{LimitModel, Trace, TraceJob, parse};
use crate::error::{Error, Result};

/// Target 5: preemptions per job of the trace, on average.
pub const PREEMPTIONS_PER_JOB: f64 = 0.5;
/// Target 2: average JCT at most this times `srtf-once`'s.
pub const JCT_OVER_SRTF_ONCE: f64 = 1.25;
/// Target 3: p99 JCT at most this times backfill's.
pub const P99_OVER_BACKFILL: f64 = 1.05;
/// Target 4: allocation at most this many points below backfill's.
pub const ALLOC_BELOW_BACKFILL: f64 = 2.0;
/// Target 6: a duration-free policy dominates when it is better on average JCT and p99 by more
/// than these fractions and on allocation by more than these points, all at once.
pub const DOMINANCE: (f64, f64, f64) = (0.02, 0.02, 1.0);
/// The summary target: geometric mean over the scored cases of average JCT over SRTF's.
pub const GEOMEAN_JCT_OVER_SRTF: f64 = 1.10;

/// Seeds policy changes are tuned on.
pub const TUNING_SEEDS: [u64; 3] = [1, 2, 3];
/// Seeds that are only ever scored (see the module's documentation).
pub const HELD_OUT_SEEDS: [u64; 3] = [1001, 1002, 1003];

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

/// The policies with a scorecard of their own, case by case: perch as a server runs it by
/// default (no quotas), which the targets are for, and perch with quotas derived from the
/// trace (whose quota reclaim preempts for guarantees).
pub const SCORED: [SimPolicy; 2] = [SimPolicy::PerchNoQuotas, SimPolicy::Perch];

/// The policy the targets and the committed figures are for: the server's default.
pub const TARGETED: SimPolicy = SimPolicy::PerchNoQuotas;

/// The duration-free policies of the harness target 6 compares with: what a scheduler that
/// knows no durations can do.
pub const DURATION_FREE: [SimPolicy; 4] = [
    SimPolicy::Backfill,
    SimPolicy::Las,
    SimPolicy::Gittins,
    SimPolicy::Themis,
];

/// The policies whose standing on the targets the closing table compares: perch's two rows,
/// the duration-free anchors (Tiresias' LAS, and 2D-Gittins over the service jobs used), Themis'
/// finish-time fairness on perch's expected runs, perch without its history prediction (the
/// declared limits alone), backfill, and the oracles, unbounded and preempting each job at most
/// once, which show what the targets ask of a policy that knows every duration.
pub const COMPARED: [SimPolicy; 9] = [
    SimPolicy::PerchNoQuotas,
    SimPolicy::Perch,
    SimPolicy::Las,
    SimPolicy::Gittins,
    SimPolicy::Themis,
    SimPolicy::PerchLimitsOnly,
    SimPolicy::Backfill,
    SimPolicy::Srtf,
    SimPolicy::SrtfOnce,
];

/// The names of the targets, in [`CaseResult::targets`] order.
pub const TARGETS: [&str; 6] = [
    "JCT<=BF",
    "JCT<=1.25xSRTF1",
    "p99<=1.05xBF",
    "allocQ>=BF-2",
    "preempt",
    "undominated",
];

/// Which seeds a case's trace was generated from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeedSet {
    /// [`TUNING_SEEDS`] (and the Philly trace, which has been looked at from the start).
    Tuning,
    /// [`HELD_OUT_SEEDS`].
    HeldOut,
}

impl SeedSet {
    /// Name in the figures file.
    pub fn name(self) -> &'static str {
        match self {
            SeedSet::Tuning => "tuning",
            SeedSet::HeldOut => "held-out",
        }
    }
}

/// How one policy fares over the cases where queues form.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tally {
    /// Cases where queues form.
    pub cases: usize,
    /// Of those, the scored ones: some policy of the harness meets targets 1 to 5 together.
    pub scored: usize,
    /// Of the scored cases, how many meet each target, in [`TARGETS`] order.
    pub met: [usize; 6],
    /// Of the scored cases, how many it meets every target in at once.
    pub all_met: usize,
    /// Geometric mean over the scored cases of its average JCT over SRTF's.
    pub jct_over_srtf: f64,
    /// The same over `srtf-once`'s.
    pub jct_over_srtf_once: f64,
    /// The same of its p99 JCT over backfill's.
    pub p99_over_backfill: f64,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 1.0 }
}

/// `p`'s tally over `results`.
pub fn tally(results: &[CaseResult], p: SimPolicy) -> Tally {
    let mut t = Tally {
        cases: results.iter().filter(|r| r.queued()).count(),
        scored: 0,
        met: [0; 6],
        all_met: 0,
        jct_over_srtf: 1.0,
        jct_over_srtf_once: 1.0,
        p99_over_backfill: 1.0,
    };
    let (mut log_srtf, mut log_once, mut log_p99) = (0.0, 0.0, 0.0);
    for r in results.iter().filter(|r| r.scored()) {
        let (b, s, x) = (r.get(SimPolicy::Backfill), r.get(SimPolicy::Srtf), r.get(p));
        t.scored += 1;
        log_srtf += ratio(x.avg_jct_s, s.avg_jct_s).ln();
        log_once += ratio(x.avg_jct_s, r.get(SimPolicy::SrtfOnce).avg_jct_s).ln();
        log_p99 += ratio(x.p99_jct_s, b.p99_jct_s).ln();
        for (i, (_, ok)) in r.targets(p).into_iter().enumerate() {
            t.met[i] += usize::from(ok);
        }
        t.all_met += usize::from(r.meets_all(p));
    }
    if t.scored > 0 {
        let n = t.scored as f64;
        t.jct_over_srtf = (log_srtf / n).exp();
        t.jct_over_srtf_once = (log_once / n).exp();
        t.p99_over_backfill = (log_p99 / n).exp();
    }
    t
}

/// One line per policy of [`COMPARED`]: of the scored cases, how many meet each target.
pub fn comparison(results: &[CaseResult]) -> String {
    let mut out = format!(
        "every policy against the targets, of the scored cases:\n{:<14} {:>6}",
        "policy", "scored"
    );
    for name in TARGETS {
        out += &format!(" {name:>15}");
    }
    out += "  JCT/SRTF JCT/SRTF1  p99/BF   all\n";
    for p in COMPARED {
        let t = tally(results, p);
        out += &format!("{:<14} {:>6}", p.name(), t.scored);
        for n in t.met {
            out += &format!(" {n:>15}");
        }
        out += &format!(
            "  {:>8.3} {:>9.3} {:>7.3} {:>5}\n",
            t.jct_over_srtf, t.jct_over_srtf_once, t.p99_over_backfill, t.all_met
        );
    }
    let queued = results.iter().filter(|r| r.queued()).count();
    let scored = results.iter().filter(|r| r.scored()).count();
    out += &format!(
        "scored: {scored} of {queued} cases where queues form; in the other {} no policy of the \
         harness, the oracles included, meets targets 1 to 5 together\n",
        queued - scored
    );
    out += "(JCT/SRTF, JCT/SRTF1, p99/BF: geometric means over the scored cases of the average JCT \
            over SRTF's and srtf-once's and of the p99 JCT over backfill's; all: scored cases where \
            the policy meets every target at once; srtf knows every duration, las none, perch the \
            declared time limits scaled by the part of its limits each user's recent jobs ran, \
            perch-limits the limits alone)\n";
    out
}

/// The verdicts of [`TARGETED`] on `results`: every target in every scored case, and the
/// geometric mean, each `met` or `missed`.
pub fn verdicts(results: &[CaseResult]) -> String {
    let t = tally(results, TARGETED);
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    format!(
        "verdicts for {}: every target in every scored case: {} of {} ({}); geometric mean of \
         average JCT over SRTF's {:.3}x, target <= {GEOMEAN_JCT_OVER_SRTF}x ({})\n",
        TARGETED.name(),
        t.all_met,
        t.scored,
        verdict(t.all_met == t.scored),
        t.jct_over_srtf,
        verdict(t.jct_over_srtf <= GEOMEAN_JCT_OVER_SRTF)
    )
}

/// Of the cases where queues form, how many are scored (see [`CaseResult::scored`]).
pub fn reachable(results: &[CaseResult]) -> usize {
    results.iter().filter(|r| r.scored()).count()
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
    /// Which set its seed is of.
    pub set: SeedSet,
}

/// A case's replays, one summary per policy of [`POLICIES`].
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// The trace's name.
    pub trace: String,
    /// Its seed.
    pub seed: u64,
    /// Which set its seed is of.
    pub set: SeedSet,
    /// Its cluster's [`SimCluster::label`].
    pub cluster: String,
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

    /// Whether the case is scored: queues form and some policy of [`POLICIES`] (the oracles and
    /// backfill included) meets targets 1 to 5 together.
    pub fn scored(&self) -> bool {
        self.queued() && !self.reached_by().is_empty()
    }

    /// The policies of [`POLICIES`] that meet targets 1 to 5 together.
    pub fn reached_by(&self) -> Vec<SimPolicy> {
        POLICIES
            .into_iter()
            .filter(|&p| self.targets(p)[..5].iter().all(|(_, ok)| *ok))
            .collect()
    }

    /// Of the policies of [`POLICIES`], the one missing the fewest of targets 1 to 5 (the first
    /// in table order among equals), with the targets it misses: what an unscored case lacks.
    pub fn closest(&self) -> (SimPolicy, Vec<&'static str>) {
        POLICIES
            .into_iter()
            .map(|p| {
                let missed: Vec<&'static str> = self.targets(p)[..5]
                    .iter()
                    .filter(|(_, ok)| !ok)
                    .map(|(name, _)| *name)
                    .collect();
                (p, missed)
            })
            .min_by_key(|(_, missed)| missed.len())
            .unwrap_or((SimPolicy::Backfill, Vec::new()))
    }

    /// Whether `p` meets every target at once in this case.
    pub fn meets_all(&self, p: SimPolicy) -> bool {
        self.targets(p).iter().all(|(_, ok)| *ok)
    }

    /// The duration-free policy that dominates `p` here (target 6), if one does.
    pub fn dominated_by(&self, p: SimPolicy) -> Option<SimPolicy> {
        let x = self.get(p);
        let (jct, p99, alloc) = DOMINANCE;
        let waiting = |s: &Summary| s.alloc_queued_pct.unwrap_or(100.0);
        DURATION_FREE.into_iter().filter(|&d| d != p).find(|&d| {
            let y = self.get(d);
            y.avg_jct_s < (1.0 - jct) * x.avg_jct_s
                && y.p99_jct_s < (1.0 - p99) * x.p99_jct_s
                && waiting(y) > waiting(x) + alloc
        })
    }

    /// Each target and whether `p` meets it, in [`TARGETS`] order.
    pub fn targets(&self, p: SimPolicy) -> [(&'static str, bool); 6] {
        let (x, b, once) = (
            self.get(p),
            self.get(SimPolicy::Backfill),
            self.get(SimPolicy::SrtfOnce),
        );
        // Allocation to the printed tenth of a point, as the tables show it.
        let tenth = |v: f64| (v * 10.0).round();
        let waiting = |s: &Summary| s.alloc_queued_pct.unwrap_or(100.0);
        let met = [
            x.avg_jct_s <= b.avg_jct_s,
            x.avg_jct_s <= JCT_OVER_SRTF_ONCE * once.avg_jct_s,
            x.p99_jct_s <= P99_OVER_BACKFILL * b.p99_jct_s,
            tenth(waiting(x)) >= tenth(waiting(b) - ALLOC_BELOW_BACKFILL),
            x.preemptions as f64 <= PREEMPTIONS_PER_JOB * self.jobs as f64,
            self.dominated_by(p).is_none(),
        ];
        std::array::from_fn(|i| (TARGETS[i], met[i]))
    }
}

/// The built-in matrix. `philly`: the Philly trace when at hand (replayed at 384, 512 and 768
/// GPUs, seeds 1 and 2, counted with the tuning set); every synthetic kind at [`TUNING_SEEDS`]
/// and at [`HELD_OUT_SEEDS`] (`quick`: the first seed of each set, and no Philly); all with
/// [`LimitModel::Uniform`] time limits, then again with [`LimitModel::Habits`] (Philly at 512
/// GPUs, seed 1, only: a Philly replay of every policy takes half a minute), the trace's name
/// marked `/h`.
pub fn builtin(philly: Option<&Trace>, quick: bool) -> Result<Vec<Case>> {
    let n = if quick { 1 } else { TUNING_SEEDS.len() };
    let seeds: Vec<(u64, SeedSet)> = TUNING_SEEDS[..n]
        .iter()
        .map(|&s| (s, SeedSet::Tuning))
        .chain(HELD_OUT_SEEDS[..n].iter().map(|&s| (s, SeedSet::HeldOut)))
        .collect();
    let mut cases = Vec::new();
    let uniform = |nodes: u32, gpus: u32, seed: u64| SimOptions {
        seed,
        ..SimOptions::uniform(nodes, gpus)
    };
    if let (Some(t), false) = (philly, quick) {
        for nodes in [48, 64, 96] {
            for seed in [1, 2] {
                cases.push(Case {
                    trace: "philly".into(),
                    jobs: t.jobs.clone(),
                    opts: uniform(nodes, 8, seed),
                    set: SeedSet::Tuning,
                });
            }
        }
    }
    let (mixed, _) = SimCluster::parse("mixed-cluster.csv", MIXED_CLUSTER)?;
    for kind in SynthKind::ALL {
        for &(seed, set) in &seeds {
            let jobs = parse(kind.name(), &generate(kind, seed), None)?.jobs;
            let clusters: Vec<SimOptions> = match kind {
                SynthKind::Small => vec![uniform(1, 8, seed), uniform(2, 8, seed)],
                SynthKind::Fractional => vec![SimOptions {
                    cluster: mixed.clone(),
                    seed,
                    ..SimOptions::default()
                }],
                SynthKind::Gangs => vec![uniform(12, 8, seed), uniform(16, 8, seed)],
                SynthKind::HeavyTail => vec![uniform(6, 8, seed), uniform(8, 8, seed)],
                SynthKind::Testbed => vec![
                    uniform(2, 4, seed),
                    uniform(3, 4, seed),
                    uniform(2, 8, seed),
                ],
                SynthKind::Overloaded => vec![uniform(3, 8, seed), uniform(12, 2, seed)],
                SynthKind::SmallNodes => vec![uniform(16, 2, seed), uniform(8, 4, seed)],
                SynthKind::Bursts => vec![uniform(6, 8, seed), uniform(8, 8, seed)],
            };
            for opts in clusters {
                cases.push(Case {
                    trace: kind.name().into(),
                    jobs: jobs.clone(),
                    opts,
                    set,
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
            set: c.set,
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
        set: case.set,
        cluster: case.opts.cluster.label(),
        limits: case.opts.limits,
        jobs: case.jobs.len(),
        rows,
    })
}

/// For each seed set, then each way of declaring time limits in `results`: the scorecard of
/// every policy of [`SCORED`], the [`comparison`] and the [`verdicts`].
pub fn scorecards(results: &[CaseResult]) -> String {
    let mut out = Vec::new();
    for (set, which) in [
        (
            SeedSet::Tuning,
            "tuning seeds: what policy changes are measured on while they are made",
        ),
        (
            SeedSet::HeldOut,
            "held-out seeds: only ever scored, never used to choose a change",
        ),
    ] {
        for (model, what) in [
            (
                LimitModel::Uniform,
                "each job's time limit its run times a factor uniform in [1.5, 5]",
            ),
            (
                LimitModel::Habits,
                "users' habits: 30% of users always declare 7 days, the others round up to 15 \
                 min, 30 min, 1, 2, 4, 8, 12, 24, 48 or 72 h",
            ),
        ] {
            let part: Vec<CaseResult> = results
                .iter()
                .filter(|r| r.limits == model && r.set == set)
                .cloned()
                .collect();
            if part.is_empty() {
                continue;
            }
            out.push(format!(
                "== {which}; time limits: {} ({what})\n",
                model.name()
            ));
            out.extend(SCORED.iter().map(|&p| scorecard(&part, p)));
            out.push(comparison(&part));
            out.push(verdicts(&part));
        }
    }
    out.join("\n")
}

/// The scorecard of `scored`: one line per case, then how many scored cases meet each target.
pub fn scorecard(results: &[CaseResult], scored: SimPolicy) -> String {
    let mut out = format!("{}:\n", scored.name());
    out += &format!(
        "{:<15} {:>11} {:>4} {:>5} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6} {:>7} {:>7} {:>9} {:>7} {:>6} {:>7} {:>5}  {}\n",
        "trace",
        "cluster",
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
        "allocQ-bf",
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
        let missed = if !r.queued() {
            "(no queue: not scored)".to_string()
        } else if !r.scored() {
            let (p, missed) = r.closest();
            format!(
                "(no policy meets targets 1-5 together: not scored; closest {} misses {})",
                p.name(),
                missed.join(" ")
            )
        } else {
            let names: Vec<String> = r
                .targets(scored)
                .into_iter()
                .filter(|(_, ok)| !ok)
                .map(|(name, _)| match (name, r.dominated_by(scored)) {
                    ("undominated", Some(d)) => format!("undominated (by {})", d.name()),
                    _ => name.to_string(),
                })
                .collect();
            let by: Vec<&str> = r.reached_by().into_iter().map(SimPolicy::name).collect();
            if names.is_empty() {
                "none".to_string()
            } else {
                format!("{} (1-5 met by {})", names.join(" "), by.join(", "))
            }
        };
        out += &format!(
            "{:<15} {:>11} {:>4} {:>5} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>7.2} {:>7.2} {:>6.2} {:>8.2} {:>+7.1} {:>+9.1} {:>7.2} {:>6.1} {:>7.3} {:>5.3}  {}\n",
            r.trace,
            r.cluster,
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
            p.alloc_queued_pct.unwrap_or(100.0) - b.alloc_queued_pct.unwrap_or(100.0),
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
    out += &format!(
        "\n{} meets, of {} scored cases ({} with queues):",
        scored.name(),
        t.scored,
        t.cases
    );
    for (name, n) in TARGETS.iter().zip(t.met) {
        out += &format!(" {name} {n}/{};", t.scored);
    }
    out.pop();
    out += &format!("; every target at once {}/{}", t.all_met, t.scored);
    if t.scored > 0 {
        out += &format!(
            "\ngeometric means over those cases: average JCT {:.3}x SRTF's and {:.3}x \
             srtf-once's, p99 JCT {:.3}x backfill's",
            t.jct_over_srtf, t.jct_over_srtf_once, t.p99_over_backfill
        );
    }
    out += &format!(
        "\n(JCT in seconds, the last one {0}'s; p/srtf, p/bf: {0}'s average JCT over SRTF's and \
         backfill's; p/srtf1: over srtf-once's (the oracle preempting each job at most once); \
         alloc-bf: its allocation over the makespan minus backfill's, points (not a target); \
         allocQ-bf: the same while jobs wait (target 4); pre/job: its preemptions per job \
         (bound {PREEMPTIONS_PER_JOB}); waste%: its GPU-time lost to preemption, of its \
         allocation; Jain: fairness across accounts of each one's mean run time / JCT, 1 = \
         equal; after the targets missed, the policies of the harness that meet targets 1 to 5 \
         together in that case)\n",
        scored.name()
    );
    out
}

/// The header of the figures file (see [`figures`]).
pub const FIGURES_HEADER: &str = "set,trace,cluster,seed,jobs,scored,avg_jct_s,p99_jct_s,alloc_waiting_pct,preemptions_per_job,targets";

/// How far a figure may move before [`regressions`] calls it a regression. The replays are
/// deterministic, so the same build gives the same figures to the digit; the margins let a
/// change elsewhere (a tie broken another way) move a case by what is noise for a scheduler,
/// and no further.
pub const NOISE: Noise = Noise {
    jct: 0.02,
    alloc_points: 0.5,
    preemptions_per_job: 0.05,
    geomean: 0.01,
};

/// See [`NOISE`].
#[derive(Clone, Copy, Debug)]
pub struct Noise {
    /// Average and p99 JCT: this fraction worse.
    pub jct: f64,
    /// Allocation: this many points lower.
    pub alloc_points: f64,
    /// Preemptions per job: this many more.
    pub preemptions_per_job: f64,
    /// The geometric mean of average JCT over SRTF's: this fraction higher.
    pub geomean: f64,
}

/// [`TARGETED`]'s figures on `results`, one CSV line per case, then one per seed set and way of
/// declaring limits with the geometric mean of its average JCT over SRTF's: the file
/// `scheduler/tests/data/scorecard-quick.csv` is this on the quick matrix, and [`regressions`]
/// compares a build with it.
pub fn figures(results: &[CaseResult]) -> String {
    let mut out = format!(
        "# {} on the quick scorecard (perch simulate --suite --quick). Regenerate after a change \
         that is meant to move it, with the change:\n\
         #   cargo run --release -p perch-scheduler --example suite -- quick --figures > scheduler/tests/data/scorecard-quick.csv\n\
         # targets: one digit per target (1 met, 0 missed) in the order {}\n{FIGURES_HEADER}\n",
        TARGETED.name(),
        TARGETS.join(" ")
    );
    for r in results {
        let p = r.get(TARGETED);
        let digits: String = r
            .targets(TARGETED)
            .iter()
            .map(|(_, ok)| if *ok { '1' } else { '0' })
            .collect();
        out += &format!(
            "{},{},{},{},{},{},{:.1},{:.1},{:.2},{:.3},{digits}\n",
            r.set.name(),
            r.trace,
            r.cluster,
            r.seed,
            r.jobs,
            if r.scored() { "yes" } else { "no" },
            p.avg_jct_s,
            p.p99_jct_s,
            p.alloc_queued_pct.unwrap_or(100.0),
            p.preemptions as f64 / r.jobs.max(1) as f64
        );
    }
    for (set, limits, geomean) in geomeans(results) {
        out += &format!(
            "geomean,{}/{},,,,,{geomean:.4},,,,\n",
            set.name(),
            limits.name()
        );
    }
    out
}

fn geomeans(results: &[CaseResult]) -> Vec<(SeedSet, LimitModel, f64)> {
    let mut out = Vec::new();
    for set in [SeedSet::Tuning, SeedSet::HeldOut] {
        for limits in [LimitModel::Uniform, LimitModel::Habits] {
            let part: Vec<CaseResult> = results
                .iter()
                .filter(|r| r.set == set && r.limits == limits)
                .cloned()
                .collect();
            if !part.is_empty() {
                out.push((set, limits, tally(&part, TARGETED).jct_over_srtf));
            }
        }
    }
    out
}

/// Where `results` regress from the committed `figures` (the text of [`figures`]) by more than
/// [`NOISE`]: a target met there and missed here, a figure worse beyond the margin, a case
/// added or gone (the figures are then out of date). Empty when none does.
pub fn regressions(results: &[CaseResult], committed: &str) -> Result<Vec<String>> {
    let bad = |line: usize, message: String| Error::SimConfig {
        option: "figures",
        message: format!("line {}: {message}", line + 1),
    };
    let now = figures(results);
    let parse = |text: &str| -> Result<Vec<(String, Vec<String>)>> {
        let mut rows = Vec::new();
        let mut header = false;
        for (i, line) in text.lines().enumerate() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            if !header {
                if line != FIGURES_HEADER {
                    return Err(bad(i, format!("expected the header `{FIGURES_HEADER}`")));
                }
                header = true;
                continue;
            }
            let cells: Vec<String> = line.split(',').map(str::to_string).collect();
            if cells.len() != 11 {
                return Err(bad(i, format!("expected 11 cells, found {}", cells.len())));
            }
            let key = cells[..4].join(",");
            rows.push((key, cells));
        }
        Ok(rows)
    };
    let (old, new) = (parse(committed)?, parse(&now)?);
    let num = |cells: &[String], i: usize| cells[i].parse::<f64>().unwrap_or(f64::NAN);
    let mut out = Vec::new();
    for (key, was) in &old {
        let Some((_, is)) = new.iter().find(|(k, _)| k == key) else {
            out.push(format!(
                "{key}: in the committed figures, not in this matrix: regenerate the figures"
            ));
            continue;
        };
        if was[0] == "geomean" {
            let (a, b) = (num(was, 6), num(is, 6));
            if b > a * (1.0 + NOISE.geomean) {
                out.push(format!(
                    "{key}: geometric mean of average JCT over SRTF's {b:.4}, was {a:.4}"
                ));
            }
            continue;
        }
        for (i, name) in TARGETS.iter().enumerate() {
            let (a, b) = (was[10].as_bytes().get(i), is[10].as_bytes().get(i));
            if a == Some(&b'1') && b != Some(&b'1') {
                out.push(format!("{key}: target {name} was met, now missed"));
            }
        }
        for (i, what) in [(6, "average JCT"), (7, "p99 JCT")] {
            let (a, b) = (num(was, i), num(is, i));
            if b > a * (1.0 + NOISE.jct) {
                out.push(format!(
                    "{key}: {what} {b:.0} s, was {a:.0} s (+{:.1}%)",
                    100.0 * (b / a - 1.0)
                ));
            }
        }
        let (a, b) = (num(was, 8), num(is, 8));
        if b < a - NOISE.alloc_points {
            out.push(format!(
                "{key}: allocation while jobs wait {b:.2}%, was {a:.2}%"
            ));
        }
        let (a, b) = (num(was, 9), num(is, 9));
        if b > a + NOISE.preemptions_per_job {
            out.push(format!("{key}: {b:.3} preemptions per job, was {a:.3}"));
        }
        // A scored case no policy reaches any more: perch reached it before (the other
        // policies are the same code), so it lost what it met. The other way is a gain.
        if was[5] == "yes" && is[5] != "yes" {
            out.push(format!(
                "{key}: no policy meets targets 1 to 5 together any more (it was scored)"
            ));
        }
    }
    for (key, _) in &new {
        if !old.iter().any(|(k, _)| k == key) {
            out.push(format!(
                "{key}: in this matrix, not in the committed figures: regenerate the figures"
            ));
        }
    }
    Ok(out)
}
