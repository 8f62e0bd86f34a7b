//! The write-ahead log: every accepted batch is on disk, fsynced, before the server answers.
//!
//! One writer thread owns the active segment file. Appends from any number of requests queue on
//! a channel; the thread writes everything queued, calls `fdatasync` once, and then answers all
//! of them (group commit), so durability costs one sync per burst rather than one per request.
//!
//! On disk (specified in `docs/format/wal.md`): `wal/<segment:020>.wal` files. A segment
//! begins with a header, [`MAGIC`] and its format version (u32 LE), then holds a sequence of
//! records `[payload length: u32 LE][crc32 of payload: u32 LE][payload]`, each payload a
//! [`RecordKind`] tag byte and its body. Segments written before versions were recorded have no
//! header and are version 1 (see [`RecordKind::split`] for their payloads). Every process start
//! opens a fresh segment, so one segment has one writer and one version, and a torn record can
//! only be the tail of a segment whose writer died; replay drops that tail (it was never
//! acknowledged) and counts it. A whole, checksummed record this binary cannot read (a newer
//! version, an unknown tag) was acknowledged: replay refuses it, and the store does not open.
//! Segments are deleted only after the flush that covers them is recorded in the manifest.

use crate::{Error, Result};
use bytes::Bytes;
use perch_model::wire::Encoding;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use tokio::sync::oneshot;

/// The format version of the segments this binary writes; it reads every version from 1 up to
/// this one.
pub const FORMAT_VERSION: u32 = 3;

/// The version of a segment with no header: written before versions were recorded.
pub const HEADERLESS_VERSION: u32 = 1;

/// The first bytes of every segment of version 2 or later, followed by the version (u32 LE).
/// Read as a version-1 record header, `PERC` is a length of over 1 GiB, more than any record
/// may be, so the first bytes of a segment tell the two apart.
pub const MAGIC: [u8; 8] = *b"PERCHWAL";

/// Length of a segment's header: [`MAGIC`] and the version.
pub const SEGMENT_HEADER: usize = MAGIC.len() + 4;

/// A record's header: payload length and checksum.
const HEADER: usize = 8;
/// Largest record accepted on replay; larger lengths mean a corrupt header.
const MAX_RECORD: usize = 256 << 20;

const _: () = assert!(
    u32::from_le_bytes([MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3]]) as usize > MAX_RECORD,
    "a segment header must never read as a version-1 record"
);

/// What a record holds: the one list of payload tags (`docs/format/wal.md` lists them too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// A `Batch` an agent sent, its JSON as received (`A`).
    AgentBatch,
    /// A `Batch` an agent sent, its MessagePack as received
    /// ([`perch_model::wire::Encoding::Msgpack`]; `M`, from version 3).
    AgentBatchMsgpack,
    /// A `Batch` the server's OTLP receiver numbered, as JSON (`O`).
    OtlpBatch,
    /// A JSON array of the server's `ClusterEvent`s (`E`).
    Events,
}

impl RecordKind {
    pub const ALL: [RecordKind; 4] = [
        RecordKind::AgentBatch,
        RecordKind::AgentBatchMsgpack,
        RecordKind::OtlpBatch,
        RecordKind::Events,
    ];

    /// The byte a payload of this kind starts with.
    pub const fn tag(self) -> u8 {
        match self {
            RecordKind::AgentBatch => b'A',
            RecordKind::AgentBatchMsgpack => b'M',
            RecordKind::OtlpBatch => b'O',
            RecordKind::Events => b'E',
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RecordKind::AgentBatch => "agent batch",
            RecordKind::AgentBatchMsgpack => "agent batch (MessagePack)",
            RecordKind::OtlpBatch => "OTLP batch",
            RecordKind::Events => "cluster events",
        }
    }

    /// The first format version whose segments may hold this kind.
    pub const fn since(self) -> u32 {
        match self {
            RecordKind::AgentBatch | RecordKind::OtlpBatch | RecordKind::Events => {
                HEADERLESS_VERSION
            }
            RecordKind::AgentBatchMsgpack => 3,
        }
    }

