//! Delivering [`Notification`]s: the receivers of the config, each with its email and
//! webhook integrations, and retries with exponential backoff. A failed delivery is reported
//! in the returned [`Delivery`] (and logged), never a panic, never silently dropped.
//!
//! `send` takes as long as its retries; the server should run it in a task of its own so the
//! evaluation loop does not wait on a slow mail server.

mod email;
pub mod message;
mod webhook;

pub use email::EmailSender;
pub use webhook::WebhookSender;

use crate::config::AlertsConfig;
use crate::dispatch::Notification;
use crate::error::Result;
use std::collections::BTreeMap;
use std::time::Duration;

/// How often and how patiently to retry a failed delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, at least 1.
    pub attempts: u32,
    /// Wait before the second attempt; doubled for each later one.
    pub first_backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 4 attempts, waiting 2 s, 4 s and 8 s: about 15 s, well inside a group interval.
    fn default() -> Self {
        Self {
            attempts: 4,
            first_backoff: Duration::from_secs(2),
            max_backoff: Duration::from_secs(30),
        }
    }
}

#[derive(Debug)]
enum Integration {
    Email(Box<EmailSender>),
    Webhook(WebhookSender),
}

impl Integration {
    fn describe(&self) -> &str {
        match self {
            Self::Email(e) => e.describe(),
            Self::Webhook(w) => w.describe(),
        }
    }

    async fn attempt(&self, n: &Notification) -> Result<bool, email::AttemptError> {
        match self {
            Self::Email(e) => e.attempt(n).await,
            Self::Webhook(w) => w.attempt(n).await,
        }
    }
}

/// The result of delivering one notification through one integration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The receiver.
    pub receiver: String,
    /// The integration (`email to ops@example.com`, `webhook https://hooks.slack.com`).
    pub integration: String,
    /// Attempts made (0 when the integration had nothing to send).
    pub attempts: u32,
    /// `None` when delivered (or nothing to send); the last error otherwise.
    pub error: Option<String>,
}

/// Every configured receiver, ready to send.
#[derive(Debug)]
pub struct Notifier {
    receivers: BTreeMap<String, Vec<Integration>>,
    retry: RetryPolicy,
}

impl Notifier {
    /// Builds every receiver of `config`; fails on a missing secret or CA file, naming the
    /// config field.
    pub fn new(config: &AlertsConfig) -> Result<Self> {
        let mut receivers = BTreeMap::new();
        for (i, r) in config.receivers.iter().enumerate() {
            let mut integrations = Vec::new();
            for (j, e) in r.email.iter().enumerate() {
                let field = format!("alerts.receivers[{i}].email[{j}]");
                integrations.push(Integration::Email(Box::new(EmailSender::new(&field, e)?)));
            }
            for (j, w) in r.webhook.iter().enumerate() {
                let field = format!("alerts.receivers[{i}].webhook[{j}]");
                integrations.push(Integration::Webhook(WebhookSender::new(&field, w)?));
            }
            receivers.insert(r.name.clone(), integrations);
        }
        Ok(Self {
            receivers,
            retry: RetryPolicy::default(),
        })
    }

    /// Replaces the retry policy (tests use short waits).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Delivers `n` through every integration of its receiver, retrying failures.
    pub async fn send(&self, n: &Notification) -> Vec<Delivery> {
        let Some(integrations) = self.receivers.get(&n.receiver) else {
            tracing::warn!(receiver = %n.receiver, "notification for an unknown receiver dropped");
            return vec![Delivery {
                receiver: n.receiver.clone(),
                integration: String::new(),
                attempts: 0,
                error: Some(format!("no receiver named {:?} is configured", n.receiver)),
            }];
        };
        let mut out = Vec::with_capacity(integrations.len());
        for integration in integrations {
            out.push(self.deliver(n, integration).await);
        }
        out
    }

    async fn deliver(&self, n: &Notification, integration: &Integration) -> Delivery {
        let mut delivery = Delivery {
            receiver: n.receiver.clone(),
            integration: integration.describe().to_owned(),
            attempts: 0,
            error: None,
        };
        let mut backoff = self.retry.first_backoff;
        loop {
            delivery.attempts += 1;
            match integration.attempt(n).await {
                Ok(sent) => {
                    if !sent {
                        delivery.attempts = 0;
                    }
                    delivery.error = None;
                    return delivery;
                }
                Err(e) => {
                    tracing::warn!(
                        receiver = %n.receiver,
                        integration = %delivery.integration,
                        attempt = delivery.attempts,
                        error = %e.message,
                        "notification delivery failed"
                    );
                    delivery.error = Some(e.message);
                    if !e.retry || delivery.attempts >= self.retry.attempts.max(1) {
                        return delivery;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.retry.max_backoff);
                }
            }
        }
    }
}
