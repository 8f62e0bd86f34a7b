//! An agent's sync: who the node is, what ended there, what runs there that should not (or
//! no longer does), the rendezvous ports it picked, and the orders waiting for it.

use super::*;

impl Control {
    /// Answers node `req.node`'s sync: stores the output it ships, takes what ended there, stops
    /// what runs there and should not, requeues what it lost, and hands it its orders. Every
    /// step below is one rule of "a job runs at most once, and each exit is charged once".
    pub fn sync(&mut self, req: SyncRequest, now: i64) -> Result<SyncResponse, ControlError> {
        self.now = now;
        let name = req.node.as_str().to_owned();
        self.check_claim(&req, now)?;
        let mut response = SyncResponse::default();
        if let Err(e) = self.store_logs(&name, &req.logs, &mut response) {
            // Job output is kept by the agent and sent again (it moves on only when the answer
            // says where to continue from): a full or broken log disk must not fail the sync,
            // or the node would go down and its jobs be requeued.
            tracing::warn!(node = %name, error = %e, "cannot store job output; the agent sends it again");
            response.log_offsets.clear();
        }
        if req.gpus == 0 {
            // A node without GPUs is monitored but runs no jobs; anything it runs is stray.
            response.stop = req
                .running
                .iter()
                .map(|r| JobStop {
                    job: r.job,
                    attempt: r.attempt,
                    signal: "SIGTERM".into(),
                    grace_secs: 10,
                })
                .collect();
            response.acknowledged = req.exited.iter().map(JobExit::id).collect();
            return Ok(response);
        }
        let idx = self.node_reports(&req, now)?;
        response.lease_ms = self.config.lease.as_millis().try_into().unwrap_or(u64::MAX);
        for note in &req.notes {
            if let Some(j) = self.jobs.get_mut(&note.job) {
                j.note(now, format!("{name}: {}", note.text));
                self.dirty_jobs.insert(note.job);
            }
        }
        self.take_start_reports(&name, &req.started, now);
        for exit in &req.exited {
            response.acknowledged.push(exit.id());
            self.take_exit(idx, exit, now)?;
        }
        response.stop = self.unexpected_runs(&name, &req.running);
        let running: HashSet<JobAttempt> = req.running.iter().copied().collect();
        self.requeue_lost(idx, &req, &running, now)?;
        self.confirm_stops(idx, Some(&running), now);
        for mp in &req.master_ports {
            self.take_master_port(&name, mp, now);
        }
        self.hand_over_orders(idx, &mut response);
        self.release_held(now)?;
        Ok(response)
    }

    /// A sync while the job database cannot commit ([`super::super::JobService::sync_degraded`]):
    /// the claim checked and a known node's lease renewed, in memory only; nothing else.
    pub fn renew_only(
        &mut self,
        req: &SyncRequest,
        now: i64,
    ) -> Result<SyncResponse, ControlError> {
        self.check_claim(req, now)?;
        let mut response = SyncResponse::default();
        if let Some(&idx) = self.node_index.get(req.node.as_str()) {
            self.nodes[idx].last_sync_ms = now;
            response.lease_ms = self.config.lease.as_millis().try_into().unwrap_or(u64::MAX);
        }
        Ok(response)
    }

    /// Refuses a sync from an agent other than the one that serves the node, while that one's
    /// claim is fresh ([`super::super::claims`]): two agents under one name would each report
    /// what runs there, and the one that runs nothing had the other's jobs taken for lost and
    /// killed.
    fn check_claim(&self, req: &SyncRequest, now: i64) -> Result<(), ControlError> {
        match &req.agent_id {
            Some(id) => {
                self.claims
                    .claim(req.node.as_str(), id, now, req.advertise_addr.as_deref())
            }
            None => Ok(()),
        }
    }

    /// The node that syncs, added on its first sync; its lease renewed, its reported features
    /// followed, and back up if it had been silent. Returns its index.
    fn node_reports(&mut self, req: &SyncRequest, now: i64) -> Result<usize, ControlError> {
        let name = req.node.as_str();
        let idx = match self.node_index.get(name) {
            Some(&i) => i,
            None => {
                let record = NodeRecord {
                    name: name.to_owned(),
                    gpus: req.gpus,
                    model: req.gpu_model.clone(),
                    rack: reported_rack(req),
                    drained: false,
                    nvlink_islands: reported_islands(req),
                    gpu_sharing: req.gpu_sharing,
                    drained_by: None,
                    drain_reason: None,
                    simulated: false,
                    mig_instances: reported_mig(req),
                };
                let i = self.add_node(record, now)?;
                self.dirty_nodes.insert(i);
                self.track_node_state(i, now);
                let what = format!("{name} joined with {} {} GPUs", req.gpus, req.gpu_model);
                self.node_event(now, i, "node_joined", "perch", what);
                i
            }
        };
        self.nodes[idx].last_sync_ms = now;
        self.nodes[idx].lease_expired = false;
        self.nodes[idx].addr = req
            .advertise_addr
            .clone()
            .filter(|a| perch_model::control::is_host_address(a));
        self.update_node_features(idx, req, now)?;
        if self.nodes[idx].down {
            self.nodes[idx].down = false;
            self.nodes[idx].reporting_since_ms = now;
            let actions = self
                .scheduler
                .step(now, Event::NodeUp(NodeId(idx as u32)))?;
            self.apply(now, actions);
            self.track_node_state(idx, now);
            self.node_event(
                now,
                idx,
                "node_up",
                "perch",
                format!("{name}'s agent reports again"),
            );
        }
        Ok(idx)
    }

