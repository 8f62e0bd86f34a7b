//! Types that cross the wire between a perch agent and the perch server.
//!
//! This crate exists because two crates need the same definitions: the collector produces
//! [`Batch`]es and the server's store consumes them. It holds data and validation only: no I/O,
//! no clock, no async.

mod ids;
mod telemetry;

pub use ids::{GpuIndex, NodeId};
pub use telemetry::{
    Batch, BatchError, GpuSample, HostSample, MAX_SAMPLES_PER_BATCH, MAX_TIME_SKEW_MS, NicSample,
};
