//! `perch bench`: measurements whose results go in BENCHMARKS.md.
//!
//! `perch bench ingest` drives the real server over HTTP on loopback: client tasks post
//! telemetry batches as fast as they are acknowledged (each acknowledgement means fsynced in
//! the write-ahead log and visible to SQL). The server runs on a single-threaded runtime; its
//! CPU time (HTTP, parsing, validation, Arrow conversion, log writer, flushes) is read from
//! `/proc/self/task/*/stat`, so "values per server CPU second" is throughput per core however
//! many cores the machine has. For comparison it also times arrow-rs encoding the same
//! batches straight to Parquet on one thread.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use perch_model::{Batch, GpuIndex, GpuSample, NodeId};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Ingest throughput over HTTP into durable storage.
    Ingest(IngestArgs),
    /// Time to render /metrics for a large fleet.
    Metrics(MetricsArgs),
    /// Job submission throughput over HTTP, and submit-to-start latency on an idle node.
    Jobs(JobsArgs),
}

#[derive(Debug, Args)]
struct JobsArgs {
    /// Seconds of sustained submission.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: u32,
    /// Jobs submitted one at a time to an idle node, to time submit-to-start.
    #[arg(long, default_value_t = 20)]
    starts: u32,
    /// Directory to put the temporary data directories in.
    #[arg(long, default_value = ".")]
    dir: std::path::PathBuf,
}

#[derive(Debug, Args)]
struct MetricsArgs {
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

#[derive(Debug, Args)]
struct IngestArgs {
    /// Seconds to measure (after one second of warm-up).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Concurrent client connections (each plays one node).
    #[arg(long, default_value_t = 16)]
    clients: u32,
    /// Sampling rounds per batch (an agent merges rounds while the server is slow).
    #[arg(long, default_value_t = 10)]
    rounds: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Directory to put the temporary data directory in (use the disk you will deploy on).
    #[arg(long, default_value = ".")]
    dir: std::path::PathBuf,
}

/// Measured values carried by each GPU sample the benchmark sends (utilization x2, memory x2,
/// power, energy, temperature, two clocks).
const VALUES_PER_GPU_SAMPLE: u64 = 9;

pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        What::Ingest(a) => ingest(a),
        What::Metrics(a) => metrics(a),
        What::Jobs(a) => jobs(a),
    }
}

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
    // Built from JSON so that fields added to `Batch` later default to empty here too.
    let node = NodeId::new(node).map_err(anyhow::Error::msg)?;
    let mut batch: Batch = serde_json::from_value(serde_json::json!({"node": node, "seq": seq}))?;
    batch.gpus = samples;
    Ok(batch)
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

