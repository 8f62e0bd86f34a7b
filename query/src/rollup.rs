//! Rollups: per-minute and per-hour summaries of GPU and host samples, kept long after the raw
//! rows are dropped.
//!
//! Rollup rows are *mergeable partial aggregates*. Each holds, for one bucket of one key
//! (`node`, `gpu` and the GPU's labels, or `node` for hosts), the number of samples and, per
//! gauge, the count of non-null values, their sum, min and max; per counter or capacity, the
//! min and max. A flush aggregates exactly the rows it writes, so a bucket that straddles two
//! flushes has two partial rows; compaction merges the partial rows of a key into one. The SQL
//! view of the same name (`gpu_samples_1m` over the stored `gpu_samples_1m_partial`) merges
//! whatever partial rows exist, so a query always gets one exact row per bucket, however the
//! rows were split. Merging is sum of counts and sums, min of mins, max of maxes: associative
//! and commutative, so the result does not depend on how flushes and compactions cut the data.
//!
//! Rollup files are written by the flush that writes the raw rows they summarise and listed by
//! the same manifest commit, so a crash never leaves raw rows without their rollup nor counts
//! them twice; rows replayed from the write-ahead log are flushed like any other. Rows still in
//! the buffer are rolled up when a query reads the rollup, from the same snapshot as the files.

use crate::schema::Table;
use crate::{Error, Result};
use arrow::array::{
    Array, ArrayRef, ArrowPrimitiveType, AsArray, PrimitiveArray, RecordBatch, UInt32Array,
    UInt64Array,
};
use arrow::compute::{SortColumn, concat_batches, lexsort_to_indices, take, take_record_batch};
use arrow::datatypes::{
    DataType, Field, Float64Type, Schema, SchemaRef, TimestampMillisecondType, UInt64Type,
};
use perch_model::catalogue::{self, Column, Read, Summary};
use std::ops::Range;
use std::sync::{Arc, LazyLock};

pub(crate) const MINUTE_MS: i64 = 60_000;
pub(crate) const HOUR_MS: i64 = 3_600_000;

/// What a rollup keeps of one kind of source table. Which columns it summarises, how and in
/// what order come from the source's catalogue ([`catalogue::Column::rollup`]); there is no
/// list of them here.
#[derive(Debug)]
pub(crate) struct RollupSpec {
    /// The raw table summarised.
    pub(crate) source: Table,
    /// Its schema (the rows `of_rows` summarises).
    raw: SchemaRef,
    /// Key columns the source is sorted by before `time` (`node`, `gpu`).
    pub(crate) sorted: &'static [&'static str],
    /// Further key columns that are constant for a device in practice (`uuid`, `model`,
    /// `simulated`): part of the key, so a GPU swapped within a minute gives two exact rows
    /// rather than one with a made-up label.
    pub(crate) labels: &'static [&'static str],
    /// The summarised columns in stored order (their catalogue rollup slots). Gauges (values
    /// that go up and down) keep the count of non-null values, sum, min and max, so the mean
    /// is exact at any coarser grain: sum of sums over sum of counts. Ranges (counters and
    /// capacities) keep min and max: a counter's increase over the bucket is max - min, when
    /// it did not reset.
    summarised: Vec<Summarised>,
    /// The stored (partial) schema, shared by the 1-minute and 1-hour tables.
    schema: SchemaRef,
}

/// One summarised column.
#[derive(Debug)]
struct Summarised {
    name: &'static str,
    summary: Summary,
    /// Float64 for float columns, UInt64 for integer ones (every integer metric is unsigned),
    /// so integer sums stay exact.
    value_type: DataType,
}

pub(crate) static GPU: LazyLock<RollupSpec> = LazyLock::new(|| {
    RollupSpec::of(
        Table::GpuSamples,
        Table::GpuSamples.schema(),
        &["node", "gpu"],
        &["uuid", "model", "simulated"],
        catalogue::GPU,
    )
});

pub(crate) static HOST: LazyLock<RollupSpec> = LazyLock::new(|| {
    RollupSpec::of(
        Table::HostSamples,
        Table::HostSamples.schema(),
        &["node"],
        &["simulated"],
        catalogue::HOST,
    )
});

