//! What a replay measures: per-job completion and wait times, GPU-time integrals, and the
//! time series behind the plot; and the table that prints them.
//!
//! Definitions: JCT = end - submit; wait = first start - submit; makespan = last end - first
//! submit; allocation = allocated GPU-time / (GPUs x makespan); allocation while queued = the
//! same, counted only while at least one job waits (does the policy leave GPUs idle while work
//! waits?); useful = GPU-time at non-zero utilization / (GPUs x makespan); efficiency = useful GPU-time /
//! allocated GPU-time; Jain's index over
//! accounts of each account's mean `min(1, run time / JCT)`.

use super::trace::TraceJob;
use crate::ids::Time;
use std::collections::BTreeMap;

/// One point of the time series.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Virtual time, ms.
    pub t: Time,
    /// Jobs waiting.
    pub pending: usize,
    /// GPUs allocated, in hundredths of a GPU (a fraction of a GPU counts as its percent).
    pub allocated: u32,
    /// GPUs allocated and busy, in hundredths.
    pub busy: u32,
}

/// The headline numbers of one replay.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Policy name.
    pub policy: String,
    /// Cluster GPUs.
    pub gpus: u32,
    /// Jobs that ended (their JCT counts).
    pub finished: usize,
    /// Jobs that never ended.
    pub unfinished: usize,
    /// Jobs among `finished` that ended with work left: past their time limit (which counts
    /// every run, wasted time included), or preempted more often than they may be requeued.
    pub incomplete: usize,
    /// Mean JCT, s.
    pub avg_jct_s: f64,
    /// Median JCT, s.
    pub median_jct_s: f64,
    /// 99th percentile JCT, s.
    pub p99_jct_s: f64,
    /// Mean wait before first start, s.
    pub avg_wait_s: f64,
    /// Makespan, s.
    pub makespan_s: f64,
    /// Allocation, percent.
    pub alloc_pct: f64,
    /// Allocation while jobs wait, percent; `None` when no job ever waited (the table prints
    /// `-`: there was nothing to measure, which is not 0%).
    pub alloc_queued_pct: Option<f64>,
    /// Useful (busy) GPU-time, percent.
    pub useful_pct: f64,
    /// Useful GPU-time over allocated GPU-time, percent (GPU efficiency).
    pub efficiency_pct: f64,
    /// Jain's fairness index across accounts.
    pub jain: f64,
    /// Preemptions of any kind.
    pub preemptions: u64,
    /// Idle reclaims among them.
    pub idle_reclaims: u64,
    /// GPU-hours preemption wasted: work lost since the last checkpoint plus restart delays.
    pub wasted_gpu_h: f64,
}

/// What became of one job of a replay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JobOutcome {
    /// When it first started; `None`: never.
    pub first_start: Option<Time>,
    /// When it ended; `None`: still pending or running when the replay ran out of events.
    pub end: Option<Time>,
}

pub(crate) struct Recorder {
    total: u32,
    submit: Vec<Time>,
    duration: Vec<Time>,
    account: Vec<String>,
    first_start: Vec<Option<Time>>,
    end: Vec<Option<Time>>,
    incomplete: usize,
    wasted_ms: f64,
    last: Time,
    alloc: u32,
    busy: u32,
    pending: usize,
    alloc_ms: f64,
    busy_ms: f64,
    queued_alloc_ms: f64,
    queued_ms: f64,
    preemptions: u64,
    idle_reclaims: u64,
    idle_reports: u64,
    pub(crate) series: Vec<Sample>,
}

impl Recorder {
    pub(crate) fn new(jobs: &[TraceJob], total: u32) -> Self {
        Recorder {
            total,
            submit: jobs.iter().map(|j| j.submit).collect(),
            duration: jobs.iter().map(|j| j.duration).collect(),
            account: jobs.iter().map(|j| j.account.clone()).collect(),
            first_start: vec![None; jobs.len()],
            end: vec![None; jobs.len()],
            incomplete: 0,
            wasted_ms: 0.0,
            last: 0,
            alloc: 0,
            busy: 0,
            pending: 0,
            alloc_ms: 0.0,
            busy_ms: 0.0,
            queued_alloc_ms: 0.0,
            queued_ms: 0.0,
            preemptions: 0,
            idle_reclaims: 0,
            idle_reports: 0,
            series: Vec::new(),
        }
    }

    fn advance(&mut self, now: Time) {
        let dt = (now - self.last).max(0) as f64;
        self.alloc_ms += dt * self.alloc as f64;
        self.busy_ms += dt * self.busy as f64;
        if self.pending > 0 {
            self.queued_ms += dt;
            self.queued_alloc_ms += dt * self.alloc as f64;
        }
        self.last = self.last.max(now);
    }

    /// `hundredths`: what the job holds, in hundredths of a GPU (as every amount here).
    pub(crate) fn start(&mut self, now: Time, job: usize, hundredths: u32) {
        self.advance(now);
        self.alloc += hundredths;
        self.first_start[job].get_or_insert(now);
    }

    pub(crate) fn stop(&mut self, now: Time, hundredths: u32) {
        self.advance(now);
        self.alloc = self.alloc.saturating_sub(hundredths);
    }

    pub(crate) fn wasted(&mut self, ms: Time, hundredths: u32) {
        self.wasted_ms += ms as f64 * f64::from(hundredths) / 100.0;
    }

