//! Tables and views that are not stored telemetry.
//!
//! A [`LiveTable`] is data another part of perch owns and keeps current (the job database, the
//! control plane's view of the nodes); SQL reads a fresh snapshot of it each time a query
//! scans it, so `jobs` joined with `gpu_samples` sees the jobs as they are now. A view is a
//! named SELECT over any of the tables, planned in each query's session like a table.

use arrow::array::AsArray;
use arrow::array::RecordBatch;
use arrow::compute::filter_record_batch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Column, DFSchema, ScalarValue};
use datafusion::datasource::physical_plan::parquet::{
    ParquetAccessPlan, ParquetFileMetrics, RowGroupAccessPlanFilter,
};
use datafusion::datasource::{MemTable, TableProvider, TableType};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::context::ExecutionProps;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::utils::{conjunction, split_conjunction};
use datafusion::logical_expr::{Expr, Operator, TableProviderFilterPushDown};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::create_physical_expr;
use datafusion::physical_optimizer::pruning::PruningPredicateBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
use parquet::file::metadata::ParquetMetaData;
use std::sync::Arc;

/// Rows owned outside the store, exposed to SQL as a table.
pub trait LiveTable: Send + Sync + std::fmt::Debug {
    /// The table's columns; every snapshot has exactly this schema.
    fn schema(&self) -> SchemaRef;
    /// The rows as of now. Called once for each query that reads the table.
    fn snapshot(&self) -> std::result::Result<Vec<RecordBatch>, String>;

    /// The rows as of now, of the columns at `projection` (every column if `None`): what a
    /// query reads of the table, each batch counted in `room` as it is made. A table that
    /// can make fewer columns for less, or is large, overrides it and counts its batches as
    /// it goes, so one too big for the query's memory stops being made part way.
    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
        room: &mut Room<'_>,
    ) -> std::result::Result<Vec<RecordBatch>, String> {
        room.keep(project(self.snapshot()?, projection)?)
    }
}

/// Room in a query's memory for the rows a live table makes for it: counted against the
/// query's limit (and the server's SQL budget) as they are made and held until the query
/// ends, as an operator's state is. A table too big for it fails the query with the memory
/// limit's message, not the server with its memory.
///
/// It also carries the query's filters on the table ([`Room::keep`]): a row they reject is
/// dropped as soon as it is made, so it is never held, and a table that can tell from its
/// storage that rows cannot match ([`Room::pruning`]) need not make them at all. A query
/// that selects a day of a long history then holds that day, not the history.
pub struct Room<'a> {
    grow: &'a mut dyn FnMut(usize) -> std::result::Result<(), String>,
    rows: Option<Rows>,
    caller: Option<Arc<Caller>>,
}

/// The query's filters on a live table, and those of them that can be evaluated over the
/// columns it reads.
struct Rows {
    filters: Pruning,
    predicates: Vec<Arc<dyn PhysicalExpr>>,
}

impl<'a> Room<'a> {
    /// Room that `grow` grants (an error: no more), for every row.
    pub fn new(grow: &'a mut dyn FnMut(usize) -> std::result::Result<(), String>) -> Self {
        Room {
            grow,
            rows: None,
            caller: None,
        }
    }

    /// Who asks, for a user's query ([`Caller`]); `None` for perch's own.
    pub fn caller(&self) -> Option<&Caller> {
        self.caller.as_deref()
    }

