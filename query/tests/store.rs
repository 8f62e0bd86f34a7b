//! The store through its public API: flushes never hide or double a row, restarts keep
//! everything, leftovers of an interrupted flush are removed, and files split by day.

use bytes::Bytes;
use perch_model::JobMetricSample;
use perch_model::{Batch, GpuIndex, GpuSample, NodeId};
use perch_query::{Error, IngestOutcome, QueryLimits, Source, SqlEngine, Store, StoreConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

const DAY_MS: i64 = 86_400_000;

fn batch(node: &str, seq: u64, time_ms: i64, gpus: u32) -> (Bytes, Batch) {
    let b = Batch {
        gpus: (0..gpus)
            .map(|g| GpuSample {
                time_ms,
                gpu: GpuIndex(g),
                uuid: format!("GPU-{g}"),
                model: "Test".into(),
                simulated: true,
                utilization_gpu_pct: Some(f64::from(g)),
                utilization_memory_pct: None,
                memory_used_bytes: None,
                memory_total_bytes: None,
                power_watts: None,
                energy_joules: None,
                temperature_celsius: None,
                sm_clock_mhz: Some(seq as u32),
                memory_clock_mhz: None,
                ..GpuSample::default()
            })
            .collect(),
        ..Batch::new(NodeId::new(node).expect("node"), seq)
    };
    (Bytes::from(serde_json::to_vec(&b).expect("json")), b)
}

async fn count(sql: &SqlEngine, query: &str) -> i64 {
    let out = sql.query(query).await.expect("query");
    let col = out.batches[0].column(0);
    arrow::array::AsArray::as_primitive::<arrow::datatypes::Int64Type>(col).value(0)
}

/// The plan of `query` as text.
async fn explain(sql: &SqlEngine, query: &str) -> String {
    let out = sql
        .query(&format!("EXPLAIN {query}"))
        .await
        .expect("explain");
    arrow::util::pretty::pretty_format_batches(&out.batches)
        .expect("format")
        .to_string()
}

/// Column `i` of the first row of `batch`, as an integer.
fn first_int(batch: &arrow::record_batch::RecordBatch, i: usize) -> i64 {
    arrow::compute::cast(batch.column(i), &arrow::datatypes::DataType::Int64)
        .map(|a| arrow::array::AsArray::as_primitive::<arrow::datatypes::Int64Type>(&a).value(0))
        .expect("int")
}

/// Column `i` of the first row of `batch`, as text.
fn first_text(batch: &arrow::record_batch::RecordBatch, i: usize) -> String {
    let col =
        arrow::compute::cast(batch.column(i), &arrow::datatypes::DataType::Utf8).expect("utf8");
    arrow::array::AsArray::as_string::<i32>(&col)
        .value(0)
        .to_owned()
}

fn config(dir: &std::path::Path) -> StoreConfig {
    StoreConfig::new(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_racing_flushes_never_miss_or_double_a_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let sql = Arc::new(SqlEngine::new(store.clone(), QueryLimits::default()));
    let acked = Arc::new(AtomicU64::new(0));
    let t0 = 1_800_000_000_000;
    let writer = tokio::spawn({
        let (store, acked) = (store.clone(), acked.clone());
        async move {
            for seq in 1..=300u64 {
                let (raw, b) = batch("n1", seq, t0 + seq as i64, 2);
                assert_eq!(
                    store.ingest(raw, &b).await.expect("ingest"),
                    IngestOutcome::Stored { samples: 2 }
                );
                acked.fetch_add(2, Ordering::SeqCst);
            }
        }
    });
    let flusher = tokio::spawn({
        let store = store.clone();
        async move {
            for _ in 0..30 {
                store.flush().await.expect("flush");
                tokio::task::yield_now().await;
            }
        }
    });
    let mut checks = 0;
    while !writer.is_finished() || checks < 5 {
        let before = acked.load(Ordering::SeqCst) as i64;
        let seen = count(&sql, "SELECT count(*) FROM gpu_samples").await;
        let after = acked.load(Ordering::SeqCst) as i64;
        assert!(
            before <= seen && seen <= after,
            "saw {seen} rows, acknowledged between {before} and {after}"
        );
        // GPU 1's rows (utilization 1), through the prefilter in exact mode over files and
        // buffered rows as flushes publish new files: never one missed or doubled.
        let before = acked.load(Ordering::SeqCst) as i64;
        let busy = count(
            &sql,
            "SELECT count(*) FROM gpu_samples WHERE utilization_gpu_pct > 0.5",
        )
        .await;
        let after = acked.load(Ordering::SeqCst) as i64;
        assert!(
            before / 2 <= busy && busy <= after / 2,
            "saw {busy} of GPU 1's rows, acknowledged between {} and {}",
            before / 2,
            after / 2
        );
        checks += 1;
    }
    writer.await.expect("writer");
    flusher.await.expect("flusher");
    store.flush().await.expect("flush");
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 600);
    assert_eq!(
        count(&sql, "SELECT count(DISTINCT sm_clock_mhz) FROM gpu_samples").await,
        300
    );
    let busy = "SELECT count(*) FROM gpu_samples WHERE utilization_gpu_pct > 0.5";
    assert!(explain(&sql, busy).await.contains("exact"));
    assert_eq!(count(&sql, busy).await, 300);
}

/// A server restarted again and again without a write (a crash loop, a careless operator)
/// keeps its write-ahead log to the segments that hold rows and the one it writes, and loses
/// none of the rows only the log holds.
#[tokio::test]
async fn restarts_without_writes_leave_no_segments_behind_and_lose_no_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let store = Store::open(config(dir.path())).expect("open");
        let (raw, b) = batch("n1", 1, 1_800_000_000_000, 3);
        store.ingest(raw, &b).await.expect("ingest");
        // Dropped without a flush: the rows live only in the write-ahead log.
    }
    for _ in 0..20 {
        drop(Store::open(config(dir.path())).expect("reopen"));
    }
    let segments = std::fs::read_dir(dir.path().join("wal"))
        .expect("wal")
        .count();
    assert_eq!(
        segments, 2,
        "the segment with the rows and the last start's"
    );
    let store = Store::open(config(dir.path())).expect("reopen");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 3);
    store.flush().await.expect("flush");
    drop(sql);
    drop(store);
    let store = Store::open(config(dir.path())).expect("reopen after the flush");
    let sql = SqlEngine::new(store, QueryLimits::default());
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 3);
}

