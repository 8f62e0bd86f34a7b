//! The remediation planner: which of the actions firing alerts ask for may run now, under
//! guardrails, as a pure function of (alerts, cluster view, state, now).
//!
//! Guardrails, after what NVSentinel, draino and MachineHealthCheck do in the field:
//! - **dry run**: every decision is made and audited, nothing is executed;
//! - **max_concurrent_drains**: drains perch started whose node still runs jobs;
//! - **circuit breaker**: a drain that would put more than `max_fraction_out` of the nodes
//!   out (drained or down), or make perch's drains within `breaker_window` exceed that share,
//!   opens the breaker. While open, no automatic action runs at all, until an operator resets
//!   it ([`Planner::reset_breaker`]); opening it is audited and raises the
//!   `RemediationCircuitOpen` alert, so it is notified once like any alert;
//! - **cooldown**: the same action on the same node (drain, requeue, the same GPU or command)
//!   is not repeated by another alert within `cooldown`; if its effect still holds (the node
//!   is still out) it is skipped, otherwise refused until the cooldown ends;
//! - **resume only what perch drained**, only once no alert with actions has fired for the
//!   node for `resume_after`, and only after the configured health check passed.
//!
//! Every decision yields an audit record for the `events` table (an executed action's record
//! comes with its result, through [`Planner::complete`]).

mod action;
mod resume;
mod view;

pub use action::{Action, Decision, Outcome, RefuseReason};
pub use view::{ClusterView, NodeState, NodeView, allowed_out};

