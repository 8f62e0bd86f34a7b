//! An aggregate that cannot tell duplicates apart runs over the distinct values of its inputs
//! first: `SELECT count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) FROM gpu_samples` is
//! `SELECT count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) FROM (SELECT DISTINCT node, gpu
//! FROM gpu_samples)`.
//!
//! Planned as written, the string is built for every row, then hashed: millions of strings for
//! a few hundred distinct series. Over the distinct `(node, gpu)` pairs first, the rows are
//! grouped by a view of a string and an integer (sorted telemetry groups those a run at a
//! time), and the string is built once per pair.
//!
//! The rewrite is exact for any deterministic expression: the set of `f(x)` over the rows is
//! the set of `f(x)` over the distinct `x`. It defers aggregates insensitive to duplicates
//! (`DISTINCT`, `min`, `max`, `approx_distinct`, `bool_and`, `bool_or`, `bit_and`, `bit_or`;
//! none with a filter or an order) whose every argument builds a string from columns, one of
//! them a string column (a label such as `node`, which telemetry repeats in long runs), and
//! keys that build such strings: the inner aggregate groups by the columns they read, the
//! outer one computes them over its distinct inputs. Building and hashing strings is what
//! costs; strings built from numbers alone, or a plain column (a measured value), would make
//! the distinct inputs as many as the rows. Beside them, `sum`, `count`, `min`, `max` and `avg`
//! of anything (no `DISTINCT`, filter or order) are computed per distinct input in the inner
//! aggregate and combined in the outer one (sums of sums, sums of counts, an average as its
//! sum over its count), so an average of utilization next to a count of distinct GPUs builds
//! each GPU's name once, not once per sample. Such combined sums of floats add in another
//! order than one aggregate would, and can differ in the last bits.
//!
//! It applies only where at least one string is deferred. The other keys are computed as
//! before, in the inner aggregate. Volatile expressions and subqueries are left alone, and so
//! is an aggregate over grouped rows (it would gain nothing, and the rule would rewrite its own
//! output again). The rewrite must give every column the name and type it had (an average of
//! decimals, a decimal, does not), or the plan is left as written. It includes a plain
//! `DISTINCT` and the inner aggregate DataFusion makes of a single `count(DISTINCT ...)`
//! (`SingleDistinctToGroupBy`).

use super::strip_alias;
use datafusion::arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, DFSchema};
use datafusion::error::Result;
use datafusion::functions::expr_fn::coalesce;
use datafusion::functions_aggregate::expr_fn::{count, max, min, sum};
use datafusion::logical_expr::expr::AggregateFunction;
use datafusion::logical_expr::{
    Aggregate, Expr, ExprSchemable, LogicalPlan, Projection, cast, lit,
};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use std::sync::Arc;

/// The rewrite (see the module's documentation). A logical rule, run after DataFusion's own.
#[derive(Debug, Default)]
pub struct DistinctInputsFirst;

impl OptimizerRule for DistinctInputsFirst {
    fn name(&self) -> &str {
        "perch_distinct_inputs_first"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::BottomUp)
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        let LogicalPlan::Aggregate(aggregate) = &plan else {
            return Ok(Transformed::no(plan));
        };
        let rewrite = distinct_first(aggregate);
        Ok(super::rewritten(plan, rewrite))
    }
}

/// An aggregate whose answer does not change when its input rows repeat.
fn duplicate_insensitive(f: &AggregateFunction) -> bool {
    let p = &f.params;
    p.filter.is_none()
        && p.order_by.is_empty()
        && (p.distinct
            || matches!(
                f.func.name(),
                "min" | "max" | "approx_distinct" | "bool_and" | "bool_or" | "bit_and" | "bit_or"
            ))
}

