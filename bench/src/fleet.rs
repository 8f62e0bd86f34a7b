//! `perch bench fleet`: what one `perch server` holds as the fleet grows, measured from outside.
//!
//! The server runs as its own process (the `perch` binary beside this one, `perch server` with
//! a tokens file, as a real fleet's server runs); this process plays N nodes over loopback,
//! each speaking the agent protocol as `perch agent` does: telemetry batches (zstd JSON, every
//! GPU's sample each interval; rounds the server has not yet taken are merged into the next
//! batch, as the agent's spool does) and syncs (every `--sync-ms`, the agent's 500 ms by
//! default), reporting the jobs the server placed on it as running, and their exits when they
//! end. Nodes connect from their own loopback addresses (127.1.x.y, 64 nodes each), as a fleet
//! connects from many hosts. A submitter keeps the queue fed (`--jobs-per-second`).
//!
//! With `--server-cpus` and `--generator-cpus` the two processes are pinned apart (taskset),
//! so the figures are the server's and the generator's own CPU use is reported beside them:
//! a generator that used all its CPU measured itself, not the server.
//!
//! Measured after the fleet has joined and settled and the server has ended its first alert
//! round (which plans every built-in rule), over `--seconds`:
//! - sync and ingest round trips (p50, p99, max), and answers refused by back-pressure;
//! - ingest lag: from a sample's time to its acknowledgement, which means it is durable in the
//!   write-ahead log and visible to SQL;
//! - `GET /metrics` time, scraped every 5 s; the scheduling pass and the alert round (the
//!   server's own counters, `perch_scheduling_pass_seconds`, `perch_alert_round_seconds`);
//! - the server's CPU (cores) and memory (RSS now and at its peak), from `/proc`;
//! - nodes the server did not see as up, at worst (a healthy node marked down is a failure);
//! - at the end, acknowledged samples against the rows SQL counts (lost must be 0).

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub(super) struct FleetArgs {
    /// Simulated nodes.
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Telemetry interval (ms): each node sends every GPU's sample this often.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Sync interval (ms); `perch agent` syncs every 500 ms.
    #[arg(long, default_value_t = 500)]
    sync_ms: u64,
    /// Seconds to measure, once the fleet has joined and settled.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seconds over which the nodes join, and again to settle before measuring.
    #[arg(long, default_value_t = 10)]
    ramp_seconds: u64,
    /// Jobs submitted a second (each 1 to 8 GPUs, running 20 to 120 s on its node).
    #[arg(long, default_value_t = 2.0)]
    jobs_per_second: f64,
    /// The perch binary to run the server with; the `perch` beside this program by default.
    #[arg(long)]
    perch: Option<PathBuf>,
    /// CPUs to run the server on (taskset's list, e.g. "0").
    #[arg(long)]
    server_cpus: Option<String>,
    /// Ingest servers to spread the telemetry over (`[cluster]`, docs/scale.md): the server
    /// under test becomes the control server, and each node sends its telemetry where its sync
    /// answers say. 0: one server takes everything.
    #[arg(long, default_value_t = 0)]
    ingest_servers: u32,
    /// CPUs to run the ingest servers on (taskset's list); `--server-cpus` by default.
    #[arg(long)]
    ingest_cpus: Option<String>,
    /// CPUs to run this generator on (e.g. "1"); its worker threads are as many.
    #[arg(long)]
    generator_cpus: Option<String>,
    /// Directory to put the server's temporary data directory in.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Also print the figures as one JSON object (for scripts/bench-fleet.sh).
    #[arg(long)]
    json: bool,
}

/// Nodes sharing one source address (the server's per-address cap is 256 connections; a node
/// holds two at most, one for telemetry and one for syncs).
const NODES_PER_ADDRESS: u32 = 64;

pub(super) fn fleet(args: FleetArgs) -> Result<()> {
    ensure!(
        args.nodes >= 1 && args.gpus >= 1,
        "--nodes and --gpus must be at least 1"
    );
    ensure!(
        args.interval_ms >= 100 && args.sync_ms >= 100,
        "--interval-ms and --sync-ms must be at least 100"
    );
    let perch = match &args.perch {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("perch"),
    };
    ensure!(
        perch.exists(),
        "{} not found: build it (cargo build --release -p perch) or pass --perch",
        perch.display()
    );
    let dir = tempfile::Builder::new()
        .prefix("perch-bench-fleet-")
        .tempdir_in(&args.dir)?;
    let server = Server::start(&perch, dir.path(), &args, &Role::Control)?;
    let mut ingest = Vec::new();
    for i in 0..args.ingest_servers {
        let role = Role::Ingest {
            name: format!("ingest-{i}"),
            control: server.url.clone(),
        };
        ingest.push(Server::start(&perch, dir.path(), &args, &role)?);
    }
    if let Some(cpus) = &args.generator_cpus {
        pin(std::process::id(), cpus)?;
    }
    let workers = args.generator_cpus.as_deref().map_or(2, cpu_count).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()?;
    let result = runtime.block_on(run(&args, &server, &mut ingest));
    drop(runtime);
    for i in ingest {
        i.stop();
    }
    let log = server.stop();
    let figures = result.with_context(|| format!("the server's log:\n{log}"))?;
    figures.print(&args, workers);
    Ok(())
}

