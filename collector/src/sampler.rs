//! One sampling round: the host, every NIC and every GPU (real through NVML, then simulated) at
//! one `now_ms`. The sampler owns the sources and their state (the NVML handle, the simulators'
//! integrators); it reads no clock, so tests drive it with any times they like.

use crate::gpu::NvmlMode;
use crate::gpu::nvml::NvmlGpus;
use crate::gpu::sim::SimGpus;
use crate::host::HostReader;
use crate::infiniband::IbReader;
use crate::jobs::{JobRegistry, JobSampler};
use crate::nic::NicReader;
use crate::sim_node::{SimHost, SimNics};
use perch_model::{
    GpuEvent, GpuProcessSample, GpuSample, HostSample, IbPortSample, JobSample, NicSample, NodeId,
};
use std::path::PathBuf;

/// The samples of one round.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Round {
    pub hosts: Vec<HostSample>,
    pub gpus: Vec<GpuSample>,
    pub nics: Vec<NicSample>,
    pub gpu_events: Vec<GpuEvent>,
    pub gpu_processes: Vec<GpuProcessSample>,
    pub ib_ports: Vec<IbPortSample>,
    pub jobs: Vec<JobSample>,
}

impl Round {
    pub fn sample_count(&self) -> usize {
        self.hosts.len()
            + self.gpus.len()
            + self.nics.len()
            + self.gpu_events.len()
            + self.gpu_processes.len()
            + self.ib_ports.len()
            + self.jobs.len()
    }
}

/// What to sample and where from.
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub node: NodeId,
    /// Root of the `/proc` and `/sys` trees (`/` in production).
    pub root: PathBuf,
    pub data_dir: PathBuf,
    pub nvml: NvmlMode,
    /// How often NVML's costly fields are read (see [`NvmlGpus::set_slow_interval`]).
    pub nvml_slow_interval: std::time::Duration,
    pub simulate_gpus: u32,
    pub simulate_host: bool,
    pub seed: u64,
    /// The jobs on this node (shared with whoever launches them).
    pub jobs: JobRegistry,
}

enum HostSource {
    Real(HostReader, NicReader, IbReader),
    Simulated(SimHost, SimNics),
}

/// Every source of one node.
pub struct Sampler {
    host: HostSource,
    nvml: Option<NvmlGpus>,
    sim: SimGpus,
    jobs: JobRegistry,
    job_sampler: JobSampler,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("nvml", &self.nvml)
            .field("sim", &self.sim)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// Opens every source. NVML trouble is logged once here and the sampler carries on without
    /// real GPUs; it never fails the agent.
    pub fn new(config: &SamplerConfig) -> Self {
        let nvml = match NvmlGpus::open(&config.nvml) {
            Ok(Some(mut gpus)) => {
                gpus.set_slow_interval(config.nvml_slow_interval);
                let models: Vec<&str> = gpus.devices().iter().map(|d| d.model.as_str()).collect();
                if models.is_empty() {
                    tracing::info!(
                        "NVML loaded but reports no GPUs; no NVIDIA GPUs will be sampled"
                    );
                } else {
                    tracing::info!(count = models.len(), models = ?models, driver = ?gpus.driver_version(), "sampling NVIDIA GPUs through NVML");
                }
                Some(gpus)
            }
            Ok(None) => {
                tracing::info!("NVML disabled; no NVIDIA GPUs will be sampled");
                None
            }
            Err(e) => {
                match &config.nvml {
                    NvmlMode::Path(path) => {
                        tracing::warn!(path = %path.display(), error = %e, "cannot load NVML from the configured path; no NVIDIA GPUs will be sampled")
                    }
                    _ => {
                        tracing::info!(error = %e, "NVML not available (no NVIDIA driver?); no NVIDIA GPUs will be sampled")
                    }
                }
                None
            }
        };
        let real_gpus = nvml.as_ref().map_or(0, |n| n.devices().len() as u32);
        let host = if config.simulate_host {
            HostSource::Simulated(
                SimHost::new(&config.node, config.seed),
                SimNics::new(&config.node, config.seed),
            )
        } else {
            HostSource::Real(
                HostReader::new(&config.root, &config.data_dir),
                NicReader::new(&config.root),
                IbReader::new(&config.root),
            )
        };
        let sim = SimGpus::new(&config.node, config.simulate_gpus, real_gpus, config.seed);
        if !sim.is_empty() {
            tracing::info!(
                count = sim.len(),
                first_index = real_gpus,
                "adding simulated GPUs, labelled simulated"
            );
        }
        Self {
            host,
            nvml,
            sim,
            jobs: config.jobs.clone(),
            job_sampler: JobSampler::new(&config.root),
        }
    }

