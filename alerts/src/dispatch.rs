//! The Alertmanager pipeline as a pure step function: silences, inhibition, routing,
//! grouping, and the group_wait / group_interval / repeat_interval timers, ending in
//! [`Notification`]s for the senders.
//!
//! [`Dispatcher::step`] is called with every firing and resolved alert and `now_ms`; it
//! returns the notifications due now. Its state (groups and what each last notified) is part
//! of the engine's snapshot, so a restart neither loses a pending notice nor repeats one.
//!
//! The rules, following Alertmanager's dedup stage: a group's first message waits
//! `group_wait` after its first alert; afterwards the group is looked at every
//! `group_interval` and sends when it has a firing alert the last message did not have, when
//! everything it last reported as firing has resolved, when alerts resolved since (if resolved
//! notices are on), when perch took an action not yet reported, or when `repeat_interval` has
//! passed since the last message.

use crate::alert::{Alert, AlertKey, AlertState};
use crate::config::{InhibitRuleConfig, RouteConfig};
use crate::matcher::{Matcher, matches_all};
use crate::silence::Silences;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A message for one receiver about one group of alerts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notification {
    /// Receiver name (from the route).
    pub receiver: String,
    /// Identifies the group (route, receiver, grouping label values).
    pub group_key: String,
    /// The grouping labels' values.
    pub group_labels: BTreeMap<String, String>,
    /// Labels every alert in the message shares.
    pub common_labels: BTreeMap<String, String>,
    /// Alerts firing now.
    pub firing: Vec<Alert>,
    /// Alerts resolved since the last message.
    pub resolved: Vec<Alert>,
    /// What perch did about these alerts, one line each.
    pub actions_taken: Vec<String>,
    /// When the message was made.
    pub at_ms: i64,
}

impl Notification {
    /// `firing` while any alert fires, else `resolved` (Alertmanager's group status).
    pub fn status(&self) -> &'static str {
        if self.firing.is_empty() {
            "resolved"
        } else {
            "firing"
        }
    }

    /// The message minus its resolved alerts, for integrations that do not want resolved
    /// notices; `None` when nothing fires (nothing left to say).
    pub fn without_resolved(&self) -> Option<Notification> {
        if self.firing.is_empty() {
            return None;
        }
        let mut n = self.clone();
        n.resolved.clear();
        n.common_labels = common_labels(n.firing.iter());
        Some(n)
    }
}

#[derive(Debug, Clone)]
enum GroupBy {
    Labels(Vec<String>),
    All,
}

/// A route with every setting resolved (children inherit the root's).
#[derive(Debug, Clone)]
struct Route {
    index: usize,
    receiver: String,
    group_by: GroupBy,
    group_wait_ms: i64,
    group_interval_ms: i64,
    repeat_interval_ms: i64,
    send_resolved: Option<bool>,
}

#[derive(Debug, Clone)]
struct ChildRoute {
    matchers: Vec<Matcher>,
    route: Route,
    continue_: bool,
}

fn group_by(labels: &[String]) -> GroupBy {
    if labels.iter().any(|l| l == "...") {
        GroupBy::All
    } else {
        GroupBy::Labels(labels.to_vec())
    }
}

/// The last message a group sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct NotifyLog {
    at_ms: i64,
    firing: BTreeSet<String>,
    resolved: BTreeSet<String>,
    actions: BTreeSet<String>,
}

/// One aggregation group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Group {
    receiver: String,
    route: usize,
    labels: BTreeMap<String, String>,
    created_at_ms: i64,
    next_flush_ms: i64,
    log: Option<NotifyLog>,
}

/// The dispatcher's persisted state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DispatchState {
    groups: BTreeMap<String, Group>,
}

/// Silences, inhibition, routing, grouping and timing.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    root: Route,
    children: Vec<ChildRoute>,
    inhibit: Vec<InhibitRuleConfig>,
    state: DispatchState,
}

impl Dispatcher {
    /// A dispatcher for a validated route tree and inhibition rules, with no groups yet.
    pub fn new(route: &RouteConfig, inhibit: Vec<InhibitRuleConfig>) -> Self {
        let root = Route {
            index: 0,
            receiver: route.receiver.clone(),
            group_by: group_by(&route.group_by),
            group_wait_ms: route.group_wait.as_ms(),
            group_interval_ms: route.group_interval.as_ms(),
            repeat_interval_ms: route.repeat_interval.as_ms(),
            send_resolved: route.send_resolved,
        };
        let children = route
            .routes
            .iter()
            .enumerate()
            .map(|(i, c)| ChildRoute {
                matchers: c.matchers.clone(),
                continue_: c.continue_,
                route: Route {
                    index: i + 1,
                    receiver: c.receiver.clone().unwrap_or_else(|| root.receiver.clone()),
                    group_by: c
                        .group_by
                        .as_deref()
                        .map_or(root.group_by.clone(), group_by),
                    group_wait_ms: c.group_wait.map_or(root.group_wait_ms, |d| d.as_ms()),
                    group_interval_ms: c
                        .group_interval
                        .map_or(root.group_interval_ms, |d| d.as_ms()),
                    repeat_interval_ms: c
                        .repeat_interval
                        .map_or(root.repeat_interval_ms, |d| d.as_ms()),
                    send_resolved: c.send_resolved.or(root.send_resolved),
                },
            })
            .collect();
        Self {
            root,
            children,
            inhibit,
            state: DispatchState::default(),
        }
    }

