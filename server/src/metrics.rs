//! `GET /metrics`: the Prometheus (OpenMetrics text) endpoint.
//!
//! perch's own counters live in a registry built once ([`ServerMetrics`]). Fleet series (GPUs,
//! hosts, NICs) are built fresh on every scrape from [`crate::Latest`], so a node that goes
//! away stops being exported instead of leaving stale series behind; they are written straight
//! to OpenMetrics text ([`Scrape`]), as prometheus-client would write them, without its
//! per-series hashing, locking and allocation (a third of a 1,000-node scrape's time). Every GPU, host and NIC
//! series carries `simulated="true|false"`; `perch_gpu_info` joins a GPU to its UUID and model.
//! Names follow `perch_<subsystem>_<name>_<unit>[_total]`; docs/metrics.md lists them all.

use crate::AppState;
use crate::latest::NodeLatest;
use crate::node_status::{self, NodeStatus};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use perch_model::NodeState;
use perch_model::catalogue::{self, Column, Kind};
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

mod alerts;
mod extended;
mod scheduler;

type Labels = Vec<(&'static str, String)>;

/// perch's own counters, registered once.
pub struct ServerMetrics {
    registry: Registry,
    ingest: Family<Labels, Counter>,
    sql: Family<Labels, Counter>,
    sql_seconds: Histogram,
    /// The histogram's sum as f64 bits: prometheus-client does not expose it, and the OTLP
    /// export of perch's own metrics reports it as `perch_sql_query_seconds`.
    sql_seconds_sum: AtomicU64,
    /// Batches of ingest servers' pushes of latest state, by outcome (taken, refused).
    cluster: Family<Labels, Counter>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let ingest = Family::<Labels, Counter>::default();
        registry.register(
            "perch_ingest_requests",
            "Ingest requests by outcome (stored, duplicate, rejected, error)",
            ingest.clone(),
        );
        let sql = Family::<Labels, Counter>::default();
        registry.register(
            "perch_sql_queries",
            "SQL queries by outcome (ok, error)",
            sql.clone(),
        );
        let sql_seconds = Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0]);
        registry.register(
            "perch_sql_query_duration_seconds",
            "SQL query latency, planning to last row",
            sql_seconds.clone(),
        );
        let info = Family::<Labels, Gauge>::default();
        info.get_or_create(&vec![("version", env!("CARGO_PKG_VERSION").to_owned())])
            .set(1);
        registry.register(
            "perch_build_info",
            "perch version (value is always 1)",
            info,
        );
        let cluster = Family::<Labels, Counter>::default();
        registry.register(
            "perch_cluster_latest_batches",
            "Nodes' latest states pushed by ingest servers, by outcome (taken, refused)",
            cluster.clone(),
        );
        ServerMetrics {
            cluster,
            registry,
            ingest,
            sql,
            sql_seconds,
            sql_seconds_sum: AtomicU64::new(0f64.to_bits()),
        }
    }
}

impl ServerMetrics {
    pub fn ingest_requests(&self, outcome: &'static str) {
        self.ingest
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc();
    }

    /// Counts an ingest server's push: batches taken and refused.
    pub fn cluster_pushes(&self, taken: u64, refused: u64) {
        for (outcome, n) in [("taken", taken), ("refused", refused)] {
            if n > 0 {
                self.cluster
                    .get_or_create(&vec![("outcome", outcome.to_owned())])
                    .inc_by(n);
            }
        }
    }

