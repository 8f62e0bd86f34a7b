//! The DataFusion table provider for one stored table: the union of its Parquet files and its
//! in-memory buffer, taken from one consistent [`Store::snapshot`], so a row is seen exactly
//! once whether or not a flush is under way.
//!
//! Files are declared sorted by the table's sort key, so DataFusion can skip sorts. Predicates
//! on `time` prune whole files by the time range the manifest records for each, before any
//! file is opened; all filters then go to the Parquet scan for row-group pruning and are
//! re-applied above the union. The file list a scan uses stays pinned until the query ends,
//! so compaction and retention never delete a file under a running query.

use crate::manifest::FileEntry;
use crate::schema::Table;
use crate::{Store, strings};
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::ScalarValue;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::datasource::{MemTable, TableProvider, TableType};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{
    Between, BinaryExpr, Expr, Operator, TableProviderFilterPushDown, col,
};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::union::UnionExec;
use std::sync::{Arc, Mutex, Weak};

/// A file set and the listing table built over it. The file set is held weakly: a strong
/// reference would pin its files (keep compaction and retention from deleting them) long
/// after the last query that read them, since every query shares the table. While the weak
/// reference lives, no other file set can take its address.
type CachedListing = (Weak<Vec<FileEntry>>, Arc<ListingTable>);

pub(crate) struct StoreTable {
    store: Arc<Store>,
    table: Table,
    /// The table's schema as scans produce it, strings as views (see [`crate::strings`]).
    schema: SchemaRef,
    /// The listing table for the last file set seen; rebuilt when a flush changes the files.
    cache: Mutex<Option<CachedListing>>,
}

/// The file lists a query's scans read, held by the query's session (an extension of its
/// configuration) until the session is dropped, so compaction and retention delete no file a
/// running query reads. The tables themselves are shared by every query's session.
#[derive(Debug, Default)]
pub(crate) struct Pins(Mutex<Vec<Arc<Vec<FileEntry>>>>);

impl std::fmt::Debug for StoreTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreTable")
            .field("table", &self.table)
            .finish()
    }
}

impl StoreTable {
    pub(crate) fn new(store: Arc<Store>, table: Table) -> Self {
        StoreTable {
            store,
            table,
            schema: strings::as_views(&table.schema()),
            cache: Mutex::new(None),
        }
    }

    /// The listing table over `files`. Its file statistics (which DataFusion reads from each
    /// file's footer to plan) go to the engine's statistics cache, shared by every query's
    /// runtime: a query that keeps some of the files by time gets a new listing table, and
    /// without the shared cache each one read every file's statistics again.
    fn listing(
        &self,
        files: &Arc<Vec<FileEntry>>,
        state: &dyn Session,
    ) -> Result<Arc<ListingTable>> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((cached_files, table)) = cache.as_ref()
            && std::ptr::eq(cached_files.as_ptr(), Arc::as_ptr(files))
        {
            return Ok(table.clone());
        }
        let urls = files
            .iter()
            .map(|f| ListingTableUrl::parse(self.store.storage.file_url(&f.path)))
            .collect::<Result<Vec<_>>>()?;
        let sort = self
            .table
            .sort_key()
            .iter()
            .map(|c| col(*c).sort(true, false))
            .collect();
        let options = ListingOptions::new(Arc::new(ParquetFormat::default()))
            .with_file_extension(".parquet")
            .with_file_sort_order(vec![sort]);
        let config = ListingTableConfig::new_with_multi_paths(urls)
            .with_listing_options(options)
            .with_schema(self.schema.clone());
        let table = Arc::new(
            ListingTable::try_new(config)?
                .with_cache(state.runtime_env().cache_manager.get_file_statistic_cache()),
        );
        *cache = Some((Arc::downgrade(files), table.clone()));
        Ok(table)
    }
}

