//! Folding raw telemetry into allocations: one grouped SQL query over `gpu_samples` for the
//! settled windows of every allocation that needs it, through the same read-only engine users
//! query. Each window's rows become a [`GpuUsage`] per GPU, which the control plane merges
//! into the allocation and commits with its advanced checkpoint.

use super::usage::GpuUsage;
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{Float64Type, Int64Type, UInt64Type};
use perch_query::SqlEngine;
use std::fmt::Write;

pub use perch_control::cost::{FoldWindow, Folded};

/// Why a fold failed (it is retried at the next one; nothing was applied).
#[derive(Debug, thiserror::Error)]
pub enum FoldError {
    #[error("accounting query over gpu_samples failed: {0}")]
    Query(#[from] perch_query::Error),
    #[error("accounting query returned an unexpected column {0}")]
    Shape(&'static str),
}

/// (window, GPU) pairs per query: bounds the statement's size and the result's rows.
const PAIRS_PER_QUERY: usize = 2000;

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The statement for `pairs` = (window index, window, position of the GPU in it).
fn statement(pairs: &[(usize, &FoldWindow, usize)]) -> String {
    let lo = pairs.iter().map(|p| p.1.from_ms).min().unwrap_or(0);
    let hi = pairs.iter().map(|p| p.1.to_ms).max().unwrap_or(0);
    let mut values = String::new();
    for (i, (_, w, g)) in pairs.iter().enumerate() {
        if i > 0 {
            values.push_str(",\n");
        }
        let _ = write!(
            values,
            "({i}, {}, {}, {}, {})",
            quote(&w.node),
            w.gpus[*g],
            w.from_ms,
            w.to_ms
        );
    }
    // The literal bounds on `time` let the store skip files outside every window; the
    // per-window bounds then select each window's rows exactly.
    format!(
        "WITH w(k, node, gpu, t0, t1) AS (VALUES {values})
SELECT w.k AS k,
  count(*) AS samples,
  count(s.utilization_gpu_pct) AS util_samples,
  sum(s.utilization_gpu_pct) AS util_sum,
  max(s.utilization_gpu_pct) AS util_max,
  max(s.memory_used_bytes) AS memory_max_bytes,
  min(s.energy_joules) AS energy_min_joules,
  max(s.energy_joules) AS energy_max_joules,
  CAST(min(CASE WHEN s.energy_joules IS NOT NULL THEN s.time END) AS BIGINT) AS energy_first_ms,
  CAST(max(CASE WHEN s.energy_joules IS NOT NULL THEN s.time END) AS BIGINT) AS energy_last_ms,
  count(s.power_watts) AS power_samples,
  sum(s.power_watts) AS power_sum_watts,
  CAST(max(CAST(s.simulated AS INT)) AS BIGINT) AS simulated
FROM gpu_samples s JOIN w ON s.node = w.node AND CAST(s.gpu AS BIGINT) = w.gpu
WHERE s.time >= to_timestamp_millis({lo}) AND s.time < to_timestamp_millis({hi})
  AND s.time >= to_timestamp_millis(w.t0) AND s.time < to_timestamp_millis(w.t1)
GROUP BY w.k"
    )
}

fn f64_at(b: &RecordBatch, name: &'static str, row: usize) -> Result<Option<f64>, FoldError> {
    let c = b.column_by_name(name).ok_or(FoldError::Shape(name))?;
    let c = c
        .as_primitive_opt::<Float64Type>()
        .ok_or(FoldError::Shape(name))?;
    Ok(c.is_valid(row).then(|| c.value(row)))
}

fn opt_i64_at(b: &RecordBatch, name: &'static str, row: usize) -> Result<Option<i64>, FoldError> {
    let c = b.column_by_name(name).ok_or(FoldError::Shape(name))?;
    let c = c
        .as_primitive_opt::<Int64Type>()
        .ok_or(FoldError::Shape(name))?;
    Ok(c.is_valid(row).then(|| c.value(row)))
}

fn i64_at(b: &RecordBatch, name: &'static str, row: usize) -> Result<i64, FoldError> {
    let c = b.column_by_name(name).ok_or(FoldError::Shape(name))?;
    let c = c
        .as_primitive_opt::<Int64Type>()
        .ok_or(FoldError::Shape(name))?;
    Ok(if c.is_valid(row) { c.value(row) } else { 0 })
}

fn u64_at(b: &RecordBatch, name: &'static str, row: usize) -> Result<Option<u64>, FoldError> {
    let c = b.column_by_name(name).ok_or(FoldError::Shape(name))?;
    let c = c
        .as_primitive_opt::<UInt64Type>()
        .ok_or(FoldError::Shape(name))?;
    Ok(c.is_valid(row).then(|| c.value(row)))
}

/// Folds `windows`: every window comes back, with empty usage where it had no samples (the
/// checkpoint still advances: those samples are not coming, or come too late).
pub async fn fold(sql: &SqlEngine, windows: Vec<FoldWindow>) -> Result<Vec<Folded>, FoldError> {
    let mut usage: Vec<Vec<GpuUsage>> = windows
        .iter()
        .map(|w| vec![GpuUsage::default(); w.gpus.len()])
        .collect();
    let mut simulated = vec![false; windows.len()];
    let pairs: Vec<(usize, &FoldWindow, usize)> = windows
        .iter()
        .enumerate()
        .flat_map(|(i, w)| (0..w.gpus.len()).map(move |g| (i, w, g)))
        .collect();
    for chunk in pairs.chunks(PAIRS_PER_QUERY) {
        let result = sql.query_internal(&statement(chunk)).await?;
        for b in &result.batches {
            for row in 0..b.num_rows() {
                let k = usize::try_from(i64_at(b, "k", row)?).map_err(|_| FoldError::Shape("k"))?;
                let &(i, _, g) = chunk.get(k).ok_or(FoldError::Shape("k"))?;
                usage[i][g] = GpuUsage {
                    samples: i64_at(b, "samples", row)?.max(0) as u64,
                    util_samples: i64_at(b, "util_samples", row)?.max(0) as u64,
                    util_sum: f64_at(b, "util_sum", row)?.unwrap_or(0.0),
                    util_max: f64_at(b, "util_max", row)?,
                    memory_max_bytes: u64_at(b, "memory_max_bytes", row)?,
                    energy_min_joules: f64_at(b, "energy_min_joules", row)?,
                    energy_max_joules: f64_at(b, "energy_max_joules", row)?,
                    energy_first_ms: opt_i64_at(b, "energy_first_ms", row)?,
                    energy_last_ms: opt_i64_at(b, "energy_last_ms", row)?,
                    power_samples: i64_at(b, "power_samples", row)?.max(0) as u64,
                    power_sum_watts: f64_at(b, "power_sum_watts", row)?.unwrap_or(0.0),
                };
                simulated[i] |= i64_at(b, "simulated", row)? > 0;
            }
        }
    }
    Ok(windows
        .into_iter()
        .zip(usage)
        .zip(simulated)
        .map(|((window, usage), simulated)| Folded {
            window,
            usage,
            simulated,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_quoted_as_sql_strings() {
        let w = FoldWindow {
            job: 1,
            attempt: 1,
            node: "o'brien".into(),
            gpus: vec![3],
            from_ms: 10,
            to_ms: 20,
        };
        let sql = statement(&[(0, &w, 0)]);
        assert!(sql.contains("(0, 'o''brien', 3, 10, 20)"), "{sql}");
        assert!(sql.contains("to_timestamp_millis(10)") && sql.contains("to_timestamp_millis(20)"));
    }
}
