//! `POST /v1/metrics`: the OpenTelemetry (OTLP/HTTP) metrics receiver jobs push to.
//!
//! The body is an `ExportMetricsServiceRequest`, protobuf (`application/x-protobuf`) or JSON
//! (`application/json`), optionally gzip or zstd encoded. Every gauge, sum and histogram data
//! point becomes one [`JobMetricSample`]; they are grouped by the resource's `host.name` (or
//! `otlp`) into [`Batch`]es and stored through the store's usual path (write-ahead log,
//! deduplication, buffer), so an answered export is durable. The answer is an
//! `ExportMetricsServiceResponse` in the request's encoding; exponential histograms and
//! summaries are counted as rejected in its partial success.
//!
//! With tokens, a point is stored only for a job its caller may write: a job's token files
//! everything under its own job, a user's token may name (`perch.job.id`) only that user's own
//! jobs, operators any. Points naming another user's job, or no job of this server, are refused
//! and named in the answer: 403 when nothing of the request is left, else a partial success.
//!
//! The store drops a batch whose `seq` is not above the last one of its sequence stream, so the
//! receiver numbers its batches itself, on a stream of its own ([`Source::Otlp`]) that no
//! agent's batches share: a job's export filed under its node's name never makes that node's
//! agent batches look old. One counter for all nodes, starting at the current Unix time in
//! microseconds (so it keeps rising across restarts), and each ingest happens under the same
//! lock as its numbering, so a later number can never be stored first.

use crate::auth::{Identity, Role};
use crate::{ApiError, AppState};
use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsPartialSuccess, ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{Metric, metric::Data, number_data_point};
use perch_model::{Batch, JobMetricSample, MAX_SAMPLES_PER_BATCH, NodeId};
use perch_query::Source;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

/// The node name used when the exporter's resource has no usable `host.name`.
pub const DEFAULT_NODE: &str = "otlp";

/// The last `seq` handed out; held while the batch carrying it is stored.
static LAST_SEQ: tokio::sync::Mutex<u64> = tokio::sync::Mutex::const_new(0);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Encoding {
    Protobuf,
    Json,
}

impl Encoding {
    fn content_type(self) -> &'static str {
        match self {
            Encoding::Protobuf => "application/x-protobuf",
            Encoding::Json => "application/json",
        }
    }
}

pub async fn metrics(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    if !state.ready.load(Ordering::Relaxed) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            crate::ErrorCode::NotReady,
            "the server is shutting down; retry later",
        ));
    }
    let encoding = encoding(&headers)?;
    let body = body.map_err(|e| {
        ApiError::new(
            e.status(),
            crate::ErrorCode::UnreadableBody,
            format!("could not read the request body: {e}"),
        )
    })?;
    let request = decode(encoding, &body)?;
    let mut converted = convert(&request);
    let owners = owners(&state, &who, &converted.samples);
    let refused = admit(&who, &mut converted.samples, &owners);
    if refused.points > 0 && converted.samples.values().all(Vec::is_empty) {
        // Nothing of it is stored: a refusal every SDK logs, and does not retry.
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            crate::ErrorCode::Forbidden,
            refused.message(),
        ));
    }
    store(&state, converted.samples).await?;
    let mut reasons = Vec::new();
    if converted.rejected > 0 {
        reasons.push("perch stores gauges, sums and histograms; exponential histograms and summaries were dropped".to_owned());
    }
    if refused.points > 0 {
        reasons.push(refused.message());
    }
    let rejected = converted.rejected + refused.points;
    let response = ExportMetricsServiceResponse {
        partial_success: (rejected > 0).then(|| ExportMetricsPartialSuccess {
            rejected_data_points: rejected,
            error_message: reasons.join("; "),
        }),
    };
    let bytes = match encoding {
        Encoding::Protobuf => prost::Message::encode_to_vec(&response),
        // OTLP/JSON leaves unset fields out rather than sending null.
        Encoding::Json => serde_json::to_vec(&match serde_json::to_value(&response) {
            Ok(serde_json::Value::Object(mut fields)) => {
                fields.retain(|_, v| !v.is_null());
                serde_json::Value::Object(fields)
            }
            other => other.unwrap_or_default(),
        })
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                crate::ErrorCode::Internal,
                format!("could not encode the response: {e}"),
            )
        })?,
    };
    Ok(([(header::CONTENT_TYPE, encoding.content_type())], bytes).into_response())
}

