//! The agent's bounded, in-memory send queue: pure data structure, no I/O, no clock.
//!
//! Rounds go in at the back; the sender takes batches from the front, in `seq` order. While the
//! server is slow or down, a new round is merged into the newest batch if that batch has never
//! been offered to the server (a batch that was sent once may already be durable there under its
//! `seq`, so it is never changed), up to `max_rounds` rounds per batch. Past `max_batches` batches
//! the oldest one not currently in flight is evicted and handed to the caller, who spills it to
//! the disk spool or counts and logs it as dropped: nothing is lost silently.

use crate::sampler::Round;
use perch_model::{Batch, MAX_SAMPLES_PER_BATCH, NodeId};
use std::collections::VecDeque;

#[derive(Debug, Clone)]
struct Pending {
    batch: Batch,
    rounds: usize,
    /// Offered to the server at least once: frozen from then on.
    attempted: bool,
}

/// What [`SendQueue::push`] did with a round.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PushOutcome {
    /// The round was merged into an existing batch rather than starting a new one.
    pub merged: bool,
    /// The batch evicted to make room, if any: spill it or count it as dropped.
    pub evicted: Option<Batch>,
}

/// The bounded queue of batches waiting for the server.
#[derive(Debug)]
pub struct SendQueue {
    node: NodeId,
    next_seq: u64,
    max_rounds: usize,
    max_batches: usize,
    items: VecDeque<Pending>,
    in_flight: Option<u64>,
}

impl SendQueue {
    /// `first_seq` is the `seq` of the first batch; both bounds are raised to at least 1.
    pub fn new(node: NodeId, first_seq: u64, max_rounds: usize, max_batches: usize) -> Self {
        Self {
            node,
            next_seq: first_seq,
            max_rounds: max_rounds.max(1),
            max_batches: max_batches.max(1),
            items: VecDeque::new(),
            in_flight: None,
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Samples waiting in the queue.
    pub fn sample_count(&self) -> usize {
        self.items.iter().map(|p| p.batch.sample_count()).sum()
    }

    /// The `seq` the next new batch will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Adds a round (an empty round is ignored).
    pub fn push(&mut self, round: Round) -> PushOutcome {
        let n = round.sample_count();
        if n == 0 {
            return PushOutcome::default();
        }
        if let Some(tail) = self.items.back_mut()
            && !tail.attempted
            && tail.rounds < self.max_rounds
            && tail.batch.sample_count() + n <= MAX_SAMPLES_PER_BATCH
        {
            tail.batch.hosts.extend(round.hosts);
            tail.batch.gpus.extend(round.gpus);
            tail.batch.nics.extend(round.nics);
            tail.batch.gpu_events.extend(round.gpu_events);
            tail.batch.gpu_processes.extend(round.gpu_processes);
            tail.batch.ib_ports.extend(round.ib_ports);
            tail.batch.jobs.extend(round.jobs);
            tail.rounds += 1;
            return PushOutcome {
                merged: true,
                evicted: None,
            };
        }
        let batch = Batch {
            node: self.node.clone(),
            seq: self.next_seq,
            hosts: round.hosts,
            gpus: round.gpus,
            nics: round.nics,
            gpu_events: round.gpu_events,
            gpu_processes: round.gpu_processes,
            ib_ports: round.ib_ports,
            jobs: round.jobs,
            job_metrics: Vec::new(),
        };
        self.next_seq += 1;
        self.items.push_back(Pending {
            batch,
            rounds: 1,
            attempted: false,
        });
        let mut evicted = None;
        if self.items.len() > self.max_batches {
            // The oldest batch that is not on the wire right now; the in-flight one will be
            // settled by the sender.
            let victim = self
                .items
                .iter()
                .position(|p| Some(p.batch.seq) != self.in_flight);
            evicted = victim.and_then(|i| self.items.remove(i)).map(|p| p.batch);
        }
        PushOutcome {
            merged: false,
            evicted,
        }
    }

    /// The `seq` of the oldest batch.
    pub fn front_seq(&self) -> Option<u64> {
        self.items.front().map(|p| p.batch.seq)
    }

    /// The batch to send next (the oldest), marked in flight and frozen against merging.
    pub fn next_to_send(&mut self) -> Option<Batch> {
        let front = self.items.front_mut()?;
        front.attempted = true;
        self.in_flight = Some(front.batch.seq);
        Some(front.batch.clone())
    }

    /// The in-flight batch `seq` is settled (accepted, or rejected for good): remove it.
    /// Returns false if it was not in the queue any more.
    pub fn complete(&mut self, seq: u64) -> bool {
        self.in_flight = None;
        match self.items.iter().position(|p| p.batch.seq == seq) {
            Some(i) => self.items.remove(i).is_some(),
            None => false,
        }
    }

    /// The in-flight batch `seq` failed and will be retried: it stays at the front.
    pub fn retry_later(&mut self, seq: u64) {
        if self.in_flight == Some(seq) {
            self.in_flight = None;
        }
    }

    /// Empties the queue, returning what was left (for counting on shutdown).
    pub fn drain(&mut self) -> Vec<Batch> {
        self.in_flight = None;
        self.items.drain(..).map(|p| p.batch).collect()
    }
}

#[cfg(test)]
mod tests;
