//! The job store on PostgreSQL, for deployments with a standby server ([`crate::ha`]): the same
//! records as the embedded [`crate::db::RedbStore`], in tables that every server of the
//! deployment reaches, and every write fenced by the database itself.
//!
//! Fencing: each row written carries the writer's leader epoch, and a trigger on every table
//! refuses the row unless that epoch is the lease row's and the lease has not expired by the
//! database's own clock ([`SCHEMA`]). The trigger takes a share lock on the lease row, so a
//! takeover (which updates that row) waits for a write in flight and every write after it is
//! refused: a deposed leader's late commit fails in the database, whatever it believes.
//!
//! The schema is created and migrated by perch, versioned like the other formats
//! (`docs/format/job-database.md`): `perch_meta.format_version`, refused when newer than this
//! binary's [`FORMAT_VERSION`].
//!
//! The connection is driven by one thread of its own ([`Conn`]), so the store can be called
//! from any thread, async workers included, as the redb store can.

use crate::db::{DbError, Dirty, Loaded};
use crate::provenance::{ProvenanceChange, ProvenanceRecord};
use crate::record::JobRecord;
use crate::store::JobStore;
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::Duration;

/// The schema version this binary creates and reads.
pub const FORMAT_VERSION: i64 = 1;

/// SQLSTATE of a write refused by the fence (a deposed leader's).
pub const FENCED: &str = "PCH01";

/// Jobs read back per query while visiting them all.
const PAGE: i64 = 5_000;

/// How long a connection attempt or an unanswered request may take before the store reports
/// the database unreachable (the lease is what stops a leader cut from it: [`crate::ha`]).
const NETWORK_TIMEOUT: Duration = Duration::from_secs(5);

/// Version 1 of the schema. Idempotent: run at every open, under an advisory lock so two
/// servers starting together do not race.
const SCHEMA: &str = r#"
SET LOCAL client_min_messages = warning;
CREATE TABLE IF NOT EXISTS perch_meta (key text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE IF NOT EXISTS perch_leader (
    id smallint PRIMARY KEY CHECK (id = 1),
    holder text NOT NULL,
    address text NOT NULL,
    epoch bigint NOT NULL,
    since timestamptz NOT NULL,
    renewed timestamptz NOT NULL,
    expires timestamptz NOT NULL
);
INSERT INTO perch_leader VALUES (1, '', '', 0, 'epoch', 'epoch', 'epoch') ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS perch_jobs (id bigint PRIMARY KEY, record jsonb NOT NULL, epoch bigint NOT NULL);
CREATE TABLE IF NOT EXISTS perch_nodes (id bigint PRIMARY KEY, record jsonb NOT NULL, epoch bigint NOT NULL);
CREATE TABLE IF NOT EXISTS perch_node_spans (id bigint PRIMARY KEY, record jsonb NOT NULL, epoch bigint NOT NULL);
CREATE TABLE IF NOT EXISTS perch_provenance (id bigint PRIMARY KEY, record jsonb NOT NULL, epoch bigint NOT NULL);
CREATE OR REPLACE FUNCTION perch_fence() RETURNS trigger LANGUAGE plpgsql AS $fence$
DECLARE
    current_epoch bigint;
    lease_end timestamptz;
BEGIN
    SELECT epoch, expires INTO current_epoch, lease_end FROM perch_leader WHERE id = 1 FOR SHARE;
    IF NEW.epoch IS DISTINCT FROM current_epoch OR lease_end <= clock_timestamp() THEN
        RAISE EXCEPTION 'a write of leader epoch % is refused: the lease is at epoch %, held until %', NEW.epoch, current_epoch, lease_end
            USING ERRCODE = 'PCH01', HINT = 'this server is no longer the leader';
    END IF;
    RETURN NEW;
END
$fence$;
DO $triggers$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['perch_jobs', 'perch_nodes', 'perch_node_spans', 'perch_provenance'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = t || '_fence') THEN
            EXECUTE format('CREATE TRIGGER %I BEFORE INSERT OR UPDATE ON %I FOR EACH ROW EXECUTE FUNCTION perch_fence()', t || '_fence', t);
        END IF;
    END LOOP;
END
$triggers$;
"#;

/// Serialises schema creation across servers (an arbitrary constant: "perch" in ASCII).
const SCHEMA_LOCK: i64 = 0x0070_6572_6368;

fn e(x: impl std::fmt::Display) -> DbError {
    DbError::new(x.to_string())
}

/// A database error, with PostgreSQL's own message and hint when it has them.
fn pg(x: postgres::Error) -> DbError {
    match x.as_db_error() {
        Some(db) if db.code().code() == FENCED => DbError::new(format!(
            "refused by the database: {} (this server was deposed; a standby leads now)",
            db.message()
        )),
        Some(db) => DbError::new(format!("PostgreSQL: {}", db.message())),
        None => DbError::new(format!("PostgreSQL: {x}")),
    }
}

/// Connects to `config` with perch's timeouts.
pub(crate) fn connect(config: &postgres::Config) -> Result<postgres::Client, DbError> {
    let mut config = config.clone();
    config
        .connect_timeout(NETWORK_TIMEOUT)
        .tcp_user_timeout(NETWORK_TIMEOUT)
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(2))
        .keepalives_interval(Duration::from_secs(1))
        .keepalives_retries(3)
        .application_name("perch");
    config.connect(postgres::NoTls).map_err(pg)
}

