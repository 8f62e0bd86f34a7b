//! The HTTP API's answers about jobs, the queue and nodes, as types both ends use: the server
//! serialises them and the CLI reads them, so a field renamed on one side stops the other
//! from compiling instead of showing up as a `-` in `perch show`.
//!
//! The server writes each answer through a `serde_json::Value`, whose objects keep their keys
//! sorted: the order clients have always seen, whatever the order of the fields here.

use crate::control::CancelOutcome;
use crate::record::{JobRecord, NodeState};
use perch_model::ErrorCode;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Cow;

/// A job as the API shows it to one caller: its record, with what only `GET /v1/jobs/{id}`
/// adds. Listings and the queue show the record alone.
///
/// The server lends its own record (`Cow::Borrowed`); a client reads an owned one
/// (`JobView<'static>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView<'a> {
    /// The record; another user's (for a caller who is not an operator) without its command
    /// line, environment and working directory, which carry other people's secrets.
    #[serde(flatten)]
    pub record: Cow<'a, JobRecord>,
    /// The record's request is hidden: the job is another user's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub private: bool,
    /// A running job's GPUs, each with its latest sample (`GET /v1/jobs/{id}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_now: Option<Vec<GpuNow>>,
    /// A pending job's estimated start (`GET /v1/jobs/{id}`).
    #[serde(flatten)]
    pub estimate: Option<StartEstimate>,
    /// The accounting of a job that has run (`GET /v1/jobs/{id}`): `Some(None)`, sent as
    /// `null`, when the server could not read it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub usage: Option<Option<JobUsage>>,
}

impl<'a> JobView<'a> {
    /// The record as it stands, with nothing added.
    pub fn of(record: Cow<'a, JobRecord>) -> JobView<'a> {
        JobView {
            record,
            private: false,
            gpus_now: None,
            estimate: None,
            usage: None,
        }
    }
}

/// A field that is there, `null` or not: `Some(None)` for `null`, where a plain
/// `Option<Option<T>>` reads `None`.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// One GPU of a running job and its latest sample, in `GET /v1/jobs/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuNow {
    pub node: String,
    pub gpu: u32,
    pub utilization_gpu_pct: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    /// `None` when the GPU has sent no sample yet.
    pub simulated: Option<bool>,
}

/// When a pending job should start (`squeue --start`): both fields are sent, `null` without
/// an estimate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartEstimate {
    /// Unix ms. Read with `deserialize_with` so that a missing field is an error, not `None`:
    /// an answer without the fields reads as no [`StartEstimate`] at all.
    #[serde(deserialize_with = "Option::deserialize")]
    pub estimated_start_ms: Option<i64>,
    /// The same time, RFC 3339.
    #[serde(deserialize_with = "Option::deserialize")]
    pub estimated_start: Option<String>,
}

/// A job's accounting as the `jobs` table has it, in `GET /v1/jobs/{id}`.
///
/// Two windows: `gpu_seconds_allocated` and `cost_allocated` run to now; every other figure
/// covers the accounted window, up to `accounted_until` (telemetry is folded minutes behind),
/// so `efficiency` and `idle_cost` compare `gpu_seconds_used` and `cost_used` with
/// `gpu_seconds_accounted` and `cost_accounted`, never with the allocation to now.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobUsage {
    pub gpu_seconds_allocated: Option<f64>,
    pub gpu_seconds_accounted: Option<f64>,
    pub gpu_seconds_used: Option<f64>,
    /// `gpu_seconds_used / gpu_seconds_accounted` (0 to 1), within the accounted window.
    #[serde(default)]
    pub efficiency: Option<f64>,
    pub utilization_mean_pct: Option<f64>,
    pub energy_joules: Option<f64>,
    pub cost_allocated: Option<f64>,
    /// Cost by allocation of `gpu_seconds_accounted`: the accounted window's.
    #[serde(default)]
    pub cost_accounted: Option<f64>,
    pub cost_used: Option<f64>,
    /// `cost_accounted - cost_used`: what idle allocated GPUs cost within the accounted window.
    #[serde(default)]
    pub idle_cost: Option<f64>,
    /// Telemetry is folded up to this time (as the `jobs` table writes a timestamp).
    pub accounted_until: Option<String>,
    pub end_time: Option<String>,
    pub elapsed_seconds: Option<f64>,
    /// Why some figures are missing or lag behind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A page of `GET /v1/jobs`, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobsPage<'a> {
    pub jobs: Vec<JobView<'a>>,
    /// The next page's `before`; `None` after the last page.
    pub next_before: Option<u64>,
}

