//! What all users' queries share: a cap on how many run at once, shared fairly between users,
//! one memory budget and one spill allowance for the whole server.
//!
//! Each slot has its own runtime (its own worker threads), so queries share the CPU through
//! the kernel's scheduler rather than through tokio's: DataFusion yields to other tasks only
//! between batches, and one CPU-heavy query on a shared runtime held every other query (even
//! `SELECT 42`) until it ended.
//!
//! The slots are shared by user ([`Shares`]). A user holds at most all but one of the slots
//! users may take, so another user's query always finds one free or soon free (one user's
//! four long queries made another's `SELECT 1` wait 27 s), and from three slots up the last
//! is kept for operators, who are held to no share. Waiting queries are served a user at a
//! time, in turn, not in the order they came: a user with twenty queued queries delays
//! another user's one by one of them, not twenty. A query that would wait past the waiting
//! room (eight per slot), or past half of it for one user, is refused at once (busy).
//! Perch's own queries (alert rules, accounting) take no slot at all.
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
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::oneshot;

/// How many queries may wait for a slot per query that may run; beyond that a query is
/// refused at once (busy) rather than queued behind minutes of work.
const WAITING_PER_SLOT: usize = 8;

/// Who a query runs for: the user its slots are counted against, and whether an operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Asker {
    /// `None` for a caller that answers no user (tests, benchmarks, the startup check): held
    /// only to the cap on all queries.
    pub(crate) name: Option<String>,
    pub(crate) operator: bool,
}

impl Asker {
    pub(crate) fn user(name: &str, operator: bool) -> Self {
        Asker {
            name: Some(name.to_owned()),
            operator,
        }
    }

    pub(crate) fn anyone() -> Self {
        Asker {
            name: None,
            operator: false,
        }
    }

    /// Held to a user's share: a named user who is not an operator.
    fn shared(&self) -> bool {
        self.name.is_some() && !self.operator
    }
}

/// How the slots are shared between users.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shares {
    /// All the slots.
    total: usize,
    /// The slots users who are not operators may hold together: from three slots up, all but
    /// one, kept for operators.
    users: usize,
    /// The slots one such user may hold: one fewer than `users` (one at least), so another
    /// user's query always finds one.
    user: usize,
    /// The queries that may wait, all users together.
    waiting: usize,
    /// The queries one user may have waiting: half the room (one at least).
    user_waiting: usize,
}

impl Shares {
    fn new(total: usize) -> Self {
        let users = if total >= 3 { total - 1 } else { total };
        let waiting = total * WAITING_PER_SLOT;
        Shares {
            total,
            users,
            user: users.saturating_sub(1).max(1),
            waiting,
            user_waiting: (waiting / 2).max(1),
        }
    }
}

/// Who holds the slots and who waits for them, behind one lock.
#[derive(Debug)]
struct Queue {
    shares: Shares,
    /// The slots no query holds.
    free: Vec<usize>,
    /// Slots held, by user.
    held: HashMap<Option<String>, usize>,
    /// Slots held by users held to a share ([`Asker::shared`]).
    users_held: usize,
    /// Waiting queries by user, each user's oldest first.
    waiting: HashMap<Option<String>, VecDeque<Waiter>>,
    /// The users with waiting queries, the next to be served first.
    turns: VecDeque<Option<String>>,
    /// All waiting queries.
    waiting_count: usize,
    next_ticket: u64,
}

/// A waiting query.
#[derive(Debug)]
struct Waiter {
    ticket: u64,
    operator: bool,
    /// Told the slot it is given.
    given: oneshot::Sender<usize>,
}

impl Queue {
    fn new(total: usize) -> Self {
        Queue {
            shares: Shares::new(total),
            free: (0..total).rev().collect(),
            held: HashMap::new(),
            users_held: 0,
            waiting: HashMap::new(),
            turns: VecDeque::new(),
            waiting_count: 0,
            next_ticket: 0,
        }
    }

