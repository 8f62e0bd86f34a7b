//! `[agent]`: the node agent (what it samples and how often, where it sends it, how it runs
//! jobs: as which users, in which cgroups, with how much output). [`AgentSection::agent_config`]
//! resolves the node's name and rack, from the shared topology file when asked.

use super::{MIB, PIB, bad, within};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `[agent]`: what `perch agent` samples, where it reports, and how it runs jobs; every key
/// is documented in `perch.example.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentSection {
    /// The server's URL. Empty: `servers`, else [`DEFAULT_SERVER`].
    pub server: String,
    /// Several servers, a leader and its standbys: the agent follows whichever leads.
    /// Instead of `server`, not beside it.
    pub servers: Vec<String>,
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
            server: String::new(),
            servers: Vec::new(),
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

impl AgentSection {
    /// Checks the keys of `[agent]`; the message names the key.
    pub(super) fn check(&self) -> Result<()> {
        within("agent.spool_max_mb", self.spool_max_mb, 0, PIB, MIB)?;
        let output = self.max_job_output_mb;
        within("agent.max_job_output_mb", output, 1, PIB, MIB)?;
        within(
            "agent.interval_ms",
            self.interval_ms,
            10,
            3_600_000,
            "milliseconds",
        )?;
        if self.simulate_gpus > perch_scheduler::MAX_GPUS_PER_NODE {
            return bad(
                "agent.simulate_gpus",
                &format!(
                    "must be 0 (none) to {}, the most GPUs a node may have, got {}",
                    perch_scheduler::MAX_GPUS_PER_NODE,
                    self.simulate_gpus
                ),
            );
        }
        if let Err(e) = perch_collector::launcher::RunAsUser::parse(&self.run_as_user) {
            return bad("agent.run_as_user", &e);
        }
        if let Err(e) = perch_collector::launcher::CgroupMode::parse(&self.cgroups) {
            return bad("agent.cgroups", &e);
        }
        if self.min_uid == 0 {
            return bad(
                "agent.min_uid",
                "must be at least 1: jobs never run as root (uid 0)",
            );
        }
        if let Some(u) = self
            .allowed_system_users
            .iter()
            .find(|u| u.is_empty() || u.as_str() == "root")
        {
            return bad(
                "agent.allowed_system_users",
                &format!("{u:?} cannot be allowed: jobs never run as root, and a name is needed"),
            );
        }
        let metrics_listen = &self.metrics_listen;
        if !metrics_listen.is_empty() && metrics_listen.parse::<std::net::SocketAddr>().is_err() {
            return bad(
                "agent.metrics_listen",
                &format!(
                    "{metrics_listen:?} must be an address such as 127.0.0.1:9400, or empty for none"
                ),
            );
        }
        let server = &self.server;
        if !(server.is_empty() || server.starts_with("http://") || server.starts_with("https://")) {
            return bad(
                "agent.server",
                &format!(
                    "{server:?} must be a URL such as http://perch-server:7300 (\"\": agent.servers, else {DEFAULT_SERVER})"
                ),
            );
        }
        super::client::check_servers("agent", &self.server, &self.servers)
    }

    /// The servers the agent reports to: `servers`, else `server`, else [`DEFAULT_SERVER`];
    /// trailing `/`s trimmed.
    pub fn server_list(&self) -> Vec<String> {
        let list = super::client::server_list(&self.server, &self.servers);
        if list.is_empty() {
            vec![DEFAULT_SERVER.to_owned()]
        } else {
            list
        }
    }

    /// Sets the servers from `--server` or `PERCH_SERVER` (`what`): one URL, or several
    /// separated by commas. They replace the file's `server` and `servers`.
    pub fn set_servers_from(&mut self, text: &str, what: &str) -> Result<()> {
        let mut list = super::ClientSection::parse_server_list(text, what)?;
        if list.len() == 1 {
            self.server = list.remove(0);
            self.servers = Vec::new();
        } else {
            self.server = String::new();
            self.servers = list;
        }
        Ok(())
    }

