//! What a notification says: the email subject and plain-text body, Alertmanager's webhook
//! JSON, and Slack's text. One place, so every channel tells the same story: what happened,
//! on which nodes, GPUs and jobs, and what perch did about it.

use crate::alert::Alert;
use crate::dispatch::Notification;
use crate::template::format_value;
use crate::timefmt::{rfc3339, utc};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Labels shown in a message's header rather than in each alert's label line.
const HEADER_LABELS: &[&str] = &["alertname", "severity"];

/// `[FIRING:50] XidResetGpu node-3 (critical)`: status and count, the grouping labels'
/// values (alertname first), the common severity, and `[simulated]` when every alert is
/// built on simulated data.
pub fn subject(n: &Notification) -> String {
    let mut out = match n.status() {
        "firing" => format!("[FIRING:{}]", n.firing.len()),
        _ => "[RESOLVED]".to_owned(),
    };
    if let Some(name) = n.group_labels.get("alertname") {
        let _ = write!(out, " {name}");
    }
    for (k, v) in &n.group_labels {
        if k != "alertname" {
            let _ = write!(out, " {v}");
        }
    }
    if n.group_labels.is_empty()
        && let Some(name) = n.common_labels.get("alertname")
    {
        let _ = write!(out, " {name}");
    }
    if let Some(severity) = n.common_labels.get("severity") {
        let _ = write!(out, " ({severity})");
    }
    if all_simulated(n) {
        out.push_str(" [simulated]");
    }
    out
}

fn all_simulated(n: &Notification) -> bool {
    let mut alerts = n.firing.iter().chain(&n.resolved).peekable();
    alerts.peek().is_some() && alerts.all(Alert::simulated)
}

fn label_line(alert: &Alert) -> String {
    alert
        .labels
        .iter()
        .filter(|(k, _)| !HEADER_LABELS.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn value_line(alert: &Alert) -> String {
    alert
        .values
        .iter()
        .map(|(k, v)| format!("{k}={}", format_value(*v)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn write_alert(out: &mut String, alert: &Alert, resolved: bool) {
    let title = if alert.summary.is_empty() {
        alert.rule.as_str()
    } else {
        alert.summary.as_str()
    };
    let _ = writeln!(out, "* {title}");
    if !alert.description.is_empty() {
        let _ = writeln!(out, "  {}", alert.description);
    }
    let since = alert.fired_at_ms.unwrap_or(alert.active_at_ms);
    match (resolved, alert.resolved_at_ms) {
        (true, Some(at)) => {
            let _ = writeln!(out, "  firing {} to {}", utc(since), utc(at));
        }
        _ => {
            let _ = writeln!(out, "  firing since {}", utc(since));
        }
    }
    let labels = label_line(alert);
    if !labels.is_empty() {
        let _ = writeln!(out, "  labels: {labels}");
    }
    let values = value_line(alert);
    if !values.is_empty() {
        let _ = writeln!(out, "  values: {values}");
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The plain-text body: the alerts (firing, then resolved) and what perch did.
pub fn text(n: &Notification) -> String {
    let mut out = String::new();
    if all_simulated(n) {
        out.push_str(
            "These alerts come from SIMULATED data (perch's simulator), not hardware.\n\n",
        );
    }
    if !n.firing.is_empty() {
        let _ = writeln!(
            out,
            "{} firing:\n",
            plural(n.firing.len(), "alert", "alerts")
        );
        for alert in &n.firing {
            write_alert(&mut out, alert, false);
        }
        out.push('\n');
    }
    out.push_str("What perch did:\n");
    if n.actions_taken.is_empty() {
        out.push_str(
            "* No automatic action: the rules behind these alerts have none, or none was needed.\n",
        );
    } else {
        for line in &n.actions_taken {
            let _ = writeln!(out, "* {line}");
        }
    }
    out.push('\n');
    if !n.resolved.is_empty() {
        let _ = writeln!(
            out,
            "{} resolved:\n",
            plural(n.resolved.len(), "alert", "alerts")
        );
        for alert in &n.resolved {
            write_alert(&mut out, alert, true);
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "-- perch alerting, receiver {}, group {}, sent {}",
        n.receiver,
        n.group_key,
        utc(n.at_ms)
    );
    out
}

fn annotations(alert: &Alert) -> BTreeMap<String, String> {
    let mut a = BTreeMap::new();
    if !alert.summary.is_empty() {
        a.insert("summary".to_owned(), alert.summary.clone());
    }
    if !alert.description.is_empty() {
        a.insert("description".to_owned(), alert.description.clone());
    }
    a
}

fn alert_json(alert: &Alert, resolved: bool) -> Value {
    json!({
        "status": if resolved { "resolved" } else { "firing" },
        "labels": alert.labels,
        "annotations": annotations(alert),
        "startsAt": rfc3339(alert.fired_at_ms.unwrap_or(alert.active_at_ms)),
        // Alertmanager's zero time for an alert that has not ended.
        "endsAt": match (resolved, alert.resolved_at_ms) {
            (true, Some(at)) => rfc3339(at),
            _ => "0001-01-01T00:00:00Z".to_owned(),
        },
        "generatorURL": "",
        "fingerprint": alert.key.0,
        "values": alert.values,
        "actionsTaken": alert.actions_taken,
    })
}

/// Alertmanager's webhook payload (version 4), so receivers written for Alertmanager work
/// unchanged, plus `actionsTaken` (group and per alert) and `values` per alert. At most
/// `max_alerts` alerts when it is above 0, with `truncatedAlerts` counting the rest.
pub fn webhook_json(n: &Notification, max_alerts: usize) -> Value {
    let all: Vec<Value> = n
        .firing
        .iter()
        .map(|a| alert_json(a, false))
        .chain(n.resolved.iter().map(|a| alert_json(a, true)))
        .collect();
    let total = all.len();
    let keep = if max_alerts == 0 {
        total
    } else {
        max_alerts.min(total)
    };
    let mut common_annotations: Option<BTreeMap<String, String>> = None;
    for alert in n.firing.iter().chain(&n.resolved) {
        let a = annotations(alert);
        common_annotations = Some(match common_annotations {
            None => a,
            Some(mut c) => {
                c.retain(|k, v| a.get(k) == Some(v));
                c
            }
        });
    }
    json!({
        "version": "4",
        "groupKey": n.group_key,
        "truncatedAlerts": total - keep,
        "status": n.status(),
        "receiver": n.receiver,
        "groupLabels": n.group_labels,
        "commonLabels": n.common_labels,
        "commonAnnotations": common_annotations.unwrap_or_default(),
        "externalURL": "",
        "alerts": all.into_iter().take(keep).collect::<Vec<_>>(),
        "actionsTaken": n.actions_taken,
    })
}

/// Slack's incoming-webhook body: the subject in bold, one line per alert, what perch did.
pub fn slack_json(n: &Notification) -> Value {
    let mut text = format!("*{}*\n", subject(n));
    for alert in &n.firing {
        let _ = writeln!(
            text,
            "• {}",
            if alert.summary.is_empty() {
                &alert.rule
            } else {
                &alert.summary
            }
        );
    }
    for alert in &n.resolved {
        let _ = writeln!(
            text,
            "• resolved: {}",
            if alert.summary.is_empty() {
                &alert.rule
            } else {
                &alert.summary
            }
        );
    }
    if !n.actions_taken.is_empty() {
        text.push_str("perch did:\n");
        for line in &n.actions_taken {
            let _ = writeln!(text, "• {line}");
        }
    }
    json!({ "text": text.trim_end() })
}

#[cfg(test)]
mod tests;