    /// A slot is free and `asker` may take it.
    fn may_take(&self, asker: &Asker) -> bool {
        if self.free.is_empty() {
            return false;
        }
        !asker.shared()
            || (self.users_held < self.shares.users
                && self.held.get(&asker.name).copied().unwrap_or(0) < self.shares.user)
    }

    fn take(&mut self, asker: &Asker) -> Option<usize> {
        let index = self.free.pop()?;
        *self.held.entry(asker.name.clone()).or_default() += 1;
        if asker.shared() {
            self.users_held += 1;
        }
        Some(index)
    }

    fn give_back(&mut self, asker: &Asker, index: usize) {
        self.free.push(index);
        if let Some(held) = self.held.get_mut(&asker.name) {
            *held -= 1;
            if *held == 0 {
                self.held.remove(&asker.name);
            }
        }
        if asker.shared() {
            self.users_held -= 1;
        }
    }

    /// Gives the free slots to waiting queries, users in turn: the first user in `turns` whose
    /// oldest waiting query may take a slot gets one and goes to the back. A user held back
    /// by its share keeps its place.
    fn serve(&mut self) {
        while !self.free.is_empty() {
            let next = self.turns.iter().position(|name| {
                self.waiting
                    .get(name)
                    .and_then(VecDeque::front)
                    .is_some_and(|w| {
                        self.may_take(&Asker {
                            name: name.clone(),
                            operator: w.operator,
                        })
                    })
            });
            let Some(name) = next.and_then(|turn| self.turns.remove(turn)) else {
                return;
            };
            let Some(waiter) = self.waiting.get_mut(&name).and_then(VecDeque::pop_front) else {
                continue;
            };
            if self.waiting.get(&name).is_some_and(VecDeque::is_empty) {
                self.waiting.remove(&name);
            } else {
                self.turns.push_back(name.clone());
            }
            self.waiting_count -= 1;
            let asker = Asker {
                name,
                operator: waiter.operator,
            };
            let Some(index) = self.take(&asker) else {
                return;
            };
            // Not taken only by a query no longer waiting: the slot goes on to the next.
            if let Err(index) = waiter.given.send(index) {
                self.give_back(&asker, index);
            }
        }
    }