#[tokio::test]
async fn restart_keeps_flushed_and_logged_rows_once_and_remembers_sequences() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = 1_800_000_000_000;
    {
        let store = Store::open(config(dir.path())).expect("open");
        for seq in 1..=10 {
            let (raw, b) = batch("n1", seq, t0 + seq as i64, 1);
            store.ingest(raw, &b).await.expect("ingest");
        }
        store.flush().await.expect("flush");
        for seq in 11..=15 {
            let (raw, b) = batch("n1", seq, t0 + seq as i64, 1);
            store.ingest(raw, &b).await.expect("ingest");
        }
        // Dropped without a flush: rows 11..=15 live only in the write-ahead log.
    }
    let store = Store::open(config(dir.path())).expect("reopen");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 15);
    for seq in [3, 12, 15] {
        let (raw, b) = batch("n1", seq, t0, 1);
        assert_eq!(
            store.ingest(raw, &b).await.expect("ingest"),
            IngestOutcome::Duplicate,
            "seq {seq}"
        );
    }
    let (raw, b) = batch("n1", 16, t0, 1);
    assert_eq!(
        store.ingest(raw, &b).await.expect("ingest"),
        IngestOutcome::Stored { samples: 1 }
    );
}

/// A batch of job metrics as the OTLP receiver files it: under the job's node, numbered by the
/// receiver's own clock-based counter.
fn otlp_batch(node: &str, seq: u64, time_ms: i64) -> (Bytes, Batch) {
    let (_, mut b) = batch(node, seq, time_ms, 0);
    b.job_metrics = vec![JobMetricSample {
        time_ms,
        job: "7".into(),
        user: "alice".into(),
        service_name: "train".into(),
        metric: "loss".into(),
        kind: "gauge".into(),
        unit: String::new(),
        value: Some(0.5),
        count: None,
        sum: None,
        attributes: "{}".into(),
        simulated: true,
    }];
    (Bytes::from(serde_json::to_vec(&b).expect("json")), b)
}

async fn ingest_as(store: &Store, source: Source, (raw, b): (Bytes, Batch)) -> IngestOutcome {
    store.ingest_from(source, raw, &b).await.expect("ingest")
}

/// A job's OTLP export, filed under its node with a clock-sized `seq`, made every
/// later agent batch of that node a "duplicate" until the agent restarted. The two sources
/// number their batches independently, so neither may shadow the other, live, after a replay
/// of the log, or after a flush (the manifest's sequences).
#[tokio::test]
async fn otlp_exports_never_make_the_nodes_agent_batches_look_old() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = 1_800_000_000_000;
    let otlp_seq = 1_800_000_000_000_000; // microseconds, far above the agent's numbers
    let stored = IngestOutcome::Stored { samples: 1 };
    {
        let store = Store::open(config(dir.path())).expect("open");
        assert_eq!(
            ingest_as(&store, Source::Agent, batch("n1", 100, t0, 1)).await,
            stored
        );
        assert_eq!(
            ingest_as(&store, Source::Otlp, otlp_batch("n1", otlp_seq, t0)).await,
            stored
        );
        assert_eq!(
            ingest_as(&store, Source::Agent, batch("n1", 101, t0 + 1, 1)).await,
            stored
        );
        // Each stream still refuses its own old numbers.
        let dup = IngestOutcome::Duplicate;
        assert_eq!(
            ingest_as(&store, Source::Agent, batch("n1", 101, t0 + 1, 1)).await,
            dup
        );
        assert_eq!(
            ingest_as(&store, Source::Otlp, otlp_batch("n2", otlp_seq, t0)).await,
            dup
        );
        // Left in the write-ahead log only.
        assert_eq!(
            ingest_as(&store, Source::Otlp, otlp_batch("n1", otlp_seq + 1, t0 + 2)).await,
            stored
        );
        assert_eq!(
            ingest_as(&store, Source::Agent, batch("n1", 102, t0 + 2, 1)).await,
            stored
        );
    }
    let store = Store::open(config(dir.path())).expect("reopen after a replay");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 3);
    assert_eq!(count(&sql, "SELECT count(*) FROM job_metrics").await, 2);
    assert_eq!(
        ingest_as(&store, Source::Agent, batch("n1", 103, t0 + 3, 1)).await,
        stored
    );
    assert_eq!(
        ingest_as(&store, Source::Otlp, otlp_batch("n1", otlp_seq + 1, t0)).await,
        IngestOutcome::Duplicate
    );
    store.flush().await.expect("flush");
    drop((sql, store));
    let store = Store::open(config(dir.path())).expect("reopen after a flush");
    assert_eq!(
        ingest_as(&store, Source::Agent, batch("n1", 104, t0 + 4, 1)).await,
        stored
    );
    assert_eq!(
        ingest_as(&store, Source::Otlp, otlp_batch("n1", otlp_seq + 2, t0 + 4)).await,
        stored
    );
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 5);
    assert_eq!(count(&sql, "SELECT count(*) FROM job_metrics").await, 3);
}

