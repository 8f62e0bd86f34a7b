//! The notification half of the config: receivers, the routing tree and inhibition rules,
//! shaped like Alertmanager's so its users find what they expect.

use crate::duration::HumanDuration;
use crate::matcher::Matcher;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// One `[[alerts.receivers]]`: a named destination with any number of email and webhook
/// integrations. A receiver with none drops what is routed to it (a "blackhole").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiverConfig {
    /// The name routes refer to.
    pub name: String,
    /// `[[alerts.receivers.email]]` integrations.
    #[serde(default)]
    pub email: Vec<EmailConfig>,
    /// `[[alerts.receivers.webhook]]` integrations.
    #[serde(default)]
    pub webhook: Vec<WebhookConfig>,
}

/// How the SMTP connection is secured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TlsMode {
    /// Plain text (a relay on localhost or a trusted network; default port 25).
    None,
    /// Plain connection upgraded with STARTTLS, which is required (default port 587).
    Starttls,
    /// TLS from the first byte, "SMTPS" (default port 465).
    Tls,
}

/// An email integration (SMTP through lettre).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmailConfig {
    /// SMTP server host name.
    pub smtp_host: String,
    /// SMTP port (default 25, 587 or 465 by `tls`).
    #[serde(default)]
    pub smtp_port: Option<u16>,
    /// `none`, `starttls` (default) or `tls`.
    #[serde(default = "default_tls")]
    pub tls: TlsMode,
    /// User name for SMTP AUTH; no authentication when absent.
    #[serde(default)]
    pub username: Option<String>,
    /// Password for SMTP AUTH (prefer `password_env`, which keeps it out of the file).
    #[serde(default)]
    pub password: Option<String>,
    /// Name of an environment variable holding the password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// Sender address (`perch <perch@example.com>`).
    pub from: String,
    /// Recipient addresses.
    pub to: Vec<String>,
    /// Also mail when alerts resolve (default false, as in Alertmanager).
    #[serde(default)]
    pub send_resolved: bool,
    /// A PEM file of extra CA certificates to trust (a private CA), besides the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Time limit for one delivery attempt (default 30s).
    #[serde(default = "default_email_timeout")]
    pub timeout: HumanDuration,
}

fn default_tls() -> TlsMode {
    TlsMode::Starttls
}

fn default_email_timeout() -> HumanDuration {
    HumanDuration::from_secs(30)
}

impl EmailConfig {
    /// The port to connect to: the configured one or the usual one for the TLS mode.
    pub fn port(&self) -> u16 {
        self.smtp_port.unwrap_or(match self.tls {
            TlsMode::None => 25,
            TlsMode::Starttls => 587,
            TlsMode::Tls => 465,
        })
    }
}

/// The body a webhook receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookFormat {
    /// Alertmanager's webhook JSON (version 4), so existing receivers work unchanged.
    Json,
    /// Slack's incoming-webhook `{"text": ...}` (Mattermost and others accept it too).
    Slack,
}

/// A webhook integration (HTTP POST through reqwest).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// `http://` or `https://` URL.
    pub url: String,
    /// `json` (default) or `slack`.
    #[serde(default = "default_format")]
    pub format: WebhookFormat,
    /// Bearer token sent as `Authorization: Bearer ...`.
    #[serde(default)]
    pub bearer_token: Option<String>,
    /// Name of an environment variable holding the bearer token.
    #[serde(default)]
    pub bearer_token_env: Option<String>,
    /// Also post when alerts resolve (default true, as in Alertmanager).
    #[serde(default = "default_true")]
    pub send_resolved: bool,
    /// Time limit for one delivery attempt (default 10s).
    #[serde(default = "default_webhook_timeout")]
    pub timeout: HumanDuration,
    /// Send at most this many alerts per message, 0 for all (default 0).
    #[serde(default)]
    pub max_alerts: usize,
}

fn default_format() -> WebhookFormat {
    WebhookFormat::Json
}

fn default_true() -> bool {
    true
}

fn default_webhook_timeout() -> HumanDuration {
    HumanDuration::from_secs(10)
}

/// `[alerts.route]`: the root route. Every alert goes to the first child route that matches
/// it (and on to later ones while a matched route has `continue = true`); an alert no child
/// matches goes to the root's receiver. Children inherit what they do not set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteConfig {
    /// Receiver for alerts no child route takes. Required once any receiver exists.
    pub receiver: String,
    /// Labels whose values split alerts into groups, one message per group
    /// (default `["alertname", "node"]`); `["..."]` groups by every label.
    pub group_by: Vec<String>,
    /// How long a new group waits for more alerts before its first message (default 30s).
    pub group_wait: HumanDuration,
    /// How long before a group's next message about new alerts (default 5m).
    pub group_interval: HumanDuration,
    /// How long before an unchanged firing group is sent again (default 4h).
    pub repeat_interval: HumanDuration,
    /// Send resolved notices; when absent each integration's own `send_resolved` decides.
    pub send_resolved: Option<bool>,
    /// Child routes (`[[alerts.route.routes]]`), tried in order.
    pub routes: Vec<ChildRouteConfig>,
}

impl Default for RouteConfig {
    fn default() -> Self {
        Self {
            receiver: String::new(),
            group_by: vec!["alertname".into(), "node".into()],
            group_wait: HumanDuration::from_secs(30),
            group_interval: HumanDuration::from_mins(5),
            repeat_interval: HumanDuration::from_mins(240),
            send_resolved: None,
            routes: Vec::new(),
        }
    }
}

/// One `[[alerts.route.routes]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildRouteConfig {
    /// All must match (`['account="vision"']`); empty matches every alert.
    #[serde(default)]
    pub matchers: Vec<Matcher>,
    /// Receiver (default: the root's).
    #[serde(default)]
    pub receiver: Option<String>,
    /// Grouping labels (default: the root's).
    #[serde(default)]
    pub group_by: Option<Vec<String>>,
    /// Default: the root's.
    #[serde(default)]
    pub group_wait: Option<HumanDuration>,
    /// Default: the root's.
    #[serde(default)]
    pub group_interval: Option<HumanDuration>,
    /// Default: the root's.
    #[serde(default)]
    pub repeat_interval: Option<HumanDuration>,
    /// Default: the root's.
    #[serde(default)]
    pub send_resolved: Option<bool>,
    /// Keep looking for further matching routes after this one (default false).
    #[serde(default, rename = "continue")]
    pub continue_: bool,
}

/// One `[[alerts.inhibit_rules]]`: while an alert matching `source_matchers` fires, alerts
/// matching `target_matchers` with the same values of the `equal` labels are not sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InhibitRuleConfig {
    /// What the muting alert looks like.
    pub source_matchers: Vec<Matcher>,
    /// What the muted alerts look like.
    pub target_matchers: Vec<Matcher>,
    /// Labels that must be equal on both (e.g. `["node"]`).
    #[serde(default)]
    pub equal: Vec<String>,
}

impl InhibitRuleConfig {
    /// The default: a lost node heartbeat mutes that node's other alerts (its GPUs, NICs and
    /// jobs all look broken when the node is gone).
    pub fn defaults() -> Vec<Self> {
        let parse = |text: &str| Matcher::parse(text);
        match (
            parse(r#"alertname="NodeHeartbeatLost""#),
            parse(r#"alertname!="NodeHeartbeatLost""#),
        ) {
            (Ok(source), Ok(target)) => vec![Self {
                source_matchers: vec![source],
                target_matchers: vec![target],
                equal: vec!["node".into()],
            }],
            // Both literals are valid matchers; this arm is never taken.
            _ => Vec::new(),
        }
    }
}
