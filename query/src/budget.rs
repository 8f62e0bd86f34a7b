//! What all users' queries share: a cap on how many run at once, one memory budget and one
//! spill allowance for the whole server.
//!
//! Each slot has its own runtime (its own worker threads), so queries share the CPU through
//! the kernel's scheduler rather than through tokio's: DataFusion yields to other tasks only
//! between batches, and one CPU-heavy query on a shared runtime held every other query (even
//! `SELECT 42`) until it ended.
//!
//! Each query still has its own memory limit ([`QueryLimits::memory_bytes`]); its pool charges
//! every reservation to the query and to the server's budget, so a handful of queries each
//! under its own limit cannot together take the machine. A query refused by the server's
//! budget (not by its own limit) is told the server is busy, not that it asked too much.
//!
//! [`QueryLimits::memory_bytes`]: crate::QueryLimits::memory_bytes

use crate::{Error, QueryLimits, Result};
use datafusion::common::resources_datafusion_err;
use datafusion::error::Result as DfResult;
use datafusion::execution::disk_manager::{DiskManager, DiskManagerMode};
use datafusion::execution::memory_pool::{
    GreedyMemoryPool, MemoryLimit, MemoryPool, MemoryReservation,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How many queries may wait for a slot per query that may run; beyond that a query is
/// refused at once (busy) rather than queued behind minutes of work.
const WAITING_PER_SLOT: usize = 8;

/// The server-wide part of the SQL limits.
#[derive(Debug)]
pub(crate) struct Budget {
    slots: Arc<Semaphore>,
    /// The slots no query holds; one per free permit of `slots`.
    free: Arc<Mutex<Vec<usize>>>,
    /// Each slot's runtime, started when the slot is first used.
    runtimes: Box<[OnceLock<Runtime>]>,
    max_concurrent: usize,
    waiting: AtomicUsize,
    memory: Arc<GreedyMemoryPool>,
    memory_bytes: usize,
    /// One disk manager for every query, so the spill allowance is the server's, not each
    /// query's (disabled when the allowance is 0).
    spill: Option<Arc<DiskManager>>,
}

impl Budget {
    pub(crate) fn new(limits: &QueryLimits) -> Self {
        let max_concurrent = limits.max_concurrent.max(1);
        let spill = if limits.spill_bytes == 0 {
            DiskManager::builder().with_mode(DiskManagerMode::Disabled)
        } else {
            DiskManager::builder().with_max_temp_directory_size(limits.spill_bytes)
        };
        Budget {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            free: Arc::new(Mutex::new((0..max_concurrent).rev().collect())),
            runtimes: (0..max_concurrent).map(|_| OnceLock::new()).collect(),
            max_concurrent,
            waiting: AtomicUsize::new(0),
            memory: Arc::new(GreedyMemoryPool::new(limits.total_memory_bytes)),
            memory_bytes: limits.total_memory_bytes,
            // Building a manager for the OS temp directory or none cannot fail; were it to,
            // queries get no spilling at all rather than an unbounded allowance.
            spill: spill.build().ok().map(Arc::new),
        }
    }

    /// A slot to run one query in, waited for until `deadline` (the query's own timeout).
    /// Refused at once when too many queries already wait.
    pub(crate) async fn slot(
        &self,
        deadline: tokio::time::Instant,
        timeout: impl FnOnce() -> Error,
    ) -> Result<Slot> {
        let permit = self.permit(deadline, timeout).await?;
        let index = self
            .free_slots()
            .pop()
            .ok_or_else(|| Error::Execution("no free SQL slot behind a permit".into()))?;
        let runtime = match self.runtime(index) {
            Ok(runtime) => runtime,
            Err(e) => {
                self.free_slots().push(index);
                return Err(e);
            }
        };
        Ok(Slot {
            index,
            free: self.free.clone(),
            runtime,
            _permit: permit,
        })
    }

    fn free_slots(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Slot `index`'s runtime, started on first use. Only the holder of the slot calls this,
    /// so no runtime is built twice.
    fn runtime(&self, index: usize) -> Result<Handle> {
        if let Some(runtime) = self.runtimes[index].get() {
            return Ok(runtime.handle().clone());
        }
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let built = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(format!("perch-sql-{index}"))
            .enable_all()
            .build()
            .map_err(|e| Error::Execution(format!("cannot start a SQL runtime: {e}")))?;
        Ok(self.runtimes[index].get_or_init(|| built).handle().clone())
    }

    /// Which slots' runtimes have started.
    #[cfg(test)]
    pub(crate) fn started_runtimes(&self) -> Vec<bool> {
        self.runtimes.iter().map(|r| r.get().is_some()).collect()
    }

    async fn permit(
        &self,
        deadline: tokio::time::Instant,
        timeout: impl FnOnce() -> Error,
    ) -> Result<OwnedSemaphorePermit> {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let max_waiting = self.max_concurrent * WAITING_PER_SLOT;
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Busy(format!(
                "the server is running its maximum of {} SQL queries with {max_waiting} more waiting; retry shortly",
                self.max_concurrent
            )));
        }
        let _waiting = Waiting(&self.waiting);
        match tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(Error::Execution("the SQL slots were closed".into())),
            Err(_) => Err(timeout()),
        }
    }

    /// The memory pool of one query: `query_bytes` of its own, within the server's budget.
    pub(crate) fn pool(&self, query_bytes: usize) -> Arc<QueryPool> {
        Arc::new(QueryPool {
            query: GreedyMemoryPool::new(query_bytes),
            query_bytes,
            server: Some(self.memory.clone()),
            server_bytes: self.memory_bytes,
            server_refused: AtomicBool::new(false),
        })
    }

    /// The memory pool of one of perch's own queries: `query_bytes` outside the users'
    /// budget, so users cannot crowd alert rules out.
    pub(crate) fn own_pool(query_bytes: usize) -> Arc<QueryPool> {
        Arc::new(QueryPool {
            query: GreedyMemoryPool::new(query_bytes),
            query_bytes,
            server: None,
            server_bytes: 0,
            server_refused: AtomicBool::new(false),
        })
    }

    /// The shared spill manager; `None` means the query may not spill.
    pub(crate) fn spill(&self) -> Option<Arc<DiskManager>> {
        self.spill.clone()
    }

    /// Bytes reserved now by all queries together.
    pub(crate) fn memory_in_use(&self) -> usize {
        self.memory.reserved()
    }
}

