//! Choosing victims: gang-aware reclaim of borrowed GPUs, starvation reclaim (for a one-node
//! job past its starvation bound, from jobs that declared longer limits), SRTF and LAS
//! preemption, and idle reclaim.
//!
//! Victims are always whole jobs (every GPU of a gang is freed together). Candidates are taken
//! cheapest first (jobs idle for the idle window before busy ones, then, for quota reclaim, the
//! jobs it has stopped least often, then the fewest GPU-milliseconds of work at stake) until the
//! waiting gang would fit; then every victim that turns out not to be needed is dropped again,
//! most expensive first, so the set is small and cheap.

use crate::cluster::NodeState;
use crate::ids::{JobId, Time};
use crate::job::PreemptReason;
use crate::scheduler::{Action, Job, JobState, Scheduler};
use rustc_hash::FxHashMap as HashMap;

/// What quota reclaim may take from an account: in all (`None`) or on one model.
type BudgetKey = (usize, Option<usize>);

/// A reclaim candidate's preference key: not idle for the window, times quota reclaim stopped
/// it before, GPU-milliseconds at stake, the later start first.
type VictimKey = (bool, u32, i64, std::cmp::Reverse<Time>);

/// Hundredths of a GPU each account may still give up: which allowance each candidate draws
/// on, with that allowance's size (by the candidates' order), and what is left of those used.
pub(crate) struct Budget<'a> {
    key: &'a [(BudgetKey, i64)],
    left: HashMap<BudgetKey, i64>,
}

