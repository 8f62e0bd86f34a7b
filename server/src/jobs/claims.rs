//! Which agent speaks for each node: the id an agent sends with its syncs
//! (`SyncRequest::agent_id`) and its telemetry (the `x-perch-agent` header), the same across
//! its restarts (`collector/src/agent_claim.rs`). While one agent keeps a node's claim fresh, a
//! sync or a batch from another under the same name is refused (409 `node_claimed`): its syncs
//! would report the node's jobs gone and have them killed, and one batch of its, numbered from
//! its own later start, made every batch of the node's own agent look like a duplicate and be
//! dropped. Readable without the control lock, as ingest needs it on every batch.

use super::control::ControlError;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// The claims, and how long one lasts without a sync or a batch.
pub(crate) struct NodeClaims {
    stale_ms: i64,
    held: Mutex<HashMap<String, Claim>>,
}

struct Claim {
    agent: String,
    seen_ms: i64,
    addr: Option<String>,
}

impl NodeClaims {
    /// Claims lapse after `stale` without a word from their agent (the heartbeat timeout).
    pub(crate) fn new(stale: Duration) -> Self {
        NodeClaims {
            stale_ms: i64::try_from(stale.as_millis()).unwrap_or(i64::MAX),
            held: Mutex::default(),
        }
    }

    /// Takes or renews `node` for `agent` at `now`; refused while another agent's claim is
    /// fresh. `addr`: where the agent says it is, for the message another agent gets.
    pub(crate) fn claim(
        &self,
        node: &str,
        agent: &str,
        now: i64,
        addr: Option<&str>,
    ) -> Result<(), ControlError> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = held.get_mut(node) {
            let silent = now - c.seen_ms;
            if c.agent != agent && silent < self.stale_ms {
                return Err(ControlError::NodeClaimed {
                    node: node.to_owned(),
                    other: c.addr.clone(),
                    silent_secs: silent.max(0) as f64 / 1000.0,
                    timeout_secs: self.stale_ms / 1000,
                });
            }
            c.seen_ms = c.seen_ms.max(now);
            if c.agent != agent {
                c.agent = agent.to_owned();
                c.seen_ms = now;
                c.addr = None;
            }
            if let Some(a) = addr {
                c.addr = Some(a.to_owned());
            }
            return Ok(());
        }
        held.insert(
            node.to_owned(),
            Claim {
                agent: agent.to_owned(),
                seen_ms: now,
                addr: addr.map(str::to_owned),
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_claim_keeps_another_agent_out_until_it_lapses() {
        let claims = NodeClaims::new(Duration::from_secs(60));
        claims.claim("n1", "a", 0, Some("10.0.0.1")).expect("first");
        claims
            .claim("n1", "a", 30_000, None)
            .expect("its own agent, again");
        let err = claims.claim("n1", "b", 50_000, None).expect_err("refused");
        assert!(
            err.to_string()
                .contains("node n1 is served by another agent (at 10.0.0.1)"),
            "{err}"
        );
        claims.claim("n2", "b", 50_000, None).expect("another node");
        // Silent for the timeout: the newcomer takes it, and the old agent is refused.
        claims.claim("n1", "b", 90_000, None).expect("lapsed");
        assert!(claims.claim("n1", "a", 91_000, None).is_err());
    }
}
