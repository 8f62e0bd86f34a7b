//! Types that cross the wire between a perch agent and the perch server.
//!
//! This crate exists because two crates need the same definitions: the collector produces
//! [`Batch`]es and the server's store consumes them. It holds data and validation only: no I/O,
//! no async; the one injected [`clock::Clock`]; and [`tls::use_ring`], the one TLS provider every process installs.

// The GPU catalogue's expansion names this crate by path, in it as in a crate expanding it.
extern crate self as perch_model;

mod audit;
pub mod catalogue;
pub mod clock;
pub mod control;
mod error_code;
mod events;
pub mod identity;
mod ids;
mod infiniband;
mod job_metrics;
mod jobs;
mod node_state;
pub mod provenance;
mod telemetry;
mod throttle;
pub mod timefmt;
pub mod tls;
pub mod wire;
pub mod xid;

pub use audit::ClusterEvent;
pub use error_code::ErrorCode;
pub use events::{GpuEvent, GpuEventKind};
pub use ids::{GpuIndex, NodeId};
pub use infiniband::IbPortSample;
pub use job_metrics::{JOB_METRIC_KINDS, JobMetricSample};
pub use jobs::{GpuProcessSample, JobSample};
pub use node_state::{AgentLiveness, NodeState, node_state};
pub use telemetry::{
    Batch, BatchError, GpuSample, HostSample, MAX_SAMPLES_PER_BATCH, MAX_TIME_SKEW_MS, NicSample,
};
pub use throttle::{THROTTLE_REASONS, throttle_reason_names};

/// What the GPU catalogue's expansion needs in a crate that expands it
/// ([`probe_gpu_catalogue`]).
#[doc(hidden)]
pub mod __private {
    pub use serde;
}