    /// The agent's configuration; the node's rack may come from the shared topology file.
    pub(super) fn agent_config(&self) -> Result<perch_collector::AgentConfig> {
        let node = if self.node.is_empty() {
            hostname()
        } else {
            self.node.clone()
        };
        let node = perch_model::NodeId::new(node)
            .map_err(|e| anyhow::anyhow!("config key agent.node: {e}"))?;
        if !self.advertise_addr.is_empty()
            && !perch_model::control::is_host_address(&self.advertise_addr)
        {
            anyhow::bail!(
                "config key agent.advertise_addr: {:?} is neither an IP address nor a host name",
                self.advertise_addr
            );
        }
        let rack = self.rack(&node)?;
        let mut servers = self.server_list();
        let mut config = if servers.len() == 1 {
            perch_collector::AgentConfig::new(servers.remove(0), node)
        } else {
            perch_collector::AgentConfig::with_servers(servers, node)
        };
        config.interval = Duration::from_millis(self.interval_ms);
        config.data_dir = self.data_dir.clone();
        config.nvml = match self.nvml.as_str() {
            "auto" => perch_collector::NvmlMode::Auto,
            "off" => perch_collector::NvmlMode::Off,
            path => perch_collector::NvmlMode::Path(path.into()),
        };
        config.nvml_slow_interval = Duration::from_millis(self.nvml_slow_interval_ms);
        config.simulate_gpus = self.simulate_gpus;
        // Each job runs under this binary as its supervisor (`perch __job-shim`).
        config.supervisor = Some(std::env::current_exe().map_err(|e| {
            anyhow::anyhow!("cannot find the perch binary to supervise jobs with: {e}")
        })?);
        config.max_queue_batches = self.max_queue_batches.max(1);
        config.max_batch_rounds = self.max_batch_rounds.max(1);
        config.spool_max_bytes = self.spool_max_mb << 20;
        config.max_job_output_bytes = self.max_job_output_mb << 20;
        config.keep_jobs_on_exit = self.keep_jobs_on_exit;
        config.token = Some(self.token.clone()).filter(|t| !t.is_empty());
        config.ca_file = Some(self.ca_file.clone()).filter(|p| !p.as_os_str().is_empty());
        config.rack = Some(rack).filter(|r| !r.is_empty());
        config.advertise_addr = Some(self.advertise_addr.clone()).filter(|r| !r.is_empty());
        config.gpu_sharing = self.gpu_sharing;
        config.nvlink_islands = Some(self.nvlink_islands.clone()).filter(|i| !i.is_empty());
        config.run_as_user = perch_collector::launcher::RunAsUser::parse(&self.run_as_user)
            .map_err(|e| anyhow::anyhow!("config key agent.run_as_user: {e}"))?;
        config.cgroups = perch_collector::launcher::CgroupMode::parse(&self.cgroups)
            .map_err(|e| anyhow::anyhow!("config key agent.cgroups: {e}"))?;
        config.uids = perch_collector::launcher::UidPolicy {
            min_uid: self.min_uid,
            allowed_system_users: self.allowed_system_users.clone(),
        };
        Ok(config)
    }

    /// The node's rack: `rack` when set, else what the shared topology file says of `node`
    /// (empty when it names no rack for it: "default").
    fn rack(&self, node: &perch_model::NodeId) -> Result<String> {
        let mut rack = self.rack.clone();
        if rack.is_empty() && !self.topology_file.as_os_str().is_empty() {
            let file = &self.topology_file;
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
        Ok(rack)
    }
}

/// The server of an agent that nothing else names.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7300";

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

/// This machine's hostname as a valid node name (invalid characters become `-`).
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

    #[test]
    fn the_agent_gets_every_server_and_starts_with_the_first() {
        let mut section = AgentSection {
            node: "n1".into(),
            ..AgentSection::default()
        };
        let one = section.agent_config().expect("default");
        assert_eq!(
            (one.server.as_str(), one.servers.len()),
            (DEFAULT_SERVER, 0)
        );
        section.servers = vec!["http://a:7300/".into(), "http://b:7300".into()];
        section.check().expect("valid");
        let two = section.agent_config().expect("two");
        assert_eq!(two.server, "http://a:7300");
        assert_eq!(two.servers, ["http://a:7300", "http://b:7300"]);
        assert_eq!(
            two.server_list().expect("valid").list(),
            ["http://a:7300", "http://b:7300"]
        );
        // --server / PERCH_SERVER replace the file's servers, one or several.
        section
            .set_servers_from("http://c:7300", "--server")
            .expect("one");
        assert_eq!(
            (section.server.as_str(), section.servers.len()),
            ("http://c:7300", 0)
        );
        section.check().expect("valid");
        section
            .set_servers_from("http://c:7300,http://d:7300", "--server")
            .expect("two");
        assert_eq!((section.server.as_str(), section.servers.len()), ("", 2));
        section.check().expect("valid");
        let err = section
            .set_servers_from("http://c:7300,d:7300", "--server (or PERCH_SERVER)")
            .expect_err("not a URL");
        assert!(
            err.to_string()
                .starts_with("--server (or PERCH_SERVER): \"d:7300\" is not a URL"),
            "{err}"
        );
    }
}
