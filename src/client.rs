//! Where the client commands (`sql`, `submit`, `jobs`, `show`, `cancel`, `logs`, `queue`,
//! `nodes`, `drain`, `resume`, `alerts`) send their requests, and with which token. One
//! resolution for all of them, so they agree with each other and with the server's own config.
//!
//! The server URL is the first of:
//! 1. `--server`;
//! 2. `PERCH_SERVER`;
//! 3. the config file (`--config` or `PERCH_CONFIG`), from the keys it sets itself:
//!    `[client] server` or `servers`, else `http://<[server] listen>` (an unspecified address
//!    such as `0.0.0.0` or `[::]` becomes loopback), else `[agent] server` or `servers`;
//! 4. `[client] server` or `servers` in the per-user file, `$XDG_CONFIG_HOME/perch/config.toml`
//!    (default `~/.config/perch/config.toml`), which holds only a `[client]` section;
//! 5. `http://127.0.0.1:7300`.
//!
//! Each may name several servers, a leader and its standbys (`--server` and `PERCH_SERVER`
//! separate them with commas). [`Connection`] then sends each request to the one in use and
//! follows the leader: a standby's redirect to a configured server is followed at once (the
//! HTTP client follows no redirect itself, so the token only goes to configured servers); a
//! standby that knows no leader, a refused connection or a timeout moves to the next server.
//! After two rounds over the list the request fails, naming every server tried.
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
    /// Base URL, without a trailing `/`: the first of `servers`.
    pub server: String,
    /// Every server named (at least one): a leader and its standbys. Base URLs without a
    /// trailing `/`.
    pub servers: Vec<String>,
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

    /// A blocking HTTP client for these servers with `timeout` (`None`: none), trusting
    /// `ca_file` too. With several servers it follows no redirect ([`Connection`] does) and
    /// gives up connecting after 5 s, to move on to the next server.
    pub fn blocking_http(
        &self,
        timeout: Option<std::time::Duration>,
    ) -> Result<reqwest::blocking::Client> {
        perch_model::tls::use_ring();
        let mut builder = reqwest::blocking::Client::builder().timeout(timeout);
        if self.servers.len() > 1 {
            builder = builder
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(CONNECT_TIMEOUT);
        }
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

    /// [`ClientConfig::unreachable`] for several servers: each with what happened there.
    fn none_leads(&self, tried: &[(String, String)]) -> String {
        let tried: Vec<String> = tried.iter().map(|(s, why)| format!("{s}: {why}")).collect();
        format!(
            "cannot reach a leading perch server among {} (from {}); tried {}. Is one of them running and leading? Name yours with --server, PERCH_SERVER or [client] servers",
            self.servers.join(", "),
            self.server_source,
            tried.join("; ")
        )
    }

    /// What to add to a 401 or 403 (`forbidden`) answer of `server`: which server said it and
    /// which token was sent. A 403 to a request without a token comes from a server that runs
    /// open (one with tokens answers 401): a token would change nothing there.
    pub fn refused_by(&self, server: &str, forbidden: bool) -> String {
        let token = match &self.token_source {
            Some(source) => format!("token from {source}"),
            None if forbidden => {
                "no token sent: this server runs open and knows you as your local user".to_owned()
            }
            None => "no token: give --token, PERCH_TOKEN or [client] token".to_owned(),
        };
        format!("server {server} from {}; {token}", self.server_source)
    }
}

/// How long a client of several servers waits for a connection before it tries the next.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A standby's header naming the leader's base URL, in its `307` answers.
const LEADER_HEADER: &str = "x-perch-leader";
/// A standby's header in its `503` answers while it knows no leader.
const STANDBY_HEADER: &str = "x-perch-standby";

/// A blocking client of the configured servers that sends each request to the one in use and
/// follows the leader among them (see the module documentation).
#[derive(Debug)]
pub struct Connection {
    pub config: ClientConfig,
    client: reqwest::blocking::Client,
    /// Index in `config.servers` of the server in use.
    current: std::cell::Cell<usize>,
}

/// What a server's answer means for where the request goes.
enum Step {
    Answered(reqwest::blocking::Response),
    /// Now to this server at once: the leader a standby named.
    Leader(usize),
    /// Move on to the next server; why this one did not do.
    Next(String),
}