    /// The simulated GPUs, e.g. to pin a job's synthetic profile on them.
    pub fn simulated_gpus_mut(&mut self) -> &mut SimGpus {
        &mut self.sim
    }

    /// Takes one round at `now_ms`.
    /// GPUs jobs can be placed on here: how many, and the model of the first (real GPUs come
    /// first; simulated ones carry "Simulated" in their model name).
    pub fn gpu_inventory(&self) -> (u32, String) {
        let real = self.nvml.as_ref().map_or(&[][..], |n| n.devices());
        let count = real.len() as u32 + self.sim.len() as u32;
        let model = match real.iter().find(|d| !d.model.is_empty()) {
            Some(d) => d.model.clone(),
            None if !real.is_empty() => "NVIDIA GPU (model unknown)".to_owned(),
            None => crate::gpu::sim::SIM_MODEL.to_owned(),
        };
        (count, model)
    }

    /// The MIG instances of this node's real GPUs in MIG mode (simulated GPUs have none).
    pub fn mig_instances(&self) -> Vec<perch_model::control::MigInstance> {
        self.nvml
            .as_ref()
            .map_or_else(Vec::new, |n| n.mig_instances())
    }

    /// The driver and CUDA versions NVML reports, for jobs' provenance; a node of simulated
    /// GPUs only says so.
    pub fn node_versions(&self) -> crate::launcher::NodeVersions {
        match &self.nvml {
            Some(n) => crate::launcher::NodeVersions {
                driver_version: n.driver_version(),
                cuda_version: n.cuda_version(),
                simulated: false,
            },
            None => crate::launcher::NodeVersions {
                driver_version: None,
                cuda_version: None,
                simulated: !self.sim.indices().is_empty(),
            },
        }
    }

    /// NVLink islands of this node's GPUs: NVML's answer for real GPUs (`None` when it cannot
    /// tell); simulated GPUs imitate NVSwitch H100 systems, so they form one island of their
    /// own.
    pub fn nvlink_islands(&self) -> Option<Vec<Vec<u32>>> {
        let mut islands = match &self.nvml {
            Some(n) if !n.devices().is_empty() => n.nvlink_islands()?,
            _ => Vec::new(),
        };
        let sim = self.sim.indices();
        if !sim.is_empty() {
            islands.push(sim);
        }
        (!islands.is_empty()).then_some(islands)
    }

