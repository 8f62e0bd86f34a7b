//! An aggregate over an aggregate, merged into one: `SELECT node, max(t_max) FROM (SELECT node,
//! gpu, max(t) AS t_max FROM s GROUP BY node, gpu) GROUP BY node` is `SELECT node, max(t) FROM
//! s GROUP BY node`.
//!
//! The rollup views are such inner aggregates (`gpu_samples_1h` merges each bucket's partial
//! rows, grouped by time, node, GPU and its labels), and the dashboards' queries over them
//! aggregate again at coarser keys: per node, per hour, for the fleet. Planned as written,
//! every row is grouped twice, the first time by six keys, three of them strings. Merged, it is
//! grouped once, by the outer keys.
//!
//! The rewrite applies when every outer key is one of the inner keys (a column passed on
//! unchanged, through the view's projection and alias), and every outer aggregate is a plain
//! `max`, `min` or `sum` (no `DISTINCT`, filter or order) of an inner aggregate that composes
//! with it: `max` of `max`, `min` of `min`, `sum` of `sum` and, when the outer aggregate has
//! keys, `sum` of `count` (a `count` over no rows at all is 0, a `sum` over no groups NULL).
//! NULLs agree: an inner group whose values are all NULL gives NULL, which the outer
//! aggregate skips as the merged one skips the values. The merged aggregate must give each
//! column the type the outer one did (`sum` of a `sum` of decimals widens twice), or the
//! plan is left alone. Floating-point sums may differ in their last bits, being added in
//! another order, as any parallel plan's do.

use super::strip_alias;
use datafusion::common::tree_node::Transformed;
use datafusion::common::{Column, DFSchemaRef};
use datafusion::error::Result;
use datafusion::logical_expr::expr::{AggregateFunction, AggregateFunctionParams};
use datafusion::logical_expr::{Aggregate, Expr, LogicalPlan, Projection};
use datafusion::optimizer::{ApplyOrder, OptimizerConfig, OptimizerRule};
use std::sync::Arc;

/// The rewrite (see the module's documentation). A logical rule, run after DataFusion's own.
#[derive(Debug, Default)]
pub struct MergeStackedAggregates;

impl OptimizerRule for MergeStackedAggregates {
    fn name(&self) -> &str {
        "perch_merge_stacked_aggregates"
    }

    fn apply_order(&self) -> Option<ApplyOrder> {
        Some(ApplyOrder::BottomUp)
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        _config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        let LogicalPlan::Aggregate(outer) = &plan else {
            return Ok(Transformed::no(plan));
        };
        let rewrite = merge(outer);
        Ok(super::rewritten(plan, rewrite))
    }
}

/// What a column of the outer aggregate's input is, in the inner aggregate's terms.
enum Origin<'a> {
    /// One of its keys (an expression over its input).
    Key(&'a Expr),
    /// One of its aggregates.
    Aggregate(&'a AggregateFunction),
}

/// The inner aggregate under `plan`, through aliases and projections.
fn inner_aggregate(plan: &LogicalPlan) -> Option<&Aggregate> {
    match plan {
        LogicalPlan::Aggregate(a) => Some(a),
        LogicalPlan::SubqueryAlias(s) => inner_aggregate(&s.input),
        LogicalPlan::Projection(p) => inner_aggregate(&p.input),
        _ => None,
    }
}

/// Where `column` of `plan`'s output comes from in the inner aggregate, when it passes through
/// the aliases and projections between unchanged.
fn origin<'a>(plan: &'a LogicalPlan, column: &Column) -> Option<Origin<'a>> {
    let at = plan.schema().index_of_column(column).ok()?;
    match plan {
        LogicalPlan::SubqueryAlias(s) => {
            let (qualifier, field) = s.input.schema().qualified_field(at);
            origin(&s.input, &Column::new(qualifier.cloned(), field.name()))
        }
        LogicalPlan::Projection(p) => match strip_alias(p.expr.get(at)?) {
            Expr::Column(c) => origin(&p.input, c),
            _ => None,
        },
        LogicalPlan::Aggregate(a) => {
            let keys = a.group_expr.len();
            if at < keys {
                Some(Origin::Key(strip_alias(&a.group_expr[at])))
            } else {
                match strip_alias(a.aggr_expr.get(at - keys)?) {
                    Expr::AggregateFunction(f) => Some(Origin::Aggregate(f)),
                    _ => None,
                }
            }
        }
        _ => None,
    }
}

/// A plain aggregate: no DISTINCT, filter, order or null treatment.
fn plain(f: &AggregateFunction) -> bool {
    let AggregateFunctionParams {
        distinct,
        filter,
        order_by,
        null_treatment,
        ..
    } = &f.params;
    !distinct && filter.is_none() && order_by.is_empty() && null_treatment.is_none()
}

