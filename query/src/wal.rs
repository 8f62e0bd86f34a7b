//! The write-ahead log: every accepted batch is on disk, fsynced, before the server answers.
//!
//! One writer thread owns the active segment file. Appends from any number of requests queue on
//! a channel; the thread writes everything queued, calls `fdatasync` once, and then answers all
//! of them (group commit), so durability costs one sync per burst rather than one per request.
//!
//! On disk: `wal/<segment:020>.wal` files, each a sequence of records
//! `[payload length: u32 LE][crc32 of payload: u32 LE][payload]`. Every process start opens a
//! fresh segment, so a torn record can only be the tail of a segment whose writer died; replay
//! stops reading that segment there. Segments are deleted only after the flush that covers them
//! is recorded in the manifest.

use crate::{Error, Result};
use bytes::Bytes;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use tokio::sync::oneshot;

const HEADER: usize = 8;
/// Largest record accepted on replay; larger lengths mean a corrupt header.
const MAX_RECORD: usize = 256 << 20;

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct WalStats {
    pub appends: AtomicU64,
    pub syncs: AtomicU64,
    pub bytes: AtomicU64,
}

enum Command {
    Append(Bytes, oneshot::Sender<Result<(), String>>),
    Rotate(oneshot::Sender<Result<u64, String>>),
}

/// Handle to the log; cheap to share behind an `Arc`.
pub struct Wal {
    dir: PathBuf,
    tx: mpsc::Sender<Command>,
    pub stats: Arc<WalStats>,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal").field("dir", &self.dir).finish()
    }
}

fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.wal"))
}

/// Segment ids present in `dir`, ascending.
pub fn segments(dir: &Path) -> Result<Vec<u64>> {
    let mut ids = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ids),
        Err(e) => return Err(Error::io("reading directory", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(Error::io("reading directory", dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(id) = name
            .strip_suffix(".wal")
            .and_then(|s| s.parse::<u64>().ok())
        {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

/// Reads every intact record of the segments after `after`, in order.
pub fn replay(dir: &Path, after: u64) -> Result<Vec<Bytes>> {
    let mut records = Vec::new();
    for id in segments(dir)?.into_iter().filter(|&id| id > after) {
        let path = segment_path(dir, id);
        let mut data = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut data))
            .map_err(Error::io("reading write-ahead log", &path))?;
        let data = Bytes::from(data);
        let mut pos = 0;
        while pos < data.len() {
            let Some(header) = data.get(pos..pos + HEADER) else {
                tracing::warn!(
                    segment = id,
                    offset = pos,
                    "write-ahead log ends in a torn record header; ignoring the tail (it was never acknowledged)"
                );
                break;
            };
            let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
            let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
            let start = pos + HEADER;
            let payload = (len <= MAX_RECORD)
                .then(|| data.get(start..start + len))
                .flatten();
            match payload {
                Some(p) if crc32fast::hash(p) == crc => {
                    records.push(data.slice(start..start + len));
                    pos = start + len;
                }
                _ => {
                    tracing::warn!(
                        segment = id,
                        offset = pos,
                        "write-ahead log record is torn or corrupt; ignoring the rest of this segment (it was never acknowledged)"
                    );
                    break;
                }
            }
        }
    }
    Ok(records)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Wal {
    /// Opens a fresh segment after every existing one and after `flushed_through` (the last
    /// segment whose records are in Parquet), and starts the writer thread. Empty segments
    /// after `flushed_through` hold no records, so they are removed first: without that every
    /// start that wrote nothing would leave one behind, and restarts would pile them up.
    pub fn open(dir: &Path, flushed_through: u64) -> Result<Wal> {
        fs::create_dir_all(dir).map_err(Error::io("creating directory", dir))?;
        let mut last = flushed_through;
        for id in segments(dir)?
            .into_iter()
            .filter(|&id| id > flushed_through)
        {
            let path = segment_path(dir, id);
            let len = fs::metadata(&path)
                .map_err(Error::io("reading write-ahead log segment", &path))?
                .len();
            if len == 0 {
                fs::remove_file(&path)
                    .map_err(Error::io("removing empty write-ahead log segment", &path))?;
            } else {
                last = id;
            }
        }
        let next = last + 1;
        let writer = Writer::create(dir.to_path_buf(), next)?;
        let stats = writer.stats.clone();
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("perch-wal".into())
            .spawn(move || writer.run(rx))
            .map_err(Error::io("starting write-ahead log thread", dir))?;
        Ok(Wal {
            dir: dir.to_path_buf(),
            tx,
            stats,
        })
    }

    /// Appends one record; returns once it is fsynced.
    pub async fn append(&self, payload: Bytes) -> Result<()> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Command::Append(payload, done))
            .map_err(|_| Error::WalClosed("writer thread stopped".into()))?;
        match wait.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::WalClosed(e)),
            Err(_) => Err(Error::WalClosed("writer thread stopped".into())),
        }
    }

    /// Closes the active segment and starts the next; returns the id of the closed one. Every
    /// append answered before this call is in a segment with an id at most the returned one.
    pub async fn rotate(&self) -> Result<u64> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Command::Rotate(done))
            .map_err(|_| Error::WalClosed("writer thread stopped".into()))?;
        match wait.await {
            Ok(r) => r.map_err(Error::WalClosed),
            Err(_) => Err(Error::WalClosed("writer thread stopped".into())),
        }
    }

    /// Deletes the segments with ids at most `through` (their data is in Parquet now).
    pub fn remove_through(&self, through: u64) -> Result<()> {
        for id in segments(&self.dir)?.into_iter().filter(|&id| id <= through) {
            let path = segment_path(&self.dir, id);
            fs::remove_file(&path).map_err(Error::io("removing write-ahead log segment", &path))?;
        }
        Ok(())
    }
}

