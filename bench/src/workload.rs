//! The synthetic cluster `perch bench query` measures: who ran which job on which GPUs, and
//! what each GPU measured every sampling interval.
//!
//! It is generated, deterministically from a seed, so that the benchmark's answers mean
//! something: jobs arrive from a handful of accounts, ask for 1 to 8 GPUs or whole-node gangs,
//! run for minutes to days, and are placed on the earliest free GPUs. A GPU a job holds follows
//! that job's profile (steady, bursty, idle, only its first GPU busy, or stalled halfway);
//! a GPU no job holds is idle. So "GPU-hours per account", "idle GPU-hours" and "the jobs
//! that wasted the most" have real, checkable answers, and both engines must agree on them.

use perch_model::{GpuIndex, GpuSample};

/// The GPU model every generated node reports.
pub(super) const GPU_MODEL: &str = "NVIDIA H100 80GB HBM3 (synthetic)";
const MEMORY_TOTAL_BYTES: u64 = 80 << 30;
/// What an idle H100 reports as used: the driver's own reservation.
const IDLE_MEMORY_BYTES: u64 = 542 << 20;

const ACCOUNTS: [(&str, f64); 6] = [
    ("vision", 0.28),
    ("language", 0.30),
    ("speech", 0.10),
    ("robotics", 0.12),
    ("recsys", 0.12),
    ("platform", 0.08),
];
const USERS_PER_ACCOUNT: u64 = 5;
/// The share of the cluster's GPU time the arriving jobs ask for; placement gaps and gang
/// waits leave the rest idle.
const OFFERED_LOAD: f64 = 0.85;
/// Jobs are placed from this long before the window, so it opens on a busy cluster.
const WARM_UP_MS: i64 = 2 * 86_400_000;
const MIN_DURATION_MS: f64 = 5.0 * 60_000.0;
const MAX_DURATION_MS: f64 = 2.0 * 86_400_000.0;

/// SplitMix64: a small, fast, seedable generator; the dataset only needs to be reproducible,
/// not cryptographic.
#[derive(Debug, Clone)]
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Deterministic noise in [-1, 1) for one GPU at one sample.
fn noise(seed: u64, gpu_slot: usize, k: u64) -> f64 {
    let h = mix(seed ^ mix((gpu_slot as u64) << 32 ^ k));
    (h >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// How a job uses the GPUs it holds.
#[derive(Debug, Clone, Copy)]
pub(super) enum Profile {
    /// Busy all along around `level` percent.
    Steady { level: f64 },
    /// Busy for `duty` of every `period_s`, idle in between (evaluation, data loading).
    Bursty {
        level: f64,
        period_s: f64,
        duty: f64,
    },
    /// Holds its GPUs and their memory but runs nothing (a forgotten notebook).
    Idle,
    /// Only the first GPU on each node works; the others wait (a misconfigured launch).
    FirstGpuOnly { level: f64 },
    /// Works until `stall_at` of its run, then hangs without releasing the GPUs.
    Stalled { level: f64, stall_at: f64 },
}

impl Profile {
    pub(super) fn name(self) -> &'static str {
        match self {
            Profile::Steady { .. } => "steady",
            Profile::Bursty { .. } => "bursty",
            Profile::Idle => "idle",
            Profile::FirstGpuOnly { .. } => "first_gpu_only",
            Profile::Stalled { .. } => "stalled",
        }
    }

    /// Utilization in percent `since_ms` into a run of `duration_ms`, on the job's GPU that is
    /// `first_on_node` or not, with `n` in [-1, 1) as this sample's noise.
    fn utilization(self, since_ms: i64, duration_ms: i64, first_on_node: bool, n: f64) -> f64 {
        let busy = |level: f64| level + 6.0 * n;
        let idle = 1.0 + n;
        let u = match self {
            Profile::Steady { level } => busy(level),
            Profile::Bursty {
                level,
                period_s,
                duty,
            } => {
                let phase = (since_ms as f64 / 1000.0 % period_s) / period_s;
                if phase < duty { busy(level) } else { idle }
            }
            Profile::Idle => idle,
            Profile::FirstGpuOnly { level } => {
                if first_on_node {
                    busy(level)
                } else {
                    idle
                }
            }
            Profile::Stalled { level, stall_at } => {
                if (since_ms as f64) < stall_at * duration_ms as f64 {
                    busy(level)
                } else {
                    idle
                }
            }
        };
        // NVML reports whole percents.
        u.clamp(0.0, 100.0).round()
    }
}

/// One job of the workload.
#[derive(Debug, Clone)]
pub(super) struct Job {
    pub(super) id: u64,
    pub(super) user: String,
    pub(super) account: &'static str,
    pub(super) profile: Profile,
    pub(super) submit_ms: i64,
    pub(super) start_ms: i64,
    /// When it ends (or would end: a job still running when the window closes ends later).
    pub(super) end_ms: i64,
    /// (node index, GPU index) of every GPU it holds, node by node.
    pub(super) gpus: Vec<(u32, u32)>,
    /// Share of each GPU's memory it uses.
    memory_share: f64,
}

/// A GPU held by a job for a time range; the ranges of one GPU never overlap.
#[derive(Debug, Clone, Copy)]
struct Hold {
    start_ms: i64,
    end_ms: i64,
    job: usize,
    first_on_node: bool,
}

/// The cluster's shape and sampling, fixed by the dataset's spec.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) nodes: u32,
    pub(super) gpus_per_node: u32,
    /// Length of the window in milliseconds, starting at time 0 (the dataset's epoch).
    pub(super) window_ms: i64,
    pub(super) interval_ms: i64,
    pub(super) seed: u64,
}

