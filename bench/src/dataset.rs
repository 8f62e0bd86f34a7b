//! The dataset `perch bench query` runs on, generated once and cached in a directory.
//!
//! GPU samples go through the store exactly as an agent's batches do (`Store::ingest`: JSON
//! in the write-ahead log, the Arrow buffer, flushes at the store's `flush_max_rows`), then a
//! compaction merges each day's flushes, as the server's maintenance does over a day; so the
//! Parquet files both engines read are the sorted, day-partitioned, zstd files perch writes.
//! The jobs and their GPU allocations are two small Parquet files beside the store, written
//! with arrow-rs, that DuckDB reads and perch serves as live tables (the way the server serves
//! its job database).
//!
//! Layout of `<dir>/<name>/` (`name` spells out the spec, so several sizes can coexist):
//! `store/` (a perch data directory), `jobs.parquet`, `job_allocations.parquet`, and
//! `spec.json`, written last: a directory without it is an interrupted run and is rebuilt.

use super::workload::{GPU_MODEL, Job, Shape, Workload};
use anyhow::{Context, Result};
use arrow::array::{
    ArrayRef, BooleanArray, Float64Array, RecordBatch, StringArray, TimestampMillisecondArray,
    UInt32Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use bytes::Bytes;
use perch_model::{Batch, NodeId};
use perch_query::{Store, StoreConfig, Table};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Start of every dataset's window: 2025-06-02T00:00:00Z, a Monday, so the window is whole
/// UTC days (whole day partitions) and the answers do not depend on when it was generated.
pub(super) const EPOCH_MS: i64 = 1_748_822_400_000;

/// What to generate; two runs with the same spec produce the same data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Spec {
    pub(super) nodes: u32,
    pub(super) gpus_per_node: u32,
    pub(super) days: u32,
    pub(super) interval_secs: u32,
    pub(super) seed: u64,
}

impl Spec {
    /// The cache directory's name; `v2` since `time` is delta-encoded in the files, `v3` since
    /// the jobs' `user` column is `user_name`, so a dataset cached by an older perch is
    /// generated again rather than measured as it was.
    fn name(&self) -> String {
        format!(
            "dataset-{}x{}-{}d-{}s-seed{}-v3",
            self.nodes, self.gpus_per_node, self.days, self.interval_secs, self.seed
        )
    }

    fn shape(&self) -> Shape {
        Shape {
            nodes: self.nodes,
            gpus_per_node: self.gpus_per_node,
            window_ms: i64::from(self.days) * 86_400_000,
            interval_ms: i64::from(self.interval_secs) * 1000,
            seed: self.seed,
        }
    }

    fn check(&self) -> Result<()> {
        anyhow::ensure!(
            self.nodes >= 1 && self.gpus_per_node >= 1 && self.days >= 1,
            "--nodes, --gpus and --days must each be at least 1"
        );
        anyhow::ensure!(
            (1..=3600).contains(&self.interval_secs),
            "--interval-secs must be between 1 and 3600"
        );
        anyhow::ensure!(
            u64::from(self.gpus_per_node) * u64::from(3600 / self.interval_secs) <= 100_000,
            "an hour of one node's samples must fit in one batch (100,000 samples); use fewer GPUs per node or a longer interval"
        );
        Ok(())
    }
}

/// A generated dataset, ready to query.
#[derive(Debug)]
pub(super) struct Dataset {
    pub(super) dir: PathBuf,
    pub(super) spec: Spec,
    pub(super) jobs: RecordBatch,
    pub(super) allocations: RecordBatch,
    /// How the dataset came to be, for the report: generated now (with how long it took) or
    /// found in the cache.
    pub(super) origin: String,
}

impl Dataset {
    pub(super) fn store_dir(&self) -> PathBuf {
        self.dir.join("store")
    }

    /// The glob DuckDB reads a stored table from: every Parquet file of the table.
    pub(super) fn table_glob(&self, table: Table) -> PathBuf {
        self.store_dir()
            .join("tables")
            .join(table.name())
            .join("**")
            .join("*.parquet")
    }

    pub(super) fn jobs_path(&self) -> PathBuf {
        self.dir.join("jobs.parquet")
    }

    pub(super) fn allocations_path(&self) -> PathBuf {
        self.dir.join("job_allocations.parquet")
    }

    /// A store configuration for this dataset: nothing expires (the window is in the past)
    /// and each day's flushes are merged by one compaction.
    pub(super) fn store_config(&self) -> StoreConfig {
        store_config(&self.store_dir())
    }
}

fn store_config(dir: &Path) -> StoreConfig {
    let mut config = StoreConfig::new(dir);
    config.retention = BTreeMap::new();
    config.compact_min_files = 2;
    config
}

