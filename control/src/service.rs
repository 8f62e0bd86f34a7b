//! The job service: the control plane ([`Control`]) behind a lock, its changes committed to
//! the job store with group commit, and the operations the HTTP edge calls.

use crate::control::{
    Brief, CancelOutcome, CancelSelection, Control, ControlError, Found, JobsConfig, Settled,
};
use crate::record::JobRecord;
use crate::spec::JobRequest;
use crate::store::{JobStore, SettledRecords};
use crate::{claims, control, db};
use futures::StreamExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

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

pub(crate) struct Commits {
    db: Arc<dyn JobStore>,
    events: tokio::sync::mpsc::UnboundedSender<Vec<perch_model::ClusterEvent>>,
    state: Mutex<CommitState>,
    done: Condvar,
}

#[derive(Default)]
struct CommitState {
    /// Changes queued and not yet committed, with the sequence number of the last one.
    queued: db::Dirty,
    queued_seq: u64,
    committed_seq: u64,
    committing: bool,
    failed: Option<String>,
}

/// How often stored job output past `server.job_output_days` is looked for.
pub const OUTPUT_EXPIRY_PERIOD: std::time::Duration = std::time::Duration::from_secs(600);

/// Array tasks added to the control plane in one step (one lock hold, one commit).
pub const ARRAY_STEP: u32 = 500;

/// Jobs cancelled in one step of a batch cancel (one lock hold, one commit).
pub const CANCEL_STEP: usize = 1_000;

/// Job ids one batch cancel may name (filters reach any number of jobs): a 64 MiB body holds
/// millions, and sorting them and answering for each held the control plane for seconds.
pub const MAX_CANCEL_IDS: usize = 100_000;

/// Settled jobs whose rows one step of [`JobService::record_settled`] writes, at most.
const RECORD_STEP: usize = 10_000;

/// Which jobs [`JobService::walk_jobs`] takes, from where.
struct Walk {
    /// From this id up, or (`newest_first`) from below it down.
    from: u64,
    newest_first: bool,
    /// Jobs visited, at most.
    want: usize,
    /// Which settled jobs besides those held whole.
    settled: Settled,
    /// Records as [`Control::view`] shows them (the pending reason filled in).
    view: bool,
}

impl Walk {
    /// Every job held whole and the `settled` ones, oldest first, as stored.
    fn all(settled: Settled) -> Walk {
        Walk {
            from: 0,
            newest_first: false,
            want: usize::MAX,
            settled,
            view: false,
        }
    }
}

/// After a failed write of settled jobs' rows (a full disk, say), the next waits this long,
/// doubling after each failure up to [`RECORD_RETRY_MAX`].
const RECORD_RETRY_MIN: std::time::Duration = std::time::Duration::from_secs(1);
const RECORD_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(300);

/// After a failed reopen of the job database ([`JobService::recover`]), the next waits this
/// long, doubling up to [`RECOVER_RETRY_MAX`]: space that returns is found within seconds.
const RECOVER_RETRY_MIN: std::time::Duration = std::time::Duration::from_secs(1);
const RECOVER_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(8);

/// Job records read under one hold of the control lock by [`JobService::scan_jobs`].
pub const SCAN_CHUNK: usize = 2_000;

/// Jobs one page of `GET /v1/jobs` or `GET /v1/queue` holds at most: 100,000 full records
/// were about 70 MB of JSON and 5 s of a core each, and four such requests at once held every
/// agent's sync for 10 s and took the server from 0.4 to 3.7 GB.
pub const MAX_PAGE: usize = 10_000;

/// Bytes of jobs one page holds at most, roughly ([`JobRecord::weight`]): 10,000 jobs with
/// a 64 KiB environment each would be 640 MB. A page ends at the job that passes it.
pub const MAX_PAGE_BYTES: usize = 32 << 20;

/// Job listings (`GET /v1/jobs`, `GET /v1/queue`) selected and written at the same time, at
/// most: more wait their turn instead of taking every core and the memory of their pages.
const CONCURRENT_LISTINGS: usize = 2;

/// Bytes of job pages made and not yet read by their clients, at most: a page stays in memory
/// until its client has read it, and a client reading a byte at a time on each of its 256
/// connections held 256 pages. A listing past it waits for room, then is refused (503).
pub const PAGES_IN_FLIGHT_BYTES: usize = 256 << 20;

