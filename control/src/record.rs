//! What the server remembers about a job, from submission to its final state: the request,
//! where it runs, its timeline, attempts and exit. This is what `perch show` prints and what
//! survives a restart. Each run of a job on a node is an [`Allocation`]: the GPUs it held,
//! from when to when, and what they did (folded from telemetry by the server's accounting).

use super::spec::JobRequest;
use crate::usage::GpuUsage;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
    /// How this node's rank of the current attempt ended, once it has (a job on several
    /// nodes runs until every rank has ended, or one has failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
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
    /// Every run on every node, oldest first: what accounting and fair share are made of.
    #[serde(default)]
    pub allocations: Vec<Allocation>,
    /// The current run's rendezvous port (`MASTER_PORT`), picked free on its rank-0 node;
    /// `None` until that node has reported it, or when the job chose its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_port: Option<u16>,
    /// Earlier attempts told to stop whose end no agent has confirmed yet: the next attempt's
    /// launches wait for them, so the job never runs twice (on the old node and the new).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stopping: Vec<StoppingRun>,
    /// When the server deleted the job's stored output, `server.job_output_days` after the
    /// job ended; the record itself stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_deleted_ms: Option<i64>,
    /// The array this job is a task of (`perch submit --array`), `None` for a job of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<ArrayTask>,
}

/// How long after its end a settled job's record stays in memory before only its summary
/// does ([`JobRecord::is_settled`], `control/archive.rs`).
pub const ARCHIVE_AFTER_MS: i64 = 10 * 60 * 1000;

/// About how many bytes a job's record takes beyond its command, environment and timeline
/// ([`JobRecord::weight`]).
pub const RECORD_BYTES: usize = 1024;

impl JobRecord {
    /// Ended at or before `before_ms`, with nothing left to change: no earlier attempt
    /// waiting to be confirmed stopped, and every allocation's accounting final. Only its
    /// stored output may still be deleted ([`JobRecord::delete_output`]).
    pub fn is_settled(&self, before_ms: i64) -> bool {
        self.state.is_final()
            && self.end_ms.is_some_and(|e| e <= before_ms)
            && self.stopping.is_empty()
            && self.allocations.iter().all(Allocation::is_final)
    }

    /// Marks the job's stored output deleted at `now` (`server.job_output_days` after it
    /// ended), with a note on its timeline; false if it already was.
    pub fn delete_output(&mut self, now: i64) -> bool {
        if self.output_deleted_ms.is_some() {
            return false;
        }
        self.output_deleted_ms = Some(now);
        let days = (now - self.end_ms.unwrap_or(now)).max(0) / 86_400_000;
        self.note(
            now,
            format!(
                "its stored output was deleted, {days} days after the job ended (server.job_output_days)"
            ),
        );
        true
    }

    /// About how many bytes the job's text takes in an answer or in the job store: command
    /// and environment ([`JobRequest::kept_bytes`]), timeline, and [`RECORD_BYTES`] for the
    /// rest.
    pub fn weight(&self) -> usize {
        let timeline: usize = self.timeline.iter().map(|e| e.event.len() + 32).sum();
        self.request.kept_bytes() + timeline + RECORD_BYTES
    }
}

/// A task's place in its array: the array's id (its first task's, `PERCH_ARRAY_JOB_ID`) and
/// the task's index (`PERCH_ARRAY_TASK_ID`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayTask {
    pub job_id: u64,
    pub task_id: u32,
}

/// An attempt of a job told to stop on a node, not yet confirmed gone there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoppingRun {
    pub node: String,
    pub attempt: u32,
}

/// The GPUs one attempt of a job held on one node, and what they did with them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Allocation {
    /// The job's attempt (1 for its first run).
    pub attempt: u32,
    pub node: String,
    pub gpus: Vec<u32>,
    pub gpu_model: String,
    pub start_ms: i64,
    /// `None` while the job runs there.
    pub end_ms: Option<i64>,
    /// The node's GPUs are simulated.
    #[serde(default)]
    pub simulated: bool,
    /// The job held this percent of its one GPU, not the whole GPU: its share (GPU sharing),
    /// or its MIG instance's compute slices over 7.
    #[serde(default)]
    pub share_percent: Option<u32>,
    /// Telemetry of these GPUs before this time (and after `start_ms`) is folded into
    /// `usage`; later samples are not yet.
    pub folded_until_ms: i64,
    /// One entry per GPU of `gpus`, in the same order.
    pub usage: Vec<GpuUsage>,
    /// The final lengths of its stdout and stderr on the node, bytes, once it ended there and
    /// the agent said (the server's copy is complete when it holds this much).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_bytes: Option<[u64; 2]>,
    /// The exit code its node reported, once it has: an exit sent again (its acknowledgement
    /// lost, or the agent restarted before it came) is then known as one already taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

impl Allocation {
    pub fn new(
        attempt: u32,
        node: String,
        gpus: Vec<u32>,
        gpu_model: String,
        start_ms: i64,
        simulated: bool,
    ) -> Allocation {
        let usage = vec![GpuUsage::default(); gpus.len()];
        Allocation {
            attempt,
            node,
            gpus,
            gpu_model,
            start_ms,
            end_ms: None,
            simulated,
            share_percent: None,
            folded_until_ms: start_ms,
            usage,
            output_bytes: None,
            exit_code: None,
        }
    }

    /// The end, or `now_ms` while it runs.
    pub fn end_or(&self, now_ms: i64) -> i64 {
        self.end_ms.unwrap_or(now_ms).max(self.start_ms)
    }

    /// Milliseconds each GPU was held, up to `now_ms` while it runs.
    pub fn held_ms(&self, now_ms: i64) -> i64 {
        self.end_or(now_ms) - self.start_ms
    }

    /// The end of the time whose telemetry is folded into `usage`.
    pub fn folded_end_ms(&self) -> i64 {
        self.folded_until_ms
            .min(self.end_ms.unwrap_or(i64::MAX))
            .max(self.start_ms)
    }

    /// Milliseconds each GPU's `usage` covers.
    pub fn folded_ms(&self) -> i64 {
        self.folded_end_ms() - self.start_ms
    }

    /// The part of each GPU held: 1, or the share's fraction.
    pub fn gpu_fraction(&self) -> f64 {
        self.share_percent
            .map_or(1.0, |p| f64::from(p.min(100)) / 100.0)
    }

    /// Ended, and everything up to the end folded: its accounting is final.
    pub fn is_final(&self) -> bool {
        self.end_ms.is_some_and(|e| self.folded_until_ms >= e)
    }
}

/// A node's state: `up`, `drained` (no new jobs) or `down` (its agent went silent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Up,
    Drained,
    Down,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Up => "up",
            NodeState::Drained => "drained",
            NodeState::Down => "down",
        }
    }
}

/// A stretch of time a node spent in one state: the history behind idle, drained and down
/// GPU-hours.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSpan {
    pub node: String,
    /// GPUs the node had then.
    pub gpus: u32,
    pub state: NodeState,
    pub start_ms: i64,
    /// `None` for the state the node is in now.
    pub end_ms: Option<i64>,
}

impl JobRecord {
    /// The nodes the job is placed on, comma-separated in placement order (`""` unplaced).
    pub fn node_list(&self) -> String {
        self.placement
            .iter()
            .map(|p| p.node.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn note(&mut self, time_ms: i64, event: impl Into<String>) {
        self.timeline.push(TimelineEntry {
            time_ms,
            event: event.into(),
        });
    }
}