    /// One exit node `idx` reports. Only the exit of the attempt that runs there now, and was
    /// handed over there, ends anything: an earlier attempt's exit, or one sent again after the
    /// job ended (its acknowledgement was lost), is noted and charged nothing. A multi-node
    /// job ends when all its ranks have ended, or at the first that fails.
    fn take_exit(&mut self, idx: usize, exit: &JobExit, now: i64) -> Result<(), ControlError> {
        let name = self.nodes[idx].record.name.clone();
        let JobExit {
            job,
            attempt,
            code,
            stopped,
            fenced,
            error,
            reason,
            output_bytes,
        } = exit;
        if let Some(j) = self.jobs.get_mut(job)
            && let Some(a) = j
                .allocations
                .iter_mut()
                .find(|a| a.attempt == *attempt && a.node == name)
        {
            if a.exit_code.is_some() {
                // Taken already: sent again because the acknowledgement was lost or the agent
                // restarted before it came. Acknowledged, and nothing else.
                return Ok(());
            }
            a.exit_code = Some(*code);
            if let Some(bytes) = output_bytes {
                a.output_bytes = Some(*bytes);
            }
            self.dirty_jobs.insert(*job);
        }
        let current = self.runs_here(*job, &name).then(|| self.jobs[job].attempts);
        if current != Some(*attempt) || !self.delivered.contains(&(idx, *job)) {
            // An earlier attempt's exit (it was stopped after the job was requeued): it
            // never ends the attempt that runs now.
            if let Some(j) = self.jobs.get_mut(job) {
                j.note(
                    now,
                    format!("attempt {attempt} ended on {name} with code {code}"),
                );
                self.dirty_jobs.insert(*job);
            }
            return Ok(());
        }
        if *fenced {
            // It did not end: it lost its node (the server restarted too, so its lease
            // had not run out here). Like a node failure for this one job.
            if let Some(j) = self.jobs.get_mut(job) {
                j.note(
                    now,
                    format!("stopped on {name} by its supervisor: the node's lease ran out while it could not reach the server"),
                );
            }
            let actions = self.step(now, Event::JobLost(JobId(*job)))?;
            self.apply(now, actions);
            return Ok(());
        }
        let Some(j) = self.jobs.get_mut(job) else {
            return Ok(());
        };
        j.note(
            now,
            format!(
                "exited with code {code} on {name}{}",
                if *stopped { " (stopped by perch)" } else { "" }
            ),
        );
        self.dirty_jobs.insert(*job);
        // A job on several nodes ends when all its ranks have ended, or at once when
        // one fails: perch stops the others and names the failing rank.
        let ranks = j.placement.len();
        let rank = j.placement.iter().position(|p| p.node == name);
        let mut failed_rank = None;
        if let (true, Some(rank)) = (ranks > 1, rank) {
            j.placement[rank].exit_code = Some(*code);
            if *code == 0 {
                let left = j.placement.iter().filter(|p| p.exit_code.is_none()).count();
                if left > 0 {
                    j.note(
                        now,
                        format!("rank {rank} finished on {name}; waiting for {left} more of {ranks} ranks"),
                    );
                    return Ok(());
                }
            } else {
                failed_rank = Some(format!(
                    "rank {rank} of {ranks} (on {name}) {}; perch stopped the other ranks",
                    match (error, reason) {
                        (Some(why), _) => format!("could not start: {why}"),
                        (None, Some(why)) => format!("was stopped: {why}"),
                        (None, None) => format!("exited with code {code}"),
                    }
                ));
            }
        }
        j.exit_code = Some(*code);
        let actions = self.step(
            now,
            Event::JobExited {
                job: JobId(*job),
                code: *code,
            },
        )?;
        self.apply(now, actions);
        if let Some(j) = self.jobs.get_mut(job) {
            if let Some(why) = failed_rank {
                j.reason = Some(why);
            } else if let Some(why) = error {
                j.reason = Some(format!("could not start on {name}: {why}"));
            } else if let Some(why) = reason {
                j.reason = Some(format!("stopped on {name}: {why}"));
            }
        }
        Ok(())
    }

