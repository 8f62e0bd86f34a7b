//! `perch bench freshness`: how soon a sample an agent sends can be read with SQL.
//!
//! The real server runs in-process and a real agent (`spawn_agent`, simulated GPUs, 1 s
//! interval) sends to it through a loopback relay that notes when each `POST /v1/ingest`
//! request starts to arrive: that is the send time, to the accuracy of a loopback hop. A
//! client polls `SELECT max(time) FROM gpu_samples WHERE node = ...` over `POST /v1/sql`
//! every few milliseconds; when the answer moves to a new round's time, that round is
//! visible. Each round gives two figures: from the sample's own time (when it was taken) to
//! visible, and from its send to visible. The server's flusher runs as usual, so rounds that
//! arrive during a flush count too.

use super::start_server;
use anyhow::{Context, Result};
use arrow::array::{Array, AsArray};
use arrow::datatypes::TimestampMillisecondType;
use clap::Args;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Args)]
pub(super) struct FreshnessArgs {
    /// Rounds to measure (the agent sends one a second).
    #[arg(long, default_value_t = 120)]
    rounds: u32,
    /// Simulated GPUs on the node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Milliseconds between two SQL polls.
    #[arg(long, default_value_t = 10)]
    poll_ms: u64,
    /// Directory to put the temporary data directory in.
    #[arg(long, default_value = ".")]
    dir: std::path::PathBuf,
}

const NODE: &str = "fresh-node";
/// What the target says: a sample is visible to SQL at most this long after it is sent.
const TARGET_MS: f64 = 2000.0;

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// Relays loopback connections to `server`, noting the time each ingest request starts.
async fn relay(server: SocketAddr, sends: Arc<Mutex<Vec<i64>>>) -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let sends = sends.clone();
            tokio::spawn(async move {
                let Ok(upstream) = TcpStream::connect(server).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = upstream.into_split();
                let up = async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = from_client.read(&mut buf).await?;
                        if n == 0 {
                            return to_server.shutdown().await;
                        }
                        // HTTP/1.1 without pipelining: a request's first bytes start a read.
                        if buf[..n].starts_with(b"POST /v1/ingest") {
                            sends
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push(now_us());
                        }
                        to_server.write_all(&buf[..n]).await?;
                    }
                };
                let down = tokio::io::copy(&mut from_server, &mut to_client);
                let _ = tokio::join!(up, down);
            });
        }
    });
    Ok(addr)
}

/// The newest sample time of the node, through `POST /v1/sql` (Arrow IPC answer).
async fn newest_ms(client: &reqwest::Client, addr: SocketAddr) -> Result<Option<i64>> {
    let sql = format!("SELECT max(time) FROM gpu_samples WHERE node = '{NODE}'");
    let response = client
        .post(format!("http://{addr}/v1/sql?format=arrow"))
        .header("content-type", "application/sql")
        .body(sql)
        .send()
        .await?;
    anyhow::ensure!(
        response.status().is_success(),
        "SQL answered {}",
        response.status()
    );
    let body = response.bytes().await?;
    let reader = arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None)?;
    for batch in reader {
        let batch = batch?;
        if batch.num_rows() > 0 && batch.num_columns() > 0 {
            let column = batch.column(0);
            let times = column
                .as_primitive_opt::<TimestampMillisecondType>()
                .context("max(time) did not come back as a millisecond timestamp")?;
            return Ok((!times.is_null(0)).then(|| times.value(0)));
        }
    }
    Ok(None)
}

pub(super) fn freshness(args: FreshnessArgs) -> Result<()> {
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let dir = tempfile::Builder::new().prefix("perch-bench-").tempdir_in(&args.dir)?;
        let (addr, stop, server) = start_server(dir.path()).await?;
        let sends = Arc::new(Mutex::new(Vec::new()));
        let relay_addr = relay(addr, sends.clone()).await?;
        let node = perch_model::NodeId::new(NODE).map_err(anyhow::Error::msg)?;
        let mut agent = perch_collector::AgentConfig::new(format!("http://{relay_addr}"), node);
        agent.simulate_gpus = args.gpus;
        agent.nvml = perch_collector::NvmlMode::Off;
        agent.run_jobs = false;
        agent.interval = Duration::from_secs(1);
        agent.data_dir = dir.path().join("agent");
        let (agent_stop, agent_stopped) = tokio::sync::oneshot::channel::<()>();
        let agent = perch_collector::spawn_agent(agent, async move {
            let _ = agent_stopped.await;
        });

        perch_model::tls::use_ring();
        let client = reqwest::Client::new();
        let poll = Duration::from_millis(args.poll_ms.max(1));
        let deadline = tokio::time::Instant::now()
            + Duration::from_secs(u64::from(args.rounds) * 2 + 30);
        let mut last: Option<i64> = None;
        let mut from_sample = Vec::new();
        let mut from_send = Vec::new();
        // The first round seen includes the agent's start-up; it is not counted.
        let mut first = true;
        while from_sample.len() < args.rounds as usize {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "only {} of {} rounds became visible in time; is the agent sending?",
                from_sample.len(),
                args.rounds
            );
            let newest = newest_ms(&client, addr).await?;
            let visible_us = now_us();
            if let Some(t) = newest
                && last.is_none_or(|l| t > l)
            {
                last = Some(t);
                if first {
                    first = false;
                } else {
                    let sample_us = t * 1000;
                    from_sample.push((visible_us - sample_us) as f64 / 1000.0);
                    // The request that carried it: the first one started after it was taken
                    // (sample times are whole milliseconds, rounded down, so never late).
                    let sent = sends
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .iter()
                        .copied()
                        .find(|&s| s >= sample_us && s <= visible_us);
                    if let Some(s) = sent {
                        from_send.push((visible_us - s) as f64 / 1000.0);
                    }
                }
            }
            tokio::time::sleep(poll).await;
        }
        let _ = agent_stop.send(());
        agent.join().await?;
        let _ = stop.send(());
        server.await??;

        println!(
            "freshness: a real agent ({} simulated GPUs, 1 s interval) -> in-process server; SQL polled every {} ms over POST /v1/sql; {} rounds",
            args.gpus, args.poll_ms, args.rounds
        );
        println!("  {}", summary("sample taken -> visible to SQL", &mut from_sample));
        println!("  {}", summary("request sent -> visible to SQL", &mut from_send));
        let worst = from_sample.iter().copied().fold(0.0, f64::max);
        println!(
            "  target: visible at most {TARGET_MS:.0} ms after sending: {}",
            if worst <= TARGET_MS { "met" } else { "missed" }
        );
        Ok(())
    })
}

fn summary(what: &str, values: &mut [f64]) -> String {
    if values.is_empty() {
        return format!("{what:<32} no rounds matched");
    }
    values.sort_by(f64::total_cmp);
    let at =
        |q: f64| values[((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1];
    format!(
        "{what:<32} median {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} rounds)",
        at(0.5),
        at(0.99),
        values[values.len() - 1],
        values.len()
    )
}
