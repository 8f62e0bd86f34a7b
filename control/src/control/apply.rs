//! Carrying out the scheduling core's actions: launch and stop orders queued per node,
//! record changes, and a multi-node job's rendezvous (rank 0 first, then the others).

use super::*;

impl Control {
    /// The longest grace a job stopped for another job's sake gets, in seconds.
    pub(super) fn preemption_grace_max_secs(&self) -> u64 {
        u64::try_from(self.config.policy.preemption_grace_max / 1000).unwrap_or(0)
    }

    /// Sends the stop of job `id`'s current attempt to each of its nodes: its checkpoint
    /// signal, then SIGKILL after its grace, at most `grace_max_secs` when given.
    pub(super) fn stop_everywhere(&mut self, id: u64, grace_max_secs: Option<u64>) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let grace_secs = grace_max_secs.map_or(job.request.grace_secs, |max| {
            job.request.grace_secs.min(max)
        });
        let stop = JobStop {
            job: id,
            attempt: job.attempts,
            signal: signal_of(&job.request),
            grace_secs,
        };
        let nodes: Vec<usize> = job
            .placement
            .iter()
            .filter_map(|p| self.node_index.get(&p.node).copied())
            .collect();
        let mut stopping = Vec::new();
        for n in nodes {
            let out = self.outbox.entry(n).or_default();
            out.start.retain(|l| l.job != id);
            out.stop.push(stop.clone());
            // An agent handed the launch may run it until it gets this stop; one past its
            // lease has stopped it already.
            if self.delivered.remove(&(n, id)) && !self.nodes[n].lease_expired {
                stopping.push(StoppingRun {
                    node: self.nodes[n].record.name.clone(),
                    attempt: stop.attempt,
                });
            }
        }
        if !stopping.is_empty()
            && let Some(job) = self.jobs.get_mut(&id)
        {
            job.stopping.extend(stopping);
            self.stopping_jobs.insert(id);
            self.dirty_jobs.insert(id);
        }
    }

    /// Node `idx` no longer runs the stopping attempts it does not report in `running`
    /// (`None`: it runs nothing, its lease having run out). A job whose earlier attempts are
    /// all confirmed gone gets its launch orders.
    pub(super) fn confirm_stops(
        &mut self,
        idx: usize,
        running: Option<&HashSet<JobAttempt>>,
        now: i64,
    ) {
        let name = self.nodes[idx].record.name.clone();
        let mut cleared = Vec::new();
        for &id in &self.stopping_jobs {
            let Some(job) = self.jobs.get_mut(&id) else {
                cleared.push(id);
                continue;
            };
            let before = job.stopping.len();
            job.stopping.retain(|s| {
                s.node != name
                    || running.is_some_and(|r| {
                        r.contains(&JobAttempt {
                            job: id,
                            attempt: s.attempt,
                        })
                    })
            });
            if job.stopping.len() != before {
                self.dirty_jobs.insert(id);
            }
            if job.stopping.is_empty() {
                cleared.push(id);
            }
        }
        for id in cleared {
            self.stopping_jobs.remove(&id);
            if self
                .jobs
                .get(&id)
                .is_some_and(|j| j.state == JobState::Running)
            {
                if let Some(j) = self.jobs.get_mut(&id) {
                    j.note(now, "its earlier attempt has stopped; launching".to_owned());
                }
                self.queue_launches(id);
            }
        }
    }

    pub(super) fn apply(&mut self, now: i64, actions: Vec<Action>) {
        for action in actions {
            tracing::debug!(?action, "scheduler action");
            match action {
                Action::Start { job, placement } => self.start(now, job.0, &placement),
                Action::Preempt {
                    job,
                    reason,
                    requeued,
                } => {
                    // The GPUs go to another job: the job's own grace, at most the operator's
                    // `preemption_grace_max` (a borrower declaring an hour's grace held an
                    // account's guaranteed GPUs for that hour).
                    let max = self.preemption_grace_max_secs();
                    self.stop_everywhere(job.0, Some(max));
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        j.preemptions += 1;
                        let capped = if j.request.grace_secs > max {
                            format!(
                                "; grace {max} s, not its own {} s (scheduler.preemption_grace_max)",
                                j.request.grace_secs
                            )
                        } else {
                            String::new()
                        };
                        j.note(
                            now,
                            format!(
                                "preempted ({reason}){}{capped}",
                                if requeued { ", requeued" } else { "" }
                            ),
                        );
                        if requeued {
                            j.state = JobState::Pending;
                        } else {
                            j.state = JobState::Preempted;
                            j.end_ms = Some(now);
                            j.reason = Some(format!("preempted: {reason}"));
                        }
                    }
                    self.dirty_jobs.insert(job.0);
                    self.close_allocations(job.0, now);
                    let outcome = if requeued { "requeued" } else { "ended" };
                    self.job_event(
                        now,
                        job.0,
                        "job_preempted",
                        "perch",
                        Some(outcome),
                        format!("job {} preempted ({reason}), {outcome}", job.0),
                    );
                    if !requeued {
                        self.job_event(
                            now,
                            job.0,
                            "job_ended",
                            "perch",
                            Some(JobState::Preempted.as_str()),
                            format!("job {} ended: preempted ({reason})", job.0),
                        );
                    }
                }
                Action::Requeue { job, reason } => {
                    self.stop_everywhere(job.0, None);
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        j.requeues += 1;
                        j.state = JobState::Pending;
                        j.note(now, format!("requeued ({reason})"));
                    }
                    self.dirty_jobs.insert(job.0);
                    self.close_allocations(job.0, now);
                    self.job_event(
                        now,
                        job.0,
                        "job_requeued",
                        "perch",
                        None,
                        format!("job {} requeued ({reason})", job.0),
                    );
                }
                Action::End { job, state } => {
                    let was_running = self
                        .jobs
                        .get(&job.0)
                        .is_some_and(|j| j.state == JobState::Running);
                    if was_running {
                        self.stop_everywhere(job.0, None);
                    }
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        let (s, reason, code) = match state {
                            EndState::Completed => (JobState::Completed, None, Some(0)),
                            EndState::Failed { code } => (
                                JobState::Failed,
                                Some(format!("exited with code {code}")),
                                Some(code),
                            ),
                            EndState::Cancelled => {
                                (JobState::Cancelled, Some("cancelled".to_owned()), None)
                            }
                            EndState::Timeout => (
                                JobState::Timeout,
                                Some(format!(
                                    "ran past its time limit of {} s",
                                    j.request.time_limit_secs
                                )),
                                None,
                            ),
                            EndState::NodeFail => (
                                JobState::NodeFail,
                                Some(
                                    "its node stopped reporting and no requeues were left"
                                        .to_owned(),
                                ),
                                None,
                            ),
                            EndState::Preempted => {
                                (JobState::Preempted, Some("preempted".to_owned()), None)
                            }
                        };
                        j.state = s;
                        j.reason = reason;
                        if j.exit_code.is_none() {
                            j.exit_code = code;
                        }
                        j.end_ms = Some(now);
                        j.note(now, s.as_str());
                    }
                    self.dirty_jobs.insert(job.0);
                    if was_running {
                        self.close_allocations(job.0, now);
                    }
                    self.job_ended_event(now, job.0, state == EndState::Cancelled);
                }
                Action::IdleReport { job, since } => {
                    let Some(record) = self.jobs.get(&job.0) else {
                        continue;
                    };
                    let (next, _) = self.idle_consequence(record, since);
                    let since_text = perch_model::timefmt::rfc3339(since);
                    let what = format!("all its GPUs idle since {since_text}. {next}");
                    if let Some(j) = self.jobs.get_mut(&job.0) {
                        j.note(now, what.clone());
                    }
                    self.dirty_jobs.insert(job.0);
                    self.job_event(
                        now,
                        job.0,
                        "job_idle",
                        "perch",
                        None,
                        format!("job {}: {what}", job.0),
                    );
                }
            }
        }
    }

    pub(super) fn start(&mut self, now: i64, id: u64, placement: &[NodeAlloc]) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        job.state = JobState::Running;
        job.start_ms = Some(now);
        job.end_ms = None;
        job.attempts += 1;
        job.reason = None;
        job.master_port = None;
        job.placement = placement
            .iter()
            .filter_map(|a| {
                self.nodes.get(a.node.0 as usize).map(|n| NodeGpus {
                    node: n.record.name.clone(),
                    gpus: a.gpu_indices(),
                    delivered: false,
                    exit_code: None,
                })
            })
            .collect();
        let where_ = job
            .placement
            .iter()
            .map(|p| format!("{}{:?}", p.node, p.gpus))
            .collect::<Vec<_>>()
            .join(" ");
        let attempt = job.attempts;
        job.note(now, format!("started on {where_} (attempt {attempt})"));
        if !job.stopping.is_empty() {
            let nodes: Vec<&str> = job.stopping.iter().map(|s| s.node.as_str()).collect();
            job.note(
                now,
                format!(
                    "its launch waits until its earlier attempt is confirmed stopped on {} (at the latest when that node's lease runs out)",
                    nodes.join(", ")
                ),
            );
        }
        self.dirty_jobs.insert(id);
        self.open_allocations(id, now);
        self.job_event(
            now,
            id,
            "job_started",
            "perch",
            None,
            format!("job {id} started on {where_} (attempt {attempt})"),
        );
        self.queue_launches(id);
    }

    /// What distributed training needs on rank `rank` of job `id`, without a wrapper: for
    /// `torch.distributed` (`env://`), DeepSpeed and Horovod `MASTER_ADDR` (rank 0's advertised
    /// address), `MASTER_PORT`, `WORLD_SIZE` (GPUs in the job: one process per GPU),
    /// `NODE_RANK`, `RANK` (the global rank of this node's first process),
    /// `LOCAL_WORLD_SIZE` (GPUs here); `PERCH_NODELIST` (the nodes, comma-separated, rank
    /// order) and `PERCH_NODE_ADDRS` (their addresses); and `torchrun`'s own `PET_*` defaults,
    /// so `torchrun train.py` starts the right number of processes on every node.
    ///
    /// The port is `port` ([`Control::rendezvous_port`]); without one (rank 0, whose agent
    /// picks it) `MASTER_PORT` is left to the agent.
    pub(super) fn distributed_env(
        &self,
        id: u64,
        rank: usize,
        port: Option<String>,
    ) -> Vec<(String, String)> {
        let Some(job) = self.jobs.get(&id) else {
            return Vec::new();
        };
        let addr_of = |node: &str| {
            self.node_index
                .get(node)
                .and_then(|&i| self.nodes[i].addr.clone())
                .unwrap_or_else(|| node.to_owned())
        };
        let names: Vec<&str> = job.placement.iter().map(|p| p.node.as_str()).collect();
        let addrs: Vec<String> = names.iter().map(|n| addr_of(n)).collect();
        let local = job.placement.get(rank).map_or(0, |p| p.gpus.len());
        let world: usize = job.placement.iter().map(|p| p.gpus.len()).sum();
        let first_rank: usize = job.placement[..rank.min(job.placement.len())]
            .iter()
            .map(|p| p.gpus.len())
            .sum();
        let master = addrs.first().cloned().unwrap_or_else(|| "127.0.0.1".into());
        let nnodes = job.placement.len();
        [
            ("MASTER_ADDR", Some(master.clone())),
            ("MASTER_PORT", port.clone()),
            ("WORLD_SIZE", Some(world.to_string())),
            ("NODE_RANK", Some(rank.to_string())),
            ("RANK", Some(first_rank.to_string())),
            ("LOCAL_WORLD_SIZE", Some(local.to_string())),
            ("PERCH_NODELIST", Some(names.join(","))),
            ("PERCH_NODE_ADDRS", Some(addrs.join(","))),
            ("PET_NNODES", Some(nnodes.to_string())),
            ("PET_NODE_RANK", Some(rank.to_string())),
            ("PET_NPROC_PER_NODE", Some(local.max(1).to_string())),
            ("PET_MASTER_ADDR", Some(master)),
            ("PET_MASTER_PORT", port),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_owned(), v?)))
        .collect()
    }

    /// Job `id`'s rendezvous port: its own `MASTER_PORT`, or the one its rank-0 node picked
    /// ([`JobRecord::master_port`]); `None` while that node has not reported it.
    pub(super) fn rendezvous_port(&self, id: u64) -> Option<String> {
        let job = self.jobs.get(&id)?;
        match job.request.env.get("MASTER_PORT") {
            Some(own) => Some(own.clone()),
            None => job.master_port.map(|p| p.to_string()),
        }
    }

    /// The hostfile of job `id` (MPI's `addr slots=N`, rank order).
    pub(super) fn hosts(&self, id: u64) -> Vec<LaunchHost> {
        let Some(job) = self.jobs.get(&id) else {
            return Vec::new();
        };
        job.placement
            .iter()
            .map(|p| LaunchHost {
                addr: self
                    .node_index
                    .get(&p.node)
                    .and_then(|&i| self.nodes[i].addr.clone())
                    .unwrap_or_else(|| p.node.clone()),
                slots: u32::try_from(p.gpus.len()).unwrap_or(u32::MAX).max(1),
            })
            .collect()
    }

    /// Queues the launch orders of a running job for every node of its placement whose
    /// agent has not been handed one yet. Unless the job chose its own `MASTER_PORT`, rank 0
    /// goes first and its agent picks a free port there; the other ranks are queued once
    /// that port is known (their agents' next sync after rank 0's).
    pub(super) fn queue_launches(&mut self, id: u64) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        if !job.stopping.is_empty() {
            // [`Control::confirm_stops`] queues them once the earlier attempt is gone.
            return;
        }
        let port = self.rendezvous_port(id);
        let hosts = self.hosts(id);
        for (rank, p) in job.placement.iter().enumerate() {
            let Some(&node) = self.node_index.get(&p.node) else {
                continue;
            };
            let queued = self.outbox.get(&node).is_some_and(|o| {
                o.start
                    .iter()
                    .any(|l| l.job == id && l.attempt == job.attempts)
            });
            if p.delivered || queued || (rank > 0 && port.is_none()) {
                continue;
            }
            let mut env = job.request.env.clone();
            env.insert("PERCH_JOB_ID".into(), id.to_string());
            env.insert("PERCH_JOB_ATTEMPT".into(), job.attempts.to_string());
            // The SDK's header syntax percent-encodes values: "Bearer%20<token>".
            let token = self.job_tokens.token(id, job.attempts);
            env.insert(
                "OTEL_EXPORTER_OTLP_HEADERS".into(),
                format!("authorization=Bearer%20{token}"),
            );
            if let Some(name) = &job.request.name {
                env.insert("PERCH_JOB_NAME".into(), name.clone());
            }
            for (key, value) in self.distributed_env(id, rank, port.clone()) {
                // The job's own value wins (a port of its choosing, say).
                env.entry(key).or_insert(value);
            }
            let launch = JobLaunch {
                job: id,
                attempt: job.attempts,
                command: job.request.command.clone(),
                env,
                workdir: job.request.workdir.clone(),
                gpus: p.gpus.clone(),
                user: job.request.user().to_owned(),
                node_rank: rank as u32,
                nodes: job.request.nodes,
                time_limit_secs: job.request.time_limit_secs,
                checkpoint_signal: signal_of(&job.request),
                grace_secs: job.request.grace_secs,
                sim_profile: job.request.sim_profile.clone(),
                gpu_share: job.request.gpu_share.as_ref().map(|s| LaunchShare {
                    percent: s.percent(),
                    memory_mb: s.memory_mb(),
                }),
                gpu_mig: job.request.gpu_profile.as_ref().and_then(|_| {
                    self.scheduler
                        .cluster()
                        .mig_instance_of(
                            perch_scheduler::NodeId(node as u32),
                            perch_scheduler::JobId(id),
                        )
                        .map(|m| perch_model::control::LaunchMig {
                            uuid: m.uuid.clone(),
                            profile: m.profile.clone(),
                        })
                }),
                cpus: job.request.cpus,
                memory_mb: job.request.memory_mb,
                pick_master_port: port.is_none(),
                hosts: hosts.clone(),
            };
            self.outbox.entry(node).or_default().start.push(launch);
        }
    }
}
