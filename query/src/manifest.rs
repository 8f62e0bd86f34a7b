//! The manifest: the one file that says which Parquet files make up each table, how far the
//! write-ahead log is covered by them, and the last batch sequence accepted from each node.
//!
//! It is replaced atomically (write a temporary file, fsync, rename, fsync the directory), so
//! after a crash it describes either the state before a flush or the state after it, never a
//! mix. Parquet files not listed are leftovers of a flush that did not finish and are removed
//! at start-up; their rows are still in the write-ahead log.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

pub const FILE_NAME: &str = "manifest.json";

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub version: u32,
    /// Write-ahead log segments with ids at most this are fully in the Parquet files.
    pub wal_flushed_through: u64,
    /// Highest batch sequence accepted per node, as of `wal_flushed_through`.
    pub node_seq: BTreeMap<String, u64>,
    /// Parquet files per table name.
    pub files: BTreeMap<String, Vec<FileEntry>>,
    pub next_file_id: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Path relative to the data directory.
    pub path: String,
    pub rows: u64,
    pub bytes: u64,
    pub min_time_ms: i64,
    pub max_time_ms: i64,
}

impl Manifest {
    pub fn load(dir: &Path) -> Result<Manifest> {
        let path = dir.join(FILE_NAME);
        match fs::read(&path) {
            Ok(data) => serde_json::from_slice(&data).map_err(|e| Error::Corrupt {
                what: "manifest",
                message: format!("{}: {e}", path.display()),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Manifest {
                version: 1,
                ..Manifest::default()
            }),
            Err(e) => Err(Error::io("reading", path)(e)),
        }
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        let tmp = dir.join(format!("{FILE_NAME}.tmp"));
        let path = dir.join(FILE_NAME);
        let data = serde_json::to_vec_pretty(self).map_err(|e| Error::Corrupt {
            what: "manifest",
            message: e.to_string(),
        })?;
        let mut f = File::create(&tmp).map_err(Error::io("creating", &tmp))?;
        f.write_all(&data)
            .and_then(|()| f.sync_all())
            .map_err(Error::io("writing", &tmp))?;
        fs::rename(&tmp, &path).map_err(Error::io("renaming", &tmp))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(Error::io("syncing directory", dir))
    }
}
