//! `perch bench ingest`: ingest throughput over HTTP into durable storage.
//!
//! The benchmark drives the real server over HTTP on loopback: client tasks post telemetry
//! batches as fast as they are acknowledged (each acknowledgement means fsynced in the
//! write-ahead log and visible to SQL). The server runs on a single-threaded runtime; its CPU
//! time (HTTP, parsing, validation, Arrow conversion, log writer, flushes) is read from
//! `/proc/self/task/*/stat`, so "values per server CPU second" is throughput per core however
//! many cores the machine has. For comparison it also times arrow-rs encoding the same
//! batches straight to Parquet on one thread.

use super::sample_batch;
use anyhow::{Context, Result};
use clap::Args;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub(super) struct IngestArgs {
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
    /// Serve over TLS (a certificate from a throwaway CA the clients trust), as with
    /// server.tls_cert: its cost is in the server's CPU time.
    #[arg(long)]
    tls: bool,
    /// Run the server with its job store on this PostgreSQL database (a connection string),
    /// as a leader with a standby runs (docs/ha.md); the embedded store when left out.
    #[arg(long)]
    postgres: Option<String>,
}

/// A throwaway CA and a certificate for 127.0.0.1 it signed, written to `dir`; returns the
/// server's files and the CA's PEM.
fn throwaway_tls(dir: &std::path::Path) -> Result<(perch_server::tls::TlsFiles, String)> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "perch bench CA");
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &issuer)?;
    let files = perch_server::tls::TlsFiles {
        cert: dir.join("bench-server.pem"),
        key: dir.join("bench-server.key"),
    };
    std::fs::write(&files.cert, cert.pem())?;
    std::fs::write(&files.key, key.serialize_pem())?;
    Ok((files, ca_cert.pem()))
}

/// Measured values carried by each GPU sample the benchmark sends (utilization x2, memory x2,
/// power, energy, temperature, two clocks).
const VALUES_PER_GPU_SAMPLE: u64 = 9;

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

pub(super) fn ingest(args: IngestArgs) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("perch-bench-")
        .tempdir_in(&args.dir)
        .context("creating the data directory")?;
    let mut config = perch_server::ServerConfig::new(perch_query::StoreConfig::new(dir.path()));
    config.store.flush_interval = Duration::from_secs(10);
    let ca = if args.tls {
        let (files, ca) = throwaway_tls(dir.path())?;
        config.tls =
            Some(perch_server::tls::Certificates::load(files).map_err(anyhow::Error::msg)?);
        Some(reqwest::Certificate::from_pem(ca.as_bytes())?)
    } else {
        None
    };
    let job_store = match &args.postgres {
        Some(url) => Some(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(super::postgres_store(url))?,
        ),
        None => None,
    };
    println!(
        "job store: {}",
        if job_store.is_some() {
            "PostgreSQL"
        } else {
            "the embedded redb"
        }
    );
    let state = perch_server::AppState::open_with(config, job_store)?;
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
    let scheme = if ca.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{addr}/v1/ingest");
    let deadline = Instant::now() + Duration::from_secs(args.seconds + 1);
    let mut handles = Vec::new();
    perch_model::tls::use_ring();
    for (head, tail) in templates {
        let (acked, url) = (acked.clone(), url.clone());
        let client = match &ca {
            Some(ca) => reqwest::Client::builder()
                .add_root_certificate(ca.clone())
                .build()?,
            None => reqwest::Client::new(),
        };
        handles.push(client_rt.spawn(async move {
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
        "ingest over {} into durable storage ({} clients, {} samples x {} values per batch, {} KiB JSON per batch)",
        if args.tls { "HTTPS (TLS 1.3)" } else { "HTTP" },
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
