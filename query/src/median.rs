//! An exact `median` and `percentile_cont` that count equal values instead of keeping each one.
//!
//! DataFusion's `median` and `percentile_cont` keep every value of every group in a vector.
//! Their partial stage hands those vectors to the final stage as lists (236 MB for the
//! benchmark's median per node over a week, query (h)), and the final stage copies them again
//! before it selects. Telemetry repeats itself: utilization comes in whole percent, temperature
//! in whole degrees; the benchmark's week of power readings holds 3,012 distinct values in
//! 31 M rows. So these count how often each value occurs in a group, and hand the counts
//! between the stages. A group whose values turn out mostly distinct stops counting and keeps
//! its values as DataFusion does, so the worst case costs what DataFusion's does.
//!
//! The answers are DataFusion's, by the same definitions, over values in ascending total order
//! (-0 below +0, NaN above every number):
//! - `median`: the middle value, or the mean of the two middle values when the count is even;
//! - `percentile_cont(p) WITHIN GROUP (ORDER BY x)`: the value at position `p × (n - 1)` from
//!   0, interpolated linearly between its two neighbours with DataFusion's quantized weight
//!   (`ORDER BY x DESC` reads `1 - p`);
//!
//! and NULL for a group without values. Values are counted by their bits, so different NaNs
//! and the two zeros stay apart, as they do in that order.
//!
//! Only `Float64` arguments take this path; the functions' signatures cast integers to
//! `Float64`, which covers every column perch stores. `DISTINCT`, `Float16`, `Float32` and
//! decimals go to DataFusion's functions unchanged, and so does every check of a
//! `percentile_cont`'s fraction (a literal from 0 to 1), made before an accumulator exists.

use arrow::array::RecordBatch;
use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Float64Array, ListArray, UInt64Array};
use arrow::buffer::{NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow::datatypes::{DataType, Field, FieldRef, Float64Type, Schema, UInt64Type};
use datafusion::common::{HashMap, ScalarValue};
use datafusion::error::{DataFusionError, Result};
use datafusion::functions_aggregate::median::Median;
use datafusion::functions_aggregate::percentile_cont::PercentileCont;
use datafusion::logical_expr::ColumnarValue;
use datafusion::logical_expr::function::AggregateFunctionSimplification;
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::format_state_name;
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, Documentation, EmitTo, GroupsAccumulator,
    Signature,
};
use std::mem::size_of;
use std::sync::Arc;

/// `median`, replacing DataFusion's in perch's sessions.
pub(crate) fn median() -> AggregateUDF {
    AggregateUDF::new_from_impl(Counting(Median::new()))
}

/// `percentile_cont` (and its alias `quantile_cont`), replacing DataFusion's in perch's
/// sessions.
pub(crate) fn percentile_cont() -> AggregateUDF {
    AggregateUDF::new_from_impl(Counting(PercentileCont::new()))
}

/// DataFusion's quantization of `percentile_cont`'s interpolation weight (its
/// `INTERPOLATION_PRECISION`, private there), which answers must match.
const INTERPOLATION_PRECISION: f64 = 1_000_000.0;
/// Uncounted values a group collects before it counts them.
const COUNT_EVERY: usize = 1024;
/// Distinct values a group may count before it may give up counting...
const GIVE_UP_PAST: usize = 4096;
/// ...which it does when fewer than this many values on average share a distinct one: a
/// count costs about four times a kept value.
const GIVE_UP_BELOW_REPEATS: u64 = 4;

/// DataFusion's function `F`, whose accumulators for `Float64` count (see the module).
#[derive(Debug, PartialEq, Eq, Hash)]
struct Counting<F>(F);

/// What a group's accumulator selects from its values.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Select {
    Median,
    /// `percentile_cont` at this fraction of the ascending order.
    Percentile(f64),
}

/// A DataFusion function whose answer is a selection from each group's values.
trait Selects: AggregateUDFImpl {
    /// The selection `args` ask for. Runs where DataFusion's accumulator would be made, after
    /// DataFusion has checked the arguments as it would for its own accumulator.
    fn select(&self, args: &AccumulatorArgs) -> Result<Select>;
}

impl Selects for Median {
    fn select(&self, _args: &AccumulatorArgs) -> Result<Select> {
        Ok(Select::Median)
    }
}

impl Selects for PercentileCont {
    fn select(&self, args: &AccumulatorArgs) -> Result<Select> {
        // DataFusion's own accumulator checks the fraction: a literal from 0 to 1, or the
        // error a user would see without perch.
        self.accumulator(args.clone())?;
        let no_rows = RecordBatch::new_empty(Arc::new(Schema::empty()));
        let fraction = match args.exprs.get(1).map(|e| e.evaluate(&no_rows)) {
            Some(Ok(ColumnarValue::Scalar(ScalarValue::Float64(Some(p))))) => p,
            Some(Ok(ColumnarValue::Scalar(ScalarValue::Float32(Some(p))))) => f64::from(p),
            _ => {
                return Err(DataFusionError::Plan(
                    "percentile_cont: the fraction must be a literal from 0 to 1, as in \
                     percentile_cont(0.9) WITHIN GROUP (ORDER BY x)"
                        .to_string(),
                ));
            }
        };
        let descending = args.order_bys.first().is_some_and(|o| o.options.descending);
        Ok(Select::Percentile(if descending {
            1.0 - fraction
        } else {
            fraction
        }))
    }
}

