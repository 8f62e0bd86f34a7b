//! What the server remembers about a job, from submission to its final state: the request,
//! where it runs, its timeline, attempts and exit. This is what `perch show` prints and what
//! survives a restart.

use super::spec::JobRequest;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Pending,
    Running,
    Completed,
    Failed,
    Cancelled,
    Timeout,
    Preempted,
    NodeFail,
}

impl JobState {
    pub fn is_final(self) -> bool {
        !matches!(self, JobState::Pending | JobState::Running)
    }

    pub fn parse(s: &str) -> Option<JobState> {
        serde_json::from_value(serde_json::Value::String(s.to_owned())).ok()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Timeout => "timeout",
            JobState::Preempted => "preempted",
            JobState::NodeFail => "node_fail",
        }
    }
}

/// GPUs of one node given to a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeGpus {
    pub node: String,
    pub gpus: Vec<u32>,
    /// The node's agent has been handed the launch order (persisted, so a restarted server
    /// knows whether a job missing from an agent's report was lost or never received).
    #[serde(default)]
    pub delivered: bool,
}

/// One moment of a job's life.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineEntry {
    pub time_ms: i64,
    pub event: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: u64,
    pub request: JobRequest,
    pub state: JobState,
    /// Why it waits, or why it ended.
    pub reason: Option<String>,
    pub submit_ms: i64,
    pub start_ms: Option<i64>,
    pub end_ms: Option<i64>,
    /// Where the current (or last) run is.
    pub placement: Vec<NodeGpus>,
    /// Runs started.
    pub attempts: u32,
    pub requeues: u32,
    pub preemptions: u32,
    pub exit_code: Option<i32>,
    pub timeline: Vec<TimelineEntry>,
}

impl JobRecord {
    pub fn note(&mut self, time_ms: i64, event: impl Into<String>) {
        self.timeline.push(TimelineEntry {
            time_ms,
            event: event.into(),
        });
    }
}