/// `GET /v1/queue`: the head of the queue, in line order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueView<'a> {
    pub queue: Vec<QueueEntry<'a>>,
    /// Pending jobs in all, shown or not.
    pub total: usize,
}

/// A job of the queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueEntry<'a> {
    /// Place in line, from 1; `None` for a job held for its dependencies.
    pub position: Option<usize>,
    /// `None` for a job held for its dependencies.
    pub priority: Option<f64>,
    pub job: JobView<'a>,
    /// With `start=true`.
    #[serde(flatten)]
    pub estimate: Option<StartEstimate>,
}

/// The answer to `POST /v1/jobs`: the job (an array's first task), and the rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submitted {
    #[serde(flatten)]
    pub job: JobRecord,
    /// The request is valid but unlikely to run as asked (its shape fits no node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
    /// Every task of an array, the first included; empty for a job of its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub array_jobs: Vec<u64>,
}

/// The answer to `POST /v1/jobs/cancel`: what became of each job named or matched, each list
/// in id order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CancelAnswer {
    pub cancelled: Vec<u64>,
    /// Named, but it had ended already.
    pub already_ended: Vec<AlreadyEnded>,
    pub not_found: Vec<u64>,
    /// Named, but another user's.
    pub forbidden: Vec<NotYours>,
}

/// A job a cancel named that had ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlreadyEnded {
    pub id: u64,
    /// The state it ended in.
    pub state: String,
}

/// A job a cancel named that belongs to another user.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NotYours {
    pub id: u64,
    pub user: String,
}

impl From<CancelOutcome> for CancelAnswer {
    fn from(o: CancelOutcome) -> CancelAnswer {
        CancelAnswer {
            cancelled: o.cancelled,
            already_ended: o
                .already_ended
                .into_iter()
                .map(|e| AlreadyEnded {
                    id: e.id,
                    state: e.state.to_owned(),
                })
                .collect(),
            not_found: o.not_found,
            forbidden: o
                .forbidden
                .into_iter()
                .map(|f| NotYours {
                    id: f.id,
                    user: f.user,
                })
                .collect(),
        }
    }
}

/// `GET /v1/nodes`: every node, by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeList {
    pub nodes: Vec<NodeInfo>,
}

/// A node in `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub name: String,
    pub gpus: u32,
    pub gpu_model: String,
    pub rack: String,
    pub allocated_gpus: usize,
    pub jobs: Vec<u64>,
    pub gpu_sharing: bool,
    pub nvlink_islands: Vec<Vec<u32>>,
    pub last_sync_secs_ago: Option<f64>,
    /// up, drained, no_telemetry or down.
    pub state: String,
    pub last_sample_secs_ago: Option<f64>,
    pub gpu_status: Vec<NodeGpu>,
}

/// A GPU in `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeGpu {
    pub index: u32,
    pub jobs: Vec<GpuJob>,
    /// healthy, xid, uncorrectable_ecc, rogue_process or taken_out.
    pub health: String,
    pub xid: Option<u32>,
    pub uuid: Option<String>,
    pub simulated: Option<bool>,
    pub utilization_gpu_pct: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    pub temperature_celsius: Option<f64>,
    /// When the latest sample was taken (node clock, Unix ms): the `time` of its row in
    /// `gpu_samples`.
    pub sample_ms: Option<i64>,
    pub sample_secs_ago: Option<f64>,
    /// Its MIG instances, when it is in MIG mode (the agent's report), each with its job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_instances: Vec<GpuMig>,
}

/// A MIG instance of a GPU in `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuMig {
    pub profile: String,
    pub uuid: String,
    pub memory_mb: Option<u64>,
    /// The job holding it, and its user.
    pub job: Option<u64>,
    pub user: Option<String>,
}

/// A job on a GPU in `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuJob {
    pub job: u64,
    pub user: String,
    pub account: String,
    pub share_percent: Option<u32>,
}

/// The answer to `POST /v1/nodes/{name}/drain` and `.../resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStateChange {
    pub node: String,
    /// `drained` or `up`.
    pub state: NodeState,
}

/// An error answer's body: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong, and what to change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// `None` for a code this build does not know (a newer server's), or none.
    #[serde(default, with = "error_code")]
    pub code: Option<ErrorCode>,
    pub message: String,
}

/// An [`ErrorCode`] by its wire name.
mod error_code {
    use super::*;

