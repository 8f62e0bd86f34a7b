//! Scalar functions perch's SQL sessions use instead of DataFusion's.
//!
//! Every timestamp perch stores is in UTC (`Timestamp(ms, "UTC")`). DataFusion truncates a
//! timestamp that carries a time zone by converting every value through chrono's time zone
//! machinery, some 150 ns a value, even when the zone is UTC, where a day, an hour or a
//! week is plain integer arithmetic. [`date_trunc`] is DataFusion's `date_trunc` run on the
//! values with the zone taken off and put back: in UTC the two give the same instants, and
//! the arithmetic path is an order of magnitude faster. Other zones go through unchanged.

use arrow::array::{Array, ArrayRef, make_array};
use arrow::datatypes::{DataType, Field, FieldRef};
use datafusion::common::ScalarValue;
use datafusion::error::Result;
use datafusion::functions::datetime::date_trunc::DateTruncFunc;
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    ColumnarValue, Documentation, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature,
};
use std::sync::Arc;

/// `date_trunc` (and its alias `datetrunc`), fast on UTC timestamps.
pub(crate) fn date_trunc() -> ScalarUDF {
    ScalarUDF::new_from_impl(UtcDateTrunc(DateTruncFunc::new()))
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct UtcDateTrunc(DateTruncFunc);

/// A zone name or offset that is UTC.
fn is_utc(tz: &str) -> bool {
    ["UTC", "Etc/UTC", "Z", "+00:00", "+0000", "+00"]
        .iter()
        .any(|u| tz.eq_ignore_ascii_case(u))
}

/// The same values with the time zone of their timestamp type replaced (no copy).
fn retag(array: &ArrayRef, tz: Option<Arc<str>>) -> Result<ArrayRef> {
    let DataType::Timestamp(unit, _) = array.data_type() else {
        return Ok(array.clone());
    };
    let data = array
        .to_data()
        .into_builder()
        .data_type(DataType::Timestamp(*unit, tz))
        .build()?;
    Ok(make_array(data))
}

impl ScalarUDFImpl for UtcDateTrunc {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn signature(&self) -> &Signature {
        self.0.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.0.return_type(arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.0.return_field_from_args(args)
    }

    fn invoke_with_args(&self, mut args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let utc = match args.args.get(1) {
            Some(ColumnarValue::Array(a)) => match a.data_type() {
                DataType::Timestamp(_, Some(tz)) if is_utc(tz) => Some(tz.clone()),
                _ => None,
            },
            _ => None,
        };
        let Some(tz) = utc else {
            return self.0.invoke_with_args(args);
        };
        if let ColumnarValue::Array(a) = &args.args[1] {
            args.args[1] = ColumnarValue::Array(retag(a, None)?);
        }
        let naive = |f: &FieldRef| -> FieldRef {
            match f.data_type() {
                DataType::Timestamp(unit, Some(_)) => {
                    Arc::new(Field::clone(f).with_data_type(DataType::Timestamp(*unit, None)))
                }
                _ => f.clone(),
            }
        };
        if let Some(f) = args.arg_fields.get_mut(1) {
            *f = naive(f);
        }
        args.return_field = naive(&args.return_field);
        Ok(match self.0.invoke_with_args(args)? {
            ColumnarValue::Array(a) => ColumnarValue::Array(retag(&a, Some(tz))?),
            ColumnarValue::Scalar(s) => ColumnarValue::Scalar(match s {
                ScalarValue::TimestampSecond(v, None) => ScalarValue::TimestampSecond(v, Some(tz)),
                ScalarValue::TimestampMillisecond(v, None) => {
                    ScalarValue::TimestampMillisecond(v, Some(tz))
                }
                ScalarValue::TimestampMicrosecond(v, None) => {
                    ScalarValue::TimestampMicrosecond(v, Some(tz))
                }
                ScalarValue::TimestampNanosecond(v, None) => {
                    ScalarValue::TimestampNanosecond(v, Some(tz))
                }
                other => other,
            }),
        })
    }

    fn aliases(&self) -> &[String] {
        self.0.aliases()
    }

    fn output_ordering(&self, input: &[ExprProperties]) -> Result<SortProperties> {
        self.0.output_ordering(input)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.0.documentation()
    }
}

/// The functions whose result can be far larger than their arguments, each refusing a call
/// whose result would be larger than an eighth of `memory_bytes` (the query's memory limit)
/// before building it: the memory pool does not see a function's output, which is copied
/// several times on its way out. `repeat('x', 1000000000)` ran for most of a minute and took
/// gigabytes past a 1 GiB limit; `cardinality(range(1, 2000000000))` took an ordinary user's
/// server to 10.8 GB and `array_repeat` to 21.7 GB, and the next such query had it killed.
///
/// - strings: `repeat`, `lpad`, `rpad`, `replace` (each match may become a longer string),
///   `regexp_replace` (a pattern can match at every position);
/// - arrays: `range`, `generate_series` (one element per step), `array_repeat`,
///   `array_resize`;
/// - concatenation, whose result is as large as its arguments together, so a chain of them
///   multiplies a batch: `concat`, `concat_ws`, `array_concat`, `array_append`,
///   `array_prepend`, `make_array`, and the `||` operator on strings
///   ([`StringConcatPlanner`]): eight
///   `s || s` of a 100 KB string over a generate_series took the server to 7.5 GB past a
///   1 GiB limit. A constant argument counts once per row it is repeated on;
/// - conversions that multiply: `string_to_array` (an element per character),
///   `array_to_string` (a delimiter per element).
///
/// Constant calls are folded while planning, so the refusal comes before anything runs.
pub(crate) fn size_capped(memory_bytes: usize) -> Vec<ScalarUDF> {
    let limit_bytes = memory_bytes / 8;
    let string = datafusion::functions::string::functions();
    let unicode = datafusion::functions::unicode::functions();
    let regex = datafusion::functions::regex::functions();
    let nested = datafusion::functions_nested::all_default_nested_functions();
    string
        .into_iter()
        .chain(unicode)
        .chain(regex)
        .chain(nested)
        .filter(|f| CAPPED.contains(&f.name()))
        .map(|f| {
            ScalarUDF::new_from_impl(SizeCapped {
                inner: Arc::unwrap_or_clone(f),
                limit_bytes,
            })
        })
        .collect()
}

/// The functions [`size_capped`] wraps.
const CAPPED: [&str; 17] = [
    "repeat",
    "lpad",
    "rpad",
    "replace",
    "regexp_replace",
    "range",
    "generate_series",
    "array_repeat",
    "array_resize",
    "concat",
    "concat_ws",
    "array_concat",
    "array_append",
    "array_prepend",
    "make_array",
    "string_to_array",
    "array_to_string",
];

/// Rows per batch for `plan` when a constant in it is so wide that repeating it on every row
/// of a full batch would pass an eighth of the query's memory (`None`: the default batch is
/// fine). A constant (a literal, or a call folded while planning such as
/// `repeat('x', 1000000)`) is built once, but projecting it, or passing it to a function with
/// column arguments, repeats it on each row: a 1 MB constant over a batch of 8,192 rows is 8 GB
/// outside any memory pool, before any size-capped function can look at it. The whole query
/// then runs in batches of that many rows (its filters and exchanges coalesce to that size
/// too). Only plans with a wide literal or a capped call are optimized ahead for this.
pub(crate) fn batch_rows_for(
    state: &datafusion::execution::SessionState,
    plan: &datafusion::logical_expr::LogicalPlan,
    memory_bytes: usize,
    default_rows: usize,
) -> Result<Option<usize>> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    use datafusion::logical_expr::{Expr, LogicalPlan};
    let budget = memory_bytes / 8;
    let wide = |bytes: usize| bytes.saturating_mul(default_rows) > budget;
    // (widest literal, whether a capped function is called)
    let scan = |plan: &LogicalPlan| -> Result<(usize, bool)> {
        let (mut widest, mut capped) = (0usize, false);
        plan.apply_with_subqueries(|node| {
            node.apply_expressions(|e| {
                e.apply(|x| {
                    match x {
                        Expr::Literal(v, _) => widest = widest.max(scalar_bytes(v)),
                        Expr::ScalarFunction(f) if CAPPED.contains(&f.name()) => capped = true,
                        _ => {}
                    }
                    Ok(TreeNodeRecursion::Continue)
                })
            })
        })?;
        Ok((widest, capped))
    };
    let (widest, capped) = scan(plan)?;
    let widest = if wide(widest) {
        widest
    } else if capped {
        // A capped call may fold into a wide constant: look at the plan as it will run.
        scan(&state.optimize(plan)?)?.0
    } else {
        return Ok(None);
    };
    Ok(wide(widest).then(|| (budget / widest.max(1)).max(1)))
}

/// Elements of list argument `i` over all rows (a constant's once per row).
fn list_elements(args: &ScalarFunctionArgs, i: usize) -> u128 {
    let elements = |a: &ArrayRef| {
        a.to_data()
            .child_data()
            .first()
            .map_or(0, |c| c.len() as u128)
    };
    match args.args.get(i) {
        None => 0,
        Some(ColumnarValue::Array(a)) => elements(a),
        Some(ColumnarValue::Scalar(s)) => s
            .to_array_of_size(1)
            .map_or(0, |a| elements(&a))
            .saturating_mul(args.number_rows as u128),
    }
}

/// Bytes a constant takes on each row it is repeated on: its payload (a string's bytes, a
/// list's elements), at least a word.
fn scalar_bytes(v: &ScalarValue) -> usize {
    v.size()
        .saturating_sub(std::mem::size_of::<ScalarValue>())
        .max(8)
}

/// Bytes argument `i` takes over `rows` rows: an array's buffers (its slice's, when it is
/// one), a constant's size once per row (without building the repeated array).
fn arg_bytes(args: &ScalarFunctionArgs, i: usize) -> u128 {
    match args.args.get(i) {
        None => 0,
        Some(ColumnarValue::Scalar(s)) => scalar_bytes(s) as u128 * args.number_rows as u128,
        Some(ColumnarValue::Array(a)) => {
            a.to_data()
                .get_slice_memory_size()
                .unwrap_or_else(|_| a.get_array_memory_size()) as u128
        }
    }
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct SizeCapped {
    inner: ScalarUDF,
    limit_bytes: usize,
}

/// Per row, the values of argument `i` as i64 (absent or null: 0).
fn lengths_arg(args: &ScalarFunctionArgs, i: usize) -> Result<Vec<i64>> {
    let rows = args.number_rows;
    let Some(arg) = args.args.get(i) else {
        return Ok(vec![0; rows]);
    };
    let array = arg.to_array(rows)?;
    let array = arrow::compute::cast(&array, &DataType::Int64)?;
    let ints = array
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .map(|a| {
            (0..a.len())
                .map(|r| if a.is_null(r) { 0 } else { a.value(r) })
                .collect()
        });
    Ok(ints.unwrap_or_else(|| vec![0; rows]))
}

/// Per row, the length in bytes of string argument `i` (absent or null: 0).
fn string_lengths(args: &ScalarFunctionArgs, i: usize) -> Result<Vec<u128>> {
    let rows = args.number_rows;
    let Some(arg) = args.args.get(i) else {
        return Ok(vec![0; rows]);
    };
    // A constant: its length on every row, without building the repeated array.
    if let ColumnarValue::Scalar(s) = arg {
        let strings = arrow::compute::cast(&s.to_array_of_size(1)?, &DataType::Utf8)?;
        let len = strings
            .as_any()
            .downcast_ref::<arrow::array::StringArray>()
            .filter(|a| !a.is_null(0))
            .map_or(0, |a| a.value(0).len() as u128);
        return Ok(vec![len; rows]);
    }
    let strings = arrow::compute::cast(&arg.to_array(rows)?, &DataType::Utf8)?;
    let lengths = arrow::compute::kernels::length::length(&strings)?;
    let lengths = arrow::compute::cast(&lengths, &DataType::Int64)?;
    Ok(lengths
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .map(|a| {
            (0..a.len())
                .map(|r| {
                    if a.is_null(r) {
                        0
                    } else {
                        u128::from(a.value(r).unsigned_abs())
                    }
                })
                .collect()
        })
        .unwrap_or_else(|| vec![0; rows]))
}

/// Per row, argument `i` as a count of i128 units: integers as they are, dates in days,
/// timestamps in nanoseconds, intervals in nanoseconds (a month counted as 28 days, so a
/// count of steps is never under-estimated); `None` for a type none of these.
fn steps_arg(args: &ScalarFunctionArgs, i: usize) -> Result<Option<Vec<Option<i128>>>> {
    use arrow::datatypes::{IntervalUnit, TimeUnit};
    let rows = args.number_rows;
    let Some(arg) = args.args.get(i) else {
        return Ok(None);
    };
    let array = arg.to_array(rows)?;
    const DAY_NS: i128 = 86_400_000_000_000;
    let (as_i64, scale): (ArrayRef, i128) = match array.data_type() {
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
            (arrow::compute::cast(&array, &DataType::Int64)?, 1)
        }
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
            (arrow::compute::cast(&array, &DataType::Int64)?, 1)
        }
        DataType::Date32 => (
            arrow::compute::cast(
                &arrow::compute::cast(&array, &DataType::Int32)?,
                &DataType::Int64,
            )?,
            DAY_NS,
        ),
        DataType::Date64 => (arrow::compute::cast(&array, &DataType::Int64)?, 1_000_000),
        DataType::Timestamp(unit, _) => {
            let scale = match unit {
                TimeUnit::Second => 1_000_000_000,
                TimeUnit::Millisecond => 1_000_000,
                TimeUnit::Microsecond => 1_000,
                TimeUnit::Nanosecond => 1,
            };
            (arrow::compute::cast(&array, &DataType::Int64)?, scale)
        }
        DataType::Interval(IntervalUnit::MonthDayNano) => {
            let Some(a) = array
                .as_any()
                .downcast_ref::<arrow::array::IntervalMonthDayNanoArray>()
            else {
                return Ok(None);
            };
            return Ok(Some(
                (0..a.len())
                    .map(|r| {
                        (!a.is_null(r)).then(|| {
                            let v = a.value(r);
                            i128::from(v.months) * 28 * DAY_NS
                                + i128::from(v.days) * DAY_NS
                                + i128::from(v.nanoseconds)
                        })
                    })
                    .collect(),
            ));
        }
        _ => return Ok(None),
    };
    let Some(a) = as_i64.as_any().downcast_ref::<arrow::array::Int64Array>() else {
        return Ok(None);
    };
    Ok(Some(
        (0..a.len())
            .map(|r| (!a.is_null(r)).then(|| i128::from(a.value(r)) * scale))
            .collect(),
    ))
}

