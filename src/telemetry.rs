//! perch's own traces and metrics, exported over OTLP/HTTP (protobuf) to a backend the site
//! already runs: an OpenTelemetry Collector, Tempo, Jaeger, or another perch's `/v1/metrics`.
//!
//! Traces are the `tracing` spans perch already opens (HTTP requests, ingest, flushes, SQL
//! queries...): a `tracing-opentelemetry` layer in the subscriber hands them to the SDK. Metrics
//! are perch's health counters as observable instruments whose callbacks read the counters the
//! server and the agent already keep for `/metrics` ([`observe_server`], [`observe_agent`]),
//! so nothing is counted twice and the two views cannot disagree. Names are the `/metrics`
//! names without `_total` (an OTLP sum is monotonic by type; Prometheus-compatible backends add
//! the suffix back), listed in docs/metrics.md.
//!
//! The SDK's batch span processor and periodic metric reader run on their own threads with a
//! blocking HTTP client, so exports never compete with the server's async tasks, and a slow or
//! absent backend costs dropped telemetry (logged by the SDK), never a stalled request.
//! [`Telemetry`] flushes both on drop, after the server has stopped.

use crate::config::TelemetrySection;
use anyhow::{Context, Result};
use opentelemetry::KeyValue;
use opentelemetry::metrics::Meter;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Where and how to export, once the config and the `OTEL_*` environment are merged.
#[derive(Clone, PartialEq)]
pub struct Target {
    /// Base URL without a trailing slash; the signal paths go after it.
    pub base: String,
    pub service: String,
    pub interval: Duration,
    pub headers: HashMap<String, String>,
}

