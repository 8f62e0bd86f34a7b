//! One scheduling pass: walk pending jobs in priority order and start, reserve, backfill or
//! preempt, per the policy.
//!
//! EASY backfill: the first job that cannot start gets a reservation: the earliest time `at`
//! when, releasing running jobs in order of their time-limit deadlines, enough nodes have
//! enough free GPUs for its gang, on chosen nodes. Every later job may start now only if it
//! ends by `at` (by its own time limit) or if, on each reserved node, it leaves the GPUs the
//! reservation needs. So backfill never delays the reserved job (unless a running job
//! overruns... it cannot: time limits are enforced).

use crate::cluster::{Cluster, NodeState, Placement};
use crate::ids::{JobId, Millis, SECOND, Time, User};
use crate::job::{GpuShare, PendingReason, PreemptReason, Qos, Shape};
use crate::placement::find;
use crate::policy::{Config, IdleAction, PolicyKind, fairshare_factor, size_factor};
use crate::scheduler::{Action, Job, JobState, Scheduler};
use crate::share::find_share;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::cmp::Ordering;

/// The size factor's weight under perch's own: among jobs whose factors tie (jobs submitted
/// since the last refresh that fit their account's equal part all have a finish-time ratio of
/// 1), the smaller request in GPU-time goes first. Too small to outweigh any other factor.
const SIZE_TIE_BREAK: f64 = 1e-6;

/// Queue order: higher priority first, then earlier submission, then lower id.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct OrderKey(f64, Time, JobId);

impl PartialEq for OrderKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for OrderKey {}
impl PartialOrd for OrderKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrderKey {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .0
            .total_cmp(&self.0)
            .then(self.1.cmp(&other.1))
            .then(self.2.cmp(&other.2))
    }
}

pub(crate) fn order_key(_config: &Config, j: &Job) -> OrderKey {
    OrderKey(j.priority, j.spec.submit, j.spec.id)
}

/// A placement on the first of `models` (each a model index, or any model) that has room.
fn find_among(
    cluster: &Cluster,
    shape: Shape,
    models: &[Option<usize>],
    cap: impl Fn(usize) -> u32,
) -> Option<Placement> {
    models.iter().find_map(|&m| find(cluster, shape, m, &cap))
}

/// A place for a GPU share on the first of `models` that has room, and whether it opens a
/// fresh GPU.
fn find_share_among(
    cluster: &Cluster,
    share: GpuShare,
    models: &[Option<usize>],
    cap: impl Fn(usize) -> u32,
) -> Option<(crate::cluster::NodeAlloc, bool)> {
    models
        .iter()
        .find_map(|&m| find_share(cluster, share, m, &cap))
}

/// A free instance of MIG `profile` on an Up node of the first of `models` that has one, on a
/// healthy GPU, as the GPU's one-bit placement: the node with the fewest free instances of
/// the profile (packing), then the lowest. The instance itself is booked at the start.
fn find_mig(
    cluster: &Cluster,
    profile: &str,
    models: &[Option<usize>],
) -> Option<crate::cluster::NodeAlloc> {
    models.iter().find_map(|&model| {
        let mut best: Option<(usize, usize, u32)> = None;
        for (ni, n) in cluster.nodes.iter().enumerate() {
            if n.state != NodeState::Up || model.is_some_and(|m| m != n.model) {
                continue;
            }
            let free: Vec<u32> = n
                .spec
                .mig
                .iter()
                .zip(&n.mig_holder)
                .filter(|(m, h)| {
                    h.is_none() && m.profile == profile && n.unhealthy & (1 << m.gpu) == 0
                })
                .map(|(m, _)| m.gpu)
                .collect();
            let Some(&gpu) = free.first() else {
                continue;
            };
            if best.is_none_or(|(count, _, _)| free.len() < count) {
                best = Some((free.len(), ni, gpu));
            }
        }
        best.map(|(_, ni, gpu)| crate::cluster::NodeAlloc {
            node: crate::ids::NodeId(ni as u32),
            mask: 1 << gpu,
        })
    })
}

/// What a placement lookup in a pass depends on besides the cluster and the reservation: the
/// gang or share, the models it may go on, and whether the reservation caps it.
type LookupKey = (Shape, Option<GpuShare>, Models, bool);

