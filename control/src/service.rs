//! The job service: the control plane ([`Control`]) behind a lock, its changes committed to
//! the job store with group commit, and the operations the HTTP edge calls.

use crate::control::{
    Brief, CancelOutcome, CancelSelection, Control, ControlError, Found, JobsConfig, Settled,
};
use crate::record::JobRecord;
use crate::spec::{FieldError, JobRequest};
use crate::store::{JobStore, SettledRecords};
use crate::{claims, control, db};
use futures::StreamExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

mod commits;
mod pages;
mod ticker;
mod walk;

use commits::*;
pub use pages::*;
pub use ticker::*;
pub use walk::*;

/// The control plane behind a lock, with group commit: an operation changes the in-memory
/// state under the lock and queues the records it changed; before it answers, the changes are
/// committed to the job database, many operations' changes in one transaction (one fsync),
/// the first waiter committing for everyone queued. Operations run on the blocking pool.
#[derive(Clone)]
pub struct JobService {
    /// The server's clock: every operation's "now".
    clock: perch_model::clock::Clock,
    /// A fair lock where it matters: a long scan hands it on between chunks
    /// ([`JobService::scan_jobs`]) instead of taking it straight back.
    pub(crate) control: Arc<parking_lot::Mutex<Control>>,
    pub(crate) commits: Arc<Commits>,
    /// The job database's directory (job logs beside it), to rebuild from in
    /// [`JobService::recover`].
    dir: Arc<std::path::Path>,
    known_nodes: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    claims: Arc<claims::NodeClaims>,
    /// Start-time estimates made at once ([`JobService::estimated_starts`]): a client asking
    /// again and again waits its turn instead of taking every core.
    plans: Arc<tokio::sync::Semaphore>,
    /// Job listings made at once ([`JobService::listing`]).
    listings: Arc<tokio::sync::Semaphore>,
    /// KiB of pages not yet read by their clients ([`PAGES_IN_FLIGHT_BYTES`]).
    pages_in_flight: Arc<tokio::sync::Semaphore>,
    /// Each user's share of them, KiB ([`USER_PAGES_IN_FLIGHT_BYTES`]).
    user_pages: Arc<Mutex<std::collections::HashMap<String, Arc<tokio::sync::Semaphore>>>>,
    /// Settled jobs' rows for SQL (the server's settled rows (`SettledRecords`)).
    settled: Arc<dyn SettledRecords>,
}

/// Start-time estimates computed at the same time, at most.
const CONCURRENT_PLANS: usize = 2;

/// Pending jobs whose start is estimated (the rest of a longer queue gets none).
pub const ESTIMATED_JOBS: usize = 1_000;

impl std::fmt::Debug for JobService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobService").finish_non_exhaustive()
    }
}

/// Array tasks added to the control plane in one step (one lock hold, one commit), at most.
pub const ARRAY_STEP: u32 = 500;

/// Jobs cancelled in one step of a batch cancel (one lock hold, one commit), at most.
pub const CANCEL_STEP: usize = 1_000;

/// Bytes of job records ([`JobRecord::weight`]) one step of an array or a batch cancel
/// writes, at most (a heavier job is a step of its own). A step's cost grows with its jobs'
/// command and environment: each task copies them, and each record is written to the job
/// store whole. An agent's sync waits for at most one step, and a step of 256 array tasks
/// with 64 KiB of environment each held syncs for 1.5 s in a debug build (500 tasks of
/// 1.5 KiB for 0.3 s).
pub const STEP_BYTES: usize = 256 << 10;

/// Splits jobs of the given weights, in order, into steps of at most `max_jobs` jobs and
/// [`STEP_BYTES`] bytes (at least one job each).
fn steps(weights: impl IntoIterator<Item = usize>, max_jobs: usize) -> Vec<std::ops::Range<usize>> {
    let mut steps = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    let mut end = 0;
    for weight in weights {
        if end > start && (end - start == max_jobs || bytes + weight > STEP_BYTES) {
            steps.push(start..end);
            (start, bytes) = (end, 0);
        }
        bytes += weight;
        end += 1;
    }
    if end > start {
        steps.push(start..end);
    }
    steps
}

/// Job ids one batch cancel may name (filters reach any number of jobs): a 64 MiB body holds
/// millions, and sorting them and answering for each held the control plane for seconds.
pub const MAX_CANCEL_IDS: usize = 100_000;

