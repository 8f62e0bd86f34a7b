//! A node's state: the one definition that `perch nodes`, `GET /v1/nodes`, `perch_node_up` and
//! the alert engine all use, so they can never disagree about the same node.

use std::fmt;

/// What a node is doing, worst first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeState {
    /// Its agent stopped syncing with the server (or, for a node that only sends telemetry,
    /// its telemetry stopped): nothing is known about it any more.
    Down,
    /// Its agent syncs, but its telemetry stopped: jobs may run there, yet no GPU, host or
    /// NIC sample has been stored for longer than the staleness window.
    NoTelemetry,
    /// Reporting, but takes no new jobs.
    Drained,
    /// Reporting and taking jobs.
    Up,
}

impl NodeState {
    pub const ALL: [NodeState; 4] = [
        NodeState::Down,
        NodeState::NoTelemetry,
        NodeState::Drained,
        NodeState::Up,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Down => "down",
            NodeState::NoTelemetry => "no_telemetry",
            NodeState::Drained => "drained",
            NodeState::Up => "up",
        }
    }

    /// Whether the node is reporting everything it should (`perch_node_up`).
    pub fn is_up(self) -> bool {
        matches!(self, NodeState::Up | NodeState::Drained)
    }
}

impl fmt::Display for NodeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the server knows of a node's agent, when the node runs one that syncs (a node with
/// GPUs); a node that only sends telemetry has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentLiveness {
    /// The control plane marked it down: no sync within the heartbeat timeout.
    pub down: bool,
    pub drained: bool,
    /// Since when (Unix ms) it has been syncing without a break: it joined, came back, or the
    /// server started. Telemetry is not expected before this plus the staleness window.
    pub reporting_since_ms: i64,
}

/// A node's state from its agent's liveness and when its last telemetry batch arrived.
///
/// Telemetry counts as stopped when no batch arrived within `stale_after_ms` (and the node has
/// been reporting at least that long, so a node that has just joined or a server that has
/// just started does not call every node silent).
pub fn node_state(
    agent: Option<AgentLiveness>,
    last_sample_ms: Option<i64>,
    now_ms: i64,
    stale_after_ms: i64,
) -> NodeState {
    let fresh_since = |since: Option<i64>| since.is_some_and(|t| now_ms - t <= stale_after_ms);
    let Some(agent) = agent else {
        return if fresh_since(last_sample_ms) {
            NodeState::Up
        } else {
            NodeState::Down
        };
    };
    if agent.down {
        return NodeState::Down;
    }
    let newest = last_sample_ms.map_or(agent.reporting_since_ms, |t| {
        t.max(agent.reporting_since_ms)
    });
    if !fresh_since(Some(newest)) {
        NodeState::NoTelemetry
    } else if agent.drained {
        NodeState::Drained
    } else {
        NodeState::Up
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE: i64 = 60_000;
    const NOW: i64 = 1_000_000_000;

    fn agent(down: bool, drained: bool, since: i64) -> Option<AgentLiveness> {
        Some(AgentLiveness {
            down,
            drained,
            reporting_since_ms: since,
        })
    }

    #[test]
    fn an_agent_that_syncs_without_telemetry_is_not_up() {
        // `perch nodes` said up while perch_node_up said 0.
        let s = node_state(
            agent(false, false, NOW - 600_000),
            Some(NOW - 240_000),
            NOW,
            STALE,
        );
        assert_eq!(s, NodeState::NoTelemetry);
        assert!(!s.is_up());
        let never = node_state(agent(false, true, NOW - 600_000), None, NOW, STALE);
        assert_eq!(
            never,
            NodeState::NoTelemetry,
            "drained does not hide silence"
        );
    }

    #[test]
    fn a_node_just_joined_or_after_a_server_restart_gets_the_window() {
        let s = node_state(agent(false, false, NOW - 5_000), None, NOW, STALE);
        assert_eq!(s, NodeState::Up);
        let s = node_state(
            agent(false, false, NOW - 5_000),
            Some(NOW - 900_000),
            NOW,
            STALE,
        );
        assert_eq!(
            s,
            NodeState::Up,
            "samples from before the break are not held against it"
        );
    }

    #[test]
    fn down_wins_and_drained_shows_when_reporting() {
        assert_eq!(
            node_state(agent(true, true, 0), Some(NOW), NOW, STALE),
            NodeState::Down
        );
        let s = node_state(agent(false, true, 0), Some(NOW - 1_000), NOW, STALE);
        assert_eq!(s, NodeState::Drained);
        assert!(s.is_up());
    }

    #[test]
    fn a_telemetry_only_node_is_up_while_it_sends() {
        // A node without GPUs (no control plane entry) was `down` in one view and 1
        // in the other.
        assert_eq!(
            node_state(None, Some(NOW - 1_000), NOW, STALE),
            NodeState::Up
        );
        assert_eq!(
            node_state(None, Some(NOW - 61_000), NOW, STALE),
            NodeState::Down
        );
        assert_eq!(node_state(None, None, NOW, STALE), NodeState::Down);
    }
}
