//! perch's physical optimizer rules, run with DataFusion's own in every SQL session.
//!
//! Both run right after DataFusion's join selection, which picks each hash join's build side
//! and mode from statistics, and before the rules that add repartitioning and push dynamic
//! filters into scans, so those rules see the joins as perch leaves them:
//!
//! - [`AggregateBuildSide`] builds a join on the side that is a grouped aggregate when the
//!   statistics cannot tell the two sides apart (the "latest sample of every GPU" join);
//! - [`interval_join::IntervalJoinRule`] runs joins on equal keys and a time interval (a
//!   sample inside an allocation) as an interval join.
//!
//! Three logical rules run after DataFusion's own: [`first_row::FirstRowPerPartition`] plans
//! `row_number() OVER (PARTITION BY ...) = 1` as an aggregate instead of a sort, and
//! [`merge_aggregates::MergeStackedAggregates`] merges an aggregate over an aggregate (a
//! dashboard's query over a rollup view) into one, and [`distinct_inputs::DistinctInputsFirst`]
//! runs an aggregate that ignores duplicates (`count(DISTINCT node || '/' || gpu)`) over the
//! distinct columns its strings are built from, building each string once.
//!
//! [`prefilter::PrefilterRule`] runs after all of DataFusion's rules, filter pushdown included:
//! where a filter sits on a Parquet scan, it tests the filter's comparisons on the columns'
//! pages first and gives the scan only the runs of rows that may pass (late materialization).
//! [`float_compare::FloatCompareRule`] then computes filters' float comparisons with a constant
//! in place.
//!
//! [`run_aggregate::RunAggregateRule`] runs after all of DataFusion's rules (before the final
//! sanity check): it replaces partial hash aggregations with one that looks up each run of
//! equal group keys once, which sorted telemetry is full of, and where runs are long folds
//! each run into one partial state of `count`, `sum`, `avg`, `min` or `max`.
//! [`run_aggregate::SortedPartialRule`] runs just before DataFusion's distribution and sorting
//! rules (`EnsureRequirements`): a partial aggregation over sorted input stops promising its
//! order, so the repartition to the final stage does not merge the partitions in order.

mod aggregate_build;
pub mod distinct_inputs;
pub mod first_row;
pub mod float_compare;
pub mod interval_join;
pub mod merge_aggregates;
pub mod prefilter;
pub mod run_aggregate;

pub use aggregate_build::AggregateBuildSide;

use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::error::Result;
use datafusion::logical_expr::{Expr, LogicalPlan};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;

/// DataFusion's physical optimizer rules with perch's inserted after join selection.
pub fn physical_optimizer_rules() -> Vec<Arc<dyn PhysicalOptimizerRule + Send + Sync>> {
    let mut rules = PhysicalOptimizer::new().rules;
    let at = rules
        .iter()
        .position(|r| r.name() == "join_selection")
        .map_or(rules.len(), |i| i + 1);
    rules.insert(at, Arc::new(interval_join::IntervalJoinRule));
    rules.insert(at, Arc::new(AggregateBuildSide));
    // Before the distribution and sorting rules, which then see its unordered output.
    let at = rules
        .iter()
        .position(|r| r.name() == "EnsureRequirements")
        .unwrap_or(rules.len());
    rules.insert(at, Arc::new(run_aggregate::SortedPartialRule));
    // Last but the plan's sanity check: every other rule has seen DataFusion's aggregates.
    let at = rules
        .iter()
        .position(|r| r.name() == "SanityCheckPlan")
        .unwrap_or(rules.len());
    rules.insert(at, Arc::new(run_aggregate::RunAggregateRule));
    // After DataFusion's filter pushdown, which gives each scan its copy of the filter.
    rules.insert(at, Arc::new(prefilter::PrefilterRule));
    // After the prefilter, which reads the comparisons it replaces.
    rules.insert(at + 1, Arc::new(float_compare::FloatCompareRule));
    rules
}

