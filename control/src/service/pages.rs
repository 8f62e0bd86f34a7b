//! Job listings: pages bounded in jobs and bytes, made at most a few at a time, each holding
//! its room among the pages in flight (per user and in all) until its client has read it.

use super::*;

/// Jobs one page of `GET /v1/jobs` or `GET /v1/queue` holds at most: 100,000 full records
/// were about 70 MB of JSON and 5 s of a core each, and four such requests at once held every
/// agent's sync for 10 s and took the server from 0.4 to 3.7 GB.
pub const MAX_PAGE: usize = 10_000;

/// Bytes of jobs one page holds at most, roughly ([`JobRecord::weight`]): 10,000 jobs with
/// a 64 KiB environment each would be 640 MB. A page ends at the job that passes it.
pub const MAX_PAGE_BYTES: usize = 32 << 20;

/// Job listings (`GET /v1/jobs`, `GET /v1/queue`) selected and written at the same time, at
/// most: more wait their turn instead of taking every core and the memory of their pages.
pub(super) const CONCURRENT_LISTINGS: usize = 2;

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
pub(super) const USER_SHARES_KEPT: usize = 1024;

/// How long a listing waits for room among the pages in flight before it is refused.
pub(super) const PAGE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The pieces a page is sent in.
pub(super) const PAGE_PIECE: usize = 64 << 10;

/// A job listing made by [`JobService::listing`]: its text in pieces, holding its room among
/// the pages in flight until the stream of its pieces is dropped (the client has read the
/// last, or has gone).
pub struct Page {
    pub(super) pieces: Vec<bytes::Bytes>,
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

/// KiB, rounded up: the unit of the pages-in-flight semaphores.
pub(super) fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

/// Room for one page being made ([`PAGE_RESERVE`]) among `rooms` (`limit` bytes of `what` in
/// all), waited for up to [`PAGE_WAIT`]; then refused saying why.
pub(super) async fn page_room(
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

impl JobService {
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
    pub(super) fn user_pages(&self, user: &str) -> Arc<tokio::sync::Semaphore> {
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
}
