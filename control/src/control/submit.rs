//! Submissions and cancels: the checks a submission passes (fields, accounts, the pending
//! cap), dependencies that hold a job back, arrays added in steps.

use super::*;

/// How a job depended on ended: the job (for an array, the first task that did not
/// complete, else task 0) and its final state; `None` while it has not ended.
type Outcome = Option<(u64, JobState)>;

impl Control {
    /// Submits a job, or `array` copies of it, in one step; returns the records in id order.
    /// The server submits through [`Control::start_array`] and steps of
    /// [`Control::submit_array_tasks`] (see `JobService::submit`); tests at a chosen time
    /// through this.
    #[cfg(any(test, feature = "testing"))]
    pub fn submit(
        &mut self,
        request: JobRequest,
        now: i64,
    ) -> Result<Vec<JobRecord>, ControlError> {
        let Some(count) = request.array else {
            self.check_submission(&request, now)?;
            let id = self.next_id;
            self.submit_one(request, id, None, now, Pass::Now)?;
            self.next_id += 1;
            self.release_held(now)?;
            return Ok(self.view(id)?.into_iter().collect());
        };
        let first = self.start_array(&request, now)?;
        self.submit_array_tasks(&request, first, 0..count, now)?;
        let mut jobs = Vec::new();
        for id in first..first + u64::from(count) {
            jobs.extend(self.view(id)?);
        }
        Ok(jobs)
    }

    /// Checks a submission of `request` (and all its array tasks) and reserves ids for it;
    /// returns the first. The tasks are then added by [`Control::submit_array_tasks`], in one
    /// or more steps: a 10,000-task array added at once held the control plane, and every
    /// agent's sync, for seconds.
    pub fn start_array(&mut self, request: &JobRequest, now: i64) -> Result<u64, ControlError> {
        self.check_submission(request, now)?;
        let count = request.array.unwrap_or(1) as usize;
        let reserved = self.reserved.entry(request.user().to_owned()).or_default();
        reserved.jobs += count;
        reserved.bytes += count * request.task_bytes();
        let count = count as u32;
        let first = self.next_id;
        self.next_id += u64::from(count);
        Ok(first)
    }

    /// Gives back `n` of the reserved array tasks of `request`'s user (added, or never to be).
    pub fn release_reservation(&mut self, request: &JobRequest, n: usize) {
        if let Some(r) = self.reserved.get_mut(request.user()) {
            r.jobs = r.jobs.saturating_sub(n);
            r.bytes = r.bytes.saturating_sub(n * request.task_bytes());
            if r.jobs == 0 {
                self.reserved.remove(request.user());
            }
        }
    }

    /// Adds array tasks `tasks` of `request`, whose ids start at `first` (from
    /// [`Control::start_array`]), with one scheduling pass for all of them. A request with no
    /// `array` is one job, task 0.
    pub fn submit_array_tasks(
        &mut self,
        request: &JobRequest,
        first: u64,
        tasks: std::ops::Range<u32>,
        now: i64,
    ) -> Result<(), ControlError> {
        self.now = now;
        for task in tasks.clone() {
            let mut r = request.clone();
            let added = if r.array.take().is_none() {
                // A single job: no array variables, no task name.
                self.submit_one(r, first, None, now, Pass::Later)
            } else {
                r.env.insert("PERCH_ARRAY_JOB_ID".into(), first.to_string());
                r.env.insert("PERCH_ARRAY_TASK_ID".into(), task.to_string());
                r.name = Some(format!(
                    "{}[{task}]",
                    request.name.as_deref().unwrap_or("array")
                ));
                let array = ArrayTask {
                    job_id: first,
                    task_id: task,
                };
                self.submit_one(r, first + u64::from(task), Some(array), now, Pass::Later)
            };
            match added {
                // Pending now (counted once this operation's changes are taken).
                Ok(()) => self.release_reservation(request, 1),
                Err(e) => {
                    self.release_reservation(request, (tasks.end - task) as usize);
                    return Err(e);
                }
            }
        }
        let actions = self.pass(now);
        self.apply(now, actions);
        self.release_held(now)
    }

