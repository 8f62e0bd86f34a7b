//! Rollups are exact: for random samples cut by random flushes, restarts (replay from the
//! write-ahead log) and compactions, the `gpu_samples_1m` and `gpu_samples_1h` views equal
//! the aggregates computed here directly from the raw samples, and they outlive the raw rows.

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{Float64Type, Int64Type, TimestampMillisecondType, UInt32Type, UInt64Type};
use bytes::Bytes;
use perch_model::{Batch, GpuIndex, GpuSample, HostSample, NodeId};
use perch_query::{QueryLimits, SqlEngine, Store, StoreConfig, Table};
use proptest::prelude::*;
use std::collections::BTreeMap;

const DAY_MS: i64 = 86_400_000;
/// 22:30 UTC: the samples below cross an hour and a day boundary.
const T0: i64 = 1_800_000_000_000 / DAY_MS * DAY_MS + 22 * 3_600_000 + 1_800_000;

#[derive(Debug, Clone)]
struct Sample {
    node: usize,
    gpu: u32,
    offset_ms: i64,
    /// Multiples of 1/4 (exact in binary), so float sums are exact in any order.
    util: Option<f64>,
    memory: Option<u64>,
    energy: Option<f64>,
    clock: Option<u32>,
}

fn sample() -> impl Strategy<Value = Sample> {
    (
        0..2usize,
        0..2u32,
        0..3 * 3_600_000i64,
        proptest::option::of(0..400u32),
        proptest::option::of(0..80_000_000_000u64),
        proptest::option::of(0..1_000_000u32),
        proptest::option::of(200..2000u32),
    )
        .prop_map(
            |(node, gpu, offset_ms, util, memory, energy, clock)| Sample {
                node,
                gpu,
                offset_ms,
                util: util.map(|u| f64::from(u) / 4.0),
                memory,
                energy: energy.map(|e| f64::from(e) / 4.0),
                clock,
            },
        )
}

/// What happens after a batch is ingested.
#[derive(Debug, Clone, Copy)]
enum Step {
    Nothing,
    Flush,
    Restart,
    Compact,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Nothing),
        3 => Just(Step::Flush),
        1 => Just(Step::Restart),
        1 => Just(Step::Compact),
    ]
}

fn node_name(n: usize) -> String {
    format!("n{n}")
}

fn gpu_sample(s: &Sample) -> GpuSample {
    GpuSample {
        time_ms: T0 + s.offset_ms,
        gpu: GpuIndex(s.gpu),
        uuid: format!("GPU-{}-{}", s.node, s.gpu),
        model: "Test".into(),
        simulated: true,
        utilization_gpu_pct: s.util,
        memory_used_bytes: s.memory,
        energy_joules: s.energy,
        sm_clock_mhz: s.clock,
        ..GpuSample::default()
    }
}

fn batch(node: usize, seq: u64, gpus: Vec<GpuSample>, hosts: Vec<HostSample>) -> (Bytes, Batch) {
    let b = Batch {
        hosts,
        gpus,
        ..Batch::new(NodeId::new(node_name(node)).expect("node"), seq)
    };
    (Bytes::from(serde_json::to_vec(&b).expect("json")), b)
}

/// count, sum, min, max of the non-null values.
#[derive(Debug, Clone, PartialEq, Default)]
struct Agg<T> {
    count: u64,
    sum: Option<T>,
    min: Option<T>,
    max: Option<T>,
}

