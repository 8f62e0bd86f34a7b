//! Telemetry spread over several servers (docs/scale.md, "Ingest servers"): one **control**
//! server runs the control plane (jobs, scheduling, alerts, accounting, SQL) and any number of
//! **ingest** servers, roles of the same binary, take the nodes' telemetry, each into a store
//! of its own (its data directory, or its prefix of the bucket). No writer coordinates with
//! another:
//!
//! - the control server names each node's ingest server in the node's sync answer
//!   (`SyncResponse::ingest_url`), by rendezvous hashing of the node's name over the ingest
//!   servers ([`assign`]): stable, and a node moves only when its server leaves the list;
//! - an ingest server keeps, per node, the newest sample of every GPU, host, NIC and port,
//!   the latest round's jobs and processes, and every GPU event since the last push
//!   ([`Forwarder`]), and pushes that to the control server once a second
//!   (`POST /v1/cluster/latest`, [`latest`]): the control server's scheduler, alerts and
//!   `/metrics` see every node's latest state, at one request a second per ingest server
//!   instead of one per node;
//! - the control server's SQL reads every ingest server's store beside its own
//!   ([`perch_query::PeerConfig`]), as of their last flush.
//!
//! An ingest server answers telemetry, health, its own `/metrics` and SQL over its own store;
//! everything else is refused with the control server's address ([`ingest_only`]).

use crate::auth::Identity;
use crate::{ApiError, AppState, ErrorCode};
use axum::Extension;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use perch_model::Batch;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// This server's part in a deployment.
#[derive(Debug, Clone, Default)]
pub enum Cluster {
    /// One server takes everything (the default).
    #[default]
    Single,
    /// The control plane, with telemetry taken by the ingest servers that push to it.
    Control(Arc<IngestServers>),
    /// Takes telemetry and pushes each node's latest state to the control server.
    Ingest(IngestRole),
}

/// A control server's ingest servers: the configured names, and where each one that pushes
/// says agents reach it. Nodes are spread over those that pushed within `alive`; with none,
/// they send to the control server itself, which stores their telemetry as one server would.
#[derive(Debug)]
pub struct IngestServers {
    names: Vec<String>,
    alive_ms: i64,
    live: RwLock<BTreeMap<String, Live>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Live {
    url: String,
    seen_ms: i64,
}

/// An ingest server's state for `/metrics`: name, URL and last push (server ms), if any.
pub type IngestView = (String, Option<(String, i64)>);

impl IngestServers {
    /// `names` (the configured `[[cluster.ingest]]`), each alive for `alive` after a push.
    pub fn new(names: Vec<String>, alive: Duration) -> Self {
        IngestServers {
            names,
            alive_ms: i64::try_from(alive.as_millis()).unwrap_or(i64::MAX),
            live: RwLock::default(),
        }
    }

    /// Records a push of `name`, reachable at `url`, at `now`. Refused: a name not
    /// configured (the control server would not read its store, and its nodes' samples would
    /// be missing from SQL), a URL that is not `http(s)://`.
    fn pushed(&self, name: &str, url: &str, now: i64) -> Result<(), String> {
        if !self.names.iter().any(|n| n == name) {
            return Err(format!(
                "ingest server {name:?} is not one of this control server's [[cluster.ingest]] ({}); add it there with its store, so SQL reads what it takes",
                self.names.join(", ")
            ));
        }
        let url = url.trim_end_matches('/');
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() > 512 {
            return Err(format!(
                "ingest server {name:?} advertises {:?}, not a URL agents can reach: set its cluster.advertise",
                url.chars().take(80).collect::<String>()
            ));
        }
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        let fresh = Live {
            url: url.to_owned(),
            seen_ms: now,
        };
        let back = match live.insert(name.to_owned(), fresh) {
            None => true,
            Some(old) => old.url != url || now - old.seen_ms > self.alive_ms,
        };
        if back {
            tracing::info!(
                ingest = name,
                url,
                "ingest server takes telemetry; nodes are spread over it"
            );
        }
        Ok(())
    }

    /// The URL of the ingest server alive at `now` that takes `node` ([`assign`]), read under
    /// the lock: on every sync, so nothing is copied but the answer.
    fn url_for(&self, node: &str, now: i64) -> Option<String> {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        let alive = live
            .iter()
            .filter(|(_, l)| now - l.seen_ms <= self.alive_ms)
            .map(|(name, l)| (name.as_str(), l.url.as_str()));
        assign(node, alive).map(|(_, url)| url.to_owned())
    }