impl SizeCapped {
    /// The most bytes the call could produce, or `None` when the arguments are of a kind
    /// this does not bound (the call then runs as DataFusion's own).
    fn output_bound(&self, args: &ScalarFunctionArgs) -> Result<Option<u128>> {
        let rows = args.number_rows;
        let sum = |per_row: Vec<u128>| Some(per_row.into_iter().fold(0u128, u128::saturating_add));
        let counts = || -> Result<Vec<u128>> {
            Ok(lengths_arg(args, 1)?
                .iter()
                .map(|n| u128::from(n.max(&0).unsigned_abs()))
                .collect())
        };
        Ok(match self.inner.name() {
            "repeat" => {
                let lengths = string_lengths(args, 0)?;
                sum(lengths.iter().zip(counts()?).map(|(l, n)| l * n).collect())
            }
            // A padded string of n characters, each up to 4 bytes.
            "lpad" | "rpad" => sum(counts()?.into_iter().map(|n| 4 * n).collect()),
            // Each match of `from` becomes `to`: at most len(s) / len(from) + 1 of them.
            "replace" => {
                let (s, from, to) = (
                    string_lengths(args, 0)?,
                    string_lengths(args, 1)?,
                    string_lengths(args, 2)?,
                );
                sum((0..rows)
                    .map(|r| s[r] + (s[r] / from[r].max(1) + 1) * to[r])
                    .collect())
            }
            // A pattern may match at every position, and each replacement may repeat the
            // match (`\0`): at most len(s) * (1 + 2 len(repl)) + len(repl).
            "regexp_replace" => {
                let (s, repl) = (string_lengths(args, 0)?, string_lengths(args, 2)?);
                sum((0..rows)
                    .map(|r| s[r] * (1 + 2 * repl[r]) + repl[r])
                    .collect())
            }
            "range" | "generate_series" => {
                // (stop) | (start, stop) | (start, stop, step); eight bytes an element.
                let n = args.args.len();
                let (start, stop, step) = match n {
                    1 => (None, steps_arg(args, 0)?, None),
                    2 => (steps_arg(args, 0)?, steps_arg(args, 1)?, None),
                    _ => (
                        steps_arg(args, 0)?,
                        steps_arg(args, 1)?,
                        steps_arg(args, 2)?,
                    ),
                };
                let Some(stop) = stop else {
                    return Ok(None);
                };
                sum((0..rows)
                    .map(|r| {
                        let from = start.as_ref().and_then(|s| s[r]).unwrap_or(0);
                        let step = step.as_ref().and_then(|s| s[r]).unwrap_or(1);
                        let to = stop[r].unwrap_or(from);
                        let span = (to - from).unsigned_abs();
                        8 * (span / step.unsigned_abs().max(1) + 1)
                    })
                    .collect())
            }
            // (element, count): count copies of the element.
            "array_repeat" => {
                let element = args.args[0].to_array(rows)?;
                let each = (element.get_array_memory_size() / rows.max(1)).max(8) as u128;
                sum(counts()?.into_iter().map(|n| n * each).collect())
            }
            // (array, size[, value]): size elements.
            "array_resize" => sum(counts()?.into_iter().map(|n| 16 * n).collect()),
            // As large as the arguments together (the separator once between each two).
            "concat" | "array_concat" | "array_append" | "array_prepend" | "make_array" => Some(
                (0..args.args.len())
                    .map(|i| arg_bytes(args, i))
                    .fold(0u128, u128::saturating_add),
            ),
            // Each character may become an element (a 16-byte view, an offset, a null bit).
            "string_to_array" => Some(arg_bytes(args, 0).saturating_mul(24)),
            // Each element becomes its text (a number: up to 24 bytes) and a delimiter.
            "array_to_string" => {
                let delimiter = string_lengths(args, 1)?.into_iter().max().unwrap_or(0);
                Some(
                    list_elements(args, 0)
                        .saturating_mul(24 + delimiter)
                        .saturating_add(arg_bytes(args, 0)),
                )
            }
            "concat_ws" => {
                let parts = args.args.len().saturating_sub(1) as u128;
                Some((1..args.args.len()).map(|i| arg_bytes(args, i)).fold(
                    arg_bytes(args, 0).saturating_mul(parts),
                    u128::saturating_add,
                ))
            }
            _ => None,
        })
    }
}