    /// Takes the waiting query `ticket` of `name` out of the queue; false if it is not there
    /// (it was served).
    fn leave(&mut self, name: &Option<String>, ticket: u64) -> bool {
        let Some(queue) = self.waiting.get_mut(name) else {
            return false;
        };
        let Some(at) = queue.iter().position(|w| w.ticket == ticket) else {
            return false;
        };
        queue.remove(at);
        if queue.is_empty() {
            self.waiting.remove(name);
            self.turns.retain(|n| n != name);
        }
        self.waiting_count -= 1;
        true
    }
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    queue
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The server-wide part of the SQL limits.
#[derive(Debug)]
pub(crate) struct Budget {
    queue: Arc<Mutex<Queue>>,
    /// Each slot's runtime, started when the slot is first used.
    runtimes: Box<[OnceLock<Runtime>]>,
    /// The stack of each slot's threads, sized for the deepest statement allowed.
    stack_bytes: usize,
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
            queue: Arc::new(Mutex::new(Queue::new(max_concurrent))),
            runtimes: (0..max_concurrent).map(|_| OnceLock::new()).collect(),
            stack_bytes: crate::guard::stack_bytes(limits.max_expression_depth),
            memory: Arc::new(GreedyMemoryPool::new(limits.total_memory_bytes)),
            memory_bytes: limits.total_memory_bytes,
            // Building a manager for the OS temp directory or none cannot fail; were it to,
            // queries get no spilling at all rather than an unbounded allowance.
            spill: spill.build().ok().map(Arc::new),
        }
    }

    /// A slot to run one of `asker`'s queries in, within their share, waited for (in turn
    /// with other users' queries) until `deadline`, the query's own timeout. Refused at once
    /// when too many queries already wait, or too many of `asker`'s.
    pub(crate) async fn slot(
        &self,
        asker: Asker,
        deadline: tokio::time::Instant,
        timeout: impl FnOnce() -> Error,
    ) -> Result<Slot> {
        let index = self.turn(&asker, deadline, timeout).await?;
        let held = Held {
            index,
            queue: self.queue.clone(),
            asker,
        };
        // A runtime that cannot start gives the slot back (`held` dropped).
        let runtime = self.runtime(held.index)?;
        Ok(Slot {
            runtime,
            _held: held,
        })
    }

    /// Waits for `asker`'s turn and takes a slot: its index.
    async fn turn(
        &self,
        asker: &Asker,
        deadline: tokio::time::Instant,
        timeout: impl FnOnce() -> Error,
    ) -> Result<usize> {
        let (ticket, given) = {
            let mut queue = lock(&self.queue);
            let theirs = queue.waiting.get(&asker.name).map_or(0, VecDeque::len);
            // Every waiting query that may take a free slot has one (`serve`), so one that
            // finds a slot it may take jumps no one, unless it is behind the asker's own.
            if theirs == 0
                && queue.may_take(asker)
                && let Some(index) = queue.take(asker)
            {
                return Ok(index);
            }
            let shares = queue.shares;
            if queue.waiting_count >= shares.waiting {
                return Err(Error::Busy(format!(
                    "the server is running its maximum of {} SQL queries with {} more waiting; retry shortly",
                    shares.total, shares.waiting
                )));
            }
            if let Some(name) = &asker.name
                && theirs >= shares.user_waiting
            {
                return Err(Error::Busy(format!(
                    "{name} has {theirs} SQL queries waiting already, as many as one user may (the server runs {} at once); retry when some have answered",
                    shares.total
                )));
            }
            let ticket = queue.next_ticket;
            queue.next_ticket += 1;
            let (tell, given) = oneshot::channel();
            let waiters = queue.waiting.entry(asker.name.clone()).or_default();
            waiters.push_back(Waiter {
                ticket,
                operator: asker.operator,
                given: tell,
            });
            if waiters.len() == 1 {
                queue.turns.push_back(asker.name.clone());
            }
            queue.waiting_count += 1;
            (ticket, given)
        };
        let mut place = Place {
            queue: &self.queue,
            asker,
            ticket,
            given,
            served: false,
        };
        match tokio::time::timeout_at(deadline, &mut place.given).await {
            Ok(Ok(index)) => {
                place.served = true;
                Ok(index)
            }
            Ok(Err(_)) => Err(Error::Execution("the SQL slots were closed".into())),
            Err(_) => Err(timeout()),
        }
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
            .thread_stack_size(self.stack_bytes)
            .enable_all()
            .build()
            .map_err(|e| Error::Execution(format!("cannot start a SQL runtime: {e}")))?;
        Ok(self.runtimes[index].get_or_init(|| built).handle().clone())
    }

    /// How many queries wait for a slot.
    #[cfg(test)]
    pub(crate) fn waiting_count(&self) -> usize {
        lock(&self.queue).waiting_count
    }

    /// Which slots' runtimes have started.
    #[cfg(test)]
    pub(crate) fn started_runtimes(&self) -> Vec<bool> {
        self.runtimes.iter().map(|r| r.get().is_some()).collect()
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

/// A slot one user's query runs in: its runtime, given back when dropped, that is when the
/// query's work has really stopped.
#[derive(Debug)]
pub(crate) struct Slot {
    runtime: Handle,
    /// Only held: dropped with the slot.
    _held: Held,
}

impl Slot {
    pub(crate) fn runtime(&self) -> &Handle {
        &self.runtime
    }
}

/// A slot taken, given back (to the next waiting query in turn) when dropped.
#[derive(Debug)]
struct Held {
    index: usize,
    queue: Arc<Mutex<Queue>>,
    asker: Asker,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut queue = lock(&self.queue);
        queue.give_back(&self.asker, self.index);
        queue.serve();
    }
}

