//! Settled jobs' rows of the `jobs` and `job_allocations` tables, in Parquet files under
//! `<data_dir>/control/settled/`: written once when a job has settled and left memory, so SQL
//! over a long history reads columns, not every record back from the job database (1.7 s for
//! `SELECT count(*) FROM jobs` at 100,000 settled jobs read from it).
//!
//! The job database stays the truth; these files are a copy of what it holds that can always
//! be made again. A settled job is *recorded* once its rows are here
//! ([`perch_control::JobService::record_settled`]); until then SQL reads its record from the job
//! database as before. The rows are stored unpriced: cost columns are worked out when read,
//! at the prices of the moment ([`super::Prices::gpu_costs`]), as for jobs held in memory.
//!
//! Files come in pairs, `<lo>-<hi>.jobs.parquet` and `<lo>-<hi>.allocations.parquet`, over
//! the chunks numbered `lo` to `hi`. A chunk is written allocations first; its jobs file,
//! renamed into place, commits it. Chunks are merged two at a time, the newest with the one
//! before while it is at least half that one's size ([`MAX_CHUNK_JOBS`] at most), so a history
//! of `n` jobs is a handful of files whatever the pace it settled at; a merged pair replaces
//! the two it covers, which are deleted. At start ([`SettledRows::open`]) whatever an
//! interrupted write or merge left is put right: a pair covered by a larger one, half a pair,
//! or a file that cannot be read or is not of today's format (written by another version), is
//! deleted, and the jobs it held are recorded again from the job database; so are they all if
//! two files hold the same job.
//!
//! Each file records its format version ([`FORMAT_VERSION`]) in the Parquet key-value metadata
//! under [`VERSION_KEY`] (specified in `docs/format/settled-rows.md`). A file is read only if
//! it is of this version (one with no version was written before versions were recorded, and
//! is version 1) and holds exactly today's columns; any other is put right as above, from the
//! job database, whichever perch wrote it.
//!
//! A file removed or damaged under the running server is noticed by the query that fails to
//! read it ([`SettledRows::lose`]): from then on queries read every settled job from the job
//! database (slower, but whole), the query itself included, until the recording task has
//! deleted the files and started writing them again ([`SettledRows::reset`]). Each reset
//! starts a new *epoch*; a query whose walk of the job database began in an earlier one
//! walks again, so no job is missed or read twice across a reset.

use super::Prices;
use super::tables;
use arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, RecordBatch, RecordBatchOptions, StringArray,
};
use arrow::array::{UInt64Array, downcast_array};
use arrow::datatypes::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::{KeyValue, ParquetMetaData};
use parquet::file::properties::WriterProperties;
use perch_control::record::JobRecord;
use perch_query::{Pruning, Room};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The format version of the files this binary writes, and the only one it reads: bump it
/// with any change to the files' columns or to what a column means.
pub(crate) const FORMAT_VERSION: u32 = 3;

/// The Parquet key-value metadata key holding a file's format version (decimal). A file
/// without it was written before versions were recorded, and is version 1.
pub(crate) const VERSION_KEY: &str = "perch.settled_rows.format_version";

/// Jobs in one pair of files, at most: a merge reads and writes two pairs a batch at a time,
/// so this bounds the time one takes, not its memory.
const MAX_CHUNK_JOBS: u64 = 1_000_000;

/// Rows per batch read.
const BATCH_ROWS: usize = 8_192;

/// Rows per row group written: each row group's statistics (its least and greatest job id,
/// submit, start and end times, ...) let a query that filters on them skip it
/// ([`perch_query::Pruning`]); files are written in the order jobs settled (as they ended),
/// so a query for a recent week reads a few row groups of a long history.
const ROW_GROUP_ROWS: usize = 4 * BATCH_ROWS;

/// A chunk's two files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Jobs,
    Allocations,
}

impl Kind {
    fn suffix(self) -> &'static str {
        match self {
            Kind::Jobs => ".jobs.parquet",
            Kind::Allocations => ".allocations.parquet",
        }
    }

    fn schema(self) -> SchemaRef {
        match self {
            Kind::Jobs => tables::stored_jobs_schema(),
            Kind::Allocations => tables::stored_allocations_schema(),
        }
    }
}

/// A pair of files: chunks `lo` to `hi`, holding `jobs` jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    lo: u64,
    hi: u64,
    jobs: u64,
}

impl Chunk {
    fn path(&self, dir: &Path, kind: Kind) -> PathBuf {
        dir.join(format!("{:010}-{:010}{}", self.lo, self.hi, kind.suffix()))
    }
}

struct State {
    /// In the order they were written (merges keep it).
    chunks: Vec<Chunk>,
    next: u64,
    /// Bumped by each [`SettledRows::reset`].
    epoch: u64,
    /// Why the files cannot be trusted, once a read of them failed, until the next reset.
    lost: Option<String>,
}

/// Which files SQL reads settled jobs' rows from now ([`SettledRows::epoch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Epoch {
    pub(crate) number: u64,
    /// The files failed a read and are to be written again: read every settled job from
    /// the job database meanwhile.
    pub(crate) lost: bool,
}

/// The settled rows' files ([`self`]).
pub(crate) struct SettledRows {
    dir: PathBuf,
    state: parking_lot::Mutex<State>,
}

impl std::fmt::Debug for SettledRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettledRows")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// `lo-hi` and the kind of a file's name.
fn parse(name: &str) -> Option<(u64, u64, Kind)> {
    let (stem, kind) = [Kind::Jobs, Kind::Allocations]
        .into_iter()
        .find_map(|k| name.strip_suffix(k.suffix()).map(|s| (s, k)))?;
    let (lo, hi) = stem.split_once('-')?;
    Some((lo.parse().ok()?, hi.parse().ok()?, kind))
}

fn remove(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot delete a settled rows file")
        }
    }
}