/// The models a lookup may place on: one (or any), or several (per-model quotas); the common
/// case allocates nothing.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Models {
    One(Option<usize>),
    Many(Vec<Option<usize>>),
}

impl Models {
    fn of(models: &[Option<usize>]) -> Models {
        match models {
            [m] => Models::One(*m),
            _ => Models::Many(models.to_vec()),
        }
    }
}

/// Placement lookups that found nothing since the pass last changed the cluster. Every change
/// a pass makes (a start, a preemption) adds an action, and the reservation is set once,
/// before any capped lookup, so until the action count moves the same lookup finds nothing
/// again: a pass behind a blocked gang answers a queue of similar jobs from here instead of
/// scanning every node for each (the pass costs about the same in any queue order).
#[derive(Default)]
struct Misses {
    keys: HashSet<LookupKey>,
    actions: usize,
}

impl Misses {
    /// `lookup()`, unless the same key found nothing with `actions` actions taken.
    fn find<T>(
        &mut self,
        actions: usize,
        key: LookupKey,
        lookup: impl FnOnce() -> Option<T>,
    ) -> Option<T> {
        if actions != self.actions {
            self.keys.clear();
            self.actions = actions;
        }
        if self.keys.contains(&key) {
            return None;
        }
        let found = lookup();
        if found.is_none() {
            self.keys.insert(key);
        }
        found
    }
}

/// What decides whether any node could ever run a job: its gang, the GPU memory of its share,
/// its model.
type NeedKey = (Shape, Option<u64>, Option<usize>);

/// A reservation for the first blocked job.
struct Reservation {
    at: Time,
    /// GPUs a job running past `at` may still take on each reserved node.
    spare: HashMap<usize, u32>,
}

impl Scheduler {
    /// Remaining oracle run time (SRTF), counting the current run.
    pub(crate) fn remaining(&self, j: &Job, now: Time) -> i64 {
        let total = j.spec.oracle_duration.unwrap_or(j.spec.time_limit);
        let running = match j.state {
            JobState::Running { start, .. } => now - start,
            JobState::Pending(_) => 0,
        };
        total - j.progress - running
    }

    /// GPU-seconds the job has run so far, over all its runs: LAS's attained service.
    pub(crate) fn attained(&self, j: &Job, now: Time) -> f64 {
        let running = match j.state {
            JobState::Running { start, .. } => now - start,
            JobState::Pending(_) => 0,
        };
        f64::from(j.spec.gpu_hundredths()) / 100.0 * (j.progress + running).max(0) as f64 / 1000.0
    }

    /// The job's Gittins index over the service of finished jobs; before enough have finished,
    /// LAS's two queues below any index (-1 for the first, -2 for the second).
    pub(crate) fn gittins(&self, j: &Job, now: Time) -> f64 {
        match self.service.index(self.attained(j, now)) {
            Some(index) => index,
            None if self.least_served(j, now) => -1.0,
            None => -2.0,
        }
    }

    /// Whether the job may preempt as LAS's first queue does: under LAS, where it has attained
    /// less than the threshold; under Gittins, the same before there is an index (after, an
    /// index does not preempt: with the preemption cost on, preempting for a higher index lost
    /// more than it won on the scorecard, scheduler/BENCHMARKS.md).
    pub(crate) fn las_phase(&self, j: &Job, now: Time) -> bool {
        match self.config.kind {
            PolicyKind::Gittins => !self.service.learned() && self.least_served(j, now),
            _ => self.least_served(j, now),
        }
    }

    /// Whether LAS puts the job in its first queue (it has attained less than the threshold).
    pub(crate) fn least_served(&self, j: &Job, now: Time) -> bool {
        self.attained(j, now) < self.config.las_threshold_gpu_seconds
    }

    /// The run the job is expected to need: its time limit, or, with
    /// [`crate::Config::predict_from_history`], the shorter run its user's recent finished jobs
    /// predict (`history.rs`).
    pub(crate) fn expected_run(&self, j: &Job) -> Millis {
        let limit = j.run_limit();
        match self.config.predict_from_history {
            true => self
                .history
                .predict(&j.spec.user, j.spec.gpu_hundredths(), limit)
                .map_or(limit, |p| p.min(limit)),
            false => limit,
        }
    }