/// Header values are credentials: only their names are shown.
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("base", &self.base)
            .field("service", &self.service)
            .field("interval", &self.interval)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Target {
    /// The export target, or `None` when export is off. `env` reads an environment variable
    /// (injected so tests need not change the process environment). The config's endpoint
    /// wins over `OTEL_EXPORTER_OTLP_ENDPOINT`, and its service name over
    /// `OTEL_SERVICE_NAME`; `OTEL_SDK_DISABLED=true` turns export off whatever the rest says.
    pub fn resolve(
        section: &TelemetrySection,
        default_service: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Target>> {
        let set = |v: Option<String>| v.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        if set(env("OTEL_SDK_DISABLED")).is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let base = match set(Some(section.otlp_endpoint.clone())) {
            Some(base) => base,
            None => match set(env("OTEL_EXPORTER_OTLP_ENDPOINT")) {
                Some(base) if base.starts_with("http://") || base.starts_with("https://") => base,
                Some(base) => anyhow::bail!(
                    "OTEL_EXPORTER_OTLP_ENDPOINT={base:?} is not an http:// or https:// URL; set it to one such as http://collector:4318, or unset it"
                ),
                None => return Ok(None),
            },
        };
        let service = set(Some(section.service_name.clone()))
            .or_else(|| set(env("OTEL_SERVICE_NAME")))
            .unwrap_or_else(|| default_service.to_owned());
        Ok(Some(Target {
            base: base.trim_end_matches('/').to_owned(),
            service,
            interval: Duration::from_secs(section.export_interval_secs.max(1)),
            headers: section
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }))
    }

    fn url(&self, signal: &str) -> String {
        format!("{}/v1/{signal}", self.base)
    }
}

/// The running exporters; dropping it flushes what is buffered and stops them. Holds nothing
/// when export is off.
#[derive(Debug, Default)]
pub struct Telemetry {
    target: Option<Target>,
    tracer_provider: Option<SdkTracerProvider>,
    meter_provider: Option<SdkMeterProvider>,
}

impl Telemetry {
    /// Starts the exporters for `target` and makes the meter provider global (so
    /// [`observe_server`] and [`observe_agent`] reach it). Call it outside an async runtime:
    /// the blocking HTTP client runs on the SDK's own threads.
    pub fn start(target: Option<Target>) -> Result<Telemetry> {
        let Some(target) = target else {
            return Ok(Telemetry::default());
        };
        let resource = Resource::builder()
            .with_service_name(target.service.clone())
            .with_attributes([
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
                // The perch receiver files metrics under this node name.
                KeyValue::new("host.name", crate::config::hostname()),
            ])
            .build();
        let spans = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(target.url("traces"))
            .with_headers(target.headers.clone())
            .build()
            .with_context(|| format!("starting the OTLP span exporter for {}", target.base))?;
        let tracer_provider = SdkTracerProvider::builder()
            .with_resource(resource.clone())
            .with_batch_exporter(spans)
            .build();
        let metrics = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(target.url("metrics"))
            .with_headers(target.headers.clone())
            .build()
            .with_context(|| format!("starting the OTLP metric exporter for {}", target.base))?;
        let reader = PeriodicReader::builder(metrics)
            .with_interval(target.interval)
            .build();
        let meter_provider = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(reader)
            .build();
        opentelemetry::global::set_meter_provider(meter_provider.clone());
        Ok(Telemetry {
            target: Some(target),
            tracer_provider: Some(tracer_provider),
            meter_provider: Some(meter_provider),
        })
    }

    /// Where spans and metrics go, when export is on.
    pub fn target(&self) -> Option<&Target> {
        self.target.as_ref()
    }

    /// The tracer for the subscriber's OpenTelemetry layer, when export is on.
    pub fn tracer(&self) -> Option<SdkTracer> {
        self.tracer_provider.as_ref().map(|p| p.tracer("perch"))
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.tracer_provider.take()
            && let Err(e) = p.shutdown()
        {
            tracing::warn!(error = %e, "flushing perch's spans to the OTLP backend failed; the last spans are lost");
        }
        if let Some(p) = self.meter_provider.take()
            && let Err(e) = p.shutdown()
        {
            tracing::warn!(error = %e, "the last export of perch's metrics to the OTLP backend failed");
        }
    }
}

fn meter() -> Meter {
    opentelemetry::global::meter("perch")
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// How a metric reads its value at every export: a counter the server or agent keeps.
type Read = Box<dyn Fn() -> u64 + Send + Sync>;

/// A monotonic counter with `attributes`, read from `read` at every export.
fn counter(
    meter: &Meter,
    name: &'static str,
    help: &'static str,
    attributes: &[KeyValue],
    read: Read,
) {
    let attributes = attributes.to_vec();
    meter
        .u64_observable_counter(name)
        .with_description(help)
        .with_callback(move |o| o.observe(read(), &attributes))
        .build();
}

/// A gauge with `attributes`, read from `read` at every export.
fn gauge(
    meter: &Meter,
    name: &'static str,
    help: &'static str,
    attributes: &[KeyValue],
    read: Read,
) {
    let attributes = attributes.to_vec();
    meter
        .u64_observable_gauge(name)
        .with_description(help)
        .with_callback(move |o| o.observe(read(), &attributes))
        .build();
}

/// Registers the server's health counters on the global meter provider: ingest and SQL from
/// the `/metrics` registry, the store's and the write-ahead log's counters, and jobs by state
/// (from the control plane's snapshot, as `/metrics` reads it).
/// Without export on, the global provider is a no-op and this costs nothing.
pub fn observe_server(state: &perch_server::AppState) {
    let meter = meter();
    let metrics = state.metrics.clone();
    meter
        .u64_observable_counter("perch_ingest_requests")
        .with_description("Ingest requests by outcome (stored, duplicate, rejected, error)")
        .with_callback(move |o| {
            for (outcome, n) in metrics.ingest_requests_by_outcome() {
                o.observe(n, &[KeyValue::new("outcome", outcome)]);
            }
        })
        .build();
    let metrics = state.metrics.clone();
    meter
        .u64_observable_counter("perch_sql_queries")
        .with_description(
            "SQL queries by outcome (ok, error), over HTTP and the PostgreSQL protocol",
        )
        .with_callback(move |o| {
            for (outcome, n) in metrics.sql_queries_by_outcome() {
                o.observe(n, &[KeyValue::new("outcome", outcome)]);
            }
        })
        .build();
    let metrics = state.metrics.clone();
    meter
        .f64_observable_counter("perch_sql_query_seconds")
        .with_description("Time spent answering SQL queries, planning to last row, all queries together (divide by perch_sql_queries for the mean)")
        .with_unit("s")
        .with_callback(move |o| o.observe(metrics.sql_seconds_total(), &[]))
        .build();
    let store = state.store.clone();
    let stats = move |f: fn(&perch_query::StoreStats) -> &AtomicU64| -> Read {
        let store = store.clone();
        Box::new(move || load(f(&store.stats)))
    };
    let none = &[];
    counter(
        &meter,
        "perch_store_batches",
        "Batches stored (excluding duplicates)",
        none,
        stats(|s| &s.batches_stored),
    );
    counter(
        &meter,
        "perch_store_duplicate_batches",
        "Batches acknowledged as duplicates of earlier ones",
        none,
        stats(|s| &s.batches_duplicate),
    );
    counter(
        &meter,
        "perch_store_samples",
        "Samples stored",
        none,
        stats(|s| &s.samples_stored),
    );
    counter(
        &meter,
        "perch_store_flushes",
        "Flushes of the buffer to Parquet",
        none,
        stats(|s| &s.flushes),
    );
    counter(
        &meter,
        "perch_store_flush_failures",
        "Flushes that failed (rows stay buffered)",
        none,
        stats(|s| &s.flush_failures),
    );
    counter(
        &meter,
        "perch_store_flushed_rows",
        "Rows written to Parquet",
        none,
        stats(|s| &s.rows_flushed),
    );
    let store = state.store.clone();
    gauge(
        &meter,
        "perch_store_buffered_rows",
        "Rows in memory waiting for the next flush",
        none,
        Box::new(move || store.buffered_rows() as u64),
    );
    let store = state.store.clone();
    counter(
        &meter,
        "perch_wal_syncs",
        "fdatasync calls on the write-ahead log (one per group commit)",
        none,
        Box::new(move || load(&store.wal_stats().syncs)),
    );
    let store = state.store.clone();
    counter(
        &meter,
        "perch_wal_written_bytes",
        "Bytes written to the write-ahead log",
        none,
        Box::new(move || load(&store.wal_stats().bytes)),
    );
    let jobs = state.jobs.clone();
    meter
        .u64_observable_gauge("perch_jobs")
        .with_description("Jobs the server knows, by state")
        .with_callback(move |o| {
            // Once the job database has failed nothing is durable again: as memory holds it.
            let snapshot = jobs.snapshot().unwrap_or_else(|_| jobs.snapshot_held());
            for (state, n) in snapshot.jobs_by_state {
                o.observe(n, &[KeyValue::new("state", state)]);
            }
        })
        .build();
}

/// Registers a node agent's counters (the ones its node-local `/metrics` shows), labelled
/// with its node, on the global meter provider.
pub fn observe_agent(node: &perch_model::NodeId, counters: Arc<perch_collector::AgentCounters>) {
    let meter = meter();
    let read = move |f: fn(&perch_collector::AgentCounters) -> &AtomicU64| -> Read {
        let counters = counters.clone();
        Box::new(move || load(f(&counters)))
    };
    let node = &[KeyValue::new("node", node.as_str().to_owned())];
    counter(
        &meter,
        "perch_agent_rounds",
        "Sampling rounds taken",
        node,
        read(|c| &c.rounds_sampled),
    );
    counter(
        &meter,
        "perch_agent_batches_sent",
        "Batches the server acknowledged",
        node,
        read(|c| &c.batches_sent),
    );
    counter(
        &meter,
        "perch_agent_batches_dropped",
        "Batches dropped (queue or spool bound, or shutdown)",
        node,
        read(|c| &c.batches_dropped),
    );
    counter(
        &meter,
        "perch_agent_send_errors",
        "Failed delivery attempts",
        node,
        read(|c| &c.send_errors),
    );
    gauge(
        &meter,
        "perch_agent_spool_bytes",
        "Bytes in the disk spool",
        node,
        read(|c| &c.spool_bytes),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(section: &TelemetrySection, env: &[(&str, &str)]) -> Option<Target> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Target::resolve(section, "perch-server", |k| env.get(k).cloned()).expect("resolves")
    }

    #[test]
    fn off_unless_an_endpoint_is_given() {
        assert_eq!(resolve(&TelemetrySection::default(), &[]), None);
        let t = resolve(
            &TelemetrySection::default(),
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")],
        )
        .expect("the standard variable turns export on");
        assert_eq!(t.url("traces"), "http://collector:4318/v1/traces");
        assert_eq!(t.service, "perch-server");
        assert_eq!(t.interval, Duration::from_secs(60));
    }

    #[test]
    fn perch_settings_win_over_the_otel_environment() {
        let mut section = TelemetrySection {
            otlp_endpoint: "https://otel.example:4318".into(),
            service_name: "perch-eu".into(),
            export_interval_secs: 5,
            ..Default::default()
        };
        section
            .headers
            .insert("Authorization".into(), "Bearer x".into());
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://elsewhere:4318"),
            ("OTEL_SERVICE_NAME", "other"),
        ];
        let t = resolve(&section, &env).expect("on");
        assert_eq!(t.url("metrics"), "https://otel.example:4318/v1/metrics");
        assert_eq!(t.service, "perch-eu");
        assert_eq!(t.interval, Duration::from_secs(5));
        assert_eq!(t.headers["Authorization"], "Bearer x");
        assert!(
            !format!("{t:?}").contains("Bearer x"),
            "credentials stay out of logs"
        );
        section.service_name.clear();
        assert_eq!(resolve(&section, &env).expect("on").service, "other");
        assert_eq!(resolve(&section, &[("OTEL_SDK_DISABLED", "true")]), None);
    }

    #[test]
    fn a_bad_standard_endpoint_names_the_variable() {
        let err = Target::resolve(&TelemetrySection::default(), "perch-agent", |k| {
            (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "collector:4318".to_owned())
        })
        .expect_err("not a URL");
        assert!(
            err.to_string().contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
            "{err}"
        );
    }
}