/// Whether an argument takes the counting path.
fn counts(data_type: &DataType, distinct: bool) -> bool {
    !distinct && *data_type == DataType::Float64
}

fn list_of(data_type: DataType) -> DataType {
    DataType::List(Arc::new(Field::new_list_field(data_type, true)))
}

impl<F: Selects + std::hash::Hash + Eq> AggregateUDFImpl for Counting<F> {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn aliases(&self) -> &[String] {
        self.0.aliases()
    }

    fn simplify(&self) -> Option<AggregateFunctionSimplification> {
        self.0.simplify()
    }

    fn supports_within_group_clause(&self) -> bool {
        self.0.supports_within_group_clause()
    }

    fn signature(&self) -> &Signature {
        self.0.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.0.return_type(arg_types)
    }

    /// Each distinct value of a group and how often it occurred, as two lists of one length.
    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        if !counts(args.input_fields[0].data_type(), args.is_distinct) {
            return self.0.state_fields(args);
        }
        Ok(vec![
            Field::new(
                format_state_name(args.name, "counted_values"),
                list_of(DataType::Float64),
                true,
            )
            .into(),
            Field::new(
                format_state_name(args.name, "value_counts"),
                list_of(DataType::UInt64),
                true,
            )
            .into(),
        ])
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        if !counts(args.expr_fields[0].data_type(), args.is_distinct) {
            return self.0.accumulator(args);
        }
        Ok(Box::new(SelectAccumulator {
            values: Values::default(),
            select: self.0.select(&args)?,
        }))
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        self.0.groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        if !counts(args.expr_fields[0].data_type(), args.is_distinct) {
            return self.0.create_groups_accumulator(args);
        }
        Ok(Box::new(SelectGroups::new(self.0.select(&args)?)))
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.0.documentation()
    }
}

/// The values of one group.
#[derive(Debug, Default)]
struct Values {
    /// Values not counted yet; every value once counting has given up.
    kept: Vec<f64>,
    counted: Counted,
}

#[derive(Debug, Default)]
enum Counted {
    /// Nothing counted yet: a group of fewer than [`COUNT_EVERY`] values never counts.
    #[default]
    Nothing,
    Counts(Box<Tally>),
    /// Too many distinct values: every value is in `kept`.
    GaveUp,
}

#[derive(Debug, Default)]
struct Tally {
    /// How often each value occurred, by its bits.
    by_bits: HashMap<u64, u64>,
    /// The sum of the counts.
    total: u64,
}

impl Tally {
    /// Whether so few values repeat that keeping them would take less.
    fn too_distinct(&self) -> bool {
        let distinct = self.by_bits.len();
        distinct > GIVE_UP_PAST && self.total < distinct as u64 * GIVE_UP_BELOW_REPEATS
    }
}

impl Values {
    /// Adds one value; returns how many bytes the group's storage grew by.
    fn push(&mut self, value: f64) -> isize {
        let counts_now =
            self.kept.len() + 1 >= COUNT_EVERY && !matches!(self.counted, Counted::GaveUp);
        if self.kept.len() < self.kept.capacity() && !counts_now {
            self.kept.push(value);
            return 0;
        }
        let before = self.size();
        self.kept.push(value);
        if counts_now {
            self.count_kept();
        }
        self.size() as isize - before as isize
    }

    /// One row of another stage's state: its values, with a count each or each once
    /// (`counts` is `None`); returns how many bytes the group's storage grew by.
    fn merge(&mut self, values: &[f64], counts: Option<&[u64]>) -> Result<isize> {
        let before = self.size();
        match counts {
            None => self.add_once(values)?,
            Some(counts) => {
                for (&value, &count) in values.iter().zip(counts) {
                    self.add_counted(value, count)?;
                }
            }
        }
        Ok(self.size() as isize - before as isize)
    }

    /// Each of `values` once.
    fn add_once(&mut self, values: &[f64]) -> Result<()> {
        if let Counted::Counts(tally) = &mut self.counted {
            for value in values {
                *tally.by_bits.entry(value.to_bits()).or_insert(0) += 1;
            }
            tally.total += values.len() as u64;
            self.give_up_if_distinct();
            return Ok(());
        }
        self.keep(values.len(), |kept| kept.extend_from_slice(values))
    }

    /// `count` occurrences of `value`.
    fn add_counted(&mut self, value: f64, count: u64) -> Result<()> {
        if let Counted::Counts(tally) = &mut self.counted {
            *tally.by_bits.entry(value.to_bits()).or_insert(0) += count;
            tally.total += count;
            self.give_up_if_distinct();
            return Ok(());
        }
        if matches!(self.counted, Counted::Nothing) && count >= COUNT_EVERY as u64 {
            // Counted from here on; the kept values are counted with the next ones.
            self.counted = Counted::Counts(Box::default());
            return self.add_counted(value, count);
        }
        let count = usize::try_from(count).map_err(|_| too_many(count))?;
        self.keep(count, |kept| kept.extend(std::iter::repeat_n(value, count)))
    }

    /// Keeps `more` values that `extend` appends, and counts them once there are enough.
    fn keep(&mut self, more: usize, extend: impl FnOnce(&mut Vec<f64>)) -> Result<()> {
        self.kept
            .try_reserve(more)
            .map_err(|_| too_many(more as u64))?;
        extend(&mut self.kept);
        if self.kept.len() >= COUNT_EVERY {
            self.count_kept();
        }
        Ok(())
    }