/// Rewrites `plan` bottom up: each node of type `T` for which `replace` gives a plan is
/// replaced by it. The skeleton of each of perch's rules.
fn replace_nodes<T: ExecutionPlan + 'static>(
    plan: Arc<dyn ExecutionPlan>,
    replace: impl Fn(&T) -> Result<Option<Arc<dyn ExecutionPlan>>>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(found) = node.downcast_ref::<T>() else {
            return Ok(Transformed::no(node));
        };
        Ok(match replace(found)? {
            Some(new) => Transformed::yes(new),
            None => Transformed::no(node),
        })
    })
    .data()
}

/// `expr` as `column op constant` with `op` a comparison, in either order (`90 < util` reads
/// as `util > 90`).
fn column_vs_constant(
    expr: &Arc<dyn datafusion::physical_expr::PhysicalExpr>,
) -> Option<(
    &datafusion::physical_expr::expressions::Column,
    datafusion::logical_expr::Operator,
    &datafusion::common::ScalarValue,
)> {
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
    let binary = expr.downcast_ref::<BinaryExpr>()?;
    let (left, right) = (binary.left(), binary.right());
    let (column, constant, op) = match (
        left.downcast_ref::<Column>(),
        right.downcast_ref::<Literal>(),
    ) {
        (Some(c), Some(l)) => (c, l, *binary.op()),
        _ => (
            right.downcast_ref::<Column>()?,
            left.downcast_ref::<Literal>()?,
            binary.op().swap()?,
        ),
    };
    matches!(
        op,
        Operator::Eq
            | Operator::NotEq
            | Operator::Lt
            | Operator::LtEq
            | Operator::Gt
            | Operator::GtEq
    )
    .then_some((column, op, constant.value()))
}

/// `expr` without the aliases around it (the logical rules look through them).
fn strip_alias(expr: &Expr) -> &Expr {
    match expr {
        Expr::Alias(a) => strip_alias(&a.expr),
        e => e,
    }
}

/// A logical rule's answer: its rewrite, or the plan as it was when the rule found nothing to
/// do or could not build the rewrite (an error from a plan constructor): the query then runs
/// as written rather than failing.
fn rewritten(plan: LogicalPlan, rewrite: Result<Option<LogicalPlan>>) -> Transformed<LogicalPlan> {
    match rewrite {
        Ok(Some(new)) => Transformed::yes(new),
        Ok(None) | Err(_) => Transformed::no(plan),
    }
}

/// The logical rules' tests: a session of 2 partitions and 64-row batches, with `rule` or
/// without, and `batch` registered as table `name` in two partitions of `chunk`-row batches.
#[cfg(test)]
pub(crate) fn test_session(
    rule: Option<Arc<dyn datafusion::optimizer::OptimizerRule + Send + Sync>>,
    name: &str,
    batch: &arrow::array::RecordBatch,
    chunk: usize,
) -> datafusion::prelude::SessionContext {
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::prelude::{SessionConfig, SessionContext};
    let mut state = SessionStateBuilder::new()
        .with_config(
            SessionConfig::new()
                .with_target_partitions(2)
                .with_batch_size(64),
        )
        .with_default_features();
    if let Some(rule) = rule {
        state = state.with_optimizer_rule(rule);
    }
    let ctx = SessionContext::new_with_state(state.build());
    let rows = batch.num_rows();
    let chunks: Vec<_> = (0..rows)
        .step_by(chunk)
        .map(|s| batch.slice(s, chunk.min(rows - s)))
        .collect();
    let half = chunks.len() / 2;
    let table = datafusion::datasource::MemTable::try_new(
        batch.schema(),
        vec![chunks[..half].to_vec(), chunks[half..].to_vec()],
    )
    .expect("table");
    ctx.register_table(name, Arc::new(table)).expect("register");
    ctx
}

/// The logical rules' tests: a query's answer, formatted, and its optimized plan.
#[cfg(test)]
pub(crate) async fn answer_and_plan(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> (String, String) {
    let df = ctx.sql(sql).await.expect("plan");
    let plan = df
        .clone()
        .into_optimized_plan()
        .expect("optimize")
        .display_indent()
        .to_string();
    let batches = df.collect().await.expect("run");
    (
        arrow::util::pretty::pretty_format_batches(&batches)
            .expect("format")
            .to_string(),
        plan,
    )
}