impl RollupSpec {
    /// The rollup of `source` (rows of schema `raw`) whose measured columns `columns` (its
    /// catalogue) describe: the catalogue's rolled-up columns in slot order, typed by their
    /// reading.
    pub(crate) fn of<R>(
        source: Table,
        raw: SchemaRef,
        sorted: &'static [&'static str],
        labels: &'static [&'static str],
        columns: &[Column<R>],
    ) -> RollupSpec {
        let summarised: Vec<Summarised> = catalogue::rolled_up(columns)
            .into_iter()
            .map(|(c, r)| Summarised {
                name: c.name,
                summary: r.summary,
                value_type: match c.read {
                    Read::F64(_) => DataType::Float64,
                    _ => DataType::UInt64,
                },
            })
            .collect();
        let mut fields = vec![Field::new("time", crate::schema::time_type(), false)];
        for key in sorted.iter().chain(labels) {
            if let Ok(f) = raw.field_with_name(key) {
                fields.push(f.clone());
            }
        }
        fields.push(Field::new("samples", DataType::UInt64, false));
        for s in &summarised {
            let (name, t) = (s.name, &s.value_type);
            if s.summary == Summary::Gauge {
                fields.push(Field::new(format!("{name}_count"), DataType::UInt64, false));
                fields.push(Field::new(format!("{name}_sum"), t.clone(), true));
            }
            fields.push(Field::new(format!("{name}_min"), t.clone(), true));
            fields.push(Field::new(format!("{name}_max"), t.clone(), true));
        }
        RollupSpec {
            source,
            raw,
            sorted,
            labels,
            summarised,
            schema: Arc::new(Schema::new(fields)),
        }
    }

    /// The summarised columns of `summary`, in stored order (for the documentation test).
    #[cfg(test)]
    pub(crate) fn summarised(&self, summary: Summary) -> impl Iterator<Item = &'static str> + '_ {
        self.summarised
            .iter()
            .filter(move |s| s.summary == summary)
            .map(|s| s.name)
    }

    /// Grouping columns in sort order, `time` standing for the bucket.
    fn group_columns(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.sorted
            .iter()
            .copied()
            .chain(["time"])
            .chain(self.labels.iter().copied())
    }

    /// The stored (partial) schema, shared by the 1-minute and 1-hour tables.
    pub(crate) fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The columns of the merged view, in order (for the documentation test).
    #[cfg(test)]
    pub(crate) fn view_columns(&self) -> Vec<String> {
        let mut out: Vec<String> = ["time"]
            .into_iter()
            .chain(self.sorted.iter().copied())
            .chain(self.labels.iter().copied())
            .chain(["samples"])
            .map(str::to_owned)
            .collect();
        for s in &self.summarised {
            let suffixes: &[&str] = match s.summary {
                Summary::Gauge => &["avg", "min", "max", "sum", "count"],
                Summary::Range => &["min", "max"],
            };
            for suffix in suffixes {
                out.push(format!("{}_{suffix}", s.name));
            }
        }
        out
    }

    /// The SELECT that merges the partial rows of `partial_table` into one row per bucket.
    pub(crate) fn view_sql(&self, partial_table: &str) -> String {
        let keys: Vec<&str> = ["time"]
            .into_iter()
            .chain(self.sorted.iter().copied())
            .chain(self.labels.iter().copied())
            .collect();
        let mut cols: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        cols.push("sum(samples) AS samples".into());
        for s in &self.summarised {
            let c = s.name;
            match s.summary {
                Summary::Gauge => {
                    cols.push(format!(
                        "CAST(sum({c}_sum) AS DOUBLE) / CAST(NULLIF(sum({c}_count), 0) AS DOUBLE) AS {c}_avg"
                    ));
                    cols.push(format!("min({c}_min) AS {c}_min"));
                    cols.push(format!("max({c}_max) AS {c}_max"));
                    cols.push(format!("sum({c}_sum) AS {c}_sum"));
                    cols.push(format!("sum({c}_count) AS {c}_count"));
                }
                Summary::Range => {
                    cols.push(format!("min({c}_min) AS {c}_min"));
                    cols.push(format!("max({c}_max) AS {c}_max"));
                }
            }
        }
        format!(
            "SELECT {} FROM {partial_table} GROUP BY {}",
            cols.join(", "),
            keys.join(", ")
        )
    }
}

/// Where the rows being summarised come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// Raw samples of the source table.
    Raw,
    /// Partial rows (of the same or a finer bucket width).
    Partial,
}

