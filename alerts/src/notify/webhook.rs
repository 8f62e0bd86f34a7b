//! Webhooks through reqwest: Alertmanager's JSON (so existing receivers work) or Slack's
//! `{"text": ...}`. Retried on connection errors, 5xx and 429, as Alertmanager does; other
//! 4xx replies mean the request itself is wrong and are reported at once.

use super::email::AttemptError;
use super::message::{slack_json, webhook_json};
use crate::config::{WebhookConfig, WebhookFormat};
use crate::dispatch::Notification;
use crate::error::{Error, Result};
use std::time::Duration;

/// One webhook integration, ready to send.
#[derive(Debug)]
pub struct WebhookSender {
    client: reqwest::Client,
    url: reqwest::Url,
    format: WebhookFormat,
    token: Option<String>,
    send_resolved: bool,
    max_alerts: usize,
    describe: String,
}

impl WebhookSender {
    /// Builds the integration; `field` is its config path, for errors.
    pub fn new(field: &str, cfg: &WebhookConfig) -> Result<Self> {
        let url = reqwest::Url::parse(&cfg.url).map_err(|e| {
            Error::config(
                format!("{field}.url"),
                format!("{:?} is not a URL: {e}", cfg.url),
            )
        })?;
        let token = match (&cfg.bearer_token, &cfg.bearer_token_env) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(var)) => Some(std::env::var(var).map_err(|_| {
                Error::config(
                    format!("{field}.bearer_token_env"),
                    format!("names {var}, which is not set in perch's environment"),
                )
            })?),
            (None, None) => None,
        };
        perch_model::tls::use_ring();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(
                u64::try_from(cfg.timeout.as_ms()).unwrap_or(10_000),
            ))
            .user_agent(concat!("perch-alerts/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::config(field, format!("cannot build the HTTP client: {e}")))?;
        // The URL may carry a secret (Slack's do): report only scheme, host and port.
        let describe = format!(
            "webhook {}://{}{}",
            url.scheme(),
            url.host_str().unwrap_or(""),
            url.port().map(|p| format!(":{p}")).unwrap_or_default()
        );
        Ok(Self {
            client,
            url,
            format: cfg.format,
            token,
            send_resolved: cfg.send_resolved,
            max_alerts: cfg.max_alerts,
            describe,
        })
    }

    /// What this integration is, for delivery reports (host only; the path may be secret).
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// The JSON body this integration would post, or `None` when there is nothing for it.
    pub fn body(&self, n: &Notification) -> Option<serde_json::Value> {
        let owned;
        let n = if self.send_resolved {
            n
        } else {
            owned = n.without_resolved()?;
            &owned
        };
        Some(match self.format {
            WebhookFormat::Json => webhook_json(n, self.max_alerts),
            WebhookFormat::Slack => slack_json(n),
        })
    }

    /// One delivery attempt. `Ok(false)`: nothing to send for this integration.
    pub(crate) async fn attempt(&self, n: &Notification) -> Result<bool, AttemptError> {
        let Some(body) = self.body(n) else {
            return Ok(false);
        };
        let mut request = self.client.post(self.url.clone()).json(&body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(|e| AttemptError {
            message: format!("request failed: {e}"),
            retry: true,
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(true);
        }
        let detail: String = response
            .text()
            .await
            .unwrap_or_default()
            .chars()
            .take(200)
            .collect();
        Err(AttemptError {
            message: format!("HTTP {status}: {}", detail.trim()),
            retry: status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS,
        })
    }
}
