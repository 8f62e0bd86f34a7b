//! The store's on-disk formats as `docs/format/` specifies them: a store written by the
//! release before formats were versioned (`tests/fixtures/format/dc15fd0/store`) opens with
//! every row, what this binary cannot read refuses the store with a message that says where
//! and what to do, what replay skips is counted, and the documents name the versions the code
//! writes.

use bytes::Bytes;
use perch_model::wire::Encoding;
use perch_model::{Batch, GpuIndex, GpuSample, NodeId};
use perch_query::wal::{self, RecordKind};
use perch_query::{QueryLimits, SqlEngine, Store, StoreConfig};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

/// 2025-06-15T00:00:00Z, the fixture's first sample.
const T0: i64 = 1_749_945_600_000;

/// The store fixture's only log segment, written by the release before formats were
/// versioned.
const OLD_SEGMENT: &str = "wal/00000000000000000002.wal";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format")
}

fn docs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/format")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read fixture") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

/// A copy of the store the release before versions wrote (opening a store upgrades it, so the
/// fixture itself is never opened).
fn old_store() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_dir(&fixtures().join("dc15fd0/store"), dir.path());
    dir
}

fn manifest_version(dir: &Path) -> u64 {
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest"))
            .expect("json");
    manifest["version"].as_u64().expect("version")
}

/// The rows `query` returns, each its columns as text joined by spaces.
async fn rows(store: &std::sync::Arc<Store>, query: &str) -> Vec<String> {
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    let out = sql.query(query).await.expect("query");
    let mut rows = Vec::new();
    for batch in &out.batches {
        let columns: Vec<_> = batch
            .columns()
            .iter()
            .map(|c| arrow::compute::cast(c, &arrow::datatypes::DataType::Utf8).expect("text"))
            .collect();
        for row in 0..batch.num_rows() {
            let cells: Vec<&str> = columns
                .iter()
                .map(|c| arrow::array::AsArray::as_string::<i32>(c).value(row))
                .collect();
            rows.push(cells.join(" "));
        }
    }
    rows
}

/// What the fixture holds: two GPU rows flushed to Parquet, and in the log two more GPU rows
/// (an agent's batch), a job metric (an OTLP batch) and an event.
async fn assert_fixture_rows(store: &std::sync::Arc<Store>) {
    let gpu = rows(
        store,
        "SELECT CAST(time AS BIGINT) AS t, gpu, utilization_gpu_pct FROM gpu_samples \
         WHERE uuid LIKE 'GPU-fixture-%' ORDER BY t, gpu",
    )
    .await;
    let t1 = T0 + 60_000;
    assert_eq!(
        gpu,
        [
            format!("{T0} 0 10.0"),
            format!("{T0} 1 20.0"),
            format!("{t1} 0 30.0"),
            format!("{t1} 1 40.0"),
        ]
    );
    let metrics = rows(store, "SELECT job, metric, value FROM job_metrics").await;
    assert_eq!(metrics, ["7 loss 0.25"]);
    let events = rows(store, "SELECT kind, actor, node FROM events").await;
    assert_eq!(events, ["node_drained fixture-admin fixture-node"]);
}

fn gpu_batch(seq: u64, time_ms: i64) -> (Bytes, Batch) {
    let batch = Batch {
        gpus: vec![GpuSample {
            time_ms,
            gpu: GpuIndex(0),
            uuid: "GPU-new".into(),
            model: "Fixture GPU".into(),
            simulated: true,
            utilization_gpu_pct: Some(99.0),
            ..GpuSample::default()
        }],
        ..Batch::new(NodeId::new("fixture-node").expect("node"), seq)
    };
    (
        Bytes::from(serde_json::to_vec(&batch).expect("json")),
        batch,
    )
}