/// Pins every thread of `pid` to `cpus`.
fn pin(pid: u32, cpus: &str) -> Result<()> {
    let status = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .context("run taskset (util-linux)")?;
    ensure!(status.success(), "taskset -a -p -c {cpus} {pid} failed");
    Ok(())
}

/// How many CPUs a taskset list names ("0", "2-3", "0,4-5").
fn cpu_count(list: &str) -> usize {
    list.split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => match (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 1,
            },
            None => 1,
        })
        .sum()
}

/// A server of the run: the server under test (the control server, with ingest servers), or
/// one of its ingest servers.
enum Role {
    Control,
    Ingest { name: String, control: String },
}

/// The server under test: a `perch server` process of its own.
struct Server {
    child: std::process::Child,
    url: String,
    agent_token: String,
    user_token: String,
    log: PathBuf,
}

impl Server {
    fn start(perch: &Path, dir: &Path, args: &FleetArgs, role: &Role) -> Result<Server> {
        let tokens = dir.join("tokens.toml");
        let (agent_token, user_token) = match std::fs::read_to_string(&tokens) {
            // The ingest servers take the control server's tokens.
            Ok(text) => {
                let token = |user: &str| {
                    text.split("[[tokens]]")
                        .find(|t| t.contains(&format!("user = \"{user}\"")))
                        .and_then(|t| t.split('"').nth(1))
                        .map(str::to_owned)
                        .context("the run's tokens file")
                };
                (token("fleet")?, token("bench")?)
            }
            Err(_) => {
                let agent_token = format!("bench-agent-{}", random_hex());
                let user_token = format!("bench-operator-{}", random_hex());
                std::fs::write(
                    &tokens,
                    format!(
                        "[[tokens]]\ntoken = \"{agent_token}\"\nuser = \"fleet\"\nrole = \"agent\"\n\n[[tokens]]\ntoken = \"{user_token}\"\nuser = \"bench\"\nrole = \"operator\"\n"
                    ),
                )?;
                (agent_token, user_token)
            }
        };
        let (name, cpus) = match role {
            Role::Control => ("server".to_owned(), args.server_cpus.as_ref()),
            Role::Ingest { name, .. } => (
                name.clone(),
                args.ingest_cpus.as_ref().or(args.server_cpus.as_ref()),
            ),
        };
        let data = dir.join(format!("{name}-data"));
        let cluster = match role {
            Role::Control if args.ingest_servers > 0 => {
                let mut text = "[cluster]\nrole = \"control\"\n".to_owned();
                for i in 0..args.ingest_servers {
                    text.push_str(&format!(
                        "[[cluster.ingest]]\nname = \"ingest-{i}\"\nstore = \"{}\"\n",
                        dir.join(format!("ingest-{i}-data")).display()
                    ));
                }
                text
            }
            Role::Control => String::new(),
            Role::Ingest { name, control } => {
                let token = dir.join("push.token");
                std::fs::write(&token, &agent_token)?;
                format!(
                    "[cluster]\nrole = \"ingest\"\nname = \"{name}\"\ncontrol = \"{control}\"\ntoken_file = \"{}\"\n",
                    token.display()
                )
            }
        };
        // Two connections a node, with room for clients; within the descriptor limit the
        // server raises at start.
        let max_connections = (2 * args.nodes as usize + 1024).max(4096);
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:0\"\npg_listen = \"\"\ndata_dir = \"{}\"\ntokens_file = \"{}\"\nmax_connections = {max_connections}\n{cluster}",
                data.display(),
                tokens.display()
            ),
        )?;
        let log = dir.join(format!("{name}.log"));
        let err = dir.join(format!("{name}.err"));
        let mut command = match cpus {
            Some(cpus) => {
                let mut c = std::process::Command::new("taskset");
                c.args(["-c", cpus]).arg(perch);
                c
            }
            None => std::process::Command::new(perch),
        };
        let child = command
            .args(["server", "--config"])
            .arg(&config)
            .env("PERCH_LOG", "warn")
            .stdout(std::fs::File::create(&log)?)
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .with_context(|| format!("start {} server", perch.display()))?;
        let mut server = Server {
            child,
            url: String::new(),
            agent_token,
            user_token,
            log,
        };
        let addr_file = data.join("server.addr");
        let started = Instant::now();
        loop {
            if let Ok(addr) = std::fs::read_to_string(&addr_file)
                && addr.ends_with('\n')
            {
                server.url = format!("http://{}", addr.trim());
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "{name} exited ({status}) before it listened:\n{}",
                    std::fs::read_to_string(&err).unwrap_or_default()
                );
            }
            ensure!(
                started.elapsed() < Duration::from_secs(120),
                "the server did not listen within 2 minutes"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, and waits for it to exit (it flushes its buffer first).
    fn terminate(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return; // Already exited (and reaped): its pid may be another process's now.
        }
        let _ = std::process::Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }

    /// Stops it (SIGTERM, as an operator would) and returns the end of its log.
    fn stop(mut self) -> String {
        self.terminate();
        let mut text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let err = self.log.with_extension("err");
        text.push_str(&std::fs::read_to_string(err).unwrap_or_default());
        let tail = text.len().saturating_sub(4000);
        text[text.floor_char_boundary(tail)..].to_owned()
    }
}

fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .elapsed()
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{:016x}{:08x}", h.finish(), std::process::id())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Latencies recorded while measuring, in microseconds.
#[derive(Default)]
struct Recorder {
    measuring: AtomicBool,
    sync_us: Mutex<Vec<u64>>,
    ingest_us: Mutex<Vec<u64>>,
    lag_ms: Mutex<Vec<u64>>,
    metrics_us: Mutex<Vec<u64>>,
    refused: AtomicU64,
    failed: AtomicU64,
    /// Samples the server acknowledged, measuring or not.
    acked_samples: AtomicU64,
    stop: AtomicBool,
}

impl Recorder {
    fn record(&self, into: &Mutex<Vec<u64>>, value: u64) {
        if self.measuring.load(Ordering::Relaxed)
            && let Ok(mut v) = into.lock()
        {
            v.push(value);
        }
    }
}

/// One simulated job on a node: when it ends.
struct Running {
    attempt: u32,
    ends_ms: i64,
}

/// What a node runs and has to report.
#[derive(Default)]
struct NodeJobs {
    running: BTreeMap<u64, Running>,
    /// Exits not yet acknowledged: (job, attempt, code, stopped).
    exited: Vec<(u64, u32, i32, bool)>,
}

async fn run(args: &FleetArgs, server: &Server, ingest: &mut [Server]) -> Result<Figures> {
    let recorder = Arc::new(Recorder::default());
    let mut clients = Vec::new();
    for group in 0..args.nodes.div_ceil(NODES_PER_ADDRESS) {
        let ip = std::net::Ipv4Addr::new(127, 1, (group / 250) as u8, (group % 250 + 1) as u8);
        clients.push(
            reqwest::Client::builder()
                .local_address(std::net::IpAddr::V4(ip))
                .timeout(Duration::from_secs(60))
                .build()?,
        );
    }
    let ramp = Duration::from_secs(args.ramp_seconds);
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for n in 0..args.nodes {
        let client = clients[(n / NODES_PER_ADDRESS) as usize].clone();
        let node = format!("fleet-{n:05}");
        let offset = ramp.mul_f64(f64::from(n) / f64::from(args.nodes));
        let jobs = Arc::new(Mutex::new(NodeJobs::default()));
        let ctx = NodeCtx {
            client,
            url: server.url.clone(),
            ingest_url: Arc::default(),
            token: server.agent_token.clone(),
            node,
            agent_id: format!("fe{n:014x}"),
            gpus: args.gpus,
            recorder: recorder.clone(),
            jobs,
        };
        let (t, s) = (ctx.clone(), ctx);
        let interval = Duration::from_millis(args.interval_ms);
        let sync = Duration::from_millis(args.sync_ms);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(started + offset).await;
            t.telemetry(interval).await
        }));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(started + offset).await;
            s.sync(sync).await
        }));
    }
    let submitter = tokio::spawn(submit(
        clients[0].clone(),
        server.url.clone(),
        server.user_token.clone(),
        args.jobs_per_second,
        args.gpus,
        recorder.clone(),
    ));
    // Joined and settled: the ramp twice over, and the server warm, its first alert round
    // ended (that round plans every built-in rule; measured from a cold start it would count
    // planning once as if every round paid it, and a short window could end inside it).
    tokio::time::sleep(2 * ramp).await;
    let observer = Observer::new(server, ingest, clients[0].clone());
    observer.warm(WARM_UP_LIMIT).await?;
    let before = observer.sample().await;
    recorder.measuring.store(true, Ordering::Relaxed);
    let window = Duration::from_secs(args.seconds);
    let measure_start = tokio::time::Instant::now();
    let mut worst_not_up = before.scrape.map_or(0, |s| s.not_up);
    let mut peak_rss = before.rss_bytes;
    let (mut scrapes, mut scrapes_failed) = (0, 0);
    let mut last = before.scrape;
    while measure_start.elapsed() < window {
        tokio::time::sleep(
            Duration::from_secs(5).min(window.saturating_sub(measure_start.elapsed())),
        )
        .await;
        let s = observer.sample().await;
        peak_rss = peak_rss.max(s.rss_bytes);
        match s.scrape {
            Some(scrape) => {
                recorder.record(&recorder.metrics_us, scrape.metrics_us);
                worst_not_up = worst_not_up.max(scrape.not_up);
                scrapes += 1;
                last = Some(scrape);
            }
            None => scrapes_failed += 1,
        }
    }
    let after = observer.sample().await;
    recorder.measuring.store(false, Ordering::Relaxed);
    if let Some(scrape) = after.scrape {
        worst_not_up = worst_not_up.max(scrape.not_up);
        last = Some(scrape);
    }
    let elapsed = after.at.duration_since(before.at).as_secs_f64();
    recorder.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    submitter.await??;
    // Every acknowledged sample is in SQL; nodes marked down at any time since the start.
    // With ingest servers, once they have stopped (flushing) and the control server has
    // read their stores.
    let acked = recorder.acked_samples.load(Ordering::Relaxed);
    let count = "SELECT count(*) AS n FROM gpu_samples";
    let mut in_sql = observer.scalar(count).await?;
    // What each ingest server took (its own store, buffer included).
    let mut ingest_samples = Vec::new();
    for i in ingest.iter() {
        ingest_samples.push(observer.scalar_at(&i.url, count).await?);
    }
    if !ingest.is_empty() {
        for i in ingest.iter_mut() {
            i.terminate();
        }
        let waited = Instant::now();
        while in_sql < acked && waited.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(500)).await;
            in_sql = observer.scalar(count).await?;
        }
    }
    let marked_down = observer
        .scalar("SELECT count(*) AS n FROM events WHERE kind = 'node_down'")
        .await?;
    ensure!(
        scrapes + scrapes_failed > 0,
        "--seconds too short to scrape /metrics once"
    );
    let (first, last) = (before.scrape.unwrap_or_default(), last.unwrap_or_default());
    Ok(Figures {
        sync_us: take(&recorder.sync_us),
        ingest_us: take(&recorder.ingest_us),
        lag_ms: take(&recorder.lag_ms),
        metrics_us: take(&recorder.metrics_us),
        refused: recorder.refused.load(Ordering::Relaxed),
        failed: recorder.failed.load(Ordering::Relaxed),
        acked_samples: recorder.acked_samples.load(Ordering::Relaxed),
        in_sql,
        server_cores: (after.cpu_secs - before.cpu_secs) / elapsed,
        ingest_cores: after
            .ingest_cpu_secs
            .iter()
            .zip(&before.ingest_cpu_secs)
            .map(|(a, b)| (a - b) / elapsed)
            .collect(),
        ingest_samples,
        generator_cores: (after.own_cpu_secs - before.own_cpu_secs) / elapsed,
        rss_bytes: after.rss_bytes,
        peak_rss_bytes: peak_rss.max(after.rss_bytes).max(after.hwm_bytes),
        worst_not_up,
        marked_down,
        scrapes_failed,
        pass: last.pass.since(&first.pass),
        alerts: last.alerts.since(&first.alerts),
    })
}

