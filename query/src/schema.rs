//! The stored tables: their Arrow schemas, their sort keys, and the conversion of an ingested
//! [`Batch`] into one record batch per table.
//!
//! Every table has `time` (UTC timestamp, millisecond precision); the tables of node telemetry
//! also have `node` and `simulated`.
//! Measured values are nullable: a metric the hardware does not report is NULL, never 0.
//! `docs/schema.md` documents every column with its unit; a test keeps the two in step.

use crate::rollup::{self, RollupSpec};
use arrow::array::{
    ArrayRef, BooleanArray, Float64Array, RecordBatch, StringArray, TimestampMillisecondArray,
    UInt32Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use perch_model::Batch;
use perch_model::catalogue::{self, Column, Read};
use std::sync::{Arc, LazyLock};

pub mod events;
mod job_metrics;
mod node_tables;

/// A table of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    GpuSamples,
    HostSamples,
    NicSamples,
    GpuEvents,
    GpuProcesses,
    IbPortSamples,
    JobSamples,
    JobMetrics,
    Events,
    /// Partial 1-minute summaries of `gpu_samples` (see [`crate::rollup`]).
    GpuSamples1m,
    /// Partial 1-hour summaries of `gpu_samples`.
    GpuSamples1h,
    HostSamples1m,
    HostSamples1h,
}

/// How a table's files are split into partitions, the unit of retention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partitioning {
    /// `date=YYYY-MM-DD` (UTC).
    Day,
    /// `month=YYYY-MM` (UTC): for the hourly rollups, which are small and kept for years, so
    /// a query over years opens dozens of files rather than a thousand.
    Month,
}

