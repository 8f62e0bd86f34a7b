//! Where the client commands (`sql`, `submit`, `jobs`, `show`, `cancel`, `logs`, `queue`,
//! `nodes`, `drain`, `resume`, `alerts`) send their requests, and with which token. One
//! resolution for all of them, so they agree with each other and with the server's own config.
//!
//! The server URL is the first of:
//! 1. `--server`;
//! 2. `PERCH_SERVER`;
//! 3. the config file (`--config` or `PERCH_CONFIG`), from the keys it sets itself:
//!    `[client] server`, else `http://<[server] listen>` (an unspecified address such as
//!    `0.0.0.0` or `[::]` becomes loopback), else `[agent] server`;
//! 4. `[client] server` in the per-user file, `$XDG_CONFIG_HOME/perch/config.toml` (default
//!    `~/.config/perch/config.toml`), which holds only a `[client]` section;
//! 5. `http://127.0.0.1:7300`.
//!
//! The token is the first of `--token`, `PERCH_TOKEN`, the config file's `[client] token` and
//! the per-user file's. Like ssh with its keys, a file that gives the token used must not be
//! readable by group or others, and a token from a file is never sent to the default address,
//! which nothing named and which may be someone else's server.
//!
//! Every answer says where it came from: on a shared host the default address may well be
//! someone else's server, so "cannot reach" and "refused" name the address and its source.
//! [`resolve`] is pure (flags, environment and files come in as arguments); [`load`] reads
//! the real ones.

use crate::config::{ClientSection, ConfigFile};
use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};

/// The server of a client that nothing else names.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7300";

/// Where a setting came from, as error messages name it.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A command-line flag, e.g. `--server`.
    Flag(&'static str),
    /// An environment variable, e.g. `PERCH_SERVER`.
    Env(&'static str),
    /// A key of the config file given by `--config` or `PERCH_CONFIG`.
    ConfigFile { path: PathBuf, key: &'static str },
    /// A key of the per-user file.
    UserFile { path: PathBuf, key: &'static str },
    /// Nothing named a server.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "{flag}"),
            Source::Env(var) => write!(f, "{var}"),
            Source::ConfigFile { path, key } => {
                write!(f, "{key} in config file {}", path.display())
            }
            Source::UserFile { path, key } => {
                write!(f, "{key} in per-user config file {}", path.display())
            }
            Source::Default => write!(
                f,
                "the default, as no --server, PERCH_SERVER, --config/PERCH_CONFIG file or ~/.config/perch/config.toml names a server"
            ),
        }
    }
}

/// Where a client sends its requests, and with which token; each with its source.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientConfig {
    /// Base URL, without a trailing `/`.
    pub server: String,
    pub server_source: Source,
    pub token: Option<String>,
    /// Where the token came from; `None` when there is none.
    pub token_source: Option<Source>,
    /// PEM certificates of a CA to trust for an `https://` server (`PERCH_CA_FILE`, else
    /// `[client] ca_file` of the files, in their order).
    pub ca_file: Option<PathBuf>,
}

impl ClientConfig {
    /// The certificates of `ca_file`, to trust besides the system's roots.
    fn ca_certificates(&self) -> Result<Vec<reqwest::Certificate>> {
        match &self.ca_file {
            Some(path) => Ok(perch_collector::sender::ca_certificates(path)?),
            None => Ok(Vec::new()),
        }
    }

    /// An HTTP client for this server, trusting `ca_file` too.
    pub fn http(&self) -> Result<reqwest::Client> {
        perch_model::tls::use_ring();
        let builder = reqwest::Client::builder();
        let builder = self
            .ca_certificates()?
            .into_iter()
            .fold(builder, |b, c| b.add_root_certificate(c));
        Ok(builder.build()?)
    }

    /// A blocking HTTP client for this server with `timeout`, trusting `ca_file` too.
    pub fn blocking_http(&self, timeout: std::time::Duration) -> Result<reqwest::blocking::Client> {
        perch_model::tls::use_ring();
        let builder = reqwest::blocking::Client::builder().timeout(timeout);
        let builder = self
            .ca_certificates()?
            .into_iter()
            .fold(builder, |b, c| b.add_root_certificate(c));
        Ok(builder.build()?)
    }

    /// The message for a server that does not answer: the address, where it came from, and
    /// what to do.
    pub fn unreachable(&self) -> String {
        format!(
            "cannot reach the perch server at {} (from {}); is it running? Start one with `perch up`, or name yours with --server, PERCH_SERVER or [client] server",
            self.server, self.server_source
        )
    }

