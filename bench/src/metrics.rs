//! `perch bench metrics`: the time to render `/metrics` for a large fleet.
//!
//! One full round (host, GPUs, two NICs, every value reported) is ingested from each node,
//! then `GET /metrics` is timed over HTTP, each scrape rendered from the latest values.

use super::sample_batch;
use anyhow::{Context, Result};
use clap::Args;
use perch_model::Batch;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub(super) struct MetricsArgs {
    /// Nodes in the fleet.
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Scrapes to time.
    #[arg(long, default_value_t = 20)]
    scrapes: u32,
    /// Directory to put the temporary data directory in.
    #[arg(long, default_value = ".")]
    dir: std::path::PathBuf,
}

/// A full node: host, GPUs and two NICs, everything reported, as a real agent's round would be.
fn full_node_batch(node: &str, gpus: u32, now_ms: i64) -> Result<Batch> {
    let mut batch = sample_batch(node, 1, 1, gpus, now_ms)?;
    let host = serde_json::json!({
        "time_ms": now_ms, "simulated": true, "cpu_user_seconds": 1e5, "cpu_nice_seconds": 1.0,
        "cpu_system_seconds": 1e4, "cpu_idle_seconds": 1e6, "cpu_iowait_seconds": 10.0,
        "cpu_irq_seconds": 1.0, "cpu_softirq_seconds": 1.0, "cpu_steal_seconds": 0.0,
        "cpu_count": 128, "memory_total_bytes": 2u64 << 40, "memory_available_bytes": 1u64 << 40,
        "load1": 30.0, "load5": 29.0, "load15": 28.0, "disk_free_bytes": 1u64 << 40,
        "disk_total_bytes": 2u64 << 40, "uptime_seconds": 1e6
    });
    batch.hosts = vec![serde_json::from_value(host)?];
    for device in ["eth0", "ib0"] {
        let nic = serde_json::json!({
            "time_ms": now_ms, "device": device, "simulated": true, "rx_bytes": 1u64 << 40,
            "rx_packets": 1u64 << 30, "rx_errors": 0, "rx_dropped": 0, "tx_bytes": 1u64 << 40,
            "tx_packets": 1u64 << 30, "tx_errors": 0, "tx_dropped": 0, "link_up": true, "speed_mbps": 400000
        });
        batch.nics.push(serde_json::from_value(nic)?);
    }
    Ok(batch)
}

pub(super) fn metrics(args: MetricsArgs) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("perch-bench-")
        .tempdir_in(&args.dir)
        .context("creating the data directory")?;
    let state = perch_server::AppState::open(perch_server::ServerConfig::new(
        perch_query::StoreConfig::new(dir.path()),
    ))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(perch_server::serve(listener, state, async move {
            let _ = stop_rx.await;
        }));
        perch_model::tls::use_ring();
        let client = reqwest::Client::new();
        let now_ms = i64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_millis(),
        )?;
        for n in 0..args.nodes {
            let batch = full_node_batch(&format!("node-{n:04}"), args.gpus, now_ms)?;
            let r = client
                .post(format!("http://{addr}/v1/ingest"))
                .json(&batch)
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "ingest answered {}", r.status());
        }
        let mut times = Vec::new();
        let mut size = 0;
        let mut series = 0;
        for _ in 0..args.scrapes {
            let started = Instant::now();
            let body = client
                .get(format!("http://{addr}/metrics"))
                .send()
                .await?
                .bytes()
                .await?;
            times.push(started.elapsed());
            size = body.len();
            series = body
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty() && l[0] != b'#')
                .count();
        }
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "/metrics for {} nodes x {} GPUs ({series} series, {} KiB), {} scrapes over HTTP",
            args.nodes,
            args.gpus,
            size / 1024,
            args.scrapes
        );
        println!(
            "  median {:.1} ms, slowest {:.1} ms",
            ms(times[times.len() / 2]),
            ms(times[times.len() - 1])
        );
        let _ = stop_tx.send(());
        server.await??;
        Ok(())
    })
}
