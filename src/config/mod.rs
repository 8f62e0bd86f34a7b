//! perch's configuration: a TOML file (`--config` or `PERCH_CONFIG`), then `PERCH_*`
//! environment variables, then command-line flags, each overriding the one before.
//! `perch.example.toml` at the repository root documents every key; a test keeps it complete.
//! The client commands read the same file for their server and token (see client.rs).
//!
//! One module per section owns its struct, its defaults and its `check`, whose message names
//! the key and what to change: `server` (with `[server.storage]`), `query`, `agent`,
//! `telemetry`, `accounting`, `client`, `scheduler`, `ha` and `cluster`. `[alerts]` and `[accounts.<name>]` are
//! the alerts crate's and the control plane's own types, checked by them. [`Config::check`] runs every
//! section's check, then those that read keys of two sections (`check_across_sections`).

mod accounting;
mod agent;
mod client;
mod cluster;
mod ha;
mod query;
mod scheduler;
mod server;
mod telemetry;
mod validation;

pub use agent::hostname;
pub use client::ClientSection;
pub use ha::{HaSection, STARTUP_ALLOWANCE as HA_STARTUP_ALLOWANCE};
pub use scheduler::SchedulerSection;
pub use telemetry::TelemetrySection;

use accounting::AccountingSection;
use agent::AgentSection;
use anyhow::{Context, Result};
use query::QuerySection;
use serde::{Deserialize, Serialize};
use server::ServerSection;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The whole configuration: one field per section, each defaulted when the file leaves it out.
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
    /// A control plane with standbys: the job database on PostgreSQL, one leader at a time.
    pub ha: HaSection,
    /// Telemetry spread over several servers: this server's role (single, control, ingest).
    pub cluster: cluster::ClusterSection,
    /// What a node runs to prove its GPUs healthy before it takes work again.
    pub validation: validation::ValidationSection,
    /// The file this came from, if any: the server reads its `[scheduler]` again on SIGHUP.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// A config file as read: its path, its values (defaults filled in), and which keys the file
/// sets itself, since a client takes the server's address only from a file that names one.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its values, checked.
    pub config: Config,
    table: toml::Table,
}

impl ConfigFile {
    /// Reads and checks the file at `path`; an error names the file.
    pub fn read(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        ConfigFile::parse(path, &text)
    }

    /// Parses and checks `text`, the contents of the file at `path`; an error names the file.
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

// Durations and sizes a server adds to clocks and multiplies into bytes are bounded, so a
// careless value is named by a check, not met as a panic on the first idle connection
// (`idle_timeout_secs = 9223372036854775807` overflowed `Instant`) or as a server that refuses
// every request (`max_body_mb = 0`) or marks every node down (a node goes stale within
// `node_stale_after_secs = 0`).
const DAY: u64 = 86_400;
const WEEK: u64 = 7 * DAY;
/// Sizes in MiB become bytes (`<< 20`): a pebibyte at most, far from wrapping.
const PIB: u64 = 1 << 30;
const SECONDS: &str = "seconds";
/// How long an ingest server keeps a file after it left its manifest: far past the control
/// server's next read of the manifest and its longest query.
const INGEST_DELETE_GRACE: Duration = Duration::from_secs(600);
const MIB: &str = "MiB";

/// The error about one key: `config key <key>: <why>`.
fn bad(key: &str, why: &str) -> Result<()> {
    Err(anyhow::anyhow!("config key {key}: {why}"))
}

/// Checks that `value` (in `unit`) is within `min..=max`, naming the key when it is not.
fn within(key: &str, value: u64, min: u64, max: u64, unit: &str) -> Result<()> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    bad(key, &format!("must be {min} to {max} {unit}, got {value}"))
}

impl Config {
    /// Reads a config file's text: defaults for what it leaves out, then every check.
    pub fn parse(text: &str) -> Result<Config> {
        let config: Config = toml::from_str(text)?;
        config.check()?;
        Ok(config)
    }

    /// Checks values serde cannot, section by section, then across sections; the message
    /// names the key.
    pub fn check(&self) -> Result<()> {
        self.server.check()?;
        self.query.check()?;
        self.agent.check()?;
        self.accounting.check()?;
        self.telemetry.check()?;
        if let Err(e) = perch_control::accounts::validate(&self.accounts) {
            anyhow::bail!("config key {e}");
        }
        self.scheduler.check()?;
        self.alerts
            .validate()
            .map_err(|e| anyhow::anyhow!("config section [alerts]: {e}"))?;
        self.client.check()?;
        self.ha.check()?;
        self.cluster.check()?;
        self.validation.check()?;
        self.check_across_sections()
    }

    /// The checks that read keys of more than one section.
    fn check_across_sections(&self) -> Result<()> {
        self.ha.check_node_lease(self.server.node_lease_secs)?;
        if self.ha.enabled() && self.cluster.role == cluster::ClusterRole::Ingest {
            return bad(
                "ha.database",
                "an ingest server runs no control plane, so no standby: leave [ha] out of its config (the control server's standbys take [ha])",
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
        Ok(())
    }

    /// The server's configuration: its store, query limits, jobs, connections, accounting,
    /// alerts, tokens and TLS certificates (both files read here).
    pub fn server_config(&self) -> Result<perch_server::ServerConfig> {
        let s = &self.server;
        let mut store = s.store();
        store.peers = self.cluster.peers();
        if self.cluster.role == cluster::ClusterRole::Ingest {
            // The control server reads this store as a peer, as of the manifest it last read:
            // a file compaction or retention replaced stays that much longer.
            store.delete_grace = INGEST_DELETE_GRACE;
        }
        let mut config = perch_server::ServerConfig::new(store);
        config.cluster = self.cluster.server_cluster()?;
        config.query = self.query.limits();
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
        config.pg_max_connections = s.pg_max_connections;
        config.max_syncs_per_second = s.max_syncs_per_second;
        config.accounting = self.accounting.server_config();
        config.validation = self.validation.server_config();
        config.alerts =
            perch_server::validation::remediation_alerts(self.alerts.clone(), &config.validation);
        if let Some(path) = self.source.clone() {
            config.alerts_source = Some(perch_server::AlertsSource::new(move || {
                ConfigFile::read(&path)
                    .map(|f| {
                        perch_server::validation::remediation_alerts(
                            f.config.alerts,
                            &f.config.validation.server_config(),
                        )
                    })
                    .map_err(|e| format!("{e:#}"))
            }));
        }
        if !s.tokens_file.as_os_str().is_empty() {
            config.tokens =
                perch_server::auth::Tokens::load(&s.tokens_file).map_err(anyhow::Error::msg)?;
            config.tokens.warn_expiring(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as i64),
            );
        }
        config.tls = s.tls()?;
        Ok(config)
    }

    /// The agent's configuration ([`AgentSection::agent_config`]).
    pub fn agent_config(&self) -> Result<perch_collector::AgentConfig> {
        self.agent.agent_config()
    }
}

/// The message refusing the config file `text` (its test fails when `text` parses).
#[cfg(test)]
fn refused(text: &str) -> String {
    format!("{:#}", Config::parse(text).expect_err(text))
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
        let example = include_str!("../../perch.example.toml");
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