    /// `f` with room that is never short: for reads outside a query's memory (a table's
    /// whole snapshot, tests).
    pub fn unlimited<T>(f: impl FnOnce(&mut Room<'_>) -> T) -> T {
        let mut grant = |_| Ok(());
        f(&mut Room::new(&mut grant))
    }

    /// The same room, for the rows `filters` keep of a table whose batches have `schema`
    /// (the columns the query reads, which include every column its filters name). A filter
    /// that cannot be evaluated here is left to the query, as a volatile one is (`random()`:
    /// judged twice, a row would be drawn twice).
    pub fn with_filters(
        mut self,
        filters: &[Expr],
        schema: &SchemaRef,
        state: &dyn Session,
    ) -> Self {
        let filters: Vec<Expr> = filters
            .iter()
            .filter(|e| !e.is_volatile())
            .filter_map(|e| unqualified(e.clone()))
            .collect();
        let predicates = match DFSchema::try_from(schema.as_ref().clone()) {
            Ok(columns) => filters
                .iter()
                .filter_map(|f| state.create_physical_expr(f.clone(), &columns).ok())
                .collect(),
            Err(_) => Vec::new(),
        };
        self.rows = (!filters.is_empty()).then(|| Rows {
            filters: Pruning {
                filters,
                props: state.execution_props().clone(),
            },
            predicates,
        });
        self.caller = state.config().get_extension::<Caller>();
        self
    }

    /// What of the query's filters a table can judge its stored files by
    /// ([`Pruning::row_groups`]): `None` when the query filters nothing.
    pub fn pruning(&self) -> Option<Pruning> {
        self.rows.as_ref().map(|rows| rows.filters.clone())
    }

    /// Counts `batches`, made for the query: an error once they pass its room.
    pub fn take(&mut self, batches: &[RecordBatch]) -> std::result::Result<(), String> {
        let bytes = batches.iter().map(RecordBatch::get_array_memory_size).sum();
        (self.grow)(bytes)
    }

    /// What the query keeps of `batches` (rows of the table's columns it reads, as the
    /// table's schema has them): the rows its filters may pass, counted as [`Room::take`]
    /// counts. A filter that fails on a batch keeps all of it, for the query to judge.
    pub fn keep(
        &mut self,
        batches: Vec<RecordBatch>,
    ) -> std::result::Result<Vec<RecordBatch>, String> {
        let kept: Vec<RecordBatch> = match &self.rows {
            None => batches,
            Some(rows) => batches
                .into_iter()
                .map(|b| rows.apply(b))
                .filter(|b| b.num_rows() > 0)
                .collect(),
        };
        self.take(&kept)?;
        Ok(kept)
    }
}

/// A query's filters on a live table, to judge the table's stored files by ([`Room::pruning`]).
#[derive(Debug, Clone)]
pub struct Pruning {
    filters: Vec<Expr>,
    /// The query's (its start time, for any `now()` left in a filter).
    props: ExecutionProps,
}

impl Pruning {
    /// The conjuncts of the filters that name only columns `has`.
    fn conjuncts_on(&self, has: impl Fn(&str) -> bool) -> Vec<Expr> {
        self.filters
            .iter()
            .flat_map(split_conjunction)
            .filter(|e| e.column_refs().iter().all(|c| has(&c.name)))
            .cloned()
            .collect()
    }

    /// Only the filters on `columns` (conjuncts naming no other column): to judge another
    /// table's files by the columns the two share the meaning of (a job id). `None` if none.
    pub fn on(&self, columns: &[&str]) -> Option<Pruning> {
        let filters = self.conjuncts_on(|name| columns.contains(&name));
        (!filters.is_empty()).then(|| Pruning {
            filters,
            props: self.props.clone(),
        })
    }

    /// The least and greatest value of `column` that a row the filters keep can hold, from
    /// the filters that compare the column itself with a whole number (`=`, `<`, `<=`, `>`,
    /// `>=`, `BETWEEN`), each a conjunct of the query's filters (any other filter narrows
    /// nothing here): `None` when they bound neither end; a range with `lo > hi` when no
    /// value can pass.
    pub fn range_u64(&self, column: &str) -> Option<(u64, u64)> {
        let (mut lo, mut hi) = (0u64, u64::MAX);
        for e in self.filters.iter().flat_map(split_conjunction) {
            if let Some((from, to)) = bound(e, column) {
                (lo, hi) = (lo.max(from), hi.min(to));
            }
        }
        (lo > 0 || hi < u64::MAX).then_some((lo, hi))
    }