    /// Stop orders for the processes node `name` runs that the server does not expect there
    /// (a job that ended or moved, an attempt that is not the current one): no job runs twice.
    fn unexpected_runs(&self, name: &str, running: &[JobAttempt]) -> Vec<JobStop> {
        running
            .iter()
            .filter(|run| {
                !(self.runs_here(run.job, name)
                    && self.jobs.get(&run.job).map(|j| j.attempts) == Some(run.attempt))
            })
            .map(|run| {
                // Its GPUs may be another job's now: at most the preemption grace.
                let (signal, grace) = self.jobs.get(&run.job).map_or_else(
                    || ("SIGTERM".to_owned(), 10),
                    |j| {
                        let max = self.preemption_grace_max_secs();
                        (signal_of(&j.request), j.request.grace_secs.min(max))
                    },
                );
                JobStop {
                    job: run.job,
                    attempt: run.attempt,
                    signal,
                    grace_secs: grace,
                }
            })
            .collect()
    }

    /// Requeues (or fails, by the scheduler's rules) the jobs node `idx` was given but neither
    /// runs nor reports ended: its agent restarted and lost them.
    fn requeue_lost(
        &mut self,
        idx: usize,
        req: &SyncRequest,
        reported: &HashSet<JobAttempt>,
        now: i64,
    ) -> Result<(), ControlError> {
        let name = req.node.as_str();
        let exited: HashSet<JobAttempt> = req.exited.iter().map(JobExit::id).collect();
        // The jobs handed to this node, not every job: a sync's cost must not grow with the
        // queue (walking 20,000 pending jobs on each of 10,000 syncs a second).
        let lost: Vec<u64> = self
            .delivered
            .range((idx, 0)..=(idx, u64::MAX))
            .filter_map(|&(_, job)| self.jobs.get(&job))
            .filter(|j| j.state == JobState::Running && j.placement.iter().any(|p| p.node == name))
            .filter(|j| {
                let run = JobAttempt {
                    job: j.id,
                    attempt: j.attempts,
                };
                // A rank that ended (and whose exit the server has) is not lost.
                let ended_here = j
                    .placement
                    .iter()
                    .any(|p| p.node == name && p.exit_code.is_some());
                !reported.contains(&run) && !exited.contains(&run) && !ended_here
            })
            .map(|j| j.id)
            .collect();
        for job in lost {
            // Handling one lost job runs a scheduling pass, which may already have preempted
            // or requeued the next one: only a job still running here is lost.
            if !self.runs_here(job, name) || !self.delivered.contains(&(idx, job)) {
                continue;
            }
            if let Some(j) = self.jobs.get_mut(&job) {
                j.note(
                    now,
                    format!("processes lost on {name} (its agent restarted without them)"),
                );
            }
            let actions = self.step(now, Event::JobLost(JobId(job)))?;
            self.apply(now, actions);
        }
        Ok(())
    }

    /// The rendezvous port rank 0 of a multi-node job picked on node `name`: the first one for
    /// the running attempt is kept, and the other ranks' launches are queued with it.
    fn take_master_port(&mut self, name: &str, mp: &MasterPort, now: i64) {
        let Some(j) = self.jobs.get_mut(&mp.job) else {
            return;
        };
        let rank0_here = j.placement.first().is_some_and(|p| p.node == name);
        if j.state != JobState::Running
            || j.attempts != mp.attempt
            || !rank0_here
            || j.master_port.is_some()
            || mp.port == 0
        {
            return;
        }
        j.master_port = Some(mp.port);
        j.note(now, format!("rendezvous port {} picked on {name}", mp.port));
        self.dirty_jobs.insert(mp.job);
        self.queue_launches(mp.job);
    }

    /// Hands node `idx` the orders queued for it. A stop that ended or moved a job goes before
    /// a stop of the same attempt found in this sync (it carries the job's checkpoint signal),
    /// and each attempt gets one stop.
    fn hand_over_orders(&mut self, idx: usize, response: &mut SyncResponse) {
        if let Some(out) = self.outbox.remove(&idx) {
            let name = &self.nodes[idx].record.name;
            for launch in &out.start {
                self.delivered.insert((idx, launch.job));
                if let Some(j) = self.jobs.get_mut(&launch.job) {
                    for p in j.placement.iter_mut().filter(|p| &p.node == name) {
                        p.delivered = true;
                    }
                    self.dirty_jobs.insert(launch.job);
                }
            }
            response.start = out.start;
            let found = std::mem::replace(&mut response.stop, out.stop);
            response.stop.extend(found);
        }
        let mut seen = HashSet::new();
        response.stop.retain(|s| seen.insert((s.job, s.attempt)));
    }

