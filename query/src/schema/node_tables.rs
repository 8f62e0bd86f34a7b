//! The tables beyond the per-sample GPU, host and NIC rows: GPU events (XID, ECC, lost), the
//! processes on each GPU with their job, InfiniBand ports, and per-job usage. Same conventions
//! as the parent module: `time`, `node`, `simulated`, and NULL for what was not reported.

use super::{
    Table, bools, common, f64_col, f64s, measured, measured_arrays, nodes, strs, times, u64_col,
    u64s,
};
use arrow::array::{ArrayRef, RecordBatch, StringArray, UInt32Array};
use arrow::datatypes::{DataType, Field, SchemaRef};
use perch_model::Batch;
use perch_model::catalogue;
use std::sync::Arc;

fn str_col(name: &str, nullable: bool) -> Field {
    Field::new(name, DataType::Utf8, nullable)
}

pub(super) fn gpu_event_schema() -> SchemaRef {
    common(vec![
        Field::new("gpu", DataType::UInt32, false),
        str_col("uuid", false),
        Field::new("simulated", DataType::Boolean, false),
        str_col("kind", false),
        u64_col("xid"),
        str_col("message", true),
    ])
}

pub(super) fn gpu_process_schema() -> SchemaRef {
    common(vec![
        Field::new("gpu", DataType::UInt32, false),
        str_col("uuid", false),
        Field::new("simulated", DataType::Boolean, false),
        Field::new("pid", DataType::UInt32, false),
        u64_col("used_memory_bytes"),
        f64_col("sm_utilization_pct"),
        f64_col("memory_utilization_pct"),
        str_col("job", true),
        Field::new("rogue", DataType::Boolean, false),
    ])
}

pub(super) fn ib_port_schema() -> SchemaRef {
    let mut fields = vec![
        str_col("device", false),
        Field::new("port", DataType::UInt32, false),
        Field::new("simulated", DataType::Boolean, false),
    ];
    fields.extend(measured(catalogue::IB_PORT));
    common(fields)
}

pub(super) fn job_schema() -> SchemaRef {
    let mut fields = vec![
        str_col("job", false),
        str_col("user_name", true),
        Field::new("simulated", DataType::Boolean, false),
        str_col("source", false),
        str_col("gpus", false),
    ];
    fields.extend(measured(catalogue::JOB));
    common(fields)
}

fn required<T>(rows: &[T], f: impl Fn(&T) -> &str) -> ArrayRef {
    Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
}

fn u32_required<T>(rows: &[T], f: impl Fn(&T) -> u32) -> ArrayRef {
    Arc::new(UInt32Array::from_iter_values(rows.iter().map(f)))
}