impl ScalarUDFImpl for SizeCapped {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.inner.return_field_from_args(args)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        if let Some(bound) = self.output_bound(&args)?
            && bound > self.limit_bytes as u128
        {
            return Err(datafusion::error::DataFusionError::ResourcesExhausted(
                format!(
                    "{}() would build {bound} bytes of strings, more than the query may use",
                    self.name()
                ),
            ));
        }
        self.inner.invoke_with_args(args)
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }
}

/// The `||` operator on two strings, as DataFusion computes it (null when either side is),
/// refusing a result larger than an eighth of the query's memory before building it. Planned
/// by [`StringConcatPlanner`] in place of the operator; its column keeps the operator's name.
#[derive(Debug, PartialEq, Eq, Hash)]
struct StringConcat {
    concat: ScalarUDF,
    signature: Signature,
    limit_bytes: usize,
}

impl ScalarUDFImpl for StringConcat {
    fn name(&self) -> &str {
        "string_concat"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        let target = if arg_types.contains(&DataType::Utf8View) {
            DataType::Utf8View
        } else if arg_types.contains(&DataType::LargeUtf8) {
            DataType::LargeUtf8
        } else {
            DataType::Utf8
        };
        Ok(vec![target; arg_types.len()])
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        Ok(arg_types.first().cloned().unwrap_or(DataType::Utf8))
    }

