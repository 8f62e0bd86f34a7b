//! Parquet files: encoding a table's rows as sorted files, one per partition (a day, or a
//! month for hourly rollups), with the rollup files a flush adds; decoding them back (adapted
//! to the current schema) for compaction. Encoding happens in memory, so the same bytes go to
//! a local directory or an object store (see [`crate::storage`]).

use crate::manifest::FileEntry;
use crate::rollup::{self, Level};
use crate::schema::{self, Partitioning, Table};
use crate::{Error, Result};
use arrow::array::{AsArray, RecordBatch, new_null_array};
use arrow::compute::{SortColumn, concat_batches, lexsort_to_indices, take_record_batch};
use arrow::datatypes::{SchemaRef, TimestampMillisecondType};
use bytes::Bytes;
use chrono::Datelike;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::metadata::SortingColumn;
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use std::collections::BTreeMap;

const DAY_MS: i64 = 86_400_000;

/// A file encoded and ready to store at `entry.path`.
pub(crate) struct NewFile {
    pub(crate) table: Table,
    pub(crate) entry: FileEntry,
    pub(crate) data: Bytes,
}

/// Decodes a stored file as record batches of `schema`: a column renamed since the file was
/// written is read under its old name ([`schema::RENAMED_COLUMNS`]), and columns the file
/// lacks (it was written before they existed) come back as nulls.
pub(crate) fn decode(data: Bytes, schema: &SchemaRef) -> Result<Vec<RecordBatch>> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(data)?.build()?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch?;
        let columns = schema
            .fields()
            .iter()
            .map(|f| {
                let old = schema::RENAMED_COLUMNS
                    .iter()
                    .find(|(now, _)| now == f.name())
                    .and_then(|(_, old)| batch.column_by_name(old));
                (f, batch.column_by_name(f.name()).or(old))
            })
            .map(|(f, column)| match column {
                Some(c) if c.data_type() == f.data_type() => Ok(c.clone()),
                Some(c) => arrow::compute::cast(c, f.data_type()),
                None => Ok(new_null_array(f.data_type(), batch.num_rows())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push(RecordBatch::try_new(schema.clone(), columns)?);
    }
    Ok(out)
}

pub(crate) fn day_string(day: i64) -> String {
    chrono::DateTime::from_timestamp(day * 86_400, 0)
        .map(|d| d.format("%Y-%m-%d").to_string())
        .unwrap_or_else(|| format!("day{day}"))
}

/// The partition a row at `time_ms` belongs to, as a number that sorts like time.
fn partition_of(partitioning: Partitioning, time_ms: i64) -> i64 {
    match partitioning {
        Partitioning::Day => time_ms.div_euclid(DAY_MS),
        Partitioning::Month => chrono::DateTime::from_timestamp_millis(time_ms)
            .map_or(time_ms.div_euclid(DAY_MS * 31), |d| {
                i64::from(d.year()) * 12 + i64::from(d.month0())
            }),
    }
}

/// The folder name of a partition (`date=2027-01-15`, `month=2027-01`).
fn partition_dir(partitioning: Partitioning, key: i64) -> String {
    match partitioning {
        Partitioning::Day => format!("date={}", day_string(key)),
        Partitioning::Month => format!(
            "month={:04}-{:02}",
            key.div_euclid(12),
            key.rem_euclid(12) + 1
        ),
    }
}

/// The rows of `table` split by partition, each sorted by the table's sort key.
pub(crate) fn sorted_partitions(
    table: Table,
    batches: &[RecordBatch],
) -> Result<Vec<(i64, RecordBatch)>> {
    let schema = table.schema();
    let all = concat_batches(&schema, batches)?;
    let times = all.column(0).as_primitive::<TimestampMillisecondType>();
    let partitioning = table.partitioning();
    let mut by_partition: BTreeMap<i64, Vec<u32>> = BTreeMap::new();
    for (i, t) in times.values().iter().enumerate() {
        by_partition
            .entry(partition_of(partitioning, *t))
            .or_default()
            .push(i as u32);
    }
    let key_idx: Vec<usize> = table
        .sort_key()
        .iter()
        .map(|name| schema.index_of(name))
        .collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(by_partition.len());
    for (key, rows) in by_partition {
        let part = if rows.len() == all.num_rows() {
            all.clone()
        } else {
            take_record_batch(&all, &arrow::array::UInt32Array::from(rows))?
        };
        let sort: Vec<SortColumn> = key_idx
            .iter()
            .map(|&i| SortColumn {
                values: part.column(i).clone(),
                options: None,
            })
            .collect();
        let order = lexsort_to_indices(&sort, None)?;
        out.push((key, take_record_batch(&part, &order)?));
    }
    Ok(out)
}

/// Encodes one sorted partition of `table` as a zstd Parquet file whose metadata declares the
/// sort order; `next_id` names it.
fn encode(table: Table, key: i64, part: &RecordBatch, next_id: &mut u64) -> Result<NewFile> {
    let schema = table.schema();
    let sorting = table
        .sort_key()
        .iter()
        .map(|name| {
            Ok(SortingColumn {
                column_idx: schema.index_of(name)? as i32,
                descending: false,
                nulls_first: false,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .set_sorting_columns(Some(sorting))
        // Within a series `time` grows by about the sampling interval: delta encoding stores
        // it in a few bits per row where a dictionary overflows and falls back to 8 bytes
        // (gpu_samples: 124 MiB -> 88 MiB a week), and decodes faster.
        .set_column_dictionary_enabled(ColumnPath::from("time"), false)
        .set_column_encoding(ColumnPath::from("time"), Encoding::DELTA_BINARY_PACKED)
        .build();
    let times = part.column(0).as_primitive::<TimestampMillisecondType>();
    let (min, max) = times
        .values()
        .iter()
        .fold((i64::MAX, i64::MIN), |(lo, hi), &t| (lo.min(t), hi.max(t)));
    let path = format!(
        "tables/{}/{}/{:010}.parquet",
        table.name(),
        partition_dir(table.partitioning(), key),
        *next_id
    );
    *next_id += 1;
    let mut writer = ArrowWriter::try_new(Vec::new(), schema, Some(props))?;
    writer.write(part)?;
    let data = Bytes::from(writer.into_inner()?);
    Ok(NewFile {
        table,
        entry: FileEntry {
            path,
            rows: part.num_rows() as u64,
            bytes: data.len() as u64,
            min_time_ms: min,
            max_time_ms: max,
        },
        data,
    })
}

/// Encodes `batches` of `table` as one sorted file per partition.
pub(crate) fn encode_table(
    table: Table,
    batches: &[RecordBatch],
    next_id: &mut u64,
) -> Result<Vec<NewFile>> {
    sorted_partitions(table, batches)?
        .into_iter()
        .map(|(key, part)| encode(table, key, &part, next_id))
        .collect()
}

/// What a flush writes for `batches` of `table`: the table's files and, for a table with
/// rollups, the partial rollup rows of exactly these rows. The 1-minute rows come from each
/// sorted partition in one pass; the 1-hour rows from the 1-minute rows.
pub(crate) fn flush_files(
    table: Table,
    batches: &[RecordBatch],
    next_id: &mut u64,
) -> Result<Vec<NewFile>> {
    let mut out = Vec::new();
    let mut rollup_rows: Vec<Vec<RecordBatch>> = vec![Vec::new(); table.rollups().len()];
    for (key, part) in sorted_partitions(table, batches)? {
        out.push(encode(table, key, &part, next_id)?);
        let mut finer: Option<RecordBatch> = None;
        for (i, rollup) in table.rollups().iter().enumerate() {
            let Some((spec, width)) = rollup.rollup() else {
                continue;
            };
            let rows = match &finer {
                None => rollup::aggregate(spec, width, &part, Level::Raw)?,
                Some(f) => rollup::aggregate(spec, width, f, Level::Partial)?,
            };
            rollup_rows[i].push(rows.clone());
            finer = Some(rows);
        }
    }
    for (rollup, rows) in table.rollups().iter().zip(rollup_rows) {
        if rows.iter().any(|r| r.num_rows() > 0) {
            out.extend(encode_table(*rollup, &rows, next_id)?);
        }
    }
    Ok(out)
}

/// Rows of the files being compacted, merged into what replaces them: the same rows for a raw
/// table; one partial row per key and bucket for a rollup.
pub(crate) fn compact_rows(table: Table, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
    match table.rollup() {
        None => Ok(batches),
        Some((spec, width)) => {
            let all = concat_batches(&table.schema(), &batches)?;
            Ok(vec![rollup::merge(spec, width, &all)?])
        }
    }
}

/// How many samples rows stand for: themselves for a raw table, their `samples` for a rollup.
/// Compaction checks it is unchanged.
pub(crate) fn samples_in(table: Table, batches: &[RecordBatch]) -> Result<u64> {
    if table.rollup().is_none() {
        return Ok(batches.iter().map(|b| b.num_rows() as u64).sum());
    }
    let mut total = 0u64;
    for b in batches {
        let samples = b
            .column_by_name("samples")
            .and_then(|c| c.as_primitive_opt::<arrow::datatypes::UInt64Type>())
            .ok_or_else(|| Error::Corrupt {
                what: "rollup file",
                message: format!("{} has no UInt64 samples column", table.name()),
            })?;
        total += samples.values().iter().sum::<u64>();
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_named_by_utc_day_or_month() {
        let t = 1_800_000_000_000; // 2027-01-15T08:00:00Z
        let day = partition_of(Partitioning::Day, t);
        assert_eq!(partition_dir(Partitioning::Day, day), "date=2027-01-15");
        let month = partition_of(Partitioning::Month, t);
        assert_eq!(partition_dir(Partitioning::Month, month), "month=2027-01");
        let before = partition_of(Partitioning::Month, -1);
        assert_eq!(partition_dir(Partitioning::Month, before), "month=1969-12");
        assert!(partition_of(Partitioning::Month, t + 31 * DAY_MS) > month);
    }
}
