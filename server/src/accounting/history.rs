//! The job history as accounting's SQL tables read it: the control plane ([`JobService`]) and
//! the settled jobs' rows written to files beside it ([`SettledRows`]). A query walks the jobs
//! the control plane holds and reads the files' rows of the rest; the control plane writes the
//! files through [`perch_control::SettledRecords`].

use super::settled::{self, SettledRows};
use perch_control::db::RedbStore;
use perch_control::record::JobRecord;
use perch_control::{ControlError, JobService, JobStore, JobsConfig};
use std::sync::Arc;

/// How many times [`History::accounting`] begins an answer before it gives up: a read of lost
/// files, then the job database's.
const ACCOUNTING_TRIES: usize = 3;

/// The control plane and the settled rows' files, opened together. Derefs to the
/// [`JobService`]: everything but the history's reads is the control plane's.
#[derive(Clone, Debug)]
pub struct History {
    jobs: JobService,
    settled: Arc<SettledRows>,
}

impl std::ops::Deref for History {
    type Target = JobService;

    fn deref(&self) -> &JobService {
        &self.jobs
    }
}

impl History {
    /// Opens the job database (`store`, or `jobs.redb` under `dir`, the embedded store), the settled
    /// rows' files (`settled/` under `dir`) and rebuilds the control plane from them. Audit
    /// events go to `events` once durable.
    pub fn open(
        dir: &std::path::Path,
        store: Option<Arc<dyn JobStore>>,
        config: JobsConfig,
        events: tokio::sync::mpsc::UnboundedSender<Vec<perch_model::ClusterEvent>>,
    ) -> Result<History, ControlError> {
        std::fs::create_dir_all(dir).map_err(ControlError::Logs)?;
        let store = match store {
            Some(store) => store,
            None => Arc::new(RedbStore::open(&dir.join("jobs.redb"))?),
        };
        let (settled, recorded) =
            SettledRows::open(&dir.join("settled")).map_err(ControlError::SettledRows)?;
        let settled = Arc::new(settled);
        let jobs = JobService::open(dir, config, events, store, settled.clone(), recorded)?;
        Ok(History { jobs, settled })
    }

    /// The control plane.
    pub fn jobs(&self) -> &JobService {
        &self.jobs
    }

    /// What SQL's accounting tables read: `visit` sees the records of jobs held whole and of
    /// settled jobs whose rows are not yet in the settled rows' files, then `read` the files'
    /// rows of the rest (less the jobs visited), both adding to one answer. A job's rows are
    /// written there before it counts as recorded, and the files are opened after the walk,
    /// so each job is in the answer once.
    ///
    /// Files removed or damaged under the running server fail a read: the answer is begun
    /// again reading every settled job from the job database (the truth the files copy), and
    /// the recording task writes the files again ([`JobService::record_settled`]); until then
    /// every query reads the job database, as before the files existed. An answer whose walk
    /// began before the files were written again is begun again too.
    pub(crate) fn accounting<A: Default>(
        &self,
        visit: impl FnMut(&mut A, &JobRecord),
        read: impl FnMut(&mut A, &settled::View) -> Result<(), settled::Unread>,
    ) -> Result<A, ControlError> {
        self.accounting_between(None, visit, read, || {})
    }

    /// [`History::accounting`] for an answer that holds no job outside ids `lo` to `hi` (a
    /// query's filters on the job id, [`perch_query::Pruning::range_u64`]): the walk visits
    /// only those. `read` still sees every file; its rows of other jobs are for the query's
    /// filters to drop, as they do.
    pub(crate) fn accounting_of<A: Default>(
        &self,
        ids: Option<(u64, u64)>,
        visit: impl FnMut(&mut A, &JobRecord),
        read: impl FnMut(&mut A, &settled::View) -> Result<(), settled::Unread>,
    ) -> Result<A, ControlError> {
        self.accounting_between(ids, visit, read, || {})
    }

    /// The jobs SQL's accounting tables see, counted, while the settled rows' files are found
    /// lost and deleted between the walk and the files' opening: what a query meets when the
    /// recording task starts over under it.
    #[cfg(test)]
    pub(crate) fn accounting_across_a_start_over(&self) -> Result<usize, ControlError> {
        let mut once = true;
        let read = |n: &mut usize, view: &settled::View| {
            let mut unlimited = |_| Ok(());
            view.allocation_columns(&[], &mut perch_query::Room::new(&mut unlimited), |b| {
                *n += b.num_rows()
            })
        };
        self.accounting_between(
            None,
            |n: &mut usize, _| *n += 1,
            read,
            || {
                if std::mem::take(&mut once) {
                    self.settled.lose("deleted by a test");
                    self.jobs.start_over_if_lost();
                }
            },
        )
    }

    /// [`History::accounting_of`], calling `between` after each walk and before the files
    /// are opened (for tests: what the recording task may do there).
    fn accounting_between<A: Default>(
        &self,
        ids: Option<(u64, u64)>,
        mut visit: impl FnMut(&mut A, &JobRecord),
        mut read: impl FnMut(&mut A, &settled::View) -> Result<(), settled::Unread>,
        mut between: impl FnMut(),
    ) -> Result<A, ControlError> {
        let (lo, hi) = ids.unwrap_or((0, u64::MAX));
        let mut failure = String::new();
        for _ in 0..ACCOUNTING_TRIES {
            let mut answer = A::default();
            let epoch = self.settled.epoch();
            let mut seen = std::collections::HashSet::new();
            let changes = self.jobs.walk_for_accounting(lo, epoch.lost, |job| {
                // In id order: past `hi`, no job is for this answer.
                if job.id > hi {
                    return false;
                }
                if !epoch.lost {
                    seen.insert(job.id);
                }
                visit(&mut answer, &job);
                true
            })?;
            // No answer shows what a crash could lose.
            self.jobs.wait_durable(changes)?;
            if epoch.lost {
                return Ok(answer);
            }
            between();
            let unread = match self.settled.view(seen, epoch) {
                Ok(Some(view)) => match read(&mut answer, &view) {
                    Ok(()) => return Ok(answer),
                    Err(e) => e,
                },
                // Written again since the walk began: walk again.
                Ok(None) => {
                    failure = "the settled rows' files were written again while this query read them, each time it tried; retry it".into();
                    continue;
                }
                Err(e) => e,
            };
            failure = match unread {
                settled::Unread::File(e) => e,
                // The query's memory is full, or the server's descriptors: the files are fine.
                settled::Unread::Room(e) | settled::Unread::Now(e) => {
                    return Err(ControlError::SettledRows(e));
                }
            };
            if self.settled.lose(&failure) {
                tracing::error!(error = %failure, "a settled rows file was removed or damaged under the running server; SQL reads settled jobs from the job database while the server writes the files again");
            }
        }
        Err(ControlError::SettledRows(failure))
    }
}
