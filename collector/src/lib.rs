//! The perch node agent as a library: it samples the host (`/proc`), every NIC (`/proc/net/dev`,
//! `/sys/class/net`), NVIDIA GPUs through NVML and, on request, simulated GPUs or a whole simulated
//! node, and streams the samples as [`perch_model::Batch`]es to the perch server.
//!
//! Layout: parsers and readers ([`host`], [`nic`], [`gpu`]) take an injectable root path or
//! library path and a `now_ms`, so tests run on fixture trees with no real clock; [`sampler`]
//! combines them into one round; [`queue`] is the pure, bounded send queue; [`spool`] keeps what
//! does not fit on disk; [`sender`] talks HTTP; [`agent`] wires them together behind [`run_agent`] / [`spawn_agent`].
//!
//! The collector never depends on the server, the store or DataFusion: it only shares the wire
//! types of `perch-model`.

pub mod agent;
pub mod agent_claim;
pub mod control_loop;
mod error;
pub mod gpu;
pub mod host;
pub mod infiniband;
pub mod jobs;
pub mod launcher;
pub mod local_metrics;
pub mod nic;
pub mod node_command;
pub mod queue;
pub mod sampler;
pub mod sender;
pub mod servers;
pub mod sim_node;
pub mod spool;
pub mod topology;
pub mod validation;

pub use agent::{
    AgentConfig, AgentCounters, AgentHandle, AgentStats, GpuDetection, NvmlMode, detect_gpus,
    run_agent, spawn_agent,
};
pub use error::{CollectorError, Result};
pub use jobs::{JobRegistry, JobSpec, JobTarget};
pub use local_metrics::serve_metrics;
