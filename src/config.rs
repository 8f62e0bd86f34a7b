//! perch's configuration: a TOML file (`--config` or `PERCH_CONFIG`), then `PERCH_*`
//! environment variables, then command-line flags, each overriding the one before.
//! `perch.example.toml` at the repository root documents every key; a test keeps it complete.
//! The client commands read the same file for their server and token (see client.rs).

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerSection,
    pub query: QuerySection,
    pub agent: AgentSection,
    pub telemetry: TelemetrySection,
    pub accounting: AccountingSection,
    /// Alert rules, receivers, routing and remediation guardrails (see alerts/README.md).
    pub alerts: perch_alerts::AlertsConfig,
    /// Where the client commands (`sql`, `submit`, `jobs`, ...) send requests, with which token.
    pub client: ClientSection,
    /// Which users may charge which accounts, at which QOS (`[accounts.<name>]`).
    pub accounts: perch_control::accounts::AccountRules,
    /// The scheduling policy the server runs and `perch simulate` replays.
    pub scheduler: SchedulerSection,
    /// The file this came from, if any: the server reads its `[scheduler]` again on SIGHUP.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[client]`: the server and token of the client commands. Also the only section of the
/// per-user file `~/.config/perch/config.toml` (see client.rs for the order of precedence).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientSection {
    /// Server URL, e.g. `http://perch-server:7300`. Empty: derived from `[server] listen`
    /// when this file sets it.
    pub server: String,
    /// Bearer token (role user or operator). Empty: none.
    pub token: String,
    /// PEM certificates of a CA to trust for an `https://` server, besides the system's.
    /// Empty: the system's only.
    pub ca_file: PathBuf,
}

/// A config file as read: its path, its values (defaults filled in), and which keys the file
/// sets itself, since a client takes the server's address only from a file that names one.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub config: Config,
    table: toml::Table,
}

impl ConfigFile {
    pub fn read(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        ConfigFile::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<ConfigFile> {
        let in_file = || format!("in config file {}", path.display());
        let config = Config::parse(text).with_context(in_file)?;
        let table = toml::from_str(text).with_context(in_file)?;
        Ok(ConfigFile {
            path: path.to_owned(),
            config,
            table,
        })
    }

    /// Whether the file itself sets `[section] key` (rather than leaving the default).
    pub fn sets(&self, section: &str, key: &str) -> bool {
        self.table
            .get(section)
            .and_then(toml::Value::as_table)
            .is_some_and(|t| t.contains_key(key))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    pub listen: String,
    pub data_dir: PathBuf,
    pub flush_interval_secs: u64,
    pub flush_max_rows: usize,
    /// Most rows held in memory before ingest is refused with 503 (flushes failing).
    pub max_buffered_rows: usize,
    pub max_body_mb: usize,
    pub node_stale_after_secs: u64,
    /// How long a silent node's jobs count as running (its lease) before they are requeued.
    pub node_lease_secs: u64,
    /// Most pending jobs one user may have (array tasks count one each).
    pub max_pending_jobs_per_user: usize,
    /// Most MiB of command and environment one user's pending jobs may hold.
    pub max_pending_job_mb_per_user: usize,
    /// Most HTTP connections open at once; past it the one idle longest is closed for a new one,
    /// which waits when none is idle.
    pub max_connections: usize,
    /// Most HTTP connections open at once from one address; past it one idle of its own is
    /// closed for a new one, else 16 more are served on probation for agents' routes only.
    pub max_connections_per_ip: usize,
    /// An HTTP connection on which nothing moves this long is closed.
    pub idle_timeout_secs: u64,
    /// The most a request's head and body may take from their first byte (s).
    pub request_timeout_secs: u64,
    pub maintenance_interval_secs: u64,
    pub compact_below_mb: u64,
    pub compact_min_files: usize,
    /// Days of data kept per table, over the store's defaults (raw GPU and host samples 30,
    /// their 1-minute rollups 180, their 1-hour rollups 1095); 0 keeps a table forever.
    pub retention_days: std::collections::BTreeMap<String, u64>,
    /// Days a job's stored output (`perch logs`) is kept after the job ended; 0: for ever.
    pub job_output_days: u64,
    /// Most MiB of the server's disk one user's jobs' stored output may occupy; past it their
    /// new output is not stored (the job's timeline says so). 0: no bound.
    pub max_job_output_mb_per_user: u64,
    /// Most MiB of the server's disk all stored job output may occupy; past it no new output
    /// is stored. 0: no bound.
    pub max_job_output_total_mb: u64,
    /// Where the Parquet files and the manifest live.
    pub storage: StorageSection,
    /// Address of the PostgreSQL-protocol SQL listener; empty turns it off. With a tokens file
    /// clients log in with a token as their password; without one it is trust mode, loopback only.
    pub pg_listen: String,
    /// TOML file of accepted bearer tokens; empty runs open (loopback only).
    pub tokens_file: PathBuf,
    /// PEM certificate chain (the server's first) for TLS on HTTP and PostgreSQL; with
    /// `tls_key`. Empty: plain text.
    pub tls_cert: PathBuf,
    /// PEM private key of `tls_cert`.
    pub tls_key: PathBuf,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            listen: "127.0.0.1:7300".into(),
            data_dir: "./perch-data".into(),
            flush_interval_secs: 60,
            flush_max_rows: 1_000_000,
            max_buffered_rows: 4_000_000,
            max_body_mb: 64,
            node_stale_after_secs: 60,
            node_lease_secs: perch_control::DEFAULT_LEASE.as_secs(),
            max_pending_jobs_per_user: perch_control::DEFAULT_MAX_PENDING_PER_USER,
            max_pending_job_mb_per_user: perch_control::DEFAULT_MAX_PENDING_BYTES_PER_USER >> 20,
            max_connections: perch_server::listener::ConnectionLimits::default().max_connections,
            max_connections_per_ip: perch_server::listener::ConnectionLimits::default().max_per_ip,
            idle_timeout_secs: perch_server::listener::ConnectionLimits::default()
                .idle_timeout
                .as_secs(),
            request_timeout_secs: perch_server::listener::ConnectionLimits::default()
                .request_timeout
                .as_secs(),
            maintenance_interval_secs: 300,
            compact_below_mb: 64,
            compact_min_files: 8,
            retention_days: Default::default(),
            job_output_days: perch_control::DEFAULT_OUTPUT_RETENTION.as_secs() / 86_400,
            max_job_output_mb_per_user: perch_control::JobsConfig::default()
                .max_output_bytes_per_user
                .map_or(0, |b| b >> 20),
            max_job_output_total_mb: perch_control::JobsConfig::default()
                .max_output_bytes_total
                .map_or(0, |b| b >> 20),
            storage: StorageSection::default(),
            pg_listen: "127.0.0.1:7432".into(),
            tokens_file: PathBuf::new(),
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
        }
    }
}

/// `[server.storage]`: local disk, or an S3-compatible bucket. Empty values in the S3 settings
/// come from the usual `AWS_*` environment variables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageSection {
    /// "local" or "s3".
    pub kind: String,
    pub bucket: String,
    pub prefix: String,
    pub endpoint: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub allow_http: bool,
}

impl Default for StorageSection {
    fn default() -> Self {
        StorageSection {
            kind: "local".into(),
            bucket: String::new(),
            prefix: String::new(),
            endpoint: String::new(),
            region: String::new(),
            access_key_id: String::new(),
            secret_access_key: String::new(),
            allow_http: false,
        }
    }
}