fn encoding(headers: &HeaderMap) -> Result<Encoding, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match mime.as_str() {
        "application/x-protobuf" | "application/protobuf" => Ok(Encoding::Protobuf),
        "application/json" => Ok(Encoding::Json),
        _ => Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            crate::ErrorCode::UnsupportedMediaType,
            format!(
                "Content-Type {content_type:?} is not supported; send an OTLP ExportMetricsServiceRequest as application/x-protobuf or application/json"
            ),
        )),
    }
}

fn decode(encoding: Encoding, body: &[u8]) -> Result<ExportMetricsServiceRequest, ApiError> {
    match encoding {
        Encoding::Protobuf => <ExportMetricsServiceRequest as prost::Message>::decode(body)
            .map_err(|e| {
                ApiError::bad_request(
                    crate::ErrorCode::MalformedOtlp,
                    format!("the body is not a protobuf OTLP ExportMetricsServiceRequest: {e}"),
                )
            }),
        Encoding::Json => serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(
                crate::ErrorCode::MalformedOtlp,
                format!("the body is not an OTLP/JSON ExportMetricsServiceRequest: {e}"),
            )
        }),
    }
}

/// What an export request turned into.
#[derive(Debug, Default)]
struct Converted {
    /// Data points per node.
    samples: BTreeMap<NodeId, Vec<JobMetricSample>>,
    /// Data points of kinds perch does not store.
    rejected: i64,
}

fn any_to_json(value: Option<&AnyValue>) -> serde_json::Value {
    use serde_json::Value as J;
    let Some(v) = value.and_then(|v| v.value.as_ref()) else {
        return J::Null;
    };
    match v {
        any_value::Value::StringValue(s) => J::String(s.clone()),
        any_value::Value::BoolValue(b) => J::Bool(*b),
        any_value::Value::IntValue(i) => J::from(*i),
        any_value::Value::DoubleValue(d) => J::from(*d),
        any_value::Value::ArrayValue(a) => {
            J::Array(a.values.iter().map(|v| any_to_json(Some(v))).collect())
        }
        any_value::Value::KvlistValue(kv) => attributes_json(&kv.values),
        any_value::Value::BytesValue(b) => {
            J::String(b.iter().map(|x| format!("{x:02x}")).collect())
        }
        any_value::Value::StringValueStrindex(_) => J::Null,
    }
}

fn attributes_json(attrs: &[KeyValue]) -> serde_json::Value {
    serde_json::Value::Object(
        attrs
            .iter()
            .map(|kv| (kv.key.clone(), any_to_json(kv.value.as_ref())))
            .collect(),
    )
}

fn string_attr(attrs: &[KeyValue], key: &str) -> String {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| match any_to_json(kv.value.as_ref()) {
            serde_json::Value::String(s) => s,
            serde_json::Value::Null => String::new(),
            other => other.to_string(),
        })
        .unwrap_or_default()
}

fn time_ms(time_unix_nano: u64) -> i64 {
    i64::try_from(time_unix_nano / 1_000_000).unwrap_or(i64::MAX)
}

