//! The jobs running on this node and what they use. A job launcher (the agent's
//! [`crate::launcher`]) registers each job in the shared [`JobRegistry`] with its GPUs and
//! either its root PID or its cgroup; every round the [`JobSampler`] reads each job's CPU,
//! memory and process count ([`usage`]) and attributes the processes NVML sees on each GPU to
//! jobs.
//!
//! Attribution: a GPU process belongs to the job whose PIDs include it. It is **rogue** when its
//! job was not allocated that GPU, or when it belongs to no job while the GPU is allocated to
//! one. A process in no job on a GPU no job holds is simply unmanaged (not rogue), and so is
//! one whose PID is not in this agent's `/proc` (an agent in a PID namespace of its own sees
//! none of NVML's PIDs; it says so in its log once).

pub mod usage;

use perch_model::{GpuIndex, GpuProcessSample, JobSample};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// How to find a job's processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobTarget {
    /// The job's root process; its descendants in `/proc` are the job.
    Pid(u32),
    /// The job's cgroup as `/proc/<pid>/cgroup` names it, e.g. `/perch/job-7`.
    Cgroup(PathBuf),
}

/// One job on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    pub job: String,
    pub user: Option<String>,
    /// GPU indices allocated to the job on this node.
    pub gpus: Vec<u32>,
    pub target: JobTarget,
    /// On simulated GPUs: the synthetic load the job declares (default: training).
    pub sim_profile: Option<crate::gpu::sim::Workload>,
}

/// The jobs on this node, shared between whoever launches jobs and the sampler.
#[derive(Debug, Clone, Default)]
pub struct JobRegistry {
    jobs: Arc<Mutex<BTreeMap<String, JobSpec>>>,
}

impl JobRegistry {
    /// Adds a job, replacing any earlier one with the same id.
    pub fn register(&self, spec: JobSpec) {
        self.lock().insert(spec.job.clone(), spec);
    }

    /// Removes a job; false when it was not registered.
    pub fn unregister(&self, job: &str) -> bool {
        self.lock().remove(job).is_some()
    }

    /// The registered jobs, in id order.
    pub fn list(&self) -> Vec<JobSpec> {
        self.lock().values().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, JobSpec>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Reads jobs' usage every round and keeps the peak memory seen for jobs whose source has no
/// peak of its own (process trees).
#[derive(Debug)]
pub struct JobSampler {
    root: PathBuf,
    tick_hz: f64,
    page_size: u64,
    peaks: HashMap<String, u64>,
    /// The `/proc` scan this sampler used last ([`usage::shared_processes`]).
    last_scan: u64,
    /// Whether a GPU process missing from `/proc` was logged.
    warned_invisible: bool,
}

impl JobSampler {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            tick_hz: rustix::param::clock_ticks_per_second() as f64,
            page_size: rustix::param::page_size() as u64,
            peaks: HashMap::new(),
            last_scan: 0,
            warned_invisible: false,
        }
    }

    /// One sample per job still found at `now_ms`, and `procs` attributed to jobs.
    pub fn sample(
        &mut self,
        jobs: &[JobSpec],
        procs: &mut [GpuProcessSample],
        simulated: bool,
        now_ms: i64,
    ) -> Vec<JobSample> {
        self.peaks.retain(|j, _| jobs.iter().any(|s| &s.job == j));
        if jobs.is_empty() {
            return Vec::new();
        }
        let tree = if jobs.iter().any(|j| matches!(j.target, JobTarget::Pid(_))) {
            usage::shared_processes(&self.root, &mut self.last_scan)
        } else {
            Default::default()
        };
        let mut out = Vec::new();
        let mut owner: HashMap<u32, usize> = HashMap::new();
        for (i, spec) in jobs.iter().enumerate() {
            let found = match &spec.target {
                JobTarget::Pid(pid) => usage::tree_usage(&tree, *pid, self.tick_hz, self.page_size),
                JobTarget::Cgroup(path) => usage::cgroup_usage(&self.root, path),
            };
            let Some(u) = found else {
                continue;
            };
            for pid in &u.pids {
                owner.insert(*pid, i);
            }
            let peak = self.peaks.entry(spec.job.clone()).or_default();
            *peak = (*peak).max(u.memory_bytes.unwrap_or(0));
            let peak = u.memory_peak_bytes.or(u.memory_bytes.map(|_| *peak));
            out.push(JobSample {
                time_ms: now_ms,
                job: spec.job.clone(),
                user: spec.user.clone(),
                simulated,
                source: u.source.to_string(),
                gpus: spec.gpus.iter().map(|g| GpuIndex(*g)).collect(),
                cpu_seconds: u.cpu_seconds,
                memory_bytes: u.memory_bytes,
                memory_peak_bytes: peak,
                processes: u.processes,
                gpu_memory_bytes: None,
            });
        }
        let mut gpu_memory: HashMap<String, u64> = HashMap::new();
        for p in procs.iter_mut() {
            let job = owner.get(&p.pid).map(|i| &jobs[*i]);
            p.job = job.map(|j| j.job.clone());
            p.rogue = match job {
                Some(j) => !j.gpus.contains(&p.gpu.0),
                None if jobs.iter().any(|j| j.gpus.contains(&p.gpu.0)) => {
                    // A PID this agent cannot see is unknown, not rogue: an agent in a PID
                    // namespace of its own (a container without the host's) sees none of
                    // the PIDs NVML reports, and would call every job's process rogue.
                    let visible = self.root.join("proc").join(p.pid.to_string()).exists();
                    if !visible && !self.warned_invisible {
                        self.warned_invisible = true;
                        tracing::warn!(
                            pid = p.pid,
                            gpu = p.gpu.0,
                            "a GPU process NVML reports is not in this agent's /proc: if the agent runs in a container, give it the host's PID namespace (docker --pid=host, Kubernetes hostPID), or GPU processes cannot be attributed to jobs; such a process is never called rogue"
                        );
                    }
                    visible
                }
                None => false,
            };
            if let (Some(j), Some(m)) = (job, p.used_memory_bytes) {
                *gpu_memory.entry(j.job.clone()).or_default() += m;
            }
            if p.rogue {
                tracing::debug!(pid = p.pid, gpu = p.gpu.0, job = ?p.job, "rogue process on a GPU not allocated to its job");
            }
        }
        for s in &mut out {
            s.gpu_memory_bytes = gpu_memory.get(&s.job).copied();
        }
        out
    }
}

#[cfg(test)]
mod tests;