    /// Themis' finish-time fairness `rho = T_shared / T_ideal` of the job now: the time since
    /// its submission plus what is left of its expected run, over that run stretched by how
    /// far its GPUs exceed an equal part of the cluster (`fair_gpus`). Above 1, the
    /// job is behind the finish an equal part would have given it.
    pub(crate) fn finish_time_fairness(&self, j: &Job, now: Time, expected: Millis) -> f64 {
        let expected = expected.max(SECOND) as f64;
        let running = match j.state {
            JobState::Running { start, .. } => now - start,
            JobState::Pending(_) => 0,
        };
        let left = (expected - (j.progress + running) as f64).max(0.0);
        let since_submit = (now - j.spec.submit).max(0) as f64;
        let gpus = f64::from(j.spec.gpu_hundredths()) / 100.0;
        let ideal = expected * (gpus / self.fair_gpus.max(1e-9)).max(1.0);
        (since_submit + left) / ideal
    }

    /// Each active account's equal part of the cluster's GPUs (Themis' `1/N` of the cluster,
    /// N the accounts with a job pending or running, as Themis divides among apps: an account
    /// that floods the queue with small jobs does not shrink another's part).
    pub(crate) fn equal_part(&self) -> f64 {
        let active = self.accounts.iter().filter(|a| a.unfinished > 0).count();
        f64::from(self.cluster.total_gpus()) / active.max(1) as f64
    }

    /// How long the job has waited, when that is past the starvation bound (perch, LAS): a
    /// job that has waited longer than `starved_after_limits` times its time limit, twice that
    /// for Low QOS (scavenger work waits behind the rest, but not without end).
    pub(crate) fn starved_wait(&self, j: &Job, now: Time) -> Option<f64> {
        let c = &self.config;
        let wait = (now - j.spec.submit).max(0) as f64;
        let tier = if j.spec.qos == Qos::Low { 2.0 } else { 1.0 };
        (c.starved_after_limits > 0.0
            && wait > tier * c.starved_after_limits * j.run_limit() as f64)
            .then_some(wait)
    }

    /// The job's priority now (higher runs first).
    pub(crate) fn priority_of(&self, j: &Job, now: Time) -> f64 {
        match self.config.kind {
            PolicyKind::Fifo | PolicyKind::Backfill => 0.0,
            PolicyKind::Srtf => -(self.remaining(j, now) as f64),
            // Starved jobs first (the longest-waiting first), then the first queue, then the
            // second; submission order within each.
            PolicyKind::Las => match self.starved_wait(j, now) {
                Some(wait) => 1.0 + wait / 1000.0,
                None if self.least_served(j, now) => 0.0,
                None => -1.0,
            },
            // Starved jobs first (an index is at most 1), then by index.
            PolicyKind::Gittins => match self.starved_wait(j, now) {
                Some(wait) => 2.0 + wait / 1000.0,
                None => self.gittins(j, now),
            },
            // Starved jobs first, then by finish-time fairness (a ratio is under 1e12 for any
            // job submitted less than 30,000 years ago: its expected run is at least a second).
            PolicyKind::Themis => match self.starved_wait(j, now) {
                Some(wait) => 1e12 + wait / 1000.0,
                None => self.finish_time_fairness(j, now, self.expected_run(j)),
            },
            PolicyKind::Perch => {
                let c = &self.config;
                let w = c.weights;
                if let Some(wait) = self.starved_wait(j, now) {
                    // Starved: above every job that is not (the weights bound the others),
                    // the longest-waiting first.
                    return w.age + w.fairshare + w.qos + w.size + w.finish + 1.0 + wait / 1000.0;
                }
                let wait = (now - j.spec.submit).max(0) as f64;
                let age = (wait / c.age_max.max(1) as f64).min(1.0);
                let total: f64 = self.accounts.iter().map(|a| a.usage).sum();
                let share = self.share(j.account);
                let fs = fairshare_factor(self.accounts[j.account].usage, total, share);
                let expected = self.expected_run(j);
                let gpus = f64::from(j.spec.gpu_hundredths()) / 100.0;
                let size = size_factor(gpus * expected as f64 / 1000.0, c.size_max_gpu_seconds);
                let rho = self.finish_time_fairness(j, now, expected);
                let finish = rho / (1.0 + rho);
                w.age * age
                    + w.fairshare * fs
                    + w.qos * j.spec.qos.factor()
                    + (w.size + SIZE_TIE_BREAK) * size
                    + w.finish * finish
            }
        }
    }