    /// What to add to a 401 or 403 answer: which server said it and which token was sent.
    pub fn refused(&self) -> String {
        let token = match &self.token_source {
            Some(source) => format!("token from {source}"),
            None => "no token: give --token, PERCH_TOKEN or [client] token".to_owned(),
        };
        format!(
            "server {} from {}; {token}",
            self.server, self.server_source
        )
    }
}

/// Which of a config file's keys gives the server.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerKey {
    /// A URL, from `[client] server` or `[agent] server`.
    Url(String, &'static str),
    /// `[server] listen`, an address the URL is derived from when it is the one used.
    Listen(String),
}

/// What one file says about the client.
#[derive(Debug, Clone, PartialEq)]
pub struct FileLayer {
    pub path: PathBuf,
    /// The per-user file, rather than the `--config` one.
    pub per_user: bool,
    pub server: Option<ServerKey>,
    /// The token and its key.
    pub token: Option<(String, &'static str)>,
    /// `[client] ca_file`.
    pub ca_file: Option<PathBuf>,
    /// The file's permission bits; a token is refused from a file group or others can read.
    pub mode: u32,
}

impl FileLayer {
    /// The client's view of the `--config` file: only keys the file sets itself count, so a
    /// file without `listen` leaves the server to the per-user file.
    pub fn from_config(file: &ConfigFile, mode: u32) -> FileLayer {
        let c = &file.config;
        let server = if !c.client.server.is_empty() {
            Some(ServerKey::Url(c.client.server.clone(), "client.server"))
        } else if file.sets("server", "listen") {
            Some(ServerKey::Listen(c.server.listen.clone()))
        } else if file.sets("agent", "server") {
            Some(ServerKey::Url(c.agent.server.clone(), "agent.server"))
        } else {
            None
        };
        FileLayer {
            path: file.path.clone(),
            per_user: false,
            server,
            token: Some(c.client.token.clone())
                .filter(|t| !t.is_empty())
                .map(|t| (t, "client.token")),
            ca_file: Some(c.client.ca_file.clone()).filter(|p| !p.as_os_str().is_empty()),
            mode,
        }
    }

    /// The per-user file: a `[client]` section and nothing else.
    pub fn from_user_file(path: &Path, text: &str, mode: u32) -> Result<FileLayer> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct UserFile {
            #[serde(default)]
            client: ClientSection,
        }
        let file: UserFile = toml::from_str(text).with_context(|| {
            format!(
                "in per-user config file {} (it holds one [client] section with the keys server and token)",
                path.display()
            )
        })?;
        let set = |v: String| Some(v).filter(|v| !v.is_empty());
        Ok(FileLayer {
            path: path.to_owned(),
            per_user: true,
            server: set(file.client.server).map(|s| ServerKey::Url(s, "client.server")),
            token: set(file.client.token).map(|t| (t, "client.token")),
            ca_file: Some(file.client.ca_file).filter(|p| !p.as_os_str().is_empty()),
            mode,
        })
    }

    fn source(&self, key: &'static str) -> Source {
        let path = self.path.clone();
        if self.per_user {
            Source::UserFile { path, key }
        } else {
            Source::ConfigFile { path, key }
        }
    }

    /// The server URL this file gives, if any.
    fn server(&self) -> Result<Option<(String, Source)>> {
        Ok(match &self.server {
            None => None,
            Some(ServerKey::Url(url, key)) => Some((url.clone(), self.source(key))),
            Some(ServerKey::Listen(listen)) => {
                let source = self.source("server.listen");
                Some((url_of_listen(listen, &source)?, source))
            }
        })
    }
}

/// `http://<listen>`, with an unspecified address (`0.0.0.0`, `[::]`) turned into loopback.
fn url_of_listen(listen: &str, source: &Source) -> Result<String> {
    let mut addr: std::net::SocketAddr = listen.parse().map_err(|_| {
        anyhow::anyhow!("{source}: {listen:?} is not an address like 127.0.0.1:7300")
    })?;
    if addr.port() == 0 {
        bail!(
            "{source} is {listen}: port 0 lets the OS pick the server's port, so a client cannot know it; set [client] server in that file or give --server"
        );
    }
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    Ok(format!("http://{addr}"))
}

