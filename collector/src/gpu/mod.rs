//! GPU sources: real NVIDIA GPUs through NVML ([`nvml`]) and simulated GPUs ([`sim`]).
//!
//! Both produce [`perch_model::GpuSample`]s for a given `now_ms`; the agent uses NVML when it
//! can and adds simulated GPUs only when asked to, always labelled `simulated: true`.

pub mod nvml;
pub mod sim;

use std::path::PathBuf;

/// How the agent finds NVML.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NvmlMode {
    /// Load `libnvidia-ml.so.1` from the system; its absence means "no NVIDIA GPUs here".
    #[default]
    Auto,
    /// Do not touch NVML at all.
    Off,
    /// Load NVML from this path (a specific driver, or a stand-in library in tests).
    Path(PathBuf),
}