impl StorageSection {
    fn store_config(&self) -> perch_query::StorageConfig {
        if self.kind != "s3" {
            return perch_query::StorageConfig::Local;
        }
        let set = |v: &String| Some(v.clone()).filter(|v| !v.is_empty());
        perch_query::StorageConfig::S3(perch_query::S3Config {
            bucket: self.bucket.clone(),
            prefix: self.prefix.clone(),
            endpoint: set(&self.endpoint),
            region: set(&self.region),
            access_key_id: set(&self.access_key_id),
            secret_access_key: set(&self.secret_access_key),
            allow_http: self.allow_http,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuerySection {
    pub timeout_secs: f64,
    pub max_rows: usize,
    pub memory_mb: usize,
    /// Memory all users' queries may hold together (MiB).
    pub total_memory_mb: usize,
    /// Users' queries that run at once.
    pub max_concurrent: usize,
    /// Temporary files all queries together may spill to (MiB); 0 turns spilling off.
    pub spill_mb: u64,
    /// The longest statement taken (KiB).
    pub max_statement_kb: usize,
    /// The deepest statement taken: operators chained, brackets, CASE and UNION nested
    /// (`perch_query::guard`).
    pub max_expression_depth: usize,
}

impl Default for QuerySection {
    fn default() -> Self {
        QuerySection {
            timeout_secs: 30.0,
            max_rows: 100_000,
            memory_mb: 1024,
            total_memory_mb: 2048,
            max_concurrent: 4,
            spill_mb: 4096,
            max_statement_kb: perch_query::guard::DEFAULT_MAX_BYTES >> 10,
            max_expression_depth: perch_query::guard::DEFAULT_MAX_DEPTH,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentSection {
    pub server: String,
    /// Empty: the machine's hostname.
    pub node: String,
    /// Rack or switch label; empty: from `topology_file`, else "default".
    pub rack: String,
    /// A topology file shared by all nodes (`perch_collector::topology`); empty: none.
    pub topology_file: PathBuf,
    /// The address other nodes reach this one at; empty: the local address of the route to
    /// the server.
    pub advertise_addr: String,
    pub interval_ms: u64,
    pub data_dir: PathBuf,
    /// "auto", "off", or the path of an NVML library to load.
    pub nvml: String,
    /// How often NVML's costly fields are read (0: every sample).
    pub nvml_slow_interval_ms: u64,
    pub simulate_gpus: u32,
    pub max_queue_batches: usize,
    pub max_batch_rounds: usize,
    pub spool_max_mb: u64,
    /// Most output (stdout and stderr together) one job may write on the node, MiB: the agent
    /// stops a job that writes more, so a print in a tight loop cannot fill the node's disk.
    pub max_job_output_mb: u64,
    /// On a graceful stop, leave running jobs to the next agent (within the lease).
    pub keep_jobs_on_exit: bool,
    /// Bearer token (role agent) for a server that requires authentication.
    pub token: String,
    /// PEM certificates of a CA to trust for an `https://` server, besides the system's.
    pub ca_file: PathBuf,
    /// Take jobs asking for a part of a GPU.
    pub gpu_sharing: bool,
    /// NVLink islands of this node's GPUs; empty: what NVML says (one island if it cannot).
    pub nvlink_islands: Vec<Vec<u32>>,
    /// "required", "if_possible" or "never".
    pub run_as_user: String,
    /// "auto", "off", or the path of a cgroup v2 directory delegated to the agent.
    pub cgroups: String,
    /// Jobs never switch to a user below this uid (root never), except those listed below.
    pub min_uid: u32,
    /// System users (uid below `min_uid`) that jobs may run as; root is never allowed.
    pub allowed_system_users: Vec<String>,
    /// Where `perch agent` serves its node-local `GET /metrics` (`host:port`); empty: nowhere.
    pub metrics_listen: String,
}

impl Default for AgentSection {
    fn default() -> Self {
        AgentSection {
            server: "http://127.0.0.1:7300".into(),
            node: String::new(),
            rack: String::new(),
            topology_file: PathBuf::new(),
            advertise_addr: String::new(),
            interval_ms: 1000,
            data_dir: "./perch-data".into(),
            nvml: "auto".into(),
            nvml_slow_interval_ms: perch_collector::gpu::nvml::DEFAULT_SLOW_INTERVAL_MS as u64,
            simulate_gpus: 0,
            max_queue_batches: 60,
            max_batch_rounds: 60,
            spool_max_mb: 256,
            max_job_output_mb: perch_collector::launcher::DEFAULT_OUTPUT_LIMIT >> 20,
            keep_jobs_on_exit: true,
            token: String::new(),
            ca_file: PathBuf::new(),
            gpu_sharing: false,
            nvlink_islands: Vec::new(),
            run_as_user: "if_possible".into(),
            cgroups: "auto".into(),
            min_uid: perch_collector::launcher::identity::DEFAULT_MIN_UID,
            allowed_system_users: Vec::new(),
            metrics_listen: String::new(),
        }
    }
}

/// `[telemetry]`: perch's own traces and metrics, pushed over OTLP/HTTP (protobuf) to a
/// backend the site already runs (an OpenTelemetry Collector, Tempo, Jaeger, another perch's
/// `/v1/metrics`). Off unless an endpoint is set here, by `--otlp-endpoint` /
/// `PERCH_OTLP_ENDPOINT`, or by the standard `OTEL_EXPORTER_OTLP_ENDPOINT`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySection {
    /// Base URL of the OTLP/HTTP receiver, e.g. `http://collector:4318`; spans go to
    /// `<base>/v1/traces` and metrics to `<base>/v1/metrics`. Empty: off, unless
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
    pub otlp_endpoint: String,
    /// The `service.name` resource attribute. Empty: `OTEL_SERVICE_NAME` if set, else
    /// `perch-server` (server, up, demo) or `perch-agent` (agent).
    pub service_name: String,
    /// Seconds between two exports of perch's metrics.
    pub export_interval_secs: u64,
    /// Extra HTTP headers on every export, e.g. `Authorization = "Bearer ..."`.
    /// `OTEL_EXPORTER_OTLP_HEADERS` adds more.
    pub headers: std::collections::BTreeMap<String, String>,
}

impl Default for TelemetrySection {
    fn default() -> Self {
        TelemetrySection {
            otlp_endpoint: String::new(),
            service_name: String::new(),
            export_interval_secs: 60,
            headers: Default::default(),
        }
    }
}

impl TelemetrySection {
    /// Checks the keys of `[telemetry]`; the message names the key and what to write instead.
    fn check(&self) -> Result<()> {
        let e = &self.otlp_endpoint;
        if !(e.is_empty() || e.starts_with("http://") || e.starts_with("https://")) {
            anyhow::bail!(
                "config key telemetry.otlp_endpoint: {e:?} must be an http:// or https:// URL such as http://collector:4318 (\"\" turns export off)"
            );
        }
        if self.export_interval_secs == 0 {
            anyhow::bail!("config key telemetry.export_interval_secs: must be at least 1");
        }
        for (name, value) in &self.headers {
            let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
            if name.is_empty() || !name.chars().all(token) {
                anyhow::bail!(
                    "config key telemetry.headers: {name:?} is not an HTTP header name (letters, digits and - only, e.g. Authorization)"
                );
            }
            if value.chars().any(|c| c.is_control()) {
                anyhow::bail!(
                    "config key telemetry.headers.{name}: the value has a control character (a line break?); give it on one line"
                );
            }
        }
        Ok(())
    }
}

/// `[accounting]`: prices, and how often job accounting folds telemetry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccountingSection {
    /// Seconds between folds of running jobs' telemetry into their accounting.
    pub fold_interval_secs: u64,
    /// Samples are folded once this many seconds old; later arrivals are not counted.
    pub settle_secs: u64,
    /// Price of a GPU-hour of models not in `gpu_prices`.
    pub gpu_price_per_hour: f64,
    /// Price of a kWh of GPU energy, added to allocated and used cost.
    pub energy_price_per_kwh: f64,
    /// Price of a GPU-hour by GPU model (as `gpu_samples.model` names it).
    pub gpu_prices: std::collections::BTreeMap<String, f64>,
}

impl Default for AccountingSection {
    fn default() -> Self {
        AccountingSection {
            fold_interval_secs: 300,
            settle_secs: 120,
            gpu_price_per_hour: 0.95,
            energy_price_per_kwh: 0.0,
            gpu_prices: Default::default(),
        }
    }
}

impl AccountingSection {
    /// Checks the keys of `[accounting]`; the message names the key.
    fn check(&self) -> Result<()> {
        if self.fold_interval_secs == 0 {
            anyhow::bail!("config key accounting.fold_interval_secs: must be at least 1");
        }
        let price = |key: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "config key {key}: {v} is not a price; give a number of at least 0"
                ))
            }
        };
        price("accounting.gpu_price_per_hour", self.gpu_price_per_hour)?;
        price("accounting.energy_price_per_kwh", self.energy_price_per_kwh)?;
        for (model, v) in &self.gpu_prices {
            price(&format!("accounting.gpu_prices.{model:?}"), *v)?;
        }
        Ok(())
    }

    fn server_config(&self) -> perch_server::accounting::AccountingConfig {
        perch_server::accounting::AccountingConfig {
            fold_interval: Duration::from_secs(self.fold_interval_secs),
            settle: Duration::from_secs(self.settle_secs),
            prices: perch_server::accounting::Prices {
                default_gpu_per_hour: self.gpu_price_per_hour,
                gpu_per_hour: self.gpu_prices.clone(),
                energy_per_kwh: self.energy_price_per_kwh,
            },
        }
    }
}

/// `[scheduler]`: which policy orders and places jobs, with its weights, quotas and idle
/// rules. The server runs it (SIGHUP reads it again; queued and running jobs stay) and
/// `perch simulate --config` replays a trace under it: one policy, two entry points.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSection {
    /// `perch` (multifactor priority, EASY backfill, quotas with borrowing and reclaim, idle
    /// detection), `backfill` (submit order with EASY backfill) or `fifo`.
    pub policy: String,
    /// Weights of the priority factors (policy `perch`).
    pub weights: WeightsSection,
    /// Waiting time at which the age factor reaches 1.
    pub age_max: perch_alerts::HumanDuration,
    /// Half-life of past usage in the fair-share factor.
    pub usage_half_life: perch_alerts::HumanDuration,
    /// Requested GPU-hours (GPUs x time limit) at which the size factor reaches 0.
    pub size_max_gpu_hours: f64,
    /// Priorities are recomputed at most this often (Slurm's PriorityCalcPeriod).
    pub priority_period: perch_alerts::HumanDuration,
    /// GPUs each account may hold (`vision = 32`). Empty: no quotas. Otherwise an account
    /// not listed has a quota of 0 (it runs only on borrowed GPUs).
    pub quotas: std::collections::BTreeMap<String, u32>,
    /// Per-model caps (`[scheduler.model_quotas.vision]` with `"NVIDIA H100 80GB HBM3" = 8`):
    /// the account may hold at most that many GPUs of the model (the name as `perch nodes`
    /// shows it), within its quota in all if it has one. Models not named are limited only by
    /// that quota; a job without a model constraint goes to the models where it has room.
    pub model_quotas: std::collections::BTreeMap<String, std::collections::BTreeMap<String, u32>>,
    /// An account at its quota may run preemptible jobs on idle GPUs; they can be reclaimed.
    /// A job that may not be preempted never borrows, and one that asks for more than its
    /// account's quota on its own is refused unless it may be (always, borrowing off).
    pub borrowing: bool,
    /// An account within its quota preempts borrowers (their checkpoint signal, then their
    /// grace) to get its GPUs back: those it has stopped least often first, then the least
    /// work at stake.
    pub reclaim: bool,
    /// Most running jobs one scheduling pass may examine as reclaim victims.
    pub max_reclaims_per_pass: usize,
    /// The longest checkpoint grace a job gets when the scheduler stops it for another job
    /// (quota reclaim, the starvation bound, idle reclaim, an eviction): its own `grace_secs`,
    /// at most this, so a borrower declaring an hour's grace cannot hold an account's
    /// guaranteed GPUs for that hour. A cancel or a time limit keeps the job's own grace.
    pub preemption_grace_max: perch_alerts::HumanDuration,
    /// A job that has waited longer than this many times its time limit (twice that for QOS
    /// low) goes before every job that has not, the longest-waiting first (policy `perch`);
    /// 0: never.
    pub starved_after_limits: f64,
    /// A one-node job past that bound that still cannot fit stops running preemptible jobs
    /// that declared longer time limits and are on their first run (checkpoint signal, then
    /// their grace), the least work at stake first; each job is stopped this way at most once.
    /// An account past its quota does not reclaim this way, and a user has one run begun this
    /// way at a time.
    pub starved_reclaim: bool,
    /// The finish factor reads a job's time limit scaled by the part of their limits its user's
    /// recent finished jobs ran (their median, over the user's last 32 completed or timed-out
    /// runs of the same GPU request, or of any, from 3 on), so a user who always declares the
    /// maximum is not ranked by it. The limit itself still ends the run and bounds backfill.
    /// At start the server rebuilds it from the finished jobs of its database (policy `perch`).
    pub predict_from_history: bool,
    /// Allocated-but-idle GPUs.
    pub idle: IdleSection,
}

