//! Rebuilding the control plane from the job database at start: nodes, then jobs in their
//! states (pending ones to the core, running ones restored on their placement, launch orders
//! never handed over queued again).

use super::*;

impl Control {
    /// Rebuilds the control plane from the records of the job database `db` (its nodes and
    /// their history `loaded` from it); `dir` holds job logs. Settled jobs are read one at a
    /// time and only their summaries kept ([`archive`]).
    pub fn open(
        dir: &std::path::Path,
        config: JobsConfig,
        now_ms: i64,
        loaded: Loaded,
        db: &std::sync::Arc<dyn crate::store::JobStore>,
    ) -> Result<Control, ControlError> {
        let Loaded { nodes, node_spans } = loaded;
        let mut c = Control {
            scheduler: Scheduler::new(Cluster::new(), config.policy.clone()),
            jobs: BTreeMap::new(),
            nodes: Vec::new(),
            node_index: HashMap::new(),
            next_id: 1,
            outbox: HashMap::new(),
            delivered: BTreeSet::new(),
            dirty_jobs: BTreeSet::new(),
            dirty_nodes: BTreeSet::new(),
            held: BTreeSet::new(),
            stopping_jobs: BTreeSet::new(),
            known_nodes: Arc::default(),
            claims: Arc::new(super::super::claims::NodeClaims::new(
                config.heartbeat_timeout,
            )),
            now: now_ms,
            logs_dir: dir.join("logs"),
            config,
            ledger: ledger::Ledger::default(),
            acting: None,
            job_tokens: JobTokens::load_or_create(dir).map_err(ControlError::Logs)?,
            pending: PendingCount::default(),
            reserved: HashMap::new(),
            archive: archive::Archive::new(db.clone()),
            deleted_output: Vec::new(),
            provenance: Vec::new(),
            output_usage: Default::default(),
            validations: Default::default(),
            passes: PassStats::default(),
        };
        for record in nodes {
            // Agents get one heartbeat timeout from now to come back.
            c.add_node(record, now_ms)?;
        }
        c.restore_spans(node_spans);
        let settled_before = now_ms.saturating_sub(crate::record::ARCHIVE_AFTER_MS);
        let (mut jobs, mut migrated, mut finished) = (Vec::new(), Vec::new(), History::default());
        let mut arrays = ArrayMigration::default();
        db.for_each_job(&mut |mut job| {
            c.next_id = c.next_id.max(job.id + 1);
            finished.add(&job);
            if arrays.visit(&mut job) {
                migrated.push(job.id);
                jobs.push(job);
            } else if job.is_settled(settled_before) {
                c.archive.insert(&job);
            } else {
                jobs.push(job);
            }
        })?;
        finished.replay(&mut c.scheduler);
        for idx in 0..c.nodes.len() {
            // Up from now (the state the control plane starts them in), unless already so.
            c.track_node_state(idx, now_ms);
        }
        for mut job in jobs {
            let mut spec = spec_of(job.id, &job.request, job.submit_ms);
            // Runs before this one (a running job's own run is not an earlier one).
            spec.earlier_runs = match job.state {
                JobState::Running => job.attempts.saturating_sub(1),
                _ => job.attempts,
            };
            let result = match job.state {
                JobState::Pending if c.dependencies(&job.request) != Deps::Met => {
                    c.held.insert(job.id);
                    Ok(())
                }
                JobState::Pending => c.scheduler.handle(now_ms, Event::Submit(spec)).map(|_| ()),
                JobState::Running => {
                    let placement = c.placement_of(&job);
                    let start = job.start_ms.unwrap_or(now_ms);
                    let restored = c.scheduler.handle(
                        now_ms,
                        Event::Restore {
                            spec,
                            placement,
                            start,
                            requeues: job.requeues,
                        },
                    );
                    for p in job.placement.iter().filter(|p| p.delivered) {
                        if let Some(&n) = c.node_index.get(&p.node) {
                            c.delivered.insert((n, job.id));
                        }
                    }
                    restored.map(|_| ())
                }
                _ => Ok(()),
            };
            let failed = result.err().map(|e| e.to_string());
            if let Some(e) = &failed {
                job.state = JobState::Failed;
                job.reason = Some(format!("could not be restored after a server restart: {e}"));
                job.end_ms = Some(now_ms);
                c.dirty_jobs.insert(job.id);
            }
            let resend = job.state == JobState::Running;
            let id = job.id;
            if !job.stopping.is_empty() {
                c.stopping_jobs.insert(id);
            }
            c.jobs.insert(id, job);
            if let Some(e) = failed {
                c.close_allocations(id, now_ms);
                c.job_event(
                    now_ms,
                    id,
                    "job_ended",
                    "perch",
                    Some("failed"),
                    format!("job {id} could not be restored after a server restart: {e}"),
                );
            }
            if resend {
                c.ensure_allocations(id);
                // Launch orders the old process queued but never handed over go out again.
                c.queue_launches(id);
            }
        }
        c.dirty_jobs.extend(migrated);
        c.refresh_fair_share(now_ms)?;
        for job in c.jobs.values() {
            c.pending.update(job);
        }
        c.measure_output();
        Ok(c)
    }

