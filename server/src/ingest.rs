//! `POST /v1/ingest`: where agents deliver telemetry batches.
//!
//! The body is a [`Batch`] in one of the encodings of [`perch_model::wire`], named by
//! `Content-Type`: JSON (`application/json`, or no `Content-Type`) or MessagePack
//! (`application/vnd.perch.batch+msgpack`, what perch agents send), optionally
//! `Content-Encoding: zstd` or `gzip`. Any other `Content-Type` is answered 415 naming the two,
//! and an agent that gets 415 falls back to JSON. Both decode to the same `Batch`, and
//! everything after (validation, deduplication, the latest view, forwarding) is one path; the
//! write-ahead log keeps the body as received, tagged with its encoding. The answer
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
use perch_model::wire::Encoding;
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
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("(not text)"));
    let result = handle(&state, &who, agent, content_type, body).await;
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
    content_type: Option<&str>,
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Value, ApiError> {
    if !state.ready.load(Ordering::Relaxed) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            crate::ErrorCode::NotReady,
            "the server is shutting down; retry later",
        ));
    }
    let encoding = Encoding::from_content_type(content_type).map_err(|e| {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            crate::ErrorCode::UnsupportedMediaType,
            e.to_string(),
        )
    })?;
    let body = body.map_err(|e| {
        ApiError::new(
            e.status(),
            crate::ErrorCode::UnreadableBody,
            format!("could not read the request body: {e}; send at most {} bytes (decompressed), encoded as zstd, gzip or not at all", state.config.max_body_bytes),
        )
    })?;
    let batch = encoding.decode(&body).map_err(|e| {
        ApiError::bad_request(
            crate::ErrorCode::MalformedBatch,
            format!(
                "the body is not a valid telemetry batch ({}): {e}",
                encoding.media_type()
            ),
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
    match state.store.ingest_encoded(encoding, body, &batch).await? {
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

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use perch_model::wire::{Encoding, MSGPACK_MEDIA_TYPE};
    use perch_model::{Batch, GpuIndex, GpuSample, NodeId};
    use std::sync::atomic::Ordering;
    use tower::ServiceExt;

    fn now_ms() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as i64
    }

    fn batch(node: &str, seq: u64) -> Batch {
        let mut b = Batch::new(NodeId::new(node).expect("node"), seq);
        b.gpus.push(GpuSample {
            time_ms: now_ms() - 1000,
            gpu: GpuIndex(0),
            uuid: "GPU-0".into(),
            model: "Test GPU".into(),
            simulated: true,
            utilization_gpu_pct: Some(seq as f64 % 100.0),
            ..GpuSample::default()
        });
        b
    }

    /// A server over a fresh data directory and its router; requests go as an operator.
    fn server(dir: &std::path::Path) -> (crate::AppState, axum::Router) {
        let mut config = crate::ServerConfig::new(perch_query::StoreConfig::new(dir));
        config.tokens = crate::auth::Tokens::parse(
            "[[tokens]]\ntoken = \"oper-token-0123456\"\nuser = \"ops\"\nrole = \"operator\"\n",
        )
        .expect("tokens");
        let state = crate::AppState::open(config).expect("state");
        let router = crate::router(state.clone());
        (state, router)
    }

    /// Posts `body` to `/v1/ingest` with `content_type` (none when `None`) and `zstd` when
    /// asked; the status and the answer's body.
    async fn post(
        router: &axum::Router,
        content_type: Option<&str>,
        body: Vec<u8>,
        zstd: bool,
    ) -> (u16, serde_json::Value) {
        let mut request = Request::builder()
            .method("POST")
            .uri("/v1/ingest")
            .header("authorization", "Bearer oper-token-0123456");
        if let Some(t) = content_type {
            request = request.header("content-type", t);
        }
        let body = if zstd {
            request = request.header("content-encoding", "zstd");
            zstd::bulk::compress(&body, 3).expect("zstd")
        } else {
            body
        };
        let answer = router
            .clone()
            .oneshot(request.body(Body::from(body)).expect("request"))
            .await
            .expect("answer");
        let status = answer.status().as_u16();
        let bytes = axum::body::to_bytes(answer.into_body(), 1 << 20)
            .await
            .expect("body");
        let value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (status, value)
    }

    async fn send(router: &axum::Router, encoding: Encoding, b: &Batch) -> serde_json::Value {
        let (status, answer) = post(
            router,
            Some(encoding.media_type()),
            encoding.encode(b).expect("encode"),
            encoding == Encoding::Msgpack,
        )
        .await;
        assert_eq!(status, 200, "{encoding:?}: {answer}");
        answer
    }

    /// Both encodings are one path: a batch sent once as MessagePack and again as JSON (or the
    /// other way round) is a duplicate the second time, both reach the latest view, and JSON
    /// without a Content-Type is still taken.
    #[tokio::test]
    async fn both_encodings_are_taken_and_deduplicated_on_one_stream() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (state, router) = server(dir.path());
        let answer = send(&router, Encoding::Msgpack, &batch("n1", 5)).await;
        assert_eq!(answer["duplicate"], false, "{answer}");
        assert_eq!(answer["samples"], 1, "{answer}");
        let answer = send(&router, Encoding::Json, &batch("n1", 5)).await;
        assert_eq!(answer["duplicate"], true, "{answer}");
        let answer = send(&router, Encoding::Json, &batch("n1", 6)).await;
        assert_eq!(answer["duplicate"], false, "{answer}");
        let answer = send(&router, Encoding::Msgpack, &batch("n1", 6)).await;
        assert_eq!(answer["duplicate"], true, "{answer}");
        let json = Encoding::Json.encode(&batch("n1", 7)).expect("json");
        let (status, answer) = post(&router, None, json, false).await;
        assert_eq!((status, &answer["duplicate"]), (200, &false.into()));
        let stats = &state.store.stats;
        assert_eq!(stats.batches_stored.load(Ordering::Relaxed), 3);
        assert_eq!(stats.batches_duplicate.load(Ordering::Relaxed), 2);
        let latest = state.latest.snapshot();
        let gpu = &latest["n1"].gpus[&0];
        assert_eq!(gpu.utilization_gpu_pct, Some(7.0));
    }

    #[tokio::test]
    async fn an_unknown_content_type_is_415_naming_the_accepted_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (state, router) = server(dir.path());
        let body = Encoding::Json.encode(&batch("n1", 1)).expect("json");
        for content_type in ["application/x-protobuf", "text/csv", "application/msgpack"] {
            let (status, answer) = post(&router, Some(content_type), body.clone(), false).await;
            assert_eq!(status, 415, "{content_type}: {answer}");
            assert_eq!(answer["error"]["code"], "unsupported_media_type");
            let message = answer["error"]["message"].as_str().expect("message");
            for named in [content_type, "application/json", MSGPACK_MEDIA_TYPE] {
                assert!(message.contains(named), "{named} not in {message}");
            }
        }
        assert_eq!(state.store.stats.batches_stored.load(Ordering::Relaxed), 0);
    }

    /// Malformed MessagePack is 400 `malformed_batch` naming what is wrong, never a panic:
    /// truncated, random bytes, lengths far past the body, deep nesting, JSON sent as
    /// MessagePack, a field of the wrong type. The server goes on taking good batches.
    #[tokio::test]
    async fn malformed_messagepack_is_400_naming_what_is_wrong() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (state, router) = server(dir.path());
        let good = Encoding::Msgpack.encode(&batch("n1", 1)).expect("encode");
        let mut wrong_type = serde_json::to_value(batch("n1", 1)).expect("value");
        wrong_type["gpus"][0]["uuid"] = 7.into();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let random: Vec<u8> = (0..2048)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut deep = b"\x81\xa4gpus".to_vec();
        deep.extend(std::iter::repeat_n(0x91u8, 50_000));
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("truncated", good[..good.len() / 2].to_vec(), "MessagePack"),
            ("random", random, "MessagePack"),
            ("huge map", b"\xdf\xff\xff\xff\xff".to_vec(), "MessagePack"),
            (
                "huge array",
                b"\x82\xa4node\xa2n1\xa4gpus\xdd\xff\xff\xff\xff".to_vec(),
                "MessagePack",
            ),
            ("deep", deep, "MessagePack"),
            (
                "JSON",
                Encoding::Json.encode(&batch("n1", 1)).expect("json"),
                "MessagePack",
            ),
            (
                "wrong type",
                rmp_serde::to_vec_named(&wrong_type).expect("encode"),
                "field `gpus[0].uuid`",
            ),
        ];
        for (what, body, says) in cases {
            for zstd in [false, true] {
                let (status, answer) =
                    post(&router, Some(MSGPACK_MEDIA_TYPE), body.clone(), zstd).await;
                assert_eq!(status, 400, "{what}: {answer}");
                assert_eq!(answer["error"]["code"], "malformed_batch", "{what}");
                let message = answer["error"]["message"].as_str().expect("message");
                assert!(message.contains(says), "{what}: {message}");
                assert!(message.contains(MSGPACK_MEDIA_TYPE), "{what}: {message}");
            }
        }
        send(&router, Encoding::Msgpack, &batch("n1", 1)).await;
        assert_eq!(state.store.stats.batches_stored.load(Ordering::Relaxed), 1);
    }
}