/// Parses a connection string (`postgresql://user@host/db` or `host=... dbname=...`).
pub fn parse_config(url: &str) -> Result<postgres::Config, DbError> {
    url.parse::<postgres::Config>().map_err(|x| {
        DbError::new(format!(
            "{url:?} is not a PostgreSQL connection string ({x}); write one such as postgresql://perch@db-host/perch"
        ))
    })
}

/// Creates the schema if missing and checks its version; refuses a newer one.
pub fn migrate(client: &mut postgres::Client) -> Result<(), DbError> {
    let mut tx = client.transaction().map_err(pg)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
        .map_err(pg)?;
    tx.batch_execute(SCHEMA).map_err(pg)?;
    let found: Option<i64> = tx
        .query_opt(
            "SELECT value FROM perch_meta WHERE key = 'format_version'",
            &[],
        )
        .map_err(pg)?
        .map(|row| row.get(0));
    match found {
        Some(v) if v > FORMAT_VERSION => {
            return Err(DbError::new(format!(
                "the PostgreSQL job database is of format version {v}; this perch reads versions up to {FORMAT_VERSION}: run the perch release that wrote it (or a newer one); see docs/format/job-database.md"
            )));
        }
        Some(_) => {}
        None => {
            tx.execute(
                "INSERT INTO perch_meta VALUES ('format_version', $1)",
                &[&FORMAT_VERSION],
            )
            .map_err(pg)?;
        }
    }
    tx.commit().map_err(pg)
}

type Call = Box<dyn FnOnce(&mut Option<postgres::Client>) + Send>;

/// One connection, driven by a thread of its own: calls are sent to it and answered in order.
/// A connection found closed is opened again at the next call.
struct Conn {
    calls: parking_lot::Mutex<mpsc::Sender<Call>>,
}

impl Conn {
    fn start(config: postgres::Config, client: postgres::Client) -> Conn {
        let (tx, rx) = mpsc::channel::<Call>();
        std::thread::Builder::new()
            .name("perch-pg-store".into())
            .spawn(move || {
                let mut client = Some(client);
                for call in rx {
                    if client.as_ref().is_none_or(|c| c.is_closed()) {
                        client = connect(&config).ok();
                    }
                    call(&mut client);
                }
            })
            .expect("spawning a thread");
        Conn {
            calls: parking_lot::Mutex::new(tx),
        }
    }

    fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut postgres::Client) -> Result<T, DbError> + Send + 'static,
    ) -> Result<T, DbError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let call: Call = Box::new(move |client| {
            let result = match client {
                Some(c) => f(c),
                None => Err(DbError::new(
                    "PostgreSQL cannot be reached (the connection is being opened again)".into(),
                )),
            };
            let _ = tx.send(result);
        });
        self.calls
            .lock()
            .send(call)
            .map_err(|_| DbError::new("the PostgreSQL connection thread stopped".into()))?;
        rx.recv()
            .map_err(|_| DbError::new("the PostgreSQL connection thread stopped".into()))?
    }
}

/// The job store on PostgreSQL, writing as leader `epoch` ([`crate::ha::Lease`]).
pub struct PgStore {
    conn: Conn,
    epoch: i64,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl PgStore {
    /// Connects, creates or checks the schema, and writes as leader `epoch` from now on:
    /// rows are accepted only while the lease row holds that epoch.
    pub fn open(config: &postgres::Config, epoch: i64) -> Result<PgStore, DbError> {
        let config = config.clone();
        // Connecting drives a runtime of the driver's own: not on the caller's thread, which
        // may be an async worker.
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut client = connect(&config)?;
                migrate(&mut client)?;
                Ok(PgStore {
                    conn: Conn::start(config.clone(), client),
                    epoch,
                })
            })
            .join()
            .map_err(|_| DbError::new("opening the PostgreSQL job store panicked".into()))?
        })
    }
}

