//! The `[alerts]` section of perch's config file: rules, the built-in pack's thresholds,
//! receivers, routes, inhibition and remediation guardrails.
//!
//! Everything has a default that works for a small cluster, so an empty section (or none)
//! gives the documented built-in pack with no receivers. Unknown keys are errors (a typo in a
//! guardrail must not silently fall back to a default), and [`AlertsConfig::validate`] checks
//! what serde cannot, naming the field and the allowed values. `alerts/README.md` is the
//! reference with an example.

mod notify;
#[cfg(test)]
mod tests;
mod validate;

pub use notify::{
    ChildRouteConfig, EmailConfig, InhibitRuleConfig, ReceiverConfig, RouteConfig, TlsMode,
    WebhookConfig, WebhookFormat,
};

use crate::duration::HumanDuration;
use crate::error::Result;
use crate::rules::{ActionSpec, DEFAULT_LABEL_COLUMNS, Rule, RuleSource, Severity};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The whole `[alerts]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertsConfig {
    /// Evaluate rules at all (default true).
    pub enabled: bool,
    /// How often rules are evaluated unless a rule sets its own `interval` (default 30s).
    pub evaluation_interval: HumanDuration,
    /// Plan remediation but change nothing: decisions are audited as `dry_run` (default false).
    pub dry_run: bool,
    /// Operator-written SQL rules (`[[alerts.rules]]`).
    pub rules: Vec<RuleConfig>,
    /// The built-in rule pack (`[alerts.builtin]`).
    pub builtin: BuiltinConfig,
    /// Where notifications go (`[[alerts.receivers]]`).
    pub receivers: Vec<ReceiverConfig>,
    /// Which receiver gets which alert, and how they are grouped (`[alerts.route]`).
    pub route: RouteConfig,
    /// Alerts that mute others while they fire (`[[alerts.inhibit_rules]]`). When absent,
    /// a lost node heartbeat mutes every other alert of that node.
    pub inhibit_rules: Option<Vec<InhibitRuleConfig>>,
    /// Automatic actions and their guardrails (`[alerts.remediation]`).
    pub remediation: RemediationConfig,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            evaluation_interval: HumanDuration::from_secs(30),
            dry_run: false,
            rules: Vec::new(),
            builtin: BuiltinConfig::default(),
            receivers: Vec::new(),
            route: RouteConfig::default(),
            inhibit_rules: None,
            remediation: RemediationConfig::default(),
        }
    }
}

/// One `[[alerts.rules]]` entry: a SQL rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// Unique name, the `alertname` label (`GpuTooHot`).
    pub name: String,
    /// One read-only SELECT over perch's tables; every row is an alert instance.
    pub sql: String,
    /// How long a row must keep appearing before the alert fires (default 0s).
    #[serde(rename = "for", default)]
    pub for_: HumanDuration,
    /// How long the alert keeps firing after its row disappears (default 0s).
    #[serde(default)]
    pub keep_firing_for: HumanDuration,
    /// `info`, `warning` (default) or `critical`.
    #[serde(default = "default_severity")]
    pub severity: Severity,
    /// Labels added to every alert of the rule (`team = "infra"`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// One-line template, e.g. `"{{ labels.node }} GPU {{ labels.gpu }} at {{ values.temp }} °C"`.
    #[serde(default)]
    pub summary: String,
    /// Longer template for the message body.
    #[serde(default)]
    pub description: String,
    /// Evaluation interval for this rule (default `evaluation_interval`).
    #[serde(default)]
    pub interval: Option<HumanDuration>,
    /// Remediation when an alert fires: `"drain_node"`, `"requeue_jobs"`, `"gpu_out"`,
    /// `"run_command:NAME"`.
    #[serde(default)]
    pub actions: Vec<ActionSpec>,
    /// Numeric columns that identify rather than measure, so become labels too
    /// (default `["gpu", "port", "xid", "pid", "job"]`).
    #[serde(default)]
    pub label_columns: Option<Vec<String>>,
}

fn default_severity() -> Severity {
    Severity::Warning
}

/// `[alerts.builtin]`: the built-in pack, on by default. Thresholds are shared by the rules
/// that use them; see `alerts/README.md` for which rule reads which.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BuiltinConfig {
    /// Load the pack at all (default true).
    pub enabled: bool,
    /// Built-in rules to leave out, by name (`["GpuAllocatedIdle"]`).
    pub disable: Vec<String>,
    /// Replace a built-in rule's actions, by rule name (`XidResetGpu = ["drain_node"]`,
    /// or `[]` to alert only).
    pub actions: BTreeMap<String, Vec<ActionSpec>>,
    /// NodeHeartbeatLost: silence after which a node counts as lost (default 1m).
    pub heartbeat_timeout: HumanDuration,
    /// XID and ECC rules: how far back an event keeps its alert firing (default 10m).
    pub event_window: HumanDuration,
    /// GpuThrottled: how long thermal or power throttling must last (default 10m).
    pub throttle_for: HumanDuration,
    /// GpuRogueProcess: how long a process outside the job holding a GPU must stay (default 2m).
    pub rogue_for: HumanDuration,
    /// GpuAllocatedIdle: how long an allocated GPU must stay idle (default 30m).
    pub idle_for: HumanDuration,
    /// GpuAllocatedIdle: utilization below which a GPU counts as idle (default 5 percent).
    pub idle_utilization_percent: f64,
    /// JobNoProgress: how long a job may show no progress (default 30m).
    pub no_progress_for: HumanDuration,
    /// NicErrorsRising / IbErrorsRising: errors within 5 minutes that raise the alert (default 10).
    pub link_errors: u64,
    /// NicLinkDown / NicErrorsRising: interfaces to watch, a regular expression on the
    /// device name (default `^(eth|en|ib|bond)`: physical and bonded links, not bridges).
    pub nic_devices: String,
    /// StoreDiskFull: free space below which the store's disk counts as full (default 10 percent).
    pub disk_free_percent: f64,
}

impl Default for BuiltinConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            disable: Vec::new(),
            actions: BTreeMap::new(),
            heartbeat_timeout: HumanDuration::from_mins(1),
            event_window: HumanDuration::from_mins(10),
            throttle_for: HumanDuration::from_mins(10),
            rogue_for: HumanDuration::from_mins(2),
            idle_for: HumanDuration::from_mins(30),
            idle_utilization_percent: 5.0,
            no_progress_for: HumanDuration::from_mins(30),
            link_errors: 10,
            nic_devices: "^(eth|en|ib|bond)".into(),
            disk_free_percent: 10.0,
        }
    }
}

/// `[alerts.remediation]`: what automatic actions may do, and when they must stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemediationConfig {
    /// Carry out rules' actions at all (default true; `dry_run` still only plans them).
    pub enabled: bool,
    /// Drains perch has started whose node still runs jobs, at most (default 2).
    pub max_concurrent_drains: usize,
    /// Share of all nodes that may be out (drained or down) after a drain (default 0.2).
    /// A drain that would exceed it opens the circuit breaker: no automatic action at all
    /// until an operator resets it.
    pub max_fraction_out: f64,
    /// The breaker also opens when perch's drains within this window would exceed
    /// `max_fraction_out` of the nodes, even if some were resumed since (default 5m).
    pub breaker_window: HumanDuration,
    /// After an action on a node, other alerts' actions on it wait this long (default 30m).
    pub cooldown: HumanDuration,
    /// Time limit for `run_command` actions without their own, and health checks (default 5m).
    pub action_timeout: HumanDuration,
    /// Command (argv) run on a node perch drained, once no alert with actions has fired for
    /// it for `resume_after`; when it exits 0 the node is resumed. Empty: perch never resumes
    /// nodes by itself (default empty).
    pub health_check: Vec<String>,
    /// Quiet time before the health check of a node perch drained (default 10m).
    pub resume_after: HumanDuration,
    /// Commands rules may run with `run_command:NAME`.
    pub commands: BTreeMap<String, CommandConfig>,
}

impl Default for RemediationConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_concurrent_drains: 2,
            max_fraction_out: 0.2,
            breaker_window: HumanDuration::from_mins(5),
            cooldown: HumanDuration::from_mins(30),
            action_timeout: HumanDuration::from_mins(5),
            health_check: Vec::new(),
            resume_after: HumanDuration::from_mins(10),
            commands: BTreeMap::new(),
        }
    }
}

/// A command a rule can run on a node through its agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandConfig {
    /// Program and arguments; `{{ labels.gpu }}` and the like are filled from the alert.
    pub argv: Vec<String>,
    /// Time limit (default `action_timeout`).
    #[serde(default)]
    pub timeout: Option<HumanDuration>,
}

impl AlertsConfig {
    /// Parses the body of an `[alerts]` section (for tests and tools; the server embeds
    /// [`AlertsConfig`] in its own config type) and validates it.
    pub fn from_toml(text: &str) -> Result<Self> {
        let config: Self = toml::from_str(text)
            .map_err(|e| crate::Error::config("alerts", e.to_string().trim().to_owned()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot: ranges, references between sections, regexes, addresses.
    /// The error names the field (`alerts.route.receiver`) and what is allowed.
    pub fn validate(&self) -> Result<()> {
        validate::validate(self)
    }

    /// Every rule to evaluate: the built-in pack (unless disabled) then the config's rules.
    pub fn rules(&self) -> Vec<Rule> {
        let mut rules = if self.builtin.enabled {
            crate::builtin::builtin_rules(&self.builtin, self.evaluation_interval.as_ms())
        } else {
            Vec::new()
        };
        rules.extend(self.rules.iter().map(|r| self.rule_from_config(r)));
        rules
    }

    fn rule_from_config(&self, r: &RuleConfig) -> Rule {
        Rule {
            name: r.name.clone(),
            source: RuleSource::Sql(r.sql.clone()),
            for_ms: r.for_.as_ms(),
            keep_firing_for_ms: r.keep_firing_for.as_ms(),
            severity: r.severity,
            labels: r.labels.clone(),
            summary: r.summary.clone(),
            description: r.description.clone(),
            interval_ms: r.interval.unwrap_or(self.evaluation_interval).as_ms(),
            actions: r.actions.clone(),
            label_columns: r.label_columns.clone().unwrap_or_else(|| {
                DEFAULT_LABEL_COLUMNS
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect()
            }),
            builtin: false,
        }
    }
}