/// `[scheduler.weights]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WeightsSection {
    pub age: f64,
    pub fairshare: f64,
    pub qos: f64,
    pub size: f64,
    /// Finish-time fairness (Themis' `rho`, scheduler/README.md).
    pub finish: f64,
}

/// `[scheduler.idle]`: a job whose GPUs all stay below `below_percent` for `after` is
/// reported (its timeline, the `JobIdle` alert to its user); with `action` `requeue` or
/// `stop`, a preemptible one still idle `grace` later is preempted when other jobs wait.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IdleSection {
    /// `off`, `report`, `requeue` or `stop`.
    pub action: String,
    pub below_percent: f64,
    pub after: perch_alerts::HumanDuration,
    pub grace: perch_alerts::HumanDuration,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        let perch = perch_scheduler::Config::perch(Vec::new());
        let human = perch_alerts::HumanDuration::from_ms;
        SchedulerSection {
            policy: "perch".into(),
            weights: WeightsSection {
                age: perch.weights.age,
                fairshare: perch.weights.fairshare,
                qos: perch.weights.qos,
                size: perch.weights.size,
                finish: perch.weights.finish,
            },
            age_max: human(perch.age_max),
            usage_half_life: human(perch.usage_half_life),
            size_max_gpu_hours: perch.size_max_gpu_seconds / 3600.0,
            priority_period: human(perch.priority_period),
            quotas: Default::default(),
            model_quotas: Default::default(),
            borrowing: perch.borrowing,
            reclaim: perch.reclaim,
            max_reclaims_per_pass: perch.max_reclaims_per_pass,
            preemption_grace_max: human(perch.preemption_grace_max),
            starved_after_limits: perch.starved_after_limits,
            starved_reclaim: perch.starved_reclaim,
            predict_from_history: perch.predict_from_history,
            idle: IdleSection::default(),
        }
    }
}

impl Default for WeightsSection {
    fn default() -> Self {
        SchedulerSection::default().weights
    }
}

impl Default for IdleSection {
    fn default() -> Self {
        let perch = perch_scheduler::Config::perch(Vec::new());
        IdleSection {
            action: "report".into(),
            below_percent: f64::from(perch.idle.threshold_pct),
            after: perch_alerts::HumanDuration::from_ms(perch.idle.window),
            grace: perch_alerts::HumanDuration::from_ms(perch.idle.grace),
        }
    }
}

impl SchedulerSection {
    /// The section that describes `policy` (`perch simulate --show-config`: start a config from
    /// what a replay ran); `None` for the simulator's reference policies: SRTF, which needs
    /// true durations no server has, and the scorecard's anchors: LAS and Gittins, which need
    /// no duration, and Themis' finish-time fairness.
    pub fn from_policy(policy: &perch_scheduler::Config) -> Option<SchedulerSection> {
        use perch_scheduler::{IdleAction, PolicyKind};
        let human = perch_alerts::HumanDuration::from_ms;
        let name = match policy.kind {
            PolicyKind::Perch => "perch",
            PolicyKind::Backfill => "backfill",
            PolicyKind::Fifo => "fifo",
            PolicyKind::Srtf | PolicyKind::Las | PolicyKind::Gittins | PolicyKind::Themis => {
                return None;
            }
        };
        Some(SchedulerSection {
            policy: name.into(),
            weights: WeightsSection {
                age: policy.weights.age,
                fairshare: policy.weights.fairshare,
                qos: policy.weights.qos,
                size: policy.weights.size,
                finish: policy.weights.finish,
            },
            age_max: human(policy.age_max),
            usage_half_life: human(policy.usage_half_life),
            size_max_gpu_hours: policy.size_max_gpu_seconds / 3600.0,
            priority_period: human(policy.priority_period),
            quotas: policy
                .quotas
                .iter()
                .map(|(a, q)| (a.0.clone(), *q))
                .collect(),
            model_quotas: policy.model_quotas.iter().fold(
                std::collections::BTreeMap::new(),
                |mut all, (a, m, q)| {
                    all.entry(a.0.clone())
                        .or_insert_with(std::collections::BTreeMap::new)
                        .insert(m.0.clone(), *q);
                    all
                },
            ),
            borrowing: policy.borrowing,
            reclaim: policy.reclaim,
            max_reclaims_per_pass: policy.max_reclaims_per_pass,
            preemption_grace_max: human(policy.preemption_grace_max),
            starved_after_limits: policy.starved_after_limits,
            starved_reclaim: policy.starved_reclaim,
            predict_from_history: policy.predict_from_history,
            idle: IdleSection {
                action: match policy.idle.action {
                    IdleAction::Off => "off",
                    IdleAction::Report => "report",
                    IdleAction::Reclaim { requeue: true } => "requeue",
                    IdleAction::Reclaim { requeue: false } => "stop",
                }
                .into(),
                below_percent: f64::from(policy.idle.threshold_pct),
                after: human(policy.idle.window),
                grace: human(policy.idle.grace),
            },
        })
    }

