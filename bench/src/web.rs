//! `perch bench web`: the web view in headless Chromium against `perch demo`: how long the
//! fleet view takes to its first full render, what one live refresh costs, and whether the
//! page's memory stays flat over minutes of live updates.

use anyhow::{Context, Result, bail};
use clap::Args;
use perch_bench::browser::{Browser, kill_group};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub(super) struct WebArgs {
    /// Simulated nodes (`perch demo --nodes`).
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    /// Simulated GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Page loads timed.
    #[arg(long, default_value_t = 5)]
    loads: u32,
    /// Minutes of live updates over which the page's memory is watched.
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// The perch binary to run `perch demo` with (default: the one beside this benchmark).
    #[arg(long)]
    perch: Option<PathBuf>,
    /// Directory to put the demo's data directory in.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Write a PNG of the fleet view here once it is drawn.
    #[arg(long)]
    screenshot: Option<PathBuf>,
}

/// `perch demo`, stopped when dropped: SIGTERM first, so that it stops its jobs (a large
/// demo runs them without supervisors, and a SIGKILL would leave thousands of `sleep`s
/// behind), then SIGKILL if it has not ended within a minute.
struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if !matches!(self.0.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What the benchmark started and an interruption must stop: filled in as each starts,
/// emptied once each is stopped the ordinary way (drops do not run when a signal ends the
/// process: Ctrl-C or SIGTERM left the demo, chromedriver and Chromium running).
struct Started {
    demo: Option<u32>,
    browser_group: Option<u32>,
    dir: Option<PathBuf>,
}

static STARTED: Mutex<Started> = Mutex::new(Started {
    demo: None,
    browser_group: None,
    dir: None,
});

fn running() -> MutexGuard<'static, Started> {
    STARTED.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether process `pid` has ended (gone, or a zombie waiting to be reaped).
fn ended(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// On SIGINT, SIGTERM or SIGHUP: stops what [`STARTED`] lists (the browser's process group
/// at once; the demo with SIGTERM, so it stops its jobs, then SIGKILL after a minute), removes
/// the demo's data directory, and exits as the signal would have (128 + its number).
fn stop_on_signals() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Registered before this returns: a signal from then on is caught, not fatal.
    let (mut int, mut term, mut hup) = runtime.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
            signal(SignalKind::hangup())?,
        ))
    })?;
    std::thread::spawn(move || {
        let code = runtime.block_on(async {
            tokio::select! {
                _ = int.recv() => 130,
                _ = term.recv() => 143,
                _ = hup.recv() => 129,
            }
        });
        eprintln!("perch-bench web: interrupted; stopping the demo and the browser");
        let started = running();
        if let Some(group) = started.browser_group {
            kill_group(group);
        }
        if let Some(pid) = started.demo {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(60);
            while !ended(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            if !ended(pid) {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
        if let Some(dir) = &started.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        std::process::exit(code);
    });
    Ok(())
}

pub(super) fn web(args: WebArgs) -> Result<()> {
    let perch = match args.perch {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .context("this executable's directory")?
            .join("perch"),
    };
    if !perch.exists() {
        bail!(
            "no perch binary at {} (build it, `cargo build --release -p perch`, or pass --perch)",
            perch.display()
        );
    }
    let dir = tempfile::Builder::new()
        .prefix("perch-bench-web-")
        .tempdir_in(&args.dir)?;
    stop_on_signals()?;
    running().dir = Some(dir.path().to_path_buf());
    let data = dir.path().join("data");
    let demo = {
        // Held while it starts: an interruption waits to see its pid.
        let mut started = running();
        let demo = Demo(
            Command::new(&perch)
                .args(["demo", "--nodes", &args.nodes.to_string()])
                .args(["--gpus-per-node", &args.gpus_per_node.to_string()])
                .args(["--listen", "127.0.0.1:0", "--data-dir"])
                .arg(&data)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {} demo", perch.display()))?,
        );
        started.demo = Some(demo.0.id());
        demo
    };
    let url = wait_for_address(&data)?;
    perch_model::tls::use_ring();
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let (gpus, allocated) = wait_for_fleet(&http, &url, args.nodes)?;
    println!(
        "web view: fleet of perch demo --nodes {} --gpus-per-node {} ({gpus} simulated GPUs, {allocated} allocated), headless Chromium",
        args.nodes, args.gpus_per_node
    );
    let nodes_json = http.get(format!("{url}/v1/nodes")).send()?.bytes()?.len();
    let started = Instant::now();
    let gzipped = http
        .get(format!("{url}/v1/nodes"))
        .header("accept-encoding", "gzip")
        .send()?
        .bytes()?
        .len();
    println!(
        "  GET /v1/nodes: {:.0} KB of JSON, {:.0} KB gzipped (as the browser gets it), {:.0} ms",
        nodes_json as f64 / 1e3,
        gzipped as f64 / 1e3,
        started.elapsed().as_secs_f64() * 1000.0
    );

    let browser = {
        let mut started = running();
        let browser = Browser::start(1600, 1000)?;
        started.browser_group = Some(browser.process_group());
        browser
    };
    let mut paints = Vec::new();
    for _ in 0..args.loads.max(1) {
        browser.go("about:blank")?;
        browser.go(&format!("{url}/#/fleet"))?;
        paints.push(wait_number(&browser, "window.__perchFleetPainted")?);
    }
    let cells = browser.js(
        "return document.querySelectorAll('.node .gpu').length",
        json!([]),
    )?;
    if cells.as_u64() != Some(u64::from(gpus)) {
        bail!("the fleet shows {cells} GPU cells, not {gpus}");
    }
    if let Some(path) = &args.screenshot {
        std::fs::write(path, browser.screenshot()?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    println!(
        "  first full render of the fleet view (navigation to painted, {} loads): {}",
        paints.len(),
        summary(&mut paints, "ms")
    );

    // Live updates: the fleet refreshes every 5 s; watch the page's memory after a forced
    // garbage collection, its DOM and its listeners.
    browser.cdp("Performance.enable", json!({}))?;
    let total = Duration::from_secs_f64((args.minutes * 60.0).max(1.0));
    let every = (total / 10).max(Duration::from_secs(1));
    let start = Instant::now();
    let mut refresh = Vec::new();
    let mut samples: Vec<(f64, f64, f64, f64)> = Vec::new();
    loop {
        browser.cdp("HeapProfiler.collectGarbage", json!({}))?;
        let metrics = browser.cdp("Performance.getMetrics", json!({}))?;
        let metric = |name: &str| {
            metrics["metrics"]
                .as_array()
                .and_then(|m| m.iter().find(|x| x["name"] == name))
                .and_then(|x| x["value"].as_f64())
                .unwrap_or(f64::NAN)
        };
        samples.push((
            start.elapsed().as_secs_f64() / 60.0,
            metric("JSHeapUsedSize") / 1e6,
            metric("Nodes"),
            metric("JSEventListeners"),
        ));
        if let Some(ms) = browser
            .js(
                "return Number(document.getElementById('view').dataset.renderMs)",
                json!([]),
            )?
            .as_f64()
        {
            refresh.push(ms);
        }
        if start.elapsed() >= total {
            break;
        }
        std::thread::sleep(every.min(total.saturating_sub(start.elapsed())));
    }
    let errors = browser.js("return window.__perchErrors", json!([]))?;
    if errors.as_array().is_some_and(|e| !e.is_empty()) {
        bail!("the page met errors: {errors}");
    }
    println!(
        "  one live refresh (fetch /v1/nodes, update the cells): {}",
        summary(&mut refresh, "ms")
    );
    println!(
        "  memory over {:.1} minutes of live updates (after a forced GC):",
        args.minutes
    );
    println!("    minute  JS heap MB  DOM nodes  listeners");
    for (minute, heap, nodes, listeners) in &samples {
        println!("    {minute:>6.1}  {heap:>10.1}  {nodes:>9.0}  {listeners:>9.0}");
    }
    if let (Some(first), Some(last)) = (samples.first(), samples.last()) {
        let max = samples.iter().map(|s| s.1).fold(f64::MIN, f64::max);
        println!(
            "  JS heap: {:.1} MB at the start, {:.1} MB at the end, {:.1} MB at most; DOM nodes {:.0} -> {:.0}",
            first.1, last.1, max, first.2, last.2
        );
    }
    // Stopped here: an interruption from now on has nothing of theirs to stop.
    {
        let mut started = running();
        drop(browser);
        started.browser_group = None;
        drop(demo);
        started.demo = None;
    }
    Ok(())
}

/// The demo writes the address it bound to `<data>/server.addr`.
fn wait_for_address(data: &std::path::Path) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(addr) = std::fs::read_to_string(data.join("server.addr")) {
            let addr = addr.trim();
            if !addr.is_empty() {
                return Ok(format!("http://{addr}"));
            }
        }
        if Instant::now() > deadline {
            bail!("perch demo wrote no server.addr within 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until every node is up and the demo's workload has placed its jobs (the allocated
/// GPU count unchanged for three polls); returns (GPUs, allocated GPUs).
fn wait_for_fleet(http: &reqwest::blocking::Client, url: &str, nodes: u32) -> Result<(u32, u32)> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last = (0, u32::MAX);
    let mut same = 0;
    loop {
        let answer: Value = http.get(format!("{url}/v1/nodes")).send()?.json()?;
        let list = answer["nodes"].as_array().cloned().unwrap_or_default();
        let up = list.iter().filter(|n| n["state"] == "up").count() as u32;
        let gpus = list
            .iter()
            .map(|n| n["gpus"].as_u64().unwrap_or(0) as u32)
            .sum();
        let allocated = list
            .iter()
            .map(|n| n["allocated_gpus"].as_u64().unwrap_or(0) as u32)
            .sum();
        if up == nodes && allocated > 0 && (gpus, allocated) == last {
            same += 1;
            if same >= 3 {
                return Ok(last);
            }
        } else {
            same = 0;
        }
        last = (gpus, allocated);
        if Instant::now() > deadline {
            bail!("after 10 minutes {up} of {nodes} nodes are up, {allocated} GPUs allocated");
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// Waits for a number the page sets (`expr`), up to two minutes.
fn wait_number(browser: &Browser, expr: &str) -> Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(x) = browser
            .js(&format!("return {expr} ?? null"), json!([]))?
            .as_f64()
        {
            return Ok(x);
        }
        if Instant::now() > deadline {
            bail!("{expr} was not set within 2 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn summary(values: &mut [f64], unit: &str) -> String {
    if values.is_empty() {
        return "no values".into();
    }
    values.sort_by(f64::total_cmp);
    let median = values[values.len() / 2];
    format!(
        "median {median:.0} {unit} (min {:.0}, max {:.0})",
        values[0],
        values[values.len() - 1]
    )
}
