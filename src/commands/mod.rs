//! The subcommands: their flags (each also a `PERCH_*` environment variable) and dispatch.

mod alerts;
mod bench;
mod demo_workload;
mod ha;
mod jobs;
mod provenance;
mod rerun;
mod serve;
pub mod simulate;
mod sql;
mod token;
pub mod validate;

use crate::config::{Config, ConfigFile};
use crate::telemetry::{Target, Telemetry};
use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "perch",
    version,
    about = "GPU cluster monitoring, accounting and scheduling in one place"
)]
pub struct Cli {
    /// TOML config file (see perch.example.toml). The client commands take their server from
    /// it too: [client] server, else server.listen.
    #[arg(long, global = true, env = "PERCH_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server: ingest, SQL, /metrics.
    Server(ServerArgs),
    /// Run the node agent: sample this node and stream to a server.
    Agent(AgentArgs),
    /// Server and a local agent in one process: perch on one machine.
    Up(UpArgs),
    /// A simulated cluster in one process, with a synthetic workload (all data labelled simulated).
    Demo(DemoArgs),
    /// Run a read-only SQL query against a server.
    Sql(sql::SqlArgs),
    /// Replay a job trace through the scheduler in virtual time.
    Simulate(simulate::SimulateArgs),
    /// Measure perch (results go in BENCHMARKS.md).
    Bench(bench::BenchArgs),
    /// Submit a job (like sbatch): perch submit --gpus 2 --time 2h -- python train.py
    Submit(Box<jobs::SubmitArgs>),
    /// List jobs (like squeue; --all for ended ones too).
    Jobs(jobs::JobsArgs),
    /// Show one job: state, reason, GPUs, live utilization, timeline (--provenance: what it
    /// ran: commit, diff, image, environment, driver).
    Show(jobs::ShowArgs),
    /// Submit a job again from the code it ran (its recorded git commit and changes).
    Rerun(rerun::RerunArgs),
    /// Cancel jobs (like scancel).
    Cancel(jobs::CancelArgs),
    /// Print a job's output (-f to follow).
    Logs(jobs::LogsArgs),
    /// Pending jobs in scheduling order, with the reason each waits.
    Queue(jobs::QueueArgs),
    /// Nodes, their GPUs and jobs (like sinfo).
    Nodes(jobs::ListArgs),
    /// Stop placing jobs on a node (running ones finish).
    Drain(jobs::DrainArgs),
    /// Place jobs on a drained node again.
    Resume(jobs::NodeArgs),
    /// Prove a node's GPUs healthy: drain it, run its validation command, resume it when it
    /// passes, keep it drained with the reason when not (operators; docs/validation.md).
    Validate(validate::ValidateArgs),
    /// Alerts (pending, firing), what perch did about them, silences and the remediation
    /// circuit breaker.
    Alerts(alerts::AlertsArgs),
    /// A control plane with standbys: `perch ha status` says who leads (docs/ha.md).
    Ha(ha::HaArgs),
    /// Access tokens: `perch token create --user alice --role user` prints a new one once.
    Token(token::TokenArgs),
}

#[derive(Debug, Args)]
struct ServerFlags {
    /// Address to listen on.
    #[arg(long, env = "PERCH_LISTEN")]
    listen: Option<String>,
    /// Data directory (write-ahead log, Parquet files).
    #[arg(long, env = "PERCH_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Seconds between flushes of buffered rows to Parquet.
    #[arg(long, env = "PERCH_FLUSH_INTERVAL_SECS")]
    flush_interval_secs: Option<u64>,
}

#[derive(Debug, Args)]
struct ServerArgs {
    #[command(flatten)]
    server: ServerFlags,
    #[command(flatten)]
    telemetry: TelemetryFlags,
}