    /// Of a Parquet file whose footer is `metadata` and columns `schema`, the row groups that
    /// may hold rows the query's filters keep, by each row group's statistics (min, max,
    /// nulls): `None` to read them all (no filter on the file's own columns, or none that
    /// statistics can judge). A table whose files are ordered by a column the query filters
    /// on (job id, time) reads a part of them.
    pub fn row_groups(&self, metadata: &ParquetMetaData, schema: &SchemaRef) -> Option<Vec<usize>> {
        // The conjuncts on the file's columns alone: a column worked out when read (a
        // price) is judged later, on the rows made.
        let on_file = conjunction(self.conjuncts_on(|name| schema.field_with_name(name).is_ok()))?;
        let columns = DFSchema::try_from(schema.as_ref().clone()).ok()?;
        let physical = create_physical_expr(
            &on_file,
            &columns,
            &self.props,
            &PhysicalPlanningContext::default(),
        )
        .ok()?;
        let predicate = PruningPredicateBuilder::new()
            .with_file_schema(Arc::clone(schema))
            .try_build(physical)
            .ok()?;
        if predicate.always_true() {
            return None;
        }
        let unseen = ExecutionPlanMetricsSet::new();
        let metrics = ParquetFileMetrics::new(0, "live table", &unseen);
        let mut plan =
            RowGroupAccessPlanFilter::new(ParquetAccessPlan::new_all(metadata.num_row_groups()));
        plan.prune_by_statistics(
            schema,
            metadata.file_metadata().schema_descr(),
            metadata.row_groups(),
            &predicate,
            &metrics,
        );
        Some(plan.build().row_group_indexes())
    }
}

impl Rows {
    /// The rows of `batch` every predicate passes (a predicate that fails on it passes all).
    fn apply(&self, batch: RecordBatch) -> RecordBatch {
        self.predicates.iter().fold(batch, |batch, predicate| {
            if batch.num_rows() == 0 {
                return batch;
            }
            let mask = predicate
                .evaluate(&batch)
                .and_then(|v| v.into_array(batch.num_rows()));
            match mask.as_ref().ok().and_then(|m| m.as_boolean_opt()) {
                Some(mask) => filter_record_batch(&batch, mask).unwrap_or(batch),
                None => batch,
            }
        })
    }
}

/// The values of `column` that `e` lets through, where `e` compares the column itself with a
/// whole number: `(lo, hi)` (`lo > hi`: none). `None` for anything else.
fn bound(e: &Expr, column: &str) -> Option<(u64, u64)> {
    let number = |e: &Expr| -> Option<i128> {
        match e {
            Expr::Literal(ScalarValue::UInt64(Some(v)), _) => Some(i128::from(*v)),
            Expr::Literal(ScalarValue::Int64(Some(v)), _) => Some(i128::from(*v)),
            Expr::Literal(ScalarValue::UInt32(Some(v)), _) => Some(i128::from(*v)),
            Expr::Literal(ScalarValue::Int32(Some(v)), _) => Some(i128::from(*v)),
            _ => None,
        }
    };
    let is_column = |e: &Expr| matches!(e, Expr::Column(c) if c.name == column);
    // Whole numbers in i128, then clamped to u64: a bound past either end lets nothing (or
    // everything) through on that side.
    let (lo, hi): (i128, i128) = match e {
        Expr::BinaryExpr(b) => {
            let (op, v) = match (is_column(&b.left), is_column(&b.right)) {
                (true, false) => (b.op, number(&b.right)?),
                (false, true) => (b.op.swap()?, number(&b.left)?),
                _ => return None,
            };
            match op {
                Operator::Eq => (v, v),
                Operator::Lt => (i128::MIN, v - 1),
                Operator::LtEq => (i128::MIN, v),
                Operator::Gt => (v + 1, i128::MAX),
                Operator::GtEq => (v, i128::MAX),
                _ => return None,
            }
        }
        Expr::Between(b) if !b.negated && is_column(&b.expr) => (number(&b.low)?, number(&b.high)?),
        _ => return None,
    };
    let max = i128::from(u64::MAX);
    if lo > max || hi < 0 || lo > hi {
        return Some((1, 0));
    }
    Some((lo.clamp(0, max) as u64, hi.clamp(0, max) as u64))
}

/// `expr` with its columns' table names taken off: a live table's batches name their
/// columns alone.
fn unqualified(expr: Expr) -> Option<Expr> {
    expr.transform(|e| {
        Ok(match e {
            Expr::Column(c) if c.relation.is_some() => {
                Transformed::yes(Expr::Column(Column::new_unqualified(c.name)))
            }
            e => Transformed::no(e),
        })
    })
    .map(|t| t.data)
    .ok()
}

/// Who asks a user's query (absent for perch's own: alert rules, the accounting fold, tests),
/// as an extension of its session's configuration: a live table of rows private to their
/// users ([`Room::caller`]) shows a user who is not an operator only that user's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub user: String,
    pub operator: bool,
}

