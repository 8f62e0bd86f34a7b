//! Late materialization for a filter over the store's Parquet files: test the filter's own
//! columns first, straight from their pages, and decode the other columns only where the
//! filter may keep rows.
//!
//! DataFusion reads a Parquet scan in full and filters it after (`FilterExec`). Its row-level
//! pushdown (`pushdown_filters`) decodes the filter's columns first, but then reads the others
//! under the exact selection of kept rows, and telemetry filters keep rows in short runs
//! scattered through long stretches of rejected ones: `utilization > 90 AND memory > 60 GB`
//! keeps 4% of a week's rows in 575 K runs of about 2 rows, while 91% of the rows lie in
//! rejected runs of 1,024 rows or more (those GPUs were idle, or their jobs small). Under that
//! selection the Parquet reader either steps through every tiny run (slow per run) or decodes
//! everything and masks it (no saving): the pushdown gained nothing (BENCHMARKS.md).
//!
//! [`PrefilterExec`] sits between the `FilterExec` and its scan. For each row group of its
//! partition it tests the filter's comparisons of a column with a constant on the column's
//! pages ([`pages`]: once per dictionary entry, then an index lookup per row), exactly as
//! DataFusion's filter compares, and hands the scan a selection of the rows that pass: every
//! run of them, with the rejected runs shorter than [`MIN_SKIPPED_RUN`] read anyway, so the
//! selection is a few long runs to read and long runs to skip. The scan skips those runs
//! without decoding their values (whole pages where it can).
//!
//! Where nothing above the filter needs the tested columns (`utilization > 90` grouped by
//! GPU), the prefilter runs in exact mode ([`exact`]): the scan does not read those columns at
//! all, and the filter above keeps rows by the prefilter's verdicts. Otherwise the scan still
//! prunes by statistics and page index as before, and the `FilterExec` above applies the
//! whole filter to what was read; a conjunct the pages cannot be tested for (another shape, a
//! type or encoding they are not read in, a column missing from an older file) is left to it,
//! a row group that cannot be read at all is scanned whole, and a partition that keeps over
//! half of what it tests stops testing after a sample.

mod exact;
mod pages;

pub use exact::PASSES;

use arrow::datatypes::{Schema, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode, TreeNodeRecursion};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::physical_plan::parquet::{
    PagePruningAccessPlanFilter, ParquetAccessPlan, ParquetFileMetrics, RowGroupAccess,
    RowGroupAccessPlanFilter,
};
use datafusion::datasource::physical_plan::{
    FileGroup, FileScanConfig, FileScanConfigBuilder, FileSource, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::cache::cache_manager::FileMetadataCache;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::simplifier::PhysicalExprSimplifier;
use datafusion::physical_expr::{
    EquivalenceProperties, PhysicalExpr, conjunction, split_conjunction,
};
use datafusion::physical_expr_adapter::{
    DefaultPhysicalExprAdapterFactory, PhysicalExprAdapterFactory,
};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::pruning::PruningPredicateBuilder;
use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet, Time,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildStats, DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties,
    ReplaceChildrenOptions, SendableRecordBatchStream, Statistics, StatisticsArgs,
    replace_children_if_necessary,
};
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;
use pages::{Bits, Cmp, Constant};
use parquet::arrow::arrow_reader::{RowSelection, RowSelector};
use parquet::file::metadata::PageIndexPolicy;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

/// Rejected runs shorter than this are read anyway: skipping a run costs the reader about as
/// much as decoding a few hundred rows of it.
pub const MIN_SKIPPED_RUN: usize = 1024;

/// One of the filter's conjuncts that the pages can be tested for: `column cmp constant`.
#[derive(Debug, Clone, PartialEq)]
struct Test {
    column: String,
    cmp: Cmp,
    constant: Constant,
}

impl fmt::Display for Test {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.cmp {
            Cmp::Eq => "=",
            Cmp::NotEq => "!=",
            Cmp::Lt => "<",
            Cmp::LtEq => "<=",
            Cmp::Gt => ">",
            Cmp::GtEq => ">=",
        };
        let constant = match self.constant {
            Constant::Double(c) => c.to_string(),
            Constant::Float(c) => c.to_string(),
            Constant::Int64(c) => c.to_string(),
            Constant::Int32(c) => c.to_string(),
            Constant::UInt64(c) => c.to_string(),
            Constant::UInt32(c) => c.to_string(),
        };
        write!(f, "{} {op} {constant}", self.column)
    }
}

impl Test {
    /// `expr` as a test, where it compares a column with a non-NULL constant of the column's
    /// own type (in either order), of a type the pages can be read as.
    fn of(expr: &Arc<dyn PhysicalExpr>) -> Option<Self> {
        let (column, op, constant) = super::column_vs_constant(expr)?;
        let cmp = match op {
            Operator::Eq => Cmp::Eq,
            Operator::NotEq => Cmp::NotEq,
            Operator::Lt => Cmp::Lt,
            Operator::LtEq => Cmp::LtEq,
            Operator::Gt => Cmp::Gt,
            Operator::GtEq => Cmp::GtEq,
            _ => return None,
        };
        let constant = match constant {
            ScalarValue::Float64(Some(c)) => Constant::Double(*c),
            ScalarValue::Float32(Some(c)) => Constant::Float(*c),
            ScalarValue::Int64(Some(c)) => Constant::Int64(*c),
            ScalarValue::Int32(Some(c)) => Constant::Int32(*c),
            ScalarValue::UInt64(Some(c)) => Constant::UInt64(*c),
            ScalarValue::UInt32(Some(c)) => Constant::UInt32(*c),
            _ => return None,
        };
        Some(Self {
            column: column.name().to_owned(),
            cmp,
            constant,
        })
    }
}

