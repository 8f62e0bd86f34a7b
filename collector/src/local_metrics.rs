//! The agent's optional node-local `/metrics`, for sites that scrape nodes directly: the latest
//! round (GPUs, host, NICs, InfiniBand ports, jobs) and the agent's own counters in the
//! Prometheus text format 0.0.4: every catalogued column (`perch_model::catalogue`) under the
//! same name, labels and value as the server's `/metrics` (docs/metrics.md), so dashboards work
//! against either.
//!
//! A deliberately small HTTP/1.1 responder on a caller-bound tokio listener: one request per
//! connection, `GET /metrics` or 404. It pulls in no web framework, keeping the agent small.

use crate::agent::AgentCounters;
use crate::sampler::Round;
use perch_model::catalogue::{self, Column};
use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Accumulates families in order; each family's `# HELP`/`# TYPE` is written once.
#[derive(Default)]
struct Text {
    out: String,
    seen: std::collections::HashSet<&'static str>,
}

impl Text {
    fn add(
        &mut self,
        name: &'static str,
        kind: &str,
        help: &str,
        labels: &[(&str, &str)],
        v: Option<f64>,
    ) {
        let Some(v) = v else {
            return;
        };
        if self.seen.insert(name) {
            let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        }
        let l: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect();
        let _ = writeln!(self.out, "{name}{{{}}} {v}", l.join(","));
    }

    /// Every exported column of `columns` for one row, as the server's `/metrics` writes it
    /// (same names, labels and values; see `perch_model::catalogue`).
    fn catalogued<R>(&mut self, columns: &[Column<R>], row: &R, labels: &[(&str, &str)]) {
        for column in columns {
            let Some(series) = &column.series else {
                continue;
            };
            let mut all = labels.to_vec();
            all.extend_from_slice(series.labels);
            self.add(
                series.name,
                series.kind.as_str(),
                series.help,
                &all,
                series.value(column, row),
            );
        }
    }
}

fn flag(b: bool) -> &'static str {
    if b { "true" } else { "false" }
}

/// Renders the latest round of `node` and the agent counters.
pub fn render(node: &str, round: Option<&Round>, counters: &AgentCounters) -> String {
    let mut t = Text::default();
    let c = |a: &std::sync::atomic::AtomicU64| Some(a.load(Relaxed) as f64);
    let nl = [("node", node)];
    t.add(
        "perch_agent_rounds_total",
        "counter",
        "Sampling rounds taken",
        &nl,
        c(&counters.rounds_sampled),
    );
    t.add(
        "perch_agent_batches_sent_total",
        "counter",
        "Batches the server acknowledged",
        &nl,
        c(&counters.batches_sent),
    );
    t.add(
        "perch_agent_batches_dropped_total",
        "counter",
        "Batches dropped (queue or spool bound, or shutdown)",
        &nl,
        c(&counters.batches_dropped),
    );
    t.add(
        "perch_agent_send_errors_total",
        "counter",
        "Failed delivery attempts",
        &nl,
        c(&counters.send_errors),
    );
    t.add(
        "perch_agent_spool_bytes",
        "gauge",
        "Bytes in the disk spool",
        &nl,
        c(&counters.spool_bytes),
    );
    let Some(r) = round else {
        return t.out;
    };
    for g in &r.gpus {
        let gpu = g.gpu.to_string();
        let l = [
            ("node", node),
            ("gpu", gpu.as_str()),
            ("simulated", flag(g.simulated)),
        ];
        t.catalogued(catalogue::GPU, g, &l);
    }
    for h in &r.hosts {
        let l = [("node", node), ("simulated", flag(h.simulated))];
        t.catalogued(catalogue::HOST, h, &l);
    }
    for x in &r.nics {
        let l = [
            ("node", node),
            ("device", x.device.as_str()),
            ("simulated", flag(x.simulated)),
        ];
        t.catalogued(catalogue::NIC, x, &l);
    }
    for p in &r.ib_ports {
        let port = p.port.to_string();
        let l = [
            ("node", node),
            ("device", p.device.as_str()),
            ("port", port.as_str()),
            ("simulated", flag(p.simulated)),
        ];
        t.catalogued(catalogue::IB_PORT, p, &l);
    }
    for j in &r.jobs {
        let l = [
            ("node", node),
            ("job_id", j.job.as_str()),
            ("simulated", flag(j.simulated)),
        ];
        t.catalogued(catalogue::JOB, j, &l);
    }
    t.out
}

/// Connections served at once; more are closed at once. The agent runs as root and launches
/// jobs: a user who opens connections and sends nothing must not be able to pile up its
/// tasks and file descriptors.
const MAX_CONNECTIONS: usize = 64;

