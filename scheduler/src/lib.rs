//! perch's scheduling core and its trace simulator.
//!
//! The core is a pure state machine: [`Scheduler::step`] takes an [`Event`] and the current
//! [`Time`] and returns the [`Action`]s the caller must carry out. It reads no clock, does no
//! I/O and draws no random numbers, so the live server and the simulator ([`sim`]) run the same
//! code and a replay is exactly reproducible.
//!
//! How a server drives it:
//!
//! 1. Build a [`Cluster`] with [`Cluster::add_node`] (one [`NodeSpec`] per node), and a
//!    [`Config`] ([`Config::perch`] with per-account quotas, or a baseline).
//! 2. `let mut s = Scheduler::new(cluster, config);`
//! 3. For every submission, exit, cancel, node or GPU change and telemetry sample, call
//!    `s.step(now_ms, event)?` and carry out the returned actions: `Start` (launch on the given
//!    GPUs), `Preempt` (checkpoint signal, grace, kill; requeued or ended), `Requeue`, `End`
//!    (record the final state; kill if it still runs), `IdleReport`.
//! 4. Call `s.step(now_ms, Event::Tick)` every few seconds (or at [`Scheduler::next_wakeup`])
//!    so time limits and idle windows act. [`Scheduler::queue`] gives `perch queue` its lines.
//!
//! See `README.md` for the policies, the priority formula and the backfill rule.

mod cluster;
mod error;
mod gittins;
mod history;
mod ids;
mod job;
mod pass;
mod placement;
mod plan;
mod policy;
mod reclaim;
mod scheduler;
mod share;
pub mod sim;

pub use cluster::{
    Cluster, GpuHealth, MAX_GPUS_PER_NODE, MigInstance, NodeAlloc, NodeSpec, NodeState, Placement,
    mig_hundredths, mig_slices,
};
pub use error::{Error, Result};
pub use ids::{
    Account, DAY, GpuModel, HOUR, JobId, MINUTE, Millis, NodeId, NodeName, SECOND, Time, User,
};
pub use job::{
    EndState, GpuShare, JobSpec, PendingReason, PreemptReason, Qos, RequeueReason, Shape,
};
pub use plan::StartPlan;
pub use policy::{Config, IdleAction, IdlePolicy, PolicyKind, Weights};
pub use scheduler::{Action, BeyondQuota, Event, QueueEntry, QuotaLimit, Scheduler};
