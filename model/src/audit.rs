//! Cluster events: what happened to jobs, nodes and GPUs, and what perch (or a person) did
//! about it. The server appends them to the store's `events` table, the audit trail that
//! operators read over SQL and the API. Unlike [`crate::GpuEvent`], which an agent reports, a
//! cluster event is written by the server itself.

use serde::{Deserialize, Serialize};

/// One audited happening. Optional fields are absent when they do not apply (a node drain has
/// no GPU; a circuit-breaker trip has no node).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterEvent {
    /// When it happened, Unix ms.
    pub time_ms: i64,
    /// What happened, in snake_case: `job_submitted`, `job_started`, `job_ended`,
    /// `job_requeued`, `node_down`, `node_up`, `node_drained`, `node_resumed`,
    /// `alert_firing`, `alert_resolved`, `remediation`, `circuit_breaker_open`, ...
    pub kind: String,
    /// Who acted: a user name, `perch` for automatic actions, or `agent`.
    pub actor: String,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default)]
    pub gpu: Option<u32>,
    #[serde(default)]
    pub job: Option<u64>,
    /// The alert rule behind it, for alert and remediation events.
    #[serde(default)]
    pub rule: Option<String>,
    /// The action taken or planned (`drain_node`, `requeue_jobs`, `gpu_out`, ...).
    #[serde(default)]
    pub action: Option<String>,
    /// How it went: `done`, `failed`, `dry_run`, `refused: <why>`, a job's end state...
    #[serde(default)]
    pub outcome: Option<String>,
    /// `info`, `warning` or `critical` for alert events.
    #[serde(default)]
    pub severity: Option<String>,
    /// The action was only planned (dry-run mode): nothing was changed.
    #[serde(default)]
    pub dry_run: bool,
    /// A sentence for people.
    pub message: String,
}

impl ClusterEvent {
    /// An event with only the required fields set.
    pub fn new(
        time_ms: i64,
        kind: impl Into<String>,
        actor: impl Into<String>,
        message: impl Into<String>,
    ) -> ClusterEvent {
        ClusterEvent {
            time_ms,
            kind: kind.into(),
            actor: actor.into(),
            node: None,
            gpu: None,
            job: None,
            rule: None,
            action: None,
            outcome: None,
            severity: None,
            dry_run: false,
            message: message.into(),
        }
    }
}