#[async_trait]
impl TableProvider for StoreTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let pins = state.config().get_extension::<Pins>().ok_or_else(|| {
            DataFusionError::Internal(format!(
                "{} scanned outside a query's session (no file pins)",
                self.table.name()
            ))
        })?;
        let crate::store::TableSnapshot {
            pin,
            files,
            buffered,
        } = self
            .store
            .snapshot(self.table)
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        pins.0.lock().unwrap_or_else(|p| p.into_inner()).push(pin);
        let (lo, hi) = time_bounds(filters);
        let files = if lo.is_some() || hi.is_some() {
            let kept: Vec<FileEntry> = files
                .iter()
                .filter(|f| {
                    lo.is_none_or(|lo| f.max_time_ms >= lo)
                        && hi.is_none_or(|hi| f.min_time_ms <= hi)
                })
                .cloned()
                .collect();
            if kept.len() == files.len() {
                files
            } else {
                Arc::new(kept)
            }
        } else {
            files
        };
        let mut inputs = Vec::with_capacity(2);
        if !files.is_empty() {
            let scan = self
                .listing(&files, state)?
                .scan(state, projection, filters, limit)
                .await?;
            inputs.push(split_one_file(scan, state).await?);
        }
        // Buffered batches out of the query's time range go too, as files do: a query over
        // past days then reads only files, each partition in the files' order, and a window
        // over each series needs no sort.
        let buffered: Vec<_> = buffered
            .into_iter()
            .filter(|b| may_hold(b, lo, hi))
            .collect();
        if !buffered.is_empty() || inputs.is_empty() {
            // Only the projected columns are cast to views: the buffer may hold a million rows.
            let schema = match projection {
                Some(p) => Arc::new(self.schema.project(p)?),
                None => self.schema.clone(),
            };
            let buffered = buffered
                .iter()
                .map(|b| {
                    let b = match projection {
                        Some(p) => b.project(p)?,
                        None => b.clone(),
                    };
                    strings::cast_batch(&b, &schema)
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let mem = MemTable::try_new(schema, vec![buffered])?;
            inputs.push(mem.scan(state, None, &[], limit).await?);
        }
        UnionExec::try_new(inputs)
    }
}

/// Whether a buffered batch may hold rows with `time` in `[lo, hi]` (milliseconds, either
/// bound open): its own range of `time` meets it. A batch without a millisecond `time` column,
/// or with no time at all, is kept.
fn may_hold(batch: &arrow::array::RecordBatch, lo: Option<i64>, hi: Option<i64>) -> bool {
    use arrow::array::AsArray;
    use arrow::datatypes::TimestampMillisecondType;
    if lo.is_none() && hi.is_none() {
        return true;
    }
    let Some(time) = batch
        .column_by_name("time")
        .and_then(|c| c.as_primitive_opt::<TimestampMillisecondType>())
    else {
        return true;
    };
    match (arrow::compute::min(time), arrow::compute::max(time)) {
        (Some(min), Some(max)) => lo.is_none_or(|lo| max >= lo) && hi.is_none_or(|hi| min <= hi),
        _ => true,
    }
}