/// A control-plane task that panicked or was cancelled.
fn task_failed(e: tokio::task::JoinError) -> ControlError {
    ControlError::TaskFailed(e.to_string())
}

/// A turn from `slots`, waited for; closed (at shutdown), refused saying `what` cannot be done.
async fn turn<'a>(
    slots: &'a tokio::sync::Semaphore,
    what: &str,
) -> Result<tokio::sync::SemaphorePermit<'a>, ControlError> {
    slots
        .acquire()
        .await
        .map_err(|e| ControlError::ShuttingDown(format!("{what} now: {e}")))
}

impl JobService {
    /// Opens the embedded job store (`jobs.redb` under `dir`, [`db::RedbStore`]) with no
    /// settled rows kept outside it, and rebuilds the control plane from it: for tools and
    /// tests; the server opens its own with [`JobService::open`].
    pub fn open_embedded(
        dir: &std::path::Path,
        config: JobsConfig,
        events: tokio::sync::mpsc::UnboundedSender<Vec<perch_model::ClusterEvent>>,
    ) -> Result<JobService, ControlError> {
        std::fs::create_dir_all(dir).map_err(ControlError::Logs)?;
        let store = Arc::new(db::RedbStore::open(&dir.join("jobs.redb"))?);
        let settled = Arc::new(crate::store::NoSettledRecords);
        JobService::open(dir, config, events, store, settled, Vec::new())
    }

    /// Rebuilds the control plane from `store`; `dir` holds job output and the job token key.
    /// `settled` keeps settled jobs' rows for accounting, and holds those of jobs `recorded`
    /// now (if the store has not ended one of them, it was restored from an older copy: the
    /// rows are deleted and written again). Audit events go to `events` once durable (see
    /// [`JobService::event_channel`]).
    pub fn open(
        dir: &std::path::Path,
        config: JobsConfig,
        events: tokio::sync::mpsc::UnboundedSender<Vec<perch_model::ClusterEvent>>,
        store: Arc<dyn JobStore>,
        settled: Arc<dyn SettledRecords>,
        recorded: Vec<u64>,
    ) -> Result<JobService, ControlError> {
        std::fs::create_dir_all(dir).map_err(ControlError::Logs)?;
        let db = store;
        let loaded = db.load()?;
        let clock = config.clock.clone();
        let mut control = Control::open(dir, config, clock.now_ms(), loaded, &db)?;
        match control.first_foreign(&recorded) {
            None => control.note_recorded(recorded),
            Some(job) => {
                tracing::warn!(
                    job,
                    "the settled rows files hold a job this job database has not ended (the database was restored from an older copy?); deleting them, the rows are written again from the job database"
                );
                settled.reset();
            }
        }
        let mut dirty = control.take_dirty();
        db.save(&dirty)?;
        if !dirty.events.is_empty() {
            let _ = events.send(std::mem::take(&mut dirty.events));
        }
        let commits = Commits {
            db,
            events,
            state: Mutex::new(CommitState::default()),
            done: Condvar::new(),
        };
        let known_nodes = control.known_nodes.clone();
        let claims = control.claims.clone();
        Ok(JobService {
            clock,
            dir: dir.into(),
            known_nodes,
            claims,
            control: Arc::new(parking_lot::Mutex::new(control)),
            commits: Arc::new(commits),
            plans: Arc::new(tokio::sync::Semaphore::new(CONCURRENT_PLANS)),
            listings: Arc::new(tokio::sync::Semaphore::new(CONCURRENT_LISTINGS)),
            pages_in_flight: Arc::new(tokio::sync::Semaphore::new(PAGES_IN_FLIGHT_BYTES >> 10)),
            user_pages: Arc::default(),
            settled,
        })
    }

    /// The estimated start of the first [`ESTIMATED_JOBS`] pending jobs (with `upto`, only as
    /// far as that job), by job id ([`perch_scheduler::StartPlan`]): the snapshot is taken under
    /// the control lock, the estimate is made off it, at most [`CONCURRENT_PLANS`] at a time.
    pub async fn estimated_starts(
        &self,
        upto: Option<u64>,
    ) -> Result<std::collections::HashMap<u64, i64>, ControlError> {
        let _turn = turn(&self.plans, "start times cannot be estimated").await?;
        // A read: the snapshot changes nothing, so nothing waits for a commit.
        let jobs = self.clone();
        let estimates = tokio::task::spawn_blocking(move || {
            let now = jobs.now_ms();
            jobs.read(|c| c.start_plan(now, ESTIMATED_JOBS, upto))
                .estimate()
        })
        .await
        .map_err(|e| ControlError::TaskFailed(format!("estimating start times failed: {e}")))?;
        Ok(estimates
            .into_iter()
            .filter_map(|(job, at)| Some((job.0, at?)))
            .collect())
    }

