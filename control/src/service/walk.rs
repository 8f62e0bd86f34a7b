//! Walks over every job, a chunk at a time under the control lock, and the writing of settled
//! jobs' rows for accounting ([`crate::SettledRecords`]).

use super::*;

/// Settled jobs whose rows one step of [`JobService::record_settled`] writes, at most.
pub(super) const RECORD_STEP: usize = 10_000;

/// Which jobs [`JobService::walk_jobs`] takes, from where.
pub(super) struct Walk {
    /// From this id up, or (`newest_first`) from below it down.
    pub(super) from: u64,
    pub(super) newest_first: bool,
    /// Jobs visited, at most.
    pub(super) want: usize,
    /// Which settled jobs besides those held whole.
    pub(super) settled: Settled,
    /// Records as [`Control::view`] shows them (the pending reason filled in).
    pub(super) view: bool,
}

impl Walk {
    /// Every job held whole and the `settled` ones, oldest first, as stored.
    pub(super) fn all(settled: Settled) -> Walk {
        Walk {
            from: 0,
            newest_first: false,
            want: usize::MAX,
            settled,
            view: false,
        }
    }
}

/// Job records read under one hold of the control lock by [`JobService::scan_jobs`].
pub const SCAN_CHUNK: usize = 2_000;

impl JobService {
    /// What SQL's accounting tables walk: every job held whole and, with `every_settled`, every
    /// settled job (else only those whose rows are not yet written, [`SettledRecords`]), from
    /// id `from` up in id order, a chunk at a time ([`JobService::walk_jobs`]); `visit` returns
    /// false to stop. Returns the last change set the walk saw: wait for it
    /// ([`JobService::wait_durable`]) before answering, so no answer shows what a crash could
    /// lose.
    pub fn walk_for_accounting(
        &self,
        from: u64,
        every_settled: bool,
        visit: impl FnMut(JobRecord) -> bool,
    ) -> Result<u64, ControlError> {
        let settled = if every_settled {
            Settled::All
        } else {
            Settled::Unrecorded
        };
        self.walk_jobs(
            Walk {
                from,
                ..Walk::all(settled)
            },
            |_| true,
            visit,
        )
    }

    /// Folds the telemetry of every allocation up to `until` (its end, if sooner), `usage`
    /// per GPU: nothing is left to account (for tests).
    #[cfg(any(test, feature = "testing"))]
    pub async fn fold_all(&self, until: i64, usage: crate::usage::GpuUsage) {
        self.run(move |c, now| {
            let folded = c
                .fold_windows(until)
                .into_iter()
                .map(|w| crate::cost::Folded {
                    usage: vec![usage.clone(); w.gpus.len()],
                    window: w,
                    simulated: false,
                })
                .collect();
            c.apply_fold(folded, now)
        })
        .await
        .expect("fold");
    }

    /// Writes the rows of up to [`RECORD_STEP`] settled jobs not yet in the settled rows'
    /// files: their records are read from the job database after letting go of the control
    /// lock, and they count as recorded only once written. Returns how many were. Blocking:
    /// the ticker runs it on the blocking pool, one at a time.
    ///
    /// Rows a query found removed or damaged ([`SettledRecords::lost`]) are deleted first,
    /// and every settled job marked unrecorded, under the control lock.
    pub fn record_settled(&self) -> Result<usize, ControlError> {
        self.start_over_if_lost();
        let reads = self.control.lock().unrecorded(RECORD_STEP);
        let records = reads.read()?;
        if records.is_empty() {
            return Ok(0);
        }
        self.settled
            .append(&records)
            .map_err(ControlError::SettledRows)?;
        self.control
            .lock()
            .note_recorded(records.iter().map(|j| j.id));
        Ok(records.len())
    }

    /// If a query found the settled rows' files lost: deletes them and marks every settled job
    /// unrecorded, in a new epoch, under the control lock.
    pub fn start_over_if_lost(&self) {
        if let Some(why) = self.settled.lost() {
            let mut control = self.control.lock();
            self.settled.reset();
            let jobs = control.forget_recorded();
            drop(control);
            tracing::warn!(jobs, reason = %why, "deleted the settled rows files; writing them again from the job database");
        }
    }

    /// Visits every job record in id order, [`SCAN_CHUNK`] at a time under the control lock,
    /// which is let go between chunks: SQL over the `jobs` table of a long history held the
    /// lock, and every agent's sync behind it, for the whole history (160 ms at 20,000 jobs,
    /// growing with every job ever run). Settled jobs' records are read from the job database
    /// outside the lock. Each record is visited once, as it was when its chunk was read.
    #[cfg(any(test, feature = "testing"))]
    pub fn scan_jobs(&self, mut visit: impl FnMut(&JobRecord)) -> Result<(), ControlError> {
        self.walk_jobs(
            Walk::all(Settled::All),
            |_| true,
            |job| {
                visit(&job);
                true
            },
        )
        .map(|_| ())
    }

    /// Walks the jobs [`SCAN_CHUNK`] ids at a time under the control lock, handed on fairly
    /// between chunks (to whoever waits, an agent's sync, not back to this walk at once, as an
    /// unfair unlock would), as `walk` says. Of the jobs it takes that `keep` accepts, at most
    /// `walk.want`, `visit` sees each record once, as its chunk found it, and returns false to
    /// stop. Records held whole are copied under the lock; settled jobs' are read from the job
    /// database after it (they are durable and do not change, [`control`]'s `archive`).
    /// Returns the last change set queued while it walked ([`Commits::seen`]).
    pub(super) fn walk_jobs(
        &self,
        walk: Walk,
        keep: impl Fn(Brief<'_>) -> bool,
        mut visit: impl FnMut(JobRecord) -> bool,
    ) -> Result<u64, ControlError> {
        let Walk {
            from,
            newest_first,
            mut want,
            settled,
            view,
        } = walk;
        /// A job taken under the lock: its record, or a settled job's id (its record is read
        /// after letting go of the lock).
        enum Walked {
            Whole(Box<JobRecord>),
            Settled(u64),
        }
        let (mut cursor, mut seen) = (from, 0);
        loop {
            let control = self.control.lock();
            seen = seen.max(self.commits.seen());
            let range = if newest_first {
                0..cursor
            } else {
                cursor..u64::MAX
            };
            let ids = control.ids_in(range, newest_first, SCAN_CHUNK, settled);
            let mut done = ids.len() < SCAN_CHUNK;
            let mut items = Vec::new();
            for &id in &ids {
                cursor = if newest_first { id } else { id + 1 };
                match control.find(id) {
                    Some(found) if keep(found.brief()) => items.push(match found {
                        Found::Live(job) if view => Walked::Whole(Box::new(control.view_of(job))),
                        Found::Live(job) => Walked::Whole(Box::new(job.clone())),
                        Found::Settled(..) => Walked::Settled(id),
                    }),
                    _ => {}
                }
                if items.len() == want {
                    done = true;
                    break;
                }
            }
            want -= items.len();
            let settled: Vec<u64> = items
                .iter()
                .filter_map(|w| match w {
                    Walked::Settled(id) => Some(*id),
                    Walked::Whole(_) => None,
                })
                .collect();
            let reads = control.settled_reads(settled);
            parking_lot::MutexGuard::unlock_fair(control);
            let mut read = reads.read()?.into_iter();
            for item in items {
                let job = match item {
                    Walked::Whole(job) => *job,
                    Walked::Settled(_) => read.next().expect("one record per settled id"),
                };
                if !visit(job) {
                    return Ok(seen);
                }
            }
            if done {
                return Ok(seen);
            }
        }
    }
}
