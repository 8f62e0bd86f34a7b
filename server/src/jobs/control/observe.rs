//! What a node's telemetry tells the scheduler: measured utilization, GPU health (XIDs,
//! ECC, lost GPUs) and rogue processes.

use super::*;

impl Control {
    /// Feeds what a node's telemetry says to the scheduler, without a scheduling pass (the
    /// next tick or operation runs one): measured GPU utilization (for idle detection and
    /// victim choice), XIDs that need a GPU reset or a reboot, uncorrectable ECC errors and
    /// lost GPUs (never placed on until healthy again), and rogue processes.
    pub(crate) fn observe(
        &mut self,
        batch: &perch_model::Batch,
        now: i64,
    ) -> Result<(), ControlError> {
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
        for p in batch
            .gpu_processes
            .iter()
            .filter(|p| p.rogue && p.gpu.0 < gpus)
        {
            events.push(Event::GpuHealth {
                node,
                gpu: p.gpu.0,
                health: GpuHealth::RogueProcess,
            });
        }
        for event in events {
            let actions = self.scheduler.handle(now, event)?;
            self.apply(now, actions);
        }
        Ok(())
    }
}

/// Whether an XID takes its GPU out of scheduling until it is healthy again: NVIDIA's catalog
/// resolves it by a GPU reset or a reboot. The classes are `perch_alerts::xid`'s, the same
/// table the XID alert rules use, so the scheduler and the alerts cannot disagree.
pub(super) fn xid_needs_reset(code: u64) -> bool {
    use perch_alerts::xid::{XidClass, xid_class};
    matches!(xid_class(code), XidClass::ResetGpu | XidClass::Reboot)
}
