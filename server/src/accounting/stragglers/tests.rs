//! `job_stragglers` on virtual time: gangs run through the real control plane, their GPUs'
//! samples are ingested with chosen timestamps, and the view's statement is evaluated at
//! chosen instants (its window's end a literal instead of `now()`).

use super::super::history::History;
use super::super::{AccountingConfig, tables};
use super::select;
use perch_control::{JobService, JobsConfig};
use perch_model::Batch;
use perch_model::control::SyncRequest;
use perch_query::{QueryLimits, SqlEngine, Store, StoreConfig};
use serde_json::{Value, json};
use std::sync::Arc;

/// 2025-06-01 10:00 UTC.
const T0: i64 = 1_748_772_000_000;
const MINUTE: i64 = 60_000;
const NODES: [&str; 2] = ["n0", "n1"];

struct Harness {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    jobs: History,
    sql: SqlEngine,
    seq: u64,
}

/// What one GPU reports at one sample.
#[derive(Debug, Clone, Copy)]
struct Gpu {
    util: f64,
    mem: f64,
    sm: u32,
    power: f64,
    pcie: f64,
    /// NVLink bytes since the start (a counter).
    nvlink: u64,
    throttle: u64,
}

/// NVML's `clocks_event_reason` bits the tests set.
const GPU_IDLE: u64 = 0x1;
const HW_SLOWDOWN: u64 = 0x8;
const HW_THERMAL: u64 = 0x40;

impl Harness {
    async fn open() -> Harness {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(StoreConfig::new(dir.path())).expect("store");
        let (tx, _events) = JobService::event_channel();
        let jobs = History::open(&dir.path().join("control"), None, JobsConfig::default(), tx)
            .expect("jobs");
        let sql = tables::register(
            SqlEngine::new(store.clone(), QueryLimits::default()),
            &jobs,
            AccountingConfig::default(),
        );
        let h = Harness {
            _dir: dir,
            store,
            jobs,
            sql,
            seq: 0,
        };
        for node in NODES {
            h.sync(node, T0 - 1000).await;
        }
        h
    }

    async fn sync(&self, node: &str, at: i64) {
        let req: SyncRequest = serde_json::from_value(json!({
            "node": node, "gpus": 2, "gpu_model": "Test H100", "running": [], "exited": [],
        }))
        .expect("sync request");
        self.jobs
            .run(move |c, _| c.sync(req, at))
            .await
            .expect("sync");
    }

    /// Submits a gang of `nodes` × `gpus` at `T0`; returns its id and its GPUs in rank order.
    async fn gang(&self, nodes: u32, gpus: u32) -> (u64, Vec<(String, u32)>) {
        let request: perch_control::spec::JobRequest = serde_json::from_value(json!({
            "command": ["train"], "user": "alice", "name": "train", "nodes": nodes,
            "gpus_per_node": gpus, "time_limit_secs": 36_000
        }))
        .expect("request");
        let records = self
            .jobs
            .run(move |c, _| c.submit(request, T0))
            .await
            .expect("submit");
        let job = &records[0];
        let ranks: Vec<(String, u32)> = job
            .placement
            .iter()
            .flat_map(|p| p.gpus.iter().map(|g| (p.node.clone(), *g)))
            .collect();
        assert_eq!(ranks.len(), (nodes * gpus) as usize, "started: {job:?}");
        (job.id, ranks)
    }