/// Appends a record batch for each of these tables that has rows in `batch`.
pub(super) fn to_record_batches(
    batch: &Batch,
    out: &mut Vec<(Table, RecordBatch)>,
) -> crate::Result<()> {
    let node = batch.node.as_str();
    let e = &batch.gpu_events;
    if !e.is_empty() {
        let columns = vec![
            times(e, |r| r.time_ms),
            nodes(e, node),
            u32_required(e, |r| r.gpu.0),
            required(e, |r| &r.uuid),
            bools(e, |r| r.simulated),
            required(e, |r| r.kind.as_str()),
            u64s(e, |r| r.xid),
            strs(e, |r| r.message.clone()),
        ];
        let t = Table::GpuEvents;
        out.push((t, RecordBatch::try_new(t.schema(), columns)?));
    }
    let p = &batch.gpu_processes;
    if !p.is_empty() {
        let columns = vec![
            times(p, |r| r.time_ms),
            nodes(p, node),
            u32_required(p, |r| r.gpu.0),
            required(p, |r| &r.uuid),
            bools(p, |r| r.simulated),
            u32_required(p, |r| r.pid),
            u64s(p, |r| r.used_memory_bytes),
            f64s(p, |r| r.sm_utilization_pct),
            f64s(p, |r| r.memory_utilization_pct),
            strs(p, |r| r.job.clone()),
            bools(p, |r| r.rogue),
        ];
        let t = Table::GpuProcesses;
        out.push((t, RecordBatch::try_new(t.schema(), columns)?));
    }
    let i = &batch.ib_ports;
    if !i.is_empty() {
        let mut columns = vec![
            times(i, |r| r.time_ms),
            nodes(i, node),
            required(i, |r| &r.device),
            u32_required(i, |r| r.port),
            bools(i, |r| r.simulated),
        ];
        measured_arrays(i, catalogue::IB_PORT, &mut columns);
        let t = Table::IbPortSamples;
        out.push((t, RecordBatch::try_new(t.schema(), columns)?));
    }
    let j = &batch.jobs;
    if !j.is_empty() {
        let gpus: Vec<String> = j
            .iter()
            .map(|r| {
                let list: Vec<String> = r.gpus.iter().map(|g| g.0.to_string()).collect();
                list.join(",")
            })
            .collect();
        let mut columns = vec![
            times(j, |r| r.time_ms),
            nodes(j, node),
            required(j, |r| &r.job),
            strs(j, |r| r.user.clone()),
            bools(j, |r| r.simulated),
            required(j, |r| &r.source),
            Arc::new(StringArray::from_iter_values(gpus.iter())) as ArrayRef,
        ];
        measured_arrays(j, catalogue::JOB, &mut columns);
        let t = Table::JobSamples;
        out.push((t, RecordBatch::try_new(t.schema(), columns)?));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::to_record_batches as convert;
    use super::*;
    use arrow::array::{AsArray, BooleanArray};
    use arrow::datatypes::UInt64Type;
    use perch_model::{
        GpuEvent, GpuEventKind, GpuIndex, GpuProcessSample, GpuSample, IbPortSample, JobSample,
        NodeId,
    };

    const T: i64 = 1_800_000_000_000;

    #[test]
    fn every_new_row_kind_lands_in_its_table() {
        let batch = Batch {
            gpus: vec![GpuSample {
                time_ms: T,
                uuid: "GPU-1".into(),
                model: "X".into(),
                throttle_reasons: Some(0x4 | 0x40),
                ..GpuSample::default()
            }],
            gpu_events: vec![GpuEvent {
                time_ms: T,
                gpu: GpuIndex(3),
                uuid: "GPU-3".into(),
                simulated: false,
                kind: GpuEventKind::Xid,
                xid: Some(79),
                message: None,
            }],
            gpu_processes: vec![GpuProcessSample {
                time_ms: T,
                uuid: "GPU-1".into(),
                pid: 9,
                rogue: true,
                ..GpuProcessSample::default()
            }],
            ib_ports: vec![IbPortSample {
                time_ms: T,
                device: "mlx5_0".into(),
                port: 1,
                rx_bytes: Some(4),
                ..IbPortSample::default()
            }],
            jobs: vec![JobSample {
                time_ms: T,
                job: "j".into(),
                source: "proc".into(),
                gpus: vec![GpuIndex(0), GpuIndex(2)],
                ..JobSample::default()
            }],
            ..Batch::new(NodeId::new("n1").expect("valid"), 1)
        };
        let out = convert(&batch).expect("converts");
        let tables: Vec<Table> = out.iter().map(|(t, _)| *t).collect();
        assert_eq!(
            tables,
            vec![
                Table::GpuSamples,
                Table::GpuEvents,
                Table::GpuProcesses,
                Table::IbPortSamples,
                Table::JobSamples
            ]
        );
        let col = |t: Table, name: &str| {
            let (_, rb) = out.iter().find(|(x, _)| *x == t).expect("table present");
            rb.column_by_name(name).expect("column").clone()
        };
        let names = col(Table::GpuSamples, "throttle_reason_names");
        assert_eq!(
            names.as_string::<i32>().value(0),
            "sw_power_cap,hw_thermal_slowdown"
        );
        assert_eq!(
            col(Table::GpuEvents, "kind").as_string::<i32>().value(0),
            "xid"
        );
        assert_eq!(
            col(Table::GpuEvents, "xid")
                .as_primitive::<UInt64Type>()
                .value(0),
            79
        );
        let rogue = col(Table::GpuProcesses, "rogue");
        let rogue = rogue.as_any().downcast_ref::<BooleanArray>().expect("bool");
        assert!(rogue.value(0));
        assert_eq!(
            col(Table::JobSamples, "gpus").as_string::<i32>().value(0),
            "0,2"
        );
        assert!(col(Table::IbPortSamples, "state").is_null(0));
    }
}