/// The generated jobs and, per GPU, the times each job held it. Times are milliseconds
/// relative to the window's start.
#[derive(Debug)]
pub(super) struct Workload {
    pub(super) shape: Shape,
    pub(super) jobs: Vec<Job>,
    holds: Vec<Vec<Hold>>,
    /// Each node's sampling phase: its agent samples at `offset + k * interval`.
    offsets: Vec<i64>,
    uuids: Vec<String>,
}

impl Workload {
    pub(super) fn generate(shape: Shape) -> Workload {
        let mut rng = Rng::new(shape.seed);
        let per_node = shape.gpus_per_node.max(1);
        let slots = (shape.nodes * per_node) as usize;
        // Job sizes: single GPUs are most common, whole-node and multi-node gangs are rarer but
        // hold most of the GPU time.
        let mut sizes: Vec<(u32, f64)> = vec![
            (1, 0.40),
            (2.min(per_node), 0.15),
            (4.min(per_node), 0.15),
            (per_node, 0.20),
        ];
        if shape.nodes >= 2 {
            sizes.push((2 * per_node, 0.06));
        }
        if shape.nodes >= 4 {
            sizes.push((4 * per_node, 0.04));
        }
        let total: f64 = sizes.iter().map(|s| s.1).sum();
        let mean_size: f64 = sizes.iter().map(|&(g, p)| f64::from(g) * p / total).sum();
        // Mean of a log-uniform duration.
        let mean_duration =
            (MAX_DURATION_MS - MIN_DURATION_MS) / (MAX_DURATION_MS / MIN_DURATION_MS).ln();
        let mean_gap_ms = mean_size * mean_duration / (OFFERED_LOAD * slots as f64);

        let mut free_at = vec![-WARM_UP_MS; slots];
        let mut holds: Vec<Vec<Hold>> = vec![Vec::new(); slots];
        let mut jobs = Vec::new();
        let mut t = -WARM_UP_MS as f64;
        loop {
            t += -mean_gap_ms * (1.0 - rng.unit()).ln();
            let submit_ms = t as i64;
            if submit_ms >= shape.window_ms {
                break;
            }
            let size = pick_size(&sizes, total, &mut rng);
            let duration_ms = (MIN_DURATION_MS.ln()
                + rng.unit() * (MAX_DURATION_MS.ln() - MIN_DURATION_MS.ln()))
            .exp() as i64;
            let (start_ms, gpus) = place(&free_at, shape, size, submit_ms, &mut rng);
            let end_ms = start_ms + duration_ms;
            // Jobs that start after the window or end before it leave no trace in it.
            if start_ms >= shape.window_ms || end_ms <= 0 {
                for &(n, g) in &gpus {
                    free_at[(n * per_node + g) as usize] = end_ms;
                }
                continue;
            }
            let job = jobs.len();
            let mut last_node = None;
            for &(n, g) in &gpus {
                let slot = (n * per_node + g) as usize;
                free_at[slot] = end_ms;
                holds[slot].push(Hold {
                    start_ms,
                    end_ms,
                    job,
                    first_on_node: last_node != Some(n),
                });
                last_node = Some(n);
            }
            let (account, user) = pick_owner(&mut rng);
            jobs.push(Job {
                id: job as u64 + 1,
                user,
                account,
                profile: pick_profile(gpus.len(), &mut rng),
                submit_ms,
                start_ms,
                end_ms,
                gpus,
                memory_share: rng.range(0.3, 0.95),
            });
        }
        for h in &mut holds {
            h.sort_by_key(|h| h.start_ms);
        }
        let offsets = (0..shape.nodes)
            .map(|n| (mix(shape.seed ^ 0xA5A5 ^ u64::from(n)) % shape.interval_ms as u64) as i64)
            .collect();
        let uuids = (0..slots)
            .map(|s| {
                let h = mix(shape.seed ^ 0x5EED ^ s as u64);
                format!(
                    "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                    h >> 32,
                    (h >> 16) & 0xffff,
                    h & 0xffff,
                    s & 0xffff,
                    mix(h) & 0xffff_ffff_ffff
                )
            })
            .collect();
        Workload {
            shape,
            jobs,
            holds,
            offsets,
            uuids,
        }
    }

