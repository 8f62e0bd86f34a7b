//! The prefilter's exact mode: where the filter's tested columns are not needed above it, the
//! scan does not read them at all.
//!
//! The verdicts [`super::pages`] reads are exact (a row passes exactly where DataFusion's
//! filter keeps it), so the scan need not decode the tested columns again for the filter to
//! evaluate them: it reads only the other columns, of the runs the selection keeps, and the
//! prefilter adds to each batch a column [`PASSES`] of the verdicts of its rows. The
//! `FilterExec` above filters on that column (and on the conjuncts that were not tested).
//!
//! The verdicts line up with the scan's rows because the prefilter alone decides what the
//! scan reads: the scan under it is planned without a predicate (so it prunes nothing) and
//! without byte ranges, and is given an access plan for every row group of each file, in the
//! order it reads them. The rows it reads are counted against the verdicts, and a scan that
//! ends with either left over fails the query rather than answer wrongly.
//!
//! A file the pages cannot answer for (a column missing from an older file, an encoding
//! [`super::pages`] does not read, a damaged chunk) is read as planned, with every column,
//! and its rows tested by the conjuncts themselves.

use super::pages::Bits;
use super::{Footer, Look, access, footer, in_range, read_ranges, scanned, test_row_group};
use arrow::array::{Array, AsArray, BooleanArray, RecordBatch, RecordBatchOptions};
use arrow::buffer::{BooleanBuffer, Buffer};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::{ParquetAccessPlan, RowGroupAccess};
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::{ExecutionPlan, SendableRecordBatchStream};
use futures::{Stream, StreamExt};
use std::sync::Arc;

/// The column of verdicts the prefilter adds to the scan's columns in exact mode.
pub const PASSES: &str = "__perch_prefilter_passes";

/// What exact mode reads with, besides the narrowed scan it runs.
#[derive(Debug)]
pub(super) struct Exact {
    /// The filter's scan as planned, with every column the filter reads: a file whose pages
    /// cannot be tested is read with it.
    pub full: Arc<dyn ExecutionPlan>,
    /// The tested conjuncts over `full`'s output, for such a file's rows.
    pub predicate: Arc<dyn PhysicalExpr>,
    /// The columns of `full`'s output that the narrowed scan outputs, in order.
    pub kept: Vec<usize>,
}

/// The narrowed scan's schema and the column of verdicts.
pub(super) fn schema(narrowed: &Schema) -> SchemaRef {
    let mut fields: Vec<Arc<Field>> = narrowed.fields().iter().cloned().collect();
    fields.push(Arc::new(Field::new(PASSES, DataType::Boolean, false)));
    Arc::new(Schema::new_with_metadata(
        fields,
        narrowed.metadata().clone(),
    ))
}

/// The access plan of every row group of `file` and the verdicts of the rows it reads, in
/// order; `None` where a row group that the partition reads could not be tested.
async fn file_mask(file: &PartitionedFile, look: &Look) -> Option<(ParquetAccessPlan, Bits)> {
    if file.extensions.get::<ParquetAccessPlan>().is_some() {
        return None;
    }
    let footer: Footer = footer(file, look).await?;
    let metadata = &footer.metadata;
    let scanned = scanned(file, &footer, look);
    let mut plan = ParquetAccessPlan::new_all(metadata.num_row_groups());
    let mut mask = Bits::default();
    for (g, group) in metadata.row_groups().iter().enumerate() {
        if group.num_columns() == 0 {
            return None;
        }
        if !in_range(file, group) {
            plan.skip(g);
            continue;
        }
        let ranges = match &scanned.inner()[g] {
            RowGroupAccess::Skip => {
                plan.skip(g);
                continue;
            }
            RowGroupAccess::Scan => None,
            RowGroupAccess::Selection(selection) => Some(read_ranges(selection)),
        };
        let rows = usize::try_from(group.num_rows()).ok()?;
        let passes = test_row_group(file, &footer, g, ranges.as_deref(), look, true).await?;
        look.counters.tested.add(rows);
        let (read, selected) = access(&passes, rows, look.min_run);
        look.counters.selected.add(selected);
        match &read {
            RowGroupAccess::Skip => {}
            RowGroupAccess::Scan => mask.append(&passes, 0, rows),
            RowGroupAccess::Selection(selection) => {
                for (start, end) in read_ranges(selection) {
                    mask.append(&passes, start, end);
                }
            }
        }
        plan.set(g, read);
    }
    Some((plan, mask))
}

