//! The store: durable ingest, the in-memory buffer SQL reads, and flushes to Parquet.
//!
//! Ordering that makes it crash-safe and free of double counting:
//! 1. `ingest` holds the read side of `gate` while it appends to the write-ahead log and then
//!    applies the batch to the buffer, so an acknowledged batch is durable and visible at once.
//! 2. `flush` takes the write side of `gate` for a moment: it rotates the log and moves the
//!    buffer to `flushing` (still visible to SQL). Every record in the closed segments is now in
//!    `flushing`, and nothing in `flushing` is in a later segment.
//! 3. It writes Parquet, saves a manifest listing the new files and the closed segment, and in
//!    one step under the lock makes the files visible and drops `flushing`; only then are the
//!    covered log segments deleted.
//!
//! Batches are deduplicated by sequence stream and `seq`: a batch whose `seq` is not above the
//! last one accepted on its stream is acknowledged as a duplicate and stored nowhere. Each
//! [`Source`] numbers its batches itself, so each has its own streams: an agent's stream is its
//! node, and the server's OTLP receiver has one stream of its own whatever node its batches name.
//! Two sources never share a sequence space, so one cannot make the other's batches look old.

use crate::files::{NewFile, flush_files};
use crate::manifest::{FileEntry, Manifest};
use crate::peers::{PeerConfig, Peers};
use crate::schema::{self, Table};
use crate::storage::{self, Storage, StorageConfig};
use crate::wal::{self, RecordKind, Wal, WalStats};
use crate::{Error, Result, rollup};
use arrow::array::RecordBatch;
use arrow::compute::concat_batches;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use perch_model::wire::Encoding;
use perch_model::{Batch, ClusterEvent};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Where and how often the store writes.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// The write-ahead log and the lock file always live here; the Parquet files and the
    /// manifest too, unless `storage` puts them in a bucket.
    pub data_dir: PathBuf,
    /// Where the Parquet files and the manifest live.
    pub storage: StorageConfig,
    /// Buffered rows are written to Parquet at least this often.
    pub flush_interval: Duration,
    /// ... or as soon as this many rows are buffered.
    pub flush_max_rows: usize,
    /// Most rows held in memory (buffered or being flushed). Past it, ingest is refused with
    /// [`Error::Backpressure`] (HTTP 503 with Retry-After) until a flush gets through: senders
    /// keep their data and retry, and the server's memory stays bounded when flushes fail.
    pub max_buffered_rows: usize,
    /// How often compaction and retention run.
    pub maintenance_interval: Duration,
    /// Files smaller than this are merged with the other small files of their day partition...
    pub compact_below_bytes: u64,
    /// ... once a partition has at least this many of them.
    pub compact_min_files: usize,
    /// Per table: rows older than this are dropped, a whole partition at a time. Tables not
    /// listed are kept forever. The defaults ([`StoreConfig::default_retention`]) keep raw GPU
    /// and host samples 30 days, their 1-minute rollups 180 days and their 1-hour rollups
    /// three years.
    pub retention: BTreeMap<Table, Duration>,
    /// Other writers' stores this store's queries read beside its own ([`crate::peers`]):
    /// the ingest servers of a deployment that spreads telemetry over several.
    pub peers: Vec<PeerConfig>,
    /// How long a file replaced by compaction or dropped by retention stays after it left the
    /// manifest, once no query of this server reads it: other servers that read this store
    /// as a peer may still list it. Zero for a store no one else reads.
    pub delete_grace: Duration,
}

impl StoreConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        StoreConfig {
            data_dir: data_dir.into(),
            storage: StorageConfig::Local,
            flush_interval: Duration::from_secs(60),
            flush_max_rows: 1_000_000,
            max_buffered_rows: 4_000_000,
            maintenance_interval: Duration::from_secs(300),
            compact_below_bytes: 64 << 20,
            compact_min_files: 8,
            retention: Self::default_retention(),
            peers: Vec::new(),
            delete_grace: Duration::ZERO,
        }
    }

    /// Raw samples that have rollups: 30 days; 1-minute rollups: 180 days; 1-hour rollups:
    /// three years. Every other table is kept until configured otherwise.
    pub fn default_retention() -> BTreeMap<Table, Duration> {
        const DAY: u64 = 86_400;
        BTreeMap::from([
            (Table::GpuSamples, Duration::from_secs(30 * DAY)),
            (Table::HostSamples, Duration::from_secs(30 * DAY)),
            (Table::GpuSamples1m, Duration::from_secs(180 * DAY)),
            (Table::HostSamples1m, Duration::from_secs(180 * DAY)),
            (Table::GpuSamples1h, Duration::from_secs(3 * 365 * DAY)),
            (Table::HostSamples1h, Duration::from_secs(3 * 365 * DAY)),
        ])
    }
}

