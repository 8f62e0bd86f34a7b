//! The users' SQL slots are shared between users: one user's long queries take at most that
//! user's share (with four slots, two), the last slot is kept for operators, waiting queries
//! are served a user at a time rather than first come first served, and one user's flood of
//! waiting queries is refused while other users' queries still queue.
//!
//! A long query here is one reading a table whose scan waits at a gate the test opens, so
//! which queries hold slots is decided by the test, never by how fast the machine is.

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use futures::future::BoxFuture;
use perch_query::{Error, LiveTable, QueryLimits, QueryOutput, SqlEngine, Store, StoreConfig};
use std::sync::{Arc, Condvar, Mutex};
use std::task::Poll;
use std::time::Duration;

/// A table whose every scan counts itself in, then waits until the test lets one through.
#[derive(Debug)]
struct Gate {
    entered: tokio::sync::watch::Sender<usize>,
    passes: Mutex<usize>,
    opened: Condvar,
}

impl Gate {
    fn new() -> Arc<Self> {
        Arc::new(Gate {
            entered: tokio::sync::watch::channel(0).0,
            passes: Mutex::new(0),
            opened: Condvar::new(),
        })
    }

    /// How many scans have reached the gate (passed or not).
    fn entered(&self) -> usize {
        *self.entered.borrow()
    }

    /// Waits until `n` scans have reached the gate: each holds its query's slot. A minute at
    /// most, so a query that never starts fails the test rather than hangs it.
    async fn until_entered(&self, n: usize, what: &str) {
        let mut seen = self.entered.subscribe();
        let reached = tokio::time::timeout(Duration::from_secs(60), seen.wait_for(|&e| e >= n));
        match reached.await {
            Ok(Ok(_)) => {}
            _ => panic!("{what}: {} of {n} queries started", self.entered()),
        }
    }

    /// Lets `n` scans through, those waiting or the next to come.
    fn pass(&self, n: usize) {
        *self.passes.lock().expect("gate") += n;
        self.opened.notify_all();
    }

    /// Lets every scan through from now on.
    fn open(&self) {
        self.pass(usize::MAX / 2);
    }
}

impl LiveTable for Gate {
    fn schema(&self) -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]))
    }

    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        self.entered.send_modify(|n| *n += 1);
        let mut passes = self.passes.lock().map_err(|e| e.to_string())?;
        while *passes == 0 {
            passes = self.opened.wait(passes).map_err(|e| e.to_string())?;
        }
        *passes -= 1;
        let batch = RecordBatch::try_new(self.schema(), vec![Arc::new(Int64Array::from(vec![1]))])
            .map_err(|e| e.to_string())?;
        Ok(vec![batch])
    }
}

struct Server {
    sql: SqlEngine,
    /// One gate table per user, `gate_a` for user a and so on.
    gates: Vec<(&'static str, Arc<Gate>)>,
    _dir: tempfile::TempDir,
}

impl Server {
    fn new(max_concurrent: usize) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(StoreConfig::new(dir.path())).expect("open");
        let limits = QueryLimits {
            max_concurrent,
            // Only reached when a query that should run never gets a slot.
            timeout: Duration::from_secs(60),
            ..QueryLimits::default()
        };
        let mut sql = SqlEngine::new(store, limits);
        let mut gates = Vec::new();
        for user in ["a", "b", "c"] {
            let gate = Gate::new();
            sql = sql.with_table(&format!("gate_{user}"), gate.clone());
            gates.push((user, gate));
        }
        Server {
            sql,
            gates,
            _dir: dir,
        }
    }

    fn gate(&self, user: &str) -> &Gate {
        &self
            .gates
            .iter()
            .find(|(u, _)| *u == user)
            .expect("a gate for the user")
            .1
    }

    /// `user`'s query, not yet started.
    fn query(
        &self,
        user: &'static str,
        sql: &'static str,
    ) -> BoxFuture<'static, Result<QueryOutput, Error>> {
        let engine = self.sql.clone();
        Box::pin(async move { engine.query_as(sql, user, false).await })
    }

    /// Starts `user`'s long query (its gate's): it asks for its slot now, so queries started
    /// one after another ask in that order.
    async fn start_long(&self, user: &'static str, running: &mut Vec<Running>) {
        let mut query = self.query(user, long(user));
        assert!(
            futures::poll!(&mut query).is_pending(),
            "{user}'s long query ended before its gate opened"
        );
        running.push(tokio::spawn(query));
    }

    fn open_all(&self) {
        for (_, gate) in &self.gates {
            gate.open();
        }
    }
}

