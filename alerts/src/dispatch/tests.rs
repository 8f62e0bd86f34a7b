use super::*;
use crate::duration::HumanDuration;
use crate::rules::Severity;
use crate::silence::SilenceRequest;

const S: i64 = 1_000;
const M: i64 = 60 * S;

fn route(receiver: &str) -> RouteConfig {
    RouteConfig {
        receiver: receiver.into(),
        group_wait: HumanDuration::from_secs(30),
        group_interval: HumanDuration::from_mins(5),
        repeat_interval: HumanDuration::from_mins(240),
        ..RouteConfig::default()
    }
}

fn alert(name: &str, pairs: &[(&str, &str)], state: AlertState, at: i64) -> Alert {
    let mut labels: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    labels.insert("alertname".into(), name.into());
    labels.insert("severity".into(), "critical".into());
    Alert {
        key: AlertKey::of(&labels),
        rule: name.into(),
        labels,
        values: BTreeMap::new(),
        severity: Severity::Critical,
        summary: format!("{name} summary"),
        description: String::new(),
        state,
        active_at_ms: at,
        fired_at_ms: Some(at),
        resolved_at_ms: None,
        last_seen_ms: at,
        keep_firing_since_ms: None,
        actions: Vec::new(),
        actions_taken: Vec::new(),
    }
}

fn resolve(mut a: Alert, at: i64) -> Alert {
    a.state = AlertState::Resolved;
    a.resolved_at_ms = Some(at);
    a
}

fn step(d: &mut Dispatcher, alerts: &[Alert], silences: &Silences, now: i64) -> Vec<Notification> {
    let refs: Vec<&Alert> = alerts.iter().collect();
    d.step(&refs, silences, now)
}

/// Steps at 0 (the group forms and waits) and at 30 s (group_wait over).
fn first_message(d: &mut Dispatcher, alerts: &[Alert], silences: &Silences) -> Vec<Notification> {
    assert!(
        step(d, alerts, silences, 0).is_empty(),
        "group_wait holds the first message"
    );
    step(d, alerts, silences, 30 * S)
}

fn xid(node: &str, gpu: u32, at: i64) -> Alert {
    alert(
        "XidResetGpu",
        &[("node", node), ("gpu", &gpu.to_string())],
        AlertState::Firing,
        at,
    )
}

#[test]
fn waits_group_wait_then_sends_one_message_for_fifty_gpus() {
    let mut d = Dispatcher::new(&route("ops"), Vec::new());
    let none = Silences::default();
    let mut alerts: Vec<Alert> = (0..50).map(|g| xid("n1", g, 0)).collect();
    alerts.push(xid("n2", 0, 0));
    assert!(step(&mut d, &alerts, &none, 0).is_empty(), "group_wait");
    assert!(
        step(&mut d, &alerts, &none, 29 * S).is_empty(),
        "group_wait"
    );
    let sent = step(&mut d, &alerts, &none, 30 * S);
    assert_eq!(sent.len(), 2, "one message per node: {sent:#?}");
    let n1 = sent
        .iter()
        .find(|n| n.group_labels.get("node").map(String::as_str) == Some("n1"))
        .expect("n1 group");
    assert_eq!(n1.firing.len(), 50);
    assert_eq!(n1.receiver, "ops");
    assert_eq!(n1.group_labels["alertname"], "XidResetGpu");
    assert_eq!(n1.common_labels["node"], "n1");
    assert!(!n1.common_labels.contains_key("gpu"));
    // Nothing new: silent until the repeat interval.
    assert!(step(&mut d, &alerts, &none, 30 * S + 5 * M).is_empty());
    assert!(step(&mut d, &alerts, &none, 30 * S + 235 * M).is_empty());
    let repeat = step(&mut d, &alerts, &none, 30 * S + 240 * M);
    assert_eq!(repeat.len(), 2, "repeat_interval");
}

#[test]
fn a_new_alert_in_a_sent_group_waits_for_group_interval() {
    let mut d = Dispatcher::new(&route("ops"), Vec::new());
    let none = Silences::default();
    let mut alerts = vec![xid("n1", 0, 0)];
    assert_eq!(first_message(&mut d, &alerts, &none).len(), 1);
    alerts.push(xid("n1", 1, 60 * S));
    assert!(step(&mut d, &alerts, &none, 60 * S).is_empty());
    assert_eq!(d.next_wakeup(), Some(30 * S + 5 * M));
    let sent = step(&mut d, &alerts, &none, 30 * S + 5 * M);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].firing.len(), 2);
}