    /// Every configured ingest server with its last push, for `/metrics`.
    pub fn view(&self) -> Vec<IngestView> {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        self.names
            .iter()
            .map(|n| (n.clone(), live.get(n).map(|l| (l.url.clone(), l.seen_ms))))
            .collect()
    }

    pub fn alive_ms(&self) -> i64 {
        self.alive_ms
    }
}

/// What an ingest server needs to reach its control server.
#[derive(Clone)]
pub struct IngestRole {
    /// Its name (in the control server's `[[cluster.ingest]]`, in logs and pushes).
    pub name: String,
    /// The control server's base URL.
    pub control_url: String,
    /// The URL agents reach this server at; empty: `http(s)://<the address it listens on>`.
    pub advertise: String,
    /// The token the pushes carry (an agent token bound to no node, or an operator's); `None`
    /// for a control server without a tokens file.
    pub token: Option<String>,
    /// PEM certificates to trust for an `https` control server, beside the system's.
    pub ca_certificates: Vec<Vec<u8>>,
    /// How often the latest state is pushed (and, with nothing new, that this server lives).
    pub every: Duration,
}

impl std::fmt::Debug for IngestRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestRole")
            .field("name", &self.name)
            .field("control_url", &self.control_url)
            .field("advertise", &self.advertise)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("every", &self.every)
            .finish()
    }
}

impl Cluster {
    /// The base URL `node` sends its telemetry to at `now`, when not this server.
    pub fn ingest_url(&self, node: &str, now: i64) -> Option<String> {
        match self {
            Cluster::Control(ingest) => ingest.url_for(node, now),
            _ => None,
        }
    }

    pub fn is_ingest(&self) -> bool {
        matches!(self, Cluster::Ingest(_))
    }
}

/// The URL agents reach a server listening on `addr` at: its address, or the host name when
/// it listens on every address.
pub fn advertise(addr: std::net::SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    let host = if addr.ip().is_unspecified() {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into())
    } else {
        match addr.ip() {
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        }
    };
    format!("{scheme}://{host}:{}", addr.port())
}

/// FNV-1a, 64 bits: a hash that is the same in every release and on every machine, so a
/// standby that takes over assigns every node where its predecessor did.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in *part {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // FNV's low bits mix poorly on short keys; one round of a finaliser (splitmix64's) fixes it.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The ingest server that takes `node`'s telemetry: the one whose hash with the node's name is
/// highest (rendezvous hashing): each server gets about an equal share, and removing one moves
/// only its own nodes.
/// `servers` are (name, anything) pairs; the chosen pair is returned.
pub fn assign<'a, T>(
    node: &str,
    servers: impl IntoIterator<Item = (&'a str, T)>,
) -> Option<(&'a str, T)> {
    servers
        .into_iter()
        .max_by_key(|(name, _)| (fnv1a(&[node.as_bytes(), name.as_bytes()]), *name))
}

/// Most GPU events kept for one node between two pushes; older ones past it are dropped (and
/// counted). An XID storm of a broken GPU must not grow the ingest server's memory.
pub const MAX_EVENTS_PER_NODE: usize = 1_024;

/// Pushes of one ingest server, for its `/metrics`.
#[derive(Debug, Default)]
pub struct ForwardStats {
    pub pushes: AtomicU64,
    pub push_failures: AtomicU64,
    pub nodes_pushed: AtomicU64,
    pub events_dropped: AtomicU64,
}

/// Each node's latest state, gathered between two pushes.
#[derive(Debug, Default)]
pub struct Forwarder {
    pending: Mutex<BTreeMap<String, Batch>>,
    pub stats: ForwardStats,
}

/// What an ingest server pushes: each node's latest state as one batch.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatestPush {
    /// The ingest server's name.
    pub from: String,
    /// Where agents reach it.
    pub url: String,
    pub batches: Vec<Batch>,
}