/// Export of perch's own traces and metrics (`[telemetry]` in perch.example.toml).
#[derive(Debug, Args)]
struct TelemetryFlags {
    /// Export perch's own traces and metrics over OTLP/HTTP to this base URL, e.g.
    /// http://collector:4318 (default: OTEL_EXPORTER_OTLP_ENDPOINT, else off).
    #[arg(long, env = "PERCH_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// service.name of perch's own telemetry (default perch-server, or perch-agent for agents).
    #[arg(long, env = "PERCH_SERVICE_NAME")]
    service_name: Option<String>,
}

impl TelemetryFlags {
    fn apply(&self, config: &mut Config) {
        if let Some(v) = &self.otlp_endpoint {
            config.telemetry.otlp_endpoint = v.clone();
        }
        if let Some(v) = &self.service_name {
            config.telemetry.service_name = v.clone();
        }
    }
}

#[derive(Debug, Args)]
struct AgentFlags {
    /// Node name (default: hostname).
    #[arg(long, env = "PERCH_NODE")]
    node: Option<String>,
    /// The node's rack or switch label: the scheduler packs a multi-node job into one rack
    /// when it can.
    #[arg(long, env = "PERCH_RACK")]
    rack: Option<String>,
    /// A topology file shared by all nodes (`<node> <rack>` lines, or Slurm's topology.conf),
    /// read when no rack is given.
    #[arg(long, env = "PERCH_TOPOLOGY_FILE")]
    topology_file: Option<PathBuf>,
    /// The address other nodes reach this one at (a multi-node job's MASTER_ADDR when this
    /// node holds rank 0). Default: the local address of the route to the server.
    #[arg(long, env = "PERCH_ADVERTISE_ADDR")]
    advertise_addr: Option<String>,
    /// Milliseconds between samples.
    #[arg(long, env = "PERCH_INTERVAL_MS")]
    interval_ms: Option<u64>,
    /// NVML: auto, off, or the path of an NVML library.
    #[arg(long, env = "PERCH_NVML")]
    nvml: Option<String>,
    /// Add this many simulated GPUs (labelled simulated in every table, series and message):
    /// 0 (none) to 64, the most GPUs a node may have.
    #[arg(long, env = "PERCH_SIMULATE_GPUS", value_parser = clap::value_parser!(u32).range(0..=i64::from(perch_scheduler::MAX_GPUS_PER_NODE)))]
    simulate_gpus: Option<u32>,
    /// Take jobs that ask for a part of a GPU (run the NVIDIA MPS daemon to enforce shares).
    #[arg(long, env = "PERCH_GPU_SHARING", num_args = 0..=1, default_missing_value = "true")]
    gpu_sharing: Option<bool>,
    /// Run jobs as their submitting user: required, if_possible or never.
    #[arg(long, env = "PERCH_RUN_AS_USER")]
    run_as_user: Option<String>,
    /// Job cgroups: auto, off, or the path of a delegated cgroup v2 directory.
    #[arg(long, env = "PERCH_CGROUPS")]
    cgroups: Option<String>,
}

#[derive(Debug, Args)]
struct AgentArgs {
    /// Server URL, e.g. http://perch-server:7300; several, separated by commas, for a leader
    /// and its standbys (the agent follows whichever leads).
    #[arg(long, env = "PERCH_SERVER")]
    server: Option<String>,
    /// Agent data directory (spool, free-space reporting).
    #[arg(long, env = "PERCH_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Bearer token (role agent) when the server requires one.
    #[arg(long, env = "PERCH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// PEM certificates of a CA to trust for an https:// server, besides the system's.
    #[arg(long, env = "PERCH_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// Serve the node-local GET /metrics on this address (e.g. 127.0.0.1:9400).
    #[arg(long, env = "PERCH_AGENT_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    #[command(flatten)]
    agent: AgentFlags,
    #[command(flatten)]
    telemetry: TelemetryFlags,
}

