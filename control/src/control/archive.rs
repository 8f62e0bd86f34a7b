//! Settled jobs: ended, accounted, nothing left to change ([`JobRecord::is_settled`]). Ten
//! minutes after its end ([`ARCHIVE_AFTER_MS`]) a settled job's record leaves memory; it stays
//! in the job database, and views, listings and SQL read it back from there. The control
//! plane keeps a summary of each ([`Archived`]: state, owner, account, array, end, output
//! deletion) for what asks about any job (dependencies, cancels, ownership, listings'
//! filters, output expiry), and running totals for what adds them all up (fair share, usage
//! on `/metrics`, job counts). A server kept every record whole for ever: about 7 KB a job,
//! 7 GB after a million; a summary and its share of the totals take about 200 bytes.
//!
//! A record leaves memory only once its last change is durable: a job found settled is marked
//! with the last change set queued then ([`super::super::Commits::seen`]), and it leaves at a
//! later tick once that change set is committed, unless it changed meanwhile. Read back, a
//! record is therefore what memory held. Its one later change, the deletion of its stored
//! output, is kept in the summary and written to the database as a patch
//! ([`crate::db::Dirty::output_deleted`]).

use super::*;
use crate::cost::{Prices, gpu_figures};
use crate::record::ARCHIVE_AFTER_MS;
use crate::store::JobStore;
use crate::usage::decayed_gpu_ms;
use std::borrow::Cow;

/// Settled jobs found per look, at most (one lock hold moves them out of memory).
const ARCHIVE_STEP: usize = 10_000;

/// How often the control plane looks for settled jobs.
const ARCHIVE_PERIOD_MS: i64 = 30_000;

/// What memory keeps of a settled job.
#[derive(Debug, Clone, Copy)]
pub struct Archived {
    state: JobState,
    user: u32,
    account: u32,
    array: Option<ArrayTask>,
    end_ms: i64,
    output_deleted_ms: Option<i64>,
}

/// A job as the control plane knows it: its whole record, or a settled job's summary.
#[derive(Clone, Copy)]
pub enum Found<'a> {
    Live(&'a JobRecord),
    Settled(&'a Archived, &'a Names),
}

/// Which settled jobs a walk of ids takes ([`Control::ids_in`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    All,
    /// Only those whose rows are not yet in the settled rows' files
    /// (the server's settled rows (`SettledRecords`)).
    Unrecorded,
}

/// What listings filter on.
#[derive(Debug, Clone, Copy)]
pub struct Brief<'a> {
    pub state: JobState,
    pub user: &'a str,
    pub account: &'a str,
}

impl<'a> Found<'a> {
    pub fn state(self) -> JobState {
        match self {
            Found::Live(j) => j.state,
            Found::Settled(a, _) => a.state,
        }
    }

    pub fn user(self) -> &'a str {
        match self {
            Found::Live(j) => j.request.user(),
            Found::Settled(a, names) => names.get(a.user),
        }
    }

    pub fn account(self) -> &'a str {
        match self {
            Found::Live(j) => j.request.account(),
            Found::Settled(a, names) => names.get(a.account),
        }
    }

    pub fn array(self) -> Option<ArrayTask> {
        match self {
            Found::Live(j) => j.array,
            Found::Settled(a, _) => a.array,
        }
    }

    pub fn brief(self) -> Brief<'a> {
        Brief {
            state: self.state(),
            user: self.user(),
            account: self.account(),
        }
    }
}

/// Users' and accounts' names, each kept once.
#[derive(Default)]
pub struct Names {
    names: Vec<String>,
    index: HashMap<String, u32>,
}

impl Names {
    fn id(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(name.to_owned());
        self.index.insert(name.to_owned(), i);
        i
    }

    fn get(&self, id: u32) -> &str {
        self.names.get(id as usize).map_or("", String::as_str)
    }
}

/// One allocation of a settled job, for fair share.
struct PastRun {
    account: u32,
    /// GPUs held (a shared GPU's part counted as such).
    gpus: f64,
    start_ms: i64,
    end_ms: i64,
}

/// The settled allocations' decayed GPU-time per account, as of `at_ms`, under `half_life`.
struct Decayed {
    half_life: i64,
    at_ms: i64,
    by_account: HashMap<u32, f64>,
}

