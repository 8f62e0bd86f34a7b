//! Delivery to the server: `POST {server}/v1/ingest` with the batch as zstd-compressed JSON.
//!
//! Replies decide a batch's fate: 2xx means durable (remove it); 4xx means the batch itself is
//! bad (log the server's message once, count it, drop it: retrying cannot help), except 408 and
//! 429 which ask us to come back later; 5xx and connection errors are retried with capped
//! exponential backoff, front of the queue first, so order is kept. Retries are safe because the
//! server ignores a `(node, seq)` it has already accepted.

use crate::agent::AgentCounters;
use crate::error::{CollectorError, Result};
use crate::queue::SendQueue;
use perch_model::Batch;
use reqwest::header::{CONTENT_ENCODING, CONTENT_TYPE};
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
    /// Try again later.
    Retry { reason: String },
}

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

/// An HTTP client bound to one server.
#[derive(Debug, Clone)]
pub struct Sender {
    client: reqwest::Client,
    url: String,
}

/// Serializes and compresses a batch the way the server expects it.
pub fn encode(batch: &Batch) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(batch).map_err(|e| CollectorError::Encode(e.to_string()))?;
    zstd::bulk::compress(&json, ZSTD_LEVEL).map_err(|e| CollectorError::Encode(e.to_string()))
}

impl Sender {
    /// `server` is the base URL, e.g. `http://127.0.0.1:7300`; `timeout` bounds one request.
    pub fn new(server: &str, timeout: Duration) -> Result<Self> {
        let base = server.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(CollectorError::Config(format!(
                "server {server:?} must be a URL such as http://127.0.0.1:7300"
            )));
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .build()
            .map_err(|e| CollectorError::Config(format!("cannot build HTTP client: {e}")))?;
        Ok(Self {
            client,
            url: format!("{base}/v1/ingest"),
        })
    }

    /// The ingest URL batches go to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends one batch once and classifies the reply.
    pub async fn post(&self, batch: &Batch) -> SendOutcome {
        let body = match encode(batch) {
            Ok(b) => b,
            Err(e) => {
                return SendOutcome::Rejected {
                    status: 0,
                    message: e.to_string(),
                };
            }
        };
        let response = self
            .client
            .post(&self.url)
            .header(CONTENT_TYPE, "application/json")
            .header(CONTENT_ENCODING, "zstd")
            .body(body)
            .send()
            .await;
        let response = match response {
            Ok(r) => r,
            Err(e) => {
                return SendOutcome::Retry {
                    reason: error_chain(&e),
                };
            }
        };
        let status = response.status();
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
            }
        }
    }
}

/// An error and its sources on one line ("error sending request: connection refused").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

pub(crate) fn lock(q: &Mutex<SendQueue>) -> MutexGuard<'_, SendQueue> {
    // A panic while holding the lock cannot leave the queue half-updated in a way that matters
    // more than losing the agent, so keep going with its contents.
    q.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the sender loop shares with the sampling loop.
#[derive(Debug, Clone)]
pub struct SenderShared {
    pub queue: Arc<Mutex<SendQueue>>,
    /// Signalled when a round is queued or `draining` is set.
    pub wake: Arc<Notify>,
    /// Set once sampling has stopped: the loop returns when the queue is empty.
    pub draining: Arc<AtomicBool>,
    pub counters: Arc<AgentCounters>,
}

/// Sends queued batches, oldest first, until draining and empty. Runs as its own task.
pub async fn run_sender(sender: Sender, shared: SenderShared, backoff: Backoff) {
    let SenderShared {
        queue,
        wake,
        draining,
        counters,
    } = shared;
    let mut failures = 0u32;
    loop {
        let next = lock(&queue).next_to_send();
        let Some(batch) = next else {
            if draining.load(Relaxed) {
                return;
            }
            wake.notified().await;
            continue;
        };
        let samples = batch.sample_count() as u64;
        match sender.post(&batch).await {
            SendOutcome::Accepted { duplicate } => {
                lock(&queue).complete(batch.seq);
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
                }
            }
            SendOutcome::Rejected { status, message } => {
                lock(&queue).complete(batch.seq);
                counters.batches_rejected.fetch_add(1, Relaxed);
                counters.samples_dropped.fetch_add(samples, Relaxed);
                tracing::warn!(seq = batch.seq, status, samples, server_message = %message, "server rejected batch, dropping it");
            }
            SendOutcome::Retry { reason } => {
                lock(&queue).retry_later(batch.seq);
                counters.send_errors.fetch_add(1, Relaxed);
                failures += 1;
                let delay = backoff.delay(failures);
                if failures == 1 {
                    tracing::warn!(url = %sender.url(), error = %reason, "cannot deliver batch, keeping it queued and retrying");
                } else {
                    tracing::debug!(attempt = failures, error = %reason, ?delay, "delivery still failing");
                }
                tokio::time::sleep(delay).await;
            }
        }
    }
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
        assert!(Sender::new("127.0.0.1:7300", timeout).is_err());
        let s = Sender::new("http://127.0.0.1:7300/", timeout).expect("valid URL");
        assert_eq!(s.url(), "http://127.0.0.1:7300/v1/ingest");
    }
}