    pub fn sql_query(&self, ok: bool, took: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.sql
            .get_or_create(&vec![("outcome", outcome.to_owned())])
            .inc();
        self.sql_seconds.observe(took.as_secs_f64());
        let add = |bits: u64| Some((f64::from_bits(bits) + took.as_secs_f64()).to_bits());
        let _ = self
            .sql_seconds_sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, add);
    }

    /// Ingest requests so far by outcome, leaving out outcomes not seen yet (as `/metrics`
    /// does): what the OTLP export of perch's own metrics reads, so it never counts apart.
    pub fn ingest_requests_by_outcome(&self) -> Vec<(&'static str, u64)> {
        totals(&self.ingest, &["stored", "duplicate", "rejected", "error"])
    }

    /// SQL queries so far by outcome (`ok`, `error`), leaving out outcomes not seen yet.
    pub fn sql_queries_by_outcome(&self) -> Vec<(&'static str, u64)> {
        totals(&self.sql, &["ok", "error"])
    }

    /// Seconds all SQL queries took together (the latency histogram's sum).
    pub fn sql_seconds_total(&self) -> f64 {
        f64::from_bits(self.sql_seconds_sum.load(Ordering::Relaxed))
    }
}

/// The value of each `outcome` series of `family` that exists.
fn totals(family: &Family<Labels, Counter>, outcomes: &[&'static str]) -> Vec<(&'static str, u64)> {
    outcomes
        .iter()
        .filter_map(|o| {
            let counter = family.get(&vec![("outcome", (*o).to_owned())])?;
            Some((*o, counter.get()))
        })
        .collect()
}

/// Families built during one scrape, written at the end in name order (gauges, then
/// counters), each series once: a label set given again sets a gauge again and adds to a
/// counter (what prometheus-client's families do; Prometheus refuses a whole scrape with a
/// duplicate series).
#[derive(Default)]
struct Scrape {
    gauges: BTreeMap<&'static str, ScrapeFamily>,
    counters: BTreeMap<&'static str, ScrapeFamily>,
}

/// One family of a scrape: its help and its series in the order first given, each as its
/// encoded label set (`{node="a",gpu="0"}`, empty without labels) and value.
struct ScrapeFamily {
    help: &'static str,
    series: Vec<(String, f64)>,
    /// Series by the hash of their encoded labels (compared in full on a hit).
    index: rustc_hash::FxHashMap<u64, usize>,
}

impl ScrapeFamily {
    fn new(help: &'static str) -> Self {
        ScrapeFamily {
            help,
            series: Vec::new(),
            index: Default::default(),
        }
    }

    fn put(&mut self, labels: &Labels, value: f64, add: bool) {
        let key = encode_labels(labels);
        let hash = {
            use std::hash::{BuildHasher, BuildHasherDefault};
            BuildHasherDefault::<rustc_hash::FxHasher>::default().hash_one(&key)
        };
        let at = match self.index.get(&hash) {
            Some(&i) if self.series[i].0 == key => Some(i),
            // Another label set with the same hash (all but impossible): look it up in full.
            Some(_) => self.series.iter().position(|(k, _)| *k == key),
            None => None,
        };
        match at {
            Some(i) if add => self.series[i].1 += value,
            Some(i) => self.series[i].1 = value,
            None => {
                self.index.entry(hash).or_insert(self.series.len());
                self.series.push((key, value));
            }
        }
    }

    /// OpenMetrics text: `# HELP` (with the period prometheus-client adds), `# TYPE`, then
    /// each series as `name[suffix]{labels} value`.
    fn encode(&self, out: &mut String, name: &str, kind: &str, suffix: &str) {
        use std::fmt::Write;
        let _ = write!(out, "# HELP {name} {}.\n# TYPE {name} {kind}\n", self.help);
        let mut number = dtoa::Buffer::new();
        for (labels, value) in &self.series {
            out.push_str(name);
            out.push_str(suffix);
            out.push_str(labels);
            out.push(' ');
            out.push_str(if value.is_nan() {
                "NaN"
            } else if *value == f64::INFINITY {
                "+Inf"
            } else if *value == f64::NEG_INFINITY {
                "-Inf"
            } else {
                number.format(*value)
            });
            out.push('\n');
        }
    }
}

/// `{a="x",b="y"}` with `\`, `"` and newlines escaped; empty for no labels.
fn encode_labels(labels: &Labels) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let mut out = String::with_capacity(
        2 + labels
            .iter()
            .map(|(k, v)| k.len() + v.len() + 4)
            .sum::<usize>(),
    );
    out.push('{');
    for (i, (key, value)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(key);
        out.push_str("=\"");
        if value.bytes().any(|b| matches!(b, b'\\' | b'"' | b'\n')) {
            for c in value.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
        } else {
            out.push_str(value);
        }
        out.push('"');
    }
    out.push('}');
    out
}

