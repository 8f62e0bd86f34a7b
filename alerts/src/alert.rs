//! An alert: one instance of one rule, identified by its full label set, with its state and
//! what perch did about it.

use crate::rules::{ActionSpec, Severity};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// The Prometheus alert states. `Inactive` only appears in transitions: an inactive alert is
/// not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlertState {
    /// Not present (or no longer present before it fired).
    Inactive,
    /// Present, waiting out the rule's `for`.
    Pending,
    /// Present for at least `for`: notified and remediated.
    Firing,
    /// Was firing, no longer present (kept a while so the resolved notice can go out).
    Resolved,
}

impl AlertState {
    /// The name used in the API, events and `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Inactive => "inactive",
            Self::Pending => "pending",
            Self::Firing => "firing",
            Self::Resolved => "resolved",
        }
    }
}

impl fmt::Display for AlertState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An alert's identity: a stable 64-bit FNV-1a hash of its label set, in hex. Stable across
/// processes and versions (unlike `std`'s hasher), because it is persisted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AlertKey(pub String);

impl AlertKey {
    /// The fingerprint of a label set.
    pub fn of(labels: &BTreeMap<String, String>) -> Self {
        const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        let mut hash = OFFSET;
        for (name, value) in labels {
            for byte in name
                .bytes()
                .chain([0xff])
                .chain(value.bytes())
                .chain([0xff])
            {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(PRIME);
            }
        }
        Self(format!("{hash:016x}"))
    }
}

impl fmt::Display for AlertKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One alert, as the API lists it and notifications carry it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alert {
    /// Fingerprint of `labels`.
    pub key: AlertKey,
    /// The rule that produced it.
    pub rule: String,
    /// Identity: the instance's labels, the rule's labels, `alertname` and `severity`.
    pub labels: BTreeMap<String, String>,
    /// Latest measurements.
    pub values: BTreeMap<String, f64>,
    /// The rule's severity.
    pub severity: Severity,
    /// Rendered summary template.
    pub summary: String,
    /// Rendered description template.
    pub description: String,
    /// Current state.
    pub state: AlertState,
    /// When this episode began (first seen pending); also tells episodes apart.
    pub active_at_ms: i64,
    /// When it started firing.
    pub fired_at_ms: Option<i64>,
    /// When it resolved.
    pub resolved_at_ms: Option<i64>,
    /// The last evaluation that returned it.
    pub last_seen_ms: i64,
    /// Since when it has been absent while `keep_firing_for` holds it firing.
    pub keep_firing_since_ms: Option<i64>,
    /// Remediation its rule asks for.
    pub actions: Vec<ActionSpec>,
    /// What perch did about it, one line each, for notifications and the API.
    pub actions_taken: Vec<String>,
}

impl Alert {
    /// Identifies this episode of the alert: the same labels firing again after resolving
    /// are a new episode, notified and remediated anew.
    pub fn episode(&self) -> String {
        format!("{}@{}", self.key, self.active_at_ms)
    }

    /// The node the alert is about, when it has a `node` label.
    pub fn node(&self) -> Option<&str> {
        self.labels.get("node").map(String::as_str)
    }

    /// True when built on simulated data (`simulated="true"` label).
    pub fn simulated(&self) -> bool {
        self.labels.get("simulated").is_some_and(|v| v == "true")
    }

    /// Adds a line to `actions_taken` unless it is already there.
    pub fn annotate(&mut self, line: &str) {
        if !self.actions_taken.iter().any(|l| l == line) {
            self.actions_taken.push(line.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_is_stable_and_separates_label_sets() {
        let a = BTreeMap::from([("node".to_string(), "n1".to_string())]);
        let b = BTreeMap::from([("node".to_string(), "n2".to_string())]);
        // Moving a byte between name and value must change the hash.
        let c = BTreeMap::from([("noden".to_string(), "1".to_string())]);
        assert_eq!(AlertKey::of(&a), AlertKey::of(&a.clone()));
        assert_ne!(AlertKey::of(&a), AlertKey::of(&b));
        assert_ne!(AlertKey::of(&a), AlertKey::of(&c));
        // Pinned: a persisted key must not change between versions.
        assert_eq!(AlertKey::of(&BTreeMap::new()).0, "cbf29ce484222325");
        assert_eq!(AlertKey::of(&a).0.len(), 16);
    }
}