    /// A channel for [`JobService::open`]: the receiver is drained into the store's `events`
    /// table by the server (see `perch_server::accounting::append_events`).
    pub fn event_channel() -> (
        tokio::sync::mpsc::UnboundedSender<Vec<perch_model::ClusterEvent>>,
        tokio::sync::mpsc::UnboundedReceiver<Vec<perch_model::ClusterEvent>>,
    ) {
        tokio::sync::mpsc::unbounded_channel()
    }

    /// Job `id`'s provenance record, for `who` (its user or an operator; others are refused as
    /// for its output). A job with nothing recorded (submitted through the API without
    /// `provenance`, not started yet) has an empty record: no submit side, no runs. An array
    /// task without a record of its own answers with its array's (the submit side is recorded
    /// once per array). Blocking: call it off the async threads.
    pub fn provenance_for(
        &self,
        id: u64,
        who: &perch_model::identity::Identity,
    ) -> Result<crate::provenance::ProvenanceRecord, ControlError> {
        let (array, seen, empty) = {
            let c = self.control.lock();
            c.check_owner(id, who)?;
            let job = c.view(id)?.ok_or(ControlError::NoSuchJob(id))?;
            let array = job.array.map(|a| a.job_id).filter(|&a| a != id);
            let empty = crate::provenance::ProvenanceRecord {
                job: id,
                user: job.request.user().to_owned(),
                submit_ms: job.submit_ms,
                submit: None,
                runs: Vec::new(),
                runs_dropped: 0,
            };
            (array, self.commits.seen(), empty)
        };
        // What the control plane showed is durable before it is read from the store.
        self.commits.wait(seen)?;
        let store = &self.commits.db;
        let mut found = store.provenance(id)?;
        if let Some(array) = array {
            let whole = store.provenance(array)?;
            found = match (found, whole) {
                (Some(mut own), Some(whole)) => {
                    own.submit = own.submit.or(whole.submit);
                    Some(own)
                }
                (own, whole) => own.or(whole.map(|mut w| {
                    w.job = id;
                    w.runs.clear();
                    w
                })),
            };
        }
        Ok(found.unwrap_or(empty))
    }

    /// Visits the provenance records of jobs in `ids` whose user is `user` (every user's for
    /// `None`: an operator), in id order, until `visit` says stop. Blocking.
    pub fn for_each_provenance(
        &self,
        ids: std::ops::RangeInclusive<u64>,
        user: Option<&str>,
        visit: &mut dyn FnMut(crate::provenance::ProvenanceRecord) -> bool,
    ) -> Result<(), ControlError> {
        let seen = self.commits.seen();
        self.commits.wait(seen)?;
        self.commits.db.for_each_provenance(ids, &mut |r| {
            if user.is_some_and(|u| u != r.user) {
                return true;
            }
            visit(r)
        })?;
        Ok(())
    }

    /// Now, by the server's clock.
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Reads the control plane under its lock (keep `f` short). For perch's own rounds: an
    /// answer to a client reads through [`JobService::read_durable`].
    pub fn read<T>(&self, f: impl FnOnce(&Control) -> T) -> T {
        f(&self.control.lock())
    }

    /// Reads the control plane under its lock (keep `f` short) and returns once every change
    /// the read could see is durable, as [`JobService::run`] does: what SQL's live tables and
    /// `/metrics` show (a job just submitted, a node just drained) does not outlive a crash
    /// that loses it. Blocking: call it off the async threads.
    pub fn read_durable<T>(&self, f: impl FnOnce(&Control) -> T) -> Result<T, ControlError> {
        let (value, seen) = {
            let control = self.control.lock();
            (f(&control), self.commits.seen())
        };
        self.commits.wait(seen)?;
        Ok(value)
    }

    /// The job and user a job metrics token speaks for, if it is valid now.
    pub fn job_of_token(&self, token: &str) -> Option<(u64, String)> {
        let now = self.now_ms();
        self.read(|c| c.job_of_token(token, now))
    }

