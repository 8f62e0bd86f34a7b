//! Build a hash join on its grouped-aggregate side.
//!
//! "The latest sample of every GPU" joins the samples with their own aggregate
//! (`max(time) ... GROUP BY node, gpu`). DataFusion estimates a grouped aggregate's rows as
//! its input's (it knows no distinct counts), so the two sides look the same size, the join
//! keeps the order it was written in and builds its hash table on 31 million samples
//! instead of 512 groups. An aggregate never has more rows than its input, and grouping
//! usually has far fewer: when the estimates tie or favour it, the aggregate is the build
//! side, collected whole. That also lets the join's dynamic filter (the range of the 512
//! keys, all from the last seconds) reach the samples' scan, which then skips the files and
//! row groups that cannot match.

use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct AggregateBuildSide;

impl PhysicalOptimizerRule for AggregateBuildSide {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        super::replace_nodes(plan, |join: &HashJoinExec| {
            if !should_swap(join)? {
                return Ok(None);
            }
            // Collected whole: the aggregate is no larger than the other side, so this costs
            // no more memory than partitioning it, spares repartitioning the larger side, and
            // gives the larger side's scan one dynamic filter (the keys' bounds and set) that
            // prunes files and row groups, not one per hash partition.
            join.swap_inputs(PartitionMode::CollectLeft).map(Some)
        })
    }

    fn name(&self) -> &str {
        "perch_aggregate_build_side"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

fn should_swap(join: &HashJoinExec) -> Result<bool> {
    if !matches!(
        join.mode,
        PartitionMode::CollectLeft | PartitionMode::Partitioned
    ) || !join.join_type.supports_swap()
        || join.null_aware
        || join.fetch().is_some()
        || !join.dynamic_expressions_produced().is_empty()
        || !is_grouped_aggregate(&join.right)
        || is_grouped_aggregate(&join.left)
    {
        return Ok(false);
    }
    let statistics = StatisticsContext::new();
    let left = statistics.compute(join.left.as_ref(), &StatisticsArgs::new())?;
    let right = statistics.compute(join.right.as_ref(), &StatisticsArgs::new())?;
    Ok(matches!(
        (left.num_rows.get_value(), right.num_rows.get_value()),
        (Some(l), Some(r)) if r <= l
    ))
}

/// `plan` produces the groups of a grouped aggregate, maybe through projections and
/// repartitioning.
fn is_grouped_aggregate(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let mut plan = plan;
    loop {
        if let Some(aggregate) = plan.downcast_ref::<AggregateExec>() {
            return !aggregate.group_expr().is_empty()
                && !matches!(aggregate.mode(), AggregateMode::Partial);
        }
        let passes_rows = plan.downcast_ref::<ProjectionExec>().is_some()
            || plan.downcast_ref::<RepartitionExec>().is_some()
            || plan.downcast_ref::<CoalescePartitionsExec>().is_some();
        match plan.children().first() {
            Some(child) if passes_rows => plan = child,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::AggregateBuildSide;
    use arrow::array::{Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    use datafusion::datasource::MemTable;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::physical_optimizer::PhysicalOptimizerRule;
    use datafusion::physical_plan::ExecutionPlan;
    use datafusion::physical_plan::joins::HashJoinExec;
    use datafusion::prelude::{SessionConfig, SessionContext};
    use std::sync::Arc;

    fn session(perch_rules: bool) -> SessionContext {
        let mut state = SessionStateBuilder::new()
            .with_config(SessionConfig::new().with_target_partitions(2))
            .with_default_features();
        if perch_rules {
            state = state.with_physical_optimizer_rules(super::super::physical_optimizer_rules());
        }
        let ctx = SessionContext::new_with_state(state.build());
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8, false),
            Field::new("gpu", DataType::Int64, false),
            Field::new("time", DataType::Int64, false),
            Field::new("util", DataType::Int64, false),
        ]));
        let rows = 4000i64;
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter_values(
                    (0..rows).map(|i| format!("n{}", i % 7)),
                )),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 3))),
                Arc::new(Int64Array::from_iter_values(
                    (0..rows).map(|i| (i * 37) % 1000),
                )),
                Arc::new(Int64Array::from_iter_values((0..rows).map(|i| i % 101))),
            ],
        )
        .expect("test query");
        ctx.register_table(
            "s",
            Arc::new(MemTable::try_new(schema, vec![vec![batch]]).expect("test query")),
        )
        .expect("test query");
        ctx
    }

    const LATEST: &str = "SELECT s.node, s.gpu, s.time, s.util FROM s
        JOIN (SELECT node, gpu, max(time) AS time FROM s GROUP BY node, gpu) latest
          ON s.node = latest.node AND s.gpu = latest.gpu AND s.time = latest.time
        ORDER BY s.node, s.gpu, s.util";

    /// The answer, and whether the hash join builds on the aggregate.
    async fn run(ctx: &SessionContext) -> (String, bool) {
        let df = ctx.sql(LATEST).await.expect("test query");
        let plan = df.clone().create_physical_plan().await.expect("test query");
        let mut builds_on_aggregate = None;
        plan.apply(|node| {
            if let Some(join) = node.downcast_ref::<HashJoinExec>() {
                builds_on_aggregate = Some(super::is_grouped_aggregate(&join.left));
            }
            Ok(TreeNodeRecursion::Continue)
        })
        .expect("test query");
        let batches = df.collect().await.expect("test query");
        let text = pretty_format_batches(&batches)
            .expect("test query")
            .to_string();
        (text, builds_on_aggregate.expect("a hash join"))
    }

    /// With perch's rules the hash join builds on the aggregate, with the same answers as
    /// DataFusion alone.
    #[tokio::test]
    async fn builds_on_the_aggregate() {
        let (got, ours) = run(&session(true)).await;
        let (want, _) = run(&session(false)).await;
        assert_eq!(got, want);
        assert!(got.lines().count() > 20, "{got}");
        assert!(ours);
    }

    /// The rule turns a join that builds on the samples around, whichever way DataFusion's
    /// own join selection left it.
    #[tokio::test]
    async fn turns_a_join_building_on_the_samples_around() {
        let ctx = session(false);
        let df = ctx.sql(LATEST).await.expect("test query");
        let state = ctx.state();
        let mut options = state.config_options().as_ref().clone();
        options.optimizer.enable_dynamic_filter_pushdown = false;
        options.optimizer.enable_join_dynamic_filter_pushdown = false;
        let logical = df.into_optimized_plan().expect("test query");
        let ctx = SessionContext::new_with_state(
            SessionStateBuilder::new_from_existing(state)
                .with_config(options.into())
                .build(),
        );
        let plan = ctx
            .state()
            .create_physical_plan(&logical)
            .await
            .expect("test query");
        let join_plan = find_join(&plan);
        let join = join_plan
            .downcast_ref::<HashJoinExec>()
            .expect("test query");
        let wrong = if super::is_grouped_aggregate(&join.left) {
            join.swap_inputs(join.mode).expect("test query")
        } else {
            join_plan.clone()
        };
        let wrong_join = find_join(&wrong);
        assert!(!super::is_grouped_aggregate(
            &wrong_join
                .downcast_ref::<HashJoinExec>()
                .expect("test query")
                .left
        ));
        let fixed = AggregateBuildSide
            .optimize(wrong, ctx.state().config_options())
            .expect("test query");
        let fixed_join = find_join(&fixed);
        assert!(super::is_grouped_aggregate(
            &fixed_join
                .downcast_ref::<HashJoinExec>()
                .expect("test query")
                .left
        ));
    }

    fn find_join(plan: &Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        let mut found = None;
        plan.apply(|node| {
            if node.downcast_ref::<HashJoinExec>().is_some() && found.is_none() {
                found = Some(node.clone());
            }
            Ok(TreeNodeRecursion::Continue)
        })
        .expect("test query");
        found.expect("a hash join")
    }
}
