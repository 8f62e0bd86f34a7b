//! The manifest: the one file that says which Parquet files make up each table, how far the
//! write-ahead log is covered by them, and the last batch sequence accepted from each node.
//!
//! It is replaced atomically (see [`crate::storage::Storage::write_manifest`]: a synced rename
//! locally, one PUT in object storage), so after a crash it describes either the state before
//! a flush or the state after it, never a mix. Parquet files not listed are leftovers of a
//! flush that did not finish and are removed at start-up; their rows are still in the
//! write-ahead log.
//!
//! Its `version` is the store's format version (`docs/format/manifest.md`): the manifest's
//! fields, the files' columns, and what the write-ahead log needs of a reader. It is the first
//! thing a store's open reads, so a perch that does not know the version refuses the store
//! before it reads anything else; a newer perch upgrades an older store once at start-up
//! (`upgrade` in `store.rs`).

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

/// The store's format version this binary writes, and the newest it reads (it reads every
/// older one, upgrading it at start-up). 2: `user` columns became `user_name` (files of
/// version 1 are rewritten). 3: write-ahead log segments carry a header
/// ([`crate::wal::FORMAT_VERSION`] 2), which a perch of version 2 would take for a torn
/// record.
pub const CURRENT_VERSION: u32 = 3;

/// The one field every version has, read before the rest: a newer manifest may hold fields
/// this binary does not know, and its version, not the first unknown field, is what to report.
#[derive(Deserialize)]
struct Versioned {
    version: u32,
}

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
        let corrupt = |e: serde_json::Error| Error::Corrupt {
            what: "manifest",
            message: format!("{location}: {e}"),
        };
        let Versioned { version } = serde_json::from_slice(data).map_err(corrupt)?;
        if version > CURRENT_VERSION {
            return Err(Error::Io {
                what: "reading the manifest",
                path: location.into(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "the store is of format version {version}, written by a newer perch; this one reads versions up to {CURRENT_VERSION}. Run the perch release that wrote it (or a newer one); see docs/format/manifest.md"
                    ),
                ),
            });
        }
        serde_json::from_slice(data).map_err(corrupt)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_manifest_is_refused_by_its_version_whatever_fields_it_has() {
        let newer = format!(
            r#"{{"version": {}, "wal_flushed_through": 0, "node_seq": {{}}, "files": {{}}, "next_file_id": 0, "shards": []}}"#,
            CURRENT_VERSION + 1
        );
        let err = Manifest::parse(newer.as_bytes(), "/data/manifest.json")
            .expect_err("refused")
            .to_string();
        for said in [
            "/data/manifest.json",
            &format!("format version {}", CURRENT_VERSION + 1),
            &format!("reads versions up to {CURRENT_VERSION}"),
            "newer perch",
        ] {
            assert!(err.contains(said), "{said:?} not in {err}");
        }
        // Of this version, a field it does not know is damage, said as such.
        let unknown = newer.replace(
            &format!("\"version\": {}", CURRENT_VERSION + 1),
            &format!("\"version\": {CURRENT_VERSION}"),
        );
        let err = Manifest::parse(unknown.as_bytes(), "m").expect_err("refused");
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("shards"), "{err}");
    }
}
