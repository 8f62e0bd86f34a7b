//! perch's alerting: rules over the store, the Prometheus alert state machine, the
//! Alertmanager notification pipeline, senders (email, webhooks) and guarded automatic
//! remediation.
//!
//! The decision logic is pure and reads no clock: every time-dependent call takes `now_ms`,
//! so tests run it in virtual time. The crate runs no SQL (the server does and hands over the
//! rows) and touches no cluster state (the server carries out the decisions and reports back).
//! `alerts/README.md` documents the built-in rules, the config and the semantics.
//!
//! The server holds one [`Engine`] (built from [`AlertsConfig`], loaded from and saved to a
//! state file) and one [`notify::Notifier`]. Every tick it:
//! 1. evaluates [`Engine::due_rules`]: runs a rule's SQL and passes the rows to
//!    [`Engine::evaluate_rows`] (or computes a typed built-in with [`builtin`]'s helpers and
//!    calls [`Engine::evaluate`]); writes each [`Transition::to_event`] to the `events` table;
//! 2. plans with [`Engine::plan_remediation`] against its [`remediate::ClusterView`], carries
//!    out the `Execute` decisions in order and reports each with [`Engine::complete`]; writes
//!    every audit record;
//! 3. sends [`Engine::notifications`] through the notifier (in a task: it retries);
//! 4. saves with [`Engine::save`].

mod alert;
pub mod builtin;
pub mod config;
mod dispatch;
mod duration;
mod engine;
mod error;
mod matcher;
pub mod notify;
mod persist;
pub mod remediate;
mod rules;
mod silence;
mod state;
pub mod template;
pub use perch_model::{timefmt, xid};

pub use alert::{Alert, AlertKey, AlertState};
pub use config::AlertsConfig;
pub use dispatch::{DispatchState, Dispatcher, Notification};
pub use duration::HumanDuration;
pub use engine::{
    AlertCount, AlertStatus, BREAKER_ALERT, Engine, EngineMetrics, RuleStatus, Snapshot,
};
pub use error::{Error, Result};
pub use matcher::{MatchOp, Matcher};
pub use perch_model::timefmt::{rfc3339, rfc3339_seconds, utc};
pub use rules::{
    ActionSpec, BuiltinKind, DEFAULT_LABEL_COLUMNS, Instance, Rule, RuleSource, Severity,
    instances_from_rows,
};
pub use silence::{Silence, SilenceRequest, SilenceState, Silences};
pub use state::{AlertTable, RESOLVED_RETENTION_MS, Transition};