/// Tests the filter's columns of each row group of its scan's partition before the scan
/// reads it, and gives the scan the runs of rows worth reading. See the module's
/// documentation.
#[derive(Debug)]
pub struct PrefilterExec {
    /// A `DataSourceExec` of Parquet files: in exact mode, the filter's scan without the
    /// columns only the tests read, and without a predicate.
    scan: Arc<dyn ExecutionPlan>,
    tests: Arc<[Test]>,
    /// The whole filter, to prune as the scan does: the row groups and pages it will skip (a
    /// dashboard's node and time range) are not worth testing.
    pruning: Arc<Pruning>,
    min_run: usize,
    exact: Option<Arc<exact::Exact>>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl PrefilterExec {
    fn new(
        scan: Arc<dyn ExecutionPlan>,
        tests: Arc<[Test]>,
        pruning: Arc<Pruning>,
        min_run: usize,
        exact: Option<Arc<exact::Exact>>,
    ) -> Self {
        let properties = match exact {
            None => Arc::clone(scan.properties()),
            // The scan's columns and order, and the verdicts after them.
            Some(_) => {
                let scan_properties = scan.properties();
                let orderings = scan_properties.output_ordering().cloned();
                Arc::new(PlanProperties::new(
                    EquivalenceProperties::new_with_orderings(
                        exact::schema(&scan.schema()),
                        orderings,
                    ),
                    scan_properties.output_partitioning().clone(),
                    scan_properties.emission_type,
                    scan_properties.boundedness,
                ))
            }
        };
        Self {
            scan,
            tests,
            pruning,
            min_run,
            exact,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    fn with_scan(&self, scan: Arc<dyn ExecutionPlan>) -> Self {
        Self::new(
            scan,
            self.tests.clone(),
            self.pruning.clone(),
            self.min_run,
            self.exact.clone(),
        )
    }
}

impl DisplayAs for PrefilterExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tests: Vec<String> = self.tests.iter().map(Test::to_string).collect();
        write!(
            f,
            "PrefilterExec: tests=[{}]{}, skips rejected runs of {}+ rows",
            tests.join(", "),
            if self.exact.is_some() {
                ", exact (the scan reads no tested-only column)"
            } else {
                ""
            },
            self.min_run
        )
    }
}

impl ExecutionPlan for PrefilterExec {
    fn name(&self) -> &str {
        "PrefilterExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.scan]
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [scan] = <[_; 1]>::try_from(children).map_err(|c| {
            DataFusionError::Internal(format!("PrefilterExec has one child, not {}", c.len()))
        })?;
        Ok(Arc::new(self.with_scan(scan)))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(
                datafusion::physical_plan::ChildrenPropertiesMode::Recompute,
            ),
        )
    }

    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(self.with_scan(self.scan.clone())))
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        // Its tests are copies of the filter's conjuncts, held as data, not expressions.
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        // The same rows come out as from the scan alone, once the filter above has run.
        Ok(input_stats
            .first()
            .filter(|_| self.exact.is_none())
            .cloned()
            .unwrap_or_else(|| Arc::new(Statistics::new_unknown(&self.schema()))))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let config = scan_config(&self.scan)
            .ok_or_else(|| DataFusionError::Internal("PrefilterExec over no Parquet scan".into()))?
            .clone();
        // In exact mode the full scan's groups: the same files as the narrowed one's.
        let groups = match &self.exact {
            Some(exact) => {
                &scan_config(&exact.full)
                    .ok_or_else(|| DataFusionError::Internal("PrefilterExec over no scan".into()))?
                    .file_groups
            }
            None => &config.file_groups,
        };
        let files = groups
            .get(partition)
            .ok_or_else(|| {
                DataFusionError::Internal(format!("PrefilterExec has no partition {partition}"))
            })?
            .files()
            .to_vec();
        let runtime = context.runtime_env();
        let look = Look {
            store: runtime.object_store(&config.object_store_url)?,
            cache: runtime.cache_manager.get_file_metadata_cache(),
            tests: self.tests.clone(),
            pruning: self.pruning.clone(),
            min_run: self.min_run,
            counters: Counters {
                tested: MetricBuilder::new(&self.metrics).counter("rows_tested", partition),
                selected: MetricBuilder::new(&self.metrics).counter("rows_selected", partition),
                time: MetricBuilder::new(&self.metrics).subset_time("prefilter_time", partition),
                untested_files: MetricBuilder::new(&self.metrics)
                    .counter("files_read_whole", partition),
            },
        };
        let schema: SchemaRef = self.schema();
        if let Some(exact) = &self.exact {
            let stream = exact::execute(exact, &config, files, look, schema.clone(), context);
            return Ok(Box::pin(RecordBatchStreamAdapter::new(
                schema,
                stream.boxed(),
            )));
        }
        let stream = futures::stream::once(async move {
            let mut planned = Vec::with_capacity(files.len());
            let mut so_far = SoFar::default();
            for file in files {
                let timer = look.counters.time.timer();
                let plan = if so_far.worth_it() {
                    access_plan(&file, &look, &mut so_far).await
                } else {
                    None
                };
                timer.done();
                planned.push(match plan {
                    Some(plan) => file.with_extension(plan),
                    None => file,
                });
            }
            // A scan of this partition's files alone: DataFusion's partitions of one scan
            // share their files' work, so a scan of every group would read the others' too.
            let config = FileScanConfigBuilder::from(config)
                .with_file_groups(vec![FileGroup::new(planned)])
                .build();
            DataSourceExec::from_data_source(config).execute(0, context)
        })
        .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream.boxed(),
        )))
    }
}