    /// The kind of an agent's batch sent in `encoding`, written as received.
    pub const fn agent_batch(encoding: Encoding) -> RecordKind {
        match encoding {
            Encoding::Json => RecordKind::AgentBatch,
            Encoding::Msgpack => RecordKind::AgentBatchMsgpack,
        }
    }

    /// The kind tagged `tag` in a segment of `version`.
    fn of_tag(version: u32, tag: u8) -> Option<RecordKind> {
        RecordKind::ALL
            .into_iter()
            .find(|k| k.tag() == tag && k.since() <= version)
    }

    /// The kind and body of a payload in a segment of `version`; `None` for a tag this binary
    /// does not know. Version 1 tagged only events (`E`) and OTLP batches (`O`): any other
    /// payload is an agent's batch, its JSON from the first byte. From version 2 every payload
    /// starts with its tag; version 3 added `M` (an agent's batch as MessagePack).
    pub fn split(version: u32, payload: &Bytes) -> Option<(RecordKind, Bytes)> {
        let tagged = |kind| (kind, payload.slice(1..));
        match (version, payload.first().copied()) {
            (HEADERLESS_VERSION, Some(b'E')) => Some(tagged(RecordKind::Events)),
            (HEADERLESS_VERSION, Some(b'O')) => Some(tagged(RecordKind::OtlpBatch)),
            (HEADERLESS_VERSION, _) => Some((RecordKind::AgentBatch, payload.clone())),
            (_, Some(tag)) => RecordKind::of_tag(version, tag).map(tagged),
            (_, None) => None,
        }
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct WalStats {
    pub appends: AtomicU64,
    pub syncs: AtomicU64,
    pub bytes: AtomicU64,
}

enum Command {
    Append(RecordKind, Bytes, oneshot::Sender<Result<(), String>>),
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

/// One record read back, and where it was.
#[derive(Debug, Clone)]
pub struct Record {
    pub kind: RecordKind,
    /// The payload after its tag (a version-1 agent batch's whole payload).
    pub body: Bytes,
    pub segment: Arc<Path>,
    /// Where the record's header starts in its segment.
    pub offset: usize,
    /// Its segment's format version.
    pub version: u32,
}

impl Record {
    /// The error that refuses to open a store over this record, which this binary cannot
    /// decode (`why`): it was acknowledged, so skipping it would lose data.
    pub fn unreadable(&self, why: impl std::fmt::Display) -> Error {
        refuse(
            &self.segment,
            format!(
                "record at offset {} (format version {}, {}) cannot be decoded: {why}",
                self.offset,
                self.version,
                self.kind.name()
            ),
        )
    }
}

/// What replay read: the records, in order, and how many it skipped.
#[derive(Debug, Default)]
pub struct Replayed {
    pub records: Vec<Record>,
    /// Torn tails dropped (one per segment a crash cut short; never acknowledged) and records
    /// whose checksum fails in the middle of a segment (damaged on disk).
    pub skipped: u64,
}

/// The error for an acknowledged record this binary cannot read.
fn refuse(segment: &Path, what: String) -> Error {
    let dir = segment.parent().unwrap_or(Path::new("."));
    Error::Io {
        what: "replaying write-ahead log segment",
        path: segment.to_owned(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{what}. This perch writes write-ahead log format version {FORMAT_VERSION} and \
                 reads versions {HEADERLESS_VERSION} to {FORMAT_VERSION}. What it holds was \
                 acknowledged, so the store is not opened without it: run the perch release that \
                 wrote it (or a newer one), which replays it and flushes it to Parquet. Moving the \
                 segment out of {} instead starts without every record in it (see \
                 docs/format/wal.md)",
                dir.display()
            ),
        ),
    }
}

/// A segment's first bytes: its version and where its records start, or `None` when it holds
/// no record (empty, or a header its writer did not finish: it wrote none after it).
fn segment_header(data: &[u8], path: &Path) -> Result<Option<(u32, usize)>> {
    if data.is_empty() {
        return Ok(None);
    }
    let n = data.len().min(MAGIC.len());
    if data[..n] != MAGIC[..n] {
        return Ok(Some((HEADERLESS_VERSION, 0)));
    }
    let Some(version) = data.get(MAGIC.len()..SEGMENT_HEADER) else {
        return Ok(None);
    };
    let version = u32::from_le_bytes([version[0], version[1], version[2], version[3]]);
    if version <= HEADERLESS_VERSION {
        return Err(refuse(
            path,
            format!(
                "the segment's header (offset 0) names format version {version}, which has no header: the header is damaged"
            ),
        ));
    }
    if version > FORMAT_VERSION {
        return Err(refuse(
            path,
            format!(
                "the segment (header at offset 0) is of format version {version}, written by a newer perch"
            ),
        ));
    }
    Ok(Some((version, SEGMENT_HEADER)))
}

/// The end of the whole, checksummed record at `pos`, if one is there.
fn whole_record(data: &[u8], pos: usize) -> Option<usize> {
    let end = claimed_end(data, pos)?;
    let crc = data.get(pos + 4..pos + HEADER)?;
    let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    (crc32fast::hash(&data[pos + HEADER..end]) == crc).then_some(end)
}

/// Where the record at `pos` would end by its header's length, if the segment is that long.
/// No version writes an empty payload, so a length of 0 is no record: zeros a crash left at
/// the end of a file (its length grown, its data not written) read as one, checksum and all.
fn claimed_end(data: &[u8], pos: usize) -> Option<usize> {
    let header = data.get(pos..pos + HEADER)?;
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    let end = pos + HEADER + len;
    (len > 0 && len <= MAX_RECORD && end <= data.len()).then_some(end)
}

/// Reads every record of the segments after `after`, in order (see [`self`] for what is
/// dropped, skipped and refused).
pub fn replay(dir: &Path, after: u64) -> Result<Replayed> {
    let mut replayed = Replayed::default();
    for id in segments(dir)?.into_iter().filter(|&id| id > after) {
        let path = segment_path(dir, id);
        let mut data = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut data))
            .map_err(Error::io("reading write-ahead log", &path))?;
        read_segment(Bytes::from(data), path.into(), &mut replayed)?;
    }
    Ok(replayed)
}

