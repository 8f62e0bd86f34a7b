//! The agent's control channel: every interval an agent posts a [`SyncRequest`] to
//! `POST /v1/agent/sync` saying what its node has and what runs there, and the server answers
//! with the jobs to start and stop. Reconciliation is built in: the server compares what the
//! agent reports with what it believes, so a job never runs twice and none is orphaned after
//! either side restarts.
//!
//! Every order, report and exit names the job's **attempt** (the server counts a job's starts
//! from 1), so an exit is charged to the attempt that ran and a late report of an old attempt
//! can never end a new one. Each answer renews the node's **lease** ([`SyncResponse::lease_ms`]):
//! the server requeues a node's jobs only once the lease has run out without a sync, and the
//! node stops its jobs before it runs out, so at most one attempt of a job runs at a time.

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
    /// The address other nodes reach this one at (`agent.advertise_addr`, else the local
    /// address of the route to the server): a multi-node job's `MASTER_ADDR` when this node
    /// holds its rank 0.
    #[serde(default)]
    pub advertise_addr: Option<String>,
    /// Groups of GPU indices fully connected by NVLink (an NVSwitch system is one group);
    /// `None` when unknown, which the scheduler treats as one group of all GPUs.
    #[serde(default)]
    pub nvlink_islands: Option<Vec<Vec<u32>>>,
    /// Whether this node takes jobs asking for a part of a GPU (`agent.gpu_sharing`).
    #[serde(default)]
    pub gpu_sharing: bool,
    /// The MIG instances of this node's GPUs in MIG mode, as NVML lists them when the agent
    /// starts (operators partition GPUs with `nvidia-smi mig`; perch creates none). A GPU with
    /// any is placed only as its instances, never whole.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_instances: Vec<MigInstance>,
    /// Which agent speaks for the node: an id its agent keeps in its data directory, the same
    /// across its restarts. While one agent syncs for a node, the server refuses another that
    /// claims the same name (a second agent started by mistake, a machine cloned with the same
    /// hostname), which would otherwise report the node's jobs gone and have them killed.
    /// `None` (agents before it): not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// Jobs whose processes are running now, with the attempt each is.
    #[serde(default)]
    pub running: Vec<JobAttempt>,
    /// Jobs whose processes ended since the last sync that the server has not acknowledged.
    #[serde(default)]
    pub exited: Vec<JobExit>,
    /// New output of running or exited jobs.
    #[serde(default)]
    pub logs: Vec<LogChunk>,
    /// One-line facts about how jobs were started here (limits not enforced, the user they
    /// run as), for the jobs' timelines. Sent once each.
    #[serde(default)]
    pub notes: Vec<JobNote>,
    /// Results of the commands the server asked for ([`SyncResponse::commands`]).
    #[serde(default)]
    pub command_results: Vec<CommandResult>,
    /// The rendezvous port this node picked for each running job whose rank 0 it holds
    /// ([`JobLaunch::pick_master_port`]); sent with every sync while the job runs.
    #[serde(default)]
    pub master_ports: Vec<MasterPort>,
    /// What each attempt started since the last delivered sync ran with (its environment, the
    /// node's driver and CUDA versions), for the job's provenance. Sent once each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub started: Vec<crate::provenance::JobStartReport>,
}

/// A rendezvous port picked on a job's rank-0 node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MasterPort {
    pub job: u64,
    pub attempt: u32,
    pub port: u16,
}

/// One node of a job, for its hostfile (MPI's format: `addr slots=N`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchHost {
    /// The address its peers reach it at.
    pub addr: String,
    /// Its GPUs in the job: one process each.
    pub slots: u32,
}

/// A command the server asks an agent to run on its node: a remediation step such as a GPU
/// reset script, or the health check before a drained node is resumed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeCommand {
    /// Chosen by the server; the result carries it back.
    pub id: u64,
    /// Program and arguments, run without a shell.
    pub argv: Vec<String>,
    /// The agent kills the command (its process group) after this long.
    pub timeout_ms: u64,
}

/// How a [`NodeCommand`] ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandResult {
    pub id: u64,
    /// The exit code; absent when it was killed by a signal, timed out or did not start.
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    /// The last few KiB of its stdout and stderr, for the audit trail.
    #[serde(default)]
    pub output: String,
    /// Why it could not be run (no such program...).
    #[serde(default)]
    pub error: Option<String>,
}

/// A fact about one job on this node, for its record's timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobNote {
    pub job: u64,
    pub text: String,
}

/// One attempt of one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobAttempt {
    pub job: u64,
    pub attempt: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobExit {
    pub job: u64,
    /// The attempt that exited.
    pub attempt: u32,
    /// Exit code; a job killed by a signal reports 128 + the signal number, like a shell.
    pub code: i32,
    /// Set when perch stopped it (cancel, preemption, time limit) rather than it exiting.
    #[serde(default)]
    pub stopped: bool,
    /// Set when its supervisor stopped it because the node's lease was not renewed: it did not
    /// end, it lost its node (the server requeues it, or ends it as node_fail).
    #[serde(default)]
    pub fenced: bool,
    /// Why it never started, when the agent could not start it (its user does not exist on
    /// the node, its program cannot be run); the server makes this the job's reason.
    #[serde(default)]
    pub error: Option<String>,
    /// Why the agent stopped it on its own, when it did (its output passed the node's limit,
    /// `agent.max_job_output_mb`); the server makes this the job's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Its stdout's and stderr's final lengths on the node, bytes. The agent ships the output
    /// it has not sent yet after the exit; the server's copy is complete once it holds this
    /// much, and `perch logs` says so until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_bytes: Option<[u64; 2]>,
}