/// A request dropped while its batch was being written to the log (the client timed
/// out) left its claim behind, and every retry of that batch was refused as in flight, so the
/// node's telemetry never resumed. The retry must be stored, once.
#[tokio::test]
async fn a_request_dropped_mid_write_does_not_block_its_retry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = 1_800_000_000_000;
    let store = Store::open(config(dir.path())).expect("open");
    // Poll each first attempt once and drop it. The log's writer thread may answer before
    // that one poll ends (then the batch is simply stored); keep going until an attempt was
    // really dropped while writing.
    let mut seq = 0;
    let dropped = loop {
        seq += 1;
        assert!(
            seq <= 200,
            "no attempt was ever still writing after one poll"
        );
        let (raw, b) = batch("n1", seq, t0 + seq as i64, 1);
        let mut first = Box::pin(store.ingest(raw.clone(), &b));
        let pending = futures::poll!(first.as_mut()).is_pending();
        drop(first);
        if pending {
            break (raw, b);
        }
    };
    let (raw, b) = dropped;
    assert_eq!(
        store
            .ingest(raw, &b)
            .await
            .expect("the retry is not refused"),
        IngestOutcome::Stored { samples: 1 }
    );
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(
        count(&sql, "SELECT count(*) FROM gpu_samples").await,
        seq as i64
    );
    drop((sql, store));
    // The abandoned attempt's record may have reached the log too: a replay still counts once.
    let store = Store::open(config(dir.path())).expect("reopen");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(
        count(&sql, "SELECT count(*) FROM gpu_samples").await,
        seq as i64
    );
}

#[tokio::test]
async fn files_split_by_day_and_orphans_are_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = 1_800_000_000_000 / DAY_MS * DAY_MS + DAY_MS - 1; // one millisecond before midnight
    {
        let store = Store::open(config(dir.path())).expect("open");
        for (seq, t) in [(1, t0), (2, t0 + 1), (3, t0 + 2)] {
            let (raw, b) = batch("n1", seq, t, 1);
            store.ingest(raw, &b).await.expect("ingest");
        }
        let stats = store.flush().await.expect("flush");
        // Two days of raw rows, a 1-minute rollup file per day and one 1-hour file for the month.
        assert_eq!((stats.rows, stats.files), (3, 5));
    }
    let days: Vec<_> = std::fs::read_dir(dir.path().join("tables/gpu_samples"))
        .expect("table dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(days.len(), 2, "{days:?}");
    let orphan = dir
        .path()
        .join("tables/gpu_samples")
        .join(&days[0])
        .join("9999999999.parquet");
    std::fs::write(&orphan, b"half-written").expect("write orphan");
    let store = Store::open(config(dir.path())).expect("reopen");
    assert!(
        !orphan.exists(),
        "a file no manifest lists is removed at start-up"
    );
    let sql = SqlEngine::new(store, QueryLimits::default());
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 3);
    // Time predicates work across files and buffer alike.
    let q = format!("SELECT count(*) FROM gpu_samples WHERE time > to_timestamp_millis({t0})");
    assert_eq!(count(&sql, &q).await, 2);
}

#[tokio::test]
async fn a_second_store_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _first = Store::open(config(dir.path())).expect("open");
    let err = Store::open(config(dir.path())).expect_err("second open");
    assert!(err.to_string().contains("another perch server"), "{err}");
}

