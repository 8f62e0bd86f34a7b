//! The long-running commands: `server`, `agent`, `up` (both in one process) and `demo` (a
//! simulated cluster in one process). Each runs until Ctrl-C or SIGTERM, then shuts down in
//! order: agents deliver what they hold, then the server flushes its buffer to Parquet.

use crate::config::Config;
use anyhow::{Context, Result};
use perch_collector::{AgentHandle, NvmlMode, detect_gpus, spawn_agent};
use perch_server::AppState;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The long-running commands' runtime; they hand freed memory back as they run
/// ([`crate::memory`]).
fn runtime() -> Result<tokio::runtime::Runtime> {
    crate::memory::start_trimming();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Resolves on Ctrl-C or SIGTERM.
async fn terminate() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("shutting down");
}

fn stopped(rx: &watch::Receiver<bool>) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut rx = rx.clone();
    async move {
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

async fn bind(config: &Config) -> Result<(TcpListener, AppState)> {
    let listen = &config.server.listen;
    let listener = TcpListener::bind(listen).await.with_context(|| {
        format!("listening on {listen} (is another perch running? choose another with --listen)")
    })?;
    let state = AppState::open(config.server_config()?).with_context(|| {
        format!(
            "opening the data directory {}",
            config.server.data_dir.display()
        )
    })?;
    crate::telemetry::observe_server(&state);
    // The PostgreSQL listener writes its bound address once it listens (`up`'s banner waits
    // for it): one left by an earlier run must not be read as this one's.
    let pg_file = config.server.data_dir.join("pg.addr");
    match std::fs::remove_file(&pg_file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", pg_file.display()));
        }
        _ => {}
    }
    // Scripts and tests that listen on port 0 read the bound address from here.
    let addr_file = config.server.data_dir.join("server.addr");
    std::fs::write(&addr_file, format!("{}\n", listener.local_addr()?))
        .with_context(|| format!("writing {}", addr_file.display()))?;
    Ok((listener, state))
}

/// The address the PostgreSQL listener bound, from the `pg.addr` it writes in `data_dir` once
/// it listens; `None` when it has not within a few seconds (it could not bind, and logged why).
async fn pg_bound(data_dir: &std::path::Path) -> Option<std::net::SocketAddr> {
    let file = data_dir.join("pg.addr");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(10));
    while tokio::time::Instant::now() < deadline {
        tick.tick().await;
        if let Some(addr) = std::fs::read_to_string(&file)
            .ok()
            .filter(|s| s.ends_with('\n')) // written whole
            .and_then(|s| s.trim().parse().ok())
        {
            return Some(addr);
        }
    }
    None
}

pub fn server(config: Config) -> Result<()> {
    if config.ha.enabled() {
        return ha::server(config);
    }
    runtime()?.block_on(async {
        let (listener, state) = bind(&config).await?;
        tracing::info!(listen = %listener.local_addr()?, data_dir = %config.server.data_dir.display(), "perch server ready");
        perch_server::serve(listener, state, terminate()).await.context("serving HTTP")
    })
}

mod ha;

pub fn agent(config: Config) -> Result<()> {
    let agent_config = config.agent_config()?;
    runtime()?.block_on(async {
        tracing::info!(node = %agent_config.node, server = %agent_config.server, "perch agent starting");
        let counters = std::sync::Arc::new(perch_collector::AgentCounters::default());
        crate::telemetry::observe_agent(&agent_config.node, counters.clone());
        let local_metrics = match config.agent.metrics_listen.as_str() {
            "" => None,
            addr => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("agent.metrics_listen: binding {addr}"))?;
                tracing::info!(listen = %listener.local_addr()?, "node-local /metrics ready");
                Some(tokio::spawn(perch_collector::serve_metrics(
                    listener,
                    agent_config.node.to_string(),
                    counters.clone(),
                    std::future::pending(),
                )))
            }
        };
        let stats =
            perch_collector::agent::run_agent_with(agent_config, terminate(), counters).await;
        if let Some(task) = local_metrics {
            task.abort();
        }
        tracing::info!(?stats, "perch agent stopped");
        stats.map(drop).map_err(Into::into)
    })
}