    fn schema_name(&self, args: &[datafusion::logical_expr::Expr]) -> Result<String> {
        Ok(args
            .iter()
            .map(|a| a.schema_name().to_string())
            .collect::<Vec<_>>()
            .join(" || "))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let bound = (0..args.args.len())
            .map(|i| arg_bytes(&args, i))
            .fold(0u128, u128::saturating_add);
        if bound > self.limit_bytes as u128 {
            return Err(datafusion::error::DataFusionError::ResourcesExhausted(
                format!("|| would build {bound} bytes of strings, more than the query may use"),
            ));
        }
        let rows = args.number_rows;
        let return_type = args.return_field.data_type().clone();
        // Null where either side is (concat() would skip it instead).
        let mut nulls: Option<arrow::array::BooleanArray> = None;
        for arg in &args.args {
            match arg {
                ColumnarValue::Scalar(s) if s.is_null() => {
                    return Ok(ColumnarValue::Scalar(ScalarValue::try_from(&return_type)?));
                }
                ColumnarValue::Scalar(_) => {}
                ColumnarValue::Array(a) => {
                    let is_null = arrow::compute::is_null(a)?;
                    nulls = Some(match nulls {
                        None => is_null,
                        Some(n) => arrow::compute::or(&n, &is_null)?,
                    });
                }
            }
        }
        let joined = self.concat.invoke_with_args(args)?;
        match (nulls, joined) {
            (Some(mask), joined) if mask.true_count() > 0 => {
                let joined = joined.to_array(rows)?;
                Ok(ColumnarValue::Array(arrow::compute::nullif(
                    &joined, &mask,
                )?))
            }
            (_, joined) => Ok(joined),
        }
    }
}