/// What the tests have saved so far in a partition. Where the filter keeps rows all through
/// the data (`utilization < 1` of GPUs that idle a moment here and there), testing costs more
/// than the rows it lets the scan skip, and a partition stops testing after a fair sample.
#[derive(Default)]
struct SoFar {
    tested: usize,
    selected: usize,
}

impl SoFar {
    /// Rows tested before judging: a row group as the store writes them.
    const SAMPLE: usize = 1 << 20;

    fn worth_it(&self) -> bool {
        self.tested < Self::SAMPLE || self.selected * 2 <= self.tested
    }
}

/// What the tests read with and how.
struct Look {
    store: Arc<dyn ObjectStore>,
    cache: Arc<FileMetadataCache>,
    tests: Arc<[Test]>,
    pruning: Arc<Pruning>,
    min_run: usize,
    counters: Counters,
}

#[derive(Clone)]
struct Counters {
    tested: Count,
    selected: Count,
    time: Time,
    /// Exact mode: files (or byte ranges of them) whose pages could not be tested, read with
    /// every column and tested row by row.
    untested_files: Count,
}

fn scan_config(plan: &Arc<dyn ExecutionPlan>) -> Option<&FileScanConfig> {
    plan.downcast_ref::<DataSourceExec>()?
        .data_source()
        .downcast_ref::<FileScanConfig>()
}

/// A file's footer, read through the session's metadata cache with its page index where it
/// has one; and the leaf column of each test, where the file has that column.
struct Footer {
    metadata: Arc<parquet::file::metadata::ParquetMetaData>,
    leaves: Vec<Option<usize>>,
}

async fn footer(file: &PartitionedFile, look: &Look) -> Option<Footer> {
    let metadata = DFParquetMetadata::new(look.store.as_ref(), &file.object_meta)
        .with_file_metadata_cache(Some(look.cache.clone()))
        .with_page_index_policy(Some(PageIndexPolicy::Optional))
        .fetch_metadata()
        .await
        .ok()?;
    let schema = metadata.file_metadata().schema_descr();
    let leaves = look
        .tests
        .iter()
        .map(|t| {
            (0..schema.num_columns())
                .find(|&i| schema.column(i).path().parts() == [t.column.as_str()])
        })
        .collect();
    Some(Footer { metadata, leaves })
}

/// A filter over the scan's output, for pruning a file as the scan prunes it.
#[derive(Debug)]
struct Pruning {
    filter: Arc<dyn PhysicalExpr>,
    schema: SchemaRef,
}

impl Pruning {
    /// The filter rewritten onto `file`'s own columns, by DataFusion's expression adapter and
    /// simplifier, as the scan's opener rewrites its predicate (DataFusion's pruning finds
    /// statistics, and checks types, by the file schema's column indices): columns found by
    /// name, casts inserted where the file's type differs, a missing column a NULL. `None`
    /// where it cannot be rewritten (the file is then pruned by nothing).
    fn on_file(&self, file: &SchemaRef) -> Option<Arc<dyn PhysicalExpr>> {
        let rewriter = DefaultPhysicalExprAdapterFactory
            .create(Arc::clone(&self.schema), Arc::clone(file))
            .ok()?;
        let rewritten = rewriter.rewrite(Arc::clone(&self.filter)).ok()?;
        PhysicalExprSimplifier::new(file).simplify(rewritten).ok()
    }
}

/// What the scan reads of each row group of `footer`'s file, as it prunes with the filter:
/// row groups by statistics, then pages by the page index, with the filter rewritten onto
/// the file's own columns as the scan's opener does (the scan's output may be fewer columns,
/// or in another order). A file whose schema cannot be read is pruned by nothing.
fn scanned(file: &PartitionedFile, footer: &Footer, look: &Look) -> ParquetAccessPlan {
    let metadata = &footer.metadata;
    let schema = metadata.file_metadata().schema_descr();
    let mut scanned = ParquetAccessPlan::new_all(metadata.num_row_groups());
    let Ok(file_schema) = parquet::arrow::parquet_to_arrow_schema(
        schema,
        metadata.file_metadata().key_value_metadata(),
    ) else {
        return scanned;
    };
    let file_schema = Arc::new(file_schema);
    let Some(filter) = look.pruning.on_file(&file_schema) else {
        return scanned;
    };
    let unseen = ExecutionPlanMetricsSet::new();
    let metrics = ParquetFileMetrics::new(0, file.object_meta.location.as_ref(), &unseen);
    if let Ok(predicate) = PruningPredicateBuilder::new()
        .with_file_schema(Arc::clone(&file_schema))
        .try_build(Arc::clone(&filter))
        && !predicate.always_true()
    {
        let mut row_groups = RowGroupAccessPlanFilter::new(scanned);
        row_groups.prune_by_statistics(
            &file_schema,
            schema,
            metadata.row_groups(),
            &predicate,
            &metrics,
        );
        scanned = row_groups.build();
    }
    let pages = PagePruningAccessPlanFilter::new(&filter, Arc::clone(&file_schema));
    if pages.filter_number() > 0 && metadata.offset_index().is_some() {
        scanned =
            pages.prune_plan_with_page_index(scanned, &file_schema, schema, metadata, &metrics);
    }
    scanned
}

/// The row ranges the scan reads of a row group, `None` where it reads all of it.
fn read_ranges(selection: &RowSelection) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    let mut at = 0;
    for s in Vec::<RowSelector>::from(selection.clone()) {
        if !s.skip {
            ranges.push((at, at + s.row_count));
        }
        at += s.row_count;
    }
    ranges
}

