//! A join on equal keys and a time range: the join accounting runs all the time, every
//! sample of a GPU against the allocations of that GPU,
//!
//! ```sql
//! ... JOIN gpu_samples s ON s.node = a.node AND s.gpu = a.gpu
//!     AND s.time >= a.start_time AND (a.end_time IS NULL OR s.time < a.end_time)
//! ```
//!
//! A hash join on `(node, gpu)` pairs every sample with every allocation its GPU ever had
//! (about 20 a week on a busy cluster) and only then checks the time: some 650 million
//! candidate pairs for a week of 512 GPUs. [`IntervalJoinRule`] replaces such a hash join
//! with [`IntervalJoinExec`], which keeps each key's intervals sorted by start with the
//! running maximum of their ends, so a probe row finds the intervals that contain its time
//! by a binary search and a short walk back: the pairs it makes are the answer. Whatever
//! else the join's filter says is still applied to those pairs.
//!
//! Only what the hash join would do the same way is replaced: inner joins and joins that
//! keep every probe row (`RIGHT`, the build side being the left input), in the hash join's
//! `CollectLeft` or `Partitioned` mode, with no row limit pushed into the join.
//!
//! Like the hash join, an inner join built once (`CollectLeft`) hands the probe side's scan
//! dynamic filters: once the build side is in, what each key and the probe value can be for
//! any interval to match (`node IN` the build side's nodes, or between its first and last past
//! 256 distinct keys, taken vectorised; `time` from the earliest start to the latest end). One
//! filter per column, so that the scan prunes pages as well as files and row groups with each
//! (a filter over several columns only prunes row groups): one job's samples are read from that
//! job's nodes and hours, not the whole store.

use arrow::array::{Array, ArrayRef, BooleanArray, Int64Array, RecordBatch, UInt32Array};
use arrow::compute::kernels::filter::prep_null_mask_filter;
use arrow::compute::{cast, concat_batches, filter as filter_array, take};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::row::{RowConverter, SortField};
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinSide, JoinType, NullEquality};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::Accumulator;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{
    BinaryExpr, Column, DynamicFilterPhysicalExpr, IsNullExpr, in_list, lit,
};
use datafusion::physical_expr::utils::split_conjunction;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr, PhysicalExprRef};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::distribution_requirements::InputDistributionRequirements;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::filter_pushdown::{
    ChildFilterDescription, ChildPushdownResult, FilterDescription, FilterPushdownPhase,
    FilterPushdownPropagation,
};
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, Distribution, ExecutionPlan,
    Partitioning, PlanProperties, ReplaceChildrenOptions,
};
use futures::TryStreamExt;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use tokio::sync::OnceCell;

/// Replaces hash joins whose filter bounds a probe-side value by a build-side interval with
/// an [`IntervalJoinExec`]. Runs right after DataFusion's join selection, so the build side
/// is the smaller input and later rules (distribution, projection and filter pushdown) see
/// the new join.
#[derive(Debug, Default)]
pub struct IntervalJoinRule;