/// Keeps in `into` the newer of each sample of `into` and `newer` (by time), the latest
/// round's jobs and processes, and every GPU event (at most [`MAX_EVENTS_PER_NODE`], the
/// newest); returns how many events were dropped.
pub fn merge(into: &mut Batch, newer: &Batch) -> usize {
    fn keep_newest<T: Clone, K: PartialEq>(
        into: &mut Vec<T>,
        newer: &[T],
        key: impl Fn(&T) -> K,
        time: impl Fn(&T) -> i64,
    ) {
        for n in newer {
            match into.iter_mut().find(|o| key(o) == key(n)) {
                Some(o) if time(o) <= time(n) => *o = n.clone(),
                Some(_) => {}
                None => into.push(n.clone()),
            }
        }
    }
    into.seq = into.seq.max(newer.seq);
    keep_newest(&mut into.hosts, &newer.hosts, |_| (), |h| h.time_ms);
    keep_newest(&mut into.gpus, &newer.gpus, |g| g.gpu, |g| g.time_ms);
    keep_newest(
        &mut into.nics,
        &newer.nics,
        |n| n.device.clone(),
        |n| n.time_ms,
    );
    keep_newest(
        &mut into.ib_ports,
        &newer.ib_ports,
        |p| (p.device.clone(), p.port),
        |p| p.time_ms,
    );
    // A round always has a host sample: a newer round's jobs and processes replace the older.
    if newer.hosts.is_empty() {
        into.jobs.extend(newer.jobs.iter().cloned());
        into.gpu_processes
            .extend(newer.gpu_processes.iter().cloned());
    } else {
        into.jobs.clone_from(&newer.jobs);
        into.gpu_processes.clone_from(&newer.gpu_processes);
    }
    into.gpu_events.extend(newer.gpu_events.iter().cloned());
    let over = into.gpu_events.len().saturating_sub(MAX_EVENTS_PER_NODE);
    into.gpu_events.drain(..over);
    over
}

/// The latest state of one node as `batch` shows it: only the newest sample of each thing.
fn latest_of(batch: &Batch) -> Batch {
    let mut latest = Batch {
        jobs: Vec::new(),
        gpu_processes: Vec::new(),
        ..Batch::new(batch.node.clone(), batch.seq)
    };
    merge(&mut latest, batch);
    latest
}

impl Forwarder {
    /// Adds a stored batch.
    pub fn add(&self, batch: &Batch) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let dropped = match pending.get_mut(batch.node.as_str()) {
            Some(into) => merge(into, batch),
            None => {
                let latest = latest_of(batch);
                let dropped = batch.gpu_events.len() - latest.gpu_events.len();
                pending.insert(batch.node.as_str().to_owned(), latest);
                dropped
            }
        };
        self.stats
            .events_dropped
            .fetch_add(dropped as u64, Ordering::Relaxed);
    }

    /// Everything gathered since the last take.
    pub fn take(&self) -> BTreeMap<String, Batch> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Puts back what a failed push took, under anything gathered since (which is newer).
    pub fn put_back(&self, taken: BTreeMap<String, Batch>) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for (node, mut older) in taken {
            if let Some(newer) = pending.remove(&node) {
                let dropped = merge(&mut older, &newer);
                self.stats
                    .events_dropped
                    .fetch_add(dropped as u64, Ordering::Relaxed);
            }
            pending.insert(node, older);
        }
    }
}

