//! The cluster as the core sees it: nodes, their GPUs, which GPUs are allocated, which are
//! unhealthy, and the node's state.
//!
//! GPU sets are bit masks (a node has at most 64 GPUs), and a histogram of free GPUs per node
//! is kept per GPU model, so "can any placement exist?" is answered without scanning nodes:
//! that is what keeps a pass over 20,000 pending jobs on 4,000 nodes fast.

use crate::error::{Error, Result};
use crate::ids::{GpuModel, JobId, NodeId, NodeName};
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
}

/// Whether a node takes work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NodeState {
    /// Runs jobs and takes new ones.
    Up,
    /// Keeps its running jobs, takes no new ones.
    Drained,
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
    pub(crate) all: u64,
    pub(crate) alloc: u64,
    pub(crate) unhealthy: u64,
    /// Last measured utilization per GPU, percent.
    pub(crate) util: Vec<f32>,
    /// The job holding each GPU.
    pub(crate) owner: Vec<Option<JobId>>,
}

impl Node {
    pub(crate) fn free_mask(&self) -> u64 {
        if self.state == NodeState::Up {
            self.all & !self.alloc & !self.unhealthy
        } else {
            0
        }
    }
    pub(crate) fn free(&self) -> u32 {
        self.free_mask().count_ones()
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
            c.add_node(NodeSpec {
                name: NodeName(format!("node{:04}", i + 1)),
                gpus,
                model: GpuModel(model.to_string()),
                rack: format!("rack{:02}", i / per_rack.max(1) + 1),
            })?;
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
        let n = spec.gpus as usize;
        self.max_gpus = self.max_gpus.max(spec.gpus);
        self.nodes.push(Node {
            spec,
            model,
            rack,
            state: NodeState::Up,
            all,
            alloc: 0,
            unhealthy: 0,
            util: vec![0.0; n],
            owner: vec![None; n],
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

    /// The job holding a GPU, if any.
    pub fn owner(&self, node: NodeId, gpu: u32) -> Option<JobId> {
        self.nodes
            .get(node.0 as usize)
            .and_then(|n| n.owner.get(gpu as usize).copied().flatten())
    }

    /// GPUs on Up nodes that are healthy and unallocated.
    pub fn free_gpus(&self) -> u32 {
        self.nodes.iter().map(Node::free).sum()
    }

    /// GPUs allocated to jobs, on any node.
    pub fn allocated_gpus(&self) -> u32 {
        self.nodes.iter().map(|n| n.alloc.count_ones()).sum()
    }

    /// All GPUs of all nodes.
    pub fn total_gpus(&self) -> u32 {
        self.nodes.iter().map(|n| n.spec.gpus).sum()
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
    pub(crate) fn nodes_with_free(&self, model: Option<usize>, g: u32) -> u32 {
        let count = |h: &Vec<u32>| h[(g as usize).min(h.len() - 1)..].iter().sum::<u32>();
        match model {
            // A model no node has (usize::MAX) matches nothing.
            Some(m) => self.hist.get(m).map_or(0, count),
            None => self.hist.iter().map(count).sum(),
        }
    }

    pub(crate) fn allocate(&mut self, job: JobId, placement: &[NodeAlloc]) {
        for a in placement {
            self.modify(a.node.0 as usize, |n| {
                debug_assert_eq!(n.alloc & a.mask, 0, "GPU double-booked");
                n.alloc |= a.mask;
                for i in 0..n.owner.len() {
                    if a.mask & (1 << i) != 0 {
                        n.owner[i] = Some(job);
                    }
                }
            });
        }
    }

    pub(crate) fn release(&mut self, placement: &[NodeAlloc]) {
        for a in placement {
            self.modify(a.node.0 as usize, |n| {
                n.alloc &= !a.mask;
                for i in 0..n.owner.len() {
                    if a.mask & (1 << i) != 0 {
                        n.owner[i] = None;
                        n.util[i] = 0.0;
                    }
                }
            });
        }
    }
}