    /// Takes or renews node `name` for agent `agent` (telemetry carries the agent's id too):
    /// refused while another agent's claim is fresh ([`claims`]).
    pub fn claim_node(&self, name: &str, agent: &str) -> Result<(), ControlError> {
        self.claims.claim(name, agent, self.now_ms(), None)
    }

    /// How many nodes the scheduler knows (cheap: no control lock).
    pub fn known_node_count(&self) -> usize {
        self.known_nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Whether the scheduler knows node `name` (cheap: no control lock).
    pub fn knows_node(&self, name: &str) -> bool {
        self.known_nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(name)
    }

    /// Runs `f` on the control plane off the async threads and returns once its changes, and
    /// every change it could see, are durable: an operation that changes nothing (a view, an
    /// agent's sync with nothing new) may read another's changes queued but not yet committed,
    /// and its answer (a job shown, a launch order handed out) must not outlive a crash that
    /// loses them. Its errors are the control plane's; the HTTP edge maps them
    /// (`From<ControlError> for ApiError`).
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Control, i64) -> Result<T, ControlError> + Send + 'static,
    ) -> Result<T, ControlError> {
        let control = self.control.clone();
        let commits = self.commits.clone();
        let clock = self.clock.clone();
        if let Some(why) = self.commits.failed() {
            // Nothing is changed in memory that the job database could not take.
            return Err(ControlError::Unavailable(why));
        }
        tokio::task::spawn_blocking(move || {
            let (result, seq) = {
                let mut c = control.lock();
                let result = f(&mut c, clock.now_ms());
                let dirty = c.take_dirty();
                let seq = if dirty.is_empty() {
                    commits.seen()
                } else {
                    commits.queue(dirty)
                };
                (result, seq)
            };
            commits.wait(seq)?;
            result
        })
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))?
    }

    /// An agent's sync while the job database cannot commit: the node's lease is renewed (no
    /// job may be requeued meanwhile, and a rebuild gives agents a heartbeat timeout from
    /// then), and nothing else is taken or handed out: no exit acknowledged, no output stored,
    /// no order, so the agent keeps all of it for a later sync. A node the control plane does
    /// not know gets no lease: it runs nothing of perch's.
    pub async fn sync_degraded(
        &self,
        request: perch_model::control::SyncRequest,
    ) -> Result<perch_model::control::SyncResponse, ControlError> {
        let service = self.clone();
        tokio::task::spawn_blocking(move || {
            let now = service.now_ms();
            service.control.lock().renew_only(&request, now)
        })
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))?
    }

    /// Submits `request` for a user (`operator` may charge any account): a job, or an array
    /// added in steps of at most [`ARRAY_STEP`] tasks and [`STEP_BYTES`], each step committed
    /// on its own, so agents' syncs
    /// and other requests get the control plane between steps. The steps run in a task of
    /// their own: a client that hangs up does not leave an array half added. A server that
    /// dies part way keeps the steps committed so far (their ids are the array's first).
    /// Returns the first job and the array's ids, with a warning when no set of the nodes
    /// seen could run it (accepted only with `hold_until_fits`; refused otherwise).
    pub async fn submit(
        &self,
        request: JobRequest,
        operator: bool,
    ) -> Result<(JobRecord, Vec<u64>, Option<String>), ControlError> {
        let service = self.clone();
        tokio::spawn(async move {
            let mut request = request;
            let provenance = request.provenance.take().map(|p| *p);
            let request = Arc::new(request);
            let r = request.clone();
            let checked = provenance.clone();
            let (first, warning) = service
                .run(move |c, now| {
                    if !operator {
                        c.may_charge(&r)?;
                    }
                    // Its fields first: a shape is only compared with the nodes once valid.
                    r.validate()?;
                    if let Some(p) = &checked {
                        c.check_provenance(p, r.user(), operator)?;
                    }
                    let warning = match c.shape_warning(&r) {
                        Some(why) if !r.hold_until_fits => {
                            return Err(ControlError::Invalid(FieldError {
                                field: if r.gpu_profile.is_some() {
                                    "gpu_profile"
                                } else if r.nodes > 1 {
                                    "nodes"
                                } else {
                                    "gpus_per_node"
                                },
                                message: format!(
                                    "{why}; or, to wait for nodes that could run it to join, \
                                     submit it with --hold-until-fits (\"hold_until_fits\": true)"
                                ),
                            }));
                        }
                        Some(why) => Some(format!(
                            "{why}; held until nodes that can run it join (hold_until_fits)"
                        )),
                        None => None,
                    };
                    let first = c.start_array(&r, now)?;
                    Ok((first, warning))
                })
                .await?;
            let count = request.array.unwrap_or(1);
            let weight = request.task_bytes() + crate::record::RECORD_BYTES;
            for step in steps(
                std::iter::repeat_n(weight, count as usize),
                ARRAY_STEP as usize,
            ) {
                // Within `count`, a u32.
                let step = step.start as u32..step.end as u32;
                let done = step.end;
                let r = request.clone();
                // Recorded with the first task, in the same commit.
                let p = (step.start == 0).then(|| provenance.clone()).flatten();
                let added = service
                    .run(move |c, now| {
                        c.submit_array_tasks(&r, first, step, now)?;
                        if let Some(p) = p {
                            c.record_provenance(first, r.user(), p, now);
                        }
                        Ok(())
                    })
                    .await;
                if let Err(e) = added {
                    // The later steps will not be added: their tasks stop counting.
                    let (r, left) = (request.clone(), (count - done) as usize);
                    let _ = service
                        .run(move |c, _| {
                            c.release_reservation(&r, left);
                            Ok(())
                        })
                        .await;
                    return Err(e);
                }
            }
            let record = service
                .read(|c| c.view(first))?
                .ok_or(ControlError::NoSuchJob(first))?;
            let ids = if request.array.is_some() {
                (first..first + u64::from(count)).collect()
            } else {
                Vec::new()
            };
            Ok::<_, ControlError>((record, ids, warning))
        })
        .await
        .map_err(task_failed)?
    }

    /// Cancels the jobs `selection` names for `who` ([`Control::cancel_targets`]), in steps
    /// of at most [`CANCEL_STEP`] jobs and [`STEP_BYTES`], each step committed on its own, so agents' syncs and other
    /// requests get the control plane between steps. Like a submission, the steps run in a
    /// task of their own: a client that hangs up does not leave the cancel half done.
    pub async fn cancel_many(
        &self,
        mut selection: CancelSelection,
        who: perch_model::identity::Identity,
    ) -> Result<CancelOutcome, ControlError> {
        if selection.ids.len() > MAX_CANCEL_IDS {
            return Err(ControlError::BadRequest(format!(
                "{} job ids in one cancel; at most {MAX_CANCEL_IDS}: send them in parts, or \
                 name them by array, user, account or name",
                selection.ids.len()
            )));
        }
        // Off the control lock: under it, only what needs the jobs.
        selection.ids.sort_unstable();
        selection.ids.dedup();
        let service = self.clone();
        tokio::spawn(async move {
            let who = Arc::new(who);
            let w = who.clone();
            let (targets, weights) = service
                .run(move |c, _| {
                    let targets = c.cancel_targets(&selection, &w)?;
                    let weights: Vec<usize> = targets.iter().map(|&id| c.weight(id)).collect();
                    Ok((targets, weights))
                })
                .await?;
            let mut outcome = CancelOutcome::default();
            for step in steps(weights, CANCEL_STEP) {
                let (step, w) = (targets[step].to_vec(), who.clone());
                let done = service
                    .run(move |c, now| c.cancel_many(&step, &w, now))
                    .await?;
                outcome.extend(done);
            }
            outcome.sort();
            Ok::<_, ControlError>(outcome)
        })
        .await
        .map_err(task_failed)?
    }
}

#[cfg(test)]
mod step_tests {
    use super::{STEP_BYTES, steps};

    #[test]
    fn light_jobs_are_stepped_by_count() {
        assert_eq!(steps([100; 5], 2), vec![0..2, 2..4, 4..5]);
        assert_eq!(steps([100; 4], 4), vec![0..4]);
        assert_eq!(
            steps(std::iter::empty(), 3),
            Vec::<std::ops::Range<usize>>::new()
        );
    }

    #[test]
    fn heavy_jobs_are_stepped_by_bytes_and_one_past_the_bound_goes_alone() {
        let third = STEP_BYTES / 3;
        assert_eq!(steps([third; 7], 500), vec![0..3, 3..6, 6..7]);
        let weights = [10, STEP_BYTES + 1, 10, 10, STEP_BYTES - 5, 10];
        assert_eq!(steps(weights, 500), vec![0..1, 1..2, 2..4, 4..5, 5..6]);
    }
}
