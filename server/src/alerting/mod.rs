//! The alert engine at work: evaluates the rules (SQL through the same read-only engine as
//! `POST /v1/sql`, typed built-ins from the control plane and the store's disk), records
//! alert transitions and every remediation decision in the `events` table, carries out the
//! decisions the guardrails allow through the job control plane, sends notifications, and
//! persists the engine's state after each round so a restart neither pages again nor forgets
//! a silence or an open circuit breaker.
//!
//! The decisions themselves are `perch-alerts`' ([`Engine`]); this module is their I/O.

pub mod routes;

use crate::AppState;
use perch_alerts::builtin::{
    NodeHeartbeat, NodeTelemetry, StoreFlush, disk_instances, flush_instances, heartbeat_instances,
    telemetry_instances,
};
use perch_alerts::notify::{Delivery, Notifier};
use perch_alerts::remediate::{Action, ClusterView, Decision, NodeState, NodeView, Outcome};
use perch_alerts::{AlertsConfig, BuiltinKind, Engine, Notification, RuleSource};
use perch_model::ClusterEvent;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Counters for `/metrics`, keyed by their label values.
#[derive(Debug, Default)]
pub struct AlertCounters {
    /// (action, outcome) -> decisions.
    pub actions: Mutex<BTreeMap<(String, String), u64>>,
    /// (receiver, outcome) -> deliveries.
    pub notifications: Mutex<BTreeMap<(String, String), u64>>,
    /// Rule evaluations that failed.
    pub evaluation_failures: AtomicU64,
    /// Rounds run, their microseconds in all, and the slowest's.
    pub rounds: AtomicU64,
    pub round_us: AtomicU64,
    pub round_us_max: AtomicU64,
}

/// The engine, its senders and where its state lives.
#[derive(Debug)]
pub struct AlertService {
    engine: Mutex<Engine>,
    /// The receivers, replaced whole when `[alerts]` is read again; a delivery under way
    /// keeps the ones it started with.
    notifier: Mutex<std::sync::Arc<Notifier>>,
    state_path: PathBuf,
    /// When the state was last saved (Unix ms), for the periodic save of quiet rounds.
    saved_at_ms: std::sync::atomic::AtomicI64,
    /// A notification left the outbox since the last save: the next round saves.
    delivered: std::sync::atomic::AtomicBool,
    pub counters: AlertCounters,
}

/// A round that changed nothing anyone would miss after a restart (no transition, decision or
/// notification) saves at most this often: the state file can be megabytes at scale.
const QUIET_SAVE_MS: i64 = 60_000;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The `events` outcome label of a decision.
fn outcome_label(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Execute => "done",
        Outcome::DryRun => "dry_run",
        Outcome::Refused(_) => "refused",
        Outcome::Skipped { .. } => "skipped",
    }
}

impl AlertService {
    /// Builds the engine from `config`, restoring its state from `<data_dir>/alerts.json`.
    /// Transitions that happened while the server was down are returned for the audit trail.
    pub fn open(
        config: AlertsConfig,
        data_dir: &std::path::Path,
        now_ms: i64,
    ) -> Result<(AlertService, Vec<ClusterEvent>), String> {
        let notifier = Notifier::new(&config).map_err(|e| e.to_string())?;
        let state_path = data_dir.join("alerts.json");
        let (engine, transitions) =
            Engine::load(config, &state_path, now_ms).map_err(|e| e.to_string())?;
        let events = transitions.iter().filter_map(|t| t.to_event()).collect();
        Ok((
            AlertService {
                engine: Mutex::new(engine),
                notifier: Mutex::new(std::sync::Arc::new(notifier)),
                state_path,
                saved_at_ms: std::sync::atomic::AtomicI64::new(now_ms),
                delivered: std::sync::atomic::AtomicBool::new(false),
                counters: AlertCounters::default(),
            },
            events,
        ))
    }

    /// Runs `f` on the engine.
    pub fn with<T>(&self, f: impl FnOnce(&mut Engine) -> T) -> T {
        f(&mut lock(&self.engine))
    }