    pub fn sample(&mut self, now_ms: i64) -> Round {
        let nvml = self
            .nvml
            .as_mut()
            .map(|n| n.sample(now_ms))
            .unwrap_or_default();
        let mut gpus = nvml.gpus;
        // Simulated GPUs follow the jobs placed on them (training unless the job says
        // otherwise); a GPU no job holds is idle: no kernels, no memory, idle power, as a real
        // free GPU is. Idle lessons, accounting and alert rules then read the truth about it.
        let jobs = self.jobs.list();
        for index in self.sim.indices() {
            let job = jobs.iter().find(|j| j.gpus.contains(&index));
            let profile = job.map_or(crate::gpu::sim::Workload::Idle, |j| {
                j.sim_profile.unwrap_or(crate::gpu::sim::Workload::Training)
            });
            self.sim.set_profile(index, Some(profile));
            self.sim.set_job(index, job.map(|j| j.job.as_str()));
        }
        gpus.extend(self.sim.sample(now_ms));
        let (hosts, nics, ib_ports) = match &mut self.host {
            HostSource::Real(host, nics, ib) => (
                vec![host.sample(now_ms)],
                nics.sample(now_ms),
                ib.sample(now_ms),
            ),
            HostSource::Simulated(host, nics) => {
                let utils: Vec<f64> = gpus.iter().filter_map(|g| g.utilization_gpu_pct).collect();
                let mean = if utils.is_empty() {
                    0.0
                } else {
                    utils.iter().sum::<f64>() / utils.len() as f64
                };
                (
                    vec![host.sample(now_ms, mean)],
                    nics.sample(now_ms, mean),
                    vec![],
                )
            }
        };
        let mut gpu_processes = nvml.processes;
        let simulated = matches!(self.host, HostSource::Simulated(..));
        let jobs =
            self.job_sampler
                .sample(&self.jobs.list(), &mut gpu_processes, simulated, now_ms);
        Round {
            hosts,
            gpus,
            nics,
            gpu_events: nvml.events,
            gpu_processes,
            ib_ports,
            jobs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn config(simulate_host: bool) -> SamplerConfig {
        SamplerConfig {
            node: NodeId::new("t1").expect("valid"),
            root: Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1"),
            data_dir: std::env::temp_dir(),
            nvml: NvmlMode::Off,
            nvml_slow_interval: std::time::Duration::ZERO,
            simulate_gpus: 3,
            simulate_host,
            seed: 4,
            jobs: JobRegistry::default(),
        }
    }

    #[test]
    fn real_host_with_simulated_gpus() {
        let round = Sampler::new(&config(false)).sample(1_800_000_000_000);
        assert_eq!(
            (round.hosts.len(), round.gpus.len(), round.nics.len()),
            (1, 3, 3)
        );
        assert_eq!(
            round.ib_ports.len(),
            2,
            "the fixture has two InfiniBand ports"
        );
        assert!(!round.hosts[0].simulated && round.nics.iter().all(|n| !n.simulated));
        assert!(round.gpus.iter().all(|g| g.simulated));
        assert_eq!(round.sample_count(), 9);
    }

    /// Simulated GPUs no job holds are idle all the time (near-0 utilization, little memory,
    /// idle power), whatever the phase model would say; a job's GPUs show its load.
    #[test]
    fn simulated_gpus_are_idle_unless_a_job_holds_them() {
        let config = config(true);
        let mut sampler = Sampler::new(&config);
        let t0 = 1_800_000_000_000;
        let idle = |g: &GpuSample| {
            g.utilization_gpu_pct.is_some_and(|u| u < 1.0)
                && g.memory_used_bytes.is_some_and(|m| m < 1 << 30)
                && g.power_watts.is_some_and(|w| w < 100.0)
        };
        // An hour at 10 s, with no job: the phase model would have passed every GPU through
        // training and allocated-idle phases.
        for step in 0..360 {
            let round = sampler.sample(t0 + step * 10_000);
            for g in &round.gpus {
                assert!(idle(g), "a GPU no job holds is busy at step {step}: {g:?}");
            }
        }
        config.jobs.register(crate::jobs::JobSpec {
            job: "7".into(),
            user: None,
            gpus: vec![1],
            target: crate::jobs::JobTarget::Cgroup("/perch/job-7".into()),
            sim_profile: None,
        });
        for step in 360..420 {
            let round = sampler.sample(t0 + step * 10_000);
            for g in &round.gpus {
                if g.gpu.0 == 1 {
                    assert!(
                        g.utilization_gpu_pct.is_some_and(|u| u >= 90.0)
                            && g.memory_used_bytes.is_some_and(|m| m > 10 << 30),
                        "the job's GPU trains: {g:?}"
                    );
                } else {
                    assert!(idle(g), "GPU {} is held by no job: {g:?}", g.gpu.0);
                }
            }
        }
        assert!(config.jobs.unregister("7"));
        let round = sampler.sample(t0 + 420 * 10_000);
        assert!(round.gpus.iter().all(idle), "idle again once the job ended");
    }

    #[test]
    fn fully_simulated_node() {
        let round = Sampler::new(&config(true)).sample(1_800_000_000_000);
        assert!(round.hosts.iter().all(|h| h.simulated));
        assert!(round.nics.iter().all(|n| n.simulated) && !round.nics.is_empty());
    }
}
