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
pub(super) fn compare(
    query: &str,
    perch: &[Vec<Cell>],
    duckdb: &[Vec<Cell>],
    tolerance: f64,
) -> Result<()> {
    let show = |row: &[Cell]| {
        row.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if perch.len() != duckdb.len() {
        bail!(
            "query {query}: the engines disagree: perch returned {} rows, DuckDB {}",
            perch.len(),
            duckdb.len()
        );
    }
    for (i, (p, d)) in perch.iter().zip(duckdb).enumerate() {
        if p.len() != d.len() || !p.iter().zip(d).all(|(a, b)| a.matches(b, tolerance)) {
            bail!(
                "query {query}: the engines disagree at row {i}:\n  perch:  {}\n  DuckDB: {}",
                show(p),
                show(d)
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
