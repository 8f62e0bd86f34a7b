//! The `events` audit table (durable like telemetry, readable by SQL before and after a
//! flush and a restart), tables that live outside the store, and views over both.

use arrow::array::{AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use perch_model::ClusterEvent;
use perch_query::{LiveTable, QueryLimits, SqlEngine, Store, StoreConfig};
use std::sync::{Arc, Mutex};

async fn scalar(sql: &SqlEngine, query: &str) -> i64 {
    let out = sql.query(query).await.expect("query");
    out.batches[0]
        .column(0)
        .as_primitive::<Int64Type>()
        .value(0)
}

fn drain_event(time_ms: i64, node: &str) -> ClusterEvent {
    ClusterEvent {
        node: Some(node.into()),
        rule: Some("XidResetGpu".into()),
        action: Some("drain_node".into()),
        outcome: Some("done".into()),
        ..ClusterEvent::new(time_ms, "remediation", "perch", format!("drained {node}"))
    }
}

#[tokio::test]
async fn events_are_durable_and_visible_before_and_after_flush_and_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let now = 1_790_000_000_000;
    {
        let store = Store::open(StoreConfig::new(dir.path())).expect("open");
        let sql = SqlEngine::new(store.clone(), QueryLimits::default());
        store
            .append_events(&[drain_event(now, "n1"), drain_event(now + 1, "n2")])
            .await
            .expect("append");
        let q = "SELECT count(*) FROM events WHERE action = 'drain_node' AND node IS NOT NULL";
        assert_eq!(scalar(&sql, q).await, 2, "visible from the buffer");
        store.flush().await.expect("flush");
        store
            .append_events(&[ClusterEvent::new(
                now + 2,
                "circuit_breaker_open",
                "perch",
                "too many nodes out",
            )])
            .await
            .expect("append");
        assert_eq!(scalar(&sql, "SELECT count(*) FROM events").await, 3);
        // Dropped without a flush: the last event is only in the write-ahead log.
    }
    let store = Store::open(StoreConfig::new(dir.path())).expect("reopen");
    let sql = SqlEngine::new(store, QueryLimits::default());
    assert_eq!(scalar(&sql, "SELECT count(*) FROM events").await, 3);
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM events WHERE kind = 'circuit_breaker_open' AND node IS NULL"
        )
        .await,
        1
    );
}

/// A table owned elsewhere whose rows change between queries.
#[derive(Debug)]
struct Jobs(Mutex<Vec<(i64, &'static str)>>);

impl LiveTable for Jobs {
    fn schema(&self) -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("job", DataType::Int64, false),
            Field::new("account", DataType::Utf8, false),
        ]))
    }
    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        let rows = self.0.lock().map_err(|e| e.to_string())?.clone();
        RecordBatch::try_new(
            self.schema(),
            vec![
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.1))),
            ],
        )
        .map(|b| vec![b])
        .map_err(|e| e.to_string())
    }
}