/// A record as `docs/format/wal.md` frames it.
fn framed(payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// A segment header as `docs/format/wal.md` specifies it.
fn header(version: u32) -> Vec<u8> {
    let mut out = b"PERCHWAL".to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_releases_store_opens_with_every_row() {
    let dir = old_store();
    assert_eq!(
        manifest_version(dir.path()),
        2,
        "the fixture is of version 2"
    );
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    assert_eq!(store.stats.batches_replayed.load(Ordering::Relaxed), 3);
    assert_eq!(store.stats.wal_records_skipped.load(Ordering::Relaxed), 0);
    assert_fixture_rows(&store).await;
    // Upgraded in place: the version is stamped, the files are the same.
    assert_eq!(manifest_version(dir.path()), 3);
    let listed: Vec<String> =
        std::fs::read_dir(dir.path().join("tables/gpu_samples/date=2025-06-15"))
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
    assert_eq!(listed, vec!["0000000000.parquet"]);

    // A batch written now goes to a segment of today's version, after the old one; both replay.
    let (raw, batch) = gpu_batch(3, T0 + 120_000);
    store.ingest(raw, &batch).await.expect("ingest");
    drop(store);
    let segments = wal::segments(&dir.path().join("wal")).expect("segments");
    assert_eq!(segments, vec![2, 3]);
    let new_segment = std::fs::read(dir.path().join("wal/00000000000000000003.wal")).expect("read");
    assert_eq!(new_segment[..12], header(wal::FORMAT_VERSION)[..]);
    let store = Store::open(StoreConfig::new(dir.path())).expect("reopen");
    assert_eq!(store.stats.batches_replayed.load(Ordering::Relaxed), 4);
    assert_fixture_rows(&store).await;
    assert_eq!(
        rows(
            &store,
            "SELECT uuid FROM gpu_samples WHERE uuid = 'GPU-new'"
        )
        .await,
        ["GPU-new"]
    );

    // Flushed, the log is gone and the rows are in files.
    store.flush().await.expect("flush");
    drop(store);
    let store = Store::open(StoreConfig::new(dir.path())).expect("reopen");
    assert_eq!(store.stats.batches_replayed.load(Ordering::Relaxed), 0);
    assert_fixture_rows(&store).await;
}

#[test]
fn a_new_store_records_its_version_before_it_writes_the_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    drop(store);
    assert_eq!(
        manifest_version(dir.path()),
        documented_version("manifest.md")
    );
}

/// Opening `dir` fails; the message holds each of `says`.
fn refused(dir: &Path, says: &[&str]) {
    let err = Store::open(StoreConfig::new(dir))
        .expect_err("refused")
        .to_string();
    for s in says {
        assert!(err.contains(s), "{s:?} not in: {err}");
    }
}

#[test]
fn a_record_this_binary_cannot_read_refuses_the_store_naming_file_offset_and_version() {
    let what_to_do = "run the perch release that wrote it";
    // A segment of a newer version.
    let dir = old_store();
    let mut newer = header(wal::FORMAT_VERSION + 1);
    newer.extend_from_slice(&framed(b"A{}"));
    std::fs::write(dir.path().join("wal/00000000000000000003.wal"), newer).expect("write");
    refused(
        dir.path(),
        &[
            "00000000000000000003.wal",
            "offset 0",
            &format!("format version {}", wal::FORMAT_VERSION + 1),
            what_to_do,
        ],
    );
    // No segment is left behind by the refused start.
    assert_eq!(
        wal::segments(&dir.path().join("wal")).expect("segments"),
        vec![2, 3]
    );

    // Today's version, a tag this binary does not know (a newer perch's new kind of record).
    let dir = old_store();
    let mut unknown_tag = header(wal::FORMAT_VERSION);
    unknown_tag.extend_from_slice(&framed(b"X[]"));
    std::fs::write(dir.path().join("wal/00000000000000000003.wal"), unknown_tag).expect("write");
    refused(
        dir.path(),
        &[
            "00000000000000000003.wal",
            "offset 12",
            &format!("format version {}", wal::FORMAT_VERSION),
            "0x58 ('X')",
            what_to_do,
        ],
    );

    // A batch with a field this binary does not know (a newer agent's, through a newer server).
    let dir = old_store();
    let (raw, _) = gpu_batch(3, T0);
    let mut json: serde_json::Value = serde_json::from_slice(&raw).expect("json");
    json["gpus"][0]["fan_speed_pct"] = 40.into();
    let mut payload = vec![RecordKind::AgentBatch.tag()];
    payload.extend_from_slice(&serde_json::to_vec(&json).expect("json"));
    let mut segment = header(wal::FORMAT_VERSION);
    segment.extend_from_slice(&framed(&payload));
    std::fs::write(dir.path().join("wal/00000000000000000003.wal"), segment).expect("write");
    refused(
        dir.path(),
        &[
            "00000000000000000003.wal",
            "offset 12",
            &format!("format version {}, agent batch", wal::FORMAT_VERSION),
            "fan_speed_pct",
            what_to_do,
        ],
    );

    // A manifest of a newer version, with fields this binary does not know.
    let dir = old_store();
    let path = dir.path().join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    manifest["version"] = 4.into();
    manifest["shards"] = serde_json::json!([]);
    std::fs::write(&path, serde_json::to_vec(&manifest).expect("json")).expect("write");
    refused(
        dir.path(),
        &[
            "manifest.json",
            "format version 4",
            "reads versions up to 3",
            "newer perch",
        ],
    );
}

#[test]
fn what_replay_skips_is_counted_and_the_rest_is_read() {
    let dir = old_store();
    let segment = dir.path().join(OLD_SEGMENT);
    let mut data = std::fs::read(&segment).expect("read");
    // The agent's batch (the segment's first record) damaged where it lies, and a torn tail.
    data[8 + 20] ^= 0x01;
    data.extend_from_slice(&[0x40, 0, 0, 0, 1, 2, 3]);
    std::fs::write(&segment, data).expect("write");
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    assert_eq!(store.stats.wal_records_skipped.load(Ordering::Relaxed), 2);
    // The OTLP batch and the events after the damaged record are read.
    assert_eq!(store.stats.batches_replayed.load(Ordering::Relaxed), 2);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let gpu = rows(&store, "SELECT count(*) FROM gpu_samples").await;
        assert_eq!(gpu, ["2"], "only the flushed rows");
        let metrics = rows(&store, "SELECT count(*) FROM job_metrics").await;
        assert_eq!(metrics, ["1"]);
    });
}