#[test]
fn resolved_notice_once_everything_resolves() {
    let mut d = Dispatcher::new(&route("ops"), Vec::new());
    let none = Silences::default();
    let a = xid("n1", 0, 0);
    assert_eq!(
        first_message(&mut d, std::slice::from_ref(&a), &none).len(),
        1
    );
    let resolved = resolve(a, M);
    assert!(
        step(&mut d, std::slice::from_ref(&resolved), &none, 2 * M).is_empty(),
        "waits for group_interval"
    );
    let sent = step(
        &mut d,
        std::slice::from_ref(&resolved),
        &none,
        30 * S + 5 * M,
    );
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].status(), "resolved");
    assert_eq!(sent[0].resolved.len(), 1);
    assert!(sent[0].firing.is_empty());
    assert!(
        sent[0].without_resolved().is_none(),
        "email without send_resolved sends nothing"
    );
    // Said once.
    assert!(step(&mut d, &[resolved], &none, 30 * S + 20 * M).is_empty());
    assert_eq!(d.next_wakeup(), None, "the group is gone");
}

#[test]
fn route_send_resolved_false_sends_no_resolved_notice() {
    let mut r = route("ops");
    r.send_resolved = Some(false);
    let mut d = Dispatcher::new(&r, Vec::new());
    let none = Silences::default();
    let a = xid("n1", 0, 0);
    assert_eq!(
        first_message(&mut d, std::slice::from_ref(&a), &none).len(),
        1
    );
    assert!(step(&mut d, &[resolve(a, M)], &none, 30 * S + 5 * M).is_empty());
}

#[test]
fn an_alert_that_came_and_went_inside_group_wait_is_not_sent() {
    let mut d = Dispatcher::new(&route("ops"), Vec::new());
    let none = Silences::default();
    let a = xid("n1", 0, 0);
    assert!(step(&mut d, std::slice::from_ref(&a), &none, 0).is_empty());
    assert!(step(&mut d, &[resolve(a, 10 * S)], &none, 30 * S).is_empty());
}

#[test]
fn silence_suppresses_and_its_expiry_lets_the_alert_through() {
    let mut d = Dispatcher::new(&route("ops"), Vec::new());
    let mut silences = Silences::default();
    silences
        .add(
            SilenceRequest {
                matchers: vec![Matcher::parse(r#"node="n1""#).expect("matcher")],
                starts_at_ms: None,
                ends_at_ms: Some(10 * M),
                duration: None,
                created_by: "ana".into(),
                comment: "maintenance".into(),
            },
            0,
        )
        .expect("silence");
    let alerts = vec![xid("n1", 0, 0), xid("n2", 0, 0)];
    let sent = first_message(&mut d, &alerts, &silences);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].group_labels["node"], "n2");
    let refs: Vec<&Alert> = alerts.iter().collect();
    assert_eq!(
        d.muted_by(&refs, &silences, 30 * S),
        [Some("silenced by s-1".to_string()), None]
    );
    assert!(step(&mut d, &alerts, &silences, 5 * M).is_empty());
    assert!(
        step(&mut d, &alerts, &silences, 10 * M).is_empty(),
        "new group waits"
    );
    let sent = step(&mut d, &alerts, &silences, 10 * M + 30 * S);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].group_labels["node"], "n1");
}

#[test]
fn node_down_inhibits_its_gpu_alerts_but_not_other_nodes() {
    let mut d = Dispatcher::new(&route("ops"), InhibitRuleConfig::defaults());
    let none = Silences::default();
    let alerts = vec![
        alert(
            "NodeHeartbeatLost",
            &[("node", "n1")],
            AlertState::Firing,
            0,
        ),
        xid("n1", 0, 0),
        xid("n1", 1, 0),
        xid("n2", 0, 0),
    ];
    let sent = first_message(&mut d, &alerts, &none);
    let mut groups: Vec<(String, String)> = sent
        .iter()
        .map(|n| {
            (
                n.group_labels["alertname"].clone(),
                n.group_labels["node"].clone(),
            )
        })
        .collect();
    groups.sort();
    assert_eq!(
        groups,
        [
            ("NodeHeartbeatLost".to_string(), "n1".to_string()),
            ("XidResetGpu".to_string(), "n2".to_string())
        ]
    );
    let refs: Vec<&Alert> = alerts.iter().collect();
    assert_eq!(
        d.muted_by(&refs, &none, 30 * S),
        [
            None,
            Some("inhibited".to_string()),
            Some("inhibited".to_string()),
            None
        ]
    );
    // A resolved source no longer inhibits.
    let mut later = alerts.clone();
    later[0] = resolve(later[0].clone(), M);
    let sent = step(&mut d, &later, &none, 2 * M);
    assert!(sent.is_empty(), "new group waits: {sent:#?}");
    let sent = step(&mut d, &later, &none, 2 * M + 30 * S);
    assert!(
        sent.iter()
            .any(|n| n.group_labels["node"] == "n1" && n.group_labels["alertname"] == "XidResetGpu"),
        "{sent:#?}"
    );
}