#[tokio::test]
async fn limits_stop_runaway_queries_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let limits = QueryLimits {
        timeout: std::time::Duration::from_millis(200),
        max_rows: 10,
        memory_bytes: 1 << 20,
        // One slot: every query below needs the one before it to have given its slot back,
        // the timed-out one included.
        max_concurrent: 1,
        ..QueryLimits::default()
    };
    let sql = SqlEngine::new(store.clone(), limits);
    // The amplifiers below are refused by size, not time: a timeout that a busy test machine
    // cannot reach first.
    let amplified = SqlEngine::new(
        store,
        QueryLimits {
            timeout: std::time::Duration::from_secs(30),
            ..limits
        },
    );
    let slow = sql
        .query("SELECT count(*) FROM generate_series(1, 1000000000) a")
        .await
        .expect_err("times out");
    assert!(
        slow.to_string().contains("longer than the 0.2 s limit"),
        "{slow}"
    );
    let big = sql
        .query("SELECT a, count(*) FROM generate_series(1, 5000000) t(a) GROUP BY a")
        .await
        .expect_err("memory");
    assert!(
        big.to_string().contains("MiB limit") || big.to_string().contains("longer than"),
        "{big}"
    );
    let cut = sql
        .query("SELECT * FROM generate_series(1, 100)")
        .await
        .expect("query");
    assert_eq!((cut.rows, cut.truncated), (10, true));
    // A result holds its memory until it is dropped (answered).
    assert!(sql.memory_in_use() > 0);
    drop(cut);
    // A function's output is invisible to the memory pool; repeat('x', 1e9) ran
    // 50 s and took 6 GB past a 1 GiB limit. Now it is refused before it is built.
    for query in [
        "SELECT repeat('x', 1000000000)",
        "SELECT length(repeat(CAST(a AS VARCHAR), 300000)) FROM generate_series(1, 10) t(a)",
        "SELECT lpad('x', 2000000000)",
        "SELECT rpad('x', 2000000000, 'ab')",
        // The same for arrays and the other amplifiers: range(1, 2e9) took a server to 10.8
        // GB, array_repeat to 21.7 GB, and the next one had it killed (an attack from the second trust pass).
        "SELECT cardinality(range(1, 2000000000))",
        "SELECT cardinality(generate_series(1, 2000000000))",
        "SELECT cardinality(range(-9223372036854775807, 9223372036854775807))",
        "SELECT cardinality(range(TIMESTAMP '2020-01-01T00:00:00', TIMESTAMP '2030-01-01T00:00:00', INTERVAL '1 second'))",
        "SELECT cardinality(generate_series(DATE '1900-01-01', DATE '2900-01-01', INTERVAL '1 day'))",
        "SELECT cardinality(array_repeat(1, 2000000000))",
        "SELECT cardinality(array_repeat(make_array(1, 2, 3), 100000))",
        "SELECT cardinality(array_resize(make_array(1), 2000000000))",
        "SELECT length(replace(repeat('a', 10000), 'a', repeat('b', 10000)))",
        "SELECT length(regexp_replace(repeat('a', 10000), '', repeat('b', 1000), 'g'))",
        "SELECT sum(cardinality(range(a, a + 100000))) FROM generate_series(1, 100) t(a)",
        // Concatenation multiplies a batch: eight `s || s` of a 100 KB string over a
        // generate_series took a server to 7.5 GB past a 1 GiB limit (and ran on after its
        // timeout). The same through concat(), concat_ws() and the list forms of ||.
        "SELECT max(length(s || s || s || s || s || s || s || s)) FROM (SELECT repeat(CAST(a AS VARCHAR), 20) s FROM generate_series(1, 100000) t(a))",
        "SELECT max(length(s || s)) FROM (SELECT repeat('x', 100) s FROM generate_series(1, 100000))",
        "SELECT max(length(concat(s, s, s))) FROM (SELECT repeat('x', 100) s FROM generate_series(1, 100000))",
        "SELECT max(length(concat_ws(s, s, s))) FROM (SELECT repeat('x', 100) s FROM generate_series(1, 100000))",
        "SELECT max(cardinality(a || a)) FROM (SELECT range(1, 100) a FROM generate_series(1, 100000))",
        "SELECT max(cardinality(array_concat(a, a, a))) FROM (SELECT range(1, 100) a FROM generate_series(1, 100000))",
        // Conversions that multiply a batch: a character to an element, an element to a
        // delimiter and its text.
        "SELECT max(cardinality(string_to_array(repeat(CAST(a AS VARCHAR), 5), NULL))) FROM generate_series(1, 1000) t(a)",
        "SELECT max(length(array_to_string(range(a, a + 3), repeat('-', 100)))) FROM generate_series(1, 1000) t(a)",
    ] {
        let started = std::time::Instant::now();
        let err = amplified.query(query).await.expect_err(query);
        assert!(err.to_string().contains("MiB limit"), "{query}: {err}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{query}"
        );
    }
    assert_eq!(sql.memory_in_use(), 0, "every query gave its memory back");
    // A refused query's other partitions stop at their next batch.
    for _ in 0..50 {
        if amplified.memory_in_use() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        amplified.memory_in_use(),
        0,
        "every query gave its memory back"
    );
    let ok = sql
        .query("SELECT repeat('ab', 3) AS r, lpad('7', 3, '0') AS l, rpad('7', 3) AS p")
        .await
        .expect("small strings are fine");
    let batch = &ok.batches[0];
    let text = |i: usize| first_text(batch, i);
    assert_eq!(
        (text(0), text(1), text(2)),
        ("ababab".into(), "007".into(), "7  ".into())
    );
    // Everyday sizes of the array and replace functions are untouched.
    let ok = sql
        .query(
            "SELECT cardinality(range(1, 1000)) AS a, \
                    cardinality(generate_series(DATE '2024-01-01', DATE '2024-01-31', INTERVAL '1 day')) AS b, \
                    cardinality(array_repeat(7, 3)) AS c, cardinality(array_resize(make_array(1, 2), 5)) AS d, \
                    replace('abc', 'b', 'xx') AS e, regexp_replace('aaa', 'a', 'b', 'g') AS f",
        )
        .await
        .expect("everyday sizes");
    let batch = &ok.batches[0];
    let int = |i: usize| first_int(batch, i);
    assert_eq!((int(0), int(1), int(2), int(3)), (999, 31, 3, 5));
    let text = |i: usize| first_text(batch, i);
    assert_eq!((text(4), text(5)), ("axxc".into(), "bbb".into()));

    // A wide constant is repeated on every row of a batch before any capped function sees it
    // (a folded repeat('x', 1000000) over a table: 8 GB a batch of 8,192 rows). The query runs
    // in batches small enough for it instead, and gets the right answer.
    let wide = "SELECT max(length(s)) AS m, count(*) AS n FROM (SELECT repeat('x', 50000) s FROM generate_series(1, 3000))";
    let plan = explain(&amplified, wide).await;
    assert!(plan.contains("batch_size=2]"), "{plan}");
    let narrow = explain(
        &amplified,
        "SELECT max(length(s)) FROM (SELECT repeat('x', 5) s FROM generate_series(1, 3000))",
    )
    .await;
    assert!(narrow.contains("batch_size=8192]"), "{narrow}");
    let ok = amplified.query(wide).await.expect("wide constant");
    let batch = &ok.batches[0];
    let int = |i: usize| first_int(batch, i);
    assert_eq!((int(0), int(1)), (50_000, 3_000));
    // Everyday conversions and concatenations are untouched.
    let ok = amplified
        .query("SELECT array_to_string(make_array(1, 2, 3), ',') AS j, cardinality(string_to_array('a,b,c', ',')) AS k, 'gpu-' || CAST(a AS VARCHAR) || '/' || 'x' AS l, concat_ws('-', 'a', 'b') AS m FROM generate_series(7, 7) t(a)")
        .await
        .expect("everyday conversions");
    let batch = &ok.batches[0];
    let text = |i: usize| first_text(batch, i);
    assert_eq!(
        (text(0), text(1), text(2), text(3)),
        ("1,2,3".into(), "3".into(), "gpu-7/x".into(), "a-b".into())
    );
}