/// The version a format document says is written today: its `Current version: **N**` line.
fn documented_version(doc: &str) -> u64 {
    let text = std::fs::read_to_string(docs().join(doc)).expect("doc");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("Current version: "))
        .unwrap_or_else(|| panic!("{doc} has no `Current version:` line"));
    line.trim_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap_or_else(|e| panic!("{doc}: {line:?}: {e}"))
}

/// The version `docs/format/README.md` gives `doc` in its table.
fn indexed_version(doc: &str) -> u64 {
    let text = std::fs::read_to_string(docs().join("README.md")).expect("README");
    let row = text
        .lines()
        .find(|l| l.starts_with('|') && l.contains(&format!("({doc})")))
        .unwrap_or_else(|| panic!("README.md has no row for {doc}"));
    let cell = row.split('|').nth(2).expect("a version cell");
    cell.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{row:?}: {e}"))
}

#[test]
fn the_documents_name_the_versions_the_code_writes() {
    let wal_version = u64::from(wal::FORMAT_VERSION);
    assert_eq!(documented_version("wal.md"), wal_version);
    assert_eq!(indexed_version("wal.md"), wal_version);
    // The manifest's version is what a new store writes.
    let dir = tempfile::tempdir().expect("tempdir");
    drop(Store::open(StoreConfig::new(dir.path())).expect("open"));
    let manifest_version = manifest_version(dir.path());
    assert_eq!(documented_version("manifest.md"), manifest_version);
    assert_eq!(indexed_version("manifest.md"), manifest_version);
    // Every payload tag is in the document's table of them.
    let doc = std::fs::read_to_string(docs().join("wal.md")).expect("doc");
    for kind in RecordKind::ALL {
        let row = format!("| `{}` | {:#04x} |", char::from(kind.tag()), kind.tag());
        assert!(
            doc.contains(&row),
            "wal.md lacks the row {row:?} for {kind:?}"
        );
    }
}

/// A segment of version 2 (JSON batches only), written by the release before MessagePack
/// batches (`tests/fixtures/format/5a0f826/wal`: one agent batch, seq 3, one GPU row at
/// 00:02Z, utilization 50, its server killed with -9 after the answer), replays beside the
/// fixture store's version-1 segment; batches received as MessagePack and as JSON afterwards
/// go to a segment of version 3 and replay after a restart; a version-2 segment holding a
/// MessagePack record is refused (version 2 had no such tag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_segments_of_version_2_and_messagepack_batches_replay_after_a_restart() {
    let dir = old_store();
    std::fs::copy(
        fixtures().join("5a0f826/wal/00000000000000000001.wal"),
        dir.path().join("wal/00000000000000000003.wal"),
    )
    .expect("copy");
    let utilization = "SELECT utilization_gpu_pct FROM gpu_samples ORDER BY 1";
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    assert_eq!(store.stats.batches_replayed.load(Ordering::Relaxed), 4);
    assert_eq!(
        rows(&store, utilization).await,
        ["10.0", "20.0", "30.0", "40.0", "50.0"]
    );

    let (_, four) = gpu_batch(4, T0 + 180_000);
    let msgpack = Encoding::Msgpack.encode(&four).expect("encode");
    store
        .ingest_encoded(Encoding::Msgpack, Bytes::from(msgpack), &four)
        .await
        .expect("ingest");
    let (raw, five) = gpu_batch(5, T0 + 240_000);
    store.ingest(raw, &five).await.expect("ingest");
    // The same batch again, in the other encoding: a duplicate on the node's one stream.
    let again = Encoding::Msgpack.encode(&five).expect("encode");
    assert_eq!(
        store
            .ingest_encoded(Encoding::Msgpack, Bytes::from(again), &five)
            .await
            .expect("ingest"),
        perch_query::IngestOutcome::Duplicate
    );
    drop(store);
    let segment = std::fs::read(dir.path().join("wal/00000000000000000004.wal")).expect("read");
    assert_eq!(segment[..12], header(3)[..]);
    assert_eq!(segment[12 + 8], b'M', "the MessagePack batch's tag");
    let store = Store::open(StoreConfig::new(dir.path())).expect("reopen");
    assert_eq!(store.stats.batches_replayed.load(Ordering::Relaxed), 6);
    assert_eq!(
        rows(&store, utilization).await,
        ["10.0", "20.0", "30.0", "40.0", "50.0", "99.0", "99.0"]
    );
    store.flush().await.expect("flush");
    drop(store);

    let dir = old_store();
    let (_, batch) = gpu_batch(3, T0);
    let mut payload = vec![RecordKind::AgentBatchMsgpack.tag()];
    payload.extend_from_slice(&Encoding::Msgpack.encode(&batch).expect("encode"));
    let mut segment = header(2);
    segment.extend_from_slice(&framed(&payload));
    std::fs::write(dir.path().join("wal/00000000000000000003.wal"), segment).expect("write");
    refused(
        dir.path(),
        &[
            "00000000000000000003.wal",
            "offset 12",
            "format version 2",
            "0x4d ('M')",
            "run the perch release that wrote it",
        ],
    );
}