/// How long a client has to send its request line and headers, and to take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Serves `GET /metrics` on `listener` until `shutdown` completes. `node` labels the series;
/// `counters` are the running agent's ([`crate::AgentHandle::counters`]), whose latest round
/// the agent keeps up to date. At most [`MAX_CONNECTIONS`] at once, each given
/// [`IO_TIMEOUT`] to send its request and again to take the answer.
pub async fn serve_metrics(
    listener: TcpListener,
    node: String,
    counters: Arc<AgentCounters>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    tokio::pin!(shutdown);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, _) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            accepted = listener.accept() => accepted?,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let node = node.clone();
        let counters = counters.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _ = answer(stream, &node, &counters).await;
        });
    }
}

/// Reads one request head (within [`IO_TIMEOUT`], at most 4 KiB) and answers it.
async fn answer(
    mut stream: TcpStream,
    node: &str,
    counters: &AgentCounters,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 4096 {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        std::io::Result::Ok(())
    };
    match tokio::time::timeout(IO_TIMEOUT, read).await {
        Ok(result) => result?,
        Err(_) => return Ok(()),
    }
    let request = String::from_utf8_lossy(&head);
    let path = request.split_ascii_whitespace().nth(1).unwrap_or("");
    let (status, body) = if request.starts_with("GET ") && path == "/metrics" {
        let round = counters.latest_round();
        ("200 OK", render(node, round.as_ref(), counters))
    } else {
        (
            "404 Not Found",
            "only GET /metrics is served here\n".to_string(),
        )
    };
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(IO_TIMEOUT, write)
        .await
        .unwrap_or(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_model::{GpuIndex, GpuSample};

    #[tokio::test]
    async fn serves_the_latest_round_and_counters() {
        let counters = Arc::new(AgentCounters::default());
        counters.rounds_sampled.store(7, Relaxed);
        counters.set_latest_round(Round {
            gpus: vec![GpuSample {
                gpu: GpuIndex(2),
                utilization_gpu_pct: Some(50.0),
                xid_errors_total: Some(3),
                ..GpuSample::default()
            }],
            ..Round::default()
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_metrics(listener, "n1".into(), counters, async {
            let _ = stopped.await;
        }));
        perch_model::tls::use_ring();
        let body = reqwest::get(format!("{url}/metrics"))
            .await
            .expect("GET")
            .text()
            .await
            .expect("body");
        for line in [
            "perch_agent_rounds_total{node=\"n1\"} 7",
            "perch_gpu_utilization_ratio{node=\"n1\",gpu=\"2\",simulated=\"false\"} 0.5",
            "perch_gpu_xid_errors_total{node=\"n1\",gpu=\"2\",simulated=\"false\"} 3",
            "# TYPE perch_gpu_xid_errors_total counter",
        ] {
            assert!(
                body.lines().any(|l| l == line),
                "{line:?} missing from\n{body}"
            );
        }
        assert!(
            !body.contains("perch_gpu_power_watts"),
            "absent values are not exported"
        );
        let server_names: Vec<&str> = catalogue::GPU
            .iter()
            .filter_map(|c| c.series.as_ref().map(|s| s.name))
            .collect();
        for line in body
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE perch_gpu_"))
        {
            let name = format!("perch_gpu_{}", line.split(' ').next().unwrap_or(""));
            assert!(
                server_names.contains(&name.as_str()),
                "{name} is not the server's name"
            );
        }
        perch_model::tls::use_ring();
        let missing = reqwest::get(format!("{url}/nope")).await.expect("GET");
        assert_eq!(missing.status().as_u16(), 404);
        // A careless or hostile user opens more connections than are served and sends
        // nothing, or a byte at a time: each is closed within the timeout, and a scrape after
        // them is answered.
        let addr = url.trim_start_matches("http://").to_owned();
        let mut trickle = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let started = std::time::Instant::now();
        let mut cut = false;
        for byte in b"GET /metrics HTTP/1.1\r\n" {
            if trickle.write_all(&[*byte]).await.is_err() {
                cut = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            if started.elapsed() > IO_TIMEOUT + Duration::from_secs(2) {
                break;
            }
        }
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(IO_TIMEOUT, trickle.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok(),
            "a connection sending a byte at a time is held open"
        );
        assert!(
            cut || rest.is_empty(),
            "a request sent a byte at a time was answered: {:?}",
            String::from_utf8_lossy(&rest)
        );
        assert!(started.elapsed() < IO_TIMEOUT + Duration::from_secs(3));
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS + 36 {
            idle.push(
                tokio::net::TcpStream::connect(&addr)
                    .await
                    .expect("connect"),
            );
        }
        // Beyond the cap a connection is closed at once, not left to wait for a slot.
        let mut beyond = idle.pop().expect("a connection");
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_millis(500), beyond.read(&mut byte)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "a connection beyond the cap was kept: {read:?}"
        );
        tokio::time::sleep(IO_TIMEOUT + Duration::from_millis(500)).await;
        perch_model::tls::use_ring();
        let body = reqwest::get(format!("{url}/metrics"))
            .await
            .expect("GET after the idle connections")
            .text()
            .await
            .expect("body");
        assert!(body.contains("perch_agent_rounds_total"));
        drop(idle);
        let _ = stop.send(());
        server.await.expect("join").expect("served");
    }
}