    /// Moves the kept values into the counts, a block at a time, until they are all counted
    /// or counting gives up (then every value is kept).
    fn count_kept(&mut self) {
        if matches!(self.counted, Counted::GaveUp) || self.kept.is_empty() {
            return;
        }
        let mut kept = std::mem::take(&mut self.kept);
        if !matches!(self.counted, Counted::Counts(_)) {
            self.counted = Counted::Counts(Box::default());
        }
        let Counted::Counts(tally) = &mut self.counted else {
            unreachable!("set just above")
        };
        let mut counted = 0;
        for block in kept.chunks(COUNT_EVERY) {
            for value in block {
                *tally.by_bits.entry(value.to_bits()).or_insert(0) += 1;
            }
            tally.total += block.len() as u64;
            counted += block.len();
            if tally.too_distinct() {
                break;
            }
        }
        // The uncounted rest, if any, stays; the allocation serves the next values.
        kept.drain(..counted);
        self.kept = kept;
        self.give_up_if_distinct();
    }

    fn give_up_if_distinct(&mut self) {
        let Counted::Counts(tally) = &self.counted else {
            return;
        };
        if !tally.too_distinct() {
            return;
        }
        let Counted::Counts(tally) = std::mem::replace(&mut self.counted, Counted::GaveUp) else {
            unreachable!("matched just above")
        };
        // Fewer than GIVE_UP_BELOW_REPEATS values per distinct one: bounded by the map's size.
        self.kept.reserve(tally.total as usize);
        for (bits, count) in tally.by_bits {
            self.kept
                .extend(std::iter::repeat_n(f64::from_bits(bits), count as usize));
        }
    }

    /// Takes one occurrence of each value away (a window frame moving on).
    fn retract(&mut self, value: f64) -> Result<()> {
        let bits = value.to_bits();
        if let Some(at) = self.kept.iter().position(|v| v.to_bits() == bits) {
            self.kept.swap_remove(at);
            return Ok(());
        }
        if let Counted::Counts(tally) = &mut self.counted
            && let Some(count) = tally.by_bits.get_mut(&bits)
        {
            *count -= 1;
            if *count == 0 {
                tally.by_bits.remove(&bits);
            }
            tally.total -= 1;
            return Ok(());
        }
        Err(DataFusionError::Internal(
            "median, percentile_cont: a window frame retracted a value it does not hold"
                .to_string(),
        ))
    }

    /// The group's values for the next stage; with their counts when it counts, or each
    /// once (nothing written to `counts`; returns `false`).
    fn state_into(&mut self, values: &mut Vec<f64>, counts: &mut Vec<u64>) -> bool {
        if matches!(self.counted, Counted::Counts(_)) {
            self.count_kept();
        }
        match &self.counted {
            Counted::Counts(tally) => {
                for (&bits, &count) in &tally.by_bits {
                    values.push(f64::from_bits(bits));
                    counts.push(count);
                }
                true
            }
            Counted::Nothing | Counted::GaveUp => {
                values.extend_from_slice(&self.kept);
                false
            }
        }
    }

    /// The median; reorders the values but keeps them (a window evaluates again).
    fn median(&mut self) -> Option<f64> {
        if !matches!(self.counted, Counted::Counts(_)) {
            return median_of_kept(&mut self.kept);
        }
        self.count_kept();
        let Counted::Counts(tally) = &self.counted else {
            return median_of_kept(&mut self.kept);
        };
        let n = tally.total + self.kept.len() as u64;
        if n == 0 {
            return None;
        }
        // The values at positions n/2 - 1 and n/2 in ascending order (one value when n is odd).
        let [low, high] = self.at_positions([(n - 1) / 2, n / 2]);
        Some(if n % 2 == 1 { high } else { (low + high) / 2.0 })
    }

    /// What `select` selects; reorders the values but keeps them (a window evaluates again).
    fn select(&mut self, select: Select) -> Option<f64> {
        match select {
            Select::Median => self.median(),
            Select::Percentile(fraction) => self.percentile(fraction),
        }
    }

    /// DataFusion's `percentile_cont` at `fraction` (checked to be from 0 to 1).
    fn percentile(&mut self, fraction: f64) -> Option<f64> {
        if matches!(self.counted, Counted::Counts(_)) {
            self.count_kept();
        }
        let n = match &self.counted {
            Counted::Counts(tally) => tally.total + self.kept.len() as u64,
            Counted::Nothing | Counted::GaveUp => self.kept.len() as u64,
        };
        if n == 0 {
            return None;
        }
        let index = fraction * ((n - 1) as f64);
        let (lower, upper) = (index.floor() as u64, index.ceil() as u64);
        let [low, high] = self.at_positions([lower, upper]);
        if lower == upper {
            return Some(low);
        }
        let scaled = ((index - lower as f64) * INTERPOLATION_PRECISION) as usize;
        let weight = scaled as f64 / INTERPOLATION_PRECISION;
        Some(low + (high - low) * weight)
    }

    /// The values at positions `at` (from 0, each below the number of values) in ascending
    /// order.
    fn at_positions<const N: usize>(&mut self, at: [u64; N]) -> [f64; N] {
        let Counted::Counts(tally) = &self.counted else {
            return at.map(|at| {
                *self
                    .kept
                    .select_nth_unstable_by(at as usize, f64::total_cmp)
                    .1
            });
        };
        // Counted values, and any not counted yet, each once.
        let mut sorted: Vec<(f64, u64)> = tally
            .by_bits
            .iter()
            .map(|(&bits, &count)| (f64::from_bits(bits), count))
            .chain(self.kept.iter().map(|&value| (value, 1)))
            .collect();
        sorted.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        at.map(|at| nth(&sorted, at))
    }