impl SettledRows {
    /// Opens (or makes) the files under `dir`, putting right what an interrupted write or
    /// merge left, and returns the ids of the jobs they hold.
    pub(crate) fn open(dir: &Path) -> Result<(SettledRows, Vec<u64>), String> {
        let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", dir.display());
        std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
        let mut jobs_files = Vec::new();
        let mut allocation_files = HashSet::new();
        let mut next = 0;
        for entry in std::fs::read_dir(dir).map_err(|e| fail(&e))? {
            let entry = entry.map_err(|e| fail(&e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with(".tmp-") {
                remove(&entry.path());
                continue;
            }
            let Some((lo, hi, kind)) = parse(name) else {
                continue;
            };
            next = next.max(hi + 1);
            match kind {
                Kind::Jobs => jobs_files.push((lo, hi)),
                Kind::Allocations => {
                    allocation_files.insert((lo, hi));
                }
            }
        }
        // The widest first: a pair within another's range was merged into it.
        jobs_files.sort_by_key(|&(lo, hi)| (lo, std::cmp::Reverse(hi)));
        let mut chunks = Vec::new();
        let mut covered_to: Option<u64> = None;
        for (lo, hi) in jobs_files {
            let chunk = Chunk { lo, hi, jobs: 0 };
            let whole = allocation_files.remove(&(lo, hi));
            if !whole || covered_to.is_some_and(|to| lo <= to) {
                remove(&chunk.path(dir, Kind::Jobs));
                remove(&chunk.path(dir, Kind::Allocations));
                continue;
            }
            covered_to = Some(hi);
            chunks.push(chunk);
        }
        // Allocations whose jobs file was never written, or that a merge covered.
        for (lo, hi) in allocation_files {
            remove(&Chunk { lo, hi, jobs: 0 }.path(dir, Kind::Allocations));
        }
        let mut ids = Vec::new();
        let mut readable = Vec::new();
        for mut chunk in chunks {
            let path = chunk.path(dir, Kind::Jobs);
            let read = File::open(&path)
                .map_err(|e| e.to_string())
                .and_then(|file| read(file, Kind::Jobs, Some(&["job"])))
                .and_then(|batches| {
                    // The allocations file must open as Parquet too.
                    File::open(chunk.path(dir, Kind::Allocations))
                        .map_err(|e| e.to_string())
                        .and_then(|f| reader(f, Kind::Allocations, Some(&["job"])))?;
                    Ok(batches)
                });
            match read {
                Ok(batches) => {
                    let before = ids.len();
                    for batch in batches {
                        let column: UInt64Array = downcast_array(batch.column(0).as_ref());
                        ids.extend(column.values().iter().copied());
                    }
                    chunk.jobs = (ids.len() - before) as u64;
                    readable.push(chunk);
                }
                Err(e) => {
                    // A copy: its jobs are written again from the job database.
                    tracing::warn!(path = %path.display(), error = %e, "a settled rows file cannot be read; deleting it, its jobs' rows are written again from the job database");
                    remove(&path);
                    remove(&chunk.path(dir, Kind::Allocations));
                }
            }
        }
        let mut chunks = readable;
        // Two files holding the same job (left by something other than this server: a
        // copy put back, a backup restored over newer files) would make SQL count it twice.
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        if let Some(twice) = sorted.windows(2).find(|w| w[0] == w[1]) {
            tracing::warn!(dir = %dir.display(), job = twice[0], "two settled rows files hold the same job; deleting them all, the rows are written again from the job database");
            for chunk in chunks.drain(..) {
                remove(&chunk.path(dir, Kind::Jobs));
                remove(&chunk.path(dir, Kind::Allocations));
            }
            ids.clear();
        }
        let rows = SettledRows {
            dir: dir.to_owned(),
            state: parking_lot::Mutex::new(State {
                chunks,
                next,
                epoch: 0,
                lost: None,
            }),
        };
        Ok((rows, ids))
    }

    /// Writes the rows of settled jobs `records` (durable in the job database) as a chunk of
    /// their own, then merges chunks as [`self`] says. Once it returns `Ok`, [`SettledRows::view`]
    /// shows them; an error means they were not written.
    pub(crate) fn append(&self, records: &[JobRecord]) -> Result<(), String> {
        if records.is_empty() {
            return Ok(());
        }
        let (jobs, allocations) = tables::stored_batches(records)?;
        let seq = {
            let mut state = self.state.lock();
            state.next += 1;
            state.next - 1
        };
        let chunk = Chunk {
            lo: seq,
            hi: seq,
            jobs: records.len() as u64,
        };
        self.write(&chunk, Kind::Allocations, vec![Ok(allocations)].into_iter())?;
        self.write(&chunk, Kind::Jobs, vec![Ok(jobs)].into_iter())?;
        self.state.lock().chunks.push(chunk);
        // The chunk is in place whatever a merge does: a merge that fails (a full disk) must
        // not have these jobs written again, twice.
        if let Err(e) = self.merge() {
            tracing::warn!(error = %e, "merging settled rows files failed; they stay as they are, and the next write tries again");
        }
        Ok(())
    }

    /// Merges the newest chunk into the one before while it is at least half that one's size.
    fn merge(&self) -> Result<(), String> {
        loop {
            let (a, b) = {
                let state = self.state.lock();
                match state.chunks.as_slice() {
                    [.., a, b] => (*a, *b),
                    _ => return Ok(()),
                }
            };
            if b.jobs * 2 < a.jobs || a.jobs + b.jobs > MAX_CHUNK_JOBS {
                return Ok(());
            }
            let merged = Chunk {
                lo: a.lo,
                hi: b.hi,
                jobs: a.jobs + b.jobs,
            };
            for kind in [Kind::Allocations, Kind::Jobs] {
                let batches = [a, b]
                    .into_iter()
                    .map(|c| File::open(c.path(&self.dir, kind)).map_err(|e| e.to_string()))
                    .map(|file| file.and_then(|f| reader(f, kind, None)))
                    .collect::<Result<Vec<_>, String>>()?;
                let rows = batches
                    .into_iter()
                    .flatten()
                    .map(|b| b.map_err(|e| e.to_string()));
                self.write(&merged, kind, rows)?;
            }
            let mut state = self.state.lock();
            let n = state.chunks.len();
            state.chunks.splice(n - 2.., [merged]);
            // Under the lock: a view has opened both old pairs, or will open the new one.
            for c in [a, b] {
                remove(&c.path(&self.dir, Kind::Jobs));
                remove(&c.path(&self.dir, Kind::Allocations));
            }
        }
    }

    /// Writes `batches` as `chunk`'s file of `kind`: to a temporary file, synced, renamed.
    fn write(
        &self,
        chunk: &Chunk,
        kind: Kind,
        batches: impl Iterator<Item = Result<RecordBatch, String>>,
    ) -> Result<(), String> {
        let path = chunk.path(&self.dir, kind);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let tmp = self.dir.join(format!(".tmp-{name}"));
        let fail = |e: &dyn std::fmt::Display| format!("writing {}: {e}", path.display());
        let result = (|| {
            let file = File::create(&tmp).map_err(|e| fail(&e))?;
            let props = WriterProperties::builder()
                .set_key_value_metadata(Some(vec![KeyValue::new(
                    VERSION_KEY.to_owned(),
                    FORMAT_VERSION.to_string(),
                )]))
                .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
                .set_compression(Compression::ZSTD(
                    ZstdLevel::try_new(3).map_err(|e| fail(&e))?,
                ))
                .build();
            let mut writer =
                ArrowWriter::try_new(file, kind.schema(), Some(props)).map_err(|e| fail(&e))?;
            for batch in batches {
                writer.write(&batch?).map_err(|e| fail(&e))?;
            }
            let file = writer.into_inner().map_err(|e| fail(&e))?;
            file.sync_all().map_err(|e| fail(&e))?;
            std::fs::rename(&tmp, &path).map_err(|e| fail(&e))?;
            File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| fail(&e))
        })();
        if result.is_err() {
            remove(&tmp);
        }
        result
    }

    /// The rows as they are now, less those of jobs in `skip` (read elsewhere): each chunk's
    /// files are opened here, so a merge after this cannot take them away. `None` if the
    /// files are no longer those of `epoch` (see [`self`]); an error if one cannot be opened.
    pub(crate) fn view(&self, skip: HashSet<u64>, epoch: Epoch) -> Result<Option<View>, Unread> {
        let state = self.state.lock();
        if state.epoch != epoch.number {
            return Ok(None);
        }
        let files = state
            .chunks
            .iter()
            .map(|c| {
                let open = |kind| {
                    let path = c.path(&self.dir, kind);
                    match File::open(&path) {
                        Ok(file) => Ok(Opened { path, file, kind }),
                        Err(e) => Err(unopened(&path, &e)),
                    }
                };
                Ok((open(Kind::Jobs)?, open(Kind::Allocations)?))
            })
            .collect::<Result<_, Unread>>()?;
        Ok(Some(View {
            files,
            skip,
            read: Default::default(),
        }))
    }

    /// Which files queries read now.
    pub(crate) fn epoch(&self) -> Epoch {
        let state = self.state.lock();
        Epoch {
            number: state.epoch,
            lost: state.lost.is_some(),
        }
    }

    /// A read of the files failed (`why`): they are not to be read until written again
    /// ([`SettledRows::reset`]). True the first time it is said in an epoch.
    pub(crate) fn lose(&self, why: &str) -> bool {
        let mut state = self.state.lock();
        let first = state.lost.is_none();
        if first {
            state.lost = Some(why.to_owned());
        }
        first
    }

    /// Why the files are to be written again, if they are.
    pub(crate) fn lost(&self) -> Option<String> {
        self.state.lock().lost.clone()
    }

    /// Deletes every file and starts a new epoch with none: the caller marks every settled
    /// job unrecorded, under the control lock this is called under, so they are written again.
    /// A query that opened files before keeps reading them.
    pub(crate) fn reset(&self) {
        let mut state = self.state.lock();
        for chunk in state.chunks.drain(..) {
            remove(&chunk.path(&self.dir, Kind::Jobs));
            remove(&chunk.path(&self.dir, Kind::Allocations));
        }
        state.epoch += 1;
        state.lost = None;
    }

    /// The number of pairs of files.
    #[cfg(test)]
    pub(crate) fn chunk_count(&self) -> usize {
        self.state.lock().chunks.len()
    }
}

/// A batch reader over `file`, a `kind` of file, of the columns named in `columns` (all if
/// `None`). A file of another format version, or whose columns are not those `kind` stores
/// today (another version wrote it, or it is not one of perch's), is refused.
fn reader(
    file: File,
    kind: Kind,
    columns: Option<&[&str]>,
) -> Result<parquet::arrow::arrow_reader::ParquetRecordBatchReader, String> {
    pruned_reader(file, kind, columns, &Pick::default())
}

/// [`reader`], of the row groups `pick` keeps.
fn pruned_reader(
    file: File,
    kind: Kind,
    columns: Option<&[&str]>,
    pick: &Pick<'_>,
) -> Result<parquet::arrow::arrow_reader::ParquetRecordBatchReader, String> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| e.to_string())?;
    let version = format_version(builder.metadata())?;
    if version != FORMAT_VERSION {
        return Err(format!(
            "it is of settled rows format version {version}; this perch reads and writes version {FORMAT_VERSION}"
        ));
    }
    let (found, expected) = (builder.schema().fields(), kind.schema());
    let same = found.len() == expected.fields().len()
        && found.iter().zip(expected.fields()).all(|(a, b)| {
            a.name() == b.name()
                && a.data_type() == b.data_type()
                && a.is_nullable() == b.is_nullable()
        });
    if !same {
        return Err(format!(
            "its columns are not those of {} rows this version of perch writes",
            match kind {
                Kind::Jobs => "jobs",
                Kind::Allocations => "job_allocations",
            }
        ));
    }
    let row_groups = pick.row_groups(builder.metadata(), builder.schema());
    let builder = match row_groups {
        Some(row_groups) => builder.with_row_groups(row_groups),
        None => builder,
    };
    let builder = match columns {
        Some(columns) => {
            let mask = ProjectionMask::columns(builder.parquet_schema(), columns.iter().copied());
            builder.with_projection(mask)
        }
        None => builder,
    };
    builder
        .with_batch_size(BATCH_ROWS)
        .build()
        .map_err(|e| e.to_string())
}