use crate::alert::Alert;
use crate::config::RemediationConfig;
use crate::rules::ActionSpec;
use crate::template::{TemplateContext, render};
use perch_model::ClusterEvent;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Why and when the circuit breaker opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakerTrip {
    /// When.
    pub opened_at_ms: i64,
    /// A sentence: which drain would have exceeded which limit.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct DrainRecord {
    at_ms: i64,
    rule: Option<String>,
    dry_run: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Health {
    Running { at_ms: i64 },
    Passed,
    Failed { at_ms: i64 },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Done {
    at_ms: i64,
    episode: String,
}

/// The planner's persisted state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlannerState {
    breaker: Option<BreakerTrip>,
    /// Nodes perch drained (or, in dry run, would have), by node.
    drained: BTreeMap<String, DrainRecord>,
    /// When perch drained nodes, within the breaker window.
    drain_times: Vec<i64>,
    /// Per node, per action identity: when perch last did it and for which alert episode.
    done: BTreeMap<String, BTreeMap<String, Done>>,
    /// Per `episode/action spec`: the last outcome, and whether it is final.
    decided: BTreeMap<String, (String, bool)>,
    /// Health checks of nodes perch drained.
    health: BTreeMap<String, Health>,
    /// Per node: the last time a firing alert with actions named it.
    last_alert_ms: BTreeMap<String, i64>,
}

/// The guardrails and their state.
#[derive(Debug, Clone)]
pub struct Planner {
    config: RemediationConfig,
    dry_run: bool,
    state: PlannerState,
}

impl Planner {
    /// A planner for a validated config.
    pub fn new(config: RemediationConfig, dry_run: bool) -> Self {
        Self {
            config,
            dry_run,
            state: PlannerState::default(),
        }
    }

    /// Restores persisted state.
    pub fn with_state(mut self, state: PlannerState) -> Self {
        self.state = state;
        self
    }

    /// The state to persist.
    pub fn state(&self) -> &PlannerState {
        &self.state
    }

    /// The open breaker, if it is open.
    pub fn breaker(&self) -> Option<&BreakerTrip> {
        self.state.breaker.as_ref()
    }

    /// Nodes perch drained and has not resumed (in dry run: would have drained).
    pub fn drained_by_perch(&self) -> Vec<&str> {
        self.state.drained.keys().map(String::as_str).collect()
    }

    /// Closes the breaker (an operator's decision) and forgets the drains of the breaker
    /// window, so the next drain is judged on the nodes out now; actions it held are judged
    /// again at the next [`Planner::plan`]. Returns the audit record,
    /// or `None` when the breaker was not open.
    pub fn reset_breaker(&mut self, by: &str, now_ms: i64) -> Option<ClusterEvent> {
        let trip = self.state.breaker.take()?;
        self.state.drain_times.clear();
        // Held actions are judged (and audited) afresh.
        self.state.decided.retain(|_, (_, fin)| *fin);
        let mut event = ClusterEvent::new(
            now_ms,
            "circuit_breaker_reset",
            by,
            format!(
                "{by} reset the remediation circuit breaker (open since {}: {})",
                crate::timefmt::utc(trip.opened_at_ms),
                trip.reason
            ),
        );
        event.outcome = Some("done".into());
        Some(event)
    }

    /// Decides, for every firing alert's requested actions and for the nodes perch drained,
    /// what may run now. `alerts` may contain any alerts; only firing ones with actions count.
    /// Returns the decisions and, when the breaker opened during this call, its audit record.
    pub fn plan(&mut self, alerts: &[&Alert], view: &ClusterView, now_ms: i64) -> Plan {
        let mut plan = Plan::default();
        if !self.config.enabled {
            return plan;
        }
        let nodes: BTreeMap<&str, &NodeView> =
            view.nodes.iter().map(|n| (n.node.as_str(), n)).collect();
        let mut firing: Vec<&Alert> = alerts
            .iter()
            .copied()
            .filter(|a| a.state == crate::AlertState::Firing && !a.actions.is_empty())
            .collect();
        firing.sort_by(|a, b| (a.fired_at_ms, &a.key).cmp(&(b.fired_at_ms, &b.key)));
        self.forget(&firing, &nodes, now_ms);

        let mut round = Round {
            out: view
                .nodes
                .iter()
                .filter(|n| n.state != NodeState::Up)
                .map(|n| n.node.clone())
                .collect(),
            in_progress: 0,
            total: view.nodes.len(),
        };
        if self.dry_run {
            round
                .out
                .extend(self.state.drained.keys().map(String::clone));
        } else {
            round.in_progress = self
                .state
                .drained
                .iter()
                .filter(|(node, r)| {
                    !r.dry_run
                        && nodes
                            .get(node.as_str())
                            .is_some_and(|n| n.state == NodeState::Drained && n.running_jobs > 0)
                })
                .count();
        }

        for alert in &firing {
            // A requeue waits for its alert's drain: requeued jobs must not land on the
            // node they are leaving.
            let mut drain_held: Option<RefuseReason> = None;
            for spec in &alert.actions {
                let key = format!("{}/{spec}", alert.episode());
                if self.state.decided.get(&key).is_some_and(|(_, fin)| *fin) {
                    continue;
                }
                let ctx = DecideCtx {
                    nodes: &nodes,
                    drain_held: drain_held.as_ref(),
                    now_ms,
                };
                let decision = self.decide(alert, spec, &ctx, &mut round, &mut plan);
                if let Outcome::Refused(reason) = &decision.outcome
                    && matches!(decision.action, Action::DrainNode { .. })
                    && !reason.is_final()
                {
                    drain_held = Some(reason.clone());
                }
                let (code, fin) = outcome_code(&decision.outcome);
                let unchanged = self
                    .state
                    .decided
                    .get(&key)
                    .is_some_and(|(prev, _)| *prev == code);
                self.state.decided.insert(key, (code, fin));
                let decision = if unchanged {
                    // The same refusal as last round: already audited and annotated.
                    continue;
                } else {
                    self.with_audit(decision)
                };
                plan.decisions.push(decision);
            }
        }
        self.plan_resumes(&nodes, now_ms, &mut plan);
        plan
    }

    /// Forgets what no longer applies: decisions of episodes that stopped firing, drains
    /// an operator undid, dry-run drains of nodes no alert names any more.
    fn forget(&mut self, firing: &[&Alert], nodes: &BTreeMap<&str, &NodeView>, now_ms: i64) {
        let episodes: BTreeSet<String> = firing.iter().map(|a| a.episode()).collect();
        self.state
            .decided
            .retain(|key, _| key.split('/').next().is_some_and(|e| episodes.contains(e)));
        for alert in firing {
            if let Some(node) = alert.node() {
                self.state.last_alert_ms.insert(node.to_owned(), now_ms);
                self.state.health.remove(node);
            }
        }
        self.state
            .last_alert_ms
            .retain(|node, _| nodes.contains_key(node.as_str()));
        let named: BTreeSet<&str> = firing.iter().filter_map(|a| a.node()).collect();
        let dry_run = self.dry_run;
        let mut undone = Vec::new();
        self.state.drained.retain(|node, r| {
            let keep = if r.dry_run {
                dry_run && named.contains(node.as_str())
            } else {
                // Up again means an operator resumed it: it is no longer perch's to resume.
                nodes
                    .get(node.as_str())
                    .is_some_and(|n| n.state != NodeState::Up)
            };
            if !keep {
                undone.push(node.clone());
            }
            keep
        });
        for node in undone {
            self.state.health.remove(&node);
        }
        let window = self.config.breaker_window.as_ms();
        self.state
            .drain_times
            .retain(|t| now_ms.saturating_sub(*t) < window);
        let cooldown = self.config.cooldown.as_ms();
        for done in self.state.done.values_mut() {
            done.retain(|_, d| now_ms.saturating_sub(d.at_ms) < cooldown);
        }
        self.state.done.retain(|_, d| !d.is_empty());
    }

    fn decide(
        &mut self,
        alert: &Alert,
        spec: &ActionSpec,
        ctx: &DecideCtx<'_>,
        round: &mut Round,
        plan: &mut Plan,
    ) -> Decision {
        let now_ms = ctx.now_ms;
        let node_label = alert.node().unwrap_or_default().to_owned();
        let (action, outcome) = match self.action_for(alert, spec) {
            Err(reason) => (placeholder(spec, node_label), Outcome::Refused(reason)),
            Ok(action @ Action::RequeueJobs { .. }) if ctx.drain_held.is_some() => {
                let reason = ctx.drain_held.cloned().unwrap_or(RefuseReason::CircuitOpen);
                (action, Outcome::Refused(reason))
            }
            Ok(action) => {
                let outcome = self.judge(&action, alert, ctx.nodes, round, plan, now_ms);
                (action, outcome)
            }
        };
        if matches!(outcome, Outcome::Execute | Outcome::DryRun) {
            self.state
                .done
                .entry(action.node().to_owned())
                .or_default()
                .insert(
                    action.identity(),
                    Done {
                        at_ms: now_ms,
                        episode: alert.episode(),
                    },
                );
        }
        Decision {
            action,
            outcome,
            alert: Some(alert.key.clone()),
            episode: Some(alert.episode()),
            rule: Some(alert.rule.clone()),
            at_ms: now_ms,
            event: None,
        }
    }

    /// Turns a rule's action spec into a concrete action for this alert.
    fn action_for(&self, alert: &Alert, spec: &ActionSpec) -> Result<Action, RefuseReason> {
        let missing = |label: &str| RefuseReason::MissingLabel {
            label: label.to_owned(),
        };
        let node = alert.node().ok_or_else(|| missing("node"))?.to_owned();
        Ok(match spec {
            ActionSpec::DrainNode => Action::DrainNode { node },
            ActionSpec::RequeueJobs => Action::RequeueJobs { node },
            ActionSpec::GpuOut => Action::GpuOut {
                node,
                gpu: alert
                    .labels
                    .get("gpu")
                    .and_then(|g| g.parse().ok())
                    .ok_or_else(|| missing("gpu"))?,
            },
            ActionSpec::RunCommand(name) => {
                let cmd =
                    self.config
                        .commands
                        .get(name)
                        .ok_or_else(|| RefuseReason::UnknownCommand {
                            command: name.clone(),
                        })?;
                let ctx = TemplateContext {
                    rule: &alert.rule,
                    severity: alert.severity.as_str(),
                    labels: &alert.labels,
                    values: &alert.values,
                };
                Action::RunCommand {
                    node,
                    command: name.clone(),
                    argv: cmd.argv.iter().map(|a| render(a, &ctx)).collect(),
                    timeout_ms: cmd.timeout.unwrap_or(self.config.action_timeout).as_ms(),
                }
            }
        })
    }

    fn judge(
        &mut self,
        action: &Action,
        alert: &Alert,
        nodes: &BTreeMap<&str, &NodeView>,
        round: &mut Round,
        plan: &mut Plan,
        now_ms: i64,
    ) -> Outcome {
        if self.state.breaker.is_some() {
            return Outcome::Refused(RefuseReason::CircuitOpen);
        }
        let node = action.node();
        if !nodes.contains_key(node) {
            return Outcome::Refused(RefuseReason::UnknownNode);
        }
        let node_out = round.out.contains(node);
        if let Action::DrainNode { .. } = action
            && node_out
        {
            return Outcome::Skipped {
                why: format!("{node} is already out of service"),
            };
        }
        let recent = self
            .state
            .done
            .get(node)
            .and_then(|d| d.get(&action.identity()))
            .filter(|d| d.episode != alert.episode());
        if let Some(done) = recent {
            let holds = match action {
                Action::RequeueJobs { .. } => node_out,
                Action::GpuOut { .. } => true,
                _ => false,
            };
            return if holds {
                Outcome::Skipped {
                    why: format!(
                        "already done at {} for another alert",
                        crate::timefmt::utc(done.at_ms)
                    ),
                }
            } else {
                Outcome::Refused(RefuseReason::Cooldown {
                    until_ms: done.at_ms.saturating_add(self.config.cooldown.as_ms()),
                })
            };
        }
        if let Action::DrainNode { .. } = action {
            let allowed = allowed_out(self.config.max_fraction_out, round.total);
            let would_be_out = round.out.len() + 1;
            let window_drains = self.state.drain_times.len() + 1;
            if would_be_out > allowed || window_drains > allowed {
                let reason = if would_be_out > allowed {
                    format!(
                        "draining {node} for {} would put {would_be_out} of {} nodes out; max_fraction_out {} allows {allowed}",
                        alert.rule, round.total, self.config.max_fraction_out
                    )
                } else {
                    format!(
                        "draining {node} for {} would make {window_drains} drains within {}; max_fraction_out {} of {} nodes allows {allowed}",
                        alert.rule,
                        self.config.breaker_window,
                        self.config.max_fraction_out,
                        round.total
                    )
                };
                plan.breaker_opened = Some(self.open_breaker(reason, now_ms));
                return Outcome::Refused(RefuseReason::CircuitOpen);
            }
            if round.in_progress >= self.config.max_concurrent_drains {
                return Outcome::Refused(RefuseReason::MaxConcurrentDrains {
                    limit: self.config.max_concurrent_drains,
                });
            }
            round.out.insert(node.to_owned());
            round.in_progress += 1;
            self.state.drain_times.push(now_ms);
            self.state.drained.insert(
                node.to_owned(),
                DrainRecord {
                    at_ms: now_ms,
                    rule: Some(alert.rule.clone()),
                    dry_run: self.dry_run,
                },
            );
        }
        if self.dry_run {
            Outcome::DryRun
        } else {
            Outcome::Execute
        }
    }

    fn open_breaker(&mut self, reason: String, now_ms: i64) -> ClusterEvent {
        let mut event = ClusterEvent::new(
            now_ms,
            "circuit_breaker_open",
            "perch",
            format!(
                "perch stopped all automatic remediation: {reason}. Reset the breaker once the cluster is understood."
            ),
        );
        event.outcome = Some("open".into());
        event.dry_run = self.dry_run;
        self.state.breaker = Some(BreakerTrip {
            opened_at_ms: now_ms,
            reason,
        });
        event
    }

    /// Fills in the audit record of a decision that is not executed.
    fn with_audit(&self, mut decision: Decision) -> Decision {
        let dry = matches!(decision.outcome, Outcome::DryRun);
        let (outcome, message) = match &decision.outcome {
            Outcome::Execute => return decision,
            Outcome::DryRun => (
                "dry_run".to_owned(),
                format!("Dry run: would {}.", decision.action.describe()),
            ),
            Outcome::Refused(reason) => (
                format!("refused: {reason}"),
                format!("Did not {}: {reason}.", decision.action.describe()),
            ),
            Outcome::Skipped { why } => (
                format!("skipped: {why}"),
                format!("Did not {}: {why}.", decision.action.describe()),
            ),
        };
        decision.event = Some(decision.audit(outcome, message, dry));
        decision
    }

    /// Records the result of an executed decision and returns its audit record.
    /// `result` is `Ok(detail)` (detail may be empty) or `Err(what failed)`.
    pub fn complete(
        &mut self,
        decision: &Decision,
        result: &Result<String, String>,
        now_ms: i64,
    ) -> ClusterEvent {
        let node = decision.action.node().to_owned();
        match (&decision.action, result) {
            (Action::HealthCheck { .. }, Ok(_)) => {
                self.state.health.insert(node.clone(), Health::Passed);
            }
            (Action::HealthCheck { .. }, Err(_)) => {
                self.state
                    .health
                    .insert(node.clone(), Health::Failed { at_ms: now_ms });
            }
            (Action::ResumeNode { .. }, Ok(_)) => {
                self.state.drained.remove(&node);
                self.state.health.remove(&node);
                if let Some(done) = self.state.done.get_mut(&node) {
                    // The requeue and GPU-out effects ended with the resume; the drain
                    // identity stays, so the cooldown still guards against a flapping node.
                    done.retain(|identity, _| identity == "drain_node");
                }
            }
            (Action::DrainNode { .. }, Err(_)) => {
                self.state.drained.remove(&node);
            }
            _ => {}
        }
        let (outcome, message) = match result {
            Ok(detail) if detail.trim().is_empty() => ("done".to_owned(), decision.action.done()),
            Ok(detail) => (
                "done".to_owned(),
                format!("{} {}", decision.action.done(), detail.trim()),
            ),
            Err(e) => (
                format!("failed: {e}"),
                format!("Failed to {}: {e}.", decision.action.describe()),
            ),
        };
        let mut event = decision.audit(outcome, message, false);
        event.time_ms = now_ms;
        event
    }
}

/// What one planning round decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Decisions, in order; carry out the `Execute` ones in this order.
    pub decisions: Vec<Decision>,
    /// The breaker's audit record, when it opened in this round.
    pub breaker_opened: Option<ClusterEvent>,
}

