//! `[ha]`: a control plane with standbys. Empty `database` (the default): one server with the
//! embedded job database, as `perch up` and a single `perch server` run. Set, every server of
//! the deployment names the same PostgreSQL database and the same shared data directory, and
//! one leads at a time (docs/ha.md).

use super::{SECONDS, bad, within};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How long a standby allows itself, once it holds the lease, to open the shared data
/// directory and replay its log before it answers: part of the takeover the node lease must
/// outlast.
pub const STARTUP_ALLOWANCE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HaSection {
    /// PostgreSQL connection string of the job database and the leader lease, e.g.
    /// `postgresql://perch@db-host/perch`. Empty: one server, no standby.
    pub database: String,
    /// This server's name in the lease, unique in the deployment. Empty: the host name.
    pub name: String,
    /// The URL the other servers send clients to while this one leads. Empty:
    /// `http://<listen address>`, with the host name for 0.0.0.0 or [::].
    pub advertise: String,
    /// How long the leader's lease lasts past each renewal: the longest a dead leader holds
    /// up a takeover.
    pub lease_secs: u64,
}

impl Default for HaSection {
    fn default() -> Self {
        HaSection {
            database: String::new(),
            name: String::new(),
            advertise: String::new(),
            lease_secs: 10,
        }
    }
}

impl HaSection {
    /// Whether this server runs with standbys.
    pub fn enabled(&self) -> bool {
        !self.database.is_empty()
    }

    pub(super) fn check(&self) -> Result<()> {
        within("ha.lease_secs", self.lease_secs, 2, 300, SECONDS)?;
        if !self.enabled() {
            return Ok(());
        }
        if let Err(e) = perch_control::pg::parse_config(&self.database) {
            return bad("ha.database", &e.to_string());
        }
        let a = &self.advertise;
        if !(a.is_empty() || a.starts_with("http://") || a.starts_with("https://")) {
            return bad(
                "ha.advertise",
                &format!("{a:?} must be a URL such as http://perch-a:7300"),
            );
        }
        Ok(())
    }

    /// The longest from a leader's death to its successor answering: the lease running out,
    /// the standby's next try, and its start.
    pub fn takeover_bound(&self) -> Duration {
        self.lease().takeover_bound() + STARTUP_ALLOWANCE
    }

    /// The lease's periods for `name` at `address`.
    pub fn lease_config(&self, name: String, address: String) -> perch_control::ha::LeaseConfig {
        perch_control::ha::LeaseConfig::new(name, address, Duration::from_secs(self.lease_secs))
    }

    fn lease(&self) -> perch_control::ha::LeaseConfig {
        self.lease_config(String::new(), String::new())
    }

    /// Running jobs must outlive a takeover: their node's lease (`server.node_lease_secs`)
    /// has to be longer than the takeover bound, or a takeover stops every job.
    pub(super) fn check_node_lease(&self, node_lease_secs: u64) -> Result<()> {
        let bound = self.takeover_bound().as_secs();
        if self.enabled() && node_lease_secs <= bound {
            return bad(
                "server.node_lease_secs",
                &format!(
                    "must be longer than a takeover ({bound} s: ha.lease_secs {} s, a standby's next try, and {} s for it to start), or every running job stops itself while a standby takes over",
                    self.lease_secs,
                    STARTUP_ALLOWANCE.as_secs()
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, refused};

    #[test]
    fn a_node_lease_shorter_than_a_takeover_is_refused_naming_both_keys() {
        let short = "[server]\nnode_stale_after_secs = 10\nnode_lease_secs = 65\n";
        Config::parse(short).expect("one server has no takeover to outlast");
        let err = refused(&format!(
            "{short}[ha]\ndatabase = \"host=/run/postgresql\"\n"
        ));
        assert!(
            err.contains("server.node_lease_secs") && err.contains("ha.lease_secs"),
            "{err}"
        );
        Config::parse(
            "[server]\nnode_stale_after_secs = 10\nnode_lease_secs = 72\n[ha]\ndatabase = \"host=/run/postgresql\"\n",
        )
        .expect("10 s + 1 s + 60 s is 71 s");
    }

    #[test]
    fn a_bad_database_advertise_or_lease_names_its_key() {
        assert!(refused("[ha]\ndatabase = \"port=seventy\"\n").contains("ha.database"));
        let db = "[ha]\ndatabase = \"host=/run/postgresql\"\n";
        assert!(refused(&format!("{db}advertise = \"perch-a:7300\"\n")).contains("ha.advertise"));
        assert!(refused("[ha]\nlease_secs = 1\n").contains("ha.lease_secs"));
    }
}
