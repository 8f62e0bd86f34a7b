//! Query results as plain cells, so perch's Arrow batches and DuckDB's Python rows can be
//! compared: numbers (timestamps as Unix milliseconds) within a float tolerance, text exactly.

use anyhow::{Result, bail};
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float64Type, Int64Type, TimeUnit};
use arrow::util::display::{ArrayFormatter, FormatOptions};

/// Relative difference allowed between two numbers: the engines sum floats in different orders.
pub(super) const TOLERANCE: f64 = 1e-9;

/// Relative tolerance for `percentile_cont`: DataFusion quantizes its interpolation weight to
/// a millionth (`INTERPOLATION_PRECISION`), DuckDB does not, so between two neighbouring
/// values the answers may differ by a millionth of their gap.
pub(super) const PERCENTILE_TOLERANCE: f64 = 1e-5;

/// How far perch's `approx_count_distinct` may be from the exact count, relative: DataFusion's
/// HyperLogLog has 16,384 registers, a standard error of 0.8%; this is about 4 of them.
pub(super) const PERCH_ESTIMATE_TOLERANCE: f64 = 0.03;

/// How far DuckDB's `approx_count_distinct` may be from the exact count: its sketch is
/// coarser (6.2% off on one day of the week's dataset, where perch's was 0.3% off).
pub(super) const DUCKDB_ESTIMATE_TOLERANCE: f64 = 0.10;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Cell {
    Null,
    Number(f64),
    Text(String),
}

impl Cell {
    pub(super) fn from_json(v: &serde_json::Value) -> Cell {
        match v {
            serde_json::Value::Null => Cell::Null,
            serde_json::Value::Number(n) => n.as_f64().map_or(Cell::Null, Cell::Number),
            serde_json::Value::String(s) => Cell::Text(s.clone()),
            other => Cell::Text(other.to_string()),
        }
    }

    fn matches(&self, other: &Cell, tolerance: f64) -> bool {
        match (self, other) {
            (Cell::Number(a), Cell::Number(b)) => {
                (a - b).abs() <= tolerance * a.abs().max(b.abs()).max(1.0)
            }
            (a, b) => a == b,
        }
    }
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cell::Null => f.write_str("NULL"),
            Cell::Number(n) => write!(f, "{n}"),
            Cell::Text(s) => write!(f, "{s:?}"),
        }
    }
}

/// Rows of cells from Arrow batches: integers, floats and decimals as numbers, timestamps as
/// Unix milliseconds, everything else (text, dates) as its display string.
pub(super) fn from_batches(batches: &[RecordBatch]) -> Result<Vec<Vec<Cell>>> {
    let mut rows = Vec::new();
    for batch in batches {
        let mut columns: Vec<Vec<Cell>> = Vec::with_capacity(batch.num_columns());
        for column in batch.columns() {
            columns.push(cells(column.as_ref())?);
        }
        for i in 0..batch.num_rows() {
            rows.push(columns.iter().map(|c| c[i].clone()).collect());
        }
    }
    Ok(rows)
}

fn cells(array: &dyn Array) -> Result<Vec<Cell>> {
    let dt = array.data_type();
    if let DataType::Timestamp(unit, _) = dt {
        let per_ms = match unit {
            TimeUnit::Second => 0.001,
            TimeUnit::Millisecond => 1.0,
            TimeUnit::Microsecond => 1_000.0,
            TimeUnit::Nanosecond => 1_000_000.0,
        };
        let raw = arrow::compute::cast(array, &DataType::Int64)?;
        let raw = raw.as_primitive::<Int64Type>();
        return Ok((0..raw.len())
            .map(|i| {
                if raw.is_null(i) {
                    Cell::Null
                } else {
                    Cell::Number((raw.value(i) as f64 / per_ms).floor())
                }
            })
            .collect());
    }
    if dt.is_numeric() {
        let f = arrow::compute::cast(array, &DataType::Float64)?;
        let f = f.as_primitive::<Float64Type>();
        return Ok((0..f.len())
            .map(|i| {
                if f.is_null(i) {
                    Cell::Null
                } else {
                    Cell::Number(f.value(i))
                }
            })
            .collect());
    }
    let formatter = ArrayFormatter::try_new(array, &FormatOptions::default())?;
    Ok((0..array.len())
        .map(|i| {
            if array.is_null(i) {
                Cell::Null
            } else {
                Cell::Text(formatter.value(i).to_string())
            }
        })
        .collect())
}

