use super::*;
use crate::alert::{AlertKey, AlertState};
use crate::duration::HumanDuration;
use crate::rules::Severity;
use proptest::prelude::*;

const M: i64 = 60_000;

fn config() -> RemediationConfig {
    RemediationConfig {
        max_concurrent_drains: 2,
        max_fraction_out: 0.2,
        cooldown: HumanDuration::from_mins(30),
        resume_after: HumanDuration::from_mins(10),
        health_check: vec!["/usr/bin/gpu-check".into()],
        ..RemediationConfig::default()
    }
}

fn view(n: usize) -> ClusterView {
    ClusterView {
        nodes: (0..n)
            .map(|i| NodeView {
                node: format!("n{i}"),
                state: NodeState::Up,
                running_jobs: 0,
            })
            .collect(),
    }
}

fn set(view: &mut ClusterView, node: &str, state: NodeState, jobs: usize) {
    for n in &mut view.nodes {
        if n.node == node {
            n.state = state;
            n.running_jobs = jobs;
        }
    }
}

fn xid(node: &str, gpu: u32, at: i64) -> Alert {
    let mut labels = BTreeMap::from([
        ("alertname".to_string(), "XidReboot".to_string()),
        ("node".to_string(), node.to_string()),
        ("gpu".to_string(), gpu.to_string()),
        ("severity".to_string(), "critical".to_string()),
    ]);
    labels.retain(|_, v| !v.is_empty());
    Alert {
        key: AlertKey::of(&labels),
        rule: "XidReboot".into(),
        labels,
        values: BTreeMap::new(),
        severity: Severity::Critical,
        summary: String::new(),
        description: String::new(),
        state: AlertState::Firing,
        active_at_ms: at,
        fired_at_ms: Some(at),
        resolved_at_ms: None,
        last_seen_ms: at,
        keep_firing_since_ms: None,
        actions: vec![ActionSpec::DrainNode, ActionSpec::RequeueJobs],
        actions_taken: Vec::new(),
    }
}

fn outcomes(plan: &Plan) -> Vec<(String, &'static str, String)> {
    plan.decisions
        .iter()
        .map(|d| {
            let outcome = match &d.outcome {
                Outcome::Execute => "execute".to_string(),
                Outcome::DryRun => "dry_run".to_string(),
                Outcome::Refused(r) => format!("refused: {r}"),
                Outcome::Skipped { .. } => "skipped".to_string(),
            };
            (d.action.node().to_owned(), d.action.name(), outcome)
        })
        .collect()
}

fn plan(p: &mut Planner, alerts: &[Alert], view: &ClusterView, now: i64) -> Plan {
    let refs: Vec<&Alert> = alerts.iter().collect();
    p.plan(&refs, view, now)
}

/// Applies executed drains to the view, as the server would.
fn apply(view: &mut ClusterView, plan: &Plan, jobs: usize) {
    for d in &plan.decisions {
        if let (Action::DrainNode { node }, Outcome::Execute) = (&d.action, &d.outcome) {
            set(view, node, NodeState::Drained, jobs);
        }
    }
}

fn row(node: &str, action: &'static str, outcome: &str) -> (String, &'static str, String) {
    (node.to_string(), action, outcome.to_string())
}

#[test]
fn drains_and_requeues_once_for_many_alerts_of_one_node() {
    let mut p = Planner::new(config(), false);
    let alerts: Vec<Alert> = (0..8).map(|g| xid("n1", g, 0)).collect();
    let got = plan(&mut p, &alerts, &view(10), 0);
    let executed: Vec<_> = outcomes(&got)
        .into_iter()
        .filter(|(_, _, o)| o == "execute")
        .collect();
    assert_eq!(
        executed,
        [
            row("n1", "drain_node", "execute"),
            row("n1", "requeue_jobs", "execute")
        ]
    );
    assert_eq!(
        got.decisions.len(),
        16,
        "the 14 others are skipped and audited"
    );
    assert!(
        got.decisions[0].event.is_none(),
        "an executed action is audited with its result"
    );
    let skipped = got
        .decisions
        .iter()
        .find(|d| matches!(d.outcome, Outcome::Skipped { .. }));
    let event = skipped
        .and_then(|d| d.event.as_ref())
        .expect("skip audited");
    assert!(
        event
            .outcome
            .as_deref()
            .is_some_and(|o| o.starts_with("skipped")),
        "{event:?}"
    );
    // Decided once: the next round has nothing to say.
    assert!(
        plan(&mut p, &alerts, &view(10), 30_000)
            .decisions
            .is_empty()
    );
}