/// A scan of one file, split into byte ranges of about equal rows, one per partition.
///
/// DataFusion splits a file into ranges of equal bytes and gives each row group to the range
/// holding its first page, so a day's file of five row groups (four of 1,048,576 rows, one of
/// 229,376) was read as 3.15 M rows on one core and 1.28 M on the other. Its work stealing
/// between partitions is off for scans declared sorted, which the store's are. So where a scan
/// reads one whole file, its ranges are cut here at row-group boundaries, from the file's
/// footer (read through the session's metadata cache, where the scan finds it again); given
/// as many ranges as partitions, DataFusion splits no further. Each range holds whole row
/// groups of a sorted file, so the order each partition reads is still sorted.
async fn split_one_file(
    scan: Arc<dyn ExecutionPlan>,
    state: &dyn Session,
) -> Result<Arc<dyn ExecutionPlan>> {
    let parts = state.config().target_partitions();
    let Some(config) = scan
        .downcast_ref::<DataSourceExec>()
        .and_then(|exec| exec.data_source().downcast_ref::<FileScanConfig>())
    else {
        return Ok(scan);
    };
    let [group] = config.file_groups.as_slice() else {
        return Ok(scan);
    };
    let [file] = group.files() else {
        return Ok(scan);
    };
    if parts < 2 || file.range.is_some() {
        return Ok(scan);
    }
    let runtime = state.runtime_env();
    let store = runtime.object_store(&config.object_store_url)?;
    let metadata = DFParquetMetadata::new(store.as_ref(), &file.object_meta)
        .with_file_metadata_cache(Some(runtime.cache_manager.get_file_metadata_cache()))
        .fetch_metadata()
        .await?;
    // Where DataFusion places a row group: its first dictionary or data page.
    let row_groups: Vec<(i64, u64)> = metadata
        .row_groups()
        .iter()
        .filter(|rg| rg.num_columns() > 0)
        .map(|rg| {
            let col = rg.column(0);
            let start = col
                .dictionary_page_offset()
                .unwrap_or_else(|| col.data_page_offset());
            (start, u64::try_from(rg.num_rows()).unwrap_or(0))
        })
        .collect();
    let size = i64::try_from(file.object_meta.size).unwrap_or(i64::MAX);
    let ranges = balanced_ranges(&row_groups, size, parts);
    if ranges.len() < 2 {
        return Ok(scan);
    }
    let groups = ranges
        .into_iter()
        .map(|(start, end)| FileGroup::new(vec![file.clone().with_range(start, end)]))
        .collect();
    let config = FileScanConfigBuilder::from(config.clone())
        .with_file_groups(groups)
        .build();
    Ok(DataSourceExec::from_data_source(config))
}

/// Byte ranges of a Parquet file, at most `parts`, each holding whole row groups and about
/// the same number of rows. `row_groups` gives each group's first byte and rows, in file
/// order; the ranges cover the file from 0 to `size`, each starting at its first group.
/// A footer whose groups do not start at increasing offsets inside the file (a damaged or
/// foreign file) gets one range, the whole file: a range cut between such groups could leave
/// one of them in no range, and its rows out of the answer.
fn balanced_ranges(row_groups: &[(i64, u64)], size: i64, parts: usize) -> Vec<(i64, i64)> {
    let n = row_groups.len();
    let parts = parts.min(n);
    let in_order = row_groups.first().is_some_and(|&(first, _)| first >= 0)
        && row_groups.windows(2).all(|w| w[0].0 < w[1].0)
        && row_groups.last().is_some_and(|&(last, _)| last < size);
    if parts < 2 || !in_order {
        return vec![(0, size)];
    }
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(0u64);
    for (_, rows) in row_groups {
        prefix.push(prefix.last().copied().unwrap_or(0).saturating_add(*rows));
    }
    let total = u128::from(prefix[n]);
    // The row group each part after the first starts at: the cut nearest its share of rows,
    // leaving at least one group to each part.
    let mut starts = Vec::with_capacity(parts);
    let mut previous = 0;
    for part in 1..parts {
        let target = total * part as u128 / parts as u128;
        let cut = (previous + 1..=n - (parts - part))
            .min_by_key(|&i| u128::from(prefix[i]).abs_diff(target))
            .unwrap_or(previous + 1);
        starts.push(cut);
        previous = cut;
    }
    let mut ranges = Vec::with_capacity(parts);
    let mut from = 0;
    for cut in starts {
        let to = row_groups[cut].0;
        ranges.push((from, to));
        from = to;
    }
    ranges.push((from, size));
    ranges
}

/// A timestamp literal in milliseconds, rounded down (`up` false) or up.
fn literal_ms(e: &Expr, up: bool) -> Option<i64> {
    let (v, per_ms) = match e {
        Expr::Literal(ScalarValue::TimestampSecond(Some(v), _), _) => return v.checked_mul(1000),
        Expr::Literal(ScalarValue::TimestampMillisecond(Some(v), _), _) => (*v, 1),
        Expr::Literal(ScalarValue::TimestampMicrosecond(Some(v), _), _) => (*v, 1_000),
        Expr::Literal(ScalarValue::TimestampNanosecond(Some(v), _), _) => (*v, 1_000_000),
        Expr::Cast(c) => return literal_ms(&c.expr, up),
        _ => return None,
    };
    Some(if up {
        v.div_euclid(per_ms) + i64::from(v.rem_euclid(per_ms) != 0)
    } else {
        v.div_euclid(per_ms)
    })
}