    /// Samples per GPU in the window.
    pub(super) fn samples_per_gpu(&self) -> i64 {
        self.shape.window_ms / self.shape.interval_ms
    }

    /// Samples `k0..k1` (sample k at `offset + k * interval`) of every GPU of `node`, round by
    /// round as an agent sends them, with times made absolute by `epoch_ms`.
    pub(super) fn node_samples(
        &self,
        node: u32,
        k0: i64,
        k1: i64,
        epoch_ms: i64,
    ) -> Vec<GpuSample> {
        let per_node = self.shape.gpus_per_node;
        let offset = self.offsets[node as usize];
        let mut out = Vec::with_capacity(((k1 - k0).max(0) as usize) * per_node as usize);
        // Where each GPU's holds stand at k0; sample times only move forward from there.
        let mut cursor: Vec<usize> = (0..per_node)
            .map(|g| {
                let slot = (node * per_node + g) as usize;
                let t = offset + k0 * self.shape.interval_ms;
                self.holds[slot].partition_point(|h| h.end_ms <= t)
            })
            .collect();
        for k in k0..k1 {
            let t = offset + k * self.shape.interval_ms;
            for g in 0..per_node {
                let slot = (node * per_node + g) as usize;
                let holds = &self.holds[slot];
                let c = &mut cursor[g as usize];
                while *c < holds.len() && holds[*c].end_ms <= t {
                    *c += 1;
                }
                let n = noise(self.shape.seed, slot, k as u64);
                let hold = holds.get(*c).filter(|h| h.start_ms <= t);
                let (utilization, memory) = match hold {
                    Some(h) => {
                        let job = &self.jobs[h.job];
                        let u = job.profile.utilization(
                            t - h.start_ms,
                            h.end_ms - h.start_ms,
                            h.first_on_node,
                            n,
                        );
                        let memory = (job.memory_share * MEMORY_TOTAL_BYTES as f64) as u64;
                        (u, (memory >> 20) << 20)
                    }
                    None => (0.0, IDLE_MEMORY_BYTES),
                };
                out.push(GpuSample {
                    time_ms: epoch_ms + t,
                    gpu: GpuIndex(g),
                    uuid: self.uuids[slot].clone(),
                    model: GPU_MODEL.to_owned(),
                    simulated: true,
                    utilization_gpu_pct: Some(utilization),
                    utilization_memory_pct: Some(
                        (utilization * 0.55 + 2.0 * n).clamp(0.0, 100.0).round(),
                    ),
                    memory_used_bytes: Some(memory),
                    memory_total_bytes: Some(MEMORY_TOTAL_BYTES),
                    power_watts: Some(((68.0 + 6.2 * utilization + 4.0 * n) * 10.0).round() / 10.0),
                    temperature_celsius: Some((31.0 + 0.42 * utilization + n).round()),
                    ..GpuSample::default()
                });
            }
        }
        out
    }
}

fn pick_size(sizes: &[(u32, f64)], total: f64, rng: &mut Rng) -> u32 {
    let mut x = rng.unit() * total;
    for &(g, p) in sizes {
        if x < p {
            return g;
        }
        x -= p;
    }
    sizes.last().map_or(1, |s| s.0)
}

fn pick_owner(rng: &mut Rng) -> (&'static str, String) {
    let mut x = rng.unit();
    let mut account = ACCOUNTS[0].0;
    for (name, share) in ACCOUNTS {
        account = name;
        if x < share {
            break;
        }
        x -= share;
    }
    let user = format!("{account}-{:02}", rng.below(USERS_PER_ACCOUNT) + 1);
    (account, user)
}

fn pick_profile(gpus: usize, rng: &mut Rng) -> Profile {
    let x = rng.unit();
    if x < 0.45 {
        Profile::Steady {
            level: rng.range(55.0, 95.0),
        }
    } else if x < 0.65 {
        Profile::Bursty {
            level: rng.range(85.0, 98.0),
            period_s: rng.range(300.0, 1800.0),
            duty: rng.range(0.5, 0.8),
        }
    } else if x < 0.75 {
        Profile::Idle
    } else if x < 0.85 && gpus > 1 {
        Profile::FirstGpuOnly {
            level: rng.range(70.0, 95.0),
        }
    } else {
        Profile::Stalled {
            level: rng.range(60.0, 95.0),
            stall_at: rng.range(0.1, 0.6),
        }
    }
}

