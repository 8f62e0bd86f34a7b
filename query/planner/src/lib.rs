//! DataFusion's SQL planner behind one function that is never inlined, so that one crate
//! compiles it, and a small one.
//!
//! `SessionState::create_logical_plan` is a small `async fn`, so rustc instantiates it in
//! whichever crate awaits it, together with everything generic beneath it: the SQL-to-plan
//! translation (`SqlToRel<S>`) and sqlparser's visitors, about half a million lines of LLVM IR.
//! Compiled inside `perch-query`, at the opt-level of perch's own operators, that made it the
//! slowest unit of the first release build (148 s). This crate gets the opt-level the
//! workspace gives query planning (`Cargo.toml`: 1 in `release`, 3 in `dist`). At opt-level 1
//! rustc shares generic instances between crates, so in `release` this crate links to the
//! planner the `datafusion` crate already compiled (it builds in under a second and
//! `perch-query` in 75 s); in `dist`, link-time optimization merges every copy anyway.

use datafusion::error::Result;
use datafusion::execution::session_state::SessionState;
use datafusion::logical_expr::LogicalPlan;
use futures::future::BoxFuture;

/// The logical plan of the one SQL statement `sql`, as
/// [`SessionState::create_logical_plan`] makes it.
#[inline(never)]
pub fn plan<'a>(state: &'a SessionState, sql: &'a str) -> BoxFuture<'a, Result<LogicalPlan>> {
    Box::pin(state.create_logical_plan(sql))
}