#[test]
fn breaker_trips_at_the_configured_fraction_and_stays_open() {
    let mut p = Planner::new(config(), false);
    let mut v = view(10);
    let storm: Vec<Alert> = (0..6).map(|i| xid(&format!("n{i}"), 0, i)).collect();
    let got = plan(&mut p, &storm, &v, 10);
    let drains: Vec<_> = outcomes(&got)
        .into_iter()
        .filter(|(_, a, _)| *a == "drain_node")
        .collect();
    assert_eq!(
        drains,
        [
            row("n0", "drain_node", "execute"),
            row("n1", "drain_node", "execute"),
            row("n2", "drain_node", "refused: circuit breaker open"),
            row("n3", "drain_node", "refused: circuit breaker open"),
            row("n4", "drain_node", "refused: circuit breaker open"),
            row("n5", "drain_node", "refused: circuit breaker open"),
        ]
    );
    // The requeue of a held drain is held too.
    assert!(outcomes(&got).contains(&row("n2", "requeue_jobs", "refused: circuit breaker open")));
    let opened = got.breaker_opened.clone().expect("breaker audit record");
    assert_eq!(opened.kind, "circuit_breaker_open");
    assert!(
        opened.message.contains("3 of 10 nodes"),
        "{}",
        opened.message
    );
    assert!(p.breaker().is_some());
    apply(&mut v, &got, 1);

    // Stays open: later alerts, even with room, change nothing and are audited once.
    let mut later = storm.clone();
    later.push(xid("n7", 0, 5 * M));
    let got = plan(&mut p, &later, &v, 5 * M);
    assert!(got.breaker_opened.is_none());
    assert_eq!(
        outcomes(&got),
        [
            row("n7", "drain_node", "refused: circuit breaker open"),
            row("n7", "requeue_jobs", "refused: circuit breaker open"),
        ]
    );
    assert!(plan(&mut p, &later, &v, 6 * M).decisions.is_empty());

    // An operator resets it; the drains are judged again on the nodes out now.
    let reset = p.reset_breaker("ana", 7 * M).expect("was open");
    assert_eq!(reset.kind, "circuit_breaker_reset");
    assert_eq!(reset.actor, "ana");
    assert!(p.reset_breaker("ana", 7 * M).is_none());
    let got = plan(&mut p, &later, &v, 8 * M);
    assert!(
        got.breaker_opened.is_some(),
        "still 2 of 10 out: the next drain trips it again"
    );
    assert_eq!(
        outcomes(&got)[0],
        row("n2", "drain_node", "refused: circuit breaker open")
    );
}

#[test]
fn nodes_already_down_count_as_out() {
    let mut p = Planner::new(config(), false);
    let mut v = view(10);
    set(&mut v, "n8", NodeState::Down, 0);
    set(&mut v, "n9", NodeState::Down, 0);
    let got = plan(&mut p, &[xid("n1", 0, 0)], &v, 0);
    assert_eq!(
        outcomes(&got)[0],
        row("n1", "drain_node", "refused: circuit breaker open")
    );
    // A down node needs no drain of its own, and drains nothing else.
    let mut p = Planner::new(config(), false);
    let mut v = view(10);
    set(&mut v, "n1", NodeState::Down, 0);
    let got = plan(&mut p, &[xid("n1", 0, 0)], &v, 0);
    assert_eq!(
        outcomes(&got),
        [
            row("n1", "drain_node", "skipped"),
            row("n1", "requeue_jobs", "execute")
        ]
    );
    assert!(p.breaker().is_none());
}