/// Who numbered a batch, and so which sequence stream deduplicates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A node's agent: one stream per node, numbered by that node's agent.
    Agent,
    /// The server's OpenTelemetry receiver: one stream for all its batches, whichever node
    /// (`host.name`) they carry, numbered by the receiver.
    Otlp,
}

impl Source {
    /// The stream's key, as kept in the manifest. Agents' keys are node names; the OTLP
    /// receiver's holds a `/`, which no node name may, so the two can never meet.
    fn stream(self, node: &str) -> String {
        match self {
            Source::Agent => node.to_owned(),
            Source::Otlp => OTLP_STREAM.to_owned(),
        }
    }

    /// How the write-ahead log tags its JSON batches.
    fn record_kind(self) -> RecordKind {
        match self {
            Source::Agent => RecordKind::AgentBatch,
            Source::Otlp => RecordKind::OtlpBatch,
        }
    }
}

/// The OTLP receiver's sequence stream (see [`Source::stream`]).
const OTLP_STREAM: &str = "/otlp";

/// After this many duplicates in a row on one stream, with no new batch between them, the
/// store warns: a sender retrying a lost answer sends one or two, so a longer run means new
/// data is being dropped (a second sender under the same node name, or numbering gone wrong).
const DUPLICATE_RUN_WARN: u64 = 3;

/// What happened to one ingested batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestOutcome {
    /// Durable and visible; carries the number of samples stored.
    Stored { samples: usize },
    /// Already accepted earlier (a retry); nothing stored.
    Duplicate,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct StoreStats {
    pub batches_stored: AtomicU64,
    pub batches_duplicate: AtomicU64,
    pub samples_stored: AtomicU64,
    pub batches_replayed: AtomicU64,
    /// Write-ahead log records replay skipped at start-up: torn tails a crash left (never
    /// acknowledged) and records damaged on disk ([`wal::Replayed::skipped`]).
    pub wal_records_skipped: AtomicU64,
    pub flushes: AtomicU64,
    pub flush_failures: AtomicU64,
    /// Flushes failed in a row since the last that worked (0 when the last one worked).
    pub consecutive_flush_failures: AtomicU64,
    /// Batches refused because too many rows were held in memory.
    pub batches_refused_backpressure: AtomicU64,
    pub files_written: AtomicU64,
    pub rows_flushed: AtomicU64,
}

/// The result of one flush.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlushStats {
    /// Buffered rows written.
    pub rows: u64,
    /// Files written, rollup files included.
    pub files: u64,
    /// Partial rollup rows written for them.
    pub rollup_rows: u64,
}

#[derive(Default)]
pub(crate) struct TableData {
    mem: Vec<RecordBatch>,
    /// Each of `mem`'s batches' merge level ([`push`]); [`UNMERGED`] for batches put back
    /// after a failed flush.
    mem_levels: Vec<u8>,
    mem_rows: usize,
    flushing: Vec<RecordBatch>,
    /// Rows in `flushing`, kept so the back-pressure check on every ingest is O(tables).
    flushing_rows: usize,
    pub(crate) files: Arc<Vec<FileEntry>>,
}

pub(crate) struct Inner {
    pub(crate) tables: BTreeMap<Table, TableData>,
    /// The last `seq` accepted per stream ([`Source::stream`]).
    node_seq: HashMap<String, u64>,
    /// Duplicates in a row per stream since its last accepted batch, and when the store last
    /// warned about that stream.
    duplicate_runs: HashMap<String, DuplicateRun>,
    in_flight: HashSet<(String, u64)>,
    pub(crate) manifest: Manifest,
    /// Files taken out of the manifest (compacted or past retention) but perhaps still read by
    /// a query that took its snapshot before; deleted once nothing holds `pinned`.
    pub(crate) graveyard: Vec<Grave>,
    /// The last flush's error while flushes fail; `None` once one works.
    flush_error: Option<String>,
}

/// What a query's scan of one table reads: [`Store::snapshot`].
pub(crate) struct TableSnapshot {
    /// This store's files, held by the query so none is deleted under it.
    pub(crate) pin: Arc<Vec<FileEntry>>,
    /// The files to scan: `pin`'s and every peer's.
    pub(crate) files: Arc<Vec<FileEntry>>,
    pub(crate) buffered: Vec<RecordBatch>,
}

pub(crate) struct Grave {
    pub(crate) pinned: Arc<Vec<FileEntry>>,
    pub(crate) paths: Vec<String>,
    /// When the files left the manifest ([`StoreConfig::delete_grace`] runs from here).
    pub(crate) buried: std::time::Instant,
}

pub struct Store {
    pub(crate) dir: PathBuf,
    /// Where the files and the manifest are.
    pub(crate) storage: Storage,
    pub(crate) config: StoreConfig,
    wal: Wal,
    gate: tokio::sync::RwLock<()>,
    /// Held by every change of the manifest (flush, compaction, retention): one at a time.
    pub(crate) manifest_lock: tokio::sync::Mutex<()>,
    inner: Mutex<Inner>,
    _lock_file: File,
    pub stats: StoreStats,
    /// Other writers' stores read beside this one.
    pub(crate) peers: Peers,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("dir", &self.dir).finish()
    }
}