    /// Whether job `job` is running with part of its placement on node `name`.
    pub(super) fn runs_here(&self, job: u64, name: &str) -> bool {
        self.jobs.get(&job).is_some_and(|j| {
            j.state == JobState::Running && j.placement.iter().any(|p| p.node == name)
        })
    }

    /// Follows an agent's report of its node's NVLink islands and sharing setting (they may
    /// change when the agent restarts with new settings, or become known later).
    pub(super) fn update_node_features(
        &mut self,
        idx: usize,
        req: &SyncRequest,
        now: i64,
    ) -> Result<(), ControlError> {
        let islands = reported_islands(req);
        let rack = reported_rack(req);
        let mig = reported_mig(req);
        if self.nodes[idx].record.mig_instances != mig {
            self.scheduler.set_mig(NodeId(idx as u32), mig_spec(&mig))?;
            let name = self.nodes[idx].record.name.clone();
            let what = format!(
                "{name}'s agent reports {} MIG instances ({}); later placements follow them",
                mig.len(),
                mig_summary(&mig)
            );
            self.nodes[idx].record.mig_instances = mig;
            self.dirty_nodes.insert(idx);
            self.node_event(now, idx, "node_mig_changed", "perch", what);
        }
        let record = &self.nodes[idx].record;
        if record.nvlink_islands == islands
            && record.gpu_sharing == req.gpu_sharing
            && record.rack == rack
        {
            return Ok(());
        }
        let moved = (record.rack != rack).then(|| (record.rack.clone(), rack.clone()));
        self.scheduler.handle(
            now,
            Event::UpdateNode {
                node: NodeId(idx as u32),
                nvlink_islands: islands.clone(),
                sharing: req.gpu_sharing,
                rack: Some(rack.clone()),
            },
        )?;
        let record = &mut self.nodes[idx].record;
        record.nvlink_islands = islands;
        record.gpu_sharing = req.gpu_sharing;
        record.rack = rack;
        if let Some((from, to)) = moved {
            let name = self.nodes[idx].record.name.clone();
            self.node_event(
                now,
                idx,
                "node_topology_changed",
                "perch",
                format!(
                    "{name}'s agent reports rack {to} (was {from}); later placements follow it"
                ),
            );
        }
        self.dirty_nodes.insert(idx);
        Ok(())
    }
}

/// The MIG instances an agent reported that the scheduler can place on: on a GPU the node
/// has, of a profile `<n>g.<m>gb` (others, such as `1g.10gb+me`, are left out), each UUID once.
fn reported_mig(req: &SyncRequest) -> Vec<perch_model::control::MigInstance> {
    let mut seen = HashSet::new();
    req.mig_instances
        .iter()
        .filter(|m| {
            m.gpu < req.gpus
                && perch_model::control::mig_profile_slices(&m.profile).is_some()
                && seen.insert(m.uuid.clone())
        })
        .cloned()
        .collect()
}

/// The scheduler's view of MIG instances.
pub(super) fn mig_spec(
    mig: &[perch_model::control::MigInstance],
) -> Vec<perch_scheduler::MigInstance> {
    mig.iter()
        .map(|m| perch_scheduler::MigInstance {
            gpu: m.gpu,
            profile: m.profile.clone(),
            uuid: m.uuid.clone(),
        })
        .collect()
}

/// "GPU 0: 3g.40gb, 4g.40gb" for an event.
fn mig_summary(mig: &[perch_model::control::MigInstance]) -> String {
    let mut by_gpu: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for m in mig {
        by_gpu.entry(m.gpu).or_default().push(&m.profile);
    }
    by_gpu
        .iter()
        .map(|(g, p)| format!("GPU {g}: {}", p.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The rack (topology label) a node's agent reports; "default" when it names none.
fn reported_rack(req: &SyncRequest) -> String {
    // A label must be a name (letters, digits, '.', '_', '-'); anything else is ignored, as
    // the agent's own configuration check would have refused it.
    req.rack
        .clone()
        .filter(|r| perch_model::NodeId::new(r.as_str()).is_ok())
        .unwrap_or_else(|| "default".into())
}

/// The NVLink islands an agent reported, or none (one island) when they name a GPU the node
/// does not have or a GPU twice: a bad report must not keep the node out of the cluster.
fn reported_islands(req: &SyncRequest) -> Vec<Vec<u32>> {
    let islands = req.nvlink_islands.clone().unwrap_or_default();
    let mut seen = BTreeSet::new();
    let valid = islands
        .iter()
        .all(|i| !i.is_empty() && i.iter().all(|&g| g < req.gpus && seen.insert(g)));
    if valid {
        islands
    } else {
        tracing::warn!(node = %req.node, ?islands, gpus = req.gpus, "agent reported invalid NVLink islands; treating the node as one island");
        Vec::new()
    }
}
