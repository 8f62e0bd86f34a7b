//! Instances of the typed built-ins, which the server computes from what it knows
//! first-hand rather than from SQL: its control plane's heartbeats and its own disk.

use crate::rules::{BuiltinKind, Instance};
use perch_model::NodeState;

/// What the server knows about one node's heartbeat.
#[derive(Debug, Clone, Copy)]
pub struct NodeHeartbeat<'a> {
    /// The node's name.
    pub node: &'a str,
    /// When its agent last synced (Unix ms), if ever.
    pub last_seen_ms: Option<i64>,
}

/// NodeHeartbeatLost's instances: nodes silent for more than `timeout_ms` (or never heard
/// from). Labels `node`; value `seconds_since_heartbeat` (absent for a node never seen).
pub fn heartbeat_instances(
    kind: &BuiltinKind,
    nodes: &[NodeHeartbeat<'_>],
    now_ms: i64,
) -> Vec<Instance> {
    let BuiltinKind::NodeHeartbeatLost { timeout_ms } = *kind else {
        return Vec::new();
    };
    nodes
        .iter()
        .filter_map(|n| {
            let silent_ms = n.last_seen_ms.map(|seen| now_ms.saturating_sub(seen));
            if silent_ms.is_some_and(|s| s <= timeout_ms) {
                return None;
            }
            let mut i = Instance::with_labels([("node", n.node)]);
            if let Some(ms) = silent_ms {
                i = i.value("seconds_since_heartbeat", (ms / 1000) as f64);
            }
            Some(i)
        })
        .collect()
}

/// What the server knows about one node's telemetry.
#[derive(Debug, Clone, Copy)]
pub struct NodeTelemetry<'a> {
    pub node: &'a str,
    /// Its state, by the one definition ([`perch_model::node_state`]).
    pub state: NodeState,
    /// When its last telemetry batch arrived (Unix ms), if one did since the server started.
    pub last_sample_ms: Option<i64>,
}

/// NodeTelemetryStopped's instances: nodes whose agent syncs but whose telemetry stopped
/// (state `no_telemetry`). Labels `node`; value `seconds_since_sample` (absent when no sample
/// arrived since the server started).
pub fn telemetry_instances(
    kind: &BuiltinKind,
    nodes: &[NodeTelemetry<'_>],
    now_ms: i64,
) -> Vec<Instance> {
    if *kind != BuiltinKind::NodeTelemetryStopped {
        return Vec::new();
    }
    nodes
        .iter()
        .filter(|n| n.state == NodeState::NoTelemetry)
        .map(|n| {
            let i = Instance::with_labels([("node", n.node)]);
            match n.last_sample_ms {
                Some(t) => i.value(
                    "seconds_since_sample",
                    (now_ms.saturating_sub(t) / 1000) as f64,
                ),
                None => i,
            }
        })
        .collect()
}

/// StoreDiskFull's instances: the store's filesystem when less than the threshold is free.
/// Labels `path`; values `free_percent`, `free_bytes`, `total_bytes`.
pub fn disk_instances(
    kind: &BuiltinKind,
    path: &str,
    free_bytes: u64,
    total_bytes: u64,
) -> Vec<Instance> {
    let BuiltinKind::StoreDiskFull { free_percent } = *kind else {
        return Vec::new();
    };
    if total_bytes == 0 {
        return Vec::new();
    }
    let percent = free_bytes as f64 * 100.0 / total_bytes as f64;
    if percent >= free_percent {
        return Vec::new();
    }
    vec![
        Instance::with_labels([("path", path)])
            .value("free_percent", (percent * 10.0).round() / 10.0)
            .value("free_bytes", free_bytes as f64)
            .value("total_bytes", total_bytes as f64),
    ]
}

/// What the store says about its flushes, for StoreFlushFailing.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreFlush<'a> {
    /// Flushes failed in a row since the last that worked.
    pub failures: u64,
    /// The last one's error.
    pub error: Option<&'a str>,
    /// Rows held in memory, and the most it may hold before ingest is refused.
    pub held_rows: u64,
    pub limit_rows: u64,
}

/// StoreFlushFailing's instance: one while at least two flushes in a row failed (one can be a
/// blip). Label `error` (its first 200 characters); values `failures`, `held_rows`,
/// `limit_rows`.
pub fn flush_instances(kind: &BuiltinKind, flush: &StoreFlush<'_>) -> Vec<Instance> {
    if *kind != BuiltinKind::StoreFlushFailing || flush.failures < 2 {
        return Vec::new();
    }
    let error = flush.error.unwrap_or("unknown");
    let error = &error[..error.floor_char_boundary(200)];
    vec![
        Instance::with_labels([("error", error)])
            .value("failures", flush.failures as f64)
            .value("held_rows", flush.held_rows as f64)
            .value("limit_rows", flush.limit_rows as f64),
    ]
}

/// JobDatabaseFailing's instance: one while the job database cannot commit (`error`: why, its
/// first 200 characters).
pub fn job_db_instances(kind: &BuiltinKind, error: Option<&str>) -> Vec<Instance> {
    match error {
        Some(error) if *kind == BuiltinKind::JobDatabaseFailing => {
            vec![Instance::with_labels([(
                "error",
                &error[..error.floor_char_boundary(200)],
            )])]
        }
        _ => Vec::new(),
    }
}

