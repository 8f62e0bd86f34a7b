//! Durable job and node records in redb: every change is committed before the HTTP answer,
//! so a `kill -9` of the server loses nothing it acknowledged.

use super::record::JobRecord;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::Path;

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");
const NODES: TableDefinition<u64, &[u8]> = TableDefinition::new("nodes");

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
}

#[derive(Debug, thiserror::Error)]
#[error("job database: {0}")]
pub struct DbError(String);

/// Records changed by one or more operations, to be committed together.
#[derive(Debug, Default)]
pub struct Dirty {
    pub jobs: Vec<JobRecord>,
    pub nodes: Vec<(u64, NodeRecord)>,
}

impl Dirty {
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.nodes.is_empty()
    }

    /// Adds a later change set: later records replace earlier ones when written in order.
    pub fn extend(&mut self, later: Dirty) {
        self.jobs.extend(later.jobs);
        self.nodes.extend(later.nodes);
    }
}

impl DbError {
    pub fn new(message: String) -> DbError {
        DbError(message)
    }
}

fn e(x: impl std::fmt::Display) -> DbError {
    DbError(x.to_string())
}

pub struct JobDb {
    db: Database,
}

impl JobDb {
    pub fn open(path: &Path) -> Result<JobDb, DbError> {
        let db = Database::create(path).map_err(e)?;
        let tx = db.begin_write().map_err(e)?;
        tx.open_table(JOBS).map_err(e)?;
        tx.open_table(NODES).map_err(e)?;
        tx.commit().map_err(e)?;
        Ok(JobDb { db })
    }

    /// Writes the given records and nodes, in order, in one durable transaction.
    pub fn save(&self, dirty: &Dirty) -> Result<(), DbError> {
        let (jobs, nodes) = (&dirty.jobs, &dirty.nodes);
        if jobs.is_empty() && nodes.is_empty() {
            return Ok(());
        }
        let tx = self.db.begin_write().map_err(e)?;
        {
            let mut table = tx.open_table(JOBS).map_err(e)?;
            for job in jobs {
                let bytes = serde_json::to_vec(job).map_err(e)?;
                table.insert(job.id, bytes.as_slice()).map_err(e)?;
            }
            let mut table = tx.open_table(NODES).map_err(e)?;
            for (id, node) in nodes {
                let bytes = serde_json::to_vec(node).map_err(e)?;
                table.insert(*id, bytes.as_slice()).map_err(e)?;
            }
        }
        tx.commit().map_err(e)
    }

    pub fn load(&self) -> Result<(Vec<JobRecord>, Vec<NodeRecord>), DbError> {
        let tx = self.db.begin_read().map_err(e)?;
        let mut jobs = Vec::new();
        for row in tx.open_table(JOBS).map_err(e)?.iter().map_err(e)? {
            let (_, v) = row.map_err(e)?;
            jobs.push(serde_json::from_slice(v.value()).map_err(e)?);
        }
        let mut nodes = Vec::new();
        for row in tx.open_table(NODES).map_err(e)?.iter().map_err(e)? {
            let (_, v) = row.map_err(e)?;
            nodes.push(serde_json::from_slice(v.value()).map_err(e)?);
        }
        Ok((jobs, nodes))
    }
}
