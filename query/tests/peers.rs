//! A store reading other writers' stores beside its own (query/src/peers.rs): what the peers
//! flushed is read with this store's rows, never twice, and a peer that cannot be read (gone,
//! of another format version) keeps its last good file list and says why.

use bytes::Bytes;
use perch_model::{Batch, GpuIndex, GpuSample, NodeId};
use perch_query::{PeerConfig, QueryLimits, SqlEngine, Store, StoreConfig};
use std::path::Path;
use std::sync::Arc;

const T0: i64 = 1_800_000_000_000;

fn batch(node: &str, seq: u64, time_ms: i64) -> (Bytes, Batch) {
    let b = Batch {
        gpus: (0..4)
            .map(|g| GpuSample {
                time_ms,
                gpu: GpuIndex(g),
                uuid: format!("GPU-{node}-{g}"),
                model: "Test".into(),
                simulated: true,
                utilization_gpu_pct: Some(f64::from(g) * 10.0),
                ..GpuSample::default()
            })
            .collect(),
        ..Batch::new(NodeId::new(node).expect("node"), seq)
    };
    (Bytes::from(serde_json::to_vec(&b).expect("json")), b)
}

async fn fill(store: &Store, node: &str, rounds: u64) {
    for seq in 1..=rounds {
        let (raw, b) = batch(node, seq, T0 + seq as i64 * 1000);
        store.ingest(raw, &b).await.expect("ingest");
    }
}

async fn rows(sql: &SqlEngine, query: &str) -> Vec<String> {
    let out = sql.query(query).await.expect("query");
    let text = arrow::util::pretty::pretty_format_batches(&out.batches)
        .expect("format")
        .to_string();
    text.lines().map(str::to_owned).collect()
}

async fn count(sql: &SqlEngine) -> i64 {
    let out = sql
        .query("SELECT count(*) FROM gpu_samples")
        .await
        .expect("query");
    arrow::array::AsArray::as_primitive::<arrow::datatypes::Int64Type>(out.batches[0].column(0))
        .value(0)
}

fn reader(dir: &Path, peers: &[(&str, &Path)]) -> Arc<Store> {
    let mut config = StoreConfig::new(dir);
    config.peers = peers
        .iter()
        .map(|(name, at)| PeerConfig {
            name: (*name).into(),
            location: at.display().to_string(),
        })
        .collect();
    Store::open(config).expect("open the reader")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_sees_its_peers_flushed_rows_with_its_own_and_none_twice() {
    let dirs: Vec<_> = (0..4)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let (a, b, c) = (dirs[1].path(), dirs[2].path(), dirs[3].path());
    // One writer fed everything, as one server would be.
    let single = Store::open(StoreConfig::new(dirs[0].path())).expect("open");
    let writer_a = Store::open(StoreConfig::new(a)).expect("open");
    let writer_b = Store::open(StoreConfig::new(b)).expect("open");
    for (node, writer) in [("n1", &writer_a), ("n2", &writer_a), ("n3", &writer_b)] {
        fill(writer, node, 30).await;
        fill(&single, node, 30).await;
    }
    writer_a.flush().await.expect("flush a");
    writer_b.flush().await.expect("flush b");
    single.flush().await.expect("flush single");
    // The reader writes rows of its own too (a node it takes itself), some still buffered.
    let reader = reader(c, &[("a", a), ("b", b)]);
    fill(&reader, "n4", 10).await;
    fill(&single, "n4", 10).await;
    let sql = SqlEngine::new(reader.clone(), QueryLimits::default());
    let one = SqlEngine::new(single.clone(), QueryLimits::default());
    let queries = [
        "SELECT node, count(*) AS n, sum(utilization_gpu_pct) AS u FROM gpu_samples GROUP BY node ORDER BY node",
        "SELECT count(*) FROM gpu_samples_1m",
        "SELECT node, gpu, sum(samples), sum(utilization_gpu_pct_sum), max(utilization_gpu_pct_max) FROM gpu_samples_1m GROUP BY node, gpu ORDER BY node, gpu",
    ];
    // Before the first refresh the peers' files are not known.
    assert_eq!(
        count(&sql).await,
        40,
        "only the reader's own rows before a refresh"
    );
    assert_eq!(reader.refresh_peers(T0).await, 2);
    for q in queries {
        assert_eq!(rows(&sql, q).await, rows(&one, q).await, "{q}");
    }
    // A refresh that finds nothing new changes nothing, and a peer's later flush is seen at
    // the next refresh.
    reader.refresh_peers(T0).await;
    fill(&writer_b, "n3", 40).await;
    fill(&single, "n3", 40).await;
    writer_b.flush().await.expect("flush b");
    single.flush().await.expect("flush");
    reader.refresh_peers(T0 + 1).await;
    for q in queries {
        assert_eq!(rows(&sql, q).await, rows(&one, q).await, "{q}");
    }
    let status = reader.peer_status();
    assert_eq!(status.len(), 2);
    assert!(
        status.iter().all(|p| p.error.is_none() && p.files > 0),
        "{status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_peer_keeps_its_last_files_and_says_why() {
    let dirs: Vec<_> = (0..2)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let (a, c) = (dirs[0].path(), dirs[1].path());
    let writer = Store::open(StoreConfig::new(a)).expect("open");
    fill(&writer, "n1", 20).await;
    writer.flush().await.expect("flush");
    drop(writer);
    let reader = reader(c, &[("a", a)]);
    let sql = SqlEngine::new(reader.clone(), QueryLimits::default());
    reader.refresh_peers(T0).await;
    assert_eq!(count(&sql).await, 80);
    // A newer perch took the peer over: its manifest is refused, its old list stays.
    let manifest = a.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).expect("manifest");
    let mut value: serde_json::Value = serde_json::from_str(&text).expect("json");
    value["version"] = serde_json::json!(99);
    std::fs::write(&manifest, value.to_string()).expect("write");
    assert_eq!(reader.refresh_peers(T0 + 1).await, 0);
    let status = &reader.peer_status()[0];
    let why = status.error.as_deref().expect("an error");
    assert!(
        why.contains("version 99") && why.contains("manifest.json"),
        "{why}"
    );
    assert_eq!(count(&sql).await, 80);
    // Damaged: the same.
    std::fs::write(&manifest, "{not json").expect("write");
    assert_eq!(reader.refresh_peers(T0 + 2).await, 0);
    assert!(reader.peer_status()[0].error.is_some());
    assert_eq!(count(&sql).await, 80);
}

#[test]
fn a_peer_at_the_readers_own_place_or_named_twice_is_refused() {
    let dirs: Vec<_> = (0..2)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let own = dirs[0].path();
    let other = dirs[1].path();
    let refused = |peers: Vec<PeerConfig>| {
        let mut config = StoreConfig::new(own);
        config.peers = peers;
        Store::open(config).expect_err("refused").to_string()
    };
    let peer = |name: &str, at: &str| PeerConfig {
        name: name.into(),
        location: at.into(),
    };
    let own_text = own.display().to_string();
    let other_text = other.display().to_string();
    assert!(refused(vec![peer("a", &own_text)]).contains("own data directory"));
    assert!(refused(vec![peer("a", &other_text), peer("b", &other_text)]).contains("named twice"));
    assert!(refused(vec![peer("a", "relative/dir")]).contains("absolute"));
}
