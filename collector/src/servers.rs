//! The servers an agent may talk to (`agent.servers`), and the one it uses now: a standby
//! server answers every request with a redirect to the leader it knows of (`307`, header
//! `x-perch-leader`), or with `503` and `x-perch-standby` while it knows none; a dead server
//! refuses connections or times out. [`Servers::route`] reads each answer and moves the agent
//! to the leader, or on to the next configured server; everything in the agent that talks to
//! the server (the sender, job control) shares one [`Servers`], so they follow together.
//!
//! Requests only ever go to configured servers: redirects are not followed by the HTTP client
//! (it would drop the token on another host anyway), and a leader that is not in the list is
//! not contacted. One configured server behaves as before: no answer moves anything.

use crate::error::{CollectorError, Result};
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, LOCATION};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Header of a standby's redirect: the leader's base URL.
pub const LEADER_HEADER: &str = "x-perch-leader";
/// Header of a standby's `503`: it knows no leader yet.
pub const STANDBY_HEADER: &str = "x-perch-standby";

/// The configured servers and the one in use.
#[derive(Debug)]
pub struct Servers {
    /// Base URLs, without a trailing `/`.
    list: Vec<String>,
    current: AtomicUsize,
    /// The ingest server the control server named in its last sync answer
    /// (`SyncResponse::ingest_url`): where telemetry goes instead of the server in use.
    ingest: std::sync::RwLock<Option<String>>,
}

/// What an answer means for where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The server in use answered: handle the answer as usual.
    Answered,
    /// A standby named the leader, a configured server, which is now in use: send again at
    /// once.
    Again,
    /// The next configured server is now in use; the request failed (`reason`) and is retried
    /// there at the next attempt.
    Next(String),
}

/// `url` without a trailing `/`, as servers are compared.
pub fn normalise(url: &str) -> &str {
    url.trim_end_matches('/')
}

