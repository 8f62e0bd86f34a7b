//! When will each pending job start? Slurm's `squeue --start`, from the scheduler's own view.
//!
//! [`Scheduler::start_plan`] takes a snapshot (cheap: per node its free GPUs and the releases
//! running jobs promise at their time limits; the first pending jobs in queue order) that
//! [`StartPlan::estimate`] walks forward in time away from the scheduler's lock: each job in
//! turn gets the earliest time at which enough nodes keep enough GPUs free for its whole time
//! limit, counting the GPUs of the jobs planned before it. Running jobs are assumed to run to
//! their limits, so an estimate is a latest start ("at the latest") unless jobs end early or a
//! new one outranks it. A job backfill reserved GPUs for keeps the reservation's own time.

use crate::cluster::NodeState;
use crate::ids::{JobId, Time};
use crate::job::PendingReason;
use crate::scheduler::{JobState, Scheduler};

/// What one pending job needs, for the plan.
#[derive(Clone, Debug)]
struct Want {
    job: JobId,
    nodes: u32,
    gpus_per_node: u32,
    model: Option<usize>,
    limit: Time,
    /// The scheduler's own time for it (a backfill reservation), if it has one.
    reserved_at: Option<Time>,
    /// Cannot be planned: over its quota, or no node can ever run it.
    skip: bool,
}

/// One node's GPUs over time: free now, and the changes to come.
#[derive(Clone, Debug)]
struct Profile {
    model: usize,
    free: i64,
    /// (time, change of free GPUs), sorted by time.
    changes: Vec<(Time, i64)>,
}

impl Profile {
    /// Free GPUs at every moment of `[from, to)`: the least of them.
    fn min_free(&self, from: Time, to: Time) -> i64 {
        let mut free = self.free;
        let mut least = i64::MAX;
        let mut i = 0;
        while i < self.changes.len() && self.changes[i].0 <= from {
            free += self.changes[i].1;
            i += 1;
        }
        least = least.min(free);
        // Changes at one instant happen together (a release and a hold at the same time
        // hand the GPUs over): the count is taken after all of them.
        while i < self.changes.len() && self.changes[i].0 < to {
            let at = self.changes[i].0;
            while i < self.changes.len() && self.changes[i].0 == at {
                free += self.changes[i].1;
                i += 1;
            }
            least = least.min(free);
        }
        least
    }

    /// The earliest start at or after `from` with `need` GPUs free for `len`: a fit can only
    /// begin at `from` or where the free count changes.
    /// One sweep over the changes.
    fn earliest(&self, from: Time, len: Time, need: i64) -> Option<Time> {
        let mut free = self.free;
        let mut i = 0;
        while i < self.changes.len() && self.changes[i].0 <= from {
            free += self.changes[i].1;
            i += 1;
        }
        // The start of the current stretch with enough free, if the count is enough now.
        let mut start = (free >= need).then_some(from);
        while i < self.changes.len() {
            let at = self.changes[i].0;
            if let Some(s) = start
                && at >= s.saturating_add(len)
            {
                return Some(s);
            }
            // Every change at this instant, then the count from here on.
            while i < self.changes.len() && self.changes[i].0 == at {
                free += self.changes[i].1;
                i += 1;
            }
            match (start, free >= need) {
                (None, true) => start = Some(at),
                (Some(_), false) => start = None,
                _ => {}
            }
        }
        start
    }

    fn hold(&mut self, from: Time, to: Time, gpus: i64) {
        for change in [(from, -gpus), (to, gpus)] {
            let at = self.changes.partition_point(|c| c.0 <= change.0);
            self.changes.insert(at, change);
        }
    }
}

/// A snapshot of what decides start times; estimate away from the scheduler's lock.
#[derive(Clone, Debug)]
pub struct StartPlan {
    now: Time,
    nodes: Vec<Profile>,
    wants: Vec<Want>,
}

/// Most candidate times a gang tries after the first, and node-interval checks per plan:
/// bounds the work on a large cluster with a long queue (later jobs are then left without an
/// estimate).
const MAX_TIMES: usize = 512;
const MAX_CHECKS: usize = 50_000_000;

impl StartPlan {
    /// The estimated start of each planned job (queue order); `None`: no estimate (over its
    /// quota, never satisfiable, held, or past the planning horizon).
    pub fn estimate(mut self) -> Vec<(JobId, Option<Time>)> {
        let mut checks = 0usize;
        let mut out = Vec::with_capacity(self.wants.len());
        for w in std::mem::take(&mut self.wants) {
            if w.skip {
                out.push((w.job, None));
                continue;
            }
            let need = i64::from(w.gpus_per_node);
            let len = w.limit.max(1);
            let k = w.nodes as usize;
            let fits = |p: &Profile| w.model.is_none_or(|m| m == p.model);
            // Each node's own earliest fit; a one-node job takes the earliest of them.
            let mut earliest: Vec<(Time, usize)> = Vec::new();
            for (i, p) in self.nodes.iter().enumerate() {
                if checks > MAX_CHECKS {
                    break;
                }
                if !fits(p) {
                    continue;
                }
                checks += 1 + p.changes.len();
                if let Some(t) = p.earliest(self.now, len, need) {
                    earliest.push((t, i));
                }
            }
            earliest.sort_unstable();
            let mut found = None;
            if checks <= MAX_CHECKS && earliest.len() >= k && k > 0 {
                // A gang needs its k nodes free over the same interval: try the k-th earliest
                // time, then later change times, each with every node free then.
                let first = earliest[k - 1].0;
                let mut times: Vec<Time> = std::iter::once(first)
                    .chain(
                        earliest
                            .iter()
                            .map(|&(_, i)| i)
                            .flat_map(|i| self.nodes[i].changes.iter().map(|c| c.0))
                            .filter(|&t| t > first),
                    )
                    .collect();
                times.sort_unstable();
                times.dedup();
                times.truncate(MAX_TIMES);
                for t in times {
                    if checks > MAX_CHECKS {
                        break;
                    }
                    let end = t.saturating_add(len);
                    let mut chosen = Vec::with_capacity(k);
                    for &(e, i) in &earliest {
                        if e > t {
                            break;
                        }
                        checks += 1 + self.nodes[i].changes.len();
                        if self.nodes[i].min_free(t, end) >= need {
                            chosen.push(i);
                            if chosen.len() == k {
                                break;
                            }
                        }
                    }
                    if chosen.len() == k {
                        for i in chosen {
                            self.nodes[i].hold(t, end, need);
                        }
                        found = Some(t);
                        break;
                    }
                }
            }
            // The scheduler's own reservation is the time it has promised.
            out.push((w.job, w.reserved_at.or(found)));
        }
        out
    }
}