#[derive(Debug, Args)]
struct UpArgs {
    #[command(flatten)]
    server: ServerFlags,
    #[command(flatten)]
    agent: AgentFlags,
    #[command(flatten)]
    telemetry: TelemetryFlags,
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// Simulated nodes.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    nodes: u32,
    /// Simulated GPUs per node.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    gpus_per_node: u32,
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Milliseconds between samples of each simulated node.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Address to listen on.
    #[arg(long, env = "PERCH_LISTEN")]
    listen: Option<String>,
    /// Data directory (default ./perch-demo-data, apart from real data).
    #[arg(long, env = "PERCH_DATA_DIR", default_value = "./perch-demo-data")]
    data_dir: PathBuf,
    /// Seconds between flushes of buffered rows to Parquet.
    #[arg(long, env = "PERCH_FLUSH_INTERVAL_SECS")]
    flush_interval_secs: Option<u64>,
    #[command(flatten)]
    telemetry: TelemetryFlags,
}

impl ServerFlags {
    fn apply(&self, config: &mut Config) {
        if let Some(v) = &self.listen {
            config.server.listen = v.clone();
        }
        if let Some(v) = &self.data_dir {
            config.server.data_dir = v.clone();
            config.agent.data_dir = v.clone();
        }
        if let Some(v) = self.flush_interval_secs {
            config.server.flush_interval_secs = v;
        }
    }
}

impl AgentFlags {
    fn apply(&self, config: &mut Config) {
        if let Some(v) = &self.node {
            config.agent.node = v.clone();
        }
        if let Some(v) = &self.rack {
            config.agent.rack = v.clone();
        }
        if let Some(v) = &self.topology_file {
            config.agent.topology_file = v.clone();
        }
        if let Some(v) = &self.advertise_addr {
            config.agent.advertise_addr = v.clone();
        }
        if let Some(v) = self.interval_ms {
            config.agent.interval_ms = v;
        }
        if let Some(v) = &self.nvml {
            config.agent.nvml = v.clone();
        }
        if let Some(v) = self.simulate_gpus {
            config.agent.simulate_gpus = v;
        }
        if let Some(v) = self.gpu_sharing {
            config.agent.gpu_sharing = v;
        }
        if let Some(v) = &self.run_as_user {
            config.agent.run_as_user = v.clone();
        }
        if let Some(v) = &self.cgroups {
            config.agent.cgroups = v.clone();
        }
    }
}

/// Logs to stderr, filtered by `PERCH_LOG` (default `info`). With `tracer`, the same spans
/// (and the events inside them) also go to perch's OTLP trace exporter: one filter decides
/// for both, so what a backend receives is what the log would show.
fn init_logging(tracer: Option<opentelemetry_sdk::trace::SdkTracer>) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_env("PERCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(colour_logs()),
        )
        .with(tracer.map(|t| tracing_opentelemetry::layer().with_tracer(t)))
        .init();
}

/// Colours only for a person at a terminal: never in a redirected log or under `NO_COLOR`.
fn colour_logs() -> bool {
    use std::io::IsTerminal as _;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Starts the export of perch's own telemetry when one is configured, then logging (whose
/// spans the exporter receives). The returned guard flushes the exporters when dropped, so
/// the long-running commands hold it until they have stopped.
fn start_telemetry(config: &Config, default_service: &str) -> Result<Telemetry> {
    let target = Target::resolve(&config.telemetry, default_service, |k| {
        std::env::var(k).ok()
    })?;
    let telemetry = Telemetry::start(target)?;
    init_logging(telemetry.tracer());
    if let Some(t) = telemetry.target() {
        tracing::info!(endpoint = %t.base, service = %t.service, interval_s = t.interval.as_secs(), "exporting perch's own traces and metrics over OTLP/HTTP");
    }
    Ok(telemetry)
}

/// Rust ignores SIGPIPE, so printing into a closed pipe (`perch queue | head`) panics. A
/// client command ends quietly instead, as Unix tools do; the long-running commands keep
/// ignoring it (a client that hangs up must not kill the server).
#[allow(unsafe_code)]
fn die_quietly_on_closed_pipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: SIG_DFL installs no handler, so nothing runs in signal context; called before
    // the command starts any thread.
    if let Err(e) = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) } {
        tracing::debug!(error = %e, "SIGPIPE stays ignored");
    }
}