    pub(super) fn add_node(
        &mut self,
        record: NodeRecord,
        now_ms: i64,
    ) -> Result<usize, ControlError> {
        let spec = NodeSpec {
            name: NodeName(record.name.clone()),
            gpus: record.gpus,
            model: GpuModel(record.model.clone()),
            rack: record.rack.clone(),
            nvlink_islands: record.nvlink_islands.clone(),
            sharing: record.gpu_sharing,
            mig: super::sync::mig_spec(&record.mig_instances),
        };
        self.scheduler.handle(now_ms, Event::AddNode(spec))?;
        let idx = self.nodes.len();
        if record.drained {
            self.scheduler
                .handle(now_ms, Event::Drain(NodeId(idx as u32)))?;
        }
        self.node_index.insert(record.name.clone(), idx);
        self.known_nodes
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(record.name.clone());
        self.nodes.push(Node {
            record,
            last_sync_ms: now_ms,
            down: false,
            lease_expired: false,
            reporting_since_ms: now_ms,
            addr: None,
        });
        Ok(idx)
    }

    pub(super) fn placement_of(&self, job: &JobRecord) -> Vec<NodeAlloc> {
        job.placement
            .iter()
            .filter_map(|p| {
                let &n = self.node_index.get(&p.node)?;
                let mask = p.gpus.iter().fold(0u64, |m, g| m | (1u64 << g));
                Some(NodeAlloc {
                    node: NodeId(n as u32),
                    mask,
                })
            })
            .collect()
    }
}

/// The run times of jobs that completed or ended at their limit, for the core's history
/// prediction, replayed oldest end first: each run's span (its first start to its last end
/// over its nodes), summed over the runs. Kept small: a job database holds every job ever run.
#[derive(Default)]
struct History {
    users: Vec<User>,
    user_ids: HashMap<String, u32>,
    /// (end, job, user, GPUs in hundredths, run time, time limit).
    runs: Vec<(i64, u64, u32, u32, i64, i64)>,
}

impl History {
    fn add(&mut self, j: &JobRecord) {
        if !matches!(j.state, JobState::Completed | JobState::Timeout) {
            return;
        }
        let Some(end) = j.end_ms else { return };
        let ran = j
            .allocations
            .iter()
            .fold(BTreeMap::<u32, (i64, i64)>::new(), |mut runs, a| {
                let end = a.end_ms.or(j.end_ms).unwrap_or(a.start_ms);
                let r = runs.entry(a.attempt).or_insert((a.start_ms, end));
                *r = (r.0.min(a.start_ms), r.1.max(end));
                runs
            })
            .values()
            .map(|(start, end)| (end - start).max(0))
            .sum();
        let spec = spec_of(j.id, &j.request, j.submit_ms);
        let user = match self.user_ids.get(&spec.user.0) {
            Some(&user) => user,
            None => {
                let user = self.users.len() as u32;
                self.user_ids.insert(spec.user.0.clone(), user);
                self.users.push(spec.user.clone());
                user
            }
        };
        self.runs
            .push((end, j.id, user, spec.gpu_hundredths(), ran, spec.time_limit));
    }

    fn replay(mut self, scheduler: &mut Scheduler) {
        self.runs.sort_unstable_by_key(|&(end, id, ..)| (end, id));
        for (_, _, user, gpus, ran, limit) in self.runs {
            scheduler.remember_finished_run(&self.users[user as usize], gpus, ran, limit);
        }
    }
}