/// Buffered record batches of one merge level merged into one of the next, to keep scans
/// cheap: a row is copied once a level, and the buffer holds fewer than this many batches a
/// level. (Merging the whole buffer every 256 batches copied every row again each time: with
/// 5,000 nodes sending every second, 8% of the server's CPU.)
const MERGE_FANOUT: usize = 16;

/// The level of batches that are never merged again (put back after a failed flush).
const UNMERGED: u8 = u8::MAX;

impl Store {
    /// Opens (or creates) the store in `config.data_dir`, replaying the write-ahead log.
    pub fn open(config: StoreConfig) -> Result<Arc<Store>> {
        let dir = config.data_dir.clone();
        fs::create_dir_all(&dir).map_err(Error::io("creating data directory", &dir))?;
        let lock_path = dir.join("LOCK");
        let lock_file = File::create(&lock_path).map_err(Error::io("creating", &lock_path))?;
        lock_file.try_lock().map_err(|_| Error::Io {
            what: "locking data directory (is another perch server using it?)",
            path: lock_path.clone(),
            source: std::io::Error::other("already locked"),
        })?;
        let manifest = storage::at_startup(&config.storage, &dir, async |storage| {
            let manifest = match storage.read_manifest().await? {
                Some(data) => {
                    let url = storage.file_url(crate::manifest::FILE_NAME);
                    upgrade(&storage, Manifest::parse(&data, &url)?).await?
                }
                None => {
                    // A new store records its version before it writes a log segment, so an
                    // older perch refuses it rather than misread the log.
                    let manifest = Manifest::empty();
                    storage.write_manifest(manifest.to_bytes()?).await?;
                    manifest
                }
            };
            remove_orphans(&storage, &manifest).await?;
            Ok(manifest)
        })?;
        let storage = Storage::new(&config.storage, &dir)?;
        let peers = Peers::new(&config.peers, &config.storage, &dir)?;
        let mut tables: BTreeMap<Table, TableData> = Table::ALL
            .into_iter()
            .map(|t| (t, TableData::default()))
            .collect();
        for (name, files) in &manifest.files {
            let table = Table::from_name(name).ok_or_else(|| Error::Corrupt {
                what: "manifest",
                message: format!("unknown table {name:?}"),
            })?;
            if let Some(t) = tables.get_mut(&table) {
                t.files = Arc::new(files.clone());
            }
        }
        let wal_dir = dir.join("wal");
        let replayed = wal::replay(&wal_dir, manifest.wal_flushed_through)?;
        let mut inner = Inner {
            tables,
            node_seq: manifest.node_seq.clone().into_iter().collect(),
            duplicate_runs: HashMap::new(),
            in_flight: HashSet::new(),
            manifest,
            graveyard: Vec::new(),
            flush_error: None,
        };
        let batches_replayed = replay(&mut inner, replayed.records)?;
        if batches_replayed > 0 {
            tracing::info!(batches = batches_replayed, "replayed write-ahead log");
        }
        // Only once every record is read: a store refused leaves no new segment behind.
        let wal = Wal::open(&wal_dir, inner.manifest.wal_flushed_through)?;
        let stats = StoreStats::default();
        stats
            .batches_replayed
            .store(batches_replayed, Ordering::Relaxed);
        stats
            .wal_records_skipped
            .store(replayed.skipped, Ordering::Relaxed);
        Ok(Arc::new(Store {
            dir,
            storage,
            config,
            wal,
            gate: tokio::sync::RwLock::new(()),
            manifest_lock: tokio::sync::Mutex::new(()),
            inner: Mutex::new(inner),
            _lock_file: lock_file,
            stats,
            peers,
        }))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave Inner half-updated in a way later code
        // relies on, so keep serving rather than poisoning every request.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn data_dir(&self) -> &Path {
        &self.dir
    }

    pub fn wal_stats(&self) -> &WalStats {
        &self.wal.stats
    }

    /// Stores one validated batch an agent sent. `raw` is its JSON encoding, written to the log
    /// as is. Returns once the batch is durable and visible to SQL.
    pub async fn ingest(&self, raw: Bytes, batch: &Batch) -> Result<IngestOutcome> {
        self.ingest_encoded(Encoding::Json, raw, batch).await
    }

    /// Stores one validated batch an agent sent in `encoding`; `raw` is that encoding of it, as
    /// received, written to the log as is (tagged with its encoding, so replay decodes it).
    pub async fn ingest_encoded(
        &self,
        encoding: Encoding,
        raw: Bytes,
        batch: &Batch,
    ) -> Result<IngestOutcome> {
        self.ingest_record(Source::Agent, RecordKind::agent_batch(encoding), raw, batch)
            .await
    }

