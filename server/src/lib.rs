//! perch's HTTP server: the ingest endpoint agents push to, read-only SQL, the Prometheus
//! endpoint, and liveness and readiness.
//!
//! [`serve`] takes a listener that is already bound and a shutdown future, so tests bind
//! `127.0.0.1:0` and never race for a port or sleep for readiness. On shutdown the store's
//! buffer is flushed to Parquet.

pub mod accounting;
pub mod alerting;
pub mod auth;
pub mod cluster;
pub use perch_model::clock;
mod error;
pub mod ha;
mod ingest;
pub mod jobs;
mod latest;
pub mod listener;
mod metrics;
pub mod node_status;
mod otlp;
mod pg;
pub mod routes;
mod sql;
pub mod tls;
pub mod validation;
mod web;

pub use error::{ApiError, ErrorCode};
pub use latest::Latest;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use perch_query::{QueryLimits, SqlEngine, Store, StoreConfig};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;

/// What the server needs to start.
/// The default of `server.pg_max_connections`: PostgreSQL's own default is 100. Within the
/// descriptors the HTTP listener leaves for the rest of the server ([`listener`]).
pub const PG_MAX_CONNECTIONS: usize = 256;

/// The default of `server.max_syncs_per_second`: up to 1,000 nodes sync at the agents' own
/// 500 ms; a larger fleet is paced slower (BENCHMARKS.md, "Fleet size").
pub const MAX_SYNCS_PER_SECOND: u32 = 2_000;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub store: StoreConfig,
    pub query: QueryLimits,
    /// Largest request body accepted, after decompression.
    pub max_body_bytes: usize,
    /// Nodes silent for longer than this are reported as not reporting on `/metrics`.
    pub node_stale_after: Duration,
    pub jobs: perch_control::JobsConfig,
    /// Accepted bearer tokens; open (no authentication) by default.
    pub tokens: auth::Tokens,
    /// Address of the PostgreSQL-protocol SQL listener, if any.
    pub pg_listen: Option<String>,
    /// Connections that listener serves at once (`server.pg_max_connections`).
    pub pg_max_connections: usize,
    /// The certificate both listeners serve TLS with; `None`: plain HTTP and PostgreSQL.
    pub tls: Option<Arc<tls::Certificates>>,
    /// The HTTP listener's connection cap and idle timeout.
    pub connections: listener::ConnectionLimits,
    /// Prices and the folding of telemetry into job accounting.
    pub accounting: accounting::AccountingConfig,
    /// Alert rules, notifications and remediation guardrails.
    pub alerts: perch_alerts::AlertsConfig,
    /// Where the scheduling policy is read again on SIGHUP (the config file); `None`: the
    /// policy stays as started.
    pub policy_source: Option<PolicySource>,
    /// Where the alerting configuration is read again on SIGHUP (the config file); `None`:
    /// the rules stay as started.
    pub alerts_source: Option<AlertsSource>,
    /// Where every "now" the server takes comes from (the system's; a manual one in tests).
    pub clock: clock::Clock,
    /// This server's part in a deployment with a standby (`[ha]`); `None`: one server.
    pub ha: Option<ha::Ha>,
    /// This server's part in a deployment that spreads telemetry over several servers
    /// (`[cluster]`).
    pub cluster: cluster::Cluster,
    /// The syncs a second the whole fleet is paced to (`server.max_syncs_per_second`): each
    /// sync answer says how long the node waits before the next ([`jobs::sync_pace`]).
    pub max_syncs_per_second: u32,
    /// What a node runs to prove its GPUs healthy before it takes work again
    /// (`[validation]`, [`validation`]).
    pub validation: perch_control::validation::Config,
}

/// Reads the scheduling policy again (the config file's `[scheduler]`); the error says what
/// to change.
#[derive(Clone)]
pub struct PolicySource(Arc<dyn Fn() -> Result<perch_scheduler::Config, String> + Send + Sync>);

impl PolicySource {
    pub fn new(
        read: impl Fn() -> Result<perch_scheduler::Config, String> + Send + Sync + 'static,
    ) -> Self {
        PolicySource(Arc::new(read))
    }