    /// Runs `config` (`[alerts]` read again, on SIGHUP) from now on: its rules, receivers,
    /// routes, inhibitions and remediation guardrails, keeping alerts, silences, group timers
    /// and the circuit breaker, as a restart would. Returns the audit records of alerts whose
    /// rule is gone (they resolve). A config whose receivers cannot be built, or that does not
    /// validate, changes nothing.
    pub fn reconfigure(
        &self,
        config: AlertsConfig,
        now_ms: i64,
    ) -> Result<Vec<ClusterEvent>, String> {
        let notifier = Notifier::new(&config).map_err(|e| e.to_string())?;
        let transitions = self
            .with(|e| e.reconfigure(config, now_ms))
            .map_err(|e| e.to_string())?;
        *lock(&self.notifier) = std::sync::Arc::new(notifier);
        self.save(now_ms);
        Ok(transitions.iter().filter_map(|t| t.to_event()).collect())
    }

    /// Saves the engine's state (atomically replaced).
    pub fn save(&self, now_ms: i64) {
        self.saved_at_ms.store(now_ms, Ordering::Relaxed);
        if let Err(e) = lock(&self.engine).save(&self.state_path, now_ms) {
            tracing::error!(error = %e, path = %self.state_path.display(), "could not save the alert state; a restart may notify again");
        }
    }

    fn count_action(&self, action: &str, outcome: &str) {
        *lock(&self.counters.actions)
            .entry((action.to_owned(), outcome.to_owned()))
            .or_default() += 1;
    }

    fn count_delivery(&self, d: &Delivery) {
        let outcome = if d.error.is_none() { "sent" } else { "failed" };
        *lock(&self.counters.notifications)
            .entry((d.receiver.clone(), outcome.to_owned()))
            .or_default() += 1;
    }
}

/// Evaluates, remediates and notifies until `shutdown`, waking every second (rules keep
/// their own intervals; the dispatcher its group timers).
pub async fn run(state: AppState, shutdown: impl std::future::Future<Output = ()>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    // Notifications made before the last stop (a crash, a takeover by this server) and not
    // delivered then: their state was saved first, so they are sent now, once.
    let undelivered = state.alerts.with(|e| e.undelivered());
    if !undelivered.is_empty() {
        tracing::info!(
            notifications = undelivered.len(),
            "sending the notifications made before the last stop and not delivered then"
        );
    }
    for n in undelivered {
        let state = state.clone();
        tokio::spawn(async move { deliver(&state, n).await });
    }
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tick.tick() => {}
        }
        round(&state).await;
    }
    state.alerts.save(state.now_ms());
}

/// One round: due rules, remediation, notifications, save.
pub async fn round(state: &AppState) {
    let started = std::time::Instant::now();
    round_inner(state).await;
    let took = started.elapsed().as_micros() as u64;
    let counters = &state.alerts.counters;
    counters.rounds.fetch_add(1, Ordering::Relaxed);
    counters.round_us.fetch_add(took, Ordering::Relaxed);
    counters.round_us_max.fetch_max(took, Ordering::Relaxed);
}

async fn round_inner(state: &AppState) {
    let service = &state.alerts;
    let now = state.now_ms();
    let mut events = Vec::new();
    for rule in service.with(|e| e.due_rules(now)) {
        let result = match &rule.source {
            RuleSource::Sql(sql) => match sql_rows(state, sql).await {
                Ok(rows) => service.with(|e| e.evaluate_rows(&rule.name, &rows, now)),
                Err(error) => {
                    service.with(|e| e.record_failure(&rule.name, &error, now));
                    Err(perch_alerts::Error::Rule {
                        rule: rule.name.clone(),
                        message: error,
                    })
                }
            },
            RuleSource::Builtin(kind) => {
                let instances = builtin(state, kind, now);
                service.with(|e| e.evaluate(&rule.name, &instances, now))
            }
        };
        match result {
            Ok(transitions) => events.extend(transitions.iter().filter_map(|t| t.to_event())),
            Err(e) => {
                service
                    .counters
                    .evaluation_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(rule = %rule.name, error = %e, "alert rule evaluation failed; its alerts keep their state");
            }
        }
    }
    events.extend(remediate(state, now).await);
    if let Err(e) = state.store.append_events(&events).await {
        tracing::error!(error = %e, "could not record alert and remediation events");
    }
    let notifications = service.with(|e| e.notifications(now));
    // Transitions, decisions and notifications are saved at once (a restart must not page or
    // act again); a quiet round only moves timestamps, saved once a minute.
    // A delivery since the last save is saved here, once a round however many ended, rather
    // than the whole state once each: a restart within the second sends those again.
    let quiet = events.is_empty()
        && notifications.is_empty()
        && !service.delivered.swap(false, Ordering::Relaxed);
    if !quiet || now - service.saved_at_ms.load(Ordering::Relaxed) >= QUIET_SAVE_MS {
        service.save(now);
    }
    for n in notifications {
        let state = state.clone();
        tokio::spawn(async move { deliver(&state, n).await });
    }
}

