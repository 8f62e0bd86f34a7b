//! The [`Engine`]: one object the server holds, composing the rule states, silences, the
//! dispatcher and the remediation planner, with one snapshot for all of them.
//!
//! What the server does every tick (see the crate README for a fuller sketch):
//! 1. for each rule in [`Engine::due_rules`], run its SQL (or compute a built-in) and call
//!    [`Engine::evaluate`] (or [`Engine::record_failure`]); write the transitions' events;
//! 2. [`Engine::plan_remediation`] with the control plane's view; carry out `Execute`
//!    decisions in order and report each with [`Engine::complete`]; write every audit record;
//! 3. [`Engine::notifications`] and hand them to the [`crate::notify::Notifier`];
//! 4. [`Engine::save`].

use crate::alert::{Alert, AlertKey, AlertState};
use crate::config::{AlertsConfig, InhibitRuleConfig};
use crate::dispatch::{DispatchState, Dispatcher, Notification};
use crate::error::{Error, Result};
use crate::remediate::{BreakerTrip, ClusterView, Decision, Plan, Planner, PlannerState};
use crate::rules::{Instance, Rule, Severity};
use crate::silence::{Silence, SilenceRequest, SilenceState, Silences};
use crate::state::{AlertTable, Transition};
use perch_model::ClusterEvent;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The alert perch raises while its remediation circuit breaker is open.
pub const BREAKER_ALERT: &str = "RemediationCircuitOpen";

const SNAPSHOT_VERSION: u32 = 1;

/// Everything the engine persists, in one JSON document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    /// Format version (1).
    pub version: u32,
    /// When it was taken.
    pub saved_at_ms: i64,
    alerts: AlertTable,
    silences: Silences,
    dispatch: DispatchState,
    remediation: PlannerState,
    last_evaluation_ms: BTreeMap<String, i64>,
    /// Notifications made and not yet handed to their receivers (absent in snapshots of
    /// releases before the outbox: none).
    #[serde(default)]
    outbox: Vec<Notification>,
}

/// Most notifications kept waiting for delivery; past it the oldest is dropped (and logged):
/// deliveries end after their bounded retries, so only a receiver configuration that stalls
/// every delivery for hours reaches it.
const OUTBOX_MAX: usize = 10_000;

/// A rule's evaluation health, for the API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleStatus {
    /// The rule.
    pub name: String,
    /// Part of the built-in pack.
    pub builtin: bool,
    /// Its severity.
    pub severity: Severity,
    /// Last evaluation (successful or not).
    pub last_evaluation_ms: Option<i64>,
    /// The last evaluation's error, if it failed.
    pub last_error: Option<String>,
    /// Alerts of the rule firing now.
    pub firing: usize,
    /// Alerts of the rule pending now.
    pub pending: usize,
}

/// An alert as `GET /v1/alerts` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlertStatus {
    /// The alert.
    #[serde(flatten)]
    pub alert: Alert,
    /// Why it is not notified (`silenced by s-3`, `inhibited`), if it is not.
    pub muted_by: Option<String>,
}

/// One series of `perch_alerts{alertname, state, severity}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlertCount {
    /// The rule.
    pub alertname: String,
    /// `pending` or `firing`.
    pub state: String,
    /// The rule's severity.
    pub severity: String,
    /// How many.
    pub count: usize,
}

/// Numbers for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineMetrics {
    /// Pending and firing alerts per rule; every rule has both states, at 0 when it has
    /// none, so a dashboard sees a rule before it first fires.
    pub alerts: Vec<AlertCount>,
    /// Silences muting now.
    pub silences_active: usize,
    /// 1 while the remediation circuit breaker is open.
    pub breaker_open: bool,
    /// Nodes perch drained and has not resumed.
    pub nodes_drained_by_perch: usize,
}

/// How long resolved alerts are kept: twice the longest group interval (at least 15
/// minutes), so every group flushes its resolved notice before the alert is dropped.
fn resolved_retention(config: &AlertsConfig) -> i64 {
    let route = &config.route;
    route
        .routes
        .iter()
        .filter_map(|c| c.group_interval)
        .chain([route.group_interval])
        .map(|d| d.as_ms())
        .max()
        .unwrap_or(0)
        .saturating_mul(2)
}