    pub fn read(&self) -> Result<perch_scheduler::Config, String> {
        (self.0)()
    }
}

/// Reads the alerting configuration again (the config file's `[alerts]`); the error says what
/// to change.
#[derive(Clone)]
pub struct AlertsSource(Arc<dyn Fn() -> Result<perch_alerts::AlertsConfig, String> + Send + Sync>);

impl AlertsSource {
    pub fn new(
        read: impl Fn() -> Result<perch_alerts::AlertsConfig, String> + Send + Sync + 'static,
    ) -> Self {
        AlertsSource(Arc::new(read))
    }

    pub fn read(&self) -> Result<perch_alerts::AlertsConfig, String> {
        (self.0)()
    }
}

impl std::fmt::Debug for AlertsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AlertsSource")
    }
}

impl std::fmt::Debug for PolicySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PolicySource")
    }
}

impl ServerConfig {
    pub fn new(store: StoreConfig) -> Self {
        ServerConfig {
            store,
            query: QueryLimits::default(),
            max_body_bytes: 64 << 20,
            node_stale_after: Duration::from_secs(60),
            jobs: perch_control::JobsConfig::default(),
            tokens: auth::Tokens::open(),
            pg_listen: None,
            pg_max_connections: PG_MAX_CONNECTIONS,
            tls: None,
            connections: listener::ConnectionLimits::default(),
            accounting: accounting::AccountingConfig::default(),
            alerts: perch_alerts::AlertsConfig::default(),
            policy_source: None,
            alerts_source: None,
            clock: clock::Clock::system(),
            ha: None,
            cluster: cluster::Cluster::Single,
            max_syncs_per_second: MAX_SYNCS_PER_SECOND,
            validation: perch_control::validation::Config::default(),
        }
    }
}

/// Shared by every request handler.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<Store>,
    pub sql: Arc<SqlEngine>,
    pub latest: Arc<Latest>,
    pub metrics: Arc<metrics::ServerMetrics>,
    pub ready: Arc<AtomicBool>,
    pub config: Arc<ServerConfig>,
    pub jobs: perch_control::JobService,
    pub tokens: Arc<auth::Tokens>,
    /// The alert engine, its senders and its persisted state.
    pub alerts: Arc<alerting::AlertService>,
    /// Commands for agents to run on their nodes (remediation), and their results.
    pub node_commands: Arc<perch_control::node_commands::NodeCommands>,
    /// On an ingest server: each node's latest state on its way to the control server.
    pub forward: Option<Arc<cluster::Forwarder>>,
    /// The control plane's audit events on their way to the `events` table; [`serve`] takes
    /// it and appends them.
    events: Arc<std::sync::Mutex<Option<EventReceiver>>>,
}

type EventReceiver = tokio::sync::mpsc::UnboundedReceiver<Vec<perch_model::ClusterEvent>>;

impl AppState {
    /// Now, by the server's clock.
    pub fn now_ms(&self) -> i64 {
        self.config.clock.now_ms()
    }

    /// Opens the store (replaying its write-ahead log) and the job database, and builds the
    /// state.
    pub fn open(config: ServerConfig) -> Result<AppState, OpenError> {
        AppState::open_with(config, None)
    }

