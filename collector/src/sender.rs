//! Delivery to the server: `POST {server}/v1/ingest` with the batch zstd-compressed, as
//! MessagePack ([`perch_model::wire`]; the server parses it several times faster than JSON),
//! or as JSON once a server has shown it takes only JSON: it answered 415, or it read the
//! MessagePack as JSON and answered 400 `malformed_batch` (every server before the binary
//! encoding did that). The refused batch is sent again at once as JSON, and the sender sends JSON
//! from then on, until the agent restarts. Batches spilled to the disk spool are JSON (the
//! spool's format is unchanged), and are sent as JSON.
//! With several servers configured, to the one in use, following the leader
//! ([`crate::servers`]): a standby or a dead server counts as a failed attempt, retried as below
//! on the next server.
//!
//! Replies decide a batch's fate: 2xx means durable (remove it); 4xx means the batch itself is
//! bad (log the server's message once, count it, drop it: retrying cannot help), except 408 and
//! 429 which ask us to come back later, and 401 and 403, which are about the agent's token, not
//! the batch (a token being rotated must not lose telemetry: the batch is kept and retried
//! until the token is accepted); 5xx and connection errors are retried with capped
//! exponential backoff, or after the server's `Retry-After` when it is longer (at most a
//! minute: the server's busy and back-pressure answers give one), lowest `seq` first (from the disk spool or the memory queue, whichever
//! holds it), so order is kept. Retries are safe because the server ignores a `(node, seq)` it
//! has already accepted.

use crate::agent::AgentCounters;
use crate::error::{CollectorError, Result};
use crate::queue::SendQueue;
use crate::servers::{Route, Servers};
use crate::spool::{Spool, SpoolEntry};
use perch_model::Batch;
use perch_model::wire::Encoding;
use reqwest::header::{CONTENT_ENCODING, CONTENT_TYPE};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::Notify;

/// zstd level: 3 is zstd's default, a good ratio at a small CPU cost.
const ZSTD_LEVEL: i32 = 3;
/// Longest server message kept in a log line.
const MAX_LOGGED_BODY: usize = 2048;

/// How one POST ended.
#[derive(Debug, Clone, PartialEq)]
pub enum SendOutcome {
    /// Durable on the server; `duplicate` when it had this `seq` already.
    Accepted { duplicate: bool },
    /// The server refused the batch for good.
    Rejected { status: u16, message: String },
    /// Try again later: not before `after` when the server said when (`Retry-After`, as its
    /// busy and back-pressure answers do).
    Retry {
        reason: String,
        after: Option<Duration>,
    },
}

