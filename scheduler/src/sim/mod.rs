//! The trace simulator: replays a job trace in virtual time through the very same
//! [`crate::Scheduler`] the server runs, and measures the outcome.
//!
//! Replay rules: every job is one gang of the fewest nodes ([`crate::Shape::fewest_nodes`]),
//! preemptible, and keeps its progress when preempted (it checkpoints on the signal) so it
//! resumes with its remaining run time; its declared time limit comes from
//! [`trace::user_time_limit`]; the SRTF reference reads the true duration. Events at the same
//! instant are applied together, then one scheduling pass runs. No wall clock, no unseeded
//! randomness: same trace, options and seed give the same numbers.

mod engine;
mod metrics;
mod plot;
pub mod trace;

pub use engine::{SimOptions, SimPolicy, SimReport, policy_config, simulate, simulate_with};
pub use metrics::{Sample, Summary, format_table};
pub use plot::write_svg;
pub use trace::{TraceFormat, TraceJob};
