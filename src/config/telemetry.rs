//! `[telemetry]`: where perch exports its own traces and metrics (OTLP/HTTP); telemetry.rs
//! resolves it against the standard `OTEL_*` variables.

use super::{DAY, SECONDS, within};
use anyhow::Result;
use serde::{Deserialize, Serialize};

/// `[telemetry]`: perch's own traces and metrics, pushed over OTLP/HTTP (protobuf) to a
/// backend the site already runs (an OpenTelemetry Collector, Tempo, Jaeger, another perch's
/// `/v1/metrics`). Off unless an endpoint is set here, by `--otlp-endpoint` /
/// `PERCH_OTLP_ENDPOINT`, or by the standard `OTEL_EXPORTER_OTLP_ENDPOINT`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySection {
    /// Base URL of the OTLP/HTTP receiver, e.g. `http://collector:4318`; spans go to
    /// `<base>/v1/traces` and metrics to `<base>/v1/metrics`. Empty: off, unless
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
    pub otlp_endpoint: String,
    /// The `service.name` resource attribute. Empty: `OTEL_SERVICE_NAME` if set, else
    /// `perch-server` (server, up, demo) or `perch-agent` (agent).
    pub service_name: String,
    /// Seconds between two exports of perch's metrics.
    pub export_interval_secs: u64,
    /// Extra HTTP headers on every export, e.g. `Authorization = "Bearer ..."`.
    /// `OTEL_EXPORTER_OTLP_HEADERS` adds more.
    pub headers: std::collections::BTreeMap<String, String>,
}

impl Default for TelemetrySection {
    fn default() -> Self {
        TelemetrySection {
            otlp_endpoint: String::new(),
            service_name: String::new(),
            export_interval_secs: 60,
            headers: Default::default(),
        }
    }
}

impl TelemetrySection {
    /// Checks the keys of `[telemetry]`; the message names the key and what to write instead.
    pub(super) fn check(&self) -> Result<()> {
        let export = self.export_interval_secs;
        within("telemetry.export_interval_secs", export, 1, DAY, SECONDS)?;
        let e = &self.otlp_endpoint;
        if !(e.is_empty() || e.starts_with("http://") || e.starts_with("https://")) {
            anyhow::bail!(
                "config key telemetry.otlp_endpoint: {e:?} must be an http:// or https:// URL such as http://collector:4318 (\"\" turns export off)"
            );
        }
        for (name, value) in &self.headers {
            let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
            if name.is_empty() || !name.chars().all(token) {
                anyhow::bail!(
                    "config key telemetry.headers: {name:?} is not an HTTP header name (letters, digits and - only, e.g. Authorization)"
                );
            }
            if value.chars().any(|c| c.is_control()) {
                anyhow::bail!(
                    "config key telemetry.headers.{name}: the value has a control character (a line break?); give it on one line"
                );
            }
        }
        Ok(())
    }
}
