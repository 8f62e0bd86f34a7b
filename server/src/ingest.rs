//! `POST /v1/ingest`: where agents deliver telemetry batches.
//!
//! The body is a JSON [`Batch`] (optionally `Content-Encoding: zstd` or `gzip`). The answer
//! is 200 only once the batch is durable: `{"accepted": true, "duplicate": false, "samples": N}`.
//! A batch already accepted (same node, `seq` not above the last) is answered 200 with
//! `"duplicate": true` and stored nowhere. A malformed or invalid batch gets 400 with a message
//! naming the field; the agent must not resend it. 503 means try again later. An agent token's
//! batch carries its agent's id in `x-perch-agent`, checked against the node's claim before
//! its sequence number counts; without it the batch is refused (400).

use crate::auth::{Identity, Role};
use crate::{ApiError, AppState};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::{Extension, Json};
use perch_model::Batch;
use perch_query::IngestOutcome;
use std::sync::atomic::Ordering;

/// The header an agent sends its id in ([`perch_control::JobService::claim_node`]).
pub const AGENT_HEADER: &str = "x-perch-agent";

pub async fn ingest(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let agent = headers.get(AGENT_HEADER).and_then(|v| v.to_str().ok());
    let result = handle(&state, &who, agent, body).await;
    let outcome = match &result {
        Ok(v) if v["duplicate"] == true => "duplicate",
        Ok(_) => "stored",
        Err(e) if e.status.is_client_error() => "rejected",
        Err(_) => "error",
    };
    state.metrics.ingest_requests(outcome);
    result.map(Json)
}

async fn handle(
    state: &AppState,
    who: &Identity,
    agent: Option<&str>,
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Value, ApiError> {
    if !state.ready.load(Ordering::Relaxed) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            crate::ErrorCode::NotReady,
            "the server is shutting down; retry later",
        ));
    }
    let body = body.map_err(|e| {
        ApiError::new(
            e.status(),
            crate::ErrorCode::UnreadableBody,
            format!("could not read the request body: {e}; send at most {} bytes (decompressed), encoded as zstd, gzip or not at all", state.config.max_body_bytes),
        )
    })?;
    let batch: Batch = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            crate::ErrorCode::MalformedBatch,
            format!("the body is not a valid telemetry batch: {e}"),
        )
    })?;
    who.may_speak_for(batch.node.as_str()).map_err(|m| {
        crate::ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            crate::ErrorCode::Forbidden,
            m,
        )
    })?;
    // Before the store sees its sequence number: one batch of a second agent under the node's
    // name, numbered from that agent's later start, made the node's own batches duplicates.
    match agent {
        Some(agent) => state.jobs.claim_node(batch.node.as_str(), agent)?,
        // Without an id the claim cannot be checked, and one batch numbered u64::MAX would
        // make every later batch of the node's own agent a duplicate: an agent token must
        // say which agent it is. Operators (and open mode) may still post by hand.
        None if who.role == Role::Agent => {
            return Err(ApiError::bad_request(
                crate::ErrorCode::InvalidBatch,
                format!(
                    "batch {} from node {}: an agent token's batch must carry its agent's id in the {AGENT_HEADER} header (as perch agents send it); upgrade this node's agent",
                    batch.seq, batch.node
                ),
            ));
        }
        None => {}
    }
    let now = state.now_ms();
    batch.validate(now).map_err(|e| {
        ApiError::bad_request(
            crate::ErrorCode::InvalidBatch,
            format!("batch {} from node {}: {e}", batch.seq, batch.node),
        )
    })?;
    match state.store.ingest(body, &batch).await? {
        IngestOutcome::Stored { samples } => {
            if let Some(forward) = &state.forward {
                // An ingest server: the control server takes the node's latest state.
                forward.add(&batch);
                return Ok(
                    serde_json::json!({"accepted": true, "duplicate": false, "samples": samples}),
                );
            }
            state.latest.update(&batch, now);
            let telemetry = !batch.gpus.is_empty()
                || !batch.gpu_events.is_empty()
                || !batch.gpu_processes.is_empty();
            if telemetry && state.jobs.knows_node(batch.node.as_str()) {
                // Telemetry feeds scheduling decisions; a failure here must not fail ingest.
                let jobs = state.jobs.clone();
                let observed = batch.clone();
                tokio::spawn(async move {
                    if let Err(e) = jobs.run(move |c, now| c.observe(&observed, now)).await {
                        tracing::warn!(error = %e, "could not pass telemetry to the scheduler");
                    }
                });
            }
            Ok(serde_json::json!({"accepted": true, "duplicate": false, "samples": samples}))
        }
        IngestOutcome::Duplicate => {
            Ok(serde_json::json!({"accepted": true, "duplicate": true, "samples": 0}))
        }
    }
}