/// The format version a file's footer records ([`VERSION_KEY`]); 1 when it records none.
fn format_version(metadata: &ParquetMetaData) -> Result<u32, String> {
    let recorded = metadata
        .file_metadata()
        .key_value_metadata()
        .and_then(|kv| kv.iter().find(|e| e.key == VERSION_KEY))
        .map(|e| e.value.as_deref().unwrap_or(""));
    match recorded {
        None => Ok(1),
        Some(v) => v
            .parse()
            .map_err(|_| format!("its {VERSION_KEY} is {v:?}, not a version number")),
    }
}

/// Which row groups of a file a query reads: those whose statistics say they may hold a row
/// its filters keep ([`Pruning::row_groups`]) and, where `jobs` bounds them, a job id from
/// `lo` to `hi`. Default: every row group.
#[derive(Default, Clone, Copy)]
struct Pick<'a> {
    pruning: Option<&'a Pruning>,
    jobs: Option<(u64, u64)>,
}

impl Pick<'_> {
    /// The row groups to read of a file with footer `metadata` and columns `schema` (`None`:
    /// all of them).
    fn row_groups(&self, metadata: &ParquetMetaData, schema: &SchemaRef) -> Option<Vec<usize>> {
        let chosen = self.pruning.and_then(|p| p.row_groups(metadata, schema));
        let Some((lo, hi)) = self.jobs else {
            return chosen;
        };
        let bounds = job_bounds(metadata, schema);
        let all: Vec<usize> = (0..metadata.num_row_groups()).collect();
        Some(
            chosen
                .unwrap_or(all)
                .into_iter()
                .filter(|&i| bounds[i].is_none_or(|(min, max)| max >= lo && min <= hi))
                .collect(),
        )
    }
}

