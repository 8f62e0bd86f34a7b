//! The store on S3-compatible object storage, against a real S3 server on loopback (moto, from
//! PyPI; `scripts/test.sh` installs it): ingest, flush, query, restart, compaction, retention
//! and start-up clean-up, with the objects checked in the bucket itself. The write-ahead log
//! stays in the local data directory; nothing else is written there.

use arrow::array::AsArray;
use arrow::datatypes::Int64Type;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use perch_model::{Batch, GpuIndex, GpuSample, NodeId};
use perch_query::{QueryLimits, S3Config, SqlEngine, StorageConfig, Store, StoreConfig};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DAY_MS: i64 = 86_400_000;
const BUCKET: &str = "perch-test";
const PREFIX: &str = "cluster-a";

/// A moto S3 server on a free loopback port, stopped when dropped.
struct Moto {
    child: Child,
    endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_moto() -> Moto {
    let probe = Command::new("python3")
        .args(["-c", "import moto.server, flask"])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        _ => panic!(
            "this test needs the moto S3 server (pip package moto[server]) and python3; run scripts/test.sh, which installs it"
        ),
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new("python3")
        .args([
            "-m",
            "moto.server",
            "-H",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start python3 -m moto.server");
    let moto = Moto {
        child,
        endpoint: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // Creating the bucket doubles as the readiness check.
        if let Ok(status) = http(port, &format!("PUT /{BUCKET} HTTP/1.1")) {
            assert!(status.contains(" 200 "), "creating the bucket: {status}");
            return moto;
        }
        assert!(Instant::now() < deadline, "moto did not start within 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends a bodyless request and returns the status line (moto does not check signatures).
fn http(port: u16, request_line: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        stream,
        "{request_line}\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response.lines().next().unwrap_or_default().to_owned())
}

fn s3(endpoint: &str) -> S3Config {
    S3Config {
        bucket: BUCKET.into(),
        prefix: PREFIX.into(),
        endpoint: Some(endpoint.into()),
        region: Some("us-east-1".into()),
        access_key_id: Some("testing".into()),
        secret_access_key: Some("testing".into()),
        allow_http: true,
    }
}

fn config(dir: &std::path::Path, endpoint: &str) -> StoreConfig {
    let mut c = StoreConfig::new(dir);
    c.storage = StorageConfig::S3(s3(endpoint));
    c.compact_min_files = 2;
    c
}

/// The bucket as the test sees it, through its own client.
fn bucket(endpoint: &str) -> Arc<dyn ObjectStore> {
    Arc::new(
        AmazonS3Builder::new()
            .with_bucket_name(BUCKET)
            .with_endpoint(endpoint)
            .with_region("us-east-1")
            .with_access_key_id("testing")
            .with_secret_access_key("testing")
            .with_allow_http(true)
            .build()
            .expect("client"),
    )
}

async fn keys(store: &Arc<dyn ObjectStore>, under: &str) -> Vec<String> {
    let mut keys: Vec<String> = store
        .list(Some(&ObjectPath::from(under)))
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .expect("list the bucket");
    keys.sort();
    keys
}

fn batch(seq: u64, time_ms: i64) -> (Bytes, Batch) {
    let b = Batch {
        gpus: (0..2)
            .map(|g| GpuSample {
                time_ms,
                gpu: GpuIndex(g),
                uuid: format!("GPU-{g}"),
                model: "Test".into(),
                simulated: true,
                utilization_gpu_pct: Some(50.0),
                ..GpuSample::default()
            })
            .collect(),
        ..Batch::new(NodeId::new("n1").expect("node"), seq)
    };
    (Bytes::from(serde_json::to_vec(&b).expect("json")), b)
}

async fn scalar(sql: &SqlEngine, query: &str) -> i64 {
    let out = sql.query(query).await.expect(query);
    out.batches[0]
        .column(0)
        .as_primitive::<Int64Type>()
        .value(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_runs_on_s3_compatible_object_storage() {
    let moto = start_moto();
    let remote = bucket(&moto.endpoint);
    let dir = tempfile::tempdir().expect("tempdir");
    let day0 = 1_800_000_000_000 / DAY_MS * DAY_MS;

    // Ingest over two days in three flushes.
    let store = Store::open(config(dir.path(), &moto.endpoint)).expect("open on s3");
    assert_eq!(store.storage_location(), format!("s3://{BUCKET}/{PREFIX}/"));
    for (seq, t) in [
        (1, day0 + 1000),
        (2, day0 + 2000),
        (3, day0 + DAY_MS + 1000),
    ] {
        let (raw, b) = batch(seq, t);
        store.ingest(raw, &b).await.expect("ingest");
        store.flush().await.expect("flush to s3");
    }
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples").await, 6);
    assert_eq!(
        scalar(
            &sql,
            "SELECT CAST(sum(samples) AS BIGINT) FROM gpu_samples_1m"
        )
        .await,
        6
    );
    let objects = keys(&remote, PREFIX).await;
    assert!(
        objects.contains(&format!("{PREFIX}/manifest.json")),
        "{objects:?}"
    );
    let raw_files = keys(&remote, &format!("{PREFIX}/tables/gpu_samples")).await;
    assert_eq!(raw_files.len(), 3, "{raw_files:?}");
    assert!(
        raw_files[0].starts_with(&format!("{PREFIX}/tables/gpu_samples/date=2027-01-15/")),
        "{raw_files:?}"
    );
    assert_eq!(
        keys(&remote, &format!("{PREFIX}/tables/gpu_samples_1h"))
            .await
            .len(),
        3
    );
    assert!(!dir.path().join("tables").exists() && !dir.path().join("manifest.json").exists());

    // Rows only in the local write-ahead log survive a restart, next to the files in the bucket.
    let (raw, b) = batch(4, day0 + 3000);
    store.ingest(raw, &b).await.expect("ingest");
    drop(sql);
    drop(store);
    // A file no manifest lists (an interrupted flush) is removed at start-up.
    let stray = ObjectPath::from(format!(
        "{PREFIX}/tables/gpu_samples/date=2027-01-15/9999999999.parquet"
    ));
    remote
        .put(&stray, PutPayload::from_static(b"half-written"))
        .await
        .expect("put a stray object");
    let store = Store::open(config(dir.path(), &moto.endpoint)).expect("reopen on s3");
    assert!(!keys(&remote, PREFIX).await.contains(&stray.to_string()));
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples").await, 8);
    store.flush().await.expect("flush");
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples").await, 8);

    // Compaction merges day 0's three small files into one and deletes the inputs.
    let stats = store.maintain(day0 + DAY_MS).await.expect("maintain");
    assert!(stats.files_compacted >= 3, "{stats:?}");
    assert_eq!(store.graveyard_files(), 0);
    let day0_files = keys(
        &remote,
        &format!("{PREFIX}/tables/gpu_samples/date=2027-01-15"),
    )
    .await;
    assert_eq!(day0_files.len(), 1, "{day0_files:?}");
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples").await, 8);
    assert_eq!(
        scalar(
            &sql,
            "SELECT CAST(sum(samples) AS BIGINT) FROM gpu_samples_1h"
        )
        .await,
        8
    );

    // Retention deletes the raw days from the bucket; the rollups stay and answer.
    let stats = store.maintain(day0 + 32 * DAY_MS).await.expect("maintain");
    assert_eq!(stats.rows_expired, 8, "{stats:?}");
    assert!(
        keys(&remote, &format!("{PREFIX}/tables/gpu_samples"))
            .await
            .is_empty()
    );
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples").await, 0);
    assert_eq!(
        scalar(
            &sql,
            "SELECT CAST(sum(samples) AS BIGINT) FROM gpu_samples_1m"
        )
        .await,
        8
    );
    drop(sql);
    drop(store);

    // Everything above is in the bucket's manifest: a fresh start sees the same.
    let store = Store::open(config(dir.path(), &moto.endpoint)).expect("reopen on s3");
    let sql = SqlEngine::new(store, QueryLimits::default());
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples").await, 0);
    assert_eq!(
        scalar(
            &sql,
            "SELECT CAST(sum(samples) AS BIGINT) FROM gpu_samples_1h"
        )
        .await,
        8
    );
}

#[test]
fn s3_storage_without_a_bucket_is_refused_with_the_key_to_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = config(dir.path(), "http://127.0.0.1:9");
    if let StorageConfig::S3(s3) = &mut c.storage {
        s3.bucket = String::new();
    }
    let err = Store::open(c).expect_err("no bucket");
    assert!(
        err.to_string().contains("set [server.storage] bucket"),
        "{err}"
    );
}
