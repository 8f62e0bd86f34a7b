//! Commands the alert engine runs on a node through its agent (a GPU reset script, the health
//! check before resuming a node perch drained). A command waits in the node's outbox until
//! its agent syncs (twice a second), runs there in its own process group with a timeout, and
//! its result comes back with a later sync. Nothing here is persisted: a server restart
//! abandons commands in flight, and their callers see an error saying so.

use perch_model::control::{CommandResult, NodeCommand};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;

/// The outboxes and the callers waiting for results.
#[derive(Debug, Default)]
pub struct NodeCommands {
    next_id: AtomicU64,
    outbox: Mutex<HashMap<String, Vec<NodeCommand>>>,
    waiting: Mutex<HashMap<u64, oneshot::Sender<CommandResult>>>,
}

/// Time for the agent's two syncs (the command's order, then its result) past the command's
/// own timeout before the caller gives up on an answer.
pub const ANSWER_SLACK: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NodeCommands {
    /// The commands for `node`'s agent, handed over once.
    pub fn take(&self, node: &str) -> Vec<NodeCommand> {
        lock(&self.outbox).remove(node).unwrap_or_default()
    }

    /// Results an agent reported; results nobody waits for any more are dropped.
    pub fn deliver(&self, results: Vec<CommandResult>) {
        let mut waiting = lock(&self.waiting);
        for r in results {
            if let Some(tx) = waiting.remove(&r.id) {
                let _ = tx.send(r);
            }
        }
    }

    /// Runs `argv` on `node` through its agent, waiting for the command's own `timeout` plus
    /// time for two syncs, and returns how it ended; an error when no answer came.
    pub async fn run_raw(
        &self,
        node: &str,
        argv: Vec<String>,
        timeout: Duration,
    ) -> Result<CommandResult, String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(id, tx);
        let shown = argv.join(" ");
        lock(&self.outbox)
            .entry(node.to_owned())
            .or_default()
            .push(NodeCommand {
                id,
                argv,
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            });
        let answer = tokio::time::timeout(timeout + ANSWER_SLACK, rx).await;
        lock(&self.waiting).remove(&id);
        if let Some(queued) = lock(&self.outbox).get_mut(node) {
            queued.retain(|c| c.id != id);
        }
        match answer {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) | Err(_) => Err(format!(
                "`{shown}` on {node}: no answer from its agent within {} s (is the node up?)",
                (timeout + ANSWER_SLACK).as_secs()
            )),
        }
    }

    /// Runs `argv` on `node` through its agent ([`NodeCommands::run_raw`]). Ok with a
    /// one-line outcome when it exits 0.
    pub async fn run(
        &self,
        node: &str,
        argv: Vec<String>,
        timeout: Duration,
    ) -> Result<String, String> {
        let shown = argv.join(" ");
        let r = self.run_raw(node, argv, timeout).await?;
        let output = r.output.trim();
        let last = output.lines().last().unwrap_or("");
        match (r.exit_code, r.timed_out, r.error) {
            (_, _, Some(e)) => Err(format!("`{shown}` on {node}: {e}")),
            (_, true, _) => Err(format!(
                "`{shown}` on {node} timed out after {} s and was killed",
                timeout.as_secs()
            )),
            (Some(0), _, _) => Ok(format!(
                "`{shown}` on {node} exited 0{}",
                if last.is_empty() {
                    String::new()
                } else {
                    format!(": {last}")
                }
            )),
            (Some(code), _, _) => Err(format!("`{shown}` on {node} exited {code}: {last}")),
            (None, _, _) => Err(format!(
                "`{shown}` on {node} was killed by a signal: {last}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_command_waits_for_its_node_and_its_result() {
        let commands = std::sync::Arc::new(NodeCommands::default());
        let c = commands.clone();
        let run = tokio::spawn(async move {
            c.run(
                "gpu-3",
                vec!["gpu-reset".into(), "0".into()],
                Duration::from_secs(5),
            )
            .await
        });
        let sent = loop {
            let sent = commands.take("gpu-3");
            if !sent.is_empty() {
                break sent;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert!(commands.take("gpu-3").is_empty(), "handed over once");
        assert_eq!(sent[0].argv, ["gpu-reset", "0"]);
        commands.deliver(vec![CommandResult {
            id: sent[0].id,
            exit_code: Some(0),
            timed_out: false,
            output: "GPU 0 reset\n".into(),
            error: None,
        }]);
        let outcome = run.await.expect("task");
        assert_eq!(
            outcome,
            Ok("`gpu-reset 0` on gpu-3 exited 0: GPU 0 reset".into())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_answer_is_an_error_that_says_so() {
        let commands = NodeCommands::default();
        let err = commands
            .run("gone", vec!["true".into()], Duration::from_secs(1))
            .await
            .expect_err("nobody answers");
        assert!(err.contains("no answer from its agent"), "{err}");
        assert!(commands.take("gone").is_empty(), "withdrawn");
    }
}
