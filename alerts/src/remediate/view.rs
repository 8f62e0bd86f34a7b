//! The server's view of the cluster that the planner judges against, and the arithmetic of
//! the share of nodes that may be out.

use serde::{Deserialize, Serialize};

/// A node's state as the server's control plane sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// In service.
    Up,
    /// Takes no new jobs (by perch or an operator).
    Drained,
    /// Not heard from.
    Down,
}

/// One node of the [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    /// Its name.
    pub node: String,
    /// Its state.
    pub state: NodeState,
    /// Jobs still running on it (a drain is in progress while this is above 0).
    pub running_jobs: usize,
}

/// The cluster as the server sees it now: every node it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterView {
    /// All nodes.
    pub nodes: Vec<NodeView>,
}

/// How many nodes may be out: the floor of `fraction` of `total`.
pub fn allowed_out(fraction: f64, total: usize) -> usize {
    // The epsilon keeps 0.2 * 10 at 2 despite binary floating point.
    ((fraction * total as f64) + 1e-9).floor().max(0.0) as usize
}