async fn deliver(state: &AppState, n: Notification) {
    let notifier = lock(&state.alerts.notifier).clone();
    for d in notifier.send(&n).await {
        state.alerts.count_delivery(&d);
        match &d.error {
            None => {
                tracing::info!(receiver = %d.receiver, integration = %d.integration, "notification sent")
            }
            Some(e) => {
                tracing::error!(receiver = %d.receiver, integration = %d.integration, attempts = d.attempts, error = %e, "notification could not be delivered")
            }
        }
    }
    // Handed over (or given up on after retries): out of the outbox, saved by the next round.
    state.alerts.with(|e| e.delivered(&n));
    state.alerts.delivered.store(true, Ordering::Relaxed);
}

/// The rows of a rule's query as JSON objects (column name -> value).
pub(crate) async fn sql_rows(
    state: &AppState,
    sql: &str,
) -> Result<Vec<Map<String, Value>>, String> {
    let output = state
        .sql
        .query_internal(sql)
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    {
        let mut writer = arrow::json::WriterBuilder::new()
            .with_explicit_nulls(true)
            .build::<_, arrow::json::writer::JsonArray>(&mut buf);
        for batch in &output.batches {
            writer.write(batch).map_err(|e| e.to_string())?;
        }
        writer.finish().map_err(|e| e.to_string())?;
    }
    if buf.is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_slice(&buf).map_err(|e| e.to_string())
}

fn builtin(state: &AppState, kind: &BuiltinKind, now: i64) -> Vec<perch_alerts::Instance> {
    match kind {
        BuiltinKind::NodeHeartbeatLost { .. } => {
            let views = state.jobs.node_views();
            let nodes: Vec<NodeHeartbeat<'_>> = views
                .iter()
                .map(|n| NodeHeartbeat {
                    node: &n.name,
                    last_seen_ms: Some(n.last_sync_ms),
                })
                .collect();
            heartbeat_instances(kind, &nodes, now)
        }
        BuiltinKind::NodeTelemetryStopped => {
            let statuses = crate::node_status::current(state, now);
            let nodes: Vec<NodeTelemetry<'_>> = statuses
                .iter()
                .map(|(name, s)| NodeTelemetry {
                    node: name,
                    state: s.state,
                    last_sample_ms: s.last_sample_ms,
                })
                .collect();
            telemetry_instances(kind, &nodes, now)
        }
        BuiltinKind::StoreDiskFull { .. } => {
            let dir = state.store.data_dir();
            match rustix::fs::statvfs(dir) {
                Ok(st) => disk_instances(
                    kind,
                    &dir.display().to_string(),
                    st.f_bavail.saturating_mul(st.f_frsize),
                    st.f_blocks.saturating_mul(st.f_frsize),
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the store's free space");
                    Vec::new()
                }
            }
        }
        BuiltinKind::JobIdle => {
            let views = state.jobs.idle_jobs();
            let jobs: Vec<perch_alerts::builtin::IdleJob<'_>> = views
                .iter()
                .map(|j| perch_alerts::builtin::IdleJob {
                    job: j.job,
                    user: &j.user,
                    account: &j.account,
                    nodes: &j.nodes,
                    idle_since_ms: j.idle_since_ms,
                    consequence: &j.consequence,
                    action_at_ms: j.action_at_ms,
                })
                .collect();
            perch_alerts::builtin::idle_job_instances(kind, &jobs, now)
        }
        BuiltinKind::JobDatabaseFailing => {
            perch_alerts::builtin::job_db_instances(kind, state.jobs.failing().as_deref())
        }
        BuiltinKind::StoreFlushFailing => {
            let store = &state.store;
            let error = store.flush_error();
            flush_instances(
                kind,
                &StoreFlush {
                    failures: store
                        .stats
                        .consecutive_flush_failures
                        .load(std::sync::atomic::Ordering::Relaxed),
                    error: error.as_deref(),
                    held_rows: store.held_rows() as u64,
                    limit_rows: store.max_buffered_rows() as u64,
                },
            )
        }
    }
}

