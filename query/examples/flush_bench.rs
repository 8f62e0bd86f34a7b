//! How long one flush of a full buffer takes: ingests `ROWS` GPU samples (1,000 GPUs on 125
//! nodes, one sample a second each, every main metric present) and times `Store::flush`, which
//! sorts them, writes the day's Parquet files (and, since rollups exist, their 1-minute and
//! 1-hour partial rows) and commits the manifest.
//!
//!     cargo run --release -p perch-query --example flush_bench [ROWS]
//!
//! A measurement, not a test: quote it with the command and the machine it ran on.

use bytes::Bytes;
use perch_model::{Batch, GpuIndex, GpuSample, NodeId};
use perch_query::{Store, StoreConfig};
use std::time::Instant;

const GPUS_PER_NODE: u32 = 8;
const NODES: u32 = 125;
/// Rounds (seconds) per ingested batch, as an agent that catches up sends them.
const ROUNDS_PER_BATCH: u32 = 60;

fn batch(node: u32, seq: u64, t0: i64) -> Result<Batch, Box<dyn std::error::Error>> {
    let name = format!("node-{node:03}");
    let mut gpus = Vec::with_capacity((GPUS_PER_NODE * ROUNDS_PER_BATCH) as usize);
    for round in 0..ROUNDS_PER_BATCH {
        let time_ms = t0 + (seq as i64 * i64::from(ROUNDS_PER_BATCH) + i64::from(round)) * 1000;
        for g in 0..GPUS_PER_NODE {
            let x = (seq as f64 + f64::from(round) + f64::from(g)) % 100.0;
            gpus.push(GpuSample {
                time_ms,
                gpu: GpuIndex(g),
                uuid: format!("GPU-{node}-{g}"),
                model: "NVIDIA H100 80GB HBM3".into(),
                simulated: true,
                utilization_gpu_pct: Some(x),
                utilization_memory_pct: Some(x / 2.0),
                memory_used_bytes: Some(40_000_000_000 + (x as u64) * 1_000_000),
                memory_total_bytes: Some(80_000_000_000),
                power_watts: Some(200.0 + x * 3.0),
                energy_joules: Some(time_ms as f64 / 1000.0 * 300.0),
                temperature_celsius: Some(40.0 + x / 4.0),
                sm_clock_mhz: Some(1500 + x as u32),
                memory_clock_mhz: Some(2619),
                ..GpuSample::default()
            });
        }
    }
    Ok(Batch {
        gpus,
        ..Batch::new(NodeId::new(name)?, seq)
    })
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rows: u64 = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 1_000_000,
    };
    let per_batch = u64::from(GPUS_PER_NODE * ROUNDS_PER_BATCH);
    let batches_per_node = rows.div_ceil(per_batch * u64::from(NODES));
    let dir = tempfile::tempdir()?;
    let mut config = StoreConfig::new(dir.path());
    config.flush_max_rows = usize::MAX;
    let store = Store::open(config)?;
    let t0 = 1_800_000_000_000 / 86_400_000 * 86_400_000;
    for seq in 1..=batches_per_node {
        let mut pending = Vec::new();
        for node in 0..NODES {
            let b = batch(node, seq, t0)?;
            let raw = Bytes::from(serde_json::to_vec(&b)?);
            let store = store.clone();
            pending.push(tokio::spawn(async move { store.ingest(raw, &b).await }));
        }
        for p in pending {
            p.await??;
        }
    }
    let buffered = store.buffered_rows();
    let start = Instant::now();
    let stats = store.flush().await?;
    let took = start.elapsed();
    println!(
        "flushed {buffered} buffered rows ({} rows in {} files) in {:.3} s",
        stats.rows,
        stats.files,
        took.as_secs_f64()
    );
    Ok(())
}