impl Scrape {
    fn gauge(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &Labels,
        value: Option<f64>,
    ) {
        if let Some(v) = value {
            self.gauges
                .entry(name)
                .or_insert_with(|| ScrapeFamily::new(help))
                .put(labels, v, false);
        }
    }

    /// `name` without `_total`; the encoder appends it.
    fn counter(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &Labels,
        value: Option<f64>,
    ) {
        if let Some(v) = value.filter(|v| *v >= 0.0) {
            self.counters
                .entry(name)
                .or_insert_with(|| ScrapeFamily::new(help))
                .put(labels, v, true);
        }
    }

    /// The families as OpenMetrics text (no `# EOF`).
    fn encode(&self, out: &mut String) {
        for (name, family) in &self.gauges {
            family.encode(out, name, "gauge", "");
        }
        for (name, family) in &self.counters {
            family.encode(out, name, "counter", "_total");
        }
    }
}

fn flag(b: bool) -> String {
    if b { "true" } else { "false" }.to_owned()
}

/// Each node's state (the one definition, [`crate::node_status`]): `perch_node_up` and
/// `perch_node_state` for every node either the control plane or the telemetry knows.
fn node_states(s: &mut Scrape, statuses: &BTreeMap<String, NodeStatus>) {
    for (node, status) in statuses {
        let base: Labels = vec![("node", node.clone())];
        s.gauge(
            "perch_node_up",
            "1 if the node is up or drained and its telemetry arrives; 0 if it is down or its agent syncs but sends no samples (the state `perch nodes` shows)",
            &base,
            Some(f64::from(u8::from(status.state.is_up()))),
        );
        for state in NodeState::ALL {
            let mut l = base.clone();
            l.push(("state", state.as_str().to_owned()));
            s.gauge(
                "perch_node_state",
                "1 for the node's state (up, drained, no_telemetry or down, as `perch nodes` shows it), 0 for the others",
                &l,
                Some(f64::from(u8::from(status.state == state))),
            );
        }
    }
}

/// Every exported column of `columns` for one row: `labels` plus the column's own.
fn catalogued<R>(s: &mut Scrape, columns: &'static [Column<R>], row: &R, labels: &Labels) {
    for column in columns {
        let Some(series) = &column.series else {
            continue;
        };
        let value = series.value(column, row);
        let own: Labels;
        let labels = if series.labels.is_empty() {
            labels
        } else {
            own = labels
                .iter()
                .cloned()
                .chain(series.labels.iter().map(|(k, v)| (*k, (*v).to_owned())))
                .collect();
            &own
        };
        match series.kind {
            Kind::Gauge => s.gauge(series.family(), series.help, labels, value),
            Kind::Counter => s.counter(series.family(), series.help, labels, value),
        }
    }
}

fn fleet(s: &mut Scrape, nodes: &BTreeMap<String, NodeLatest>) {
    for (node, latest) in nodes {
        let base: Labels = vec![("node", node.clone())];
        s.gauge(
            "perch_node_last_seen_timestamp_seconds",
            "When the node's last batch arrived (server clock)",
            &base,
            Some(latest.last_seen_ms as f64 / 1000.0),
        );
        s.gauge(
            "perch_node_gpus",
            "GPUs the node reports",
            &base,
            Some(latest.gpus.len() as f64),
        );
        if let Some(h) = &latest.host {
            let l: Labels = vec![("node", node.clone()), ("simulated", flag(h.simulated))];
            catalogued(s, catalogue::HOST, h, &l);
        }
        for g in latest.gpus.values() {
            let l: Labels = vec![
                ("node", node.clone()),
                ("gpu", g.gpu.to_string()),
                ("simulated", flag(g.simulated)),
            ];
            let mut info = l.clone();
            info.push(("uuid", g.uuid.clone()));
            info.push(("model", g.model.clone()));
            s.gauge(
                "perch_gpu_info",
                "One series per GPU joining node and index to UUID and model (value 1)",
                &info,
                Some(1.0),
            );
            catalogued(s, catalogue::GPU, g, &l);
        }
        extended::gpu(s, node, latest);
        extended::ib_and_jobs(s, node, latest);
        for n in latest.nics.values() {
            let l: Labels = vec![
                ("node", node.clone()),
                ("device", n.device.clone()),
                ("simulated", flag(n.simulated)),
            ];
            catalogued(s, catalogue::NIC, n, &l);
        }
    }
}

