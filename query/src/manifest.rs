//! The manifest: the one file that says which Parquet files make up each table, how far the
//! write-ahead log is covered by them, and the last batch sequence accepted from each node.
//!
//! It is replaced atomically (see [`crate::storage::Storage::write_manifest`]: a synced rename
//! locally, one PUT in object storage), so after a crash it describes either the state before
//! a flush or the state after it, never a mix. Parquet files not listed are leftovers of a
//! flush that did not finish and are removed at start-up; their rows are still in the
//! write-ahead log.

use crate::{Error, Result};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
    /// Path relative to the storage root (the data directory, or the bucket prefix).
    pub path: String,
    pub rows: u64,
    pub bytes: u64,
    pub min_time_ms: i64,
    pub max_time_ms: i64,
}

/// The manifest's format, and the files': 2 since `user` columns became `user_name` (files of
/// version 1 are rewritten once at startup, see `Store::open`).
pub const CURRENT_VERSION: u32 = 2;

impl Manifest {
    /// A new store's manifest.
    pub fn empty() -> Manifest {
        Manifest {
            version: CURRENT_VERSION,
            ..Manifest::default()
        }
    }

    /// Parses a stored manifest; `location` names it in the error.
    pub fn parse(data: &[u8], location: &str) -> Result<Manifest> {
        let manifest: Manifest = serde_json::from_slice(data).map_err(|e| Error::Corrupt {
            what: "manifest",
            message: format!("{location}: {e}"),
        })?;
        if manifest.version > CURRENT_VERSION {
            return Err(Error::Corrupt {
                what: "manifest",
                message: format!(
                    "{location} is of version {}, written by a newer perch; this one reads up to version {CURRENT_VERSION}: run the newer perch",
                    manifest.version
                ),
            });
        }
        Ok(manifest)
    }

    pub fn to_bytes(&self) -> Result<Bytes> {
        serde_json::to_vec_pretty(self)
            .map(Bytes::from)
            .map_err(|e| Error::Corrupt {
                what: "manifest",
                message: e.to_string(),
            })
    }
}