/// Plans `a || b` as size-capped functions: on two strings as [`StringConcat`] (DataFusion's
/// operator builds any size), on lists as the capped `array_concat`, `array_append` or
/// `array_prepend` (DataFusion's own planner calls its uncapped ones). Goes before
/// DataFusion's planners.
#[derive(Debug)]
pub(crate) struct StringConcatPlanner {
    udf: Arc<ScalarUDF>,
    /// The capped `array_concat`, `array_append`, `array_prepend`.
    lists: [Arc<ScalarUDF>; 3],
}

impl StringConcatPlanner {
    /// For queries with `memory_bytes` of memory.
    pub(crate) fn new(memory_bytes: usize) -> Self {
        let concat = datafusion::functions::string::concat();
        let capped = size_capped(memory_bytes);
        let list = |name: &str| {
            let f = capped
                .iter()
                .find(|f| f.name() == name)
                .cloned()
                .unwrap_or_else(|| panic!("{name} is one of CAPPED"));
            Arc::new(f)
        };
        StringConcatPlanner {
            udf: Arc::new(ScalarUDF::new_from_impl(StringConcat {
                concat: Arc::unwrap_or_clone(concat),
                signature: Signature::user_defined(datafusion::logical_expr::Volatility::Immutable),
                limit_bytes: memory_bytes / 8,
            })),
            lists: [
                list("array_concat"),
                list("array_append"),
                list("array_prepend"),
            ],
        }
    }
}