    /// Stores one validated batch numbered by `source`, deduplicated on that source's own
    /// sequence stream. `raw` is its JSON encoding. Returns once the batch is durable and
    /// visible to SQL.
    ///
    /// Cancel-safe: a caller dropped while the log write is pending (a client that hung up)
    /// leaves no trace of the attempt, so the sender's retry is written, not refused.
    pub async fn ingest_from(
        &self,
        source: Source,
        raw: Bytes,
        batch: &Batch,
    ) -> Result<IngestOutcome> {
        self.ingest_record(source, source.record_kind(), raw, batch)
            .await
    }

    /// [`Store::ingest_from`] with the log record's kind (which says how `raw` is encoded).
    #[tracing::instrument(name = "store.ingest", skip_all, fields(node = %batch.node, seq = batch.seq))]
    async fn ingest_record(
        &self,
        source: Source,
        kind: RecordKind,
        raw: Bytes,
        batch: &Batch,
    ) -> Result<IngestOutcome> {
        let parts = schema::to_record_batches(batch)?;
        let stream = source.stream(batch.node.as_str());
        let _gate = self.gate.read().await;
        let claim = {
            let mut inner = self.lock();
            let adding: usize = parts.iter().map(|(_, rb)| rb.num_rows()).sum();
            let held = held_rows(&inner);
            if held + adding > self.config.max_buffered_rows {
                self.stats
                    .batches_refused_backpressure
                    .fetch_add(1, Ordering::Relaxed);
                return Err(Error::Backpressure {
                    held,
                    limit: self.config.max_buffered_rows,
                    flush_error: inner.flush_error.clone(),
                });
            }
            let last = inner.node_seq.get(&stream).copied();
            if let Some(last) = last.filter(|&last| batch.seq <= last) {
                self.stats.batches_duplicate.fetch_add(1, Ordering::Relaxed);
                note_duplicate(&mut inner, &stream, batch, last);
                return Ok(IngestOutcome::Duplicate);
            }
            // The same batch is being written by an earlier request (a retry raced it). That
            // write may still fail, so this one is neither stored nor acknowledged: the sender
            // retries and then learns the outcome.
            let key = (stream.clone(), batch.seq);
            if !inner.in_flight.insert(key.clone()) {
                return Err(Error::InFlight {
                    node: batch.node.as_str().to_owned(),
                    seq: batch.seq,
                });
            }
            InFlightClaim {
                store: self,
                key: Some(key),
            }
        };
        let written = self.wal.append(kind, raw).await;
        let mut inner = self.lock();
        claim.release(&mut inner);
        written?;
        apply(&mut inner, stream, batch, parts);
        let samples = batch.sample_count();
        self.stats.batches_stored.fetch_add(1, Ordering::Relaxed);
        self.stats
            .samples_stored
            .fetch_add(samples as u64, Ordering::Relaxed);
        Ok(IngestOutcome::Stored { samples })
    }

    /// Appends cluster events (the audit trail the server writes) to the `events` table.
    /// Returns once they are durable in the log and visible to SQL, like an ingested batch.
    pub async fn append_events(&self, events: &[ClusterEvent]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let rb = schema::events::to_record_batch(events)?;
        let raw = serde_json::to_vec(events)
            .map_err(|e| Error::Execution(format!("encoding events: {e}")))?;
        let _gate = self.gate.read().await;
        self.wal
            .append(RecordKind::Events, Bytes::from(raw))
            .await?;
        push(&mut self.lock(), Table::Events, rb);
        Ok(())
    }

    /// Rows waiting in memory for the next flush.
    pub fn buffered_rows(&self) -> usize {
        self.lock().tables.values().map(|t| t.mem_rows).sum()
    }

    /// Rows held in memory: buffered, or being written by a flush.
    pub fn held_rows(&self) -> usize {
        held_rows(&self.lock())
    }

    /// The most rows held in memory before ingest is refused.
    pub fn max_buffered_rows(&self) -> usize {
        self.config.max_buffered_rows
    }

    /// The last flush's error, while flushes fail (`None` once one works).
    pub fn flush_error(&self) -> Option<String> {
        self.lock().flush_error.clone()
    }

    /// Parquet files and bytes per table.
    pub fn file_counts(&self) -> Vec<(Table, usize, u64)> {
        self.lock()
            .tables
            .iter()
            .map(|(t, d)| (*t, d.files.len(), d.files.iter().map(|f| f.bytes).sum()))
            .collect()
    }

