//! Which agent serves a node: an id the agent keeps beside the node's jobs
//! (`<data_dir>/jobs/<node>/agent-id`), the same across its restarts, sent with every sync; and
//! a lock on that directory, so two agents on one machine cannot serve the same node from it.
//!
//! Two agents that claim one node name (a second `perch agent` started by mistake, a machine
//! cloned with the same hostname, two data directories) would each report what runs on the
//! node: the one that runs nothing made the server take the other's jobs for lost and kill
//! them. The lock stops the first case here; the id lets the server refuse the others while
//! the node's own agent syncs (`SyncRequest::agent_id`).

use crate::CollectorError;
use std::fs::{self, File};
use std::path::Path;

/// The id and the lock, held while the agent runs its node's jobs.
#[derive(Debug)]
pub struct AgentClaim {
    pub id: String,
    _lock: File,
}

/// Locks `dir` (the node's jobs directory) and reads the agent's id there, making one on the
/// first start. Fails when another agent holds the lock, naming what to change.
pub fn claim(dir: &Path, node: &str) -> Result<AgentClaim, CollectorError> {
    fs::create_dir_all(dir).map_err(|e| CollectorError::io(dir, e))?;
    let lock_path = dir.join("agent.lock");
    let lock = File::create(&lock_path).map_err(|e| CollectorError::io(&lock_path, e))?;
    if lock.try_lock().is_err() {
        return Err(CollectorError::Config(format!(
            "another perch agent runs node {node}'s jobs from this data directory ({} is \
             locked); stop it, or give this agent its own agent.data_dir and agent.node",
            lock_path.display()
        )));
    }
    let path = dir.join("agent-id");
    let id = match fs::read_to_string(&path) {
        Ok(text) if valid(text.trim()) => text.trim().to_owned(),
        _ => {
            let mut bytes = [0u8; 16];
            getrandom::fill(&mut bytes)
                .map_err(|e| CollectorError::io(&path, std::io::Error::other(e.to_string())))?;
            let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            let tmp = dir.join("agent-id.tmp");
            fs::write(&tmp, format!("{id}\n")).map_err(|e| CollectorError::io(&tmp, e))?;
            fs::rename(&tmp, &path).map_err(|e| CollectorError::io(&path, e))?;
            id
        }
    };
    Ok(AgentClaim { id, _lock: lock })
}

fn valid(id: &str) -> bool {
    (8..=64).contains(&id.len()) && id.chars().all(|c| c.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_survives_a_restart_and_the_lock_keeps_a_second_agent_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = claim(dir.path(), "n1").expect("claimed");
        assert_eq!(first.id.len(), 32);
        let err = claim(dir.path(), "n1").expect_err("locked").to_string();
        assert!(
            err.contains("another perch agent runs node n1's jobs"),
            "{err}"
        );
        let id = first.id.clone();
        drop(first);
        let again = claim(dir.path(), "n1").expect("claimed after the first stopped");
        assert_eq!(again.id, id, "the same agent after a restart");
        let other = tempfile::tempdir().expect("tempdir");
        assert_ne!(claim(other.path(), "n1").expect("claimed").id, id);
    }
}