impl Caller {
    /// Whether rows of `owner` are shown to this caller.
    pub fn may_see(&self, owner: &str) -> bool {
        self.operator || self.user == owner
    }
}

/// The rows' reservations a query's live tables made, held by its session (an extension of
/// its configuration) until the query ends.
#[derive(Debug, Default)]
pub(crate) struct Held(std::sync::Mutex<Vec<MemoryReservation>>);

/// `batches`' columns at `projection` (all if `None`).
pub fn project(
    batches: Vec<RecordBatch>,
    projection: Option<&[usize]>,
) -> std::result::Result<Vec<RecordBatch>, String> {
    match projection {
        None => Ok(batches),
        Some(p) => batches
            .iter()
            .map(|b| b.project(p).map_err(|e| e.to_string()))
            .collect(),
    }
}

/// Why a [`LiveTable`] made no rows for a query.
#[derive(Debug)]
pub(crate) enum LiveError {
    /// It could not: the server's failure, not the query's (answered as
    /// [`crate::Error::Execution`], not as a bad query).
    Failed { table: String, message: String },
    /// Its rows passed the query's memory ([`Room`]).
    NoRoom {
        table: String,
        refused: DataFusionError,
    },
}

impl std::fmt::Display for LiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LiveError::Failed { table, message } => write!(f, "reading table {table}: {message}"),
            LiveError::NoRoom { table, refused } => write!(f, "rows of table {table}: {refused}"),
        }
    }
}

impl std::error::Error for LiveError {}

/// The DataFusion face of a [`LiveTable`].
#[derive(Debug)]
pub(crate) struct LiveProvider {
    pub(crate) table: Arc<dyn LiveTable>,
    pub(crate) name: String,
}

