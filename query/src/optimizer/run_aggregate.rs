//! Partial aggregation that looks up each run of equal group keys once.
//!
//! Telemetry arrives in runs: a Parquet file of `gpu_samples` is sorted by node, GPU and time,
//! so a batch of 8,192 samples holds one or two GPUs, and the rows an interval join makes
//! come out in the same order, one allocation after another. DataFusion's hash aggregation
//! still hashes and compares the keys of every row (the "latest sample of every GPU" query
//! spends most of its time there). [`RunAggregateExec`] does the partial stage of such an
//! aggregation: it finds where the keys change between neighbouring rows (a comparison of
//! each row with the next, column by column), looks up only the first row of each run in
//! DataFusion's own group table, gives every row of the run that group, and updates
//! DataFusion's own accumulators with all the rows. The answer is the same by construction;
//! only the lookups go. Where a batch's runs are long ([`FOLD_MIN_RUN`] rows on average),
//! `count`, `sum`, `avg`, `min` and `max` do not take the rows one by one either: arrow's
//! kernel folds each run into one partial state, merged into the run's group as the final
//! stage merges partial states ([`Fold`], which says where float sums may differ in the last
//! bits). A batch of numeric keys that does not come in runs (a count of the
//! places where they change says so) is looked up row by row, as DataFusion does; for other
//! keys, a partition whose first rows do not come in runs stops looking for them.
//!
//! The rest of DataFusion's partial stage is kept: a group table that outgrows its memory
//! is emitted early (the final stage merges partial states, so that is always correct), and
//! when nearly every row is a new group the partial stage is skipped and each row is passed
//! on as a state of its own, with DataFusion's thresholds.
//!
//! [`RunAggregateRule`] replaces partial `AggregateExec`s whose input is not declared sorted
//! (DataFusion streams those itself) that group by plain columns or expressions, without
//! grouping sets, a row limit, DISTINCT or ORDER BY inside an aggregate, and whose aggregates
//! all have group accumulators. It runs after all of DataFusion's rules, so none of them
//! needs to know this plan node.

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, GenericByteViewArray, PrimitiveArray, RecordBatch,
    UInt32Array,
};
use arrow::buffer::{BooleanBuffer, Buffer};
use arrow::compute::{partition, take};
use arrow::datatypes::{
    ArrowNativeType, ArrowNumericType, ArrowPrimitiveType, ByteViewType, DataType, Float64Type,
    Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::functions_aggregate::average::Avg;
use datafusion::functions_aggregate::count::Count as CountFunction;
use datafusion::functions_aggregate::min_max::{Max, Min};
use datafusion::functions_aggregate::sum::Sum;
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::group_values::{GroupValues, new_group_values};
use datafusion::physical_plan::aggregates::order::GroupOrdering;
use datafusion::physical_plan::aggregates::{
    AggregateExec, AggregateMode, aggregate_expressions, evaluate_many,
};
use datafusion::physical_plan::distribution_requirements::InputDistributionRequirements;
use datafusion::physical_plan::execution_plan::{CardinalityEffect, EmissionType};
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildStats, ChildrenPropertiesMode, DisplayAs, DisplayFormatType, ExecutionPlan,
    ExecutionPlanProperties, InputOrderMode, PlanProperties, ReplaceChildrenOptions, Statistics,
    StatisticsArgs, replace_children_if_necessary,
};
use futures::StreamExt;
use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Replaces eligible partial aggregations with [`RunAggregateExec`] (see the module's
/// documentation). Runs last among the physical optimizer rules.
#[derive(Debug, Default)]
pub struct RunAggregateRule;

impl PhysicalOptimizerRule for RunAggregateRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        super::replace_nodes(plan, |agg: &AggregateExec| {
            Ok(eligible(agg).then(|| {
                Arc::new(RunAggregateExec::new(Arc::new(agg.clone()))) as Arc<dyn ExecutionPlan>
            }))
        })
    }

    fn name(&self) -> &str {
        "perch_run_aggregate"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Runs before DataFusion's distribution and sorting rules (`EnsureRequirements`): in a
/// bounded plan of several partitions, a partial aggregation over sorted input stops
/// promising an order. It runs as a [`RunAggregateExec`], or, when an aggregate needs its
/// input's order, stays DataFusion's behind an [`UnorderedExec`].
///
/// DataFusion would aggregate such input in its order and keep that order through the hash
/// repartition to the final stage, with an order-preserving repartition: each output
/// partition merges the inputs' rows in key order. A day's file, sorted by node and split
/// into two ranges, holds two disjoint ranges of nodes, so the merge drains one range before
/// it takes anything from the other, and one partition's work waits on the other's. Grafana's
/// `$__timeGroup` query (each node's memory in 5-minute buckets over 6 hours) ran on 1.07 of
/// 2 cores that way. Runs of equal keys are what sorted input gives, and [`RunAggregateExec`]
/// looks each up once without needing the order; the final stage then hashes, and
/// `EnsureRequirements` adds a sort above it where an `ORDER BY` needs one. Where the order
/// lets the plan stop early it is kept (see `unorder_partials`).
#[derive(Debug, Default)]
pub struct SortedPartialRule;

impl PhysicalOptimizerRule for SortedPartialRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if config.execution.target_partitions < 2 || plan.boundedness().is_unbounded() {
            return Ok(plan);
        }
        unorder_partials(plan)
    }

    fn name(&self) -> &str {
        "perch_sorted_partial_aggregate"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Its input's rows, untouched, with their order forgotten: what sits between a partial
/// aggregation that needs its input's order and the repartition to the final stage, so that
/// the repartition does not merge the partitions in order (see [`SortedPartialRule`]).
#[derive(Debug)]
pub struct UnorderedExec {
    input: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
}

impl UnorderedExec {
    fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        let properties = Arc::new(
            input
                .properties()
                .as_ref()
                .clone()
                .with_eq_properties(EquivalenceProperties::new(input.schema())),
        );
        UnorderedExec { input, properties }
    }
}

impl DisplayAs for UnorderedExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "UnorderedExec")
    }
}

impl ExecutionPlan for UnorderedExec {
    fn name(&self) -> &str {
        "UnorderedExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match (children.pop(), children.is_empty()) {
            (Some(input), true) => Ok(Arc::new(UnorderedExec::new(input))),
            _ => Err(DataFusionError::Internal(
                "UnorderedExec takes exactly one input".into(),
            )),
        }
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        input_stats.first().cloned().ok_or_else(|| {
            DataFusionError::Internal("UnorderedExec was given no input statistics".into())
        })
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        CardinalityEffect::Equal
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        self.input.execute(partition, context)
    }
}

/// [`SortedPartialRule`] on `plan`: each partial aggregation over sorted input, except where
/// the ordered plan can stop once it has the first rows, so it is left as DataFusion planned
/// it: under a row limit (`GROUP BY node, gpu, time ORDER BY node, gpu, time LIMIT 3` over a
/// day: 11 ms in order, 372 ms and 533 MB hashed), and grouped by the raw `time`, nearly a
/// group per row, which the server's row cap stops early (the same query without the limit:
/// 55 ms in order, over the 1 GiB query limit hashed).
fn unorder_partials(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    if plan.fetch().is_some() {
        return Ok(plan);
    }
    let children = plan
        .children()
        .into_iter()
        .map(|c| unorder_partials(c.clone()))
        .collect::<Result<Vec<_>>>()?;
    let plan = replace_children_if_necessary(plan, children)?;
    let Some(agg) = plan.downcast_ref::<AggregateExec>() else {
        return Ok(plan);
    };
    if *agg.mode() != AggregateMode::Partial
        || *agg.input_order_mode() == InputOrderMode::Linear
        || groups_by_raw_time(agg)
    {
        return Ok(plan);
    }
    let agg = Arc::new(agg.clone());
    Ok(if eligible_in_any_order(&agg) {
        Arc::new(RunAggregateExec::new(agg))
    } else {
        // An aggregate that needs its input's order (the latest value of each series) keeps
        // it, and only the final stage stops waiting on it.
        Arc::new(UnorderedExec::new(agg))
    })
}

