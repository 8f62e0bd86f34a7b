//! What a node reports about one attempt of a job as it starts it, for the job's provenance
//! record: the environment the job's first process got (after perch's additions, with the
//! values of variables whose names look like secrets replaced) and the node's GPU driver and
//! CUDA versions. Sent once per attempt with the agent's next sync ([`crate::control::SyncRequest::started`]).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The most bytes of environment (names and values) one start report carries; past it the
/// agent keeps the variables in name order up to the limit and sets `env_truncated`.
pub const MAX_REPORTED_ENV_BYTES: usize = 64 << 10;

/// What a redacted value reads as.
pub const REDACTED: &str = "<redacted>";

/// Parts of a variable name that mark its value as a secret (compared case-insensitively).
/// `HEADERS` is OpenTelemetry's `OTEL_EXPORTER_OTLP_*HEADERS`, which carries an exporter's
/// credentials (perch's own job token among them).
pub const SECRET_NAME_PARTS: [&str; 9] = [
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "KEY",
    "CREDENTIAL",
    "AUTH",
    "HEADERS",
    "COOKIE",
];

/// One attempt's start on one node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobStartReport {
    pub job: u64,
    pub attempt: u32,
    /// The job's environment as its first process got it, secrets' values redacted.
    pub env: BTreeMap<String, String>,
    /// Some variables were left out to stay within [`MAX_REPORTED_ENV_BYTES`].
    #[serde(default)]
    pub env_truncated: bool,
    /// The NVIDIA driver version NVML reports (`None`: no NVML on the node, or simulated GPUs).
    #[serde(default)]
    pub driver_version: Option<String>,
    /// The CUDA version the driver supports, `major.minor` (`None` when NVML does not say).
    #[serde(default)]
    pub cuda_version: Option<String>,
    /// The node's GPUs are simulated: there is no driver to report.
    #[serde(default)]
    pub simulated: bool,
}

/// Whether variable `name`'s value is taken for a secret ([`SECRET_NAME_PARTS`]).
pub fn is_secret_name(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    SECRET_NAME_PARTS.iter().any(|p| upper.contains(p))
}

/// Whether a value carries a credential whatever its variable is called: an HTTP
/// authorization (`Bearer ...`, `Basic ...`, `authorization=...`) or a URL with a password
/// (`postgresql://user:pass@host/db`).
pub fn is_secret_value(value: &str) -> bool {
    let lower = value.to_ascii_lowercase();
    if lower.contains("bearer ")
        || lower.contains("bearer%20")
        || lower.contains("basic ")
        || lower.contains("basic%20")
        || lower.contains("authorization")
    {
        return true;
    }
    // scheme://user:password@host: a ':' in the part before '@' of any authority.
    lower.match_indices("://").any(|(at, _)| {
        let rest = &value[at + 3..];
        let authority = rest
            .split(['/', '?', '#', ' ', ',', ';'])
            .next()
            .unwrap_or("");
        authority
            .rsplit_once('@')
            .is_some_and(|(userinfo, _)| userinfo.contains(':'))
    })
}

/// Whether a variable's value is kept out of provenance ([`is_secret_name`],
/// [`is_secret_value`]).
pub fn is_secret(name: &str, value: &str) -> bool {
    is_secret_name(name) || is_secret_value(value)
}

/// `env` with secrets' values replaced by [`REDACTED`] and cut to [`MAX_REPORTED_ENV_BYTES`];
/// the second value says whether variables were left out.
pub fn reportable_env(env: &BTreeMap<String, String>) -> (BTreeMap<String, String>, bool) {
    let mut out = BTreeMap::new();
    let mut bytes = 0;
    let mut truncated = false;
    for (k, v) in env {
        let v = if is_secret(k, v) {
            REDACTED
        } else {
            v.as_str()
        };
        if bytes + k.len() + v.len() > MAX_REPORTED_ENV_BYTES {
            truncated = true;
            continue;
        }
        bytes += k.len() + v.len();
        out.insert(k.clone(), v.to_owned());
    }
    (out, truncated)
}

/// A CUDA driver version as NVML gives it (`12040`) as `major.minor` (`12.4`).
pub fn cuda_version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted_and_the_rest_kept() {
        let env: BTreeMap<String, String> = [
            ("HF_TOKEN", "hf_abc"),
            ("aws_secret_access_key", "x"),
            ("DB_PASSWORD", "p"),
            ("CUDA_VISIBLE_DEVICES", "0,1"),
            ("PATH", "/bin"),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "authorization=Bearer%20perch-job.1.1.abc",
            ),
            ("DATABASE_URL", "postgresql://app:hunter2@db:5432/runs"),
            ("EXTRA", "x-api: Bearer abc"),
            ("MLFLOW_TRACKING_URI", "http://mlflow:5000/api"),
            ("MODEL_REPO", "https://hf.co/user@org/model"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let (out, truncated) = reportable_env(&env);
        assert!(!truncated);
        assert_eq!(out["HF_TOKEN"], REDACTED);
        assert_eq!(out["aws_secret_access_key"], REDACTED);
        assert_eq!(out["DB_PASSWORD"], REDACTED);
        assert_eq!(out["CUDA_VISIBLE_DEVICES"], "0,1");
        assert_eq!(out["PATH"], "/bin");
        // Credentials by value, whatever the name.
        assert_eq!(out["OTEL_EXPORTER_OTLP_HEADERS"], REDACTED);
        assert_eq!(out["DATABASE_URL"], REDACTED);
        assert_eq!(out["EXTRA"], REDACTED);
        // A URL without a password, and an '@' outside an authority's user part, stay.
        assert_eq!(out["MLFLOW_TRACKING_URI"], "http://mlflow:5000/api");
        assert_eq!(out["MODEL_REPO"], "https://hf.co/user@org/model");
    }

    #[test]
    fn a_large_environment_is_cut_and_says_so() {
        let env: BTreeMap<String, String> = (0..100)
            .map(|i| (format!("V{i:03}"), "x".repeat(1024)))
            .collect();
        let (out, truncated) = reportable_env(&env);
        assert!(truncated);
        assert!(out.len() < 100 && out.len() > 50, "{}", out.len());
    }

    #[test]
    fn cuda_versions_read_as_major_minor() {
        assert_eq!(cuda_version_text(12040), "12.4");
        assert_eq!(cuda_version_text(11080), "11.8");
    }
}
