//! Choosing victims: gang-aware reclaim of borrowed GPUs, SRTF preemption, and idle reclaim.
//!
//! Victims are always whole jobs (every GPU of a gang is freed together). Candidates are taken
//! cheapest first (measured-idle jobs before busy ones, then the fewest GPU-milliseconds of work
//! at stake) until the waiting gang would fit; then every victim that turns out not to be needed
//! is dropped again, most expensive first, so the set is small and cheap.

use crate::cluster::NodeState;
use crate::ids::{JobId, Time};
use crate::job::PreemptReason;
use crate::scheduler::{Action, JobState, Scheduler};
use std::collections::HashMap;

impl Scheduler {
    /// The smallest prefix-then-pruned set of `candidates` (in preference order) whose release
    /// lets `id`'s gang fit, or `None`. A candidate whose release frees nothing the gang can
    /// use (all its nodes already have room for a rank in the what-if) is passed over, and
    /// with `budget` (hundredths of a GPU each account may give up) so is one its account
    /// cannot afford.
    pub(crate) fn select_victims(
        &self,
        id: JobId,
        candidates: &[JobId],
        mut budget: Option<HashMap<usize, i64>>,
    ) -> Option<Vec<JobId>> {
        let j = self.jobs.get(&id)?;
        let g = j.spec.shape.gpus_per_node;
        let k = j.spec.shape.nodes;
        let model = j.model;
        let nodes = &self.cluster.nodes;
        let mut hyp: HashMap<usize, u32> = HashMap::new();
        let mut sharers_left = HashMap::new();
        let mut count = self.cluster.nodes_with_free(model, g);
        // Applies (or, with `release == false`, undoes) the release of `v` to the what-if.
        let mut apply =
            |hyp: &mut HashMap<usize, u32>, count: &mut u32, v: JobId, release: bool| {
                for (i, mask) in self.freed_by(v, &mut sharers_left, release) {
                    let n = &nodes[i];
                    if n.state != NodeState::Up || model.is_some_and(|m| m != n.model) {
                        continue;
                    }
                    let gain = (mask & !n.unhealthy).count_ones();
                    let f = hyp.entry(i).or_insert_with(|| n.free());
                    let before = *f >= g;
                    if release {
                        *f += gain
                    } else {
                        *f -= gain
                    }
                    let after = *f >= g;
                    match (before, after) {
                        (false, true) => *count += 1,
                        (true, false) => *count -= 1,
                        _ => {}
                    }
                }
            };
        let mut chosen = Vec::new();
        for &v in candidates {
            if count >= k {
                break;
            }
            let Some(job) = self.jobs.get(&v) else {
                continue;
            };
            let JobState::Running { placement, .. } = &job.state else {
                continue;
            };
            let helps = placement.iter().any(|a| {
                let i = a.node.0 as usize;
                let n = &nodes[i];
                n.state == NodeState::Up
                    && model.is_none_or(|m| m == n.model)
                    && hyp.get(&i).copied().unwrap_or_else(|| n.free()) < g
            });
            if !helps {
                continue;
            }
            if let Some(budget) = &mut budget {
                let left = budget.entry(job.account).or_insert(0);
                let cost = i64::from(job.spec.gpu_hundredths());
                if *left < cost {
                    continue;
                }
                *left -= cost;
            }
            apply(&mut hyp, &mut count, v, true);
            chosen.push(v);
        }
        if count < k {
            return None;
        }
        for idx in (0..chosen.len()).rev() {
            let v = chosen[idx];
            apply(&mut hyp, &mut count, v, false);
            if count >= k {
                chosen.remove(idx);
            } else {
                apply(&mut hyp, &mut count, v, true);
            }
        }
        Some(chosen)
    }