impl Table {
    pub const ALL: [Table; 13] = [
        Table::GpuSamples,
        Table::HostSamples,
        Table::NicSamples,
        Table::GpuEvents,
        Table::GpuProcesses,
        Table::IbPortSamples,
        Table::JobSamples,
        Table::JobMetrics,
        Table::Events,
        Table::GpuSamples1m,
        Table::GpuSamples1h,
        Table::HostSamples1m,
        Table::HostSamples1h,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Table::GpuSamples => "gpu_samples",
            Table::HostSamples => "host_samples",
            Table::NicSamples => "nic_samples",
            Table::GpuEvents => "gpu_events",
            Table::GpuProcesses => "gpu_processes",
            Table::IbPortSamples => "ib_port_samples",
            Table::JobSamples => "job_samples",
            Table::JobMetrics => "job_metrics",
            Table::Events => "events",
            Table::GpuSamples1m => "gpu_samples_1m",
            Table::GpuSamples1h => "gpu_samples_1h",
            Table::HostSamples1m => "host_samples_1m",
            Table::HostSamples1h => "host_samples_1h",
        }
    }

    /// For a rollup: what it summarises and its bucket width in milliseconds. SQL sees a
    /// rollup as a view of this name that merges the stored partial rows, which are
    /// themselves readable as `<name>_partial`.
    pub(crate) fn rollup(self) -> Option<(&'static RollupSpec, i64)> {
        match self {
            Table::GpuSamples1m => Some((&*rollup::GPU, rollup::MINUTE_MS)),
            Table::GpuSamples1h => Some((&*rollup::GPU, rollup::HOUR_MS)),
            Table::HostSamples1m => Some((&*rollup::HOST, rollup::MINUTE_MS)),
            Table::HostSamples1h => Some((&*rollup::HOST, rollup::HOUR_MS)),
            _ => None,
        }
    }

    /// The 1-minute and 1-hour rollups a flush of this table writes, finest first.
    pub(crate) fn rollups(self) -> &'static [Table] {
        match self {
            Table::GpuSamples => &[Table::GpuSamples1m, Table::GpuSamples1h],
            Table::HostSamples => &[Table::HostSamples1m, Table::HostSamples1h],
            _ => &[],
        }
    }

    /// The name SQL reads this table's stored rows by: the table's own name, except for a
    /// rollup, whose stored rows are partial (its name is the merging view).
    pub fn stored_sql_name(self) -> String {
        if self.rollup().is_some() {
            format!("{}_partial", self.name())
        } else {
            self.name().to_owned()
        }
    }

    /// For a rollup: the SQL of its merging view, reading the stored partial rows from
    /// `partial` (a table name, or a table function such as another engine's
    /// `read_parquet('...')` over the same files). `partial` is pasted into the SQL as it is:
    /// pass only text perch wrote. `None` for a table that is not a rollup.
    pub fn rollup_view_sql(self, partial: &str) -> Option<String> {
        self.rollup().map(|(spec, _)| spec.view_sql(partial))
    }

    pub fn partitioning(self) -> Partitioning {
        match self {
            Table::GpuSamples1h | Table::HostSamples1h => Partitioning::Month,
            _ => Partitioning::Day,
        }
    }

    pub fn from_name(name: &str) -> Option<Table> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    pub fn schema(self) -> SchemaRef {
        static GPU: LazyLock<SchemaRef> = LazyLock::new(|| gpu_schema(catalogue::GPU));
        static HOST: LazyLock<SchemaRef> = LazyLock::new(host_schema);
        static NIC: LazyLock<SchemaRef> = LazyLock::new(nic_schema);
        static EVENTS: LazyLock<SchemaRef> = LazyLock::new(node_tables::gpu_event_schema);
        static PROCS: LazyLock<SchemaRef> = LazyLock::new(node_tables::gpu_process_schema);
        static IB: LazyLock<SchemaRef> = LazyLock::new(node_tables::ib_port_schema);
        static JOBS: LazyLock<SchemaRef> = LazyLock::new(node_tables::job_schema);
        static JOB_METRICS: LazyLock<SchemaRef> = LazyLock::new(job_metrics::job_metric_schema);
        static CLUSTER_EVENTS: LazyLock<SchemaRef> = LazyLock::new(events::event_schema);
        match self {
            Table::GpuSamples => GPU.clone(),
            Table::HostSamples => HOST.clone(),
            Table::NicSamples => NIC.clone(),
            Table::GpuEvents => EVENTS.clone(),
            Table::GpuProcesses => PROCS.clone(),
            Table::IbPortSamples => IB.clone(),
            Table::JobSamples => JOBS.clone(),
            Table::JobMetrics => JOB_METRICS.clone(),
            Table::Events => CLUSTER_EVENTS.clone(),
            Table::GpuSamples1m | Table::GpuSamples1h => rollup::GPU.schema(),
            Table::HostSamples1m | Table::HostSamples1h => rollup::HOST.schema(),
        }
    }

    /// Columns the Parquet files are sorted by, in order; `time` is always last.
    pub fn sort_key(self) -> &'static [&'static str] {
        match self {
            Table::GpuSamples => &["node", "gpu", "time"],
            Table::HostSamples => &["node", "time"],
            Table::NicSamples => &["node", "device", "time"],
            Table::GpuEvents => &["node", "gpu", "time"],
            Table::GpuProcesses => &["node", "gpu", "pid", "time"],
            Table::IbPortSamples => &["node", "device", "port", "time"],
            Table::JobSamples => &["node", "job", "time"],
            Table::JobMetrics => &["job", "metric", "time"],
            Table::Events => &["kind", "time"],
            Table::GpuSamples1m | Table::GpuSamples1h => &["node", "gpu", "time"],
            Table::HostSamples1m | Table::HostSamples1h => &["node", "time"],
        }
    }
}

/// Columns renamed since files were first written, as (name now, name in older files). A file
/// is read through the old name when it lacks the new one, and the store rewrites such files
/// once at startup ([`crate::manifest::CURRENT_VERSION`]). `user` became `user_name`: in
/// PostgreSQL clients an unquoted `user` is the login name, not the column.
pub(crate) const RENAMED_COLUMNS: &[(&str, &str)] = &[("user_name", "user")];

pub(crate) fn time_type() -> DataType {
    DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()))
}

fn common(fields: Vec<Field>) -> SchemaRef {
    let mut all = vec![
        Field::new("time", time_type(), false),
        Field::new("node", DataType::Utf8, false),
    ];
    all.extend(fields);
    Arc::new(Schema::new(all))
}

fn f64_col(name: &str) -> Field {
    Field::new(name, DataType::Float64, true)
}

fn u64_col(name: &str) -> Field {
    Field::new(name, DataType::UInt64, true)
}

/// The measured columns of a sample type, from the catalogue: nullable, typed by their reading.
pub(crate) fn measured<R>(columns: &[Column<R>]) -> impl Iterator<Item = Field> + '_ {
    columns.iter().map(|c| {
        let data_type = match c.read {
            Read::F64(_) => DataType::Float64,
            Read::U64(_) => DataType::UInt64,
            Read::U32(_) => DataType::UInt32,
            Read::Bool(_) => DataType::Boolean,
            Read::Text(_) => DataType::Utf8,
        };
        Field::new(c.name, data_type, true)
    })
}