/// Every data point of `metric` that perch stores, with its kind-specific value.
fn points(metric: &Metric, base: &JobMetricSample, out: &mut Vec<JobMetricSample>) -> i64 {
    let with = |kind: &str, time: u64, attrs: &[KeyValue]| JobMetricSample {
        time_ms: time_ms(time),
        metric: metric.name.clone(),
        kind: kind.into(),
        unit: metric.unit.clone(),
        attributes: attributes_json(attrs).to_string(),
        ..base.clone()
    };
    let number = |v: Option<number_data_point::Value>| match v {
        Some(number_data_point::Value::AsDouble(d)) => Some(d),
        Some(number_data_point::Value::AsInt(i)) => Some(i as f64),
        None => None,
    };
    match &metric.data {
        Some(Data::Gauge(g)) => out.extend(g.data_points.iter().map(|p| JobMetricSample {
            value: number(p.value),
            ..with("gauge", p.time_unix_nano, &p.attributes)
        })),
        Some(Data::Sum(s)) => out.extend(s.data_points.iter().map(|p| JobMetricSample {
            value: number(p.value),
            ..with("sum", p.time_unix_nano, &p.attributes)
        })),
        Some(Data::Histogram(h)) => out.extend(h.data_points.iter().map(|p| JobMetricSample {
            value: p.sum.filter(|_| p.count > 0).map(|s| s / p.count as f64),
            count: Some(p.count),
            sum: p.sum,
            ..with("histogram", p.time_unix_nano, &p.attributes)
        })),
        Some(Data::ExponentialHistogram(h)) => return h.data_points.len() as i64,
        Some(Data::Summary(s)) => return s.data_points.len() as i64,
        None => {}
    }
    0
}

fn convert(request: &ExportMetricsServiceRequest) -> Converted {
    let mut out = Converted::default();
    for rm in &request.resource_metrics {
        let attrs = rm
            .resource
            .as_ref()
            .map(|r| r.attributes.as_slice())
            .unwrap_or_default();
        let host = string_attr(attrs, "host.name");
        let node = NodeId::new(&host)
            .or_else(|_| NodeId::new(DEFAULT_NODE))
            .ok();
        let base = JobMetricSample {
            job: string_attr(attrs, "perch.job.id"),
            user: string_attr(attrs, "perch.user"),
            service_name: string_attr(attrs, "service.name"),
            simulated: string_attr(attrs, "perch.simulated").eq_ignore_ascii_case("true"),
            ..JobMetricSample::default()
        };
        let mut samples = Vec::new();
        for sm in &rm.scope_metrics {
            for metric in &sm.metrics {
                out.rejected += points(metric, &base, &mut samples);
            }
        }
        match node {
            Some(node) => out.samples.entry(node).or_default().extend(samples),
            None => out.rejected += samples.len() as i64,
        }
    }
    out
}

/// The owner of each job the points name, for a user's token ([`admit`] needs them): one
/// look-up under the control lock for the whole request. `None`: no job of that id.
fn owners(
    state: &AppState,
    who: &Identity,
    samples: &BTreeMap<NodeId, Vec<JobMetricSample>>,
) -> BTreeMap<u64, Option<String>> {
    if who.role == Role::Operator || who.job.is_some() {
        return BTreeMap::new();
    }
    let ids: std::collections::BTreeSet<u64> = samples
        .values()
        .flatten()
        .filter_map(|s| s.job.parse().ok())
        .collect();
    if ids.is_empty() {
        return BTreeMap::new();
    }
    state.jobs.read(|c| {
        ids.into_iter()
            .map(|id| (id, c.find(id).map(|f| f.user().to_owned())))
            .collect()
    })
}

/// Points [`admit`] refused, and why.
#[derive(Debug, Default, PartialEq)]
struct Refused {
    points: i64,
    /// Each refused `perch.job.id` and why (the first few, for the message).
    jobs: BTreeMap<String, String>,
}

/// Jobs named in a refusal's message at most.
const NAMED_JOBS: usize = 5;

impl Refused {
    fn message(&self) -> String {
        let mut named: Vec<String> = self
            .jobs
            .iter()
            .take(NAMED_JOBS)
            .map(|(job, why)| {
                let shown: String = job.chars().take(40).collect();
                format!("job {shown:?} {why}")
            })
            .collect();
        if self.jobs.len() > NAMED_JOBS {
            named.push("and other jobs".to_owned());
        }
        format!(
            "{} data point(s) refused: {}; a user's token pushes metrics for that user's own jobs only (or for none: leave perch.job.id out), and a job pushes its own with the token perch gives it in OTEL_EXPORTER_OTLP_HEADERS",
            self.points,
            named.join(", ")
        )
    }
}