    /// The account's fair share: its quota's part of all quotas, or an equal part.
    fn share(&self, account: usize) -> f64 {
        let total: u32 = self.accounts.iter().filter_map(|a| a.quota).sum();
        match self.accounts[account].quota {
            Some(q) if total > 0 => (q as f64 / total as f64).max(1e-3),
            _ => 1.0 / self.accounts.len().max(1) as f64,
        }
    }

    /// Every `priority_period`: decays usage, charges running jobs, recomputes priorities and
    /// re-sorts the queue. In between, only drops jobs that left the queue.
    fn refresh_priorities(&mut self, now: Time) {
        // Only perch's, LAS's, Gittins' and Themis' priorities move with time (attained
        // service, waiting, the starvation bound); the others are fixed at submission.
        if now < self.next_priority_at
            || !matches!(
                self.config.kind,
                PolicyKind::Perch | PolicyKind::Las | PolicyKind::Gittins | PolicyKind::Themis
            )
        {
            if self.queue.len() > 2 * self.pending_len() + 64 {
                self.queue.retain(|id| {
                    matches!(
                        self.jobs.get(id).map(|j| &j.state),
                        Some(JobState::Pending(_))
                    )
                });
            }
            return;
        }
        self.next_priority_at = now + self.config.priority_period;
        if matches!(self.config.kind, PolicyKind::Perch | PolicyKind::Themis) {
            self.fair_gpus = self.equal_part();
        }
        if let Some(last) = self.usage_decayed_at {
            let factor =
                (-((now - last) as f64) / self.config.usage_half_life.max(1) as f64).exp2();
            for a in &mut self.accounts {
                a.usage *= factor;
            }
        }
        self.usage_decayed_at = Some(now);
        let running: Vec<JobId> = self.deadlines.iter().map(|&(_, id)| id).collect();
        for id in running {
            if let Some(j) = self.jobs.get_mut(&id)
                && let JobState::Running { start, .. } = j.state
            {
                let from = j.charged_until.max(start);
                self.accounts[j.account].usage +=
                    (now - from).max(0) as f64 * f64::from(j.spec.gpu_hundredths()) / 100.0;
                j.charged_until = now;
            }
        }
        let mut queue = std::mem::take(&mut self.queue);
        queue.retain(|id| {
            matches!(
                self.jobs.get(id).map(|j| &j.state),
                Some(JobState::Pending(_))
            )
        });
        let mut keyed: Vec<(OrderKey, JobId)> = Vec::with_capacity(queue.len());
        for id in queue {
            let Some(j) = self.jobs.get(&id) else {
                continue;
            };
            let p = self.priority_of(j, now);
            if let Some(j) = self.jobs.get_mut(&id) {
                j.priority = p;
                keyed.push((order_key(&self.config, j), id));
            }
        }
        keyed.sort_unstable_by_key(|a| a.0);
        self.queue = keyed.into_iter().map(|(_, id)| id).collect();
    }

    fn set_reason(&mut self, id: JobId, reason: PendingReason) {
        if let Some(j) = self.jobs.get_mut(&id) {
            j.state = JobState::Pending(reason);
        }
    }

    /// Whether no node, even empty and healthy, could ever hold the gang (or the share: no
    /// node that allows sharing, or none whose GPUs have that much memory).
    fn unsatisfiable(&self, j: &Job) -> bool {
        if let Some(share) = j.spec.share {
            return !self.cluster.nodes.iter().any(|n| {
                n.state != NodeState::Down
                    && n.spec.sharing
                    && j.model.is_none_or(|m| m == n.model)
                    && n.mem_total
                        .iter()
                        .any(|t| t.is_none_or(|t| t >= share.memory_mb))
            });
        }
        let fit = self
            .cluster
            .nodes
            .iter()
            .filter(|n| n.state != NodeState::Down)
            .filter(|n| {
                j.model.is_none_or(|m| m == n.model) && n.spec.gpus >= j.spec.shape.gpus_per_node
            })
            .count();
        fit < j.spec.shape.nodes as usize
    }

