//! `perch bench ingest`: ingest throughput over HTTP into durable storage.
//!
//! The benchmark drives the real server over HTTP on loopback: client tasks post telemetry
//! batches as fast as they are acknowledged (each acknowledgement means fsynced in the
//! write-ahead log and visible to SQL). The server runs on a single-threaded runtime; its CPU
//! time (HTTP, parsing, validation, Arrow conversion, log writer, flushes) is read from
//! `/proc/self/task/*/stat`, so "values per server CPU second" is throughput per core however
//! many cores the machine has. For comparison it also times arrow-rs encoding the same
//! batches straight to Parquet on one thread.
//!
//! The bodies are JSON, MessagePack (the agent's binary encoding, `perch_model::wire`), or both:
//! by default the clients alternate between the two in phases against the same server, so the
//! two figures come from one run, and a verdict line compares the binary figure with the target
//! of 3 M values per server CPU-second. It also times what the agent spends encoding one
//! sampling round in each (its `encode_as`, compression included).

use super::sample_batch;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use perch_model::wire::Encoding;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Which encodings the clients send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Json,
    /// MessagePack, the agent's binary encoding.
    Binary,
    /// Both, alternating in phases against the same server.
    Both,
}

/// The binary encoding's target: values per server CPU-second (issue 60).
const BINARY_TARGET: f64 = 3e6;

#[derive(Debug, Args)]
pub(super) struct IngestArgs {
    /// Seconds to measure each encoding (after one second of warm-up); with both, each one's
    /// time is split over `--alternations` phases.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// What the clients send: JSON, MessagePack (binary), or both alternating.
    #[arg(long, value_enum, default_value_t = Format::Both)]
    format: Format,
    /// With `--format both`: how many times each encoding takes its turn.
    #[arg(long, default_value_t = 2)]
    alternations: u32,
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
    // Every client sends the same samples under its own node name and a rising seq, in either
    // encoding: one sequence for both, so the server deduplicates across them. Each body is a
    // template with the seq spliced in, so sending costs the client a copy per request.
    let mut templates = Vec::new();
    for c in 0..args.clients {
        let node = format!("bench-{c:03}");
        templates.push(Templates::new(&sample_batch(
            &node,
            0,
            args.rounds,
            args.gpus,
            now_ms,
        )?)?);
    }
    let body_bytes = |e: Encoding| templates.first().map_or(0, |t| t.body(e, FIRST_SEQ).len());
    let (json_bytes, msgpack_bytes) = (body_bytes(Encoding::Json), body_bytes(Encoding::Msgpack));
    let phases: Vec<Encoding> = match args.format {
        Format::Json => vec![Encoding::Json],
        Format::Binary => vec![Encoding::Msgpack],
        Format::Both => (0..args.alternations.max(1))
            .flat_map(|_| [Encoding::Json, Encoding::Msgpack])
            .collect(),
    };
    // Each encoding is measured `seconds` in all, over its turns.
    let turns = phases.len() / if args.format == Format::Both { 2 } else { 1 };
    let per_phase = Duration::from_secs_f64(args.seconds / turns as f64);
    let current = Arc::new(AtomicU8::new(encoding_id(phases[0])));