/// The longest `Retry-After` followed; a longer one is taken as this.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Capped exponential backoff.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// The delay before retry number `failures` (1-based).
    pub fn delay(&self, failures: u32) -> Duration {
        let factor = 1u32 << failures.saturating_sub(1).min(16);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

/// An HTTP client of the configured servers, sending to the one in use ([`Servers`]).
#[derive(Debug, Clone)]
pub struct Sender {
    client: reqwest::Client,
    servers: Arc<Servers>,
    /// Bearer token for servers that require one (the `agent` role).
    token: Option<String>,
    /// The agent's id ([`crate::agent_claim`]), sent with every batch.
    agent_id: Option<String>,
    /// Cleared once a server has shown it takes only JSON (see [`self`]); shared by the
    /// sender's clones.
    binary: Arc<AtomicBool>,
}

/// Serializes and compresses a batch as JSON: what the disk spool holds ([`Sender::post_body`]).
pub fn encode(batch: &Batch) -> Result<Vec<u8>> {
    encode_as(Encoding::Json, batch)
}

/// Serializes `batch` in `encoding` and compresses it (zstd).
pub fn encode_as(encoding: Encoding, batch: &Batch) -> Result<Vec<u8>> {
    let raw = encoding.encode(batch).map_err(CollectorError::Encode)?;
    zstd::bulk::compress(&raw, ZSTD_LEVEL).map_err(|e| CollectorError::Encode(e.to_string()))
}

impl Sender {
    /// `server` is the base URL, e.g. `http://127.0.0.1:7300`; `timeout` bounds one request.
    /// `ca_file`: PEM certificates of a CA to trust besides the system's (see [`trust`]).
    pub fn new(server: &str, timeout: Duration, ca_file: Option<&Path>) -> Result<Self> {
        Self::with_servers(Arc::new(Servers::one(server)?), timeout, ca_file)
    }

    /// A sender to whichever of `servers` leads (see [`crate::servers`]); `servers` is shared
    /// with the rest of the agent, so they follow the leader together.
    pub fn with_servers(
        servers: Arc<Servers>,
        timeout: Duration,
        ca_file: Option<&Path>,
    ) -> Result<Self> {
        perch_model::tls::use_ring();
        let builder = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .redirect(servers.redirect_policy());
        let client = trust(builder, ca_file)?
            .build()
            .map_err(|e| CollectorError::Config(format!("cannot build HTTP client: {e}")))?;
        Ok(Self {
            client,
            servers,
            token: None,
            agent_id: None,
            binary: Arc::new(AtomicBool::new(true)),
        })
    }

    /// The encoding new batches are sent in: MessagePack, or JSON once a server refused it.
    pub fn encoding(&self) -> Encoding {
        if self.binary.load(Relaxed) {
            Encoding::Msgpack
        } else {
            Encoding::Json
        }
    }

    /// Sends `Authorization: Bearer <token>` with every batch.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token.filter(|t| !t.is_empty());
        self
    }

    /// Sends the agent's id ([`crate::agent_claim`]) with every batch, in `x-perch-agent`.
    pub fn with_agent_id(mut self, id: String) -> Self {
        self.agent_id = Some(id);
        self
    }

    /// The ingest URL batches go to now.
    pub fn url(&self) -> String {
        let base = self
            .servers
            .ingest()
            .unwrap_or_else(|| self.servers.current_url().to_owned());
        format!("{base}/v1/ingest")
    }

    /// The request sending `body`, zstd-compressed `encoding`, to `base`.
    fn request(&self, base: &str, encoding: Encoding, body: Vec<u8>) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .post(format!("{base}/v1/ingest"))
            .header(CONTENT_TYPE, encoding.media_type())
            .header(CONTENT_ENCODING, "zstd");
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(id) = &self.agent_id {
            request = request.header("x-perch-agent", id);
        }
        request.body(body)
    }

    /// Sends one batch once, in [`Sender::encoding`], and classifies the reply. A server that
    /// shows it takes only JSON (see [`self`]) gets the batch again at once as JSON, and every
    /// later one.
    pub async fn post(&self, batch: &Batch) -> SendOutcome {
        let encoding = self.encoding();
        let outcome = self.post_as(encoding, batch).await;
        if encoding == Encoding::Msgpack && takes_only_json(&outcome) {
            self.binary.store(false, Relaxed);
            tracing::info!(
                answer = ?outcome,
                "the server does not take MessagePack batches (a perch server older than the binary ingest encoding); sending JSON from now on"
            );
            return self.post_as(Encoding::Json, batch).await;
        }
        outcome
    }

    async fn post_as(&self, encoding: Encoding, batch: &Batch) -> SendOutcome {
        match encode_as(encoding, batch) {
            Ok(body) => self.post_encoded(encoding, body).await,
            Err(e) => SendOutcome::Rejected {
                status: 0,
                message: e.to_string(),
            },
        }
    }

    /// Sends an already encoded batch (zstd JSON, as the spool holds it) once and classifies
    /// the reply.
    pub async fn post_body(&self, body: Vec<u8>) -> SendOutcome {
        self.post_encoded(Encoding::Json, body).await
    }

    /// Sends a zstd-compressed batch in `encoding` once and classifies the reply. A standby
    /// that names a configured leader is answered by sending to the leader at once; any other
    /// standby or a server that does not answer moves the next attempt to the next server.
    pub async fn post_encoded(&self, encoding: Encoding, mut body: Vec<u8>) -> SendOutcome {
        if let Some(ingest) = self.servers.ingest() {
            // An ingest server the control server named: no standby answers there, and a
            // failure keeps the batch for the next try (the next sync may name another).
            return match self.request(&ingest, encoding, body).send().await {
                Ok(response) => Self::outcome(response).await,
                Err(e) => SendOutcome::Retry {
                    reason: format!("ingest server {ingest}: {}", error_chain(&e)),
                    after: None,
                },
            };
        }
        // Bounds the redirects followed at once: standbys naming each other cannot spin.
        let mut redirects = self.servers.len();
        let response = loop {
            let (from, base) = self.servers.current();
            // One server sends once: no copy.
            let payload = if self.servers.fails_over() {
                body.clone()
            } else {
                std::mem::take(&mut body)
            };
            let response = match self.request(base, encoding, payload).send().await {
                Ok(r) => r,
                Err(e) => {
                    let reason = error_chain(&e);
                    self.servers.failed(from, &reason);
                    return SendOutcome::Retry {
                        reason,
                        after: None,
                    };
                }
            };
            match self
                .servers
                .route(from, response.status(), response.headers())
            {
                Route::Answered => break response,
                Route::Next(reason) => {
                    return SendOutcome::Retry {
                        reason,
                        after: None,
                    };
                }
                Route::Again if redirects > 0 => redirects -= 1,
                Route::Again => {
                    return SendOutcome::Retry {
                        reason: "the standby servers keep redirecting to each other".into(),
                        after: None,
                    };
                }
            }
        };
        Self::outcome(response).await
    }

    /// What a server's answer to a batch means.
    async fn outcome(response: reqwest::Response) -> SendOutcome {
        let status = response.status();
        let after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map(|secs| Duration::from_secs(secs).min(MAX_RETRY_AFTER));
        let text = response.text().await.unwrap_or_default();
        if status.is_success() {
            let duplicate = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| {
                    v.get("duplicate")
                        .map(|d| d.as_bool() == Some(true) || d.as_u64().unwrap_or(0) > 0)
                })
                .unwrap_or(false);
            SendOutcome::Accepted { duplicate }
        } else if matches!(status.as_u16(), 401 | 403) {
            SendOutcome::Retry {
                reason: format!(
                    "the server refuses this agent's token (HTTP {status}: {}); telemetry is kept (in memory, then in the disk spool) and sent once the token is accepted: check agent.token and the server's tokens file",
                    text.chars().take(200).collect::<String>()
                ),
                after,
            }
        } else if status.as_u16() == 409 && text.contains("\"node_claimed\"") {
            // Another agent serves this node name now. Kept, not dropped: a reinstalled node
            // whose old agent has just gone takes the name once that one has been silent for
            // the server's timeout, and its samples of the wait are delivered then.
            SendOutcome::Retry {
                reason: format!(
                    "another agent serves this node's name; telemetry is kept (in memory, then in the disk spool) until the node is this agent's (HTTP {status}: {})",
                    text.chars().take(400).collect::<String>()
                ),
                after,
            }
        } else if status.is_client_error() && status.as_u16() != 408 && status.as_u16() != 429 {
            let mut message = text;
            if message.len() > MAX_LOGGED_BODY {
                let cut = (0..=MAX_LOGGED_BODY)
                    .rev()
                    .find(|i| message.is_char_boundary(*i))
                    .unwrap_or(0);
                message.truncate(cut);
            }
            SendOutcome::Rejected {
                status: status.as_u16(),
                message,
            }
        } else {
            SendOutcome::Retry {
                reason: format!(
                    "HTTP {status}: {}",
                    text.chars().take(200).collect::<String>()
                ),
                after,
            }
        }
    }
}

