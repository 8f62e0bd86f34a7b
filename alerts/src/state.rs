//! The Prometheus alert state machine, per (rule, label set): inactive -> pending (for `for`)
//! -> firing, held by `keep_firing_for` against flaps, then resolved.
//!
//! [`AlertTable::evaluate`] takes one rule's instances at `now_ms` and returns the
//! transitions; it reads no clock. Resolved alerts stay in the table for at least
//! [`RESOLVED_RETENTION_MS`] (longer when a route's group interval is longer, see
//! [`AlertTable::with_retention`]) so the dispatcher can send their resolved notice and the
//! API can show them, then they are dropped.

use crate::alert::{Alert, AlertKey, AlertState};
use crate::rules::{Instance, Rule};
use crate::template::{TemplateContext, render};
use perch_model::ClusterEvent;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// How long a resolved alert is kept at least (Prometheus keeps them 15 minutes for
/// Alertmanager).
pub const RESOLVED_RETENTION_MS: i64 = 15 * 60_000;

fn default_retention() -> i64 {
    RESOLVED_RETENTION_MS
}

/// A change of an alert's state, for logs, the `events` table and `/metrics`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    /// The alert.
    pub key: AlertKey,
    /// Its rule.
    pub rule: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// State before.
    pub from: AlertState,
    /// State after.
    pub to: AlertState,
    /// When (the evaluation's `now_ms`).
    pub at_ms: i64,
    /// Its severity's name.
    pub severity: String,
    /// Its rendered summary.
    pub summary: String,
}

impl Transition {
    /// The audit event for a transition worth recording (`alert_firing`, `alert_resolved`);
    /// `None` for pending and pending-to-inactive, which are noise in an audit trail.
    pub fn to_event(&self) -> Option<ClusterEvent> {
        let kind = match self.to {
            AlertState::Firing => "alert_firing",
            AlertState::Resolved => "alert_resolved",
            AlertState::Pending | AlertState::Inactive => return None,
        };
        let mut event = ClusterEvent::new(self.at_ms, kind, "perch", self.summary.clone());
        event.node = self.labels.get("node").cloned();
        event.gpu = self.labels.get("gpu").and_then(|g| g.parse().ok());
        event.job = self.labels.get("job").and_then(|j| j.parse().ok());
        event.rule = Some(self.rule.clone());
        event.severity = Some(self.severity.clone());
        Some(event)
    }
}

/// Every live alert (pending, firing, recently resolved), by key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AlertTable {
    alerts: BTreeMap<AlertKey, Alert>,
    /// How long resolved alerts are kept (config, not state: not persisted).
    #[serde(skip, default = "default_retention")]
    retention_ms: i64,
}

impl Default for AlertTable {
    fn default() -> Self {
        Self {
            alerts: BTreeMap::new(),
            retention_ms: RESOLVED_RETENTION_MS,
        }
    }
}

impl AlertTable {
    /// Keeps resolved alerts `ms` (at least [`RESOLVED_RETENTION_MS`]): they must outlive the
    /// longest group interval, or a group would lose its resolved notice.
    pub fn with_retention(mut self, ms: i64) -> Self {
        self.retention_ms = ms.max(RESOLVED_RETENTION_MS);
        self
    }