    /// Opens the server on `job_store`, or the embedded one (`control/jobs.redb` in the data
    /// directory) when `None`.
    pub fn open_with(
        config: ServerConfig,
        job_store: Option<Arc<dyn perch_control::JobStore>>,
    ) -> Result<AppState, OpenError> {
        let store = Store::open(config.store.clone())?;
        let (events_tx, events_rx) = perch_control::JobService::event_channel();
        // The control plane keeps the server's time.
        let history = accounting::history::History::open(
            &config.store.data_dir.join("control"),
            job_store,
            perch_control::JobsConfig {
                clock: config.clock.clone(),
                ..config.jobs.clone()
            },
            events_tx,
        )?;
        let jobs = history.jobs().clone();
        let sql = Arc::new(accounting::tables::register(
            SqlEngine::new(store.clone(), config.query),
            &history,
            config.accounting.clone(),
        ));
        let (alerts, restored) = alerting::AlertService::open(
            config.alerts.clone(),
            &config.store.data_dir,
            config.clock.now_ms(),
        )
        .map_err(OpenError::Alerts)?;
        if !restored.is_empty() {
            tracing::info!(
                transitions = restored.len(),
                "alert states restored; alerts that resolved while perch was down are resolved"
            );
        }
        Ok(AppState {
            forward: config
                .cluster
                .is_ingest()
                .then(|| Arc::new(cluster::Forwarder::default())),
            alerts: Arc::new(alerts),
            node_commands: Arc::default(),
            store,
            sql,
            latest: Arc::new(Latest::default()),
            metrics: Arc::new(metrics::ServerMetrics::default()),
            ready: Arc::new(AtomicBool::new(true)),
            tokens: Arc::new(config.tokens.clone()),
            config: Arc::new(config),
            jobs,
            events: Arc::new(std::sync::Mutex::new(Some(events_rx))),
        })
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("{0}")]
    Store(#[from] perch_query::Error),
    #[error("{0}")]
    Jobs(#[from] perch_control::ControlError),
    #[error("alerts: {0}")]
    Alerts(String),
}

/// The HTTP routes.
pub fn router(state: AppState) -> Router {
    let limit = state.config.max_body_bytes;
    let routes = routes::ROUTES.iter().fold(Router::new(), |router, r| {
        router.route(r.path, r.handler(limit))
    });
    routes
        .fallback(error::not_found)
        .layer(axum::middleware::from_fn(error::json_errors))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            cluster::ingest_only,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::middleware,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .layer(tower_http::decompression::RequestDecompressionLayer::new())
        // Answers gzipped for clients that ask (browsers, Prometheus): `/v1/nodes` of a
        // 1,000-node fleet is megabytes of JSON every few seconds.
        .layer(tower_http::compression::CompressionLayer::new())
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(http_span)
                .on_response(
                    |response: &axum::response::Response, _: Duration, span: &tracing::Span| {
                        span.record("http.response.status_code", response.status().as_u16());
                    },
                ),
        )
        // Outermost: a request's connection is busy from the moment its head is in.
        .layer(axum::middleware::from_fn(listener::track_requests))
        .with_state(state)
}

/// The least body an agent's sync is allowed, whatever `server.max_body_mb` says: a sync carries
/// up to 8 MiB of job output, which JSON can make 48 MiB (a control byte is written `\u0001`).
/// Refusing it would refuse the node's lease renewal, and its supervisors would stop every job
/// of the node. With tokens only agents reach this route (the check comes before the body).
pub const SYNC_BODY_MIN: usize = 64 << 20;

/// One span per request, named as OpenTelemetry names HTTP server spans: method and route
/// (`POST /v1/jobs/{id}/cancel`), never the raw path, so span names stay few. Handlers' own
/// spans (SQL, ingest) nest under it, and perch's OTLP export sends them all.
fn http_span(request: &axum::extract::Request) -> tracing::Span {
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |m| m.as_str());
    tracing::info_span!(
        "http.request",
        otel.name = %format!("{} {route}", request.method()),
        otel.kind = "server",
        http.request.method = %request.method(),
        http.route = route,
        http.response.status_code = tracing::field::Empty,
    )
}

pub(crate) async fn index(headers: axum::http::HeaderMap) -> axum::response::Response {
    use axum::response::IntoResponse;
    if web::wants_html(&headers) {
        return web::index(&headers);
    }
    let endpoints: serde_json::Map<String, serde_json::Value> = routes::ROUTES
        .iter()
        .map(|r| (format!("{} {}", r.method.as_str(), r.path), r.what.into()))
        .collect();
    axum::Json(serde_json::json!({
        "service": "perch",
        "version": env!("CARGO_PKG_VERSION"),
        "endpoints": endpoints,
        "web_view": "open / in a browser",
    }))
    .into_response()
}

/// The OpenAPI 3 description of this server's HTTP API.
pub const OPENAPI: &str = include_str!("../openapi.json");