struct Writer {
    dir: PathBuf,
    id: u64,
    file: File,
    /// Length of the file up to the last record known to be complete.
    good_len: u64,
    /// Set when a failed write could not be undone; every later append fails.
    poisoned: Option<String>,
    stats: Arc<WalStats>,
}

impl Writer {
    fn create(dir: PathBuf, id: u64) -> Result<Writer> {
        let path = segment_path(&dir, id);
        let file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(Error::io("creating write-ahead log segment", &path))?;
        sync_dir(&dir).map_err(Error::io("syncing directory", &dir))?;
        Ok(Writer {
            dir,
            id,
            file,
            good_len: 0,
            poisoned: None,
            stats: Arc::default(),
        })
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        let mut pending: Vec<(Bytes, oneshot::Sender<Result<(), String>>)> = Vec::new();
        while let Ok(first) = rx.recv() {
            let mut next = Some(first);
            while let Some(cmd) = next.take() {
                match cmd {
                    Command::Append(payload, done) => pending.push((payload, done)),
                    Command::Rotate(done) => {
                        self.commit(&mut pending);
                        let _ = done.send(self.rotate());
                    }
                }
                if pending.len() < 4096 {
                    next = rx.try_recv().ok();
                }
            }
            self.commit(&mut pending);
        }
        self.commit(&mut pending);
    }

    fn commit(&mut self, pending: &mut Vec<(Bytes, oneshot::Sender<Result<(), String>>)>) {
        if pending.is_empty() {
            return;
        }
        let result = self.write_all(pending);
        for (_, done) in pending.drain(..) {
            let _ = done.send(result.clone());
        }
    }