/// Each row group's least and greatest job id, from its statistics (`None` where it has
/// none).
fn job_bounds(metadata: &ParquetMetaData, schema: &SchemaRef) -> Vec<Option<(u64, u64)>> {
    let unknown = vec![None; metadata.num_row_groups()];
    let parquet_schema = metadata.file_metadata().schema_descr();
    let Ok(converter) = StatisticsConverter::try_new("job", schema, parquet_schema) else {
        return unknown;
    };
    let (Ok(mins), Ok(maxes)) = (
        converter.row_group_mins(metadata.row_groups()),
        converter.row_group_maxes(metadata.row_groups()),
    ) else {
        return unknown;
    };
    let (Some(mins), Some(maxes)) = (
        mins.as_any().downcast_ref::<UInt64Array>(),
        maxes.as_any().downcast_ref::<UInt64Array>(),
    ) else {
        return unknown;
    };
    (0..metadata.num_row_groups())
        .map(|i| (mins.is_valid(i) && maxes.is_valid(i)).then(|| (mins.value(i), maxes.value(i))))
        .collect()
}

/// The least and greatest job id in the row groups of `file` that `pick` keeps: `None` when
/// it keeps none.
fn jobs_picked(file: File, pick: &Pick<'_>) -> Result<Option<(u64, u64)>, String> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| e.to_string())?;
    let (metadata, schema) = (builder.metadata(), builder.schema());
    let chosen = pick
        .row_groups(metadata, schema)
        .unwrap_or_else(|| (0..metadata.num_row_groups()).collect());
    let bounds = job_bounds(metadata, schema);
    Ok(chosen
        .into_iter()
        .map(|i| bounds[i].unwrap_or((0, u64::MAX)))
        .reduce(|(a, b), (c, d)| (a.min(c), b.max(d))))
}

fn read(file: File, kind: Kind, columns: Option<&[&str]>) -> Result<Vec<RecordBatch>, String> {
    reader(file, kind, columns)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

/// A file a view opened.
struct Opened {
    path: PathBuf,
    file: File,
    kind: Kind,
}

/// The settled rows one query reads ([`SettledRows::view`]).
pub(crate) struct View {
    files: Vec<(Opened, Opened)>,
    skip: HashSet<u64>,
    /// Rows read from the files so far (what the row groups' statistics did not skip).
    read: std::cell::Cell<usize>,
}

/// A float column of `batch`, by name.
fn floats(batch: &RecordBatch, name: &str) -> Result<Float64Array, String> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| format!("settled rows lack column {name}"))?;
    Ok(downcast_array(column.as_ref()))
}

/// The columns of `job_allocations` that what a GPU cost is worked out from.
const COST_INPUTS: [&str; 5] = [
    "gpu_model",
    "gpu_seconds_allocated",
    "gpu_seconds_accounted",
    "gpu_seconds_used",
    "energy_joules",
];

/// What each allocation row of `batch` (with [`COST_INPUTS`]) cost at `prices`: by
/// allocation, and within the accounted window by allocation and by use.
#[derive(Debug, Default)]
struct Costs {
    allocated: Vec<f64>,
    accounted: Vec<Option<f64>>,
    used: Vec<Option<f64>>,
}

fn costs(batch: &RecordBatch, prices: &Prices) -> Result<Costs, String> {
    let model: StringArray = downcast_array(
        batch
            .column_by_name("gpu_model")
            .ok_or("settled rows lack column gpu_model")?
            .as_ref(),
    );
    let allocated = floats(batch, "gpu_seconds_allocated")?;
    let accounted = floats(batch, "gpu_seconds_accounted")?;
    let used = floats(batch, "gpu_seconds_used")?;
    let energy = floats(batch, "energy_joules")?;
    let value = |a: &Float64Array, i: usize| a.is_valid(i).then(|| a.value(i));
    let mut out = Costs::default();
    for i in 0..batch.num_rows() {
        let (by_allocation, by_use) = prices.gpu_costs(
            model.value(i),
            allocated.value(i),
            value(&used, i),
            value(&energy, i),
        );
        out.allocated.push(by_allocation);
        out.accounted.push(prices.accounted_cost(
            model.value(i),
            value(&accounted, i),
            value(&energy, i),
        ));
        out.used.push(by_use);
    }
    Ok(out)
}

/// `batch`'s job ids (its first column, as stored).
fn job_ids(batch: &RecordBatch) -> UInt64Array {
    downcast_array(batch.column(0).as_ref())
}

/// Whether `schema` (a table's, or part of it) has priced columns.
fn priced(schema: &SchemaRef) -> bool {
    schema
        .fields()
        .iter()
        .any(|f| tables::PRICED.contains(&f.name().as_str()))
}

/// The stored columns `schema` needs, the job id first.
fn stored_columns(schema: &SchemaRef) -> Vec<&str> {
    let mut columns = vec!["job"];
    for f in schema.fields() {
        let name = f.name().as_str();
        if !tables::PRICED.contains(&name) && !columns.contains(&name) {
            columns.push(name);
        }
    }
    columns
}