impl JobExit {
    /// The attempt that exited.
    pub fn id(&self) -> JobAttempt {
        JobAttempt {
            job: self.job,
            attempt: self.attempt,
        }
    }
}

impl JobLaunch {
    /// The attempt to start.
    pub fn id(&self) -> JobAttempt {
        JobAttempt {
            job: self.job,
            attempt: self.attempt,
        }
    }
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
    /// The attempt whose output this is (0 from an agent that does not say: the current one).
    #[serde(default)]
    pub attempt: u32,
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
    pub acknowledged: Vec<JobAttempt>,
    /// The node's lease, renewed by this answer: the server counts the node's jobs as running
    /// for this long after it received the request, and requeues them only after that without
    /// a sync. The node must have stopped them by then (see the module documentation).
    #[serde(default)]
    pub lease_ms: u64,
    /// Where each stream of each job should continue from (the server's copy's length), so a
    /// restarted agent or server resumes log shipping without gaps or repeats.
    #[serde(default)]
    pub log_offsets: Vec<(u64, LogStream, u64)>,
    /// Commands to run on the node; results come back in the next syncs.
    #[serde(default)]
    pub commands: Vec<NodeCommand>,
    /// Where the node sends its telemetry (`POST <ingest_url>/v1/ingest`) when the deployment
    /// spreads ingest over several servers (docs/scale.md); absent: to this server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingest_url: Option<String>,
    /// The server's pace: sync again in no less than this (ms), unless a job exited or a gang
    /// needs its rendezvous port. Larger fleets are paced slower, so the syncs of the whole
    /// fleet stay within what the server takes (`server.max_syncs_per_second`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_sync_ms: Option<u64>,
}

/// Start this job's processes on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobLaunch {
    pub job: u64,
    /// Which start of the job this is (1 for the first).
    pub attempt: u32,
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
    /// Set for a job that gets a part of its one GPU rather than the whole of it.
    #[serde(default)]
    pub gpu_share: Option<LaunchShare>,
    /// Set for a job placed on a MIG instance: it sees that instance only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_mig: Option<LaunchMig>,
    /// CPUs the job asked for: its cgroup's `cpu.max`, where the agent can set one.
    #[serde(default)]
    pub cpus: Option<u32>,
    /// Host memory the job asked for, MiB: its cgroup's `memory.max`.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Rank 0 of a job that did not choose its own `MASTER_PORT`: the agent picks a TCP port
    /// free on this node, sets `MASTER_PORT` and `PET_MASTER_PORT` to it and reports it
    /// ([`SyncRequest::master_ports`]); the server launches the other ranks once it has it.
    #[serde(default)]
    pub pick_master_port: bool,
    /// Every node of the job in rank order: the agent writes them to a hostfile in the job's
    /// directory and sets `PERCH_HOSTFILE` to its path.
    #[serde(default)]
    pub hosts: Vec<LaunchHost>,
}

/// A MIG instance of one GPU, as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigInstance {
    /// The NVML index of the GPU it is part of.
    pub gpu: u32,
    /// Its profile, `<compute slices>g.<memory>gb` (`3g.40gb`).
    pub profile: String,
    /// Its UUID (`MIG-...`): what `CUDA_VISIBLE_DEVICES` names to select it.
    pub uuid: String,
    /// Its memory, MiB, when NVML tells.
    #[serde(default)]
    pub memory_mb: Option<u64>,
}

/// Parses a MIG profile name `<n>g.<m>gb` (`3g.40gb`) into its compute slices (1 to 7) and
/// memory in GB; `None` for anything else.
pub fn mig_profile_slices(profile: &str) -> Option<(u32, u32)> {
    let (g, rest) = profile.split_once("g.")?;
    let m = rest.strip_suffix("gb")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(g) || !digits(m) {
        return None;
    }
    let slices: u32 = g.parse().ok()?;
    let gb: u32 = m.parse().ok()?;
    ((1..=7).contains(&slices) && gb > 0).then_some((slices, gb))
}

/// The MIG instance a job runs on: the agent sets `CUDA_VISIBLE_DEVICES` to `uuid` and
/// `PERCH_GPU_PROFILE` to `profile`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchMig {
    pub uuid: String,
    pub profile: String,
}

/// The part of a GPU a shared job gets: the agent sets `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
/// to `percent` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` to `memory_mb`, which MPS enforces
/// when it runs on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchShare {
    /// Percent of the GPU's compute, 1 to 99.
    pub percent: u32,
    /// GPU memory, MiB.
    pub memory_mb: u64,
}

/// Stop this job: the checkpoint signal, `grace_secs`, then SIGKILL to its process group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobStop {
    pub job: u64,
    /// The attempt to stop; a later attempt of the same job is left alone.
    pub attempt: u32,
    pub signal: String,
    pub grace_secs: u64,
}
/// Whether `a` can be a node's advertised address ([`SyncRequest::advertise_addr`]): an IP
/// address or a host name (letters, digits, '.', '-'), at most 253 characters.
pub fn is_host_address(a: &str) -> bool {
    a.parse::<std::net::IpAddr>().is_ok()
        || (!a.is_empty()
            && a.len() <= 253
            && a.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-'))
}

#[cfg(test)]
mod address_tests {
    use super::is_host_address;

    #[test]
    fn an_advertised_address_is_an_ip_or_a_host_name() {
        for ok in ["10.0.0.7", "::1", "gpu-a.cluster.local", "node7"] {
            assert!(is_host_address(ok), "{ok}");
        }
        for bad in ["", "a b", "evil;rm -rf", "host:80", &"x".repeat(254)] {
            assert!(!is_host_address(bad), "{bad}");
        }
    }
}
