//! `row_number() = 1`: the newest (or oldest) row of each partition, the way operators ask for
//! "the latest sample of every GPU". DataFusion's `WindowTopN` keeps a heap of K rows per
//! partition instead of sorting every partition whole, but it recognises only `rn <= K` and
//! `rn < K`, and it is off by default (a large K over many partitions can cost more than the
//! sort). [`FirstRowRule`] runs it for `rn = 1` (and `rank = 1`): equal to `rn <= 1`, since the
//! ranking starts at 1, and K = 1 keeps one row per partition, never more than the sort held.

use datafusion::common::ScalarValue;
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::PhysicalExprRef;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::window_topn::WindowTopN;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::filter::FilterExec;
use std::sync::Arc;

/// Runs DataFusion's per-partition top-K for filters `ranking = 1` over a window.
#[derive(Debug, Default)]
pub struct FirstRowRule;

/// `rn <= 1` for a predicate `rn = 1` or `1 = rn` on a column.
fn at_most_one(predicate: &PhysicalExprRef) -> Option<PhysicalExprRef> {
    let b = predicate.downcast_ref::<BinaryExpr>()?;
    if *b.op() != Operator::Eq {
        return None;
    }
    let is_one = |e: &PhysicalExprRef| {
        e.downcast_ref::<Literal>().is_some_and(|l| {
            matches!(
                l.value(),
                ScalarValue::UInt64(Some(1))
                    | ScalarValue::Int64(Some(1))
                    | ScalarValue::Int32(Some(1))
                    | ScalarValue::UInt32(Some(1))
            )
        })
    };
    let (column, one) = if b.left().downcast_ref::<Column>().is_some() && is_one(b.right()) {
        (b.left(), b.right())
    } else if b.right().downcast_ref::<Column>().is_some() && is_one(b.left()) {
        (b.right(), b.left())
    } else {
        return None;
    };
    Some(Arc::new(BinaryExpr::new(
        column.clone(),
        Operator::LtEq,
        one.clone(),
    )))
}

impl PhysicalOptimizerRule for FirstRowRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let mut topn = config.clone();
        topn.optimizer.enable_window_topn = true;
        super::replace_nodes::<FilterExec>(plan, |filter| {
            if filter.projection().is_some() {
                return Ok(None);
            }
            let Some(predicate) = at_most_one(filter.predicate()) else {
                return Ok(None);
            };
            let candidate: Arc<dyn ExecutionPlan> =
                Arc::new(FilterExec::try_new(predicate, filter.input().clone())?);
            let rewritten = WindowTopN::new().optimize(candidate, &topn)?;
            // WindowTopN checked the column is a ranking window's output; when it did not
            // take the filter, the `= 1` filter stays as it was.
            Ok((rewritten.downcast_ref::<FilterExec>().is_none()).then_some(rewritten))
        })
    }

    fn name(&self) -> &str {
        "perch_first_row"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::prelude::{SessionConfig, SessionContext};

    fn session(perch_rules: bool) -> SessionContext {
        let mut state = SessionStateBuilder::new()
            .with_config(SessionConfig::new().with_target_partitions(2))
            .with_default_features();
        if perch_rules {
            state = state.with_physical_optimizer_rules(super::super::physical_optimizer_rules());
        }
        SessionContext::new_with_state(state.build())
    }

    async fn run(ctx: &SessionContext, sql: &str) -> (String, String) {
        ctx.sql(
            "CREATE TABLE s AS SELECT value % 7 AS gpu, value AS t, value * 3 % 11 AS util \
             FROM generate_series(1, 5000)",
        )
        .await
        .expect("create")
        .collect()
        .await
        .expect("create");
        let df = ctx.sql(sql).await.expect("sql");
        let plan = df.clone().create_physical_plan().await.expect("plan");
        let plan = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        let rows = pretty_format_batches(&df.collect().await.expect("rows"))
            .expect("format")
            .to_string();
        (plan, rows)
    }

    /// The newest row of each GPU by `row_number() = 1` (and by `rank() = 1`) runs as a
    /// per-partition top-1 and answers what the sort answers; a filter `= 1` on an ordinary
    /// column is left alone.
    #[tokio::test]
    async fn row_number_equal_to_one_keeps_one_row_per_partition() {
        for sql in [
            "SELECT gpu, t, util FROM (SELECT gpu, t, util, row_number() OVER \
             (PARTITION BY gpu ORDER BY t DESC) AS newest FROM s) WHERE newest = 1 ORDER BY gpu",
            "SELECT gpu, t FROM (SELECT gpu, t, rank() OVER \
             (PARTITION BY gpu ORDER BY t) AS r FROM s) WHERE 1 = r ORDER BY gpu",
        ] {
            let (plan, rows) = run(&session(true), sql).await;
            let (plain, expected) = run(&session(false), sql).await;
            assert!(plan.contains("PartitionedTopKExec"), "{plan}");
            assert!(!plain.contains("PartitionedTopKExec"), "{plain}");
            assert_eq!(rows, expected, "{sql}");
            assert_eq!(rows.lines().count(), 7 + 4, "one row per GPU: {rows}");
        }
        let (plan, _) = run(
            &session(true),
            "SELECT gpu, t FROM s WHERE util = 1 ORDER BY gpu, t",
        )
        .await;
        assert!(!plan.contains("PartitionedTopKExec"), "{plan}");
    }
}
