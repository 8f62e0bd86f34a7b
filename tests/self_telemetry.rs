//! perch's own telemetry over OTLP/HTTP. Metrics: one perch (`up`, so a server and an agent)
//! and a `perch agent` export their health counters to a second perch's OTLP receiver, where
//! they arrive as `job_metrics` rows. Traces: a perch server exports to a small OTLP receiver in this test,
//! which decodes the protobuf requests; the spans of an SQL query and an ingest arrive under
//! their HTTP request's span, with `service.name`, and the ones still buffered at SIGTERM are
//! flushed on the way out. The first uses `[telemetry]` in the config file, the second the
//! standard `OTEL_EXPORTER_OTLP_ENDPOINT`.

mod common;

use common::{Agent, Perch, marked_batch, wait_for};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;
use std::sync::{Arc, Mutex};

#[test]
fn own_metrics_arrive_in_another_perch() {
    let dir = tempfile::tempdir().expect("tempdir");
    // No PostgreSQL listener: the default port may be another test's.
    let no_pg = dir.path().join("no-pg.toml");
    std::fs::write(&no_pg, "[server]\npg_listen = \"\"\n").expect("write config");
    let no_pg = no_pg.to_string_lossy().into_owned();
    let receiver = Perch::start(
        &dir.path().join("receiver"),
        &["server", "--config", &no_pg],
    );
    let config = dir.path().join("perch.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\npg_listen = \"\"\n[telemetry]\notlp_endpoint = \"{}\"\nexport_interval_secs = 1\n",
            receiver.url
        ),
    )
    .expect("write config");
    let config = config.to_string_lossy().into_owned();
    let exporter = Perch::start(
        &dir.path().join("exporter"),
        &[
            "up",
            "--config",
            &config,
            "--simulate-gpus",
            "1",
            "--interval-ms",
            "100",
            "--nvml",
            "off",
        ],
    );
    assert!(
        exporter
            .log()
            .contains("exporting perch's own traces and metrics over OTLP/HTTP"),
        "{}",
        exporter.log()
    );
    // An SQL query, so perch_sql_queries has a series.
    wait_for("the exporter's own GPU samples", || {
        (exporter.scalar("SELECT count(*) FROM gpu_samples") > 0).then_some(())
    });

    // Counters the exporter keeps arrive as sums, labelled with its service.
    let latest = |metric: &str, attributes: &str| {
        receiver
            .sql(&format!(
                "SELECT value, kind FROM job_metrics WHERE service_name = 'perch-server' \
                 AND metric = '{metric}' AND attributes = '{attributes}' \
                 ORDER BY time DESC LIMIT 1"
            ))
            .into_iter()
            .next()
    };
    let stored = wait_for(
        "perch_ingest_requests{outcome=stored} in the receiver",
        || {
            latest("perch_ingest_requests", r#"{"outcome":"stored"}"#)
                .filter(|row| row["value"].as_f64().is_some_and(|v| v >= 1.0))
        },
    );
    assert_eq!(stored["kind"], "sum", "{stored}");
    let queries = wait_for("perch_sql_queries{outcome=ok}", || {
        latest("perch_sql_queries", r#"{"outcome":"ok"}"#)
    });
    assert!(
        queries["value"].as_f64().is_some_and(|v| v >= 1.0),
        "{queries}"
    );
    let syncs = wait_for("perch_wal_syncs", || latest("perch_wal_syncs", "{}"));
    assert!(syncs["value"].as_f64().is_some_and(|v| v >= 1.0), "{syncs}");
    let buffered = wait_for("perch_store_buffered_rows", || {
        latest("perch_store_buffered_rows", "{}")
    });
    assert_eq!(buffered["kind"], "gauge", "{buffered}");
    let running = wait_for("perch_jobs{state=running}", || {
        latest("perch_jobs", r#"{"state":"running"}"#)
    });
    assert_eq!(running["kind"], "gauge", "{running}");
    assert_eq!(
        running["value"].as_f64(),
        Some(0.0),
        "no job runs: {running}"
    );
    let node = exporter.sql("SELECT DISTINCT node FROM gpu_samples");
    let node = node[0]["node"].as_str().expect("node name");
    let rounds = wait_for("perch_agent_rounds of the local agent", || {
        latest("perch_agent_rounds", &format!(r#"{{"node":"{node}"}}"#))
    });
    assert!(
        rounds["value"].as_f64().is_some_and(|v| v >= 1.0),
        "{rounds}"
    );

    // A separate `perch agent` exports as perch-agent.
    let _agent = Agent::start(
        &receiver.url,
        "otel-agent",
        &dir.path().join("agent"),
        1,
        None,
        &["--interval-ms", "100", "--config", &config],
    );
    let sent = wait_for("perch_agent_batches_sent from perch agent", || {
        receiver
            .sql(
                "SELECT value FROM job_metrics WHERE service_name = 'perch-agent' \
                 AND metric = 'perch_agent_batches_sent' \
                 AND attributes = '{\"node\":\"otel-agent\"}' AND value >= 1 LIMIT 1",
            )
            .into_iter()
            .next()
    });
    assert!(sent["value"].as_f64().is_some_and(|v| v >= 1.0), "{sent}");

    // The receiver's copy agrees with the exporter's own /metrics, within the counting since.
    // Read the export first: the counter only grows, so a later scrape is at least as high.
    let exported = latest("perch_ingest_requests", r#"{"outcome":"stored"}"#)
        .and_then(|row| row["value"].as_f64())
        .expect("exported");
    let scrape = reqwest::blocking::get(format!("{}/metrics", exporter.url))
        .and_then(|r| r.text())
        .expect("GET /metrics");
    let scraped: f64 = scrape
        .lines()
        .find_map(|l| l.strip_prefix(r#"perch_ingest_requests_total{outcome="stored"} "#))
        .and_then(|v| v.parse().ok())
        .expect("perch_ingest_requests_total on /metrics");
    assert!(
        exported <= scraped,
        "exported {exported} is a count the scrape ({scraped}) has passed"
    );
}

/// What the test's OTLP receiver got: decoded trace exports, and how many metric exports.
#[derive(Default)]
struct Received {
    traces: Vec<ExportTraceServiceRequest>,
    metric_posts: usize,
}

/// An OTLP/HTTP receiver on 127.0.0.1 (its own thread and runtime); returns its base URL.
fn otlp_receiver(received: Arc<Mutex<Received>>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let traces = received.clone();
            let app = axum::Router::new()
                .route(
                    "/v1/traces",
                    axum::routing::post(move |body: axum::body::Bytes| {
                        let traces = traces.clone();
                        async move {
                            match ExportTraceServiceRequest::decode(body) {
                                Ok(request) => {
                                    traces.lock().expect("lock").traces.push(request);
                                    axum::http::StatusCode::OK
                                }
                                Err(_) => axum::http::StatusCode::BAD_REQUEST,
                            }
                        }
                    }),
                )
                .route(
                    "/v1/metrics",
                    axum::routing::post(move || {
                        received.lock().expect("lock").metric_posts += 1;
                        async { axum::http::StatusCode::OK }
                    }),
                );
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            axum::serve(listener, app).await.expect("serve");
        });
    });
    url
}

fn string_attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a str> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref().and_then(|v: &AnyValue| v.value.as_ref()) {
            Some(any_value::Value::StringValue(s)) => Some(s.as_str()),
            _ => None,
        }
    })
}