#[tokio::test]
async fn live_tables_are_read_fresh_and_views_build_on_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    let jobs = Arc::new(Jobs(Mutex::new(vec![(1, "vision"), (2, "nlp")])));
    let sql = SqlEngine::new(store, QueryLimits::default())
        .with_table("jobs", jobs.clone())
        .with_view(
            "jobs_per_account",
            "SELECT account, count(*) AS jobs FROM jobs GROUP BY account",
        )
        .with_view(
            "busiest_account",
            "SELECT max(jobs) AS jobs FROM jobs_per_account",
        );
    sql.check_views().await.expect("views plan");
    assert_eq!(scalar(&sql, "SELECT count(*) FROM jobs").await, 2);
    jobs.0.lock().expect("lock").push((3, "nlp"));
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM jobs").await,
        3,
        "a fresh snapshot"
    );
    assert_eq!(scalar(&sql, "SELECT jobs FROM busiest_account").await, 2);
    assert!(sql.table_names().contains(&"busiest_account".to_string()));

    // Every query's session shares one catalogue: a user's DDL, refused, changes nothing that
    // the next query (anyone's) sees.
    for hostile in [
        "CREATE VIEW jobs AS SELECT 1 AS account",
        "CREATE OR REPLACE VIEW busiest_account AS SELECT 0 AS jobs",
        "CREATE TABLE gpu_samples AS SELECT 1 AS x",
        "DROP TABLE jobs",
        "DROP VIEW jobs_per_account",
        "CREATE SCHEMA evil",
        "CREATE EXTERNAL TABLE passwd STORED AS CSV LOCATION '/etc/passwd'",
    ] {
        let err = sql.query(hostile).await.expect_err(hostile);
        assert!(err.to_string().contains("read-only"), "{hostile}: {err}");
    }
    assert_eq!(scalar(&sql, "SELECT count(*) FROM jobs").await, 3);
    assert_eq!(scalar(&sql, "SELECT jobs FROM busiest_account").await, 2);
    assert!(sql.query("SELECT * FROM passwd").await.is_err());

    // SHOW TABLES listed the rollups' stored `_partial` rows in no particular order,
    // and the unknown-table hint named only the stored tables, not live tables and views.
    let out = sql.query("show  TABLES;").await.expect("SHOW TABLES");
    let mut listed = Vec::new();
    for batch in &out.batches {
        let schemas = batch.column(1).as_string::<i32>();
        let names = batch.column(2).as_string::<i32>();
        for i in 0..batch.num_rows() {
            listed.push((schemas.value(i).to_owned(), names.value(i).to_owned()));
        }
    }
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(listed, sorted, "SHOW TABLES is sorted");
    let public: Vec<&str> = listed
        .iter()
        .filter(|(schema, _)| schema == "public")
        .map(|(_, name)| name.as_str())
        .collect();
    for name in ["gpu_samples", "gpu_samples_1m", "jobs", "busiest_account"] {
        assert!(public.contains(&name), "{name} missing from {public:?}");
    }
    assert!(
        !public.iter().any(|n| n.ends_with("_partial")),
        "{public:?}"
    );
    let err = sql
        .query("SELECT * FROM gpus")
        .await
        .expect_err("no such table");
    let message = err.to_string();
    for name in [
        "gpu_samples",
        "gpu_samples_1m",
        "jobs",
        "busiest_account",
        "events",
    ] {
        assert!(message.contains(name), "{name} missing from {message}");
    }
    assert!(!message.contains("_partial"), "{message}");

    let broken = SqlEngine::new(
        Store::open(StoreConfig::new(dir.path().join("other"))).expect("open"),
        QueryLimits::default(),
    )
    .with_view("bad", "SELECT nope FROM gpu_samples");
    let err = broken.check_views().await.expect_err("a broken view");
    assert!(err.to_string().contains("view bad"), "{err}");
}

/// A live table that cannot make its rows (its owner's storage failed).
#[derive(Debug)]
struct Broken;

impl LiveTable for Broken {
    fn schema(&self) -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("job", DataType::Int64, false)]))
    }
    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        Err("the job database cannot be read".into())
    }
}

/// A live table's failure is the server's: answered as a failed execution (HTTP 500), with
/// the table and the reason, not as a fault in the query (400) its sender would go and fix.
#[tokio::test]
async fn a_live_table_that_fails_is_the_servers_failure_not_the_querys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    let sql = SqlEngine::new(store, QueryLimits::default()).with_table("jobs", Arc::new(Broken));
    for query in [
        "SELECT count(*) FROM jobs",
        "SELECT job FROM jobs WHERE job > 3 ORDER BY job",
    ] {
        let err = sql.query(query).await.expect_err("the table fails");
        assert!(
            matches!(err, perch_query::Error::Execution(_)),
            "{query}: {err:?}"
        );
        let said = err.to_string();
        assert!(
            said.contains("reading table jobs: the job database cannot be read"),
            "{said}"
        );
    }
    // The query's own faults stay the query's.
    let err = sql.query("SELECT nope FROM jobs").await.expect_err("bad");
    assert!(matches!(err, perch_query::Error::BadQuery(_)), "{err:?}");
}

/// A live table of `batches` batches of 1 MiB (131,072 eight-byte ids each), counting in
/// `made` how many it made before it stopped.
#[derive(Debug)]
struct Big {
    batches: usize,
    made: std::sync::atomic::AtomicUsize,
}

impl Big {
    fn batch(&self, i: usize) -> RecordBatch {
        let rows = 131_072;
        RecordBatch::try_new(
            self.schema(),
            vec![Arc::new(Int64Array::from_iter_values(
                (0..rows).map(|r| (i * rows + r) as i64),
            ))],
        )
        .expect("batch")
    }
}

impl LiveTable for Big {
    fn schema(&self) -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("job", DataType::Int64, false)]))
    }
    fn snapshot(&self) -> Result<Vec<RecordBatch>, String> {
        Ok((0..self.batches).map(|i| self.batch(i)).collect())
    }
    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
        room: &mut perch_query::Room<'_>,
    ) -> Result<Vec<RecordBatch>, String> {
        let mut out = Vec::new();
        for i in 0..self.batches {
            let batch = perch_query::project(vec![self.batch(i)], projection)?;
            self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            out.extend(room.keep(batch)?);
        }
        Ok(out)
    }
}

