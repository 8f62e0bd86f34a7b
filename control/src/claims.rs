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
pub struct NodeClaims {
    stale_ms: i64,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    claims: HashMap<String, Claim>,
    /// How many claims were left at the last sweep: the next comes when there are twice as
    /// many, so sweeping costs O(1) a claim.
    after_sweep: usize,
}

/// Claims kept at least, however stale (below this a sweep is not worth it).
const SWEEP_FROM: usize = 1_024;

struct Claim {
    agent: String,
    seen_ms: i64,
    addr: Option<String>,
}

impl NodeClaims {
    /// Claims lapse after `stale` without a word from their agent (the heartbeat timeout).
    pub fn new(stale: Duration) -> Self {
        NodeClaims {
            stale_ms: i64::try_from(stale.as_millis()).unwrap_or(i64::MAX),
            held: Mutex::default(),
        }
    }

    /// Takes or renews `node` for `agent` at `now`; refused while another agent's claim is
    /// fresh. `addr`: where the agent says it is, for the message another agent gets. An id
    /// is what agents make (8 to 64 hex digits): anything else is refused, so a request cannot
    /// park kilobytes per node here.
    pub fn claim(
        &self,
        node: &str,
        agent: &str,
        now: i64,
        addr: Option<&str>,
    ) -> Result<(), ControlError> {
        if !(8..=64).contains(&agent.len()) || !agent.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(ControlError::BadRequest(format!(
                "agent id {:?} is not 8 to 64 hex digits, as perch agents make them (in \
                 <data_dir>/jobs/<node>/agent-id)",
                agent.chars().take(80).collect::<String>()
            )));
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.claims.len() >= SWEEP_FROM.max(2 * held.after_sweep)
            && !held.claims.contains_key(node)
        {
            // One entry per node name ever reported would grow for ever (nodes renamed,
            // replaced, or made up by an agent token bound to no node). A lapsed claim keeps
            // no one out, so dropping it changes no answer.
            let stale_ms = self.stale_ms;
            held.claims
                .retain(|_, c| now.saturating_sub(c.seen_ms) < stale_ms);
            held.after_sweep = held.claims.len();
        }
        let fresh = Claim {
            agent: agent.to_owned(),
            seen_ms: now,
            addr: None,
        };
        let c = held.claims.entry(node.to_owned()).or_insert(fresh);
        let silent = now - c.seen_ms;
        if c.agent != agent {
            if silent < self.stale_ms {
                return Err(ControlError::NodeClaimed {
                    node: node.to_owned(),
                    other: c.addr.clone(),
                    silent_secs: silent.max(0) as f64 / 1000.0,
                    timeout_secs: self.stale_ms / 1000,
                });
            }
            // The old agent has been silent for the timeout: the node is this one's now.
            *c = Claim {
                agent: agent.to_owned(),
                seen_ms: now,
                addr: None,
            };
        }
        c.seen_ms = c.seen_ms.max(now);
        if let Some(a) = addr {
            c.addr = Some(a.to_owned());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_claim_keeps_another_agent_out_until_it_lapses() {
        let claims = NodeClaims::new(Duration::from_secs(60));
        let (a, b) = ("aaaaaaaa", "bbbbbbbb");
        claims.claim("n1", a, 0, Some("10.0.0.1")).expect("first");
        claims
            .claim("n1", a, 30_000, None)
            .expect("its own agent, again");
        let err = claims.claim("n1", b, 50_000, None).expect_err("refused");
        assert!(
            err.to_string()
                .contains("node n1 is served by another agent (at 10.0.0.1)"),
            "{err}"
        );
        claims.claim("n2", b, 50_000, None).expect("another node");
        // Silent for the timeout: the newcomer takes it, and the old agent is refused.
        claims.claim("n1", b, 90_000, None).expect("lapsed");
        let err = claims
            .claim("n1", a, 91_000, None)
            .expect_err("the old agent");
        assert!(matches!(err, ControlError::NodeClaimed { .. }), "{err}");
        // Only ids as agents make them: no kilobytes parked per node.
        let err = claims
            .claim("n3", &"x".repeat(4096), 0, None)
            .expect_err("not an id");
        assert!(matches!(err, ControlError::BadRequest(_)), "{err}");
        assert!(claims.claim("n3", "abc", 0, None).is_err());
    }

    /// Lapsed claims are swept whenever the registry has doubled since the last sweep: one
    /// entry per node name ever reported no longer grows for ever, and a fresh claim still
    /// keeps other agents out.
    #[test]
    fn lapsed_claims_are_swept_and_fresh_ones_kept() {
        let claims = NodeClaims::new(Duration::from_secs(60));
        let a = "aaaaaaaa";
        for i in 0..10_000 {
            claims
                .claim(&format!("made-up-{i}"), a, 0, None)
                .expect("claim");
        }
        for i in 0..7_000 {
            claims
                .claim(&format!("later-{i}"), a, 200_000, None)
                .expect("claim");
        }
        let held = claims.held.lock().expect("lock");
        assert!(
            held.claims.len() <= 7_000,
            "{} claims kept",
            held.claims.len()
        );
        assert!(!held.claims.contains_key("made-up-0"));
        assert!(held.claims.contains_key("later-6999"));
        drop(held);
        claims.claim("later-0", a, 210_000, None).expect("renew");
        let err = claims
            .claim("later-0", "bbbbbbbb", 220_000, None)
            .expect_err("fresh claim");
        assert!(matches!(err, ControlError::NodeClaimed { .. }), "{err}");
    }
}