/// Where the per-user file is: `$XDG_CONFIG_HOME/perch/config.toml` when that variable is an
/// absolute path (as the XDG spec asks), else `$HOME/.config/perch/config.toml`.
pub fn user_file_path(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(dir) = env("XDG_CONFIG_HOME").filter(|d| Path::new(d).is_absolute()) {
        return Some(Path::new(&dir).join("perch").join("config.toml"));
    }
    env("HOME").filter(|h| !h.is_empty()).map(|h| {
        Path::new(&h)
            .join(".config")
            .join("perch")
            .join("config.toml")
    })
}

/// The client's server and token from its flags, its environment (`env` looks a variable up)
/// and its files, in the order of precedence the module docs give.
pub fn resolve(
    server_flag: Option<&str>,
    token_flag: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
    config_file: Option<&FileLayer>,
    user_file: Option<&FileLayer>,
) -> Result<ClientConfig> {
    let env = |name: &str| env(name).filter(|v| !v.is_empty());
    let files = [config_file, user_file];
    let files = files.iter().flatten();

    let mut server = match (server_flag, env("PERCH_SERVER")) {
        (Some(url), _) => Some((url.to_owned(), Source::Flag("--server"))),
        (None, Some(url)) => Some((url, Source::Env("PERCH_SERVER"))),
        (None, None) => None,
    };
    for file in files.clone() {
        if server.is_some() {
            break;
        }
        server = file.server()?;
    }
    let (server, server_source) =
        server.unwrap_or_else(|| (DEFAULT_SERVER.to_owned(), Source::Default));
    if !(server.starts_with("http://") || server.starts_with("https://")) {
        bail!("{server_source}: {server:?} is not a URL such as http://perch-server:7300");
    }

    let mut token = match (token_flag, env("PERCH_TOKEN")) {
        (Some(t), _) => Some((t.to_owned(), Source::Flag("--token"))),
        (None, Some(t)) => Some((t, Source::Env("PERCH_TOKEN"))),
        (None, None) => None,
    };
    let ca_file = env("PERCH_CA_FILE")
        .map(PathBuf::from)
        .or_else(|| files.clone().find_map(|f| f.ca_file.clone()));
    for file in files {
        if token.is_some() {
            break;
        }
        if let Some((t, key)) = &file.token {
            if file.mode & 0o077 != 0 {
                let path = file.path.display();
                bail!(
                    "{path} gives a token ({key}) but group or others may read it (mode {:03o}): run `chmod 600 {path}`",
                    file.mode & 0o777
                );
            }
            token = Some((t.clone(), file.source(key)));
        }
    }
    let (token, token_source) = token
        .filter(|(t, _)| !t.is_empty())
        .map_or((None, None), |(t, s)| (Some(t), Some(s)));
    // A token kept in a file goes only to a server something named: the default address may
    // be someone else's server on a shared host, and would receive the token in clear.
    if server_source == Source::Default
        && let Some(source @ (Source::ConfigFile { .. } | Source::UserFile { .. })) = &token_source
    {
        bail!(
            "the token from {source} is not sent to {DEFAULT_SERVER}, which nothing named (on a shared host it may be someone else's server): set [client] server beside the token, or give --server or PERCH_SERVER"
        );
    }

    Ok(ClientConfig {
        server: server.trim_end_matches('/').to_owned(),
        server_source,
        token,
        token_source,
        ca_file,
    })
}

/// [`resolve`] with this process's environment and files: `config_file` is the `--config` /
/// `PERCH_CONFIG` file, if one was given; the per-user file is read when it exists.
pub fn load(
    server_flag: Option<&str>,
    token_flag: Option<&str>,
    config_file: Option<&ConfigFile>,
) -> Result<ClientConfig> {
    let env = |name: &str| std::env::var(name).ok();
    let config_file = match config_file {
        Some(file) => Some(FileLayer::from_config(file, mode_of(&file.path)?)),
        None => None,
    };
    let user_file = match user_file_path(&env) {
        Some(path) => read_user_file(&path)?,
        None => None,
    };
    resolve(
        server_flag,
        token_flag,
        &env,
        config_file.as_ref(),
        user_file.as_ref(),
    )
}

/// The per-user file, or `None` when there is none.
fn read_user_file(path: &Path) -> Result<Option<FileLayer>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(e)
                .with_context(|| format!("reading per-user config file {}", path.display()));
        }
    };
    FileLayer::from_user_file(path, &text, mode_of(path)?).map(Some)
}

fn mode_of(path: &Path) -> Result<u32> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(meta.permissions().mode())
}

#[cfg(test)]
mod tests;