fn id(x: u64) -> Result<i64, DbError> {
    i64::try_from(x).map_err(|_| DbError::new(format!("id {x} is beyond PostgreSQL's bigint")))
}

/// `rows` as parallel arrays of ids and JSON texts, the last of each id kept (later records
/// replace earlier ones).
fn columns<T: serde::Serialize>(
    rows: impl Iterator<Item = (u64, T)>,
) -> Result<(Vec<i64>, Vec<String>), DbError> {
    let mut last = BTreeMap::new();
    for (k, v) in rows {
        last.insert(id(k)?, serde_json::to_string(&v).map_err(e)?);
    }
    Ok(last.into_iter().unzip())
}

fn upsert(
    tx: &mut postgres::Transaction<'_>,
    table: &str,
    (ids, records): &(Vec<i64>, Vec<String>),
    epoch: i64,
) -> Result<(), DbError> {
    if ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "INSERT INTO {table} (id, record, epoch) SELECT i, r::jsonb, $3 FROM unnest($1::bigint[], $2::text[]) AS t(i, r) \
         ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record, epoch = EXCLUDED.epoch"
    );
    tx.execute(&sql, &[ids, records, &epoch]).map_err(pg)?;
    Ok(())
}

/// Writes provenance `changes` in order: each read (locked) and written back changed.
fn save_provenance(
    tx: &mut postgres::Transaction<'_>,
    changes: &[ProvenanceChange],
    epoch: i64,
) -> Result<(), DbError> {
    if changes.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = changes
        .iter()
        .map(|c| id(c.job()))
        .collect::<Result<_, _>>()?;
    let mut stored: BTreeMap<u64, ProvenanceRecord> = BTreeMap::new();
    for row in tx
        .query(
            "SELECT id, record::text FROM perch_provenance WHERE id = ANY($1) FOR UPDATE",
            &[&ids],
        )
        .map_err(pg)?
    {
        let i: i64 = row.get(0);
        stored.insert(i as u64, serde_json::from_str(row.get(1)).map_err(e)?);
    }
    for change in changes {
        let job = change.job();
        let record = change.apply(stored.remove(&job));
        stored.insert(job, record);
    }
    upsert(tx, "perch_provenance", &columns(stored.into_iter())?, epoch)
}

impl JobStore for PgStore {
    fn provenance(&self, job: u64) -> Result<Option<ProvenanceRecord>, DbError> {
        let job = id(job)?;
        let found: Option<String> = self.conn.call(move |c| {
            Ok(c.query_opt(
                "SELECT record::text FROM perch_provenance WHERE id = $1",
                &[&job],
            )
            .map_err(pg)?
            .map(|row| row.get(0)))
        })?;
        found
            .map(|r| serde_json::from_str(&r).map_err(e))
            .transpose()
    }

    fn for_each_provenance(
        &self,
        ids: std::ops::RangeInclusive<u64>,
        visit: &mut dyn FnMut(ProvenanceRecord) -> bool,
    ) -> Result<(), DbError> {
        let last = i64::try_from(*ids.end()).unwrap_or(i64::MAX);
        let mut after = i64::try_from(*ids.start()).unwrap_or(i64::MAX) - 1;
        loop {
            let page: Vec<(i64, String)> = self.conn.call(move |c| {
                Ok(c.query(
                    "SELECT id, record::text FROM perch_provenance WHERE id > $1 AND id <= $2 ORDER BY id LIMIT $3",
                    &[&after, &last, &PAGE],
                )
                .map_err(pg)?
                .into_iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect())
            })?;
            let Some(&(end, _)) = page.last() else {
                return Ok(());
            };
            after = end;
            for (_, record) in page {
                if !visit(serde_json::from_str(&record).map_err(e)?) {
                    return Ok(());
                }
            }
        }
    }

