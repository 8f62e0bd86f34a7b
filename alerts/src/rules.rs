//! Rules and the alert instances their evaluation yields.
//!
//! A rule is either SQL over perch's store (every returned row is one alert instance: its text
//! columns are labels, its numeric columns values) or one of the few typed built-ins the server
//! computes from its own state rather than from SQL ([`BuiltinKind`]). The server runs the
//! query (this crate has no SQL engine) and hands the rows to [`Rule::instances`].

use crate::error::{Error, Result};
use crate::matcher::is_label_name;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// How urgent an alert is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Worth knowing; nobody needs to act now.
    Info,
    /// Needs attention during working hours.
    Warning,
    /// Needs attention now.
    Critical,
}

impl Severity {
    /// The name used in labels, config and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::Warning => "warning",
            Self::Critical => "critical",
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A remediation a rule asks for when one of its alerts fires. The alert's labels say where:
/// `node` for every action, `gpu` too for [`ActionSpec::GpuOut`].
///
/// Written in config as `"drain_node"`, `"requeue_jobs"`, `"gpu_out"` or
/// `"run_command:NAME"`, where NAME is a command defined under `[alerts.remediation.commands]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionSpec {
    /// Stop placing jobs on the node; running jobs finish unless `RequeueJobs` is also asked.
    DrainNode,
    /// Stop the node's running jobs and put them back in the queue (to run elsewhere).
    RequeueJobs,
    /// Take the alert's GPU out of scheduling, leaving the node's other GPUs in use.
    GpuOut,
    /// Run a configured command on the node through its agent, with the command's timeout.
    RunCommand(String),
}

impl ActionSpec {
    /// Parses the config form; the error lists the accepted forms.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "drain_node" => Ok(Self::DrainNode),
            "requeue_jobs" => Ok(Self::RequeueJobs),
            "gpu_out" => Ok(Self::GpuOut),
            _ => match text.strip_prefix("run_command:") {
                Some(name) if !name.trim().is_empty() => Ok(Self::RunCommand(name.trim().into())),
                _ => Err(format!(
                    "unknown action {text:?}; use \"drain_node\", \"requeue_jobs\", \"gpu_out\" or \"run_command:NAME\""
                )),
            },
        }
    }
}

impl fmt::Display for ActionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DrainNode => f.write_str("drain_node"),
            Self::RequeueJobs => f.write_str("requeue_jobs"),
            Self::GpuOut => f.write_str("gpu_out"),
            Self::RunCommand(name) => write!(f, "run_command:{name}"),
        }
    }
}

impl Serialize for ActionSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ActionSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// The built-ins that are not SQL: the server computes their instances from its control plane
/// or its filesystem, with the helpers in [`crate::builtin`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BuiltinKind {
    /// A node's agent has not synced for longer than `timeout_ms`.
    NodeHeartbeatLost {
        /// Silence after which a node counts as lost.
        timeout_ms: i64,
    },
    /// A node's agent still syncs but no telemetry from it has been stored within the
    /// server's staleness window (the node's state is `no_telemetry`).
    NodeTelemetryStopped,
    /// The filesystem holding perch's store has less than `free_percent` free.
    StoreDiskFull {
        /// Threshold in percent of the filesystem's size.
        free_percent: f64,
    },
    /// The store's flushes to Parquet have failed at least twice in a row (a full disk, an
    /// unwritable bucket): rows pile up in memory until ingest is refused.
    StoreFlushFailing,
    /// The job database cannot commit (a full disk): job operations are refused until perch
    /// has reopened it.
    JobDatabaseFailing,
    /// The scheduler has reported a running job's GPUs idle for its idle window
    /// (`[scheduler.idle]`): the warning to its user before any reclaim.
    JobIdle,
}

/// Where a rule's instances come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleSource {
    /// A read-only SQL query over perch's tables; each row is an instance.
    Sql(String),
    /// A built-in the server computes itself.
    Builtin(BuiltinKind),
}

/// One alerting rule, ready to evaluate (built from config by
/// [`crate::AlertsConfig::rules`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rule {
    /// Unique name; becomes the `alertname` label.
    pub name: String,
    /// What to evaluate.
    pub source: RuleSource,
    /// How long an instance must keep appearing before it fires (0: fires at once).
    pub for_ms: i64,
    /// How long a firing alert keeps firing after it stops appearing (flap protection).
    pub keep_firing_for_ms: i64,
    /// How urgent it is; becomes the `severity` label.
    pub severity: Severity,
    /// Extra labels added to every instance (they win over the row's columns).
    pub labels: BTreeMap<String, String>,
    /// One-line summary template (see [`crate::template`]).
    pub summary: String,
    /// Longer description template.
    pub description: String,
    /// How often to evaluate the rule.
    pub interval_ms: i64,
    /// Remediation to plan when an instance fires.
    pub actions: Vec<ActionSpec>,
    /// Numeric columns that are identities rather than measurements (`gpu`, `port`): they
    /// become labels as well as values, so two GPUs are two alerts.
    pub label_columns: Vec<String>,
    /// True for the rules of the built-in pack.
    pub builtin: bool,
}

/// The numeric columns that are labels unless a rule says otherwise.
pub const DEFAULT_LABEL_COLUMNS: &[&str] = &["gpu", "port", "xid", "pid", "job"];

/// Labels perch sets itself; a row or rule label of the same name is overwritten.
pub const RESERVED_LABELS: &[&str] = &["alertname", "severity"];