/// Files the points under who sent them, whatever their resource attributes claim, and keeps
/// only those the caller may write: a job's token speaks for its job and user only; a user's
/// token for that user, and for a job (`perch.job.id`) only when it is one of the user's own
/// (`owners`), so no one fills another's job's series or charts; operators (and open mode)
/// push as the attributes say. Returns what was refused.
fn admit(
    who: &Identity,
    samples: &mut BTreeMap<NodeId, Vec<JobMetricSample>>,
    owners: &BTreeMap<u64, Option<String>>,
) -> Refused {
    let mut refused = Refused::default();
    if who.role == Role::Operator && who.job.is_none() {
        return refused;
    }
    for points in samples.values_mut() {
        points.retain_mut(|sample| {
            if let Some(job) = who.job {
                sample.job = job.to_string();
            } else if !sample.job.is_empty() {
                let why = match sample.job.parse::<u64>().ok().map(|id| owners.get(&id)) {
                    Some(Some(Some(owner))) if who.may_act_on(owner) => None,
                    Some(Some(Some(owner))) => {
                        Some(format!("belongs to {owner}, not {}", who.user))
                    }
                    _ => Some("names no job of this server".to_owned()),
                };
                if let Some(why) = why {
                    refused.points += 1;
                    if refused.jobs.len() <= NAMED_JOBS {
                        refused.jobs.entry(sample.job.clone()).or_insert(why);
                    }
                    return false;
                }
            }
            sample.user.clone_from(&who.user);
            true
        });
    }
    refused
}

