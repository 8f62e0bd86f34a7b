//! Group commit: an operation's changes are queued under the control lock and committed to
//! the job store before it answers, many operations' changes in one transaction; and the
//! recovery of a store whose commit failed (a full disk).

use super::*;

pub(crate) struct Commits {
    pub(super) db: Arc<dyn JobStore>,
    pub(super) events: tokio::sync::mpsc::UnboundedSender<Vec<perch_model::ClusterEvent>>,
    pub(super) state: Mutex<CommitState>,
    pub(super) done: Condvar,
}

#[derive(Default)]
pub(super) struct CommitState {
    /// Changes queued and not yet committed, with the sequence number of the last one.
    pub(super) queued: db::Dirty,
    pub(super) queued_seq: u64,
    pub(super) committed_seq: u64,
    pub(super) committing: bool,
    pub(super) failed: Option<String>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Commits {
    /// Why the job database cannot commit, while it cannot.
    pub(super) fn failed(&self) -> Option<String> {
        lock(&self.state).failed.clone()
    }

    /// Queues a change set; returns its sequence number. Called under the control lock, so
    /// sequence order is the order of the changes.
    pub(crate) fn queue(&self, dirty: db::Dirty) -> u64 {
        let mut s = lock(&self.state);
        s.queued.extend(dirty);
        s.queued_seq += 1;
        s.queued_seq
    }

    /// The sequence number of the last change set queued. Read under the control lock, it
    /// covers every change an operation holding the lock can see.
    pub(super) fn seen(&self) -> u64 {
        lock(&self.state).queued_seq
    }

    /// The last change set queued ([`Commits::seen`]) and the last one committed.
    pub(super) fn seqs(&self) -> (u64, u64) {
        let s = lock(&self.state);
        (s.queued_seq, s.committed_seq)
    }

    /// Returns once change set `seq` is durable (committing it, and everything queued with
    /// it, if no one else is).
    pub(super) fn wait(&self, seq: u64) -> Result<(), ControlError> {
        let mut s = lock(&self.state);
        loop {
            if let Some(e) = &s.failed {
                return Err(ControlError::Unavailable(e.clone()));
            }
            if s.committed_seq >= seq {
                return Ok(());
            }
            if !s.committing {
                s.committing = true;
                let mut batch = std::mem::take(&mut s.queued);
                let upto = s.queued_seq;
                drop(s);
                let result = self.db.save(&batch);
                if result.is_ok() && !batch.events.is_empty() {
                    // Only what is durable is announced; a closed receiver (no server
                    // running) just drops them.
                    let _ = self.events.send(std::mem::take(&mut batch.events));
                }
                s = lock(&self.state);
                s.committing = false;
                match result {
                    Ok(()) => s.committed_seq = upto,
                    // The in-memory state is now ahead of the job database, and redb takes no
                    // transaction until it is reopened: refuse everything rather than answer
                    // as if changes were durable, until [`JobService::recover`] has reopened
                    // it and rebuilt the control plane from what it holds.
                    Err(e) => {
                        tracing::error!(error = %e, "the job database cannot commit (a full disk?); job operations are refused and agents' leases renewed until it is reopened, tried every few seconds");
                        s.failed = Some(e.to_string());
                    }
                }
                self.done.notify_all();
                continue;
            }
            s = self.done.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl JobService {
    /// Makes a change as an operation would, and queues it for commit without waiting:
    /// another request's change between the two. Returns its sequence number.
    #[cfg(any(test, feature = "testing"))]
    pub fn change_uncommitted(&self, f: impl FnOnce(&mut Control)) -> u64 {
        let mut control = self.control.lock();
        f(&mut control);
        self.commits.queue(control.take_dirty())
    }

    /// The job database fails (`why`), as a commit that cannot be written makes it.
    #[cfg(any(test, feature = "testing"))]
    pub fn fail_commits(&self, why: &str) {
        lock(&self.commits.state).failed = Some(why.to_owned());
    }

    /// Whether change set `seq` is durable.
    #[cfg(any(test, feature = "testing"))]
    pub fn durable(&self, seq: u64) -> bool {
        self.commits.seqs().1 >= seq
    }

    /// Returns once change set `seq` (and every one before it) is durable.
    pub fn wait_durable(&self, seq: u64) -> Result<(), ControlError> {
        self.commits.wait(seq)
    }

    /// Why the job database cannot commit, while it cannot (`/readyz`, the built-in alert
    /// `JobDatabaseFailing`).
    pub fn failing(&self) -> Option<String> {
        self.commits.failed()
    }

    /// After a commit failed: reopens the job database and rebuilds the control plane from
    /// what it holds, as a restart would (the changes refused since were answered as such, and
    /// agents get a heartbeat timeout from now to report what runs). Agents' claims on their
    /// nodes are kept. Fails, changing nothing, while the database cannot be reopened or the
    /// rebuilt state written (the disk still full); the ticker tries again. Blocking.
    pub fn recover(&self) -> Result<(), ControlError> {
        let mut control = self.control.lock();
        if self.commits.failed().is_none() {
            return Ok(());
        }
        // No commit runs while the control lock is held and the commits failed.
        self.commits.db.reopen()?;
        let loaded = self.commits.db.load()?;
        let config = control.config.clone();
        let mut rebuilt =
            Control::open(&self.dir, config, self.now_ms(), loaded, &self.commits.db)?;
        rebuilt.claims = self.claims.clone();
        {
            let mut known = self.known_nodes.write().unwrap_or_else(|p| p.into_inner());
            *known = rebuilt
                .known_nodes
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
        }
        rebuilt.known_nodes = self.known_nodes.clone();
        // Which settled jobs the rows' files hold is not known to the rebuilt state: they are
        // written again from the job database (SQL reads it meanwhile).
        self.settled.reset();
        rebuilt.forget_recorded();
        let mut dirty = rebuilt.take_dirty();
        self.commits.db.save(&dirty)?;
        if !dirty.events.is_empty() {
            let _ = self.commits.events.send(std::mem::take(&mut dirty.events));
        }
        *control = rebuilt;
        let mut s = lock(&self.commits.state);
        s.queued = db::Dirty::default();
        s.committed_seq = s.queued_seq;
        s.failed = None;
        drop(s);
        tracing::info!(
            "the job database commits again: reopened, and the control plane rebuilt from it"
        );
        Ok(())
    }
}