    fn write_all(
        &mut self,
        pending: &[(Bytes, oneshot::Sender<Result<(), String>>)],
    ) -> Result<(), String> {
        if let Some(reason) = &self.poisoned {
            return Err(reason.clone());
        }
        let mut buf = Vec::with_capacity(pending.iter().map(|(p, _)| p.len() + HEADER).sum());
        for (payload, _) in pending {
            let len =
                u32::try_from(payload.len()).map_err(|_| "record larger than 4 GiB".to_string())?;
            buf.extend_from_slice(&len.to_le_bytes());
            buf.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
            buf.extend_from_slice(payload);
        }
        let written = self
            .file
            .write_all(&buf)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.good_len += buf.len() as u64;
                self.stats
                    .appends
                    .fetch_add(pending.len() as u64, Ordering::Relaxed);
                self.stats.syncs.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes
                    .fetch_add(buf.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                let message = format!("writing segment {}: {e}", self.id);
                tracing::error!(error = %message, "write-ahead log write failed; the batches were not acknowledged");
                // Cut the partial write off so the next record starts on a record boundary.
                if let Err(e2) = self
                    .file
                    .set_len(self.good_len)
                    .and_then(|()| self.file.sync_data())
                {
                    self.poisoned = Some(format!(
                        "{message}; could not truncate the partial write: {e2}"
                    ));
                }
                Err(message)
            }
        }
    }

    fn rotate(&mut self) -> Result<u64, String> {
        let closed = self.id;
        let next = Writer::create(self.dir.clone(), closed + 1).map_err(|e| e.to_string())?;
        self.file = next.file;
        self.id = next.id;
        self.good_len = 0;
        Ok(closed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    }

    #[test]
    fn appends_replay_in_order_and_rotation_bounds_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        rt().block_on(async {
            let wal = Wal::open(dir.path(), 0).expect("open");
            wal.append(Bytes::from_static(b"one"))
                .await
                .expect("append");
            let closed = wal.rotate().await.expect("rotate");
            wal.append(Bytes::from_static(b"two"))
                .await
                .expect("append");
            assert_eq!(
                replay(dir.path(), 0).expect("replay"),
                vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")]
            );
            assert_eq!(
                replay(dir.path(), closed).expect("replay"),
                vec![Bytes::from_static(b"two")]
            );
            wal.remove_through(closed).expect("remove");
            assert_eq!(
                replay(dir.path(), 0).expect("replay"),
                vec![Bytes::from_static(b"two")]
            );
        });
    }

    #[test]
    fn starts_that_write_nothing_leave_no_segments_behind() {
        let dir = tempfile::tempdir().expect("tempdir");
        for _ in 0..5 {
            let _wal = Wal::open(dir.path(), 7).expect("open");
        }
        // Each start removed the empty segment of the one before; ids stay after the flushed one.
        assert_eq!(segments(dir.path()).expect("segments"), vec![8]);
        rt().block_on(async {
            let wal = Wal::open(dir.path(), 7).expect("open");
            wal.append(Bytes::from_static(b"kept"))
                .await
                .expect("append");
        });
        drop(Wal::open(dir.path(), 7).expect("reopen"));
        let _wal = Wal::open(dir.path(), 7).expect("reopen");
        assert_eq!(segments(dir.path()).expect("segments"), vec![8, 9]);
        assert_eq!(
            replay(dir.path(), 7).expect("replay"),
            vec![Bytes::from_static(b"kept")]
        );
    }

    #[test]
    fn torn_tail_is_ignored_and_next_start_uses_a_new_segment() {
        let dir = tempfile::tempdir().expect("tempdir");
        rt().block_on(async {
            let wal = Wal::open(dir.path(), 0).expect("open");
            wal.append(Bytes::from_static(b"kept"))
                .await
                .expect("append");
        });
        let seg = segment_path(dir.path(), 1);
        let mut f = OpenOptions::new()
            .append(true)
            .open(&seg)
            .expect("open segment");
        f.write_all(&[200, 0, 0, 0, 1, 2])
            .expect("write torn header");
        drop(f);
        assert_eq!(
            replay(dir.path(), 0).expect("replay"),
            vec![Bytes::from_static(b"kept")]
        );
        // Flip a payload byte: the crc no longer matches and the record is dropped.
        let mut data = fs::read(&seg).expect("read");
        data[HEADER] ^= 0xff;
        fs::write(&seg, data).expect("write");
        assert!(replay(dir.path(), 0).expect("replay").is_empty());
        rt().block_on(async {
            let _wal = Wal::open(dir.path(), 0).expect("reopen");
        });
        assert_eq!(segments(dir.path()).expect("segments"), vec![1, 2]);
    }
}