    /// Samples every `step` ms in `[from, to)` of the GPUs `ranks`, each as `f(rank, time)`.
    async fn ingest(
        &mut self,
        ranks: &[(String, u32)],
        from: i64,
        to: i64,
        step: i64,
        f: impl Fn(usize, i64) -> Gpu,
    ) {
        for node in NODES {
            let mut gpus = Vec::new();
            let mut t = from;
            while t < to {
                for (rank, (n, gpu)) in ranks.iter().enumerate() {
                    if n != node {
                        continue;
                    }
                    let g = f(rank, t);
                    gpus.push(json!({"time_ms": t, "gpu": gpu, "uuid": format!("GPU-{node}-{gpu}"),
                        "model": "Test H100", "simulated": false, "utilization_gpu_pct": g.util,
                        "utilization_memory_pct": g.mem, "sm_clock_mhz": g.sm, "power_watts": g.power,
                        "pcie_tx_bytes_per_second": g.pcie / 2.0, "pcie_rx_bytes_per_second": g.pcie / 2.0,
                        "nvlink_rx_bytes": g.nvlink / 2, "nvlink_tx_bytes": g.nvlink / 2,
                        "throttle_reasons": g.throttle}));
                }
                t += step;
            }
            if gpus.is_empty() {
                continue;
            }
            self.seq += 1;
            let body = serde_json::to_vec(&json!({"node": node, "seq": self.seq, "gpus": gpus}))
                .expect("json");
            let batch: Batch = serde_json::from_slice(&body).expect("batch");
            self.store
                .ingest(bytes::Bytes::from(body), &batch)
                .await
                .expect("ingest");
        }
    }

    /// Node `node`'s NIC `eth0` and the job's counter `steps` in `[from, to)`, every second,
    /// going up by `nic` bytes and `steps` steps a second.
    async fn ingest_node(
        &mut self,
        node: &str,
        job: u64,
        from: i64,
        to: i64,
        nic: f64,
        steps: f64,
    ) {
        let (mut nics, mut metrics) = (Vec::new(), Vec::new());
        for t in (from..to).step_by(1000) {
            let secs = (t - T0) as f64 / 1000.0;
            nics.push(json!({"time_ms": t, "device": "eth0", "simulated": false,
                "rx_bytes": (secs * nic / 2.0) as u64, "tx_bytes": (secs * nic / 2.0) as u64,
                "link_up": true}));
            metrics.push(
                json!({"time_ms": t, "job": job.to_string(), "user": "alice",
                "service_name": "train", "metric": "steps", "kind": "sum", "value": secs * steps,
                "attributes": "{}"}),
            );
        }
        self.seq += 1;
        let body = serde_json::to_vec(
            &json!({"node": node, "seq": self.seq, "nics": nics, "job_metrics": metrics}),
        )
        .expect("json");
        let batch: Batch = serde_json::from_slice(&body).expect("batch");
        self.store
            .ingest(bytes::Bytes::from(body), &batch)
            .await
            .expect("ingest");
    }

    /// The view's rows for the window that ends at `end`.
    async fn stragglers(&self, end: i64) -> Vec<Value> {
        let out = self
            .sql
            .query(&select(&format!("to_timestamp_millis({end})")))
            .await
            .expect("query");
        let mut w = arrow::json::ArrayWriter::new(Vec::new());
        for b in &out.batches {
            w.write(b).expect("write");
        }
        w.finish().expect("finish");
        serde_json::from_slice(&w.into_inner()).unwrap_or_default()
    }
}