/// The alerting engine.
#[derive(Debug)]
pub struct Engine {
    config: AlertsConfig,
    rules: Vec<Rule>,
    alerts: AlertTable,
    silences: Silences,
    dispatcher: Dispatcher,
    planner: Planner,
    last_evaluation_ms: BTreeMap<String, i64>,
    last_error: BTreeMap<String, String>,
    /// Notifications made and not yet delivered (or given up on): saved with the state, so a
    /// server that stops before delivering them (a crash, a takeover) sends them when the
    /// state is next loaded ([`Engine::undelivered`]).
    outbox: Vec<Notification>,
}

impl Engine {
    /// A fresh engine for `config` (validated here).
    pub fn new(config: AlertsConfig) -> Result<Self> {
        config.validate()?;
        let rules = config.rules();
        let inhibit = config
            .inhibit_rules
            .clone()
            .unwrap_or_else(InhibitRuleConfig::defaults);
        Ok(Self {
            dispatcher: Dispatcher::new(&config.route, inhibit),
            planner: Planner::new(config.remediation.clone(), config.dry_run),
            rules,
            alerts: AlertTable::default().with_retention(resolved_retention(&config)),
            config,
            silences: Silences::default(),
            last_evaluation_ms: BTreeMap::new(),
            last_error: BTreeMap::new(),
            outbox: Vec::new(),
        })
    }

    /// An engine for `config` with restored state. Alerts of rules no longer configured
    /// resolve; their transitions are returned for the audit trail.
    pub fn restore(
        config: AlertsConfig,
        snapshot: Snapshot,
        now_ms: i64,
    ) -> Result<(Self, Vec<Transition>)> {
        if snapshot.version != SNAPSHOT_VERSION {
            return Err(Error::Snapshot {
                path: Default::default(),
                message: format!(
                    "version {} (this perch reads version {SNAPSHOT_VERSION})",
                    snapshot.version
                ),
            });
        }
        let mut engine = Self::new(config)?;
        engine.alerts = snapshot
            .alerts
            .with_retention(resolved_retention(&engine.config));
        engine.silences = snapshot.silences;
        engine.dispatcher = engine.dispatcher.clone().with_state(snapshot.dispatch);
        engine.planner = engine.planner.clone().with_state(snapshot.remediation);
        engine.last_evaluation_ms = snapshot.last_evaluation_ms;
        engine.outbox = snapshot.outbox;
        let mut names: Vec<&str> = engine.rules.iter().map(|r| r.name.as_str()).collect();
        names.push(BREAKER_ALERT);
        let transitions = engine.alerts.retain_rules(&names, now_ms);
        Ok((engine, transitions))
    }

    /// Runs `config` from now on, as a restart with it would, keeping the state: alerts of
    /// rules still configured, silences, group timers, the circuit breaker, the outbox. Alerts
    /// of rules no longer configured resolve (their transitions are returned for the audit
    /// trail), and every rule is evaluated at the next round, so a changed rule applies at
    /// once. A config that does not validate changes nothing.
    pub fn reconfigure(&mut self, config: AlertsConfig, now_ms: i64) -> Result<Vec<Transition>> {
        let mut snapshot = self.snapshot(now_ms);
        snapshot.last_evaluation_ms.clear();
        let (mut engine, transitions) = Self::restore(config, snapshot, now_ms)?;
        let kept: Vec<String> = engine.rules.iter().map(|r| r.name.clone()).collect();
        engine.last_error = std::mem::take(&mut self.last_error)
            .into_iter()
            .filter(|(rule, _)| kept.contains(rule))
            .collect();
        *self = engine;
        Ok(transitions)
    }

    /// Loads the engine's state from `path` (a fresh engine when the file does not exist).
    pub fn load(config: AlertsConfig, path: &Path, now_ms: i64) -> Result<(Self, Vec<Transition>)> {
        match crate::persist::load_json::<Snapshot>(path)? {
            None => Ok((Self::new(config)?, Vec::new())),
            Some(snapshot) => Self::restore(config, snapshot, now_ms).map_err(|e| match e {
                Error::Snapshot { message, .. } => Error::Snapshot {
                    path: path.to_owned(),
                    message,
                },
                other => other,
            }),
        }
    }