/// Stores the data points, one batch per node (split at the batch size limit).
async fn store(
    state: &AppState,
    samples: BTreeMap<NodeId, Vec<JobMetricSample>>,
) -> Result<(), ApiError> {
    let now = state.now_ms();
    let now_micros = u64::try_from(state.config.clock.now_micros()).unwrap_or(0);
    for (node, samples) in samples {
        for chunk in samples.chunks(MAX_SAMPLES_PER_BATCH) {
            let mut last = LAST_SEQ.lock().await;
            let seq = (*last + 1).max(now_micros);
            let batch = Batch {
                job_metrics: chunk.to_vec(),
                ..Batch::new(node.clone(), seq)
            };
            batch.validate(now).map_err(|e| {
                ApiError::bad_request(
                    crate::ErrorCode::InvalidOtlp,
                    format!("the OTLP export holds a data point perch cannot store: {e}"),
                )
            })?;
            let raw = serde_json::to_vec(&batch).map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    crate::ErrorCode::Internal,
                    format!("could not encode the batch: {e}"),
                )
            })?;
            *last = seq;
            state
                .store
                .ingest_from(Source::Otlp, Bytes::from(raw), &batch)
                .await?;
            state.latest.update_job_metrics(&batch.job_metrics, now);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::metrics::v1::{
        Gauge, Histogram, HistogramDataPoint, NumberDataPoint, ResourceMetrics, ScopeMetrics,
        Summary, SummaryDataPoint,
    };
    use opentelemetry_proto::tonic::resource::v1::Resource;

    fn kv(key: &str, v: any_value::Value) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Some(AnyValue { value: Some(v) }),
            ..KeyValue::default()
        }
    }

    fn s(v: &str) -> any_value::Value {
        any_value::Value::StringValue(v.into())
    }

    #[test]
    fn converts_gauges_histograms_and_counts_the_rest() {
        const T: u64 = 1_800_000_000_123_456_789;
        let metric = |name: &str, data| Metric {
            name: name.into(),
            unit: "1".into(),
            data: Some(data),
            ..Metric::default()
        };
        let request = ExportMetricsServiceRequest {
            resource_metrics: vec![ResourceMetrics {
                resource: Some(Resource {
                    attributes: vec![
                        kv("perch.job.id", s("42")),
                        kv("perch.user", s("ada")),
                        kv("host.name", s("gpu-01")),
                    ],
                    ..Resource::default()
                }),
                scope_metrics: vec![ScopeMetrics {
                    metrics: vec![
                        metric(
                            "loss",
                            Data::Gauge(Gauge {
                                data_points: vec![NumberDataPoint {
                                    time_unix_nano: T,
                                    value: Some(number_data_point::Value::AsDouble(0.25)),
                                    attributes: vec![kv("phase", s("train"))],
                                    ..NumberDataPoint::default()
                                }],
                            }),
                        ),
                        metric(
                            "step_seconds",
                            Data::Histogram(Histogram {
                                data_points: vec![HistogramDataPoint {
                                    time_unix_nano: T,
                                    count: 4,
                                    sum: Some(2.0),
                                    ..HistogramDataPoint::default()
                                }],
                                ..Histogram::default()
                            }),
                        ),
                        metric(
                            "latency",
                            Data::Summary(Summary {
                                data_points: vec![SummaryDataPoint::default()],
                            }),
                        ),
                    ],
                    ..ScopeMetrics::default()
                }],
                ..ResourceMetrics::default()
            }],
        };
        let out = convert(&request);
        assert_eq!(out.rejected, 1);
        let rows = &out.samples[&NodeId::new("gpu-01").expect("valid")];
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].time_ms, 1_800_000_000_123);
        assert_eq!((rows[0].job.as_str(), rows[0].user.as_str()), ("42", "ada"));
        assert_eq!(rows[0].value, Some(0.25));
        assert_eq!(rows[0].attributes, r#"{"phase":"train"}"#);
        assert_eq!(rows[1].kind, "histogram");
        assert_eq!(
            (rows[1].value, rows[1].count, rows[1].sum),
            (Some(0.5), Some(4), Some(2.0))
        );
    }

    /// A user's token may name its own jobs only; a job's token and an operator are not
    /// limited by the attributes.
    #[test]
    fn a_users_token_writes_only_its_own_jobs() {
        let node = NodeId::new("gpu-01").expect("valid");
        let point = |job: &str| JobMetricSample {
            job: job.into(),
            user: "claimed".into(),
            metric: "loss".into(),
            ..JobMetricSample::default()
        };
        let points =
            || BTreeMap::from([(node.clone(), ["1", "2", "", "99", "x"].map(point).to_vec())]);
        let owners = BTreeMap::from([
            (1, Some("alice".to_owned())),
            (2, Some("bob".to_owned())),
            (99, None),
        ]);
        let who = |user: &str, role, job| Identity {
            user: user.into(),
            role,
            nodes: None,
            job,
        };
        let kept = |s: &BTreeMap<NodeId, Vec<JobMetricSample>>| -> Vec<(String, String)> {
            s.values()
                .flatten()
                .map(|p| (p.job.clone(), p.user.clone()))
                .collect()
        };
        let pair = |j: &str, u: &str| (j.to_owned(), u.to_owned());

        let mut s = points();
        let refused = admit(&who("alice", Role::User, None), &mut s, &owners);
        assert_eq!(kept(&s), vec![pair("1", "alice"), pair("", "alice")]);
        assert_eq!(refused.points, 3);
        let message = refused.message();
        for part in [
            "3 data point(s) refused",
            "job \"2\" belongs to bob, not alice",
            "job \"99\" names no job of this server",
            "job \"x\" names no job",
        ] {
            assert!(message.contains(part), "{message}");
        }

        let mut s = points();
        let refused = admit(&who("bob", Role::User, Some(2)), &mut s, &BTreeMap::new());
        assert_eq!(refused, Refused::default());
        assert_eq!(kept(&s), vec![pair("2", "bob"); 5]);

        let mut s = points();
        let refused = admit(&who("ops", Role::Operator, None), &mut s, &BTreeMap::new());
        assert_eq!(refused, Refused::default());
        assert_eq!(kept(&s)[1], pair("2", "claimed"));
    }

    #[test]
    fn content_types() {
        let check = |ct: &str, want: Option<Encoding>| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, ct.parse().expect("header"));
            assert_eq!(encoding(&h).ok(), want, "{ct}");
        };
        check("application/x-protobuf", Some(Encoding::Protobuf));
        check("application/json; charset=utf-8", Some(Encoding::Json));
        check("text/plain", None);
    }
}