#[async_trait]
impl TableProvider for LiveProvider {
    fn schema(&self) -> SchemaRef {
        self.table.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    /// Every filter that gives the same answer each time it is evaluated is applied to the
    /// rows as the table makes them ([`Room::keep`]), and again by the query.
    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|e| match e.is_volatile() {
                true => TableProviderFilterPushDown::Unsupported,
                false => TableProviderFilterPushDown::Inexact,
            })
            .collect())
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let schema = match projection {
            Some(p) => Arc::new(self.table.schema().project(p)?),
            None => self.table.schema(),
        };
        let reservation = MemoryConsumer::new(format!("live table {}", self.name))
            .register(&state.runtime_env().memory_pool);
        let mut refused = None;
        let made = {
            let mut grow = |bytes| {
                reservation.try_grow(bytes).map_err(|e| {
                    let said = e.to_string();
                    refused = Some(e);
                    said
                })
            };
            let mut room = Room::new(&mut grow).with_filters(filters, &schema, state);
            self.table
                .snapshot_of(projection.map(Vec::as_slice), &mut room)
        };
        let table = self.name.clone();
        let batches = made.map_err(|message| {
            DataFusionError::External(Box::new(match refused {
                // Past the query's memory: that error, which says what to change.
                Some(refused) => LiveError::NoRoom { table, refused },
                None => LiveError::Failed { table, message },
            }))
        })?;
        // Held while the query runs: the batches are.
        if let Some(held) = state.config().get_extension::<Held>() {
            held.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(reservation);
        }
        let table = MemTable::try_new(schema, vec![batches])?;
        table.scan(state, None, filters, limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::{col, lit};

    fn range(filters: Vec<Expr>) -> Option<(u64, u64)> {
        Pruning {
            filters,
            props: ExecutionProps::new(),
        }
        .range_u64("job")
    }

    /// The rows a query's filters keep are judged as they are made, by every filter that
    /// gives the same answer each time and can be evaluated on the columns read; the others
    /// keep every row (the query judges them once, after).
    #[test]
    fn rows_are_judged_by_the_filters_that_can_judge_them_alone() {
        use arrow::array::{Int64Array, StringArray};
        use arrow::datatypes::{DataType, Field, Schema};
        use datafusion::functions::math::expr_fn::random;
        let schema = Arc::new(Schema::new(vec![
            Field::new("job", DataType::Int64, false),
            Field::new("user_name", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from_iter_values(0..10)),
                Arc::new(StringArray::from_iter_values(
                    (0..10).map(|i| format!("u{}", i % 2)),
                )),
            ],
        )
        .expect("batch");
        let state = datafusion::prelude::SessionContext::new().state();
        let kept = |filters: Vec<Expr>| {
            let mut grant = |_| Ok(());
            Room::new(&mut grant)
                .with_filters(&filters, &schema, &state)
                .keep(vec![batch.clone()])
                .expect("room")
                .iter()
                .map(RecordBatch::num_rows)
                .sum::<usize>()
        };
        assert_eq!(kept(vec![col("job").lt(lit(4i64))]), 4);
        assert_eq!(
            kept(vec![
                col("job").lt(lit(4i64)),
                col("user_name").eq(lit("u1"))
            ]),
            2
        );
        // Qualified as the query names them.
        assert_eq!(kept(vec![col("jobs.job").gt_eq(lit(7i64))]), 3);
        // `random()` drawn here and again by the query would keep a row half as often.
        assert_eq!(kept(vec![random().lt(lit(0.0))]), 10);
        // A column the rows do not have: left to the query, the other filter still judged.
        assert_eq!(
            kept(vec![col("gpu").eq(lit(1i64)), col("job").lt(lit(4i64))]),
            4
        );
        assert_eq!(kept(vec![]), 10);
    }

    /// The job ids a query's filters can keep, from the comparisons of `job` with a number
    /// alone: what a table may skip without looking at a row. Anything it cannot read
    /// narrows nothing, so the range is never narrower than the filters.
    #[test]
    fn a_range_of_job_ids_is_read_from_comparisons_alone() {
        let job = || col("job");
        assert_eq!(range(vec![job().eq(lit(5u64))]), Some((5, 5)));
        assert_eq!(
            range(vec![job().gt(lit(10u64)).and(job().lt_eq(lit(20u64)))]),
            Some((11, 20))
        );
        assert_eq!(range(vec![lit(10u64).lt(job())]), Some((11, u64::MAX)));
        assert_eq!(
            range(vec![job().between(lit(3u64), lit(7u64))]),
            Some((3, 7))
        );
        // Two filters (two conjuncts) narrow each other; another column's does not count.
        assert_eq!(
            range(vec![
                job().gt_eq(lit(4u64)),
                col("gpu").eq(lit(1u32)),
                job().lt(lit(9i64))
            ]),
            Some((4, 8))
        );
        // Nothing can pass.
        let (lo, hi) = range(vec![job().eq(lit(-1i64))]).expect("bounded");
        assert!(lo > hi);
        let (lo, hi) = range(vec![job().gt(lit(5u64)).and(job().lt(lit(3u64)))]).expect("bounded");
        assert!(lo > hi);
        // What it cannot read bounds nothing.
        for e in [
            job().gt(lit(5u64)).or(job().lt(lit(2u64))),
            job().in_list(vec![lit(1u64), lit(3u64)], false),
            job().not_eq(lit(5u64)),
            job().not_between(lit(3u64), lit(7u64)),
            (job() + lit(1u64)).eq(lit(5u64)),
            col("gpu").eq(lit(5u32)),
        ] {
            assert_eq!(range(vec![e.clone()]), None, "{e}");
        }
    }
}
