//! `[cluster]`: telemetry spread over several servers (docs/scale.md, "Ingest servers"). Left
//! out (role `single`, the default), one server takes everything, as `perch up` and a single
//! `perch server` run. A `control` server runs the control plane and names, in each node's sync
//! answer, the `[[cluster.ingest]]` server the node sends its telemetry to; its SQL reads every
//! ingest server's store beside its own. An `ingest` server takes telemetry into a store of its
//! own and pushes each node's latest state to `cluster.control`.

use super::{bad, within};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClusterRole {
    /// One server takes everything.
    #[default]
    Single,
    /// The control plane; telemetry goes to the `[[cluster.ingest]]` servers.
    Control,
    /// Takes telemetry for the nodes the control server sends it.
    Ingest,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    pub role: ClusterRole,
    /// An ingest server's name, as the control server's `[[cluster.ingest]]` gives it. Empty:
    /// the host name.
    pub name: String,
    /// An ingest server's control server (its base URL, `http://perch-control:7300`).
    pub control: String,
    /// An ingest server's token for its pushes to the control server (a file holding it): an
    /// agent token bound to no node, or an operator's. Empty: none (a control server without
    /// a tokens file).
    pub token_file: PathBuf,
    /// PEM certificates an ingest server trusts for an `https` control server.
    pub control_ca_file: PathBuf,
    /// The URL agents reach an ingest server at, sent to the control server with each push.
    /// Empty: `http://<server.listen>` (`https` with TLS; the host name for 0.0.0.0 or [::]).
    pub advertise: String,
    /// How often an ingest server pushes its nodes' latest state (and that it lives).
    pub push_interval_ms: u64,
    /// A control server sends nodes to an ingest server while it heard from it within this.
    pub ingest_timeout_secs: u64,
    /// A control server's ingest servers.
    pub ingest: Vec<IngestEntry>,
}

/// One ingest server, as its control server knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestEntry {
    /// Its `cluster.name`.
    pub name: String,
    /// Where its store is: its `server.data_dir` (on storage this server reads too: a shared
    /// file system) or, when `server.storage` is s3, its key prefix in the same bucket.
    pub store: String,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            role: ClusterRole::Single,
            name: String::new(),
            control: String::new(),
            token_file: PathBuf::new(),
            control_ca_file: PathBuf::new(),
            advertise: String::new(),
            push_interval_ms: 1_000,
            ingest_timeout_secs: 10,
            ingest: Vec::new(),
        }
    }
}

fn is_url(u: &str) -> bool {
    u.starts_with("http://") || u.starts_with("https://")
}

impl ClusterSection {
    pub(super) fn check(&self) -> Result<()> {
        within(
            "cluster.ingest_timeout_secs",
            self.ingest_timeout_secs,
            2,
            600,
            super::SECONDS,
        )?;
        if self.ingest_timeout_secs * 1000 < 2 * self.push_interval_ms {
            return bad(
                "cluster.ingest_timeout_secs",
                "must be at least two push intervals (cluster.push_interval_ms), or ingest servers that push on time count as gone",
            );
        }
        within(
            "cluster.push_interval_ms",
            self.push_interval_ms,
            100,
            60_000,
            "milliseconds",
        )?;
        match self.role {
            ClusterRole::Single if !self.ingest.is_empty() => bad(
                "cluster.ingest",
                "lists ingest servers, but cluster.role is not \"control\": set role = \"control\" on the server that runs the control plane",
            ),
            ClusterRole::Single | ClusterRole::Ingest if !self.ingest.is_empty() => bad(
                "cluster.ingest",
                "is for the control server; an ingest server names its control server in cluster.control",
            ),
            ClusterRole::Single => Ok(()),
            ClusterRole::Control => {
                if self.ingest.is_empty() {
                    return bad(
                        "cluster.ingest",
                        "a control server needs at least one [[cluster.ingest]] (name, store); without ingest servers leave [cluster] out",
                    );
                }
                for (i, e) in self.ingest.iter().enumerate() {
                    let key = format!("cluster.ingest[{i}]");
                    if e.name.is_empty() || e.name.len() > 64 {
                        return bad(&format!("{key}.name"), "must be 1 to 64 characters");
                    }
                    if e.store.is_empty() {
                        return bad(
                            &format!("{key}.store"),
                            "must name the ingest server's store: its data_dir, or its prefix of the bucket",
                        );
                    }
                    if self.ingest[..i]
                        .iter()
                        .any(|o| o.name == e.name || o.store == e.store)
                    {
                        return bad(
                            &key,
                            &format!(
                                "{:?} repeats the name or store of another ingest server; each has its own",
                                e.name
                            ),
                        );
                    }
                }
                Ok(())
            }
            ClusterRole::Ingest => {
                if !(self.advertise.is_empty() || is_url(&self.advertise)) {
                    return bad(
                        "cluster.advertise",
                        &format!(
                            "{:?} must be a URL such as http://ingest-a:7300",
                            self.advertise
                        ),
                    );
                }
                if !is_url(&self.control) {
                    return bad(
                        "cluster.control",
                        &format!(
                            "{:?}: an ingest server needs its control server's URL, such as http://perch-control:7300",
                            self.control
                        ),
                    );
                }
                Ok(())
            }
        }
    }