#[test]
fn breaker_window_counts_drains_that_were_undone() {
    let mut cfg = config();
    cfg.max_fraction_out = 0.2;
    let mut p = Planner::new(cfg, false);
    let v = view(10);
    // Two drains, then an operator resumes both at once (view shows them up again).
    let first: Vec<Alert> = (0..2).map(|i| xid(&format!("n{i}"), 0, 0)).collect();
    let got = plan(&mut p, &first, &v, 0);
    assert_eq!(
        got.decisions
            .iter()
            .filter(|d| d.outcome == Outcome::Execute)
            .count(),
        4
    );
    let got = plan(&mut p, &[xid("n5", 0, M)], &v, M);
    assert!(got.breaker_opened.is_some(), "3 drains within the window");
    // Outside the window the same drain is fine.
    let mut p2 = Planner::new(config(), false);
    plan(&mut p2, &first, &v, 0);
    let got = plan(&mut p2, &[xid("n5", 0, 6 * M)], &v, 6 * M);
    assert!(got.breaker_opened.is_none());
    assert_eq!(outcomes(&got)[0], row("n5", "drain_node", "execute"));
}

#[test]
fn max_concurrent_drains_defers_without_tripping() {
    let mut cfg = config();
    cfg.max_fraction_out = 0.5;
    cfg.max_concurrent_drains = 1;
    let mut p = Planner::new(cfg, false);
    let mut v = view(10);
    let alerts = vec![xid("n1", 0, 0), xid("n2", 0, 1)];
    let got = plan(&mut p, &alerts, &v, 10);
    assert_eq!(
        outcomes(&got),
        [
            row("n1", "drain_node", "execute"),
            row("n1", "requeue_jobs", "execute"),
            row(
                "n2",
                "drain_node",
                "refused: 1 drains already in progress (max_concurrent_drains)"
            ),
            row(
                "n2",
                "requeue_jobs",
                "refused: 1 drains already in progress (max_concurrent_drains)"
            ),
        ]
    );
    // n1 still runs jobs: still in progress; the refusal is not repeated.
    apply(&mut v, &got, 3);
    assert!(plan(&mut p, &alerts, &v, 20).decisions.is_empty());
    // n1's jobs are gone: n2 may drain now.
    set(&mut v, "n1", NodeState::Drained, 0);
    let got = plan(&mut p, &alerts, &v, 30);
    assert_eq!(
        outcomes(&got),
        [
            row("n2", "drain_node", "execute"),
            row("n2", "requeue_jobs", "execute")
        ]
    );
    assert!(p.breaker().is_none());
}

#[test]
fn cooldown_holds_a_second_drain_of_a_resumed_node() {
    let mut p = Planner::new(config(), false);
    let mut v = view(10);
    let first = xid("n1", 0, 0);
    let got = plan(&mut p, &[first], &v, 0);
    apply(&mut v, &got, 0);
    // An operator resumes n1; five minutes later another XID.
    set(&mut v, "n1", NodeState::Up, 0);
    let second = xid("n1", 1, 5 * M);
    let got = plan(&mut p, std::slice::from_ref(&second), &v, 5 * M);
    let until = crate::timefmt::utc(30 * M);
    assert_eq!(
        outcomes(&got),
        [
            row(
                "n1",
                "drain_node",
                &format!("refused: cooldown until {until}")
            ),
            row(
                "n1",
                "requeue_jobs",
                &format!("refused: cooldown until {until}")
            ),
        ]
    );
    assert!(
        plan(&mut p, std::slice::from_ref(&second), &v, 10 * M)
            .decisions
            .is_empty()
    );
    let got = plan(&mut p, &[second], &v, 30 * M);
    assert_eq!(
        outcomes(&got),
        [
            row("n1", "drain_node", "execute"),
            row("n1", "requeue_jobs", "execute")
        ]
    );
}

#[test]
fn dry_run_executes_nothing_but_decides_and_audits_everything() {
    let mut p = Planner::new(config(), true);
    let v = view(10);
    let storm: Vec<Alert> = (0..3).map(|i| xid(&format!("n{i}"), 0, i)).collect();
    let got = plan(&mut p, &storm, &v, 10);
    assert!(got.decisions.iter().all(|d| d.outcome != Outcome::Execute));
    assert_eq!(
        outcomes(&got)
            .into_iter()
            .filter(|(_, a, _)| *a == "drain_node")
            .collect::<Vec<_>>(),
        [
            row("n0", "drain_node", "dry_run"),
            row("n1", "drain_node", "dry_run"),
            row("n2", "drain_node", "refused: circuit breaker open"),
        ]
    );
    for d in &got.decisions {
        let event = d
            .event
            .as_ref()
            .expect("every dry-run decision is audited at once");
        assert_eq!(event.dry_run, d.outcome == Outcome::DryRun, "{event:?}");
    }
    assert_eq!(
        got.decisions[0].annotation().as_deref(),
        Some("Dry run: would drain n0.")
    );
    assert!(got.breaker_opened.expect("trips in dry run too").dry_run);
}

