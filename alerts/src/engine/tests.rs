use super::*;
use crate::remediate::{Action, NodeState, NodeView, Outcome};

const S: i64 = 1_000;
const M: i64 = 60 * S;
const H: i64 = 60 * M;

fn config() -> AlertsConfig {
    AlertsConfig::from_toml(
        r#"
        [[receivers]]
        name = "ops"
        [[receivers.webhook]]
        url = "http://127.0.0.1:9/hook"

        [route]
        receiver = "ops"
        group_wait = "30s"

        [[rules]]
        name = "GpuTooHot"
        sql = "SELECT node, gpu, max(temperature_celsius) AS temp FROM gpu_samples GROUP BY node, gpu"
        severity = "warning"
        summary = "{{ labels.node }} GPU {{ labels.gpu }} at {{ values.temp }} °C"
        "#,
    )
    .expect("valid config")
}

fn cluster(n: usize) -> ClusterView {
    ClusterView {
        nodes: (0..n)
            .map(|i| NodeView {
                node: format!("n{i}"),
                state: NodeState::Up,
                running_jobs: 1,
            })
            .collect(),
    }
}

fn xid_79(node: &str, gpu: u32) -> Instance {
    Instance::with_labels([("node", node), ("simulated", "false")])
        .value("gpu", f64::from(gpu))
        .value("xid", 79.0)
        .value("events", 1.0)
}

fn xid_instances(node: &str, gpus: u32) -> Vec<Instance> {
    (0..gpus)
        .map(|g| {
            let mut i = xid_79(node, g);
            i.labels.insert("gpu".into(), g.to_string());
            i.labels.insert("xid".into(), "79".into());
            i
        })
        .collect()
}

/// Runs the server's loop once: remediation (executing and completing every decision),
/// then notifications.
fn tick(engine: &mut Engine, view: &ClusterView, now: i64) -> (Vec<Decision>, Vec<Notification>) {
    let plan = engine.plan_remediation(view, now);
    for d in &plan.decisions {
        if d.outcome == Outcome::Execute {
            let detail = match d.action {
                Action::RequeueJobs { .. } => "Jobs 17 and 18 went back to the queue.",
                _ => "",
            };
            engine.complete(d, &Ok(detail.to_owned()), now);
        }
    }
    (plan.decisions, engine.notifications(now))
}

#[test]
fn an_xid_on_fifty_gpus_drains_once_and_sends_one_message_saying_so() {
    let mut engine = Engine::new(config()).expect("engine");
    let t = engine
        .evaluate("XidReboot", &xid_instances("n3", 50), 0)
        .expect("builtin rule");
    assert_eq!(t.len(), 50);
    assert!(t.iter().all(|t| t.to == AlertState::Firing));
    let (decisions, sent) = tick(&mut engine, &cluster(10), 0);
    let executed: Vec<&str> = decisions
        .iter()
        .filter(|d| d.outcome == Outcome::Execute)
        .map(|d| d.action.name())
        .collect();
    assert_eq!(executed, ["drain_node", "requeue_jobs"]);
    assert!(sent.is_empty(), "group_wait");
    let (_, sent) = tick(&mut engine, &cluster(10), 30 * S);
    assert_eq!(sent.len(), 1);
    let n = &sent[0];
    assert_eq!(n.firing.len(), 50);
    assert_eq!(
        n.actions_taken,
        [
            "Drained n3: no new jobs start there.",
            "Requeued the jobs of n3. Jobs 17 and 18 went back to the queue."
        ]
    );
    assert_eq!(
        crate::notify::message::subject(n),
        "[FIRING:50] XidReboot n3 (critical)"
    );
}

/// An engine whose XidReboot alert on n1 fired and paged once, at 30 s; and that page.
fn paged_once() -> (Engine, Vec<Notification>) {
    let mut engine = Engine::new(config()).expect("engine");
    engine
        .evaluate("XidReboot", &xid_instances("n1", 1), 0)
        .expect("eval");
    tick(&mut engine, &cluster(10), 0);
    let (_, sent) = tick(&mut engine, &cluster(10), 30 * S);
    assert_eq!(sent.len(), 1);
    (engine, sent)
}