/// A live table's rows count against the query's memory limit as they are made: a table too
/// big for it is refused with the limit's message (what to change), having made no more than
/// the limit allows, and what a query held is given back when it ends. Before, the rows were
/// made whole outside the limit: `SELECT * FROM job_allocations WHERE gpu = 99` over a long
/// history held every row in the server's memory, whatever `query.memory_mb` said. The rows
/// the query's filters on the table reject are dropped as they are made: the same 64 MiB
/// table answers a query that keeps a seventh of it within 16 MiB.
#[tokio::test]
async fn a_live_table_too_big_for_the_querys_memory_is_refused_as_it_is_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("open");
    let big = Arc::new(Big {
        batches: 64,
        made: Default::default(),
    });
    let limits = QueryLimits {
        memory_bytes: 16 << 20,
        ..QueryLimits::default()
    };
    let sql = SqlEngine::new(store, limits).with_table("jobs", big.clone());
    // A volatile filter is not applied as rows are made (it would be drawn twice), so it
    // keeps them all here.
    for query in [
        "SELECT count(*) FROM jobs WHERE job % 2 = 0",
        "SELECT count(*) FROM jobs WHERE job + random() < 1e12",
        "SELECT sum(job) FROM jobs",
    ] {
        big.made.store(0, std::sync::atomic::Ordering::Relaxed);
        let err = sql
            .query(query)
            .await
            .expect_err("64 MiB of rows for a 16 MiB query");
        assert!(
            matches!(err, perch_query::Error::ResourcesExhausted { limit_mb: 16, table: Some(ref t) } if t == "jobs"),
            "{query}: {err:?}"
        );
        assert!(
            err.to_string().contains(
                "the rows of jobs it keeps pass it: select fewer of that table's columns, or filter its rows more narrowly"
            ),
            "says what helps: {err}"
        );
        let made = big.made.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            made <= 33,
            "{query}: made {made} MiB of rows for a 16 MiB query"
        );
        assert_eq!(sql.memory_in_use(), 0, "given back");
    }
    // A seventh of the rows kept: answered, each row judged once more by the query.
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM jobs WHERE job % 7 = 0").await,
        (0..64 * 131_072).filter(|j| j % 7 == 0).count() as i64
    );
    assert_eq!(
        scalar(
            &sql,
            "SELECT count(*) FROM jobs AS j WHERE j.job < 1000 AND j.job >= 10"
        )
        .await,
        990
    );
    assert_eq!(sql.memory_in_use(), 0, "given back");
    // Within the limit, the same query answers, and gives back what it held.
    let small = Arc::new(Big {
        batches: 4,
        made: Default::default(),
    });
    let store = Store::open(StoreConfig::new(dir.path().join("2"))).expect("open");
    let sql = SqlEngine::new(store, limits).with_table("jobs", small);
    assert_eq!(
        scalar(&sql, "SELECT count(*) FROM jobs WHERE job % 2 = 0").await,
        4 * 131_072 / 2
    );
    assert_eq!(
        scalar(&sql, "SELECT sum(job) FROM jobs").await,
        (0..4 * 131_072).sum::<i64>()
    );
    // A volatile filter is judged once per row, by the query: about half of 524,288 rows,
    // not a quarter (a row drawn twice).
    let half = scalar(&sql, "SELECT count(*) FROM jobs WHERE random() < 0.5").await;
    assert!((220_000..300_000).contains(&half), "{half}");
    // A sort under a query limit below the 10 MiB DataFusion sets aside for each sort's
    // merge: every ORDER BY was refused under `query.memory_mb = 8`, however few its rows.
    let one = Arc::new(Big {
        batches: 1,
        made: Default::default(),
    });
    let store = Store::open(StoreConfig::new(dir.path().join("3"))).expect("open");
    let limits = QueryLimits {
        memory_bytes: 4 << 20,
        ..QueryLimits::default()
    };
    let sql = SqlEngine::new(store, limits).with_table("jobs", one);
    assert_eq!(
        scalar(
            &sql,
            "SELECT job FROM jobs WHERE job < 1000 ORDER BY job DESC LIMIT 1"
        )
        .await,
        999
    );
    let sorted = sql
        .query("SELECT job FROM jobs WHERE job < 20000 ORDER BY job DESC")
        .await
        .expect("20,000 rows sorted within 4 MiB");
    assert_eq!(sorted.rows, 20_000);
    drop(sorted);
    assert_eq!(sql.memory_in_use(), 0, "given back");
}