    /// Saves the state to `path` atomically.
    pub fn save(&self, path: &Path, now_ms: i64) -> Result<()> {
        crate::persist::save_json_atomic(path, &self.snapshot(now_ms))
    }

    /// The state as one serializable value.
    pub fn snapshot(&self, now_ms: i64) -> Snapshot {
        Snapshot {
            version: SNAPSHOT_VERSION,
            saved_at_ms: now_ms,
            alerts: self.alerts.clone(),
            silences: self.silences.clone(),
            dispatch: self.dispatcher.state().clone(),
            remediation: self.planner.state().clone(),
            last_evaluation_ms: self.last_evaluation_ms.clone(),
            outbox: self.outbox.clone(),
        }
    }

    /// The config the engine runs.
    pub fn config(&self) -> &AlertsConfig {
        &self.config
    }

    /// Every rule, built-ins first.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Rules whose interval has passed since their last evaluation (cloned, so the caller can
    /// run their queries without holding the engine).
    pub fn due_rules(&self, now_ms: i64) -> Vec<Rule> {
        if !self.config.enabled {
            return Vec::new();
        }
        self.rules
            .iter()
            .filter(|r| {
                self.last_evaluation_ms
                    .get(&r.name)
                    .is_none_or(|last| now_ms.saturating_sub(*last) >= r.interval_ms)
            })
            .cloned()
            .collect()
    }

    fn rule(&self, name: &str) -> Result<Rule> {
        self.rules
            .iter()
            .find(|r| r.name == name)
            .cloned()
            .ok_or_else(|| Error::Rule {
                rule: name.to_owned(),
                message: "no rule of this name is configured".into(),
            })
    }

    /// Applies one evaluation of rule `name` that yielded `instances`.
    pub fn evaluate(
        &mut self,
        name: &str,
        instances: &[Instance],
        now_ms: i64,
    ) -> Result<Vec<Transition>> {
        let rule = self.rule(name)?;
        self.last_evaluation_ms.insert(rule.name.clone(), now_ms);
        self.last_error.remove(&rule.name);
        Ok(self.alerts.evaluate(&rule, instances, now_ms))
    }

    /// Applies one evaluation of SQL rule `name` from its result rows. Rows that cannot be
    /// instances fail the evaluation (recorded as the rule's error) and leave the rule's
    /// alerts as they were, as Prometheus does when a query fails.
    pub fn evaluate_rows(
        &mut self,
        name: &str,
        rows: &[Map<String, Value>],
        now_ms: i64,
    ) -> Result<Vec<Transition>> {
        let rule = self.rule(name)?;
        match rule.instances(rows) {
            Ok(instances) => self.evaluate(name, &instances, now_ms),
            Err(e) => {
                self.record_failure(name, &e.to_string(), now_ms);
                Err(e)
            }
        }
    }

    /// Records that rule `name` could not be evaluated (its query failed); its alerts keep
    /// their state until an evaluation succeeds.
    pub fn record_failure(&mut self, name: &str, error: &str, now_ms: i64) {
        self.last_evaluation_ms.insert(name.to_owned(), now_ms);
        self.last_error.insert(name.to_owned(), error.to_owned());
    }

    /// Each rule's health and alert counts.
    pub fn rule_status(&self) -> Vec<RuleStatus> {
        self.rules
            .iter()
            .map(|r| {
                let count = |state| {
                    self.alerts
                        .iter()
                        .filter(|a| a.rule == r.name && a.state == state)
                        .count()
                };
                RuleStatus {
                    name: r.name.clone(),
                    builtin: r.builtin,
                    severity: r.severity,
                    last_evaluation_ms: self.last_evaluation_ms.get(&r.name).copied(),
                    last_error: self.last_error.get(&r.name).cloned(),
                    firing: count(AlertState::Firing),
                    pending: count(AlertState::Pending),
                }
            })
            .collect()
    }

