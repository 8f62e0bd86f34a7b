//! Series of the alert engine: alerts by rule, state and severity (every rule present, at 0
//! when quiet, so a dashboard sees a rule before it first fires), silences, the remediation
//! circuit breaker, actions by outcome and notifications by receiver.

use super::{Labels, Scrape};
use crate::alerting::AlertService;
use std::sync::atomic::Ordering;

pub(super) fn alerts(s: &mut Scrape, service: &AlertService, now: i64) {
    let m = service.with(|e| e.metrics(now));
    for a in &m.alerts {
        s.gauge(
            "perch_alerts",
            "Alerts by rule, state (pending, firing) and severity",
            &vec![
                ("alertname", a.alertname.clone()),
                ("state", a.state.clone()),
                ("severity", a.severity.clone()),
            ],
            Some(a.count as f64),
        );
    }
    let none: Labels = Vec::new();
    s.gauge(
        "perch_alert_silences",
        "Silences muting alerts now",
        &none,
        Some(m.silences_active as f64),
    );
    s.gauge(
        "perch_remediation_circuit_breaker_open",
        "1 while automatic remediation is stopped because too many nodes are out",
        &none,
        Some(f64::from(u8::from(m.breaker_open))),
    );
    s.gauge(
        "perch_remediation_nodes_drained",
        "Nodes perch's remediation drained and has not resumed",
        &none,
        Some(m.nodes_drained_by_perch as f64),
    );
    let counters = &service.counters;
    s.counter(
        "perch_alert_rounds",
        "Alert rounds run (due rules, remediation, notifications, save)",
        &none,
        Some(counters.rounds.load(Ordering::Relaxed) as f64),
    );
    s.counter(
        "perch_alert_round_seconds",
        "Time in alert rounds, in all (with perch_alert_rounds_total: the mean)",
        &none,
        Some(counters.round_us.load(Ordering::Relaxed) as f64 / 1e6),
    );
    s.gauge(
        "perch_alert_round_seconds_max",
        "The slowest alert round since the server started",
        &none,
        Some(counters.round_us_max.load(Ordering::Relaxed) as f64 / 1e6),
    );
    s.counter(
        "perch_alert_evaluation_failures",
        "Rule evaluations that failed (the rule's alerts keep their state)",
        &none,
        Some(service.counters.evaluation_failures.load(Ordering::Relaxed) as f64),
    );
    let actions = service
        .counters
        .actions
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    for ((action, outcome), n) in actions {
        s.counter(
            "perch_remediation_actions",
            "Remediation decisions by action and outcome (done, dry_run, refused, skipped)",
            &vec![("action", action), ("outcome", outcome)],
            Some(n as f64),
        );
    }
    let sent = service
        .counters
        .notifications
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    for ((receiver, outcome), n) in sent {
        s.counter(
            "perch_notifications",
            "Notifications delivered (sent) or given up on (failed), by receiver",
            &vec![("receiver", receiver), ("outcome", outcome)],
            Some(n as f64),
        );
    }
}