/// The merged aggregate for `outer(inner(...))`, when the two compose (see the module's
/// documentation): the inner aggregate itself.
fn composes(outer: &str, inner: &str, keyed: bool) -> bool {
    matches!(
        (outer, inner),
        ("max", "max") | ("min", "min") | ("sum", "sum")
    ) || (keyed && outer == "sum" && inner == "count")
}

fn merge(outer: &Aggregate) -> Result<Option<LogicalPlan>> {
    let Some(inner) = inner_aggregate(&outer.input) else {
        return Ok(None);
    };
    let grouping_sets = |a: &Aggregate| {
        a.group_expr
            .iter()
            .any(|e| matches!(e, Expr::GroupingSet(_)))
    };
    if grouping_sets(outer) || grouping_sets(inner) || inner.group_expr.is_empty() {
        return Ok(None);
    }
    let input = &outer.input;
    let mut keys = Vec::with_capacity(outer.group_expr.len());
    for key in &outer.group_expr {
        let Expr::Column(c) = strip_alias(key) else {
            return Ok(None);
        };
        match origin(input, c) {
            Some(Origin::Key(k)) => keys.push(k.clone()),
            _ => return Ok(None),
        }
    }
    let keyed = !keys.is_empty();
    let mut aggregates = Vec::with_capacity(outer.aggr_expr.len());
    for aggregate in &outer.aggr_expr {
        let Expr::AggregateFunction(f) = strip_alias(aggregate) else {
            return Ok(None);
        };
        let [Expr::Column(c)] = f.params.args.as_slice() else {
            return Ok(None);
        };
        if !plain(f) {
            return Ok(None);
        }
        let Some(Origin::Aggregate(g)) = origin(input, c) else {
            return Ok(None);
        };
        if !plain(g) || !composes(f.func.name(), g.func.name(), keyed) {
            return Ok(None);
        }
        aggregates.push(Expr::AggregateFunction(g.clone()));
    }
    let merged = Aggregate::try_new(inner.input.clone(), keys, aggregates)?;
    if !same_types(&merged.schema, &outer.schema) {
        return Ok(None);
    }
    // The outer aggregate's columns under their own names, so nothing above notices.
    let columns = merged
        .schema
        .iter()
        .zip(outer.schema.iter())
        .map(|((q, f), (outer_q, outer_f))| {
            Expr::Column(Column::new(q.cloned(), f.name()))
                .alias_qualified(outer_q.cloned(), outer_f.name())
        })
        .collect();
    Ok(Some(LogicalPlan::Projection(
        Projection::try_new_with_schema(
            columns,
            Arc::new(LogicalPlan::Aggregate(merged)),
            outer.schema.clone(),
        )?,
    )))
}

fn same_types(a: &DFSchemaRef, b: &DFSchemaRef) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields().iter())
            .all(|(x, y)| x.data_type() == y.data_type())
}

#[cfg(test)]
mod tests {
    use super::MergeStackedAggregates;
    use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use datafusion::prelude::SessionContext;
    use std::sync::Arc;