    pub fn serialize<S: Serializer>(code: &Option<ErrorCode>, s: S) -> Result<S::Ok, S::Error> {
        match code {
            Some(c) => s.serialize_str(c.as_str()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ErrorCode>, D::Error> {
        let name = Option::<String>::deserialize(d)?;
        Ok(name.and_then(|n| ErrorCode::ALL.iter().copied().find(|c| c.as_str() == n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{ArrayTask, JobState, NodeGpus, TimelineEntry};
    use crate::spec::JobRequest;

    fn record() -> JobRecord {
        let request: JobRequest =
            serde_json::from_str(r#"{"command": ["python", "train.py"], "env": {"A": "1"}}"#)
                .expect("request");
        JobRecord {
            id: 7,
            request,
            state: JobState::Pending,
            reason: Some("Priority".into()),
            submit_ms: 1_000,
            start_ms: None,
            end_ms: None,
            placement: vec![NodeGpus {
                node: "n1".into(),
                gpus: vec![0, 1],
                delivered: true,
                exit_code: Some(0),
            }],
            attempts: 1,
            requeues: 1,
            preemptions: 0,
            exit_code: None,
            timeline: vec![TimelineEntry {
                time_ms: 1_000,
                event: "submitted".into(),
            }],
            allocations: Vec::new(),
            master_port: None,
            stopping: Vec::new(),
            output_deleted_ms: None,
            array: Some(ArrayTask {
                job_id: 5,
                task_id: 2,
            }),
        }
    }

    fn round_trip<T: Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
        value: &T,
    ) {
        let text = serde_json::to_string(value).expect("serialise");
        let back: T = serde_json::from_str(&text).expect(&text);
        assert_eq!(&back, value, "{text}");
    }

    /// What the server adds comes back as it went, absent, `null` or set: a pending job's
    /// estimate without a time, accounting that could not be read.
    #[test]
    fn job_views_read_back_as_written() {
        let bare = JobView::of(Cow::Owned(record()));
        round_trip(&bare);
        let text = serde_json::to_string(&bare).expect("serialise");
        for absent in ["private", "gpus_now", "estimated_start", "usage"] {
            assert!(!text.contains(absent), "{absent} in {text}");
        }
        let shown = JobView {
            private: true,
            gpus_now: Some(vec![GpuNow {
                node: "n1".into(),
                gpu: 0,
                utilization_gpu_pct: Some(50.0),
                memory_used_bytes: None,
                power_watts: None,
                simulated: Some(true),
            }]),
            estimate: Some(StartEstimate {
                estimated_start_ms: None,
                estimated_start: None,
            }),
            usage: Some(None),
            ..bare.clone()
        };
        round_trip(&shown);
        let text = serde_json::to_string(&shown).expect("serialise");
        assert!(text.contains(r#""usage":null"#), "{text}");
        assert!(text.contains(r#""estimated_start":null"#), "{text}");
        round_trip(&JobView {
            usage: Some(Some(JobUsage {
                gpu_seconds_allocated: Some(60.0),
                note: Some("lagging".into()),
                ..JobUsage::default()
            })),
            ..bare
        });
    }

    #[test]
    fn pages_and_answers_read_back_as_written() {
        let job = JobView::of(Cow::Owned(record()));
        round_trip(&JobsPage {
            jobs: vec![job.clone()],
            next_before: Some(7),
        });
        round_trip(&QueueView {
            queue: vec![
                QueueEntry {
                    position: Some(1),
                    priority: Some(0.5),
                    job: job.clone(),
                    estimate: None,
                },
                QueueEntry {
                    position: None,
                    priority: None,
                    job,
                    estimate: Some(StartEstimate {
                        estimated_start_ms: Some(5),
                        estimated_start: Some("1970-01-01T00:00:00.005Z".into()),
                    }),
                },
            ],
            total: 2,
        });
        round_trip(&Submitted {
            job: record(),
            warning: Some("no node fits".into()),
            array_jobs: vec![7, 8],
        });
        round_trip(&NodeStateChange {
            node: "n1".into(),
            state: NodeState::Drained,
        });
    }

    /// A code this build knows reads as itself; one it does not (a newer server's) leaves
    /// the message readable.
    #[test]
    fn error_bodies_read_with_their_code() {
        let known: ErrorBody = serde_json::from_str(
            r#"{"error": {"code": "too_many_pending", "message": "at the cap"}}"#,
        )
        .expect("known");
        assert_eq!(known.error.code, Some(ErrorCode::TooManyPending));
        round_trip(&known);
        let unknown: ErrorBody =
            serde_json::from_str(r#"{"error": {"code": "from_the_future", "message": "m"}}"#)
                .expect("unknown");
        assert_eq!(unknown.error.code, None);
        assert_eq!(unknown.error.message, "m");
    }
}