fn store_series(s: &mut Scrape, state: &AppState) {
    let st = &state.store.stats;
    let none: Labels = Vec::new();
    let load = |a: &AtomicU64| Some(a.load(Ordering::Relaxed) as f64);
    s.counter(
        "perch_store_batches",
        "Batches stored (excluding duplicates)",
        &none,
        load(&st.batches_stored),
    );
    s.counter(
        "perch_store_duplicate_batches",
        "Batches acknowledged as duplicates of earlier ones",
        &none,
        load(&st.batches_duplicate),
    );
    s.counter(
        "perch_store_samples",
        "Samples stored",
        &none,
        load(&st.samples_stored),
    );
    s.gauge(
        "perch_store_replayed_batches",
        "Batches replayed from the write-ahead log at start-up",
        &none,
        load(&st.batches_replayed),
    );
    s.counter(
        "perch_store_flushes",
        "Flushes of the buffer to Parquet",
        &none,
        load(&st.flushes),
    );
    s.counter(
        "perch_store_flush_failures",
        "Flushes that failed (rows stay buffered)",
        &none,
        load(&st.flush_failures),
    );
    s.gauge(
        "perch_store_flush_failures_in_a_row",
        "Flushes failed in a row since the last that worked (0: the last worked)",
        &none,
        load(&st.consecutive_flush_failures),
    );
    s.counter(
        "perch_store_batches_refused_backpressure",
        "Batches answered 503 because server.max_buffered_rows rows were held in memory (the sender keeps and retries them)",
        &none,
        load(&st.batches_refused_backpressure),
    );
    s.counter(
        "perch_store_flushed_rows",
        "Rows written to Parquet",
        &none,
        load(&st.rows_flushed),
    );
    s.gauge(
        "perch_store_buffered_rows",
        "Rows in memory waiting for the next flush",
        &none,
        Some(state.store.buffered_rows() as f64),
    );
    for (table, files, bytes) in state.store.file_counts() {
        let l: Labels = vec![("table", table.name().to_owned())];
        s.gauge(
            "perch_store_files",
            "Parquet files per table",
            &l,
            Some(files as f64),
        );
        s.gauge(
            "perch_store_size_bytes",
            "Parquet bytes per table",
            &l,
            Some(bytes as f64),
        );
    }
    let wal = state.store.wal_stats();
    s.counter(
        "perch_wal_syncs",
        "fdatasync calls on the write-ahead log (one per group commit)",
        &none,
        load(&wal.syncs),
    );
    s.counter(
        "perch_wal_written_bytes",
        "Bytes written to the write-ahead log",
        &none,
        load(&wal.bytes),
    );
    s.counter(
        "perch_wal_records_skipped",
        "Write-ahead log records skipped at start-up: torn tails a crash left (never acknowledged) and records damaged on disk",
        &none,
        load(&st.wal_records_skipped),
    );
}