async fn stop_all(
    agents: Vec<AgentHandle>,
    stop: watch::Sender<bool>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
) -> Result<()> {
    let _ = stop.send(true);
    for agent in agents {
        if let Err(e) = agent.join().await {
            tracing::warn!(error = %e, "agent stopped with an error");
        }
    }
    server.await.context("server task")?.context("serving HTTP")
}

/// GPUs `perch up` simulates when it finds none and none were asked for.
const UP_SIMULATED_GPUS: u32 = 4;

/// How long a starting `perch up` waits for a predecessor still stopping on its data directory.
const PREDECESSOR_WAIT: Duration = Duration::from_secs(60);

/// Waits until no other process holds `locks` (a `perch up` still stopping holds its store's
/// and its agent's for as long as its jobs' grace and its agent's last deliveries take),
/// saying so in the log; fails naming them after [`PREDECESSOR_WAIT`]. So a new `perch up`
/// never serves while its agent, refused the node's lock, has stopped.
async fn wait_for_predecessor(locks: &[PathBuf]) -> Result<()> {
    let started = std::time::Instant::now();
    let mut waiting = false;
    loop {
        let held: Vec<String> = locks
            .iter()
            .filter(|path| held_elsewhere(path))
            .map(|path| path.display().to_string())
            .collect();
        if held.is_empty() {
            if waiting {
                tracing::info!("the previous perch has let go of this data directory; starting");
            }
            return Ok(());
        }
        if started.elapsed() >= PREDECESSOR_WAIT {
            anyhow::bail!(
                "{} still locked after {} s: another perch uses this data directory (one still stopping its jobs, or a second perch up); stop it, or give this one its own --data-dir",
                held.join(" and "),
                PREDECESSOR_WAIT.as_secs()
            );
        }
        if !waiting {
            tracing::warn!(
                locks = %held.join(", "),
                "another perch holds this data directory (one still stopping?); waiting up to {} s for it to exit",
                PREDECESSOR_WAIT.as_secs()
            );
            waiting = true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether another open file holds the lock on `path` (a file that is not there is free).
fn held_elsewhere(path: &Path) -> bool {
    std::fs::File::open(path)
        .is_ok_and(|file| matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock)))
}

/// What the banners say about access to an open server (no tokens file).
fn open_access(addr: std::net::SocketAddr) -> String {
    let me = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .ok()
        .flatten()
        .map_or_else(|| "this server's user".to_owned(), |u| u.name);
    let operators = if me == "root" {
        "root is an operator".to_owned()
    } else {
        format!("root and {me} are operators")
    };
    format!(
        "open, no tokens: it listens on {addr} only and local callers are identified by their uid: {operators}, every other local user acts only as themselves; remote callers need a tokens file (server.tokens_file)"
    )
}

pub fn up(config: Config) -> Result<()> {
    let mut agent_config = config.agent_config()?;
    // Its server stops too: Ctrl-C ends the whole machine's perch, jobs included.
    agent_config.keep_jobs_on_exit = false;
    runtime()?.block_on(async {
        wait_for_predecessor(&[
            config.server.data_dir.join("LOCK"),
            agent_config
                .data_dir
                .join("jobs")
                .join(agent_config.node.as_str())
                .join("agent.lock"),
        ])
        .await?;
        let (listener, state) = bind(&config).await?;
        let addr = listener.local_addr()?;
        let (stop, stop_rx) = watch::channel(false);
        let server = tokio::spawn(perch_server::serve(listener, state, stopped(&stop_rx)));
        // With TLS the built-in agent speaks it too, trusting agent.ca_file (PERCH_CA_FILE),
        // else the server's own certificate file: a self-signed certificate, or a chain whose
        // issuer is in the file, works with no more settings.
        let scheme = if config.server.tls_cert.as_os_str().is_empty() {
            "http"
        } else {
            if agent_config.ca_file.is_none() {
                agent_config.ca_file = Some(config.server.tls_cert.clone());
            }
            "https"
        };
        agent_config.server = format!("{scheme}://{addr}");
        let detection = tokio::task::spawn_blocking({
            let nvml = agent_config.nvml.clone();
            move || detect_gpus(&nvml)
        })
        .await?;
        // With no GPU found and none asked for, `up` simulates some, so a first try shows
        // what perch does (README); a GPU node's agent (`perch agent`) never simulates unasked.
        let defaulted = detection.count == 0 && agent_config.simulate_gpus == 0;
        if defaulted {
            agent_config.simulate_gpus = UP_SIMULATED_GPUS;
        }
        let simulated = agent_config.simulate_gpus;
        let gpu_line = match (detection.count, simulated) {
            (0, n) if defaulted => format!("{}. Simulating {n} GPUs instead (--simulate-gpus N for another number): they are labelled simulated in every table, series and message.", detection.message),
            (0, n) => format!("{}. Simulating {n} GPUs: they are labelled simulated in every table, series and message.", detection.message),
            (_, 0) => detection.message.clone(),
            (_, n) => format!("{}, plus {n} SIMULATED GPUs (labelled simulated everywhere).", detection.message),
        };
        let counters = std::sync::Arc::new(perch_collector::AgentCounters::default());
        crate::telemetry::observe_agent(&agent_config.node, counters.clone());
        let mut agent = tokio::spawn(perch_collector::agent::run_agent_with(
            agent_config.clone(),
            stopped(&stop_rx),
            counters,
        ));
        let access = if config.server.tokens_file.as_os_str().is_empty() {
            open_access(addr)
        } else {
            "bearer tokens required (PERCH_TOKEN)".to_owned()
        };
        // The address the PostgreSQL listener bound (port 0 is a free port), not the setting.
        let pg_addr = if config.server.pg_listen.is_empty() {
            None
        } else {
            pg_bound(&config.server.data_dir).await
        };
        let psql = match pg_addr {
            Some(pg) => {
                // With tokens, the PostgreSQL listener takes one as the password.
                let password = if config.server.tokens_file.as_os_str().is_empty() {
                    ""
                } else {
                    "PGPASSWORD=<your token> "
                };
                let (host, port) = (pg.ip(), pg.port());
                format!("{password}psql -h {host} -p {port} -U perch -c \"SELECT count(*) FROM gpu_samples\"")
            }
            None if config.server.pg_listen.is_empty() => {
                "off (server.pg_listen is empty)".to_owned()
            }
            None => format!(
                "off: {} could not be bound (the log above says why; set server.pg_listen to another address)",
                config.server.pg_listen
            ),
        };
        // Jobs never run as root: root's banner names the user a job runs as.
        let submit_as = if nix::unistd::geteuid().is_root() {
            " --user NAME"
        } else {
            ""
        };
        let grafana_sql = match pg_addr {
            Some(pg) => format!("; SQL: a PostgreSQL data source at {pg}"),
            None => String::new(),
        };
        println!(
            "perch is up: server and local agent in one process.\n\
             \x20 node:       {node}\n\
             \x20 GPUs:       {gpu_line}\n\
             \x20 server:     http://{addr}  ({access})\n\
             \x20 web view:   http://{addr}/  (open it in a browser)\n\
             \x20 jobs:       perch submit --server http://{addr}{submit_as} --gpus 1 -- sh -c 'echo $CUDA_VISIBLE_DEVICES'; perch jobs --all\n\
             \x20 psql:       {psql}\n\
             \x20 data:       {data}\n\
             \x20 query:      perch sql --server http://{addr} \"SELECT node, gpu, simulated, count(*) AS samples, avg(utilization_gpu_pct) AS util FROM gpu_samples GROUP BY 1, 2, 3\"\n\
             \x20 metrics:    curl -s http://{addr}/metrics\n\
             \x20 dashboards: dashboards/ (Grafana JSON: Prometheus scrapes http://{addr}/metrics, as dashboards/prometheus.yml says, and Grafana's Prometheus data source points at Prometheus{grafana_sql})\n\
             \x20 stop:       Ctrl-C",
            node = agent_config.node,
            data = config.server.data_dir.display(),
        );
        // `up` is a server and its agent: when the agent stops on its own (its node's lock
        // taken after all, a configuration it refuses), the whole of it stops, saying why.
        let ended = tokio::select! {
            () = terminate() => None,
            ended = &mut agent => Some(ended),
        };
        let _ = stop.send(true);
        let agent_error = match ended {
            None => match agent.await {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(e) => Some(e.to_string()),
            },
            Some(ended) => {
                let why = match ended {
                    Ok(Ok(_)) => "it stopped".to_owned(),
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                };
                if let Err(e) = server.await.context("server task")? {
                    tracing::error!(error = %e, "serving HTTP");
                }
                anyhow::bail!(
                    "the node's agent stopped while perch up ran: {why}; perch up stops too rather than serve without it"
                );
            }
        };
        if let Some(e) = agent_error {
            tracing::warn!(error = %e, "agent stopped with an error");
        }
        server.await.context("server task")?.context("serving HTTP")
    })
}

/// How often each of the demo's simulated agents samples and syncs. Every agent of a demo
/// runs on this one machine, so a large demo slows them down to leave the server its CPU: a
/// thousand nodes sampling every second and syncing twice a second would be a thousand
/// machines' worth of agents on two cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemoPace {
    pub sample: Duration,
    pub sync: Duration,
    /// Whether each job runs under its own supervisor (`perch __job-shim`), as on a real
    /// node. Each supervisor is a perch process with about 5 MB of its own (the binary's
    /// relocated data), so a demo of thousands of jobs on one machine runs them without.
    pub supervised: bool,
}