    /// What a query sees of `table` right now: its files and its buffered rows, consistent with
    /// each other (no row in both). For a rollup, the buffered rows are the partial rows of the
    /// source table's buffer, taken under the same lock as the rollup's files: a flush lists
    /// the rollup files and drops the raw rows from the buffer in one step.
    ///
    /// With peers ([`crate::peers`]), the files are this store's and the peers' together; the
    /// first of the three is this store's alone, for the query to pin.
    pub(crate) fn snapshot(&self, table: Table) -> Result<TableSnapshot> {
        let rollup = table.rollup();
        let buffer_of = rollup.map_or(table, |(spec, _)| spec.source);
        let (files, buffered) = {
            let inner = self.lock();
            let files = inner
                .tables
                .get(&table)
                .map(|t| t.files.clone())
                .unwrap_or_default();
            let buffered: Vec<RecordBatch> = inner
                .tables
                .get(&buffer_of)
                .map(|t| t.flushing.iter().chain(&t.mem).cloned().collect())
                .unwrap_or_default();
            (files, buffered)
        };
        let scanned = match self.peer_files(table) {
            Some(peer) if !peer.is_empty() => self.peers.with_own(table, &files, &peer),
            _ => files.clone(),
        };
        let buffered = match rollup {
            None => buffered,
            Some((spec, width)) => rollup::of_rows(spec, width, &buffered)?
                .into_iter()
                .collect(),
        };
        Ok(TableSnapshot {
            pin: files,
            files: scanned,
            buffered,
        })
    }

    /// Where the files and the manifest live (`s3://bucket/prefix/` or the data directory).
    pub fn storage_location(&self) -> String {
        self.storage.describe()
    }

    /// Writes everything buffered to Parquet, with the rollups of those rows, in one manifest
    /// commit.
    #[tracing::instrument(name = "store.flush", skip_all)]
    pub async fn flush(&self) -> Result<FlushStats> {
        let result = self.flush_once().await;
        match &result {
            Ok(_) => {
                self.stats
                    .consecutive_flush_failures
                    .store(0, Ordering::Relaxed);
                self.lock().flush_error = None;
            }
            Err(e) => {
                self.stats.flush_failures.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .consecutive_flush_failures
                    .fetch_add(1, Ordering::Relaxed);
                self.lock().flush_error = Some(e.to_string());
            }
        }
        result
    }

    async fn flush_once(&self) -> Result<FlushStats> {
        let _one = self.manifest_lock.lock().await;
        let (segment, node_seq, work, next_file_id) = {
            let _gate = self.gate.write().await;
            let segment = self.wal.rotate().await?;
            let mut inner = self.lock();
            let mut work = Vec::new();
            for (table, data) in inner.tables.iter_mut() {
                data.flushing.append(&mut data.mem);
                data.mem_levels.clear();
                data.flushing_rows += data.mem_rows;
                data.mem_rows = 0;
                if !data.flushing.is_empty() {
                    work.push((*table, data.flushing.clone()));
                }
            }
            (
                segment,
                inner.node_seq.clone(),
                work,
                inner.manifest.next_file_id,
            )
        };
        let written = self.write_flush(work, next_file_id).await;
        let (written, next_file_id) = match written {
            Ok(w) => w,
            Err(e) => {
                // Keep the rows visible and buffered; their log segments are still on disk.
                // Files already written are listed by no manifest: removed at the next start.
                let mut inner = self.lock();
                for data in inner.tables.values_mut() {
                    let mut back = std::mem::take(&mut data.flushing);
                    data.mem_rows += std::mem::take(&mut data.flushing_rows);
                    let mut levels = vec![UNMERGED; back.len()];
                    back.append(&mut data.mem);
                    levels.append(&mut data.mem_levels);
                    data.mem = back;
                    data.mem_levels = levels;
                }
                return Err(e);
            }
        };
        let mut manifest = self.lock().manifest.clone();
        let mut stats = FlushStats::default();
        for (table, entry) in written {
            stats.files += 1;
            if table.rollup().is_some() {
                stats.rollup_rows += entry.rows;
            } else {
                stats.rows += entry.rows;
            }
            manifest
                .files
                .entry(table.name().to_owned())
                .or_default()
                .push(entry);
        }
        manifest.wal_flushed_through = segment;
        manifest.node_seq = node_seq.into_iter().collect();
        manifest.next_file_id = next_file_id;
        self.commit(manifest, BTreeMap::new(), |inner| {
            for data in inner.tables.values_mut() {
                data.flushing.clear();
                data.flushing_rows = 0;
            }
        })
        .await?;
        self.wal.remove_through(segment)?;
        self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        self.stats
            .files_written
            .fetch_add(stats.files, Ordering::Relaxed);
        self.stats
            .rows_flushed
            .fetch_add(stats.rows, Ordering::Relaxed);
        if stats.rows > 0 {
            tracing::debug!(
                rows = stats.rows,
                rollup_rows = stats.rollup_rows,
                files = stats.files,
                "flushed buffer to parquet"
            );
        }
        Ok(stats)
    }