    /// Refuses a submission that is invalid, names a job that does not exist, or would take
    /// its user past the pending cap.
    pub(super) fn check_submission(
        &mut self,
        request: &JobRequest,
        now: i64,
    ) -> Result<(), ControlError> {
        request.validate()?;
        self.now = now;
        for (field, deps) in [
            ("after_ok", &request.after_ok),
            ("after_any", &request.after_any),
            ("after_not_ok", &request.after_not_ok),
        ] {
            if let Some(missing) = deps.iter().find(|&&d| self.find(d).is_none()) {
                return Err(ControlError::Invalid(FieldError {
                    field,
                    message: format!("no job {missing}; `perch jobs --all` lists them"),
                }));
            }
        }
        self.check_quota(request, now)?;
        let adding = request.array.map_or(1, |n| n as usize);
        let user = request.user();
        let (pending, reserved) = (self.pending.of(user), self.reserved.get(user));
        let reserved = reserved.copied().unwrap_or_default();
        let jobs = pending.jobs + reserved.jobs;
        if jobs + adding > self.config.max_pending_per_user {
            return Err(ControlError::TooManyPending {
                user: user.to_owned(),
                pending: jobs,
                adding,
                limit: self.config.max_pending_per_user,
            });
        }
        let (bytes, adding) = (
            pending.bytes + reserved.bytes,
            adding * request.task_bytes(),
        );
        if bytes + adding > self.config.max_pending_bytes_per_user {
            return Err(ControlError::TooManyPendingBytes {
                user: user.to_owned(),
                pending: bytes,
                adding,
                limit: self.config.max_pending_bytes_per_user,
            });
        }
        Ok(())
    }

    /// Refuses a job that asks, on its own, for more than its account's quota unless it can
    /// borrow: it could only ever run on other accounts' idle GPUs, which they take back when
    /// they need them, so it must be preemptible and borrowing on. Accepted, a job that may
    /// not be preempted and borrowed anyway held another account's guaranteed GPUs until its
    /// time limit (the CLI submits jobs not preemptible unless told).
    fn check_quota(&self, request: &JobRequest, now: i64) -> Result<(), ControlError> {
        let Some(over) = self.scheduler.beyond_quota(&spec_of(0, request, now)) else {
            return Ok(());
        };
        let (field, message) = if !self.config.policy.borrowing {
            (
                "gpus_per_node",
                format!(
                    "the job {over}, and borrowing is off (scheduler.borrowing), so it could \
                     never start: ask for fewer GPUs, or ask an operator to raise the quota"
                ),
            )
        } else if !request.preemptible {
            (
                "preemptible",
                format!(
                    "the job {over}, so it can only run on idle GPUs borrowed from other \
                     accounts, which take them back when they need them: resubmit it \
                     preemptible (`perch submit --preemptible`, or \"preemptible\": true), or \
                     ask for fewer GPUs, or ask an operator to raise the quota"
                ),
            )
        } else {
            return Ok(());
        };
        Err(ControlError::Invalid(FieldError { field, message }))
    }

    /// Whether a job's dependencies allow it to be scheduled.
    pub(super) fn dependencies(&self, request: &JobRequest) -> Deps {
        self.dependencies_with(request, &mut HashMap::new())
    }

    /// [`Control::dependencies`], with the outcomes of the jobs depended on kept in `seen`
    /// (an array's takes a walk over its tasks: one walk for all its dependents).
    fn dependencies_with(&self, request: &JobRequest, seen: &mut HashMap<u64, Outcome>) -> Deps {
        let mut outcome = |id: u64| *seen.entry(id).or_insert_with(|| self.outcome(id));
        for &id in &request.after_ok {
            match outcome(id) {
                Some((_, JobState::Completed)) => {}
                Some((task, s)) if task == id => {
                    return Deps::Never(format!("job {id} ended {} (after_ok)", s.as_str()));
                }
                Some((task, s)) => {
                    return Deps::Never(format!(
                        "task {} (job {task}) of array {id} ended {} (after_ok)",
                        task - id,
                        s.as_str()
                    ));
                }
                None => return Deps::Waiting,
            }
        }
        for &id in &request.after_not_ok {
            match outcome(id) {
                Some((task, JobState::Completed)) if task == id && self.is_array(id) => {
                    return Deps::Never(format!(
                        "every task of array {id} completed (after_not_ok)"
                    ));
                }
                Some((_, JobState::Completed)) => {
                    return Deps::Never(format!("job {id} completed (after_not_ok)"));
                }
                Some(_) => {}
                None => return Deps::Waiting,
            }
        }
        if request.after_any.iter().any(|&id| outcome(id).is_none()) {
            return Deps::Waiting;
        }
        Deps::Met
    }

    /// Whether `id` is an array's id (its task 0's).
    fn is_array(&self, id: u64) -> bool {
        self.find(id).is_some_and(|j| {
            j.array()
                == Some(ArrayTask {
                    job_id: id,
                    task_id: 0,
                })
        })
    }

