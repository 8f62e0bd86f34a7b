//! Cancels: one job, or many at once (job ids, a whole array, or every unfinished job of a
//! user, an account or a name), which the service works through in steps
//! (`JobService::cancel_many`).

use super::*;
use perch_model::identity::{Identity, Role};

/// Which jobs a batch cancel names: `ids`, or the unfinished jobs that match every filter
/// given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CancelSelection {
    pub ids: Vec<u64>,
    /// An array's id: its first task's, as `perch submit --array` printed it.
    pub array: Option<u64>,
    pub user: Option<String>,
    pub account: Option<String>,
    pub name: Option<String>,
    /// `Pending` or `Running`.
    pub state: Option<JobState>,
}

/// What a batch cancel did to each job it named or matched, each list in id order.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CancelOutcome {
    pub cancelled: Vec<u64>,
    /// Named, but it had ended already (or ended while the cancel was worked through).
    pub already_ended: Vec<EndedJob>,
    pub not_found: Vec<u64>,
    /// Named, but another user's: only its owner or an operator may cancel it.
    pub forbidden: Vec<OwnedJob>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OwnedJob {
    pub id: u64,
    pub user: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EndedJob {
    pub id: u64,
    pub state: &'static str,
}

impl CancelOutcome {
    /// Adds what a later step did.
    pub fn extend(&mut self, other: CancelOutcome) {
        self.cancelled.extend(other.cancelled);
        self.already_ended.extend(other.already_ended);
        self.not_found.extend(other.not_found);
        self.forbidden.extend(other.forbidden);
    }

    /// Puts each list in id order (steps cancel pending jobs before running ones).
    pub fn sort(&mut self) {
        self.cancelled.sort_unstable();
        self.already_ended.sort_unstable_by_key(|e| e.id);
        self.not_found.sort_unstable();
        self.forbidden.sort_unstable_by_key(|e| e.id);
    }
}

impl Control {
    /// Cancels job `id` at the request of user `by` (who is named in the audit trail).
    pub fn cancel(&mut self, id: u64, by: &str, now: i64) -> Result<JobRecord, ControlError> {
        self.now = now;
        self.acting = Some(by.to_owned());
        let result = self
            .cancel_one(id, now)
            .and_then(|()| self.release_held(now));
        self.acting = None;
        result?;
        self.view(id)?.ok_or(ControlError::NoSuchJob(id))
    }

    /// Ends job `id` as cancelled, without a scheduling pass: the ticker's, within a second,
    /// gives the GPUs of a job that ran to the next. A pass reaches every pending job, so
    /// cancelling an array of 100,000 pending tasks one by one took a pass each, and minutes
    /// of the control plane. Jobs held on it are not looked at ([`Control::release_held`]).
    fn cancel_one(&mut self, id: u64, now: i64) -> Result<(), ControlError> {
        let state = self.find(id).ok_or(ControlError::NoSuchJob(id))?.state();
        if state.is_final() {
            return Err(ControlError::AlreadyEnded {
                id,
                state: state.as_str(),
            });
        }
        if self.held.remove(&id) {
            if let Some(j) = self.jobs.get_mut(&id) {
                j.state = JobState::Cancelled;
                j.reason = Some("cancelled".into());
                j.end_ms = Some(now);
                j.note(now, "cancelled");
            }
            self.dirty_jobs.insert(id);
            self.job_ended_event(now, id, true);
        } else {
            let actions = self.scheduler.handle(now, Event::Cancel(JobId(id)))?;
            self.apply(now, actions);
        }
        Ok(())
    }

    /// The jobs `selection` names for `who` (its ids sorted and without repeats, as
    /// `JobService::cancel_many` makes them), in the order to cancel them: pending ones first,
    /// then running ones, so that no pass between two steps starts a task of an array whose
    /// running tasks were just stopped. Named ids are returned whatever they are (each is
    /// checked as it is cancelled); filters match unfinished jobs only, and only `who`'s own
    /// unless an operator. Refused: a selection that names nothing, both ids and filters, a
    /// user's filter naming another user, an operator's filters that would reach every
    /// user's jobs, a state that is not pending or running, and an id that is not an array's.
    pub fn cancel_targets(
        &self,
        selection: &CancelSelection,
        who: &Identity,
    ) -> Result<Vec<u64>, ControlError> {
        let CancelSelection {
            ids,
            array,
            user,
            account,
            name,
            state,
        } = selection;
        let filtered = array.is_some()
            || user.is_some()
            || account.is_some()
            || name.is_some()
            || state.is_some();
        let bad = |m: &str| Err(ControlError::BadRequest(m.to_owned()));
        if !ids.is_empty() && filtered {
            return bad("give job ids, or filters (array, user, account, name, state), not both");
        }
        if !ids.is_empty() {
            let mut ids = ids.clone();
            let running = |id: &u64| {
                self.jobs
                    .get(id)
                    .is_some_and(|j| j.state == JobState::Running)
            };
            ids.sort_by_key(running);
            return Ok(ids);
        }
        if !filtered {
            return bad(
                "name the jobs to cancel: ids, or filters (array, user, account, name, state)",
            );
        }
        if let Some(s) = state
            && s.is_final()
        {
            return bad(&format!(
                "state {:?} has ended; only pending or running jobs can be cancelled",
                s.as_str()
            ));
        }
        let operator = who.role == Role::Operator;
        let user = match user {
            Some(u) if !who.may_act_on(u) => {
                return Err(ControlError::Forbidden(format!(
                    "{} may cancel only their own jobs; leave out the user, or give {}",
                    who.user, who.user
                )));
            }
            Some(u) => Some(u.as_str()),
            // Anyone but an operator cancels their own jobs only.
            None if !operator => Some(who.user.as_str()),
            None => None,
        };
        if operator && user.is_none() && account.is_none() && array.is_none() {
            return bad(
                "these filters would cancel every user's jobs: add a user, an account or an \
                 array (an operator may cancel anyone's)",
            );
        }
        if let Some(a) = *array {
            let first_task = Some(ArrayTask {
                job_id: a,
                task_id: 0,
            });
            let Some(first) = self.find(a).filter(|j| j.array() == first_task) else {
                return Err(ControlError::NoSuchArray(a));
            };
            let owner = first.user();
            if !who.may_act_on(owner) {
                return Err(ControlError::Forbidden(format!(
                    "array {a} belongs to {owner}; only its owner or an operator may cancel it"
                )));
            }
        }
        let mut pending = Vec::new();
        let mut running = Vec::new();
        for job in self.jobs.values() {
            let r = &job.request;
            let matches = !job.state.is_final()
                && state.is_none_or(|s| s == job.state)
                && array.is_none_or(|a| job.array.is_some_and(|t| t.job_id == a))
                && user.is_none_or(|u| r.user() == u)
                && account.as_deref().is_none_or(|a| r.account() == a)
                && name.as_deref().is_none_or(|n| named(job, n));
            if matches {
                match job.state {
                    JobState::Running => running.push(job.id),
                    _ => pending.push(job.id),
                }
            }
        }
        pending.extend(running);
        Ok(pending)
    }

    /// Cancels `ids` (from [`Control::cancel_targets`]) for `who`, each job that exists, is
    /// theirs to cancel and has not ended; says what became of each. Jobs held on them are
    /// looked at once, after all of them.
    pub fn cancel_many(
        &mut self,
        ids: &[u64],
        who: &Identity,
        now: i64,
    ) -> Result<CancelOutcome, ControlError> {
        self.now = now;
        self.acting = Some(who.user.clone());
        let mut out = CancelOutcome::default();
        let mut failed = None;
        for &id in ids {
            let Some(job) = self.find(id) else {
                out.not_found.push(id);
                continue;
            };
            if !who.may_act_on(job.user()) {
                let user = job.user().to_owned();
                out.forbidden.push(OwnedJob { id, user });
                continue;
            }
            match self.cancel_one(id, now) {
                Ok(()) => out.cancelled.push(id),
                Err(ControlError::AlreadyEnded { id, state }) => {
                    out.already_ended.push(EndedJob { id, state })
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let released = self.release_held(now);
        self.acting = None;
        match failed {
            Some(e) => Err(e),
            None => released.map(|()| out),
        }
    }
}

/// Whether `job` is called `name`; an array's tasks are called by their array's name too
/// (task 3 of `train` is `train[3]`).
fn named(job: &JobRecord, name: &str) -> bool {
    let Some(own) = job.request.name.as_deref() else {
        return false;
    };
    own == name
        || job.array.is_some_and(|t| {
            own.strip_prefix(name)
                .is_some_and(|rest| rest == format!("[{}]", t.task_id))
        })
}
