//! `[client]`: where the client commands (`sql`, `submit`, `jobs`, ...) send their requests,
//! with which token. client.rs resolves it against flags, `PERCH_*` variables and the per-user
//! file.

use super::bad;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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

impl ClientSection {
    /// Checks the keys of `[client]`; the message names the key and what to write instead.
    pub(super) fn check(&self) -> Result<()> {
        let client = &self.server;
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
}