impl Drop for Budget {
    /// Runtimes are stopped without waiting: an engine may be dropped inside async code,
    /// where blocking on a runtime's shutdown panics.
    fn drop(&mut self) {
        for cell in self.runtimes.iter_mut() {
            if let Some(runtime) = cell.take() {
                runtime.shutdown_background();
            }
        }
    }
}

/// A slot one user's query runs in: its runtime, given back (with the permit) when dropped,
/// that is when the query's work has really stopped.
#[derive(Debug)]
pub(crate) struct Slot {
    index: usize,
    free: Arc<Mutex<Vec<usize>>>,
    runtime: Handle,
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    pub(crate) fn runtime(&self) -> &Handle {
        &self.runtime
    }
}

impl Drop for Slot {
    /// The slot is free again before its permit is (fields drop after this), so whoever gets
    /// the permit next finds it.
    fn drop(&mut self) {
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(self.index);
    }
}

/// Counts a waiting query out however its wait ends (slot, timeout, or the caller gone).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One query's memory: every reservation is charged to the query and to the server.
#[derive(Debug)]
pub(crate) struct QueryPool {
    query: GreedyMemoryPool,
    query_bytes: usize,
    /// The server's budget; `None` for perch's own queries.
    server: Option<Arc<GreedyMemoryPool>>,
    server_bytes: usize,
    /// The server's budget (not the query's own limit) refused a reservation.
    server_refused: AtomicBool,
}

impl QueryPool {
    pub(crate) fn server_refused(&self) -> bool {
        self.server_refused.load(Ordering::SeqCst)
    }

    pub(crate) fn server_bytes(&self) -> usize {
        self.server_bytes
    }
}