/// The arrays of the measured columns of `rows`, in the catalogue's order.
pub(crate) fn measured_arrays<R>(rows: &[R], columns: &[Column<R>], out: &mut Vec<ArrayRef>) {
    out.extend(columns.iter().map(|c| match c.read {
        Read::F64(f) => f64s(rows, f),
        Read::U64(f) => u64s(rows, f),
        Read::U32(f) => u32s(rows, f),
        Read::Bool(f) => opt_bools(rows, f),
        Read::Text(f) => strs(rows, f),
    }));
}

/// `gpu_samples`' schema: its keys, then a column per line of the GPU catalogue `columns`.
pub(crate) fn gpu_schema<R>(columns: &[Column<R>]) -> SchemaRef {
    let mut fields = vec![
        Field::new("gpu", DataType::UInt32, false),
        Field::new("uuid", DataType::Utf8, false),
        Field::new("model", DataType::Utf8, false),
        Field::new("simulated", DataType::Boolean, false),
    ];
    fields.extend(measured(columns));
    common(fields)
}

fn host_schema() -> SchemaRef {
    let mut fields = vec![Field::new("simulated", DataType::Boolean, false)];
    fields.extend(measured(catalogue::HOST));
    common(fields)
}

fn nic_schema() -> SchemaRef {
    let mut fields = vec![
        Field::new("device", DataType::Utf8, false),
        Field::new("simulated", DataType::Boolean, false),
    ];
    fields.extend(measured(catalogue::NIC));
    common(fields)
}

fn times<T>(rows: &[T], f: impl Fn(&T) -> i64) -> ArrayRef {
    Arc::new(TimestampMillisecondArray::from_iter_values(rows.iter().map(f)).with_timezone("UTC"))
}

fn nodes<T>(rows: &[T], node: &str) -> ArrayRef {
    Arc::new(StringArray::from_iter_values(rows.iter().map(|_| node)))
}

fn f64s<T>(rows: &[T], f: impl Fn(&T) -> Option<f64>) -> ArrayRef {
    Arc::new(Float64Array::from_iter(rows.iter().map(f)))
}

fn u64s<T>(rows: &[T], f: impl Fn(&T) -> Option<u64>) -> ArrayRef {
    Arc::new(UInt64Array::from_iter(rows.iter().map(f)))
}

fn bools<T>(rows: &[T], f: impl Fn(&T) -> bool) -> ArrayRef {
    Arc::new(BooleanArray::from_iter(rows.iter().map(|r| Some(f(r)))))
}

fn opt_bools<T>(rows: &[T], f: impl Fn(&T) -> Option<bool>) -> ArrayRef {
    Arc::new(BooleanArray::from_iter(rows.iter().map(f)))
}

fn u32s<T>(rows: &[T], f: impl Fn(&T) -> Option<u32>) -> ArrayRef {
    Arc::new(UInt32Array::from_iter(rows.iter().map(f)))
}

fn strs<T>(rows: &[T], f: impl Fn(&T) -> Option<String>) -> ArrayRef {
    Arc::new(StringArray::from_iter(rows.iter().map(f)))
}