/// An expression worth computing over distinct inputs: it builds a string from columns, and
/// nothing in it is volatile or a subquery.
fn builds_a_string(expr: &Expr, schema: &DFSchema) -> bool {
    let expr = strip_alias(expr);
    if matches!(expr, Expr::Column(_) | Expr::Literal(..)) || expr.column_refs().is_empty() {
        return false;
    }
    let mut unsafe_part = false;
    let _ = expr.apply(|e| {
        unsafe_part = e.is_volatile_node()
            || matches!(
                e,
                Expr::ScalarSubquery(_)
                    | Expr::Exists(_)
                    | Expr::InSubquery(_)
                    | Expr::OuterReferenceColumn(..)
                    | Expr::Placeholder(_)
                    | Expr::AggregateFunction(_)
                    | Expr::WindowFunction(_)
            );
        Ok(if unsafe_part {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    let is_string = |t: Result<DataType>| {
        matches!(
            t,
            Ok(DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
        )
    };
    // Built from a label (a string column such as `node`), which telemetry repeats in long
    // runs: strings built from numbers alone (a measured value, a counter) are as many as the
    // rows, and grouping those first would only add work.
    !unsafe_part
        && is_string(expr.get_type(schema))
        && expr
            .column_refs()
            .iter()
            .any(|c| is_string(Expr::Column((*c).clone()).get_type(schema)))
}

/// What the rewrite does with one of the aggregate's aggregates.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    /// Computed in the outer aggregate as written, over the distinct columns its arguments
    /// read.
    Deferred,
    /// Computed as partial states in the inner aggregate, combined in the outer one.
    Sum,
    Count,
    Min,
    Max,
    Avg,
}

impl Part {
    fn of(f: &AggregateFunction, schema: &DFSchema) -> Option<Part> {
        let p = &f.params;
        if duplicate_insensitive(f)
            && !p.args.is_empty()
            && p.args.iter().all(|a| builds_a_string(a, schema))
        {
            return Some(Part::Deferred);
        }
        if p.distinct || p.filter.is_some() || !p.order_by.is_empty() || p.args.len() != 1 {
            return None;
        }
        Some(match f.func.name() {
            "sum" => Part::Sum,
            "count" => Part::Count,
            "min" => Part::Min,
            "max" => Part::Max,
            "avg" => Part::Avg,
            _ => return None,
        })
    }
}

/// The column the inner aggregate names `name`.
fn part(name: &str) -> Expr {
    Expr::Column(Column::new_unqualified(name))
}

fn distinct_first(aggregate: &Aggregate) -> Result<Option<LogicalPlan>> {
    if aggregate
        .group_expr
        .iter()
        .any(|e| matches!(e, Expr::GroupingSet(_)))
    {
        return Ok(None);
    }
    // Already over grouped rows (this rule's own inner aggregate among them): nothing to gain.
    let mut below = aggregate.input.as_ref();
    while let LogicalPlan::Projection(p) = below {
        below = p.input.as_ref();
    }
    if matches!(below, LogicalPlan::Aggregate(_)) {
        return Ok(None);
    }
    let input_schema = aggregate.input.schema();
    let mut parts = Vec::new();
    for e in &aggregate.aggr_expr {
        match strip_alias(e) {
            Expr::AggregateFunction(f) => match Part::of(f, input_schema) {
                Some(part) => parts.push((part, f)),
                None => return Ok(None),
            },
            _ => return Ok(None),
        }
    }
    let deferred: Vec<bool> = aggregate
        .group_expr
        .iter()
        .map(|g| builds_a_string(g, input_schema))
        .collect();
    // At least one string built from columns, by a key or an aggregate that can wait for the
    // distinct inputs.
    if !parts.iter().any(|(p, _)| *p == Part::Deferred) && !deferred.contains(&true) {
        return Ok(None);
    }
    // The inner aggregate: the keys computed as before, then every column the string keys and
    // the deferred aggregates' arguments read, in the input's order.
    let mut inner_keys = Vec::new();
    let mut outer_keys = Vec::new();
    let mut carried: Vec<&Column> = Vec::new();
    for (i, key) in aggregate.group_expr.iter().enumerate() {
        if deferred[i] {
            carried.extend(key.column_refs());
            outer_keys.push(key.clone());
        } else {
            inner_keys.push(key.clone());
            let (qualifier, field) = aggregate.schema.qualified_field(i);
            outer_keys.push(Expr::Column(Column::new(qualifier.cloned(), field.name())));
        }
    }
    for (_, f) in parts.iter().filter(|(p, _)| *p == Part::Deferred) {
        for arg in &f.params.args {
            carried.extend(arg.column_refs());
        }
    }
    carried.sort_by_key(|c| input_schema.index_of_column(c).unwrap_or(usize::MAX));
    carried.dedup();
    for column in carried {
        let key = Expr::Column(column.clone());
        if !inner_keys.contains(&key) {
            inner_keys.push(key);
        }
    }
    // Partial states in the inner aggregate, combined in the outer one, finished in a
    // projection over it where a combination is not the aggregate itself.
    let mut inner_aggr = Vec::new();
    let mut outer_aggr = Vec::new();
    let mut finals = Vec::new();
    let keys = aggregate.group_expr.len();
    for (i, ((kind, f), written)) in parts.iter().zip(&aggregate.aggr_expr).enumerate() {
        let name = aggregate.schema.field(keys + i).name().clone();
        if *kind == Part::Deferred {
            outer_aggr.push(written.clone());
            finals.push(part(&name));
            continue;
        }
        let arg = f.params.args[0].clone();
        let (p, q) = (format!("__perch_part_{i}"), format!("__perch_total_{i}"));
        let finished = match kind {
            Part::Sum | Part::Min | Part::Max => {
                let (inner, outer) = match kind {
                    Part::Sum => (sum(arg), sum(part(&p))),
                    Part::Min => (min(arg), min(part(&p))),
                    _ => (max(arg), max(part(&p))),
                };
                inner_aggr.push(inner.alias(&p));
                outer_aggr.push(outer.alias(&q));
                part(&q)
            }
            // A sum of counts is NULL where a count is 0: without GROUP BY, over no rows.
            Part::Count => {
                inner_aggr.push(count(arg).alias(&p));
                outer_aggr.push(sum(part(&p)).alias(&q));
                coalesce(vec![part(&q), lit(0_i64)])
            }
            // The sum over the count, NULL where no value was seen (the sum is NULL).
            Part::Avg => {
                let (ps, pn) = (format!("{p}_sum"), format!("{p}_count"));
                let (qs, qn) = (format!("{q}_sum"), format!("{q}_count"));
                inner_aggr.push(sum(arg.clone()).alias(&ps));
                inner_aggr.push(count(arg).alias(&pn));
                outer_aggr.push(sum(part(&ps)).alias(&qs));
                outer_aggr.push(sum(part(&pn)).alias(&qn));
                part(&qs) / cast(part(&qn), DataType::Float64)
            }
            Part::Deferred => unreachable!("handled above"),
        };
        finals.push(finished.alias(name));
    }
    let inner = LogicalPlan::Aggregate(Aggregate::try_new(
        aggregate.input.clone(),
        inner_keys,
        inner_aggr,
    )?);
    let outer = Aggregate::try_new(Arc::new(inner), outer_keys, outer_aggr)?;
    let plan = if parts.iter().all(|(p, _)| *p == Part::Deferred) {
        LogicalPlan::Aggregate(outer)
    } else {
        let mut exprs: Vec<Expr> = (0..keys)
            .map(|i| {
                let (qualifier, field) = outer.schema.qualified_field(i);
                Expr::Column(Column::new(qualifier.cloned(), field.name()))
            })
            .collect();
        exprs.extend(finals);
        LogicalPlan::Projection(Projection::try_new(
            exprs,
            Arc::new(LogicalPlan::Aggregate(outer)),
        )?)
    };
    let schema = plan.schema();
    let same = schema.fields().len() == aggregate.schema.fields().len()
        && schema
            .iter()
            .zip(aggregate.schema.iter())
            .all(|((q1, f1), (q2, f2))| {
                q1 == q2 && f1.name() == f2.name() && f1.data_type() == f2.data_type()
            });
    Ok(same.then_some(plan))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::{answer_and_plan, test_session};
    use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{Field, Schema};

    /// 4 nodes x 3 GPUs, 50 samples each in series order, some NULL nodes and values.
    fn samples() -> RecordBatch {
        let mut node = Vec::new();
        let mut gpu = Vec::new();
        let mut v = Vec::new();
        for n in 0..4 {
            for g in 0..3_i64 {
                for t in 0..50 {
                    node.push((n != 3 || g != 2).then(|| format!("node-{n:02}")));
                    gpu.push(g);
                    v.push((t % 7 != 0).then(|| f64::from((t * 13 + n * 5) % 97)));
                }
            }
        }
        let schema = Schema::new(vec![
            Field::new("node", DataType::Utf8, true),
            Field::new("gpu", DataType::Int64, false),
            Field::new("v", DataType::Float64, true),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(StringArray::from(node)),
                Arc::new(Int64Array::from(gpu)),
                Arc::new(Float64Array::from(v)),
            ],
        )
        .expect("batch")
    }

    /// Every shape answers as DataFusion alone does; the ones with a string built from
    /// columns are planned over the distinct columns first.
    #[tokio::test]
    async fn answers_as_written_and_builds_each_string_once_per_distinct_input() {
        let cases = [
            (
                "SELECT count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) AS n FROM t WHERE v > 20",
                true,
            ),
            (
                "SELECT gpu % 2 AS parity, count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) AS n
                 FROM t GROUP BY gpu % 2 ORDER BY parity",
                true,
            ),
            // Not one-to-one: distinct inputs give repeated strings, counted once.
            (
                "SELECT count(DISTINCT substr(node, 1, 4)) AS n FROM t",
                true,
            ),
            // DataFusion computes a DISTINCT's expressions in a projection under the aggregate,
            // whose keys are then plain columns: not rewritten (yet).
            ("SELECT DISTINCT upper(node) AS n FROM t ORDER BY n", false),
            (
                "SELECT gpu, approx_distinct(node || CAST(gpu AS VARCHAR)) AS n
                 FROM t GROUP BY gpu ORDER BY gpu",
                true,
            ),
            // Strings built from numbers alone: as many as the rows, left alone.
            (
                "SELECT count(DISTINCT concat('x', CAST(v AS VARCHAR), CAST(gpu AS VARCHAR))) AS n FROM t",
                false,
            ),
            // A measured value among the arguments: its maximum is taken in the inner
            // aggregate, not grouped by (as many distinct inputs as rows).
            (
                "SELECT gpu, approx_distinct(node || CAST(gpu AS VARCHAR)) AS n, max(v) AS top
                 FROM t GROUP BY gpu ORDER BY gpu",
                true,
            ),
            // The same string twice is computed once, in a projection under the aggregate
            // (common subexpressions): as with a DISTINCT's expressions, not rewritten (yet).
            (
                "SELECT min(concat(node, ':', CAST(gpu AS VARCHAR))) AS lo,
                        max(concat(node, ':', CAST(gpu AS VARCHAR))) AS hi FROM t",
                false,
            ),
            (
                "SELECT max(concat(node, ':', CAST(gpu AS VARCHAR))) AS hi FROM t",
                true,
            ),
            // Duplicates count: left alone.
            (
                "SELECT count(node || '/' || CAST(gpu AS VARCHAR)) AS n FROM t",
                false,
            ),
            (
                "SELECT node, count(DISTINCT gpu) AS n FROM t GROUP BY node ORDER BY node",
                false,
            ),
            (
                "SELECT count(DISTINCT node || CAST(random() AS VARCHAR)) > 0 AS n FROM t",
                false,
            ),
            // Beside aggregates that count duplicates: those are summed up per distinct
            // input in the inner aggregate and combined in the outer one.
            (
                "SELECT gpu % 2 AS parity, avg(v) AS a,
                        count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) AS n,
                        count(v) AS c, count(*) AS rows, sum(v) AS s, min(v) AS lo,
                        max(node) AS hi
                 FROM t GROUP BY gpu % 2 HAVING avg(v) > 1 ORDER BY parity",
                true,
            ),
            (
                "SELECT node, sum(gpu) AS s, count(DISTINCT node || CAST(gpu AS VARCHAR)) AS n
                 FROM t GROUP BY node ORDER BY node",
                true,
            ),
            // No rows: counts are 0, the rest NULL.
            (
                "SELECT count(v) AS c, count(*) AS rows, avg(v) AS a, sum(v) AS s,
                        count(DISTINCT node || 'x') AS n
                 FROM t WHERE v > 1000",
                true,
            ),
            // Integer sums that wrap: a sum of sums wraps to the same value.
            (
                "SELECT count(DISTINCT node || 'x') AS n,
                        sum(CAST(9223372036854775000 AS BIGINT) + gpu) AS s FROM t",
                true,
            ),
            // An average of decimals is a decimal: its sum over its count would not be.
            (
                "SELECT avg(CAST(v AS DECIMAL(10, 2))) AS a, count(DISTINCT node || 'x') AS n
                 FROM t",
                false,
            ),
            (
                "SELECT count(DISTINCT node || 'x') AS n, stddev(v) AS sd FROM t",
                false,
            ),
        ];
        let batch = samples();
        for (sql, rewritten) in cases {
            let with = test_session(Some(Arc::new(DistinctInputsFirst)), "t", &batch, 37);
            let without = test_session(None, "t", &batch, 37);
            let (answer, plan) = answer_and_plan(&with, sql).await;
            let (expected, plan_as_written) = answer_and_plan(&without, sql).await;
            assert_eq!(answer, expected, "{sql}\n{plan}");
            assert_eq!(plan != plan_as_written, rewritten, "{sql}\n{plan}");
            if rewritten {
                // The inner aggregate groups the columns the strings are built from.
                let inner = plan
                    .lines()
                    .rfind(|l| l.contains("Aggregate: groupBy="))
                    .unwrap_or_else(|| panic!("no aggregate:\n{plan}"));
                let keys = inner.split("aggr=").next().unwrap_or_default();
                assert!(
                    keys.contains("t.node") && !inner.contains("||") && !inner.contains("substr"),
                    "{sql}\n{plan}"
                );
            }
        }
    }
}
