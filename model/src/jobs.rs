//! Per-job telemetry: each job's CPU, memory and process count on the node, and every process
//! on a GPU with the job it belongs to. A process on a GPU that is not allocated to its job
//! (or that belongs to no job on the node) is marked `rogue`.

use crate::GpuIndex;
use crate::telemetry::{BatchError, check_label, check_pct, check_time};
use serde::{Deserialize, Serialize};

/// One process on one GPU at one instant.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuProcessSample {
    pub time_ms: i64,
    pub gpu: GpuIndex,
    pub uuid: String,
    pub simulated: bool,
    pub pid: u32,
    #[serde(default)]
    pub used_memory_bytes: Option<u64>,
    /// Share of the last period this process ran kernels (NVML process utilization), 0..=100.
    #[serde(default)]
    pub sm_utilization_pct: Option<f64>,
    #[serde(default)]
    pub memory_utilization_pct: Option<f64>,
    /// The job this process belongs to, when it is one of a registered job's processes.
    #[serde(default)]
    pub job: Option<String>,
    /// True when the GPU is not allocated to the process's job, or the process is in no job
    /// while jobs are registered on the node.
    #[serde(default)]
    pub rogue: bool,
}

/// One job's resource use on the node at one instant.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSample {
    pub time_ms: i64,
    pub job: String,
    #[serde(default)]
    pub user: Option<String>,
    pub simulated: bool,
    /// Where the numbers come from: `cgroup_v2`, `cgroup_v1` or `proc` (the process tree).
    pub source: String,
    /// GPUs allocated to the job on this node.
    #[serde(default)]
    pub gpus: Vec<GpuIndex>,
    /// CPU time of the job, user plus system (counter).
    #[serde(default)]
    pub cpu_seconds: Option<f64>,
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    #[serde(default)]
    pub memory_peak_bytes: Option<u64>,
    #[serde(default)]
    pub processes: Option<u32>,
    /// GPU memory held by the job's processes over all GPUs, as NVML reports it.
    #[serde(default)]
    pub gpu_memory_bytes: Option<u64>,
}

pub(crate) fn validate(
    procs: &[GpuProcessSample],
    jobs: &[JobSample],
    now_ms: i64,
) -> Result<(), BatchError> {
    for (i, p) in procs.iter().enumerate() {
        let f = |name: &str| format!("gpu_processes[{i}].{name}");
        check_time(|| f("time_ms"), p.time_ms, now_ms)?;
        check_label(|| f("uuid"), &p.uuid)?;
        check_pct(|| f("sm_utilization_pct"), p.sm_utilization_pct)?;
        check_pct(|| f("memory_utilization_pct"), p.memory_utilization_pct)?;
        if let Some(j) = &p.job {
            check_label(|| f("job"), j)?;
        }
    }
    for (i, j) in jobs.iter().enumerate() {
        let f = |name: &str| format!("jobs[{i}].{name}");
        check_time(|| f("time_ms"), j.time_ms, now_ms)?;
        check_label(|| f("job"), &j.job)?;
        check_label(|| f("source"), &j.source)?;
        if let Some(u) = &j.user {
            check_label(|| f("user"), u)?;
        }
        for c in crate::catalogue::JOB {
            c.validate(j, f)?;
        }
    }
    Ok(())
}
