//! The first row of each partition as an aggregate, not a sort: `row_number() OVER (PARTITION
//! BY p ORDER BY o) = 1` (or `<= 1`, `< 2`) becomes `first_value` of the whole row, ordered by
//! `o`, grouped by `p`.
//!
//! Dashboards ask for "each GPU's latest sample" in exactly this shape. Planned as written,
//! DataFusion sorts every row by the partition keys and the order (the files are sorted by
//! time ascending, the query wants it descending), numbers every row and keeps one per
//! partition. The aggregate reads each row once and keeps one per group; DuckDB's optimizer
//! makes the same rewrite (to `arg_max` of a struct).
//!
//! The row is taken whole, as one struct, by one `first_value`, so every column of an output
//! row comes from the same input row, also when the order has ties (where `row_number` picks
//! any of the tied rows, and so may this). Without a `PARTITION BY` the window numbers the
//! whole input, which an aggregate without groups would answer with one row even for no input:
//! that case is left as it is.

use super::strip_alias;
use datafusion::common::DFSchema;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{Column, ScalarValue};
use datafusion::error::Result;
use datafusion::functions::expr_fn::{get_field, named_struct};
use datafusion::functions_aggregate::expr_fn::first_value;
use datafusion::functions_window::row_number::RowNumber;
use datafusion::logical_expr::expr::AggregateFunction;
use datafusion::logical_expr::expr::{WindowFunction, WindowFunctionParams};
use datafusion::logical_expr::utils::{conjunction, split_conjunction};
use datafusion::logical_expr::{
    Aggregate, BinaryExpr, Expr, ExprSchemable, Filter, LogicalPlan, Operator, Projection,
    SortExpr, Window, WindowFunctionDefinition, lit,
};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use std::sync::Arc;

/// The rewrite (see the module's documentation). A logical rule, run after DataFusion's own.
#[derive(Debug, Default)]
pub struct FirstRowPerPartition;

/// The name of the aggregate that holds each partition's first row.
const FIRST_ROW: &str = "__perch_first_row";

impl OptimizerRule for FirstRowPerPartition {
    fn name(&self) -> &str {
        "perch_first_row_per_partition"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::BottomUp)
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        let LogicalPlan::Filter(filter) = &plan else {
            return Ok(Transformed::no(plan));
        };
        let rewrite = rewrite_filter(filter);
        Ok(super::rewritten(plan, rewrite))
    }
}

/// The partition keys and order of the window's only expression, when it is `row_number()`
/// with at least one partition key and no filter.
fn row_number_window(window: &Window) -> Option<&WindowFunctionParams> {
    let [expr] = window.window_expr.as_slice() else {
        return None;
    };
    let Expr::WindowFunction(f) = strip_alias(expr) else {
        return None;
    };
    let WindowFunction { fun, params } = f.as_ref();
    let WindowFunctionDefinition::WindowUDF(udwf) = fun else {
        return None;
    };
    (udwf.inner().is::<RowNumber>()
        && params.args.is_empty()
        && !params.partition_by.is_empty()
        && params.filter.is_none()
        && !params.distinct)
        .then_some(params)
}

/// An integer literal's value.
fn integer(expr: &Expr) -> Option<i128> {
    let Expr::Literal(value, _) = strip_alias(expr) else {
        return None;
    };
    Some(match value {
        ScalarValue::Int8(Some(v)) => i128::from(*v),
        ScalarValue::Int16(Some(v)) => i128::from(*v),
        ScalarValue::Int32(Some(v)) => i128::from(*v),
        ScalarValue::Int64(Some(v)) => i128::from(*v),
        ScalarValue::UInt8(Some(v)) => i128::from(*v),
        ScalarValue::UInt16(Some(v)) => i128::from(*v),
        ScalarValue::UInt32(Some(v)) => i128::from(*v),
        ScalarValue::UInt64(Some(v)) => i128::from(*v),
        _ => return None,
    })
}

/// Whether `expr` is `column` itself. A cast of it to another integer type compared with a
/// literal reaches this rule already unwrapped by DataFusion's simplifier; other casts are
/// left alone.
fn is_column(expr: &Expr, column: &Column) -> bool {
    matches!(strip_alias(expr), Expr::Column(c) if c == column)
}

