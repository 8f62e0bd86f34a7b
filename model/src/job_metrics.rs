//! Metrics a job pushes about itself (loss, samples per second...) through OpenTelemetry.
//!
//! The server's OTLP receiver turns each data point of an OTLP export into one
//! [`JobMetricSample`] and stores them through the same path as agent telemetry (a [`Batch`]
//! with its write-ahead log, deduplication and buffer), so they are as durable as any sample.
//!
//! [`Batch`]: crate::Batch

use crate::telemetry::{BatchError, check_label, check_time, field_error};
use serde::{Deserialize, Serialize};

/// Longest metric name, unit, service name or attribute text accepted (a data point's
/// attributes become a label on `/metrics`: 64 KiB ones made scrapes huge).
const MAX_ATTRIBUTES_LEN: usize = 4 * 1024;

/// One data point of a metric a job exported.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobMetricSample {
    /// Unix time in milliseconds of the data point.
    pub time_ms: i64,
    /// The job's ID (resource attribute `perch.job.id`), empty when the exporter sent none.
    #[serde(default)]
    pub job: String,
    /// Resource attribute `perch.user`, empty when absent.
    #[serde(default)]
    pub user: String,
    /// Resource attribute `service.name`, empty when absent.
    #[serde(default)]
    pub service_name: String,
    pub metric: String,
    /// `gauge`, `sum` or `histogram`.
    pub kind: String,
    #[serde(default)]
    pub unit: String,
    /// The value: a gauge's or sum's value; a histogram's mean (sum / count), absent when the
    /// histogram has no sum or no observations.
    #[serde(default)]
    pub value: Option<f64>,
    /// For histograms: the number of observations (otherwise absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// For histograms: the sum of the observations, when the exporter sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sum: Option<f64>,
    /// The data point's attributes as a JSON object.
    #[serde(default)]
    pub attributes: String,
    /// The exporter said it is a simulation (resource attribute `perch.simulated = true`, as
    /// `perch demo`'s simulated trainers send), not a measurement of a real job.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub simulated: bool,
}

/// The kinds of metric stored.
pub const JOB_METRIC_KINDS: [&str; 3] = ["gauge", "sum", "histogram"];

pub(crate) fn validate(samples: &[JobMetricSample], now_ms: i64) -> Result<(), BatchError> {
    for (i, s) in samples.iter().enumerate() {
        let f = |name: &str| format!("job_metrics[{i}].{name}");
        check_time(|| f("time_ms"), s.time_ms, now_ms)?;
        check_label(|| f("metric"), &s.metric)?;
        if !JOB_METRIC_KINDS.contains(&s.kind.as_str()) {
            return Err(field_error(
                f("kind"),
                format!("{:?} is not one of gauge, sum, histogram", s.kind),
            ));
        }
        for (name, text) in [
            ("job", &s.job),
            ("user", &s.user),
            ("service_name", &s.service_name),
            ("unit", &s.unit),
        ] {
            if !text.is_empty() {
                check_label(|| f(name), text)?;
            }
        }
        if s.attributes.len() > MAX_ATTRIBUTES_LEN {
            return Err(field_error(
                f("attributes"),
                format!(
                    "{} bytes; keep a data point's attributes under {MAX_ATTRIBUTES_LEN} bytes",
                    s.attributes.len()
                ),
            ));
        }
        for (name, v) in [("value", s.value), ("sum", s.sum)] {
            if let Some(v) = v.filter(|v| !v.is_finite()) {
                return Err(field_error(f(name), format!("{v} must be a finite number")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Batch, NodeId};

    const NOW: i64 = 1_800_000_000_000;

    fn check(mutate: impl FnOnce(&mut JobMetricSample), want: Option<&str>) {
        let mut s = JobMetricSample {
            time_ms: NOW,
            job: "7".into(),
            metric: "loss".into(),
            kind: "gauge".into(),
            value: Some(0.5),
            attributes: "{}".into(),
            ..JobMetricSample::default()
        };
        mutate(&mut s);
        let b = Batch {
            job_metrics: vec![s],
            ..Batch::new(NodeId::new("otlp").expect("valid"), 1)
        };
        match (b.validate(NOW), want) {
            (Ok(()), None) => {}
            (Err(e), Some(w)) => assert!(e.to_string().contains(w), "{e} lacks {w}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn validation_names_the_field() {
        check(|_| {}, None);
        check(|s| s.job.clear(), None);
        check(|s| s.metric.clear(), Some("job_metrics[0].metric"));
        check(|s| s.kind = "summary".into(), Some("job_metrics[0].kind"));
        check(|s| s.value = Some(f64::NAN), Some("job_metrics[0].value"));
        check(|s| s.time_ms = 5, Some("job_metrics[0].time_ms"));
        check(|s| s.unit = "\n".into(), Some("job_metrics[0].unit"));
    }
}