/// List nesting depth of a type (0 for a non-list).
fn list_depth(t: &DataType) -> usize {
    match t {
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            1 + list_depth(f.data_type())
        }
        _ => 0,
    }
}

impl datafusion::logical_expr::planner::ExprPlanner for StringConcatPlanner {
    fn plan_binary_op(
        &self,
        expr: datafusion::logical_expr::planner::RawBinaryExpr,
        schema: &datafusion::common::DFSchema,
    ) -> Result<
        datafusion::logical_expr::planner::PlannerResult<
            datafusion::logical_expr::planner::RawBinaryExpr,
        >,
    > {
        use datafusion::logical_expr::ExprSchemable;
        use datafusion::logical_expr::planner::PlannerResult;
        use datafusion::sql::sqlparser::ast::BinaryOperator;
        if expr.op != BinaryOperator::StringConcat {
            return Ok(PlannerResult::Original(expr));
        }
        let is_string =
            |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
        let (left, right) = (expr.left.get_type(schema)?, expr.right.get_type(schema)?);
        let (l, r) = (list_depth(&left), list_depth(&right));
        // As DataFusion's own planner chooses, with the capped functions.
        let udf = if l + r > 0 {
            match l.cmp(&r) {
                std::cmp::Ordering::Equal => &self.lists[0],
                std::cmp::Ordering::Greater => &self.lists[1],
                std::cmp::Ordering::Less => &self.lists[2],
            }
        } else if is_string(&left) && is_string(&right) {
            &self.udf
        } else {
            return Ok(PlannerResult::Original(expr));
        };
        Ok(PlannerResult::Planned(
            datafusion::logical_expr::Expr::ScalarFunction(
                datafusion::logical_expr::expr::ScalarFunction::new_udf(
                    udf.clone(),
                    vec![expr.left, expr.right],
                ),
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::prelude::SessionContext;

    /// `||` on strings through the size-capped function gives what DataFusion's operator
    /// gives: values, nulls, types and column names.
    #[tokio::test]
    async fn string_concat_agrees_with_datafusion() {
        let stock = SessionContext::new();
        let perch = SessionContext::new_with_state(
            datafusion::execution::SessionStateBuilder::new()
                .with_default_features()
                .with_expr_planners(
                    std::iter::once(Arc::new(StringConcatPlanner::new(1 << 30))
                        as Arc<dyn datafusion::logical_expr::planner::ExprPlanner>)
                    .chain(datafusion::execution::SessionStateDefaults::default_expr_planners())
                    .collect(),
                )
                .build(),
        );
        for query in [
            "SELECT 'a' || 'b', 'a' || NULL, NULL || 'a'",
            "SELECT s || '-' || s, s || t, t || s FROM (VALUES ('x', NULL), (NULL, 'y'), ('p', 'q'), ('', '')) AS v(s, t)",
            "SELECT arrow_cast(s, 'Utf8View') || s, arrow_cast(s, 'LargeUtf8') || 'z' FROM (VALUES ('x'), (NULL)) AS v(s)",
            "SELECT s || 1, 1 || s, make_array(1) || make_array(2), make_array(1) || 2, 0 || make_array(1) FROM (VALUES ('x')) AS v(s)",
            "SELECT count(*) FROM (VALUES ('ab'), ('cd')) AS v(s) WHERE s || 'x' = 'abx'",
        ] {
            let run = |ctx: &SessionContext| {
                let ctx = ctx.clone();
                async move {
                    let df = ctx.sql(query).await.expect(query);
                    let schema = df.schema().clone();
                    let batches = df.collect().await.expect(query);
                    (
                        schema
                            .fields()
                            .iter()
                            .map(|f| (f.name().clone(), f.data_type().clone()))
                            .collect::<Vec<_>>(),
                        pretty_format_batches(&batches).expect("format").to_string(),
                    )
                }
            };
            assert_eq!(run(&perch).await, run(&stock).await, "{query}");
        }
        // And it is the capped function that ran.
        let plan = perch
            .sql("EXPLAIN SELECT s || s FROM (VALUES ('x')) AS v(s)")
            .await
            .expect("explain")
            .collect()
            .await
            .expect("plan");
        let plan = pretty_format_batches(&plan).expect("format").to_string();
        assert!(plan.contains("string_concat"), "{plan}");
    }

    /// Every granularity, on UTC timestamps (the fast path) and on other zones (DataFusion's
    /// own), across days, months, years, a leap day and before 1970, gives what DataFusion's
    /// own `date_trunc` gives, type and zone included.
    #[tokio::test]
    async fn agrees_with_datafusion() {
        let granularities = [
            "microsecond",
            "millisecond",
            "second",
            "minute",
            "hour",
            "day",
            "week",
            "month",
            "quarter",
            "year",
        ];
        let stock = SessionContext::new();
        let perch = SessionContext::new();
        perch.register_udf(date_trunc());
        for zone in ["UTC", "+00:00", "America/New_York", "Asia/Kolkata"] {
            let values = format!(
                "SELECT arrow_cast(v, 'Timestamp(Millisecond, Some(\"{zone}\"))') AS t FROM (VALUES
                ('1969-12-31T23:59:59.999Z'), ('1970-01-01T00:00:00Z'), ('2024-02-29T23:59:59.5Z'),
                ('2024-03-01T00:00:00.001Z'), ('2025-06-08T13:45:10.250Z'), ('2025-12-31T23:00:00Z'),
                ('1900-07-04T12:00:00Z'), (NULL)) AS x(v)"
            );
            for g in granularities {
                let sql = format!(
                    "SELECT t, date_trunc('{g}', t) AS d, arrow_typeof(date_trunc('{g}', t)) AS ty,
                            CAST(date_trunc('{g}', t) AS DATE) AS day
                     FROM ({values}) ORDER BY t"
                );
                let run = |ctx: SessionContext| {
                    let sql = sql.clone();
                    async move {
                        let batches = ctx
                            .sql(&sql)
                            .await
                            .expect("test query")
                            .collect()
                            .await
                            .expect("test query");
                        pretty_format_batches(&batches)
                            .expect("test query")
                            .to_string()
                    }
                };
                let want = run(stock.clone()).await;
                let got = run(perch.clone()).await;
                assert_eq!(got, want, "{zone} {g}");
                assert!(got.contains(zone), "{got}");
            }
        }
    }
}
