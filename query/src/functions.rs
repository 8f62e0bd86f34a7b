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
///   `array_resize`.
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
const CAPPED: [&str; 9] = [
    "repeat",
    "lpad",
    "rpad",
    "replace",
    "regexp_replace",
    "range",
    "generate_series",
    "array_repeat",
    "array_resize",
];

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

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::prelude::SessionContext;

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