impl Connection {
    /// A client of `config`'s servers whose requests time out after `timeout` (`None`: never).
    pub fn new(config: ClientConfig, timeout: Option<std::time::Duration>) -> Result<Connection> {
        let client = config.blocking_http(timeout)?;
        Ok(Connection {
            config,
            client,
            current: std::cell::Cell::new(0),
        })
    }

    /// The base URL of the server in use.
    pub fn server(&self) -> &str {
        &self.config.servers[self.current.get()]
    }

    /// What to add to a 401 or 403 (`forbidden`) answer of the server in use.
    pub fn refused(&self, forbidden: bool) -> String {
        self.config.refused_by(self.server(), forbidden)
    }

    /// Sends the request `build` makes from the HTTP client and a server's base URL, with the
    /// token, to the server in use, following the leader; answers the response, whatever its
    /// status. One server: one try, as the request is. A request that may change something
    /// (not GET or HEAD) is only sent again after a timeout if the connection was never made:
    /// the server in use may have carried it out.
    pub fn send(
        &self,
        build: impl Fn(&reqwest::blocking::Client, &str) -> reqwest::blocking::RequestBuilder,
    ) -> Result<reqwest::blocking::Response> {
        let servers = &self.config.servers;
        if servers.len() == 1 {
            return self
                .request(&build, 0)?
                .send()
                .with_context(|| self.config.unreachable());
        }
        let mut tried: Vec<(String, String)> = Vec::new();
        for _ in 0..2 * servers.len() {
            let at = self.current.get();
            let request = self.request(&build, at)?.build()?;
            let safe = matches!(
                *request.method(),
                reqwest::Method::GET | reqwest::Method::HEAD
            );
            let step = match self.client.execute(request) {
                Ok(response) => self.step(at, response),
                Err(e) if e.is_timeout() && !e.is_connect() && !safe => {
                    return Err(anyhow::Error::new(e).context(format!(
                        "no answer from the perch server at {} within the time limit; it may have carried the request out: check before trying again",
                        servers[at]
                    )));
                }
                Err(e) => Step::Next(perch_collector::sender::error_chain(&e)),
            };
            match step {
                Step::Answered(response) => return Ok(response),
                Step::Leader(to) => {
                    tried.push((
                        servers[at].clone(),
                        format!("a standby naming {} as the leader", servers[to]),
                    ));
                    self.current.set(to);
                }
                Step::Next(why) => {
                    tried.push((servers[at].clone(), why));
                    self.current.set((at + 1) % servers.len());
                }
            }
        }
        bail!(self.config.none_leads(&tried))
    }

    /// The request for server `at`, with the token (servers are all configured ones).
    fn request(
        &self,
        build: &impl Fn(&reqwest::blocking::Client, &str) -> reqwest::blocking::RequestBuilder,
        at: usize,
    ) -> Result<reqwest::blocking::RequestBuilder> {
        let request = build(&self.client, &self.config.servers[at]);
        Ok(match &self.config.token {
            Some(t) => request.bearer_auth(t),
            None => request,
        })
    }

    /// Where the answer of server `at` sends the request.
    fn step(&self, at: usize, response: reqwest::blocking::Response) -> Step {
        let servers = &self.config.servers;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let status = response.status();
        if status == reqwest::StatusCode::TEMPORARY_REDIRECT {
            let leader = header(LEADER_HEADER)
                .map(|l| l.trim_end_matches('/').to_owned())
                .or_else(|| header("location").and_then(|l| origin(&l).map(str::to_owned)));
            return match leader {
                Some(leader) => match servers.iter().position(|s| *s == leader) {
                    Some(to) if to != at => Step::Leader(to),
                    Some(_) => Step::Next("a standby naming itself as the leader".into()),
                    None => Step::Next(format!(
                        "a standby naming {leader} as the leader, which is not among the servers named (nothing was sent there: add it to the list if it is yours)"
                    )),
                },
                None => Step::Next("a redirect that names no leader".into()),
            };
        }
        if status == reqwest::StatusCode::SERVICE_UNAVAILABLE && header(STANDBY_HEADER).is_some() {
            return Step::Next("a standby that knows no leader yet".into());
        }
        Step::Answered(response)
    }
}