/// What `decide` reads besides the alert.
struct DecideCtx<'a> {
    nodes: &'a BTreeMap<&'a str, &'a NodeView>,
    /// Why this alert's drain was held back, if it was.
    drain_held: Option<&'a RefuseReason>,
    now_ms: i64,
}

/// What a planning round tracks as it decides.
struct Round {
    /// Nodes out (drained or down), including those drained earlier in this round.
    out: BTreeSet<String>,
    /// Drains perch started whose node still runs jobs.
    in_progress: usize,
    /// Nodes in the cluster.
    total: usize,
}

/// The action a spec names, for the record of a refusal when the alert cannot fill it in.
fn placeholder(spec: &ActionSpec, node: String) -> Action {
    match spec {
        ActionSpec::DrainNode => Action::DrainNode { node },
        ActionSpec::RequeueJobs => Action::RequeueJobs { node },
        ActionSpec::GpuOut => Action::GpuOut { node, gpu: 0 },
        ActionSpec::RunCommand(command) => Action::RunCommand {
            node,
            command: command.clone(),
            argv: Vec::new(),
            timeout_ms: 0,
        },
    }
}

fn outcome_code(outcome: &Outcome) -> (String, bool) {
    match outcome {
        Outcome::Execute => ("execute".into(), true),
        Outcome::DryRun => ("dry_run".into(), true),
        Outcome::Skipped { .. } => ("skipped".into(), true),
        Outcome::Refused(r) => (format!("refused: {r}"), r.is_final()),
    }
}

#[cfg(test)]
mod tests;
