//! What a user submits: the job request as JSON over HTTP (the CLI builds it from flags or a
//! TOML file), checked field by field so every error names the field and what is allowed.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Longest time limit accepted.
pub const MAX_TIME_LIMIT_SECS: u64 = 30 * 24 * 3600;
/// Signals a job may ask for before it is killed.
pub const SIGNALS: [&str; 5] = ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"];

fn one() -> u32 {
    1
}

fn hour() -> u64 {
    3600
}

fn thirty() -> u64 {
    30
}

/// A job request. Only `command` is required.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobRequest {
    /// A name to recognise the job by.
    #[serde(default)]
    pub name: Option<String>,
    /// Program and arguments, run without a shell (use `["sh", "-c", "..."]` for one).
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory on the node (default: the agent's job directory for the job).
    #[serde(default)]
    pub workdir: Option<String>,
    /// Nodes in the gang.
    #[serde(default = "one")]
    pub nodes: u32,
    /// GPUs on each node.
    #[serde(default = "one")]
    pub gpus_per_node: u32,
    #[serde(default)]
    pub cpus: Option<u32>,
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Only GPUs of this model (as NVML names it).
    #[serde(default)]
    pub gpu_model: Option<String>,
    #[serde(default = "hour")]
    pub time_limit_secs: u64,
    /// Who runs it (filled from the caller's identity when the server has authentication).
    #[serde(default)]
    pub user: Option<String>,
    /// Who pays; defaults to the user.
    #[serde(default)]
    pub account: Option<String>,
    #[serde(default)]
    pub queue: Option<String>,
    /// low, normal or high.
    #[serde(default)]
    pub qos: Option<String>,
    #[serde(default)]
    pub preemptible: bool,
    #[serde(default)]
    pub max_requeues: u32,
    /// Sent first when the job must stop; `grace_secs` later it is killed.
    #[serde(default)]
    pub checkpoint_signal: Option<String>,
    #[serde(default = "thirty")]
    pub grace_secs: u64,
    /// On simulated GPUs (labelled simulated), the load the job shows: idle (allocated but
    /// idle), steady or bursty. Real GPUs show what the job really does.
    #[serde(default)]
    pub sim_profile: Option<String>,
    /// Start only after these jobs completed successfully (Slurm's afterok); if one of them
    /// ends otherwise, this job is cancelled.
    #[serde(default)]
    pub after_ok: Vec<u64>,
    /// Start only after these jobs ended, however they ended (Slurm's afterany).
    #[serde(default)]
    pub after_any: Vec<u64>,
    /// Submit this many copies (a job array); each gets `PERCH_ARRAY_JOB_ID` (the first
    /// copy's id) and `PERCH_ARRAY_TASK_ID` (0, 1, ...).
    #[serde(default)]
    pub array: Option<u32>,
}

/// A field that is wrong and what would be right.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("field `{field}`: {message}")]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

fn err(field: &'static str, message: impl Into<String>) -> FieldError {
    FieldError {
        field,
        message: message.into(),
    }
}

fn check_name(field: &'static str, value: &str) -> Result<(), FieldError> {
    if value.is_empty()
        || value.len() > 64
        || !value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(err(
            field,
            format!("{value:?} must be 1 to 64 ASCII letters, digits, '.', '_' or '-'"),
        ));
    }
    Ok(())
}

