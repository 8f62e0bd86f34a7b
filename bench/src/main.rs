//! `perch-bench` (also run as `perch bench`): measurements whose results go in BENCHMARKS.md,
//! one module per benchmark. A binary of its own, so that none of this is built into perch.
//!
//! Each prints a small table meant to be pasted into BENCHMARKS.md next to the command that
//! produced it. They drive the real server, store and agent (in-process, over loopback), never
//! mocks, so a figure measures what a deployment would do.

mod dataset;
mod duckdb;
mod fleet;
mod freshness;
mod ingest;
mod jobs;
mod metrics;
mod query;
mod results;
mod web;
mod workload;

use anyhow::Result;
use clap::{Parser, Subcommand};
use perch_model::{Batch, GpuIndex, GpuSample, NodeId};

/// Measure perch (results go in BENCHMARKS.md).
#[derive(Debug, Parser)]
#[command(name = "perch bench", bin_name = "perch bench", version)]
struct Cli {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Ingest throughput over HTTP into durable storage.
    Ingest(ingest::IngestArgs),
    /// What one `perch server` holds as the fleet grows: N simulated nodes speaking the agent
    /// protocol from this process, the server in its own.
    Fleet(fleet::FleetArgs),
    /// Time to render /metrics for a large fleet.
    Metrics(metrics::MetricsArgs),
    /// Job submission throughput over HTTP, and submit-to-start latency on an idle node.
    Jobs(jobs::JobsArgs),
    /// Accounting and monitoring queries over a week of a cluster, perch against DuckDB.
    Query(query::QueryArgs),
    /// How soon a sample an agent sends is visible to SQL.
    Freshness(freshness::FreshnessArgs),
    /// The web view in headless Chromium against `perch demo`: first render of the fleet,
    /// live refreshes, memory over time.
    Web(web::WebArgs),
}

fn main() -> Result<()> {
    perch_model::tls::use_ring();
    // The agent that benchmarks start in-process launches each job under its supervisor by
    // running this executable again (`perch __job-shim`, as perch itself does).
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args
        .get(1)
        .is_some_and(|a| a == perch_collector::launcher::shim::SUBCOMMAND)
    {
        let code = perch_collector::launcher::shim::main(&args[2..]);
        std::process::exit(code);
    }
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("PERCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match cli.what {
        What::Ingest(a) => ingest::ingest(a),
        What::Fleet(a) => fleet::fleet(a),
        What::Metrics(a) => metrics::metrics(a),
        What::Jobs(a) => jobs::jobs(a),
        What::Query(a) => query::query(a),
        What::Freshness(a) => freshness::freshness(a),
        What::Web(a) => web::web(a),
    }
}

/// A batch of `rounds` sampling rounds of `gpus` synthetic GPUs, one second apart, ending at
/// `now_ms`, every value reported.
fn sample_batch(node: &str, seq: u64, rounds: u32, gpus: u32, now_ms: i64) -> Result<Batch> {
    let mut samples = Vec::new();
    for r in 0..rounds {
        for g in 0..gpus {
            let x = f64::from((r * 31 + g * 7) % 100);
            samples.push(GpuSample {
                time_ms: now_ms - i64::from(rounds - r) * 1000,
                gpu: GpuIndex(g),
                uuid: format!("GPU-BENCH-{node}-{g}"),
                model: "Bench GPU (synthetic)".into(),
                simulated: true,
                utilization_gpu_pct: Some(x),
                utilization_memory_pct: Some(x / 2.0),
                memory_used_bytes: Some(40 << 30),
                memory_total_bytes: Some(80 << 30),
                power_watts: Some(300.0 + x),
                energy_joules: Some(1e6 + f64::from(r)),
                temperature_celsius: Some(60.0 + x / 10.0),
                sm_clock_mhz: Some(1980),
                memory_clock_mhz: Some(2619),
                ..GpuSample::default()
            });
        }
    }
    gpu_batch(node, seq, samples)
}

/// `node`'s batch number `seq` holding `samples` and nothing else.
fn gpu_batch(node: &str, seq: u64, samples: Vec<GpuSample>) -> Result<Batch> {
    // Built from JSON so that fields added to `Batch` later default to empty here too.
    let node = NodeId::new(node).map_err(anyhow::Error::msg)?;
    let mut batch: Batch = serde_json::from_value(serde_json::json!({"node": node, "seq": seq}))?;
    batch.gpus = samples;
    Ok(batch)
}

/// Starts the real server in-process on a loopback port over a data directory in `dir`
/// (no PostgreSQL listener); send on the returned channel to stop it.
async fn start_server(
    dir: &std::path::Path,
) -> Result<(
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    start_server_on(dir, None).await
}

/// The job store on the PostgreSQL database `url`, as a leader writes it: the lease taken
/// (waiting for a holder's to run out) and the store fenced at its epoch.
async fn postgres_store(url: &str) -> Result<std::sync::Arc<dyn perch_control::JobStore>> {
    let url = url.to_owned();
    tokio::task::spawn_blocking(move || {
        let db = perch_control::pg::parse_config(&url)?;
        let name = format!("perch-bench-{}", std::process::id());
        let config = perch_control::ha::LeaseConfig::new(
            name.clone(),
            format!("http://{name}"),
            std::time::Duration::from_secs(300),
        );
        let mut lease = perch_control::ha::Lease::connect(&db, config, Default::default())?;
        let (holder, _) = lease
            .acquire(&|| false)
            .ok_or_else(|| anyhow::anyhow!("the lease was not taken"))?;
        let store = perch_control::pg::PgStore::open(&db, holder.epoch)?;
        Ok(std::sync::Arc::new(store) as std::sync::Arc<dyn perch_control::JobStore>)
    })
    .await?
}

/// A server on `dir` with `job_store` (the embedded one when `None`).
async fn start_server_on(
    dir: &std::path::Path,
    job_store: Option<std::sync::Arc<dyn perch_control::JobStore>>,
) -> Result<(
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let mut config = perch_server::ServerConfig::new(perch_query::StoreConfig::new(dir));
    config.pg_listen = None;
    let state = perch_server::AppState::open_with(config, job_store)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(perch_server::serve(listener, state, async move {
        let _ = stop_rx.await;
    }));
    Ok((addr, stop_tx, server))
}