impl Scheduler {
    /// The models job `j` may take GPUs of within its account's per-model quotas: `None` when
    /// no per-model quota restricts it, else the indices of the models (its own, or any) where
    /// its account has room for it (empty: none).
    pub(crate) fn quota_models(&self, j: &Job) -> Option<Vec<usize>> {
        let a = &self.accounts[j.account];
        if a.model_quota.is_empty() {
            return None;
        }
        let models = &self.cluster.models;
        let candidates: Vec<usize> = match j.model {
            // A model no node has: nothing can place it anyway.
            Some(m) if m >= models.len() => return None,
            Some(m) => vec![m],
            None => (0..models.len()).collect(),
        };
        let need = u64::from(j.spec.gpu_hundredths());
        let room: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&m| {
                self.model_cap(j.account, m)
                    .is_none_or(|q| u64::from(a.held_of(m)) + need <= u64::from(q) * 100)
            })
            .collect();
        if j.model.is_none() && room.len() == candidates.len() {
            return None;
        }
        Some(room)
    }

    /// Account `account`'s cap on the model with index `m`, if the policy names one.
    pub(crate) fn model_cap(&self, account: usize, m: usize) -> Option<u32> {
        let name = self.cluster.models.get(m)?;
        self.accounts[account]
            .model_quota
            .iter()
            .find(|(model, _)| model == name)
            .map(|(_, q)| *q)
    }

    /// The smallest prefix-then-pruned set of `candidates` (in preference order) whose release
    /// lets `id`'s gang fit, or `None`. A candidate whose release frees nothing the gang can
    /// use (all its nodes already have room for a rank in the what-if) is passed over, and
    /// with `budget` (hundredths of a GPU each account may give up) so is one its account
    /// cannot afford.
    pub(crate) fn select_victims(
        &self,
        id: JobId,
        model: Option<usize>,
        candidates: &[JobId],
        mut budget: Option<Budget<'_>>,
    ) -> Option<Vec<JobId>> {
        let j = self.jobs.get(&id)?;
        let g = j.spec.shape.gpus_per_node;
        let k = j.spec.shape.nodes;
        let nodes = &self.cluster.nodes;
        let mut hyp: HashMap<usize, u32> = HashMap::default();
        let mut sharers_left = HashMap::default();
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
        for (c, &v) in candidates.iter().enumerate() {
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
                let (key, excess) = budget
                    .key
                    .get(c)
                    .copied()
                    .unwrap_or(((job.account, None), 0));
                let left = budget.left.entry(key).or_insert(excess);
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

    /// Quota reclaim for `id` (within its account's quotas), placed on one of `models`:
    /// preempt jobs of accounts over their quota in all, or over their cap on the model the job
    /// runs on, never below it.
    pub(crate) fn reclaim_quota(
        &mut self,
        now: Time,
        id: JobId,
        models: &[Option<usize>],
    ) -> Vec<Action> {
        let Some(me) = self.jobs.get(&id).map(|j| j.account) else {
            return Vec::new();
        };
        let mut cands: Vec<(VictimKey, JobId, (BudgetKey, i64))> = Vec::new();
        for &(_, v) in &self.deadlines {
            let Some(job) = self.jobs.get(&v) else {
                continue;
            };
            let a = &self.accounts[job.account];
            let JobState::Running { start, placement } = &job.state else {
                continue;
            };
            let start = *start;
            if job.account == me || !job.spec.preemptible {
                continue;
            }
            // What the account holds beyond its quota (in all, else on the job's model) is the
            // allowance victims are chosen within: never below the quota.
            let over = |held: u32, q: u32| i64::from(held) - i64::from(q) * 100;
            let key = if !a.within(0) {
                let q = a.quota.unwrap_or(0);
                Some(((job.account, None), over(a.alloc, q)))
            } else {
                placement.iter().find_map(|p| {
                    let m = self.cluster.nodes[p.node.0 as usize].model;
                    let q = self.model_cap(job.account, m)?;
                    let excess = over(a.held_of(m), q);
                    (excess > 0).then_some(((job.account, Some(m)), excess))
                })
            };
            let Some(allowance) = key else {
                continue;
            };
            let cost = i64::from(job.spec.gpu_hundredths()) * (now - start).max(0);
            // Idle jobs go first, but only once idle for the policy's window: one low sample
            // (a job loading its data, or a reading taken before its agent launched it) must
            // not make a busy job the victim in place of a younger one.
            let idle = job
                .idle_since
                .is_some_and(|s| s + self.config.idle.window <= now);
            // The job stopped least often first: by work at stake alone, a borrower that just
            // restarted is always the cheapest, and on Philly at 384 GPUs with trace quotas one
            // job was stopped 240 times (scheduler/BENCHMARKS.md). Equal cost: the job started
            // last loses the least.
            let key = (!idle, job.reclaim_stops, cost, std::cmp::Reverse(start));
            cands.push((key, v, allowance));
        }
        cands.sort_unstable();
        let ordered: Vec<JobId> = cands.iter().map(|&(_, v, _)| v).collect();
        let allowances: Vec<(BudgetKey, i64)> = cands.iter().map(|&(_, _, a)| a).collect();
        let victims = models.iter().find_map(|&m| {
            let budget = Budget {
                key: &allowances,
                left: HashMap::default(),
            };
            self.select_victims(id, m, &ordered, Some(budget))
        });
        let Some(victims) = victims else {
            return Vec::new();
        };
        self.count_stops(&victims, |j| &mut j.reclaim_stops);
        self.preempt_for(now, victims, PreemptReason::QuotaReclaim { for_job: id })
    }

    /// SRTF: preempt running jobs with more remaining time than `id`, longest first, each at
    /// most `max_order_preemptions` times in its life.
    pub(crate) fn preempt_longer(&mut self, now: Time, id: JobId) -> Vec<Action> {
        let Some(mine) = self.jobs.get(&id).map(|j| self.remaining(j, now)) else {
            return Vec::new();
        };
        let mut cands: Vec<(std::cmp::Reverse<i64>, JobId)> = self
            .deadlines
            .iter()
            .filter_map(|&(_, v)| self.jobs.get(&v).map(|j| (v, j)))
            .filter(|(_, j)| {
                j.spec.preemptible && j.order_preemptions < self.config.max_order_preemptions
            })
            .map(|(v, j)| (std::cmp::Reverse(self.remaining(j, now)), v))
            .filter(|(r, _)| r.0 > mine)
            .collect();
        cands.sort_unstable();
        let ordered: Vec<JobId> = cands.into_iter().map(|(_, v)| v).collect();
        let model = self.jobs.get(&id).and_then(|j| j.model);
        let Some(victims) = self.select_victims(id, model, &ordered, None) else {
            return Vec::new();
        };
        self.count_stops(&victims, |j| &mut j.order_preemptions);
        self.preempt_for(now, victims, PreemptReason::ShorterJob { for_job: id })
    }

    /// Adds one to the counter `field` picks of each victim.
    fn count_stops(&mut self, victims: &[JobId], field: impl Fn(&mut Job) -> &mut u32) {
        for v in victims {
            if let Some(j) = self.jobs.get_mut(v) {
                *field(j) += 1;
            }
        }
    }

    /// Starvation reclaim for `id`, a one-node job past its starvation bound: preempt
    /// preemptible running jobs that declared a longer time limit, are not starved and are on
    /// their first run, the least work at stake first.
    pub(crate) fn reclaim_for_starved(
        &mut self,
        now: Time,
        id: JobId,
        models: &[Option<usize>],
    ) -> Vec<Action> {
        let Some(limit) = self.jobs.get(&id).map(|j| j.run_limit()) else {
            return Vec::new();
        };
        let mut cands: Vec<(i64, std::cmp::Reverse<Time>, JobId)> = self
            .deadlines
            .iter()
            .filter_map(|&(_, v)| self.jobs.get(&v).map(|j| (v, j)))
            .filter(|(_, j)| {
                j.spec.preemptible
                    && j.progress == 0
                    && j.spec.earlier_runs == 0
                    && j.run_limit() > limit
            })
            .filter(|(_, j)| self.starved_wait(j, now).is_none())
            .filter_map(|(v, j)| match j.state {
                // Never a job this very pass started: its start would be undone unseen.
                JobState::Running { start, .. } if start < now => Some((
                    i64::from(j.spec.gpu_hundredths()) * (now - start).max(0),
                    std::cmp::Reverse(start),
                    v,
                )),
                JobState::Running { .. } | JobState::Pending(_) => None,
            })
            .collect();
        cands.sort_unstable();
        let ordered: Vec<JobId> = cands.into_iter().map(|(_, _, v)| v).collect();
        let victims = models
            .iter()
            .find_map(|&m| self.select_victims(id, m, &ordered, None));
        match victims {
            Some(victims) => self.preempt_for(now, victims, PreemptReason::Starved { for_job: id }),
            None => Vec::new(),
        }
    }

    /// LAS: preempt running jobs of the second queue (attained service past the threshold)
    /// for `id`, most served first, each at most `max_order_preemptions` times in its life.
    pub(crate) fn preempt_more_served(&mut self, now: Time, id: JobId) -> Vec<Action> {
        let mut cands: Vec<(std::cmp::Reverse<u64>, JobId)> = self
            .deadlines
            .iter()
            .filter_map(|&(_, v)| self.jobs.get(&v).map(|j| (v, j)))
            .filter(|(_, j)| {
                j.spec.preemptible
                    && j.order_preemptions < self.config.max_order_preemptions
                    && !self.least_served(j, now)
            })
            .map(|(v, j)| (std::cmp::Reverse(self.attained(j, now) as u64), v))
            .collect();
        cands.sort_unstable();
        let ordered: Vec<JobId> = cands.into_iter().map(|(_, v)| v).collect();
        let model = self.jobs.get(&id).and_then(|j| j.model);
        let Some(victims) = self.select_victims(id, model, &ordered, None) else {
            return Vec::new();
        };
        self.count_stops(&victims, |j| &mut j.order_preemptions);
        self.preempt_for(now, victims, PreemptReason::LessServed { for_job: id })
    }

    /// Idle reclaim for pending job `id`: the fewest preemptible jobs idle past the window and
    /// the grace (longest idle first) whose release lets it fit. The caller starts `id` on
    /// them in the same pass, so the GPUs never go back to an idle job.
    pub(crate) fn reclaim_idle_for(
        &mut self,
        now: Time,
        id: JobId,
        models: &[Option<usize>],
        requeue: bool,
    ) -> Vec<Action> {
        let mut due = self.idle_due(now);
        due.sort_unstable();
        let ordered: Vec<JobId> = due.into_iter().map(|(_, v)| v).collect();
        let victims = models
            .iter()
            .find_map(|&m| self.select_victims(id, m, &ordered, None));
        match victims {
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