/// A settled job's GPU-seconds and energy by (account, user, GPU model): its share of
/// `/metrics`' usage, priced when asked ([`gpu_figures`] with the prices of the moment).
#[derive(Debug, Default, Clone, Copy)]
struct UsageSums {
    allocated_seconds: f64,
    /// Of the allocated seconds, those of GPUs whose use is known: what used is measured
    /// against (a settled job's accounted window is the whole of it).
    accounted_seconds: f64,
    used_seconds: f64,
    /// Energy of the GPUs held whole.
    energy_joules: f64,
    /// Of it, the GPUs whose use is known.
    energy_used_joules: f64,
}

/// The settled jobs ([`Control::archive_settled`]).
pub struct Archive {
    jobs: BTreeMap<u64, Archived>,
    names: Names,
    models: Names,
    by_state: HashMap<JobState, u64>,
    runs: Vec<PastRun>,
    decayed: Option<Decayed>,
    usage: HashMap<(u32, u32, u32), UsageSums>,
    /// Settled jobs whose rows are not yet in the settled rows' files
    /// (the server's settled rows (`SettledRecords`)): SQL reads their records from the job database.
    unrecorded: BTreeSet<u64>,
    /// Jobs held whole whose rows are in those files already (found there at start).
    recorded_live: HashSet<u64>,
    /// Jobs found settled, and the last change set queued when they were: they leave memory
    /// once it is committed, unless they changed since ([`Control::take_dirty`] drops those).
    marked: Option<(u64, BTreeSet<u64>)>,
    /// When to look for settled jobs next.
    next_look_ms: i64,
    reader: std::sync::Arc<dyn JobStore>,
}

impl Archive {
    pub fn new(reader: std::sync::Arc<dyn JobStore>) -> Archive {
        Archive {
            jobs: BTreeMap::new(),
            names: Names::default(),
            models: Names::default(),
            by_state: HashMap::new(),
            runs: Vec::new(),
            decayed: None,
            usage: HashMap::new(),
            unrecorded: BTreeSet::new(),
            recorded_live: HashSet::new(),
            marked: None,
            next_look_ms: i64::MIN,
            reader,
        }
    }

    /// Keeps the summary of `job`, whose record is durable and leaves memory.
    pub fn insert(&mut self, job: &JobRecord) {
        let user = self.names.id(job.request.user());
        let account = self.names.id(job.request.account());
        let end_ms = job.end_ms.unwrap_or(job.submit_ms);
        self.jobs.insert(
            job.id,
            Archived {
                state: job.state,
                user,
                account,
                array: job.array,
                end_ms,
                output_deleted_ms: job.output_deleted_ms,
            },
        );
        *self.by_state.entry(job.state).or_default() += 1;
        if !self.recorded_live.remove(&job.id) {
            self.unrecorded.insert(job.id);
        }
        for a in &job.allocations {
            let run = PastRun {
                account,
                gpus: a.gpus.len() as f64 * a.gpu_fraction(),
                start_ms: a.start_ms,
                end_ms: a.end_or(end_ms),
            };
            if let Some(d) = &mut self.decayed {
                let at = d.at_ms.max(run.end_ms);
                advance(d, at);
                *d.by_account.entry(account).or_default() +=
                    decayed_gpu_ms(run.gpus, run.start_ms, run.end_ms, at, d.half_life);
            }
            self.runs.push(run);
            let model = self.models.id(&a.gpu_model);
            let sums = self.usage.entry((account, user, model)).or_default();
            for g in 0..a.gpus.len() {
                // Unpriced: seconds and energy only (prices are applied when asked).
                let f = gpu_figures(a, g, end_ms, &Prices::default());
                sums.allocated_seconds += f.allocated_seconds;
                if a.share_percent.is_none() {
                    let energy = f.energy_joules.unwrap_or(0.0);
                    sums.energy_joules += energy;
                    if let Some(used) = f.used_seconds {
                        sums.used_seconds += used;
                        sums.accounted_seconds += f.accounted_seconds.unwrap_or(0.0);
                        sums.energy_used_joules += energy;
                    }
                }
            }
        }
    }

