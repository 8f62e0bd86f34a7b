//! perch's control plane: jobs and nodes, what users submit ([`spec`]), the records kept of
//! them ([`record`]), the state that decides ([`control::Control`], feeding the pure
//! scheduler core), and the service that runs it ([`JobService`]): operations under one lock,
//! committed to a [`JobStore`] before they answer.
//!
//! It knows nothing of HTTP or SQL: operations answer in [`ControlError`], which the server
//! maps to HTTP in one place; accounting (the server's SQL tables) reads it through
//! [`JobService`] and is told of the control plane's changes through [`SettledRecords`]. The
//! HTTP API's answers about jobs and nodes are typed here ([`api`]), so that the server, which
//! writes them, and the CLI, which reads them, agree.

pub mod accounts;
pub mod api;
pub mod claims;
pub mod control;
pub mod cost;
pub mod db;
pub mod ha;
pub mod job_token;
pub mod node_commands;
pub mod pg;
#[cfg(feature = "testing")]
pub mod pg_testing;
pub mod provenance;
pub mod record;
mod service;
pub mod spec;
pub mod store;
pub mod usage;
pub mod validation;

pub use control::{
    AllocationView, CancelOutcome, CancelSelection, ControlError, ControlSnapshot, DEFAULT_LEASE,
    DEFAULT_MAX_PENDING_BYTES_PER_USER, DEFAULT_MAX_PENDING_PER_USER, DEFAULT_OUTPUT_RETENTION,
    JobsConfig, NodeView, PassStats, PendingView, UsageView,
};
pub use service::*;
pub use store::{JobStore, SettledRecords};