    /// [`Scheduler::unsatisfiable`], worked out once per pass for each kind of request in
    /// `memo`: it depends only on the request and the nodes, which a pass does not change. A
    /// queue of 20,000 jobs no node could serve (an array with a typo) cost a scan of all
    /// 4,000 nodes for each of them, every pass: 175 ms (scheduler/BENCHMARKS.md).
    fn unsatisfiable_in(&self, j: &Job, memo: &mut HashMap<NeedKey, bool>) -> bool {
        let key = (j.spec.shape, j.spec.share.map(|s| s.memory_mb), j.model);
        *memo.entry(key).or_insert_with(|| self.unsatisfiable(j))
    }

    /// Whether some shared GPU on an Up node could take more (a pass goes on looking while it
    /// could, even with no free GPU left).
    fn share_room(&self) -> bool {
        self.cluster.sharing_nodes > 0
            && self.cluster.nodes.iter().any(|n| {
                n.spec.sharing && n.state == NodeState::Up && {
                    let mut m = n.shared & !n.unhealthy;
                    let mut room = false;
                    while m != 0 && !room {
                        let i = m.trailing_zeros() as usize;
                        m &= m - 1;
                        room = n.share_percent(i) < 100;
                    }
                    room
                }
            })
    }

    /// Whether some Up node has a free MIG instance on a healthy GPU (a pass goes on looking
    /// while one does, even with no free GPU left).
    fn mig_room(&self) -> bool {
        self.cluster.mig_nodes > 0
            && self.cluster.nodes.iter().any(|n| {
                n.state == NodeState::Up
                    && n.spec
                        .mig
                        .iter()
                        .zip(&n.mig_holder)
                        .any(|(m, h)| h.is_none() && n.unhealthy & (1 << m.gpu) == 0)
            })
    }

    /// Whether no node that is not down has an instance of the job's MIG profile (of its
    /// model, when it names one).
    fn no_mig_profile(&self, j: &Job, profile: &str) -> bool {
        !self.cluster.nodes.iter().any(|n| {
            n.state != NodeState::Down
                && j.model.is_none_or(|m| m == n.model)
                && n.spec.mig.iter().any(|m| m.profile == profile)
        })
    }

    fn free_total(&self) -> u32 {
        self.cluster.free_of(None)
    }