pub(crate) async fn openapi() -> ([(axum::http::HeaderName, &'static str); 1], &'static str) {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
}

pub(crate) async fn readyz(
    axum::extract::State(state): axum::extract::State<AppState>,
) -> (axum::http::StatusCode, String) {
    if !state.ready.load(Ordering::Relaxed) {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "not ready\n".into(),
        );
    }
    match state.jobs.failing() {
        None => (
            axum::http::StatusCode::OK,
            match &state.config.ha {
                None => "ready\n".into(),
                Some(ha) => format!("ready{}\n", ha::leader_words(ha)),
            },
        ),
        Some(why) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: the job database cannot commit ({why}); perch reopens it by itself once its disk has room\n"
            ),
        ),
    }
}

/// Serves until `shutdown` resolves, then flushes the store.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let clock = state.config.clock.clone();
    let flusher = tokio::spawn(state.store.clone().run_flusher(move || clock.now_ms(), {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }));
    let ticker = tokio::spawn(state.jobs.clone().run_ticker({
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }));
    if let Err(e) = state.sql.check_views().await {
        tracing::error!(error = %e, "an accounting view does not plan");
    }
    let accounting = tokio::spawn(accounting::run(
        state.jobs.clone(),
        state.sql.clone(),
        state.config.accounting.clone(),
        {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|stop| *stop).await;
            }
        },
    ));
    let stopped = || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    // An ingest server evaluates no alert: the control server sees every node's latest state
    // and evaluates them once.
    let alerting = tokio::spawn({
        let state = state.clone();
        let stop = stopped();
        async move {
            if !state.config.cluster.is_ingest() {
                alerting::run(state, stop).await;
            }
        }
    });
    let forwarder = match &state.config.cluster {
        cluster::Cluster::Ingest(role) => {
            let advertise = if role.advertise.is_empty() {
                cluster::advertise(listener.local_addr()?, state.config.tls.is_some())
            } else {
                role.advertise.clone()
            };
            tracing::info!(control = %role.control_url, advertise = %advertise, "ingest server: pushing the nodes' latest state to the control server");
            Some(tokio::spawn(cluster::run_forwarder(
                state.clone(),
                role.clone(),
                advertise,
                stopped(),
            )))
        }
        _ => None,
    };
    tokio::spawn(state.store.clone().run_peer_refresh(
        {
            let clock = state.config.clock.clone();
            move || clock.now_ms()
        },
        stopped(),
    ));
    let events = state
        .events
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(events) = events {
        // Ends with the job service; not awaited, so shutdown never waits on it.
        tokio::spawn(accounting::append_events(state.store.clone(), events));
    }
    let pg = match &state.config.pg_listen {
        Some(addr) => {
            let mut rx = stop_rx.clone();
            pg::start(&state, addr, async move {
                let _ = rx.wait_for(|stop| *stop).await;
            })
            .await?
        }
        None => None,
    };
    tokio::spawn(reload_on_hangup(
        state.config.clock.clone(),
        state.tokens.clone(),
        state.config.tls.clone(),
        state
            .config
            .policy_source
            .clone()
            .map(|source| (source, state.jobs.clone())),
        state
            .config
            .alerts_source
            .clone()
            .map(|source| (source, state.clone())),
        stop_rx.clone(),
    ));
    let app = router(state.clone());
    let limits = listener::fit_descriptor_limit(state.config.connections);
    let listener =
        listener::LimitedListener::new(listener, limits, tls_acceptor(&state, &[b"http/1.1"])?);
    let result = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<listener::Peer>(),
    )
    .with_graceful_shutdown(async move {
        shutdown.await;
    })
    .await;
    state.ready.store(false, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    if let Err(e) = flusher.await {
        tracing::error!(error = %e, "flusher task failed");
    }
    if let Some(Err(e)) = match pg {
        Some(task) => Some(task.await),
        None => None,
    } {
        tracing::error!(error = %e, "PostgreSQL listener task failed");
    }
    if let Err(e) = ticker.await {
        tracing::error!(error = %e, "job ticker task failed");
    }
    if let Err(e) = accounting.await {
        tracing::error!(error = %e, "accounting task failed");
    }
    if let Err(e) = alerting.await {
        tracing::error!(error = %e, "alerting task failed");
    }
    if let Some(Err(e)) = match forwarder {
        Some(task) => Some(task.await),
        None => None,
    } {
        tracing::error!(error = %e, "the task pushing the latest state to the control server failed");
    }
    result
}