    /// The store's peers (the control server reads its ingest servers' stores).
    pub(super) fn peers(&self) -> Vec<perch_query::PeerConfig> {
        match self.role {
            ClusterRole::Control => self
                .ingest
                .iter()
                .map(|e| perch_query::PeerConfig {
                    name: e.name.clone(),
                    location: e.store.clone(),
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The server's part, reading the token and CA files an ingest server names.
    pub(super) fn server_cluster(&self) -> Result<perch_server::cluster::Cluster> {
        use perch_server::cluster::{Cluster, IngestRole, IngestServers};
        Ok(match self.role {
            ClusterRole::Single => Cluster::Single,
            ClusterRole::Control => Cluster::Control(std::sync::Arc::new(IngestServers::new(
                self.ingest.iter().map(|e| e.name.clone()).collect(),
                Duration::from_secs(self.ingest_timeout_secs),
            ))),
            ClusterRole::Ingest => Cluster::Ingest(IngestRole {
                name: if self.name.is_empty() {
                    super::hostname()
                } else {
                    self.name.clone()
                },
                control_url: self.control.trim_end_matches('/').to_owned(),
                advertise: self.advertise.trim_end_matches('/').to_owned(),
                token: read_opt(&self.token_file, "cluster.token_file")?
                    .map(|t| String::from_utf8_lossy(&t).trim().to_owned())
                    .filter(|t| !t.is_empty()),
                ca_certificates: read_opt(&self.control_ca_file, "cluster.control_ca_file")?
                    .into_iter()
                    .collect(),
                every: Duration::from_millis(self.push_interval_ms),
            }),
        })
    }
}

fn read_opt(path: &Path, key: &str) -> Result<Option<Vec<u8>>> {
    if path.as_os_str().is_empty() {
        return Ok(None);
    }
    std::fs::read(path)
        .map(Some)
        .with_context(|| format!("config key {key}: reading {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::super::refused;

    #[test]
    fn careless_cluster_sections_are_refused_naming_the_key() {
        assert!(refused("[cluster]\nrole = \"control\"\n").contains("cluster.ingest"));
        assert!(refused("[cluster]\nrole = \"ingest\"\n").contains("cluster.control"));
        assert!(
            refused("[cluster]\nrole = \"ingest\"\ncontrol = \"c:7300\"\n")
                .contains("cluster.control")
        );
        let entry = |name: &str, store: &str| {
            format!("[[cluster.ingest]]\nname = \"{name}\"\nstore = \"{store}\"\n")
        };
        let control = "[cluster]\nrole = \"control\"\n";
        assert!(
            refused(&format!("{control}{}", entry("", "/s/a"))).contains("cluster.ingest[0].name")
        );
        assert!(
            refused(&format!(
                "{control}{}{}",
                entry("a", "/s/a"),
                entry("a", "/s/b")
            ))
            .contains("cluster.ingest[1]")
        );
        assert!(
            refused(&format!(
                "{control}{}{}",
                entry("a", "/s/a"),
                entry("b", "/s/a")
            ))
            .contains("cluster.ingest[1]")
        );
        assert!(
            refused(&format!("[cluster]\n{}", entry("a", "/s/a"))).contains("role = \"control\"")
        );
        assert!(
            refused(
                "[cluster]\nrole = \"ingest\"\ncontrol = \"http://c:1\"\nadvertise = \"c:1\"\n"
            )
            .contains("cluster.advertise")
        );
        assert!(
            refused("[cluster]\nrole = \"ingest\"\ncontrol = \"http://c:1\"\npush_interval_ms = 10000\ningest_timeout_secs = 10\n")
                .contains("cluster.ingest_timeout_secs")
        );
        assert!(refused("[cluster]\nrole = \"leader\"\n").contains("role"));
        assert!(
            refused(
                "[cluster]\nrole = \"ingest\"\ncontrol = \"http://c:1\"\npush_interval_ms = 5\n"
            )
            .contains("cluster.push_interval_ms")
        );
        assert!(refused("[cluster]\nrole = \"ingest\"\ncontrol = \"http://c:1\"\n[ha]\ndatabase = \"host=/run/postgresql\"\n").contains("[ha]"));
    }
}