    /// Quota reclaim for `id` (within its account's quota): preempt jobs of accounts that are
    /// over their quota, never below it.
    pub(crate) fn reclaim_quota(&mut self, now: Time, id: JobId) -> Vec<Action> {
        let Some(me) = self.jobs.get(&id).map(|j| j.account) else {
            return Vec::new();
        };
        let mut cands: Vec<((bool, i64, std::cmp::Reverse<Time>), JobId)> = Vec::new();
        for &(_, v) in &self.deadlines {
            let Some(job) = self.jobs.get(&v) else {
                continue;
            };
            let a = &self.accounts[job.account];
            let JobState::Running { start, .. } = job.state else {
                continue;
            };
            if job.account == me || !job.spec.preemptible || a.within(0) {
                continue;
            }
            let cost = i64::from(job.spec.gpu_hundredths()) * (now - start).max(0);
            // Idle jobs go first, but only once idle for the policy's window: one low sample
            // (a job loading its data, or a reading taken before its agent launched it) must
            // not make a busy job the victim in place of a younger one.
            let idle = job
                .idle_since
                .is_some_and(|s| s + self.config.idle.window <= now);
            // Equal cost: the job started last loses the least.
            cands.push(((!idle, cost, std::cmp::Reverse(start)), v));
        }
        cands.sort_unstable();
        // An account gives up GPUs only down to its quota: what it holds beyond it is the
        // budget victims are chosen within (never below the quota).
        let mut budget: HashMap<usize, i64> = HashMap::new();
        for (_, v) in &cands {
            let Some(job) = self.jobs.get(v) else {
                continue;
            };
            let a = &self.accounts[job.account];
            let excess = a
                .quota
                .map_or(0, |q| i64::from(a.alloc) - i64::from(q) * 100);
            budget.insert(job.account, excess.max(0));
        }
        let ordered: Vec<JobId> = cands.into_iter().map(|(_, v)| v).collect();
        match self.select_victims(id, &ordered, Some(budget)) {
            Some(victims) => {
                self.preempt_for(now, victims, PreemptReason::QuotaReclaim { for_job: id })
            }
            None => Vec::new(),
        }
    }

    /// SRTF: preempt running jobs with more remaining time than `id`, longest first.
    pub(crate) fn preempt_longer(&mut self, now: Time, id: JobId) -> Vec<Action> {
        let Some(mine) = self.jobs.get(&id).map(|j| self.remaining(j, now)) else {
            return Vec::new();
        };
        let mut cands: Vec<(std::cmp::Reverse<i64>, JobId)> = self
            .deadlines
            .iter()
            .filter_map(|&(_, v)| self.jobs.get(&v).map(|j| (v, j)))
            .filter(|(_, j)| j.spec.preemptible)
            .map(|(v, j)| (std::cmp::Reverse(self.remaining(j, now)), v))
            .filter(|(r, _)| r.0 > mine)
            .collect();
        cands.sort_unstable();
        let ordered: Vec<JobId> = cands.into_iter().map(|(_, v)| v).collect();
        match self.select_victims(id, &ordered, None) {
            Some(victims) => {
                self.preempt_for(now, victims, PreemptReason::ShorterJob { for_job: id })
            }
            None => Vec::new(),
        }
    }

    /// Idle reclaim for pending job `id`: the fewest preemptible jobs idle past the window and
    /// the grace (longest idle first) whose release lets it fit. The caller starts `id` on
    /// them in the same pass, so the GPUs never go back to an idle job.
    pub(crate) fn reclaim_idle_for(&mut self, now: Time, id: JobId, requeue: bool) -> Vec<Action> {
        let mut due = self.idle_due(now);
        due.sort_unstable();
        let ordered: Vec<JobId> = due.into_iter().map(|(_, v)| v).collect();
        match self.select_victims(id, &ordered, None) {
            Some(victims) => victims
                .into_iter()
                .map(|v| self.preempt(now, v, PreemptReason::Idle, requeue))
                .collect(),
            None => Vec::new(),
        }
    }

    /// Preemptible running jobs idle past the window and the grace: (idle since, job).
    fn idle_due(&self, now: Time) -> Vec<(Time, JobId)> {
        let wait = self.config.idle.window + self.config.idle.grace;
        self.idle
            .iter()
            .filter_map(|id| self.jobs.get(id).map(|j| (*id, j)))
            .filter(|(_, j)| matches!(j.state, JobState::Running { .. }) && j.spec.preemptible)
            .filter_map(|(id, j)| j.idle_since.filter(|s| s + wait <= now).map(|s| (s, id)))
            .collect()
    }

    /// Whether any job is due for idle reclaim.
    pub(crate) fn any_idle_due(&self, now: Time) -> bool {
        !self.idle_due(now).is_empty()
    }
}