/// The dataset for `spec` under `root`, generated first unless a complete one is there.
pub(super) async fn open_or_generate(root: &Path, spec: Spec) -> Result<Dataset> {
    spec.check()?;
    let dir = root.join(spec.name());
    let spec_path = dir.join("spec.json");
    if spec_path.exists() {
        let text = fs::read_to_string(&spec_path)
            .with_context(|| format!("reading {}", spec_path.display()))?;
        let found: Spec = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a dataset spec; delete {} to regenerate it",
                spec_path.display(),
                dir.display()
            )
        })?;
        anyhow::ensure!(
            found == spec,
            "{} holds a different dataset ({found:?}); delete it to regenerate",
            dir.display()
        );
        return Ok(Dataset {
            jobs: read_parquet(&dir.join("jobs.parquet"))?,
            allocations: read_parquet(&dir.join("job_allocations.parquet"))?,
            dir,
            spec,
            origin: "reused from the cache".into(),
        });
    }
    if dir.exists() {
        eprintln!(
            "{} is incomplete (an interrupted run); rebuilding it",
            dir.display()
        );
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let started = Instant::now();
    let workload = Arc::new(Workload::generate(spec.shape()));
    let (jobs, allocations) = job_tables(&workload)?;
    write_parquet(&dir.join("jobs.parquet"), &jobs)?;
    write_parquet(&dir.join("job_allocations.parquet"), &allocations)?;
    let report = fill_store(&dir.join("store"), workload.clone()).await?;
    let spec_json = serde_json::to_string_pretty(&spec)?;
    fs::write(&spec_path, spec_json).with_context(|| format!("writing {}", spec_path.display()))?;
    Ok(Dataset {
        dir,
        spec,
        jobs,
        allocations,
        origin: format!(
            "generated in {:.0} s: {}, {} jobs",
            started.elapsed().as_secs_f64(),
            report,
            workload.jobs.len()
        ),
    })
}

/// Ingests every GPU sample of the workload through the store, an hour of one node per batch,
/// all nodes concurrently (so the write-ahead log group-commits them as it would for a fleet),
/// flushing whenever `flush_max_rows` are buffered; then merges each day's files.
async fn fill_store(dir: &Path, workload: Arc<Workload>) -> Result<String> {
    let config = store_config(dir);
    let flush_rows = config.flush_max_rows;
    let store = Store::open(config)?;
    let shape = workload.shape;
    let per_batch = 3_600_000 / shape.interval_ms;
    let total = workload.samples_per_gpu();
    let now_ms = EPOCH_MS + shape.window_ms;
    let started = Instant::now();
    let mut rows = 0u64;
    let mut flushed_files = 0u64;
    let mut seq = 0u64;
    let mut k0 = 0;
    while k0 < total {
        let k1 = (k0 + per_batch).min(total);
        seq += 1;
        let mut tasks = tokio::task::JoinSet::new();
        for node in 0..shape.nodes {
            let (store, workload) = (store.clone(), workload.clone());
            tasks.spawn(async move {
                let name = NodeId::new(node_name(node)).map_err(anyhow::Error::msg)?;
                // Built from JSON so that fields added to `Batch` later default to empty here.
                let mut batch: Batch =
                    serde_json::from_value(serde_json::json!({"node": name, "seq": seq}))?;
                batch.gpus = workload.node_samples(node, k0, k1, EPOCH_MS);
                batch.validate(now_ms)?;
                let raw = Bytes::from(serde_json::to_vec(&batch)?);
                store.ingest(raw, &batch).await?;
                Ok::<_, anyhow::Error>(batch.gpus.len() as u64)
            });
        }
        while let Some(done) = tasks.join_next().await {
            rows += done??;
        }
        if store.buffered_rows() >= flush_rows {
            flushed_files += store.flush().await?.files;
        }
        k0 = k1;
        let day = 86_400_000 / shape.interval_ms;
        if k0 % day == 0 || k0 == total {
            eprintln!(
                "  generated {} of {} days ({rows} GPU rows, {:.0} s)",
                k0 / day,
                shape.window_ms / 86_400_000,
                started.elapsed().as_secs_f64()
            );
        }
    }
    flushed_files += store.flush().await?.files;
    let ingest_s = started.elapsed().as_secs_f64();
    let merged = store.maintain(now_ms).await?;
    let (files, bytes) = store
        .file_counts()
        .into_iter()
        .find(|(t, _, _)| t.name() == "gpu_samples")
        .map_or((0, 0), |(_, f, b)| (f, b));
    Ok(format!(
        "{rows} GPU rows ingested in {ingest_s:.0} s ({:.0} rows/s, {flushed_files} files flushed), \
         compaction merged {} files into {}, gpu_samples now {files} files, {} MiB",
        rows as f64 / ingest_s,
        merged.files_compacted,
        merged.files_written,
        bytes >> 20
    ))
}

fn ts(values: Vec<Option<i64>>) -> ArrayRef {
    Arc::new(TimestampMillisecondArray::from(values).with_timezone("UTC"))
}

fn ts_field(name: &str, nullable: bool) -> Field {
    Field::new(
        name,
        DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
        nullable,
    )
}

