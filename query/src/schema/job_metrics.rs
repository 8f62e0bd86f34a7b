//! The `job_metrics` table: metrics jobs push over OpenTelemetry (OTLP), one row per data
//! point. Same conventions as the parent module; `simulated` is true only when the exporter
//! says so (resource attribute `perch.simulated`): a job measures these values itself, whether
//! or not its GPUs are simulated.

use super::{Table, bools, common, f64_col, f64s, nodes, times, u64_col, u64s};
use arrow::array::{ArrayRef, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, SchemaRef};
use perch_model::{Batch, JobMetricSample};
use std::sync::Arc;

pub(super) fn job_metric_schema() -> SchemaRef {
    let text = |name: &str| Field::new(name, DataType::Utf8, false);
    common(vec![
        text("job"),
        text("user_name"),
        Field::new("simulated", DataType::Boolean, false),
        text("service_name"),
        text("metric"),
        text("kind"),
        text("unit"),
        f64_col("value"),
        u64_col("count"),
        f64_col("sum"),
        text("attributes"),
    ])
}

fn text(rows: &[JobMetricSample], f: impl Fn(&JobMetricSample) -> &str) -> ArrayRef {
    Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
}

/// Appends the `job_metrics` record batch when `batch` has data points.
pub(super) fn to_record_batches(
    batch: &Batch,
    out: &mut Vec<(Table, RecordBatch)>,
) -> crate::Result<()> {
    let m = &batch.job_metrics;
    if m.is_empty() {
        return Ok(());
    }
    let columns = vec![
        times(m, |r| r.time_ms),
        nodes(m, batch.node.as_str()),
        text(m, |r| &r.job),
        text(m, |r| &r.user),
        bools(m, |r| r.simulated),
        text(m, |r| &r.service_name),
        text(m, |r| &r.metric),
        text(m, |r| &r.kind),
        text(m, |r| &r.unit),
        f64s(m, |r| r.value),
        u64s(m, |r| r.count),
        f64s(m, |r| r.sum),
        text(m, |r| &r.attributes),
    ];
    let t = Table::JobMetrics;
    out.push((t, RecordBatch::try_new(t.schema(), columns)?));
    Ok(())
}