    /// Runs one scheduling pass at `now`.
    pub fn schedule(&mut self, now: Time) -> Vec<Action> {
        let mut out = Vec::new();
        self.passes += 1;
        self.refresh_priorities(now);
        self.fifo_blocked = false;
        // Idle reclaim frees GPUs for one waiting job at a time, inside the pass (below), so the
        // GPUs go to that job: never back to the idle job itself.
        let idle_reclaim = match self.config.idle.action {
            IdleAction::Reclaim { requeue } if self.any_idle_due(now) => Some(requeue),
            _ => None,
        };
        // Jobs requeued during the pass land in `self.queue` and are merged back after it.
        let order = std::mem::take(&mut self.queue);
        let kind = self.config.kind;
        let quotas = self.config.has_quotas();
        let mut reservation: Option<Reservation> = None;
        let mut misses = Misses::default();
        let mut unsatisfiable = HashMap::default();
        let mut holder: Option<JobId> = None;
        let mut fifo_blocked = false;
        let mut reclaims_left = self.config.max_reclaims_per_pass;
        let mut free = self.free_total();
        let share_room = self.share_room();
        let mig_room = self.mig_room();
        // Starvation reclaim can start a job only while a one-node job past its bound waits:
        // without one, a full cluster still ends the pass early.
        let starved_waiting = kind == PolicyKind::Perch
            && self.config.starved_reclaim
            && order.iter().any(|id| {
                self.jobs.get(id).is_some_and(|j| {
                    matches!(j.state, JobState::Pending(_))
                        && j.spec.shape.nodes == 1
                        && self.starved_wait(j, now).is_some()
                })
            });
        // Users with a run that starvation reclaim began: their other starved jobs wait for
        // it, so a user cannot chain short jobs to stop many others' jobs at once.
        let mut rescuers: HashSet<User> = if starved_waiting {
            self.deadlines
                .iter()
                .filter_map(|(_, v)| self.jobs.get(v))
                .filter(|j| j.rescued)
                .map(|j| j.spec.user.clone())
                .collect()
        } else {
            HashSet::default()
        };
        let preempting = match kind {
            PolicyKind::Srtf => true,
            PolicyKind::Perch => (quotas && self.config.reclaim) || starved_waiting,
            PolicyKind::Las | PolicyKind::Gittins => true,
            PolicyKind::Fifo | PolicyKind::Backfill | PolicyKind::Themis => false,
        };
        for &id in &order {
            // Nothing more can start: later jobs keep their last reason.
            if fifo_blocked
                || (free == 0
                    && !share_room
                    && !mig_room
                    && (reservation.is_some() || kind == PolicyKind::Srtf)
                    && (!preempting || reclaims_left == 0)
                    && idle_reclaim.is_none())
            {
                break;
            }
            let Some(j) = self.jobs.get(&id) else {
                continue;
            };
            // A job this pass stopped (its entry from before it started is still in `order`)
            // waits for the next pass at its new place.
            if !matches!(j.state, JobState::Pending(_)) || j.queued_in == self.passes {
                continue;
            }
            let shape = j.spec.shape;
            let own_model = [j.model];
            let capped = self.quota_models(j);
            let within = self.accounts[j.account].within(j.spec.gpu_hundredths())
                && capped.as_ref().is_none_or(|room| !room.is_empty());
            // Borrowed GPUs must come back when their owner needs them, so only a job that may
            // be preempted borrows: one that may not, past its account's quota, held another
            // account's guaranteed GPUs until its time limit (found running the release
            // binary, whose CLI submits jobs not preemptible unless told). A server refuses a
            // job that could only ever borrow unless it is preemptible (`beyond_quota`).
            if quotas && !within && (!self.config.borrowing || !j.spec.preemptible) {
                self.set_reason(id, PendingReason::QuotaExceeded);
                continue;
            }
            // Where it may go: within its per-model quotas, the models with room for it; else
            // (no per-model quota, or borrowing) its own constraint.
            let room: Vec<Option<usize>>;
            let models: &[Option<usize>] = match capped {
                Some(r) if within => {
                    room = r.into_iter().map(Some).collect();
                    &room
                }
                _ => &own_model,
            };
            if let Some(profile) = j.spec.gpu_profile.clone() {
                // A job on a MIG instance takes no whole GPU: like a share, it neither
                // preempts nor reserves.
                if let Some(alloc) = find_mig(&self.cluster, &profile, models) {
                    out.push(self.start(now, id, vec![alloc]));
                    continue;
                }
                let reason = if self.no_mig_profile(j, &profile) {
                    PendingReason::Unsatisfiable
                } else {
                    PendingReason::Resources
                };
                fifo_blocked = kind == PolicyKind::Fifo && reason == PendingReason::Resources;
                self.set_reason(id, reason);
                continue;
            }
            if let Some(share) = j.spec.share {
                // A shared job fits on part of one GPU: it neither preempts nor reserves (a
                // fraction of a GPU frees up far more often than a whole gang).
                let ends_by = |r: &Reservation| now + j.run_limit() <= r.at;
                let capped = reservation.as_ref().filter(|r| !ends_by(r));
                let key = (shape, Some(share), Models::of(models), capped.is_some());
                let placed = misses.find(out.len(), key, || match capped {
                    Some(r) => find_share_among(&self.cluster, share, models, |i| {
                        r.spare.get(&i).copied().unwrap_or(u32::MAX)
                    }),
                    None => find_share_among(&self.cluster, share, models, |_| u32::MAX),
                });
                if let Some((alloc, fresh)) = placed {
                    if fresh {
                        free = free.saturating_sub(1);
                        if let Some(r) = &mut reservation
                            && now + j.run_limit() > r.at
                            && let Some(s) = r.spare.get_mut(&(alloc.node.0 as usize))
                        {
                            *s = s.saturating_sub(1);
                        }
                    }
                    out.push(self.start(now, id, vec![alloc]));
                    continue;
                }
                let reason = if self.unsatisfiable_in(j, &mut unsatisfiable) {
                    PendingReason::Unsatisfiable
                } else {
                    PendingReason::Resources
                };
                fifo_blocked = kind == PolicyKind::Fifo && reason == PendingReason::Resources;
                self.set_reason(id, reason);
                continue;
            }
            let quota_reclaim =
                kind == PolicyKind::Perch && quotas && within && self.config.reclaim;
            // Never for an account past its quota: starvation does not buy GPUs that other
            // accounts' quotas guarantee them.
            let starved = starved_waiting
                && shape.nodes == 1
                && (!quotas || within)
                && !rescuers.contains(&j.spec.user)
                && self.starved_wait(j, now).is_some();
            let may_preempt = reclaims_left > 0
                && (quota_reclaim
                    || starved
                    || kind == PolicyKind::Srtf
                    || (matches!(kind, PolicyKind::Las | PolicyKind::Gittins)
                        && self.las_phase(j, now)));
            let ends_by = |r: &Reservation| now + j.run_limit() <= r.at;
            let capped = reservation.as_ref().filter(|r| !ends_by(r));
            let key = (shape, None, Models::of(models), capped.is_some());
            let placed = match capped {
                _ if free < shape.gpus() => None,
                None => misses.find(out.len(), key, || {
                    find_among(&self.cluster, shape, models, |_| u32::MAX)
                }),
                Some(r) => misses.find(out.len(), key, || {
                    find_among(&self.cluster, shape, models, |i| {
                        r.spare.get(&i).copied().unwrap_or(u32::MAX)
                    })
                }),
            };
            let fits_now = |misses: &mut Misses, cluster: &Cluster, actions: usize| {
                misses
                    .find(actions, (shape, None, Models::of(models), false), || {
                        find_among(cluster, shape, models, |_| u32::MAX)
                    })
                    .is_some()
            };
            if let Some(p) = placed {
                if let Some(r) = &mut reservation
                    && now + j.run_limit() > r.at
                {
                    for a in &p {
                        if let Some(s) = r.spare.get_mut(&(a.node.0 as usize)) {
                            *s = s.saturating_sub(a.mask.count_ones());
                        }
                    }
                }
                free -= shape.gpus();
                out.push(self.start(now, id, p));
                continue;
            }
            if may_preempt && !fits_now(&mut misses, &self.cluster, out.len()) {
                reclaims_left -= 1;
                let mut preempted = match kind {
                    PolicyKind::Srtf => self.preempt_longer(now, id),
                    PolicyKind::Las => self.preempt_more_served(now, id),
                    PolicyKind::Gittins => self.preempt_more_served(now, id),
                    _ if quota_reclaim => self.reclaim_quota(now, id, models),
                    _ => Vec::new(),
                };
                let mut rescue = false;
                if preempted.is_empty() && starved {
                    preempted = self.reclaim_for_starved(now, id, models);
                    rescue = !preempted.is_empty();
                }
                if !preempted.is_empty() {
                    out.extend(preempted);
                    if let Some(p) = find_among(&self.cluster, shape, models, |_| u32::MAX) {
                        out.push(self.start(now, id, p));
                        if rescue && let Some(j) = self.jobs.get_mut(&id) {
                            j.rescued = true;
                            rescuers.insert(j.spec.user.clone());
                        }
                    }
                    free = self.free_total();
                    continue;
                }
            }
            if let Some(requeue) = idle_reclaim
                && !fits_now(&mut misses, &self.cluster, out.len())
            {
                let preempted = self.reclaim_idle_for(now, id, models, requeue);
                if !preempted.is_empty() {
                    out.extend(preempted);
                    if let Some(p) = find_among(&self.cluster, shape, models, |_| u32::MAX) {
                        out.push(self.start(now, id, p));
                    }
                    free = self.free_total();
                    continue;
                }
            }
            if reservation.is_some() || kind == PolicyKind::Srtf {
                let reason = if reservation.is_some() {
                    PendingReason::Priority
                } else {
                    PendingReason::Resources
                };
                self.set_reason(id, reason);
                continue;
            }
            let Some(j) = self.jobs.get(&id) else {
                continue;
            };
            if self.unsatisfiable_in(j, &mut unsatisfiable) {
                self.set_reason(id, PendingReason::Unsatisfiable);
                continue;
            }
            if kind == PolicyKind::Fifo {
                self.set_reason(id, PendingReason::Resources);
                fifo_blocked = true;
                continue;
            }
            reservation = models
                .iter()
                .filter_map(|&m| self.reserve(now, id, m))
                .min_by_key(|r| r.at);
            let reason = reservation.as_ref().map_or(PendingReason::Resources, |r| {
                PendingReason::Reserved { at: r.at }
            });
            if reservation.is_some() {
                holder = Some(id);
            }
            self.set_reason(id, reason);
        }
        // The job the last pass reserved for, now behind another that holds the reservation
        // (a pass stops where nothing more can start, before it reaches that job again): it
        // waits for priority, not for GPUs reserved to it.
        if let Some(before) = std::mem::replace(&mut self.reserved_for, holder)
            && holder != Some(before)
            && matches!(
                self.jobs.get(&before).map(|j| &j.state),
                Some(JobState::Pending(PendingReason::Reserved { .. }))
            )
        {
            self.set_reason(before, PendingReason::Priority);
        }
        self.fifo_blocked = fifo_blocked;
        let requeued = std::mem::replace(&mut self.queue, order);
        for id in requeued {
            self.drop_stale_entry(id);
            self.insert_in_queue(id);
        }
        out
    }