#[test]
fn alert_without_needed_labels_is_refused_once() {
    let mut p = Planner::new(config(), false);
    let mut alert = xid("n1", 0, 0);
    alert.labels.remove("node");
    alert.actions = vec![ActionSpec::DrainNode];
    let got = plan(&mut p, std::slice::from_ref(&alert), &view(3), 0);
    assert_eq!(
        outcomes(&got),
        [row(
            "",
            "drain_node",
            "refused: the alert has no `node` label"
        )]
    );
    assert!(
        plan(&mut p, &[alert], &view(3), M).decisions.is_empty(),
        "final: not repeated"
    );

    let mut gpu_less = xid("n1", 0, 0);
    gpu_less.labels.remove("gpu");
    gpu_less.actions = vec![ActionSpec::GpuOut];
    let got = plan(&mut p, &[gpu_less], &view(3), 0);
    let event = got.decisions[0].event.as_ref().expect("audited");
    assert_eq!(event.gpu, None);
    assert_eq!(
        event.outcome.as_deref(),
        Some("refused: the alert has no `gpu` label")
    );
}

#[test]
fn run_command_fills_templates_and_uses_the_command_timeout() {
    let mut cfg = config();
    cfg.commands.insert(
        "gpu_reset".into(),
        crate::config::CommandConfig {
            argv: vec![
                "nvidia-smi".into(),
                "-r".into(),
                "-i".into(),
                "{{ labels.gpu }}".into(),
            ],
            timeout: Some(HumanDuration::from_mins(2)),
        },
    );
    let mut p = Planner::new(cfg, false);
    let mut alert = xid("n1", 3, 0);
    alert.actions = vec![ActionSpec::RunCommand("gpu_reset".into())];
    let got = plan(&mut p, &[alert], &view(3), 0);
    assert_eq!(
        got.decisions[0].action,
        Action::RunCommand {
            node: "n1".into(),
            command: "gpu_reset".into(),
            argv: vec!["nvidia-smi".into(), "-r".into(), "-i".into(), "3".into()],
            timeout_ms: 2 * M,
        }
    );
}

#[test]
fn resumes_only_its_own_drains_after_a_passing_health_check() {
    let mut p = Planner::new(config(), false);
    let mut v = view(10);
    let alert = xid("n1", 0, 0);
    let got = plan(&mut p, std::slice::from_ref(&alert), &v, 0);
    apply(&mut v, &got, 0);
    set(&mut v, "n2", NodeState::Drained, 0); // an operator's drain: never resumed by perch
    for d in &got.decisions {
        p.complete(d, &Ok(String::new()), 0);
    }
    // The alert fires until 4 minutes; quiet for resume_after (10 m) after that.
    assert!(plan(&mut p, &[alert], &v, 4 * M).decisions.is_empty());
    assert!(plan(&mut p, &[], &v, 13 * M).decisions.is_empty());
    let got = plan(&mut p, &[], &v, 14 * M);
    assert_eq!(outcomes(&got), [row("n1", "health_check", "execute")]);
    assert!(
        plan(&mut p, &[], &v, 15 * M).decisions.is_empty(),
        "check running"
    );
    // The check fails: retried after the cooldown.
    let failed = p.complete(
        &got.decisions[0],
        &Err("exit 1: ECC pending".into()),
        15 * M,
    );
    assert_eq!(
        failed.outcome.as_deref(),
        Some("failed: exit 1: ECC pending")
    );
    assert!(plan(&mut p, &[], &v, 30 * M).decisions.is_empty());
    let got = plan(&mut p, &[], &v, 45 * M);
    assert_eq!(outcomes(&got), [row("n1", "health_check", "execute")]);
    let passed = p.complete(&got.decisions[0], &Ok("exit 0".into()), 46 * M);
    assert_eq!(passed.outcome.as_deref(), Some("done"));
    let got = plan(&mut p, &[], &v, 46 * M);
    assert_eq!(outcomes(&got), [row("n1", "resume_node", "execute")]);
    let resumed = p.complete(&got.decisions[0], &Ok(String::new()), 46 * M);
    assert_eq!(resumed.message, "Resumed n1.");
    set(&mut v, "n1", NodeState::Up, 0);
    assert!(p.drained_by_perch().is_empty());
    assert!(plan(&mut p, &[], &v, 60 * M).decisions.is_empty());
}