    /// Encodes the flushed rows (and their rollups) off the runtime, then stores the files.
    async fn write_flush(
        &self,
        work: Vec<(Table, Vec<RecordBatch>)>,
        next_file_id: u64,
    ) -> Result<(Vec<(Table, FileEntry)>, u64)> {
        let (files, next) = tokio::task::spawn_blocking(move || {
            let mut next = next_file_id;
            let mut out = Vec::new();
            for (table, batches) in work {
                out.extend(flush_files(table, &batches, &mut next)?);
            }
            Ok::<_, Error>((out, next))
        })
        .await
        .map_err(|e| Error::Execution(format!("flush task failed: {e}")))??;
        Ok((self.put_files(files).await?, next))
    }

    /// Stores encoded files, a few at a time (object stores reward concurrency).
    pub(crate) async fn put_files(&self, files: Vec<NewFile>) -> Result<Vec<(Table, FileEntry)>> {
        futures::stream::iter(files)
            .map(|f| async move {
                self.storage.put(&f.entry.path, f.data).await?;
                Ok::<_, Error>((f.table, f.entry))
            })
            .buffered(8)
            .try_collect()
            .await
    }

    /// Saves `manifest` and makes it current: each table's file list is replaced, `also`
    /// runs under the same lock (so a query sees the old state or the new one, never a mix),
    /// and the `removed` files of each table go to the graveyard. The caller holds
    /// `manifest_lock`.
    pub(crate) async fn commit(
        &self,
        manifest: Manifest,
        mut removed: BTreeMap<Table, Vec<String>>,
        also: impl FnOnce(&mut Inner),
    ) -> Result<()> {
        self.storage.write_manifest(manifest.to_bytes()?).await?;
        let mut inner = self.lock();
        let inner = &mut *inner;
        for (table, data) in inner.tables.iter_mut() {
            let files = Arc::new(
                manifest
                    .files
                    .get(table.name())
                    .cloned()
                    .unwrap_or_default(),
            );
            let old = std::mem::replace(&mut data.files, files);
            if let Some(paths) = removed.remove(table).filter(|p| !p.is_empty()) {
                inner.graveyard.push(Grave {
                    pinned: old,
                    paths,
                    buried: std::time::Instant::now(),
                });
            }
        }
        also(inner);
        inner.manifest = manifest;
        Ok(())
    }

    /// Flushes every `flush_interval`, or sooner once `flush_max_rows` rows are buffered, until
    /// `shutdown` resolves; then flushes once more. Retention runs as of `now_ms()` (the
    /// caller's clock, in milliseconds since the epoch).
    pub async fn run_flusher(
        self: Arc<Self>,
        now_ms: impl Fn() -> i64,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = tokio::time::Instant::now();
        let mut last_maintenance = tokio::time::Instant::now();
        // After a failed flush the next waits 1 s, then 2, 4... up to 5 minutes, however many
        // rows are buffered: a failing bucket or a full disk is not retried four times a
        // second (each try sorts and encodes every buffered row).
        let mut not_before = tokio::time::Instant::now();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tick.tick() => {}
            }
            let rows = self.buffered_rows();
            if tokio::time::Instant::now() >= not_before
                && (rows >= self.config.flush_max_rows
                    || (rows > 0 && last.elapsed() >= self.config.flush_interval))
            {
                last = tokio::time::Instant::now();
                if let Err(e) = self.flush().await {
                    let failures = self
                        .stats
                        .consecutive_flush_failures
                        .load(Ordering::Relaxed);
                    let wait = flush_backoff(failures);
                    not_before = tokio::time::Instant::now() + wait;
                    tracing::error!(error = %e, failures, retry_in_s = wait.as_secs(), "flush to parquet failed; rows stay buffered and logged (ingest is refused with 503 past server.max_buffered_rows)");
                }
            }
            if last_maintenance.elapsed() >= self.config.maintenance_interval {
                last_maintenance = tokio::time::Instant::now();
                if let Err(e) = self.maintain(now_ms()).await {
                    tracing::error!(error = %e, "compaction or retention failed; will retry");
                }
            }
            self.reap().await;
        }
        if let Err(e) = self.flush().await {
            tracing::error!(error = %e, "final flush failed; the write-ahead log still holds the rows");
        }
    }
}

/// Brings a store written by an older perch to today's format ([`manifest`]'s versions), once,
/// before anything reads it. Version 1 to 2 rewrites the files whose columns were renamed
/// since ([`schema::RENAMED_COLUMNS`]). Version 2 to 3 changes no file: the write-ahead log's
/// segments gained a header, and the new version keeps a perch that does not know it (and
/// would take the header for a torn record) off the store. The new files are written first and
/// the manifest last, so a crash in between leaves the old manifest and files (the new ones are
/// orphans `remove_orphans` deletes) and the next start tries again; the old files become
/// orphans once the new manifest is saved.
async fn upgrade(storage: &Storage, mut manifest: Manifest) -> Result<Manifest> {
    if manifest.version >= crate::manifest::CURRENT_VERSION {
        return Ok(manifest);
    }
    let from = manifest.version;
    if from < 2 {
        let rewritten = rename_columns(storage, &mut manifest).await?;
        if rewritten > 0 {
            tracing::info!(
                files = rewritten,
                "rewrote files written by an older perch in today's format (user columns are now user_name)"
            );
        }
    }
    manifest.version = crate::manifest::CURRENT_VERSION;
    storage.write_manifest(manifest.to_bytes()?).await?;
    tracing::info!(
        from,
        to = manifest.version,
        "upgraded the store's format; perch releases before this version refuse it from now on"
    );
    Ok(manifest)
}