    /// A session over `s(node, gpu, label, hour, t, p)` with NULL values and a group whose
    /// values are all NULL, and the view `v`, a rollup of it by hour, node, GPU and label.
    async fn session(rule: bool) -> SessionContext {
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8, true),
            Field::new("gpu", DataType::Int64, false),
            Field::new("label", DataType::Utf8, false),
            Field::new("hour", DataType::Int64, false),
            Field::new("t", DataType::Int64, true),
            Field::new("p", DataType::Float64, true),
        ]));
        let rows = 2000i64;
        let node = |i: i64| (i % 17 != 0).then(|| format!("n{}", i % 5));
        // GPU 3 of node n3 never reports t: its inner groups' max and sum are NULL.
        let t = |i: i64| (i % 11 != 0 && !(i % 5 == 3 && i % 4 == 3)).then_some((i * 37) % 91);
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter((0..rows).map(node))),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 4))),
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|i| format!("m{}", i % 4 / 2)),
                )),
                Arc::new(Int64Array::from_iter_values(
                    (0..rows).map(|i| (i / 7) % 24),
                )),
                Arc::new(Int64Array::from_iter((0..rows).map(t))),
                Arc::new(Float64Array::from_iter(
                    (0..rows).map(|i| (i % 13 != 0).then_some((i % 250) as f64 * 0.5)),
                )),
            ],
        )
        .expect("batch");
        let rule = rule.then(|| Arc::new(MergeStackedAggregates) as _);
        let ctx = super::super::test_session(rule, "s", &batch, 300);
        ctx.sql(
            "CREATE VIEW v AS SELECT hour, node, gpu, label, count(*) AS samples, \
             count(t) AS t_count, max(t) AS t_max, min(t) AS t_min, sum(t) AS t_sum, \
             sum(p) AS p_sum, CAST(sum(p) AS DOUBLE) / CAST(NULLIF(count(p), 0) AS DOUBLE) AS p_avg \
             FROM s GROUP BY hour, node, gpu, label",
        )
        .await
        .expect("view");
        ctx
    }

    async fn run(ctx: &SessionContext, sql: &str) -> (String, String) {
        super::super::answer_and_plan(ctx, sql).await
    }

    /// `sql` run without the rule and with it: (answer, plan) each.
    async fn without_and_with(sql: &str) -> ((String, String), (String, String)) {
        (
            run(&session(false).await, sql).await,
            run(&session(true).await, sql).await,
        )
    }

    fn aggregates(plan: &str) -> usize {
        plan.matches("Aggregate: groupBy").count()
    }

    /// Merged: one aggregate, the same answer (the sums here are of integers and of halves,
    /// exact in any order).
    #[tokio::test]
    async fn an_aggregate_over_a_rollup_is_grouped_once() {
        let queries = [
            "SELECT node, hour AS h, max(t_max) AS hottest, sum(p_sum) / sum(samples) AS p FROM v GROUP BY node, hour ORDER BY node, h",
            "SELECT node, min(t_min), sum(t_sum), sum(t_count), sum(samples) FROM v GROUP BY node ORDER BY node",
            "SELECT label, gpu, max(t_max) FROM v WHERE hour > 3 GROUP BY label, gpu ORDER BY label, gpu",
            "SELECT max(t_max), min(t_min), sum(t_sum) FROM v",
            "SELECT * FROM (SELECT node, max(t_max) AS m FROM v GROUP BY node) WHERE m > 80 ORDER BY node",
            "SELECT node, max(m) FROM (SELECT node, gpu, max(t) AS m FROM s GROUP BY node, gpu) GROUP BY node ORDER BY node",
        ];
        for sql in queries {
            let ((want, before), (got, plan)) = without_and_with(sql).await;
            assert_eq!(got, want, "{sql}\n{plan}");
            assert_eq!(aggregates(&before), 2, "{before}");
            assert_eq!(aggregates(&plan), 1, "{sql}\n{plan}");
        }
    }

    /// Left as written (the plan is the one without the rule): a key or an aggregate the outer
    /// one computes anew, aggregates that do not compose, a count of no groups (NULL) that a
    /// count of no rows (0) would change, DISTINCT, and a HAVING or LIMIT between the two.
    #[tokio::test]
    async fn aggregates_that_do_not_compose_stay_stacked() {
        let queries = [
            "SELECT node, avg(t_max) FROM v GROUP BY node ORDER BY node",
            "SELECT node, max(t_min) FROM v GROUP BY node ORDER BY node",
            "SELECT node, sum(t_max) FROM v GROUP BY node ORDER BY node",
            "SELECT node, count(t_max) FROM v GROUP BY node ORDER BY node",
            "SELECT node, max(p_avg) FROM v GROUP BY node ORDER BY node",
            "SELECT hour % 2, max(t_max) FROM v GROUP BY hour % 2 ORDER BY 1",
            "SELECT node, sum(DISTINCT t_sum) FROM v GROUP BY node ORDER BY node",
            "SELECT sum(t_count) FROM v WHERE hour > 100",
            "SELECT node, max(t_max) FILTER (WHERE gpu = 1) FROM v GROUP BY node ORDER BY node",
            // A HAVING or a LIMIT between the two: the outer one sees fewer groups.
            "SELECT node, max(m) FROM (SELECT node, gpu, max(t) AS m FROM s GROUP BY node, gpu HAVING max(t) > 85) GROUP BY node ORDER BY node",
            "SELECT node, max(m) FROM (SELECT node, gpu, max(t) AS m FROM s GROUP BY node, gpu ORDER BY node, gpu LIMIT 5) GROUP BY node ORDER BY node",
        ];
        for sql in queries {
            let ((want, before), (got, plan)) = without_and_with(sql).await;
            assert_eq!(got, want, "{sql}\n{plan}");
            assert_eq!(plan, before, "{sql}");
        }
        // The count of no groups: NULL, as without the rule.
        let (got, _) = run(
            &session(true).await,
            "SELECT sum(t_count) AS n FROM v WHERE hour > 100",
        )
        .await;
        assert!(got.contains("|   |"), "{got}");
    }
}