/// One exported span: its name, IDs, and the service that sent it.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    span_id: Vec<u8>,
    parent_span_id: Vec<u8>,
    trace_id: Vec<u8>,
    service: String,
    attributes: Vec<KeyValue>,
}

fn spans(received: &Mutex<Received>) -> Vec<Span> {
    let received = received.lock().expect("lock");
    let mut out = Vec::new();
    for request in &received.traces {
        for resource_spans in &request.resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| string_attribute(&r.attributes, "service.name"))
                .unwrap_or_default()
                .to_owned();
            for scope in &resource_spans.scope_spans {
                for s in &scope.spans {
                    out.push(Span {
                        name: s.name.clone(),
                        span_id: s.span_id.clone(),
                        parent_span_id: s.parent_span_id.clone(),
                        trace_id: s.trace_id.clone(),
                        service: service.clone(),
                        attributes: s.attributes.clone(),
                    });
                }
            }
        }
    }
    out
}

#[test]
fn own_spans_arrive_over_otlp_and_are_flushed_at_exit() {
    let received = Arc::new(Mutex::new(Received::default()));
    let endpoint = otlp_receiver(received.clone());
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    std::fs::write(&config, "[server]\npg_listen = \"\"\n").expect("write config");
    let config = config.to_string_lossy().into_owned();
    let mut perch = Perch::start_with_env(
        &dir.path().join("data"),
        &["server", "--config", &config],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)],
    );
    let client = reqwest::blocking::Client::new();
    let answer = client
        .post(format!("{}/v1/ingest", perch.url))
        .json(&marked_batch("trace-node", 1))
        .send()
        .expect("POST /v1/ingest");
    assert!(answer.status().is_success(), "{answer:?}");
    assert_eq!(perch.scalar("SELECT count(*) FROM gpu_samples"), 1);
    // SIGTERM: the server stops, flushes its buffer, and the exporter sends what it holds.
    let status = perch.terminate();
    assert!(status.success(), "{status}; log:\n{}", perch.log());

    let spans = wait_for(
        "the spans of the ingest, the query and the final flush",
        || {
            let spans = spans(&received);
            let has = |name: &str| spans.iter().any(|s| s.name == name);
            (has("POST /v1/sql") && has("sql.query") && has("store.ingest") && has("store.flush"))
                .then_some(spans)
        },
    );
    assert!(
        spans.iter().all(|s| s.service == "perch-server"),
        "{:?}",
        spans
            .iter()
            .map(|s| (&s.name, &s.service))
            .collect::<Vec<_>>()
    );
    // The server runs SQL of its own (accounting, alert rules): find the test's query by text.
    let find = |name: &str, attribute: Option<(&str, &str)>| {
        spans
            .iter()
            .find(|s| {
                s.name == name
                    && attribute.is_none_or(|(k, v)| string_attribute(&s.attributes, k) == Some(v))
            })
            .unwrap_or_else(|| panic!("no {name} span with {attribute:?}"))
    };
    let request = find("POST /v1/sql", Some(("http.route", "/v1/sql")));
    let query = find(
        "sql.query",
        Some(("db.query.text", "SELECT count(*) FROM gpu_samples")),
    );
    let ingest_request = find("POST /v1/ingest", None);
    let ingest = find("store.ingest", Some(("node", "trace-node")));
    // A handler's span is a child of its request's span, in the same trace.
    for (child, parent) in [(query, request), (ingest, ingest_request)] {
        assert_eq!(
            child.parent_span_id, parent.span_id,
            "{} under {}",
            child.name, parent.name
        );
        assert_eq!(
            child.trace_id, parent.trace_id,
            "{} in {}'s trace",
            child.name, parent.name
        );
    }
    assert!(
        received.lock().expect("lock").metric_posts >= 1,
        "the metrics were exported at least at exit"
    );
}