/// Whether the condition keeps exactly the rows numbered 1: `n = 1`, `n <= 1`, `n < 2`, or
/// the same with the sides swapped.
fn keeps_first(expr: &Expr, n: &Column) -> bool {
    let Expr::BinaryExpr(BinaryExpr { left, op, right }) = strip_alias(expr) else {
        return false;
    };
    let (op, value) = if is_column(left, n) {
        (*op, integer(right))
    } else if is_column(right, n) {
        match op.swap() {
            Some(op) => (op, integer(left)),
            None => return false,
        }
    } else {
        return false;
    };
    matches!(
        (op, value),
        (Operator::Eq, Some(1)) | (Operator::LtEq, Some(1)) | (Operator::Lt, Some(2))
    )
}

/// Whether `expr` mentions `column` anywhere.
fn mentions(expr: &Expr, column: &Column) -> bool {
    expr.column_refs().contains(column)
}

/// The window under a filter: its input directly, or through a projection that only passes
/// columns on (DataFusion leaves one there when the filter also reads other columns).
fn window_under(filter: &Filter) -> Option<(&Window, Option<&Projection>)> {
    match filter.input.as_ref() {
        LogicalPlan::Window(w) => Some((w, None)),
        LogicalPlan::Projection(p) if p.expr.iter().all(|e| matches!(e, Expr::Column(_))) => {
            match p.input.as_ref() {
                LogicalPlan::Window(w) => Some((w, Some(p))),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `arg_max(row, k)` for `ORDER BY k DESC`, `arg_min(row, k)` for `ORDER BY k`, where the
/// order is one key that cannot be NULL (so where the window puts NULLs does not matter) and of
/// a type `arg_max` compares; otherwise `None`, for `first_value(row ORDER BY ...)`.
/// `arg_max` reads each batch in one pass where `first_value` of a struct goes row by row.
fn by_key(row: Expr, order_by: &[SortExpr], schema: &DFSchema) -> Option<Expr> {
    let [SortExpr { expr, asc, .. }] = order_by else {
        return None;
    };
    let data_type = expr.get_type(schema).ok()?;
    if expr.nullable(schema).unwrap_or(true) || !crate::by_key::key_supported(&data_type) {
        return None;
    }
    let f = if *asc {
        crate::by_key::arg_min()
    } else {
        crate::by_key::arg_max()
    };
    Some(Expr::AggregateFunction(AggregateFunction::new_udf(
        Arc::new(f),
        vec![row, expr.clone()],
        false,
        None,
        vec![],
        None,
    )))
}

fn rewrite_filter(filter: &Filter) -> Result<Option<LogicalPlan>> {
    let Some((window, projection)) = window_under(filter) else {
        return Ok(None);
    };
    let Some(params) = row_number_window(window) else {
        return Ok(None);
    };
    let inputs = window.input.schema().fields().len();
    if inputs == 0 || window.schema.fields().len() != inputs + 1 {
        return Ok(None);
    }
    let (n_qualifier, n_field) = window.schema.qualified_field(inputs);
    let n = Column::new(n_qualifier.cloned(), n_field.name());
    let conjuncts = split_conjunction(&filter.predicate);
    let Some(at) = conjuncts.iter().position(|c| keeps_first(c, &n)) else {
        return Ok(None);
    };
    let rest: Vec<Expr> = conjuncts
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != at)
        .map(|(_, c)| (*c).clone())
        .collect();
    if rest.iter().any(|c| mentions(c, &n)) {
        return Ok(None);
    }
    // first_value(named_struct('c0', col0, 'c1', col1, ...) ORDER BY o) GROUP BY p
    let mut members = Vec::with_capacity(2 * inputs);
    for (i, (qualifier, field)) in window.input.schema().iter().enumerate() {
        members.push(lit(format!("c{i}")));
        members.push(Expr::Column(Column::new(qualifier.cloned(), field.name())));
    }
    let row = by_key(
        named_struct(members.clone()),
        &params.order_by,
        window.input.schema(),
    )
    .unwrap_or_else(|| first_value(named_struct(members), params.order_by.clone()))
    .alias(FIRST_ROW);
    let aggregate = LogicalPlan::Aggregate(Aggregate::try_new(
        window.input.clone(),
        params.partition_by.clone(),
        vec![row],
    )?);
    // The window's columns again, under their own names, and the row number, 1.
    let mut columns = Vec::with_capacity(inputs + 1);
    for (i, (qualifier, field)) in window.input.schema().iter().enumerate() {
        columns.push(
            get_field(Expr::Column(Column::from_name(FIRST_ROW)), format!("c{i}"))
                .alias_qualified(qualifier.cloned(), field.name()),
        );
    }
    columns.push(
        Expr::Literal(ScalarValue::UInt64(Some(1)), None)
            .alias_qualified(n_qualifier.cloned(), n_field.name()),
    );
    let mut plan = LogicalPlan::Projection(Projection::try_new(columns, Arc::new(aggregate))?);
    if let Some(p) = projection {
        plan = LogicalPlan::Projection(Projection::try_new(p.expr.clone(), Arc::new(plan))?);
    }
    Ok(Some(match conjunction(rest) {
        Some(predicate) => LogicalPlan::Filter(Filter::try_new(predicate, Arc::new(plan))?),
        None => plan,
    }))
}

#[cfg(test)]
mod tests {
    use super::FirstRowPerPartition;
    use arrow::array::{Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::prelude::SessionContext;
    use std::sync::Arc;

    /// A session over `samples(node, gpu, time, util)`: 6 nodes x 3 GPUs, times unique per
    /// GPU, with NULL nodes and a tie on the latest time of node n1's GPU 0 (`ties`).
    fn session(rule: bool, ties: bool) -> SessionContext {
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8, true),
            Field::new("gpu", DataType::Int64, false),
            Field::new("time", DataType::Int64, true),
            Field::new("util", DataType::Int64, false),
        ]));
        let rows = 3000i64;
        let node = |i: i64| (i % 13 != 0).then(|| format!("n{}", i % 6));
        let mut time: Vec<Option<i64>> = (0..rows).map(|i| Some((i * 7919) % 100_003)).collect();
        time[5] = None;
        if ties {
            // Rows 1 and 19 are both node n1, GPU 1: give them the partition's greatest time.
            time[1] = Some(1_000_000);
            time[19] = Some(1_000_000);
        }
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter((0..rows).map(node))),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 3))),
                Arc::new(Int64Array::from(time)),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 101))),
            ],
        )
        .expect("batch");
        let rule = rule.then(|| Arc::new(FirstRowPerPartition) as _);
        super::super::test_session(rule, "samples", &batch, 250)
    }

    async fn run(ctx: &SessionContext, sql: &str) -> (String, String) {
        super::super::answer_and_plan(ctx, sql).await
    }

    /// `sql` run without the rule and with it: (answer, plan) each.
    async fn without_and_with(sql: &str) -> ((String, String), (String, String)) {
        (
            run(&session(false, false), sql).await,
            run(&session(true, false), sql).await,
        )
    }

    /// The rewritten query answers as the window does, row for row, for each form of the
    /// condition, with NULL partition keys and NULL times (first for DESC, as the window's
    /// order puts them), and the plan has an aggregate in place of the window.
    #[tokio::test]
    async fn the_first_row_of_each_partition_is_the_windows() {
        let queries = [
            "SELECT node, gpu, time, util FROM (SELECT node, gpu, time, util, row_number() OVER (PARTITION BY node, gpu ORDER BY time DESC) AS newest FROM samples) WHERE newest = 1 ORDER BY node, gpu",
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY node ORDER BY time, gpu) AS k FROM samples WHERE util > 10) t WHERE 1 = k ORDER BY node",
            "SELECT node, gpu, util, k FROM (SELECT node, gpu, util, row_number() OVER (PARTITION BY gpu ORDER BY time DESC NULLS LAST) AS k FROM samples) WHERE k <= 1 AND util > 3 ORDER BY gpu",
            "SELECT gpu, time FROM (SELECT gpu, time, row_number() OVER (PARTITION BY gpu % 2 ORDER BY time) AS k FROM samples) WHERE k < 2 ORDER BY gpu",
            "SELECT k FROM (SELECT row_number() OVER (PARTITION BY node) AS k FROM samples) WHERE k = 1",
            // The attack of BENCHMARKS.md: a partition per row, the row read.
            "SELECT count(*), max(util), min(time) FROM (SELECT *, row_number() OVER (PARTITION BY node, gpu, time ORDER BY util DESC) AS k FROM samples) WHERE k = 1",
        ];
        for sql in queries {
            let ((want, window_plan), (got, plan)) = without_and_with(sql).await;
            assert_eq!(got, want, "{sql}\n{plan}");
            assert!(window_plan.contains("WindowAggr"), "{window_plan}");
            // An aggregate in place of the window (its first_value is pruned when no column
            // of the row is read).
            assert!(
                plan.contains("Aggregate: groupBy") && !plan.contains("WindowAggr"),
                "{sql}\n{plan}"
            );
        }
    }

    /// Not rewritten: another row number than the first, another window function, no
    /// partition, or a condition that reads the number again.
    #[tokio::test]
    async fn other_shapes_keep_their_window() {
        let queries = [
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY node ORDER BY time) AS k FROM samples) WHERE k = 2",
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY node ORDER BY time) AS k FROM samples) WHERE k <= 2",
            "SELECT * FROM (SELECT *, rank() OVER (PARTITION BY node ORDER BY time) AS k FROM samples) WHERE k = 1",
            "SELECT * FROM (SELECT *, row_number() OVER (ORDER BY time) AS k FROM samples) WHERE k = 1",
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY node ORDER BY time) AS k FROM samples) WHERE k = 1 OR k = 3",
        ];
        for sql in queries {
            let ((want, _), (got, plan)) = without_and_with(sql).await;
            assert!(!plan.contains("__perch_first_row"), "{sql}\n{plan}");
            // Same rows, in whatever order each plan gives them.
            let sorted = |s: &str| {
                let mut l: Vec<&str> = s.lines().collect();
                l.sort_unstable();
                l.join("\n")
            };
            assert_eq!(sorted(&got), sorted(&want), "{sql}");
        }
    }

    /// Where the order is one key that cannot be NULL, the row is taken by `arg_max` (for
    /// `DESC`) or `arg_min`, and the answer is still the window's.
    #[tokio::test]
    async fn a_key_that_cannot_be_null_takes_arg_max() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8, true),
            Field::new("gpu", DataType::Int64, false),
            Field::new("time", DataType::Int64, false),
            Field::new("util", DataType::Int64, true),
        ]));
        let rows = 3000i64;
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter(
                    (0..rows).map(|i| (i % 13 != 0).then(|| format!("n{}", i % 6))),
                )),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 3))),
                Arc::new(Int64Array::from_iter_values(
                    (0..rows).map(|i| (i * 7919) % 100_003),
                )),
                Arc::new(Int64Array::from_iter(
                    (0..rows).map(|i| (i % 5 != 0).then_some(i % 101)),
                )),
            ],
        )
        .expect("batch");
        let queries = [
            (
                "SELECT node, gpu, time, util FROM (SELECT node, gpu, time, util, row_number() OVER (PARTITION BY node, gpu ORDER BY time DESC) AS newest FROM samples) WHERE newest = 1 ORDER BY node, gpu",
                "arg_max",
            ),
            (
                "SELECT node, gpu, util FROM (SELECT *, row_number() OVER (PARTITION BY node, gpu ORDER BY time) AS k FROM samples WHERE util > 10) t WHERE k = 1 ORDER BY node, gpu",
                "arg_min",
            ),
            (
                "SELECT gpu, util FROM (SELECT gpu, util, row_number() OVER (PARTITION BY gpu ORDER BY time DESC NULLS LAST) AS k FROM samples) WHERE k <= 1 ORDER BY gpu",
                "arg_max",
            ),
            // Two keys: first_value, as before.
            (
                "SELECT node, util FROM (SELECT *, row_number() OVER (PARTITION BY node ORDER BY util DESC, time) AS k FROM samples) t WHERE k = 1 ORDER BY node",
                "first_value",
            ),
        ];
        for (sql, function) in queries {
            let with = super::super::test_session(
                Some(Arc::new(FirstRowPerPartition)),
                "samples",
                &batch,
                250,
            );
            let without = super::super::test_session(None, "samples", &batch, 250);
            let (want, _) = run(&without, sql).await;
            let (got, plan) = run(&with, sql).await;
            assert_eq!(got, want, "{sql}\n{plan}");
            assert!(
                plan.contains(&format!("{function}(named_struct")),
                "{sql}\n{plan}"
            );
        }
    }

    /// With a tie on the order, the window may return either tied row; so may the rewrite,
    /// but every column of the row it returns comes from one input row.
    #[tokio::test]
    async fn a_tie_gives_one_whole_row() {
        let sql = "SELECT node, gpu, time, util FROM (SELECT node, gpu, time, util, row_number() OVER (PARTITION BY node, gpu ORDER BY time DESC) AS k FROM samples) WHERE k = 1 AND time = 1000000";
        let (got, plan) = run(&session(true, true), sql).await;
        assert!(plan.contains("__perch_first_row"), "{plan}");
        // Rows 1 and 19 of the input: node n1, GPU 1, utils 1 and 19.
        assert!(
            got.contains("| n1   | 1   | 1000000 | 1    |")
                || got.contains("| n1   | 1   | 1000000 | 19   |"),
            "{got}"
        );
        assert_eq!(got.lines().count(), 5, "one row: {got}");
    }
}
