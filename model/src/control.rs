//! The agent's control channel: every interval an agent posts a [`SyncRequest`] to
//! `POST /v1/agent/sync` saying what its node has and what runs there, and the server answers
//! with the jobs to start and stop. Reconciliation is built in: the server compares what the
//! agent reports with what it believes, so a job never runs twice and none is orphaned after
//! either side restarts.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What an agent reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncRequest {
    pub node: crate::NodeId,
    /// GPUs the scheduler may use on this node (0 means the node runs no GPU jobs).
    pub gpus: u32,
    pub gpu_model: String,
    /// Topology label (rack or switch) for packing gangs close together.
    #[serde(default)]
    pub rack: Option<String>,
    /// Jobs whose processes are running now.
    #[serde(default)]
    pub running: Vec<u64>,
    /// Jobs whose processes ended since the last sync that the server has not acknowledged.
    #[serde(default)]
    pub exited: Vec<JobExit>,
    /// New output of running or exited jobs.
    #[serde(default)]
    pub logs: Vec<LogChunk>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobExit {
    pub job: u64,
    /// Exit code; a job killed by a signal reports 128 + the signal number, like a shell.
    pub code: i32,
    /// Set when perch stopped it (cancel, preemption, time limit) rather than it exiting.
    #[serde(default)]
    pub stopped: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    Stdout,
    Stderr,
}

impl LogStream {
    pub fn as_str(self) -> &'static str {
        match self {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        }
    }
}

/// Bytes `offset..offset + data.len()` of a job's stream on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogChunk {
    pub job: u64,
    pub stream: LogStream,
    pub offset: u64,
    pub data: String,
}

/// What the server answers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncResponse {
    pub start: Vec<JobLaunch>,
    pub stop: Vec<JobStop>,
    /// Exits the server has recorded: the agent may forget them.
    pub acknowledged: Vec<u64>,
    /// Where each stream of each job should continue from (the server's copy's length), so a
    /// restarted agent or server resumes log shipping without gaps or repeats.
    #[serde(default)]
    pub log_offsets: Vec<(u64, LogStream, u64)>,
}

/// Start this job's processes on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobLaunch {
    pub job: u64,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    /// GPU indices on this node, for `CUDA_VISIBLE_DEVICES`.
    pub gpus: Vec<u32>,
    pub user: String,
    /// This node's rank in the gang and the gang's size.
    pub node_rank: u32,
    pub nodes: u32,
    /// Seconds the job may run; the agent kills it past that even if the server is away.
    pub time_limit_secs: u64,
    pub checkpoint_signal: String,
    pub grace_secs: u64,
    /// On simulated GPUs, the load they show while this job runs: idle, steady or bursty.
    #[serde(default)]
    pub sim_profile: Option<String>,
}

/// Stop this job: the checkpoint signal, `grace_secs`, then SIGKILL to its process group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobStop {
    pub job: u64,
    pub signal: String,
    pub grace_secs: u64,
}