/// Pushes the forwarder's gathered state to the control server every `role.every` until
/// `stop` resolves, and once more then. A failed push is kept (merged under newer state) and
/// retried at the next tick.
pub async fn run_forwarder(
    state: AppState,
    role: IngestRole,
    advertise: String,
    stop: impl std::future::Future<Output = ()>,
) {
    let Some(forwarder) = state.forward.clone() else {
        return;
    };
    perch_model::tls::use_ring();
    let mut builder = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .connect_timeout(Duration::from_secs(5))
        .redirect(reqwest::redirect::Policy::none());
    for pem in &role.ca_certificates {
        match reqwest::Certificate::from_pem_bundle(pem) {
            Ok(certs) => {
                for cert in certs {
                    builder = builder.add_root_certificate(cert);
                }
            }
            Err(e) => tracing::error!(error = %e, "cluster.control_ca_file: not PEM certificates"),
        }
    }
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the HTTP client for the control server; the latest state is not pushed");
            return;
        }
    };
    let url = format!(
        "{}/v1/cluster/latest",
        role.control_url.trim_end_matches('/')
    );
    tokio::pin!(stop);
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            _ = &mut stop => true,
            _ = tokio::time::sleep(role.every) => false,
        };
        let taken = forwarder.take();
        // Pushed even with nothing new: the control server sends nodes here only while it
        // hears from this server.
        {
            let push = LatestPush {
                from: role.name.clone(),
                url: advertise.clone(),
                batches: taken.values().cloned().collect(),
            };
            match send(&client, &url, role.token.as_deref(), &push).await {
                Ok(()) => {
                    if failing {
                        tracing::info!(control = %role.control_url, "the control server takes the latest state again");
                        failing = false;
                    }
                    forwarder.stats.pushes.fetch_add(1, Ordering::Relaxed);
                    forwarder
                        .stats
                        .nodes_pushed
                        .fetch_add(taken.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(control = %role.control_url, error = %e, "cannot push the nodes' latest state to the control server; kept and retried (telemetry is still stored here)");
                        failing = true;
                    }
                    forwarder
                        .stats
                        .push_failures
                        .fetch_add(1, Ordering::Relaxed);
                    forwarder.put_back(taken);
                }
            }
        }
        if stopping {
            return;
        }
    }
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    push: &LatestPush,
) -> Result<(), String> {
    let json = serde_json::to_vec(push).map_err(|e| e.to_string())?;
    let body = zstd::encode_all(&json[..], 1).map_err(|e| e.to_string())?;
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .header("content-encoding", "zstd")
        .body(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    if response.status().is_success() {
        return Ok(());
    }
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    Err(format!(
        "{status}: {}",
        text.chars().take(500).collect::<String>()
    ))
}

/// `POST /v1/cluster/latest`: an ingest server's push of its nodes' latest state. Each batch
/// is checked as an agent's would be (the caller may speak for the node, the batch is valid);
/// a batch that is not is skipped and counted in the answer, the others are taken. Nothing is
/// stored: the samples are in the ingest server's store.
pub async fn latest(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if who.role == crate::auth::Role::Agent && who.nodes.is_some() {
        // A push names where nodes send their telemetry (and their tokens): one node's token
        // must not be able to send every node's elsewhere.
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            format!(
                "this token ({}) is bound to node(s); an ingest server pushes with an agent token bound to no node, or an operator's (cluster.token_file)",
                who.user
            ),
        ));
    }
    let Cluster::Control(ingest) = &state.config.cluster else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::WrongServer,
            "this server is not a control server of ingest servers ([cluster] role = \"control\"); point the ingest server's cluster.control at the control server",
        ));
    };
    let body = body.map_err(|e| {
        ApiError::new(
            e.status(),
            ErrorCode::UnreadableBody,
            format!("could not read the request body: {e}"),
        )
    })?;
    let push: LatestPush = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            ErrorCode::MalformedBatch,
            format!("the body is not an ingest server's push of latest state: {e}"),
        )
    })?;
    let now = state.now_ms();
    ingest
        .pushed(&push.from, &push.url, now)
        .map_err(|why| ApiError::new(StatusCode::CONFLICT, ErrorCode::WrongServer, why))?;
    let mut taken = Vec::with_capacity(push.batches.len());
    let mut refused = Vec::new();
    for batch in push.batches {
        let checked = who
            .may_speak_for(batch.node.as_str())
            .and_then(|()| batch.validate(now).map_err(|e| e.to_string()));
        match checked {
            Ok(()) => taken.push(batch),
            Err(why) => refused.push(format!("{}: {why}", batch.node)),
        }
    }
    for batch in &taken {
        state.latest.update(batch, now);
    }
    state
        .metrics
        .cluster_pushes(taken.len() as u64, refused.len() as u64);
    let known: Vec<Batch> = taken
        .into_iter()
        .filter(|b| {
            (!b.gpus.is_empty() || !b.gpu_events.is_empty() || !b.gpu_processes.is_empty())
                && state.jobs.knows_node(b.node.as_str())
        })
        .collect();
    if !known.is_empty() {
        // One control-plane call for the whole push.
        state
            .jobs
            .run(move |c, now| {
                for b in &known {
                    c.observe(b, now)?;
                }
                Ok(())
            })
            .await?;
    }
    if !refused.is_empty() {
        tracing::warn!(from = %push.from, refused = refused.len(), first = %refused[0], "batches of an ingest server's push refused");
    }
    Ok(Json(serde_json::json!({
        "taken": true,
        "refused": refused.into_iter().take(20).collect::<Vec<_>>(),
    })))
}

/// The paths an ingest server serves; every other is refused with the control server's
/// address.
const INGEST_PATHS: &[&str] = &[
    "/v1/ingest",
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1/sql",
    "/v1/whoami",
    "/openapi.json",
];

