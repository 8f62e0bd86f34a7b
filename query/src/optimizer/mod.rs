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
//! Two logical rules run after DataFusion's own: [`first_row::FirstRowPerPartition`] plans
//! `row_number() OVER (PARTITION BY ...) = 1` as an aggregate instead of a sort, and
//! [`merge_aggregates::MergeStackedAggregates`] merges an aggregate over an aggregate (a
//! dashboard's query over a rollup view) into one.
//!
//! [`run_aggregate::RunAggregateRule`] runs after all of DataFusion's rules (before the final
//! sanity check): it replaces partial hash aggregations with one that looks up each run of
//! equal group keys once, which sorted telemetry is full of.

mod aggregate_build;
pub mod first_row;
pub mod interval_join;
pub mod merge_aggregates;
pub mod run_aggregate;

pub use aggregate_build::AggregateBuildSide;

use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::error::Result;
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
    // Last but the plan's sanity check: every other rule has seen DataFusion's aggregates.
    let at = rules
        .iter()
        .position(|r| r.name() == "SanityCheckPlan")
        .unwrap_or(rules.len());
    rules.insert(at, Arc::new(run_aggregate::RunAggregateRule));
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
