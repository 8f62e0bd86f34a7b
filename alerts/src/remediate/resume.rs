//! Giving back what perch took: a node perch drained is health-checked once no alert with
//! actions has named it for `resume_after`, and resumed when the check passes. Nodes an
//! operator drained are never touched.

use super::{Action, Decision, Health, NodeState, NodeView, Outcome, Plan, Planner};
use std::collections::BTreeMap;

impl Planner {
    /// Health checks and resumes of nodes perch drained.
    pub(super) fn plan_resumes(
        &mut self,
        nodes: &BTreeMap<&str, &NodeView>,
        now_ms: i64,
        plan: &mut Plan,
    ) {
        if self.state.breaker.is_some() || self.config.health_check.is_empty() {
            return;
        }
        let timeout_ms = self.config.action_timeout.as_ms();
        let candidates: Vec<String> = self
            .state
            .drained
            .iter()
            .filter(|(node, r)| {
                !r.dry_run
                    && nodes
                        .get(node.as_str())
                        .is_some_and(|n| n.state == NodeState::Drained)
                    && {
                        let quiet_since = self
                            .state
                            .last_alert_ms
                            .get(node.as_str())
                            .copied()
                            .unwrap_or(r.at_ms)
                            .max(r.at_ms);
                        now_ms.saturating_sub(quiet_since) >= self.config.resume_after.as_ms()
                    }
            })
            .map(|(node, _)| node.clone())
            .collect();
        for node in candidates {
            let action = match self.state.health.get(&node) {
                None => Some(Action::HealthCheck {
                    node: node.clone(),
                    argv: self.config.health_check.clone(),
                    timeout_ms,
                }),
                Some(Health::Failed { at_ms })
                    if now_ms.saturating_sub(*at_ms) >= self.config.cooldown.as_ms() =>
                {
                    Some(Action::HealthCheck {
                        node: node.clone(),
                        argv: self.config.health_check.clone(),
                        timeout_ms,
                    })
                }
                Some(Health::Running { at_ms })
                    if now_ms.saturating_sub(*at_ms) > timeout_ms.saturating_mul(2) =>
                {
                    // The result never came (server restart, lost agent): try again.
                    Some(Action::HealthCheck {
                        node: node.clone(),
                        argv: self.config.health_check.clone(),
                        timeout_ms,
                    })
                }
                Some(Health::Passed) => Some(Action::ResumeNode { node: node.clone() }),
                Some(_) => None,
            };
            let Some(action) = action else { continue };
            if let Action::HealthCheck { .. } = action {
                self.state
                    .health
                    .insert(node.clone(), Health::Running { at_ms: now_ms });
            }
            let rule = self.state.drained.get(&node).and_then(|r| r.rule.clone());
            plan.decisions.push(Decision {
                action,
                outcome: Outcome::Execute,
                alert: None,
                episode: None,
                rule,
                at_ms: now_ms,
                event: None,
            });
        }
    }
}