/// `scheme://host:port` of `url` (a redirect's `Location`), if it has one.
fn origin(url: &str) -> Option<&str> {
    let (scheme, rest) = url.split_once("://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    Some(&url[..scheme.len() + 3 + end])
}

impl Servers {
    /// `list`, tried from its first entry. Refused: an empty list, an entry that is not an
    /// `http(s)://` URL, an entry named twice.
    pub fn new<S: AsRef<str>>(list: &[S]) -> Result<Self> {
        let mut bases: Vec<String> = Vec::with_capacity(list.len());
        for server in list {
            let server = server.as_ref();
            let base = normalise(server);
            if !(base.starts_with("http://") || base.starts_with("https://")) {
                return Err(CollectorError::Config(format!(
                    "server {server:?} must be a URL such as http://127.0.0.1:7300"
                )));
            }
            if bases.iter().any(|b| b == base) {
                return Err(CollectorError::Config(format!(
                    "server {base} is listed twice; name each server once"
                )));
            }
            bases.push(base.to_owned());
        }
        if bases.is_empty() {
            return Err(CollectorError::Config(
                "no server configured: give one, e.g. http://127.0.0.1:7300".into(),
            ));
        }
        Ok(Self {
            list: bases,
            current: AtomicUsize::new(0),
            ingest: std::sync::RwLock::new(None),
        })
    }

    /// One server: every answer is handled as it was before failover existed.
    pub fn one(server: &str) -> Result<Self> {
        Self::new(&[server])
    }

    /// `list`, starting with `first` when it is one of them.
    pub fn starting_at<S: AsRef<str>>(list: &[S], first: &str) -> Result<Self> {
        let servers = Self::new(list)?;
        if let Some(i) = servers.index_of(first) {
            servers.current.store(i, Ordering::Relaxed);
        }
        Ok(servers)
    }

    /// The configured servers' base URLs.
    pub fn list(&self) -> &[String] {
        &self.list
    }

    /// How many servers are configured.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Never true: a [`Servers`] holds at least one server.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Whether answers may move the agent to another server (more than one is configured).
    pub fn fails_over(&self) -> bool {
        self.list.len() > 1
    }

    /// The server in use: its index (for [`Servers::route`] and [`Servers::failed`]) and base URL.
    pub fn current(&self) -> (usize, &str) {
        let i = self.current.load(Ordering::Relaxed) % self.list.len();
        (i, &self.list[i])
    }

    /// Sends telemetry to `url` (an ingest server the control server named; `None`: to the
    /// server in use). Only `http(s)://` URLs are taken; the change is logged.
    pub fn set_ingest(&self, url: Option<&str>) {
        let url = url
            .map(normalise)
            .filter(|u| u.starts_with("http://") || u.starts_with("https://"));
        let mut ingest = self.ingest.write().unwrap_or_else(|p| p.into_inner());
        if ingest.as_deref() != url {
            match url {
                Some(u) => tracing::info!(
                    ingest = u,
                    "the control server sends this node's telemetry to an ingest server"
                ),
                None => tracing::info!("telemetry goes to the control server again"),
            }
            *ingest = url.map(str::to_owned);
        }
    }

    /// Where telemetry goes when not to the server in use ([`Servers::set_ingest`]).
    pub fn ingest(&self) -> Option<String> {
        self.ingest
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The base URL of the server in use.
    pub fn current_url(&self) -> &str {
        self.current().1
    }

    /// The index of `url` among the configured servers (compared without a trailing `/`).
    pub fn index_of(&self, url: &str) -> Option<usize> {
        let url = normalise(url);
        self.list.iter().position(|s| s == url)
    }

    /// The redirect policy of an HTTP client of these servers: none when there are several,
    /// since [`Servers::route`] follows the leader itself (to configured servers only); one
    /// server keeps the client's default.
    pub fn redirect_policy(&self) -> reqwest::redirect::Policy {
        if self.fails_over() {
            reqwest::redirect::Policy::none()
        } else {
            reqwest::redirect::Policy::default()
        }
    }

    /// Server `from` did not answer (connection refused, a timeout: `why`): the next one is
    /// used from now on.
    pub fn failed(&self, from: usize, why: &str) {
        if self.fails_over() {
            self.switch(from, (from + 1) % self.list.len(), why);
        }
    }

    /// Where the answer `status`, `headers` of server `from` sends requests.
    pub fn route(&self, from: usize, status: StatusCode, headers: &HeaderMap) -> Route {
        if !self.fails_over() {
            return Route::Answered;
        }
        let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
        let server = &self.list[from % self.list.len()];
        if status == StatusCode::TEMPORARY_REDIRECT {
            let leader = header(LEADER_HEADER)
                .map(normalise)
                .or_else(|| header(LOCATION.as_str()).and_then(origin));
            let why = match leader.map(|l| (l, self.index_of(l))) {
                Some((_, Some(to))) if to != from % self.list.len() => {
                    self.switch(
                        from,
                        to,
                        &format!("{server} is a standby and names it as the leader"),
                    );
                    return Route::Again;
                }
                Some((leader, Some(_))) => {
                    format!("{server} redirects to itself ({leader}) as the leader")
                }
                Some((leader, None)) => format!(
                    "{server} is a standby and names {leader} as the leader, which is not among the configured servers (nothing is sent there: add it to the list if it is one of yours)"
                ),
                None => format!("{server} redirects without naming a leader"),
            };
            self.failed(from, &why);
            return Route::Next(why);
        }
        if status == StatusCode::SERVICE_UNAVAILABLE && header(STANDBY_HEADER).is_some() {
            let why = format!("{server} is a standby and knows no leader yet");
            self.failed(from, &why);
            return Route::Next(why);
        }
        Route::Answered
    }

    /// Moves from server `from` to `to`, logging it, unless another request moved already.
    fn switch(&self, from: usize, to: usize, why: &str) {
        if self
            .current
            .compare_exchange(from, to, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
            && from != to
        {
            tracing::warn!(
                server = %self.list[to],
                previous = %self.list[from],
                reason = why,
                "now using server {}",
                self.list[to]
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! Agents against several tiny in-process servers (axum on port 0): a leader that stores
    //! what it gets, standbys that answer as the protocol says, a server that goes away.

    use super::*;
    use crate::agent::{AgentConfig, AgentCounters, AgentStats, NvmlMode, run_agent_with};
    use crate::sender::Backoff;
    use axum::http::{HeaderMap as AxumHeaders, Method, StatusCode as AxumStatus, Uri};
    use axum::response::{IntoResponse, Response};
    use perch_model::{Batch, NodeId};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tokio::sync::{oneshot, watch};

    /// How a test server answers.
    #[derive(Debug, Clone)]
    enum Mode {
        /// Stores batches and syncs, answers 200.
        Lead,
        /// `503`, `Retry-After: 1`, `x-perch-standby: 1`.
        StandbyNoLeader,
        /// `307` to this leader.
        StandbyFollowing(String),
    }

    /// What a test server saw.
    #[derive(Debug, Default)]
    struct Seen {
        /// Every request: method, path, `Authorization` header.
        requests: Vec<(Method, String, Option<String>)>,
        batches: Vec<Batch>,
        syncs: usize,
    }

    struct TestServer {
        url: String,
        seen: Arc<Mutex<Seen>>,
        changed: watch::Sender<u64>,
        stop: Option<oneshot::Sender<()>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl TestServer {
        async fn start(mode: Mode) -> TestServer {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let url = format!("http://{}", listener.local_addr().expect("addr"));
            let seen = Arc::new(Mutex::new(Seen::default()));
            let (changed, _) = watch::channel(0u64);
            let app = axum::Router::new().fallback({
                let (seen, changed) = (seen.clone(), changed.clone());
                move |method: Method, uri: Uri, headers: AxumHeaders, body: bytes::Bytes| {
                    let (seen, changed, mode) = (seen.clone(), changed.clone(), mode.clone());
                    async move { answer(&mode, &seen, &changed, method, &uri, &headers, &body) }
                }
            });
            let (stop, stopped) = oneshot::channel::<()>();
            let task = tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .expect("serve");
            });
            TestServer {
                url,
                seen,
                changed,
                stop: Some(stop),
                task,
            }
        }

        /// Waits until `done` holds of what the server saw.
        async fn until(&self, done: impl Fn(&Seen) -> bool) {
            let mut rx = self.changed.subscribe();
            let seen = self.seen.clone();
            bounded(rx.wait_for(|_| done(&seen.lock().expect("lock"))))
                .await
                .expect("the server runs");
        }

        /// Stops answering and closes the listener: connections are refused from now on.
        async fn kill(&mut self) {
            if let Some(stop) = self.stop.take() {
                let _ = stop.send(());
            }
            bounded(&mut self.task).await.expect("server task");
        }

        fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
            self.seen.lock().expect("lock")
        }
    }

    fn answer(
        mode: &Mode,
        seen: &Mutex<Seen>,
        changed: &watch::Sender<u64>,
        method: Method,
        uri: &Uri,
        headers: &AxumHeaders,
        body: &[u8],
    ) -> Response {
        let path = uri.path().to_owned();
        let auth = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let response = {
            let mut seen = seen.lock().expect("lock");
            seen.requests.push((method, path.clone(), auth));
            match mode {
                Mode::StandbyNoLeader => (
                    AxumStatus::SERVICE_UNAVAILABLE,
                    [("retry-after", "1"), ("x-perch-standby", "1")],
                    r#"{"error":{"code":"standby","message":"this server is a standby and knows no leader yet"}}"#,
                )
                    .into_response(),
                Mode::StandbyFollowing(leader) => (
                    AxumStatus::TEMPORARY_REDIRECT,
                    [
                        ("location", format!("{leader}{uri}")),
                        ("x-perch-leader", leader.clone()),
                    ],
                )
                    .into_response(),
                Mode::Lead if path == "/v1/ingest" => {
                    // Whichever encoding the agent sent, as the server reads it.
                    let raw = zstd::stream::decode_all(body).expect("zstd");
                    let encoding = perch_model::wire::Encoding::from_content_type(
                        headers.get("content-type").and_then(|v| v.to_str().ok()),
                    )
                    .expect("an encoding the server takes");
                    let batch: Batch = encoding.decode(&raw).expect("batch");
                    seen.batches.push(batch);
                    r#"{"accepted":true,"duplicate":false}"#.into_response()
                }
                Mode::Lead if path == "/v1/agent/sync" => {
                    seen.syncs += 1;
                    (
                        [("content-type", "application/json")],
                        r#"{"start":[],"stop":[],"acknowledged":[]}"#,
                    )
                        .into_response()
                }
                Mode::Lead => AxumStatus::NOT_FOUND.into_response(),
            }
        };
        changed.send_modify(|n| *n += 1);
        response
    }

    /// Guards against a hang only: every wait in these tests is for a condition.
    async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(60), f)
            .await
            .expect("test hung")
    }

    const TOKEN: &str = "agent-secret";

    fn agent_config(servers: &[&TestServer], dir: &std::path::Path) -> AgentConfig {
        let list = servers.iter().map(|s| s.url.clone()).collect();
        let mut c = AgentConfig::with_servers(list, NodeId::new("n1").expect("valid"));
        c.interval = Duration::from_millis(5);
        c.sync_interval = Duration::from_millis(20);
        c.nvml = NvmlMode::Off;
        c.simulate_host = true;
        c.simulate_gpus = 1;
        c.data_dir = dir.to_owned();
        c.spool_max_bytes = 0;
        c.max_queue_batches = 100_000;
        c.drain_timeout = Duration::from_secs(30);
        c.backoff = Backoff {
            initial: Duration::from_millis(1),
            max: Duration::from_millis(4),
        };
        c.token = Some(TOKEN.into());
        c
    }

    /// Runs an agent until `stop` is signalled.
    fn spawn(
        config: AgentConfig,
    ) -> (
        oneshot::Sender<()>,
        tokio::task::JoinHandle<crate::Result<AgentStats>>,
    ) {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run_agent_with(
            config,
            async move {
                let _ = stopped.await;
            },
            Arc::new(AgentCounters::default()),
        ));
        (stop, task)
    }

    async fn finish(
        stop: oneshot::Sender<()>,
        task: tokio::task::JoinHandle<crate::Result<AgentStats>>,
    ) -> AgentStats {
        let _ = stop.send(());
        bounded(task).await.expect("agent task").expect("agent ran")
    }

    fn delivered(s: &Seen) -> bool {
        s.batches.len() >= 3 && s.syncs >= 1
    }

    /// Every request the leader got carried the agent's token.
    fn all_with_token(s: &Seen) {
        let want = format!("Bearer {TOKEN}");
        for (method, path, auth) in &s.requests {
            assert_eq!(auth.as_deref(), Some(want.as_str()), "{method} {path}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_standby_without_a_leader_moves_the_agent_to_the_next_server() {
        let standby = TestServer::start(Mode::StandbyNoLeader).await;
        let leader = TestServer::start(Mode::Lead).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let (stop, task) = spawn(agent_config(&[&standby, &leader], dir.path()));
        leader.until(delivered).await;
        let stats = finish(stop, task).await;
        assert!(
            !standby.seen().requests.is_empty(),
            "the standby was tried first"
        );
        assert!(standby.seen().batches.is_empty() && standby.seen().syncs == 0);
        all_with_token(&leader.seen());
        assert_eq!(stats.batches_dropped, 0, "{stats:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_standby_naming_a_configured_leader_sends_the_agent_there_at_once() {
        let leader = TestServer::start(Mode::Lead).await;
        let standby = TestServer::start(Mode::StandbyFollowing(leader.url.clone())).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let (stop, task) = spawn(agent_config(&[&standby, &leader], dir.path()));
        leader.until(delivered).await;
        let stats = finish(stop, task).await;
        assert!(
            !standby.seen().requests.is_empty(),
            "the standby was tried first"
        );
        all_with_token(&leader.seen());
        assert_eq!(
            stats.send_errors, 0,
            "the redirect is followed at once, not as a failed attempt: {stats:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leader_that_is_not_configured_is_never_contacted() {
        let stranger = TestServer::start(Mode::Lead).await;
        let standby = TestServer::start(Mode::StandbyFollowing(stranger.url.clone())).await;
        let leader = TestServer::start(Mode::Lead).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let (stop, task) = spawn(agent_config(&[&standby, &leader], dir.path()));
        leader.until(delivered).await;
        finish(stop, task).await;
        assert!(
            !standby.seen().requests.is_empty(),
            "the standby was tried first"
        );
        assert!(
            stranger.seen().requests.is_empty(),
            "nothing goes to an unconfigured server: {:?}",
            stranger.seen().requests
        );
        all_with_token(&leader.seen());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn when_the_server_in_use_dies_delivery_goes_on_at_the_next_and_nothing_is_lost() {
        let mut first = TestServer::start(Mode::Lead).await;
        let second = TestServer::start(Mode::Lead).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let (stop, task) = spawn(agent_config(&[&first, &second], dir.path()));
        first.until(delivered).await;
        first.kill().await;
        second.until(delivered).await;
        let stats = finish(stop, task).await;
        let mut seqs: Vec<u64> = Vec::new();
        let mut rounds = 0;
        for server in [&first, &second] {
            for b in &server.seen().batches {
                if !seqs.contains(&b.seq) {
                    seqs.push(b.seq);
                    rounds += b.hosts.len() as u64;
                }
            }
        }
        seqs.sort_unstable();
        let (low, high) = (seqs[0], seqs[seqs.len() - 1]);
        assert_eq!(
            high - low + 1,
            seqs.len() as u64,
            "no seq is missing: {seqs:?}"
        );
        assert_eq!(
            rounds, stats.rounds_sampled,
            "every round delivered: {stats:?}"
        );
        assert_eq!((stats.batches_dropped, stats.batches_queued), (0, 0));
        all_with_token(&second.seen());
    }

    #[test]
    fn servers_are_urls_named_once() {
        let err = Servers::new(&["http://a:7300", "b:7300"]).expect_err("not a URL");
        assert!(
            err.to_string().contains("\"b:7300\" must be a URL"),
            "{err}"
        );
        let err = Servers::new(&["http://a:7300", "http://a:7300/"]).expect_err("twice");
        assert!(
            err.to_string().contains("http://a:7300 is listed twice"),
            "{err}"
        );
        assert!(Servers::new::<&str>(&[]).is_err());
        let s = Servers::starting_at(&["http://a:7300/", "http://b:7300"], "http://b:7300/")
            .expect("valid");
        assert_eq!(s.list(), ["http://a:7300", "http://b:7300"]);
        assert_eq!(s.current_url(), "http://b:7300");
    }

    #[test]
    fn answers_route_requests() {
        let s = Servers::new(&["http://a:7300", "http://b:7300", "http://c:7300"]).expect("ok");
        let mut h = HeaderMap::new();
        h.insert(
            LOCATION,
            "http://c:7300/v1/ingest?x=1".parse().expect("value"),
        );
        // The Location's origin names the leader when x-perch-leader is missing.
        assert_eq!(s.route(0, StatusCode::TEMPORARY_REDIRECT, &h), Route::Again);
        assert_eq!(s.current_url(), "http://c:7300");
        h.insert(
            LEADER_HEADER,
            "http://elsewhere:7300".parse().expect("value"),
        );
        assert!(matches!(
            s.route(2, StatusCode::TEMPORARY_REDIRECT, &h),
            Route::Next(why) if why.contains("not among the configured servers")
        ));
        assert_eq!(s.current_url(), "http://a:7300", "round robin");
        let mut standby = HeaderMap::new();
        standby.insert(STANDBY_HEADER, "1".parse().expect("value"));
        assert!(matches!(
            s.route(0, StatusCode::SERVICE_UNAVAILABLE, &standby),
            Route::Next(_)
        ));
        assert_eq!(s.current_url(), "http://b:7300");
        // A plain 503 is the server's own answer, handled as before.
        let plain = HeaderMap::new();
        assert_eq!(
            s.route(1, StatusCode::SERVICE_UNAVAILABLE, &plain),
            Route::Answered
        );
        // A stale failure (another request moved already) moves nothing.
        s.failed(0, "late");
        assert_eq!(s.current_url(), "http://b:7300");
        // One server: nothing moves.
        let one = Servers::one("http://a:7300").expect("ok");
        assert_eq!(
            one.route(0, StatusCode::SERVICE_UNAVAILABLE, &standby),
            Route::Answered
        );
    }
}
