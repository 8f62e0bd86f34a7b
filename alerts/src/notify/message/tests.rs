use super::*;
use crate::alert::{AlertKey, AlertState};
use crate::rules::Severity;

fn alert(node: &str, gpu: u32, simulated: bool, state: AlertState) -> Alert {
    let labels = BTreeMap::from([
        ("alertname".to_string(), "XidResetGpu".to_string()),
        ("severity".to_string(), "critical".to_string()),
        ("node".to_string(), node.to_string()),
        ("gpu".to_string(), gpu.to_string()),
        ("simulated".to_string(), simulated.to_string()),
    ]);
    Alert {
        key: AlertKey::of(&labels),
        rule: "XidResetGpu".into(),
        labels,
        values: BTreeMap::from([("xid".to_string(), 79.0)]),
        severity: Severity::Critical,
        summary: format!("XID 79 on {node} GPU {gpu}"),
        description: "The GPU fell off the bus.".into(),
        state,
        active_at_ms: 1_700_000_000_000,
        fired_at_ms: Some(1_700_000_000_000),
        resolved_at_ms: (state == AlertState::Resolved).then_some(1_700_000_600_000),
        last_seen_ms: 1_700_000_000_000,
        keep_firing_since_ms: None,
        actions: Vec::new(),
        actions_taken: vec!["Drained n3: no new jobs start there.".into()],
    }
}

fn notification(firing: Vec<Alert>, resolved: Vec<Alert>) -> Notification {
    let mut common = firing
        .first()
        .or(resolved.first())
        .map(|a| a.labels.clone())
        .unwrap_or_default();
    for a in firing.iter().chain(&resolved) {
        common.retain(|k, v| a.labels.get(k) == Some(v));
    }
    Notification {
        receiver: "ops".into(),
        group_key: "0:ops:{alertname=\"XidResetGpu\",node=\"n3\"}".into(),
        group_labels: BTreeMap::from([
            ("alertname".to_string(), "XidResetGpu".to_string()),
            ("node".to_string(), "n3".to_string()),
        ]),
        common_labels: common,
        firing,
        resolved,
        actions_taken: vec![
            "Drained n3: no new jobs start there.".into(),
            "Requeued the jobs of n3.".into(),
        ],
        at_ms: 1_700_000_030_000,
    }
}

#[test]
fn subject_says_status_count_group_and_severity() {
    let n = notification(
        vec![
            alert("n3", 0, false, AlertState::Firing),
            alert("n3", 1, false, AlertState::Firing),
        ],
        vec![],
    );
    assert_eq!(subject(&n), "[FIRING:2] XidResetGpu n3 (critical)");
    let n = notification(vec![], vec![alert("n3", 0, false, AlertState::Resolved)]);
    assert_eq!(subject(&n), "[RESOLVED] XidResetGpu n3 (critical)");
    let n = notification(vec![alert("n3", 0, true, AlertState::Firing)], vec![]);
    assert_eq!(
        subject(&n),
        "[FIRING:1] XidResetGpu n3 (critical) [simulated]"
    );
}

#[test]
fn body_says_what_happened_where_and_what_perch_did() {
    let n = notification(
        vec![alert("n3", 0, false, AlertState::Firing)],
        vec![alert("n3", 5, false, AlertState::Resolved)],
    );
    let body = text(&n);
    for needle in [
        "1 alert firing:",
        "* XID 79 on n3 GPU 0",
        "  The GPU fell off the bus.",
        "  firing since 2023-11-14 22:13:20 UTC",
        "  labels: gpu=0, node=n3, simulated=false",
        "  values: xid=79",
        "What perch did:\n* Drained n3: no new jobs start there.\n* Requeued the jobs of n3.",
        "1 alert resolved:",
        "* XID 79 on n3 GPU 5",
        "  firing 2023-11-14 22:13:20 UTC to 2023-11-14 22:23:20 UTC",
        "receiver ops",
    ] {
        assert!(body.contains(needle), "missing {needle:?} in:\n{body}");
    }
    assert!(!body.contains("SIMULATED"));
    let mut quiet = n.clone();
    quiet.actions_taken.clear();
    assert!(text(&quiet).contains("* No automatic action"));
    let sim = notification(vec![alert("n3", 0, true, AlertState::Firing)], vec![]);
    assert!(text(&sim).starts_with("These alerts come from SIMULATED data"));
}

#[test]
fn webhook_json_has_alertmanagers_shape() {
    let n = notification(
        vec![alert("n3", 0, false, AlertState::Firing)],
        vec![alert("n3", 5, false, AlertState::Resolved)],
    );
    let v = webhook_json(&n, 0);
    assert_eq!(v["version"], "4");
    assert_eq!(v["status"], "firing");
    assert_eq!(v["receiver"], "ops");
    assert_eq!(v["groupLabels"]["node"], "n3");
    assert_eq!(v["commonLabels"]["alertname"], "XidResetGpu");
    assert!(v["commonLabels"].get("gpu").is_none());
    assert_eq!(
        v["commonAnnotations"]["description"],
        "The GPU fell off the bus."
    );
    assert!(v["commonAnnotations"].get("summary").is_none());
    assert_eq!(v["truncatedAlerts"], 0);
    let alerts = v["alerts"].as_array().expect("alerts");
    assert_eq!(alerts.len(), 2);
    assert_eq!(alerts[0]["status"], "firing");
    assert_eq!(alerts[0]["startsAt"], "2023-11-14T22:13:20.000Z");
    assert_eq!(alerts[0]["endsAt"], "0001-01-01T00:00:00Z");
    assert_eq!(alerts[1]["endsAt"], "2023-11-14T22:23:20.000Z");
    assert_eq!(alerts[0]["annotations"]["summary"], "XID 79 on n3 GPU 0");
    assert_eq!(alerts[0]["values"]["xid"], 79.0);
    assert_eq!(v["actionsTaken"][1], "Requeued the jobs of n3.");
    let truncated = webhook_json(&n, 1);
    assert_eq!(truncated["truncatedAlerts"], 1);
    assert_eq!(truncated["alerts"].as_array().map(Vec::len), Some(1));
}

#[test]
fn slack_text_has_subject_alerts_and_actions() {
    let n = notification(vec![alert("n3", 0, false, AlertState::Firing)], vec![]);
    let v = slack_json(&n);
    assert_eq!(
        v["text"],
        "*[FIRING:1] XidResetGpu n3 (critical)*\n• XID 79 on n3 GPU 0\nperch did:\n• Drained n3: no new jobs start there.\n• Requeued the jobs of n3."
    );
}
