//! The agent's disk spool: batches that no longer fit in the in-memory queue while the server is
//! unreachable, and whatever is still queued at shutdown, wait here and are replayed in `seq`
//! order when the server is back (also after an agent restart).
//!
//! One file per batch, `<seq, 20 digits>-<samples>.zst`, holding exactly the compressed body that
//! is POSTed, written to a temporary name and renamed so a crash never leaves half a batch. The
//! spool is bounded by total bytes; past the bound the oldest batches are deleted and handed back
//! to the caller to count and log. Batches are sent in `seq` order, so a restart replays the
//! spool before anything new (new sequence numbers are above every spooled one).

use crate::error::{CollectorError, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One spooled batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpoolEntry {
    pub seq: u64,
    pub samples: u64,
    pub bytes: u64,
}

/// A directory of spooled batches with a size bound.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    entries: BTreeMap<u64, SpoolEntry>,
    bytes: u64,
}

fn file_name(seq: u64, samples: u64) -> String {
    format!("{seq:020}-{samples}.zst")
}

fn parse_name(name: &str) -> Option<(u64, u64)> {
    let (seq, samples) = name.strip_suffix(".zst")?.split_once('-')?;
    Some((seq.parse().ok()?, samples.parse().ok()?))
}

impl Spool {
    /// Opens (creating if needed) the spool in `dir`, picking up batches left by an earlier run
    /// and removing temporary files a crash left behind.
    pub fn open(dir: impl Into<PathBuf>, max_bytes: u64) -> Result<Self> {
        let dir = dir.into();
        let err = |e: std::io::Error| CollectorError::Spool {
            path: dir.clone(),
            message: e.to_string(),
        };
        std::fs::create_dir_all(&dir).map_err(err)?;
        let mut entries = BTreeMap::new();
        let mut bytes = 0;
        for item in std::fs::read_dir(&dir).map_err(err)? {
            let item = item.map_err(err)?;
            let name = item.file_name().to_string_lossy().into_owned();
            if name.ends_with(".tmp") {
                let _ = std::fs::remove_file(item.path());
                continue;
            }
            let Some((seq, samples)) = parse_name(&name) else {
                continue;
            };
            let size = item.metadata().map_err(err)?.len();
            bytes += size;
            entries.insert(
                seq,
                SpoolEntry {
                    seq,
                    samples,
                    bytes: size,
                },
            );
        }
        Ok(Self {
            dir,
            max_bytes,
            entries,
            bytes,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes on disk.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The oldest batch.
    pub fn head(&self) -> Option<SpoolEntry> {
        self.entries.values().next().copied()
    }

    /// The newest `seq` held, so a restarted agent can number its batches above it.
    pub fn max_seq(&self) -> Option<u64> {
        self.entries.keys().next_back().copied()
    }

    fn path(&self, e: &SpoolEntry) -> PathBuf {
        self.dir.join(file_name(e.seq, e.samples))
    }

    /// Stores an encoded batch. Returns the batches deleted to stay within the bound (the
    /// oldest first; the new one itself when it alone exceeds the bound).
    pub fn push(&mut self, seq: u64, samples: u64, body: &[u8]) -> Result<Vec<SpoolEntry>> {
        let entry = SpoolEntry {
            seq,
            samples,
            bytes: body.len() as u64,
        };
        if entry.bytes > self.max_bytes {
            return Ok(vec![entry]);
        }
        let path = self.path(&entry);
        let tmp = path.with_extension("tmp");
        let err = |e: std::io::Error| CollectorError::Spool {
            path: path.clone(),
            message: e.to_string(),
        };
        std::fs::write(&tmp, body).map_err(err)?;
        std::fs::rename(&tmp, &path).map_err(err)?;
        if let Some(old) = self.entries.insert(seq, entry) {
            self.bytes -= old.bytes;
        }
        self.bytes += entry.bytes;
        let mut evicted = Vec::new();
        while self.bytes > self.max_bytes {
            let Some(oldest) = self.head() else { break };
            self.remove(oldest.seq)?;
            evicted.push(oldest);
        }
        Ok(evicted)
    }

    /// The stored body of `entry`.
    pub fn read(&self, entry: &SpoolEntry) -> Result<Vec<u8>> {
        let path = self.path(entry);
        std::fs::read(&path).map_err(|e| CollectorError::Spool {
            path,
            message: e.to_string(),
        })
    }

    /// Deletes batch `seq` (delivered, rejected or evicted).
    pub fn remove(&mut self, seq: u64) -> Result<()> {
        let Some(entry) = self.entries.remove(&seq) else {
            return Ok(());
        };
        self.bytes -= entry.bytes;
        let path = self.path(&entry);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(CollectorError::Spool {
                path,
                message: e.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_names(name: &str, expected: Option<(u64, u64)>) {
        assert_eq!(parse_name(name), expected, "{name:?}");
    }

    #[test]
    fn names() {
        check_names(&file_name(42, 7), Some((42, 7)));
        check_names("00000000000000000042-7.zst.tmp", None);
        check_names("notes.txt", None);
        check_names("x-1.zst", None);
        assert!(file_name(9, 1) < file_name(10, 1), "names sort by seq");
    }

    #[test]
    fn keeps_seq_order_bound_and_survives_reopen() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut s = Spool::open(dir.path(), 25).expect("open");
        assert_eq!(s.push(20, 2, b"0123456789").expect("push"), []);
        assert_eq!(s.push(10, 1, b"0123456789").expect("push"), []);
        assert_eq!(
            s.head().map(|e| e.seq),
            Some(10),
            "the lowest seq comes first"
        );
        // A third batch exceeds 25 bytes: the oldest (seq 10) goes.
        let evicted = s.push(30, 3, b"0123456789").expect("push");
        assert_eq!(
            evicted,
            [SpoolEntry {
                seq: 10,
                samples: 1,
                bytes: 10
            }]
        );
        assert_eq!((s.len(), s.bytes()), (2, 20));
        // Too big on its own: refused without touching the others.
        assert_eq!(s.push(40, 4, &[0; 26]).expect("push").len(), 1);
        std::fs::write(dir.path().join("00000000000000000050-1.tmp"), b"half").expect("write");
        drop(s);

        let mut s = Spool::open(dir.path(), 25).expect("reopen");
        assert_eq!((s.len(), s.bytes(), s.max_seq()), (2, 20, Some(30)));
        let head = s.head().expect("head");
        assert_eq!((head.seq, head.samples), (20, 2));
        assert_eq!(s.read(&head).expect("read"), b"0123456789");
        s.remove(20).expect("remove");
        s.remove(20).expect("removing twice is fine");
        assert_eq!(s.head().map(|e| e.seq), Some(30));
        assert!(
            !dir.path().join("00000000000000000050-1.tmp").exists(),
            "temp files are cleaned"
        );
    }
}