impl PhysicalOptimizerRule for IntervalJoinRule {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        super::replace_nodes(plan, |join: &HashJoinExec| {
            Ok(IntervalJoinExec::try_from_hash_join(join)?
                .map(|exec| Arc::new(exec) as Arc<dyn ExecutionPlan>))
        })
    }

    fn name(&self) -> &str {
        "perch_interval_join"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The interval a build row stands for and the probe value it must contain, each an
/// expression over its own side's columns: `start <= value < end` once normalised.
#[derive(Debug, Clone)]
struct IntervalSpec {
    probe_value: PhysicalExprRef,
    start: PhysicalExprRef,
    /// `value >= start` (true) or `value > start` (false).
    start_inclusive: bool,
    end: PhysicalExprRef,
    /// `value <= end` (true) or `value < end` (false).
    end_inclusive: bool,
    /// The filter reads `end IS NULL OR value < end`: a null end is an interval still open.
    open_if_null: bool,
    /// The filter has conjuncts besides the interval; they are checked on the pairs found.
    residual: bool,
}

/// A hash join on equal keys whose filter also asks a probe value to fall inside a build
/// row's interval. See the module documentation.
#[derive(Debug)]
pub struct IntervalJoinExec {
    left: Arc<dyn ExecutionPlan>,
    right: Arc<dyn ExecutionPlan>,
    on: Vec<(PhysicalExprRef, PhysicalExprRef)>,
    filter: JoinFilter,
    interval: IntervalSpec,
    join_type: JoinType,
    mode: PartitionMode,
    null_equality: NullEquality,
    projection: Option<Vec<usize>>,
    /// The left columns then the right ones, before the projection.
    join_schema: SchemaRef,
    properties: Arc<PlanProperties>,
    /// The build side, made once and shared by every output partition in `CollectLeft` mode.
    shared_build: Arc<OnceCell<Arc<BuildSide>>>,
    /// The filters the probe side's scan took (inner joins in `CollectLeft` mode), one per
    /// [`IntervalJoinExec::filter_children`], set from the build side once it is in.
    dynamic_filters: Vec<Arc<DynamicFilterPhysicalExpr>>,
    metrics: ExecutionPlanMetricsSet,
}

impl IntervalJoinExec {
    /// The interval join doing what `join` does, when its filter holds an interval
    /// condition and its mode and join type are ones this operator runs the same way.
    pub fn try_from_hash_join(join: &HashJoinExec) -> Result<Option<Self>> {
        if !matches!(join.join_type, JoinType::Inner | JoinType::Right)
            || !matches!(
                join.mode,
                PartitionMode::CollectLeft | PartitionMode::Partitioned
            )
            || join.null_aware
            || join.fetch().is_some()
            || join.on.is_empty()
        {
            return Ok(None);
        }
        let Some(filter) = join.filter() else {
            return Ok(None);
        };
        let left_schema = join.left.schema();
        let right_schema = join.right.schema();
        let Some(interval) = find_interval(filter) else {
            return Ok(None);
        };
        // The three values are compared as 64-bit integers: they must have one type that
        // orders the way its integer does.
        let value_type = interval.probe_value.data_type(&right_schema)?;
        if !orders_as_integer(&value_type)
            || interval.start.data_type(&left_schema)? != value_type
            || interval.end.data_type(&left_schema)? != value_type
        {
            return Ok(None);
        }
        let projection = join.projection.as_ref().map(|p| p.to_vec());
        let schema = match &projection {
            Some(p) => Arc::new(join.join_schema().project(p)?),
            None => join.join_schema().clone(),
        };
        let partitions = join
            .right
            .properties()
            .output_partitioning()
            .partition_count();
        let properties = PlanProperties::new(
            EquivalenceProperties::new(schema),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Ok(Some(IntervalJoinExec {
            left: join.left.clone(),
            right: join.right.clone(),
            on: join.on.clone(),
            filter: filter.clone(),
            interval,
            join_type: join.join_type,
            mode: join.mode,
            null_equality: join.null_equality,
            projection,
            join_schema: join.join_schema().clone(),
            properties: Arc::new(properties),
            shared_build: Arc::new(OnceCell::new()),
            dynamic_filters: Vec::new(),
            metrics: ExecutionPlanMetricsSet::new(),
        }))
    }

    /// Whether the probe side may be handed a dynamic filter: an inner join (no probe row is
    /// kept unmatched) with one build side for all partitions, where DataFusion allows join
    /// filters at all.
    fn allows_dynamic_filter(&self, config: &ConfigOptions) -> bool {
        self.join_type == JoinType::Inner
            && self.mode == PartitionMode::CollectLeft
            && self.null_equality == NullEquality::NullEqualsNothing
            && config.optimizer.enable_join_dynamic_filter_pushdown
    }

    /// The probe-side expressions a dynamic filter reads: the keys, then the probe value.
    fn filter_children(&self) -> Vec<PhysicalExprRef> {
        self.on
            .iter()
            .map(|(_, r)| r.clone())
            .chain([self.interval.probe_value.clone()])
            .collect()
    }

    fn with_children(&self, left: Arc<dyn ExecutionPlan>, right: Arc<dyn ExecutionPlan>) -> Self {
        IntervalJoinExec {
            left,
            right,
            on: self.on.clone(),
            filter: self.filter.clone(),
            interval: self.interval.clone(),
            join_type: self.join_type,
            mode: self.mode,
            null_equality: self.null_equality,
            projection: self.projection.clone(),
            join_schema: self.join_schema.clone(),
            properties: self.properties.clone(),
            shared_build: Arc::new(OnceCell::new()),
            dynamic_filters: self.dynamic_filters.clone(),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }
}

impl DisplayAs for IntervalJoinExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let on: Vec<String> = self.on.iter().map(|(l, r)| format!("({l}, {r})")).collect();
        let i = &self.interval;
        write!(
            f,
            "IntervalJoinExec: mode={:?}, join_type={:?}, on=[{}], interval={}{}, {}{}{} contains {}",
            self.mode,
            self.join_type,
            on.join(", "),
            if i.start_inclusive { "[" } else { "(" },
            i.start,
            i.end,
            if i.end_inclusive { "]" } else { ")" },
            if i.open_if_null { " open if null" } else { "" },
            i.probe_value,
        )?;
        if i.residual {
            write!(f, ", filter={}", self.filter)?;
        }
        if let Some(p) = &self.projection {
            write!(f, ", projection={p:?}")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for IntervalJoinExec {
    fn name(&self) -> &str {
        "IntervalJoinExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        match self.mode {
            PartitionMode::Partitioned => {
                let (left, right) = self.on.iter().cloned().unzip();
                InputDistributionRequirements::co_partitioned(vec![
                    Distribution::KeyPartitioned(left),
                    Distribution::KeyPartitioned(right),
                ])
            }
            _ => InputDistributionRequirements::new(vec![
                Distribution::SinglePartition,
                Distribution::UnspecifiedDistribution,
            ]),
        }
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.left, &self.right]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        let exprs = self
            .on
            .iter()
            .flat_map(|(l, r)| [l, r])
            .chain([self.filter.expression()]);
        for expr in exprs {
            if f(expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 2 {
            return Err(DataFusionError::Internal(
                "IntervalJoinExec has two children".into(),
            ));
        }
        let right = children.pop().expect("two children");
        let left = children.pop().expect("two children");
        // The output partition count follows the probe side.
        let join = self.with_children(left, right);
        let partitions = join
            .right
            .properties()
            .output_partitioning()
            .partition_count();
        let mut properties = (*join.properties).clone();
        properties.partitioning = Partitioning::UnknownPartitioning(partitions);
        Ok(Arc::new(IntervalJoinExec {
            properties: Arc::new(properties),
            ..join
        }))
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
        // As the hash join: a plan run again does not update a filter a scan took earlier.
        Ok(Arc::new(IntervalJoinExec {
            dynamic_filters: Vec::new(),
            ..self.with_children(self.left.clone(), self.right.clone())
        }))
    }

    fn gather_filters_for_pushdown(
        &self,
        phase: FilterPushdownPhase,
        parent_filters: Vec<Arc<dyn PhysicalExpr>>,
        config: &ConfigOptions,
    ) -> Result<FilterDescription> {
        let left = ChildFilterDescription::all_unsupported(&parent_filters);
        let mut right = ChildFilterDescription::all_unsupported(&parent_filters);
        if phase == FilterPushdownPhase::Post
            && self.dynamic_filters.is_empty()
            && self.allows_dynamic_filter(config)
        {
            right = right.with_self_filters(
                self.filter_children()
                    .into_iter()
                    .map(|c| Arc::new(DynamicFilterPhysicalExpr::new(vec![c], lit(true))) as _)
                    .collect(),
            );
        }
        Ok(FilterDescription::new().with_child(left).with_child(right))
    }

    fn handle_child_pushdown_result(
        &self,
        _phase: FilterPushdownPhase,
        child_pushdown_result: ChildPushdownResult,
        _config: &ConfigOptions,
    ) -> Result<FilterPushdownPropagation<Arc<dyn ExecutionPlan>>> {
        let mut result = FilterPushdownPropagation::if_any(child_pushdown_result.clone());
        // Whatever the scan said, it can prune files, row groups and pages with the filters.
        let taken: Vec<Arc<DynamicFilterPhysicalExpr>> = child_pushdown_result
            .self_filters
            .get(1)
            .into_iter()
            .flatten()
            .filter_map(|f| {
                let any: Arc<dyn std::any::Any + Send + Sync> = f.predicate.clone();
                Arc::downcast::<DynamicFilterPhysicalExpr>(any).ok()
            })
            .collect();
        if !taken.is_empty() && taken.len() == self.filter_children().len() {
            let node = IntervalJoinExec {
                dynamic_filters: taken,
                ..self.with_children(self.left.clone(), self.right.clone())
            };
            result = result.with_updated_node(Arc::new(node) as Arc<dyn ExecutionPlan>);
        }
        Ok(result)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let probe = self.right.execute(partition, context.clone())?;
        let build_partition = match self.mode {
            PartitionMode::Partitioned => partition,
            _ => 0,
        };
        let baseline = BaselineMetrics::new(&self.metrics, partition);
        let candidates = MetricBuilder::new(&self.metrics).counter("candidate_pairs", partition);
        let plan = ProbePlan {
            on_right: self.on.iter().map(|(_, r)| r.clone()).collect(),
            probe_value: self.interval.probe_value.clone(),
            filter: self.interval.residual.then(|| self.filter.clone()),
            keep_unmatched_probe: self.join_type == JoinType::Right,
            skip_null_keys: self.null_equality == NullEquality::NullEqualsNothing,
            join_schema: self.join_schema.clone(),
            projection: self.projection.clone(),
            candidates,
        };
        let shared = (self.mode != PartitionMode::Partitioned).then(|| self.shared_build.clone());
        let left = self.left.clone();
        let on_left: Vec<_> = self.on.iter().map(|(l, _)| l.clone()).collect();
        let interval = self.interval.clone();
        let null_equality = self.null_equality;
        // Only a build side shared by every partition speaks for the whole probe side.
        let publish = (shared.is_some() && !self.dynamic_filters.is_empty()).then(|| {
            (
                self.dynamic_filters.clone(),
                self.filter_children(),
                self.right.schema(),
            )
        });
        let build = async move {
            let make = || {
                BuildSide::collect(
                    left.clone(),
                    build_partition,
                    context.clone(),
                    &on_left,
                    &interval,
                    null_equality,
                )
            };
            match shared {
                Some(cell) => cell
                    .get_or_try_init(|| async {
                        let build = make().await?;
                        if let Some((filters, children, schema)) = &publish {
                            let exprs = build.probe_filters(children, schema)?;
                            for (filter, expr) in filters.iter().zip(exprs) {
                                filter.update(expr)?;
                                filter.mark_complete();
                            }
                        }
                        Ok::<_, DataFusionError>(Arc::new(build))
                    })
                    .await
                    .cloned(),
                None => make().await.map(Arc::new),
            }
        };
        let stream = futures::stream::once(async move {
            let build = build.await?;
            Ok::<_, DataFusionError>(probe.and_then(move |batch| {
                let timer = baseline.elapsed_compute().timer();
                let joined = plan.join(&build, &batch);
                timer.done();
                if let Ok(b) = &joined {
                    baseline.output_rows().add(b.num_rows());
                }
                futures::future::ready(joined)
            }))
        })
        .try_flatten()
        .try_filter(|b| futures::future::ready(b.num_rows() > 0));
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            stream,
        )))
    }
}

/// The build side: its rows, and for each key its intervals sorted by start.
#[derive(Debug)]
struct BuildSide {
    batch: RecordBatch,
    converter: RowConverter,
    /// Key (in the row format) -> the range of its intervals in the arrays below.
    groups: HashMap<Box<[u8]>, (u32, u32)>,
    /// Inclusive starts and exclusive ends, wider than the values so that an exclusive start
    /// or an inclusive end at the type's limit, and an open end, need no special case.
    starts: Vec<i128>,
    /// Exclusive ends (`i128::MAX` for an open interval).
    ends: Vec<i128>,
    /// The largest end among the key's intervals up to and including this one.
    max_ends: Vec<i128>,
    rows: Vec<u32>,
    /// Per key, the values that can match.
    key_values: Vec<KeyValues>,
    /// The earliest start and the latest end of any interval that can match, in the probe
    /// value's type; no latest end when an interval is open.
    value_bounds: Option<(ScalarValue, Option<ScalarValue>)>,
    _reservation: MemoryReservation,
}

impl BuildSide {
    async fn collect(
        plan: Arc<dyn ExecutionPlan>,
        partition: usize,
        context: Arc<TaskContext>,
        on_left: &[PhysicalExprRef],
        interval: &IntervalSpec,
        null_equality: NullEquality,
    ) -> Result<BuildSide> {
        let schema = plan.schema();
        let reservation = MemoryConsumer::new(format!("IntervalJoinExec[build {partition}]"))
            .register(context.memory_pool());
        let batches: Vec<RecordBatch> = plan.execute(partition, context)?.try_collect().await?;
        let batch = concat_batches(&schema, &batches)?;
        drop(batches);
        reservation.try_grow(batch.get_array_memory_size())?;
        if batch.num_rows() > u32::MAX as usize {
            return Err(DataFusionError::ResourcesExhausted(
                "the interval join's build side has more than 2^32 rows".into(),
            ));
        }

        let keys = evaluate(on_left, &batch)?;
        let converter = RowConverter::new(
            keys.iter()
                .map(|k| SortField::new(k.data_type().clone()))
                .collect(),
        )?;
        let key_rows = converter.convert_columns(&keys)?;
        let start_values = interval
            .start
            .evaluate(&batch)?
            .into_array(batch.num_rows())?;
        let end_values = interval
            .end
            .evaluate(&batch)?
            .into_array(batch.num_rows())?;
        let starts = as_i64(&start_values)?;
        let ends = as_i64(&end_values)?;

        let mut group_of: HashMap<Box<[u8]>, u32> = HashMap::new();
        let mut entries: Vec<(u32, i128, i128, u32)> = Vec::with_capacity(batch.num_rows());
        for row in 0..batch.num_rows() {
            if null_equality == NullEquality::NullEqualsNothing
                && keys.iter().any(|k| k.is_null(row))
            {
                continue;
            }
            if starts.is_null(row) {
                continue;
            }
            let start = i128::from(starts.value(row)) + i128::from(!interval.start_inclusive);
            let end = if ends.is_null(row) {
                if !interval.open_if_null {
                    continue;
                }
                i128::MAX
            } else {
                i128::from(ends.value(row)) + i128::from(interval.end_inclusive)
            };
            if end <= start {
                continue;
            }
            let next = group_of.len() as u32;
            let group = *group_of
                .entry(key_rows.row(row).as_ref().into())
                .or_insert(next);
            entries.push((group, start, end, row as u32));
        }
        entries.sort_unstable();
        let rows_kept = || entries.iter().map(|e| e.3 as usize);
        // One row per key, when the keys are few (entries are sorted by key).
        let representatives: Option<Vec<u32>> = (group_of.len() <= KeyValues::FEW).then(|| {
            entries
                .iter()
                .enumerate()
                .filter(|(i, e)| *i == 0 || entries[i - 1].0 != e.0)
                .map(|(_, e)| e.3)
                .collect()
        });
        let kept = UInt32Array::from_iter_values(entries.iter().map(|e| e.3));
        let key_values = keys
            .iter()
            .map(|k| KeyValues::of(k, &kept, representatives.as_deref()))
            .collect::<Result<Vec<_>>>()?;
        let earliest = rows_kept().min_by_key(|&r| starts.value(r));
        let open = rows_kept().any(|r| ends.is_null(r));
        let latest = rows_kept()
            .filter(|&r| !ends.is_null(r))
            .max_by_key(|&r| ends.value(r));
        let value_bounds = match earliest {
            Some(first) => Some((
                ScalarValue::try_from_array(&start_values, first)?,
                match (open, latest) {
                    (false, Some(last)) => Some(ScalarValue::try_from_array(&end_values, last)?),
                    _ => None,
                },
            )),
            None => None,
        };

        // Each group's range in the arrays below, by group id.
        let mut ranges = vec![(0u32, 0u32); group_of.len()];
        let (mut starts, mut ends, mut max_ends, mut rows) = (
            Vec::with_capacity(entries.len()),
            Vec::with_capacity(entries.len()),
            Vec::with_capacity(entries.len()),
            Vec::with_capacity(entries.len()),
        );
        let mut i = 0;
        while i < entries.len() {
            let group = entries[i].0;
            let first = i;
            let mut running = i128::MIN;
            while i < entries.len() && entries[i].0 == group {
                let (_, start, end, row) = entries[i];
                running = running.max(end);
                starts.push(start);
                ends.push(end);
                max_ends.push(running);
                rows.push(row);
                i += 1;
            }
            ranges[group as usize] = (first as u32, (i - first) as u32);
        }
        let groups: HashMap<Box<[u8]>, (u32, u32)> = group_of
            .into_iter()
            .map(|(key, group)| (key, ranges[group as usize]))
            .collect();
        reservation.try_grow(
            entries.len() * (3 * size_of::<i128>() + size_of::<u32>())
                + groups.keys().map(|k| k.len() + 48).sum::<usize>(),
        )?;
        Ok(BuildSide {
            batch,
            converter,
            groups,
            starts,
            ends,
            max_ends,
            rows,
            key_values,
            value_bounds,
            _reservation: reservation,
        })
    }

    /// The dynamic filters for the probe side, one per child of `children` (the probe keys,
    /// then the probe value, over the probe side's `schema`): each key among the build side's
    /// values (or inside their range when there are many), the value inside the intervals'
    /// span; never narrower than what can match, and false everywhere when nothing can.
    fn probe_filters(
        &self,
        children: &[PhysicalExprRef],
        schema: &SchemaRef,
    ) -> Result<Vec<PhysicalExprRef>> {
        let (value, keys) = children
            .split_last()
            .expect("the probe value is the last child");
        let compare = |expr: &PhysicalExprRef, op: Operator, v: &ScalarValue| {
            Arc::new(BinaryExpr::new(expr.clone(), op, lit(v.clone()))) as PhysicalExprRef
        };
        let and = |a: PhysicalExprRef, b: PhysicalExprRef| {
            Arc::new(BinaryExpr::new(a, Operator::And, b)) as PhysicalExprRef
        };
        let Some((first, last)) = &self.value_bounds else {
            return Ok(children.iter().map(|_| lit(false)).collect());
        };
        let mut out = Vec::with_capacity(children.len());
        for (key, values) in keys.iter().zip(&self.key_values) {
            out.push(match values {
                KeyValues::None => lit(false),
                KeyValues::Any => lit(true),
                KeyValues::Few(list) => in_list(
                    key.clone(),
                    list.iter().map(|v| lit(v.clone())).collect(),
                    &false,
                    schema,
                )?,
                KeyValues::Range(lo, hi) => and(
                    compare(key, Operator::GtEq, lo),
                    compare(key, Operator::LtEq, hi),
                ),
            });
        }
        let from = compare(value, Operator::GtEq, first);
        out.push(match last {
            Some(last) => and(from, compare(value, Operator::LtEq, last)),
            None => from,
        });
        Ok(out)
    }
}

/// The values a build key takes among the rows that can match.
#[derive(Debug)]
enum KeyValues {
    /// No row can match.
    None,
    /// The distinct values, in order, when the build side has at most [`KeyValues::FEW`] keys.
    Few(Vec<ScalarValue>),
    /// More: the least and the greatest.
    Range(ScalarValue, ScalarValue),
    /// A type whose least and greatest cannot be taken: no filter on this column.
    Any,
}

impl KeyValues {
    /// Up to this many distinct keys (all columns together), each column goes into an `IN`
    /// list.
    const FEW: usize = 256;

    /// The values of `array` at the rows `kept`; `representatives` holds one row per distinct
    /// key when there are at most [`KeyValues::FEW`]. Vectorised: the build side may be large.
    fn of(
        array: &ArrayRef,
        kept: &UInt32Array,
        representatives: Option<&[u32]>,
    ) -> Result<KeyValues> {
        if kept.is_empty() {
            return Ok(KeyValues::None);
        }
        if let Some(rows) = representatives {
            let mut list = rows
                .iter()
                .map(|&r| ScalarValue::try_from_array(array, r as usize))
                .collect::<Result<Vec<_>>>()?;
            list.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
            list.dedup();
            return Ok(KeyValues::Few(list));
        }
        let values = take(array.as_ref(), kept, None)?;
        let extreme = |mut acc: Box<dyn Accumulator>| {
            acc.update_batch(std::slice::from_ref(&values))
                .and_then(|()| acc.evaluate())
                .ok()
                .filter(|v| !v.is_null())
        };
        let lo = MinAccumulator::try_new(values.data_type())
            .ok()
            .and_then(|a| extreme(Box::new(a)));
        let hi = MaxAccumulator::try_new(values.data_type())
            .ok()
            .and_then(|a| extreme(Box::new(a)));
        Ok(match (lo, hi) {
            (Some(lo), Some(hi)) => KeyValues::Range(lo, hi),
            _ => KeyValues::Any,
        })
    }
}

/// What each probe batch needs, cloned into the stream of every output partition.
#[derive(Debug, Clone)]
struct ProbePlan {
    on_right: Vec<PhysicalExprRef>,
    probe_value: PhysicalExprRef,
    /// The join's whole filter, when it says more than the interval.
    filter: Option<JoinFilter>,
    keep_unmatched_probe: bool,
    skip_null_keys: bool,
    join_schema: SchemaRef,
    projection: Option<Vec<usize>>,
    candidates: Count,
}

impl ProbePlan {
    fn join(&self, build: &BuildSide, probe: &RecordBatch) -> Result<RecordBatch> {
        let keys = evaluate(&self.on_right, probe)?;
        let key_rows = build.converter.convert_columns(&keys)?;
        let values = as_i64(
            &self
                .probe_value
                .evaluate(probe)?
                .into_array(probe.num_rows())?,
        )?;

        let mut build_rows: Vec<u32> = Vec::new();
        let mut probe_rows: Vec<u32> = Vec::new();
        // Probe rows come sorted by key more often than not: look a key up once per run.
        let mut last: Option<(usize, Option<(u32, u32)>)> = None;
        for row in 0..probe.num_rows() {
            if values.is_null(row) || (self.skip_null_keys && keys.iter().any(|k| k.is_null(row))) {
                continue;
            }
            let key = key_rows.row(row);
            let group = match last {
                Some((prev, group)) if key_rows.row(prev) == key => group,
                _ => build.groups.get(key.as_ref()).copied(),
            };
            last = Some((row, group));
            let Some((first, len)) = group else { continue };
            let (first, len) = (first as usize, len as usize);
            let value = i128::from(values.value(row));
            let starts = &build.starts[first..first + len];
            let mut i = starts.partition_point(|&s| s <= value);
            while i > 0 {
                i -= 1;
                if build.max_ends[first + i] <= value {
                    break;
                }
                if build.ends[first + i] > value {
                    build_rows.push(build.rows[first + i]);
                    probe_rows.push(row as u32);
                }
            }
        }
        self.candidates.add(build_rows.len());
        let mut build_idx = UInt32Array::from(build_rows);
        let mut probe_idx = UInt32Array::from(probe_rows);

        if let Some(filter) = &self.filter {
            let keep = evaluate_filter(filter, &build.batch, probe, &build_idx, &probe_idx)?;
            build_idx = downcast_u32(filter_array(&build_idx, &keep)?);
            probe_idx = downcast_u32(filter_array(&probe_idx, &keep)?);
        }
        if self.keep_unmatched_probe {
            let mut matched = vec![false; probe.num_rows()];
            for &row in probe_idx.values() {
                matched[row as usize] = true;
            }
            let unmatched: Vec<u32> = (0..probe.num_rows() as u32)
                .filter(|&r| !matched[r as usize])
                .collect();
            if !unmatched.is_empty() {
                let count = unmatched.len();
                let mut b: Vec<Option<u32>> = build_idx.iter().collect();
                b.extend(std::iter::repeat_n(None, count));
                let mut p: Vec<u32> = probe_idx.values().to_vec();
                p.extend(unmatched);
                build_idx = UInt32Array::from(b);
                probe_idx = UInt32Array::from(p);
            }
        }

        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.join_schema.fields().len());
        for column in build.batch.columns() {
            columns.push(take(column, &build_idx, None)?);
        }
        for column in probe.columns() {
            columns.push(take(column, &probe_idx, None)?);
        }
        let options = arrow::array::RecordBatchOptions::new().with_row_count(Some(probe_idx.len()));
        let joined =
            RecordBatch::try_new_with_options(self.join_schema.clone(), columns, &options)?;
        Ok(match &self.projection {
            Some(p) => joined.project(p)?,
            None => joined,
        })
    }
}