    /// Checks the keys of `[scheduler]`; the message names the key.
    pub fn check(&self) -> Result<()> {
        self.policy().map(|_| ())
    }

    /// The scheduler core's policy this section describes, or what to change (naming the key).
    pub fn policy(&self) -> Result<perch_scheduler::Config> {
        use perch_scheduler::{Account, Config as Policy, IdleAction};
        let bad = |key: &str, why: String| anyhow::anyhow!("config key scheduler.{key}: {why}");
        let mut c = match self.policy.as_str() {
            "perch" => Policy::perch(Vec::new()),
            "backfill" => Policy::backfill(),
            "fifo" => Policy::fifo(),
            "srtf" => {
                return Err(bad(
                    "policy",
                    "srtf needs every job's true duration, which only a trace replay knows (perch simulate --policy srtf); choose perch, backfill or fifo".into(),
                ));
            }
            other => {
                return Err(bad(
                    "policy",
                    format!("{other:?} is not a policy; choose perch, backfill or fifo"),
                ));
            }
        };
        for (key, w) in [
            ("age", self.weights.age),
            ("fairshare", self.weights.fairshare),
            ("qos", self.weights.qos),
            ("size", self.weights.size),
            ("finish", self.weights.finish),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(bad(
                    &format!("weights.{key}"),
                    format!("{w} is not a weight; give a number of at least 0"),
                ));
            }
        }
        c.weights = perch_scheduler::Weights {
            age: self.weights.age,
            fairshare: self.weights.fairshare,
            qos: self.weights.qos,
            size: self.weights.size,
            finish: self.weights.finish,
        };
        for (key, d) in [
            ("age_max", self.age_max),
            ("usage_half_life", self.usage_half_life),
            ("priority_period", self.priority_period),
        ] {
            if d.is_zero() {
                return Err(bad(
                    key,
                    "must be longer than 0, like \"7d\" or \"5m\"".into(),
                ));
            }
        }
        c.age_max = self.age_max.as_ms();
        c.usage_half_life = self.usage_half_life.as_ms();
        c.priority_period = self.priority_period.as_ms();
        if !(self.size_max_gpu_hours.is_finite() && self.size_max_gpu_hours > 0.0) {
            return Err(bad(
                "size_max_gpu_hours",
                format!(
                    "{} must be a number of GPU-hours above 0",
                    self.size_max_gpu_hours
                ),
            ));
        }
        c.size_max_gpu_seconds = self.size_max_gpu_hours * 3600.0;
        if !(self.starved_after_limits.is_finite() && self.starved_after_limits >= 0.0) {
            return Err(bad(
                "starved_after_limits",
                format!(
                    "{} must be a number of time limits of at least 0 (0: never)",
                    self.starved_after_limits
                ),
            ));
        }
        if self.policy == "perch" {
            c.starved_after_limits = self.starved_after_limits;
            c.starved_reclaim = self.starved_reclaim;
            c.predict_from_history = self.predict_from_history;
        }
        for (account, gpus) in &self.quotas {
            if account.trim().is_empty() || account.len() > 128 {
                return Err(bad(
                    "quotas",
                    format!("{account:?} is not an account name (1 to 128 characters)"),
                ));
            }
            if *gpus > 1_000_000 {
                return Err(bad(
                    &format!("quotas.{account}"),
                    format!("{gpus} GPUs is more than any cluster has"),
                ));
            }
        }
        c.quotas = self
            .quotas
            .iter()
            .map(|(a, q)| (Account(a.clone()), *q))
            .collect();
        for (account, caps) in &self.model_quotas {
            if account.trim().is_empty() || account.len() > 128 {
                return Err(bad(
                    "model_quotas",
                    format!("{account:?} is not an account name (1 to 128 characters)"),
                ));
            }
            for (model, gpus) in caps {
                let key = format!("model_quotas.{account}.{model:?}");
                if model.trim().is_empty() || model.len() > 256 {
                    return Err(bad(
                        &key,
                        "a GPU model is named as `perch nodes` shows it (1 to 256 characters)"
                            .into(),
                    ));
                }
                if *gpus > 1_000_000 {
                    return Err(bad(
                        &key,
                        format!("{gpus} GPUs is more than any cluster has"),
                    ));
                }
                c.model_quotas.push((
                    Account(account.clone()),
                    perch_scheduler::GpuModel(model.clone()),
                    *gpus,
                ));
            }
        }
        c.borrowing = self.borrowing;
        c.reclaim = self.reclaim;
        if self.max_reclaims_per_pass == 0 || self.max_reclaims_per_pass > 10_000 {
            return Err(bad(
                "max_reclaims_per_pass",
                format!("{} must be 1 to 10000", self.max_reclaims_per_pass),
            ));
        }
        c.max_reclaims_per_pass = self.max_reclaims_per_pass;
        if self.preemption_grace_max.as_ms() > 3600 * 1000 {
            return Err(bad(
                "preemption_grace_max",
                "must be at most \"1h\", the longest grace a job may declare".into(),
            ));
        }
        c.preemption_grace_max = self.preemption_grace_max.as_ms();
        let idle = &self.idle;
        c.idle.action = match idle.action.as_str() {
            "off" => IdleAction::Off,
            "report" => IdleAction::Report,
            "requeue" => IdleAction::Reclaim { requeue: true },
            "stop" => IdleAction::Reclaim { requeue: false },
            other => {
                return Err(bad(
                    "idle.action",
                    format!("{other:?} is not an idle action; choose off, report, requeue or stop"),
                ));
            }
        };
        if !(0.0..=100.0).contains(&idle.below_percent) {
            return Err(bad(
                "idle.below_percent",
                format!("{} is not a percentage (0 to 100)", idle.below_percent),
            ));
        }
        c.idle.threshold_pct = idle.below_percent as f32;
        if idle.after.as_ms() < 10 * perch_scheduler::SECOND {
            return Err(bad(
                "idle.after",
                "must be at least \"10s\" (minutes are usual: shorter spells are a job's normal pauses)".into(),
            ));
        }
        c.idle.window = idle.after.as_ms();
        c.idle.grace = idle.grace.as_ms();
        Ok(c)
    }
}

impl Config {
    pub fn parse(text: &str) -> Result<Config> {
        let config: Config = toml::from_str(text)?;
        config.check()?;
        Ok(config)
    }

