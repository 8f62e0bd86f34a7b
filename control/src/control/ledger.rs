//! The control plane's books: what accounting needs it to remember as jobs and nodes change.
//! Each run of a job on a node opens an [`Allocation`] and closes it when the run ends; each
//! change of a node's state closes one [`NodeSpan`] and opens the next; each of these is also
//! an audit event for the store's `events` table. All of it is committed with the records
//! that changed, in the same job-database transaction (events once that commit is durable).
//!
//! Folding telemetry into allocations also lands here ([`Control::apply_fold`]), and so does
//! fair share: the scheduler core is told each account's decayed past usage, computed from
//! the allocations, at startup and after every fold.

use super::Control;
use crate::cost::{FoldWindow, Folded};
use crate::db::NodeRecord;
use crate::record::{Allocation, JobState, NodeSpan, NodeState};
use perch_model::ClusterEvent;
use perch_scheduler::{Account, Event};
use std::collections::BTreeMap;

impl Control {
    /// The state a node is in now, as accounting and `perch nodes` name it.
    pub fn node_state(&self, idx: usize) -> NodeState {
        let n = &self.nodes[idx];
        if n.down {
            NodeState::Down
        } else if n.record.drained {
            NodeState::Drained
        } else {
            NodeState::Up
        }
    }

    /// Closes node `idx`'s current span and opens one for its state now, if that changed.
    pub(super) fn track_node_state(&mut self, idx: usize, now: i64) {
        let state = self.node_state(idx);
        let gpus = self.nodes[idx].record.gpus;
        if let Some(&id) = self.ledger.open_spans.get(&idx)
            && let Some(span) = self.ledger.spans.get_mut(&id)
        {
            if span.state == state && span.gpus == gpus {
                return;
            }
            span.end_ms = Some(now.max(span.start_ms));
            self.ledger.dirty_spans.insert(id);
        }
        let id = self.ledger.spans.keys().next_back().map_or(1, |k| k + 1);
        self.ledger.spans.insert(
            id,
            NodeSpan {
                node: self.nodes[idx].record.name.clone(),
                gpus,
                state,
                start_ms: now,
                end_ms: None,
            },
        );
        self.ledger.open_spans.insert(idx, id);
        self.ledger.dirty_spans.insert(id);
    }

    /// Takes the node state history loaded from the job database (nodes already added).
    pub(super) fn restore_spans(&mut self, spans: Vec<(u64, NodeSpan)>) {
        for (id, span) in spans {
            if span.end_ms.is_none()
                && let Some(&idx) = self.node_index.get(&span.node)
            {
                // Two open spans for a node cannot be written by this code; keep the later.
                if let Some(old) = self.ledger.open_spans.insert(idx, id)
                    && let Some(s) = self.ledger.spans.get_mut(&old)
                {
                    s.end_ms = Some(span.start_ms.max(s.start_ms));
                    self.ledger.dirty_spans.insert(old);
                }
            }
            self.ledger.spans.insert(id, span);
        }
    }

    pub(super) fn event(&mut self, event: ClusterEvent) {
        self.ledger.events.push(event);
    }

    /// An event about job `id` (its owner's name is not the actor: `actor` says who acted).
    pub(super) fn job_event(
        &mut self,
        now: i64,
        id: u64,
        kind: &str,
        actor: &str,
        outcome: Option<&str>,
        message: String,
    ) {
        let node = self
            .jobs
            .get(&id)
            .and_then(|j| match j.placement.as_slice() {
                [one] => Some(one.node.clone()),
                _ => None,
            });
        self.event(ClusterEvent {
            job: Some(id),
            node,
            outcome: outcome.map(str::to_owned),
            ..ClusterEvent::new(now, kind, actor, message)
        });
    }