#[test]
fn a_restart_does_not_page_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("alerts-state.json");
    let (engine, _) = paged_once();
    engine.save(&path, 31 * S).expect("save");
    drop(engine);

    let (mut engine, resolved) = Engine::load(config(), &path, M).expect("load");
    assert!(resolved.is_empty());
    let mut view = cluster(10);
    view.nodes[1].state = NodeState::Drained;
    // Still firing after the restart: same episode, no transition, no decision, no message
    // until the repeat interval.
    for now in (M..4 * H).step_by(usize::try_from(5 * M).unwrap_or(1)) {
        let t = engine
            .evaluate("XidReboot", &xid_instances("n1", 1), now)
            .expect("eval");
        assert!(t.is_empty(), "{t:?}");
        let (decisions, sent) = tick(&mut engine, &view, now);
        assert!(decisions.is_empty(), "{decisions:?}");
        assert!(sent.is_empty(), "re-notified at {now}: {sent:?}");
    }
    // It resolves: one resolved notice.
    let t = engine.evaluate("XidReboot", &[], 4 * H).expect("eval");
    assert_eq!(t[0].to, AlertState::Resolved);
    let sent: Vec<Notification> = (0..12)
        .flat_map(|i| tick(&mut engine, &view, 4 * H + i * M).1)
        .collect();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].status(), "resolved");
}

#[test]
fn missing_state_file_is_a_fresh_start_and_garbage_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("none.json");
    let (engine, t) = Engine::load(config(), &path, 0).expect("fresh");
    assert!(t.is_empty());
    assert!(engine.alerts(0).is_empty());
    std::fs::write(&path, br#"{"version": 99}"#).expect("write");
    let err = Engine::load(config(), &path, 0)
        .expect_err("garbage")
        .to_string();
    assert!(err.contains("none.json"), "{err}");
}

#[test]
fn a_rule_removed_from_the_config_resolves_on_restore() {
    let mut engine = Engine::new(config()).expect("engine");
    let hot = Instance::with_labels([("node", "n1"), ("gpu", "0")]).value("temp", 95.0);
    engine.evaluate("GpuTooHot", &[hot], 0).expect("eval");
    let snapshot = engine.snapshot(S);
    let mut without = config();
    without.rules.clear();
    let (engine, t) = Engine::restore(without, snapshot, 2 * S).expect("restore");
    assert_eq!(t.len(), 1);
    assert_eq!(
        (t[0].rule.as_str(), t[0].to),
        ("GpuTooHot", AlertState::Resolved)
    );
    assert_eq!(engine.alerts(2 * S)[0].alert.state, AlertState::Resolved);
}

#[test]
fn the_breaker_is_one_alert_notified_once_and_resolved_by_reset() {
    let mut engine = Engine::new(config()).expect("engine");
    let storm: Vec<Instance> = (0..6)
        .flat_map(|i| xid_instances(&format!("n{i}"), 1))
        .collect();
    engine.evaluate("XidReboot", &storm, 0).expect("eval");
    let (decisions, _) = tick(&mut engine, &cluster(10), 0);
    let drained = decisions
        .iter()
        .filter(|d| d.outcome == Outcome::Execute && d.action.name() == "drain_node")
        .count();
    assert_eq!(drained, 2);
    assert!(engine.breaker().is_some());
    let (_, sent) = tick(&mut engine, &cluster(10), 30 * S);
    let breaker: Vec<&Notification> = sent
        .iter()
        .filter(|n| n.group_labels.get("alertname").map(String::as_str) == Some(BREAKER_ALERT))
        .collect();
    assert_eq!(breaker.len(), 1);
    assert!(
        breaker[0].firing[0]
            .description
            .contains("max_fraction_out")
    );
    // A refused node's message says why nothing was done.
    let n4 = sent
        .iter()
        .find(|n| n.group_labels.get("node").map(String::as_str) == Some("n4"))
        .expect("n4 message");
    assert!(
        n4.actions_taken
            .iter()
            .any(|l| l == "Did not drain n4: circuit breaker open."),
        "{:?}",
        n4.actions_taken
    );
    assert!(engine.metrics(30 * S).breaker_open);
    for i in 1..10 {
        let (_, sent) = tick(&mut engine, &cluster(10), 30 * S + i * 5 * M);
        assert!(
            sent.iter()
                .all(|n| n.group_labels["alertname"] != BREAKER_ALERT)
        );
    }
    let reset = engine.reset_breaker("ana", H).expect("open");
    assert_eq!(reset.kind, "circuit_breaker_reset");
    let alert = engine
        .alerts(H)
        .into_iter()
        .find(|a| a.alert.rule == BREAKER_ALERT)
        .expect("breaker alert");
    assert_eq!(alert.alert.state, AlertState::Resolved);
}

