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
//! the set of `f(x)` over the distinct `x`. It applies to an aggregate whose every aggregate
//! is insensitive to duplicates (`DISTINCT`, `min`, `max`, `approx_distinct`, `bool_and`,
//! `bool_or`, `bit_and`, `bit_or`; none with a filter or an order), which includes a plain
//! `DISTINCT` and the inner aggregate DataFusion makes of a single `count(DISTINCT ...)`
//! (`SingleDistinctToGroupBy`). It is applied only where it saves work: when every argument
//! of its aggregates, and at least one of its keys or arguments, is an expression that builds
//! a string from columns, one of them a string column (a label such as `node`, which telemetry
//! repeats in long runs). Building and hashing strings is what costs; strings built from
//! numbers alone, or an aggregate of a plain column (a measured value), would make the
//! distinct inputs as many as the rows. The other keys are computed as before, in the inner aggregate; the string
//! expressions are computed in the outer one, over its distinct inputs. Volatile expressions
//! and subqueries are left alone, and so is an aggregate whose input is already a `DISTINCT`
//! (it would gain nothing, and the rule would rewrite its own output again). The rewrite must
//! give every column the name and type it had, or the plan is left as written.

use super::strip_alias;
use datafusion::arrow::datatypes::DataType;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, DFSchema};
use datafusion::error::Result;
use datafusion::logical_expr::expr::AggregateFunction;
use datafusion::logical_expr::{Aggregate, Expr, ExprSchemable, LogicalPlan};
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

fn distinct_first(aggregate: &Aggregate) -> Result<Option<LogicalPlan>> {
    if aggregate
        .group_expr
        .iter()
        .any(|e| matches!(e, Expr::GroupingSet(_)))
    {
        return Ok(None);
    }
    if let LogicalPlan::Aggregate(below) = aggregate.input.as_ref()
        && below.aggr_expr.is_empty()
    {
        return Ok(None);
    }
    let mut args = Vec::new();
    for e in &aggregate.aggr_expr {
        match strip_alias(e) {
            Expr::AggregateFunction(f) if duplicate_insensitive(f) => {
                args.extend(f.params.args.iter())
            }
            _ => return Ok(None),
        }
    }
    let input_schema = aggregate.input.schema();
    let deferred: Vec<bool> = aggregate
        .group_expr
        .iter()
        .map(|g| builds_a_string(g, input_schema))
        .collect();
    // Every argument a string built from columns: a plain column (a measured value) would
    // make the inner aggregate as large as its input.
    if !args.iter().all(|a| builds_a_string(a, input_schema))
        || (args.is_empty() && !deferred.contains(&true))
    {
        return Ok(None);
    }
    // The inner aggregate: the keys computed as before, then every column the string keys and
    // the aggregates' arguments read, in the input's order.
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
    for arg in &args {
        carried.extend(arg.column_refs());
    }
    carried.sort_by_key(|c| input_schema.index_of_column(c).unwrap_or(usize::MAX));
    carried.dedup();
    for column in carried {
        let key = Expr::Column(column.clone());
        if !inner_keys.contains(&key) {
            inner_keys.push(key);
        }
    }
    let inner = LogicalPlan::Aggregate(Aggregate::try_new(
        aggregate.input.clone(),
        inner_keys,
        Vec::new(),
    )?);
    let outer = Aggregate::try_new(Arc::new(inner), outer_keys, aggregate.aggr_expr.clone())?;
    let same = outer.schema.fields().len() == aggregate.schema.fields().len()
        && outer
            .schema
            .iter()
            .zip(aggregate.schema.iter())
            .all(|((q1, f1), (q2, f2))| {
                q1 == q2 && f1.name() == f2.name() && f1.data_type() == f2.data_type()
            });
    Ok(same.then_some(LogicalPlan::Aggregate(outer)))
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
            // A measured value among the arguments: as many distinct inputs as rows.
            (
                "SELECT gpu, approx_distinct(node || CAST(gpu AS VARCHAR)) AS n, max(v) AS top
                 FROM t GROUP BY gpu ORDER BY gpu",
                false,
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
                    .rfind(|l| l.contains("aggr=[[]]"))
                    .unwrap_or_else(|| panic!("no inner DISTINCT:\n{plan}"));
                assert!(
                    inner.contains("t.node") && !inner.contains("||") && !inner.contains("substr"),
                    "{sql}\n{plan}"
                );
            }
        }
    }
}