#[test]
fn routes_by_account_with_continue_and_fallback() {
    let toml = r#"
        receiver = "ops"
        group_wait = "0s"
        [[routes]]
        matchers = ['account="vision"']
        receiver = "vision-team"
        continue = true
        [[routes]]
        matchers = ['severity="critical"']
        receiver = "pager"
        [[routes]]
        matchers = ['account="nlp"']
        receiver = "nlp-team"
    "#;
    let route: RouteConfig = toml::from_str(toml).expect("route config");
    let mut d = Dispatcher::new(&route, Vec::new());
    let none = Silences::default();
    let mut vision = alert(
        "JobNoProgress",
        &[("account", "vision"), ("job", "7")],
        AlertState::Firing,
        0,
    );
    vision.labels.insert("severity".into(), "warning".into());
    let mut nlp = alert(
        "JobNoProgress",
        &[("account", "nlp"), ("job", "8")],
        AlertState::Firing,
        0,
    );
    nlp.labels.insert("severity".into(), "warning".into());
    let crit_vision = alert(
        "XidReboot",
        &[("account", "vision"), ("node", "n1")],
        AlertState::Firing,
        0,
    );
    let mut other = alert("GpuThrottled", &[("node", "n3")], AlertState::Firing, 0);
    other.labels.insert("severity".into(), "warning".into());
    let alerts = [vision, nlp, crit_vision, other];
    let sent = step(&mut d, &alerts, &none, 0);
    let mut got: Vec<(String, String)> = sent
        .iter()
        .flat_map(|n| {
            n.firing
                .iter()
                .map(|a| (n.receiver.clone(), a.labels["alertname"].clone()))
        })
        .collect();
    got.sort();
    let want: Vec<(String, String)> = [
        ("nlp-team", "JobNoProgress"),
        ("ops", "GpuThrottled"),
        ("pager", "XidReboot"),
        ("vision-team", "JobNoProgress"),
        ("vision-team", "XidReboot"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(got, want);
}

#[test]
fn a_new_remediation_line_is_reported_at_the_next_interval() {
    let mut d = Dispatcher::new(&route("ops"), Vec::new());
    let none = Silences::default();
    let mut a = xid("n1", 0, 0);
    a.actions_taken.push("Drained n1.".into());
    let sent = first_message(&mut d, std::slice::from_ref(&a), &none);
    assert_eq!(sent[0].actions_taken, ["Drained n1."]);
    assert!(step(&mut d, std::slice::from_ref(&a), &none, 30 * S + 5 * M).is_empty());
    a.actions_taken.push("Ran gpu_reset on n1: exit 0.".into());
    let sent = step(&mut d, &[a], &none, 30 * S + 10 * M);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].actions_taken.len(), 2);
}

#[test]
fn no_receiver_means_no_notifications() {
    let mut d = Dispatcher::new(&route(""), Vec::new());
    assert!(step(&mut d, &[xid("n1", 0, 0)], &Silences::default(), M).is_empty());
    assert_eq!(d.next_wakeup(), None);
}

#[test]
fn state_survives_a_round_trip() {
    let mut d = Dispatcher::new(&route("ops"), Vec::new());
    let none = Silences::default();
    let a = xid("n1", 0, 0);
    assert_eq!(
        first_message(&mut d, std::slice::from_ref(&a), &none).len(),
        1
    );
    let json = serde_json::to_string(d.state()).expect("serialize");
    let state: DispatchState = serde_json::from_str(&json).expect("deserialize");
    let mut restored = Dispatcher::new(&route("ops"), Vec::new()).with_state(state);
    assert!(
        step(&mut restored, &[a], &none, 31 * S + 5 * M).is_empty(),
        "no re-notify"
    );
}