    /// Every alert (pending, firing, recently resolved) and whether it is muted.
    pub fn alerts(&self, now_ms: i64) -> Vec<AlertStatus> {
        let all: Vec<&Alert> = self.alerts.iter().collect();
        let muted = self.dispatcher.muted_by(&all, &self.silences, now_ms);
        all.into_iter()
            .zip(muted)
            .map(|(alert, muted_by)| AlertStatus {
                alert: alert.clone(),
                muted_by,
            })
            .collect()
    }

    /// The rendered summary of the alert `key`, if there is such an alert: what a remediation
    /// it asked for gives as its reason (a drain's names the job and rank of `JobStraggler`).
    pub fn alert_summary(&self, key: &AlertKey) -> Option<String> {
        self.alerts.get(key).map(|a| a.summary.clone())
    }

    /// Adds a line to what perch did about an alert; false when there is no such alert.
    pub fn annotate(&mut self, key: &AlertKey, line: &str) -> bool {
        match self.alerts.get_mut(key) {
            Some(alert) => {
                alert.annotate(line);
                true
            }
            None => false,
        }
    }

    /// Plans remediation for the firing alerts against the server's view of the cluster.
    /// Annotates the alerts with what was decided (dry runs, refusals) and raises
    /// [`BREAKER_ALERT`] when the circuit breaker opens.
    pub fn plan_remediation(&mut self, view: &ClusterView, now_ms: i64) -> Plan {
        let refs: Vec<&Alert> = self.alerts.iter().collect();
        let plan = self.planner.plan(&refs, view, now_ms);
        for decision in &plan.decisions {
            if let (Some(key), Some(line)) = (&decision.alert, decision.annotation()) {
                self.annotate(key, &line);
            }
        }
        if plan.breaker_opened.is_some()
            && let Some(trip) = self.planner.breaker().cloned()
        {
            self.raise_breaker_alert(&trip, now_ms);
        }
        plan
    }