/// Rewrites the files of the tables with renamed columns under their new names; returns how
/// many it rewrote.
async fn rename_columns(storage: &Storage, manifest: &mut Manifest) -> Result<usize> {
    let renamed = |t: &Table| {
        t.schema().fields().iter().any(|f| {
            schema::RENAMED_COLUMNS
                .iter()
                .any(|(now, _)| now == f.name())
        })
    };
    let mut rewritten = 0usize;
    for table in Table::ALL.into_iter().filter(renamed) {
        let Some(old) = manifest.files.get(table.name()).cloned() else {
            continue;
        };
        let mut entries = Vec::with_capacity(old.len());
        for f in &old {
            let data = storage.get(&f.path).await?;
            let mut next = manifest.next_file_id;
            let written = tokio::task::spawn_blocking(move || {
                let batches = crate::files::decode(data, &table.schema())?;
                let written = crate::files::encode_table(table, &batches, &mut next)?;
                Ok::<_, Error>((written, next))
            })
            .await
            .map_err(|e| Error::Execution(format!("upgrade task failed: {e}")))??;
            let (files, next) = written;
            manifest.next_file_id = next;
            for file in files {
                storage.put(&file.entry.path, file.data).await?;
                entries.push(file.entry);
            }
            rewritten += 1;
        }
        manifest.files.insert(table.name().to_owned(), entries);
    }
    Ok(rewritten)
}

/// Removes files under `tables/` that the manifest does not list: left by a flush or a
/// compaction that did not commit (their rows are in the log or in the files they were to
/// replace), or replaced files a crash kept from being deleted.
async fn remove_orphans(storage: &Storage, manifest: &Manifest) -> Result<()> {
    let known: HashSet<&str> = manifest
        .files
        .values()
        .flatten()
        .map(|f| f.path.as_str())
        .collect();
    for rel in storage.list("tables").await? {
        if !known.contains(rel.as_str()) {
            tracing::warn!(file = %rel, "removing a parquet file no manifest lists (left by an interrupted flush or compaction; its rows are in the write-ahead log or in the files it was to replace)");
            storage.delete(&rel).await?;
        }
    }
    Ok(())
}

/// Applies the write-ahead log's records to `inner`, in order; returns how many were applied
/// (batches already in the files, by their stream's sequence, are not). A record that cannot
/// be decoded refuses the store ([`wal::Record::unreadable`]): it was acknowledged.
fn replay(inner: &mut Inner, records: Vec<wal::Record>) -> Result<u64> {
    let mut applied = 0u64;
    for record in records {
        let (source, encoding) = match record.kind {
            RecordKind::Events => {
                let events: Vec<ClusterEvent> =
                    serde_json::from_slice(&record.body).map_err(|e| record.unreadable(e))?;
                let rb =
                    schema::events::to_record_batch(&events).map_err(|e| record.unreadable(e))?;
                push(inner, Table::Events, rb);
                applied += 1;
                continue;
            }
            RecordKind::AgentBatch => (Source::Agent, Encoding::Json),
            RecordKind::AgentBatchMsgpack => (Source::Agent, Encoding::Msgpack),
            RecordKind::OtlpBatch => (Source::Otlp, Encoding::Json),
        };
        let batch = encoding
            .decode(&record.body)
            .map_err(|e| record.unreadable(e))?;
        let parts = schema::to_record_batches(&batch).map_err(|e| record.unreadable(e))?;
        let stream = source.stream(batch.node.as_str());
        if inner.node_seq.get(&stream).is_some_and(|&s| batch.seq <= s) {
            continue;
        }
        apply(inner, stream, &batch, parts);
        applied += 1;
    }
    Ok(applied)
}

fn push(inner: &mut Inner, table: Table, rb: RecordBatch) {
    if let Some(data) = inner.tables.get_mut(&table) {
        data.mem_rows += rb.num_rows();
        data.mem.push(rb);
        data.mem_levels.push(0);
        merge_tail(&table.schema(), &mut data.mem, &mut data.mem_levels);
    }
}

