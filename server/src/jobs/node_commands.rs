//! Commands the alert engine runs on a node through its agent (a GPU reset script, a health
//! check). PLACEHOLDER until the agent protocol carries them.

use std::time::Duration;

/// Runs `argv` on `node` through its agent, waiting at most `timeout`.
pub async fn run_on_node(
    _jobs: &super::JobService,
    node: &str,
    argv: Vec<String>,
    _timeout: Duration,
) -> Result<String, String> {
    Err(format!(
        "running {argv:?} on {node} through its agent is not wired yet"
    ))
}