/// Rewrites prometheus-client's OpenMetrics text as the classic Prometheus text format
/// (version 0.0.4), for clients that did not ask for OpenMetrics (curl, promtool, older
/// scrapers): counter families get their `_total` name in `# HELP` and `# TYPE`, and the
/// OpenMetrics-only `# UNIT` and `# EOF` lines go.
fn to_classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + counters.len() * 16);
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rewritten = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match rewritten {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// `GET /metrics`. Rendering a large fleet takes a few hundred milliseconds of CPU (see
/// BENCHMARKS.md): it runs on the blocking pool, so a scrape never holds up the async
/// workers that answer agents' syncs.
pub async fn metrics(State(state): State<AppState>, headers: axum::http::HeaderMap) -> Response {
    match tokio::task::spawn_blocking(move || render(state, headers)).await {
        Ok(response) => response,
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering metrics failed: {e}"),
        )
            .into_response(),
    }
}

fn render(state: AppState, headers: axum::http::HeaderMap) -> Response {
    let mut scrape = Scrape::default();
    let now = state.now_ms();
    cluster_series(&mut scrape, &state, now);
    if state.config.cluster.is_ingest() {
        // Its own series only: the control server exports the fleet (every node's latest
        // state comes to it), so a scraper of both counts nothing twice.
        store_series(&mut scrape, &state);
        return encode(scrape, &state, &headers);
    }
    let latest = state.latest.snapshot();
    // Usage first: the snapshot then waits for every change either could see to be durable.
    let usage = state.jobs.usage(&state.config.accounting.prices);
    let control = state.jobs.snapshot().unwrap_or_else(|e| {
        // The job database has failed: the server refuses every change and says so. The
        // fleet's telemetry is still worth scraping (dashboards going blank is the last thing
        // an operator needs then), with the control plane as memory holds it.
        tracing::warn!(error = %e, "the job database has failed; /metrics shows the control plane as held in memory");
        state.jobs.snapshot_held()
    });
    let last_samples = latest
        .iter()
        .map(|(node, l)| (node.clone(), l.last_seen_ms))
        .collect();
    let statuses = node_status::statuses(
        control.nodes.clone(),
        &last_samples,
        now,
        node_status::stale_after_ms(&state),
    );
    node_states(&mut scrape, &statuses);
    fleet(&mut scrape, &latest);
    store_series(&mut scrape, &state);
    scheduler::scheduler(&mut scrape, &control);
    scheduler::usage(&mut scrape, &usage);
    alerts::alerts(&mut scrape, &state.alerts, now);
    extended::pushed(&mut scrape, &state.latest.job_metrics(now));
    scrape.counter(
        "perch_job_metric_series_dropped",
        "Data points jobs pushed over OpenTelemetry that are stored but not exported here: their job already had the most series one job may export (200)",
        &Vec::new(),
        Some(
            state
                .latest
                .job_series_dropped
                .load(Ordering::Relaxed) as f64,
        ),
    );
    encode(scrape, &state, &headers)
}