/// `scheme://host:port` of `url` (a redirect's `Location`).
fn origin(url: &str) -> Option<&str> {
    let (scheme, rest) = url.split_once("://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    Some(&url[..scheme.len() + 3 + end])
}

/// Which of a config file's keys gives the server.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerKey {
    /// URLs, from `[client] server` or `servers`, or `[agent] server` or `servers`.
    Urls(Vec<String>, &'static str),
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
        let agent = (file.sets("agent", "server") || file.sets("agent", "servers"))
            .then(|| urls(&c.agent.server, &c.agent.servers, AGENT_KEYS))
            .flatten();
        let server = if let Some(client) = urls(&c.client.server, &c.client.servers, CLIENT_KEYS) {
            Some(client)
        } else if file.sets("server", "listen") {
            Some(ServerKey::Listen(c.server.listen.clone()))
        } else {
            agent
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
                "in per-user config file {} (it holds one [client] section with the keys server or servers, token and ca_file)",
                path.display()
            )
        })?;
        let set = |v: String| Some(v).filter(|v| !v.is_empty());
        if !file.client.server.is_empty() && !file.client.servers.is_empty() {
            bail!(
                "per-user config file {}: client.server and client.servers are both set: keep one (servers lists a leader and its standbys)",
                path.display()
            );
        }
        Ok(FileLayer {
            path: path.to_owned(),
            per_user: true,
            server: urls(&file.client.server, &file.client.servers, CLIENT_KEYS),
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

    /// The server URLs this file gives, if any.
    fn server(&self) -> Result<Option<(Vec<String>, Source)>> {
        Ok(match &self.server {
            None => None,
            Some(ServerKey::Urls(urls, key)) => Some((urls.clone(), self.source(key))),
            Some(ServerKey::Listen(listen)) => {
                let source = self.source("server.listen");
                Some((vec![url_of_listen(listen, &source)?], source))
            }
        })
    }
}

/// The `server` or `servers` of a file's `[client]` or `[agent]` (`keys`), when it names any.
fn urls(server: &str, servers: &[String], keys: (&'static str, &'static str)) -> Option<ServerKey> {
    if !servers.is_empty() {
        Some(ServerKey::Urls(servers.to_vec(), keys.1))
    } else {
        (!server.is_empty()).then(|| ServerKey::Urls(vec![server.to_owned()], keys.0))
    }
}

const CLIENT_KEYS: (&str, &str) = ("client.server", "client.servers");
const AGENT_KEYS: (&str, &str) = ("agent.server", "agent.servers");

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
        (Some(urls), _) => Some((urls.to_owned(), Source::Flag("--server"))),
        (None, Some(urls)) => Some((urls, Source::Env("PERCH_SERVER"))),
        (None, None) => None,
    }
    .map(|(urls, source)| {
        ClientSection::parse_server_list(&urls, &source.to_string()).map(|urls| (urls, source))
    })
    .transpose()?;
    for file in files.clone() {
        if server.is_some() {
            break;
        }
        server = file.server()?;
    }
    let (servers, server_source) =
        server.unwrap_or_else(|| (vec![DEFAULT_SERVER.to_owned()], Source::Default));
    let servers: Vec<String> = servers
        .iter()
        .map(|s| s.trim_end_matches('/').to_owned())
        .collect();
    for (i, server) in servers.iter().enumerate() {
        if !(server.starts_with("http://") || server.starts_with("https://")) {
            bail!("{server_source}: {server:?} is not a URL such as http://perch-server:7300");
        }
        if servers[..i].contains(server) {
            bail!("{server_source}: {server} is named twice; name each server once");
        }
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
        server: servers[0].clone(),
        servers,
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

#[cfg(test)]
mod failover_tests {
    //! [`Connection`] against tiny HTTP servers on port 0, each on a thread of its own.

    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::sync::{Arc, Mutex};

    /// What a tiny server does with a request for `path`: the raw response, or `None` to keep
    /// the connection open unanswered until the test ends.
    type Respond = Box<dyn Fn(&str) -> Option<String> + Send>;

    /// Request line and `Authorization` header of a request.
    type Seen = (String, Option<String>);

    struct Tiny {
        url: String,
        /// Every request.
        seen: Arc<Mutex<Vec<Seen>>>,
    }

    impl Tiny {
        fn start(respond: Respond) -> Tiny {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let url = format!("http://{}", listener.local_addr().expect("addr"));
            let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
            let record = seen.clone();
            std::thread::spawn(move || {
                // Connections left unanswered stay open here until the test process ends.
                let mut held = Vec::new();
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { continue };
                    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                    let mut line = String::new();
                    reader.read_line(&mut line).expect("request line");
                    let (mut auth, mut length) = (None, 0usize);
                    loop {
                        let mut header = String::new();
                        reader.read_line(&mut header).expect("header");
                        let header = header.trim_end();
                        if header.is_empty() {
                            break;
                        }
                        let (name, value) = header.split_once(':').expect("header");
                        match name.to_ascii_lowercase().as_str() {
                            "authorization" => auth = Some(value.trim().to_owned()),
                            "content-length" => length = value.trim().parse().expect("length"),
                            _ => {}
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).expect("body");
                    let path = line.split(' ').nth(1).unwrap_or("").to_owned();
                    record
                        .lock()
                        .expect("lock")
                        .push((line.trim_end().to_owned(), auth));
                    match respond(&path) {
                        Some(response) => {
                            let _ = stream.write_all(response.as_bytes());
                        }
                        None => held.push(stream),
                    }
                }
            });
            Tiny { url, seen }
        }

        fn requests(&self) -> Vec<Seen> {
            self.seen.lock().expect("lock").clone()
        }
    }

    fn reply(status: &str, headers: &[(&str, String)], body: &str) -> String {
        let mut text = format!("HTTP/1.1 {status}\r\nconnection: close\r\n");
        for (name, value) in headers {
            text.push_str(&format!("{name}: {value}\r\n"));
        }
        text.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
        text
    }

    fn leader() -> Tiny {
        Tiny::start(Box::new(|_| {
            Some(reply(
                "200 OK",
                &[("content-type", "application/json".into())],
                r#"{"ok":true}"#,
            ))
        }))
    }

    fn standby_following(leader: &str) -> Tiny {
        let leader = leader.to_owned();
        Tiny::start(Box::new(move |path| {
            Some(reply(
                "307 Temporary Redirect",
                &[
                    ("location", format!("{leader}{path}")),
                    ("x-perch-leader", leader.clone()),
                ],
                "",
            ))
        }))
    }

    fn standby_without_leader() -> Tiny {
        Tiny::start(Box::new(|_| {
            Some(reply(
                "503 Service Unavailable",
                &[
                    ("retry-after", "1".into()),
                    ("x-perch-standby", "1".into()),
                    ("content-type", "application/json".into()),
                ],
                r#"{"error":{"code":"standby","message":"no leader known yet"}}"#,
            ))
        }))
    }

    /// The URL of a server that is gone: connections are refused.
    fn dead() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", listener.local_addr().expect("addr"))
    }

    fn connection(servers: &[&str], timeout: std::time::Duration) -> Connection {
        let flag = servers.join(",");
        let config =
            resolve(Some(&flag), Some("user-secret"), &|_| None, None, None).expect("resolves");
        assert_eq!(config.servers.len(), servers.len());
        Connection::new(config, Some(timeout)).expect("client")
    }

    fn get(c: &Connection, path: &str) -> Result<reqwest::blocking::Response> {
        c.send(|http, server| http.get(format!("{server}{path}")))
    }

    const BEARER: &str = "Bearer user-secret";
    const LONG: std::time::Duration = std::time::Duration::from_secs(30);

    #[test]
    fn a_redirect_to_a_configured_leader_is_followed_with_the_token() {
        let leader = leader();
        let standby = standby_following(&leader.url);
        let c = connection(&[&standby.url, &leader.url], LONG);
        let response = get(&c, "/v1/nodes?x=1").expect("answered");
        assert_eq!(response.status(), 200);
        assert_eq!(c.server(), leader.url, "the leader is in use now");
        assert_eq!(
            leader.requests(),
            [(
                "GET /v1/nodes?x=1 HTTP/1.1".to_owned(),
                Some(BEARER.to_owned())
            )]
        );
        assert_eq!(standby.requests().len(), 1);
        // The next request goes straight to the leader.
        get(&c, "/v1/queue").expect("answered");
        assert_eq!(standby.requests().len(), 1);
    }

    #[test]
    fn a_redirect_to_an_unconfigured_server_sends_nothing_there() {
        let stranger = leader();
        let standby = standby_following(&stranger.url);
        let leader = leader();
        let c = connection(&[&standby.url, &leader.url], LONG);
        let response = c
            .send(|http, server| http.post(format!("{server}/v1/jobs")).json(&"job"))
            .expect("answered");
        assert_eq!(response.status(), 200);
        assert!(stranger.requests().is_empty(), "{:?}", stranger.requests());
        assert_eq!(leader.requests().len(), 1);
        assert_eq!(leader.requests()[0].1.as_deref(), Some(BEARER));
    }

    #[test]
    fn a_standby_without_a_leader_or_a_dead_server_moves_on_to_the_next() {
        let standby = standby_without_leader();
        let leader = leader();
        let gone = dead();
        let c = connection(&[&gone, &standby.url, &leader.url], LONG);
        assert_eq!(get(&c, "/v1/nodes").expect("answered").status(), 200);
        assert_eq!(c.server(), leader.url);
        assert_eq!(standby.requests().len(), 1);
        assert_eq!(leader.requests()[0].1.as_deref(), Some(BEARER));
    }

    #[test]
    fn after_two_rounds_the_error_names_every_server_tried() {
        let standby = standby_without_leader();
        let gone = dead();
        let c = connection(&[&standby.url, &gone], LONG);
        let err = format!("{:#}", get(&c, "/v1/nodes").expect_err("no leader"));
        assert!(
            err.starts_with("cannot reach a leading perch server among"),
            "{err}"
        );
        assert!(err.contains(&standby.url) && err.contains(&gone), "{err}");
        assert!(err.contains("knows no leader yet"), "{err}");
        assert_eq!(standby.requests().len(), 2, "two rounds");
    }

    #[test]
    fn a_change_without_an_answer_is_not_sent_again_elsewhere() {
        let silent = Tiny::start(Box::new(|_| None));
        let leader = leader();
        let c = connection(
            &[&silent.url, &leader.url],
            std::time::Duration::from_millis(300),
        );
        let err = c
            .send(|http, server| http.post(format!("{server}/v1/jobs")).json(&"job"))
            .expect_err("timed out");
        assert!(
            format!("{err:#}").contains("may have carried the request out"),
            "{err:#}"
        );
        assert!(leader.requests().is_empty(), "not submitted twice");
        // A read is safe to send again.
        assert_eq!(get(&c, "/v1/nodes").expect("answered").status(), 200);
    }

    #[test]
    fn server_lists_from_flags_variables_and_files() {
        let env = |name: &str| {
            (name == "PERCH_SERVER").then(|| "http://a:7300/, http://b:7300".to_owned())
        };
        let got = resolve(None, None, &env, None, None).expect("env list");
        assert_eq!(got.servers, ["http://a:7300", "http://b:7300"]);
        assert_eq!(got.server, "http://a:7300");
        let err = resolve(Some("http://a:7300,b:7300"), None, &|_| None, None, None)
            .expect_err("not a URL")
            .to_string();
        assert!(
            err.starts_with("--server: \"b:7300\" is not a URL"),
            "{err}"
        );
        let err = resolve(
            Some("http://a:7300,http://a:7300/"),
            None,
            &|_| None,
            None,
            None,
        )
        .expect_err("twice")
        .to_string();
        assert!(err.contains("http://a:7300 is named twice"), "{err}");
        let file = |text: &str| {
            let file =
                crate::config::ConfigFile::parse(Path::new("/etc/perch.toml"), text).expect(text);
            FileLayer::from_config(&file, 0o100600)
        };
        let layer = file("[client]\nservers = [\"http://a:7300\", \"http://b:7300\"]\n");
        let got = resolve(None, None, &|_| None, Some(&layer), None).expect("file list");
        assert_eq!(got.servers, ["http://a:7300", "http://b:7300"]);
        assert_eq!(
            got.server_source.to_string(),
            "client.servers in config file /etc/perch.toml"
        );
        let layer = file("[agent]\nservers = [\"http://a:7300\", \"http://b:7300\"]\n");
        let got = resolve(None, None, &|_| None, Some(&layer), None).expect("agent list");
        assert_eq!(got.servers.len(), 2);
        let user = FileLayer::from_user_file(
            Path::new("/u/config.toml"),
            "[client]\nservers = [\"http://u:7300\", \"http://v:7300\"]\n",
            0o100600,
        )
        .expect("user file");
        let got = resolve(None, None, &|_| None, None, Some(&user)).expect("user list");
        assert_eq!(got.servers, ["http://u:7300", "http://v:7300"]);
    }
}