/// Whether row group `g` of the file is in `file`'s byte range (DataFusion's rule: where its
/// first page is), or the file is read whole.
fn in_range(file: &PartitionedFile, group: &parquet::file::metadata::RowGroupMetaData) -> bool {
    let Some(range) = &file.range else {
        return true;
    };
    let first = group.column(0);
    let offset = first
        .dictionary_page_offset()
        .unwrap_or_else(|| first.data_page_offset());
    range.contains(offset)
}

/// The rows of row group `g` that pass every test of a column the file has, read from their
/// pages; rows outside `ranges` (what the scan reads of it) left out. `None` where no test
/// could be read; `exact` asks for every test to be read, or `None`.
async fn test_row_group(
    file: &PartitionedFile,
    footer: &Footer,
    g: usize,
    ranges: Option<&[(usize, usize)]>,
    look: &Look,
    exact: bool,
) -> Option<Bits> {
    let group = footer.metadata.row_group(g);
    let rows = usize::try_from(group.num_rows()).ok()?;
    let mut kept: Option<Bits> = None;
    for (&leaf, test) in footer.leaves.iter().zip(look.tests.iter()) {
        let Some(leaf) = leaf else {
            if exact {
                return None;
            }
            continue;
        };
        let chunk = group.column(leaf);
        let (start, len) = chunk.byte_range();
        let read = async {
            let bytes = look
                .store
                .get_range(&file.object_meta.location, start..start.checked_add(len)?)
                .await
                .ok()?;
            let locations = footer
                .metadata
                .offset_index()
                .and_then(|index| index.get(g)?.get(leaf))
                .map(|index| index.page_locations().as_slice());
            pages::chunk_rows(
                bytes,
                chunk,
                rows,
                test.cmp,
                test.constant,
                locations.zip(ranges),
            )
            .filter(|bits| bits.len() == rows)
        };
        let Some(rows_kept) = read.await else {
            if exact {
                return None;
            }
            continue;
        };
        match &mut kept {
            Some(k) => k.and(&rows_kept),
            None => kept = Some(rows_kept),
        }
        if kept.as_ref().is_some_and(Bits::none) {
            break;
        }
    }
    kept
}

/// The rows of `file` worth reading, by row group; `None` where nothing could be tested (the
/// file is read as it would have been). A failure to read or decode only means reading more.
async fn access_plan(
    file: &PartitionedFile,
    look: &Look,
    so_far: &mut SoFar,
) -> Option<ParquetAccessPlan> {
    if file.extensions.get::<ParquetAccessPlan>().is_some() {
        return None;
    }
    let footer = footer(file, look).await?;
    if footer.leaves.iter().all(Option::is_none) {
        return None;
    }
    let metadata = &footer.metadata;
    let mut plan = ParquetAccessPlan::new_all(metadata.num_row_groups());
    let scanned = scanned(file, &footer, look);
    let mut changed = false;
    for (g, group) in metadata.row_groups().iter().enumerate() {
        if group.num_columns() == 0 || !so_far.worth_it() {
            continue;
        }
        let Ok(rows) = usize::try_from(group.num_rows()) else {
            continue;
        };
        // The row ranges the scan reads, or nothing where it reads the whole row group.
        let ranges = match &scanned.inner()[g] {
            RowGroupAccess::Skip => continue,
            RowGroupAccess::Scan => None,
            RowGroupAccess::Selection(selection) => Some(read_ranges(selection)),
        };
        // Where the page index leaves the scan little to read, testing costs more than it
        // could save (a dashboard's few minutes of one GPU).
        if ranges
            .as_ref()
            .is_some_and(|r| r.iter().map(|(s, e)| e - s).sum::<usize>() < rows / 8)
        {
            continue;
        }
        // Only the row groups this partition's byte range reads; the others are left for
        // the range to skip.
        if !in_range(file, group) {
            continue;
        }
        let Some(kept) = test_row_group(file, &footer, g, ranges.as_deref(), look, false).await
        else {
            continue;
        };
        look.counters.tested.add(rows);
        let (access, selected) = access(&kept, rows, look.min_run);
        look.counters.selected.add(selected);
        so_far.tested += rows;
        so_far.selected += selected;
        plan.set(g, access);
        changed = true;
    }
    changed.then_some(plan)
}

/// How to read a row group of `rows` rows of which `kept` may pass: the runs of them, joined
/// across rejected runs shorter than `min_run` rows; and how many rows that reads.
fn access(kept: &Bits, rows: usize, min_run: usize) -> (RowGroupAccess, usize) {
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for (start, end) in kept.runs() {
        match spans.last_mut() {
            Some(last) if start - last.1 < min_run => last.1 = end,
            Some(_) => spans.push((start, end)),
            // A rejected run at the start, too short to skip, is read with the first.
            None => spans.push((if start < min_run { 0 } else { start }, end)),
        }
    }
    if let Some(last) = spans.last_mut()
        && rows - last.1 < min_run
    {
        last.1 = rows;
    }
    let selected = spans.iter().map(|(s, e)| e - s).sum();
    if spans.is_empty() {
        return (RowGroupAccess::Skip, 0);
    }
    // Reading half a row group or more run by run costs more than reading all of it.
    if spans == [(0, rows)] || selected > rows / 2 {
        return (RowGroupAccess::Scan, rows);
    }
    let mut selectors = Vec::with_capacity(spans.len() * 2 + 1);
    let mut at = 0;
    for (start, end) in spans {
        if start > at {
            selectors.push(RowSelector::skip(start - at));
        }
        selectors.push(RowSelector::select(end - start));
        at = end;
    }
    if rows > at {
        selectors.push(RowSelector::skip(rows - at));
    }
    (
        RowGroupAccess::Selection(RowSelection::from(selectors)),
        selected,
    )
}