/// The ingest server's pushes to its control server, and the peer stores this server reads.
fn cluster_series(s: &mut Scrape, state: &AppState, now: i64) {
    if let Some(f) = &state.forward {
        let none: Labels = Vec::new();
        let load = |a: &AtomicU64| Some(a.load(Ordering::Relaxed) as f64);
        s.counter(
            "perch_cluster_pushes",
            "Pushes of the nodes' latest state to the control server that it took",
            &none,
            load(&f.stats.pushes),
        );
        s.counter(
            "perch_cluster_push_failures",
            "Pushes of the nodes' latest state the control server did not take (kept and retried)",
            &none,
            load(&f.stats.push_failures),
        );
        s.counter(
            "perch_cluster_pushed_nodes",
            "Nodes' latest states the control server took, summed over pushes",
            &none,
            load(&f.stats.nodes_pushed),
        );
        s.counter(
            "perch_cluster_dropped_gpu_events",
            "GPU events not pushed to the control server: more than 1,024 of one node between two pushes (all are stored)",
            &none,
            load(&f.stats.events_dropped),
        );
    }
    if let crate::cluster::Cluster::Control(ingest) = &state.config.cluster {
        for (name, last) in ingest.view() {
            let labels: Labels = vec![("ingest", name)];
            let age = last.map(|(_, t)| (now - t).max(0));
            s.gauge(
                "perch_cluster_ingest_up",
                "1 while an ingest server pushes (nodes are sent to it), 0 when it has not pushed within cluster.ingest_timeout_secs",
                &labels,
                Some(if age.is_some_and(|a| a <= ingest.alive_ms()) { 1.0 } else { 0.0 }),
            );
            s.gauge(
                "perch_cluster_ingest_push_age_seconds",
                "Seconds since the ingest server's last push (absent: never)",
                &labels,
                age.map(|a| a as f64 / 1000.0),
            );
        }
    }
    for peer in state.store.peer_status() {
        let labels: Labels = vec![("peer", peer.name.clone())];
        s.gauge(
            "perch_store_peer_files",
            "Parquet files of another server's store (an ingest server's) this server's SQL reads, as of its manifest's last read",
            &labels,
            Some(peer.files as f64),
        );
        s.gauge(
            "perch_store_peer_bytes",
            "Bytes of those files",
            &labels,
            Some(peer.bytes as f64),
        );
        s.gauge(
            "perch_store_peer_read_age_seconds",
            "Seconds since the peer store's manifest was last read whole (absent: never)",
            &labels,
            peer.read_ms.map(|t| (now - t).max(0) as f64 / 1000.0),
        );
        s.gauge(
            "perch_store_peer_up",
            "1 when the peer store's manifest was read at the last try, 0 when it could not be",
            &labels,
            Some(if peer.error.is_none() && peer.read_ms.is_some() {
                1.0
            } else {
                0.0
            }),
        );
    }
}