#[tokio::test]
async fn compaction_merges_small_files_keeps_every_row_and_spares_running_queries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(dir.path());
    cfg.compact_min_files = 4;
    let store = Store::open(cfg).expect("open");
    let t0 = 1_800_000_000_000 / DAY_MS * DAY_MS + 3_600_000;
    for seq in 1..=6u64 {
        let (raw, b) = batch("n1", seq, t0 + seq as i64 * 1000, 2);
        store.ingest(raw, &b).await.expect("ingest");
        store.flush().await.expect("flush");
    }
    assert_eq!(
        store.file_counts()[0].1,
        6,
        "one gpu_samples file per flush"
    );
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    // A query that took its snapshot before compaction keeps its files until it is done.
    let pinned = store.snapshot_for_test(perch_query::Table::GpuSamples);
    let stats = store.maintain(t0).await.expect("maintain");
    // gpu_samples and its two rollups: six files each become one.
    assert_eq!((stats.files_compacted, stats.files_written), (18, 3));
    assert_eq!(store.file_counts()[0].1, 1);
    assert_eq!(
        store.graveyard_files(),
        6,
        "old files wait while a snapshot holds them"
    );
    assert!(dir.path().join(&pinned[0]).exists());
    drop(pinned);
    store.reap().await;
    assert_eq!(store.graveyard_files(), 0);
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 12);
    // Compaction merged the six partial rows of each GPU's minute into one.
    assert_eq!(
        count(&sql, "SELECT count(*) FROM gpu_samples_1m_partial").await,
        2
    );
    assert_eq!(
        count(
            &sql,
            "SELECT CAST(sum(samples) AS BIGINT) FROM gpu_samples_1m WHERE samples = 6"
        )
        .await,
        12
    );
    assert_eq!(
        count(&sql, "SELECT count(DISTINCT sm_clock_mhz) FROM gpu_samples").await,
        6
    );
    // Nothing left to merge: a second round changes nothing.
    assert_eq!(
        store.maintain(t0).await.expect("maintain"),
        perch_query::MaintenanceStats::default()
    );
    // Queries share their tables (one catalogue for every session) but not their pins: the
    // files the queries above read are deleted once the files are compacted away.
    for seq in 7..=10u64 {
        let (raw, b) = batch("n1", seq, t0 + seq as i64 * 1000, 2);
        store.ingest(raw, &b).await.expect("ingest");
        store.flush().await.expect("flush");
        assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples_1m").await, 2);
    }
    let stats = store.maintain(t0).await.expect("maintain");
    assert!(stats.files_compacted > 0, "{stats:?}");
    store.reap().await;
    assert_eq!(
        store.graveyard_files(),
        0,
        "a query that ended still holds the files it read"
    );
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 20);
    drop(store);
    drop(sql);
    let store = Store::open(config(dir.path())).expect("reopen");
    let sql = SqlEngine::new(store, QueryLimits::default());
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 20);
}