    fn load(&self) -> Result<Loaded, DbError> {
        self.conn.call(|c| {
            let mut nodes = Vec::new();
            for row in c
                .query("SELECT record::text FROM perch_nodes ORDER BY id", &[])
                .map_err(pg)?
            {
                nodes.push(serde_json::from_str(row.get(0)).map_err(e)?);
            }
            let mut node_spans = Vec::new();
            for row in c
                .query(
                    "SELECT id, record::text FROM perch_node_spans ORDER BY id",
                    &[],
                )
                .map_err(pg)?
            {
                let id: i64 = row.get(0);
                node_spans.push((id as u64, serde_json::from_str(row.get(1)).map_err(e)?));
            }
            Ok(Loaded { nodes, node_spans })
        })
    }

    fn for_each_job(&self, visit: &mut dyn FnMut(JobRecord)) -> Result<(), DbError> {
        let mut after = -1i64;
        loop {
            let page: Vec<(i64, String)> = self.conn.call(move |c| {
                Ok(c.query(
                    "SELECT id, record::text FROM perch_jobs WHERE id > $1 ORDER BY id LIMIT $2",
                    &[&after, &PAGE],
                )
                .map_err(pg)?
                .into_iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect())
            })?;
            let Some(&(last, _)) = page.last() else {
                return Ok(());
            };
            after = last;
            for (_, record) in page {
                visit(serde_json::from_str(&record).map_err(e)?);
            }
        }
    }

    fn get(&self, ids: &[u64]) -> Result<Vec<JobRecord>, DbError> {
        let wanted = ids.iter().map(|&i| id(i)).collect::<Result<Vec<_>, _>>()?;
        let asked = wanted.clone();
        let found: BTreeMap<i64, String> = self.conn.call(move |c| {
            Ok(c.query(
                "SELECT id, record::text FROM perch_jobs WHERE id = ANY($1)",
                &[&asked],
            )
            .map_err(pg)?
            .into_iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect())
        })?;
        wanted
            .iter()
            .map(|i| {
                let record = found
                    .get(i)
                    .ok_or_else(|| DbError::new(format!("job {i} is not in the job database")))?;
                serde_json::from_str(record).map_err(e)
            })
            .collect()
    }

    fn save(&self, dirty: &Dirty) -> Result<(), DbError> {
        if dirty.jobs.is_empty()
            && dirty.nodes.is_empty()
            && dirty.node_spans.is_empty()
            && dirty.output_deleted.is_empty()
            && dirty.provenance.is_empty()
        {
            return Ok(());
        }
        let provenance = dirty.provenance.clone();
        let jobs = columns(dirty.jobs.iter().map(|j| (j.id, j)))?;
        let nodes = columns(dirty.nodes.iter().map(|(i, n)| (*i, n)))?;
        let spans = columns(dirty.node_spans.iter().map(|(i, s)| (*i, s)))?;
        let deleted = dirty
            .output_deleted
            .iter()
            .map(|&(i, at)| Ok((id(i)?, at)))
            .collect::<Result<Vec<_>, DbError>>()?;
        let epoch = self.epoch;
        self.conn.call(move |c| {
            let mut tx = c.transaction().map_err(pg)?;
            upsert(&mut tx, "perch_jobs", &jobs, epoch)?;
            if !deleted.is_empty() {
                let ids: Vec<i64> = deleted.iter().map(|d| d.0).collect();
                let mut stored: BTreeMap<i64, JobRecord> = BTreeMap::new();
                for row in tx
                    .query(
                        "SELECT id, record::text FROM perch_jobs WHERE id = ANY($1) FOR UPDATE",
                        &[&ids],
                    )
                    .map_err(pg)?
                {
                    stored.insert(row.get(0), serde_json::from_str(row.get(1)).map_err(e)?);
                }
                let mut changed = Vec::new();
                for (i, at) in deleted {
                    if let Some(job) = stored.get_mut(&i)
                        && job.delete_output(at)
                    {
                        changed.push((i as u64, job.clone()));
                    }
                }
                upsert(&mut tx, "perch_jobs", &columns(changed.into_iter())?, epoch)?;
            }
            upsert(&mut tx, "perch_nodes", &nodes, epoch)?;
            upsert(&mut tx, "perch_node_spans", &spans, epoch)?;
            save_provenance(&mut tx, &provenance, epoch)?;
            tx.commit().map_err(pg)
        })
    }

    /// Nothing to repair: PostgreSQL rolled the failed transaction back. A closed connection
    /// is opened again by the next call.
    fn reopen(&self) -> Result<(), DbError> {
        self.conn
            .call(|c| c.simple_query("SELECT 1").map(drop).map_err(pg))
    }
}