/// Gives the array tasks of a job database written before records named their array their
/// [`ArrayTask`], from what those tasks were submitted with: `PERCH_ARRAY_JOB_ID` and
/// `PERCH_ARRAY_TASK_ID` in their environment and `name[task]` as their name. A user may set
/// those in a job of their own, so a task counts only where the server's ids agree (its id is
/// the array's plus its index) and the array's first task is the same user's. Jobs are
/// visited in id order, so an array's first task comes before the others.
#[derive(Default)]
struct ArrayMigration {
    /// The first tasks seen, and their users.
    firsts: HashMap<u64, String>,
}

impl ArrayMigration {
    /// Gives `job` its task if it is one; true if it was given one.
    fn visit(&mut self, job: &mut JobRecord) -> bool {
        let claimed = || -> Option<ArrayTask> {
            let env = |k: &str| job.request.env.get(k).map(String::as_str);
            let task = ArrayTask {
                job_id: env("PERCH_ARRAY_JOB_ID")?.parse().ok()?,
                task_id: env("PERCH_ARRAY_TASK_ID")?.parse().ok()?,
            };
            let name = job.request.name.as_deref()?;
            (job.array.is_none()
                && task.job_id.checked_add(u64::from(task.task_id)) == Some(job.id)
                && name.ends_with(&format!("[{}]", task.task_id)))
            .then_some(task)
        };
        let Some(task) = claimed() else {
            return false;
        };
        if task.task_id == 0 {
            self.firsts.insert(job.id, job.request.user().to_owned());
        }
        if self.firsts.get(&task.job_id).map(String::as_str) == Some(job.request.user()) {
            job.array = Some(task);
            return true;
        }
        false
    }
}

/// [`ArrayMigration`] over `jobs` (in id order); returns the jobs given a task.
#[cfg(test)]
fn restore_arrays(jobs: &mut [JobRecord]) -> Vec<u64> {
    let mut arrays = ArrayMigration::default();
    jobs.iter_mut()
        .filter_map(|j| arrays.visit(j).then_some(j.id))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: u64, user: &str, name: &str, env: &[(&str, &str)]) -> JobRecord {
        let env: BTreeMap<&str, &str> = env.iter().copied().collect();
        serde_json::from_value(serde_json::json!({
            "id": id, "state": "pending", "reason": null, "submit_ms": 0, "start_ms": null,
            "end_ms": null, "placement": [], "attempts": 0, "requeues": 0, "preemptions": 0,
            "exit_code": null, "timeline": [],
            "request": { "command": ["x"], "user": user, "name": name, "env": env },
        }))
        .expect("record")
    }

    /// Records written before tasks named their array get it from their environment and
    /// name, only where the server's ids agree and the array's first task is the same user's:
    /// a job of one's own that claims to be a task of another user's array is not one.
    #[test]
    fn array_tasks_of_an_older_database_are_known_by_what_the_server_gave_them() {
        let task = |id: u64, user: &str, array: u64, task: u32| {
            let (a, t) = (array.to_string(), task.to_string());
            let env = [
                ("PERCH_ARRAY_JOB_ID", a.as_str()),
                ("PERCH_ARRAY_TASK_ID", t.as_str()),
            ];
            record(id, user, &format!("sweep[{task}]"), &env)
        };
        let mut jobs = vec![
            task(10, "alice", 10, 0),
            task(11, "alice", 10, 1),
            task(12, "alice", 10, 2),
            // Claims a place its id does not have.
            task(13, "alice", 10, 5),
            // Another user's job dressed as a task of alice's array.
            task(15, "bob", 10, 5),
            // A single job with no array variables.
            record(16, "bob", "plain", &[]),
        ];
        let migrated = restore_arrays(&mut jobs);
        assert_eq!(migrated, vec![10, 11, 12]);
        let arrays: Vec<Option<(u64, u32)>> = jobs
            .iter()
            .map(|j| j.array.map(|t| (t.job_id, t.task_id)))
            .collect();
        assert_eq!(
            arrays,
            vec![
                Some((10, 0)),
                Some((10, 1)),
                Some((10, 2)),
                None,
                None,
                None
            ]
        );
        // Run again (the next start), nothing more is given one.
        assert!(restore_arrays(&mut jobs).is_empty());
    }
}