#[tokio::test]
async fn retention_drops_whole_old_day_partitions_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(dir.path());
    cfg.retention.insert(
        perch_query::Table::GpuSamples,
        std::time::Duration::from_secs(2 * 86_400),
    );
    let store = Store::open(cfg).expect("open");
    let day0 = 1_800_000_000_000 / DAY_MS * DAY_MS;
    for (seq, day) in [(1u64, 0i64), (2, 1), (3, 2), (4, 3)] {
        let (raw, b) = batch("n1", seq, day0 + day * DAY_MS + 1000, 1);
        store.ingest(raw, &b).await.expect("ingest");
    }
    store.flush().await.expect("flush");
    // "Now" is the start of day 3: days 0 ends more than two days ago, day 1 ends within.
    let stats = store.maintain(day0 + 3 * DAY_MS).await.expect("maintain");
    assert_eq!((stats.files_expired, stats.rows_expired), (1, 1));
    store.reap().await;
    let sql = SqlEngine::new(store, QueryLimits::default());
    assert_eq!(
        count(
            &sql,
            "SELECT CAST(min(sm_clock_mhz) AS BIGINT) FROM gpu_samples"
        )
        .await,
        2
    );
    assert_eq!(count(&sql, "SELECT count(*) FROM gpu_samples").await, 3);
}

#[tokio::test]
async fn time_predicates_skip_files_outside_the_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let day0 = 1_800_000_000_000 / DAY_MS * DAY_MS;
    for day in 0..5i64 {
        let (raw, b) = batch("n1", day as u64 + 1, day0 + day * DAY_MS, 1);
        store.ingest(raw, &b).await.expect("ingest");
        store.flush().await.expect("flush");
    }
    let sql = SqlEngine::new(store, QueryLimits::default());
    let q = format!(
        "SELECT count(*) FROM gpu_samples WHERE time >= to_timestamp_millis({})",
        day0 + 3 * DAY_MS
    );
    let plan = explain(&sql, &q).await;
    let files = plan.matches(".parquet").count();
    assert_eq!(
        files, 2,
        "only the last two days' files are scanned:\n{plan}"
    );
    let q = format!(
        "SELECT count(*) FROM gpu_samples WHERE time >= to_timestamp_millis({})",
        day0 + 3 * DAY_MS
    );
    assert_eq!(count(&sql, &q).await, 2);
}

/// `name=T total → M matched` from an EXPLAIN ANALYZE plan.
fn pruning_metric(plan: &str, name: &str) -> (String, String) {
    let start = plan
        .find(&format!("{name}="))
        .unwrap_or_else(|| panic!("no {name} in\n{plan}"));
    let rest = &plan[start + name.len() + 1..];
    let rest = &rest[..rest.find(',').unwrap_or(rest.len())];
    let (total, matched) = rest
        .split_once(" total → ")
        .unwrap_or_else(|| panic!("{name}: unexpected format {rest:?}"));
    (
        total.to_owned(),
        matched.trim_end_matches(" matched").to_owned(),
    )
}

#[tokio::test]
async fn time_predicates_prune_pages_inside_files_and_files_keep_their_sort_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let day0 = 1_800_000_000_000 / DAY_MS * DAY_MS;
    // One GPU, 50,000 samples a second apart in one day file.
    for chunk in 0..50i64 {
        let (_, mut b) = batch("n1", chunk as u64 + 1, day0, 1);
        let proto = b.gpus[0].clone();
        b.gpus = (0..1000)
            .map(|i| GpuSample {
                time_ms: day0 + (chunk * 1000 + i) * 1000,
                ..proto.clone()
            })
            .collect();
        let raw = Bytes::from(serde_json::to_vec(&b).expect("json"));
        store.ingest(raw, &b).await.expect("ingest");
    }
    store.flush().await.expect("flush");
    let sql = SqlEngine::new(store, QueryLimits::default());
    let last = format!("time >= to_timestamp_millis({})", day0 + 45_000_000);
    let plan = explain(
        &sql,
        &format!("ANALYZE SELECT count(*) FROM gpu_samples WHERE {last}"),
    )
    .await;
    // The filter reaches the Parquet scan as a pruning predicate on the time statistics...
    assert!(plan.contains("pruning_predicate="), "{plan}");
    assert!(plan.contains("time_max@"), "{plan}");
    // ... which row-group statistics and the page index evaluate: most pages are skipped.
    let (groups, _) = pruning_metric(&plan, "row_groups_pruned_statistics");
    assert_eq!(groups, "1", "one row group: {plan}");
    let (total, matched) = pruning_metric(&plan, "page_index_pages_pruned");
    let (total, matched): (u32, u32) = (
        total.parse().expect("pages"),
        matched.parse().expect("pages"),
    );
    assert!(
        total >= 3 && matched < total,
        "pages {matched} of {total}:\n{plan}"
    );
    assert_eq!(
        count(
            &sql,
            &format!("SELECT count(*) FROM gpu_samples WHERE {last}")
        )
        .await,
        5000
    );
    // The scan declares the files' sort order, so ordering by the sort key needs no sort.
    let plan = explain(
        &sql,
        "SELECT node, gpu, time FROM gpu_samples ORDER BY node, gpu, time",
    )
    .await;
    assert!(
        plan.contains(
            "output_ordering=[node@0 ASC NULLS LAST, gpu@1 ASC NULLS LAST, time@2 ASC NULLS LAST]"
        ),
        "{plan}"
    );
    assert!(!plan.contains("SortExec"), "{plan}");
}

