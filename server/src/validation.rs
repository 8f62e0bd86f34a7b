//! Validation runs carried out: `POST /v1/nodes/{name}/validate` (operators) and the
//! remediation's health check when `[validation] after_remediation` is on. A run drains the
//! node (`validating ...`), the node's agent runs `[validation] command` (the built-in GPU
//! check by default) with its timeout, and the result resumes the node or keeps it drained
//! with the reason ([`perch_control::validation`] decides). The request answers as soon as
//! the run has started; the result is in `node_validations` and `events`.

use crate::{ApiError, AppState, ErrorCode};
use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use perch_control::ControlError;
use perch_control::validation::{Refused, Report, Run, Trigger};
use perch_model::identity::Identity;

/// Why a validation did not start.
#[derive(Debug)]
pub enum StartError {
    Control(ControlError),
    Refused(Refused),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Control(e) => e.fmt(f),
            Self::Refused(e) => e.fmt(f),
        }
    }
}

impl From<StartError> for ApiError {
    fn from(e: StartError) -> ApiError {
        match e {
            StartError::Control(e) => e.into(),
            StartError::Refused(e) => ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::ValidationRunning,
                e.to_string(),
            ),
        }
    }
}

/// Starts a validation of `node` running `argv`; the handle ends with the finished run (`None` if the job
/// database could not record its end; the error is logged).
pub async fn start(
    state: &AppState,
    node: &str,
    trigger: Trigger,
    by: &str,
    argv: Vec<String>,
) -> Result<(Run, tokio::task::JoinHandle<Option<Run>>), StartError> {
    let config = state.config.validation.clone();
    let (n, b, command) = (node.to_owned(), by.to_owned(), argv.join(" "));
    let run = state
        .jobs
        .run(move |c, now| c.validation_begin(&n, trigger, &b, command, now))
        .await
        .map_err(StartError::Control)?
        .map_err(StartError::Refused)?;
    tracing::info!(
        node,
        id = run.id,
        trigger = trigger.as_str(),
        "validation started"
    );
    let state = state.clone();
    let (id, node) = (run.id, node.to_owned());
    let handle = tokio::spawn(async move {
        let report = match state
            .node_commands
            .run_raw(&node, argv, config.timeout)
            .await
        {
            Ok(r) => Report {
                exit_code: r.exit_code,
                timed_out: r.timed_out,
                error: r.error,
                output: r.output,
            },
            Err(no_answer) => Report {
                exit_code: None,
                timed_out: false,
                error: Some(no_answer),
                output: String::new(),
            },
        };
        let timeout_ms = u64::try_from(config.timeout.as_millis()).unwrap_or(u64::MAX);
        match state
            .jobs
            .run(move |c, now| c.validation_end(id, report, timeout_ms, now))
            .await
        {
            Ok(run) => {
                if let Some(r) = &run {
                    tracing::info!(node = %r.node, id, verdict = ?r.verdict, "validation finished");
                }
                run
            }
            Err(e) => {
                tracing::error!(node, id, error = %e, "the validation's result could not be recorded; the node stays drained (`perch resume` it once checked)");
                None
            }
        }
    });
    Ok((run, handle))
}

/// The remediation's health check `argv` as a validation: Ok when it passed, Err with the
/// reason.
pub async fn for_remediation(
    state: &AppState,
    node: &str,
    argv: Vec<String>,
) -> Result<String, String> {
    let (_, handle) = start(state, node, Trigger::Remediation, "perch", argv)
        .await
        .map_err(|e| e.to_string())?;
    let run = handle
        .await
        .map_err(|e| format!("validation task: {e}"))?
        .ok_or_else(|| "the validation's result could not be recorded".to_owned())?;
    match run.verdict {
        Some(perch_control::validation::Verdict::Passed) => {
            Ok(format!("validation of {node} passed"))
        }
        _ => Err(format!(
            "validation of {node} {}: {}",
            run.verdict.map_or("ended", |v| v.as_str()),
            run.output.trim().lines().last().unwrap_or("")
        )),
    }
}

/// With `after_remediation`, the remediation's health check is the validation: when
/// `[alerts.remediation] health_check` is empty it becomes the validation's command, so perch
/// resumes the nodes it drained once a validation passed.
pub fn remediation_alerts(
    mut alerts: perch_alerts::AlertsConfig,
    validation: &perch_control::validation::Config,
) -> perch_alerts::AlertsConfig {
    if validation.after_remediation && alerts.remediation.health_check.is_empty() {
        alerts.remediation.health_check = validation.argv();
    }
    alerts
}

/// `POST /v1/nodes/{name}/validate`: starts a validation and answers 202 with the run.
pub async fn validate(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(name): Path<String>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let argv = state.config.validation.argv();
    let (run, _) = start(&state, &name, Trigger::Operator, &who.user, argv).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({ "validation": run })),
    ))
}