    /// Each account's settled GPU-time, decayed with `half_life` up to `now`.
    fn decayed(&mut self, now: i64, half_life: i64) -> impl Iterator<Item = (&str, f64)> {
        if self
            .decayed
            .as_ref()
            .is_none_or(|d| d.half_life != half_life)
        {
            // First asked, or the policy's half-life changed: from every settled run.
            let at = self
                .runs
                .iter()
                .map(|r| r.end_ms)
                .max()
                .unwrap_or(now)
                .max(now);
            let mut by_account: HashMap<u32, f64> = HashMap::new();
            for r in &self.runs {
                *by_account.entry(r.account).or_default() +=
                    decayed_gpu_ms(r.gpus, r.start_ms, r.end_ms, at, half_life);
            }
            self.decayed = Some(Decayed {
                half_life,
                at_ms: at,
                by_account,
            });
        }
        let d = self.decayed.as_mut().expect("just made");
        if now > d.at_ms {
            advance(d, now);
        }
        let names = &self.names;
        d.by_account.iter().map(move |(&a, &v)| (names.get(a), v))
    }
}

/// Moves decayed GPU-time forward to `at`: a run that ended is worth `2^(-t/half_life)` of
/// itself `t` later.
fn advance(d: &mut Decayed, at: i64) {
    if at == d.at_ms {
        return;
    }
    let factor = (-((at - d.at_ms) as f64) / d.half_life.max(1) as f64).exp2();
    for v in d.by_account.values_mut() {
        *v *= factor;
    }
    d.at_ms = at;
}