    // Acknowledged batches per encoding.
    let acked = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("bench-client")
        .build()?;
    let scheme = if ca.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{addr}/v1/ingest");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut handles = Vec::new();
    perch_model::tls::use_ring();
    for template in templates {
        let (acked, url, current, stop) =
            (acked.clone(), url.clone(), current.clone(), stop.clone());
        let client = match &ca {
            Some(ca) => reqwest::Client::builder()
                .add_root_certificate(ca.clone())
                .build()?,
            None => reqwest::Client::new(),
        };
        handles.push(client_rt.spawn(async move {
            let mut seq = FIRST_SEQ;
            while !stop.load(Ordering::Relaxed) {
                let encoding = encoding_of(current.load(Ordering::Relaxed));
                let response = client
                    .post(&url)
                    .header("content-type", encoding.media_type())
                    .body(template.body(encoding, seq))
                    .send()
                    .await?;
                anyhow::ensure!(
                    response.status().is_success(),
                    "ingest of {} answered {}",
                    encoding.name(),
                    response.status()
                );
                acked[usize::from(encoding_id(encoding))].fetch_add(1, Ordering::Relaxed);
                seq += 1;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    let server_threads = ["perch-srv", "perch-wal"];
    std::thread::sleep(Duration::from_secs(1));
    // Per encoding: batches, wall seconds, server CPU seconds.
    let mut measured = [(0u64, 0f64, 0f64); 2];
    for (i, &encoding) in phases.iter().enumerate() {
        let id = encoding_id(encoding);
        if i > 0 && phases[i - 1] != encoding {
            // Requests of the last phase still in flight finish before this one is measured.
            current.store(id, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(200));
        }
        let counter = &acked[usize::from(id)];
        let (b0, c0, t0) = (
            counter.load(Ordering::Relaxed),
            thread_cpu_seconds(&server_threads),
            Instant::now(),
        );
        std::thread::sleep(per_phase);
        let m = &mut measured[usize::from(id)];
        m.0 += counter.load(Ordering::Relaxed) - b0;
        m.1 += t0.elapsed().as_secs_f64();
        m.2 += thread_cpu_seconds(&server_threads) - c0;
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        client_rt.block_on(h)??;
    }
    let _ = stop_tx.send(());
    server
        .join()
        .map_err(|_| anyhow::anyhow!("server thread panicked"))??;

    println!(
        "ingest over {} into durable storage ({} clients, {} samples x {} values per batch, {} KiB JSON or {} KiB MessagePack per batch, uncompressed)",
        if args.tls { "HTTPS (TLS 1.3)" } else { "HTTP" },
        args.clients,
        args.rounds * args.gpus,
        VALUES_PER_GPU_SAMPLE,
        json_bytes / 1024,
        msgpack_bytes / 1024,
    );
    if phases.len() > 1 {
        println!(
            "  alternating JSON and MessagePack, {} phases of {:.1} s each",
            phases.len(),
            per_phase.as_secs_f64()
        );
    }
    let mut per_cpu = [None, None];
    for encoding in [Encoding::Json, Encoding::Msgpack] {
        let id = usize::from(encoding_id(encoding));
        if !phases.contains(&encoding) {
            continue;
        }
        let (batches, wall, cpu) = measured[id];
        let values = batches * per_batch_values;
        let cpu = cpu.max(0.01);
        println!("{} ({})", encoding.name(), encoding.media_type());
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
        per_cpu[id] = Some(values as f64 / cpu);
    }
    if let Some(binary) = per_cpu[usize::from(encoding_id(Encoding::Msgpack))] {
        let against_json = per_cpu[usize::from(encoding_id(Encoding::Json))]
            .map(|json| format!(", {:.2}x JSON's {:.2} M", binary / json, json / 1e6))
            .unwrap_or_default();
        println!(
            "verdict: binary ingest {:.2} M values per server CPU-s{against_json}: {} the target of {:.0} M",
            binary / 1e6,
            if binary >= BINARY_TARGET {
                "meets"
            } else {
                "below"
            },
            BINARY_TARGET / 1e6
        );
    }
    agent_encoding(&sample_batch("bench-000", 1, 1, args.gpus, now_ms)?)?;

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
    for encoding in [Encoding::Json, Encoding::Msgpack] {
        if let Some(per_cpu) = per_cpu[usize::from(encoding_id(encoding))] {
            println!(
                "  perch per core ({}) / arrow-rs direct = {:.2}",
                encoding.name(),
                per_cpu / direct
            );
        }
    }
    Ok(())
}

/// The first seq every client sends: from 2^32 up, MessagePack writes a seq in 9 bytes, so a
/// template's seq is replaced in place.
const FIRST_SEQ: u64 = 1 << 32;

fn encoding_id(e: Encoding) -> u8 {
    match e {
        Encoding::Json => 0,
        Encoding::Msgpack => 1,
    }
}

fn encoding_of(id: u8) -> Encoding {
    if id == 0 {
        Encoding::Json
    } else {
        Encoding::Msgpack
    }
}

/// One client's batch in both encodings, with the place of its seq.
struct Templates {
    /// The JSON before and after the seq's digits.
    json: (String, String),
    /// The MessagePack, and where the seq's 8 big-endian bytes start.
    msgpack: (Vec<u8>, usize),
}

impl Templates {
    fn new(batch: &perch_model::Batch) -> Result<Templates> {
        const MARK: u64 = 0x5eed_5eed_5eed_5eed;
        let mut marked = batch.clone();
        marked.seq = MARK;
        let json = String::from_utf8(Encoding::Json.encode(&marked).map_err(anyhow::Error::msg)?)?;
        let digits = MARK.to_string();
        let at = json.find(&digits).context("seq in the JSON batch")?;
        let msgpack = Encoding::Msgpack
            .encode(&marked)
            .map_err(anyhow::Error::msg)?;
        let mut mark = vec![0xcf];
        mark.extend_from_slice(&MARK.to_be_bytes());
        let place = msgpack
            .windows(mark.len())
            .position(|w| w == mark)
            .context("seq in the MessagePack batch")?;
        Ok(Templates {
            json: (json[..at].to_owned(), json[at + digits.len()..].to_owned()),
            msgpack: (msgpack, place + 1),
        })
    }

    /// The body of batch `seq` (at least [`FIRST_SEQ`]).
    fn body(&self, encoding: Encoding, seq: u64) -> Vec<u8> {
        match encoding {
            Encoding::Json => format!("{}{seq}{}", self.json.0, self.json.1).into_bytes(),
            Encoding::Msgpack => {
                let (template, at) = &self.msgpack;
                let mut body = template.clone();
                body[*at..*at + 8].copy_from_slice(&seq.to_be_bytes());
                body
            }
        }
    }
}

/// What the agent spends encoding one sampling round (`batch`) for sending, in each encoding:
/// `perch_collector::sender::encode_as`, serialization and zstd.
fn agent_encoding(batch: &perch_model::Batch) -> Result<()> {
    let rounds = 2000u32;
    let mut figures = Vec::new();
    for encoding in [Encoding::Json, Encoding::Msgpack] {
        let mut bytes = 0usize;
        let started = Instant::now();
        for _ in 0..rounds {
            bytes = perch_collector::sender::encode_as(encoding, batch)?.len();
        }
        let us = started.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
        figures.push(us);
        println!(
            "agent encoding one round of {} GPU samples as {:<8} {us:.1} us ({bytes} bytes after zstd)",
            batch.gpus.len(),
            encoding.name()
        );
    }
    println!(
        "  agent encoding msgpack / json = {:.2}",
        figures[1] / figures[0]
    );
    Ok(())
}