/// `batch` as `schema` has it, `costs` as its priced columns.
fn assemble(
    batch: &RecordBatch,
    schema: &SchemaRef,
    costs: Option<Costs>,
) -> Result<RecordBatch, String> {
    let floats = |v: Vec<Option<f64>>| Arc::new(Float64Array::from(v)) as ArrayRef;
    let columns = schema
        .fields()
        .iter()
        .map(|f| {
            let priced: Option<ArrayRef> = costs.as_ref().and_then(|c| match f.name().as_str() {
                "cost_allocated" => Some(Arc::new(Float64Array::from(c.allocated.clone())) as _),
                "cost_accounted" => Some(floats(c.accounted.clone())),
                "cost_used" => Some(floats(c.used.clone())),
                "idle_cost" => Some(floats(
                    c.accounted
                        .iter()
                        .zip(&c.used)
                        .map(|(a, u)| perch_control::cost::idle_cost(*a, *u))
                        .collect(),
                )),
                _ => None,
            });
            priced
                .or_else(|| batch.column_by_name(f.name()).cloned())
                .ok_or_else(|| format!("settled rows lack column {}", f.name()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(schema.clone(), columns, &options).map_err(|e| e.to_string())
}

impl Drop for View {
    fn drop(&mut self) {
        // What a query's filters left to read ([`perch_query::Pruning`]), for an operator
        // asking why a query over the history is slow.
        tracing::debug!(rows = self.read.get(), "settled rows read for a query");
    }
}

impl View {
    /// Rows read from the files so far.
    #[cfg(test)]
    pub(crate) fn rows_read(&self) -> usize {
        self.read.get()
    }

    /// `opened`'s rows of jobs not skipped, of `columns` (the job id first), a batch at a
    /// time to `f`.
    fn each(
        &self,
        opened: &Opened,
        columns: &[&str],
        pick: Pick<'_>,
        mut f: impl FnMut(RecordBatch) -> Result<(), Unread>,
    ) -> Result<(), Unread> {
        let unread =
            |e: &dyn std::fmt::Display| Unread::File(format!("{}: {e}", opened.path.display()));
        let file = opened
            .file
            .try_clone()
            .map_err(|e| unopened(&opened.path, &e))?;
        let batches =
            pruned_reader(file, opened.kind, Some(columns), &pick).map_err(|e| unread(&e))?;
        for batch in batches {
            let batch = batch.map_err(|e| unread(&e))?;
            self.read.set(self.read.get() + batch.num_rows());
            if self.skip.is_empty() {
                f(batch)?;
                continue;
            }
            let keep: BooleanArray = job_ids(&batch)
                .values()
                .iter()
                .map(|id| Some(!self.skip.contains(id)))
                .collect();
            let kept =
                arrow::compute::filter_record_batch(&batch, &keep).map_err(|e| unread(&e))?;
            if kept.num_rows() > 0 {
                f(kept)?;
            }
        }
        Ok(())
    }

    /// The `job_allocations` rows' `job` and `columns` (unpriced ones), as stored, a batch
    /// at a time to `f`, each counted in `room` (what `f` keeps of it is about its size).
    pub(crate) fn allocation_columns(
        &self,
        columns: &[&str],
        room: &mut Room<'_>,
        mut f: impl FnMut(RecordBatch),
    ) -> Result<(), Unread> {
        let columns: Vec<&str> = std::iter::once("job")
            .chain(columns.iter().copied())
            .collect();
        for (_, file) in &self.files {
            self.each(file, &columns, Pick::default(), |batch| {
                room.take(std::slice::from_ref(&batch))
                    .map_err(Unread::Room)?;
                f(batch);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The `job_allocations` rows in `schema` (the table's, or the columns a query reads),
    /// priced at `prices`, each batch counted in `room` as it is made.
    pub(crate) fn allocations(
        &self,
        prices: &Prices,
        schema: &SchemaRef,
        room: &mut Room<'_>,
    ) -> Result<Vec<RecordBatch>, Unread> {
        let priced = priced(schema);
        let mut columns = stored_columns(schema);
        if priced {
            for input in COST_INPUTS {
                if !columns.contains(&input) {
                    columns.push(input);
                }
            }
        }
        let (mut out, pruning) = (Vec::new(), room.pruning());
        let pick = Pick {
            pruning: pruning.as_ref(),
            jobs: None,
        };
        for (_, file) in &self.files {
            self.each(file, &columns, pick, |batch| {
                let costs = priced
                    .then(|| costs(&batch, prices))
                    .transpose()
                    .map_err(Unread::File)?;
                out.extend(keep(room, assemble(&batch, schema, costs))?);
                Ok(())
            })?;
        }
        Ok(out)
    }

    /// The `jobs` rows in `schema` (the table's, or the columns a query reads), priced at
    /// `prices`: a job's cost is its GPUs', added in the order [`tables::job_totals`] adds
    /// them. Each batch is counted in `room` as it is made.
    pub(crate) fn jobs(
        &self,
        prices: &Prices,
        schema: &SchemaRef,
        room: &mut Room<'_>,
    ) -> Result<Vec<RecordBatch>, Unread> {
        let priced = priced(schema);
        let columns = stored_columns(schema);
        let (mut out, pruning) = (Vec::new(), room.pruning());
        let pick = Pick {
            pruning: pruning.as_ref(),
            jobs: None,
        };
        for (jobs, allocations) in &self.files {
            let mut by_job: HashMap<u64, (f64, Option<f64>, Option<f64>)> = HashMap::new();
            if priced {
                // The GPUs' costs of the jobs the query may keep: the job ids in the row
                // groups of jobs it reads, and its filters on job ids (only a job id means
                // the same in both files).
                let file = jobs
                    .file
                    .try_clone()
                    .map_err(|e| unopened(&jobs.path, &e))?;
                let picked = jobs_picked(file, &pick)
                    .map_err(|e| Unread::File(format!("{}: {e}", jobs.path.display())))?;
                let Some(range) = picked else {
                    continue;
                };
                let by_id = pruning.as_ref().and_then(|p| p.on(&["job"]));
                let pick = Pick {
                    pruning: by_id.as_ref(),
                    jobs: Some(range),
                };
                let inputs: Vec<&str> = std::iter::once("job").chain(COST_INPUTS).collect();
                self.each(allocations, &inputs, pick, |batch| {
                    let c = costs(&batch, prices).map_err(Unread::File)?;
                    let add = |a: Option<f64>, b: Option<f64>| match (a, b) {
                        (Some(x), Some(y)) => Some(x + y),
                        (x, y) => x.or(y),
                    };
                    for (i, job) in job_ids(&batch).values().iter().enumerate() {
                        let sum = by_job.entry(*job).or_insert((0.0, None, None));
                        sum.0 += c.allocated[i];
                        sum.1 = add(sum.1, c.accounted[i]);
                        sum.2 = add(sum.2, c.used[i]);
                    }
                    Ok(())
                })?;
            }
            self.each(jobs, &columns, pick, |batch| {
                let costs = priced.then(|| {
                    let mut c = Costs::default();
                    for id in job_ids(&batch).values().iter() {
                        let (allocated, accounted, used) =
                            by_job.get(id).copied().unwrap_or((0.0, None, None));
                        c.allocated.push(allocated);
                        c.accounted.push(accounted);
                        c.used.push(used);
                    }
                    c
                });
                out.extend(keep(room, assemble(&batch, schema, costs))?);
                Ok(())
            })?;
        }
        Ok(out)
    }
}

/// What the query keeps of a batch made for it ([`Room::keep`]), counted in its `room`.
fn keep(
    room: &mut Room<'_>,
    made: Result<RecordBatch, String>,
) -> Result<Vec<RecordBatch>, Unread> {
    room.keep(vec![made.map_err(Unread::File)?])
        .map_err(Unread::Room)
}

/// Why a view's rows were not made.
#[derive(Debug)]
pub(crate) enum Unread {
    /// A file could not be read (removed or damaged under the running server): the files
    /// are to be written again.
    File(String),
    /// The query has no room in its memory for them: nothing to mend but the query.
    Room(String),
    /// The server could not open or read a file now for a reason that is not the file's (no
    /// file descriptors left, no memory): the query fails, the files are not written again.
    /// Taking them for lost would have let a flood of connections that used up the server's
    /// descriptors make it rewrite the whole history.
    Now(String),
}

impl std::fmt::Display for Unread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unread::File(e) | Unread::Room(e) | Unread::Now(e) => f.write_str(e),
        }
    }
}

/// Why `path` could not be opened (or its descriptor copied): gone, or the server's state
/// of the moment.
fn unopened(path: &Path, e: &std::io::Error) -> Unread {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::NotFound => Unread::File(format!(
            "{} was removed by something other than this server",
            path.display()
        )),
        // EMFILE, ENFILE, ENOMEM, EINTR: nothing wrong with the file.
        K::OutOfMemory | K::Interrupted | K::WouldBlock => {
            Unread::Now(format!("{}: {e}", path.display()))
        }
        _ if matches!(e.raw_os_error(), Some(23 | 24)) => {
            Unread::Now(format!("{}: {e}", path.display()))
        }
        _ => Unread::File(format!("{}: {e}", path.display())),
    }
}

/// The control plane writes settled jobs' rows here, and is told when they are lost.
impl perch_control::SettledRecords for SettledRows {
    fn append(&self, records: &[JobRecord]) -> Result<(), String> {
        SettledRows::append(self, records)
    }

    fn lost(&self) -> Option<String> {
        SettledRows::lost(self)
    }

    fn reset(&self) {
        SettledRows::reset(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_control::record::Allocation;

    fn job(id: u64) -> JobRecord {
        let mut job: JobRecord = serde_json::from_value(serde_json::json!({
            "id": id,
            "request": { "command": ["x"], "user": "alice" },
            "state": "completed",
            "reason": null,
            "submit_ms": 0,
            "start_ms": 0,
            "end_ms": 1000,
            "placement": [],
            "attempts": 1,
            "requeues": 0,
            "preemptions": 0,
            "exit_code": 0,
            "timeline": [],
        }))
        .expect("record");
        let mut a = Allocation::new(1, "n".into(), vec![0], "H100".into(), 0, false);
        a.end_ms = Some(1000);
        job.allocations.push(a);
        job
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Jobs settling one at a time leave a handful of files, each job in one of them.
    #[test]
    fn chunks_merge_to_a_few_files_and_hold_each_job_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rows, ids) = SettledRows::open(dir.path()).expect("open");
        assert!(ids.is_empty());
        for id in 1..=200 {
            rows.append(&[job(id)]).expect("append");
            let n = rows.chunk_count();
            // Sizes at least halve from one chunk to the next.
            assert!(
                n as f64 <= 2.0 + (id as f64).log2() * 2.0,
                "{n} chunks for {id} jobs"
            );
        }
        assert_eq!(names(dir.path()).len(), rows.chunk_count() * 2);
        drop(rows);
        let (rows, mut ids) = SettledRows::open(dir.path()).expect("open");
        ids.sort();
        assert_eq!(ids, (1..=200).collect::<Vec<_>>());
        let view = rows
            .view([7].into(), rows.epoch())
            .expect("view")
            .expect("this epoch");
        let schema = tables::stored_allocations_schema();
        let mut unlimited = |_| Ok(());
        let mut read = 0;
        view.allocation_columns(&["gpu"], &mut Room::new(&mut unlimited), |b| {
            read += b.num_rows()
        })
        .expect("read");
        assert_eq!(read, 199, "the skipped job's rows are left out");
        // No more room in the query's memory: the query is refused, the files stay trusted.
        let mut full = |bytes: usize| Err(format!("no room for {bytes} bytes"));
        let refused = view
            .allocations(&Prices::default(), &schema, &mut Room::new(&mut full))
            .expect_err("no room");
        assert!(matches!(refused, Unread::Room(_)), "{refused}");
        assert!(
            schema.field_with_name("cost_used").is_err(),
            "stored unpriced"
        );
        // A file damaged under a running server: the read names it.
        let damaged = names(dir.path())
            .into_iter()
            .find(|n| n.ends_with(".allocations.parquet"))
            .expect("a file");
        std::fs::write(dir.path().join(&damaged), b"damaged").expect("damage");
        let view = rows
            .view(HashSet::new(), rows.epoch())
            .expect("opened")
            .expect("this epoch");
        let said = view
            .allocation_columns(&["gpu"], &mut Room::new(&mut unlimited), |_| {})
            .expect_err("damaged");
        assert!(
            matches!(&said, Unread::File(e) if e.contains(&damaged)),
            "{said}"
        );
        // Files removed under a running server (an operator's cleanup): a view says which.
        for name in names(dir.path()) {
            std::fs::remove_file(dir.path().join(name)).expect("remove");
        }
        let epoch = rows.epoch();
        let Err(Unread::File(said)) = rows.view(HashSet::new(), epoch) else {
            panic!("no files to read");
        };
        assert!(said.contains("removed by something other than"), "{said}");
        assert!(rows.lose(&said), "said once");
        assert!(!rows.lose(&said));
        // The server out of descriptors or memory: nothing wrong with the files.
        for (errno, lost) in [(24, false), (23, false), (12, false), (5, true), (2, true)] {
            let e = std::io::Error::from_raw_os_error(errno);
            let unread = unopened(Path::new("f"), &e);
            assert_eq!(
                matches!(unread, Unread::File(_)),
                lost,
                "errno {errno}: {unread}"
            );
        }
        assert!(rows.epoch().lost);
        // Written again: a new epoch; a view of the old one is refused, so its query walks
        // the job database again rather than miss the jobs it took as recorded.
        rows.reset();
        assert!(names(dir.path()).is_empty());
        assert!(!rows.epoch().lost);
        assert!(rows.view(HashSet::new(), epoch).expect("view").is_none());
        rows.append(&[job(1)]).expect("append");
        assert_eq!(rows.chunk_count(), 1);
    }

    /// A query's filters on job id or time skip the row groups whose statistics say they
    /// hold no row it keeps: a query for the last jobs of a long history reads their row
    /// group, not the history. The rows are the same as read whole.
    #[test]
    fn a_query_reads_only_the_row_groups_its_filters_may_keep() {
        use datafusion::prelude::{SessionContext, col, lit};
        let dir = tempfile::tempdir().expect("tempdir");
        let (rows, _) = SettledRows::open(dir.path()).expect("open");
        let n = 3 * ROW_GROUP_ROWS as u64;
        let base = job(0);
        let jobs: Vec<JobRecord> = (1..=n)
            .map(|id| {
                let mut j = base.clone();
                j.id = id;
                j.submit_ms = id as i64 * 1000;
                j
            })
            .collect();
        rows.append(&jobs).expect("append");
        let state = SessionContext::new().state();
        let read = |filters: Vec<datafusion::prelude::Expr>, table: Kind| {
            let view = rows
                .view(HashSet::new(), rows.epoch())
                .expect("view")
                .expect("this epoch");
            let schema = match table {
                Kind::Jobs => tables::jobs_schema(),
                Kind::Allocations => tables::allocations_schema(),
            };
            let mut unlimited = |_| Ok(());
            let mut room = Room::new(&mut unlimited).with_filters(&filters, &schema, &state);
            let made = match table {
                Kind::Jobs => view.jobs(&Prices::default(), &schema, &mut room),
                Kind::Allocations => view.allocations(&Prices::default(), &schema, &mut room),
            }
            .expect("read");
            let ids: Vec<u64> = made
                .iter()
                .flat_map(|b| job_ids(b).values().to_vec())
                .collect();
            (ids, view.rows_read())
        };
        let last = n - 10;
        for table in [Kind::Jobs, Kind::Allocations] {
            // The priced jobs read their allocations' costs as well: one row each here.
            let files = match table {
                Kind::Jobs => 2,
                Kind::Allocations => 1,
            };
            let (all, whole) = read(vec![], table);
            assert_eq!(
                (all.len(), whole),
                (n as usize, files * n as usize),
                "{table:?}"
            );
            let (ids, part) = read(vec![col("job").gt(lit(last))], table);
            assert_eq!(ids, (last + 1..=n).collect::<Vec<_>>(), "{table:?}");
            assert_eq!(
                part,
                files * ROW_GROUP_ROWS,
                "{table:?}: one row group of three read"
            );
            // A filter on a column the file does not hold (a price) is judged on the rows.
            let (ids, part) = read(
                vec![col("job").lt(lit(5u64)).and(col("cost_used").is_null())],
                table,
            );
            assert_eq!(ids, (1..5).collect::<Vec<_>>(), "{table:?}");
            assert_eq!(part, files * ROW_GROUP_ROWS, "{table:?}");
        }
        // On time: the jobs submitted in the last 100 seconds.
        let (ids, part) = read(
            vec![col("submit_time").gt(lit(
                datafusion::scalar::ScalarValue::TimestampMillisecond(
                    Some((n as i64 - 100) * 1000),
                    Some("UTC".into()),
                ),
            ))],
            Kind::Jobs,
        );
        assert_eq!(ids, (n - 99..=n).collect::<Vec<_>>());
        assert_eq!(
            part,
            2 * ROW_GROUP_ROWS,
            "the costs' rows of those jobs' ids alone"
        );
        // No row group of jobs may hold a match: neither file is read.
        let (ids, part) = read(vec![col("user_name").eq(lit("nobody"))], Kind::Jobs);
        assert_eq!((ids.len(), part), (0, 0));
    }

    /// A merge that fails leaves the chunk just written in place and says it was written, so
    /// its jobs are not written a second time.
    #[test]
    fn a_failed_merge_does_not_fail_the_write_before_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rows, _) = SettledRows::open(dir.path()).expect("open");
        rows.append(&[job(1), job(2)]).expect("append");
        // The older pair cannot be read: merging the next one into it fails.
        std::fs::remove_file(dir.path().join("0000000000-0000000000.allocations.parquet"))
            .expect("remove");
        rows.append(&[job(3)]).expect("written, though not merged");
        assert_eq!(rows.chunk_count(), 2);
        assert!(names(dir.path()).contains(&"0000000001-0000000001.jobs.parquet".to_owned()));
    }

    /// What an interrupted merge or write leaves is put right at start: the pairs a merged
    /// pair covers, half a pair, and temporary files are deleted.
    #[test]
    fn an_interrupted_merge_or_write_is_put_right_at_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rows, _) = SettledRows::open(dir.path()).expect("open");
        rows.append(&[job(1), job(2)]).expect("append");
        rows.append(&[job(3)]).expect("append");
        assert_eq!(rows.chunk_count(), 1, "merged");
        let merged = names(dir.path());
        assert_eq!(
            merged,
            [
                "0000000000-0000000001.allocations.parquet",
                "0000000000-0000000001.jobs.parquet"
            ]
        );
        drop(rows);
        // The merge's inputs still there (deleted after the merged pair is in place), half a
        // pair (its jobs file never written) and a temporary file.
        let copy = |from: &str, to: &str| {
            std::fs::copy(dir.path().join(from), dir.path().join(to)).expect("copy");
        };
        copy(&merged[0], "0000000000-0000000000.allocations.parquet");
        copy(&merged[1], "0000000000-0000000000.jobs.parquet");
        copy(&merged[0], "0000000002-0000000002.allocations.parquet");
        copy(&merged[1], ".tmp-0000000002-0000000002.jobs.parquet");
        let (rows, mut ids) = SettledRows::open(dir.path()).expect("open");
        ids.sort();
        assert_eq!(ids, [1, 2, 3], "each job once");
        assert_eq!(names(dir.path()), merged);
        // Numbering goes on past every name seen.
        rows.append(&[job(4)]).expect("append");
        assert!(names(dir.path()).iter().any(|n| n.contains("0000000003")));
        drop(rows);
        // A file that is not Parquet (a disk's damage): its pair goes, the rest stays.
        let newest = names(dir.path())
            .into_iter()
            .find(|n| n.starts_with("0000000003") && n.ends_with(".jobs.parquet"))
            .expect("the newest pair");
        std::fs::write(dir.path().join(newest), b"not parquet").expect("write");
        let (_, mut ids) = SettledRows::open(dir.path()).expect("open despite a damaged file");
        ids.sort();
        assert_eq!(ids, [1, 2, 3], "job 4 is to be written again");
        assert_eq!(names(dir.path()), merged);
        // A pair copied back beside itself under another name (a backup restored): each of
        // its jobs in two files, so none is trusted.
        copy(&merged[0], "0000000009-0000000009.allocations.parquet");
        copy(&merged[1], "0000000009-0000000009.jobs.parquet");
        let (_, ids) = SettledRows::open(dir.path()).expect("open");
        assert!(ids.is_empty(), "{ids:?}");
        assert!(names(dir.path()).is_empty());
    }

    /// Copies the directory `from` into a new temporary one.
    fn copied(from: &Path) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        for entry in std::fs::read_dir(from).expect("fixture") {
            let entry = entry.expect("entry");
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
        }
        dir
    }

    /// The settled rows files the release before formats were versioned wrote (see
    /// `query/tests/fixtures/format/README.md`): jobs 1 (alice, H100) and 2 (bob, A100).
    fn previous_release_files() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../query/tests/fixtures/format/dc15fd0/settled")
    }

    fn recorded_version(path: &Path) -> Option<String> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(path).expect("open"))
            .expect("parquet");
        builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|e| e.key == VERSION_KEY))
            .and_then(|e| e.value.clone())
    }

    /// The previous release's files are version 1 (no version key): their `energy_joules` and
    /// `accounted_until` follow older rules (a short job's energy a false 0), so a start deletes
    /// them, and the recording task writes their jobs again from the job database.
    #[test]
    fn the_previous_releases_files_are_written_again() {
        let dir = copied(&previous_release_files());
        let jobs_file = dir.path().join("0000000000-0000000000.jobs.parquet");
        assert_eq!(
            recorded_version(&jobs_file),
            None,
            "written before versions"
        );
        assert_eq!(names(dir.path()).len(), 2, "a pair");
        let Err(said) = reader(File::open(&jobs_file).expect("open"), Kind::Jobs, None) else {
            panic!("a file of version 1 is refused");
        };
        assert!(said.contains("format version 1"), "{said}");
        let (_rows, ids) = SettledRows::open(dir.path()).expect("open");
        assert!(ids.is_empty(), "no job is read from them: {ids:?}");
        assert!(names(dir.path()).is_empty(), "the pair is deleted");
    }

    #[test]
    fn files_record_their_version_and_another_version_is_written_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (rows, _) = SettledRows::open(dir.path()).expect("open");
        rows.append(&[job(1), job(2)]).expect("append");
        drop(rows);
        let jobs_file = dir.path().join("0000000000-0000000000.jobs.parquet");
        assert_eq!(
            recorded_version(&jobs_file),
            Some(FORMAT_VERSION.to_string())
        );
        // The same rows, as a perch of the next version would label them.
        let batches = read(File::open(&jobs_file).expect("open"), Kind::Jobs, None).expect("read");
        let props = WriterProperties::builder()
            .set_key_value_metadata(Some(vec![KeyValue::new(
                VERSION_KEY.to_owned(),
                (FORMAT_VERSION + 1).to_string(),
            )]))
            .build();
        let mut writer = ArrowWriter::try_new(
            File::create(&jobs_file).expect("create"),
            Kind::Jobs.schema(),
            Some(props),
        )
        .expect("writer");
        for b in &batches {
            writer.write(b).expect("write");
        }
        writer.close().expect("close");
        let Err(said) = reader(File::open(&jobs_file).expect("open"), Kind::Jobs, None) else {
            panic!("a file of another version is refused");
        };
        assert!(
            said.contains(&format!("format version {}", FORMAT_VERSION + 1)),
            "{said}"
        );
        // At start the pair goes, and its jobs are to be recorded again from the job database.
        let (_, ids) = SettledRows::open(dir.path()).expect("open");
        assert!(ids.is_empty(), "{ids:?}");
        assert!(names(dir.path()).is_empty());
    }

    /// `docs/format/settled-rows.md` and the index of formats name the version written.
    #[test]
    fn the_document_names_the_version_written() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/format");
        let doc = std::fs::read_to_string(docs.join("settled-rows.md")).expect("doc");
        let current = doc
            .lines()
            .find_map(|l| l.strip_prefix("Current version: "))
            .expect("a `Current version:` line");
        assert_eq!(
            current.trim_matches(|c: char| !c.is_ascii_digit()),
            FORMAT_VERSION.to_string()
        );
        assert!(doc.contains(&format!("`{VERSION_KEY}`")), "names the key");
        let index = std::fs::read_to_string(docs.join("README.md")).expect("index");
        let row = index
            .lines()
            .find(|l| l.starts_with('|') && l.contains("(settled-rows.md)"))
            .expect("a row for settled-rows.md");
        assert_eq!(
            row.split('|').nth(2).map(str::trim),
            Some(FORMAT_VERSION.to_string().as_str())
        );
    }
}
