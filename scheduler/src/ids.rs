//! Typed identifiers and virtual time.
//!
//! The core never reads a clock: every instant is a [`Time`] in milliseconds handed in by the
//! caller (the live server's wall clock, or the simulator's virtual clock). Identifiers are
//! newtypes so that a node index can never be passed where a job id is expected.

use serde::{Deserialize, Serialize};
use std::fmt;

/// An instant, in milliseconds since an epoch chosen by the caller.
pub type Time = i64;
/// A span of time in milliseconds.
pub type Millis = i64;

/// One second in [`Millis`].
pub const SECOND: Millis = 1_000;
/// One minute in [`Millis`].
pub const MINUTE: Millis = 60 * SECOND;
/// One hour in [`Millis`].
pub const HOUR: Millis = 60 * MINUTE;
/// One day in [`Millis`].
pub const DAY: Millis = 24 * HOUR;

/// A job, numbered by whoever submits it (the server's sequence, the trace's line).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct JobId(pub u64);

/// A node's position in the [`crate::Cluster`] it was added to; stable for the cluster's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u32);

/// A node's host name, as users and agents know it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeName(pub String);

/// The account (team, Slurm account, Kueue queue) that owns a quota and is billed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Account(pub String);

/// The user who submitted a job.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct User(pub String);

/// A GPU model name (`"H100"`, `"A100-80GB"`), used by job constraints.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GpuModel(pub String);

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    )*};
}
display_inner!(JobId, NodeId, NodeName, Account, User, GpuModel);