#[test]
fn an_operator_resume_hands_the_node_back() {
    let mut p = Planner::new(config(), false);
    let mut v = view(10);
    let got = plan(&mut p, &[xid("n1", 0, 0)], &v, 0);
    apply(&mut v, &got, 0);
    assert_eq!(p.drained_by_perch(), ["n1"]);
    set(&mut v, "n1", NodeState::Up, 0);
    plan(&mut p, &[], &v, M);
    assert!(p.drained_by_perch().is_empty());
}

#[test]
fn a_failed_drain_is_audited_and_forgotten() {
    let mut p = Planner::new(config(), false);
    let got = plan(&mut p, &[xid("n1", 0, 0)], &view(10), 0);
    let event = p.complete(&got.decisions[0], &Err("agent unreachable".into()), 1);
    assert_eq!(event.kind, "remediation");
    assert_eq!(event.action.as_deref(), Some("drain_node"));
    assert_eq!(event.outcome.as_deref(), Some("failed: agent unreachable"));
    assert_eq!(event.rule.as_deref(), Some("XidReboot"));
    assert_eq!(event.node.as_deref(), Some("n1"));
    assert!(p.drained_by_perch().is_empty());
}

#[test]
fn allowed_out_is_the_floor_of_the_fraction() {
    assert_eq!(allowed_out(0.2, 10), 2);
    assert_eq!(allowed_out(0.2, 9), 1);
    assert_eq!(allowed_out(0.2, 4), 0);
    assert_eq!(allowed_out(1.0, 7), 7);
    assert_eq!(allowed_out(0.3, 10), 3);
}

proptest! {
    /// Whatever the alerts, the initial node states and the timing, executing the planner's
    /// drains never leaves more nodes out than `max_fraction_out` allows (unless more were
    /// already out without perch, in which case perch drains nothing).
    #[test]
    fn drains_never_exceed_the_fraction(
        total in 1usize..40,
        fraction in 0.05f64..1.0,
        concurrent in 1usize..6,
        down in proptest::collection::vec(0usize..40, 0..6),
        rounds in proptest::collection::vec(
            (proptest::collection::vec(0usize..40, 0..12), 0i64..20 * M, any::<bool>()),
            1..8,
        ),
    ) {
        let mut cfg = config();
        cfg.max_fraction_out = fraction;
        cfg.max_concurrent_drains = concurrent;
        let mut p = Planner::new(cfg, false);
        let mut v = view(total);
        for d in &down {
            set(&mut v, &format!("n{}", d % total), NodeState::Down, 0);
        }
        let allowed = allowed_out(fraction, total);
        let mut now = 0;
        for (nodes, step, jobs_finish) in rounds {
            now += step;
            let out_before = v.nodes.iter().filter(|n| n.state != NodeState::Up).count();
            let alerts: Vec<Alert> = nodes
                .iter()
                .map(|i| xid(&format!("n{}", i % total), (*i / total) as u32, now))
                .collect();
            let got = plan(&mut p, &alerts, &v, now);
            apply(&mut v, &got, usize::from(!jobs_finish));
            let out_after = v.nodes.iter().filter(|n| n.state != NodeState::Up).count();
            let drained = got
                .decisions
                .iter()
                .filter(|d| matches!(d.action, Action::DrainNode { .. }) && d.outcome == Outcome::Execute)
                .count();
            prop_assert!(
                out_after <= allowed.max(out_before),
                "out {out_before} -> {out_after}, allowed {allowed} of {total}"
            );
            if drained > 0 {
                prop_assert!(out_after <= allowed);
            }
            if jobs_finish {
                for n in &mut v.nodes {
                    n.running_jobs = 0;
                }
            }
        }
    }
}