/// One alert instance from an evaluation: its identity (labels) and its measurements (values).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    /// Identity: row text columns, label columns, and later the rule's labels.
    pub labels: BTreeMap<String, String>,
    /// Measurements: row numeric columns.
    pub values: BTreeMap<String, f64>,
}

impl Instance {
    /// An instance with these labels and no values.
    pub fn with_labels<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self {
            labels: pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            values: BTreeMap::new(),
        }
    }

    /// Adds a value.
    pub fn value(mut self, name: &str, v: f64) -> Self {
        self.values.insert(name.to_owned(), v);
        self
    }
}

impl Rule {
    /// Turns the rows a SQL rule returned into instances, with [`instances_from_rows`].
    pub fn instances(&self, rows: &[Map<String, Value>]) -> Result<Vec<Instance>> {
        instances_from_rows(&self.name, rows, &self.label_columns)
    }
}

/// Turns query rows (JSON objects, as `POST /v1/sql` returns them) into instances.
///
/// Per column: a string is a label; a boolean is a label (`"true"`/`"false"`); a number is a
/// value, and also a label when its column is in `label_columns` (integers print without a
/// fraction); null or absent contributes nothing (absent is not zero). Arrays and objects are
/// an error. Column names must be valid label names (`[A-Za-z_][A-Za-z0-9_]*`; alias
/// expressions with `AS`). Two rows with the same labels are an error, as in Prometheus: they
/// would be one alert with two sets of values.
pub fn instances_from_rows(
    rule: &str,
    rows: &[Map<String, Value>],
    label_columns: &[String],
) -> Result<Vec<Instance>> {
    let fail = |message: String| Error::Rule {
        rule: rule.to_owned(),
        message,
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let mut instance = Instance::default();
        for (column, value) in row {
            if !is_label_name(column) {
                return Err(fail(format!(
                    "column {column:?} is not a valid label name; alias it with AS name (letters, digits, '_')"
                )));
            }
            match value {
                Value::Null => {}
                Value::String(s) => {
                    instance.labels.insert(column.clone(), s.clone());
                }
                Value::Bool(b) => {
                    instance.labels.insert(column.clone(), b.to_string());
                }
                Value::Number(n) => {
                    let Some(v) = n.as_f64() else {
                        return Err(fail(format!(
                            "row {i}, column {column:?}: {n} is not a finite number"
                        )));
                    };
                    if label_columns.iter().any(|c| c == column) {
                        instance
                            .labels
                            .insert(column.clone(), crate::template::format_value(v));
                    }
                    instance.values.insert(column.clone(), v);
                }
                Value::Array(_) | Value::Object(_) => {
                    return Err(fail(format!(
                        "row {i}, column {column:?} is a list or struct; select scalar columns only"
                    )));
                }
            }
        }
        if !seen.insert(instance.labels.clone()) {
            return Err(fail(format!(
                "rows {:?} appear twice; group by every text column, or drop the column that differs",
                instance.labels
            )));
        }
        out.push(instance);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows(value: Value) -> Vec<Map<String, Value>> {
        serde_json::from_value(value).expect("rows")
    }

    fn label_cols() -> Vec<String> {
        DEFAULT_LABEL_COLUMNS
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    #[test]
    fn text_columns_are_labels_and_numbers_values() {
        let got = instances_from_rows(
            "r",
            &rows(json!([
                {"node": "n1", "gpu": 0, "xid": 79, "count": 3, "ok": true, "missing": null},
                {"node": "n1", "gpu": 1, "xid": 79, "count": 1.5, "ok": false}
            ])),
            &label_cols(),
        )
        .expect("valid rows");
        assert_eq!(got.len(), 2);
        let first = &got[0];
        assert_eq!(first.labels["node"], "n1");
        assert_eq!(first.labels["gpu"], "0");
        assert_eq!(first.labels["xid"], "79");
        assert_eq!(first.labels["ok"], "true");
        assert!(!first.labels.contains_key("count"));
        assert!(!first.labels.contains_key("missing"));
        assert!(!first.values.contains_key("missing"));
        assert_eq!(first.values["count"], 3.0);
        assert_eq!(first.values["gpu"], 0.0);
        assert_eq!(got[1].values["count"], 1.5);
    }

    #[test]
    fn bad_rows_are_errors_that_say_what_to_change() {
        for (value, fragment) in [
            (json!([{"max(gpu)": 1}]), "alias it with AS"),
            (json!([{"node": [1]}]), "scalar columns"),
            (
                json!([{"node": "a", "v": 1}, {"node": "a", "v": 2}]),
                "appear twice",
            ),
        ] {
            let err = instances_from_rows("rule-x", &rows(value), &label_cols())
                .expect_err("must fail")
                .to_string();
            assert!(err.contains("rule-x") && err.contains(fragment), "{err}");
        }
    }

    #[test]
    fn empty_result_is_no_instances() {
        assert!(
            instances_from_rows("r", &[], &[])
                .expect("empty is fine")
                .is_empty()
        );
    }

    #[test]
    fn actions_parse_and_print() {
        for text in [
            "drain_node",
            "requeue_jobs",
            "gpu_out",
            "run_command:gpu_reset",
        ] {
            let a = ActionSpec::parse(text).expect(text);
            assert_eq!(a.to_string(), text);
        }
        for bad in ["drain", "run_command:", "run_command: "] {
            let err = ActionSpec::parse(bad).expect_err(bad);
            assert!(err.contains("run_command:NAME"), "{err}");
        }
    }
}