/// `user` columns became `user_name` (an unquoted `user` is the login name in
/// PostgreSQL clients). A store written before keeps its users: its files are rewritten at the
/// next start, and the manifest records the new version.
#[tokio::test]
async fn files_of_an_older_perch_keep_their_users_under_the_new_column_name() {
    use perch_model::JobSample;
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = 1_800_000_000_000;
    {
        let store = Store::open(config(dir.path())).expect("open");
        let (_, mut b) = batch("n1", 1, t0, 0);
        b.jobs = vec![JobSample {
            time_ms: t0,
            job: "7".into(),
            user: Some("alice".into()),
            simulated: true,
            source: "proc".into(),
            gpus: vec![GpuIndex(0)],
            cpu_seconds: Some(1.0),
            memory_bytes: None,
            memory_peak_bytes: None,
            processes: Some(1),
            gpu_memory_bytes: None,
        }];
        let raw = Bytes::from(serde_json::to_vec(&b).expect("json"));
        store.ingest(raw, &b).await.expect("ingest");
        let (raw, b) = otlp_batch("n1", 5, t0);
        store
            .ingest_from(Source::Otlp, raw, &b)
            .await
            .expect("ingest");
        store.flush().await.expect("flush");
    }
    // Turn the store into one an older perch wrote: `user` columns, manifest version 1.
    let manifest_path = dir.path().join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).expect("manifest")).expect("json");
    let mut olds = 0;
    for table in ["job_samples", "job_metrics"] {
        for entry in manifest["files"][table].as_array_mut().expect("files") {
            let path = dir.path().join(entry["path"].as_str().expect("path"));
            let file = std::fs::File::open(&path).expect("open file");
            let reader =
                parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                    .expect("reader")
                    .build()
                    .expect("build");
            let batches: Vec<_> = reader.map(|b| b.expect("batch")).collect();
            let schema = batches[0].schema();
            let fields: Vec<_> = schema
                .fields()
                .iter()
                .map(|f| {
                    let name = if f.name() == "user_name" {
                        "user"
                    } else {
                        f.name()
                    };
                    f.as_ref().clone().with_name(name)
                })
                .collect();
            let old_schema = Arc::new(arrow::datatypes::Schema::new(fields));
            let out = std::fs::File::create(&path).expect("rewrite");
            let mut writer = parquet::arrow::ArrowWriter::try_new(out, old_schema.clone(), None)
                .expect("writer");
            for b in &batches {
                let renamed =
                    arrow::array::RecordBatch::try_new(old_schema.clone(), b.columns().to_vec())
                        .expect("renamed batch");
                writer.write(&renamed).expect("write");
            }
            writer.close().expect("close");
            entry["bytes"] = std::fs::metadata(&path).expect("size").len().into();
            olds += 1;
        }
    }
    assert_eq!(olds, 2, "one file per table");
    manifest["version"] = 1.into();
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).expect("json")).expect("write");

    let store = Store::open(config(dir.path())).expect("reopen and upgrade");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    for table in ["job_samples", "job_metrics"] {
        assert_eq!(
            count(
                &sql,
                &format!("SELECT count(*) FROM {table} WHERE user_name = 'alice'")
            )
            .await,
            1,
            "{table}"
        );
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).expect("manifest")).expect("json");
    assert_eq!(
        manifest["version"], 3,
        "upgraded through version 2 to today's"
    );
    // A manifest from a newer perch is refused with a message that says so.
    let mut newer = manifest.clone();
    newer["version"] = 99.into();
    drop((sql, store));
    std::fs::write(&manifest_path, serde_json::to_vec(&newer).expect("json")).expect("write");
    let err = Store::open(config(dir.path())).expect_err("a newer manifest");
    assert!(err.to_string().contains("newer perch"), "{err}");
}