    fn size(&self) -> usize {
        let counted = match &self.counted {
            Counted::Counts(tally) => {
                size_of::<Tally>() + tally.by_bits.capacity() * (2 * size_of::<u64>() + 1)
            }
            Counted::Nothing | Counted::GaveUp => 0,
        };
        self.kept.capacity() * size_of::<f64>() + counted
    }
}

/// The value at position `at` (from 0) of the values counted in `sorted`.
fn nth(sorted: &[(f64, u64)], at: u64) -> f64 {
    let mut before = 0;
    for &(value, count) in sorted {
        before += count;
        if at < before {
            return value;
        }
    }
    unreachable!("position {at} is below the counts' total {before}")
}

/// DataFusion's selection of the middle (two middle values averaged for an even count).
fn median_of_kept(values: &mut [f64]) -> Option<f64> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let (low, &mut high, _) = values.select_nth_unstable_by(n / 2, f64::total_cmp);
    if n % 2 == 1 {
        return Some(high);
    }
    let low_max = low
        .iter()
        .copied()
        .max_by(f64::total_cmp)
        .expect("an even count of at least two leaves one value below the middle");
    Some((low_max + high) / 2.0)
}

fn too_many(count: u64) -> DataFusionError {
    DataFusionError::ResourcesExhausted(format!(
        "median, percentile_cont: {count} values do not fit in memory"
    ))
}

/// The rows of `values` that count: not NULL, and passing the aggregate's `FILTER`.
fn counted_rows<'a>(
    values: &'a Float64Array,
    filter: Option<&'a BooleanArray>,
) -> impl Iterator<Item = (usize, f64)> + 'a {
    values
        .values()
        .iter()
        .enumerate()
        .filter(move |&(i, _)| {
            values.is_valid(i) && filter.is_none_or(|f| f.is_valid(i) && f.value(i))
        })
        .map(|(i, &v)| (i, v))
}

/// Calls `merge` with each row of a state: the row, its values, and their counts (`None`:
/// each value once).
fn for_each_state_row(
    states: &[ArrayRef],
    mut merge: impl FnMut(usize, &[f64], Option<&[u64]>) -> Result<()>,
) -> Result<()> {
    let [values, counts] = states else {
        return Err(DataFusionError::Internal(format!(
            "median, percentile_cont: a state has two columns, not {}",
            states.len()
        )));
    };
    let values = values.as_list::<i32>();
    let counts = counts.as_list::<i32>();
    let all_values = values.values().as_primitive::<Float64Type>().values();
    let all_counts = counts.values().as_primitive::<UInt64Type>().values();
    let (value_offsets, count_offsets) = (values.value_offsets(), counts.value_offsets());
    for row in (0..values.len()).filter(|&row| values.is_valid(row)) {
        let at = value_offsets[row] as usize..value_offsets[row + 1] as usize;
        let counted_at = count_offsets[row] as usize..count_offsets[row + 1] as usize;
        let counts = match counted_at.len() {
            0 => None,
            n if n == at.len() => Some(&all_counts[counted_at]),
            n => {
                return Err(DataFusionError::Internal(format!(
                    "median, percentile_cont: row {row} of a state has {} values but {n} counts",
                    at.len()
                )));
            }
        };
        merge(row, &all_values[at], counts)?;
    }
    Ok(())
}

/// The state's two lists: each group's values, and their counts (an empty list where each
/// value counts once).
struct StateLists {
    values: Vec<f64>,
    value_lengths: Vec<usize>,
    counts: Vec<u64>,
    count_lengths: Vec<usize>,
}

impl StateLists {
    fn new() -> Self {
        StateLists {
            values: Vec::new(),
            value_lengths: Vec::new(),
            counts: Vec::new(),
            count_lengths: Vec::new(),
        }
    }

    fn push(&mut self, group: &mut Values) {
        let (values, counts) = (self.values.len(), self.counts.len());
        group.state_into(&mut self.values, &mut self.counts);
        self.value_lengths.push(self.values.len() - values);
        self.count_lengths.push(self.counts.len() - counts);
    }

    fn finish(self) -> Result<Vec<ArrayRef>> {
        if i32::try_from(self.values.len()).is_err() {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "median, percentile_cont: a state of {} values is larger than a list holds",
                self.values.len()
            )));
        }
        let list = |data_type: DataType, lengths: Vec<usize>, child: ArrayRef| -> ArrayRef {
            Arc::new(ListArray::new(
                Arc::new(Field::new_list_field(data_type, true)),
                OffsetBuffer::<i32>::from_lengths(lengths),
                child,
                None,
            ))
        };
        Ok(vec![
            list(
                DataType::Float64,
                self.value_lengths,
                Arc::new(Float64Array::from(self.values)),
            ),
            list(
                DataType::UInt64,
                self.count_lengths,
                Arc::new(UInt64Array::from(self.counts)),
            ),
        ])
    }
}

/// One [`Values`] per group.
#[derive(Debug)]
struct SelectGroups {
    groups: Vec<Values>,
    /// What the groups' values and counts take (`size` must not visit every group).
    bytes: usize,
    select: Select,
}

impl SelectGroups {
    fn new(select: Select) -> Self {
        SelectGroups {
            groups: Vec::new(),
            bytes: 0,
            select,
        }
    }