pub(super) fn jobs_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("job", DataType::UInt64, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("user_name", DataType::Utf8, false),
        Field::new("account", DataType::Utf8, false),
        Field::new("state", DataType::Utf8, false),
        ts_field("submit_time", false),
        ts_field("start_time", true),
        ts_field("end_time", true),
        Field::new("node_count", DataType::UInt32, false),
        Field::new("gpus", DataType::UInt32, false),
        Field::new("gpu_seconds_allocated", DataType::Float64, false),
        Field::new("simulated", DataType::Boolean, false),
    ]))
}

pub(super) fn allocations_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("job", DataType::UInt64, false),
        Field::new("attempt", DataType::UInt32, false),
        Field::new("user_name", DataType::Utf8, false),
        Field::new("account", DataType::Utf8, false),
        Field::new("node", DataType::Utf8, false),
        Field::new("gpu", DataType::UInt32, false),
        Field::new("gpu_model", DataType::Utf8, false),
        ts_field("start_time", false),
        ts_field("end_time", true),
        Field::new("gpu_seconds_allocated", DataType::Float64, false),
        Field::new("simulated", DataType::Boolean, false),
    ]))
}

/// The `jobs` and `job_allocations` rows, with the server's column names and types (a subset
/// of its columns). A job still running when the window closes is `running` with no
/// `end_time`, in both tables, as the server reports it; GPU-seconds run to the window's end.
/// A job's name is its generated profile (`idle`, `stalled`, ...), so results show why a job
/// wasted its GPUs.
fn job_tables(w: &Workload) -> Result<(RecordBatch, RecordBatch)> {
    let window_end = w.shape.window_ms;
    let jobs = &w.jobs;
    let state = |j: &Job| match (j.end_ms > window_end, j.profile.name()) {
        (true, _) => "running",
        (false, "stalled") => "timeout",
        (false, "idle") => "cancelled",
        (false, _) => "completed",
    };
    let end = |j: &Job| (j.end_ms <= window_end).then_some(EPOCH_MS + j.end_ms);
    let held_s = |j: &Job| (j.end_ms.min(window_end) - j.start_ms) as f64 / 1000.0;
    let bools = |n: usize| Arc::new(BooleanArray::from(vec![true; n])) as ArrayRef;
    let job_columns: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from_iter_values(jobs.iter().map(|j| j.id))),
        Arc::new(StringArray::from_iter_values(
            jobs.iter().map(|j| j.profile.name()),
        )),
        Arc::new(StringArray::from_iter_values(
            jobs.iter().map(|j| j.user.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            jobs.iter().map(|j| j.account),
        )),
        Arc::new(StringArray::from_iter_values(jobs.iter().map(state))),
        ts(jobs.iter().map(|j| Some(EPOCH_MS + j.submit_ms)).collect()),
        ts(jobs.iter().map(|j| Some(EPOCH_MS + j.start_ms)).collect()),
        ts(jobs.iter().map(end).collect()),
        Arc::new(UInt32Array::from_iter_values(jobs.iter().map(|j| {
            let mut nodes: Vec<u32> = j.gpus.iter().map(|g| g.0).collect();
            nodes.dedup();
            nodes.len() as u32
        }))),
        Arc::new(UInt32Array::from_iter_values(
            jobs.iter().map(|j| j.gpus.len() as u32),
        )),
        Arc::new(Float64Array::from_iter_values(
            jobs.iter().map(|j| j.gpus.len() as f64 * held_s(j)),
        )),
        bools(jobs.len()),
    ];
    let jobs_batch = RecordBatch::try_new(jobs_schema(), job_columns)?;

    let rows: Vec<(&Job, u32, u32)> = jobs
        .iter()
        .flat_map(|j| j.gpus.iter().map(move |&(n, g)| (j, n, g)))
        .collect();
    let alloc_columns: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.0.id))),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|_| 1))),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.0.user.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.0.account),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| node_name(r.1)),
        )),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.2))),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|_| GPU_MODEL),
        )),
        ts(rows.iter().map(|r| Some(EPOCH_MS + r.0.start_ms)).collect()),
        ts(rows.iter().map(|r| end(r.0)).collect()),
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|r| held_s(r.0)),
        )),
        bools(rows.len()),
    ];
    let allocations = RecordBatch::try_new(allocations_schema(), alloc_columns)?;
    Ok((jobs_batch, allocations))
}

/// The name of node `n`, as its agent would send it.
pub(super) fn node_name(n: u32) -> String {
    format!("node-{n:03}")
}

fn write_parquet(path: &Path, batch: &RecordBatch) -> Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::ZSTD(
            parquet::basic::ZstdLevel::try_new(3)?,
        ))
        .build();
    let mut writer = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props))?;
    writer.write(batch)?;
    writer.close()?;
    Ok(())
}

fn read_parquet(path: &Path) -> Result<RecordBatch> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .with_context(|| format!("reading {}", path.display()))?;
    let schema = reader.schema().clone();
    let batches = reader
        .build()?
        .collect::<std::result::Result<Vec<_>, _>>()
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(arrow::compute::concat_batches(&schema, &batches)?)
}