pub fn run(cli: Cli) -> Result<()> {
    let file = cli.config.as_deref().map(ConfigFile::read).transpose()?;
    let mut config = file.as_ref().map(|f| f.config.clone()).unwrap_or_default();
    config.source = file.as_ref().map(|f| f.path.clone());
    let file = file.as_ref();
    let long_running = matches!(
        cli.command,
        Command::Server(_) | Command::Agent(_) | Command::Up(_) | Command::Demo(_)
    );
    if !long_running {
        init_logging(None);
        die_quietly_on_closed_pipe();
    }
    match cli.command {
        Command::Server(args) => {
            args.server.apply(&mut config);
            args.telemetry.apply(&mut config);
            config.check()?;
            let _telemetry = start_telemetry(&config, "perch-server")?;
            serve::server(config)
        }
        Command::Agent(args) => {
            if let Some(v) = args.server {
                config
                    .agent
                    .set_servers_from(&v, "--server (or PERCH_SERVER)")?;
            }
            if let Some(v) = args.data_dir {
                config.agent.data_dir = v;
            }
            if let Some(v) = args.token {
                config.agent.token = v;
            }
            if let Some(v) = args.ca_file {
                config.agent.ca_file = v;
            }
            if let Some(v) = args.metrics_listen {
                config.agent.metrics_listen = v;
            }
            args.agent.apply(&mut config);
            args.telemetry.apply(&mut config);
            config.check()?;
            let _telemetry = start_telemetry(&config, "perch-agent")?;
            serve::agent(config)
        }
        Command::Up(args) => {
            // One machine, one data directory: the local agent keeps its spool and its jobs'
            // directories beside the server's data unless the file names another place (a
            // config that moved only the server's would leave them in the working directory).
            if file.is_some_and(|f| !f.sets("agent", "data_dir")) {
                config.agent.data_dir = config.server.data_dir.clone();
            }
            args.server.apply(&mut config);
            args.agent.apply(&mut config);
            args.telemetry.apply(&mut config);
            config.check()?;
            let _telemetry = start_telemetry(&config, "perch-server")?;
            serve::up(config)
        }
        Command::Demo(args) => {
            if let Some(v) = args.listen {
                config.server.listen = v;
            }
            if let Some(v) = args.flush_interval_secs {
                config.server.flush_interval_secs = v;
            }
            config.server.data_dir = args.data_dir.clone();
            config.agent.data_dir = args.data_dir;
            config.agent.interval_ms = args.interval_ms;
            // Every simulated agent connects from 127.0.0.1: the per-address cap that keeps
            // one host from taking every slot would refuse most of a large demo's nodes.
            let agents = args.nodes as usize * 4 + 256;
            config.server.max_connections_per_ip = config.server.max_connections_per_ip.max(agents);
            config.server.max_connections = config.server.max_connections.max(agents + 1024);
            args.telemetry.apply(&mut config);
            config.check()?;
            let _telemetry = start_telemetry(&config, "perch-server")?;
            serve::demo(config, args.nodes, args.gpus_per_node, args.seed)
        }
        Command::Sql(args) => sql::run(args, file),
        Command::Simulate(args) => simulate::run(args, file),
        Command::Bench(args) => bench::run(args),
        Command::Submit(args) => jobs::submit(*args, file),
        Command::Jobs(args) => jobs::jobs(args, file),
        Command::Show(args) => jobs::show(args, file),
        Command::Rerun(args) => rerun::rerun(args, file),
        Command::Cancel(args) => jobs::cancel(args, file),
        Command::Logs(args) => jobs::logs(args, file),
        Command::Queue(args) => jobs::queue(args, file),
        Command::Nodes(args) => jobs::nodes(args, file),
        Command::Drain(args) => jobs::drain(args, file),
        Command::Resume(args) => jobs::set_drained(args, false, file),
        Command::Validate(args) => validate::run(args, file),
        Command::Alerts(args) => alerts::run(args, file),
        Command::Token(args) => token::run(args),
        Command::Ha(args) => ha::run(args, file),
    }
}