    /// Restores persisted groups.
    pub fn with_state(mut self, state: DispatchState) -> Self {
        self.state = state;
        self
    }

    /// The state to persist.
    pub fn state(&self) -> &DispatchState {
        &self.state
    }

    /// The routes an alert goes to: matching children in order (stopping at the first
    /// without `continue`), or the root when none matches.
    fn routes(&self, labels: &BTreeMap<String, String>) -> Vec<&Route> {
        let mut out = Vec::new();
        for child in &self.children {
            if matches_all(&child.matchers, labels) {
                out.push(&child.route);
                if !child.continue_ {
                    break;
                }
            }
        }
        if out.is_empty() {
            out.push(&self.root);
        }
        out
    }

    /// Indexes the firing alerts that can inhibit: per inhibit rule, the sources by their
    /// `equal` label values. Built once per step, so muting n alerts costs n lookups, not n².
    fn inhibit_index<'a>(
        &self,
        alerts: &[&'a Alert],
    ) -> Vec<BTreeMap<Vec<&'a str>, Vec<&'a AlertKey>>> {
        self.inhibit
            .iter()
            .map(|rule| {
                let mut sources: BTreeMap<Vec<&str>, Vec<&AlertKey>> = BTreeMap::new();
                for a in alerts.iter().copied() {
                    if a.state == AlertState::Firing
                        && matches_all(&rule.source_matchers, &a.labels)
                    {
                        sources
                            .entry(equal_values(&rule.equal, a))
                            .or_default()
                            .push(&a.key);
                    }
                }
                sources
            })
            .collect()
    }

    /// True when a firing alert other than `target` inhibits it.
    fn inhibited(&self, target: &Alert, index: &[BTreeMap<Vec<&str>, Vec<&AlertKey>>]) -> bool {
        self.inhibit.iter().zip(index).any(|(rule, sources)| {
            matches_all(&rule.target_matchers, &target.labels)
                && sources
                    .get(&equal_values(&rule.equal, target))
                    .is_some_and(|keys| keys.iter().any(|k| **k != target.key))
        })
    }

    /// Why each alert is not notified right now (`silenced by s-3`, `inhibited`), or `None`
    /// when it is, in the order given. For the API.
    pub fn muted_by(
        &self,
        alerts: &[&Alert],
        silences: &Silences,
        now_ms: i64,
    ) -> Vec<Option<String>> {
        let index = self.inhibit_index(alerts);
        alerts
            .iter()
            .map(|a| {
                if let Some(id) = silences.muting(&a.labels, now_ms) {
                    Some(format!("silenced by {id}"))
                } else {
                    self.inhibited(a, &index).then(|| "inhibited".to_owned())
                }
            })
            .collect()
    }

    /// The earliest time a group has something to do, for the caller's timer.
    pub fn next_wakeup(&self) -> Option<i64> {
        self.state.groups.values().map(|g| g.next_flush_ms).min()
    }