/// A number in [-1, 1) that depends only on its inputs.
fn noise(t: i64, rank: usize, salt: u64) -> f64 {
    let mut x = (t as u64) ^ ((rank as u64) << 48) ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// A healthy rank of a data-parallel job at `t`: busy with ±8% noise per sample; the first
/// 40 s loading (idle), an idle minute every 10 minutes (evaluation), rank 0 writing a
/// checkpoint over PCIe for 30 s every 15 minutes, and one rank stalled on its input for
/// 4 s now and then.
fn even(rank: usize, t: i64) -> Gpu {
    let since = t - T0;
    let n = |salt| 1.0 + 0.08 * noise(t, rank, salt);
    let idle = since < 40_000 || ((since % (10 * MINUTE)) < MINUTE && since > MINUTE);
    let nvlink = (since.max(0) as f64 / 1000.0 * 40e9) as u64;
    if idle {
        return Gpu {
            util: 0.0,
            mem: 0.0,
            sm: 345,
            power: 70.0 * n(1),
            pcie: 1e6,
            nvlink,
            throttle: GPU_IDLE,
        };
    }
    let stalled = (since / 4000) % 97 == rank as i64 * 13;
    let checkpoint = rank == 0 && (since % (15 * MINUTE)) < 30_000;
    Gpu {
        util: if stalled {
            35.0
        } else {
            (95.0 * n(2)).min(100.0)
        },
        mem: 40.0 * n(3),
        sm: (1980.0 - 60.0 * noise(t, rank, 4).abs()) as u32,
        power: 600.0 * n(5),
        pcie: if checkpoint { 9e9 } else { 2e9 * n(6) },
        nvlink,
        throttle: 0,
    }
}

/// A rank thermally throttled: the clock and power down, hardware slowdown reported.
fn throttled(rank: usize, t: i64) -> Gpu {
    let g = even(rank, t);
    if g.util == 0.0 {
        return g;
    }
    Gpu {
        sm: 1100,
        power: g.power * 0.62,
        throttle: HW_SLOWDOWN | HW_THERMAL,
        ..g
    }
}

#[tokio::test]
async fn an_even_gang_is_never_flagged_over_an_hour_of_load() {
    let mut h = Harness::open().await;
    let (_, ranks) = h.gang(2, 2).await;
    for start in (T0..T0 + 60 * MINUTE).step_by(5 * MINUTE as usize) {
        h.ingest(&ranks, start, start + 5 * MINUTE, 2000, even)
            .await;
    }
    // Every minute's window: the whole hour.
    let mut evaluated = 0;
    for end in (T0 + MINUTE..=T0 + 60 * MINUTE).step_by(MINUTE as usize) {
        let rows = h.stragglers(end).await;
        assert!(rows.is_empty(), "at +{} s: {rows:?}", (end - T0) / 1000);
        evaluated += 1;
    }
    assert_eq!(evaluated, 60);
}

#[tokio::test]
async fn a_throttled_rank_is_flagged_within_a_minute_with_its_evidence() {
    let mut h = Harness::open().await;
    let (job, ranks) = h.gang(2, 2).await;
    let slow = 3;
    let from = T0 + 3 * MINUTE;
    h.ingest(&ranks, T0, T0 + 6 * MINUTE, 1000, |rank, t| {
        if rank == slow && t >= from {
            throttled(rank, t)
        } else {
            even(rank, t)
        }
    })
    .await;
    assert!(h.stragglers(from).await.is_empty(), "even before");
    let mut flagged_at = None;
    for end in (from..=from + MINUTE).step_by(10_000) {
        let rows = h.stragglers(end).await;
        if !rows.is_empty() {
            flagged_at = Some((end, rows));
            break;
        }
    }
    let (at, rows) = flagged_at.expect("flagged within a minute");
    assert!(at - from <= MINUTE, "after {} s", (at - from) / 1000);
    let (node, gpu) = &ranks[slow];
    for r in &rows {
        assert_eq!(r["job"], job, "{r}");
        assert_eq!(r["rank"], slow, "only the throttled rank: {r}");
        assert_eq!(r["node_rank"], 1, "{r}");
        assert_eq!(r["node"], node.as_str(), "{r}");
        assert_eq!(r["gpu"], *gpu, "{r}");
        assert_eq!(r["gang_size"], 4, "{r}");
        let reasons = r["throttle_reasons"].as_str().unwrap_or_default();
        assert!(reasons.contains("hw_slowdown"), "{r}");
        assert!(r["ratio"].as_f64().unwrap_or(1.0) < 0.85, "{r}");
    }
    let metrics: Vec<&str> = rows.iter().filter_map(|r| r["metric"].as_str()).collect();
    assert!(metrics.contains(&"sm_clock_mhz"), "{metrics:?}");
    assert!(metrics.contains(&"power_watts"), "{metrics:?}");
    let clock = rows
        .iter()
        .find(|r| r["metric"] == "sm_clock_mhz")
        .expect("clock row");
    // Its mean over the minute, throttled in most of it, against the others' 1920 to 1980.
    let (value, median) = (clock["value"].as_f64(), clock["gang_median"].as_f64());
    assert!(value < Some(1400.0) && median > Some(1900.0), "{clock}");
    // The rest of the run keeps it flagged, the same rank only.
    let later = h.stragglers(T0 + 6 * MINUTE).await;
    assert!(!later.is_empty() && later.iter().all(|r| r["rank"] == slow));
}

/// With two ranks the median is their mean: one measure behind is not enough (rank 0 writes
/// checkpoints over PCIe, the other does not), a throttled rank is flagged.
#[tokio::test]
async fn two_ranks_need_a_cause_or_a_second_measure() {
    let mut h = Harness::open().await;
    let (_, ranks) = h.gang(2, 1).await;
    h.ingest(&ranks, T0, T0 + 4 * MINUTE, 1000, |rank, t| {
        let g = even(rank, t);
        match rank {
            0 if g.util > 0.0 => Gpu { pcie: 8e9, ..g },
            _ => g,
        }
    })
    .await;
    for end in (T0 + MINUTE..=T0 + 4 * MINUTE).step_by(10_000) {
        let rows = h.stragglers(end).await;
        assert!(rows.is_empty(), "at +{} s: {rows:?}", (end - T0) / 1000);
    }
    h.ingest(&ranks, T0 + 4 * MINUTE, T0 + 6 * MINUTE, 1000, |rank, t| {
        if rank == 1 {
            throttled(rank, t)
        } else {
            even(rank, t)
        }
    })
    .await;
    let rows = h.stragglers(T0 + 6 * MINUTE).await;
    assert!(!rows.is_empty());
    assert!(
        rows.iter().all(|r| r["rank"] == 1 && r["gang_size"] == 2),
        "{rows:?}"
    );
}

/// Node-wide measures: the job's own step counter (as an OpenTelemetry SDK pushes it, per
/// node) and the node's NIC throughput. Two nodes: the step rate behind alone is not enough;
/// with the NIC behind too, the node is flagged (no GPU, no rank: its `NODE_RANK`).
#[tokio::test]
async fn a_node_behind_on_its_steps_and_its_network_is_flagged() {
    let mut h = Harness::open().await;
    let (job, ranks) = h.gang(2, 1).await;
    let end = T0 + 3 * MINUTE;
    h.ingest(&ranks, T0, end, 1000, even).await;
    let slow = ranks[1].0.clone();
    let fast = ranks[0].0.clone();
    h.ingest_node(&fast, job, T0, end, 2e9, 10.0).await;
    h.ingest_node(&slow, job, T0, T0 + 2 * MINUTE, 2e9, 4.0)
        .await;
    assert!(
        h.stragglers(T0 + 2 * MINUTE).await.is_empty(),
        "steps alone"
    );
    h.ingest_node(&slow, job, T0 + 2 * MINUTE, end, 0.5e9, 4.0)
        .await;
    let rows = h.stragglers(end).await;
    let mut metrics: Vec<&str> = rows.iter().filter_map(|r| r["metric"].as_str()).collect();
    metrics.sort_unstable();
    assert_eq!(metrics, ["job:steps", "nic_bytes_per_second"], "{rows:?}");
    for r in &rows {
        assert_eq!(r["node"], slow.as_str(), "{r}");
        assert_eq!(r["node_rank"], 1, "{r}");
        assert!(r["gpu"].is_null() && r["rank"].is_null(), "{r}");
        assert_eq!(r["gang_size"], 2, "{r}");
    }
    let steps = rows
        .iter()
        .find(|r| r["metric"] == "job:steps")
        .expect("steps");
    assert_eq!(steps["value"], 4.0, "{steps}");
    assert_eq!(steps["gang_median"], 7.0, "{steps}");
}