fn encode(scrape: Scrape, state: &AppState, headers: &axum::http::HeaderMap) -> Response {
    let mut body = String::with_capacity(16 << 20);
    let encoded = encode_registry(&mut body, &state.metrics.registry).map(|()| {
        scrape.encode(&mut body);
    });
    let encoded = encoded.and_then(|()| encode_eof(&mut body));
    if let Err(e) = encoded {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {e}"),
        )
            .into_response();
    }
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let (body, content_type) = if openmetrics {
        (
            body,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
    } else {
        (
            to_classic_text(&body),
            "text/plain; version=0.0.4; charset=utf-8",
        )
    };
    let mut response = body.into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/metrics.md has a row for each catalogued series: its name, its kind, its labels
    /// (the sample type's own, then each extra one with its values) and the series it replaces.
    #[test]
    fn metrics_doc_gives_each_catalogued_series() {
        fn check<R>(doc: &str, base: &str, columns: &[Column<R>]) {
            let mut families: BTreeMap<&str, Vec<&catalogue::Series<R>>> = BTreeMap::new();
            for series in columns.iter().filter_map(|c| c.series.as_ref()) {
                families.entry(series.name).or_default().push(series);
            }
            for (name, members) in families {
                let mut labels = base.to_owned();
                let keys = members[0].labels.iter().map(|(k, _)| *k);
                for key in keys {
                    let mut values: Vec<&str> = Vec::new();
                    for m in &members {
                        for (k, v) in m.labels {
                            if *k == key && !values.contains(v) {
                                values.push(v);
                            }
                        }
                    }
                    labels.push_str(&format!(", {key} ({})", values.join(", ")));
                }
                let start = format!("| `{name}` | {} | {labels} |", members[0].kind.as_str());
                let row = doc
                    .lines()
                    .find(|l| l.starts_with(&format!("| `{name}` |")))
                    .unwrap_or_else(|| {
                        let replaces: Vec<&str> = members.iter().map(|m| m.replaces).collect();
                        panic!(
                            "docs/metrics.md has no row for {name}: add \"{start} <what it \
                             means> | {} |\"",
                            replaces.join(", ")
                        )
                    });
                assert!(
                    row.starts_with(&start),
                    "docs/metrics.md: the row of {name} must begin {start:?}"
                );
                // A series that replaces none has nothing to name.
                for m in members.iter().filter(|m| !m.replaces.is_empty()) {
                    assert!(
                        row.contains(m.replaces),
                        "docs/metrics.md: the row of {name} must name {}",
                        m.replaces
                    );
                }
            }
        }
        let doc = include_str!("../../docs/metrics.md");
        check(doc, "node, gpu, simulated", catalogue::GPU);
        check(doc, "node, simulated", catalogue::HOST);
        check(doc, "node, device, simulated", catalogue::NIC);
        check(doc, "node, device, port, simulated", catalogue::IB_PORT);
        check(doc, "node, job_id, simulated", catalogue::JOB);
    }

    #[test]
    fn a_scrape_writes_each_series_once_escaped_as_prometheus_reads_it() {
        let mut s = Scrape::default();
        let a: Labels = vec![("node", "a".into()), ("gpu", "0".into())];
        let evil: Labels = vec![("job", "x\"} 1\nfake 2\\".into())];
        s.gauge("g", "A gauge", &a, Some(1.0));
        s.gauge("g", "A gauge", &a, Some(2.5));
        s.gauge("g", "A gauge", &evil, Some(f64::NAN));
        s.gauge("g", "A gauge", &Vec::new(), Some(f64::INFINITY));
        s.gauge(
            "g",
            "A gauge",
            &vec![("x", "-".into())],
            Some(f64::NEG_INFINITY),
        );
        s.gauge("skipped", "Never set", &a, None);
        s.counter("c", "A counter", &a, Some(3.0));
        s.counter("c", "A counter", &a, Some(4.0));
        s.counter("c", "A counter", &a, Some(-1.0));
        s.gauge("big", "Large", &a, Some(64_266_360_993.0));
        let mut text = String::new();
        s.encode(&mut text);
        assert_eq!(
            text,
            "# HELP big Large.\n# TYPE big gauge\nbig{node=\"a\",gpu=\"0\"} 64266360993.0\n\
             # HELP g A gauge.\n# TYPE g gauge\n\
             g{node=\"a\",gpu=\"0\"} 2.5\n\
             g{job=\"x\\\"} 1\\nfake 2\\\\\"} NaN\n\
             g +Inf\n\
             g{x=\"-\"} -Inf\n\
             # HELP c A counter.\n# TYPE c counter\nc_total{node=\"a\",gpu=\"0\"} 7.0\n"
        );
    }

    /// A failed job database does not blind the fleet's telemetry: `/metrics` still answers,
    /// with the GPUs' series and the nodes as memory holds them.
    #[tokio::test]
    async fn a_failed_job_database_still_lets_the_fleet_be_scraped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = crate::AppState::open(crate::ServerConfig::new(perch_query::StoreConfig::new(
            dir.path(),
        )))
        .expect("open");
        let req: perch_model::control::SyncRequest = serde_json::from_value(serde_json::json!({
            "node": "gpu-a", "gpus": 2, "gpu_model": "Test H100", "running": []
        }))
        .expect("sync");
        state
            .jobs
            .run(move |c, now| c.sync(req, now))
            .await
            .expect("sync");
        state.jobs.fail_commits("disk full");
        let jobs = state.jobs.clone();
        assert!(
            tokio::task::spawn_blocking(move || jobs.snapshot())
                .await
                .expect("task")
                .is_err(),
            "the durable snapshot says the database failed"
        );
        let response = tokio::task::spawn_blocking(move || render(state, Default::default()))
            .await
            .expect("render");
        assert_eq!(response.status(), StatusCode::OK);
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("node=\"gpu-a\""), "{text}");
    }

    #[test]
    fn classic_text_names_counters_with_total() {
        let om = "# HELP a_requests Requests.\n# TYPE a_requests counter\na_requests_total{x=\"1\"} 2\n# HELP b Bytes.\n# TYPE b gauge\n# UNIT b bytes\nb 1.0\n# EOF\n";
        let text = to_classic_text(om);
        assert_eq!(
            text,
            "# HELP a_requests_total Requests.\n# TYPE a_requests_total counter\na_requests_total{x=\"1\"} 2\n# HELP b Bytes.\n# TYPE b gauge\nb 1.0\n"
        );
    }
}