/// A query's place in the queue, left however its wait ends: on a timeout, or with the caller
/// gone, its place goes, and a slot it was given as it stopped waiting goes to the next.
struct Place<'a> {
    queue: &'a Mutex<Queue>,
    asker: &'a Asker,
    ticket: u64,
    given: oneshot::Receiver<usize>,
    served: bool,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.served {
            return;
        }
        let mut queue = lock(self.queue);
        if queue.leave(&self.asker.name, self.ticket) {
            return;
        }
        if let Ok(index) = self.given.try_recv() {
            queue.give_back(self.asker, index);
            queue.serve();
        }
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
    use futures::FutureExt;
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
        let anyone = Asker::anyone();
        let running = budget
            .slot(anyone.clone(), far, timeout)
            .await
            .expect("granted");
        let mut waiters = Vec::new();
        for _ in 0..WAITING_PER_SLOT {
            let b = budget.clone();
            waiters.push(tokio::spawn(async move {
                b.slot(Asker::anyone(), far, timeout).await
            }));
        }
        while budget.waiting_count() < WAITING_PER_SLOT {
            tokio::task::yield_now().await;
        }
        let refused = budget
            .slot(anyone.clone(), far, timeout)
            .await
            .expect_err("refused");
        assert!(matches!(refused, Error::Busy(_)), "{refused}");
        // Still full: refused whatever the deadline.
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        assert!(matches!(
            budget.slot(anyone.clone(), soon, timeout).await,
            Err(Error::Busy(_))
        ));
        drop(running);
        for w in waiters {
            drop(w.await.expect("granted").expect("granted"));
        }
        assert_eq!(budget.waiting_count(), 0);
        let soon = tokio::time::Instant::now() + Duration::from_millis(20);
        let _again = budget
            .slot(anyone.clone(), soon, timeout)
            .await
            .expect("granted");
        let late = budget
            .slot(anyone.clone(), soon, timeout)
            .await
            .expect_err("refused");
        assert!(matches!(late, Error::Timeout { .. }), "{late}");
        assert_eq!(budget.waiting_count(), 0);
    }

    fn far() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(30)
    }

    fn timeout() -> Error {
        Error::Timeout { limit_s: 30.0 }
    }

    fn user(name: &str) -> Asker {
        Asker::user(name, false)
    }

    /// A slot that is free for `asker` now: granted on the first poll, without waiting.
    fn at_once(budget: &Budget, asker: &Asker) -> Slot {
        budget
            .slot(asker.clone(), far(), timeout)
            .now_or_never()
            .unwrap_or_else(|| panic!("{asker:?} waited for a free slot"))
            .unwrap_or_else(|e| panic!("{asker:?} refused: {e}"))
    }

    async fn until_waiting(budget: &Budget, n: usize) {
        while budget.waiting_count() < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_user_holds_its_share_and_the_last_slot_is_kept_for_operators() {
        let budget = Budget::new(&limits(4, 100));
        let a = [at_once(&budget, &user("a")), at_once(&budget, &user("a"))];
        // Two of the four are free, yet a's third query waits: a holds its share.
        let mut a3 = Box::pin(budget.slot(user("a"), far(), timeout));
        assert!(futures::poll!(&mut a3).is_pending(), "a took a third slot");
        // Another user's query is not held behind a's.
        let b = at_once(&budget, &user("b"));
        // Users together hold all but the last slot: that one is an operator's.
        let mut c = Box::pin(budget.slot(user("c"), far(), timeout));
        assert!(
            futures::poll!(&mut c).is_pending(),
            "c took the operators' slot"
        );
        let operator = at_once(&budget, &Asker::user("root", true));
        // The slot b gives back goes to c, not to a, which still holds its share.
        drop(b);
        let c = c.await.expect("granted");
        assert!(futures::poll!(&mut a3).is_pending(), "a took a third slot");
        let [a1, a2] = a;
        drop(a1);
        let a3 = a3.await.expect("granted");
        drop((a2, a3, c, operator));
        assert_eq!(budget.waiting_count(), 0);
    }

    #[tokio::test]
    async fn waiting_queries_take_turns_between_users() {
        let budget = Arc::new(Budget::new(&limits(1, 100)));
        let held = at_once(&budget, &user("z"));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // a's three queries queue first, then b's and c's one each.
        for (i, name) in ["a", "a", "a", "b", "c"].into_iter().enumerate() {
            let (b, tx) = (budget.clone(), tx.clone());
            tokio::spawn(async move {
                let slot = b.slot(user(name), far(), timeout).await;
                tx.send((format!("{name}{i}"), slot)).expect("send");
            });
            until_waiting(&budget, i + 1).await;
        }
        drop(held);
        let mut order = Vec::new();
        for _ in 0..5 {
            let (who, slot) = rx.recv().await.expect("a query served");
            order.push(who);
            drop(slot.expect("granted"));
        }
        assert_eq!(
            order,
            ["a0", "b3", "c4", "a1", "a2"],
            "b and c wait for one of a's queries, not all three"
        );
        assert_eq!(budget.waiting_count(), 0);
    }

    #[tokio::test]
    async fn one_users_flood_is_refused_while_others_still_queue() {
        let budget = Arc::new(Budget::new(&limits(1, 100)));
        let room = WAITING_PER_SLOT;
        let held = at_once(&budget, &user("z"));
        let mut waiters = Vec::new();
        let mut wait = |name: &'static str| {
            let b = budget.clone();
            waiters.push(tokio::spawn(async move {
                drop(b.slot(user(name), far(), timeout).await.expect("granted"));
            }));
        };
        // One user may fill half the waiting room.
        for _ in 0..room / 2 {
            wait("a");
        }
        until_waiting(&budget, room / 2).await;
        let flood = budget
            .slot(user("a"), far(), timeout)
            .now_or_never()
            .expect("refused at once")
            .expect_err("refused");
        assert!(matches!(flood, Error::Busy(_)), "{flood}");
        assert!(flood.to_string().contains("a has"), "{flood}");
        // Others still queue, until the room is full.
        for name in ["b", "c", "d", "e"] {
            wait(name);
        }
        until_waiting(&budget, room).await;
        let full = budget
            .slot(user("f"), far(), timeout)
            .now_or_never()
            .expect("refused at once")
            .expect_err("refused");
        assert!(matches!(full, Error::Busy(_)), "{full}");
        drop(held);
        for w in waiters {
            w.await.expect("served");
        }
        assert_eq!(budget.waiting_count(), 0);
    }

    #[tokio::test]
    async fn a_wait_given_up_leaves_its_turn_and_any_slot_it_was_given() {
        let budget = Budget::new(&limits(1, 100));
        let held = at_once(&budget, &user("z"));
        let mut a = Box::pin(budget.slot(user("a"), far(), timeout));
        assert!(futures::poll!(&mut a).is_pending());
        let mut b = Box::pin(budget.slot(user("b"), far(), timeout));
        assert!(futures::poll!(&mut b).is_pending());
        let mut c = Box::pin(budget.slot(user("c"), far(), timeout));
        assert!(futures::poll!(&mut c).is_pending());
        assert_eq!(budget.waiting_count(), 3);
        // b gives up while waiting; a is given the slot but gives up before it hears.
        drop(b);
        drop(held);
        drop(a);
        let c = c.await.expect("the slot a was given goes on to c");
        assert_eq!(budget.waiting_count(), 0);
        drop(c);
        drop(at_once(&budget, &user("d")));
    }
}