/// Whether `agg` groups by the raw `time` column, the last of every stored table's sort key
/// (`node, gpu, time`): about a group per sample, so the ordered plan is the one that can stop
/// early. A bucket of time (`date_trunc`, `floor`) is an expression, not this.
fn groups_by_raw_time(agg: &AggregateExec) -> bool {
    agg.group_expr().input_exprs().iter().any(|k| {
        k.downcast_ref::<Column>()
            .is_some_and(|c| c.name() == "time")
    })
}

fn eligible(agg: &AggregateExec) -> bool {
    *agg.input_order_mode() == InputOrderMode::Linear && eligible_in_any_order(agg)
}

/// A partial aggregation [`RunAggregateExec`] can run, whatever its input's order.
fn eligible_in_any_order(agg: &AggregateExec) -> bool {
    let group_by = agg.group_expr();
    *agg.mode() == AggregateMode::Partial
        && group_by.is_single()
        && !group_by.is_empty()
        && agg.limit_options().is_none()
        && agg.aggr_expr().iter().all(|a| {
            a.groups_accumulator_supported() && a.order_bys().is_empty() && !a.is_distinct()
        })
}

/// The partial stage of an aggregation, looking up runs of equal keys once. Plans, schema,
/// partitioning and statistics are those of the `AggregateExec` it replaces; its output
/// comes in no particular order, even where that aggregation's input was sorted.
#[derive(Debug)]
pub struct RunAggregateExec {
    agg: Arc<AggregateExec>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl RunAggregateExec {
    fn new(agg: Arc<AggregateExec>) -> Self {
        let properties = if *agg.input_order_mode() == InputOrderMode::Linear {
            agg.properties().clone()
        } else {
            // The groups are emitted all at once, when the input ends or memory runs short.
            Arc::new(
                agg.properties()
                    .as_ref()
                    .clone()
                    .with_eq_properties(EquivalenceProperties::new(agg.schema()))
                    .with_emission_type(EmissionType::Final),
            )
        };
        RunAggregateExec {
            agg,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for RunAggregateExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        struct Inner<'a>(&'a AggregateExec, DisplayFormatType);
        impl fmt::Display for Inner<'_> {
            fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
                self.0.fmt_as(self.1, f)
            }
        }
        let inner = Inner(&self.agg, t).to_string();
        let rest = inner
            .strip_prefix("AggregateExec: mode=Partial")
            .unwrap_or(&inner);
        write!(f, "RunAggregateExec: mode=Partial{rest}")
    }
}

impl ExecutionPlan for RunAggregateExec {
    fn name(&self) -> &str {
        "RunAggregateExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        self.agg.input_distribution_requirements()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![self.agg.input()]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.agg.apply_expressions(f)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let plan = Arc::new(self.agg.as_ref().clone()).replace_children(children, options)?;
        let agg = plan.downcast_ref::<AggregateExec>().ok_or_else(|| {
            DataFusionError::Internal("an AggregateExec with new children is not one".into())
        })?;
        Ok(Arc::new(RunAggregateExec::new(Arc::new(agg.clone()))))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn reset_state(self: Arc<Self>) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(RunAggregateExec::new(self.agg.clone())))
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        self.agg.child_stats_requests(partition)
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        self.agg.statistics_from_inputs(input_stats, args)
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        self.agg.cardinality_effect()
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.agg.input().execute(partition, context.clone())?;
        let options = &context.session_config().options().execution;
        let group_by = self.agg.group_expr();
        let table = Table {
            group_exprs: group_by.input_exprs(),
            arg_exprs: aggregate_expressions(self.agg.aggr_expr(), &AggregateMode::Partial, 0)?,
            filter_exprs: self.agg.filter_expr().to_vec(),
            values: new_group_values(
                group_by.group_schema(&self.agg.input().schema())?,
                &GroupOrdering::None,
            )?,
            accumulators: self
                .agg
                .aggr_expr()
                .iter()
                .map(|a| a.create_groups_accumulator())
                .collect::<Result<_>>()?,
            folds: self
                .agg
                .aggr_expr()
                .iter()
                .map(|a| Fold::of(a, &self.agg.input().schema()))
                .collect(),
            head_groups: Vec::new(),
            groups: Vec::new(),
            find_runs: true,
            rows: 0,
            runs: 0,
        };
        let state = State {
            input,
            table,
            schema: self.agg.schema(),
            batch_size: context.session_config().batch_size(),
            pending: VecDeque::new(),
            reservation: MemoryConsumer::new(format!("RunAggregateExec[{partition}]"))
                .with_can_spill(true)
                .register(context.memory_pool()),
            skip: Skip {
                probe_rows: options.skip_partial_aggregation_probe_rows_threshold,
                ratio: options.skip_partial_aggregation_probe_ratio_threshold,
                input_rows: 0,
                decided: false,
                skipping: false,
            },
            done: false,
            baseline: BaselineMetrics::new(&self.metrics, partition),
            looked_up: MetricBuilder::new(&self.metrics).counter("looked_up_rows", partition),
            folded_rows: MetricBuilder::new(&self.metrics).counter("folded_rows", partition),
            early_emits: MetricBuilder::new(&self.metrics).counter("early_emits", partition),
            skipped_rows: MetricBuilder::new(&self.metrics)
                .counter("skipped_aggregation_rows", partition),
        };
        let stream = futures::stream::try_unfold(state, |mut state| async move {
            let next = state.next_batch().await?;
            Ok(next.map(|batch| (batch, state)))
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.agg.schema(),
            stream,
        )))
    }
}

/// When to stop aggregating and pass rows on as states: DataFusion's thresholds.
struct Skip {
    probe_rows: usize,
    ratio: f64,
    /// Input rows aggregated while deciding.
    input_rows: usize,
    decided: bool,
    skipping: bool,
}

/// One partition's groups: DataFusion's group table and accumulators, and how rows are
/// assigned to them.
struct Table {
    group_exprs: Vec<Arc<dyn PhysicalExpr>>,
    arg_exprs: Vec<Vec<Arc<dyn PhysicalExpr>>>,
    filter_exprs: Vec<Option<Arc<dyn PhysicalExpr>>>,
    values: Box<dyn GroupValues>,
    accumulators: Vec<Box<dyn GroupsAccumulator>>,
    /// How each aggregate folds a run into one partial state, where it can.
    folds: Vec<Option<Fold>>,
    /// The group of each run's first row (scratch).
    head_groups: Vec<usize>,
    /// The group of each row (scratch).
    groups: Vec<usize>,
    /// Whether to look for runs of keys other than numbers; turned off when they are short.
    find_runs: bool,
    /// Rows and runs of such keys seen.
    rows: usize,
    runs: usize,
}