    /// Checks values serde cannot; the message names the key.
    pub fn check(&self) -> Result<()> {
        let bad = |key: &str, why: &str| Err(anyhow::anyhow!("config key {key}: {why}"));
        // Without tokens the PostgreSQL listener runs in trust mode (no password): loopback only.
        // With tokens, clients log in with a token as their password, as on HTTP.
        if self.server.tokens_file.as_os_str().is_empty()
            && let Ok(a) = self.server.pg_listen.parse::<std::net::SocketAddr>()
            && !a.ip().is_loopback()
        {
            return bad(
                "server.pg_listen",
                &format!(
                    "{a} is not a loopback address; without server.tokens_file the PostgreSQL listener runs in trust mode (no password) and listens on loopback only: set tokens_file, and clients log in with a token as their password"
                ),
            );
        }
        if self.server.tokens_file.as_os_str().is_empty()
            && let Ok(a) = self.server.listen.parse::<std::net::SocketAddr>()
            && !a.ip().is_loopback()
        {
            return bad(
                "server.listen",
                &format!(
                    "{a} is not a loopback address; without server.tokens_file perch runs open (no authentication) and listens on loopback only: set tokens_file"
                ),
            );
        }
        if self.server.listen.parse::<std::net::SocketAddr>().is_err() {
            return bad(
                "server.listen",
                &format!(
                    "{:?} is not an address like 127.0.0.1:7300",
                    self.server.listen
                ),
            );
        }
        if !self.server.pg_listen.is_empty()
            && self
                .server
                .pg_listen
                .parse::<std::net::SocketAddr>()
                .is_err()
        {
            return bad(
                "server.pg_listen",
                &format!(
                    "{:?} is not an address like 127.0.0.1:7432 (empty turns the listener off)",
                    self.server.pg_listen
                ),
            );
        }
        // Durations and sizes a server adds to clocks and multiplies into bytes: bounded, so a
        // careless value is named here, not met as a panic on the first idle connection
        // (`idle_timeout_secs = 9223372036854775807` overflowed `Instant`) or as a server that
        // refuses every request (`max_body_mb = 0`) or marks every node down (a node goes
        // stale within `node_stale_after_secs = 0`).
        const DAY: u64 = 86_400;
        const WEEK: u64 = 7 * DAY;
        // Sizes in MiB become bytes (`<< 20`): a pebibyte at most, far from wrapping.
        const PIB: u64 = 1 << 30;
        let within = |key: &str, value: u64, min: u64, max: u64, unit: &str| -> Result<()> {
            if (min..=max).contains(&value) {
                return Ok(());
            }
            bad(key, &format!("must be {min} to {max} {unit}, got {value}"))
        };
        let (srv, secs, mib) = (&self.server, "seconds", "MiB");
        within(
            "server.flush_interval_secs",
            srv.flush_interval_secs,
            1,
            DAY,
            secs,
        )?;
        within(
            "server.node_stale_after_secs",
            srv.node_stale_after_secs,
            2,
            DAY,
            secs,
        )?;
        within("server.node_lease_secs", srv.node_lease_secs, 3, WEEK, secs)?;
        within(
            "server.idle_timeout_secs",
            srv.idle_timeout_secs,
            1,
            WEEK,
            secs,
        )?;
        within(
            "server.request_timeout_secs",
            srv.request_timeout_secs,
            1,
            DAY,
            secs,
        )?;
        within(
            "server.maintenance_interval_secs",
            srv.maintenance_interval_secs,
            1,
            DAY,
            secs,
        )?;
        within("server.max_body_mb", srv.max_body_mb as u64, 1, 4096, mib)?;
        within("server.compact_below_mb", srv.compact_below_mb, 0, PIB, mib)?;
        within("query.memory_mb", self.query.memory_mb as u64, 0, PIB, mib)?;
        within(
            "query.total_memory_mb",
            self.query.total_memory_mb as u64,
            0,
            PIB,
            mib,
        )?;
        within("query.spill_mb", self.query.spill_mb, 0, PIB, mib)?;
        within("agent.spool_max_mb", self.agent.spool_max_mb, 0, PIB, mib)?;
        let output = self.agent.max_job_output_mb;
        within("agent.max_job_output_mb", output, 1, PIB, mib)?;
        within(
            "agent.interval_ms",
            self.agent.interval_ms,
            10,
            3_600_000,
            "milliseconds",
        )?;
        let acct = &self.accounting;
        within(
            "accounting.fold_interval_secs",
            acct.fold_interval_secs,
            1,
            DAY,
            secs,
        )?;
        within("accounting.settle_secs", acct.settle_secs, 0, WEEK, secs)?;
        let export = self.telemetry.export_interval_secs;
        within("telemetry.export_interval_secs", export, 1, DAY, secs)?;
        if self.server.job_output_days > 36_500 {
            return bad(
                "server.job_output_days",
                &format!(
                    "must be at most 36500 days (100 years; 0 keeps output for ever), got {}",
                    self.server.job_output_days
                ),
            );
        }
        for (key, mb) in [
            (
                "server.max_job_output_mb_per_user",
                self.server.max_job_output_mb_per_user,
            ),
            (
                "server.max_job_output_total_mb",
                self.server.max_job_output_total_mb,
            ),
        ] {
            if mb > 1 << 30 {
                return bad(
                    key,
                    &format!("must be at most 1073741824 MiB (1 PiB; 0 is no bound), got {mb}"),
                );
            }
        }
        for (table, days) in &self.server.retention_days {
            if *days > 36_500 {
                return bad(
                    &format!("server.retention_days.{table}"),
                    &format!("must be at most 36500 days (100 years), got {days}"),
                );
            }
        }
        if !(self.query.timeout_secs > 0.0 && self.query.timeout_secs <= DAY as f64) {
            return bad(
                "query.timeout_secs",
                &format!(
                    "must be above 0 and at most {DAY} seconds, got {}",
                    self.query.timeout_secs
                ),
            );
        }
        if self.server.node_lease_secs <= self.server.node_stale_after_secs {
            return bad(
                "server.node_lease_secs",
                &format!(
                    "must be longer than server.node_stale_after_secs ({} s): a node is marked down first, and its jobs are requeued only when its lease runs out",
                    self.server.node_stale_after_secs
                ),
            );
        }
        if self.server.max_connections < 16 {
            return bad(
                "server.max_connections",
                "must be at least 16 (agents, clients and scrapers share them)",
            );
        }
        if (self.server.idle_timeout_secs as f64) <= self.query.timeout_secs {
            return bad(
                "server.idle_timeout_secs",
                &format!(
                    "must be longer than query.timeout_secs ({} s), so that no answer being computed counts as idle",
                    self.query.timeout_secs
                ),
            );
        }
        if self.server.max_pending_jobs_per_user == 0 {
            return bad("server.max_pending_jobs_per_user", "must be at least 1");
        }
        if !(1..=1 << 20).contains(&self.server.max_pending_job_mb_per_user) {
            return bad(
                "server.max_pending_job_mb_per_user",
                "must be 1 to 1048576 (MiB of command and environment of one user's pending jobs)",
            );
        }
        if let Err(e) = perch_control::accounts::validate(&self.accounts) {
            anyhow::bail!("config key {e}");
        }
        if self.server.flush_interval_secs == 0 {
            return bad("server.flush_interval_secs", "must be at least 1");
        }
        for table in self.server.retention_days.keys() {
            if perch_query::Table::from_name(table).is_none() {
                let names: Vec<_> = perch_query::Table::ALL.iter().map(|t| t.name()).collect();
                return bad(
                    &format!("server.retention_days.{table}"),
                    &format!("no such table; the tables are {}", names.join(", ")),
                );
            }
        }
        let storage = &self.server.storage;
        match storage.kind.as_str() {
            "local" if !storage.bucket.is_empty() => {
                return bad(
                    "server.storage.bucket",
                    "is set but server.storage.kind is \"local\"; set kind = \"s3\" to use the bucket",
                );
            }
            "local" => {}
            "s3" if storage.bucket.is_empty() => {
                return bad(
                    "server.storage.bucket",
                    "kind = \"s3\" needs the bucket's name",
                );
            }
            "s3" => {}
            other => {
                return bad(
                    "server.storage.kind",
                    &format!("{other:?} is not a storage kind; use \"local\" or \"s3\""),
                );
            }
        }
        if self.server.compact_min_files < 2 || self.server.maintenance_interval_secs == 0 {
            return bad(
                "server.compact_min_files / server.maintenance_interval_secs",
                "must be at least 2 and 1",
            );
        }
        if !(self.query.timeout_secs > 0.0 && self.query.timeout_secs.is_finite()) {
            return bad("query.timeout_secs", "must be a positive number of seconds");
        }
        if self.query.max_rows == 0 || self.query.memory_mb == 0 {
            return bad("query.max_rows / query.memory_mb", "must be at least 1");
        }
        if self.server.max_buffered_rows < self.server.flush_max_rows.saturating_mul(2) {
            return bad(
                "server.max_buffered_rows",
                &format!(
                    "must be at least twice server.flush_max_rows ({}), so ingest goes on while a flush is written",
                    self.server.flush_max_rows
                ),
            );
        }
        if self.server.max_connections_per_ip == 0
            || self.server.max_connections_per_ip > self.server.max_connections
        {
            return bad(
                "server.max_connections_per_ip",
                &format!(
                    "must be between 1 and server.max_connections ({})",
                    self.server.max_connections
                ),
            );
        }
        if self.query.total_memory_mb < self.query.memory_mb {
            return bad(
                "query.total_memory_mb",
                &format!(
                    "must be at least query.memory_mb ({} MiB), or no query could use its own limit",
                    self.query.memory_mb
                ),
            );
        }
        if !(1..=64 << 10).contains(&self.query.max_statement_kb) {
            return bad(
                "query.max_statement_kb",
                "must be between 1 and 65536 (64 MiB)",
            );
        }
        if !(16..=perch_query::guard::MAX_MAX_DEPTH).contains(&self.query.max_expression_depth) {
            return bad(
                "query.max_expression_depth",
                &format!(
                    "must be between 16 and {}: the SQL threads' stacks grow with it",
                    perch_query::guard::MAX_MAX_DEPTH
                ),
            );
        }
        if !(1..=1024).contains(&self.query.max_concurrent) {
            return bad("query.max_concurrent", "must be between 1 and 1024");
        }
        if self.agent.simulate_gpus > perch_scheduler::MAX_GPUS_PER_NODE {
            return bad(
                "agent.simulate_gpus",
                &format!(
                    "must be 0 (none) to {}, the most GPUs a node may have, got {}",
                    perch_scheduler::MAX_GPUS_PER_NODE,
                    self.agent.simulate_gpus
                ),
            );
        }
        if self.agent.interval_ms < 10 {
            return bad(
                "agent.interval_ms",
                "must be at least 10 (100 samples a second)",
            );
        }
        self.telemetry.check()?;
        self.accounting.check()?;
        self.scheduler.check()?;
        self.alerts
            .validate()
            .map_err(|e| anyhow::anyhow!("config section [alerts]: {e}"))?;
        if let Err(e) = perch_collector::launcher::RunAsUser::parse(&self.agent.run_as_user) {
            return bad("agent.run_as_user", &e);
        }
        if let Err(e) = perch_collector::launcher::CgroupMode::parse(&self.agent.cgroups) {
            return bad("agent.cgroups", &e);
        }
        if self.agent.min_uid == 0 {
            return bad(
                "agent.min_uid",
                "must be at least 1: jobs never run as root (uid 0)",
            );
        }
        if let Some(u) = self
            .agent
            .allowed_system_users
            .iter()
            .find(|u| u.is_empty() || u.as_str() == "root")
        {
            return bad(
                "agent.allowed_system_users",
                &format!("{u:?} cannot be allowed: jobs never run as root, and a name is needed"),
            );
        }
        let metrics_listen = &self.agent.metrics_listen;
        if !metrics_listen.is_empty() && metrics_listen.parse::<std::net::SocketAddr>().is_err() {
            return bad(
                "agent.metrics_listen",
                &format!(
                    "{metrics_listen:?} must be an address such as 127.0.0.1:9400, or empty for none"
                ),
            );
        }
        if !(self.agent.server.starts_with("http://") || self.agent.server.starts_with("https://"))
        {
            return bad(
                "agent.server",
                &format!(
                    "{:?} must be a URL such as http://perch-server:7300",
                    self.agent.server
                ),
            );
        }
        let client = &self.client.server;
        if !(client.is_empty() || client.starts_with("http://") || client.starts_with("https://")) {
            return bad(
                "client.server",
                &format!(
                    "{client:?} must be a URL such as http://perch-server:7300 (\"\" derives it from server.listen)"
                ),
            );
        }
        Ok(())
    }