/// Exact mode's stream for one partition: see the module's documentation. Files are tested
/// one at a time, each just before it is read, so a partition holds the verdicts of one file.
pub(super) fn execute(
    exact: &Arc<Exact>,
    narrowed: &FileScanConfig,
    files: Vec<PartitionedFile>,
    look: Look,
    schema: SchemaRef,
    context: Arc<TaskContext>,
) -> impl Stream<Item = Result<RecordBatch>> + Send + 'static {
    let exact = Arc::clone(exact);
    let narrowed = narrowed.clone();
    let look = Arc::new(look);
    futures::stream::iter(files)
        .then(move |file| {
            let (exact, narrowed, look) = (Arc::clone(&exact), narrowed.clone(), Arc::clone(&look));
            let (schema, context) = (Arc::clone(&schema), Arc::clone(&context));
            async move {
                let timer = look.counters.time.timer();
                let tested = file_mask(&file, &look).await;
                timer.done();
                let stream = match tested {
                    Some((plan, mask)) => {
                        let scan = scan_of(&narrowed, unranged(file, plan)).execute(0, context)?;
                        with_verdicts(scan, mask, schema).boxed()
                    }
                    None => {
                        look.counters.untested_files.add(1);
                        let full = super::scan_config(&exact.full).ok_or_else(|| {
                            DataFusionError::Internal("exact prefilter over no scan".into())
                        })?;
                        let scan = scan_of(full, file).execute(0, context)?;
                        scan.map(move |batch| tested_row_by_row(&batch?, &exact, &schema))
                            .boxed()
                    }
                };
                Ok::<_, DataFusionError>(stream)
            }
        })
        .map(|stream| match stream {
            Ok(s) => s,
            Err(e) => futures::stream::once(async move { Err(e) }).boxed(),
        })
        .flatten()
}

/// `file` read whole under `plan`, which skips the row groups outside its byte range.
fn unranged(mut file: PartitionedFile, plan: ParquetAccessPlan) -> PartitionedFile {
    file.range = None;
    file.with_extension(plan)
}

/// A scan of `config`'s kind over `file` alone, in one partition.
fn scan_of(config: &FileScanConfig, file: PartitionedFile) -> Arc<DataSourceExec> {
    let config = FileScanConfigBuilder::from(config.clone())
        .with_file_groups(vec![FileGroup::new(vec![file])])
        .build();
    DataSourceExec::from_data_source(config)
}

/// `scan`'s batches with the verdicts of their rows, taken from `mask` in order; an error
/// where the scan reads more or fewer rows than `mask` has verdicts for.
fn with_verdicts(
    scan: SendableRecordBatchStream,
    mask: Bits,
    schema: SchemaRef,
) -> impl Stream<Item = Result<RecordBatch>> + Send {
    let len = mask.len();
    let verdicts = BooleanBuffer::new(Buffer::from_vec(mask.into_words()), 0, len);
    futures::stream::unfold(Some((scan, 0usize)), move |state| {
        let (verdicts, schema) = (verdicts.clone(), Arc::clone(&schema));
        async move {
            let (mut scan, at) = state?;
            let misaligned = |read: usize| {
                DataFusionError::Internal(format!(
                    "the prefilter has verdicts for {len} rows, and the scan read {read}"
                ))
            };
            match scan.next().await {
                Some(Ok(batch)) => {
                    let rows = batch.num_rows();
                    if at + rows > len {
                        return Some((Err(misaligned(at + rows)), None));
                    }
                    let passes = BooleanArray::new(verdicts.slice(at, rows), None);
                    let mut columns = batch.columns().to_vec();
                    columns.push(Arc::new(passes));
                    let out = RecordBatch::try_new_with_options(
                        schema,
                        columns,
                        &RecordBatchOptions::new().with_row_count(Some(rows)),
                    )
                    .map_err(DataFusionError::from);
                    Some((out, Some((scan, at + rows))))
                }
                Some(Err(e)) => Some((Err(e), None)),
                None if at == len => None,
                None => Some((Err(misaligned(at)), None)),
            }
        }
    })
}

/// A batch of the full scan, narrowed, with the verdicts of the tested conjuncts.
fn tested_row_by_row(
    batch: &RecordBatch,
    exact: &Exact,
    schema: &SchemaRef,
) -> Result<RecordBatch> {
    let rows = batch.num_rows();
    let verdicts = exact.predicate.evaluate(batch)?.into_array(rows)?;
    let verdicts = verdicts.as_boolean_opt().ok_or_else(|| {
        DataFusionError::Internal("the prefilter's conjuncts gave no booleans".into())
    })?;
    // NULL is not kept.
    let passes = match verdicts.nulls() {
        Some(nulls) => verdicts.values() & nulls.inner(),
        None => verdicts.values().clone(),
    };
    let mut columns: Vec<Arc<dyn Array>> = exact
        .kept
        .iter()
        .map(|&i| Arc::clone(batch.column(i)))
        .collect();
    columns.push(Arc::new(BooleanArray::new(passes, None)));
    Ok(RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &RecordBatchOptions::new().with_row_count(Some(rows)),
    )?)
}