    /// One step at `now_ms` over all alerts (pending ones are ignored).
    pub fn step(
        &mut self,
        alerts: &[&Alert],
        silences: &Silences,
        now_ms: i64,
    ) -> Vec<Notification> {
        let index = self.inhibit_index(alerts);
        // Members of each group this step, keyed like the persisted groups.
        let mut members: BTreeMap<String, Members<'_>> = BTreeMap::new();
        for alert in alerts {
            if !matches!(alert.state, AlertState::Firing | AlertState::Resolved)
                || silences.muting(&alert.labels, now_ms).is_some()
                || self.inhibited(alert, &index)
            {
                continue;
            }
            for route in self.routes(&alert.labels) {
                if route.receiver.is_empty() {
                    continue;
                }
                let labels = match &route.group_by {
                    GroupBy::All => alert.labels.clone(),
                    GroupBy::Labels(names) => names
                        .iter()
                        .filter_map(|n| alert.labels.get(n).map(|v| (n.clone(), v.clone())))
                        .collect(),
                };
                let key = group_key(route, &labels);
                members
                    .entry(key)
                    .or_insert_with(|| (route.clone(), labels, Vec::new()))
                    .2
                    .push(alert);
            }
        }

        let mut out = Vec::new();
        let keys: BTreeSet<String> = self
            .state
            .groups
            .keys()
            .cloned()
            .chain(members.keys().cloned())
            .collect();
        for key in keys {
            let Some((route, labels, alerts)) = members.remove(&key) else {
                // Nothing left in the group (all resolved and dropped, silenced or inhibited).
                self.state.groups.remove(&key);
                continue;
            };
            let group = match self.state.groups.get_mut(&key) {
                Some(g) => g,
                None => {
                    if !alerts.iter().any(|a| a.state == AlertState::Firing) {
                        continue;
                    }
                    self.state.groups.entry(key.clone()).or_insert(Group {
                        receiver: route.receiver.clone(),
                        route: route.index,
                        labels: labels.clone(),
                        created_at_ms: now_ms,
                        next_flush_ms: now_ms.saturating_add(route.group_wait_ms),
                        log: None,
                    })
                }
            };
            if now_ms < group.next_flush_ms {
                continue;
            }
            let notified_firing = group.log.as_ref().map(|l| &l.firing);
            let firing: Vec<Alert> = alerts
                .iter()
                .filter(|a| a.state == AlertState::Firing)
                .map(|a| (*a).clone())
                .collect();
            // Resolved alerts belong to the group if it reported them firing, or they
            // resolved after it was created (an alert that came and went inside group_wait).
            let resolved: Vec<Alert> = alerts
                .iter()
                .filter(|a| a.state == AlertState::Resolved)
                .filter(|a| {
                    notified_firing.is_some_and(|f| f.contains(&a.episode()))
                        || a.resolved_at_ms.is_some_and(|t| t >= group.created_at_ms)
                })
                .filter(|a| {
                    !group
                        .log
                        .as_ref()
                        .is_some_and(|l| l.resolved.contains(&a.episode()))
                })
                .map(|a| (*a).clone())
                .collect();
            let firing_ids: BTreeSet<String> = firing.iter().map(Alert::episode).collect();
            let resolved_ids: BTreeSet<String> = resolved.iter().map(Alert::episode).collect();
            let mut actions: Vec<String> = Vec::new();
            for line in firing
                .iter()
                .chain(&resolved)
                .flat_map(|a| &a.actions_taken)
            {
                if !actions.contains(line) {
                    actions.push(line.clone());
                }
            }
            let send_resolved = route.send_resolved != Some(false);
            let needs = match &group.log {
                None => !firing.is_empty(),
                Some(log) => {
                    !firing_ids.is_subset(&log.firing)
                        || (firing.is_empty() && !log.firing.is_empty())
                        || (send_resolved && !resolved_ids.is_empty())
                        || actions.iter().any(|a| !log.actions.contains(a))
                        || (!firing.is_empty()
                            && now_ms.saturating_sub(log.at_ms) >= route.repeat_interval_ms)
                }
            };
            if needs && (!firing.is_empty() || (send_resolved && !resolved.is_empty())) {
                let resolved = if send_resolved { resolved } else { Vec::new() };
                out.push(Notification {
                    receiver: group.receiver.clone(),
                    group_key: key.clone(),
                    group_labels: group.labels.clone(),
                    common_labels: common_labels(firing.iter().chain(&resolved)),
                    firing,
                    resolved,
                    actions_taken: actions.clone(),
                    at_ms: now_ms,
                });
            }
            if needs {
                let mut log = group.log.take().unwrap_or_default();
                log.at_ms = now_ms;
                log.firing = firing_ids.clone();
                log.actions = actions.into_iter().collect();
                log.resolved.extend(resolved_ids);
                group.log = Some(log);
            }
            if let Some(log) = group.log.as_mut() {
                // Forget resolved alerts the engine has dropped; the set stays small.
                log.resolved
                    .retain(|id| alerts.iter().any(|a| a.episode() == *id));
            }
            group.next_flush_ms = now_ms.saturating_add(route.group_interval_ms);
            if firing_ids.is_empty() {
                // Everything resolved and reported: the group is done.
                self.state.groups.remove(&key);
            }
        }
        out
    }
}

/// One group's route, grouping labels and alerts in this step.
type Members<'a> = (Route, BTreeMap<String, String>, Vec<&'a Alert>);

fn group_key(route: &Route, labels: &BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    format!("{}:{}:{{{}}}", route.index, route.receiver, pairs.join(","))
}

/// The values of the `equal` labels (absent as ""), which must agree for an inhibition.
fn equal_values<'a>(equal: &[String], alert: &'a Alert) -> Vec<&'a str> {
    equal
        .iter()
        .map(|l| alert.labels.get(l).map_or("", String::as_str))
        .collect()
}

fn common_labels<'a>(mut alerts: impl Iterator<Item = &'a Alert>) -> BTreeMap<String, String> {
    let Some(first) = alerts.next() else {
        return BTreeMap::new();
    };
    let mut common = first.labels.clone();
    for alert in alerts {
        common.retain(|k, v| alert.labels.get(k) == Some(v));
    }
    common
}

#[cfg(test)]
mod tests;