    pub fn server_config(&self) -> Result<perch_server::ServerConfig> {
        let s = &self.server;
        let mut store = perch_query::StoreConfig::new(&s.data_dir);
        store.flush_interval = Duration::from_secs(s.flush_interval_secs);
        store.flush_max_rows = s.flush_max_rows;
        store.max_buffered_rows = s.max_buffered_rows;
        store.maintenance_interval = Duration::from_secs(s.maintenance_interval_secs);
        store.compact_below_bytes = s.compact_below_mb << 20;
        store.compact_min_files = s.compact_min_files;
        store.storage = s.storage.store_config();
        for (name, days) in &s.retention_days {
            if let Some(table) = perch_query::Table::from_name(name) {
                if *days == 0 {
                    store.retention.remove(&table);
                } else {
                    store
                        .retention
                        .insert(table, Duration::from_secs(days * 86_400));
                }
            }
        }
        let mut config = perch_server::ServerConfig::new(store);
        config.query = perch_query::QueryLimits {
            timeout: Duration::from_secs_f64(self.query.timeout_secs),
            max_rows: self.query.max_rows,
            memory_bytes: self.query.memory_mb << 20,
            total_memory_bytes: self.query.total_memory_mb << 20,
            max_concurrent: self.query.max_concurrent,
            spill_bytes: self.query.spill_mb << 20,
            max_statement_bytes: self.query.max_statement_kb << 10,
            max_expression_depth: self.query.max_expression_depth,
        };
        config.max_body_bytes = s.max_body_mb << 20;
        config.node_stale_after = Duration::from_secs(s.node_stale_after_secs);
        config.jobs.heartbeat_timeout = Duration::from_secs(s.node_stale_after_secs);
        config.jobs.lease = Duration::from_secs(s.node_lease_secs);
        config.jobs.accounts = self.accounts.clone();
        config.jobs.max_pending_per_user = s.max_pending_jobs_per_user;
        config.jobs.max_pending_bytes_per_user = s.max_pending_job_mb_per_user << 20;
        config.jobs.output_retention =
            (s.job_output_days > 0).then(|| Duration::from_secs(s.job_output_days * 86_400));
        config.jobs.max_output_bytes_per_user =
            (s.max_job_output_mb_per_user > 0).then_some(s.max_job_output_mb_per_user << 20);
        config.jobs.max_output_bytes_total =
            (s.max_job_output_total_mb > 0).then_some(s.max_job_output_total_mb << 20);
        config.jobs.policy = self.scheduler.policy()?;
        if let Some(path) = self.source.clone() {
            config.policy_source = Some(perch_server::PolicySource::new(move || {
                ConfigFile::read(&path)
                    .and_then(|f| f.config.scheduler.policy())
                    .map_err(|e| format!("{e:#}"))
            }));
        }
        config.connections = perch_server::listener::ConnectionLimits {
            max_connections: s.max_connections,
            max_per_ip: s.max_connections_per_ip,
            idle_timeout: Duration::from_secs(s.idle_timeout_secs),
            request_timeout: Duration::from_secs(s.request_timeout_secs),
        };
        config.pg_listen = Some(s.pg_listen.clone()).filter(|a| !a.is_empty());
        config.accounting = self.accounting.server_config();
        config.alerts = self.alerts.clone();
        if !s.tokens_file.as_os_str().is_empty() {
            config.tokens =
                perch_server::auth::Tokens::load(&s.tokens_file).map_err(anyhow::Error::msg)?;
            config.tokens.warn_expiring(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as i64),
            );
        }
        match (
            s.tls_cert.as_os_str().is_empty(),
            s.tls_key.as_os_str().is_empty(),
        ) {
            (true, true) => {}
            (false, false) => {
                config.tls = Some(
                    perch_server::tls::Certificates::load(perch_server::tls::TlsFiles {
                        cert: s.tls_cert.clone(),
                        key: s.tls_key.clone(),
                    })
                    .map_err(|e| anyhow::anyhow!("config key {e}"))?,
                );
            }
            (true, false) => anyhow::bail!(
                "config key server.tls_key is set without server.tls_cert: give both, or neither"
            ),
            (false, true) => anyhow::bail!(
                "config key server.tls_cert is set without server.tls_key: give both, or neither"
            ),
        }
        Ok(config)
    }

    pub fn agent_config(&self) -> Result<perch_collector::AgentConfig> {
        let a = &self.agent;
        let node = if a.node.is_empty() {
            hostname()
        } else {
            a.node.clone()
        };
        let node = perch_model::NodeId::new(node)
            .map_err(|e| anyhow::anyhow!("config key agent.node: {e}"))?;
        if !a.advertise_addr.is_empty() && !perch_model::control::is_host_address(&a.advertise_addr)
        {
            anyhow::bail!(
                "config key agent.advertise_addr: {:?} is neither an IP address nor a host name",
                a.advertise_addr
            );
        }
        let mut rack = a.rack.clone();
        if rack.is_empty() && !a.topology_file.as_os_str().is_empty() {
            let file = &a.topology_file;
            let text = read_bounded(file, TOPOLOGY_MAX_BYTES).map_err(|e| {
                anyhow::anyhow!(
                    "config key agent.topology_file: reading {}: {e}",
                    file.display()
                )
            })?;
            match perch_collector::topology::rack_of(&text, node.as_str()) {
                Ok(Some(found)) => {
                    perch_model::NodeId::new(found.as_str()).map_err(|e| {
                        anyhow::anyhow!(
                            "config key agent.topology_file: {}: the rack of {node}: {e}",
                            file.display()
                        )
                    })?;
                    rack = found;
                }
                Ok(None) => tracing::warn!(
                    node = %node,
                    file = %file.display(),
                    "the topology file does not name this node; its rack is \"default\""
                ),
                Err(e) => anyhow::bail!("config key agent.topology_file: {}: {e}", file.display()),
            }
        }
        if !rack.is_empty() {
            perch_model::NodeId::new(rack.as_str())
                .map_err(|e| anyhow::anyhow!("config key agent.rack: {e}"))?;
        }
        let mut config =
            perch_collector::AgentConfig::new(a.server.trim_end_matches('/').to_owned(), node);
        config.interval = Duration::from_millis(a.interval_ms);
        config.data_dir = a.data_dir.clone();
        config.nvml = match a.nvml.as_str() {
            "auto" => perch_collector::NvmlMode::Auto,
            "off" => perch_collector::NvmlMode::Off,
            path => perch_collector::NvmlMode::Path(path.into()),
        };
        config.nvml_slow_interval = Duration::from_millis(a.nvml_slow_interval_ms);
        config.simulate_gpus = a.simulate_gpus;
        // Each job runs under this binary as its supervisor (`perch __job-shim`).
        config.supervisor = Some(std::env::current_exe().map_err(|e| {
            anyhow::anyhow!("cannot find the perch binary to supervise jobs with: {e}")
        })?);
        config.max_queue_batches = a.max_queue_batches.max(1);
        config.max_batch_rounds = a.max_batch_rounds.max(1);
        config.spool_max_bytes = a.spool_max_mb << 20;
        config.max_job_output_bytes = a.max_job_output_mb << 20;
        config.keep_jobs_on_exit = a.keep_jobs_on_exit;
        config.token = Some(a.token.clone()).filter(|t| !t.is_empty());
        config.ca_file = Some(a.ca_file.clone()).filter(|p| !p.as_os_str().is_empty());
        config.rack = Some(rack).filter(|r| !r.is_empty());
        config.advertise_addr = Some(a.advertise_addr.clone()).filter(|r| !r.is_empty());
        config.gpu_sharing = a.gpu_sharing;
        config.nvlink_islands = Some(a.nvlink_islands.clone()).filter(|i| !i.is_empty());
        config.run_as_user = perch_collector::launcher::RunAsUser::parse(&a.run_as_user)
            .map_err(|e| anyhow::anyhow!("config key agent.run_as_user: {e}"))?;
        config.cgroups = perch_collector::launcher::CgroupMode::parse(&a.cgroups)
            .map_err(|e| anyhow::anyhow!("config key agent.cgroups: {e}"))?;
        config.uids = perch_collector::launcher::UidPolicy {
            min_uid: a.min_uid,
            allowed_system_users: a.allowed_system_users.clone(),
        };
        Ok(config)
    }
}

