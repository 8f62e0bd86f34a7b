//! `[query]`: the limits of the SQL queries the server runs for its users (time, rows,
//! memory, spill, statement size and depth, how many at once).

use super::{DAY, MIB, PIB, bad, within};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[query]`: the limits of users' SQL queries; every key is documented in
/// `perch.example.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuerySection {
    pub timeout_secs: f64,
    pub max_rows: usize,
    pub memory_mb: usize,
    /// Memory all users' queries may hold together (MiB).
    pub total_memory_mb: usize,
    /// Users' queries that run at once.
    pub max_concurrent: usize,
    /// Temporary files all queries together may spill to (MiB); 0 turns spilling off.
    pub spill_mb: u64,
    /// The longest statement taken (KiB).
    pub max_statement_kb: usize,
    /// The deepest statement taken: operators chained, brackets, CASE and UNION nested
    /// (`perch_query::guard`).
    pub max_expression_depth: usize,
}

impl Default for QuerySection {
    fn default() -> Self {
        QuerySection {
            timeout_secs: 30.0,
            max_rows: 100_000,
            memory_mb: 1024,
            total_memory_mb: 2048,
            max_concurrent: 4,
            spill_mb: 4096,
            max_statement_kb: perch_query::guard::DEFAULT_MAX_BYTES >> 10,
            max_expression_depth: perch_query::guard::DEFAULT_MAX_DEPTH,
        }
    }
}

impl QuerySection {
    /// Checks the keys of `[query]`; the message names the key.
    pub(super) fn check(&self) -> Result<()> {
        within("query.memory_mb", self.memory_mb as u64, 0, PIB, MIB)?;
        let total = self.total_memory_mb as u64;
        within("query.total_memory_mb", total, 0, PIB, MIB)?;
        within("query.spill_mb", self.spill_mb, 0, PIB, MIB)?;
        if !(self.timeout_secs > 0.0 && self.timeout_secs <= DAY as f64) {
            return bad(
                "query.timeout_secs",
                &format!(
                    "must be above 0 and at most {DAY} seconds, got {}",
                    self.timeout_secs
                ),
            );
        }
        if self.max_rows == 0 || self.memory_mb == 0 {
            return bad("query.max_rows / query.memory_mb", "must be at least 1");
        }
        if self.total_memory_mb < self.memory_mb {
            return bad(
                "query.total_memory_mb",
                &format!(
                    "must be at least query.memory_mb ({} MiB), or no query could use its own limit",
                    self.memory_mb
                ),
            );
        }
        if !(1..=64 << 10).contains(&self.max_statement_kb) {
            return bad(
                "query.max_statement_kb",
                "must be between 1 and 65536 (64 MiB)",
            );
        }
        if !(16..=perch_query::guard::MAX_MAX_DEPTH).contains(&self.max_expression_depth) {
            return bad(
                "query.max_expression_depth",
                &format!(
                    "must be between 16 and {}: the SQL threads' stacks grow with it",
                    perch_query::guard::MAX_MAX_DEPTH
                ),
            );
        }
        if !(1..=1024).contains(&self.max_concurrent) {
            return bad("query.max_concurrent", "must be between 1 and 1024");
        }
        Ok(())
    }

    /// The limits every query of the server runs under.
    pub(super) fn limits(&self) -> perch_query::QueryLimits {
        perch_query::QueryLimits {
            timeout: Duration::from_secs_f64(self.timeout_secs),
            max_rows: self.max_rows,
            memory_bytes: self.memory_mb << 20,
            total_memory_bytes: self.total_memory_mb << 20,
            max_concurrent: self.max_concurrent,
            spill_bytes: self.spill_mb << 20,
            max_statement_bytes: self.max_statement_kb << 10,
            max_expression_depth: self.max_expression_depth,
        }
    }
}