    /// How job `id` ended, for a job depending on it: `None` while it has not ended (or does
    /// not exist). An array's id (its task 0's) stands for the whole array, as in Slurm: it
    /// has ended when every task has, with the first task that did not complete and its
    /// state, else task 0 and `Completed`.
    fn outcome(&self, id: u64) -> Outcome {
        let found = self.find(id)?;
        if !self.is_array(id) {
            return found.state().is_final().then_some((id, found.state()));
        }
        let mut failed = None;
        let mut task = id;
        while let Some(j) = self
            .find(task)
            .filter(|j| j.array().is_some_and(|a| a.job_id == id))
        {
            let state = j.state();
            if !state.is_final() {
                return None;
            }
            if state != JobState::Completed && failed.is_none() {
                failed = Some((task, state));
            }
            task += 1;
        }
        // An array is added in steps: ids reserved and not added yet, while its user has
        // tasks still to add, may be its later tasks.
        let adding = self.reserved.get(found.user()).is_some_and(|r| r.jobs > 0);
        if adding && task < self.next_id && self.find(task).is_none() {
            return None;
        }
        Some(failed.unwrap_or((id, JobState::Completed)))
    }

    /// Hands held jobs whose dependencies are now met to the scheduler, and cancels those
    /// whose dependencies can never be met. One scheduling pass for all it hands over: an
    /// array of 10,000 tasks waiting on one job is released at once.
    pub(super) fn release_held(&mut self, now: i64) -> Result<(), ControlError> {
        let held: Vec<u64> = self.held.iter().copied().collect();
        let mut released = false;
        let mut seen = HashMap::new();
        for id in held {
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            match self.dependencies_with(&job.request, &mut seen) {
                Deps::Waiting => {}
                Deps::Met => {
                    self.held.remove(&id);
                    let spec = spec_of(id, &job.request, job.submit_ms);
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.note(now, "dependencies met");
                    }
                    let actions = self.scheduler.handle(now, Event::Submit(spec))?;
                    self.apply(now, actions);
                    released = true;
                }
                Deps::Never(why) => {
                    self.held.remove(&id);
                    let mut array = None;
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.state = JobState::Cancelled;
                        j.reason = Some(format!("dependency can never be met: {why}"));
                        j.end_ms = Some(now);
                        j.note(now, "cancelled: dependency can never be met");
                        array = j.array.map(|a| a.job_id);
                    }
                    // Ended now: what was known of it (and of its array) is out of date.
                    seen.remove(&id);
                    if let Some(a) = array {
                        seen.remove(&a);
                    }
                    self.dirty_jobs.insert(id);
                    self.job_ended_event(now, id, false);
                }
            }
        }
        if released {
            let actions = self.pass(now);
            self.apply(now, actions);
        }
        Ok(())
    }

    /// Adds one job with id `id` (reserved by the caller), task `array` of an array.
    pub(super) fn submit_one(
        &mut self,
        mut request: JobRequest,
        id: u64,
        array: Option<ArrayTask>,
        now: i64,
        pass: Pass,
    ) -> Result<(), ControlError> {
        // Record who runs it and who pays explicitly, so listings and accounting never guess.
        let user = request.user().to_owned();
        let account = request.account().to_owned();
        request.user = Some(user);
        request.account = Some(account);
        let spec = spec_of(id, &request, now);
        spec.validate()?;
        let mut record = JobRecord {
            id,
            request,
            state: JobState::Pending,
            reason: None,
            submit_ms: now,
            start_ms: None,
            end_ms: None,
            placement: Vec::new(),
            attempts: 0,
            requeues: 0,
            preemptions: 0,
            exit_code: None,
            timeline: Vec::new(),
            allocations: Vec::new(),
            master_port: None,
            stopping: Vec::new(),
            output_deleted_ms: None,
            array,
        };
        record.note(now, "submitted");
        let waits = self.dependencies(&record.request) != Deps::Met;
        let user = record.request.user().to_owned();
        let what = match &record.request.name {
            Some(name) => format!("job {id} ({name}) submitted by {user}"),
            None => format!("job {id} submitted by {user}"),
        };
        self.jobs.insert(id, record);
        self.dirty_jobs.insert(id);
        self.job_event(now, id, "job_submitted", &user, None, what);
        if waits {
            self.held.insert(id);
        } else {
            let mut actions = self.scheduler.handle(now, Event::Submit(spec))?;
            if pass == Pass::Now {
                actions.extend(self.pass(now));
            }
            self.apply(now, actions);
        }
        Ok(())
    }

    /// Whether the request's user (not an operator) may charge its account at its QOS
    /// ([`crate::accounts`]).
    pub fn may_charge(&self, request: &JobRequest) -> Result<(), ControlError> {
        let qos = request.qos.as_deref().unwrap_or("normal");
        crate::accounts::may_charge(
            &self.config.accounts,
            request.user(),
            request.account(),
            qos,
        )
        .map_err(ControlError::Forbidden)
    }
}