/// What one page may take of [`PAGES_IN_FLIGHT_BYTES`] while it is made: its text ends at the
/// job that passes [`MAX_PAGE_BYTES`], and one job's text is under 2 MiB (320 KiB of command
/// and environment, escaped).
pub const PAGE_RESERVE: usize = MAX_PAGE_BYTES + (4 << 20);

/// Of [`PAGES_IN_FLIGHT_BYTES`], what one user's pages may hold: one whose clients read
/// slowly waits for their own pages, not everyone's.
pub const USER_PAGES_IN_FLIGHT_BYTES: usize = 64 << 20;

/// Users' shares kept before those with nothing in flight are forgotten.
const USER_SHARES_KEPT: usize = 1024;

/// How long a listing waits for room among the pages in flight before it is refused.
const PAGE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The pieces a page is sent in.
const PAGE_PIECE: usize = 64 << 10;

/// A job listing made by [`JobService::listing`]: its text in pieces, holding its room among
/// the pages in flight until the stream of its pieces is dropped (the client has read the
/// last, or has gone).
pub struct Page {
    pieces: Vec<bytes::Bytes>,
    rooms: [tokio::sync::OwnedSemaphorePermit; 2],
}

impl std::fmt::Debug for Page {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bytes: usize = self.pieces.iter().map(bytes::Bytes::len).sum();
        f.debug_struct("Page").field("bytes", &bytes).finish()
    }
}

impl Page {
    /// The pieces to send, in order; the room goes with the stream.
    pub fn into_stream(
        self,
    ) -> impl futures::Stream<Item = Result<bytes::Bytes, std::convert::Infallible>> + Send {
        let Page { pieces, rooms } = self;
        futures::stream::iter(pieces).map(move |piece| {
            let _held = &rooms;
            Ok(piece)
        })
    }
}

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

/// KiB, rounded up: the unit of the pages-in-flight semaphores.
fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