type Running = tokio::task::JoinHandle<Result<QueryOutput, Error>>;

fn long(user: &str) -> &'static str {
    match user {
        "a" => "SELECT x FROM gate_a",
        "b" => "SELECT x FROM gate_b",
        _ => "SELECT x FROM gate_c",
    }
}

async fn all_answer(running: Vec<Running>) {
    for query in running {
        let out = query.await.expect("joined").expect("answered");
        assert_eq!(out.rows, 1);
    }
}

#[tokio::test]
async fn another_users_select_1_is_answered_while_one_user_holds_long_queries() {
    let server = Server::new(4);
    let mut running = Vec::new();
    // a asks for every slot.
    for _ in 0..4 {
        server.start_long("a", &mut running).await;
    }
    server.gate("a").until_entered(2, "a's share").await;
    let b = server
        .query("b", "SELECT 1")
        .await
        .expect("b's query is answered while a's hold their slots");
    assert_eq!(b.rows, 1);
    assert!(
        running.iter().all(|q| !q.is_finished()),
        "a's queries were still running"
    );
    // With b's long query too, users hold all but the last slot, which is an operator's.
    server.start_long("b", &mut running).await;
    server.gate("b").until_entered(1, "b's long query").await;
    let operator = server
        .sql
        .query_as("SELECT 1", "root", true)
        .await
        .expect("an operator's query takes the slot kept for operators");
    assert_eq!(operator.rows, 1);
    // That slot was free: neither of a's other two queries held one. They wait.
    assert_eq!(server.gate("a").entered(), 2, "a ran past its share");
    // One of a's ends: its slot goes to a's next.
    server.gate("a").pass(1);
    server.gate("a").until_entered(3, "a's third query").await;
    server.open_all();
    all_answer(running).await;
}

#[tokio::test]
async fn a_users_queued_queries_take_turns_with_another_users() {
    let server = Server::new(4);
    let mut running = Vec::new();
    // a holds its two slots and c one: the users' three are taken.
    for user in ["a", "a", "c"] {
        server.start_long(user, &mut running).await;
    }
    server.gate("a").until_entered(2, "a's share").await;
    server.gate("c").until_entered(1, "c's query").await;
    // a queues four more, then b one.
    for user in ["a", "a", "a", "a", "b"] {
        server.start_long(user, &mut running).await;
    }
    // The first slot a gives back goes to a's next query (a asked first)...
    server.gate("a").pass(1);
    server.gate("a").until_entered(3, "a's third query").await;
    // ...and the second to b, not to a's other three.
    server.gate("a").pass(1);
    server
        .gate("b")
        .until_entered(1, "b's query after one of a's")
        .await;
    assert_eq!(server.gate("a").entered(), 3, "a was served out of turn");
    server.open_all();
    all_answer(running).await;
}

#[tokio::test]
async fn one_users_flood_is_refused_while_another_user_still_queues() {
    let server = Server::new(4);
    let mut running = Vec::new();
    for user in ["a", "a", "c"] {
        server.start_long(user, &mut running).await;
    }
    server.gate("a").until_entered(2, "a's share").await;
    server.gate("c").until_entered(1, "c's query").await;
    // One user may fill half the waiting room (eight per slot, 32): 16 of a's queries wait.
    for _ in 0..16 {
        server.start_long("a", &mut running).await;
    }
    let mut flood = server.query("a", long("a"));
    match futures::poll!(&mut flood) {
        Poll::Ready(Err(Error::Busy(why))) => assert!(why.contains("a has"), "{why}"),
        Poll::Ready(other) => panic!("a's 17th waiting query: {other:?}"),
        Poll::Pending => panic!("a's 17th waiting query was queued"),
    }
    // b's query still queues, and is answered when a slot is free.
    let mut b = server.query("b", "SELECT 1");
    assert!(futures::poll!(&mut b).is_pending(), "b's query was refused");
    server.open_all();
    assert_eq!(b.await.expect("b's query answered").rows, 1);
    all_answer(running).await;
}
