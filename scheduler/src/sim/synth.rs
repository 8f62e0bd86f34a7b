//! Synthetic traces of shapes the Philly trace does not have, generated deterministically from a
//! seed so that the committed files (`scheduler/traces/`) can be checked against their
//! generator and regenerated (`perch simulate --generate KIND --seed S > FILE`).
//!
//! | kind | what it stresses |
//! |---|---|
//! | `small` | a small cluster (8 to 16 GPUs) and 40 jobs: few jobs, where one bad decision shows |
//! | `fractional` | single-GPU work, 40% of jobs asking for a fraction of a GPU, 10% pinned to A100, on mixed 2/4/8-GPU nodes of three models (`mixed-cluster.csv`) |
//! | `gangs` | half the jobs are gangs of 16 to 64 GPUs; a tenth high priority and not preemptible |
//! | `heavy-tail` | Pareto durations (a few jobs run for days) and idle tails on a third of the GPU-time |
//! | `testbed` | a research testbed: 30 to 100 jobs (the seed draws how many) on 8 to 16 GPUs, most of them multi-GPU, up to a whole 8-GPU node |
//! | `overloaded` | 3,000 jobs on 24 GPUs loaded to 2x: the queue grows for the whole trace, and what a policy starts first decides everything |
//! | `small-nodes` | 800 jobs of 1 to 8 GPUs for clusters of 2- and 4-GPU nodes (32 GPUs), where a 4- or 8-GPU job is a gang across nodes |
//! | `bursts` | 800 jobs, 70% of them in sweeps of 5 to 40 alike jobs submitted by one user within a minute, on 48 and 64 GPUs |
//!
//! Arrivals are Poisson at a rate that loads the cluster the trace is meant for to about 1.2x
//! its capacity over the trace (2x for `overloaded`; `bursts` draws its sweeps' starts that
//! way), so queues form; durations are log-normal unless said otherwise.
//!
//! The distributions, exactly (GPUs as value:weight; log-normal as median and sigma of the
//! log, clamped; accounts x users per account, each job's drawn uniformly):
//!
//! | kind | jobs | capacity, load | GPUs per job | duration | accounts |
//! |---|---|---|---|---|---|
//! | `small` | 40 | 12 GPUs, 1.2 | 1:4 2:3 4:2 8:1 | log-normal 30 min, 1.2, [1 min, 1 day] | 3 x 2 |
//! | `fractional` | 2,000 | 56, 1.2 | 40% fractions 0.1:1 0.25:3 0.46:2 0.5:3 0.75:1, else 1:7 2:1.5 4:1 8:0.5; 10% of whole-GPU jobs on A100 | log-normal 15 min, 1.5, [30 s, 3 days] | 6 x 5 |
//! | `gangs` | 600 | 128, 1.2 | half 16:3 32:2 64:1, half 1:3 2:1 4:1 8:2; 10% high priority and not preemptible, 20% low | log-normal 1 h, 1.3, [2 min, 4 days] | 4 x 4 |
//! | `heavy-tail` | 1,500 | 64, 1.2 | 1:6 2:1 4:1.5 8:1.5 | Pareto min 2 min, alpha 1.1, cap 7 days; idle tails to a third of GPU-time | 5 x 4 |
//! | `testbed` | 30-100 (uniform) | 12, 1.3 | 1:2 2:3 4:3 8:2 | log-normal 20 min, 1.1, [1 min, 1 day] | 3 x 3 |
//! | `overloaded` | 3,000 | 24, 2.0 | 1:6 2:2 4:1.5 8:0.5 | log-normal 30 min, 1.4, [1 min, 2 days] | 6 x 4 |
//! | `small-nodes` | 800 | 32, 1.2 | 1:5 2:2.5 4:1.5 8:0.5 | log-normal 40 min, 1.2, [1 min, 3 days] | 5 x 4 |
//! | `bursts` | 800 | 56, 1.2 | 1:5 2:2 4:1.5 8:1 | log-normal 25 min, 1.3, [1 min, 2 days]; a sweep's jobs the first's times 0.8-1.2 | 5 x 4 |

use super::trace::unit;

/// A kind of synthetic trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthKind {
    /// See the module table.
    Small,
    /// See the module table.
    Fractional,
    /// See the module table.
    Gangs,
    /// See the module table.
    HeavyTail,
    /// See the module table.
    Testbed,
    /// See the module table.
    Overloaded,
    /// See the module table.
    SmallNodes,
    /// See the module table.
    Bursts,
}