/// On an ingest server, refuses what only the control server does (jobs, nodes, alerts,
/// the web view) with 421 `ingest_only`, naming the control server.
pub async fn ingest_only(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Cluster::Ingest(role) = &state.config.cluster else {
        return next.run(request).await;
    };
    if INGEST_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let mut response = ApiError::new(
        StatusCode::MISDIRECTED_REQUEST,
        ErrorCode::IngestOnly,
        format!(
            "this perch server ({}) only takes telemetry ([cluster] role = \"ingest\"); send this to the control server at {}",
            role.name, role.control_url
        ),
    )
    .into_response();
    if let Ok(v) = axum::http::HeaderValue::from_str(&role.control_url) {
        response.headers_mut().insert("x-perch-control", v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_model::{GpuEvent, GpuEventKind, GpuIndex, GpuSample, HostSample, NodeId};

    fn servers(n: usize) -> Vec<(&'static str, usize)> {
        ["ingest-0", "ingest-1", "ingest-2"][..n]
            .iter()
            .enumerate()
            .map(|(i, name)| (*name, i))
            .collect()
    }

    #[test]
    fn nodes_spread_evenly_and_only_a_leaving_servers_nodes_move() {
        let three = servers(3);
        let nodes: Vec<String> = (0..3000).map(|i| format!("gpu-{i:05}")).collect();
        let mut share = BTreeMap::new();
        for n in &nodes {
            *share
                .entry(assign(n, three.iter().copied()).expect("one").0)
                .or_insert(0) += 1;
        }
        assert_eq!(share.len(), 3);
        assert!(
            share.values().all(|&c| (900..=1100).contains(&c)),
            "{share:?}"
        );
        // Take ingest-1 away: only its nodes move.
        let two: Vec<(&str, usize)> = three
            .iter()
            .copied()
            .filter(|(name, _)| *name != "ingest-1")
            .collect();
        for n in &nodes {
            let before = assign(n, three.iter().copied()).expect("one");
            let after = assign(n, two.iter().copied()).expect("one");
            if before.0 != "ingest-1" {
                assert_eq!(before, after, "{n} moved though its server stayed");
            }
        }
        assert!(assign("n", Vec::<(&str, usize)>::new()).is_none());
        // The same in every release: a standby assigns as its predecessor did.
        assert_eq!(
            assign("gpu-00042", three.iter().copied()).expect("one").0,
            "ingest-2"
        );
    }

    fn round(node: &str, seq: u64, t: i64, util: f64) -> Batch {
        Batch {
            hosts: vec![
                serde_json::from_value::<HostSample>(
                    serde_json::json!({"time_ms": t, "simulated": true}),
                )
                .expect("host sample"),
            ],
            gpus: (0..2)
                .map(|g| GpuSample {
                    time_ms: t,
                    gpu: GpuIndex(g),
                    simulated: true,
                    utilization_gpu_pct: Some(util),
                    ..GpuSample::default()
                })
                .collect(),
            ..Batch::new(NodeId::new(node).expect("node"), seq)
        }
    }

    #[test]
    fn the_forwarder_keeps_the_newest_samples_every_event_and_puts_back_a_failed_push() {
        let f = Forwarder::default();
        let mut first = round("n1", 1, 1_000, 10.0);
        first.gpu_events.push(GpuEvent {
            time_ms: 1_000,
            gpu: GpuIndex(1),
            kind: GpuEventKind::Xid,
            xid: Some(79),
            uuid: String::new(),
            simulated: true,
            message: None,
        });
        f.add(&first);
        // An older round delivered late (a spool replay) does not win over a newer one.
        f.add(&round("n1", 3, 3_000, 30.0));
        f.add(&round("n1", 2, 2_000, 20.0));
        let taken = f.take();
        let n1 = &taken["n1"];
        assert_eq!(n1.gpus.len(), 2);
        assert!(n1.gpus.iter().all(|g| g.utilization_gpu_pct == Some(30.0)));
        assert_eq!(n1.hosts.len(), 1);
        assert_eq!(n1.hosts[0].time_ms, 3_000);
        assert_eq!(n1.gpu_events.len(), 1, "the XID is kept");
        assert!(f.take().is_empty());
        // A failed push goes back under what came since.
        f.add(&round("n1", 4, 4_000, 40.0));
        f.put_back(taken);
        let again = f.take();
        assert!(
            again["n1"]
                .gpus
                .iter()
                .all(|g| g.utilization_gpu_pct == Some(40.0))
        );
        assert_eq!(again["n1"].gpu_events.len(), 1);
        // An event storm is bounded.
        let mut storm = round("n2", 1, 5_000, 0.0);
        storm.gpu_events = (0..MAX_EVENTS_PER_NODE as i64 + 10)
            .map(|i| GpuEvent {
                time_ms: 5_000 + i,
                gpu: GpuIndex(0),
                kind: GpuEventKind::Xid,
                xid: Some(13),
                uuid: String::new(),
                simulated: true,
                message: None,
            })
            .collect();
        f.add(&storm);
        f.add(&storm);
        let n2 = &f.take()["n2"];
        assert_eq!(n2.gpu_events.len(), MAX_EVENTS_PER_NODE);
        assert_eq!(
            f.stats.events_dropped.load(Ordering::Relaxed),
            10 + MAX_EVENTS_PER_NODE as u64 + 10
        );
    }
}