impl JobRequest {
    /// Checks every field; the first wrong one is named.
    pub fn validate(&self) -> Result<(), FieldError> {
        match self.command.first() {
            None => {
                return Err(err(
                    "command",
                    "give the program and its arguments, e.g. [\"python\", \"train.py\"]",
                ));
            }
            Some(p) if p.is_empty() => return Err(err("command", "the program name is empty")),
            _ => {}
        }
        if self.command.iter().any(|a| a.contains('\0')) {
            return Err(err("command", "arguments cannot contain NUL bytes"));
        }
        if let Some(name) = &self.name
            && (name.is_empty() || name.len() > 128 || name.chars().any(char::is_control))
        {
            return Err(err(
                "name",
                "must be 1 to 128 characters without control characters",
            ));
        }
        for key in self.env.keys() {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(err("env", format!("{key:?} is not a valid variable name")));
            }
            if key == "CUDA_VISIBLE_DEVICES" || key.starts_with("PERCH_") {
                return Err(err("env", format!("{key} is set by perch; leave it out")));
            }
        }
        if !(1..=1024).contains(&self.nodes) {
            return Err(err("nodes", "must be between 1 and 1024"));
        }
        if !(1..=64).contains(&self.gpus_per_node) {
            return Err(err("gpus_per_node", "must be between 1 and 64"));
        }
        if self.cpus == Some(0) {
            return Err(err("cpus", "must be at least 1 when given"));
        }
        if self.memory_mb == Some(0) {
            return Err(err("memory_mb", "must be at least 1 when given"));
        }
        if !(1..=MAX_TIME_LIMIT_SECS).contains(&self.time_limit_secs) {
            return Err(err(
                "time_limit_secs",
                format!("must be between 1 and {MAX_TIME_LIMIT_SECS} (30 days)"),
            ));
        }
        if let Some(u) = &self.user {
            check_name("user", u)?;
        }
        if let Some(a) = &self.account {
            check_name("account", a)?;
        }
        if let Some(q) = &self.queue {
            check_name("queue", q)?;
        }
        if let Some(q) = &self.qos
            && !matches!(q.as_str(), "low" | "normal" | "high")
        {
            return Err(err("qos", format!("{q:?} is not one of low, normal, high")));
        }
        if self.max_requeues > 100 {
            return Err(err("max_requeues", "must be at most 100"));
        }
        if let Some(s) = &self.checkpoint_signal
            && !SIGNALS.contains(&s.as_str())
        {
            return Err(err(
                "checkpoint_signal",
                format!("{s:?} is not one of {}", SIGNALS.join(", ")),
            ));
        }
        if let Some(p) = &self.sim_profile
            && !matches!(p.as_str(), "idle" | "steady" | "bursty")
        {
            return Err(err(
                "sim_profile",
                format!("{p:?} is not one of idle, steady, bursty"),
            ));
        }
        if let Some(n) = self.array
            && !(1..=10_000).contains(&n)
        {
            return Err(err("array", "must be between 1 and 10000"));
        }
        if self.after_ok.len() + self.after_any.len() > 100 {
            return Err(err("after_ok", "at most 100 dependencies in all"));
        }
        if self.grace_secs > 3600 {
            return Err(err("grace_secs", "must be at most 3600"));
        }
        Ok(())
    }

    pub fn user(&self) -> &str {
        self.user.as_deref().unwrap_or("nobody")
    }

    pub fn account(&self) -> &str {
        self.account.as_deref().unwrap_or_else(|| self.user())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, expected: Option<&str>) {
        let got = serde_json::from_str::<JobRequest>(json)
            .map_err(|e| e.to_string())
            .and_then(|r| r.validate().map_err(|e| e.to_string()));
        match (got, expected) {
            (Ok(()), None) => {}
            (Err(msg), Some(want)) => assert!(msg.contains(want), "{json}: {msg:?} lacks {want:?}"),
            (got, want) => panic!("{json}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn every_bad_field_is_named() {
        check(r#"{"command": ["python", "train.py"]}"#, None);
        check(r#"{"command": []}"#, Some("field `command`"));
        check(
            r#"{"comand": ["x"]}"#,
            Some("unknown field `comand`, expected one of"),
        );
        check(
            r#"{"command": ["x"], "gpus_per_node": 0}"#,
            Some("field `gpus_per_node`: must be between 1 and 64"),
        );
        check(r#"{"command": ["x"], "nodes": 0}"#, Some("field `nodes`"));
        check(
            r#"{"command": ["x"], "qos": "urgent"}"#,
            Some("not one of low, normal, high"),
        );
        check(
            r#"{"command": ["x"], "checkpoint_signal": "SIGKILL"}"#,
            Some("not one of SIGTERM"),
        );
        check(
            r#"{"command": ["x"], "time_limit_secs": 0}"#,
            Some("field `time_limit_secs`"),
        );
        check(r#"{"command": ["x"], "user": "a b"}"#, Some("field `user`"));
        check(
            r#"{"command": ["x"], "env": {"CUDA_VISIBLE_DEVICES": "0"}}"#,
            Some("set by perch"),
        );
        check(
            r#"{"command": ["x"], "gpus_per_node": -1}"#,
            Some("invalid value"),
        );
    }
}