/// How long the server may take to end its first alert round once the fleet has joined.
const WARM_UP_LIMIT: Duration = Duration::from_secs(120);

fn take(v: &Mutex<Vec<u64>>) -> Vec<u64> {
    let mut v = std::mem::take(&mut *v.lock().expect("recorder"));
    v.sort_unstable();
    v
}

#[derive(Clone)]
struct NodeCtx {
    client: reqwest::Client,
    url: String,
    /// The ingest server the last sync answer named, if any (as `perch agent` follows it).
    ingest_url: Arc<Mutex<Option<String>>>,
    token: String,
    node: String,
    /// As agents make them: hex digits, the same across the run.
    agent_id: String,
    gpus: u32,
    recorder: Arc<Recorder>,
    jobs: Arc<Mutex<NodeJobs>>,
}

impl NodeCtx {
    /// Samples every `interval`, sending what the server has not taken yet in one batch.
    async fn telemetry(self, interval: Duration) -> Result<()> {
        let step = interval.as_millis() as i64;
        let mut next_round = now_ms();
        let mut pending: Vec<i64> = Vec::new();
        let mut seq = 0u64;
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !self.recorder.stop.load(Ordering::Relaxed) {
            ticks.tick().await;
            let now = now_ms();
            while next_round <= now {
                pending.push(next_round);
                next_round += step;
            }
            // The agent's spool holds a day; a bench run never needs more than this.
            if pending.len() > 10_000 {
                pending.drain(..pending.len() - 10_000);
            }
            // A tick early after a slow answer: no round is due yet.
            if pending.is_empty() {
                continue;
            }
            let body = self.batch(seq, &pending)?;
            let base = self
                .ingest_url
                .lock()
                .expect("ingest url")
                .clone()
                .unwrap_or_else(|| self.url.clone());
            let sent = Instant::now();
            let answer = self
                .client
                .post(format!("{base}/v1/ingest"))
                .bearer_auth(&self.token)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(reqwest::header::CONTENT_ENCODING, "zstd")
                .header("x-perch-agent", &self.agent_id)
                .body(body)
                .send()
                .await;
            let took = sent.elapsed().as_micros() as u64;
            let answer = match answer {
                Ok(r) if r.status().is_client_error() && r.status().as_u16() != 429 => {
                    let status = r.status();
                    bail!(
                        "{}: ingest answered {status}: {}",
                        self.node,
                        r.text().await.unwrap_or_default()
                    )
                }
                other => other,
            };
            match answer.map(|r| r.status()) {
                Ok(s) if s.is_success() => {
                    let acked = now_ms();
                    self.recorder.record(&self.recorder.ingest_us, took);
                    for t in &pending {
                        self.recorder
                            .record(&self.recorder.lag_ms, (acked - t).max(0) as u64);
                    }
                    self.recorder.acked_samples.fetch_add(
                        pending.len() as u64 * u64::from(self.gpus),
                        Ordering::Relaxed,
                    );
                    pending.clear();
                    seq += 1;
                }
                Ok(s) if s.as_u16() == 429 || s.as_u16() == 503 => {
                    self.recorder.refused.fetch_add(1, Ordering::Relaxed);
                }
                Ok(s) => bail!("{}: ingest answered {s}", self.node),
                Err(_) => {
                    self.recorder.failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// One batch of the rounds taken at `times`, zstd JSON as the agent sends it.
    fn batch(&self, seq: u64, times: &[i64]) -> Result<Vec<u8>> {
        let busy: Vec<bool> = {
            let jobs = self.jobs.lock().expect("jobs");
            let used = jobs.running.len() as u32;
            (0..self.gpus).map(|g| g < used).collect()
        };
        let mut gpus = Vec::with_capacity(times.len() * self.gpus as usize);
        for (r, &time_ms) in times.iter().enumerate() {
            for g in 0..self.gpus {
                let x = ((r as u32 * 31 + g * 7 + seq as u32) % 20) as f64;
                let util = if busy[g as usize] { 75.0 + x } else { x / 4.0 };
                gpus.push(perch_model::GpuSample {
                    time_ms,
                    gpu: perch_model::GpuIndex(g),
                    uuid: format!("GPU-{}-{g}", self.node),
                    model: "Fleet GPU (simulated)".into(),
                    simulated: true,
                    utilization_gpu_pct: Some(util),
                    utilization_memory_pct: Some(util / 2.0),
                    memory_used_bytes: Some(if busy[g as usize] { 60 << 30 } else { 1 << 30 }),
                    memory_total_bytes: Some(80 << 30),
                    power_watts: Some(90.0 + util * 5.0),
                    energy_joules: Some(1e6 + (time_ms / 1000) as f64 * 300.0),
                    temperature_celsius: Some(40.0 + util / 4.0),
                    sm_clock_mhz: Some(1980),
                    memory_clock_mhz: Some(2619),
                    ..perch_model::GpuSample::default()
                });
            }
        }
        let json = serde_json::to_vec(&super::gpu_batch(&self.node, seq, gpus)?)?;
        Ok(zstd::bulk::compress(&json, 3)?)
    }

    /// Syncs every `interval`, or as the server paces it (`next_sync_ms`) unless a job ended,
    /// as `perch agent` does: what runs, what ended; starts and stops what the server says.
    async fn sync(self, interval: Duration) -> Result<()> {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut paced_until = tokio::time::Instant::now();
        while !self.recorder.stop.load(Ordering::Relaxed) {
            ticks.tick().await;
            let now = now_ms();
            let ended = {
                let jobs = self.jobs.lock().expect("jobs");
                !jobs.exited.is_empty() || jobs.running.values().any(|r| r.ends_ms <= now)
            };
            if tokio::time::Instant::now() < paced_until && !ended {
                continue;
            }
            let (running, exited) = {
                let mut jobs = self.jobs.lock().expect("jobs");
                let ended: Vec<u64> = jobs
                    .running
                    .iter()
                    .filter(|(_, r)| r.ends_ms <= now)
                    .map(|(&j, _)| j)
                    .collect();
                for job in ended {
                    if let Some(r) = jobs.running.remove(&job) {
                        jobs.exited.push((job, r.attempt, 0, false));
                    }
                }
                let running: Vec<_> = jobs
                    .running
                    .iter()
                    .map(|(&job, r)| serde_json::json!({"job": job, "attempt": r.attempt}))
                    .collect();
                let exited: Vec<_> = jobs
                    .exited
                    .iter()
                    .map(|&(job, attempt, code, stopped)| {
                        serde_json::json!({"job": job, "attempt": attempt, "code": code, "stopped": stopped})
                    })
                    .collect();
                (running, exited)
            };
            let request = serde_json::json!({
                "node": self.node,
                "gpus": self.gpus,
                "gpu_model": "Fleet GPU (simulated)",
                "rack": format!("rack-{}", &self.node[self.node.len() - 5..self.node.len() - 2]),
                "agent_id": self.agent_id,
                "running": running,
                "exited": exited,
            });
            let sent = Instant::now();
            let sent_at = tokio::time::Instant::now();
            let answer = self
                .client
                .post(format!("{}/v1/agent/sync", self.url))
                .bearer_auth(&self.token)
                .json(&request)
                .send()
                .await;
            let response = match answer {
                Ok(r) if r.status().is_success() => {
                    r.json::<perch_model::control::SyncResponse>().await
                }
                Ok(r) if matches!(r.status().as_u16(), 429 | 503) => {
                    self.recorder.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Ok(r) => bail!("{}: sync answered {}", self.node, r.status()),
                Err(e) => Err(e),
            };
            self.recorder
                .record(&self.recorder.sync_us, sent.elapsed().as_micros() as u64);
            let Ok(response) = response else {
                self.recorder.failed.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            response
                .ingest_url
                .clone_into(&mut self.ingest_url.lock().expect("ingest url"));
            // Half a tick early, as the agent does: the tick due at the pace syncs.
            paced_until = sent_at
                + Duration::from_millis(response.next_sync_ms.unwrap_or(0).min(60_000))
                    .saturating_sub(interval / 2);
            let now = now_ms();
            let mut jobs = self.jobs.lock().expect("jobs");
            let acknowledged: std::collections::HashSet<(u64, u32)> = response
                .acknowledged
                .iter()
                .map(|a| (a.job, a.attempt))
                .collect();
            jobs.exited
                .retain(|(job, attempt, ..)| !acknowledged.contains(&(*job, *attempt)));
            for launch in response.start {
                // 20 to 120 s, the same for the same job.
                let secs = 20 + (launch.job * 7919) % 101;
                jobs.running.entry(launch.job).or_insert(Running {
                    attempt: launch.attempt,
                    ends_ms: now + secs as i64 * 1000,
                });
            }
            for stop in response.stop {
                if jobs
                    .running
                    .get(&stop.job)
                    .is_some_and(|r| r.attempt == stop.attempt)
                {
                    jobs.running.remove(&stop.job);
                    jobs.exited.push((stop.job, stop.attempt, 143, true));
                }
            }
        }
        Ok(())
    }
}

/// Submits `per_second` jobs a second until the run stops, of 1 to 8 GPUs, at most a node's
/// `gpus` (a shape no node could run is refused at submit).
async fn submit(
    client: reqwest::Client,
    url: String,
    token: String,
    per_second: f64,
    gpus: u32,
    recorder: Arc<Recorder>,
) -> Result<()> {
    if per_second <= 0.0 {
        return Ok(());
    }
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second));
    let mut i = 0u64;
    while !recorder.stop.load(Ordering::Relaxed) {
        ticks.tick().await;
        i += 1;
        let body = serde_json::json!({
            "command": ["python3", "train.py"],
            "gpus_per_node": 1 + i % u64::from(gpus.clamp(1, 8)),
            "user": format!("user{}", i % 20),
            "account": format!("team{}", i % 5),
            "time_limit_secs": 3600,
        });
        match client
            .post(format!("{url}/v1/jobs"))
            .bearer_auth(&token)
            .json(&body)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => {}
            Ok(r) if matches!(r.status().as_u16(), 429 | 503) => {}
            Ok(r) => bail!(
                "submitting a job answered {}: {}",
                r.status(),
                r.text().await.unwrap_or_default()
            ),
            Err(_) => {
                recorder.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(())
}

/// A counter pair the server exports: how many, and their seconds in all, and the slowest.
#[derive(Debug, Default, Clone, Copy)]
struct Timed {
    count: f64,
    seconds: f64,
    max_seconds: f64,
}

impl Timed {
    fn since(&self, before: &Timed) -> Timed {
        Timed {
            count: self.count - before.count,
            seconds: self.seconds - before.seconds,
            max_seconds: self.max_seconds,
        }
    }

    fn mean_ms(&self) -> f64 {
        if self.count > 0.0 {
            self.seconds / self.count * 1e3
        } else {
            0.0
        }
    }
}

/// The processes' use, read from `/proc`, and what `/metrics` said when it answered.
struct Observation {
    /// When the usage below was read: CPU is divided by the time between two readings, not by
    /// the window, since a scrape after the reading can take seconds.
    at: Instant,
    cpu_secs: f64,
    /// Each ingest server's.
    ingest_cpu_secs: Vec<f64>,
    own_cpu_secs: f64,
    rss_bytes: u64,
    hwm_bytes: u64,
    scrape: Option<Scrape>,
}

/// One `GET /metrics` that answered within [`SCRAPE_TIMEOUT`].
#[derive(Debug, Default, Clone, Copy)]
struct Scrape {
    metrics_us: u64,
    not_up: u64,
    pass: Timed,
    alerts: Timed,
}

/// A scrape slower than this counts as failed (Prometheus' default timeout is 10 s).
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(20);

struct Observer {
    client: reqwest::Client,
    url: String,
    token: String,
    pid: u32,
    ingest_pids: Vec<u32>,
}

impl Observer {
    fn new(server: &Server, ingest: &[Server], client: reqwest::Client) -> Observer {
        Observer {
            client,
            url: server.url.clone(),
            token: server.user_token.clone(),
            pid: server.pid(),
            ingest_pids: ingest.iter().map(Server::pid).collect(),
        }
    }

    async fn sample(&self) -> Observation {
        let (cpu_secs, rss_bytes, hwm_bytes) = proc_usage(self.pid);
        let (own_cpu_secs, _, _) = proc_usage(std::process::id());
        Observation {
            at: Instant::now(),
            cpu_secs,
            ingest_cpu_secs: self.ingest_pids.iter().map(|p| proc_usage(*p).0).collect(),
            own_cpu_secs,
            rss_bytes,
            hwm_bytes,
            scrape: self.scrape().await.ok(),
        }
    }

    /// Waits until the server has ended its first alert round; an error after `limit`.
    async fn warm(&self, limit: Duration) -> Result<()> {
        let waited = Instant::now();
        loop {
            if self.scrape().await.is_ok_and(|s| s.alerts.count >= 1.0) {
                return Ok(());
            }
            ensure!(
                waited.elapsed() < limit,
                "the server ended no alert round in {} s after the fleet joined: see its log \
                 (perch_alert_rounds_total stayed 0)",
                limit.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn scrape(&self) -> Result<Scrape> {
        let sent = Instant::now();
        let text = self
            .client
            .get(format!("{}/metrics", self.url))
            .bearer_auth(&self.token)
            .timeout(SCRAPE_TIMEOUT)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        let metrics_us = sent.elapsed().as_micros() as u64;
        let value = |name: &str| -> f64 {
            text.lines()
                .find(|l| l.split([' ', '{']).next() == Some(name))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        let not_up = text
            .lines()
            .filter(|l| l.starts_with("perch_node_up{") && l.ends_with(" 0"))
            .count() as u64;
        Ok(Scrape {
            metrics_us,
            not_up,
            pass: Timed {
                count: value("perch_scheduling_passes_total"),
                seconds: value("perch_scheduling_pass_seconds_total"),
                max_seconds: value("perch_scheduling_pass_seconds_max"),
            },
            alerts: Timed {
                count: value("perch_alert_rounds_total"),
                seconds: value("perch_alert_round_seconds_total"),
                max_seconds: value("perch_alert_round_seconds_max"),
            },
        })
    }

    async fn scalar(&self, sql: &str) -> Result<u64> {
        self.scalar_at(&self.url, sql).await
    }

    /// `sql`'s one number `n`, asked of the server at `url`.
    async fn scalar_at(&self, url: &str, sql: &str) -> Result<u64> {
        let body: serde_json::Value = self
            .client
            .post(format!("{url}/v1/sql"))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({ "sql": sql }))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        body["rows"][0]["n"]
            .as_u64()
            .with_context(|| format!("{sql}: {body}"))
    }
}

/// A process's CPU seconds (user and system, all threads), RSS and peak RSS.
fn proc_usage(pid: u32) -> (f64, u64, u64) {
    let ticks = 100.0; // USER_HZ on Linux
    let cpu = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = f.get(11)?.parse().ok()?;
            let stime: f64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) / ticks)
        })
        .unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
            * 1024
    };
    (cpu, kb("VmRSS:"), kb("VmHWM:"))
}

struct Figures {
    sync_us: Vec<u64>,
    ingest_us: Vec<u64>,
    lag_ms: Vec<u64>,
    metrics_us: Vec<u64>,
    refused: u64,
    failed: u64,
    acked_samples: u64,
    in_sql: u64,
    server_cores: f64,
    /// Each ingest server's cores.
    ingest_cores: Vec<f64>,
    /// The samples each ingest server took.
    ingest_samples: Vec<u64>,
    generator_cores: f64,
    rss_bytes: u64,
    peak_rss_bytes: u64,
    worst_not_up: u64,
    /// `node_down` events the server recorded since it started.
    marked_down: u64,
    scrapes_failed: u64,
    pass: Timed,
    alerts: Timed,
}

/// The `p`-th percentile of sorted `v` (0 when empty).
fn pct(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

impl Figures {
    fn print(&self, args: &FleetArgs, workers: usize) {
        let ms = |us: u64| us as f64 / 1e3;
        let sync_p99 = ms(pct(&self.sync_us, 0.99));
        let lag_p99 = pct(&self.lag_ms, 0.99) as f64;
        let lost = self.acked_samples.saturating_sub(self.in_sql);
        println!(
            "fleet: {} nodes x {} GPUs (simulated), telemetry every {} ms, sync every {} ms, {} s measured; server on CPUs {}, generator on CPUs {} ({workers} threads)",
            args.nodes,
            args.gpus,
            args.interval_ms,
            args.sync_ms,
            args.seconds,
            args.server_cpus.as_deref().unwrap_or("any"),
            args.generator_cpus.as_deref().unwrap_or("any"),
        );
        println!(
            "  sync round trip     p50 {:.1} ms  p99 {sync_p99:.1} ms  max {:.1} ms  ({} syncs)",
            ms(pct(&self.sync_us, 0.5)),
            ms(pct(&self.sync_us, 1.0)),
            self.sync_us.len()
        );
        println!(
            "  ingest round trip   p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms  ({} batches)",
            ms(pct(&self.ingest_us, 0.5)),
            ms(pct(&self.ingest_us, 0.99)),
            ms(pct(&self.ingest_us, 1.0)),
            self.ingest_us.len()
        );
        println!(
            "  ingest lag          p50 {} ms  p99 {lag_p99} ms  max {} ms  (sample taken -> durable and in SQL)",
            pct(&self.lag_ms, 0.5),
            pct(&self.lag_ms, 1.0)
        );
        println!(
            "  refused (429/503)   {}  failed (no answer)  {}",
            self.refused, self.failed
        );
        println!(
            "  GET /metrics        median {:.0} ms  max {:.0} ms  ({} scrapes, {} over 20 s)",
            ms(pct(&self.metrics_us, 0.5)),
            ms(pct(&self.metrics_us, 1.0)),
            self.metrics_us.len(),
            self.scrapes_failed
        );
        println!(
            "  scheduling pass     mean {:.2} ms  max since start {:.1} ms  ({:.0} passes)",
            self.pass.mean_ms(),
            self.pass.max_seconds * 1e3,
            self.pass.count
        );
        println!(
            "  alert round         mean {:.1} ms  max since start {:.1} ms  ({:.0} rounds)",
            self.alerts.mean_ms(),
            self.alerts.max_seconds * 1e3,
            self.alerts.count
        );
        println!(
            "  server              {:.2} cores  RSS {} MiB (peak {} MiB)",
            self.server_cores,
            self.rss_bytes >> 20,
            self.peak_rss_bytes >> 20
        );
        if !self.ingest_cores.is_empty() {
            let each: Vec<String> = self
                .ingest_cores
                .iter()
                .map(|c| format!("{c:.2}"))
                .collect();
            let took: Vec<String> = self.ingest_samples.iter().map(u64::to_string).collect();
            println!(
                "  ingest servers      {} on CPUs {}: {} cores, {} samples taken (the server above is their control server)",
                self.ingest_cores.len(),
                args.ingest_cpus
                    .as_deref()
                    .or(args.server_cpus.as_deref())
                    .unwrap_or("any"),
                each.join(", "),
                took.join(", ")
            );
        }
        println!("  generator           {:.2} cores", self.generator_cores);
        println!(
            "  nodes not up        {} at worst in a scrape; {} marked down in all",
            self.worst_not_up, self.marked_down
        );
        println!(
            "  samples             {} acknowledged, {} in SQL: {lost} lost",
            self.acked_samples, self.in_sql
        );
        let met = sync_p99 < 1000.0
            && lag_p99 < 2000.0
            && self.worst_not_up == 0
            && self.marked_down == 0
            && lost == 0;
        println!(
            "  verdict             {} (sync p99 < 1 s, ingest lag p99 < 2 s, no node down, nothing lost)",
            if met { "held" } else { "not held" }
        );
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "nodes": args.nodes, "gpus": args.gpus, "interval_ms": args.interval_ms,
                    "sync_ms": args.sync_ms, "seconds": args.seconds,
                    "sync_p50_ms": ms(pct(&self.sync_us, 0.5)), "sync_p99_ms": sync_p99,
                    "ingest_p99_ms": ms(pct(&self.ingest_us, 0.99)),
                    "lag_p50_ms": pct(&self.lag_ms, 0.5), "lag_p99_ms": lag_p99,
                    "metrics_median_ms": ms(pct(&self.metrics_us, 0.5)),
                    "pass_mean_ms": self.pass.mean_ms(), "alert_round_mean_ms": self.alerts.mean_ms(),
                    "server_cores": self.server_cores, "generator_cores": self.generator_cores,
                    "ingest_servers": self.ingest_cores.len(), "ingest_cores": self.ingest_cores,
                    "ingest_samples": self.ingest_samples,
                    "rss_mib": self.rss_bytes >> 20, "peak_rss_mib": self.peak_rss_bytes >> 20,
                    "refused": self.refused, "failed": self.failed,
                    "not_up_worst": self.worst_not_up, "marked_down": self.marked_down,
                    "scrapes_failed": self.scrapes_failed, "acked_samples": self.acked_samples,
                    "in_sql": self.in_sql, "lost": lost, "held": met,
                })
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(cpu_count("0"), 1);
        assert_eq!(cpu_count("2-3"), 2);
        assert_eq!(cpu_count("0,4-5"), 3);
    }

    #[test]
    fn percentiles_of_sorted_values() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(pct(&v, 0.5), 51);
        assert_eq!(pct(&v, 0.99), 99);
        assert_eq!(pct(&v, 1.0), 100);
        assert_eq!(pct(&[], 0.99), 0);
    }
}