/// The largest demo (in GPUs, about as many jobs) whose jobs get a supervisor each.
pub const DEMO_SUPERVISED_GPUS: u32 = 512;

impl DemoPace {
    pub fn new(nodes: u32, gpus_per_node: u32, asked: Duration) -> DemoPace {
        let supervised = nodes.saturating_mul(gpus_per_node) <= DEMO_SUPERVISED_GPUS;
        let nodes = u64::from(nodes);
        DemoPace {
            sample: asked.max(Duration::from_millis(nodes * 5)),
            sync: Duration::from_millis(500).max(Duration::from_millis(nodes * 2)),
            supervised,
        }
    }
}

/// The demo's agents live in the server's process, and their descriptors count against its
/// limit: per node its lock and a connection or two at each end, per running job its output
/// files (read and written). A 1,000-node demo outgrew a limit of 20,000 once its agents sent
/// telemetry and syncs on connections of their own, and the server could accept no
/// connection (EMFILE): the limit is raised to fit where the process may, and a demo it
/// cannot fit says what to raise.
fn fit_demo_descriptors(config: &Config, nodes: u32, gpus_per_node: u32) {
    let per_node = 8 + 6 * u64::from(gpus_per_node);
    let want = u64::from(nodes) * per_node + config.server.max_connections as u64 + 1024;
    let got = perch_server::listener::raise_descriptor_limit(want);
    if got < want {
        tracing::warn!(
            descriptors = got,
            wanted = want,
            "the descriptor limit is low for a demo of {nodes} nodes: its agents and their jobs may run out (raise it: ulimit -n {want})"
        );
    }
}