fn read_segment(data: Bytes, path: Arc<Path>, out: &mut Replayed) -> Result<()> {
    let Some((version, mut pos)) = segment_header(&data, &path)? else {
        return Ok(());
    };
    while pos < data.len() {
        let Some(end) = whole_record(&data, pos) else {
            // A record whose checksum fails with a whole record after it was damaged where it
            // lay, or cut short by a crash whose later writes reached the disk before it: skip
            // it alone. Anything else is the tail a crash cut short.
            if let Some(next) =
                claimed_end(&data, pos).filter(|&n| whole_record(&data, n).is_some())
            {
                tracing::error!(
                    segment = %path.display(),
                    offset = pos,
                    "a write-ahead log record followed by whole ones fails its checksum: damaged on disk (its data is lost), or cut short by a crash in the middle of a write (never acknowledged); skipping it"
                );
                out.skipped += 1;
                pos = next;
                continue;
            }
            tracing::warn!(
                segment = %path.display(),
                offset = pos,
                "write-ahead log segment ends in a torn record; dropping the tail (it was never acknowledged)"
            );
            out.skipped += 1;
            break;
        };
        let payload = data.slice(pos + HEADER..end);
        let Some((kind, body)) = RecordKind::split(version, &payload) else {
            let tag = payload.first().map_or("none".to_owned(), |t| {
                format!("{t:#04x} ({:?})", char::from(*t))
            });
            return Err(refuse(
                &path,
                format!(
                    "record at offset {pos} (format version {version}) has payload tag {tag}, which this perch does not know"
                ),
            ));
        };
        out.records.push(Record {
            kind,
            body,
            segment: path.clone(),
            offset: pos,
            version,
        });
        pos = end;
    }
    Ok(())
}