/// Whether a server's answer to a MessagePack batch shows that it takes only JSON: 415, or 400
/// `malformed_batch` from a server that read the body as JSON (its message does not name the
/// MessagePack media type, as a server that decoded MessagePack would).
fn takes_only_json(outcome: &SendOutcome) -> bool {
    match outcome {
        SendOutcome::Rejected { status: 415, .. } => true,
        SendOutcome::Rejected {
            status: 400,
            message,
        } => {
            message.contains("\"malformed_batch\"")
                && !message.contains(perch_model::wire::MSGPACK_MEDIA_TYPE)
        }
        _ => false,
    }
}

/// An error and its sources on one line ("error sending request: connection refused").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the queue or spool half-updated in a way that
    // matters more than losing the agent, so keep going with their contents.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the sender loop shares with the sampling loop.
#[derive(Debug, Clone)]
pub struct SenderShared {
    pub queue: Arc<Mutex<SendQueue>>,
    /// Batches spilled to disk; always older than what is in `queue` at the same `seq`.
    pub spool: Option<Arc<Mutex<Spool>>>,
    /// Signalled when a round is queued or `draining` is set.
    pub wake: Arc<Notify>,
    /// Set once sampling has stopped: the loop returns when the memory queue is empty (the
    /// spool keeps what is left for the next run).
    pub draining: Arc<AtomicBool>,
    pub counters: Arc<AgentCounters>,
}

/// The next batch to send: the lowest `seq` of the spool and the memory queue.
enum Next {
    Memory(Batch),
    Spooled(SpoolEntry),
}

fn pick(shared: &SenderShared) -> Option<Next> {
    let mut queue = lock(&shared.queue);
    let spooled = shared.spool.as_ref().and_then(|s| lock(s).head());
    match (queue.front_seq(), spooled) {
        (Some(mem), Some(sp)) if sp.seq < mem => Some(Next::Spooled(sp)),
        (None, Some(sp)) if !shared.draining.load(Relaxed) => Some(Next::Spooled(sp)),
        (Some(_), _) => queue.next_to_send().map(Next::Memory),
        _ => None,
    }
}

/// Removes a settled spooled batch, logging (not failing) if the file cannot be deleted.
fn unspool(shared: &SenderShared, seq: u64) {
    if let Some(spool) = &shared.spool {
        let mut spool = lock(spool);
        if let Err(e) = spool.remove(seq) {
            tracing::warn!(seq, error = %e, "cannot delete delivered batch from spool");
        }
        shared.counters.spool_bytes.store(spool.bytes(), Relaxed);
    }
}

