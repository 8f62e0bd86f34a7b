//! The cluster as the core sees it: nodes, their GPUs, which GPUs are allocated, which are
//! unhealthy, and the node's state.
//!
//! GPU sets are bit masks (a node has at most 64 GPUs), and a histogram of free GPUs per node
//! is kept per GPU model, so "can any placement exist?" is answered without scanning nodes:
//! that is what keeps a pass over 20,000 pending jobs on 4,000 nodes fast.
//!
//! A GPU is in one of three conditions: free, held whole by one job (`alloc`, `owner`), or
//! shared by jobs that each hold a part of it (`shared`, `sharers`). "Free" for whole-GPU
//! placement means neither, so a whole-GPU job never lands on a GPU with shares and a share
//! never lands on a GPU held whole.

use crate::error::{Error, Result};
use crate::ids::{GpuModel, JobId, NodeId, NodeName};
use crate::job::GpuShare;
use serde::{Deserialize, Serialize};

/// The most GPUs one node may have.
pub const MAX_GPUS_PER_NODE: u32 = 64;

/// A node as declared by an operator or agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// Host name.
    pub name: NodeName,
    /// Number of GPUs, 1 to 64.
    pub gpus: u32,
    /// Their model.
    pub model: GpuModel,
    /// Rack or switch label; gangs are packed within one label when they can be.
    pub rack: String,
    /// Groups of GPU indices fully connected by NVLink (an NVSwitch system is one group). A
    /// job's GPUs on this node are taken inside one group when they can be. Empty means
    /// unknown, treated as one group of all GPUs; a GPU in no group has no NVLink peer.
    #[serde(default)]
    pub nvlink_islands: Vec<Vec<u32>>,
    /// Whether jobs asking for a part of a GPU may be placed here. Off unless the node says
    /// so: shared GPUs need MPS (or trust between the jobs) to keep one job from starving
    /// the others.
    #[serde(default)]
    pub sharing: bool,
    /// MIG instances of its GPUs in MIG mode. Such a GPU is placed only as its instances, each
    /// to one job asking for its profile ([`crate::JobSpec::gpu_profile`]); never whole, never
    /// shared.
    #[serde(default)]
    pub mig: Vec<MigInstance>,
}

/// One MIG instance of a node's GPU, as its agent reported it (perch creates none: operators
/// partition GPUs with `nvidia-smi mig`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MigInstance {
    /// The GPU it is part of.
    pub gpu: u32,
    /// Its profile, `<compute slices>g.<memory>gb` (`3g.40gb`).
    pub profile: String,
    /// Its UUID, unique on the node.
    pub uuid: String,
}

/// The compute slices of a MIG profile `<n>g.<m>gb` (1 to 7), `None` when `profile` is not of
/// that form.
pub fn mig_slices(profile: &str) -> Option<u32> {
    let (g, rest) = profile.split_once("g.")?;
    let m = rest.strip_suffix("gb")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(g) || !digits(m) || m.bytes().all(|b| b == b'0') {
        return None;
    }
    g.parse().ok().filter(|n| (1..=7).contains(n))
}

/// The part of its GPU a MIG profile holds, in hundredths: its compute slices over 7, rounded
/// (3g: 43). `None` when `profile` is not a MIG profile.
pub fn mig_hundredths(profile: &str) -> Option<u32> {
    mig_slices(profile).map(|slices| (slices * 100 + 3) / 7)
}

/// Checks a node's MIG instances: each on one of its GPUs, of a valid profile, UUIDs unique.
fn check_mig(name: &str, gpus: u32, mig: &[MigInstance]) -> Result<u64> {
    let bad = |message: String| Error::InvalidNode {
        name: name.to_string(),
        message,
    };
    let mut mask = 0u64;
    for (k, m) in mig.iter().enumerate() {
        if m.gpu >= gpus {
            return Err(bad(format!(
                "mig: GPU {} does not exist (the node has GPUs 0 to {})",
                m.gpu,
                gpus.saturating_sub(1)
            )));
        }
        if mig_slices(&m.profile).is_none() {
            return Err(bad(format!(
                "mig: profile {:?} is not of the form <n>g.<m>gb (e.g. 3g.40gb)",
                m.profile
            )));
        }
        if mig[..k].iter().any(|o| o.uuid == m.uuid) {
            return Err(bad(format!("mig: UUID {} is listed twice", m.uuid)));
        }
        mask |= 1 << m.gpu;
    }
    Ok(mask)
}