/// A running job the scheduler has reported idle, for JobIdle.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleJob<'a> {
    pub job: u64,
    pub user: &'a str,
    pub account: &'a str,
    /// Its nodes, comma-separated.
    pub nodes: &'a str,
    /// Unix ms its idle spell began.
    pub idle_since_ms: i64,
    /// What perch does next, in words ("perch requeues it at ... if it is still idle").
    pub consequence: &'a str,
    /// When perch acts on it, if it will (Unix ms).
    pub action_at_ms: Option<i64>,
}

/// JobIdle's instances: one per reported idle job. Labels `job`, `user`, `account`, `nodes`,
/// `idle_since` (RFC 3339), `consequence`; values `minutes_idle` and, when perch will act,
/// `minutes_until_action`.
pub fn idle_job_instances(kind: &BuiltinKind, jobs: &[IdleJob<'_>], now_ms: i64) -> Vec<Instance> {
    if *kind != BuiltinKind::JobIdle {
        return Vec::new();
    }
    jobs.iter()
        .map(|j| {
            let id = j.job.to_string();
            let since = crate::rfc3339(j.idle_since_ms);
            let mut i = Instance::with_labels([
                ("job", id.as_str()),
                ("user", j.user),
                ("account", j.account),
                ("nodes", j.nodes),
                ("idle_since", since.as_str()),
                ("consequence", j.consequence),
            ])
            .value(
                "minutes_idle",
                (now_ms.saturating_sub(j.idle_since_ms) / 60_000) as f64,
            );
            if let Some(at) = j.action_at_ms {
                i = i.value(
                    "minutes_until_action",
                    (at.saturating_sub(now_ms).max(0) / 60_000) as f64,
                );
            }
            i
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_failing_fires_from_the_second_failure_in_a_row() {
        let kind = BuiltinKind::StoreFlushFailing;
        let flush = |failures| StoreFlush {
            failures,
            error: Some("writing tables/gpu_samples: No space left on device"),
            held_rows: 10,
            limit_rows: 100,
        };
        assert!(flush_instances(&kind, &flush(0)).is_empty());
        assert!(
            flush_instances(&kind, &flush(1)).is_empty(),
            "one failure can be a blip"
        );
        let got = flush_instances(&kind, &flush(2));
        assert_eq!(got.len(), 1);
        assert_eq!(
            got[0].labels.get("error").map(String::as_str),
            Some("writing tables/gpu_samples: No space left on device")
        );
        let other = BuiltinKind::StoreDiskFull { free_percent: 5.0 };
        assert!(flush_instances(&other, &flush(3)).is_empty());
    }

    #[test]
    fn telemetry_stopped_fires_for_no_telemetry_nodes_only() {
        let kind = BuiltinKind::NodeTelemetryStopped;
        let nodes = [
            NodeTelemetry {
                node: "a",
                state: NodeState::NoTelemetry,
                last_sample_ms: Some(1_000),
            },
            NodeTelemetry {
                node: "b",
                state: NodeState::Down,
                last_sample_ms: Some(1_000),
            },
            NodeTelemetry {
                node: "c",
                state: NodeState::Up,
                last_sample_ms: Some(241_000),
            },
            NodeTelemetry {
                node: "d",
                state: NodeState::NoTelemetry,
                last_sample_ms: None,
            },
        ];
        let fired = telemetry_instances(&kind, &nodes, 241_000);
        let labels: Vec<_> = fired.iter().map(|i| i.labels["node"].as_str()).collect();
        assert_eq!(labels, ["a", "d"], "a down node is NodeHeartbeatLost's");
        assert_eq!(fired[0].values["seconds_since_sample"], 240.0);
        assert!(!fired[1].values.contains_key("seconds_since_sample"));
        let other = BuiltinKind::StoreDiskFull { free_percent: 5.0 };
        assert!(telemetry_instances(&other, &nodes, 241_000).is_empty());
    }

    #[test]
    fn a_job_database_that_cannot_commit_is_one_alert_with_the_error() {
        let kind = BuiltinKind::JobDatabaseFailing;
        let got = job_db_instances(&kind, Some("No space left on device (os error 28)"));
        assert_eq!(got.len(), 1);
        assert!(got[0].labels["error"].contains("No space left"));
        assert!(job_db_instances(&kind, None).is_empty());
        let other = BuiltinKind::StoreFlushFailing;
        assert!(job_db_instances(&other, Some("full")).is_empty());
    }

    #[test]
    fn each_reported_idle_job_is_one_alert_naming_its_user_and_what_comes_next() {
        let job = IdleJob {
            job: 42,
            user: "alice",
            account: "vision",
            nodes: "gpu-a,gpu-b",
            idle_since_ms: 1_800_000_000_000,
            consequence: "perch requeues it in 10 min.",
            action_at_ms: Some(1_800_000_000_000 + 40 * 60_000),
        };
        let now = 1_800_000_000_000 + 30 * 60_000;
        let got = idle_job_instances(&BuiltinKind::JobIdle, std::slice::from_ref(&job), now);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].labels["job"], "42");
        assert_eq!(got[0].labels["user"], "alice");
        assert_eq!(got[0].labels["nodes"], "gpu-a,gpu-b");
        assert_eq!(got[0].values["minutes_idle"], 30.0);
        assert_eq!(got[0].values["minutes_until_action"], 10.0);
        let other = BuiltinKind::StoreFlushFailing;
        assert!(idle_job_instances(&other, &[job], now).is_empty());
    }
}
