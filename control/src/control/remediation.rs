//! What the alert engine's remediation does to the cluster, as control-plane operations:
//! move a node's running jobs elsewhere, and take a GPU out of scheduling or put it back.
//! Draining and resuming are [`Control::set_drained`], shared with operators.

use super::{Control, ControlError};
use crate::record::JobState;
use perch_scheduler::{Event, GpuHealth, JobId, NodeId};

impl Control {
    fn node_id(&self, name: &str) -> Result<NodeId, ControlError> {
        self.node_index
            .get(name)
            .map(|&i| NodeId(i as u32))
            .ok_or_else(|| ControlError::NoSuchNode(name.to_owned()))
    }

    /// Stops every job running on node `name` (checkpoint signal, grace, kill) and puts it
    /// back in the queue, to run elsewhere; returns their ids. A drained node's jobs then
    /// start on other nodes as soon as GPUs allow.
    pub fn evict_node_jobs(&mut self, name: &str, now: i64) -> Result<Vec<u64>, ControlError> {
        self.node_id(name)?;
        let running: Vec<u64> = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Running && j.placement.iter().any(|p| p.node == name))
            .map(|j| j.id)
            .collect();
        for &id in &running {
            let actions = self.step(now, Event::Evict(JobId(id)))?;
            self.apply(now, actions);
            if let Some(j) = self.jobs.get_mut(&id) {
                j.note(now, format!("moved off {name} by perch's remediation"));
            }
            self.dirty_jobs.insert(id);
        }
        Ok(running)
    }

    /// Takes GPU `gpu` of node `name` out of scheduling (`out`) or puts it back. Jobs already
    /// on it keep running; nothing new is placed there while it is out.
    pub fn set_gpu_out(
        &mut self,
        name: &str,
        gpu: u32,
        out: bool,
        now: i64,
    ) -> Result<(), ControlError> {
        let node = self.node_id(name)?;
        let health = if out {
            GpuHealth::TakenOut
        } else {
            GpuHealth::Healthy
        };
        let actions = self
            .scheduler
            .step(now, Event::GpuHealth { node, gpu, health })?;
        self.apply(now, actions);
        Ok(())
    }
}