impl NodeSpec {
    /// A node of `gpus` GPUs of `model` in `rack`, NVLink topology unknown, no sharing.
    pub fn new(name: &str, gpus: u32, model: &str, rack: &str) -> NodeSpec {
        NodeSpec {
            name: NodeName(name.to_string()),
            gpus,
            model: GpuModel(model.to_string()),
            rack: rack.to_string(),
            nvlink_islands: Vec::new(),
            sharing: false,
            mig: Vec::new(),
        }
    }
}

/// The NVLink islands of `spec` as bit masks covering every GPU: the declared groups, then
/// each GPU in no group alone; one mask of all GPUs when nothing is declared.
fn island_masks(spec: &NodeSpec, all: u64) -> Result<Vec<u64>> {
    if spec.nvlink_islands.is_empty() {
        return Ok(vec![all]);
    }
    let bad = |message: String| Error::InvalidNode {
        name: spec.name.0.clone(),
        message,
    };
    let mut seen = 0u64;
    let mut masks = Vec::with_capacity(spec.nvlink_islands.len());
    for island in &spec.nvlink_islands {
        if island.is_empty() {
            return Err(bad(
                "nvlink_islands: an island must list at least one GPU".into()
            ));
        }
        let mut mask = 0u64;
        for &g in island {
            if g >= spec.gpus {
                return Err(bad(format!(
                    "nvlink_islands: GPU {g} does not exist (the node has GPUs 0 to {})",
                    spec.gpus - 1
                )));
            }
            if seen & (1 << g) != 0 {
                return Err(bad(format!(
                    "nvlink_islands: GPU {g} is in two islands; each GPU belongs to one"
                )));
            }
            seen |= 1 << g;
            mask |= 1 << g;
        }
        masks.push(mask);
    }
    let mut rest = all & !seen;
    while rest != 0 {
        let bit = rest & rest.wrapping_neg();
        masks.push(bit);
        rest &= !bit;
    }
    Ok(masks)
}

/// Whether a node takes work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NodeState {
    /// Runs jobs and takes new ones.
    Up,
    /// Keeps its running jobs, takes no new ones.
    Drained,
    /// Stopped reporting: takes no new jobs, and its running jobs stay placed (they may well
    /// still run) until it reports again or is declared [`NodeState::Down`].
    Unreachable,
    /// Gone: its jobs were ended or requeued.
    Down,
}

/// A GPU's health as the collector last reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GpuHealth {
    /// Fit for work.
    Healthy,
    /// A recent XID error, with its code.
    Xid(u32),
    /// Uncorrectable ECC errors.
    UncorrectableEcc,
    /// A process no job owns is using it.
    RogueProcess,
    /// Taken out of scheduling by an operator or perch's remediation until put back.
    TakenOut,
}

/// The GPUs a gang got on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeAlloc {
    /// The node.
    pub node: NodeId,
    /// Bit `i` set when GPU index `i` is granted.
    pub mask: u64,
}

impl NodeAlloc {
    /// The granted GPU indices, ascending (what goes into `CUDA_VISIBLE_DEVICES`).
    pub fn gpu_indices(&self) -> Vec<u32> {
        (0..64).filter(|i| self.mask & (1 << i) != 0).collect()
    }
}

/// Where a gang runs: one entry per node.
pub type Placement = Vec<NodeAlloc>;