fn metrics(args: MetricsArgs) -> Result<()> {
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

async fn start_server(
    dir: &std::path::Path,
) -> Result<(
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let mut config = perch_server::ServerConfig::new(perch_query::StoreConfig::new(dir));
    config.pg_listen = None;
    let state = perch_server::AppState::open(config)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(perch_server::serve(listener, state, async move {
        let _ = stop_rx.await;
    }));
    Ok((addr, stop_tx, server))
}

fn jobs(args: JobsArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // 1. Sustained submission: every acknowledgement means the job is in the job database.
        let dir = tempfile::Builder::new().prefix("perch-bench-").tempdir_in(&args.dir)?;
        let (addr, stop, server) = start_server(dir.path()).await?;
        let submitted = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + Duration::from_secs(args.seconds);
        let mut tasks = Vec::new();
        for c in 0..args.clients {
            let submitted = submitted.clone();
            tasks.push(tokio::spawn(async move {
                let client = reqwest::Client::new();
                let body = serde_json::json!({"command": ["true"], "gpus_per_node": 1, "user": format!("u{c}"), "time_limit_secs": 600});
                while Instant::now() < deadline {
                    let r = client.post(format!("http://{addr}/v1/jobs")).json(&body).send().await?;
                    anyhow::ensure!(r.status().is_success(), "submit answered {}", r.status());
                    submitted.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        let started = Instant::now();
        for t in tasks {
            t.await??;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let n = submitted.load(Ordering::Relaxed);
        println!("job submission over HTTP ({} clients, each job durable in the job database before its answer)", args.clients);
        println!("  {n} jobs in {elapsed:.1} s = {:.0} jobs/s", n as f64 / elapsed);
        let _ = stop.send(());
        server.await??;

        // 2. Submit-to-start on an idle node: from sending the request to the job's process
        // running on the agent (it creates a file).
        let dir = tempfile::Builder::new().prefix("perch-bench-").tempdir_in(&args.dir)?;
        let (addr, stop, server) = start_server(dir.path()).await?;
        let node = perch_model::NodeId::new("bench-node").map_err(anyhow::Error::msg)?;
        let mut agent = perch_collector::AgentConfig::new(format!("http://{addr}"), node);
        agent.simulate_gpus = 8;
        agent.nvml = perch_collector::NvmlMode::Off;
        agent.data_dir = dir.path().join("agent");
        let (agent_stop, agent_stopped) = tokio::sync::oneshot::channel::<()>();
        let agent = perch_collector::spawn_agent(agent, async move {
            let _ = agent_stopped.await;
        });
        let client = reqwest::Client::new();
        // Wait until the node has joined.
        loop {
            let nodes: serde_json::Value = client.get(format!("http://{addr}/v1/nodes")).send().await?.json().await?;
            if nodes["nodes"].as_array().is_some_and(|n| !n.is_empty()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut latencies = Vec::new();
        for i in 0..args.starts {
            let marker = dir.path().join(format!("started-{i}"));
            let body = serde_json::json!({"command": ["touch", marker.to_string_lossy()], "gpus_per_node": 1});
            let sent = Instant::now();
            let r = client.post(format!("http://{addr}/v1/jobs")).json(&body).send().await?;
            anyhow::ensure!(r.status().is_success(), "submit answered {}", r.status());
            while !marker.exists() {
                anyhow::ensure!(sent.elapsed() < Duration::from_secs(30), "job {i} did not start within 30 s");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            latencies.push(sent.elapsed());
            // Let it finish so the next one finds the node idle.
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        latencies.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!("submit-to-start on an idle node ({} jobs, agent syncs every 500 ms)", args.starts);
        println!(
            "  median {:.0} ms, p95 {:.0} ms, slowest {:.0} ms",
            ms(latencies[latencies.len() / 2]),
            ms(latencies[(latencies.len() * 95 / 100).min(latencies.len() - 1)]),
            ms(latencies[latencies.len() - 1])
        );
        let _ = agent_stop.send(());
        agent.join().await?;
        let _ = stop.send(());
        server.await??;
        Ok(())
    })
}

/// CPU seconds used so far by this process's threads whose name starts with `prefix`.
fn thread_cpu_seconds(prefixes: &[&str]) -> f64 {
    let ticks_per_s = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = &stat[open + 1..close];
        if !prefixes.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        // After the name: state is field 3, utime field 14, stime field 15 (1-based).
        let utime = fields
            .get(11)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let stime = fields
            .get(12)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        total += utime + stime;
    }
    total as f64 / ticks_per_s
}

fn ingest(args: IngestArgs) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("perch-bench-")
        .tempdir_in(&args.dir)
        .context("creating the data directory")?;
    let mut config = perch_server::ServerConfig::new(perch_query::StoreConfig::new(dir.path()));
    config.store.flush_interval = Duration::from_secs(10);
    let state = perch_server::AppState::open(config)?;
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server =
        std::thread::Builder::new()
            .name("perch-srv".into())
            .spawn(move || -> Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .thread_name("perch-srv")
                    .build()?;
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(std_listener)?;
                    perch_server::serve(listener, state, async move {
                        let _ = stop_rx.await;
                    })
                    .await?;
                    Ok(())
                })
            })?;

    let now_ms = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    let per_batch_values = u64::from(args.rounds * args.gpus) * VALUES_PER_GPU_SAMPLE;
    // Every client sends the same samples under its own node name and a rising seq; the body
    // is split around the seq so sending costs the client one small format per request.
    let mut templates = Vec::new();
    for c in 0..args.clients {
        let node = format!("bench-{c:03}");
        let json = serde_json::to_string(&sample_batch(&node, 0, args.rounds, args.gpus, now_ms)?)?;
        let marker = "\"seq\":0,";
        let at = json.find(marker).context("seq in the encoded batch")?;
        templates.push((json[..at + 6].to_owned(), json[at + 7..].to_owned()));
    }
    let body_bytes = templates.first().map_or(0, |(a, b)| a.len() + b.len() + 8);

    let acked = Arc::new(AtomicU64::new(0));
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("bench-client")
        .build()?;
    let url = format!("http://{addr}/v1/ingest");
    let deadline = Instant::now() + Duration::from_secs(args.seconds + 1);
    let mut handles = Vec::new();
    for (head, tail) in templates {
        let (acked, url) = (acked.clone(), url.clone());
        handles.push(client_rt.spawn(async move {
            let client = reqwest::Client::new();
            let mut seq = 1u64;
            while Instant::now() < deadline {
                let body = format!("{head}{seq}{tail}");
                let response = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await?;
                anyhow::ensure!(
                    response.status().is_success(),
                    "ingest answered {}",
                    response.status()
                );
                acked.fetch_add(1, Ordering::Relaxed);
                seq += 1;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    let server_threads = ["perch-srv", "perch-wal"];
    std::thread::sleep(Duration::from_secs(1));
    let (b0, c0, t0) = (
        acked.load(Ordering::Relaxed),
        thread_cpu_seconds(&server_threads),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(args.seconds));
    let (b1, c1, elapsed) = (
        acked.load(Ordering::Relaxed),
        thread_cpu_seconds(&server_threads),
        t0.elapsed(),
    );
    for h in handles {
        client_rt.block_on(h)??;
    }
    let _ = stop_tx.send(());
    server
        .join()
        .map_err(|_| anyhow::anyhow!("server thread panicked"))??;

    let batches = b1 - b0;
    let values = batches * per_batch_values;
    let wall = elapsed.as_secs_f64();
    let cpu = (c1 - c0).max(0.01);
    println!(
        "ingest over HTTP into durable storage ({} clients, {} samples x {} values per batch, {} KiB JSON per batch)",
        args.clients,
        args.rounds * args.gpus,
        VALUES_PER_GPU_SAMPLE,
        body_bytes / 1024
    );
    println!(
        "  batches acknowledged     {batches} in {wall:.1} s ({:.0}/s)",
        batches as f64 / wall
    );
    println!("  values per second (wall) {:.0}", values as f64 / wall);
    println!(
        "  server CPU               {cpu:.2} s of {wall:.1} s ({:.0}% of one core)",
        100.0 * cpu / wall
    );
    println!(
        "  values per server CPU-s  {:.0}   <- throughput per core",
        values as f64 / cpu
    );

    // arrow-rs straight to Parquet, same batches, one thread.
    let batch = sample_batch("bench-000", 1, args.rounds, args.gpus, now_ms)?;
    let rounds = 200u64;
    let started = Instant::now();
    let mut bytes = 0usize;
    for _ in 0..rounds {
        let parts = perch_query::schema::to_record_batches(&batch)?;
        for (table, rb) in parts {
            let mut out = Vec::new();
            let props = parquet::file::properties::WriterProperties::builder()
                .set_compression(parquet::basic::Compression::ZSTD(
                    parquet::basic::ZstdLevel::try_new(3)?,
                ))
                .build();
            let mut writer =
                parquet::arrow::ArrowWriter::try_new(&mut out, table.schema(), Some(props))?;
            writer.write(&rb)?;
            writer.close()?;
            bytes += out.len();
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let direct = (rounds * per_batch_values) as f64 / secs;
    println!(
        "arrow-rs encoding the same batches straight to Parquet (zstd, one thread, in memory)"
    );
    println!(
        "  values per second        {direct:.0} ({} KiB of Parquet per batch)",
        bytes / rounds as usize / 1024
    );
    println!(
        "  perch per core / arrow-rs direct = {:.2}",
        values as f64 / cpu / direct
    );
    Ok(())
}