impl Scheduler {
    /// A snapshot for estimating the start of the first `max_jobs` pending jobs (see the
    /// module), or only as far as job `upto` (the jobs ahead of it decide its start).
    /// Shared-GPU jobs count as needing one whole GPU.
    pub fn start_plan(&self, now: Time, max_jobs: usize, upto: Option<JobId>) -> StartPlan {
        let nodes = self
            .cluster
            .nodes
            .iter()
            .map(|n| {
                let usable = n.state == NodeState::Up && !n.drained;
                Profile {
                    model: n.model,
                    free: if usable { i64::from(n.free()) } else { 0 },
                    changes: Vec::new(),
                }
            })
            .collect::<Vec<_>>();
        let mut plan = StartPlan {
            now,
            nodes,
            wants: Vec::new(),
        };
        for &(deadline, id) in &self.deadlines {
            let Some(JobState::Running { placement, .. }) = self.jobs.get(&id).map(|j| &j.state)
            else {
                continue;
            };
            let whole = self
                .jobs
                .get(&id)
                .is_some_and(|j| j.spec.share.is_none() && j.spec.gpu_profile.is_none());
            for a in placement {
                let Some(node) = self.cluster.nodes.get(a.node.0 as usize) else {
                    continue;
                };
                if !whole || node.state != NodeState::Up || node.drained {
                    continue;
                }
                let healthy = a.mask & !node.unhealthy;
                let p = &mut plan.nodes[a.node.0 as usize];
                p.changes
                    .push((deadline.max(now), i64::from(healthy.count_ones())));
            }
        }
        for p in &mut plan.nodes {
            p.changes.sort_unstable();
        }
        for entry in self.queue().into_iter().take(max_jobs) {
            let last = upto == Some(entry.job);
            let Some(j) = self.jobs.get(&entry.job) else {
                continue;
            };
            let shape = j.spec.shape;
            let (nodes, gpus_per_node) = if j.spec.share.is_some() {
                (1, 1)
            } else {
                (shape.nodes, shape.gpus_per_node)
            };
            plan.wants.push(Want {
                job: entry.job,
                nodes,
                gpus_per_node,
                model: j.model,
                limit: j.run_limit(),
                reserved_at: match entry.reason {
                    PendingReason::Reserved { at } => Some(at),
                    _ => None,
                },
                // A job on a MIG instance waits for an instance, not for whole GPUs.
                skip: j.spec.gpu_profile.is_some()
                    || matches!(
                        entry.reason,
                        PendingReason::QuotaExceeded | PendingReason::Unsatisfiable
                    ),
            });
            if last {
                break;
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_free_over_an_interval_counts_every_change_inside_it() {
        let mut p = Profile {
            model: 0,
            free: 2,
            changes: vec![(10, 4), (20, -6)],
        };
        assert_eq!(p.min_free(0, 10), 2);
        assert_eq!(p.min_free(10, 20), 6);
        assert_eq!(p.min_free(0, 30), 0);
        p.hold(12, 15, 5);
        assert_eq!(p.min_free(10, 20), 1);
        assert_eq!(p.min_free(15, 20), 6);
        // 6 GPUs for 3 ms: not before 15 (the hold), and they are gone at 20.
        assert_eq!(p.earliest(0, 3, 6), Some(15));
        assert_eq!(p.earliest(0, 6, 6), None);
        assert_eq!(p.earliest(0, 100, 0), Some(0));
    }

    /// The one-sweep earliest fit agrees with trying every start, on many random profiles.
    #[test]
    fn the_earliest_fit_agrees_with_trying_every_start() {
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        for _ in 0..2_000 {
            let mut p = Profile {
                model: 0,
                free: next(5) as i64,
                changes: Vec::new(),
            };
            for _ in 0..next(8) {
                let at = next(50) as i64;
                let change = next(9) as i64 - 4;
                let i = p.changes.partition_point(|c| c.0 <= at);
                p.changes.insert(i, (at, change));
            }
            let (from, len, need) = (next(20) as i64, 1 + next(30) as i64, next(6) as i64);
            let brute = std::iter::once(from)
                .chain(p.changes.iter().map(|c| c.0).filter(|&t| t > from))
                .find(|&t| p.min_free(t, t + len) >= need);
            assert_eq!(
                p.earliest(from, len, need),
                brute,
                "{p:?} {from} {len} {need}"
            );
        }
    }
}