#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub(crate) spec: NodeSpec,
    pub(crate) model: usize,
    pub(crate) rack: usize,
    pub(crate) state: NodeState,
    /// Drained by an operator or remediation, whether it is up or down now: a drained node
    /// that goes down comes back drained.
    pub(crate) drained: bool,
    pub(crate) all: u64,
    /// GPUs held whole.
    pub(crate) alloc: u64,
    /// GPUs holding at least one share.
    pub(crate) shared: u64,
    pub(crate) unhealthy: u64,
    /// Each GPU's last reported health (`unhealthy` has a bit set for every one not healthy).
    pub(crate) health: Vec<GpuHealth>,
    /// NVLink islands as masks covering every GPU (see [`NodeSpec::nvlink_islands`]).
    pub(crate) islands: Vec<u64>,
    /// Last measured utilization per GPU, percent.
    pub(crate) util: Vec<f32>,
    /// Last measured GPU memory per GPU, MiB (absent until telemetry says).
    pub(crate) mem_used: Vec<Option<u64>>,
    pub(crate) mem_total: Vec<Option<u64>>,
    /// The job holding each GPU whole.
    pub(crate) owner: Vec<Option<JobId>>,
    /// The jobs sharing each GPU, with the percent and memory they were granted.
    pub(crate) sharers: Vec<Vec<(JobId, GpuShare)>>,
    /// GPUs in MIG mode (any instance in `spec.mig`): never free for whole or shared jobs.
    pub(crate) mig_gpus: u64,
    /// The job holding each of `spec.mig`, by position.
    pub(crate) mig_holder: Vec<Option<JobId>>,
}

impl Node {
    pub(crate) fn free_mask(&self) -> u64 {
        if self.state == NodeState::Up {
            self.all & !self.alloc & !self.shared & !self.unhealthy & !self.mig_gpus
        } else {
            0
        }
    }
    pub(crate) fn free(&self) -> u32 {
        self.free_mask().count_ones()
    }
    /// Percent of GPU `i` granted to shares.
    pub(crate) fn share_percent(&self, i: usize) -> u32 {
        self.sharers[i].iter().map(|(_, s)| s.percent).sum()
    }
    /// GPU memory of GPU `i` granted to shares, MiB.
    pub(crate) fn share_memory(&self, i: usize) -> u64 {
        self.sharers[i].iter().map(|(_, s)| s.memory_mb).sum()
    }
    /// A GPU nobody holds any more: its measured load is forgotten until the next sample
    /// (the agent starts nothing on it before the last job's processes are gone).
    fn forget_load(&mut self, i: usize) {
        self.util[i] = 0.0;
        if self.mem_total[i].is_some() {
            self.mem_used[i] = Some(0);
        }
    }
}

/// All nodes, with per-model free-GPU histograms kept up to date.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    pub(crate) nodes: Vec<Node>,
    pub(crate) models: Vec<GpuModel>,
    pub(crate) racks: Vec<String>,
    /// `hist[model][k]`: nodes of that model with exactly `k` usable free GPUs.
    pub(crate) hist: Vec<Vec<u32>>,
    pub(crate) max_gpus: u32,
    /// All GPUs of all nodes.
    pub(crate) gpus: u32,
    /// Nodes that take shared jobs (a pass looks for room on shared GPUs only when some do).
    pub(crate) sharing_nodes: u32,
    /// Nodes with MIG instances (a pass looks for free instances only when some have).
    pub(crate) mig_nodes: u32,
}

impl Cluster {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// `count` identical nodes named `node0001`..., `per_rack` to a rack label `rack01`....
    pub fn uniform(count: u32, gpus: u32, model: &str, per_rack: u32) -> Result<Self> {
        let mut c = Cluster::new();
        for i in 0..count {
            c.add_node(NodeSpec::new(
                &format!("node{:04}", i + 1),
                gpus,
                model,
                &format!("rack{:02}", i / per_rack.max(1) + 1),
            ))?;
        }
        Ok(c)
    }