    /// The earliest time `id`'s gang fits if running jobs leave at their deadlines, and the
    /// nodes it would take then.
    fn reserve(&self, now: Time, id: JobId, model: Option<usize>) -> Option<Reservation> {
        let j = self.jobs.get(&id)?;
        if self.unsatisfiable(j) {
            return None;
        }
        let g = j.spec.shape.gpus_per_node;
        let k = j.spec.shape.nodes;
        let nodes = &self.cluster.nodes;
        let mut hyp: HashMap<usize, u32> = HashMap::default();
        let mut sharers_left = HashMap::default();
        let mut count = self.cluster.nodes_with_free(model, g);
        let mut at = now;
        if count < k {
            let mut reached = false;
            for &(end, victim) in &self.deadlines {
                for (i, mask) in self.freed_by(victim, &mut sharers_left, true) {
                    let n = &nodes[i];
                    if n.state != NodeState::Up || model.is_some_and(|m| m != n.model) {
                        continue;
                    }
                    let f = hyp.entry(i).or_insert_with(|| n.free());
                    let before = *f;
                    *f += (mask & !n.unhealthy).count_ones();
                    if before < g && *f >= g {
                        count += 1;
                    }
                }
                if count >= k {
                    at = end.max(now);
                    reached = true;
                    break;
                }
            }
            if !reached {
                return None;
            }
        }
        // Reserve on the nodes that are fullest now, so free nodes stay open to backfill.
        let mut cands: Vec<(u32, usize, u32)> = (0..nodes.len())
            .filter(|&i| model.is_none_or(|m| m == nodes[i].model))
            .map(|i| {
                (
                    nodes[i].free(),
                    i,
                    hyp.get(&i).copied().unwrap_or_else(|| nodes[i].free()),
                )
            })
            .filter(|&(_, _, at_free)| at_free >= g)
            .collect();
        cands.sort_unstable();
        let spare = cands
            .into_iter()
            .take(k as usize)
            .map(|(_, i, at_free)| (i, at_free - g))
            .collect();
        Some(Reservation { at, spare })
    }

    /// Preempts a job for the pass (used by reclaim and SRTF).
    pub(crate) fn preempt_for(
        &mut self,
        now: Time,
        victims: Vec<JobId>,
        reason: PreemptReason,
    ) -> Vec<Action> {
        victims
            .into_iter()
            .map(|v| self.preempt(now, v, reason, true))
            .collect()
    }
}