impl std::fmt::Display for QueryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a query's pool: {} of its {} MiB in use",
            self.query.reserved(),
            self.query_bytes >> 20
        )
    }
}

impl MemoryPool for QueryPool {
    fn name(&self) -> &str {
        "perch-query"
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.query.grow(reservation, additional);
        if let Some(server) = &self.server {
            server.grow(reservation, additional);
        }
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        self.query.shrink(reservation, shrink);
        if let Some(server) = &self.server {
            server.shrink(reservation, shrink);
        }
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> DfResult<()> {
        self.query.try_grow(reservation, additional)?;
        let Some(server) = &self.server else {
            return Ok(());
        };
        if server.try_grow(reservation, additional).is_err() {
            self.query.shrink(reservation, additional);
            self.server_refused.store(true, Ordering::SeqCst);
            return Err(resources_datafusion_err!(
                "the server's SQL memory budget of {} MiB is taken by other queries",
                self.server_bytes >> 20
            ));
        }
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.query.reserved()
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.query_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::MemoryConsumer;
    use std::time::Duration;

    fn limits(max_concurrent: usize, total_mb: usize) -> QueryLimits {
        QueryLimits {
            max_concurrent,
            memory_bytes: 64 << 20,
            total_memory_bytes: total_mb << 20,
            ..QueryLimits::default()
        }
    }

    #[test]
    fn a_query_is_held_to_its_own_limit_and_to_what_the_others_left() {
        let budget = Budget::new(&limits(4, 100));
        let a: Arc<dyn MemoryPool> = budget.pool(64 << 20);
        let b = budget.pool(64 << 20);
        let b_dyn: Arc<dyn MemoryPool> = b.clone();
        let ra = MemoryConsumer::new("a").register(&a);
        let rb = MemoryConsumer::new("b").register(&b_dyn);
        // Over its own limit: refused, and not as the server's doing.
        assert!(ra.try_grow(65 << 20).is_err());
        ra.try_grow(60 << 20).expect("granted");
        assert_eq!(budget.memory_in_use(), 60 << 20);
        // Within its own limit but past what the server has left.
        assert!(rb.try_grow(50 << 20).is_err());
        assert!(b.server_refused());
        assert_eq!(
            b.reserved(),
            0,
            "a refused reservation is not kept on the query"
        );
        rb.try_grow(40 << 20).expect("granted");
        drop(ra);
        assert_eq!(
            budget.memory_in_use(),
            40 << 20,
            "a finished query gives its memory back"
        );
        rb.try_grow(20 << 20).expect("granted");
    }

    #[tokio::test]
    async fn queries_past_the_cap_wait_and_past_the_waiting_room_are_refused() {
        let budget = Arc::new(Budget::new(&limits(1, 100)));
        let far = tokio::time::Instant::now() + Duration::from_secs(30);
        let timeout = || Error::Timeout { limit_s: 30.0 };
        let running = budget.slot(far, timeout).await.expect("granted");
        let mut waiters = Vec::new();
        for _ in 0..WAITING_PER_SLOT {
            let b = budget.clone();
            waiters.push(tokio::spawn(async move { b.slot(far, timeout).await }));
        }
        while budget.waiting.load(Ordering::SeqCst) < WAITING_PER_SLOT {
            tokio::task::yield_now().await;
        }
        let refused = budget.slot(far, timeout).await.expect_err("refused");
        assert!(matches!(refused, Error::Busy(_)), "{refused}");
        // Still full: refused whatever the deadline.
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        assert!(matches!(
            budget.slot(soon, timeout).await,
            Err(Error::Busy(_))
        ));
        drop(running);
        for w in waiters {
            drop(w.await.expect("granted").expect("granted"));
        }
        assert_eq!(budget.waiting.load(Ordering::SeqCst), 0);
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        let _again = budget.slot(soon, timeout).await.expect("granted");
        let late = budget.slot(soon, timeout).await.expect_err("refused");
        assert!(matches!(late, Error::Timeout { .. }), "{late}");
        assert_eq!(budget.waiting.load(Ordering::SeqCst), 0);
    }
}
