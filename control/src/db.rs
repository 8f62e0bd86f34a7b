//! The embedded job store: durable job and node records in one redb file, every change
//! committed before the HTTP answer, so a `kill -9` of the server loses nothing it
//! acknowledged. Node state history lives here too, for the down and drained GPU-hours of
//! accounting. The file's layout and its version are specified in
//! `docs/format/job-database.md`.

use crate::provenance::ProvenanceRecord;
use crate::record::{JobRecord, NodeSpan};
use crate::store::JobStore;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");

/// redb's page cache for the job database. Its default, 1 GiB, filled with copies of records
/// the control plane already holds in memory: only settled jobs' records are read back (a
/// view, a listing, SQL). This holds the B-tree's inner pages many times over and a commit's
/// writes.
const CACHE_BYTES: usize = 64 * 1024 * 1024;
const NODES: TableDefinition<u64, &[u8]> = TableDefinition::new("nodes");
const NODE_SPANS: TableDefinition<u64, &[u8]> = TableDefinition::new("node_spans");
/// Each job's provenance record by job id ([`crate::provenance`]): added in version 1 without
/// changing it (a binary without it never opens the table and leaves it alone).
const PROVENANCE: TableDefinition<u64, &[u8]> = TableDefinition::new("provenance");
/// The file's format version, under [`FORMAT_KEY`].
const META: TableDefinition<&str, u32> = TableDefinition::new("meta");
const FORMAT_KEY: &str = "format_version";

/// The job database format this binary writes and reads (`docs/format/job-database.md`).
/// A database without a version was written before versions were recorded: it is this
/// version's layout, and is stamped when first opened. One with a newer version is refused.
pub const FORMAT_VERSION: u32 = 1;

/// A node as the scheduler knows it, in the order nodes joined (their scheduler ids).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    pub gpus: u32,
    pub model: String,
    pub rack: String,
    pub drained: bool,
    /// NVLink islands the agent reported (empty: unknown, one island).
    #[serde(default)]
    pub nvlink_islands: Vec<Vec<u32>>,
    /// The node takes jobs asking for a part of a GPU.
    #[serde(default)]
    pub gpu_sharing: bool,
    /// Who drained it: a user, or `perch` for automatic remediation.
    #[serde(default)]
    pub drained_by: Option<String>,
    /// Why it was drained, when the one who drained it said.
    #[serde(default)]
    pub drain_reason: Option<String>,
    /// Its GPUs are simulated (learnt from its telemetry).
    #[serde(default)]
    pub simulated: bool,
    /// The MIG instances its agent last reported (kept so that jobs on them are restored onto
    /// them before the agent syncs again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_instances: Vec<perch_model::control::MigInstance>,
}

#[derive(Debug, thiserror::Error)]
#[error("job database: {0}")]
pub struct DbError(String);

/// Records changed by one or more operations, to be committed together, and the audit
/// events they caused (appended to the store's `events` table once the commit is durable).
#[derive(Debug, Default)]
pub struct Dirty {
    pub jobs: Vec<JobRecord>,
    pub nodes: Vec<(u64, NodeRecord)>,
    pub node_spans: Vec<(u64, NodeSpan)>,
    pub events: Vec<perch_model::ClusterEvent>,
    /// Settled jobs (not held whole in memory) whose stored output was deleted, and when:
    /// their records are read, marked ([`JobRecord::delete_output`]) and written back in the
    /// commit, after every change queued before.
    pub output_deleted: Vec<(u64, i64)>,
    /// Provenance records to write or add to, in order ([`crate::provenance`]).
    pub provenance: Vec<crate::provenance::ProvenanceChange>,
}

impl Dirty {
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
            && self.output_deleted.is_empty()
            && self.nodes.is_empty()
            && self.node_spans.is_empty()
            && self.events.is_empty()
            && self.provenance.is_empty()
    }

    /// Adds a later change set: later records replace earlier ones when written in order.
    pub fn extend(&mut self, later: Dirty) {
        self.jobs.extend(later.jobs);
        self.output_deleted.extend(later.output_deleted);
        self.nodes.extend(later.nodes);
        self.node_spans.extend(later.node_spans);
        self.events.extend(later.events);
        self.provenance.extend(later.provenance);
    }
}