/// Summarises `input` into partial rows of buckets `width_ms` wide. Consecutive rows with the
/// same key and bucket become one row, so input sorted by the group columns gives one row per
/// key and bucket; any other order gives more partial rows, which merge to the same result.
/// Output rows keep the input's order, so sorted input gives sorted output.
pub(crate) fn aggregate(
    spec: &RollupSpec,
    width_ms: i64,
    input: &RecordBatch,
    from: Level,
) -> Result<RecordBatch> {
    let schema = spec.schema();
    let time = column(input, "time")?;
    let times = time.as_primitive::<TimestampMillisecondType>();
    let buckets: ArrayRef = Arc::new(
        PrimitiveArray::<TimestampMillisecondType>::from_iter_values(
            times
                .values()
                .iter()
                .map(|t| t.div_euclid(width_ms) * width_ms),
        )
        .with_timezone("UTC"),
    );
    let groups: Vec<ArrayRef> = spec
        .group_columns()
        .map(|c| {
            if c == "time" {
                Ok(buckets.clone())
            } else {
                column(input, c).cloned()
            }
        })
        .collect::<Result<_>>()?;
    let ranges = if input.num_rows() == 0 {
        Vec::new()
    } else {
        arrow::compute::partition(&groups)?.ranges()
    };
    let firsts = UInt32Array::from_iter_values(ranges.iter().map(|r| r.start as u32));
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(schema.fields().len());
    columns.push(take(&buckets, &firsts, None)?);
    for key in spec.sorted.iter().chain(spec.labels) {
        columns.push(take(column(input, key)?, &firsts, None)?);
    }
    columns.push(Arc::new(match from {
        Level::Raw => {
            UInt64Array::from_iter_values(ranges.iter().map(|r| (r.end - r.start) as u64))
        }
        Level::Partial => counts_of(column(input, "samples")?, &ranges)?,
    }));
    for s in &spec.summarised {
        let c = s.name;
        match (s.summary, from) {
            (Summary::Gauge, Level::Raw) => {
                let values = column(input, c)?;
                columns.push(Arc::new(count_valid(values.as_ref(), &ranges)));
                columns.push(fold(values, &ranges, Op::Sum)?);
                columns.push(fold(values, &ranges, Op::Min)?);
                columns.push(fold(values, &ranges, Op::Max)?);
            }
            (Summary::Gauge, Level::Partial) => {
                columns.push(Arc::new(counts_of(
                    column(input, &format!("{c}_count"))?,
                    &ranges,
                )?));
                columns.push(fold(column(input, &format!("{c}_sum"))?, &ranges, Op::Sum)?);
                columns.push(fold(column(input, &format!("{c}_min"))?, &ranges, Op::Min)?);
                columns.push(fold(column(input, &format!("{c}_max"))?, &ranges, Op::Max)?);
            }
            (Summary::Range, Level::Raw) => {
                let values = column(input, c)?;
                columns.push(fold(values, &ranges, Op::Min)?);
                columns.push(fold(values, &ranges, Op::Max)?);
            }
            (Summary::Range, Level::Partial) => {
                columns.push(fold(column(input, &format!("{c}_min"))?, &ranges, Op::Min)?);
                columns.push(fold(column(input, &format!("{c}_max"))?, &ranges, Op::Max)?);
            }
        }
    }
    Ok(RecordBatch::try_new(schema, columns)?)
}

/// Partial rows of `width_ms` buckets for raw rows in any order (the buffer, at query time).
pub(crate) fn of_rows(
    spec: &RollupSpec,
    width_ms: i64,
    batches: &[RecordBatch],
) -> Result<Option<RecordBatch>> {
    if batches.iter().all(|b| b.num_rows() == 0) {
        return Ok(None);
    }
    let all = concat_batches(&spec.raw, batches)?;
    let sorted = sort_by(&all, spec.sorted.iter().copied().chain(["time"]))?;
    aggregate(spec, width_ms, &sorted, Level::Raw).map(Some)
}

/// Merges partial rows into one per key and bucket (compaction of a rollup partition).
pub(crate) fn merge(
    spec: &RollupSpec,
    width_ms: i64,
    partial: &RecordBatch,
) -> Result<RecordBatch> {
    let sorted = sort_by(partial, spec.group_columns())?;
    aggregate(spec, width_ms, &sorted, Level::Partial)
}