/// Room for one page being made ([`PAGE_RESERVE`]) among `rooms` (`limit` bytes of `what` in
/// all), waited for up to [`PAGE_WAIT`]; then refused saying why.
async fn page_room(
    rooms: Arc<tokio::sync::Semaphore>,
    limit: usize,
    what: &str,
) -> Result<tokio::sync::OwnedSemaphorePermit, ControlError> {
    match tokio::time::timeout(PAGE_WAIT, rooms.acquire_many_owned(kib(PAGE_RESERVE))).await {
        Ok(Ok(room)) => Ok(room),
        Ok(Err(e)) => Err(ControlError::ShuttingDown(format!(
            "jobs cannot be listed now: {e}"
        ))),
        Err(_) => Err(ControlError::ListingBusy(format!(
            "{what} not yet read by their clients hold {} MiB, all there may be: try again in a moment, or ask for a smaller limit",
            limit >> 20
        ))),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Commits {
    /// Why the job database cannot commit, while it cannot.
    fn failed(&self) -> Option<String> {
        lock(&self.state).failed.clone()
    }

    /// Queues a change set; returns its sequence number. Called under the control lock, so
    /// sequence order is the order of the changes.
    pub(crate) fn queue(&self, dirty: db::Dirty) -> u64 {
        let mut s = lock(&self.state);
        s.queued.extend(dirty);
        s.queued_seq += 1;
        s.queued_seq
    }

    /// The sequence number of the last change set queued. Read under the control lock, it
    /// covers every change an operation holding the lock can see.
    fn seen(&self) -> u64 {
        lock(&self.state).queued_seq
    }

    /// The last change set queued ([`Commits::seen`]) and the last one committed.
    fn seqs(&self) -> (u64, u64) {
        let s = lock(&self.state);
        (s.queued_seq, s.committed_seq)
    }

    /// Returns once change set `seq` is durable (committing it, and everything queued with
    /// it, if no one else is).
    fn wait(&self, seq: u64) -> Result<(), ControlError> {
        let mut s = lock(&self.state);
        loop {
            if let Some(e) = &s.failed {
                return Err(ControlError::Unavailable(e.clone()));
            }
            if s.committed_seq >= seq {
                return Ok(());
            }
            if !s.committing {
                s.committing = true;
                let mut batch = std::mem::take(&mut s.queued);
                let upto = s.queued_seq;
                drop(s);
                let result = self.db.save(&batch);
                if result.is_ok() && !batch.events.is_empty() {
                    // Only what is durable is announced; a closed receiver (no server
                    // running) just drops them.
                    let _ = self.events.send(std::mem::take(&mut batch.events));
                }
                s = lock(&self.state);
                s.committing = false;
                match result {
                    Ok(()) => s.committed_seq = upto,
                    // The in-memory state is now ahead of the job database, and redb takes no
                    // transaction until it is reopened: refuse everything rather than answer
                    // as if changes were durable, until [`JobService::recover`] has reopened
                    // it and rebuilt the control plane from what it holds.
                    Err(e) => {
                        tracing::error!(error = %e, "the job database cannot commit (a full disk?); job operations are refused and agents' leases renewed until it is reopened, tried every few seconds");
                        s.failed = Some(e.to_string());
                    }
                }
                self.done.notify_all();
                continue;
            }
            s = self.done.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
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

    /// Now, by the server's clock.
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Reads the control plane under its lock (keep `f` short). For perch's own rounds: an
    /// answer to a client reads through [`JobService::read_durable`].
    pub fn read<T>(&self, f: impl FnOnce(&Control) -> T) -> T {
        f(&self.control.lock())
    }

    /// Makes a change as an operation would, and queues it for commit without waiting:
    /// another request's change between the two. Returns its sequence number.
    #[cfg(any(test, feature = "testing"))]
    pub fn change_uncommitted(&self, f: impl FnOnce(&mut Control)) -> u64 {
        let mut control = self.control.lock();
        f(&mut control);
        self.commits.queue(control.take_dirty())
    }

    /// The job database fails (`why`), as a commit that cannot be written makes it.
    #[cfg(any(test, feature = "testing"))]
    pub fn fail_commits(&self, why: &str) {
        lock(&self.commits.state).failed = Some(why.to_owned());
    }

    /// Whether change set `seq` is durable.
    #[cfg(any(test, feature = "testing"))]
    pub fn durable(&self, seq: u64) -> bool {
        self.commits.seqs().1 >= seq
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

    /// What SQL's accounting tables walk: every job held whole and, with `every_settled`, every
    /// settled job (else only those whose rows are not yet written, [`SettledRecords`]), from
    /// id `from` up in id order, a chunk at a time ([`JobService::walk_jobs`]); `visit` returns
    /// false to stop. Returns the last change set the walk saw: wait for it
    /// ([`JobService::wait_durable`]) before answering, so no answer shows what a crash could
    /// lose.
    pub fn walk_for_accounting(
        &self,
        from: u64,
        every_settled: bool,
        visit: impl FnMut(JobRecord) -> bool,
    ) -> Result<u64, ControlError> {
        let settled = if every_settled {
            Settled::All
        } else {
            Settled::Unrecorded
        };
        self.walk_jobs(
            Walk {
                from,
                ..Walk::all(settled)
            },
            |_| true,
            visit,
        )
    }

    /// Returns once change set `seq` (and every one before it) is durable.
    pub fn wait_durable(&self, seq: u64) -> Result<(), ControlError> {
        self.commits.wait(seq)
    }

    /// Folds the telemetry of every allocation up to `until` (its end, if sooner), `usage`
    /// per GPU: nothing is left to account (for tests).
    #[cfg(any(test, feature = "testing"))]
    pub async fn fold_all(&self, until: i64, usage: crate::usage::GpuUsage) {
        self.run(move |c, now| {
            let folded = c
                .fold_windows(until)
                .into_iter()
                .map(|w| crate::cost::Folded {
                    usage: vec![usage.clone(); w.gpus.len()],
                    window: w,
                    simulated: false,
                })
                .collect();
            c.apply_fold(folded, now)
        })
        .await
        .expect("fold");
    }

    /// Writes the rows of up to [`RECORD_STEP`] settled jobs not yet in the settled rows'
    /// files: their records are read from the job database after letting go of the control
    /// lock, and they count as recorded only once written. Returns how many were. Blocking:
    /// the ticker runs it on the blocking pool, one at a time.
    ///
    /// Rows a query found removed or damaged ([`SettledRecords::lost`]) are deleted first,
    /// and every settled job marked unrecorded, under the control lock.
    pub fn record_settled(&self) -> Result<usize, ControlError> {
        self.start_over_if_lost();
        let reads = self.control.lock().unrecorded(RECORD_STEP);
        let records = reads.read()?;
        if records.is_empty() {
            return Ok(0);
        }
        self.settled
            .append(&records)
            .map_err(ControlError::SettledRows)?;
        self.control
            .lock()
            .note_recorded(records.iter().map(|j| j.id));
        Ok(records.len())
    }

    /// If a query found the settled rows' files lost: deletes them and marks every settled job
    /// unrecorded, in a new epoch, under the control lock.
    pub fn start_over_if_lost(&self) {
        if let Some(why) = self.settled.lost() {
            let mut control = self.control.lock();
            self.settled.reset();
            let jobs = control.forget_recorded();
            drop(control);
            tracing::warn!(jobs, reason = %why, "deleted the settled rows files; writing them again from the job database");
        }
    }

    /// Visits every job record in id order, [`SCAN_CHUNK`] at a time under the control lock,
    /// which is let go between chunks: SQL over the `jobs` table of a long history held the
    /// lock, and every agent's sync behind it, for the whole history (160 ms at 20,000 jobs,
    /// growing with every job ever run). Settled jobs' records are read from the job database
    /// outside the lock. Each record is visited once, as it was when its chunk was read.
    #[cfg(any(test, feature = "testing"))]
    pub fn scan_jobs(&self, mut visit: impl FnMut(&JobRecord)) -> Result<(), ControlError> {
        self.walk_jobs(
            Walk::all(Settled::All),
            |_| true,
            |job| {
                visit(&job);
                true
            },
        )
        .map(|_| ())
    }

    /// Walks the jobs [`SCAN_CHUNK`] ids at a time under the control lock, handed on fairly
    /// between chunks (to whoever waits, an agent's sync, not back to this walk at once, as an
    /// unfair unlock would), as `walk` says. Of the jobs it takes that `keep` accepts, at most
    /// `walk.want`, `visit` sees each record once, as its chunk found it, and returns false to
    /// stop. Records held whole are copied under the lock; settled jobs' are read from the job
    /// database after it (they are durable and do not change, [`control`]'s `archive`).
    /// Returns the last change set queued while it walked ([`Commits::seen`]).
    fn walk_jobs(
        &self,
        walk: Walk,
        keep: impl Fn(Brief<'_>) -> bool,
        mut visit: impl FnMut(JobRecord) -> bool,
    ) -> Result<u64, ControlError> {
        let Walk {
            from,
            newest_first,
            mut want,
            settled,
            view,
        } = walk;
        /// A job taken under the lock: its record, or a settled job's id (its record is read
        /// after letting go of the lock).
        enum Walked {
            Whole(Box<JobRecord>),
            Settled(u64),
        }
        let (mut cursor, mut seen) = (from, 0);
        loop {
            let control = self.control.lock();
            seen = seen.max(self.commits.seen());
            let range = if newest_first {
                0..cursor
            } else {
                cursor..u64::MAX
            };
            let ids = control.ids_in(range, newest_first, SCAN_CHUNK, settled);
            let mut done = ids.len() < SCAN_CHUNK;
            let mut items = Vec::new();
            for &id in &ids {
                cursor = if newest_first { id } else { id + 1 };
                match control.find(id) {
                    Some(found) if keep(found.brief()) => items.push(match found {
                        Found::Live(job) if view => Walked::Whole(Box::new(control.view_of(job))),
                        Found::Live(job) => Walked::Whole(Box::new(job.clone())),
                        Found::Settled(..) => Walked::Settled(id),
                    }),
                    _ => {}
                }
                if items.len() == want {
                    done = true;
                    break;
                }
            }
            want -= items.len();
            let settled: Vec<u64> = items
                .iter()
                .filter_map(|w| match w {
                    Walked::Settled(id) => Some(*id),
                    Walked::Whole(_) => None,
                })
                .collect();
            let reads = control.settled_reads(settled);
            parking_lot::MutexGuard::unlock_fair(control);
            let mut read = reads.read()?.into_iter();
            for item in items {
                let job = match item {
                    Walked::Whole(job) => *job,
                    Walked::Settled(_) => read.next().expect("one record per settled id"),
                };
                if !visit(job) {
                    return Ok(seen);
                }
            }
            if done {
                return Ok(seen);
            }
        }
    }

    /// The newest `limit` jobs below id `before` that `keep` accepts, newest first, as
    /// [`Control::view`] shows them (fewer if they pass [`MAX_PAGE_BYTES`]), and the `before`
    /// of the next page when this one is full. A filter few jobs match reads the whole
    /// history, a chunk at a time ([`JobService::walk_jobs`]). Returns once every change it
    /// saw is durable. Blocking: call it off the async threads ([`JobService::listing`]).
    pub fn list_jobs(
        &self,
        before: u64,
        limit: usize,
        keep: impl Fn(Brief<'_>) -> bool,
    ) -> Result<(Vec<JobRecord>, Option<u64>), ControlError> {
        let (mut jobs, mut bytes, mut full) = (Vec::new(), 0, false);
        let walk = Walk {
            from: before,
            newest_first: true,
            want: limit,
            settled: Settled::All,
            view: true,
        };
        let seen = self.walk_jobs(walk, keep, |job| {
            bytes += job.weight();
            jobs.push(job);
            full = jobs.len() == limit || bytes >= MAX_PAGE_BYTES;
            !full
        })?;
        self.commits.wait(seen)?;
        let next = full.then(|| jobs.last().map(|j| j.id)).flatten();
        Ok((jobs, next))
    }

    /// The first `limit` jobs of the queue ([`Control::queue`]) and its length, once every
    /// change it saw is durable. Blocking: call it off the async threads
    /// ([`JobService::listing`]).
    pub fn queue_page(&self, limit: usize) -> Result<control::QueuePage, ControlError> {
        let (page, seen) = {
            let control = self.control.lock();
            (control.queue(limit), self.commits.seen())
        };
        self.commits.wait(seen)?;
        Ok(page)
    }

    /// Runs `make` (a job listing written as JSON for `user`) off the async threads, at most
    /// [`CONCURRENT_LISTINGS`] at a time, and answers with its text, which holds its size of
    /// [`USER_PAGES_IN_FLIGHT_BYTES`] and of [`PAGES_IN_FLIGHT_BYTES`] until the client has
    /// read it (or gone): the [`Page`]'s pieces hold it.
    pub async fn listing<E: From<ControlError> + Send + 'static>(
        &self,
        user: &str,
        make: impl FnOnce(&JobService) -> Result<Vec<u8>, E> + Send + 'static,
    ) -> Result<Page, E> {
        let theirs = self.user_pages(user);
        let mut rooms = [
            page_room(theirs, USER_PAGES_IN_FLIGHT_BYTES, "your job listings").await?,
            page_room(
                self.pages_in_flight.clone(),
                PAGES_IN_FLIGHT_BYTES,
                "job listings",
            )
            .await?,
        ];
        let page = {
            let _turn = turn(&self.listings, "jobs cannot be listed").await?;
            let jobs = self.clone();
            tokio::task::spawn_blocking(move || make(&jobs))
                .await
                .map_err(|e| E::from(task_failed(e)))??
        };
        // Give back what the page does not take.
        let spare = kib(PAGE_RESERVE).saturating_sub(kib(page.len()));
        for room in &mut rooms {
            drop(room.split(spare as usize));
        }
        let page = bytes::Bytes::from(page);
        let pieces: Vec<bytes::Bytes> = (0..page.len())
            .step_by(PAGE_PIECE)
            .map(|at| page.slice(at..page.len().min(at + PAGE_PIECE)))
            .collect();
        Ok(Page { pieces, rooms })
    }

    /// `user`'s share of the pages in flight ([`USER_PAGES_IN_FLIGHT_BYTES`]).
    fn user_pages(&self, user: &str) -> Arc<tokio::sync::Semaphore> {
        let mut shares = lock(&self.user_pages);
        if shares.len() >= USER_SHARES_KEPT {
            // Shares with nothing in flight are as good as new.
            let whole = USER_PAGES_IN_FLIGHT_BYTES >> 10;
            shares.retain(|_, s| s.available_permits() < whole);
        }
        shares
            .entry(user.to_owned())
            .or_insert_with(|| {
                Arc::new(tokio::sync::Semaphore::new(
                    USER_PAGES_IN_FLIGHT_BYTES >> 10,
                ))
            })
            .clone()
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

    /// Why the job database cannot commit, while it cannot (`/readyz`, the built-in alert
    /// `JobDatabaseFailing`).
    pub fn failing(&self) -> Option<String> {
        self.commits.failed()
    }

    /// After a commit failed: reopens the job database and rebuilds the control plane from
    /// what it holds, as a restart would (the changes refused since were answered as such, and
    /// agents get a heartbeat timeout from now to report what runs). Agents' claims on their
    /// nodes are kept. Fails, changing nothing, while the database cannot be reopened or the
    /// rebuilt state written (the disk still full); the ticker tries again. Blocking.
    pub fn recover(&self) -> Result<(), ControlError> {
        let mut control = self.control.lock();
        if self.commits.failed().is_none() {
            return Ok(());
        }
        // No commit runs while the control lock is held and the commits failed.
        self.commits.db.reopen()?;
        let loaded = self.commits.db.load()?;
        let config = control.config.clone();
        let mut rebuilt =
            Control::open(&self.dir, config, self.now_ms(), loaded, &self.commits.db)?;
        rebuilt.claims = self.claims.clone();
        {
            let mut known = self.known_nodes.write().unwrap_or_else(|p| p.into_inner());
            *known = rebuilt
                .known_nodes
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
        }
        rebuilt.known_nodes = self.known_nodes.clone();
        // Which settled jobs the rows' files hold is not known to the rebuilt state: they are
        // written again from the job database (SQL reads it meanwhile).
        self.settled.reset();
        rebuilt.forget_recorded();
        let mut dirty = rebuilt.take_dirty();
        self.commits.db.save(&dirty)?;
        if !dirty.events.is_empty() {
            let _ = self.commits.events.send(std::mem::take(&mut dirty.events));
        }
        *control = rebuilt;
        let mut s = lock(&self.commits.state);
        s.queued = db::Dirty::default();
        s.committed_seq = s.queued_seq;
        s.failed = None;
        drop(s);
        tracing::info!(
            "the job database commits again: reopened, and the control plane rebuilt from it"
        );
        Ok(())
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
    /// added [`ARRAY_STEP`] tasks at a time, each step committed on its own, so agents' syncs
    /// and other requests get the control plane between steps. The steps run in a task of
    /// their own: a client that hangs up does not leave an array half added. A server that
    /// dies part way keeps the steps committed so far (their ids are the array's first).
    /// Returns the first job and the array's ids, with a warning when no set of today's nodes
    /// could run it.
    pub async fn submit(
        &self,
        request: JobRequest,
        operator: bool,
    ) -> Result<(JobRecord, Vec<u64>, Option<String>), ControlError> {
        let service = self.clone();
        tokio::spawn(async move {
            let request = Arc::new(request);
            let r = request.clone();
            let (first, warning) = service
                .run(move |c, now| {
                    if !operator {
                        c.may_charge(&r)?;
                    }
                    let warning = c.shape_warning(&r);
                    let first = c.start_array(&r, now)?;
                    Ok((first, warning))
                })
                .await?;
            let count = request.array.unwrap_or(1);
            let mut done = 0;
            while done < count {
                let step = done..count.min(done + ARRAY_STEP);
                done = step.end;
                let r = request.clone();
                let added = service
                    .run(move |c, now| c.submit_array_tasks(&r, first, step, now))
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

    /// Cancels the jobs `selection` names for `who` ([`Control::cancel_targets`]),
    /// [`CANCEL_STEP`] at a time, each step committed on its own, so agents' syncs and other
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
            let targets = service
                .run(move |c, _| c.cancel_targets(&selection, &w))
                .await?;
            let mut outcome = CancelOutcome::default();
            for step in targets.chunks(CANCEL_STEP) {
                let (step, w) = (step.to_vec(), who.clone());
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

    /// Ticks the control plane ([`Control::tick`]), and takes settled jobs' records out of
    /// memory once durable ([`Control::archive_settled`]).
    pub async fn tick(&self) -> Result<(), ControlError> {
        let commits = self.commits.clone();
        self.run(move |c, now| {
            c.tick(now)?;
            let (seen, committed) = commits.seqs();
            c.archive_settled(now, seen, committed);
            Ok(())
        })
        .await
    }

    /// Deletes the stored output of jobs that ended longer than `server.job_output_days` ago
    /// (their records stay, marked, so `perch logs` says so): the job directories are listed
    /// and removed outside the control lock, only the marking takes it. Returns how many
    /// directories were removed.
    pub async fn expire_output(&self) -> Result<usize, ControlError> {
        let control = self.control.clone();
        let present = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u64>> {
            let dir = control.lock().logs_dir();
            match std::fs::read_dir(&dir) {
                Ok(entries) => Ok(entries
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(e),
            }
        })
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))?
        .map_err(ControlError::Logs)?;
        if present.is_empty() {
            return Ok(0);
        }
        let remove = self
            .run(move |c, now| Ok(c.expire_output(now, &present)))
            .await?;
        tokio::task::spawn_blocking(move || {
            let mut removed = 0;
            for path in remove {
                match std::fs::remove_dir_all(&path) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "could not delete a job's expired output; trying again at the next check")
                    }
                }
            }
            removed
        })
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))
    }

    /// Ticks the control plane every second until `shutdown`, writes settled jobs' rows
    /// ([`JobService::record_settled`]) beside it, and deletes expired job output
    /// every [`OUTPUT_EXPIRY_PERIOD`] (first at start) in a task of its own, one at a time: a
    /// server upgraded with years of output to delete keeps ticking (time limits, silent
    /// nodes) while it does.
    pub async fn run_ticker(self, shutdown: impl std::future::Future<Output = ()>) {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        let mut expiry = tokio::time::interval(OUTPUT_EXPIRY_PERIOD);
        let mut expiring: Option<tokio::task::JoinHandle<()>> = None;
        let mut recording: Option<tokio::task::JoinHandle<Result<usize, ControlError>>> = None;
        let (mut record_after, mut record_backoff) =
            (tokio::time::Instant::now(), RECORD_RETRY_MIN);
        let (mut recover_after, mut recover_backoff) =
            (tokio::time::Instant::now(), RECOVER_RETRY_MIN);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tick.tick() => {
                    if self.failing().is_some() {
                        // Nothing ticks on a state the job database cannot take: reopen it.
                        if tokio::time::Instant::now() >= recover_after {
                            let service = self.clone();
                            let recovered = tokio::task::spawn_blocking(move || service.recover()).await;
                            match recovered.map_err(|e| ControlError::TaskFailed(e.to_string())).and_then(|r| r) {
                                Ok(()) => recover_backoff = RECOVER_RETRY_MIN,
                                Err(e) => {
                                    tracing::warn!(error = %e, retry_secs = recover_backoff.as_secs(), "the job database cannot be reopened yet");
                                    recover_after = tokio::time::Instant::now() + recover_backoff;
                                    recover_backoff = (recover_backoff * 2).min(RECOVER_RETRY_MAX);
                                }
                            }
                        }
                        continue;
                    }
                    if let Err(e) = self.tick().await {
                        tracing::error!(error = %e, "job control tick failed");
                    }
                    // Settled jobs' rows are written beside the ticks, one step at a time: a
                    // server upgraded with a long history writes it while it goes on ticking.
                    if recording.as_ref().is_some_and(|task| task.is_finished()) {
                        let done = recording.take().expect("checked").await;
                        match done.map_err(|e| ControlError::TaskFailed(e.to_string())).and_then(|r| r) {
                            Ok(_) => record_backoff = RECORD_RETRY_MIN,
                            Err(e) => {
                                tracing::error!(error = %e, retry_secs = record_backoff.as_secs(), "writing settled jobs' rows failed; SQL reads them from the job database until a later try works");
                                record_after = tokio::time::Instant::now() + record_backoff;
                                record_backoff = (record_backoff * 2).min(RECORD_RETRY_MAX);
                            }
                        }
                    }
                    if recording.is_none() && tokio::time::Instant::now() >= record_after {
                        let service = self.clone();
                        recording = Some(tokio::task::spawn_blocking(move || service.record_settled()));
                    }
                }
                _ = expiry.tick() => {
                    // One at a time: a check still deleting a backlog is not joined by another.
                    if expiring.as_ref().is_none_or(|task| task.is_finished()) {
                        let service = self.clone();
                        expiring = Some(tokio::spawn(async move {
                            match service.expire_output().await {
                                Ok(0) => {}
                                Ok(n) => tracing::info!(jobs = n, "deleted the stored output of jobs that ended longer ago than server.job_output_days"),
                                Err(e) => tracing::error!(error = %e, "deleting expired job output failed"),
                            }
                        }));
                    }
                }
            }
        }
        // A write of settled rows under way ends before the ticker does: nothing holds the
        // job database once the server has stopped.
        if let Some(task) = recording {
            let _ = task.await;
        }
    }
}
