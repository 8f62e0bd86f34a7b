//! What a node's telemetry tells the scheduler: measured utilization, GPU health (XIDs,
//! ECC, lost GPUs) and rogue processes.

use super::*;

impl Control {
    /// Feeds what a node's telemetry says to the scheduler, without a scheduling pass (the
    /// next tick or operation runs one): measured GPU utilization (for idle detection and
    /// victim choice), XIDs that need a GPU reset or a reboot, uncorrectable ECC errors and
    /// lost GPUs (never placed on until healthy again), and rogue processes (a GPU with one is
    /// not placed on while it is there; it is healthy again once the node's latest sample of
    /// that GPU lists none, unless something else, an XID say, made it unhealthy).
    pub fn observe(&mut self, batch: &perch_model::Batch, now: i64) -> Result<(), ControlError> {
        use perch_model::GpuEventKind as Kind;
        use perch_scheduler::GpuHealth;
        self.now = now;
        let Some(&idx) = self.node_index.get(batch.node.as_str()) else {
            return Ok(());
        };
        let node = NodeId(idx as u32);
        let gpus = self.nodes[idx].record.gpus;
        if !batch.gpus.is_empty() {
            self.note_simulated(idx, batch.gpus.iter().any(|g| g.simulated));
        }
        let mut events = Vec::new();
        for g in batch.gpus.iter().filter(|g| g.gpu.0 < gpus) {
            if let Some(pct) = g.utilization_gpu_pct {
                events.push(Event::GpuUtilization {
                    node,
                    gpu: g.gpu.0,
                    percent: pct as f32,
                    memory_used_mb: g.memory_used_bytes.map(|b| b >> 20),
                    memory_total_mb: g.memory_total_bytes.map(|b| b >> 20),
                });
            }
        }
        for e in batch.gpu_events.iter().filter(|e| e.gpu.0 < gpus) {
            let health = match (e.kind, e.xid) {
                (Kind::Xid, Some(code)) if xid_needs_reset(code) => GpuHealth::Xid(code as u32),
                (Kind::EccDoubleBit, _) => GpuHealth::UncorrectableEcc,
                (Kind::GpuLost, _) => GpuHealth::Xid(79),
                (Kind::GpuRecovered, _) => GpuHealth::Healthy,
                _ => continue,
            };
            tracing::warn!(node = %batch.node, gpu = e.gpu.0, ?health, "GPU health changed; the scheduler will not place jobs on it until it is healthy");
            events.push(Event::GpuHealth {
                node,
                gpu: e.gpu.0,
                health,
            });
        }
        // Rogue processes as of each GPU's latest sample that listed its processes (a batch
        // can hold several rounds).
        let mut latest: std::collections::BTreeMap<u32, i64> = Default::default();
        for g in batch
            .gpus
            .iter()
            .filter(|g| g.gpu.0 < gpus && g.processes.is_some())
        {
            let t = latest.entry(g.gpu.0).or_insert(g.time_ms);
            *t = (*t).max(g.time_ms);
        }
        for (gpu, time_ms) in latest {
            // An XID or a lost GPU in the same batch says more than a rogue process.
            if events
                .iter()
                .any(|e| matches!(e, Event::GpuHealth { gpu: g, .. } if *g == gpu))
            {
                continue;
            }
            let rogue = batch
                .gpu_processes
                .iter()
                .any(|p| p.gpu.0 == gpu && p.time_ms == time_ms && p.rogue);
            let before = self
                .scheduler
                .cluster()
                .gpu_health(node, gpu)
                .unwrap_or(GpuHealth::Healthy);
            let health = match (before, rogue) {
                (GpuHealth::Healthy, true) => GpuHealth::RogueProcess,
                (GpuHealth::RogueProcess, false) => GpuHealth::Healthy,
                _ => continue,
            };
            if rogue {
                tracing::warn!(node = %batch.node, gpu, "a process outside the job that holds this GPU runs on it; no job is placed on it while it does");
            } else {
                tracing::info!(node = %batch.node, gpu, "the rogue process left the GPU; it is placed on again");
            }
            events.push(Event::GpuHealth { node, gpu, health });
        }
        for event in events {
            let actions = self.scheduler.handle(now, event)?;
            self.apply(now, actions);
        }
        Ok(())
    }
}

/// Whether an XID takes its GPU out of scheduling until it is healthy again: NVIDIA's catalog
/// resolves it by a GPU reset or a reboot. The classes are `perch_model::xid`'s, the same
/// table the XID alert rules use, so the scheduler and the alerts cannot disagree.
pub(super) fn xid_needs_reset(code: u64) -> bool {
    use perch_model::xid::{XidClass, xid_class};
    matches!(xid_class(code), XidClass::ResetGpu | XidClass::Reboot)
}