/// The sum of every number in the result: a one-figure fingerprint to print beside it.
pub(super) fn checksum(rows: &[Vec<Cell>]) -> f64 {
    rows.iter()
        .flatten()
        .map(|c| match c {
            Cell::Number(n) => *n,
            _ => 0.0,
        })
        .sum()
}

/// Fails, saying where, unless both results have the same rows in the same order with equal
/// cells (numbers within `tolerance`, relative).
/// Checks a query that estimates: each engine's rows against the exact answer, perch's within
/// [`PERCH_ESTIMATE_TOLERANCE`], DuckDB's within [`DUCKDB_ESTIMATE_TOLERANCE`].
pub(super) fn estimates_near(
    query: &str,
    perch: &[Vec<Cell>],
    duckdb: &[Vec<Cell>],
    exact: &[Vec<Cell>],
) -> Result<()> {
    let exact = ("the exact answer", exact);
    compare_as(
        query,
        ("perch's estimate", perch),
        exact,
        PERCH_ESTIMATE_TOLERANCE,
    )?;
    compare_as(
        query,
        ("DuckDB's estimate", duckdb),
        exact,
        DUCKDB_ESTIMATE_TOLERANCE,
    )
}

pub(super) fn compare(
    query: &str,
    perch: &[Vec<Cell>],
    duckdb: &[Vec<Cell>],
    tolerance: f64,
) -> Result<()> {
    compare_as(query, ("perch", perch), ("DuckDB", duckdb), tolerance)
}

/// Two answers to `query`, each with what it came from, equal within `tolerance`.
fn compare_as(
    query: &str,
    (a_name, a): (&str, &[Vec<Cell>]),
    (b_name, b): (&str, &[Vec<Cell>]),
    tolerance: f64,
) -> Result<()> {
    let show = |row: &[Cell]| {
        row.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if a.len() != b.len() {
        bail!(
            "query {query}: the answers disagree: {a_name} returned {} rows, {b_name} {}",
            a.len(),
            b.len()
        );
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x.len() != y.len() || !x.iter().zip(y).all(|(p, q)| p.matches(q, tolerance)) {
            bail!(
                "query {query}: the answers disagree at row {i}:\n  {a_name}: {}\n  {b_name}: {}",
                show(x),
                show(y)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        ArrayRef, Date32Array, Float64Array, StringArray, TimestampMillisecondArray, UInt64Array,
    };
    use std::sync::Arc;

    #[test]
    fn arrow_cells_match_what_duckdb_sends() {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(vec![Some("vision"), None])),
            Arc::new(Date32Array::from(vec![20_241, 20_242])),
            Arc::new(
                TimestampMillisecondArray::from(vec![1_748_822_400_123, 0]).with_timezone("UTC"),
            ),
            Arc::new(UInt64Array::from(vec![7, 8])),
            Arc::new(Float64Array::from(vec![0.1 + 0.2, 1.0])),
        ];
        let batch = RecordBatch::try_from_iter(["a", "d", "t", "u", "f"].into_iter().zip(columns))
            .expect("valid batch");
        let perch = from_batches(&[batch]).expect("converts");
        let duckdb: Vec<Vec<Cell>> = serde_json::json!([
            ["vision", "2025-06-02", 1_748_822_400_123i64, 7, 0.3],
            [null, "2025-06-03", 0, 8, 1.0]
        ])
        .as_array()
        .expect("array")
        .iter()
        .map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(Cell::from_json)
                .collect()
        })
        .collect();
        compare("t", &perch, &duckdb, TOLERANCE).expect("equal within tolerance");
        assert!((checksum(&perch) - (1_748_822_400_123.0 + 15.0 + 1.3 + 0.0)).abs() < 1.0);
    }

    #[test]
    fn disagreements_name_the_row() {
        let a = vec![vec![Cell::Text("x".into()), Cell::Number(1.0)]];
        let b = vec![vec![Cell::Text("x".into()), Cell::Number(1.001)]];
        let err = compare("q", &a, &b, TOLERANCE)
            .expect_err("1.0 vs 1.001 differ")
            .to_string();
        assert!(err.contains("row 0"), "{err}");
        let err = compare("q", &a, &[], TOLERANCE)
            .expect_err("row counts differ")
            .to_string();
        assert!(err.contains("1 rows, DuckDB 0"), "{err}");
    }
}