/// The join filter on the candidate pairs: its columns taken from either side.
fn evaluate_filter(
    filter: &JoinFilter,
    build: &RecordBatch,
    probe: &RecordBatch,
    build_idx: &UInt32Array,
    probe_idx: &UInt32Array,
) -> Result<BooleanArray> {
    let columns = filter
        .column_indices()
        .iter()
        .map(|c| match c.side {
            JoinSide::Left => take(build.column(c.index), build_idx, None),
            _ => take(probe.column(c.index), probe_idx, None),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let options = arrow::array::RecordBatchOptions::new().with_row_count(Some(build_idx.len()));
    let batch = RecordBatch::try_new_with_options(filter.schema().clone(), columns, &options)?;
    let result = filter
        .expression()
        .evaluate(&batch)?
        .into_array(batch.num_rows())?;
    let keep = result
        .as_any()
        .downcast_ref::<BooleanArray>()
        .ok_or_else(|| DataFusionError::Internal("a join filter that is not boolean".into()))?;
    // A null is not a match.
    Ok(match keep.nulls() {
        Some(_) => prep_null_mask_filter(keep),
        None => keep.clone(),
    })
}

fn downcast_u32(array: ArrayRef) -> UInt32Array {
    array
        .as_any()
        .downcast_ref::<UInt32Array>()
        .expect("filtering keeps the type")
        .clone()
}

fn evaluate(exprs: &[PhysicalExprRef], batch: &RecordBatch) -> Result<Vec<ArrayRef>> {
    exprs
        .iter()
        .map(|e| e.evaluate(batch)?.into_array(batch.num_rows()))
        .collect()
}

fn orders_as_integer(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32
            | DataType::Date32
            | DataType::Date64
            | DataType::Timestamp(_, _)
    )
}

fn as_i64(array: &ArrayRef) -> Result<Int64Array> {
    let array = cast(array, &DataType::Int64)?;
    Ok(array
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("cast to Int64")
        .clone())
}

/// The interval in a join filter: a lower and an upper bound of one probe-side value by
/// build-side values, each a conjunct of the filter.
fn find_interval(filter: &JoinFilter) -> Option<IntervalSpec> {
    let conjuncts = split_conjunction(filter.expression());
    let mut lower: Option<(PhysicalExprRef, PhysicalExprRef, bool)> = None;
    let mut upper: Option<(PhysicalExprRef, PhysicalExprRef, bool, bool)> = None;
    for conjunct in &conjuncts {
        if let Some((value, op, bound)) = comparison(filter, conjunct) {
            match op {
                Operator::GtEq | Operator::Gt if lower.is_none() => {
                    lower = Some((value, bound, op == Operator::GtEq));
                }
                Operator::LtEq | Operator::Lt if upper.is_none() => {
                    upper = Some((value, bound, op == Operator::LtEq, false));
                }
                _ => {}
            }
        } else if upper.is_none()
            && let Some((value, op, bound)) = open_upper(filter, conjunct)
        {
            upper = Some((value, bound, op == Operator::LtEq, true));
        }
    }
    let (value, start, start_inclusive) = lower?;
    let (upper_value, end, end_inclusive, open_if_null) = upper?;
    if *value != *upper_value {
        return None;
    }
    Some(IntervalSpec {
        probe_value: value,
        start,
        start_inclusive,
        end,
        end_inclusive,
        open_if_null,
        residual: conjuncts.len() > 2,
    })
}

/// `end IS NULL OR value < end` (either order, `<` or `<=`).
fn open_upper(
    filter: &JoinFilter,
    expr: &PhysicalExprRef,
) -> Option<(PhysicalExprRef, Operator, PhysicalExprRef)> {
    let or = expr.downcast_ref::<BinaryExpr>()?;
    if *or.op() != Operator::Or {
        return None;
    }
    for (maybe_null, maybe_cmp) in [(or.left(), or.right()), (or.right(), or.left())] {
        let Some(is_null) = maybe_null.downcast_ref::<IsNullExpr>() else {
            continue;
        };
        let Some((JoinSide::Left, tested)) = one_side(filter, is_null.arg()) else {
            continue;
        };
        if let Some((value, op @ (Operator::Lt | Operator::LtEq), bound)) =
            comparison(filter, maybe_cmp)
            && *bound == *tested
        {
            return Some((value, op, bound));
        }
    }
    None
}

/// `probe_value <op> build_value` for a comparison between one side and the other,
/// turned around when written the other way, each operand over its own side's columns.
fn comparison(
    filter: &JoinFilter,
    expr: &PhysicalExprRef,
) -> Option<(PhysicalExprRef, Operator, PhysicalExprRef)> {
    let binary = expr.downcast_ref::<BinaryExpr>()?;
    let op = *binary.op();
    if !matches!(
        op,
        Operator::Lt | Operator::LtEq | Operator::Gt | Operator::GtEq
    ) {
        return None;
    }
    let (left_side, left) = one_side(filter, binary.left())?;
    let (right_side, right) = one_side(filter, binary.right())?;
    match (left_side, right_side) {
        (JoinSide::Right, JoinSide::Left) => Some((left, op, right)),
        (JoinSide::Left, JoinSide::Right) => Some((right, op.swap()?, left)),
        _ => None,
    }
}

/// `expr` rewritten over the columns of the one join side it reads, and that side; `None`
/// when it reads both sides or no column at all.
fn one_side(filter: &JoinFilter, expr: &PhysicalExprRef) -> Option<(JoinSide, PhysicalExprRef)> {
    let indices = filter.column_indices();
    let mut side: Option<JoinSide> = None;
    let mut mixed = false;
    expr.apply(|e| {
        if let Some(c) = e.downcast_ref::<Column>() {
            match indices.get(c.index()).map(|i| i.side) {
                Some(s) if side.is_none() || side == Some(s) => side = Some(s),
                _ => mixed = true,
            }
        }
        Ok(TreeNodeRecursion::Continue)
    })
    .ok()?;
    let side = side.filter(|_| !mixed)?;
    if side == JoinSide::None {
        return None;
    }
    let rewritten = expr
        .clone()
        .transform(|e| {
            Ok(match e.downcast_ref::<Column>() {
                Some(c) => {
                    Transformed::yes(Arc::new(Column::new(c.name(), indices[c.index()].index))
                        as PhysicalExprRef)
                }
                None => Transformed::no(e),
            })
        })
        .data()
        .ok()?;
    Some((side, rewritten))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, Int64Array, StringArray, TimestampMillisecondArray};
    use arrow::datatypes::{Field, Schema, TimeUnit};
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::prelude::{SessionConfig, SessionContext};
    use proptest::prelude::*;

    /// A build row: node, gpu, job, start, end (ms).
    type Alloc = (Option<u8>, u8, i64, i64, Option<i64>);
    /// A probe row: node, gpu, time (ms), utilization.
    type Sample = (Option<u8>, u8, Option<i64>, f64);

    fn ts() -> DataType {
        DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()))
    }

    fn tables(allocs: &[Alloc], samples: &[Sample]) -> (MemTable, MemTable) {
        let node = |n: Option<u8>| n.map(|n| format!("node-{n}"));
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8, true),
            Field::new("gpu", DataType::Int64, false),
            Field::new("job", DataType::Int64, false),
            Field::new("start_time", ts(), false),
            Field::new("end_time", ts(), true),
        ]));
        let a = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter(allocs.iter().map(|a| node(a.0)))),
                Arc::new(Int64Array::from_iter_values(
                    allocs.iter().map(|a| i64::from(a.1)),
                )),
                Arc::new(Int64Array::from_iter_values(allocs.iter().map(|a| a.2))),
                Arc::new(
                    TimestampMillisecondArray::from_iter_values(allocs.iter().map(|a| a.3))
                        .with_timezone("UTC"),
                ),
                Arc::new(
                    TimestampMillisecondArray::from_iter(allocs.iter().map(|a| a.4))
                        .with_timezone("UTC"),
                ),
            ],
        )
        .expect("test query");
        let alloc = MemTable::try_new(schema, vec![vec![a]]).expect("test query");
        let schema = Arc::new(Schema::new(vec![
            Field::new("node", DataType::Utf8, true),
            Field::new("gpu", DataType::Int64, false),
            Field::new("time", ts(), true),
            Field::new("util", DataType::Float64, false),
        ]));
        // Two batches per partition and two partitions, so the probe side is split.
        let batch = |rows: &[Sample]| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from_iter(rows.iter().map(|s| node(s.0)))),
                    Arc::new(Int64Array::from_iter_values(
                        rows.iter().map(|s| i64::from(s.1)),
                    )),
                    Arc::new(
                        TimestampMillisecondArray::from_iter(rows.iter().map(|s| s.2))
                            .with_timezone("UTC"),
                    ),
                    Arc::new(Float64Array::from_iter_values(rows.iter().map(|s| s.3))),
                ],
            )
            .expect("test query")
        };
        let quarter = samples.len().div_ceil(4).max(1);
        let chunks: Vec<RecordBatch> = samples.chunks(quarter).map(batch).collect();
        let (p0, p1) = chunks.split_at(chunks.len() / 2);
        let samples =
            MemTable::try_new(schema.clone(), vec![p0.to_vec(), p1.to_vec()]).expect("test query");
        (alloc, samples)
    }

    fn session(interval_join: bool, partitioned: bool) -> SessionContext {
        let mut config = SessionConfig::new().with_target_partitions(2);
        if partitioned {
            let options = config.options_mut();
            options.optimizer.hash_join_single_partition_threshold = 0;
            options.optimizer.hash_join_single_partition_threshold_rows = 0;
        }
        let mut state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features();
        if interval_join {
            state = state.with_physical_optimizer_rules(super::super::physical_optimizer_rules());
        }
        SessionContext::new_with_state(state.build())
    }

    const QUERIES: &[&str] = &[
        // What accounting asks: samples inside allocations still open or ended.
        "SELECT a.job, count(*) AS n, sum(s.util) AS u FROM a JOIN s
           ON s.node = a.node AND s.gpu = a.gpu
          AND s.time >= a.start_time AND (a.end_time IS NULL OR s.time < a.end_time)
         GROUP BY a.job ORDER BY a.job",
        // Every sample kept, with how many of them an allocation held.
        "SELECT s.node, count(*) AS n, count(a.job) AS held FROM s LEFT JOIN a
           ON s.node = a.node AND s.gpu = a.gpu
          AND s.time >= a.start_time AND (s.time < a.end_time OR a.end_time IS NULL)
         GROUP BY s.node ORDER BY s.node NULLS FIRST",
        // Written the other way round, exclusive start and inclusive end, no open ends.
        "SELECT a.job, s.node, s.gpu, s.time, s.util FROM s JOIN a
           ON a.node = s.node AND a.gpu = s.gpu
          AND a.start_time < s.time AND a.end_time >= s.time
         ORDER BY a.job, s.node, s.gpu, s.time, s.util",
        // A filter saying more than the interval.
        "SELECT a.job, s.time, s.util FROM a JOIN s
           ON s.node = a.node AND s.gpu = a.gpu
          AND s.time >= a.start_time AND (a.end_time IS NULL OR s.time < a.end_time)
          AND s.util * 10 > a.job % 50
         ORDER BY a.job, s.time, s.util",
    ];

    async fn run(ctx: &SessionContext, sql: &str) -> (String, String) {
        let df = ctx.sql(sql).await.expect("test query");
        let plan = df.clone().create_physical_plan().await.expect("test query");
        let plan = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        let batches = df.collect().await.expect("test query");
        (
            pretty_format_batches(&batches)
                .expect("test query")
                .to_string(),
            plan,
        )
    }

    async fn check(allocs: Vec<Alloc>, samples: Vec<Sample>) {
        for partitioned in [false, true] {
            let with = session(true, partitioned);
            let without = session(false, partitioned);
            for ctx in [&with, &without] {
                let (a, s) = tables(&allocs, &samples);
                ctx.register_table("a", Arc::new(a)).expect("test query");
                ctx.register_table("s", Arc::new(s)).expect("test query");
            }
            for sql in QUERIES {
                let (got, plan) = run(&with, sql).await;
                let (want, hash_plan) = run(&without, sql).await;
                assert!(plan.contains("IntervalJoinExec"), "{sql}\n{plan}");
                assert!(!hash_plan.contains("IntervalJoinExec"));
                assert_eq!(got, want, "partitioned {partitioned}: {sql}\n{plan}");
            }
        }
    }

    fn alloc() -> impl Strategy<Value = Alloc> {
        (
            prop::option::weighted(0.95, 0u8..4),
            0u8..3,
            0i64..1000,
            0i64..200,
            0i64..80,
            prop::option::weighted(0.8, Just(())),
        )
            .prop_map(|(n, g, job, start, len, ended)| {
                (n, g, job, start, ended.map(|_| start + len))
            })
    }

    fn sample() -> impl Strategy<Value = Sample> {
        (
            prop::option::weighted(0.95, 0u8..4),
            0u8..3,
            prop::option::weighted(0.95, -10i64..300),
            0u8..11,
        )
            .prop_map(|(n, g, t, u)| (n, g, t, f64::from(u) / 10.0))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        /// Overlapping intervals, open ones, empty ones, null keys and times: the interval
        /// join answers exactly what the hash join answers, in both modes. (There are more
        /// samples than allocations, so join selection builds on the allocations, as it does
        /// on real data; with the intervals on the probe side the hash join is kept.)
        #[test]
        fn answers_what_the_hash_join_answers(
            allocs in prop::collection::vec(alloc(), 0..40),
            samples in prop::collection::vec(sample(), 50..300),
        ) {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("test query")
                .block_on(check(allocs, samples));
        }
    }

    /// One job's samples, as `perch bench query` (l) asks: the build side (the job's two
    /// allocations, on node-3 and node-7) is published to the Parquet scan as one filter per
    /// column, `node IN (...)` among them, and the scan skips the pages of the other nodes and
    /// other hours instead of reading all 8,000 samples (before: every row, 3.17x DuckDB's
    /// time on the benchmark). The answer is the hash join's.
    #[tokio::test]
    async fn one_jobs_samples_are_read_from_its_nodes_pages_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("samples.parquet");
        // 10 nodes x 4 GPUs x 200 samples, sorted as the store sorts them, 50 rows a page.
        let mut rows = Vec::new();
        for n in 0..10u8 {
            for g in 0..4u8 {
                for t in 0..200i64 {
                    rows.push((Some(n), g, Some(t * 1000), f64::from(n) + t as f64 / 1000.0));
                }
            }
        }
        let alloc_rows = [
            (Some(3), 1, 7, 20_000, Some(60_000)),
            (Some(7), 2, 7, 50_000, None),
            (Some(5), 0, 8, 0, None),
        ];
        let (_, samples) = tables(&alloc_rows, &rows);
        let batches: Vec<RecordBatch> = {
            let ctx = SessionContext::new();
            ctx.register_table("s", Arc::new(samples))
                .expect("register");
            ctx.sql("SELECT * FROM s ORDER BY node, gpu, time")
                .await
                .expect("sql")
                .collect()
                .await
                .expect("rows")
        };
        let props = parquet::file::properties::WriterProperties::builder()
            .set_data_page_row_count_limit(50)
            .set_write_batch_size(50)
            .build();
        let file = std::fs::File::create(&path).expect("create");
        let mut writer =
            parquet::arrow::ArrowWriter::try_new(file, batches[0].schema(), Some(props))
                .expect("writer");
        for b in &batches {
            writer.write(b).expect("write");
        }
        writer.close().expect("close");

        // Sums of fractions are rounded: plans may add them in different orders.
        let sql = "SELECT s.node, count(*) AS n, round(sum(s.util), 9) AS u FROM a JOIN s
                     ON s.node = a.node AND s.gpu = a.gpu
                    AND s.time >= a.start_time AND (a.end_time IS NULL OR s.time < a.end_time)
                   WHERE a.job = 7 GROUP BY s.node ORDER BY s.node";
        let mut answers = Vec::new();
        for interval_join in [false, true] {
            let ctx = session(interval_join, false);
            ctx.register_table("a", Arc::new(tables(&alloc_rows, &[]).0))
                .expect("register");
            ctx.register_parquet("s", path.to_str().expect("utf-8"), Default::default())
                .await
                .expect("register");
            let df = ctx.sql(sql).await.expect("sql");
            answers.push(
                pretty_format_batches(&df.clone().collect().await.expect("rows"))
                    .expect("format")
                    .to_string(),
            );
            if interval_join {
                let explained = ctx
                    .sql(&format!("EXPLAIN ANALYZE {sql}"))
                    .await
                    .expect("explain")
                    .collect()
                    .await
                    .expect("explain");
                let text = pretty_format_batches(&explained)
                    .expect("format")
                    .to_string();
                let scan = text
                    .lines()
                    .find(|l| l.contains("DataSourceExec") && l.contains("samples.parquet"))
                    .unwrap_or_else(|| panic!("no scan in {text}"));
                assert!(
                    scan.contains("IN (SET) ([node-3, node-7])")
                        || scan.contains("IN ([node-3, node-7])"),
                    "the node filter: {scan}"
                );
                let read: f64 = scan
                    .split("output_rows=")
                    .nth(1)
                    .and_then(|r| r.split([',', ' ']).next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("rows read: {scan}"));
                assert!(read <= 1000.0, "read {read} of 8000 rows: {scan}");
            }
        }
        assert_eq!(answers[0], answers[1]);
        assert!(answers[1].contains("node-3") && answers[1].contains("node-7"));
    }

    /// What a build key publishes: its distinct values when the keys are few, else its least
    /// and greatest (vectorised, over the rows that can match only), nothing when no row can.
    #[test]
    fn key_values_are_a_list_when_few_and_a_range_when_many() {
        let nodes: ArrayRef = Arc::new(StringArray::from(vec![
            Some("node-9"),
            Some("node-2"),
            None,
            Some("node-2"),
            Some("node-5"),
        ]));
        let kept = UInt32Array::from(vec![0, 1, 3, 4]);
        let text = |v: &KeyValues| format!("{v:?}");
        let few = KeyValues::of(&nodes, &kept, Some(&[1, 4, 0, 3])).expect("few");
        assert!(
            matches!(&few, KeyValues::Few(l) if l.len() == 3 && l[0] == ScalarValue::from("node-2")),
            "{}",
            text(&few)
        );
        let range = KeyValues::of(&nodes, &kept, None).expect("range");
        assert!(
            matches!(&range, KeyValues::Range(lo, hi)
                if *lo == ScalarValue::from("node-2") && *hi == ScalarValue::from("node-9")),
            "{}",
            text(&range)
        );
        // Row 2 (null) is not among the kept rows; with none kept, nothing can match.
        let none = KeyValues::of(&nodes, &UInt32Array::from(Vec::<u32>::new()), None);
        assert!(matches!(none, Ok(KeyValues::None)));
    }

    /// Bounds at the limits of the value's type: an open interval and an inclusive end at
    /// the largest value still contain it, an exclusive start at it contains nothing.
    #[tokio::test]
    async fn bounds_at_the_limits_of_the_type() {
        let max = i64::MAX;
        check(
            vec![
                (Some(0), 0, 1, 0, None),
                (Some(0), 0, 2, max - 5, Some(max)),
                (Some(1), 0, 3, max, Some(max)),
            ],
            (0..60)
                .map(|i| {
                    (
                        Some(i % 2),
                        0,
                        Some(if i < 30 { max } else { max - i64::from(i) }),
                        1.0,
                    )
                })
                .collect(),
        )
        .await;
    }

    #[tokio::test]
    async fn leaves_other_joins_to_the_hash_join() {
        let ctx = session(true, false);
        let (a, s) = tables(
            &[(Some(0), 0, 1, 0, Some(10))],
            &[(Some(0), 0, Some(5), 1.0)],
        );
        ctx.register_table("a", Arc::new(a)).expect("test query");
        ctx.register_table("s", Arc::new(s)).expect("test query");
        for sql in [
            // Only a lower bound.
            "SELECT * FROM a JOIN s ON s.node = a.node AND s.time >= a.start_time",
            // Bounds on two different probe values.
            "SELECT * FROM a JOIN s ON s.node = a.node AND s.time >= a.start_time AND s.util < a.job",
            // A join that must find the build rows nothing matched.
            "SELECT * FROM a FULL JOIN s ON s.node = a.node AND s.time >= a.start_time AND s.time < a.end_time",
        ] {
            let (_, plan) = run(&ctx, sql).await;
            assert!(!plan.contains("IntervalJoinExec"), "{sql}\n{plan}");
        }
    }
}