/// Puts a [`PrefilterExec`] between each `FilterExec` and the Parquet scan right under it,
/// where the filter has conjuncts the pages can be tested for and the scan outputs columns
/// the filter does not read (those are what is saved). See the module's documentation.
#[derive(Debug, Default)]
pub struct PrefilterRule;

impl PhysicalOptimizerRule for PrefilterRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        super::replace_nodes::<FilterExec>(plan, prefiltered)
    }

    fn name(&self) -> &str {
        "perch_prefilter"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

fn prefiltered(filter: &FilterExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let scan = filter.input();
    let Some(config) = scan_config(scan) else {
        return Ok(None);
    };
    let Some(source) = config.file_source().downcast_ref::<ParquetSource>() else {
        return Ok(None);
    };
    if source.table_parquet_options().global.pushdown_filters || config.limit.is_some() {
        return Ok(None);
    }
    // The conjuncts over the scan's own output columns, named as in the files.
    let (tested, rest): (Vec<_>, Vec<_>) = split_conjunction(filter.predicate())
        .into_iter()
        .map(|c| {
            let test = Test::of(c).filter(|t| {
                config
                    .table_partition_cols()
                    .iter()
                    .all(|p| p.name() != &t.column)
            });
            (c, test)
        })
        .partition(|(_, t)| t.is_some());
    let tests: Vec<Test> = tested.iter().filter_map(|(_, t)| t.clone()).collect();
    if tests.is_empty() {
        return Ok(None);
    }
    let pruning = Arc::new(Pruning {
        filter: Arc::clone(filter.predicate()),
        schema: scan.schema(),
    });
    let tested: Vec<Arc<dyn PhysicalExpr>> = tested.into_iter().map(|(c, _)| c.clone()).collect();
    let rest: Vec<Arc<dyn PhysicalExpr>> = rest.into_iter().map(|(c, _)| c.clone()).collect();
    let prefilter = |scan, exact| {
        Arc::new(PrefilterExec::new(
            scan,
            tests.clone().into(),
            pruning.clone(),
            MIN_SKIPPED_RUN,
            exact,
        ))
    };
    if let Some(plan) = exactly(filter, config, source, tested, &rest, prefilter)? {
        return Ok(Some(plan));
    }
    let read_by_filter = columns(filter.predicate());
    if scan
        .schema()
        .fields()
        .iter()
        .all(|f| read_by_filter.contains(f.name().as_str()))
    {
        return Ok(None);
    }
    let prefilter: Arc<dyn ExecutionPlan> = prefilter(scan.clone(), None);
    Ok(Some(replace_children_if_necessary(
        Arc::new(filter.clone()),
        vec![prefilter],
    )?))
}

/// The filter in exact mode, where the tested conjuncts read columns nothing above the filter
/// needs (`exact`'s documentation): the scan without those columns and without a predicate,
/// the prefilter with its verdicts, and the filter on the verdicts and the untested
/// conjuncts. `None` where every column is needed, or the scan's output is not plain columns.
fn exactly(
    filter: &FilterExec,
    config: &FileScanConfig,
    source: &ParquetSource,
    tested: Vec<Arc<dyn PhysicalExpr>>,
    rest: &[Arc<dyn PhysicalExpr>],
    prefilter: impl Fn(Arc<dyn ExecutionPlan>, Option<Arc<exact::Exact>>) -> Arc<PrefilterExec>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let scan = filter.input();
    let schema = scan.schema();
    let Some(output) = filter.projection() else {
        return Ok(None);
    };
    let mut needed: HashSet<String> = rest.iter().flat_map(columns).collect();
    needed.extend(output.iter().map(|&i| schema.field(i).name().clone()));
    let kept: Vec<usize> = (0..schema.fields().len())
        .filter(|&i| needed.contains(schema.field(i).name()))
        .collect();
    // A column of the verdicts' name (no table of the store has one) would be found in its
    // place.
    if kept.len() == schema.fields().len() || schema.field_with_name(PASSES).is_ok() {
        return Ok(None);
    }
    // The scan's output columns as the table's.
    let Some(projection) = source.projection() else {
        return Ok(None);
    };
    let Some(table_columns) = projection
        .iter()
        .map(|p| p.expr.downcast_ref::<Column>().map(Column::index))
        .collect::<Option<Vec<usize>>>()
    else {
        return Ok(None);
    };
    if table_columns.len() != schema.fields().len() {
        return Ok(None);
    }
    let mut unfiltered = ParquetSource::new(source.table_schema().clone())
        .with_table_parquet_options(source.table_parquet_options().clone());
    if let Some(factory) = source.parquet_file_reader_factory() {
        unfiltered = unfiltered.with_parquet_file_reader_factory(Arc::clone(factory));
    }
    let narrowed = FileScanConfigBuilder::from(config.clone())
        .with_source(Arc::new(unfiltered))
        .with_projection_indices(Some(kept.iter().map(|&i| table_columns[i]).collect()))?
        .build();
    let narrowed: Arc<dyn ExecutionPlan> = DataSourceExec::from_data_source(narrowed);
    let names = |s: &Schema, at: &[usize]| -> Vec<String> {
        at.iter().map(|&i| s.field(i).name().clone()).collect()
    };
    if names(&narrowed.schema(), &(0..kept.len()).collect::<Vec<_>>()) != names(&schema, &kept) {
        return Ok(None);
    }
    let exact = exact::Exact {
        full: Arc::clone(scan),
        predicate: conjunction(tested),
        kept: kept.clone(),
    };
    let prefilter = prefilter(narrowed, Some(Arc::new(exact)));
    let out = prefilter.schema();
    // The filter's columns, found by name in the prefilter's output.
    let renamed = |expr: &Arc<dyn PhysicalExpr>| -> Result<Arc<dyn PhysicalExpr>> {
        Arc::clone(expr)
            .transform(|e| {
                Ok(match e.downcast_ref::<Column>() {
                    Some(c) => {
                        Transformed::yes(Arc::new(Column::new(c.name(), out.index_of(c.name())?))
                            as Arc<dyn PhysicalExpr>)
                    }
                    None => Transformed::no(e),
                })
            })
            .data()
    };
    let passes: Arc<dyn PhysicalExpr> = Arc::new(Column::new(PASSES, kept.len()));
    let predicate = conjunction(
        std::iter::once(Ok(passes))
            .chain(rest.iter().map(renamed))
            .collect::<Result<Vec<_>>>()?,
    );
    let projection = output
        .iter()
        .map(|&i| out.index_of(schema.field(i).name()))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let filter = FilterExecBuilder::new(predicate, prefilter)
        .with_default_selectivity(filter.default_selectivity())
        .with_batch_size(filter.batch_size())
        .with_fetch(filter.fetch())
        .apply_projection(Some(projection))?
        .build()?;
    Ok(Some(Arc::new(filter)))
}

/// Names of the columns `expr` reads.
fn columns(expr: &Arc<dyn PhysicalExpr>) -> HashSet<String> {
    let mut names = HashSet::new();
    let _ = expr.apply(|e| {
        if let Some(c) = e.downcast_ref::<Column>() {
            names.insert(c.name().to_owned());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        ArrayRef, Float64Array, Int32Array, RecordBatch, StringArray, TimestampMillisecondArray,
    };
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::prelude::{SessionConfig, SessionContext};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;
    use parquet::schema::types::ColumnPath;

    /// 4 nodes x 4 GPUs x 3,000 samples, sorted by node, GPU and time as the store writes
    /// them: GPUs busy in long jobs (utilization 91 to 100) between long idle stretches, with
    /// a busy moment here and there, a few NULLs and a NaN.
    fn samples(path: &std::path::Path) {
        samples_as(path, Layout::Store);
    }

    /// How a file of samples is written.
    #[derive(Clone, Copy, PartialEq)]
    enum Layout {
        /// As the store writes them: dictionaries, PLAIN where they overflow.
        Store,
        /// `util` in BYTE_STREAM_SPLIT, an encoding the pages are not read in.
        SplitUtil,
        /// Without a `util` column (a file written before it was added).
        NoUtil,
    }

    fn samples_as(path: &std::path::Path, layout: Layout) {
        let (mut node, mut gpu, mut util, mut power) = (vec![], vec![], vec![], vec![]);
        let mut time = vec![];
        for n in 0..4 {
            for g in 0..4i32 {
                for t in 0..3_000i32 {
                    node.push(format!("node-{n}"));
                    gpu.push(g);
                    // Every 10 s from 2025-06-08 00:00 UTC.
                    time.push(1_749_340_800_000 + i64::from(t) * 10_000);
                    let busy = (t / 700 + g + n) % 5 == 0;
                    util.push(match t {
                        _ if t % 1_009 == 0 => None,
                        _ if t == 1_500 && g == 2 => Some(f64::NAN),
                        _ if busy => Some(91.0 + f64::from(t % 10)),
                        _ if t % 1_999 == 0 => Some(95.0),
                        _ => Some(f64::from(t % 5)),
                    });
                    power.push(100.0 + f64::from(t % 300) + f64::from(n * 10 + g));
                }
            }
        }
        let mut columns = vec![
            ("node", Arc::new(StringArray::from(node)) as ArrayRef),
            ("gpu", Arc::new(Int32Array::from(gpu))),
            ("util", Arc::new(Float64Array::from(util))),
            ("power", Arc::new(Float64Array::from(power))),
            (
                "time",
                Arc::new(TimestampMillisecondArray::from(time).with_timezone("UTC")),
            ),
        ];
        if layout == Layout::NoUtil {
            columns.remove(2);
        }
        let batch = RecordBatch::try_from_iter(columns).expect("batch");
        let mut props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(10_000))
            .set_data_page_row_count_limit(1_000)
            .set_write_batch_size(1_000)
            // As the store writes `time`.
            .set_column_dictionary_enabled(ColumnPath::from("time"), false)
            .set_column_encoding(
                ColumnPath::from("time"),
                parquet::basic::Encoding::DELTA_BINARY_PACKED,
            );
        if layout == Layout::SplitUtil {
            let util = ColumnPath::from("util");
            props = props
                .set_column_dictionary_enabled(util.clone(), false)
                .set_column_encoding(util, parquet::basic::Encoding::BYTE_STREAM_SPLIT);
        }
        let props = props.build();
        let file = std::fs::File::create(path).expect("create");
        let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(props)).expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
    }

    fn session(prefilter: bool) -> SessionContext {
        let rules = crate::optimizer::physical_optimizer_rules()
            .into_iter()
            .filter(|r| prefilter || r.name() != "perch_prefilter")
            .collect();
        let config = SessionConfig::new()
            .with_target_partitions(2)
            .with_repartition_file_min_size(1);
        SessionContext::new_with_state(
            SessionStateBuilder::new()
                .with_config(config)
                .with_default_features()
                .with_physical_optimizer_rules(rules)
                .build(),
        )
    }

    async fn answer(ctx: &SessionContext, sql: &str) -> String {
        let batches = ctx
            .sql(sql)
            .await
            .expect("plan")
            .collect()
            .await
            .expect("run");
        pretty_format_batches(&batches).expect("format").to_string()
    }

    /// Filters answer the same with and without the prefilter, in exact mode and not:
    /// selective and not, on both sides of a constant, with NULLs and NaN in the column, a
    /// conjunct it cannot test, and the file split between two partitions by byte range. And
    /// over a table of three files whose second cannot be tested on its pages (`util` in an
    /// encoding they are not read in) and whose third has no `util` column, which exact mode
    /// reads whole and tests row by row, between files it tested.
    #[tokio::test]
    async fn answers_do_not_change() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("samples.parquet");
        samples(&path);
        let mixed = dir.path().join("mixed");
        std::fs::create_dir(&mixed).expect("dir");
        samples_as(&mixed.join("1.parquet"), Layout::Store);
        samples_as(&mixed.join("2.parquet"), Layout::SplitUtil);
        samples_as(&mixed.join("3.parquet"), Layout::NoUtil);
        samples_as(&mixed.join("4.parquet"), Layout::Store);
        let queries = [
            "SELECT node, gpu, count(*) AS n, sum(power) AS p FROM s WHERE util > 90 GROUP BY node, gpu ORDER BY node, gpu",
            "SELECT node, count(*) AS n, max(power) AS p FROM s WHERE util > 90 AND power > 250 GROUP BY node ORDER BY node",
            "SELECT node, count(DISTINCT gpu) AS g FROM s WHERE util < 1 GROUP BY node ORDER BY node",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE util >= 95 AND node <> 'node-1'",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE 93 = util",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE util != 0",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE gpu = 2 AND util <= 4",
            "SELECT count(*) AS n FROM s WHERE util > 1000",
            "SELECT node, gpu, power FROM s WHERE util > 99 AND gpu = 3 ORDER BY node, power LIMIT 5",
            // Pages of GPUs 0 and 1 are pruned by the page index, in the test too.
            "SELECT node, gpu, count(*) AS n, sum(power) AS p FROM s WHERE gpu >= 2 AND util > 90 GROUP BY node, gpu ORDER BY node, gpu",
            "SELECT node, count(*) AS n, sum(power) AS p FROM s WHERE node = 'node-2' AND util < 2 GROUP BY node",
            // Constants a careless or hostile user may write: NaN sorts above every number.
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE util > 'NaN'::double",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE util = 'NaN'::double",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE util >= 'NaN'::double",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE util < '-Infinity'::double",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE util <= -0.0",
            // No column read but the tested one: exact mode reads none.
            "SELECT count(*) AS n FROM s WHERE util > 90",
            // The tested column is an output: the scan reads it, the filter tests it again.
            "SELECT node, gpu, util, power FROM s WHERE util > 98 ORDER BY node, gpu, power, util",
            // Time windows inside each series (pages span several), alone and with a test.
            "SELECT node, gpu, count(*) AS n, sum(power) AS p FROM s WHERE time >= TIMESTAMP '2025-06-08 08:00:00' GROUP BY node, gpu ORDER BY node, gpu",
            "SELECT count(*) AS n, sum(power) AS p FROM s WHERE time >= TIMESTAMP '2025-06-08 02:00:00' AND time < TIMESTAMP '2025-06-08 03:00:00' AND util > 90",
            "SELECT node, gpu, max(time) AS t, min(time) AS f, count(*) AS n FROM s WHERE time > to_timestamp_millis(1749350000000) GROUP BY node, gpu ORDER BY node, gpu",
            "SELECT node, gpu, time, util FROM (SELECT node, gpu, time, util, row_number() OVER (PARTITION BY node, gpu ORDER BY time DESC, util DESC NULLS LAST) AS newest FROM s WHERE time >= TIMESTAMP '2025-06-08 08:00:00') WHERE newest = 1 ORDER BY node, gpu",
            "SELECT count(*) AS n FROM s WHERE time <= TIMESTAMP '2025-06-08 00:00:00'",
            "SELECT count(*) AS n FROM s WHERE time = TIMESTAMP '2025-06-08 01:00:00+00:00'",
            "SELECT count(*) AS n FROM s WHERE time != TIMESTAMP '2025-06-08 01:00:00' AND time > TIMESTAMP '1970-01-01 00:00:00'",
        ];
        let with = session(true);
        let without = session(false);
        for ctx in [&with, &without] {
            ctx.register_parquet("s", path.to_str().expect("utf-8"), Default::default())
                .await
                .expect("register");
            let mixed = format!("{}/", mixed.to_str().expect("utf-8"));
            ctx.register_parquet("m", &mixed, Default::default())
                .await
                .expect("register");
        }
        for sql in queries {
            for sql in [sql.to_owned(), sql.replace("FROM s ", "FROM m ")] {
                assert_eq!(
                    answer(&with, &sql).await,
                    answer(&without, &sql).await,
                    "{sql}"
                );
            }
        }
        // Exact mode over the mixed table: the files it could not test (the one in
        // BYTE_STREAM_SPLIT, split in two ranges, and the one without `util`) were read whole.
        let explained = answer(
            &with,
            &format!(
                "EXPLAIN ANALYZE {}",
                queries[0].replace("FROM s ", "FROM m ")
            ),
        )
        .await;
        let line = explained
            .lines()
            .find(|l| l.contains("PrefilterExec"))
            .unwrap_or_else(|| panic!("no prefilter in {explained}"));
        assert!(
            line.contains("exact") && line.contains("files_read_whole=3"),
            "{line}"
        );
        // The selective one is prefiltered, and reads only part of the file.
        let explained = answer(&with, &format!("EXPLAIN ANALYZE {}", queries[0])).await;
        let line = explained
            .lines()
            .find(|l| l.contains("PrefilterExec"))
            .unwrap_or_else(|| panic!("no prefilter in {explained}"));
        let metric = |name: &str| -> f64 {
            let shown = line
                .split(&format!("{name}="))
                .nth(1)
                .and_then(|r| r.split([',', ']']).next())
                .unwrap_or_else(|| panic!("{name} in {line}"));
            let (number, scale) = match shown.split_once(' ') {
                Some((n, "K")) => (n, 1e3),
                Some((n, "M")) => (n, 1e6),
                _ => (shown, 1.0),
            };
            number
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("{name} in {line}"))
                * scale
        };
        assert_eq!(metric("rows_tested"), 48_000.0, "{line}");
        let selected = metric("rows_selected");
        assert!(selected > 0.0 && selected < 30_000.0, "{line}");
    }

    /// No prefilter where the filter reads every column the scan outputs and needs them all
    /// after (nothing to skip), nor where no conjunct compares a column with a constant.
    /// Exact mode where the tested columns are needed only by the filter.
    #[tokio::test]
    async fn only_where_it_can_save() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("samples.parquet");
        samples(&path);
        let ctx = session(true);
        ctx.register_parquet("s", path.to_str().expect("utf-8"), Default::default())
            .await
            .expect("register");
        for (sql, expected) in [
            ("SELECT sum(util) FROM s WHERE util > 90", None),
            ("SELECT sum(power) FROM s WHERE util + 1 > power", None),
            ("SELECT sum(power) FROM s WHERE node = 'node-1'", None),
            ("SELECT util, power FROM s WHERE util > 90", Some(false)),
            ("SELECT count(*) FROM s WHERE util > 90", Some(true)),
            ("SELECT sum(power) FROM s WHERE util > 90", Some(true)),
            (
                "SELECT sum(util) FROM s WHERE util > 90 AND gpu = 1",
                Some(true),
            ),
        ] {
            let plan = answer(&ctx, &format!("EXPLAIN {sql}")).await;
            let found = plan
                .lines()
                .find(|l| l.contains("PrefilterExec"))
                .map(|l| l.contains("exact"));
            assert_eq!(found, expected, "{sql}: {plan}");
        }
    }

    /// A table with a column of the verdicts' name (no table of the store has one, a foreign
    /// file might) is not run in exact mode, where that name would be found in the verdicts'
    /// place; its answers do not change.
    #[tokio::test]
    async fn a_column_named_like_the_verdicts_is_left_alone() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("odd.parquet");
        let rows = 5_000;
        let batch = RecordBatch::try_from_iter([
            (
                "util",
                Arc::new(Float64Array::from_iter_values(
                    (0..rows).map(|i| f64::from(i % 100)),
                )) as ArrayRef,
            ),
            (
                PASSES,
                Arc::new(Int32Array::from_iter_values((0..rows).map(|i| i % 7))),
            ),
        ])
        .expect("batch");
        let file = std::fs::File::create(&path).expect("create");
        let mut writer = ArrowWriter::try_new(file, batch.schema(), None).expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
        let sql = format!("SELECT count(*) AS n, sum({PASSES}) AS s FROM t WHERE util > 90");
        let with = session(true);
        let without = session(false);
        for ctx in [&with, &without] {
            ctx.register_parquet("t", path.to_str().expect("utf-8"), Default::default())
                .await
                .expect("register");
        }
        assert_eq!(answer(&with, &sql).await, answer(&without, &sql).await);
        let plan = answer(&with, &format!("EXPLAIN {sql}")).await;
        assert!(!plan.contains("exact"), "{plan}");
    }

    #[test]
    fn access_joins_short_gaps_and_skips_long_ones() {
        let bits = |runs: &[(usize, usize)], rows: usize| {
            let mut b = Bits::default();
            let mut at = 0;
            for &(s, e) in runs {
                b.push_n(false, s - at);
                b.push_n(true, e - s);
                at = e;
            }
            b.push_n(false, rows - at);
            b
        };
        let selection = |access: RowGroupAccess| match access {
            RowGroupAccess::Selection(s) => Vec::<RowSelector>::from(s.clone()),
            other => panic!("{other:?}"),
        };
        // Nothing kept: skipped whole.
        assert!(matches!(
            access(&bits(&[], 10_000), 10_000, 1_024).0,
            RowGroupAccess::Skip
        ));
        // Short gaps, and short runs at the edges, are read.
        let (a, selected) = access(
            &bits(
                &[(500, 510), (1_000, 1_010), (5_000, 5_001), (9_500, 9_501)],
                10_000,
            ),
            10_000,
            1_024,
        );
        assert_eq!(
            selection(a),
            vec![
                RowSelector::select(1_010),
                RowSelector::skip(3_990),
                RowSelector::select(1),
                RowSelector::skip(4_499),
                RowSelector::select(500),
            ]
        );
        assert_eq!(selected, 1_511);
        // Half of it or more kept: read whole.
        assert!(matches!(
            access(&bits(&[(0, 5_001)], 10_000), 10_000, 1_024).0,
            RowGroupAccess::Scan
        ));
        assert!(matches!(
            access(&bits(&[(0, 4_999)], 10_000), 10_000, 1_024).0,
            RowGroupAccess::Selection(_)
        ));
    }
}