/// Below this many rows per run on average, runs are not worth finding: each batch of
/// numeric keys decides for itself ([`Edges::runs`]); other keys decide once, after
/// [`RUN_PROBE_ROWS`] rows. A lookup costs more than what a run adds (its head taken, its
/// groups written), so runs of two already pay: on the 50 W histogram of power over a week,
/// whose buckets change every 3.7 rows on average, batches deciding at 2 looked up 10.3 M of
/// 31 M rows and spent 363 ms aggregating, at 4 (and once per partition) 23.3 M and 608 ms.
const MIN_MEAN_RUN: usize = 2;
/// Rows seen before deciding whether runs of other keys than numbers are worth finding.
const RUN_PROBE_ROWS: usize = 65_536;
/// At or above this many rows per run on average, aggregates that can fold a run into one
/// partial state ([`Fold`]) do so: a run then costs one call of arrow's kernel over a slice
/// (about as much as 10 rows updated one by one) instead of an update per row. Runs in a
/// day's file of samples are as long as the batches when grouped by node or GPU. A count of
/// values that are never NULL (`count(*)`) folds runs of any length: it is their lengths.
const FOLD_MIN_RUN: usize = 32;

impl Table {
    fn evaluate(&self, batch: &RecordBatch) -> Result<Evaluated> {
        let keys = self
            .group_exprs
            .iter()
            .map(|e| e.evaluate(batch)?.into_array(batch.num_rows()))
            .collect::<Result<Vec<_>>>()?;
        let args = evaluate_many(&self.arg_exprs, batch)?;
        let filters = self
            .filter_exprs
            .iter()
            .map(|e| {
                e.as_ref()
                    .map(|e| {
                        let array = e.evaluate(batch)?.into_array(batch.num_rows())?;
                        array.as_boolean_opt().cloned().ok_or_else(|| {
                            DataFusionError::Internal(format!(
                                "an aggregate's FILTER is {}, not boolean",
                                array.data_type()
                            ))
                        })
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Evaluated {
            keys,
            args,
            filters,
        })
    }

    /// The runs of `keys`, with the group of each run's first row in `self.head_groups`;
    /// `None` when runs are not worth finding (they are too short).
    fn intern_runs(&mut self, keys: &[ArrayRef]) -> Result<Option<Vec<Range<usize>>>> {
        let rows = keys.first().map_or(0, |k| k.len());
        let edges = Edges::of(keys);
        let ranges = match edges {
            // Numbers and timestamps: the count of places where they change is the count of
            // runs, found with a count of set bits, so each batch decides for itself.
            Some(edges) if edges.views.is_empty() => {
                if edges.runs() * MIN_MEAN_RUN > rows {
                    return Ok(None);
                }
                edges.ranges(rows)
            }
            // Strings (whose views may differ where the values do not) and other types: the
            // runs are known once found, so the first rows decide for the rest.
            edges => {
                if self.find_runs
                    && self.rows >= RUN_PROBE_ROWS
                    && self.runs * MIN_MEAN_RUN > self.rows
                {
                    self.find_runs = false;
                }
                if !self.find_runs {
                    return Ok(None);
                }
                let ranges = match edges {
                    Some(edges) => edges.ranges(rows),
                    None => partition(keys)?.ranges(),
                };
                self.rows += rows;
                self.runs += ranges.len();
                ranges
            }
        };
        let starts = UInt32Array::from_iter_values(ranges.iter().map(|r| r.start as u32));
        let heads = keys
            .iter()
            .map(|k| take(k.as_ref(), &starts, None))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        self.values.intern(&heads, &mut self.head_groups)?;
        Ok(Some(ranges))
    }

    /// Aggregates `batch`; returns how many rows were looked up in the group table, and how
    /// many were folded a run at a time (by at least one aggregate).
    fn aggregate(&mut self, batch: &RecordBatch) -> Result<(usize, usize)> {
        let Evaluated {
            keys,
            args,
            filters,
        } = self.evaluate(batch)?;
        let rows = batch.num_rows();
        let Some(ranges) = self.intern_runs(&keys)? else {
            self.values.intern(&keys, &mut self.groups)?;
            self.update(&args, &filters)?;
            return Ok((rows, 0));
        };
        let total = self.values.len();
        let long = rows >= FOLD_MIN_RUN * ranges.len();
        let (mut grouped, mut folded) = (false, false);
        for (i, acc) in self.accumulators.iter_mut().enumerate() {
            if filters[i].is_none()
                && let Some(fold) = self.folds[i]
                // A count of values that are never NULL (`count(*)`) is each run's length:
                // worth taking for runs of any length.
                && (long || (fold == Fold::Count && args[i][0].logical_null_count() == 0))
            {
                let states = fold.states(&args[i][0], &ranges)?;
                acc.merge_batch(&states, &self.head_groups, total)?;
                folded = true;
                continue;
            }
            if !grouped {
                self.groups.clear();
                self.groups.reserve(rows);
                for (range, &group) in ranges.iter().zip(&self.head_groups) {
                    self.groups
                        .extend(std::iter::repeat_n(group, range.end - range.start));
                }
                grouped = true;
            }
            acc.update_batch(&args[i], &self.groups, filters[i].as_ref(), total)?;
        }
        Ok((ranges.len(), if folded { rows } else { 0 }))
    }

    /// Updates every accumulator with the rows whose groups are in `self.groups`.
    fn update(&mut self, args: &[Vec<ArrayRef>], filters: &[Option<BooleanArray>]) -> Result<()> {
        let total = self.values.len();
        for ((acc, args), filter) in self.accumulators.iter_mut().zip(args).zip(filters) {
            acc.update_batch(args, &self.groups, filter.as_ref(), total)?;
        }
        Ok(())
    }

    /// Every group so far, as keys and partial states; the table is empty afterwards.
    fn emit(&mut self, schema: &arrow::datatypes::SchemaRef) -> Result<Option<RecordBatch>> {
        if self.values.is_empty() {
            return Ok(None);
        }
        let mut columns = self.values.emit(EmitTo::All)?;
        for acc in &mut self.accumulators {
            columns.extend(acc.state(EmitTo::All)?);
        }
        self.values.clear_shrink(0);
        Ok(Some(RecordBatch::try_new(schema.clone(), columns)?))
    }

    fn memory(&self) -> usize {
        self.values.size()
            + self.accumulators.iter().map(|a| a.size()).sum::<usize>()
            + (self.groups.capacity() + self.head_groups.capacity()) * size_of::<usize>()
    }

    /// `batch` as one state per row, keys first (the partial stage skipped).
    fn to_states(
        &self,
        batch: &RecordBatch,
        schema: &arrow::datatypes::SchemaRef,
    ) -> Result<RecordBatch> {
        let Evaluated {
            mut keys,
            args,
            filters,
        } = self.evaluate(batch)?;
        for ((acc, args), filter) in self.accumulators.iter().zip(&args).zip(&filters) {
            keys.extend(acc.convert_to_state(args, filter.as_ref())?);
        }
        Ok(RecordBatch::try_new(schema.clone(), keys)?)
    }
}

/// Where the keys of neighbouring rows differ, found without comparing values. Fixed-width
/// keys (numbers, timestamps) are compared by their bits: rows whose slots are bitwise equal
/// and both valid have equal keys. The converse need not hold (0.0 and -0.0, two NULLs),
/// which only splits a run and costs one more lookup. String views (how parquet and
/// DataFusion hand over strings) are compared by their 16-byte views first; where two views
/// differ only the values can tell (a long string stored twice), and those few places are
/// checked by value when the runs are made.
struct Edges<'a> {
    /// Bit `i` set where some key surely changes between rows `i` and `i + 1`.
    sure: BooleanBuffer,
    /// Bit `i` set where a string view changes (its value perhaps not).
    maybe: BooleanBuffer,
    views: Vec<&'a dyn Array>,
}

impl<'a> Edges<'a> {
    /// `None` for keys some of which have no fixed-width slots (arrow's comparison of
    /// values finds their runs), or no rows.
    fn of(keys: &'a [ArrayRef]) -> Option<Edges<'a>> {
        let rows = keys.first()?.len();
        if rows == 0 {
            return None;
        }
        let mut edges = Edges {
            sure: BooleanBuffer::new_unset(rows - 1),
            maybe: BooleanBuffer::new_unset(rows - 1),
            views: Vec::new(),
        };
        for key in keys {
            let differ = slots_differ(key.as_ref())?;
            if matches!(key.data_type(), DataType::Utf8View | DataType::BinaryView) {
                edges.maybe = &edges.maybe | &differ;
                edges.views.push(key.as_ref());
            } else {
                edges.sure = &edges.sure | &differ;
            }
        }
        Some(edges)
    }

    /// How many runs of equal keys the rows are in, where no key is a string view: one more
    /// than the places where a key changes.
    fn runs(&self) -> usize {
        self.sure.count_set_bits() + 1
    }

    /// The runs of `rows` rows with equal keys, as row ranges in order.
    fn ranges(&self, rows: usize) -> Vec<Range<usize>> {
        let mut ranges = Vec::new();
        let mut start = 0;
        let mut cut = |edge: usize| {
            ranges.push(start..edge + 1);
            start = edge + 1;
        };
        if self.views.is_empty() {
            self.sure.set_indices().for_each(&mut cut);
        } else {
            for edge in (&self.sure | &self.maybe).set_indices() {
                if self.sure.value(edge) || self.views.iter().any(|v| view_changes(*v, edge)) {
                    cut(edge);
                }
            }
        }
        ranges.push(start..rows);
        ranges
    }
}

/// Bit `i` set where row `i + 1`'s slot or validity differs from row `i`'s; `None` for a
/// type without fixed-width slots (or a buffer that cannot be read as such).
fn slots_differ(key: &dyn Array) -> Option<BooleanBuffer> {
    let data = key.to_data();
    let buffer = data.buffers().first()?;
    let (offset, len) = (data.offset(), data.len());
    let width = match key.data_type() {
        DataType::Utf8View | DataType::BinaryView => 16,
        t => t.primitive_width()?,
    };
    let mut differ = match width {
        1 => adjacent_differ::<u8>(buffer, offset, len),
        2 => adjacent_differ::<u16>(buffer, offset, len),
        4 => adjacent_differ::<u32>(buffer, offset, len),
        8 => adjacent_differ::<u64>(buffer, offset, len),
        16 => adjacent_differ::<u128>(buffer, offset, len),
        _ => None,
    }?;
    if let Some(nulls) = key.logical_nulls() {
        let valid = nulls.inner();
        let n = len - 1;
        differ = &differ | &(&valid.slice(0, n) ^ &valid.slice(1, n));
    }
    Some(differ)
}

/// Whether the string (or binary) view column `key` holds another value in row `i + 1` than
/// in row `i`.
fn view_changes(key: &dyn Array, i: usize) -> bool {
    match (key.is_valid(i), key.is_valid(i + 1)) {
        (false, false) => false,
        (true, true) => match key.data_type() {
            DataType::Utf8View => view_value_changes(key.as_string_view(), i),
            _ => view_value_changes(key.as_binary_view(), i),
        },
        _ => true,
    }
}

/// Equal views are equal values. Different views are different values when inline (up to
/// 12 bytes, zero-padded) or of another length or prefix; otherwise the bytes decide.
fn view_value_changes<T: ByteViewType + ?Sized>(array: &GenericByteViewArray<T>, i: usize) -> bool {
    let views = array.views();
    let (a, b) = (views[i], views[i + 1]);
    if a == b {
        return false;
    }
    // The length is in the low 32 bits, then a 4-byte prefix.
    if (a as u32) <= 12 || a as u64 != b as u64 {
        return true;
    }
    let (x, y): (&[u8], &[u8]) = (array.value(i).as_ref(), array.value(i + 1).as_ref());
    x != y
}

fn adjacent_differ<T: ArrowNativeType>(
    buffer: &Buffer,
    offset: usize,
    len: usize,
) -> Option<BooleanBuffer> {
    let bytes = buffer.as_slice();
    if bytes.as_ptr().align_offset(align_of::<T>()) != 0
        || !bytes.len().is_multiple_of(size_of::<T>())
    {
        return None;
    }
    let slots = buffer.typed_data::<T>().get(offset..offset + len)?;
    Some(BooleanBuffer::collect_bool(len - 1, |i| {
        slots[i] != slots[i + 1]
    }))
}

/// An aggregate whose partial state for a run of rows is the run's own aggregate, made by
/// arrow's kernel over the run's slice and merged into the run's group as the final stage
/// merges partial states (`GroupsAccumulator::merge_batch`).
///
/// Counts, and minima and maxima of integers and times, are exactly those the row-by-row
/// update gives. A sum or average of floats adds the run's values in arrow's lanes before
/// adding the run to its group, so it can differ from the row-by-row order in the last bits,
/// as DataFusion's own answers differ with the partitioning (and its `avg` without groups
/// uses the same kernel). Minima and maxima of floats are left to the row-by-row update:
/// DataFusion's treat NaN by arrival order, arrow's kernel as the largest value.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fold {
    Count,
    Sum,
    Avg,
    Min,
    Max,
}

impl Fold {
    /// How `expr` folds runs of rows from `input`, if it can: one of DataFusion's own
    /// `count`, `sum`, `avg`, `min` or `max` of one argument, with the partial state its
    /// accumulator merges for that argument's type.
    fn of(expr: &AggregateFunctionExpr, input: &arrow::datatypes::Schema) -> Option<Fold> {
        let [arg] = expr.expressions().try_into().ok()?;
        if expr.is_distinct() || !expr.order_bys().is_empty() {
            return None;
        }
        let arg = arg.data_type(input).ok()?;
        let states: Vec<DataType> = expr
            .state_fields()
            .ok()?
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        let udf = expr.fun().inner().as_ref();
        let fold = if udf.is::<CountFunction>() {
            Fold::Count
        } else if udf.is::<Sum>() {
            Fold::Sum
        } else if udf.is::<Avg>() {
            Fold::Avg
        } else if udf.is::<Min>() {
            Fold::Min
        } else if udf.is::<Max>() {
            Fold::Max
        } else {
            return None;
        };
        let fits = match fold {
            Fold::Count => states == [DataType::Int64],
            Fold::Sum => {
                states == [arg.clone()]
                    && matches!(arg, DataType::Int64 | DataType::UInt64 | DataType::Float64)
            }
            Fold::Avg => {
                arg == DataType::Float64 && states == [DataType::UInt64, DataType::Float64]
            }
            Fold::Min | Fold::Max => states == [arg.clone()] && integers(&arg).is_some(),
        };
        fits.then_some(fold)
    }

    /// The partial state of each run of `values`, in the order of `runs`.
    fn states(self, values: &ArrayRef, runs: &[Range<usize>]) -> Result<Vec<ArrayRef>> {
        Ok(match self {
            Fold::Count => vec![Arc::new(counts::<Int64Type>(values, runs))],
            Fold::Sum => vec![match values.data_type() {
                DataType::Int64 => sums::<Int64Type>(values, runs),
                DataType::UInt64 => sums::<UInt64Type>(values, runs),
                DataType::Float64 => sums::<Float64Type>(values, runs),
                other => return Err(unfoldable(self, other)),
            }],
            Fold::Avg => {
                // DataFusion's partial state of an average marks a group with no values by a
                // NULL count as well as a NULL sum.
                let sums = sums::<Float64Type>(values, runs);
                let counts = counts::<UInt64Type>(values, runs);
                let counts = PrimitiveArray::<UInt64Type>::new(
                    counts.values().clone(),
                    sums.logical_nulls(),
                );
                vec![Arc::new(counts), sums]
            }
            Fold::Min | Fold::Max => {
                let Some(physical) = integers(values.data_type()) else {
                    return Err(unfoldable(self, values.data_type()));
                };
                // Times are integers underneath: fold those, then give back the time type.
                let raw = arrow::array::make_array(
                    values
                        .to_data()
                        .into_builder()
                        .data_type(physical)
                        .build()?,
                );
                let max = self == Fold::Max;
                let folded = match raw.data_type() {
                    DataType::Int8 => extremes::<Int8Type>(&raw, runs, max),
                    DataType::Int16 => extremes::<Int16Type>(&raw, runs, max),
                    DataType::Int32 => extremes::<Int32Type>(&raw, runs, max),
                    DataType::Int64 => extremes::<Int64Type>(&raw, runs, max),
                    DataType::UInt8 => extremes::<UInt8Type>(&raw, runs, max),
                    DataType::UInt16 => extremes::<UInt16Type>(&raw, runs, max),
                    DataType::UInt32 => extremes::<UInt32Type>(&raw, runs, max),
                    DataType::UInt64 => extremes::<UInt64Type>(&raw, runs, max),
                    other => return Err(unfoldable(self, other)),
                };
                vec![arrow::array::make_array(
                    folded
                        .to_data()
                        .into_builder()
                        .data_type(values.data_type().clone())
                        .build()?,
                )]
            }
        })
    }
}

fn unfoldable(fold: Fold, data_type: &DataType) -> DataFusionError {
    DataFusionError::Internal(format!("{fold:?} cannot fold runs of {data_type}"))
}

/// The integer type that holds `data_type`'s values, for the integers and the types of time
/// that order as their integers do.
fn integers(data_type: &DataType) -> Option<DataType> {
    use DataType::*;
    match data_type {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 => Some(data_type.clone()),
        Date32 | Time32(_) => Some(Int32),
        Date64 | Time64(_) | Timestamp(_, _) | Duration(_) => Some(Int64),
        _ => None,
    }
}

/// The values each run counts: its rows less its NULLs.
fn counts<T: ArrowPrimitiveType>(values: &ArrayRef, runs: &[Range<usize>]) -> PrimitiveArray<T> {
    let nulls = values.logical_nulls().filter(|n| n.null_count() > 0);
    PrimitiveArray::<T>::from_iter_values(runs.iter().map(|run| {
        let len = run.end - run.start;
        let valid = len
            - nulls
                .as_ref()
                .map_or(0, |n| n.slice(run.start, len).null_count());
        T::Native::usize_as(valid)
    }))
}

/// Each run's sum (NULL where it has no values), by arrow's kernel, wrapping as DataFusion's
/// `sum` wraps.
fn sums<T: ArrowNumericType>(values: &ArrayRef, runs: &[Range<usize>]) -> ArrayRef {
    let values = values.as_primitive::<T>();
    Arc::new(
        runs.iter()
            .map(|run| arrow::compute::sum(&values.slice(run.start, run.end - run.start)))
            .collect::<PrimitiveArray<T>>(),
    )
}

/// Each run's minimum or maximum (NULL where it has no values).
fn extremes<T: ArrowNumericType>(values: &ArrayRef, runs: &[Range<usize>], max: bool) -> ArrayRef {
    let values = values.as_primitive::<T>();
    Arc::new(
        runs.iter()
            .map(|run| {
                let run = values.slice(run.start, run.end - run.start);
                if max {
                    arrow::compute::max(&run)
                } else {
                    arrow::compute::min(&run)
                }
            })
            .collect::<PrimitiveArray<T>>(),
    )
}

struct Evaluated {
    keys: Vec<ArrayRef>,
    args: Vec<Vec<ArrayRef>>,
    filters: Vec<Option<BooleanArray>>,
}

struct State {
    input: SendableRecordBatchStream,
    table: Table,
    schema: arrow::datatypes::SchemaRef,
    batch_size: usize,
    /// Output ready to be returned, at most `batch_size` rows each.
    pending: VecDeque<RecordBatch>,
    reservation: MemoryReservation,
    skip: Skip,
    done: bool,
    baseline: BaselineMetrics,
    looked_up: Count,
    folded_rows: Count,
    early_emits: Count,
    skipped_rows: Count,
}

impl State {
    async fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        loop {
            if let Some(batch) = self.pending.pop_front() {
                self.baseline.record_output(batch.num_rows());
                return Ok(Some(batch));
            }
            if self.done {
                self.reservation.free();
                return Ok(None);
            }
            match self.input.next().await {
                Some(batch) => {
                    let batch = batch?;
                    let elapsed = self.baseline.elapsed_compute().clone();
                    let _timer = elapsed.timer();
                    self.consume(&batch)?;
                }
                None => {
                    let elapsed = self.baseline.elapsed_compute().clone();
                    let _timer = elapsed.timer();
                    self.emit()?;
                    self.done = true;
                }
            }
        }
    }

    fn consume(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if self.skip.skipping {
            self.skipped_rows.add(batch.num_rows());
            let states = self.table.to_states(batch, &self.schema)?;
            self.pending.push_back(states);
            return Ok(());
        }
        let (looked_up, folded) = self.table.aggregate(batch)?;
        self.looked_up.add(looked_up);
        self.folded_rows.add(folded);
        self.decide_skip(batch.num_rows());
        if self.skip.skipping {
            return self.emit();
        }
        if self.reservation.try_resize(self.table.memory()).is_err() {
            // The final stage merges partial states, so emitting what is here is correct
            // and frees the table.
            self.early_emits.add(1);
            self.emit()?;
        }
        Ok(())
    }

    /// Once `probe_rows` input rows are in, skip the partial stage for the rest of the input
    /// if the groups number at least `ratio` of them (the stage would barely reduce).
    fn decide_skip(&mut self, rows: usize) {
        if self.skip.decided {
            return;
        }
        self.skip.input_rows += rows;
        if self.skip.input_rows < self.skip.probe_rows {
            return;
        }
        self.skip.decided = true;
        self.skip.skipping =
            self.table.values.len() as f64 >= self.skip.ratio * self.skip.input_rows as f64;
    }

    fn emit(&mut self) -> Result<()> {
        if let Some(batch) = self.table.emit(&self.schema)? {
            let mut offset = 0;
            while offset < batch.num_rows() {
                let len = self.batch_size.min(batch.num_rows() - offset);
                self.pending.push_back(batch.slice(offset, len));
                offset += len;
            }
        }
        let _ = self.reservation.try_resize(self.table.memory());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array, StringViewArray};
    use arrow::datatypes::{Field, Schema};
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::execution::runtime_env::RuntimeEnvBuilder;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::physical_plan::{collect, displayable};
    use datafusion::prelude::{SessionConfig, SessionContext};
    use proptest::prelude::*;

    /// A run of rows with the same keys: (length, node, gpu, value seed).
    type Run = (usize, Option<u8>, Option<i64>, i64);

    fn table(runs: &[Run], batch_rows: usize) -> MemTable {
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8View, true),
            Field::new("gpu", DataType::Int64, true),
            Field::new("f", DataType::Float64, true),
            Field::new("v", DataType::Int64, true),
        ]));
        let mut node = Vec::new();
        let mut gpu = Vec::new();
        let mut f = Vec::new();
        let mut v = Vec::new();
        for &(len, n, g, seed) in runs {
            for i in 0..len {
                // Long names are stored out of line in the views, short ones inline.
                node.push(n.map(|n| {
                    if n % 2 == 0 {
                        format!("n{n}")
                    } else {
                        format!("node-with-a-long-name-{n}")
                    }
                }));
                gpu.push(g);
                let x = seed.wrapping_mul(31).wrapping_add(i as i64) % 7;
                f.push(match x {
                    0 => None,
                    1 => Some(-0.0),
                    2 => Some(0.0),
                    3 => Some(f64::NAN),
                    _ => Some(x as f64 / 2.0),
                });
                v.push((x != 4).then_some(seed % 100 + i as i64));
            }
        }
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringViewArray::from_iter(node)),
                Arc::new(Int64Array::from(gpu)),
                Arc::new(Float64Array::from(f)),
                Arc::new(Int64Array::from(v)),
            ],
        )
        .expect("test batch");
        let batches: Vec<RecordBatch> = (0..batch.num_rows())
            .step_by(batch_rows.max(1))
            .map(|at| batch.slice(at, batch_rows.min(batch.num_rows() - at)))
            .collect();
        let (p0, p1) = batches.split_at(batches.len() / 2);
        MemTable::try_new(schema, vec![p0.to_vec(), p1.to_vec()]).expect("test table")
    }

    fn session(runs: bool, skip_probe_rows: usize, memory: Option<usize>) -> SessionContext {
        let mut config = SessionConfig::new()
            .with_target_partitions(2)
            .with_batch_size(64);
        config
            .options_mut()
            .execution
            .skip_partial_aggregation_probe_rows_threshold = skip_probe_rows;
        let mut runtime = RuntimeEnvBuilder::new();
        if let Some(bytes) = memory {
            runtime = runtime.with_memory_limit(bytes, 1.0);
        }
        let mut state = SessionStateBuilder::new()
            .with_config(config)
            .with_runtime_env(runtime.build_arc().expect("runtime"))
            .with_default_features();
        if runs {
            state = state.with_physical_optimizer_rules(super::super::physical_optimizer_rules());
        }
        SessionContext::new_with_state(state.build())
    }

    /// A session with perch's rules and one without, each with `runs` as table `t`.
    fn both(
        runs: &[Run],
        batch_rows: usize,
        skip_probe_rows: usize,
    ) -> (SessionContext, SessionContext) {
        let with = session(true, skip_probe_rows, None);
        let without = session(false, skip_probe_rows, None);
        for ctx in [&with, &without] {
            ctx.register_table("t", Arc::new(table(runs, batch_rows)))
                .expect("test table");
        }
        (with, without)
    }

    const QUERIES: &[&str] = &[
        "SELECT node, gpu, count(*) AS n, count(v) AS nv, sum(v) AS s, avg(v) AS a,
                min(v) AS lo, max(f) AS hi, min(f) AS flo, max(node) AS mx
         FROM t GROUP BY node, gpu ORDER BY node, gpu",
        "SELECT gpu % 3 AS m, sum(v) FILTER (WHERE v > 10) AS big, count(*) AS n
         FROM t GROUP BY gpu % 3 ORDER BY m",
        "SELECT f, count(*) AS n, sum(v) AS s FROM t GROUP BY f ORDER BY f",
        "SELECT node, max(gpu) AS g FROM t GROUP BY node ORDER BY node",
        "SELECT node, gpu, min(v) AS lo, max(v) AS hi FROM t GROUP BY node, gpu ORDER BY node, gpu",
    ];

    /// Runs `sql`; returns its rows as text, its plan, and the sum of a metric over the
    /// plan's `RunAggregateExec`s.
    async fn run(ctx: &SessionContext, sql: &str, metric: &str) -> (String, String, usize) {
        let df = ctx.sql(sql).await.expect("test query");
        let plan = df.create_physical_plan().await.expect("test query");
        let batches = collect(plan.clone(), ctx.task_ctx())
            .await
            .expect("test query");
        let mut total = 0;
        let mut stack = vec![plan.clone()];
        while let Some(node) = stack.pop() {
            if node.name() == "RunAggregateExec"
                && let Some(value) = node.metrics().and_then(|m| m.sum_by_name(metric))
            {
                total += value.as_usize();
            }
            stack.extend(node.children().into_iter().cloned());
        }
        (
            pretty_format_batches(&batches)
                .expect("test query")
                .to_string(),
            displayable(plan.as_ref()).indent(false).to_string(),
            total,
        )
    }

    async fn check(runs: Vec<Run>, batch_rows: usize, skip_probe_rows: usize) {
        let (with, without) = both(&runs, batch_rows, skip_probe_rows);
        for sql in QUERIES {
            let (got, plan, _) = run(&with, sql, "looked_up_rows").await;
            let (want, stock, _) = run(&without, sql, "looked_up_rows").await;
            assert!(plan.contains("RunAggregateExec"), "{sql}\n{plan}");
            assert!(!stock.contains("RunAggregateExec"));
            assert_eq!(got, want, "{sql}\n{plan}");
        }
    }

    fn run_strategy() -> impl Strategy<Value = Run> {
        (
            prop_oneof![Just(1usize), 1usize..5, 1usize..200],
            prop::option::weighted(0.9, 0u8..5),
            prop::option::weighted(0.9, -2i64..4),
            any::<i64>().prop_map(|s| s.rem_euclid(1000)),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
        /// Long runs, runs of one row, null keys, -0.0 next to 0.0 and NaN as keys, FILTER
        /// and expressions as keys, batches cutting runs, the partial stage skipped or
        /// not: the answers are DataFusion's own.
        #[test]
        fn answers_what_datafusion_answers(
            runs in prop::collection::vec(run_strategy(), 0..60),
            batch_rows in prop_oneof![Just(7usize), Just(64), Just(1000)],
            skip_probe_rows in prop_oneof![Just(0usize), Just(100_000)],
        ) {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime")
                .block_on(check(runs, batch_rows, skip_probe_rows));
        }
    }

    /// On sorted telemetry only the first row of each run is looked up.
    #[tokio::test]
    async fn looks_up_runs_not_rows() {
        let runs: Vec<Run> = (0..40)
            .map(|i| (500, Some(i % 5), Some(i64::from(i)), 1))
            .collect();
        let ctx = session(true, 100_000, None);
        ctx.register_table("t", Arc::new(table(&runs, 1000)))
            .expect("test table");
        let (_, _, looked_up) = run(&ctx, QUERIES[0], "looked_up_rows").await;
        // 20,000 rows in 40 runs, read in batches of 64 rows: a lookup per run and at most
        // one more per batch (a run a batch starts in the middle of).
        let batches = 20_000usize.div_ceil(64) + 2;
        assert!((40..=40 + batches).contains(&looked_up), "{looked_up}");
    }

    /// Long runs are folded a run at a time by `count`, `sum`, `avg`, `min` and `max`
    /// (integers, times, NULLs in runs and whole runs of NULL), beside aggregates that are
    /// not (of floats, of strings, with FILTER): the answers are DataFusion's, exactly where
    /// the values are integers, and within rounding for sums of fractions.
    #[tokio::test]
    async fn folds_long_runs_with_the_answers_datafusion_gives() {
        let mut runs: Vec<Run> = (0..60)
            .map(|i| {
                (
                    300 + 7 * i as usize,
                    Some(i % 5),
                    Some(i64::from(i % 4)),
                    i64::from(i),
                )
            })
            .collect();
        // A run of 200 rows with no values of `v` (`table` leaves it NULL where
        // (seed * 31 + i) % 7 == 4, so at seed 6 on the first row of each run of one).
        runs.extend([(1, Some(9), Some(9), 6); 200]);
        let (with, without) = both(&runs, 1000, 100_000);
        for sql in [
            QUERIES[0],
            "SELECT node, count(*) AS n, count(v) AS nv, sum(v) AS s, min(v) AS lo,
                    max(v) AS hi, avg(v) AS a, sum(v) FILTER (WHERE v > 50) AS big,
                    max(arrow_cast(v, 'Timestamp(Millisecond, None)')) AS last,
                    min(arrow_cast(arrow_cast(v, 'Int32'), 'Date32')) AS first_day,
                    min(arrow_cast(v, 'UInt16')) AS small
             FROM t GROUP BY node ORDER BY node",
            "SELECT gpu, sum(f * 2) AS twice, avg(v * 4) AS a FROM t
             WHERE NOT isnan(f) GROUP BY gpu ORDER BY gpu",
        ] {
            let (got, plan, folded) = run(&with, sql, "folded_rows").await;
            let (want, _, _) = run(&without, sql, "folded_rows").await;
            assert!(folded > 10_000, "{folded} rows folded\n{sql}\n{plan}");
            assert_eq!(got, want, "{sql}\n{plan}");
        }
        // Fractions: `f` is a multiple of 0.5, so every sum is exact in either order; a
        // tenth of it is not.
        let sql = "SELECT gpu, sum(f / 10) AS s, avg(f / 10) AS a FROM t
                   WHERE NOT isnan(f) GROUP BY gpu ORDER BY gpu";
        let numbers = |text: String| -> Vec<f64> {
            text.split(['|', '\n'])
                .filter_map(|cell| cell.trim().parse::<f64>().ok())
                .collect()
        };
        let (got, plan, folded) = run(&with, sql, "folded_rows").await;
        let (want, _, _) = run(&without, sql, "folded_rows").await;
        assert!(folded > 10_000, "{folded} rows folded\n{plan}");
        let (got, want) = (numbers(got), numbers(want));
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-9 * w.abs().max(1.0),
                "{got:?} against {want:?}"
            );
        }
    }

    /// Keys that change on every row: runs are given up on, every row is looked up, and the
    /// answer is still DataFusion's.
    #[tokio::test]
    async fn gives_up_on_short_runs() {
        let runs: Vec<Run> = (0..100_000)
            .map(|i| (1, Some((i % 3) as u8), Some(i64::from(i % 2)), 5))
            .collect();
        let ctx = session(true, usize::MAX, None);
        ctx.register_table("t", Arc::new(table(&runs, 4096)))
            .expect("test table");
        let (got, _, looked_up) = run(&ctx, QUERIES[0], "looked_up_rows").await;
        assert_eq!(looked_up, 100_000);
        let stock = session(false, usize::MAX, None);
        stock
            .register_table("t", Arc::new(table(&runs, 4096)))
            .expect("test table");
        assert_eq!(got, run(&stock, QUERIES[0], "looked_up_rows").await.0);
    }

    /// Each batch of numeric keys decides whether its runs are worth finding: a partition
    /// whose first rows change keys on every row (past the probe that decides for string
    /// keys, in each of the two partitions) still finds the long runs after them (a decision
    /// made once, on the first rows, looked up all 160,000 rows).
    #[tokio::test]
    async fn finds_runs_of_numbers_again_after_short_ones() {
        let short = 140_000;
        assert!(short > 2 * RUN_PROBE_ROWS);
        let mut runs: Vec<Run> = (0..short)
            .map(|i| (1, Some(1), Some((i % 2) as i64), 5))
            .collect();
        runs.extend((0..40).map(|i| (500, Some(1), Some(i64::from(i)), 1)));
        let sql = "SELECT gpu, count(*) AS n, sum(v) AS s FROM t GROUP BY gpu ORDER BY gpu";
        let ctx = session(true, usize::MAX, None);
        ctx.register_table("t", Arc::new(table(&runs, 1000)))
            .expect("test table");
        let (got, _, looked_up) = run(&ctx, sql, "looked_up_rows").await;
        // The short runs' rows, then a lookup per long run and at most one more per batch:
        // 20 batches of 1,000 rows, each read as 16 of at most 64.
        let batches = 20 * 1000usize.div_ceil(64);
        assert!(
            (short + 40..=short + 40 + batches).contains(&looked_up),
            "{looked_up} rows looked up"
        );
        let stock = session(false, usize::MAX, None);
        stock
            .register_table("t", Arc::new(table(&runs, 1000)))
            .expect("test table");
        assert_eq!(got, run(&stock, sql, "looked_up_rows").await.0);
    }

    /// When nearly every row is a group of its own the partial stage is skipped, as
    /// DataFusion skips it, and rows go on as states.
    #[tokio::test]
    async fn skips_the_partial_stage_when_it_does_not_reduce() {
        let runs: Vec<Run> = (0..10_000).map(|i| (1, Some(2), Some(i), 7)).collect();
        let sql =
            "SELECT gpu, count(*) AS n, sum(v) AS s, max(f) AS f FROM t GROUP BY gpu ORDER BY gpu";
        let ctx = session(true, 1_000, None);
        ctx.register_table("t", Arc::new(table(&runs, 512)))
            .expect("test table");
        let (got, _, skipped) = run(&ctx, sql, "skipped_aggregation_rows").await;
        assert!(skipped > 5_000, "{skipped}");
        let stock = session(false, 1_000, None);
        stock
            .register_table("t", Arc::new(table(&runs, 512)))
            .expect("test table");
        assert_eq!(got, run(&stock, sql, "skipped_aggregation_rows").await.0);
    }

    /// A table bigger than the memory it may use is emitted early and merged by the final
    /// stage: the answer does not change.
    #[tokio::test]
    async fn emits_early_under_memory_pressure() {
        let runs: Vec<Run> = (0..30_000).map(|i| (2, Some(1), Some(i), 3)).collect();
        // No ORDER BY: a sort under this little memory is not what is tested.
        let sql = "SELECT gpu, count(*) AS n, sum(v) AS s FROM t GROUP BY gpu";
        let sorted = |text: String| {
            let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
            lines.sort();
            lines
        };
        let ctx = session(true, usize::MAX, Some(256 << 10));
        ctx.register_table("t", Arc::new(table(&runs, 4096)))
            .expect("test table");
        let (got, _, early) = run(&ctx, sql, "early_emits").await;
        assert!(early > 0, "the partial stage never ran out of memory");
        let stock = session(false, usize::MAX, None);
        stock
            .register_table("t", Arc::new(table(&runs, 4096)))
            .expect("test table");
        assert_eq!(sorted(got), sorted(run(&stock, sql, "early_emits").await.0));
    }

    /// Keys without fixed-width slots (booleans, dictionaries, plain strings) take arrow's
    /// comparison of values; a constant key, a NULL key. Answers are DataFusion's.
    #[tokio::test]
    async fn other_key_types_answer_like_datafusion() {
        let runs: Vec<Run> = (0u8..30)
            .map(|i| {
                (
                    1 + usize::from(i % 7),
                    Some(i % 4),
                    Some(i64::from(i % 3)),
                    11,
                )
            })
            .collect();
        let (with, without) = both(&runs, 16, 100_000);
        for sql in [
            "SELECT v > 50 AS big, count(*) AS n FROM t GROUP BY v > 50 ORDER BY big",
            "SELECT arrow_cast(node, 'Dictionary(Int32, Utf8)') AS d, count(*) AS n FROM t
             GROUP BY arrow_cast(node, 'Dictionary(Int32, Utf8)') ORDER BY d",
            "SELECT arrow_cast(node, 'Utf8') AS s, gpu, sum(v) AS s2 FROM t
             GROUP BY arrow_cast(node, 'Utf8'), gpu ORDER BY s, gpu",
            "SELECT 'x' AS c, NULL AS z, count(*) AS n FROM t GROUP BY 1, 2",
        ] {
            let (got, plan, _) = run(&with, sql, "looked_up_rows").await;
            let (want, _, _) = run(&without, sql, "looked_up_rows").await;
            assert_eq!(got, want, "{sql}\n{plan}");
            // Constant keys count as sorted input: `SortedPartialRule` runs them here too.
            assert!(plan.contains("RunAggregateExec"), "{plan}");
        }
    }

    /// Telemetry as the store writes it: sorted by node, GPU and time, declared so, in two
    /// partitions holding disjoint ranges of nodes (a day's file split in two).
    fn sorted_series() -> MemTable {
        use datafusion::prelude::col;
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8View, false),
            Field::new("gpu", DataType::Int64, false),
            Field::new("time", DataType::Int64, false),
            Field::new("v", DataType::Int64, true),
        ]));
        let (mut node, mut gpu, mut time, mut v) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for n in 0..6 {
            for g in 0..4i64 {
                for t in 0..(40 + 13 * (n + g as usize) % 90) as i64 {
                    node.push(format!("node-{n:02}"));
                    gpu.push(g);
                    time.push(t * 10);
                    v.push((t % 5 != 3).then_some((t * 7 + g) % 23));
                }
            }
        }
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringViewArray::from_iter_values(node)),
                Arc::new(Int64Array::from(gpu)),
                Arc::new(Int64Array::from(time)),
                Arc::new(Int64Array::from(v)),
            ],
        )
        .expect("test batch");
        let batches: Vec<RecordBatch> = (0..batch.num_rows())
            .step_by(50)
            .map(|at| batch.slice(at, 50.min(batch.num_rows() - at)))
            .collect();
        let (p0, p1) = batches.split_at(batches.len() / 2);
        MemTable::try_new(schema, vec![p0.to_vec(), p1.to_vec()])
            .expect("test table")
            .with_sort_order(vec![vec![
                col("node").sort(true, false),
                col("gpu").sort(true, false),
                col("time").sort(true, false),
            ]])
    }

    /// Sorted input: DataFusion aggregates it in order and repartitions with an
    /// order-preserving merge that drains one partition before the other. perch runs the
    /// partial stage as a run aggregation (or, for an aggregate that needs the order, behind
    /// an `UnorderedExec`) and the repartition without order, except where the order lets the
    /// plan stop early: under a row limit, or grouped by the whole sort key (a group per
    /// row). The answers, in the order each query asks for, are DataFusion's.
    #[tokio::test]
    async fn sorted_input_is_aggregated_without_an_ordered_repartition() {
        let with = session(true, 100_000, None);
        let without = session(false, 100_000, None);
        for ctx in [&with, &without] {
            ctx.register_table("t", Arc::new(sorted_series()))
                .expect("test table");
        }
        for (sql, partial) in [
            (
                "SELECT node, gpu, count(*) AS n, sum(v) AS s, max(time) AS last FROM t
                 GROUP BY node, gpu ORDER BY node, gpu",
                Some("RunAggregateExec"),
            ),
            (
                "SELECT node, max(v) AS hi FROM t GROUP BY node ORDER BY node",
                Some("RunAggregateExec"),
            ),
            (
                "SELECT time / 100 AS bucket, node, max(v) AS hi, count(*) AS n FROM t
                 GROUP BY time / 100, node ORDER BY bucket, node",
                Some("RunAggregateExec"),
            ),
            (
                "SELECT node, gpu, min(v) AS lo FROM t GROUP BY node, gpu",
                Some("RunAggregateExec"),
            ),
            (
                "SELECT node, gpu, array_agg(v ORDER BY time) AS vs FROM t
                 GROUP BY node, gpu ORDER BY node, gpu",
                Some("UnorderedExec"),
            ),
            (
                "SELECT node, gpu, count(*) AS n FROM t GROUP BY node, gpu
                 ORDER BY node, gpu LIMIT 3",
                None,
            ),
            (
                "SELECT node, gpu, time, max(v) AS v FROM t GROUP BY node, gpu, time
                 ORDER BY node, gpu, time",
                None,
            ),
        ] {
            let (got, plan, _) = run(&with, sql, "looked_up_rows").await;
            let (want, stock, _) = run(&without, sql, "looked_up_rows").await;
            assert!(stock.contains("preserve_order=true"), "{sql}\n{stock}");
            match partial {
                Some(partial) => {
                    assert!(plan.contains(partial), "{sql}\n{plan}");
                    assert!(!plan.contains("preserve_order=true"), "{sql}\n{plan}");
                }
                None => {
                    assert!(!plan.contains("RunAggregateExec"), "{sql}\n{plan}");
                    assert!(!plan.contains("UnorderedExec"), "{sql}\n{plan}");
                }
            }
            if sql.contains("ORDER BY node") {
                assert_eq!(got, want, "{sql}\n{plan}");
            } else {
                let lines = |t: &str| {
                    let mut l: Vec<String> = t.lines().map(str::to_owned).collect();
                    l.sort();
                    l
                };
                assert_eq!(lines(&got), lines(&want), "{sql}\n{plan}");
            }
        }
    }

    /// The rule must run before DataFusion adds the repartitions, or they keep the order.
    #[test]
    fn sorted_partial_rule_runs_right_before_ensure_requirements() {
        let names: Vec<String> = super::super::physical_optimizer_rules()
            .iter()
            .map(|r| r.name().to_owned())
            .collect();
        let at = names
            .iter()
            .position(|n| n == "perch_sorted_partial_aggregate")
            .expect("the rule is installed");
        assert_eq!(
            names.get(at + 1).map(String::as_str),
            Some("EnsureRequirements"),
            "{names:?}"
        );
    }

    #[tokio::test]
    async fn leaves_what_it_cannot_do_to_datafusion() {
        let ctx = session(true, 100_000, None);
        ctx.register_table("t", Arc::new(table(&[(10, Some(1), Some(2), 3)], 64)))
            .expect("test table");
        for sql in [
            "SELECT node, array_agg(v ORDER BY v) FROM t GROUP BY node",
            "SELECT node, gpu, count(*) FROM t GROUP BY GROUPING SETS ((node), (gpu))",
            "SELECT count(*), max(v) FROM t",
        ] {
            let (_, plan, _) = run(&ctx, sql, "looked_up_rows").await;
            assert!(!plan.contains("RunAggregateExec"), "{sql}\n{plan}");
        }
    }
}