fn sort_by<'a>(batch: &RecordBatch, columns: impl Iterator<Item = &'a str>) -> Result<RecordBatch> {
    let sort: Vec<SortColumn> = columns
        .map(|c| {
            Ok(SortColumn {
                values: column(batch, c)?.clone(),
                options: None,
            })
        })
        .collect::<Result<_>>()?;
    let order = lexsort_to_indices(&sort, None)?;
    Ok(take_record_batch(batch, &order)?)
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a ArrayRef> {
    batch.column_by_name(name).ok_or_else(|| Error::Corrupt {
        what: "rollup input",
        message: format!("no column {name}"),
    })
}

/// The number of non-null values in each range.
fn count_valid(values: &dyn Array, ranges: &[Range<usize>]) -> UInt64Array {
    match values.nulls() {
        None => UInt64Array::from_iter_values(ranges.iter().map(|r| r.len() as u64)),
        Some(nulls) => UInt64Array::from_iter_values(
            ranges
                .iter()
                .map(|r| r.clone().filter(|&i| nulls.is_valid(i)).count() as u64),
        ),
    }
}

/// Sums a non-null count column per range.
fn counts_of(counts: &ArrayRef, ranges: &[Range<usize>]) -> Result<UInt64Array> {
    let counts = counts
        .as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| Error::Corrupt {
            what: "rollup input",
            message: format!("a count column is {} instead of UInt64", counts.data_type()),
        })?;
    let summed = fold_typed(counts, ranges, |a, b| a.saturating_add(b));
    Ok(UInt64Array::from_iter_values(
        summed.iter().map(|v| v.unwrap_or(0)),
    ))
}

#[derive(Clone, Copy)]
enum Op {
    Sum,
    Min,
    Max,
}

/// Folds the non-null values of each range (NULL where a range has none), as Float64 for
/// float input and UInt64 (sums saturating at 2^64 - 1) for unsigned integer input.
fn fold(values: &ArrayRef, ranges: &[Range<usize>], op: Op) -> Result<ArrayRef> {
    Ok(match values.data_type() {
        DataType::Float64 => {
            let v = values.as_primitive::<Float64Type>();
            Arc::new(match op {
                Op::Sum => fold_typed(v, ranges, |a, b| a + b),
                Op::Min => fold_typed(v, ranges, f64::min),
                Op::Max => fold_typed(v, ranges, f64::max),
            })
        }
        DataType::UInt64 | DataType::UInt32 => {
            let cast = arrow::compute::cast(values, &DataType::UInt64)?;
            let v = cast.as_primitive::<UInt64Type>();
            Arc::new(match op {
                Op::Sum => fold_typed(v, ranges, u64::saturating_add),
                Op::Min => fold_typed(v, ranges, u64::min),
                Op::Max => fold_typed(v, ranges, u64::max),
            })
        }
        other => {
            return Err(Error::Corrupt {
                what: "rollup input",
                message: format!("cannot summarise a column of type {other}"),
            });
        }
    })
}

fn fold_typed<T: ArrowPrimitiveType>(
    values: &PrimitiveArray<T>,
    ranges: &[Range<usize>],
    f: impl Fn(T::Native, T::Native) -> T::Native,
) -> PrimitiveArray<T> {
    let raw = values.values();
    ranges
        .iter()
        .map(|r| {
            let mut acc: Option<T::Native> = None;
            for i in r.clone() {
                if values.is_valid(i) {
                    acc = Some(match acc {
                        Some(a) => f(a, raw[i]),
                        None => raw[i],
                    });
                }
            }
            acc
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another engine gets the very view perch registers, over whatever source it names.
    #[test]
    fn a_rollup_view_reads_the_partial_rows_it_is_given() {
        let sql = Table::GpuSamples1h
            .rollup_view_sql("read_parquet('x/*.parquet')")
            .expect("a rollup has a view");
        assert_eq!(sql, GPU.view_sql("read_parquet('x/*.parquet')"));
        assert!(sql.contains(" FROM read_parquet('x/*.parquet') GROUP BY time, node, gpu"));
        assert_eq!(
            Table::GpuSamples1h.rollup_view_sql("gpu_samples_1h_partial"),
            Some(GPU.view_sql(&Table::GpuSamples1h.stored_sql_name()))
        );
        assert!(Table::GpuSamples.rollup_view_sql("gpu_samples").is_none());
    }

    #[test]
    fn view_sql_names_every_view_column() {
        for spec in [&*GPU, &*HOST] {
            let sql = spec.view_sql("t");
            for c in spec
                .view_columns()
                .iter()
                .skip(1 + spec.sorted.len() + spec.labels.len())
            {
                assert!(sql.contains(&format!(" AS {c}")), "{c} missing from {sql}");
            }
            // Every partial column the view reads exists in the stored schema.
            let schema = spec.schema();
            for f in schema.fields() {
                assert!(sql.contains(f.name().as_str()), "{} unused", f.name());
            }
        }
    }
}
