//! The last sample of every GPU, host and NIC, kept for the Prometheus endpoint so a scrape
//! never has to query the store.

use perch_model::{Batch, GpuSample, HostSample, NicSample};
use std::collections::BTreeMap;
use std::sync::RwLock;

/// Latest values of one node.
#[derive(Debug, Clone, Default)]
pub struct NodeLatest {
    /// Server time (Unix ms) the node's last batch arrived.
    pub last_seen_ms: i64,
    pub host: Option<HostSample>,
    pub gpus: BTreeMap<u32, GpuSample>,
    pub nics: BTreeMap<String, NicSample>,
}

#[derive(Debug, Default)]
pub struct Latest {
    nodes: RwLock<BTreeMap<String, NodeLatest>>,
}

impl Latest {
    /// Records the newest sample of each GPU, host and NIC in `batch`.
    pub fn update(&self, batch: &Batch, now_ms: i64) {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        let node = nodes.entry(batch.node.as_str().to_owned()).or_default();
        node.last_seen_ms = now_ms;
        for h in &batch.hosts {
            if node
                .host
                .as_ref()
                .is_none_or(|old| old.time_ms <= h.time_ms)
            {
                node.host = Some(h.clone());
            }
        }
        for g in &batch.gpus {
            let slot = node.gpus.entry(g.gpu.0);
            match slot {
                std::collections::btree_map::Entry::Occupied(mut o)
                    if o.get().time_ms <= g.time_ms =>
                {
                    o.insert(g.clone());
                }
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(g.clone());
                }
                std::collections::btree_map::Entry::Occupied(_) => {}
            }
        }
        for n in &batch.nics {
            let newer = node
                .nics
                .get(&n.device)
                .is_none_or(|old| old.time_ms <= n.time_ms);
            if newer {
                node.nics.insert(n.device.clone(), n.clone());
            }
        }
    }

    /// A copy of every node's latest values.
    pub fn snapshot(&self) -> BTreeMap<String, NodeLatest> {
        self.nodes.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
