//! The OpenTelemetry variables every job gets, so an OpenTelemetry SDK in the job exports its
//! metrics to the perch server's OTLP receiver (`POST /v1/metrics`) with no code change:
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (the server's base URL; SDKs append `/v1/metrics`),
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`), `OTEL_SERVICE_NAME` (the job's name when the server passes
//! `PERCH_JOB_NAME`, else `perch-job-<id>`)
//! and `OTEL_RESOURCE_ATTRIBUTES` (`perch.job.id`, `perch.user`, `host.name`).
//!
//! A variable the job's own environment sets wins, except that the job's resource attributes
//! are appended after perch's: SDKs let a later key override an earlier one, so the job can
//! add or replace attributes without losing the ones perch's tables are keyed on.

use perch_model::control::JobLaunch;
use std::collections::BTreeMap;

/// Where jobs on this node send their telemetry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtelTarget {
    /// The perch server's base URL, as the agent reaches it.
    pub endpoint: String,
    /// This node's name, for `host.name`.
    pub node: String,
    /// The CA file the agent trusts for an `https://` server, passed to jobs as
    /// `OTEL_EXPORTER_OTLP_CERTIFICATE` (the SDKs' name for it).
    pub ca_file: Option<String>,
}

/// Percent-encodes what the `OTEL_RESOURCE_ATTRIBUTES` syntax reserves (`,`, `=`, `%`),
/// spaces, control and non-ASCII bytes.
fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_graphic() && !matches!(b, b',' | b'=' | b'%') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The variables for job `l`, its own `env` already taken into account.
pub fn variables(target: &OtelTarget, l: &JobLaunch) -> BTreeMap<String, String> {
    let mut attrs = format!(
        "perch.job.id={},perch.user={},host.name={}",
        l.job,
        encode(&l.user),
        encode(&target.node)
    );
    if let Some(own) = l
        .env
        .get("OTEL_RESOURCE_ATTRIBUTES")
        .filter(|v| !v.is_empty())
    {
        attrs.push(',');
        attrs.push_str(own);
    }
    let mut vars = BTreeMap::new();
    vars.insert("OTEL_RESOURCE_ATTRIBUTES".to_owned(), attrs);
    for (key, value) in [
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            target.endpoint.trim_end_matches('/').to_owned(),
        ),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_owned()),
        (
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            target.ca_file.clone().unwrap_or_default(),
        ),
        (
            "OTEL_SERVICE_NAME",
            l.env
                .get("PERCH_JOB_NAME")
                .filter(|n| !n.is_empty())
                .cloned()
                .unwrap_or_else(|| format!("perch-job-{}", l.job)),
        ),
    ] {
        if !l.env.contains_key(key) && !value.is_empty() {
            vars.insert(key.to_owned(), value);
        }
    }
    vars
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(env: &[(&str, &str)]) -> JobLaunch {
        JobLaunch {
            job: 7,
            attempt: 1,
            command: vec!["true".into()],
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            workdir: None,
            gpus: vec![0],
            user: "ada lovelace".into(),
            node_rank: 0,
            nodes: 1,
            time_limit_secs: 60,
            checkpoint_signal: "SIGTERM".into(),
            grace_secs: 1,
            sim_profile: None,
            gpu_share: None,
            gpu_mig: None,
            cpus: None,
            memory_mb: None,
            pick_master_port: false,
            hosts: Vec::new(),
        }
    }

    #[test]
    fn sets_endpoint_service_and_attributes_and_the_job_wins() {
        let target = OtelTarget {
            endpoint: "http://perch:7300/".into(),
            node: "gpu-01".into(),
            ca_file: None,
        };
        let vars = variables(&target, &launch(&[]));
        assert_eq!(vars["OTEL_EXPORTER_OTLP_ENDPOINT"], "http://perch:7300");
        assert_eq!(vars["OTEL_SERVICE_NAME"], "perch-job-7");
        assert_eq!(
            vars["OTEL_RESOURCE_ATTRIBUTES"],
            "perch.job.id=7,perch.user=ada%20lovelace,host.name=gpu-01"
        );
        let own = launch(&[
            ("OTEL_SERVICE_NAME", "trainer"),
            ("OTEL_RESOURCE_ATTRIBUTES", "team=nlp"),
        ]);
        let vars = variables(&target, &own);
        assert!(!vars.contains_key("OTEL_SERVICE_NAME"));
        assert!(vars["OTEL_RESOURCE_ATTRIBUTES"].ends_with(",host.name=gpu-01,team=nlp"));
    }
}
