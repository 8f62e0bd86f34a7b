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
    /// Server URL, e.g. `http://perch-server:7300`. Empty: `servers`, else derived from
    /// `[server] listen` when this file sets it.
    pub server: String,
    /// Several servers, a leader and its standbys: requests go to whichever leads. Instead
    /// of `server`, not beside it.
    pub servers: Vec<String>,
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
        if !(client.is_empty() || is_url(client)) {
            return bad(
                "client.server",
                &format!(
                    "{client:?} must be a URL such as http://perch-server:7300 (\"\" derives it from server.listen)"
                ),
            );
        }
        check_servers("client", &self.server, &self.servers)
    }

    /// The servers of a `--server` flag or a `PERCH_SERVER` variable (`what`, named in
    /// errors): one URL, or several separated by commas (a leader and its standbys).
    pub fn parse_server_list(text: &str, what: &str) -> Result<Vec<String>> {
        let list: Vec<String> = text
            .split(',')
            .map(|s| s.trim().trim_end_matches('/').to_owned())
            .collect();
        for (i, url) in list.iter().enumerate() {
            if !is_url(url) {
                anyhow::bail!(
                    "{what}: {url:?} is not a URL such as http://perch-server:7300 (several servers: separate them with commas)"
                );
            }
            if list[..i].contains(url) {
                anyhow::bail!("{what}: {url} is named twice; name each server once");
            }
        }
        Ok(list)
    }
}

fn is_url(s: &str) -> bool {
    s.starts_with("http://") || s.starts_with("https://")
}

/// `servers`, else `server` alone (none when it is empty), trailing `/`s trimmed.
pub(super) fn server_list(server: &str, servers: &[String]) -> Vec<String> {
    let trim = |s: &String| s.trim_end_matches('/').to_owned();
    if servers.is_empty() {
        Some(server)
            .filter(|s| !s.is_empty())
            .map(|s| s.trim_end_matches('/').to_owned())
            .into_iter()
            .collect()
    } else {
        servers.iter().map(trim).collect()
    }
}

/// Checks `<section>.servers` (`server` is checked by the section): not beside a `server`,
/// every entry a URL, none twice. The message names the keys and what to write instead.
pub(super) fn check_servers(section: &str, server: &str, servers: &[String]) -> Result<()> {
    if servers.is_empty() {
        return Ok(());
    }
    if !server.is_empty() {
        return bad(
            &format!("{section}.server"),
            &format!(
                "{section}.server and {section}.servers are both set: keep one ({section}.servers = [\"http://a:7300\", \"http://b:7300\"] lists a leader and its standbys; {section}.server names one server)"
            ),
        );
    }
    let key = format!("{section}.servers");
    for (i, url) in servers.iter().enumerate() {
        if !is_url(url) {
            return bad(
                &key,
                &format!("{url:?} must be a URL such as http://perch-server:7300"),
            );
        }
        let base = url.trim_end_matches('/');
        if servers[..i].iter().any(|s| s.trim_end_matches('/') == base) {
            return bad(
                &key,
                &format!("{base} is listed twice; name each server once"),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{Config, refused};

    #[test]
    fn server_lists_are_urls_named_once_and_not_beside_server() {
        for section in ["client", "agent"] {
            let err = refused(&format!(
                "[{section}]\nserver = \"http://a:7300\"\nservers = [\"http://a:7300\", \"http://b:7300\"]\n"
            ));
            assert!(
                err.contains(&format!(
                    "{section}.server and {section}.servers are both set: keep one"
                )),
                "{err}"
            );
            let err = refused(&format!(
                "[{section}]\nservers = [\"http://a:7300\", \"b:7300\"]\n"
            ));
            assert!(
                err.starts_with(&format!(
                    "config key {section}.servers: \"b:7300\" must be a URL"
                )),
                "{err}"
            );
            let err = refused(&format!(
                "[{section}]\nservers = [\"http://a:7300\", \"http://a:7300/\"]\n"
            ));
            assert!(
                err.starts_with(&format!(
                    "config key {section}.servers: http://a:7300 is listed twice"
                )),
                "{err}"
            );
        }
        let c = Config::parse("[client]\nservers = [\"http://a:7300/\", \"https://b:7300\"]\n")
            .expect("valid");
        assert_eq!(
            super::server_list(&c.client.server, &c.client.servers),
            ["http://a:7300", "https://b:7300"]
        );
    }

    #[test]
    fn flag_lists_are_checked_and_name_where_they_came_from() {
        let list =
            super::ClientSection::parse_server_list("http://a:7300/,http://b:7300", "--server")
                .expect("valid");
        assert_eq!(list, ["http://a:7300", "http://b:7300"]);
        let err = super::ClientSection::parse_server_list("http://a:7300,", "PERCH_SERVER")
            .expect_err("empty entry");
        assert!(
            err.to_string()
                .starts_with("PERCH_SERVER: \"\" is not a URL"),
            "{err}"
        );
        let err =
            super::ClientSection::parse_server_list("http://a:7300,http://a:7300", "--server")
                .expect_err("twice");
        assert!(
            err.to_string().contains("http://a:7300 is named twice"),
            "{err}"
        );
    }
}