impl<T: Copy + PartialOrd + std::ops::Add<Output = T>> Agg<T> {
    fn add(&mut self, v: Option<T>) {
        let Some(v) = v else { return };
        self.count += 1;
        self.sum = Some(self.sum.map_or(v, |s| s + v));
        self.min = Some(self.min.map_or(v, |m| if v < m { v } else { m }));
        self.max = Some(self.max.map_or(v, |m| if v > m { v } else { m }));
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
struct Bucket {
    samples: u64,
    util: Agg<f64>,
    memory: Agg<u64>,
    clock: Agg<u64>,
    energy_min: Option<f64>,
    energy_max: Option<f64>,
}

type Key = (i64, String, u32);

fn expected(samples: &[Sample], width: i64) -> BTreeMap<Key, Bucket> {
    let mut out: BTreeMap<Key, Bucket> = BTreeMap::new();
    for s in samples {
        let t = T0 + s.offset_ms;
        let b = out
            .entry((t.div_euclid(width) * width, node_name(s.node), s.gpu))
            .or_default();
        b.samples += 1;
        b.util.add(s.util);
        b.memory.add(s.memory);
        b.clock.add(s.clock.map(u64::from));
        let mut energy = Agg::default();
        energy.add(b.energy_min);
        energy.add(b.energy_max);
        energy.add(s.energy);
        (b.energy_min, b.energy_max) = (energy.min, energy.max);
    }
    out
}

fn f64_at(batch: &RecordBatch, name: &str, i: usize) -> Option<f64> {
    let c = batch.column_by_name(name).expect(name);
    c.is_valid(i)
        .then(|| c.as_primitive::<Float64Type>().value(i))
}

fn u64_at(batch: &RecordBatch, name: &str, i: usize) -> Option<u64> {
    let c = batch.column_by_name(name).expect(name);
    c.is_valid(i)
        .then(|| c.as_primitive::<UInt64Type>().value(i))
}

async fn actual(sql: &SqlEngine, view: &str) -> BTreeMap<Key, Bucket> {
    let out = sql
        .query(&format!("SELECT * FROM {view}"))
        .await
        .expect("query the rollup view");
    let mut rows = BTreeMap::new();
    for b in &out.batches {
        for i in 0..b.num_rows() {
            let key = (
                b.column_by_name("time")
                    .expect("time")
                    .as_primitive::<TimestampMillisecondType>()
                    .value(i),
                b.column_by_name("node")
                    .expect("node")
                    .as_string::<i32>()
                    .value(i)
                    .to_owned(),
                b.column_by_name("gpu")
                    .expect("gpu")
                    .as_primitive::<UInt32Type>()
                    .value(i),
            );
            let agg_f = |m: &str| Agg {
                count: u64_at(b, &format!("{m}_count"), i).unwrap_or(0),
                sum: f64_at(b, &format!("{m}_sum"), i),
                min: f64_at(b, &format!("{m}_min"), i),
                max: f64_at(b, &format!("{m}_max"), i),
            };
            let agg_u = |m: &str| Agg {
                count: u64_at(b, &format!("{m}_count"), i).unwrap_or(0),
                sum: u64_at(b, &format!("{m}_sum"), i),
                min: u64_at(b, &format!("{m}_min"), i),
                max: u64_at(b, &format!("{m}_max"), i),
            };
            let bucket = Bucket {
                samples: u64_at(b, "samples", i).unwrap_or(0),
                util: agg_f("utilization_gpu_pct"),
                memory: agg_u("memory_used_bytes"),
                clock: agg_u("sm_clock_mhz"),
                energy_min: f64_at(b, "energy_joules_min", i),
                energy_max: f64_at(b, "energy_joules_max", i),
            };
            // The mean is the sum over the count, when there is any value.
            let avg = f64_at(b, "utilization_gpu_pct_avg", i);
            assert_eq!(
                avg,
                bucket.util.sum.map(|s| s / bucket.util.count as f64),
                "{key:?}"
            );
            assert!(
                rows.insert(key.clone(), bucket).is_none(),
                "two rows for {key:?}"
            );
        }
    }
    rows
}

fn config(dir: &std::path::Path) -> StoreConfig {
    let mut c = StoreConfig::new(dir);
    c.compact_min_files = 2;
    c
}

async fn run_case(samples: Vec<Sample>, steps: Vec<Step>, per_batch: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = Store::open(config(dir.path())).expect("open");
    let mut seq = [0u64; 2];
    for (i, chunk) in samples.chunks(per_batch.max(1)).enumerate() {
        for (node, seq) in seq.iter_mut().enumerate() {
            let gpus: Vec<GpuSample> = chunk
                .iter()
                .filter(|s| s.node == node)
                .map(gpu_sample)
                .collect();
            if gpus.is_empty() {
                continue;
            }
            *seq += 1;
            let (raw, b) = batch(node, *seq, gpus, vec![]);
            store.ingest(raw, &b).await.expect("ingest");
        }
        match steps.get(i).copied().unwrap_or(Step::Nothing) {
            Step::Nothing => {}
            Step::Flush => {
                store.flush().await.expect("flush");
            }
            Step::Restart => {
                drop(store);
                store = Store::open(config(dir.path())).expect("reopen");
            }
            Step::Compact => {
                store.maintain(T0).await.expect("maintain");
            }
        }
    }
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    // Some rows may still be buffered: the views roll them up at query time.
    for (view, width) in [("gpu_samples_1m", 60_000), ("gpu_samples_1h", 3_600_000)] {
        assert_eq!(
            actual(&sql, view).await,
            expected(&samples, width),
            "{view}"
        );
    }
    store.flush().await.expect("flush");
    store.maintain(T0).await.expect("maintain");
    for (view, width) in [("gpu_samples_1m", 60_000), ("gpu_samples_1h", 3_600_000)] {
        assert_eq!(
            actual(&sql, view).await,
            expected(&samples, width),
            "{view} after the last flush and compaction"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn rollups_equal_aggregates_of_the_raw_rows(
        samples in proptest::collection::vec(sample(), 1..300),
        steps in proptest::collection::vec(step(), 0..40),
        per_batch in 1..40usize,
    ) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(run_case(samples, steps, per_batch));
    }
}

async fn scalar(sql: &SqlEngine, query: &str) -> i64 {
    let out = sql.query(query).await.expect(query);
    out.batches[0]
        .column(0)
        .as_primitive::<Int64Type>()
        .value(0)
}

fn host(time_ms: i64, user: f64, load: f64) -> HostSample {
    HostSample {
        time_ms,
        simulated: true,
        cpu_user_seconds: Some(user),
        cpu_nice_seconds: None,
        cpu_system_seconds: None,
        cpu_idle_seconds: None,
        cpu_iowait_seconds: None,
        cpu_irq_seconds: None,
        cpu_softirq_seconds: None,
        cpu_steal_seconds: None,
        cpu_count: Some(64),
        memory_total_bytes: None,
        memory_available_bytes: None,
        load1: Some(load),
        load5: None,
        load15: None,
        disk_free_bytes: None,
        disk_total_bytes: None,
        uptime_seconds: None,
    }
}

#[tokio::test]
async fn rollups_outlive_the_raw_rows_and_each_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    let day0 = 1_800_000_000_000 / DAY_MS * DAY_MS;
    // Day 0: two GPU samples and two host samples a minute apart; day 1: one of each.
    for (seq, t) in [(1u64, day0 + 1000), (2, day0 + 61_000), (3, day0 + DAY_MS)] {
        let gpus = vec![GpuSample {
            time_ms: t,
            uuid: "GPU-0".into(),
            model: "Test".into(),
            utilization_gpu_pct: Some(seq as f64 * 10.0),
            ..GpuSample::default()
        }];
        let hosts = vec![host(t, seq as f64 * 100.0, 1.5)];
        let (raw, b) = batch(0, seq, gpus, hosts);
        store.ingest(raw, &b).await.expect("ingest");
    }
    store.flush().await.expect("flush");
    let sql = SqlEngine::new(store.clone(), QueryLimits::default());
    let day0_filter = format!(
        "time >= to_timestamp_millis({day0}) AND time < to_timestamp_millis({})",
        day0 + DAY_MS
    );

    // Default retention, 31 days on: raw day 0 and day 1 are gone, both rollups answer.
    let stats = store.maintain(day0 + 32 * DAY_MS).await.expect("maintain");
    assert_eq!(stats.rows_expired, 6, "raw GPU and host rows of both days");
    store.reap().await;
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples").await, 0);
    assert_eq!(scalar(&sql, "SELECT count(*) FROM host_samples").await, 0);
    let q = format!("SELECT CAST(sum(samples) AS BIGINT) FROM gpu_samples_1m WHERE {day0_filter}");
    assert_eq!(scalar(&sql, &q).await, 2);
    let q = format!(
        "SELECT CAST(sum(utilization_gpu_pct_sum) / sum(utilization_gpu_pct_count) AS BIGINT) FROM gpu_samples_1h WHERE {day0_filter}"
    );
    assert_eq!(scalar(&sql, &q).await, 15, "mean of 10 and 20");
    let q = "SELECT CAST(max(cpu_user_seconds_max) - min(cpu_user_seconds_min) AS BIGINT) FROM host_samples_1m";
    assert_eq!(scalar(&sql, q).await, 200);
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM host_samples_1h").await,
        2
    );

    // 182 days on: the 1-minute rollups are gone too, the hourly ones (a month partition) stay.
    store.maintain(day0 + 182 * DAY_MS).await.expect("maintain");
    store.reap().await;
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples_1m").await, 0);
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples_1h").await, 2);
    assert_eq!(
        scalar(
            &sql,
            "SELECT CAST(sum(samples) AS BIGINT) FROM gpu_samples_1h"
        )
        .await,
        3
    );
    let months: Vec<_> = std::fs::read_dir(dir.path().join("tables/gpu_samples_1h"))
        .expect("1h table dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(months, ["month=2027-01"]);

    // Four years on, nothing is left.
    store
        .maintain(day0 + 4 * 365 * DAY_MS)
        .await
        .expect("maintain");
    assert_eq!(scalar(&sql, "SELECT count(*) FROM gpu_samples_1h").await, 0);
    assert!(
        store
            .file_counts()
            .iter()
            .all(|(t, files, _)| *files == 0 || *t == Table::Events)
    );
}

#[tokio::test]
async fn time_predicates_on_a_rollup_view_reach_its_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    let day0 = 1_800_000_000_000 / DAY_MS * DAY_MS;
    for day in 0..5i64 {
        let gpus = vec![GpuSample {
            time_ms: day0 + day * DAY_MS,
            uuid: "GPU-0".into(),
            model: "Test".into(),
            ..GpuSample::default()
        }];
        let (raw, b) = batch(0, day as u64 + 1, gpus, vec![]);
        store.ingest(raw, &b).await.expect("ingest");
        store.flush().await.expect("flush");
    }
    let sql = SqlEngine::new(store, QueryLimits::default());
    let since = format!("time >= to_timestamp_millis({})", day0 + 3 * DAY_MS);
    let out = sql
        .query(&format!(
            "EXPLAIN SELECT * FROM gpu_samples_1m WHERE {since}"
        ))
        .await
        .expect("explain");
    let plan = arrow::util::pretty::pretty_format_batches(&out.batches)
        .expect("format")
        .to_string();
    assert_eq!(
        plan.matches(".parquet").count(),
        2,
        "only the last two days' rollup files are scanned:\n{plan}"
    );
    let q = format!("SELECT count(*) FROM gpu_samples_1m WHERE {since}");
    assert_eq!(scalar(&sql, &q).await, 2);
}