/// Converts one batch into a record batch per table that has rows.
pub fn to_record_batches(batch: &Batch) -> crate::Result<Vec<(Table, RecordBatch)>> {
    let node = batch.node.as_str();
    let mut out = Vec::with_capacity(Table::ALL.len());
    let g = &batch.gpus;
    if !g.is_empty() {
        let mut columns = vec![
            times(g, |r| r.time_ms),
            nodes(g, node),
            Arc::new(UInt32Array::from_iter_values(g.iter().map(|r| r.gpu.0))) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                g.iter().map(|r| r.uuid.as_str()),
            )),
            Arc::new(StringArray::from_iter_values(
                g.iter().map(|r| r.model.as_str()),
            )),
            bools(g, |r| r.simulated),
        ];
        measured_arrays(g, catalogue::GPU, &mut columns);
        out.push((
            Table::GpuSamples,
            RecordBatch::try_new(Table::GpuSamples.schema(), columns)?,
        ));
    }
    let h = &batch.hosts;
    if !h.is_empty() {
        let mut columns = vec![
            times(h, |r| r.time_ms),
            nodes(h, node),
            bools(h, |r| r.simulated),
        ];
        measured_arrays(h, catalogue::HOST, &mut columns);
        out.push((
            Table::HostSamples,
            RecordBatch::try_new(Table::HostSamples.schema(), columns)?,
        ));
    }
    let n = &batch.nics;
    if !n.is_empty() {
        let mut columns = vec![
            times(n, |r| r.time_ms),
            nodes(n, node),
            Arc::new(StringArray::from_iter_values(
                n.iter().map(|r| r.device.as_str()),
            )) as ArrayRef,
            bools(n, |r| r.simulated),
        ];
        measured_arrays(n, catalogue::NIC, &mut columns);
        out.push((
            Table::NicSamples,
            RecordBatch::try_new(Table::NicSamples.schema(), columns)?,
        ));
    }
    node_tables::to_record_batches(batch, &mut out)?;
    job_metrics::to_record_batches(batch, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_model::catalogue::{Cadence, Summary};

    /// The section of docs/schema.md whose `## ` heading names `table`.
    fn doc_section<'a>(doc: &'a str, table: &str) -> &'a str {
        let name = format!("`{table}`");
        let start = doc
            .match_indices("\n## ")
            .map(|(i, _)| i + 1)
            .find(|&i| doc[i..].lines().next().is_some_and(|h| h.contains(&name)))
            .unwrap_or_else(|| panic!("docs/schema.md has no heading naming {name}"));
        let section = &doc[start..];
        &section[..section[1..].find("\n## ").map_or(section.len(), |e| e + 1)]
    }

    /// Each catalogued column's row in docs/schema.md gives the catalogue's type and unit (and,
    /// for a column read at the slow cadence, says so), and each rolled-up column has its row
    /// in the rollups' table, as a gauge or a range. A missing row is named as it should begin.
    #[test]
    fn schema_doc_gives_each_catalogued_columns_type_and_unit() {
        fn row_of<'a>(section: &'a str, table: &str, name: &str, start: &str) -> &'a str {
            let row = section
                .lines()
                .find(|l| l.starts_with(&format!("| `{name}` |")))
                .unwrap_or_else(|| {
                    panic!("docs/schema.md, {table}: add the row \"{start} <what it is> |\"")
                });
            assert!(
                row.starts_with(start),
                "docs/schema.md, {table}: the row of {name} must begin {start:?} (perch_model::catalogue)"
            );
            row
        }
        fn check<R>(doc: &str, table: Table, columns: &[Column<R>]) {
            let section = doc_section(doc, table.name());
            for c in columns {
                let start = format!("| `{}` | {} | {} |", c.name, c.read.type_name(), c.unit)
                    .replace("|  |", "| |");
                let row = row_of(section, table.name(), c.name, &start);
                assert!(
                    c.cadence == Cadence::EverySample
                        || row.contains("agent.nvml_slow_interval_ms"),
                    "docs/schema.md, {}: the row of {} must say it is read every \
                     `agent.nvml_slow_interval_ms` (its catalogue line is slow)",
                    table.name(),
                    c.name
                );
            }
            let Some(rollup) = table.rollups().first() else {
                return;
            };
            let section = doc_section(doc, rollup.name());
            for (c, r) in catalogue::rolled_up(columns) {
                let summary = match r.summary {
                    Summary::Gauge => "gauge",
                    Summary::Range => "range",
                };
                let start =
                    format!("| `{}` | {summary} | {} |", c.name, c.unit).replace("|  |", "| |");
                row_of(section, "the rollups' table", c.name, &start);
            }
        }
        let doc = include_str!("../../docs/schema.md");
        check(doc, Table::GpuSamples, catalogue::GPU);
        check(doc, Table::HostSamples, catalogue::HOST);
        check(doc, Table::NicSamples, catalogue::NIC);
        check(doc, Table::IbPortSamples, catalogue::IB_PORT);
        check(doc, Table::JobSamples, catalogue::JOB);
    }

    /// Every column of every table is documented in docs/schema.md, under a heading naming the
    /// table. A rollup documents its keys and each summarised column once (the suffixes are
    /// explained in the text), and every column of its view follows from them.
    #[test]
    fn schema_doc_covers_every_column() {
        let doc = include_str!("../../docs/schema.md");
        for table in Table::ALL {
            let section = doc_section(doc, table.name());
            let documented = |column: &str| section.contains(&format!("| `{column}` |"));
            match table.rollup() {
                None => {
                    for field in table.schema().fields() {
                        assert!(
                            documented(field.name()),
                            "docs/schema.md: {} lacks a row for {}",
                            table.name(),
                            field.name()
                        );
                    }
                }
                Some((spec, _)) => {
                    for column in spec.view_columns() {
                        let base = ["_avg", "_min", "_max", "_sum", "_count"]
                            .iter()
                            .find_map(|s| column.strip_suffix(s))
                            .filter(|b| {
                                spec.summarised(Summary::Gauge)
                                    .chain(spec.summarised(Summary::Range))
                                    .any(|s| s == *b)
                            })
                            .unwrap_or(&column);
                        assert!(
                            documented(base),
                            "docs/schema.md: {} lacks a row for {base}",
                            table.name()
                        );
                    }
                    for suffix in ["_avg", "_min", "_max", "_sum", "_count", "_partial"] {
                        assert!(
                            section.contains(suffix),
                            "rollup docs never explain {suffix}"
                        );
                    }
                }
            }
        }
    }

    mod probe {
        perch_model::probe_gpu_catalogue!();
    }

    /// One line more in the GPU catalogue is a column of `gpu_samples` after every other, its
    /// values are in the record batches, and the GPU rollups summarise it after every other
    /// column, as its line says (a range): the schema, the batches and the rollups are made
    /// from the catalogue alone, with no list of columns of their own.
    #[test]
    fn a_gpu_line_alone_makes_its_column_and_its_rollup() {
        use arrow::array::AsArray;
        use arrow::datatypes::UInt64Type;

        // The real table is what the same function makes of the real catalogue.
        assert_eq!(gpu_schema(catalogue::GPU), Table::GpuSamples.schema());
        let real = Table::GpuSamples.schema();
        let probed = gpu_schema(probe::GPU);
        let n = real.fields().len();
        assert_eq!(probed.fields().len(), n + 1);
        assert_eq!(&probed.fields()[..n], &real.fields()[..]);
        let field = probed.field(n);
        assert_eq!(
            (
                field.name().as_str(),
                field.data_type(),
                field.is_nullable()
            ),
            ("probe_rollovers_total", &DataType::UInt64, true)
        );

        const T: i64 = 1_800_000_000_000;
        let rows: Vec<probe::GpuSample> = [(T, 5), (T + 20_000, 9)]
            .into_iter()
            .map(|(time_ms, value)| probe::GpuSample {
                time_ms,
                uuid: "GPU-1".into(),
                model: "Probe".into(),
                probe_rollovers_total: Some(value),
                ..catalogue::every_value_set(probe::GPU)
            })
            .collect();
        let mut columns = vec![
            times(&rows, |r| r.time_ms),
            nodes(&rows, "n1"),
            Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.gpu.0))) as ArrayRef,
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.uuid.as_str()),
            )),
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.model.as_str()),
            )),
            bools(&rows, |r| r.simulated),
        ];
        measured_arrays(&rows, probe::GPU, &mut columns);
        let raw = RecordBatch::try_new(probed.clone(), columns).expect("the probe's rows");
        let values = raw
            .column_by_name("probe_rollovers_total")
            .expect("column")
            .as_primitive::<UInt64Type>();
        assert_eq!(values.values().to_vec(), [5, 9]);

        let spec = RollupSpec::of(
            Table::GpuSamples,
            probed,
            rollup::GPU.sorted,
            rollup::GPU.labels,
            probe::GPU,
        );
        let stored = spec.schema();
        let real_stored = Table::GpuSamples1m.schema();
        let m = real_stored.fields().len();
        assert_eq!(&stored.fields()[..m], &real_stored.fields()[..]);
        let added: Vec<&str> = stored.fields()[m..]
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(
            added,
            ["probe_rollovers_total_min", "probe_rollovers_total_max"]
        );
        assert!(
            spec.view_sql("p")
                .ends_with("min(probe_rollovers_total_min) AS probe_rollovers_total_min, max(probe_rollovers_total_max) AS probe_rollovers_total_max FROM p GROUP BY time, node, gpu, uuid, model, simulated")
        );
        let minute = rollup::of_rows(&spec, rollup::MINUTE_MS, &[raw])
            .expect("summarised")
            .expect("rows");
        let range = |suffix: &str| {
            minute
                .column_by_name(&format!("probe_rollovers_total_{suffix}"))
                .expect("column")
                .as_primitive::<UInt64Type>()
                .value(0)
        };
        assert_eq!((minute.num_rows(), range("min"), range("max")), (1, 5, 9));
    }
}