    pub(crate) fn set_busy(&mut self, now: Time, flag: &mut bool, busy: bool, hundredths: u32) {
        if *flag == busy {
            return;
        }
        self.advance(now);
        *flag = busy;
        if busy {
            self.busy += hundredths
        } else {
            self.busy = self.busy.saturating_sub(hundredths)
        }
    }

    /// `complete`: the job's work was done (not cut short by a limit or a last preemption).
    pub(crate) fn end(&mut self, now: Time, job: usize, complete: bool) {
        self.end[job] = Some(now);
        if !complete {
            self.incomplete += 1;
        }
    }

    pub(crate) fn preempted(&mut self, idle: bool) {
        self.preemptions += 1;
        if idle {
            self.idle_reclaims += 1;
        }
    }

    pub(crate) fn idle_report(&mut self) {
        self.idle_reports += 1;
    }

    pub(crate) fn sample(&mut self, now: Time, pending: usize) {
        self.advance(now);
        self.pending = pending;
        let s = Sample {
            t: now,
            pending,
            allocated: self.alloc,
            busy: self.busy,
        };
        match self.series.last_mut() {
            Some(last) if last.t == now => *last = s,
            _ => self.series.push(s),
        }
    }

    pub(crate) fn outcomes(&self) -> Vec<JobOutcome> {
        self.first_start
            .iter()
            .zip(&self.end)
            .map(|(&first_start, &end)| JobOutcome { first_start, end })
            .collect()
    }

    pub(crate) fn summary(&self, policy: &str) -> Summary {
        let mut jct: Vec<f64> = Vec::new();
        let mut wait_sum = 0.0;
        let mut per_account: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
        let mut makespan = 0;
        for i in 0..self.submit.len() {
            let Some(end) = self.end[i] else { continue };
            let j = (end - self.submit[i]) as f64;
            jct.push(j / 1000.0);
            wait_sum += (self.first_start[i].unwrap_or(end) - self.submit[i]) as f64 / 1000.0;
            makespan = makespan.max(end);
            let ratio = if j <= 0.0 {
                1.0
            } else {
                (self.duration[i] as f64 / j).min(1.0)
            };
            let e = per_account.entry(&self.account[i]).or_default();
            e.0 += ratio;
            e.1 += 1;
        }
        let n = jct.len();
        jct.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            if n == 0 {
                0.0
            } else {
                jct[((n as f64 * p).ceil() as usize).clamp(1, n) - 1]
            }
        };
        let xs: Vec<f64> = per_account.values().map(|(s, c)| s / *c as f64).collect();
        let (sum, sq): (f64, f64) = (xs.iter().sum(), xs.iter().map(|x| x * x).sum());
        // Amounts are in hundredths of a GPU.
        let capacity = 100.0 * self.total as f64 * makespan as f64;
        let share = |v: f64, of: f64| if of > 0.0 { 100.0 * v / of } else { 0.0 };
        Summary {
            policy: policy.to_string(),
            gpus: self.total,
            finished: n,
            unfinished: self.submit.len() - n,
            avg_jct_s: if n == 0 {
                0.0
            } else {
                jct.iter().sum::<f64>() / n as f64
            },
            median_jct_s: pct(0.5),
            p99_jct_s: pct(0.99),
            avg_wait_s: if n == 0 { 0.0 } else { wait_sum / n as f64 },
            makespan_s: makespan as f64 / 1000.0,
            alloc_pct: share(self.alloc_ms, capacity),
            alloc_queued_pct: (self.queued_ms > 0.0).then(|| {
                share(
                    self.queued_alloc_ms,
                    100.0 * self.total as f64 * self.queued_ms,
                )
            }),
            useful_pct: share(self.busy_ms, capacity),
            efficiency_pct: share(self.busy_ms, self.alloc_ms),
            jain: if sq > 0.0 {
                sum * sum / (xs.len() as f64 * sq)
            } else {
                1.0
            },
            preemptions: self.preemptions,
            idle_reclaims: self.idle_reclaims,
            incomplete: self.incomplete,
            wasted_gpu_h: self.wasted_ms / 3.6e6,
        }
    }
}

/// The summaries as an aligned text table.
pub fn format_table(rows: &[Summary]) -> String {
    let mut out = format!(
        "{:<20} {:>5} {:>11} {:>10} {:>11} {:>10} {:>9} {:>7} {:>8} {:>7} {:>5} {:>6} {:>8} {:>8} {:>6} {:>6}\n",
        "policy",
        "GPUs",
        "avg JCT s",
        "med JCT s",
        "p99 JCT s",
        "avg wait s",
        "makespan h",
        "alloc%",
        "allocQ%",
        "useful%",
        "eff%",
        "Jain",
        "preempt",
        "wasteGPUh",
        "incompl",
        "unfin"
    );
    for r in rows {
        out += &format!(
            "{:<20} {:>5} {:>11.0} {:>10.0} {:>11.0} {:>10.0} {:>10.1} {:>7.1} {:>8} {:>7.1} {:>5.1} {:>6.3} {:>8} {:>9.1} {:>7} {:>6}\n",
            r.policy,
            r.gpus,
            r.avg_jct_s,
            r.median_jct_s,
            r.p99_jct_s,
            r.avg_wait_s,
            r.makespan_s / 3600.0,
            r.alloc_pct,
            r.alloc_queued_pct
                .map_or_else(|| "-".to_owned(), |p| format!("{p:.1}")),
            r.useful_pct,
            r.efficiency_pct,
            r.jain,
            r.preemptions,
            r.wasted_gpu_h,
            r.incomplete,
            r.unfinished
        );
    }
    out
}