    /// The full label set of an instance of `rule`: the row's labels, then the rule's labels,
    /// then `alertname` and `severity`, each overriding what came before.
    pub fn labels_of(rule: &Rule, instance: &Instance) -> BTreeMap<String, String> {
        let mut labels = instance.labels.clone();
        labels.extend(rule.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        labels.insert("alertname".into(), rule.name.clone());
        labels.insert("severity".into(), rule.severity.as_str().into());
        labels
    }

    /// Applies one evaluation of `rule` that returned `instances` at `now_ms`.
    pub fn evaluate(
        &mut self,
        rule: &Rule,
        instances: &[Instance],
        now_ms: i64,
    ) -> Vec<Transition> {
        let mut transitions = Vec::new();
        let mut present = BTreeSet::new();
        for instance in instances {
            let labels = Self::labels_of(rule, instance);
            let key = AlertKey::of(&labels);
            let ctx = TemplateContext {
                rule: &rule.name,
                severity: rule.severity.as_str(),
                labels: &labels,
                values: &instance.values,
            };
            let summary = render(&rule.summary, &ctx);
            let description = render(&rule.description, &ctx);
            present.insert(key.clone());
            if self
                .alerts
                .get(&key)
                .is_none_or(|a| a.state == AlertState::Resolved)
            {
                // A new episode (or the same labels again after resolving).
                self.alerts.insert(
                    key.clone(),
                    Alert {
                        key: key.clone(),
                        rule: rule.name.clone(),
                        labels: labels.clone(),
                        values: BTreeMap::new(),
                        severity: rule.severity,
                        summary: String::new(),
                        description: String::new(),
                        state: AlertState::Inactive,
                        active_at_ms: now_ms,
                        fired_at_ms: None,
                        resolved_at_ms: None,
                        last_seen_ms: now_ms,
                        keep_firing_since_ms: None,
                        actions: rule.actions.clone(),
                        actions_taken: Vec::new(),
                    },
                );
            }
            let Some(alert) = self.alerts.get_mut(&key) else {
                continue;
            };
            alert.values = instance.values.clone();
            alert.summary = summary;
            alert.description = description;
            alert.last_seen_ms = now_ms;
            alert.keep_firing_since_ms = None;
            alert.actions = rule.actions.clone();
            let from = alert.state;
            let to = match from {
                AlertState::Inactive | AlertState::Pending
                    if now_ms.saturating_sub(alert.active_at_ms) >= rule.for_ms =>
                {
                    alert.fired_at_ms = Some(now_ms);
                    AlertState::Firing
                }
                AlertState::Inactive => AlertState::Pending,
                other => other,
            };
            alert.state = to;
            if from != to {
                transitions.push(transition(alert, from, now_ms));
            }
        }
        // Alerts of this rule that did not come back.
        let mut dropped = Vec::new();
        for (key, alert) in self.alerts.iter_mut() {
            if alert.rule != rule.name || present.contains(key) {
                continue;
            }
            match alert.state {
                AlertState::Pending | AlertState::Inactive => {
                    let from = alert.state;
                    alert.state = AlertState::Inactive;
                    transitions.push(transition(alert, from, now_ms));
                    dropped.push(key.clone());
                }
                AlertState::Firing => {
                    let since = *alert.keep_firing_since_ms.get_or_insert(now_ms);
                    if now_ms.saturating_sub(since) >= rule.keep_firing_for_ms {
                        resolve(alert, now_ms, &mut transitions);
                    }
                }
                AlertState::Resolved => {}
            }
        }
        for key in dropped {
            self.alerts.remove(&key);
        }
        self.expire(now_ms);
        transitions
    }

    /// Resolves every alert of a rule that no longer exists (removed from the config), so
    /// it does not fire forever; keeps alerts whose rule is in `rules` or in `keep`.
    pub fn retain_rules(&mut self, rules: &[&str], now_ms: i64) -> Vec<Transition> {
        let mut transitions = Vec::new();
        let mut dropped = Vec::new();
        for (key, alert) in self.alerts.iter_mut() {
            if rules.contains(&alert.rule.as_str()) {
                continue;
            }
            match alert.state {
                AlertState::Firing => resolve(alert, now_ms, &mut transitions),
                AlertState::Pending | AlertState::Inactive => dropped.push(key.clone()),
                AlertState::Resolved => {}
            }
        }
        for key in dropped {
            self.alerts.remove(&key);
        }
        transitions
    }

    /// Drops resolved alerts older than the retention.
    pub fn expire(&mut self, now_ms: i64) {
        let retention = self.retention_ms;
        self.alerts.retain(|_, a| {
            a.state != AlertState::Resolved
                || a.resolved_at_ms
                    .is_none_or(|at| now_ms.saturating_sub(at) < retention)
        });
    }

    /// Every alert, in key order.
    pub fn iter(&self) -> impl Iterator<Item = &Alert> {
        self.alerts.values()
    }

    /// One alert.
    pub fn get(&self, key: &AlertKey) -> Option<&Alert> {
        self.alerts.get(key)
    }

    /// One alert, mutably (to annotate it).
    pub fn get_mut(&mut self, key: &AlertKey) -> Option<&mut Alert> {
        self.alerts.get_mut(key)
    }

    /// Puts an alert in directly (perch's own alerts, such as the circuit breaker's).
    pub fn upsert(&mut self, alert: Alert) {
        self.alerts.insert(alert.key.clone(), alert);
    }

    /// Number of alerts kept.
    pub fn len(&self) -> usize {
        self.alerts.len()
    }

    /// True when no alert is kept.
    pub fn is_empty(&self) -> bool {
        self.alerts.is_empty()
    }
}

fn resolve(alert: &mut Alert, now_ms: i64, transitions: &mut Vec<Transition>) {
    alert.state = AlertState::Resolved;
    alert.resolved_at_ms = Some(now_ms);
    alert.keep_firing_since_ms = None;
    transitions.push(transition(alert, AlertState::Firing, now_ms));
}

fn transition(alert: &Alert, from: AlertState, now_ms: i64) -> Transition {
    Transition {
        key: alert.key.clone(),
        rule: alert.rule.clone(),
        labels: alert.labels.clone(),
        from,
        to: alert.state,
        at_ms: now_ms,
        severity: alert.severity.as_str().into(),
        summary: alert.summary.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{RuleSource, Severity};

    fn rule(for_ms: i64, keep_ms: i64) -> Rule {
        Rule {
            name: "HotGpu".into(),
            source: RuleSource::Sql("SELECT 1".into()),
            for_ms,
            keep_firing_for_ms: keep_ms,
            severity: Severity::Warning,
            labels: BTreeMap::from([("team".to_string(), "infra".to_string())]),
            summary: "{{ labels.node }} at {{ values.temp }}".into(),
            description: String::new(),
            interval_ms: 10_000,
            actions: Vec::new(),
            label_columns: Vec::new(),
            builtin: false,
        }
    }

    fn hot(node: &str, temp: f64) -> Instance {
        Instance::with_labels([("node", node)]).value("temp", temp)
    }

    fn states(t: &[Transition]) -> Vec<(AlertState, AlertState)> {
        t.iter().map(|t| (t.from, t.to)).collect()
    }

    use AlertState::*;

    #[test]
    fn pending_then_firing_after_for() {
        let r = rule(60_000, 0);
        let mut table = AlertTable::default();
        assert_eq!(
            states(&table.evaluate(&r, &[hot("n1", 90.0)], 0)),
            [(Inactive, Pending)]
        );
        assert!(table.evaluate(&r, &[hot("n1", 91.0)], 30_000).is_empty());
        let t = table.evaluate(&r, &[hot("n1", 92.0)], 60_000);
        assert_eq!(states(&t), [(Pending, Firing)]);
        assert_eq!(t[0].summary, "n1 at 92");
        let alert = table.iter().next().expect("one alert");
        assert_eq!(alert.labels["alertname"], "HotGpu");
        assert_eq!(alert.labels["team"], "infra");
        assert_eq!(alert.labels["severity"], "warning");
        assert_eq!(alert.fired_at_ms, Some(60_000));
        assert_eq!(alert.active_at_ms, 0);
    }

    #[test]
    fn zero_for_fires_at_once() {
        let mut table = AlertTable::default();
        let t = table.evaluate(&rule(0, 0), &[hot("n1", 90.0)], 5);
        assert_eq!(states(&t), [(Inactive, Firing)]);
    }

    #[test]
    fn pending_that_disappears_goes_back_to_inactive() {
        let r = rule(60_000, 0);
        let mut table = AlertTable::default();
        table.evaluate(&r, &[hot("n1", 90.0)], 0);
        assert_eq!(
            states(&table.evaluate(&r, &[], 30_000)),
            [(Pending, Inactive)]
        );
        assert!(table.is_empty());
        // It starts over: `for` counts from the new appearance.
        table.evaluate(&r, &[hot("n1", 90.0)], 40_000);
        assert!(table.evaluate(&r, &[hot("n1", 90.0)], 90_000).is_empty());
        assert_eq!(
            states(&table.evaluate(&r, &[hot("n1", 90.0)], 100_000)),
            [(Pending, Firing)]
        );
    }

    #[test]
    fn keep_firing_for_suppresses_a_flap() {
        let r = rule(0, 60_000);
        let mut table = AlertTable::default();
        table.evaluate(&r, &[hot("n1", 90.0)], 0);
        // Gone for 50 s: still firing.
        assert!(table.evaluate(&r, &[], 10_000).is_empty());
        assert!(table.evaluate(&r, &[], 50_000).is_empty());
        // Back: still the same firing episode, no transition.
        assert!(table.evaluate(&r, &[hot("n1", 90.0)], 60_000).is_empty());
        let alert = table.iter().next().expect("alert");
        assert_eq!((alert.state, alert.active_at_ms), (Firing, 0));
        // Gone for good: resolves once keep_firing_for has passed since it vanished.
        assert!(table.evaluate(&r, &[], 70_000).is_empty());
        assert!(table.evaluate(&r, &[], 120_000).is_empty());
        assert_eq!(
            states(&table.evaluate(&r, &[], 130_000)),
            [(Firing, Resolved)]
        );
    }

    #[test]
    fn without_keep_firing_for_a_gap_resolves_and_returns_as_new_episode() {
        let r = rule(0, 0);
        let mut table = AlertTable::default();
        table.evaluate(&r, &[hot("n1", 90.0)], 0);
        assert_eq!(
            states(&table.evaluate(&r, &[], 10_000)),
            [(Firing, Resolved)]
        );
        let t = table.evaluate(&r, &[hot("n1", 90.0)], 20_000);
        assert_eq!(states(&t), [(Inactive, Firing)]);
        assert_eq!(table.iter().next().map(|a| a.active_at_ms), Some(20_000));
    }

    #[test]
    fn resolved_alerts_are_dropped_after_retention() {
        let r = rule(0, 0);
        let mut table = AlertTable::default();
        table.evaluate(&r, &[hot("n1", 90.0)], 0);
        table.evaluate(&r, &[], 1_000);
        table.evaluate(&r, &[], 1_000 + RESOLVED_RETENTION_MS - 1);
        assert_eq!(table.len(), 1);
        table.evaluate(&r, &[], 1_000 + RESOLVED_RETENTION_MS);
        assert!(table.is_empty());
    }

    #[test]
    fn retention_follows_the_longest_group_interval() {
        let r = rule(0, 0);
        let mut table = AlertTable::default().with_retention(60 * 60_000);
        table.evaluate(&r, &[hot("n1", 90.0)], 0);
        table.evaluate(&r, &[], 1_000);
        table.expire(1_000 + 59 * 60_000);
        assert_eq!(table.len(), 1);
        table.expire(1_000 + 60 * 60_000);
        assert!(table.is_empty());
        assert_eq!(
            AlertTable::default().with_retention(1).retention_ms,
            RESOLVED_RETENTION_MS
        );
    }

    #[test]
    fn other_rules_alerts_are_untouched() {
        let a = rule(0, 0);
        let mut b = rule(0, 0);
        b.name = "Other".into();
        let mut table = AlertTable::default();
        table.evaluate(&a, &[hot("n1", 90.0)], 0);
        table.evaluate(&b, &[hot("n1", 90.0)], 0);
        assert_eq!(
            states(&table.evaluate(&a, &[], 1_000)),
            [(Firing, Resolved)]
        );
        assert_eq!(table.iter().filter(|x| x.state == Firing).count(), 1);
        // A rule removed from the config resolves.
        let t = table.retain_rules(&["HotGpu"], 2_000);
        assert_eq!(states(&t), [(Firing, Resolved)]);
        assert_eq!(t[0].rule, "Other");
    }

    #[test]
    fn transitions_become_audit_events() {
        let r = rule(0, 0);
        let mut table = AlertTable::default();
        let mut inst = hot("n1", 90.0);
        inst.labels.insert("gpu".into(), "3".into());
        let t = table.evaluate(&r, &[inst], 7);
        let event = t[0].to_event().expect("firing is audited");
        assert_eq!(event.kind, "alert_firing");
        assert_eq!(event.node.as_deref(), Some("n1"));
        assert_eq!(event.gpu, Some(3));
        assert_eq!(event.rule.as_deref(), Some("HotGpu"));
        assert_eq!(event.severity.as_deref(), Some("warning"));
        let mut slow = rule(60_000, 0);
        slow.name = "Slow".into();
        let pending = table.evaluate(&slow, &[hot("n2", 1.0)], 8);
        assert_eq!(states(&pending), [(Inactive, Pending)]);
        assert!(pending.iter().all(|t| t.to_event().is_none()));
    }
}
