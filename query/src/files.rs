//! Parquet files on disk: writing a table's rows as sorted files, one per day partition;
//! reading them back (adapted to the current schema) for compaction; and removing files no
//! manifest lists.

use crate::manifest::{FileEntry, Manifest};
use crate::schema::Table;
use crate::{Error, Result};
use arrow::array::{AsArray, RecordBatch, new_null_array};
use arrow::compute::{SortColumn, concat_batches, lexsort_to_indices, take_record_batch};
use arrow::datatypes::{SchemaRef, TimestampMillisecondType};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::SortingColumn;
use parquet::file::properties::WriterProperties;
use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::path::Path;

/// Reads a stored file back as record batches of `schema`: columns the file lacks (it was
/// written before they existed) come back as nulls.
pub(crate) fn read_file(
    dir: &Path,
    entry: &FileEntry,
    schema: &SchemaRef,
) -> Result<Vec<RecordBatch>> {
    let path = dir.join(&entry.path);
    let file = File::open(&path).map_err(Error::io("opening", &path))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)?.build()?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch?;
        let columns = schema
            .fields()
            .iter()
            .map(|f| match batch.column_by_name(f.name()) {
                Some(c) if c.data_type() == f.data_type() => Ok(c.clone()),
                Some(c) => arrow::compute::cast(c, f.data_type()),
                None => Ok(new_null_array(f.data_type(), batch.num_rows())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push(RecordBatch::try_new(schema.clone(), columns)?);
    }
    Ok(out)
}

pub(crate) fn remove_orphans(dir: &Path, manifest: &Manifest) -> Result<()> {
    let known: HashSet<&str> = manifest
        .files
        .values()
        .flatten()
        .map(|f| f.path.as_str())
        .collect();
    let root = dir.join("tables");
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(rel) = path.strip_prefix(dir) {
                let rel = rel.to_string_lossy();
                if !known.contains(rel.as_ref()) {
                    tracing::warn!(file = %rel, "removing a parquet file no manifest lists (left by an interrupted flush; its rows are in the write-ahead log)");
                    fs::remove_file(&path).map_err(Error::io("removing", &path))?;
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn day_string(day: i64) -> String {
    chrono::DateTime::from_timestamp(day * 86_400, 0)
        .map(|d| d.format("%Y-%m-%d").to_string())
        .unwrap_or_else(|| format!("day{day}"))
}

/// Writes `batches` of `table` as one sorted Parquet file per day.
pub(crate) fn write_table(
    dir: &Path,
    table: Table,
    batches: &[RecordBatch],
    next_id: &mut u64,
) -> Result<Vec<FileEntry>> {
    let schema = table.schema();
    let all = concat_batches(&schema, batches)?;
    let times = all.column(0).as_primitive::<TimestampMillisecondType>();
    let mut by_day: BTreeMap<i64, Vec<u32>> = BTreeMap::new();
    for (i, t) in times.values().iter().enumerate() {
        by_day
            .entry(t.div_euclid(86_400_000))
            .or_default()
            .push(i as u32);
    }
    let key_idx: Vec<usize> = table
        .sort_key()
        .iter()
        .map(|name| schema.index_of(name))
        .collect::<Result<_, _>>()?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .set_sorting_columns(Some(
            key_idx
                .iter()
                .map(|&i| SortingColumn {
                    column_idx: i as i32,
                    descending: false,
                    nulls_first: false,
                })
                .collect(),
        ))
        .build();
    let mut entries = Vec::new();
    for (day, rows) in by_day {
        let part = take_record_batch(&all, &arrow::array::UInt32Array::from(rows))?;
        let sort: Vec<SortColumn> = key_idx
            .iter()
            .map(|&i| SortColumn {
                values: part.column(i).clone(),
                options: None,
            })
            .collect();
        let order = lexsort_to_indices(&sort, None)?;
        let part = take_record_batch(&part, &order)?;
        let part_times = part.column(0).as_primitive::<TimestampMillisecondType>();
        let (min, max) = part_times
            .values()
            .iter()
            .fold((i64::MAX, i64::MIN), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        let rel_dir = format!("tables/{}/date={}", table.name(), day_string(day));
        let abs_dir = dir.join(&rel_dir);
        fs::create_dir_all(&abs_dir).map_err(Error::io("creating directory", &abs_dir))?;
        let rel = format!("{rel_dir}/{:010}.parquet", *next_id);
        *next_id += 1;
        let path = dir.join(&rel);
        let file = File::create(&path).map_err(Error::io("creating", &path))?;
        let mut writer = ArrowWriter::try_new(file, schema.clone(), Some(props.clone()))?;
        writer.write(&part)?;
        let file = writer.into_inner()?;
        file.sync_all().map_err(Error::io("syncing", &path))?;
        File::open(&abs_dir)
            .and_then(|d| d.sync_all())
            .map_err(Error::io("syncing directory", &abs_dir))?;
        let bytes = fs::metadata(&path)
            .map_err(Error::io("reading metadata of", &path))?
            .len();
        entries.push(FileEntry {
            path: rel,
            rows: part.num_rows() as u64,
            bytes,
            min_time_ms: min,
            max_time_ms: max,
        });
    }
    Ok(entries)
}