    /// `job_ended` for job `id` as its record now says; `requested` when a person's cancel
    /// ended it (the actor is then that person).
    pub(super) fn job_ended_event(&mut self, now: i64, id: u64, requested: bool) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let state = job.state.as_str();
        let message = match &job.reason {
            Some(r) => format!("job {id} ended {state}: {r}"),
            None => format!("job {id} ended {state}"),
        };
        let actor = match (&self.acting, requested) {
            (Some(who), true) => who.clone(),
            _ => "perch".to_owned(),
        };
        self.job_event(now, id, "job_ended", &actor, Some(state), message);
    }

    pub(super) fn node_event(
        &mut self,
        now: i64,
        idx: usize,
        kind: &str,
        actor: &str,
        message: String,
    ) {
        let node = self.nodes[idx].record.name.clone();
        self.event(ClusterEvent {
            node: Some(node),
            ..ClusterEvent::new(now, kind, actor, message)
        });
    }

    /// Opens one allocation per node of job `id`'s placement (it just started).
    pub(super) fn open_allocations(&mut self, id: u64, now: i64) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        // A share holds its percent of the GPU; a MIG instance its compute slices over 7
        // (3g: 43%): accounting charges that part, and leaves the GPU's telemetry (all its
        // jobs') unsplit, as the scheduler's quotas and fair share already count it.
        let share = match (&job.request.gpu_share, &job.request.gpu_profile) {
            (Some(s), _) => Some(s.percent()),
            (None, Some(profile)) => perch_scheduler::mig_hundredths(profile),
            (None, None) => None,
        };
        for p in &job.placement {
            let node = self
                .node_index
                .get(&p.node)
                .and_then(|&i| self.nodes.get(i));
            let (model, simulated) = node.map_or((String::new(), false), |n| {
                (n.record.model.clone(), n.record.simulated)
            });
            let mut a = Allocation::new(
                job.attempts,
                p.node.clone(),
                p.gpus.clone(),
                model,
                now,
                simulated,
            );
            a.share_percent = share;
            job.allocations.push(a);
        }
    }

    /// Ends job `id`'s open allocations at `now` and wakes the accounting task, which folds
    /// their last telemetry once it has settled.
    pub(super) fn close_allocations(&mut self, id: u64, now: i64) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        let mut closed = false;
        for a in job.allocations.iter_mut().filter(|a| a.end_ms.is_none()) {
            a.end_ms = Some(now.max(a.start_ms));
            closed = true;
        }
        if closed {
            self.ledger.fold_wakeup.notify_one();
        }
    }

    /// A running job restored from a database written before allocations existed gets one
    /// from its placement, so it is accounted from its start on.
    pub(super) fn ensure_allocations(&mut self, id: u64) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        if job.state != JobState::Running || job.allocations.iter().any(|a| a.end_ms.is_none()) {
            return;
        }
        let start = job.start_ms.unwrap_or(self.now);
        self.open_allocations(id, start);
        self.dirty_jobs.insert(id);
    }

    /// Learns from telemetry that a node's GPUs are simulated (or not).
    pub(super) fn note_simulated(&mut self, idx: usize, simulated: bool) {
        let record: &mut NodeRecord = &mut self.nodes[idx].record;
        if record.simulated != simulated {
            record.simulated = simulated;
            self.dirty_nodes.insert(idx);
        }
    }

    /// The windows of telemetry to fold now: for every allocation not yet final, from where
    /// its last fold stopped to `until_ms` (or its end, if sooner).
    pub fn fold_windows(&self, until_ms: i64) -> Vec<FoldWindow> {
        let mut out = Vec::new();
        for job in self.jobs.values() {
            for a in job.allocations.iter().filter(|a| !a.is_final()) {
                let to = until_ms.min(a.end_ms.unwrap_or(i64::MAX));
                if to > a.folded_until_ms {
                    out.push(FoldWindow {
                        job: job.id,
                        attempt: a.attempt,
                        node: a.node.clone(),
                        gpus: a.gpus.clone(),
                        from_ms: a.folded_until_ms,
                        to_ms: to,
                    });
                }
            }
        }
        out
    }

    /// When the next ended allocation's telemetry will have settled, `settle_ms` after its
    /// end; `None` when every ended allocation is final.
    pub fn next_settled_end(&self, settle_ms: i64) -> Option<i64> {
        self.jobs
            .values()
            .flat_map(|j| &j.allocations)
            .filter(|a| !a.is_final())
            .filter_map(|a| a.end_ms.map(|e| e.saturating_add(settle_ms)))
            .min()
    }

    /// Adds folded windows to their allocations (each only if the allocation still stops
    /// where the window starts, so a window is never counted twice), then refreshes fair
    /// share. The changed records commit in one transaction: a fold is in the database
    /// whole, or not at all and done again.
    pub fn apply_fold(
        &mut self,
        folded: Vec<Folded>,
        now: i64,
    ) -> Result<usize, super::ControlError> {
        let mut applied = 0;
        for f in folded {
            let w = &f.window;
            let Some(job) = self.jobs.get_mut(&w.job) else {
                continue;
            };
            let Some(a) = job.allocations.iter_mut().find(|a| {
                a.attempt == w.attempt && a.node == w.node && a.folded_until_ms == w.from_ms
            }) else {
                continue;
            };
            if a.usage.len() != a.gpus.len() {
                a.usage.resize(a.gpus.len(), Default::default());
            }
            for (slot, u) in a.usage.iter_mut().zip(&f.usage) {
                slot.merge(u);
            }
            a.folded_until_ms = w.to_ms;
            a.simulated |= f.simulated;
            self.dirty_jobs.insert(w.job);
            applied += 1;
        }
        if applied > 0 {
            self.refresh_fair_share(now)?;
        }
        Ok(applied)
    }

    /// Tells the scheduler core every account's past usage: the GPU-time of all allocations,
    /// decayed with the policy's half-life, up to `now`. Fair share thus reflects the real
    /// history, across restarts, instead of only what the core saw since it started.
    pub(super) fn refresh_fair_share(&mut self, now: i64) -> Result<(), super::ControlError> {
        let usage = self.decayed_usage(now);
        let usage = usage.into_iter().map(|(a, u)| (Account(a), u)).collect();
        self.scheduler.handle(now, Event::AccountUsage(usage))?;
        Ok(())
    }

    /// Every node: its record, its state, and when its agent last synced.
    pub fn node_records(&self) -> impl Iterator<Item = (&NodeRecord, NodeState, i64)> {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (&n.record, self.node_state(i), n.last_sync_ms))
    }

    /// The node state history, oldest span first.
    pub fn node_spans(&self) -> impl Iterator<Item = &NodeSpan> {
        self.ledger.spans.values()
    }

    /// The wakeup the accounting task waits on besides its interval.
    pub fn fold_wakeup(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.ledger.fold_wakeup.clone()
    }
}

/// The control plane's accounting state beside the records.
#[derive(Default)]
pub struct Ledger {
    spans: BTreeMap<u64, NodeSpan>,
    /// Node index -> id of its current span.
    open_spans: std::collections::HashMap<usize, u64>,
    pub(super) dirty_spans: std::collections::BTreeSet<u64>,
    /// Audit events not yet handed to the job service.
    pub(super) events: Vec<ClusterEvent>,
    fold_wakeup: std::sync::Arc<tokio::sync::Notify>,
}

impl Ledger {
    pub(super) fn take_spans(&mut self) -> Vec<(u64, NodeSpan)> {
        std::mem::take(&mut self.dirty_spans)
            .into_iter()
            .filter_map(|id| self.spans.get(&id).map(|s| (id, s.clone())))
            .collect()
    }
}