/// The job database's nodes and their history, as loaded at startup (jobs are visited one at
/// a time, [`JobDb::for_each_job`]).
#[derive(Debug, Default)]
pub struct Loaded {
    pub nodes: Vec<NodeRecord>,
    /// Node state history by id (ids give the order spans were opened in).
    pub node_spans: Vec<(u64, NodeSpan)>,
}

impl DbError {
    pub fn new(message: String) -> DbError {
        DbError(message)
    }
}

fn e(x: impl std::fmt::Display) -> DbError {
    DbError(x.to_string())
}

/// The open database. `None` while it is being reopened.
type Slot = parking_lot::RwLock<Option<Arc<Database>>>;

/// The embedded [`JobStore`]: one redb file (`jobs.redb` in the server's data directory).
pub struct RedbStore {
    path: std::path::PathBuf,
    slot: Slot,
}

impl RedbStore {
    /// Opens (or creates) the job database at `path`: refused, naming both versions, when a
    /// newer binary's format is found there.
    pub fn open(path: &Path) -> Result<RedbStore, DbError> {
        let db = open_database(path)?;
        Ok(RedbStore {
            path: path.to_owned(),
            slot: parking_lot::RwLock::new(Some(db)),
        })
    }

    /// The format version the file records.
    pub fn format_version(&self) -> Result<u32, DbError> {
        let tx = self.db()?.begin_read().map_err(e)?;
        let meta = tx.open_table(META).map_err(e)?;
        let version = meta.get(FORMAT_KEY).map_err(e)?.map(|v| v.value());
        version.ok_or_else(|| DbError("the job database records no format version".into()))
    }

    fn db(&self) -> Result<Arc<Database>, DbError> {
        self.slot
            .read()
            .clone()
            .ok_or_else(|| DbError("the job database is being reopened".into()))
    }
}

impl JobStore for RedbStore {
    /// Writes the given records and nodes, in order, in one durable transaction.
    fn save(&self, dirty: &Dirty) -> Result<(), DbError> {
        let (jobs, nodes, spans) = (&dirty.jobs, &dirty.nodes, &dirty.node_spans);
        if jobs.is_empty()
            && nodes.is_empty()
            && spans.is_empty()
            && dirty.output_deleted.is_empty()
            && dirty.provenance.is_empty()
        {
            return Ok(());
        }
        let tx = self.db()?.begin_write().map_err(e)?;
        {
            let mut table = tx.open_table(JOBS).map_err(e)?;
            for job in jobs {
                let bytes = serde_json::to_vec(job).map_err(e)?;
                table.insert(job.id, bytes.as_slice()).map_err(e)?;
            }
            for &(id, at) in &dirty.output_deleted {
                let stored = table.get(id).map_err(e)?.map(|v| v.value().to_vec());
                let Some(stored) = stored else { continue };
                let mut job: JobRecord = serde_json::from_slice(&stored).map_err(e)?;
                if job.delete_output(at) {
                    let bytes = serde_json::to_vec(&job).map_err(e)?;
                    table.insert(id, bytes.as_slice()).map_err(e)?;
                }
            }
            let mut table = tx.open_table(NODES).map_err(e)?;
            for (id, node) in nodes {
                let bytes = serde_json::to_vec(node).map_err(e)?;
                table.insert(*id, bytes.as_slice()).map_err(e)?;
            }
            let mut table = tx.open_table(NODE_SPANS).map_err(e)?;
            for (id, span) in spans {
                let bytes = serde_json::to_vec(span).map_err(e)?;
                table.insert(*id, bytes.as_slice()).map_err(e)?;
            }
            let mut table = tx.open_table(PROVENANCE).map_err(e)?;
            for change in &dirty.provenance {
                let id = change.job();
                let stored = match table.get(id).map_err(e)? {
                    Some(v) => Some(serde_json::from_slice(v.value()).map_err(e)?),
                    None => None,
                };
                let bytes = serde_json::to_vec(&change.apply(stored)).map_err(e)?;
                table.insert(id, bytes.as_slice()).map_err(e)?;
            }
        }
        tx.commit().map_err(e)
    }