/// This machine's hostname as a valid node name (invalid characters become `-`).
/// The largest topology file read (a cluster of 100,000 nodes takes a few MiB).
const TOPOLOGY_MAX_BYTES: u64 = 16 << 20;

/// A text file of at most `max` bytes: a path to `/dev/zero` or a runaway file is an error,
/// not an agent that fills its memory.
fn read_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > max {
        return Err(std::io::Error::other(format!(
            "larger than {} MiB; is it the right file?",
            max >> 20
        )));
    }
    Ok(text)
}

pub fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(128)
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(value: &toml::Value, prefix: &str, out: &mut Vec<String>) {
        if let toml::Value::Table(t) = value {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if v.is_table() {
                    keys(v, &key, out);
                } else {
                    out.push(key);
                }
            }
        }
    }

    #[test]
    fn example_config_is_valid_and_documents_every_key() {
        let example = include_str!("../perch.example.toml");
        let parsed = Config::parse(example).expect("the example config parses");
        assert_eq!(parsed, Config::default(), "the example shows the defaults");
        let mut documented = Vec::new();
        keys(&toml::from_str(example).expect("toml"), "", &mut documented);
        let mut all = Vec::new();
        keys(
            &toml::Value::try_from(Config::default()).expect("serializes"),
            "",
            &mut all,
        );
        documented.sort();
        all.sort();
        assert_eq!(documented, all);
    }

    /// The server's default policy is the scheduler core's own default: an empty
    /// `[scheduler]` changes nothing, and each key reaches the core.
    #[test]
    fn the_scheduler_section_is_the_cores_policy() {
        use perch_scheduler::{Account, IdleAction, MINUTE};
        let default = SchedulerSection::default().policy().expect("default");
        assert_eq!(default, perch_scheduler::Config::perch(Vec::new()));
        let c = Config::parse(
            "[scheduler]\npolicy = \"backfill\"\npriority_period = \"1m\"\nborrowing = false\n\
             [scheduler.weights]\nage = 5.0\n\
             [scheduler.quotas]\nvision = 32\nnlp = 16\n\
             [scheduler.model_quotas.vision]\n\"NVIDIA H100 80GB HBM3\" = 8\n\
             [scheduler.idle]\naction = \"requeue\"\nbelow_percent = 5.0\nafter = \"20m\"\ngrace = \"2m\"\n",
        )
        .expect("parses");
        let p = c.scheduler.policy().expect("policy");
        assert_eq!(p.kind, perch_scheduler::PolicyKind::Backfill);
        assert_eq!(p.priority_period, MINUTE);
        assert!(!p.borrowing);
        assert_eq!(p.weights.age, 5.0);
        assert_eq!(p.weights.finish, 4000.0, "unset weights keep their default");
        assert_eq!(
            p.quotas,
            vec![(Account("nlp".into()), 16), (Account("vision".into()), 32)]
        );
        assert_eq!(
            p.model_quotas,
            vec![(
                Account("vision".into()),
                perch_scheduler::GpuModel("NVIDIA H100 80GB HBM3".into()),
                8
            )]
        );
        // What `--show-config` prints reads back as the same policy.
        let shown = SchedulerSection::from_policy(&p).expect("shown");
        assert_eq!(shown.policy().expect("again"), p);
        assert_eq!(p.idle.action, IdleAction::Reclaim { requeue: true });
        assert_eq!(p.idle.threshold_pct, 5.0);
        assert_eq!((p.idle.window, p.idle.grace), (20 * MINUTE, 2 * MINUTE));
        // Starvation reclaim is on by default and reaches the core when turned off.
        assert!(default.starved_reclaim);
        let off = Config::parse("[scheduler]\nstarved_reclaim = false\n").expect("parses");
        let off = off.scheduler.policy().expect("policy");
        assert!(!off.starved_reclaim);
        assert_eq!(
            SchedulerSection::from_policy(&off)
                .expect("shown")
                .policy()
                .expect("again"),
            off
        );
    }

    #[test]
    fn pg_listen_leaves_loopback_only_with_tokens() {
        let open = "[server]\npg_listen = \"0.0.0.0:7432\"\n";
        assert!(Config::parse(open).is_err());
        let with_tokens = format!("{open}tokens_file = \"tokens.toml\"\n");
        let config = Config::parse(&with_tokens).expect("a token-protected listener may be public");
        assert_eq!(config.server.pg_listen, "0.0.0.0:7432");
    }

    #[test]
    fn the_rack_comes_from_the_shared_topology_file_unless_set() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("topology.conf");
        std::fs::write(&file, "SwitchName=leaf2 Nodes=gpu[01-04]\ngpu-x rack-9\n").expect("file");
        let agent = |extra: &str| {
            Config::parse(&format!(
                "[agent]\nnode = \"gpu03\"\ntopology_file = {:?}\n{extra}",
                file.display()
            ))
            .expect("parses")
            .agent_config()
        };
        assert_eq!(agent("").expect("agent").rack.as_deref(), Some("leaf2"));
        assert_eq!(
            agent("rack = \"mine\"").expect("agent").rack.as_deref(),
            Some("mine"),
            "an explicit rack wins"
        );
        std::fs::write(&file, "gpu03 rack 9\n").expect("file");
        let err = format!("{:#}", agent("").expect_err("bad line"));
        assert!(
            err.contains("agent.topology_file") && err.contains("line 1"),
            "{err}"
        );
        std::fs::write(&file, "gpu03 no/slashes\n").expect("file");
        let err = format!("{:#}", agent("").expect_err("bad label"));
        assert!(err.contains("agent.topology_file"), "{err}");
        std::fs::remove_file(&file).expect("rm");
        let err = format!("{:#}", agent("").expect_err("missing"));
        assert!(err.contains("agent.topology_file: reading"), "{err}");
        // A careless path: refused, not read until memory runs out.
        let zero = Config::parse("[agent]\nnode = \"gpu03\"\ntopology_file = \"/dev/zero\"\n")
            .expect("parses")
            .agent_config()
            .expect_err("endless file");
        assert!(
            format!("{zero:#}").contains("larger than 16 MiB"),
            "{zero:#}"
        );
    }

    #[test]
    fn bad_config_names_the_key() {
        for (text, want) in [
            ("[server]\nlisten = \"nowhere\"", "server.listen"),
            ("[server]\nlistne = \"x\"", "listne"),
            ("[agent]\ninterval_ms = 1", "agent.interval_ms"),
            ("[agent]\nserver = \"perch:7300\"", "agent.server"),
            (
                "[agent]\nrun_as_user = \"sometimes\"",
                "agent.run_as_user: \"sometimes\" is not one of required, if_possible, never",
            ),
            ("[agent]\ncgroups = \"on\"", "agent.cgroups"),
            ("[agent]\nmin_uid = 0", "agent.min_uid: must be at least 1"),
            // Values a careless operator types, each once met as a panic or a useless
            // server: an Instant overflow on the first idle connection, every body refused,
            // every node marked down, sizes wrapping when made bytes.
            (
                "[server]\nidle_timeout_secs = 9223372036854775807",
                "server.idle_timeout_secs: must be 1 to 604800 seconds, got 9223372036854775807",
            ),
            (
                "[server]\nmax_body_mb = 0",
                "server.max_body_mb: must be 1 to 4096 MiB, got 0",
            ),
            (
                "[server]\nnode_stale_after_secs = 0",
                "server.node_stale_after_secs: must be 2 to 86400 seconds, got 0",
            ),
            (
                "[query]\nspill_mb = 9223372036854775807",
                "query.spill_mb: must be 0 to 1073741824 MiB",
            ),
            (
                "[query]\ntimeout_secs = inf",
                "query.timeout_secs: must be above 0 and at most 86400 seconds, got inf",
            ),
            (
                "[server]\njob_output_days = 18446744073709551615",
                "server.job_output_days: must be at most 36500 days (100 years; 0 keeps output for ever)",
            ),
            (
                "[server.retention_days]\ngpu_samples = 9223372036854775807",
                "server.retention_days.gpu_samples: must be at most 36500 days",
            ),
            (
                "[server]\nmax_job_output_mb_per_user = 18446744073709551615",
                "server.max_job_output_mb_per_user: must be at most 1073741824 MiB (1 PiB; 0 is no bound)",
            ),
            (
                "[agent]\nsimulate_gpus = 65",
                "agent.simulate_gpus: must be 0 (none) to 64, the most GPUs a node may have, got 65",
            ),
            (
                "[accounts.vision]\nqos = [\"urgent\"]",
                "accounts.vision.qos: \"urgent\" is not one of low, normal, high",
            ),
            ("[accounts.vision]\nuser = [\"a\"]", "unknown field `user`"),
            (
                "[server]\nnode_stale_after_secs = 60\nnode_lease_secs = 30",
                "server.node_lease_secs: must be longer than server.node_stale_after_secs (60 s)",
            ),
            (
                "[agent]\nallowed_system_users = [\"daemon\", \"root\"]",
                "agent.allowed_system_users: \"root\" cannot be allowed",
            ),
            ("[client]\nserver = \"perch:7300\"", "client.server"),
            ("[client]\nsever = \"http://perch:7300\"", "sever"),
            ("[query]\ntimeout_secs = 0", "query.timeout_secs"),
            (
                "[query]\nmemory_mb = 512\ntotal_memory_mb = 256",
                "query.total_memory_mb: must be at least query.memory_mb (512 MiB)",
            ),
            ("[query]\nmax_concurrent = 0", "query.max_concurrent"),
            (
                "[server]\nflush_max_rows = 1000\nmax_buffered_rows = 1500",
                "server.max_buffered_rows: must be at least twice server.flush_max_rows (1000)",
            ),
            (
                "[server.retention_days]\ngpu_sample = 30",
                "no such table; the tables are gpu_samples",
            ),
            ("[server.storage]\nkind = \"gcs\"", "server.storage.kind"),
            ("[server.storage]\nkind = \"s3\"", "server.storage.bucket"),
            ("[server.storage]\nbucket = \"b\"", "set kind = \"s3\""),
            (
                "[server]\npg_listen = \"0.0.0.0:7432\"",
                "without server.tokens_file the PostgreSQL listener runs in trust mode",
            ),
            (
                "[telemetry]\notlp_endpoint = \"collector:4318\"",
                "telemetry.otlp_endpoint",
            ),
            (
                "[telemetry]\nexport_interval_secs = 0",
                "telemetry.export_interval_secs",
            ),
            (
                "[accounting]\ngpu_price_per_hour = -1",
                "accounting.gpu_price_per_hour",
            ),
            (
                "[scheduler]\npolicy = \"sjf\"",
                "scheduler.policy: \"sjf\" is not a policy; choose perch, backfill or fifo",
            ),
            (
                "[scheduler]\npolicy = \"srtf\"",
                "scheduler.policy: srtf needs",
            ),
            ("[scheduler.weights]\nage = -1.0", "scheduler.weights.age"),
            (
                "[scheduler.weights]\nfinish = -1.0",
                "scheduler.weights.finish",
            ),
            (
                "[scheduler.weights]\nfairshare = nan",
                "scheduler.weights.fairshare",
            ),
            ("[scheduler.weights]\nagee = 1.0", "agee"),
            ("[scheduler]\nage_max = \"0\"", "scheduler.age_max"),
            ("[scheduler]\nage_max = \"7 days\"", "7 days"),
            (
                "[scheduler]\nsize_max_gpu_hours = 0.0",
                "scheduler.size_max_gpu_hours",
            ),
            ("[scheduler.quotas]\nvision = -3", "vision"),
            (
                "[scheduler.quotas]\nvision = 2000000",
                "scheduler.quotas.vision",
            ),
            ("[scheduler.quotas]\n\" \" = 2", "scheduler.quotas"),
            (
                "[scheduler.model_quotas.vision]\nH100 = 2000000",
                "scheduler.model_quotas.vision.\"H100\"",
            ),
            (
                "[scheduler.model_quotas.vision]\n\"\" = 2",
                "scheduler.model_quotas.vision",
            ),
            ("[scheduler.model_quotas]\nvision = 3", "expected a map"),
            (
                "[scheduler]\nmax_reclaims_per_pass = 0",
                "scheduler.max_reclaims_per_pass",
            ),
            (
                "[scheduler]\npreemption_grace_max = \"2h\"",
                "scheduler.preemption_grace_max: must be at most \"1h\"",
            ),
            (
                "[scheduler.idle]\naction = \"kill\"",
                "scheduler.idle.action: \"kill\" is not an idle action; choose off, report, requeue or stop",
            ),
            (
                "[scheduler.idle]\nbelow_percent = 101.0",
                "scheduler.idle.below_percent",
            ),
            ("[scheduler.idle]\nafter = \"5s\"", "scheduler.idle.after"),
            (
                "[accounting.gpu_prices]\n\"H100 80GB HBM3\" = nan",
                "accounting.gpu_prices.\"H100 80GB HBM3\"",
            ),
            (
                "[telemetry.headers]\n\"bad header\" = \"x\"",
                "not an HTTP header name",
            ),
        ] {
            let err = format!("{:#}", Config::parse(text).expect_err(text));
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }
}