impl Control {
    /// Job `id`, whole or settled.
    pub fn find(&self, id: u64) -> Option<Found<'_>> {
        match self.jobs.get(&id) {
            Some(job) => Some(Found::Live(job)),
            None => self
                .archive
                .jobs
                .get(&id)
                .map(|a| Found::Settled(a, &self.archive.names)),
        }
    }

    /// Job `id`'s record: from memory, or a settled job's from the job database.
    pub fn record(&self, id: u64) -> Result<Option<Cow<'_, JobRecord>>, ControlError> {
        if let Some(job) = self.jobs.get(&id) {
            return Ok(Some(Cow::Borrowed(job)));
        }
        if !self.archive.jobs.contains_key(&id) {
            return Ok(None);
        }
        let mut read = self.settled_records(&[id])?;
        Ok(read.pop().map(Cow::Owned))
    }

    /// The stored records of settled jobs `ids`, as memory knows them. Reads the job
    /// database: keep `ids` short under the control lock ([`Control::settled_reads`] reads
    /// after it).
    pub fn settled_records(&self, ids: &[u64]) -> Result<Vec<JobRecord>, ControlError> {
        self.settled_reads(ids.to_vec()).read()
    }

    /// What reading settled jobs `ids` back takes, to be read after letting go of the control
    /// lock: their records are durable and change only by the deletion of their output, which
    /// memory knows first (its commit may still be under way).
    pub fn settled_reads(&self, ids: Vec<u64>) -> SettledReads {
        let deleted = ids
            .iter()
            .map(|id| self.archive.jobs.get(id).and_then(|a| a.output_deleted_ms))
            .collect();
        SettledReads {
            reader: self.archive.reader.clone(),
            ids,
            deleted,
        }
    }

    /// Marks settled job `id`'s stored output deleted at `now`: in its summary at once, in the
    /// job database with the next commit. False if it was already.
    pub(super) fn delete_settled_output(&mut self, id: u64, now: i64) -> bool {
        let Some(a) = self.archive.jobs.get_mut(&id) else {
            return false;
        };
        if a.output_deleted_ms.is_some() {
            return false;
        }
        a.output_deleted_ms = Some(now);
        self.deleted_output.push((id, now));
        true
    }

    /// Settled job `id`'s end and output deletion.
    pub(super) fn settled_times(&self, id: u64) -> Option<(i64, Option<i64>)> {
        self.archive
            .jobs
            .get(&id)
            .map(|a| (a.end_ms, a.output_deleted_ms))
    }

    /// The ids of jobs in `range` (held whole, and the `settled` ones), in id order or
    /// (`newest_first`) the reverse, at most `max`.
    pub fn ids_in(
        &self,
        range: std::ops::Range<u64>,
        newest_first: bool,
        max: usize,
        settled: Settled,
    ) -> Vec<u64> {
        let live = self.jobs.range(range.clone()).map(|(&id, _)| id);
        let settled: Box<dyn DoubleEndedIterator<Item = u64>> = match settled {
            Settled::All => Box::new(self.archive.jobs.range(range).map(|(&id, _)| id)),
            Settled::Unrecorded => Box::new(self.archive.unrecorded.range(range).copied()),
        };
        if newest_first {
            merge(live.rev(), settled.rev(), |a, b| a > b, max)
        } else {
            merge(live, settled, |a, b| a < b, max)
        }
    }

    /// Takes settled jobs' records out of memory, in two steps a tick or more apart: finds
    /// those settled for [`ARCHIVE_AFTER_MS`] (every [`ARCHIVE_PERIOD_MS`], at most
    /// [`ARCHIVE_STEP`]) and marks them with `seen`, the last change set queued; once
    /// `committed` has reached it, those that have not changed since leave memory. Returns
    /// how many did.
    pub fn archive_settled(&mut self, now: i64, seen: u64, committed: u64) -> usize {
        let before = now.saturating_sub(ARCHIVE_AFTER_MS);
        if let Some((seq, ids)) = self.archive.marked.take() {
            if seq > committed {
                self.archive.marked = Some((seq, ids));
                return 0;
            }
            let mut moved = BTreeSet::new();
            for id in ids {
                if self.dirty_jobs.contains(&id)
                    || !self.jobs.get(&id).is_some_and(|j| j.is_settled(before))
                {
                    continue;
                }
                if let Some(job) = self.jobs.remove(&id) {
                    self.archive.insert(&job);
                    moved.insert(id);
                }
            }
            // Launches handed over stay known until the job leaves memory.
            self.delivered.retain(|(_, job)| !moved.contains(job));
            return moved.len();
        }
        if now < self.archive.next_look_ms {
            return 0;
        }
        self.archive.next_look_ms = now.saturating_add(ARCHIVE_PERIOD_MS);
        let ids: BTreeSet<u64> = self
            .jobs
            .values()
            .filter(|j| j.is_settled(before))
            .map(|j| j.id)
            .take(ARCHIVE_STEP)
            .collect();
        if !ids.is_empty() {
            // Looked for again as soon as these are out, while a backlog lasts.
            if ids.len() == ARCHIVE_STEP {
                self.archive.next_look_ms = now;
            }
            self.archive.marked = Some((seen, ids));
        }
        0
    }

    /// Jobs changed by the operation now committing cannot leave memory on their mark.
    pub(super) fn unmark(&mut self, changed: &BTreeSet<u64>) {
        if let Some((_, ids)) = &mut self.archive.marked {
            for id in changed {
                ids.remove(id);
            }
        }
    }

    /// Each account's GPU-time, decayed with the policy's half-life up to `now`, settled jobs
    /// and the rest: what fair share is made of.
    pub(super) fn decayed_usage(&mut self, now: i64) -> BTreeMap<String, f64> {
        let half_life = self.config.policy.usage_half_life;
        let mut usage: BTreeMap<String, f64> = BTreeMap::new();
        for job in self.jobs.values() {
            let mut total = 0.0;
            for a in &job.allocations {
                total += decayed_gpu_ms(
                    a.gpus.len() as f64 * a.gpu_fraction(),
                    a.start_ms,
                    a.end_or(now),
                    now,
                    half_life,
                );
            }
            if total > 0.0 {
                *usage.entry(job.request.account().to_owned()).or_default() += total;
            }
        }
        for (account, v) in self.archive.decayed(now, half_life) {
            if v > 0.0 {
                *usage.entry(account.to_owned()).or_default() += v;
            }
        }
        usage
    }

    /// Settled jobs' usage and cost per (account, user), at `prices`.
    pub(super) fn settled_usage(&self, prices: &Prices) -> Vec<UsageView> {
        let mut by: BTreeMap<(u32, u32), UsageView> = BTreeMap::new();
        let names = &self.archive.names;
        for (&(account, user, model), s) in &self.archive.usage {
            let price = prices.gpu_hour(self.archive.models.get(model));
            let kwh = prices.energy_per_kwh / 3.6e6;
            let u = by.entry((account, user)).or_insert_with(|| UsageView {
                account: names.get(account).to_owned(),
                user: names.get(user).to_owned(),
                ..UsageView::default()
            });
            u.gpu_seconds_allocated += s.allocated_seconds;
            u.gpu_seconds_accounted += s.accounted_seconds;
            u.gpu_seconds_used += s.used_seconds;
            u.cost_allocated += s.allocated_seconds / 3600.0 * price + s.energy_joules * kwh;
            u.cost_accounted += s.accounted_seconds / 3600.0 * price + s.energy_used_joules * kwh;
            u.cost_used += s.used_seconds / 3600.0 * price + s.energy_used_joules * kwh;
        }
        by.into_values().collect()
    }

    /// Settled jobs by state.
    pub(super) fn settled_by_state(&self) -> impl Iterator<Item = (JobState, u64)> + '_ {
        self.archive.by_state.iter().map(|(&s, &n)| (s, n))
    }

    /// The first `max` settled jobs whose rows are not yet in the settled rows' files, to be
    /// read after letting go of the control lock.
    pub fn unrecorded(&self, max: usize) -> SettledReads {
        self.settled_reads(self.archive.unrecorded.iter().take(max).copied().collect())
    }

    /// Jobs `ids` have their rows in the settled rows' files (written, or found there at
    /// start): SQL reads them from there from now on.
    pub fn note_recorded(&mut self, ids: impl IntoIterator<Item = u64>) {
        for id in ids {
            if !self.archive.unrecorded.remove(&id) && self.jobs.contains_key(&id) {
                self.archive.recorded_live.insert(id);
            }
        }
    }

    /// The first of `ids` (found in the settled rows' files) that is no ended job of this job
    /// database: files another database's jobs filled (a job database restored from an older
    /// backup beside newer files), whose rows SQL would show as jobs that never ran here, or
    /// twice once the ids are given again.
    pub fn first_foreign(&self, ids: &[u64]) -> Option<u64> {
        ids.iter().copied().find(|id| {
            !self.archive.jobs.contains_key(id)
                && !self.jobs.get(id).is_some_and(|j| j.state.is_final())
        })
    }

    /// Every settled job is to be written to the settled rows' files again (they were lost):
    /// none counts as recorded. Returns how many there are.
    pub fn forget_recorded(&mut self) -> usize {
        self.archive.recorded_live.clear();
        self.archive.unrecorded = self.archive.jobs.keys().copied().collect();
        self.archive.unrecorded.len()
    }

    /// Settled jobs.
    #[cfg(any(test, feature = "testing"))]
    pub fn settled_count(&self) -> usize {
        self.archive.jobs.len()
    }
}

