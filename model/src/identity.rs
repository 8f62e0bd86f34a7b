//! Who is calling and in which role: the tokens file maps a token to an [`Identity`]; the
//! server authorises routes by [`Role`] and the control plane acts on jobs by it.

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Operator,
    Agent,
}

impl Role {
    /// The name the tokens file and `GET /v1/whoami` use.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Operator => "operator",
            Role::Agent => "agent",
        }
    }
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub role: Role,
    /// For an agent token: the nodes it may report for and sync as (`nodes` in the tokens
    /// file); `None` lets it speak for any node.
    pub nodes: Option<Vec<String>>,
    /// For a job's metrics token: the job. It may only push that job's metrics.
    pub job: Option<u64>,
}

impl Identity {
    /// May send telemetry for, and sync as, node `node`: an agent bound to other nodes may
    /// not (one stolen node's token cannot forge another node's data or take its jobs).
    /// Refused: what to change, for a 403 `forbidden`.
    pub fn may_speak_for(&self, node: &str) -> Result<(), String> {
        match &self.nodes {
            Some(nodes) if !nodes.iter().any(|n| n == node) => Err(format!(
                "this token ({}) is bound to node(s) {}; it may not report as {node}: give this node its own token, or add it to the token's `nodes` in the tokens file",
                self.user,
                nodes.join(", ")
            )),
            _ => Ok(()),
        }
    }

    /// May act on a job that belongs to `owner`.
    pub fn may_act_on(&self, owner: &str) -> bool {
        self.role == Role::Operator || self.user == owner
    }
}