/// Merges the newest batches as an LSM tree merges its levels: [`MERGE_FANOUT`] batches of
/// one level at the end become one batch of the next, and again while that completes a run.
/// Returns the rows it copied.
fn merge_tail(
    schema: &arrow::datatypes::SchemaRef,
    mem: &mut Vec<RecordBatch>,
    levels: &mut Vec<u8>,
) -> usize {
    let mut copied = 0;
    while let Some(&level) = levels.last() {
        let run = levels.iter().rev().take_while(|&&l| l == level).count();
        if level == UNMERGED || run < MERGE_FANOUT {
            break;
        }
        let from = mem.len() - run;
        let Ok(merged) = concat_batches(schema, &mem[from..]) else {
            break;
        };
        copied += merged.num_rows();
        mem.truncate(from);
        mem.push(merged);
        levels.truncate(from);
        levels.push(level + 1);
    }
    copied
}

/// How long the flusher waits after `failures` flushes failed in a row: 1 s, doubling, at
/// most 5 minutes.
fn flush_backoff(failures: u64) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(9)).min(Duration::from_secs(300))
}

fn held_rows(inner: &Inner) -> usize {
    inner
        .tables
        .values()
        .map(|t| t.mem_rows + t.flushing_rows)
        .sum()
}

fn apply(inner: &mut Inner, stream: String, batch: &Batch, parts: Vec<(Table, RecordBatch)>) {
    for (table, rb) in parts {
        push(inner, table, rb);
    }
    inner.duplicate_runs.remove(&stream);
    let seq = inner.node_seq.entry(stream).or_insert(0);
    *seq = (*seq).max(batch.seq);
}

/// A stream's run of duplicates since its last accepted batch.
#[derive(Debug, Default)]
pub(crate) struct DuplicateRun {
    count: u64,
    warned_at: Option<std::time::Instant>,
}

/// Counts a duplicate on `stream` and warns, at most once a minute per stream, once a run is
/// long enough to mean that new data is being dropped rather than a lost answer retried.
fn note_duplicate(inner: &mut Inner, stream: &str, batch: &Batch, last: u64) {
    let run = inner.duplicate_runs.entry(stream.to_owned()).or_default();
    run.count += 1;
    let quiet = run
        .warned_at
        .is_some_and(|at| at.elapsed() < Duration::from_secs(60));
    if run.count >= DUPLICATE_RUN_WARN && !quiet {
        run.warned_at = Some(std::time::Instant::now());
        tracing::warn!(
            node = %batch.node,
            seq = batch.seq,
            last_accepted_seq = last,
            duplicates_in_a_row = run.count,
            "batches from a live sender are answered as duplicates and dropped: their seq is not \
             above the last one accepted for this node. Another agent may be running under the \
             same node name; if not, restart this node's agent so it numbers its batches afresh"
        );
    }
}

/// A batch's place in `in_flight`, given back when its log write ends or its caller is dropped.
struct InFlightClaim<'a> {
    store: &'a Store,
    key: Option<(String, u64)>,
}

impl InFlightClaim<'_> {
    /// Gives the place back under the caller's lock.
    fn release(mut self, inner: &mut Inner) {
        if let Some(key) = self.key.take() {
            inner.in_flight.remove(&key);
        }
    }
}

impl Drop for InFlightClaim<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.store.lock().in_flight.remove(&key);
        }
    }
}

#[cfg(test)]
mod buffer_tests {
    use super::*;
    use arrow::array::{Array, UInt64Array};
    use arrow::datatypes::{DataType, Field, Schema};

    /// 5,000 one-row batches: the buffer stays a few dozen batches, in order, and each row is
    /// copied once a level (four levels of 16 for 5,000), not once every 256 batches.
    #[test]
    fn buffered_batches_merge_by_level_in_order_copying_each_row_a_few_times() {
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::UInt64, false)]));
        let (mut mem, mut levels, mut copied) = (Vec::new(), Vec::new(), 0);
        let n = 5_000u64;
        for i in 0..n {
            let column = Arc::new(UInt64Array::from(vec![i]));
            mem.push(RecordBatch::try_new(schema.clone(), vec![column]).expect("batch"));
            levels.push(0);
            copied += merge_tail(&schema, &mut mem, &mut levels);
            assert!(
                mem.len() < 4 * MERGE_FANOUT,
                "{} batches buffered",
                mem.len()
            );
        }
        assert!(copied <= 4 * n as usize, "{copied} rows copied for {n}");
        let all = concat_batches(&schema, &mem).expect("concat");
        let x = all
            .column(0)
            .as_any()
            .downcast_ref::<UInt64Array>()
            .expect("u64");
        assert_eq!(x.len(), n as usize);
        assert!(x.values().iter().copied().eq(0..n), "order changed");
        // Batches put back after a failed flush are never merged again.
        let mut levels = vec![UNMERGED; MERGE_FANOUT];
        let mut back = vec![mem[0].clone(); MERGE_FANOUT];
        assert_eq!(merge_tail(&schema, &mut back, &mut levels), 0);
    }
}
