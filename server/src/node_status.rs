//! Every node's state, from the control plane's view of its agent and the time its last
//! telemetry batch arrived, through the one definition in [`perch_model::node_state`].
//! `GET /v1/nodes` (so `perch nodes`), `/metrics` (`perch_node_up`, `perch_node_state`) and
//! the alert engine all read it from here.

use crate::AppState;
use perch_control::NodeView;
use perch_model::{NodeState, node_state};
use std::collections::BTreeMap;

/// One node's state and what it was decided from.
#[derive(Debug, Clone)]
pub struct NodeStatus {
    pub state: NodeState,
    /// When its last telemetry batch arrived (server clock, Unix ms), if one did since the
    /// server started.
    pub last_sample_ms: Option<i64>,
    /// The control plane's view, for a node whose agent syncs (nodes with GPUs); `None` for a
    /// node that only sends telemetry.
    pub view: Option<NodeView>,
}

/// Every node either side knows, by name.
pub fn statuses(
    views: Vec<NodeView>,
    last_samples: &BTreeMap<String, i64>,
    now_ms: i64,
    stale_after_ms: i64,
) -> BTreeMap<String, NodeStatus> {
    let mut out: BTreeMap<String, NodeStatus> = views
        .into_iter()
        .map(|v| {
            let last_sample_ms = last_samples.get(&v.name).copied();
            let state = node_state(Some(v.liveness), last_sample_ms, now_ms, stale_after_ms);
            let name = v.name.clone();
            let status = NodeStatus {
                state,
                last_sample_ms,
                view: Some(v),
            };
            (name, status)
        })
        .collect();
    for (name, &last) in last_samples {
        out.entry(name.clone()).or_insert_with(|| NodeStatus {
            state: node_state(None, Some(last), now_ms, stale_after_ms),
            last_sample_ms: Some(last),
            view: None,
        });
    }
    out
}

/// The statuses of the running server, now.
pub fn current(state: &AppState, now_ms: i64) -> BTreeMap<String, NodeStatus> {
    statuses(
        state.jobs.node_views(),
        &state.latest.last_seen(),
        now_ms,
        stale_after_ms(state),
    )
}

pub fn stale_after_ms(state: &AppState) -> i64 {
    i64::try_from(state.config.node_stale_after.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_model::AgentLiveness;

    fn view(name: &str, down: bool) -> NodeView {
        NodeView {
            name: name.into(),
            liveness: AgentLiveness {
                down,
                drained: false,
                reporting_since_ms: 0,
            },
            gpus: 8,
            allocated: 0,
            running_jobs: 0,
            last_sync_ms: 0,
        }
    }

    #[test]
    fn both_sides_nodes_appear_once_with_one_state() {
        let now = 10_000_000;
        let last = BTreeMap::from([
            ("a".to_owned(), now - 1_000),
            ("b".to_owned(), now - 600_000),
            ("cpu-only".to_owned(), now - 2_000),
        ]);
        let s = statuses(
            vec![view("a", false), view("b", false), view("c", true)],
            &last,
            now,
            60_000,
        );
        let states: Vec<(&str, NodeState)> = s.iter().map(|(k, v)| (k.as_str(), v.state)).collect();
        assert_eq!(
            states,
            vec![
                ("a", NodeState::Up),
                ("b", NodeState::NoTelemetry),
                ("c", NodeState::Down),
                ("cpu-only", NodeState::Up),
            ]
        );
        assert!(s["cpu-only"].view.is_none());
    }
}