#[test]
fn rows_become_alerts_and_bad_rows_are_recorded_as_the_rules_error() {
    let mut engine = Engine::new(config()).expect("engine");
    let rows: Vec<Map<String, Value>> = serde_json::from_value(serde_json::json!([
        {"node": "n1", "gpu": 0, "temp": 95.5},
        {"node": "n1", "gpu": 1, "temp": 96}
    ]))
    .expect("rows");
    let t = engine.evaluate_rows("GpuTooHot", &rows, 0).expect("eval");
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].summary, "n1 GPU 0 at 95.5 °C");
    let bad: Vec<Map<String, Value>> =
        serde_json::from_value(serde_json::json!([{"count(*)": 1}])).expect("rows");
    assert!(engine.evaluate_rows("GpuTooHot", &bad, 10 * S).is_err());
    let status = engine
        .rule_status()
        .into_iter()
        .find(|r| r.name == "GpuTooHot")
        .expect("status");
    assert!(status.last_error.is_some_and(|e| e.contains("alias it")));
    assert_eq!(status.firing, 2, "a failed evaluation keeps the alerts");
    assert!(engine.evaluate("NoSuchRule", &[], 0).is_err());
}

#[test]
fn due_rules_follow_each_rules_interval() {
    let mut engine = Engine::new(config()).expect("engine");
    let all = engine.due_rules(0).len();
    assert_eq!(all, engine.rules().len());
    engine.evaluate("GpuTooHot", &[], 0).expect("eval");
    engine.record_failure("XidReboot", "query timed out", 0);
    let due: Vec<String> = engine
        .due_rules(29 * S)
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert!(!due.contains(&"GpuTooHot".to_string()));
    assert!(!due.contains(&"XidReboot".to_string()));
    assert_eq!(due.len(), all - 2);
    assert!(
        engine
            .due_rules(30 * S)
            .iter()
            .any(|r| r.name == "GpuTooHot")
    );
    assert_eq!(engine.next_wakeup(29 * S), 29 * S, "the others are due now");
}

#[test]
fn metrics_count_pending_and_firing_per_rule_with_zeros() {
    let mut engine = Engine::new(config()).expect("engine");
    engine
        .evaluate("XidReboot", &xid_instances("n1", 2), 0)
        .expect("eval");
    let m = engine.metrics(0);
    let count = |rule: &str, state: &str| {
        m.alerts
            .iter()
            .find(|c| c.alertname == rule && c.state == state)
            .map(|c| c.count)
    };
    assert_eq!(count("XidReboot", "firing"), Some(2));
    assert_eq!(count("XidReboot", "pending"), Some(0));
    assert_eq!(count("GpuTooHot", "firing"), Some(0));
    assert!(!m.breaker_open);
    assert_eq!(m.silences_active, 0);
    serde_json::to_string(&m).expect("serializable");
}

#[test]
fn a_long_group_interval_still_gets_its_resolved_notice() {
    let mut cfg = config();
    cfg.route.group_interval = crate::HumanDuration::from_mins(30);
    let mut engine = Engine::new(cfg).expect("engine");
    engine
        .evaluate("XidReboot", &xid_instances("n1", 1), 0)
        .expect("eval");
    let mut view = cluster(10);
    view.nodes[1].state = NodeState::Drained;
    tick(&mut engine, &view, 0);
    assert_eq!(tick(&mut engine, &view, 30 * S).1.len(), 1);
    engine.evaluate("XidReboot", &[], M).expect("eval");
    // The next flush is at 30 s + 30 m, past the 15 minutes Prometheus keeps resolved alerts.
    assert!(tick(&mut engine, &view, 20 * M).1.is_empty());
    let sent = tick(&mut engine, &view, 30 * S + 30 * M).1;
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].status(), "resolved");
}

#[test]
fn a_notification_made_and_not_delivered_before_a_restart_is_sent_after_it_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("alerts-state.json");
    let (engine, sent) = paged_once();
    // Saved before sending, as the server does; the server dies before delivering it.
    engine.save(&path, 30 * S).expect("save");
    drop(engine);

    let (mut engine, _) = Engine::load(config(), &path, M).expect("load");
    assert_eq!(engine.undelivered(), sent, "the next server sends it");
    let (_, again) = tick(&mut engine, &cluster(10), M);
    assert!(again.is_empty(), "and does not make it again: {again:?}");
    engine.delivered(&sent[0]);
    assert!(engine.undelivered().is_empty());
    engine.save(&path, M).expect("save");
    let (engine, _) = Engine::load(config(), &path, 2 * M).expect("load");
    assert!(engine.undelivered().is_empty(), "delivered once, sent once");
}
