//! `GET /v1/alerts` (alerts, rule health, the circuit breaker), silences (`GET`/`POST
//! /v1/silences`, `DELETE /v1/silences/{id}`) and `POST /v1/alerts/breaker/reset`. Changing
//! silences and resetting the breaker are for operators (see `auth.rs`); every change is
//! saved at once and audited in the `events` table.

use crate::auth::Identity;
use crate::{ApiError, AppState};
use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::{Extension, http::StatusCode};
use perch_alerts::{Matcher, SilenceRequest};
use perch_model::ClusterEvent;
use serde::Deserialize;
use serde_json::{Value, json};

pub async fn alerts(State(state): State<AppState>) -> Json<Value> {
    let now = state.now_ms();
    let (alerts, rules, breaker, drained, dry_run) = state.alerts.with(|e| {
        (
            e.alerts(now),
            e.rule_status(),
            e.breaker().cloned(),
            e.drained_by_perch()
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>(),
            e.config().dry_run,
        )
    });
    Json(json!({
        "alerts": alerts,
        "rules": rules,
        "remediation": {
            "dry_run": dry_run,
            "circuit_breaker": breaker,
            "nodes_drained_by_perch": drained,
        },
    }))
}

pub async fn silences(State(state): State<AppState>) -> Json<Value> {
    let now = state.now_ms();
    let list: Vec<Value> = state
        .alerts
        .with(|e| e.silences(now))
        .into_iter()
        .map(|(s, st)| {
            let mut v = serde_json::to_value(&s).unwrap_or(Value::Null);
            if let Value::Object(m) = &mut v {
                m.insert(
                    "state".into(),
                    serde_json::to_value(st).unwrap_or(Value::Null),
                );
            }
            v
        })
        .collect();
    Json(json!({ "silences": list }))
}

/// `POST /v1/silences`: who creates it comes from the caller's token.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSilence {
    pub matchers: Vec<Matcher>,
    #[serde(default)]
    pub starts_at_ms: Option<i64>,
    /// The end, Unix ms; or give `duration`.
    #[serde(default)]
    pub ends_at_ms: Option<i64>,
    /// How long from the start (`"2h"`); or give `ends_at_ms`.
    #[serde(default)]
    pub duration: Option<perch_alerts::HumanDuration>,
    pub comment: String,
}

async fn audit(state: &AppState, event: ClusterEvent) {
    if let Err(e) = state.store.append_events(&[event]).await {
        tracing::error!(error = %e, "could not record an alerting event");
    }
}

pub async fn add_silence(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    body: Result<Json<NewSilence>, JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(body) = body.map_err(|e| {
        ApiError::json_body(
            &e,
            crate::ErrorCode::BadSilence,
            format!(
                "{}; send {{\"matchers\": [{{\"name\": \"node\", \"value\": \"gpu-07\"}}], \"duration\": \"2h\", \"comment\": \"why\"}}",
                e.body_text()
            ),
        )
    })?;
    let now = state.now_ms();
    let request = SilenceRequest {
        matchers: body.matchers,
        starts_at_ms: body.starts_at_ms,
        ends_at_ms: body.ends_at_ms,
        duration: body.duration,
        created_by: who.user.clone(),
        comment: body.comment,
    };
    let silence = state
        .alerts
        .with(|e| e.add_silence(request, now))
        .map_err(|e| ApiError::bad_request(crate::ErrorCode::BadSilence, e.to_string()))?;
    state.alerts.save(now);
    let matchers: Vec<String> = silence.matchers.iter().map(ToString::to_string).collect();
    audit(
        &state,
        ClusterEvent::new(
            now,
            "silence_added",
            who.user,
            format!(
                "silence {} ({}) until {}: {}",
                silence.id,
                matchers.join(", "),
                perch_alerts::rfc3339(silence.ends_at_ms),
                silence.comment
            ),
        ),
    )
    .await;
    Ok((StatusCode::CREATED, Json(json!({ "silence": silence }))))
}

pub async fn expire_silence(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let now = state.now_ms();
    let silence = state
        .alerts
        .with(|e| e.expire_silence(&id, now))
        .map_err(|e| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                crate::ErrorCode::NoSuchSilence,
                e.to_string(),
            )
        })?;
    state.alerts.save(now);
    audit(
        &state,
        ClusterEvent::new(
            now,
            "silence_expired",
            who.user,
            format!("silence {id} expired"),
        ),
    )
    .await;
    Ok(Json(json!({ "silence": silence })))
}

pub async fn reset_breaker(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
) -> Json<Value> {
    let now = state.now_ms();
    let event = state.alerts.with(|e| e.reset_breaker(&who.user, now));
    state.alerts.save(now);
    let was_open = event.is_some();
    if let Some(event) = event {
        audit(&state, event).await;
    }
    Json(json!({
        "circuit_breaker": "closed",
        "was_open": was_open,
    }))
}