/// Sends batches, lowest `seq` first, until draining and the memory queue is empty. Runs as
/// its own task.
pub async fn run_sender(sender: Sender, shared: SenderShared, backoff: Backoff) {
    let counters = shared.counters.clone();
    let mut failures = 0u32;
    loop {
        let Some(next) = pick(&shared) else {
            if shared.draining.load(Relaxed) {
                return;
            }
            shared.wake.notified().await;
            continue;
        };
        // A batch from memory was never sent by an earlier run of the agent; with no failure
        // since the last answer, this is its first try.
        let first_try = matches!(next, Next::Memory(_)) && failures == 0;
        // Where this attempt goes (a failure moves the next one elsewhere, see crate::servers).
        let url = sender.url();
        let (seq, samples, outcome) = match next {
            Next::Memory(batch) => (
                batch.seq,
                batch.sample_count() as u64,
                sender.post(&batch).await,
            ),
            Next::Spooled(entry) => {
                let body = shared.spool.as_ref().map(|s| lock(s).read(&entry));
                match body {
                    Some(Ok(body)) => (entry.seq, entry.samples, sender.post_body(body).await),
                    Some(Err(e)) => {
                        tracing::warn!(seq = entry.seq, error = %e, "cannot read spooled batch, dropping it");
                        unspool(&shared, entry.seq);
                        counters.batches_dropped.fetch_add(1, Relaxed);
                        counters.samples_dropped.fetch_add(entry.samples, Relaxed);
                        continue;
                    }
                    None => continue,
                }
            }
        };
        let settle = |shared: &SenderShared| {
            if !lock(&shared.queue).complete(seq) {
                unspool(shared, seq);
            }
            counters
                .batches_queued
                .store(lock(&shared.queue).len() as u64, Relaxed);
        };
        match outcome {
            SendOutcome::Accepted { duplicate } => {
                settle(&shared);
                if failures > 0 {
                    tracing::info!(
                        failed_attempts = failures,
                        "server reachable again, sending queued batches"
                    );
                    failures = 0;
                }
                counters.batches_sent.fetch_add(1, Relaxed);
                counters.samples_sent.fetch_add(samples, Relaxed);
                if duplicate {
                    counters.batches_duplicate.fetch_add(1, Relaxed);
                    // A batch answered as a duplicate on its first try was never stored: the
                    // server has already accepted a higher seq for this node.
                    if first_try {
                        tracing::warn!(
                            seq,
                            "the server answered a new batch as a duplicate and dropped it: it \
                             has accepted a higher seq for this node. Is another agent running \
                             under this node's name?"
                        );
                    }
                }
            }
            SendOutcome::Rejected { status, message } => {
                settle(&shared);
                counters.batches_rejected.fetch_add(1, Relaxed);
                counters.samples_dropped.fetch_add(samples, Relaxed);
                tracing::warn!(seq, status, samples, server_message = %message, "server rejected batch, dropping it");
            }
            SendOutcome::Retry { reason, after } => {
                lock(&shared.queue).retry_later(seq);
                counters.send_errors.fetch_add(1, Relaxed);
                failures += 1;
                let delay = backoff.delay(failures).max(after.unwrap_or_default());
                if failures == 1 {
                    tracing::warn!(url = %url, error = %reason, "cannot deliver batch, keeping it queued and retrying");
                } else {
                    tracing::debug!(attempt = failures, error = %reason, ?delay, "delivery still failing");
                }
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// `builder` trusting, besides the system's roots, the CA certificates in `ca_file` (PEM): a
/// server whose certificate an in-house CA signed (`agent.ca_file`, `PERCH_CA_FILE`).
pub fn trust(
    builder: reqwest::ClientBuilder,
    ca_file: Option<&Path>,
) -> Result<reqwest::ClientBuilder> {
    let Some(path) = ca_file else {
        return Ok(builder);
    };
    Ok(ca_certificates(path)?
        .into_iter()
        .fold(builder, |b, cert| b.add_root_certificate(cert)))
}

/// The PEM certificates in `path` (one or more), refused when it holds none: what the agent
/// and the CLI trust for an in-house CA.
pub fn ca_certificates(path: &Path) -> Result<Vec<reqwest::Certificate>> {
    let pem = std::fs::read(path)
        .map_err(|e| CollectorError::Config(format!("reading CA file {}: {e}", path.display())))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| CollectorError::Config(format!("CA file {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(CollectorError::Config(format!(
            "CA file {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let b = Backoff::default();
        let ms: Vec<u128> = (1..=8).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(b.delay(u32::MAX).as_millis(), 5000);
    }

    #[test]
    fn server_must_be_a_url() {
        let timeout = Duration::from_secs(1);
        assert!(Sender::new("127.0.0.1:7300", timeout, None).is_err());
        let s = Sender::new("http://127.0.0.1:7300/", timeout, None).expect("valid URL");
        assert_eq!(s.url(), "http://127.0.0.1:7300/v1/ingest");
    }
}
