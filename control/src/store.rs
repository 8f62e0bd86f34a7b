//! Where the control plane keeps what it must not lose: the seam between the control plane and
//! its database. [`JobStore`] is what [`crate::JobService`] commits to and rebuilds from;
//! [`crate::db::RedbStore`] (one redb file beside the server) is the embedded default. A
//! second implementation (a database shared by a standby server) implements the same
//! operations with the same guarantees.
//!
//! [`SettledRecords`] is the other way out: the server's accounting keeps the rows of settled
//! jobs in files of its own, and the control plane tells it when those rows no longer match
//! the job database and writes new ones through it.

use crate::db::{DbError, Dirty, Loaded};
use crate::provenance::ProvenanceRecord;
use crate::record::JobRecord;

/// The control plane's durable records: jobs, nodes and node spans, as
/// `docs/format/job-database.md` specifies them for the embedded store.
///
/// Guarantees every implementation gives: [`JobStore::save`] is atomic and durable when it
/// returns (all of a [`Dirty`] or none of it, surviving a crash of the process and of the
/// machine); reads see every save that returned before they began; records are read back
/// exactly as saved (fields a newer binary added and this one does not know are kept by
/// the records' own `serde` defaults, never silently dropped by the store).
pub trait JobStore: Send + Sync + 'static {
    /// The nodes and node spans, to rebuild the control plane from (jobs are visited with
    /// [`JobStore::for_each_job`]).
    fn load(&self) -> Result<Loaded, DbError>;

    /// Visits every job record in id order.
    fn for_each_job(&self, visit: &mut dyn FnMut(JobRecord)) -> Result<(), DbError>;

    /// The records of jobs `ids`, in that order; a missing one is an error.
    fn get(&self, ids: &[u64]) -> Result<Vec<JobRecord>, DbError>;

    /// Commits `dirty` (its jobs, nodes, node spans and output deletions; events are not
    /// stored here) in one transaction, durable when it returns.
    fn save(&self, dirty: &Dirty) -> Result<(), DbError>;

    /// Closes and opens the store again after a failed commit (a full disk): the state it
    /// then holds is what the last successful [`JobStore::save`] left.
    fn reopen(&self) -> Result<(), DbError>;

    /// Job `id`'s provenance record ([`crate::provenance`]), if one was written.
    fn provenance(&self, id: u64) -> Result<Option<ProvenanceRecord>, DbError>;

    /// Visits the provenance records of jobs in `ids`, in id order, until `visit` says stop
    /// (returns false).
    fn for_each_provenance(
        &self,
        ids: std::ops::RangeInclusive<u64>,
        visit: &mut dyn FnMut(ProvenanceRecord) -> bool,
    ) -> Result<(), DbError>;
}

/// The rows of settled jobs that accounting keeps outside the job store (the server's
/// Parquet files, `docs/format/settled-rows.md`), as the control plane reaches them: it
/// hands over settled jobs' records to write, asks whether a reader found the files lost,
/// and has them forgotten when the job store was rebuilt.
pub trait SettledRecords: Send + Sync + 'static {
    /// Writes the rows of these settled jobs; they count as recorded once this returns Ok.
    /// Err: why (the rows are written again later).
    fn append(&self, records: &[JobRecord]) -> Result<(), String>;

    /// Why a reader found the rows removed or damaged since the last [`SettledRecords::reset`],
    /// if one did.
    fn lost(&self) -> Option<String>;

    /// Deletes every row written: which settled jobs they hold no longer matches the job
    /// store (it was rebuilt, or restored from an older copy).
    fn reset(&self);
}

/// Settled rows kept nowhere: what a control plane without accounting files uses (tests, and
/// tools that open a job database to read it).
#[derive(Debug, Default)]
pub struct NoSettledRecords;

impl SettledRecords for NoSettledRecords {
    fn append(&self, _: &[JobRecord]) -> Result<(), String> {
        Ok(())
    }

    fn lost(&self) -> Option<String> {
        None
    }

    fn reset(&self) {}
}