    fn grew(&mut self, by: isize) {
        self.bytes = self.bytes.saturating_add_signed(by);
    }

    fn take(&mut self, emit_to: EmitTo) -> Vec<Values> {
        let taken = emit_to.take_needed(&mut self.groups);
        let bytes: usize = taken.iter().map(Values::size).sum();
        self.bytes = self.bytes.saturating_sub(bytes);
        taken
    }
}

impl GroupsAccumulator for SelectGroups {
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        self.groups.resize_with(total_num_groups, Values::default);
        let values = values[0].as_primitive::<Float64Type>();
        let mut grew = 0;
        if values.null_count() == 0 && opt_filter.is_none() {
            for (&group, &value) in group_indices.iter().zip(values.values()) {
                grew += self.groups[group].push(value);
            }
        } else {
            for (row, value) in counted_rows(values, opt_filter) {
                grew += self.groups[group_indices[row]].push(value);
            }
        }
        self.grew(grew);
        Ok(())
    }

    fn merge_batch(
        &mut self,
        states: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        self.groups.resize_with(total_num_groups, Values::default);
        let mut grew = 0;
        let groups = &mut self.groups;
        let merged = for_each_state_row(states, |row, values, counts| {
            grew += groups[group_indices[row]].merge(values, counts)?;
            Ok(())
        });
        self.grew(grew);
        merged
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let mut lists = StateLists::new();
        for mut group in self.take(emit_to) {
            lists.push(&mut group);
        }
        lists.finish()
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        let select = self.select;
        let selected: Float64Array = self
            .take(emit_to)
            .iter_mut()
            .map(|group| group.select(select))
            .collect();
        Ok(Arc::new(selected))
    }

    /// Each row as a state of its own: its value, once (NULL when it does not count).
    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        let input = values[0].as_primitive::<Float64Type>();
        let rows = input.len();
        let valid: Vec<bool> = (0..rows)
            .map(|i| input.is_valid(i) && opt_filter.is_none_or(|f| f.is_valid(i) && f.value(i)))
            .collect();
        let nulls = Some(NullBuffer::from(valid));
        let field = |data_type| Arc::new(Field::new_list_field(data_type, true));
        Ok(vec![
            Arc::new(ListArray::new(
                field(DataType::Float64),
                OffsetBuffer::<i32>::from_lengths(std::iter::repeat_n(1, rows)),
                Arc::new(Float64Array::new(input.values().clone(), None)),
                nulls.clone(),
            )),
            Arc::new(ListArray::new(
                field(DataType::UInt64),
                OffsetBuffer::<i32>::new_zeroed(rows),
                Arc::new(UInt64Array::new(
                    ScalarBuffer::from(Vec::<u64>::new()),
                    None,
                )),
                nulls,
            )),
        ])
    }

    fn size(&self) -> usize {
        self.groups.capacity() * size_of::<Values>() + self.bytes
    }
}

/// The same for an aggregate without groups, and for windows.
#[derive(Debug)]
struct SelectAccumulator {
    values: Values,
    select: Select,
}