/// Settled jobs' records to read back ([`Control::settled_reads`]).
pub struct SettledReads {
    reader: std::sync::Arc<dyn JobStore>,
    ids: Vec<u64>,
    /// When each one's stored output was deleted, if it was.
    deleted: Vec<Option<i64>>,
}

impl SettledReads {
    /// The records, in the order of their ids.
    pub fn read(self) -> Result<Vec<JobRecord>, ControlError> {
        if self.ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut records = self.reader.get(&self.ids)?;
        for (job, at) in records.iter_mut().zip(self.deleted) {
            if let Some(at) = at {
                job.delete_output(at);
            }
        }
        Ok(records)
    }
}

/// The first `max` of two sorted id sequences merged (`first(a, b)`: a comes before b).
fn merge(
    a: impl Iterator<Item = u64>,
    b: impl Iterator<Item = u64>,
    first: impl Fn(u64, u64) -> bool,
    max: usize,
) -> Vec<u64> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    let mut out = Vec::new();
    while out.len() < max {
        let next = match (a.peek(), b.peek()) {
            (Some(&x), Some(&y)) if first(x, y) => a.next(),
            (Some(_), Some(_)) => b.next(),
            (Some(_), None) => a.next(),
            (None, Some(_)) => b.next(),
            (None, None) => break,
        };
        out.extend(next);
    }
    out
}