/// When flushes fail (a full disk, an unwritable bucket) rows piled up in memory
/// without bound, and the flusher retried every 250 ms. Now ingest is refused past
/// `max_buffered_rows` with `Backpressure` (503 store_busy: senders keep their batches and
/// retry), nothing acknowledged is lost, the failure is counted, and ingest resumes by itself
/// once a flush works again.
#[tokio::test]
async fn failing_flushes_refuse_ingest_past_the_bound_and_lose_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = 1_800_000_000_000;
    let mut config = config(dir.path());
    config.max_buffered_rows = 8;
    let store = Store::open(config.clone()).expect("open");
    // Where the flush writes Parquet files: a plain file there makes every write fail, even
    // as root.
    let tables = dir.path().join("tables");
    let _ = std::fs::remove_dir_all(&tables);
    std::fs::write(&tables, "not a directory").expect("block tables/");
    let mut acked = 0;
    let mut seq = 0;
    let refused = loop {
        seq += 1;
        let (raw, b) = batch("n1", seq, t0 + seq as i64, 2);
        match store.ingest(raw, &b).await {
            Ok(IngestOutcome::Stored { samples }) => acked += samples,
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
        assert!(seq < 100, "ingest never refused");
        if seq % 2 == 0 {
            assert!(store.flush().await.is_err(), "the flush should fail");
        }
    };
    assert!(matches!(refused, Error::Backpressure { .. }), "{refused}");
    let message = refused.to_string();
    assert!(
        message.contains("server.max_buffered_rows = 8") && message.contains("flushes are failing"),
        "{message}"
    );
    assert!(store.held_rows() <= 8);
    assert!(
        store
            .stats
            .consecutive_flush_failures
            .load(Ordering::Relaxed)
            >= 2
    );
    assert!(store.flush_error().is_some());
    // Everything acknowledged is visible, and survives a restart (from the log).
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(
        count(&sql, "SELECT count(*) FROM gpu_samples").await,
        acked as i64
    );
    drop(sql);
    drop(store);
    std::fs::remove_file(&tables).expect("unblock");
    let store = Store::open(config).expect("reopen");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    assert_eq!(
        count(&sql, "SELECT count(*) FROM gpu_samples").await,
        acked as i64
    );
    // The disk is back: a flush works, the counters reset, and the refused batch goes in.
    store.flush().await.expect("flush");
    assert_eq!(
        store
            .stats
            .consecutive_flush_failures
            .load(Ordering::Relaxed),
        0
    );
    assert!(store.flush_error().is_none());
    let (raw, b) = batch("n1", seq, t0 + seq as i64, 2);
    assert_eq!(
        store.ingest(raw, &b).await.expect("accepted again"),
        IngestOutcome::Stored { samples: 2 }
    );
    assert_eq!(
        count(&sql, "SELECT count(*) FROM gpu_samples").await,
        acked as i64 + 2
    );
}

/// The rows a query returns were collected outside its memory limit, so a result
/// within `max_rows` could still take any amount of memory. They count against the limit (and
/// the server's budget) now.
#[tokio::test]
async fn a_result_is_held_to_the_query_memory_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let limits = QueryLimits {
        memory_bytes: 4 << 20,
        max_rows: 10_000_000,
        ..QueryLimits::default()
    };
    let sql = SqlEngine::new(store, limits);
    let big = sql
        .query("SELECT value, value * 2 AS b, CAST(value AS VARCHAR) AS c FROM generate_series(1, 2000000)")
        .await
        .expect_err("a 60 MB result under a 4 MiB limit");
    assert!(big.to_string().contains("4 MiB limit"), "{big}");
    let small = sql
        .query("SELECT value FROM generate_series(1, 1000)")
        .await
        .expect("a small result");
    assert_eq!(small.rows, 1000);
    drop(small);
    assert_eq!(
        sql.memory_in_use(),
        0,
        "the result's memory is given back with it"
    );
}

/// A window over each GPU's series reads the files in their order: over a past day it sorts
/// nothing, even while rows of today wait in the memory buffer, and every answer counts each
/// sample once, buffered or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_over_a_past_day_sorts_nothing_with_rows_buffered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(config(dir.path())).expect("open");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let yesterday = (now / DAY_MS - 1) * DAY_MS;
    let mut seq = 0;
    for round in 0..30 {
        for node in ["node-a", "node-b"] {
            seq += 1;
            let (raw, b) = batch(node, seq, yesterday + round * 10_000, 4);
            store.ingest(raw, &b).await.expect("ingest");
        }
    }
    store.flush().await.expect("flush");
    for round in 0..5 {
        for node in ["node-a", "node-b"] {
            seq += 1;
            let (raw, b) = batch(node, seq, now - 60_000 + round * 10_000, 4);
            store.ingest(raw, &b).await.expect("ingest");
        }
    }
    assert!(store.buffered_rows() > 0, "today's rows are buffered");
    let day = format!(
        "time >= TIMESTAMP '{}' AND time < TIMESTAMP '{}'",
        perch_model::timefmt::rfc3339_seconds(yesterday),
        perch_model::timefmt::rfc3339_seconds(yesterday + DAY_MS)
    );
    let window = |filter: &str| {
        format!(
            "SELECT count(previous) FROM (SELECT lag(sm_clock_mhz) OVER (PARTITION BY node, gpu ORDER BY time) AS previous
             FROM gpu_samples WHERE {filter})"
        )
    };
    // 8 series of 30 samples: every sample but each series' first has a previous one, the
    // one before it in time.
    assert_eq!(count(&sql, &window(&day)).await, 8 * 29);
    let plan = explain(&sql, &window(&day)).await;
    assert!(
        plan.contains("BoundedWindowAggExec") && !plan.contains("SortExec"),
        "a window over files alone needs no sort:\n{plan}"
    );
    // With the buffer in range, the rows are sorted with it, and counted once.
    assert_eq!(count(&sql, &window("true")).await, 8 * 34);
}