fn cluster_view(state: &AppState) -> ClusterView {
    ClusterView {
        nodes: state
            .jobs
            .node_views()
            .into_iter()
            .map(|n| NodeView {
                state: if n.liveness.down {
                    NodeState::Down
                } else if n.liveness.drained {
                    NodeState::Drained
                } else {
                    NodeState::Up
                },
                node: n.name,
                running_jobs: n.running_jobs,
            })
            .collect(),
    }
}

/// Plans remediation and carries out what the guardrails allow; returns the audit records.
async fn remediate(state: &AppState, now: i64) -> Vec<ClusterEvent> {
    let view = cluster_view(state);
    let plan = state.alerts.with(|e| e.plan_remediation(&view, now));
    let mut events = Vec::new();
    if let Some(e) = plan.breaker_opened {
        tracing::error!(message = %e.message, "remediation circuit breaker opened: no automatic action runs until an operator resets it");
        events.push(e);
    }
    for decision in plan.decisions {
        state
            .alerts
            .count_action(decision.action.name(), outcome_label(&decision.outcome));
        if let Some(event) = &decision.event {
            events.push(event.clone());
        }
        if decision.outcome != Outcome::Execute {
            continue;
        }
        let result = execute(state, &decision).await;
        if let Err(e) = &result {
            tracing::error!(action = decision.action.name(), node = decision.action.node(), error = %e, "remediation action failed");
        }
        events.push(state.alerts.with(|e| e.complete(&decision, &result, now)));
    }
    events
}

async fn execute(state: &AppState, decision: &Decision) -> Result<String, String> {
    let summary = decision
        .alert
        .as_ref()
        .and_then(|key| state.alerts.with(|e| e.alert_summary(key)));
    let reason = match (decision.rule.as_deref(), summary) {
        (Some(r), Some(summary)) => format!("alert {r}: {summary}"),
        (Some(r), None) => format!("alert {r}"),
        (None, _) => "perch remediation".into(),
    };
    match decision.action.clone() {
        Action::DrainNode { node } => state
            .jobs
            .run(move |c, now| c.set_drained(&node, true, "perch", Some(reason), now))
            .await
            .map(|()| "drained".to_owned())
            .map_err(|e| e.to_string()),
        Action::RequeueJobs { node } => state
            .jobs
            .run(move |c, now| c.evict_node_jobs(&node, now))
            .await
            .map(|jobs| match jobs.len() {
                0 => "no job was running there".to_owned(),
                _ => format!(
                    "requeued job{} {}",
                    if jobs.len() == 1 { "" } else { "s" },
                    jobs.iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
            .map_err(|e| e.to_string()),
        Action::GpuOut { node, gpu } => state
            .jobs
            .run(move |c, now| c.set_gpu_out(&node, gpu, true, now))
            .await
            .map(|()| format!("GPU {gpu} taken out of scheduling"))
            .map_err(|e| e.to_string()),
        Action::ResumeNode { node } => state
            .jobs
            .run(move |c, now| c.set_drained(&node, false, "perch", None, now))
            .await
            .map(|()| "resumed".to_owned())
            .map_err(|e| e.to_string()),
        Action::HealthCheck { node, argv, .. } if state.config.validation.after_remediation => {
            crate::validation::for_remediation(state, &node, argv).await
        }
        Action::RunCommand {
            node,
            argv,
            timeout_ms,
            ..
        }
        | Action::HealthCheck {
            node,
            argv,
            timeout_ms,
        } => {
            state
                .node_commands
                .run(
                    &node,
                    argv,
                    Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0)),
                )
                .await
        }
    }
}
