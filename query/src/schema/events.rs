//! The `events` table: the cluster's audit trail ([`ClusterEvent`]s the server writes: job and
//! node state changes, alerts, remediation actions). Unlike the node tables, `node` is
//! nullable here (a circuit-breaker trip concerns no node) and there is no `simulated`.

use super::{Table, time_type};
use arrow::array::{ArrayRef, BooleanArray, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use perch_model::ClusterEvent;
use std::sync::Arc;

pub(super) fn event_schema() -> SchemaRef {
    let text = |name: &str, nullable| Field::new(name, DataType::Utf8, nullable);
    Arc::new(Schema::new(vec![
        Field::new("time", time_type(), false),
        text("kind", false),
        text("actor", false),
        text("node", true),
        Field::new("gpu", DataType::UInt32, true),
        Field::new("job", DataType::UInt64, true),
        text("rule", true),
        text("action", true),
        text("outcome", true),
        text("severity", true),
        Field::new("dry_run", DataType::Boolean, false),
        text("message", false),
    ]))
}

/// The `events` record batch for `events` (which may be empty).
pub fn to_record_batch(events: &[ClusterEvent]) -> crate::Result<RecordBatch> {
    let opt = |f: fn(&ClusterEvent) -> Option<&str>| -> ArrayRef {
        Arc::new(StringArray::from_iter(events.iter().map(f)))
    };
    let columns: Vec<ArrayRef> = vec![
        super::times(events, |e| e.time_ms),
        Arc::new(StringArray::from_iter_values(
            events.iter().map(|e| e.kind.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            events.iter().map(|e| e.actor.as_str()),
        )),
        opt(|e| e.node.as_deref()),
        Arc::new(UInt32Array::from_iter(events.iter().map(|e| e.gpu))),
        Arc::new(UInt64Array::from_iter(events.iter().map(|e| e.job))),
        opt(|e| e.rule.as_deref()),
        opt(|e| e.action.as_deref()),
        opt(|e| e.outcome.as_deref()),
        opt(|e| e.severity.as_deref()),
        Arc::new(BooleanArray::from_iter(
            events.iter().map(|e| Some(e.dry_run)),
        )),
        Arc::new(StringArray::from_iter_values(
            events.iter().map(|e| e.message.as_str()),
        )),
    ];
    Ok(RecordBatch::try_new(Table::Events.schema(), columns)?)
}