pub fn demo(config: Config, nodes: u32, gpus_per_node: u32, seed: u64) -> Result<()> {
    fit_demo_descriptors(&config, nodes, gpus_per_node);
    let base = config.agent_config()?;
    let pace = DemoPace::new(nodes, gpus_per_node, base.interval);
    runtime()?.block_on(async {
        let (listener, state) = bind(&config).await?;
        let addr = listener.local_addr()?;
        let (stop, stop_rx) = watch::channel(false);
        let server = tokio::spawn(perch_server::serve(listener, state, stopped(&stop_rx)));
        let mut agents = Vec::new();
        for i in 0..nodes {
            let mut a = base.clone();
            a.server = format!("http://{addr}");
            a.node = perch_model::NodeId::new(format!("sim-node-{i:03}")).map_err(anyhow::Error::msg)?;
            a.simulate_host = true;
            a.simulate_gpus = gpus_per_node;
            a.nvml = NvmlMode::Off;
            // The demo's users (alice, bob, ...) are made up: jobs run as the agent's user.
            a.run_as_user = perch_collector::launcher::RunAsUser::Never;
            a.seed = seed.wrapping_mul(1_000_003).wrapping_add(u64::from(i));
            a.keep_jobs_on_exit = false;
            a.interval = pace.sample;
            a.sync_interval = pace.sync;
            if !pace.supervised {
                a.supervisor = None;
            }
            // Each node its own jobs: clones of a registry share it.
            a.jobs = perch_collector::JobRegistry::default();
            agents.push(spawn_agent(a, stopped(&stop_rx)));
        }
        let workload = tokio::spawn(super::demo_workload::run(
            format!("http://{addr}"),
            nodes,
            gpus_per_node,
        ));
        println!(
            "perch demo: a SIMULATED cluster of {nodes} nodes x {gpus_per_node} GPUs in one process.\n\
             \x20 Every row, series and message from it is labelled simulated (simulated = true).\n\
             \x20 workload:   demo jobs from alice, bob, chen and dana (accounts vision, nlp, speech) fill\n\
             \x20             about 3/4 of the GPUs, two gangs of whole nodes wait in the queue; busy ones push simulated\n\
             \x20             loss and throughput over OpenTelemetry (perch jobs --all, perch queue)\n\
             \x20 pace:       each node samples every {sample:?} and syncs every {sync:?} (all {nodes} share this machine)\n\
             \x20 jobs:       {supervision}\n\
             \x20 server:     http://{addr}  ({access})\n\
             \x20 web view:   http://{addr}/  (open it in a browser)\n\
             \x20 data:       {data}\n\
             \x20 query:      perch sql --server http://{addr} \"SELECT node, avg(utilization_gpu_pct) AS util FROM gpu_samples GROUP BY node ORDER BY node\"\n\
             \x20 metrics:    curl -s http://{addr}/metrics\n\
             \x20 stop:       Ctrl-C",
            data = config.server.data_dir.display(),
            access = open_access(addr),
            sample = pace.sample,
            sync = pace.sync,
            supervision = if pace.supervised {
                "each under its own supervisor, as on a real node".to_owned()
            } else {
                format!("run without a supervisor each (over {DEMO_SUPERVISED_GPUS} GPUs): Ctrl-C stops them; after a kill -9, pkill -f 'sleep 86400'")
            },
        );
        terminate().await;
        workload.abort();
        stop_all(agents, stop, server).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_demo_samples_and_syncs_less_often() {
        let second = Duration::from_secs(1);
        let small = DemoPace::new(4, 8, second);
        assert_eq!(
            (small.sample, small.sync, small.supervised),
            (second, Duration::from_millis(500), true)
        );
        let large = DemoPace::new(1000, 8, second);
        assert_eq!(
            (large.sample, large.sync, large.supervised),
            (Duration::from_secs(5), Duration::from_secs(2), false)
        );
        // What the user asked for stands when it is slower.
        assert_eq!(DemoPace::new(1000, 8, 10 * second).sample, 10 * second);
        assert!(DemoPace::new(64, 8, second).supervised);
        assert!(!DemoPace::new(65, 8, second).supervised);
    }
}