    /// Visits every job record, in id order.
    fn for_each_job(&self, visit: &mut dyn FnMut(JobRecord)) -> Result<(), DbError> {
        let tx = self.db()?.begin_read().map_err(e)?;
        for row in tx.open_table(JOBS).map_err(e)?.iter().map_err(e)? {
            let (_, v) = row.map_err(e)?;
            visit(serde_json::from_slice(v.value()).map_err(e)?);
        }
        Ok(())
    }

    fn load(&self) -> Result<Loaded, DbError> {
        let tx = self.db()?.begin_read().map_err(e)?;
        let mut nodes = Vec::new();
        for row in tx.open_table(NODES).map_err(e)?.iter().map_err(e)? {
            let (_, v) = row.map_err(e)?;
            nodes.push(serde_json::from_slice(v.value()).map_err(e)?);
        }
        let mut node_spans = Vec::new();
        for row in tx.open_table(NODE_SPANS).map_err(e)?.iter().map_err(e)? {
            let (k, v) = row.map_err(e)?;
            node_spans.push((k.value(), serde_json::from_slice(v.value()).map_err(e)?));
        }
        Ok(Loaded { nodes, node_spans })
    }

    /// Closes the database and opens it again. After a commit failed
    /// on I/O (a full disk) redb refuses every later transaction until then; opening repairs
    /// what the failed commit left. Fails while a read begun before still holds the file (it
    /// is closed; try again later) or while the disk still cannot take the repair.
    fn reopen(&self) -> Result<(), DbError> {
        let mut slot = self.slot.write();
        *slot = None;
        *slot = Some(open_database(&self.path)?);
        Ok(())
    }

    fn provenance(&self, id: u64) -> Result<Option<ProvenanceRecord>, DbError> {
        let tx = self.db()?.begin_read().map_err(e)?;
        let table = tx.open_table(PROVENANCE).map_err(e)?;
        let found = table.get(id).map_err(e)?;
        found
            .map(|v| serde_json::from_slice(v.value()).map_err(e))
            .transpose()
    }

    fn for_each_provenance(
        &self,
        ids: std::ops::RangeInclusive<u64>,
        visit: &mut dyn FnMut(ProvenanceRecord) -> bool,
    ) -> Result<(), DbError> {
        let tx = self.db()?.begin_read().map_err(e)?;
        for row in tx
            .open_table(PROVENANCE)
            .map_err(e)?
            .range(ids)
            .map_err(e)?
        {
            let (_, v) = row.map_err(e)?;
            if !visit(serde_json::from_slice(v.value()).map_err(e)?) {
                break;
            }
        }
        Ok(())
    }

    /// The stored records of `ids`, in their order; a missing one is an error (the control
    /// plane only asks for records it committed).
    fn get(&self, ids: &[u64]) -> Result<Vec<JobRecord>, DbError> {
        let tx = self.db()?.begin_read().map_err(e)?;
        let table = tx.open_table(JOBS).map_err(e)?;
        ids.iter()
            .map(|&id| {
                let v = table
                    .get(id)
                    .map_err(e)?
                    .ok_or_else(|| DbError(format!("job {id} is not in the job database")))?;
                serde_json::from_slice(v.value()).map_err(e)
            })
            .collect()
    }
}

fn open_database(path: &Path) -> Result<Arc<Database>, DbError> {
    let db = redb::Builder::new()
        .set_cache_size(CACHE_BYTES)
        .create(path)
        .map_err(e)?;
    let tx = db.begin_write().map_err(e)?;
    {
        let mut meta = tx.open_table(META).map_err(e)?;
        let found = meta.get(FORMAT_KEY).map_err(e)?.map(|v| v.value());
        match found {
            Some(v) if v > FORMAT_VERSION => {
                return Err(DbError(format!(
                    "job database {} is of format version {v}; this perch reads versions up to {FORMAT_VERSION}: run the perch release that wrote it (or a newer one); see docs/format/job-database.md",
                    path.display()
                )));
            }
            Some(_) => {}
            // Written before versions were recorded: today's layout.
            None => {
                meta.insert(FORMAT_KEY, FORMAT_VERSION).map_err(e)?;
            }
        }
    }
    tx.open_table(JOBS).map_err(e)?;
    tx.open_table(NODES).map_err(e)?;
    tx.open_table(NODE_SPANS).map_err(e)?;
    tx.open_table(PROVENANCE).map_err(e)?;
    tx.commit().map_err(e)?;
    Ok(Arc::new(db))
}