/// The TLS acceptor for a listener offering `alpn`, if the server has a certificate.
fn tls_acceptor(
    state: &AppState,
    alpn: &[&[u8]],
) -> std::io::Result<Option<tokio_rustls::TlsAcceptor>> {
    state
        .config
        .tls
        .as_ref()
        .map(|certs| certs.acceptor(alpn).map_err(std::io::Error::other))
        .transpose()
}

/// `[alerts]` read again and put in force (rules, receivers, routes, inhibitions,
/// remediation), or, when it does not read or validate, the one in force kept, saying why.
async fn reload_alerts(source: &AlertsSource, state: &AppState) {
    let read = tokio::task::spawn_blocking({
        let source = source.clone();
        move || source.read()
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    let config = match read {
        Ok(config) => config,
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: [alerts] was not read again; the rules and receivers as they were stay");
            return;
        }
    };
    if state.alerts.with(|e| *e.config() == config) {
        tracing::info!("SIGHUP: [alerts] unchanged");
        return;
    }
    match state.alerts.reconfigure(config, state.now_ms()) {
        Ok(events) => {
            let rules = state.alerts.with(|e| e.rules().len());
            tracing::info!(
                rules,
                "SIGHUP: [alerts] read again and in force (rules, receivers, routes, inhibitions, remediation)"
            );
            if let Err(e) = state.store.append_events(&events).await {
                tracing::error!(error = %e, "could not record the alerts of removed rules as resolved");
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: the new [alerts] could not be applied; the rules and receivers as they were stay")
        }
    }
}

/// Reads the tokens file, the TLS certificate, the scheduling policy and the alerting
/// configuration again on each SIGHUP until the server stops: an operator adds or revokes a
/// token, installs a renewed certificate, changes the policy or the alert rules, without a
/// restart. A file that does not parse leaves what was there, with an error in the log.
async fn reload_on_hangup(
    clock: clock::Clock,
    tokens: Arc<auth::Tokens>,
    tls: Option<Arc<tls::Certificates>>,
    policy: Option<(PolicySource, perch_control::JobService)>,
    alerts: Option<(AlertsSource, AppState)>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; the tokens file is read at startup only");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return,
            got = hangups.recv() => if got.is_none() { return },
        }
        if let Some((source, jobs)) = &policy {
            match tokio::task::spawn_blocking({
                let source = source.clone();
                move || source.read()
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            {
                Ok(config) => match jobs.run(move |c, now| c.set_policy(config, now)).await {
                    Ok(true) => tracing::info!("SIGHUP: scheduling policy read again and in force"),
                    Ok(false) => tracing::info!("SIGHUP: scheduling policy unchanged"),
                    Err(e) => {
                        tracing::error!(error = ?e, "SIGHUP: the new scheduling policy could not be applied")
                    }
                },
                Err(e) => {
                    tracing::error!(error = %e, "SIGHUP: [scheduler] was not read again; the policy as it was stays")
                }
            }
        }
        if let Some((source, state)) = &alerts {
            reload_alerts(source, state).await;
        }
        if let Some(tls) = &tls {
            match tls.reload() {
                Ok(()) => {
                    tracing::info!("SIGHUP: TLS certificate read again; new connections get it")
                }
                Err(e) => {
                    tracing::error!(error = %e, "SIGHUP: the TLS certificate was not read again; the one served so far stays")
                }
            }
        }
        if tokens.is_open() {
            tracing::info!("SIGHUP: no tokens file to read (the server runs open)");
            continue;
        }
        match tokens.reload() {
            Ok(n) => {
                tracing::info!(tokens = n, "SIGHUP: tokens file read again");
                tokens.warn_expiring(clock.now_ms());
            }
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: the tokens file was not read again; the tokens as they were stay")
            }
        }
    }
}
