//! The trace simulator: replays a job trace in virtual time through the very same
//! [`crate::Scheduler`] the server runs, and measures the outcome.
//!
//! Replay rules: every job is one gang of the fewest nodes of the largest node size it may use
//! ([`SimCluster::shape`]), or a fraction of one GPU; a preempted job keeps its work up to its
//! last checkpoint and pays a restart delay ([`PreemptionCost`]); its declared time limit comes
//! from [`trace::user_time_limit`]; the SRTF reference reads the true duration. Events at the
//! same instant are applied together, then one scheduling pass runs. No wall clock, no unseeded
//! randomness: same trace, options and seed give the same numbers.

mod cluster;
mod csv;
mod engine;
mod metrics;
mod plot;
pub mod suite;
pub mod synth;
pub mod trace;

pub use cluster::{DEFAULT_GPU_MEMORY_GB, SimCluster, SimNode};
pub use engine::{
    PreemptionCost, SimOptions, SimPolicy, SimReport, policy_config, simulate, simulate_with,
    trace_quotas,
};
pub use metrics::{JobOutcome, Sample, Summary, format_table};
pub use plot::write_svg;
pub use synth::{MIXED_CLUSTER, SynthKind};
pub use trace::{LimitModel, Trace, TraceFormat, TraceJob};
