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

    fn listing(&self, files: &Arc<Vec<FileEntry>>) -> Result<Arc<ListingTable>> {
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
        let table = Arc::new(ListingTable::try_new(config)?);
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
        let (files, buffered) = self
            .store
            .snapshot(self.table)
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        pins.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(files.clone());
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
            inputs.push(
                self.listing(&files)?
                    .scan(state, projection, filters, limit)
                    .await?,
            );
        }
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