impl Accumulator for SelectAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        for (_, value) in counted_rows(values[0].as_primitive::<Float64Type>(), None) {
            self.values.push(value);
        }
        Ok(())
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        for_each_state_row(states, |_, values, counts| {
            self.values.merge(values, counts).map(|_| ())
        })
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        let mut lists = StateLists::new();
        lists.push(&mut self.values);
        lists
            .finish()?
            .into_iter()
            .map(|list| Ok(ScalarValue::List(Arc::new(list.as_list::<i32>().clone()))))
            .collect()
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        Ok(ScalarValue::Float64(self.values.select(self.select)))
    }

    fn size(&self) -> usize {
        size_of::<Self>() + self.values.size()
    }

    fn retract_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        for (_, value) in counted_rows(values[0].as_primitive::<Float64Type>(), None) {
            self.values.retract(value)?;
        }
        Ok(())
    }

    fn supports_retract_batch(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float32Array, Int64Array, RecordBatch};
    use arrow::datatypes::Schema;
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::prelude::{SessionConfig, SessionContext};
    use proptest::prelude::*;

    /// Rows `k` of the test table: its group `g`, a value `x` from `value`, `i` and `f` the
    /// same value as an integer and a `Float32`; every seventh `x` NULL when `nulls`.
    fn table(rows: i64, groups: i64, nulls: bool, value: impl Fn(i64) -> f64) -> Vec<RecordBatch> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("g", DataType::Int64, false),
            Field::new("x", DataType::Float64, true),
            Field::new("i", DataType::Int64, true),
            Field::new("f", DataType::Float32, true),
        ]));
        // Four partitions of small batches, so that partial states travel between stages.
        (0..4)
            .map(|part| {
                let ks: Vec<i64> = (0..rows).filter(|k| k % 4 == part).collect();
                let x: Float64Array = ks
                    .iter()
                    .map(|&k| (!nulls || k % 7 != 3).then(|| value(k)))
                    .collect();
                let i: Int64Array = x.iter().map(|v| v.map(|v| v as i64)).collect();
                let f: Float32Array = x.iter().map(|v| v.map(|v| v as f32)).collect();
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from(ks.clone())),
                        Arc::new(Int64Array::from(
                            ks.iter().map(|k| k % groups).collect::<Vec<_>>(),
                        )),
                        Arc::new(x),
                        Arc::new(i),
                        Arc::new(f),
                    ],
                )
                .expect("batch")
            })
            .collect()
    }

    fn context(config: SessionConfig, batches: &[RecordBatch], counting: bool) -> SessionContext {
        let ctx = SessionContext::new_with_config(config);
        if counting {
            ctx.register_udaf(median());
            ctx.register_udaf(percentile_cont());
        }
        let partitions = batches
            .iter()
            .map(|b| {
                (0..b.num_rows())
                    .step_by(500)
                    .map(|at| b.slice(at, 500.min(b.num_rows() - at)))
                    .collect()
            })
            .collect();
        let table = MemTable::try_new(batches[0].schema(), partitions).expect("table");
        ctx.register_table("t", Arc::new(table)).expect("register");
        ctx
    }

    async fn answer(ctx: &SessionContext, query: &str) -> String {
        let batches = ctx
            .sql(query)
            .await
            .expect(query)
            .collect()
            .await
            .expect(query);
        pretty_format_batches(&batches).expect("format").to_string()
    }

    const QUERIES: &[&str] = &[
        "SELECT g, median(x) FROM t GROUP BY g ORDER BY g",
        "SELECT median(x), median(i), count(x) FROM t",
        "SELECT g, median(x) FILTER (WHERE k % 3 = 0) FROM t GROUP BY g ORDER BY g",
        "SELECT g, median(x) FILTER (WHERE k < 0) FROM t GROUP BY g ORDER BY g",
        "SELECT g, median(i), median(f), median(DISTINCT x) FROM t GROUP BY g ORDER BY g",
        "SELECT g, median(x) FROM t WHERE k % 2 = 0 OR g = 1 GROUP BY g ORDER BY g",
        "SELECT k, median(x) OVER (PARTITION BY g ORDER BY k ROWS BETWEEN 40 PRECEDING AND CURRENT ROW) FROM t WHERE k < 3000 ORDER BY k",
        "SELECT k, median(x) OVER (PARTITION BY g ORDER BY k) FROM t WHERE k < 3000 ORDER BY k",
        "SELECT g, percentile_cont(0.5) WITHIN GROUP (ORDER BY x), percentile_cont(0.9) WITHIN GROUP (ORDER BY x), percentile_cont(0.99) WITHIN GROUP (ORDER BY x) FROM t GROUP BY g ORDER BY g",
        "SELECT percentile_cont(0.25) WITHIN GROUP (ORDER BY x), percentile_cont(0.999) WITHIN GROUP (ORDER BY i), quantile_cont(x, 0.75) FROM t",
        "SELECT g, percentile_cont(0.1) WITHIN GROUP (ORDER BY x DESC), percentile_cont(0.3) WITHIN GROUP (ORDER BY f) FROM t GROUP BY g ORDER BY g",
        "SELECT g, percentile_cont(0.0) WITHIN GROUP (ORDER BY x), percentile_cont(1.0) WITHIN GROUP (ORDER BY x), percentile_cont(0.37) WITHIN GROUP (ORDER BY x) FILTER (WHERE k % 3 = 0) FROM t GROUP BY g ORDER BY g",
        "SELECT g, percentile_cont(0.95) WITHIN GROUP (ORDER BY x) FILTER (WHERE k < 0) FROM t WHERE k % 2 = 0 OR g = 1 GROUP BY g ORDER BY g",
        "SELECT k, quantile_cont(x, 0.8) OVER (PARTITION BY g ORDER BY k ROWS BETWEEN 40 PRECEDING AND CURRENT ROW) FROM t WHERE k < 3000 ORDER BY k",
    ];

    /// The attack of a median over values that never repeat: the kept values count against the
    /// query's memory, so a query's limit refuses it (`ResourcesExhausted`) rather than the
    /// process growing; the same number of values that repeat is counted and fits.
    #[tokio::test]
    async fn distinct_values_are_held_to_the_memory_limit() {
        use datafusion::execution::memory_pool::GreedyMemoryPool;
        use datafusion::execution::runtime_env::RuntimeEnvBuilder;
        let limited = |batches: &[RecordBatch]| {
            let runtime = RuntimeEnvBuilder::new()
                .with_memory_pool(Arc::new(GreedyMemoryPool::new(4 << 20)))
                .build_arc()
                .expect("runtime");
            let ctx = SessionContext::new_with_config_rt(
                SessionConfig::new().with_target_partitions(2),
                runtime,
            );
            ctx.register_udaf(median());
            let table =
                MemTable::try_new(batches[0].schema(), vec![batches.to_vec()]).expect("table");
            ctx.register_table("t", Arc::new(table)).expect("register");
            ctx
        };
        // One million values, 8 MB as f64: twice the 4 MiB the query may hold.
        let distinct = table(1_000_000, 1, false, |k| k as f64 * 0.5);
        let err = limited(&distinct)
            .sql("SELECT median(x) FROM t")
            .await
            .expect("plans")
            .collect()
            .await
            .expect_err("distinct values past the limit are refused");
        assert!(
            err.find_root().to_string().contains("Resources exhausted"),
            "{err}"
        );
        let repeating = table(1_000_000, 1, false, |k| (k % 101) as f64);
        let ctx = limited(&repeating);
        assert!(
            answer(&ctx, "SELECT median(x) FROM t")
                .await
                .contains("| 50.0 ")
        );
    }

    /// Every query gives DataFusion's own answer, on values that repeat (counted), on values
    /// that do not (counting gives up), on both in one table, with NULLs, and with NaN,
    /// infinities and even and odd counts.
    #[tokio::test]
    async fn agrees_with_datafusion() {
        type Shape = (&'static str, Box<dyn Fn(i64) -> f64>);
        let shapes: [Shape; 5] = [
            ("whole percents", Box::new(|k| ((k * 37) % 101) as f64)),
            (
                "every value distinct",
                Box::new(|k| (k as f64) * 1.37 - 20_000.0),
            ),
            (
                "group 1 distinct, the rest repeating",
                Box::new(|k| {
                    if k % 5 == 1 {
                        k as f64 / 3.0
                    } else {
                        (k % 13) as f64 * 0.5
                    }
                }),
            ),
            (
                "NaN and infinities among repeats",
                Box::new(|k| match k % 11 {
                    0 => f64::NAN,
                    1 => f64::INFINITY,
                    2 => f64::NEG_INFINITY,
                    r => r as f64,
                }),
            ),
            (
                "two values",
                Box::new(|k| if k % 3 == 0 { 1.5 } else { 2.5 }),
            ),
        ];
        for (shape, value) in &shapes {
            for (rows, nulls) in [(40_000, false), (40_001, true), (7, false), (6, true)] {
                let batches = table(rows, 5, nulls, value);
                let config = SessionConfig::new().with_target_partitions(4);
                let stock = context(config.clone(), &batches, false);
                let perch = context(config, &batches, true);
                for query in QUERIES {
                    assert_eq!(
                        answer(&perch, query).await,
                        answer(&stock, query).await,
                        "{shape}, {rows} rows, nulls {nulls}: {query}"
                    );
                }
            }
        }
    }

    /// When nearly every row is a group of its own, DataFusion stops aggregating in the
    /// partial stage and passes each row on as a state (`convert_to_state`): same answers.
    #[tokio::test]
    async fn rows_passed_on_as_states_agree() {
        let batches = table(20_000, 5, true, |k| ((k * 37) % 101) as f64);
        let config = SessionConfig::new()
            .with_target_partitions(4)
            .set_usize(
                "datafusion.execution.skip_partial_aggregation_probe_rows_threshold",
                100,
            )
            .set_str(
                "datafusion.execution.skip_partial_aggregation_probe_ratio_threshold",
                "0.1",
            );
        let stock = context(config.clone(), &batches, false);
        let perch = context(config, &batches, true);
        let query = "SELECT k / 2 AS pair, median(x) FILTER (WHERE k % 3 <> 0) FROM t GROUP BY k / 2 ORDER BY pair";
        assert_eq!(answer(&perch, query).await, answer(&stock, query).await);
        let plan = answer(&perch, &format!("EXPLAIN ANALYZE {query}")).await;
        assert!(
            plan.contains("skipped_aggregation_rows=")
                && !plan.contains("skipped_aggregation_rows=0,"),
            "the partial stage was not skipped: {plan}"
        );
    }

    /// A million values of 101 distinct ones leave 101 counts, not a million values; values
    /// that do not repeat are kept as values, in about the memory DataFusion would use.
    #[test]
    fn counts_what_repeats_and_keeps_what_does_not() {
        let mut percents = Values::default();
        for k in 0..1_000_000u64 {
            percents.push((k % 101) as f64);
        }
        let mut values = Vec::new();
        let mut counts = Vec::new();
        percents.state_into(&mut values, &mut counts);
        assert_eq!(values.len(), 101);
        assert_eq!(counts.iter().sum::<u64>(), 1_000_000);
        assert!(percents.size() < 16 * 1024, "{} bytes", percents.size());
        assert_eq!(percents.median(), Some(50.0));

        let mut distinct = Values::default();
        for k in 0..100_000u64 {
            distinct.push(k as f64);
        }
        assert!(matches!(distinct.counted, Counted::GaveUp));
        assert_eq!(distinct.kept.len(), 100_000);
        assert!(
            distinct.size() < 2 * 8 * 100_000 + 8 * 1024,
            "{} bytes",
            distinct.size()
        );
        assert_eq!(distinct.median(), Some(49_999.5));
    }

    /// Grown and emitted groups are accounted for without visiting every group.
    #[test]
    fn size_follows_the_groups() {
        let mut groups = SelectGroups::new(Select::Median);
        let values: ArrayRef = Arc::new(Float64Array::from_iter_values(
            (0..10_000).map(|k| k as f64),
        ));
        let indices: Vec<usize> = (0..10_000).map(|k| k % 3).collect();
        groups
            .update_batch(&[values], &indices, None, 3)
            .expect("update");
        let grown = groups.size();
        let exact: usize = groups.groups.iter().map(Values::size).sum();
        assert_eq!(
            grown,
            groups.groups.capacity() * size_of::<Values>() + exact
        );
        groups.evaluate(EmitTo::First(2)).expect("evaluate");
        let left: usize = groups.groups.iter().map(Values::size).sum();
        assert_eq!(
            groups.size(),
            groups.groups.capacity() * size_of::<Values>() + left
        );
    }

    /// A state whose lists do not line up is an error, not a panic.
    #[test]
    fn a_malformed_state_is_an_error() {
        let values: ArrayRef = Arc::new(ListArray::new(
            Arc::new(Field::new_list_field(DataType::Float64, true)),
            OffsetBuffer::from_lengths([2]),
            Arc::new(Float64Array::from(vec![1.0, 2.0])),
            None,
        ));
        let counts: ArrayRef = Arc::new(ListArray::new(
            Arc::new(Field::new_list_field(DataType::UInt64, true)),
            OffsetBuffer::from_lengths([1]),
            Arc::new(UInt64Array::from(vec![1])),
            None,
        ));
        let mut groups = SelectGroups::new(Select::Median);
        let Err(error) = groups.merge_batch(&[values.clone(), counts], &[0], 1) else {
            panic!("a state with 2 values and 1 count was merged");
        };
        assert!(
            error.to_string().contains("2 values but 1 counts"),
            "{error}"
        );
        assert!(groups.merge_batch(&[values], &[0], 1).is_err());
    }

    /// DataFusion's percentile_cont over every value, sorted (its definition, written out).
    fn sorted_percentile(mut all: Vec<f64>, fraction: f64) -> Option<f64> {
        all.sort_by(f64::total_cmp);
        let n = all.len();
        (n > 0).then(|| {
            let index = fraction * (n - 1) as f64;
            let (low, high) = (all[index.floor() as usize], all[index.ceil() as usize]);
            let weight = ((index - index.floor()) * 1_000_000.0) as usize as f64 / 1_000_000.0;
            if index.floor() == index.ceil() {
                low
            } else {
                low + (high - low) * weight
            }
        })
    }

    /// A percentile of counted values, of kept values, and of a group that gave counting up
    /// are each DataFusion's, at the ends and between.
    #[test]
    fn percentiles_of_counted_and_kept_values() {
        let repeating: Vec<f64> = (0..50_000u64).map(|k| ((k * 37) % 101) as f64).collect();
        let distinct: Vec<f64> = (0..50_000u64).map(|k| k as f64 * 0.37).collect();
        let few = vec![3.0, -0.0, 0.0, f64::NAN, 1.5];
        for all in [repeating, distinct, few] {
            let mut group = Values::default();
            all.iter().for_each(|&v| {
                group.push(v);
            });
            for fraction in [0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0] {
                let want = sorted_percentile(all.clone(), fraction);
                let got = group.select(Select::Percentile(fraction));
                assert_eq!(
                    got.map(f64::to_bits),
                    want.map(f64::to_bits),
                    "{fraction} of {} values",
                    all.len()
                );
            }
        }
        assert_eq!(Values::default().select(Select::Percentile(0.5)), None);
    }

    /// The error `query` ends in, planned or run.
    async fn refusal(ctx: &SessionContext, query: &str) -> String {
        let result = match ctx.sql(query).await {
            Ok(frame) => frame.collect().await.map(|_| ()),
            Err(e) => Err(e),
        };
        result.expect_err(query).to_string()
    }

    /// A fraction that is not a literal from 0 to 1 gets DataFusion's own error, not a panic.
    #[tokio::test]
    async fn a_bad_fraction_is_refused_as_datafusion_refuses_it() {
        let batches = table(100, 5, false, |k| k as f64);
        let config = SessionConfig::new().with_target_partitions(2);
        let stock = context(config.clone(), &batches, false);
        let perch = context(config, &batches, true);
        for query in [
            "SELECT percentile_cont(1.5) WITHIN GROUP (ORDER BY x) FROM t",
            "SELECT percentile_cont(x) WITHIN GROUP (ORDER BY x) FROM t",
            "SELECT g, percentile_cont(-0.1) WITHIN GROUP (ORDER BY x) FROM t GROUP BY g",
        ] {
            assert_eq!(
                refusal(&perch, query).await,
                refusal(&stock, query).await,
                "{query}"
            );
        }
    }

    /// The naive median: every value, sorted.
    fn sorted_median(mut all: Vec<f64>) -> Option<f64> {
        all.sort_by(f64::total_cmp);
        let n = all.len();
        (n > 0).then(|| {
            if n % 2 == 1 {
                all[n / 2]
            } else {
                (all[n / 2 - 1] + all[n / 2]) / 2.0
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// Any mix of pushed values and merged states (each value once, or counted; few
        /// distinct values or many, so that groups count, give up, or never start) gives the
        /// median of all the values, and a state taken and merged again gives it too.
        #[test]
        fn any_mix_of_pushes_and_merges_is_the_median(
            steps in prop::collection::vec(
                (0u8..3, 1usize..3000, prop_oneof![Just(7u64), Just(100_000)], 1u64..5000),
                1..12,
            ),
        ) {
            let mut group = Values::default();
            let mut all = Vec::new();
            for (step, (kind, n, domain, count)) in steps.into_iter().enumerate() {
                let values: Vec<f64> = (0..n as u64)
                    .map(|k| ((k * 7919 + step as u64 * 104_729) % domain) as f64 * 0.5)
                    .collect();
                match kind {
                    0 => values.iter().for_each(|&v| { group.push(v); }),
                    1 => { group.merge(&values, None).expect("merge"); }
                    _ => {
                        let counts: Vec<u64> = values.iter().map(|_| count % 7 + 1).collect();
                        group.merge(&values, Some(&counts)).expect("merge");
                        for (&v, &c) in values.iter().zip(&counts) {
                            all.extend(std::iter::repeat_n(v, c as usize));
                        }
                        continue;
                    }
                }
                all.extend(values);
            }
            let want = sorted_median(all);
            let mut values = Vec::new();
            let mut counts = Vec::new();
            let counted = group.state_into(&mut values, &mut counts);
            let mut again = Values::default();
            again.merge(&values, counted.then_some(&counts[..])).expect("merge");
            prop_assert_eq!(group.median(), want);
            prop_assert_eq!(again.median(), want);
        }
    }
}