fn is_time(e: &Expr) -> bool {
    match e {
        Expr::Column(c) => c.name == "time",
        Expr::Cast(c) => is_time(&c.expr),
        _ => false,
    }
}

/// The range of `time` the filters allow, as inclusive milliseconds (conservative: a file
/// outside it cannot hold a matching row).
pub(crate) fn time_bounds(filters: &[Expr]) -> (Option<i64>, Option<i64>) {
    let mut lo: Option<i64> = None;
    let mut hi: Option<i64> = None;
    let mut raise = |v: Option<i64>| {
        if let Some(v) = v {
            lo = Some(lo.map_or(v, |l| l.max(v)));
        }
    };
    let mut lower = |v: Option<i64>| {
        if let Some(v) = v {
            hi = Some(hi.map_or(v, |h| h.min(v)));
        }
    };
    let mut stack: Vec<&Expr> = filters.iter().collect();
    while let Some(e) = stack.pop() {
        match e {
            Expr::BinaryExpr(BinaryExpr {
                left,
                op: Operator::And,
                right,
            }) => {
                stack.push(left);
                stack.push(right);
            }
            Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
                // Normalise to `time <op> literal`.
                let (op, lit) = if is_time(left) {
                    (*op, right.as_ref())
                } else if is_time(right) {
                    match op.swap() {
                        Some(swapped) => (swapped, left.as_ref()),
                        None => continue,
                    }
                } else {
                    continue;
                };
                match op {
                    Operator::Gt | Operator::GtEq => raise(literal_ms(lit, false)),
                    Operator::Lt | Operator::LtEq => lower(literal_ms(lit, true)),
                    Operator::Eq => {
                        raise(literal_ms(lit, false));
                        lower(literal_ms(lit, true));
                    }
                    _ => {}
                }
            }
            Expr::Between(Between {
                expr,
                negated: false,
                low,
                high,
            }) if is_time(expr) => {
                raise(literal_ms(low, false));
                lower(literal_ms(high, true));
            }
            _ => {}
        }
    }
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::logical_expr::lit;

    #[test]
    fn ranges_hold_whole_row_groups_and_about_equal_rows() {
        let mib = 1 << 20;
        // The benchmark's day file: four full row groups and a short one.
        let day = [
            (4, 1_048_576),
            (2_876_026, 1_048_576),
            (6_126_196, 1_048_576),
            (9_415_188, 1_048_576),
            (12_689_546, 229_376),
        ];
        assert_eq!(
            balanced_ranges(&day, 13_521_841, 2),
            vec![(0, 6_126_196), (6_126_196, 13_521_841)]
        );
        assert_eq!(
            balanced_ranges(&day, 13_521_841, 4),
            vec![
                (0, 2_876_026),
                (2_876_026, 6_126_196),
                (6_126_196, 9_415_188),
                (9_415_188, 13_521_841)
            ]
        );
        // More parts than row groups: one group each.
        assert_eq!(balanced_ranges(&day[..2], 3 * mib, 16).len(), 2);
        // One row group, or one part: the whole file.
        assert_eq!(balanced_ranges(&day[..1], 3 * mib, 2), vec![(0, 3 * mib)]);
        assert_eq!(balanced_ranges(&day, 13_521_841, 1), vec![(0, 13_521_841)]);
        // Skewed groups: each part keeps at least one.
        // Groups out of order, or past the end of the file: the whole file, not a cut that
        // could leave a group in no range.
        let shuffled = [(4, 100), (5_000, 100), (2_000, 100)];
        assert_eq!(balanced_ranges(&shuffled, 9_000, 2), vec![(0, 9_000)]);
        let past_end = [(4, 100), (5_000, 100)];
        assert_eq!(balanced_ranges(&past_end, 4_000, 2), vec![(0, 4_000)]);
        let skewed = [(4, 10), (100, 10), (200, 1_000_000)];
        assert_eq!(
            balanced_ranges(&skewed, 5_000, 3),
            vec![(0, 100), (100, 200), (200, 5_000)]
        );
    }

    /// A scan of one file of several row groups is read as one range per partition, each of
    /// whole row groups and about equal rows, and reads every row once, in order.
    #[tokio::test]
    async fn one_file_is_split_at_row_groups_into_equal_rows() {
        use arrow::array::{Int64Array, RecordBatch};
        use arrow::datatypes::{DataType, Field, Schema};
        use datafusion::physical_plan::{ExecutionPlanProperties, collect_partitioned};
        use datafusion::prelude::{SessionConfig, SessionContext};
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("t.parquet");
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        let props = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(1_000))
            .build();
        let mut writer = parquet::arrow::ArrowWriter::try_new(
            std::fs::File::create(&path).expect("file"),
            schema.clone(),
            Some(props),
        )
        .expect("writer");
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from_iter_values(0..4_230))],
        )
        .expect("batch");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
        let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
        let url = ListingTableUrl::parse(path.to_str().expect("utf-8 path")).expect("url");
        let options = ListingOptions::new(Arc::new(ParquetFormat::default()))
            .with_file_sort_order(vec![vec![col("v").sort(true, false)]]);
        let config = ListingTableConfig::new(url)
            .with_listing_options(options)
            .with_schema(schema);
        let table = ListingTable::try_new(config).expect("table");
        let state = ctx.state();
        let scan = table.scan(&state, None, &[], None).await.expect("scan");
        assert_eq!(scan.output_partitioning().partition_count(), 1);
        let split = split_one_file(scan, &state).await.expect("split");
        assert_eq!(split.output_partitioning().partition_count(), 2);
        assert!(split.output_ordering().is_some(), "the order is kept");
        let parts = collect_partitioned(split, ctx.task_ctx())
            .await
            .expect("run");
        let values: Vec<Vec<i64>> = parts
            .iter()
            .map(|batches| {
                batches
                    .iter()
                    .flat_map(|b| {
                        b.column(0)
                            .as_any()
                            .downcast_ref::<Int64Array>()
                            .expect("i64")
                            .values()
                            .to_vec()
                    })
                    .collect()
            })
            .collect();
        // Row groups of 1,000, 1,000, 1,000, 1,000 and 230: 2,000 and 2,230 rows.
        assert_eq!(values[0], (0..2_000).collect::<Vec<_>>());
        assert_eq!(values[1], (2_000..4_230).collect::<Vec<_>>());
    }

    fn ts_ms(v: i64) -> Expr {
        lit(ScalarValue::TimestampMillisecond(
            Some(v),
            Some("UTC".into()),
        ))
    }

    fn ts_us(v: i64) -> Expr {
        lit(ScalarValue::TimestampMicrosecond(Some(v), None))
    }

    fn check(filters: Vec<Expr>, expected: (Option<i64>, Option<i64>)) {
        assert_eq!(time_bounds(&filters), expected, "{filters:?}");
    }

    #[test]
    fn time_bounds_from_filters() {
        check(vec![col("time").gt(ts_ms(10))], (Some(10), None));
        check(vec![ts_ms(10).lt(col("time"))], (Some(10), None));
        check(
            vec![col("time").lt_eq(ts_ms(20)), col("time").gt_eq(ts_ms(5))],
            (Some(5), Some(20)),
        );
        check(
            vec![col("time").gt(ts_ms(5)).and(col("time").lt(ts_ms(9)))],
            (Some(5), Some(9)),
        );
        check(
            vec![col("time").between(ts_ms(1), ts_ms(2))],
            (Some(1), Some(2)),
        );
        check(vec![col("time").eq(ts_us(1_500))], (Some(1), Some(2)));
        check(vec![col("time").gt(ts_us(-1_500))], (Some(-2), None));
        // Not a bound on time: no pruning.
        check(vec![col("node").gt(ts_ms(10))], (None, None));
        check(
            vec![col("time").gt(ts_ms(1)).or(col("time").lt(ts_ms(0)))],
            (None, None),
        );
        check(vec![col("time").not_eq(ts_ms(3))], (None, None));
    }
}