impl SynthKind {
    /// Every kind, in table order.
    pub const ALL: [SynthKind; 8] = [
        SynthKind::Small,
        SynthKind::Fractional,
        SynthKind::Gangs,
        SynthKind::HeavyTail,
        SynthKind::Testbed,
        SynthKind::Overloaded,
        SynthKind::SmallNodes,
        SynthKind::Bursts,
    ];

    /// Name on the command line and file name stem.
    pub fn name(self) -> &'static str {
        match self {
            SynthKind::Small => "small",
            SynthKind::Fractional => "fractional",
            SynthKind::Gangs => "gangs",
            SynthKind::HeavyTail => "heavy-tail",
            SynthKind::Testbed => "testbed",
            SynthKind::Overloaded => "overloaded",
            SynthKind::SmallNodes => "small-nodes",
            SynthKind::Bursts => "bursts",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<SynthKind> {
        SynthKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// The mixed inventory the `fractional` trace is meant for: nodes of 2, 4 and 8 GPUs of three
/// models, 56 GPUs in all (a cluster file).
pub const MIXED_CLUSTER: &str = "\
# The mixed fleet of the `fractional` synthetic trace: 56 GPUs on nodes of 2, 4 and 8.
name,gpus,model,rack,gpu_memory_gb,sharing
t4-01,2,T4,r1,16,true
t4-02,2,T4,r1,16,true
t4-03,2,T4,r1,16,true
t4-04,2,T4,r1,16,true
a10-01,4,A10,r2,24,true
a10-02,4,A10,r2,24,true
a10-03,4,A10,r2,24,true
a10-04,4,A10,r2,24,true
a100-01,8,A100,r3,80,true
a100-02,8,A100,r3,80,true
a100-03,8,A100,r3,80,true
a100-04,8,A100,r4,80,true
";

/// A draw in `[0, 1)` for job `i`, stream `salt`.
struct Draw {
    seed: u64,
}

impl Draw {
    fn u(&self, i: u64, salt: u64) -> f64 {
        unit(self.seed, i, salt)
    }

    /// Exponential with mean `mean`.
    fn exp(&self, i: u64, salt: u64, mean: f64) -> f64 {
        -mean * (1.0 - self.u(i, salt)).ln()
    }

    /// Log-normal with median `median` and log-space deviation `sigma` (Box-Muller).
    fn lognormal(&self, i: u64, salt: u64, median: f64, sigma: f64) -> f64 {
        let (a, b) = (self.u(i, salt).max(1e-12), self.u(i, salt + 1000));
        let z = (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos();
        median * (sigma * z).exp()
    }

    /// Pareto with minimum `min` and shape `alpha`, capped at `cap`.
    fn pareto(&self, i: u64, salt: u64, min: f64, alpha: f64, cap: f64) -> f64 {
        (min / (1.0 - self.u(i, salt)).powf(1.0 / alpha)).min(cap)
    }

    /// One of `items` by weight.
    fn pick<T: Copy>(&self, i: u64, salt: u64, items: &[(T, f64)]) -> T {
        let total: f64 = items.iter().map(|x| x.1).sum();
        let mut x = self.u(i, salt) * total;
        for &(v, w) in items {
            if x < w {
                return v;
            }
            x -= w;
        }
        items[items.len() - 1].0
    }
}

/// One generated job, before it is written.
struct Job {
    submit: f64,
    duration: f64,
    gpus: String,
    account: usize,
    user: usize,
    utilization: String,
    gpu_model: &'static str,
    priority: &'static str,
    preemptible: bool,
    /// Submitted with the job before it, in one sweep (`bursts`).
    follows: bool,
}

/// Generates the trace `kind` from `seed`, as generic trace CSV.
pub fn generate(kind: SynthKind, seed: u64) -> String {
    let d = Draw { seed };
    // (jobs, GPUs the trace is meant for, accounts, users per account, load)
    let (n, capacity, accounts, users, load) = match kind {
        SynthKind::Small => (40u64, 12.0, 3usize, 2usize, 1.2),
        SynthKind::Fractional => (2000, 56.0, 6, 5, 1.2),
        SynthKind::Gangs => (600, 128.0, 4, 4, 1.2),
        SynthKind::HeavyTail => (1500, 64.0, 5, 4, 1.2),
        SynthKind::Testbed => (30 + (d.u(0, 11) * 71.0) as u64, 12.0, 3, 3, 1.3),
        SynthKind::Overloaded => (3000, 24.0, 6, 4, 2.0),
        SynthKind::SmallNodes => (800, 32.0, 5, 4, 1.2),
        SynthKind::Bursts => (800, 56.0, 5, 4, 1.2),
    };
    let mut jobs: Vec<Job> = (0..n)
        .map(|i| {
            let account = (d.u(i, 1) * accounts as f64) as usize;
            let user = (d.u(i, 2) * users as f64) as usize;
            let mut job = Job {
                submit: 0.0,
                duration: 0.0,
                gpus: String::new(),
                account,
                user,
                utilization: String::new(),
                gpu_model: "",
                priority: "",
                preemptible: true,
                follows: false,
            };
            match kind {
                SynthKind::Small => {
                    let g = d.pick(i, 3, &[(1u32, 4.0), (2, 3.0), (4, 2.0), (8, 1.0)]);
                    job.gpus = g.to_string();
                    job.duration = d.lognormal(i, 4, 1800.0, 1.2).clamp(60.0, 86_400.0);
                }
                SynthKind::Fractional => {
                    if d.u(i, 3) < 0.4 {
                        let f = d.pick(
                            i,
                            5,
                            &[
                                (0.1, 1.0),
                                (0.25, 3.0),
                                (0.46, 2.0),
                                (0.5, 3.0),
                                (0.75, 1.0),
                            ],
                        );
                        job.gpus = format!("{f}");
                    } else {
                        let g = d.pick(i, 6, &[(1u32, 7.0), (2, 1.5), (4, 1.0), (8, 0.5)]);
                        job.gpus = g.to_string();
                    }
                    if d.u(i, 7) < 0.1 && !job.gpus.starts_with("0.") {
                        job.gpu_model = "A100";
                    }
                    job.duration = d.lognormal(i, 4, 900.0, 1.5).clamp(30.0, 3.0 * 86_400.0);
                }
                SynthKind::Gangs => {
                    let g = if d.u(i, 3) < 0.5 {
                        d.pick(i, 5, &[(16u32, 3.0), (32, 2.0), (64, 1.0)])
                    } else {
                        d.pick(i, 6, &[(1u32, 3.0), (2, 1.0), (4, 1.0), (8, 2.0)])
                    };
                    job.gpus = g.to_string();
                    if d.u(i, 7) < 0.1 {
                        job.priority = "high";
                        job.preemptible = false;
                    } else if d.u(i, 7) < 0.3 {
                        job.priority = "low";
                    }
                    job.duration = d.lognormal(i, 4, 3600.0, 1.3).clamp(120.0, 4.0 * 86_400.0);
                }
                SynthKind::HeavyTail => {
                    let g = d.pick(i, 3, &[(1u32, 6.0), (2, 1.0), (4, 1.5), (8, 1.5)]);
                    job.gpus = g.to_string();
                    job.duration = d.pareto(i, 4, 120.0, 1.1, 7.0 * 86_400.0);
                }
                SynthKind::Testbed => {
                    let g = d.pick(i, 3, &[(1u32, 2.0), (2, 3.0), (4, 3.0), (8, 2.0)]);
                    job.gpus = g.to_string();
                    job.duration = d.lognormal(i, 4, 1200.0, 1.1).clamp(60.0, 86_400.0);
                }
                SynthKind::Overloaded => {
                    let g = d.pick(i, 3, &[(1u32, 6.0), (2, 2.0), (4, 1.5), (8, 0.5)]);
                    job.gpus = g.to_string();
                    job.duration = d.lognormal(i, 4, 1800.0, 1.4).clamp(60.0, 2.0 * 86_400.0);
                }
                SynthKind::SmallNodes => {
                    let g = d.pick(i, 3, &[(1u32, 5.0), (2, 2.5), (4, 1.5), (8, 0.5)]);
                    job.gpus = g.to_string();
                    job.duration = d.lognormal(i, 4, 2400.0, 1.2).clamp(60.0, 3.0 * 86_400.0);
                }
                SynthKind::Bursts => {
                    let g = d.pick(i, 3, &[(1u32, 5.0), (2, 2.0), (4, 1.5), (8, 1.0)]);
                    job.gpus = g.to_string();
                    job.duration = d.lognormal(i, 4, 1500.0, 1.3).clamp(60.0, 2.0 * 86_400.0);
                }
            }
            job
        })
        .collect();
    if kind == SynthKind::HeavyTail {
        // Idle tails until a third of the GPU-time is idle, most on the long jobs (people
        // forget notebooks and finished runs, not two-minute tests).
        let total: f64 = jobs.iter().map(|j| j.duration * amount(&j.gpus)).sum();
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by(|&a, &b| d.u(a as u64, 8).total_cmp(&d.u(b as u64, 8)));
        let mut idle = 0.0;
        for i in order {
            if idle >= total / 3.0 {
                break;
            }
            let j = &mut jobs[i];
            if j.duration < 1800.0 {
                continue;
            }
            let frac = 0.4 + 0.5 * d.u(i as u64, 9);
            let busy = (j.duration * (1.0 - frac)).round();
            j.utilization = format!("95:{busy};0:{}", (j.duration - busy).round());
            idle += (j.duration - busy) * amount(&j.gpus);
        }
    }
    if kind == SynthKind::Bursts {
        sweeps(&d, &mut jobs);
    }
    // Poisson arrivals loading `capacity` GPUs to `load` over the trace; a sweep's jobs come
    // within a minute of its first.
    let work: f64 = jobs.iter().map(|j| j.duration * amount(&j.gpus)).sum();
    let span = work / (load * capacity);
    let arrivals = if kind == SynthKind::Bursts {
        sweep_starts(&jobs)
    } else {
        (0..jobs.len()).collect()
    };
    let mean_gap = span / arrivals.len().max(1) as f64;
    let mut t = 0.0;
    for (k, &first) in arrivals.iter().enumerate() {
        let last = arrivals.get(k + 1).copied().unwrap_or(jobs.len());
        for (offset, j) in jobs[first..last].iter_mut().enumerate() {
            j.submit = t + if offset == 0 {
                0.0
            } else {
                (d.u((first + offset) as u64, 12) * 60.0).floor()
            };
        }
        t += d.exp(first as u64, 10, mean_gap);
    }
    jobs.sort_by(|a, b| a.submit.total_cmp(&b.submit));
    let mut out = format!(
        "# perch synthetic trace `{}`, seed {seed} (perch simulate --generate {} --seed {seed})\n\
         submit,duration,gpus,account,user,utilization,gpu_model,priority,preemptible\n",
        kind.name(),
        kind.name()
    );
    for j in &jobs {
        out += &format!(
            "{:.0},{:.0},{},acct{},acct{}-user{},{},{},{},{}\n",
            j.submit,
            j.duration.round().max(1.0),
            j.gpus,
            j.account,
            j.account,
            j.user,
            j.utilization,
            j.gpu_model,
            j.priority,
            j.preemptible
        );
    }
    out
}

/// The sweeps of a `bursts` trace: runs of 5 to 40 consecutive jobs (70% of all jobs) made
/// alike: the first one's user, shape and, within 20%, duration (a hyper-parameter sweep); the
/// others are marked as following it.
fn sweeps(d: &Draw, jobs: &mut [Job]) {
    let mut i = 0;
    while i < jobs.len() {
        let len = if d.u(i as u64, 13) < 0.7 {
            5 + (d.u(i as u64, 14) * 36.0) as usize
        } else {
            1
        };
        let end = (i + len).min(jobs.len());
        let (gpus, user, account, duration) = (
            jobs[i].gpus.clone(),
            jobs[i].user,
            jobs[i].account,
            jobs[i].duration,
        );
        for (k, j) in jobs[i + 1..end].iter_mut().enumerate() {
            j.gpus = gpus.clone();
            j.user = user;
            j.account = account;
            j.duration = duration * (0.8 + 0.4 * d.u((i + 1 + k) as u64, 15));
            j.follows = true;
        }
        i = end;
    }
}

/// The index of each sweep's first job (see [`sweeps`]).
fn sweep_starts(jobs: &[Job]) -> Vec<usize> {
    (0..jobs.len()).filter(|&i| !jobs[i].follows).collect()
}

fn amount(gpus: &str) -> f64 {
    gpus.parse().unwrap_or(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::trace::parse;

    #[test]
    fn every_kind_parses_and_is_deterministic() -> crate::Result<()> {
        for kind in SynthKind::ALL {
            let text = generate(kind, 1);
            assert_eq!(text, generate(kind, 1));
            assert_ne!(text, generate(kind, 2));
            let trace = parse(kind.name(), &text, None)?;
            assert!(trace.warnings.is_empty(), "{:?}", trace.warnings);
            assert!(trace.jobs.len() >= 40);
        }
        let frac = parse("f", &generate(SynthKind::Fractional, 1), None)?.jobs;
        let share = frac.iter().filter(|j| j.fraction.is_some()).count() as f64 / frac.len() as f64;
        assert!((0.35..0.45).contains(&share), "{share}");
        Ok(())
    }
}