    /// Adds a node, up and healthy, and returns its id.
    pub fn add_node(&mut self, spec: NodeSpec) -> Result<NodeId> {
        if spec.gpus == 0 || spec.gpus > MAX_GPUS_PER_NODE {
            return Err(Error::InvalidNode {
                name: spec.name.0.clone(),
                message: format!(
                    "gpus must be between 1 and {MAX_GPUS_PER_NODE}, got {}",
                    spec.gpus
                ),
            });
        }
        // Checked before anything is registered, so a refused node leaves no trace.
        island_masks(&spec, u64::MAX)?;
        let mig_gpus = check_mig(&spec.name.0, spec.gpus, &spec.mig)?;
        if self.nodes.iter().any(|n| n.spec.name == spec.name) {
            return Err(Error::InvalidNode {
                name: spec.name.0.clone(),
                message: "name already used".into(),
            });
        }
        let model = match self.models.iter().position(|m| *m == spec.model) {
            Some(i) => i,
            None => {
                self.models.push(spec.model.clone());
                self.hist.push(vec![0; MAX_GPUS_PER_NODE as usize + 1]);
                self.models.len() - 1
            }
        };
        let rack = match self.racks.iter().position(|r| *r == spec.rack) {
            Some(i) => i,
            None => {
                self.racks.push(spec.rack.clone());
                self.racks.len() - 1
            }
        };
        let all = if spec.gpus == 64 {
            u64::MAX
        } else {
            (1u64 << spec.gpus) - 1
        };
        let islands = island_masks(&spec, all)?;
        let n = spec.gpus as usize;
        self.max_gpus = self.max_gpus.max(spec.gpus);
        self.gpus += spec.gpus;
        self.sharing_nodes += u32::from(spec.sharing);
        self.mig_nodes += u32::from(!spec.mig.is_empty());
        let mig_holder = vec![None; spec.mig.len()];
        self.nodes.push(Node {
            spec,
            model,
            rack,
            state: NodeState::Up,
            drained: false,
            all,
            alloc: 0,
            shared: 0,
            unhealthy: 0,
            health: vec![GpuHealth::Healthy; n],
            islands,
            util: vec![0.0; n],
            mem_used: vec![None; n],
            mem_total: vec![None; n],
            owner: vec![None; n],
            sharers: vec![Vec::new(); n],
            mig_gpus,
            mig_holder,
        });
        let id = self.nodes.len() - 1;
        self.hist[model][self.nodes[id].free() as usize] += 1;
        Ok(NodeId(id as u32))
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when there are no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node's spec.
    pub fn spec(&self, node: NodeId) -> Option<&NodeSpec> {
        self.nodes.get(node.0 as usize).map(|n| &n.spec)
    }

    /// Looks a node up by name.
    pub fn node_id(&self, name: &NodeName) -> Option<NodeId> {
        self.nodes
            .iter()
            .position(|n| n.spec.name == *name)
            .map(|i| NodeId(i as u32))
    }

    /// The node's state.
    pub fn state(&self, node: NodeId) -> Option<NodeState> {
        self.nodes.get(node.0 as usize).map(|n| n.state)
    }

    /// The job holding a GPU whole, if any.
    pub fn owner(&self, node: NodeId, gpu: u32) -> Option<JobId> {
        self.nodes
            .get(node.0 as usize)
            .and_then(|n| n.owner.get(gpu as usize).copied().flatten())
    }

    /// The jobs sharing a GPU, with what each was granted (empty for a free or whole GPU).
    pub fn sharers(&self, node: NodeId, gpu: u32) -> &[(JobId, GpuShare)] {
        self.nodes
            .get(node.0 as usize)
            .and_then(|n| n.sharers.get(gpu as usize))
            .map_or(&[], Vec::as_slice)
    }

    /// A GPU's last reported health (`None` for an unknown node or GPU).
    pub fn gpu_health(&self, node: NodeId, gpu: u32) -> Option<GpuHealth> {
        self.nodes
            .get(node.0 as usize)
            .and_then(|n| n.health.get(gpu as usize).copied())
    }

    /// Every job on a GPU: its whole owner, or its sharers, or the jobs on its MIG instances.
    pub fn holders(&self, node: NodeId, gpu: u32) -> Vec<JobId> {
        let mut jobs = match self.owner(node, gpu) {
            Some(j) => vec![j],
            None => self.sharers(node, gpu).iter().map(|(j, _)| *j).collect(),
        };
        if let Some(n) = self.nodes.get(node.0 as usize) {
            jobs.extend(
                n.spec
                    .mig
                    .iter()
                    .zip(&n.mig_holder)
                    .filter(|(m, _)| m.gpu == gpu)
                    .filter_map(|(_, h)| *h),
            );
        }
        jobs
    }

    /// The node's NVLink islands as GPU index lists, GPUs in no declared island alone.
    pub fn nvlink_islands(&self, node: NodeId) -> Vec<Vec<u32>> {
        self.nodes.get(node.0 as usize).map_or(Vec::new(), |n| {
            n.islands
                .iter()
                .map(|m| (0..64).filter(|i| m & (1u64 << i) != 0).collect())
                .collect()
        })
    }

    /// Changes a node's NVLink islands, whether it takes shared jobs and (when given) its
    /// rack. Running jobs stay where they are; only later placements follow the new topology.
    pub fn set_features(
        &mut self,
        node: NodeId,
        nvlink_islands: Vec<Vec<u32>>,
        sharing: bool,
        rack: Option<String>,
    ) -> Result<()> {
        let rack_index = match &rack {
            Some(label) => Some(match self.racks.iter().position(|r| r == label) {
                Some(i) => i,
                None => {
                    self.racks.push(label.clone());
                    self.racks.len() - 1
                }
            }),
            None => None,
        };
        let n = self.node_mut(node)?;
        let mut spec = n.spec.clone();
        spec.nvlink_islands = nvlink_islands;
        spec.sharing = sharing;
        if let Some(label) = rack {
            spec.rack = label;
        }
        let islands = island_masks(&spec, n.all)?;
        let was_sharing = n.spec.sharing;
        n.islands = islands;
        n.spec = spec;
        if let Some(i) = rack_index {
            n.rack = i;
        }
        self.sharing_nodes = self.sharing_nodes + u32::from(sharing) - u32::from(was_sharing);
        Ok(())
    }

    /// The node's MIG instances, with the job holding each.
    pub fn mig_instances(&self, node: NodeId) -> Vec<(MigInstance, Option<JobId>)> {
        self.nodes.get(node.0 as usize).map_or(Vec::new(), |n| {
            n.spec
                .mig
                .iter()
                .cloned()
                .zip(n.mig_holder.iter().copied())
                .collect()
        })
    }

    /// Replaces the node's MIG instances with what its agent reports now. An instance kept
    /// (same UUID) keeps its job; one gone that a job still holds stays listed until the job
    /// ends, so no job loses its books.
    pub fn set_mig(&mut self, node: NodeId, mig: Vec<MigInstance>) -> Result<()> {
        let n = self.node_mut(node)?;
        let mut mig = mig;
        for (old, holder) in n.spec.mig.iter().zip(&n.mig_holder) {
            if holder.is_some() && !mig.iter().any(|m| m.uuid == old.uuid) {
                mig.push(old.clone());
            }
        }
        let mask = check_mig(&n.spec.name.0, n.spec.gpus, &mig)?;
        let holders: Vec<Option<JobId>> = mig
            .iter()
            .map(|m| {
                n.spec
                    .mig
                    .iter()
                    .position(|o| o.uuid == m.uuid)
                    .and_then(|k| n.mig_holder[k])
            })
            .collect();
        let was = !n.spec.mig.is_empty();
        let now = !mig.is_empty();
        let idx = node.0 as usize;
        self.modify(idx, |n| {
            n.spec.mig = mig;
            n.mig_holder = holders;
            n.mig_gpus = mask;
        });
        self.mig_nodes = self.mig_nodes + u32::from(now) - u32::from(was);
        Ok(())
    }

    /// Books for `job` the lowest free instance of `profile` on GPU `gpu` of `node`; false
    /// when there is none.
    pub(crate) fn allocate_mig(
        &mut self,
        job: JobId,
        node: NodeId,
        gpu: u32,
        profile: &str,
    ) -> bool {
        let Some(n) = self.nodes.get_mut(node.0 as usize) else {
            return false;
        };
        let free = n
            .spec
            .mig
            .iter()
            .zip(&n.mig_holder)
            .position(|(m, h)| h.is_none() && m.gpu == gpu && m.profile == profile);
        match free {
            Some(k) => {
                n.mig_holder[k] = Some(job);
                true
            }
            None => false,
        }
    }

    /// The MIG instance `job` holds on `node`, if any.
    pub fn mig_instance_of(&self, node: NodeId, job: JobId) -> Option<&MigInstance> {
        let n = self.nodes.get(node.0 as usize)?;
        let k = n.mig_holder.iter().position(|h| *h == Some(job))?;
        n.spec.mig.get(k)
    }

    /// GPUs on Up nodes that are healthy and unallocated.
    pub fn free_gpus(&self) -> u32 {
        self.nodes.iter().map(Node::free).sum()
    }

    /// GPUs allocated to jobs, whole or in part, on any node.
    pub fn allocated_gpus(&self) -> u32 {
        self.nodes
            .iter()
            .map(|n| (n.alloc | n.shared).count_ones())
            .sum()
    }

    /// All GPUs of all nodes.
    pub fn total_gpus(&self) -> u32 {
        self.gpus
    }

    pub(crate) fn model_index(&self, model: Option<&GpuModel>) -> Option<Option<usize>> {
        match model {
            None => Some(None),
            Some(m) => self.models.iter().position(|x| x == m).map(Some),
        }
    }

    pub(crate) fn node_mut(&mut self, node: NodeId) -> Result<&mut Node> {
        self.nodes
            .get_mut(node.0 as usize)
            .ok_or(Error::UnknownNode { node, gpu: None })
    }

    /// Applies `f` to a node, keeping the histogram right.
    pub(crate) fn modify(&mut self, idx: usize, f: impl FnOnce(&mut Node)) {
        let node = &mut self.nodes[idx];
        let before = node.free() as usize;
        f(node);
        let after = node.free() as usize;
        if before != after {
            let h = &mut self.hist[node.model];
            h[before] -= 1;
            h[after] += 1;
        }
    }

    /// Nodes (of `model`, or any) with at least `g` usable free GPUs.
    /// Free GPUs of `model` (any model: `None`) in all, from the histogram (no node visited).
    pub(crate) fn free_of(&self, model: Option<usize>) -> u32 {
        let total = |h: &Vec<u32>| h.iter().enumerate().map(|(k, c)| k as u32 * c).sum::<u32>();
        match model {
            Some(m) => self.hist.get(m).map_or(0, total),
            None => self.hist.iter().map(total).sum(),
        }
    }

    pub(crate) fn nodes_with_free(&self, model: Option<usize>, g: u32) -> u32 {
        let count = |h: &Vec<u32>| h[(g as usize).min(h.len() - 1)..].iter().sum::<u32>();
        match model {
            // A model no node has (usize::MAX) matches nothing.
            Some(m) => self.hist.get(m).map_or(0, count),
            None => self.hist.iter().map(count).sum(),
        }
    }

    /// Books `placement` for `job`: whole GPUs, or its share of each GPU.
    pub(crate) fn allocate(
        &mut self,
        job: JobId,
        placement: &[NodeAlloc],
        share: Option<GpuShare>,
    ) {
        for a in placement {
            self.modify(a.node.0 as usize, |n| {
                debug_assert_eq!(n.alloc & a.mask, 0, "GPU double-booked");
                match share {
                    None => {
                        debug_assert_eq!(n.shared & a.mask, 0, "whole GPU job on a shared GPU");
                        n.alloc |= a.mask;
                    }
                    Some(_) => n.shared |= a.mask,
                }
                for i in 0..n.owner.len() {
                    if a.mask & (1 << i) != 0 {
                        match share {
                            None => n.owner[i] = Some(job),
                            Some(s) => n.sharers[i].push((job, s)),
                        }
                    }
                }
            });
        }
    }

    /// Frees what [`Cluster::allocate`] booked for `job`.
    pub(crate) fn release(&mut self, job: JobId, placement: &[NodeAlloc]) {
        for a in placement {
            self.modify(a.node.0 as usize, |n| {
                for i in 0..n.owner.len() {
                    let bit = 1u64 << i;
                    if a.mask & bit == 0 {
                        continue;
                    }
                    if n.owner[i] == Some(job) {
                        n.owner[i] = None;
                        n.alloc &= !bit;
                        n.forget_load(i);
                    } else {
                        n.sharers[i].retain(|(j, _)| *j != job);
                        if n.sharers[i].is_empty() && n.shared & bit != 0 {
                            n.shared &= !bit;
                            n.forget_load(i);
                        }
                    }
                }
                for h in &mut n.mig_holder {
                    if *h == Some(job) {
                        *h = None;
                    }
                }
            });
        }
    }
}