/// The earliest start for a job of `size` GPUs submitted at `submit_ms`, and its GPUs: within
/// one node when it fits, else whole nodes (a gang starts when all of them are free).
fn place(
    free_at: &[i64],
    shape: Shape,
    size: u32,
    submit_ms: i64,
    rng: &mut Rng,
) -> (i64, Vec<(u32, u32)>) {
    let per_node = shape.gpus_per_node.max(1);
    // Start the search at a random node so equal candidates spread over the cluster.
    let first = rng.below(u64::from(shape.nodes)) as u32;
    let order = (0..shape.nodes).map(|i| (first + i) % shape.nodes);
    if size <= per_node {
        let mut best: Option<(i64, u32, Vec<u32>)> = None;
        for n in order {
            let mut gpus: Vec<u32> = (0..per_node).collect();
            gpus.sort_by_key(|&g| free_at[(n * per_node + g) as usize]);
            gpus.truncate(size as usize);
            let ready = gpus
                .iter()
                .map(|&g| free_at[(n * per_node + g) as usize])
                .max()
                .unwrap_or(submit_ms)
                .max(submit_ms);
            if best.as_ref().is_none_or(|b| ready < b.0) {
                best = Some((ready, n, gpus));
            }
        }
        let (start, n, mut gpus) = best.unwrap_or((submit_ms, 0, vec![0]));
        gpus.sort_unstable();
        (start, gpus.into_iter().map(|g| (n, g)).collect())
    } else {
        let wanted = size.div_ceil(per_node) as usize;
        let mut nodes: Vec<(i64, u32)> = order
            .map(|n| {
                let ready = (0..per_node)
                    .map(|g| free_at[(n * per_node + g) as usize])
                    .max()
                    .unwrap_or(submit_ms)
                    .max(submit_ms);
                (ready, n)
            })
            .collect();
        nodes.sort_by_key(|&(ready, _)| ready);
        nodes.truncate(wanted);
        let start = nodes.iter().map(|n| n.0).max().unwrap_or(submit_ms);
        let mut picked: Vec<u32> = nodes.into_iter().map(|n| n.1).collect();
        picked.sort_unstable();
        let gpus = picked
            .into_iter()
            .flat_map(|n| (0..per_node).map(move |g| (n, g)))
            .collect();
        (start, gpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Workload {
        Workload::generate(Shape {
            nodes: 4,
            gpus_per_node: 8,
            window_ms: 86_400_000,
            interval_ms: 10_000,
            seed: 7,
        })
    }

    #[test]
    fn no_gpu_is_held_twice_at_once() {
        let w = small();
        assert!(w.jobs.len() > 10, "{} jobs", w.jobs.len());
        for holds in &w.holds {
            for pair in holds.windows(2) {
                assert!(pair[0].end_ms <= pair[1].start_ms, "{pair:?}");
            }
        }
    }

    #[test]
    fn held_gpus_follow_their_job_and_free_gpus_idle() {
        let w = small();
        let samples = w.node_samples(0, 0, w.samples_per_gpu(), 0);
        assert_eq!(samples.len() as i64, 8 * w.samples_per_gpu());
        let offset = w.offsets[0];
        let mut held = 0;
        for s in &samples {
            let slot = s.gpu.0 as usize;
            let hold = w.holds[slot]
                .iter()
                .find(|h| h.start_ms <= s.time_ms && s.time_ms < h.end_ms);
            match hold {
                None => assert_eq!(s.utilization_gpu_pct, Some(0.0), "{s:?}"),
                Some(h) => {
                    held += 1;
                    if let Profile::Idle = w.jobs[h.job].profile {
                        assert!(s.utilization_gpu_pct <= Some(2.0), "{s:?}");
                    }
                }
            }
            assert_eq!((s.time_ms - offset) % 10_000, 0);
        }
        assert!(held > samples.len() / 3, "{held} of {} held", samples.len());
    }

    #[test]
    fn the_same_seed_gives_the_same_workload() {
        let (a, b) = (small(), small());
        assert_eq!(a.jobs.len(), b.jobs.len());
        let sa = a.node_samples(1, 100, 200, 0);
        let sb = b.node_samples(1, 100, 200, 0);
        assert_eq!(
            sa.iter().map(|s| s.utilization_gpu_pct).collect::<Vec<_>>(),
            sb.iter().map(|s| s.utilization_gpu_pct).collect::<Vec<_>>()
        );
    }
}