    fn breaker_labels() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("alertname".to_string(), BREAKER_ALERT.to_string()),
            (
                "severity".to_string(),
                Severity::Critical.as_str().to_string(),
            ),
        ])
    }

    fn raise_breaker_alert(&mut self, trip: &BreakerTrip, now_ms: i64) {
        let labels = Self::breaker_labels();
        let dry = if self.config.dry_run {
            " (dry run)"
        } else {
            ""
        };
        self.alerts.upsert(Alert {
            key: AlertKey::of(&labels),
            rule: BREAKER_ALERT.into(),
            labels,
            values: BTreeMap::new(),
            severity: Severity::Critical,
            summary: format!("perch stopped all automatic remediation{dry}"),
            description: format!(
                "The remediation circuit breaker opened: {}. No node is drained and no action runs \
                 until an operator resets it (perch alerts breaker reset, or POST /v1/alerts/breaker/reset).",
                trip.reason
            ),
            state: AlertState::Firing,
            active_at_ms: now_ms,
            fired_at_ms: Some(now_ms),
            resolved_at_ms: None,
            last_seen_ms: now_ms,
            keep_firing_since_ms: None,
            actions: Vec::new(),
            actions_taken: vec!["Stopped all automatic remediation.".into()],
        });
    }

    /// Records the result of an executed decision: returns its audit record and adds the
    /// outcome to the alert's "what perch did" lines.
    pub fn complete(
        &mut self,
        decision: &Decision,
        result: &Result<String, String>,
        now_ms: i64,
    ) -> ClusterEvent {
        let event = self.planner.complete(decision, result, now_ms);
        if let Some(key) = &decision.alert {
            self.annotate(key, &event.message);
        }
        event
    }

    /// Why and when the breaker opened, while it is open.
    pub fn breaker(&self) -> Option<&BreakerTrip> {
        self.planner.breaker()
    }

    /// Closes the breaker (an operator's call) and resolves its alert; `None` when closed.
    pub fn reset_breaker(&mut self, by: &str, now_ms: i64) -> Option<ClusterEvent> {
        let event = self.planner.reset_breaker(by, now_ms)?;
        if let Some(alert) = self.alerts.get_mut(&AlertKey::of(&Self::breaker_labels())) {
            alert.state = AlertState::Resolved;
            alert.resolved_at_ms = Some(now_ms);
            alert.annotate(&format!(
                "{by} reset the breaker; automatic remediation resumed."
            ));
        }
        Some(event)
    }

    /// Nodes perch drained and has not resumed.
    pub fn drained_by_perch(&self) -> Vec<&str> {
        self.planner.drained_by_perch()
    }

    /// The notifications due at `now_ms`. Each waits in the outbox, saved with the state,
    /// until [`Engine::delivered`] says it was handed to its receiver: save the state before
    /// sending them, so that a notification is neither made twice nor lost by a crash.
    pub fn notifications(&mut self, now_ms: i64) -> Vec<Notification> {
        self.silences.gc(now_ms);
        self.alerts.expire(now_ms);
        let alerts: Vec<&Alert> = self.alerts.iter().collect();
        let due = self.dispatcher.step(&alerts, &self.silences, now_ms);
        self.outbox.extend(due.iter().cloned());
        if self.outbox.len() > OUTBOX_MAX {
            let dropped = self.outbox.len() - OUTBOX_MAX;
            tracing::error!(
                dropped,
                "more notifications wait for delivery than the outbox keeps; the oldest are dropped"
            );
            self.outbox.drain(..dropped);
        }
        due
    }

    /// `n` was handed to its receiver's integrations (sent, or given up on after retries): it
    /// leaves the outbox.
    pub fn delivered(&mut self, n: &Notification) {
        if let Some(i) = self.outbox.iter().position(|o| {
            o.receiver == n.receiver && o.group_key == n.group_key && o.at_ms == n.at_ms
        }) {
            self.outbox.remove(i);
        }
    }

    /// The notifications made and not yet delivered: after a load, those the server that
    /// saved the state did not get to send.
    pub fn undelivered(&self) -> Vec<Notification> {
        self.outbox.clone()
    }

    /// When the engine next has something to do: the next rule evaluation or group flush.
    pub fn next_wakeup(&self, now_ms: i64) -> i64 {
        let next_rule = self
            .rules
            .iter()
            .map(|r| {
                self.last_evaluation_ms
                    .get(&r.name)
                    .map_or(now_ms, |last| last.saturating_add(r.interval_ms))
            })
            .min();
        [next_rule, self.dispatcher.next_wakeup()]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or_else(|| now_ms.saturating_add(self.config.evaluation_interval.as_ms()))
            .max(now_ms)
    }

    /// Adds a silence.
    pub fn add_silence(&mut self, request: SilenceRequest, now_ms: i64) -> Result<Silence> {
        self.silences.add(request, now_ms)
    }

    /// Expires a silence now.
    pub fn expire_silence(&mut self, id: &str, now_ms: i64) -> Result<Silence> {
        self.silences.expire(id, now_ms)
    }

    /// Every silence with its state.
    pub fn silences(&self, now_ms: i64) -> Vec<(Silence, SilenceState)> {
        self.silences.list(now_ms)
    }

    /// Numbers for `/metrics`.
    pub fn metrics(&self, now_ms: i64) -> EngineMetrics {
        let mut counts: BTreeMap<(String, &'static str, &'static str), usize> = BTreeMap::new();
        for rule in &self.rules {
            for state in [AlertState::Pending, AlertState::Firing] {
                counts.insert(
                    (rule.name.clone(), state.as_str(), rule.severity.as_str()),
                    0,
                );
            }
        }
        for a in self.alerts.iter() {
            if matches!(a.state, AlertState::Pending | AlertState::Firing) {
                *counts
                    .entry((a.rule.clone(), a.state.as_str(), a.severity.as_str()))
                    .or_insert(0) += 1;
            }
        }
        let alerts = counts
            .into_iter()
            .map(|((alertname, state, severity), count)| AlertCount {
                alertname,
                state: state.to_owned(),
                severity: severity.to_owned(),
                count,
            })
            .collect();
        EngineMetrics {
            alerts,
            silences_active: self.silences.active_count(now_ms),
            breaker_open: self.planner.breaker().is_some(),
            nodes_drained_by_perch: self.planner.drained_by_perch().len(),
        }
    }
}

#[cfg(test)]
mod tests;