/// A segment that holds no record: empty, or only a header (whole or torn).
fn holds_no_record(path: &Path) -> Result<bool> {
    let mut start = Vec::with_capacity(SEGMENT_HEADER + 1);
    File::open(path)
        .and_then(|f| f.take(SEGMENT_HEADER as u64 + 1).read_to_end(&mut start))
        .map_err(Error::io("reading write-ahead log segment", path))?;
    let n = start.len().min(MAGIC.len());
    Ok(start.is_empty() || (start[..n] == MAGIC[..n] && start.len() <= SEGMENT_HEADER))
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Wal {
    /// Opens a fresh segment after every existing one and after `flushed_through` (the last
    /// segment whose records are in Parquet), and starts the writer thread. Segments after
    /// `flushed_through` that hold no record (empty, or a header alone) are removed first:
    /// without that every start that wrote nothing would leave one behind, and restarts would
    /// pile them up.
    pub fn open(dir: &Path, flushed_through: u64) -> Result<Wal> {
        fs::create_dir_all(dir).map_err(Error::io("creating directory", dir))?;
        let mut last = flushed_through;
        for id in segments(dir)?
            .into_iter()
            .filter(|&id| id > flushed_through)
        {
            let path = segment_path(dir, id);
            if holds_no_record(&path)? {
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

    /// Appends one record of `kind` holding `body`; returns once it is fsynced.
    pub async fn append(&self, kind: RecordKind, body: Bytes) -> Result<()> {
        if body.len() >= MAX_RECORD {
            // Replay would take its length for a corrupt header: never acknowledge one.
            return Err(Error::WalClosed(format!(
                "a record of {} bytes is more than the {} MiB one record may hold; send smaller batches",
                body.len(),
                MAX_RECORD >> 20
            )));
        }
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Command::Append(kind, body, done))
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

/// An append waiting for the next group commit.
type Pending = (RecordKind, Bytes, oneshot::Sender<Result<(), String>>);

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
    /// Creates segment `id` with its header, synced.
    fn create(dir: PathBuf, id: u64) -> Result<Writer> {
        let path = segment_path(&dir, id);
        let mut file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(Error::io("creating write-ahead log segment", &path))?;
        let mut header = [0u8; SEGMENT_HEADER];
        header[..MAGIC.len()].copy_from_slice(&MAGIC);
        header[MAGIC.len()..].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        let written = file
            .write_all(&header)
            .and_then(|()| file.sync_data())
            .map_err(Error::io("writing write-ahead log segment header", &path))
            .and_then(|()| sync_dir(&dir).map_err(Error::io("syncing directory", &dir)));
        if let Err(e) = written {
            // No record was written to it: removed, so that the next try (once a full disk has
            // room again) can create the segment afresh instead of finding it there.
            drop(file);
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(Writer {
            dir,
            id,
            file,
            good_len: SEGMENT_HEADER as u64,
            poisoned: None,
            stats: Arc::default(),
        })
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        let mut pending: Vec<Pending> = Vec::new();
        while let Ok(first) = rx.recv() {
            let mut next = Some(first);
            while let Some(cmd) = next.take() {
                match cmd {
                    Command::Append(kind, body, done) => pending.push((kind, body, done)),
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

    fn commit(&mut self, pending: &mut Vec<Pending>) {
        if pending.is_empty() {
            return;
        }
        let result = self.write_all(pending);
        for (_, _, done) in pending.drain(..) {
            let _ = done.send(result.clone());
        }
    }

    fn write_all(&mut self, pending: &[Pending]) -> Result<(), String> {
        if let Some(reason) = &self.poisoned {
            return Err(reason.clone());
        }
        let mut buf =
            Vec::with_capacity(pending.iter().map(|(_, b, _)| HEADER + 1 + b.len()).sum());
        for (kind, body, _) in pending {
            let len = u32::try_from(body.len() + 1)
                .map_err(|_| "record larger than 4 GiB".to_string())?;
            let mut crc = crc32fast::Hasher::new();
            crc.update(&[kind.tag()]);
            crc.update(body);
            buf.extend_from_slice(&len.to_le_bytes());
            buf.extend_from_slice(&crc.finalize().to_le_bytes());
            buf.push(kind.tag());
            buf.extend_from_slice(body);
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

    fn bodies(replayed: &Replayed) -> Vec<(RecordKind, Bytes)> {
        replayed
            .records
            .iter()
            .map(|r| (r.kind, r.body.clone()))
            .collect()
    }

    fn agent(body: &'static [u8]) -> (RecordKind, Bytes) {
        (RecordKind::AgentBatch, Bytes::from_static(body))
    }

    /// A record as it lies in a segment: header, then `payload`.
    fn framed(payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn appends_replay_in_order_and_rotation_bounds_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        rt().block_on(async {
            let wal = Wal::open(dir.path(), 0).expect("open");
            wal.append(RecordKind::AgentBatch, Bytes::from_static(b"one"))
                .await
                .expect("append");
            let closed = wal.rotate().await.expect("rotate");
            wal.append(RecordKind::Events, Bytes::from_static(b"two"))
                .await
                .expect("append");
            let all = replay(dir.path(), 0).expect("replay");
            assert_eq!(
                bodies(&all),
                vec![
                    agent(b"one"),
                    (RecordKind::Events, Bytes::from_static(b"two"))
                ]
            );
            assert_eq!(all.skipped, 0);
            assert_eq!(
                (all.records[0].offset, all.records[0].version),
                (SEGMENT_HEADER, FORMAT_VERSION)
            );
            assert_eq!(
                bodies(&replay(dir.path(), closed).expect("replay")),
                vec![(RecordKind::Events, Bytes::from_static(b"two"))]
            );
            wal.remove_through(closed).expect("remove");
            assert_eq!(
                bodies(&replay(dir.path(), 0).expect("replay")),
                vec![(RecordKind::Events, Bytes::from_static(b"two"))]
            );
        });
    }

    #[test]
    fn segments_start_with_their_header_and_records_with_their_tag() {
        let dir = tempfile::tempdir().expect("tempdir");
        rt().block_on(async {
            let wal = Wal::open(dir.path(), 0).expect("open");
            wal.append(RecordKind::OtlpBatch, Bytes::from_static(b"{}"))
                .await
                .expect("append");
        });
        let data = fs::read(segment_path(dir.path(), 1)).expect("read");
        let mut expected = b"PERCHWAL".to_vec();
        expected.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        expected.extend_from_slice(&framed(b"O{}"));
        assert_eq!(data, expected);
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
            wal.append(RecordKind::AgentBatch, Bytes::from_static(b"kept"))
                .await
                .expect("append");
        });
        drop(Wal::open(dir.path(), 7).expect("reopen"));
        let _wal = Wal::open(dir.path(), 7).expect("reopen");
        assert_eq!(segments(dir.path()).expect("segments"), vec![8, 9]);
        assert_eq!(
            bodies(&replay(dir.path(), 7).expect("replay")),
            vec![agent(b"kept")]
        );
    }

    #[test]
    fn torn_tail_is_dropped_and_counted_and_next_start_uses_a_new_segment() {
        let dir = tempfile::tempdir().expect("tempdir");
        rt().block_on(async {
            let wal = Wal::open(dir.path(), 0).expect("open");
            wal.append(RecordKind::AgentBatch, Bytes::from_static(b"kept"))
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
        let replayed = replay(dir.path(), 0).expect("replay");
        assert_eq!(bodies(&replayed), vec![agent(b"kept")]);
        assert_eq!(replayed.skipped, 1);
        // Flip a payload byte: the crc no longer matches, and with nothing whole after it the
        // record is the tail a crash cut short.
        let mut data = fs::read(&seg).expect("read");
        data[SEGMENT_HEADER + HEADER + 1] ^= 0xff;
        fs::write(&seg, data).expect("write");
        let replayed = replay(dir.path(), 0).expect("replay");
        assert!(replayed.records.is_empty());
        assert_eq!(replayed.skipped, 1);
        rt().block_on(async {
            let _wal = Wal::open(dir.path(), 0).expect("reopen");
        });
        assert_eq!(segments(dir.path()).expect("segments"), vec![1, 2]);
    }

    #[test]
    fn zeros_a_crash_left_at_the_end_are_a_torn_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut data = MAGIC.to_vec();
        data.extend_from_slice(&2u32.to_le_bytes());
        data.extend_from_slice(&framed(b"Akept"));
        data.extend_from_slice(&[0; 4096]);
        fs::write(segment_path(dir.path(), 1), data).expect("write");
        let replayed = replay(dir.path(), 0).expect("replay");
        assert_eq!(bodies(&replayed), vec![agent(b"kept")]);
        assert_eq!(replayed.skipped, 1);
    }

    #[test]
    fn a_damaged_record_before_whole_ones_is_skipped_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut data = MAGIC.to_vec();
        data.extend_from_slice(&2u32.to_le_bytes());
        for payload in [&b"Aone"[..], b"Atwo", b"Athree"] {
            data.extend_from_slice(&framed(payload));
        }
        // Damage "two" where it lies: its header still says how long it is.
        let second = SEGMENT_HEADER + HEADER + 4;
        data[second + HEADER + 2] ^= 0xff;
        fs::write(segment_path(dir.path(), 1), data).expect("write");
        let replayed = replay(dir.path(), 0).expect("replay");
        assert_eq!(bodies(&replayed), vec![agent(b"one"), agent(b"three")]);
        assert_eq!(replayed.skipped, 1);
    }

    #[test]
    fn headerless_segments_are_version_1_with_their_implicit_agent_tag() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut data = Vec::new();
        for payload in [&b"{\"a\":1}"[..], b" {}", b"E[]", b"O{}"] {
            data.extend_from_slice(&framed(payload));
        }
        fs::write(segment_path(dir.path(), 1), data).expect("write");
        let replayed = replay(dir.path(), 0).expect("replay");
        assert_eq!(
            bodies(&replayed),
            vec![
                agent(b"{\"a\":1}"),
                agent(b" {}"),
                (RecordKind::Events, Bytes::from_static(b"[]")),
                (RecordKind::OtlpBatch, Bytes::from_static(b"{}")),
            ]
        );
        assert!(replayed.records.iter().all(|r| r.version == 1));
        assert_eq!(replayed.records[1].offset, HEADER + 7);
        // A new segment follows it; the headerless one is kept (it holds records).
        drop(Wal::open(dir.path(), 0).expect("open"));
        assert_eq!(segments(dir.path()).expect("segments"), vec![1, 2]);
    }

    #[test]
    fn what_this_binary_cannot_read_is_refused_naming_file_offset_and_version() {
        let check = |data: Vec<u8>, says: &[&str]| {
            let dir = tempfile::tempdir().expect("tempdir");
            fs::write(segment_path(dir.path(), 3), data).expect("write");
            let err = replay(dir.path(), 0).expect_err("refused").to_string();
            for s in says {
                assert!(err.contains(s), "{s:?} not in: {err}");
            }
            assert!(err.contains("00000000000000000003.wal"), "{err}");
            assert!(err.contains("run the perch release that wrote it"), "{err}");
        };
        let mut newer = MAGIC.to_vec();
        newer.extend_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        newer.extend_from_slice(&framed(b"Z"));
        check(
            newer,
            &[
                "offset 0",
                &format!("format version {}", FORMAT_VERSION + 1),
            ],
        );
        let mut unknown_tag = MAGIC.to_vec();
        unknown_tag.extend_from_slice(&2u32.to_le_bytes());
        unknown_tag.extend_from_slice(&framed(b"A{}"));
        unknown_tag.extend_from_slice(&framed(b"Z{}"));
        check(
            unknown_tag,
            &[
                &format!("offset {}", SEGMENT_HEADER + HEADER + 3),
                "format version 2",
                "0x5a ('Z')",
            ],
        );
    }
}
