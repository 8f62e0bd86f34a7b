//! One active server at a time: the leader lease, a row in the PostgreSQL job database
//! (`perch_leader`, [`crate::pg`]) that one server holds for `ttl` at a time by the database's
//! clock and renews well before it ends. Each new holder gets the next epoch; the job store
//! writes as that epoch and the database refuses any other ([`crate::pg::PgStore`]).
//!
//! A standby tries to take the lease every [`LeaseConfig::try_every`] and can only once it has
//! expired. A leader that has not renewed by its own deadline (`ttl - margin` after it *sent*
//! its last successful renewal, on its own monotonic clock) has lost it: it must stop acting
//! at once ([`Lease::run`] calls `lost`; the server exits). Since the database's expiry is
//! measured from when it *ran* the renewal, later than it was sent, the old leader stops
//! before any standby can take over, as long as the two clocks' rates differ by less than the
//! margin over one lease. Its late writes are refused by the fence either way.

use crate::db::DbError;
use crate::pg;
use parking_lot::Mutex;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the lease is held.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// This server's name in the lease (unique in the deployment).
    pub name: String,
    /// Where the others send clients to reach this server while it leads
    /// (`http://host:port`).
    pub address: String,
    /// How long a lease lasts past each renewal: the longest a dead leader holds up a
    /// takeover.
    pub ttl: Duration,
    /// How often the leader renews (`ttl / 4` by default: three renewals may fail in a row).
    pub renew_every: Duration,
    /// How often a standby tries to take the lease.
    pub try_every: Duration,
    /// How long before the database's expiry the leader gives up: its renewal's travel time
    /// and the difference in clock rates must fit in it.
    pub margin: Duration,
}

impl LeaseConfig {
    /// `ttl` with the derived periods: renewal every quarter, a try each second (or quarter,
    /// if shorter), a margin of a fifth.
    pub fn new(name: String, address: String, ttl: Duration) -> LeaseConfig {
        LeaseConfig {
            name,
            address,
            renew_every: ttl / 4,
            try_every: (ttl / 4).min(Duration::from_secs(1)),
            margin: ttl / 5,
            ttl,
        }
    }

    /// The longest from a leader's death to a standby leading, less the standby's own start:
    /// the lease running out, then the standby's next try.
    pub fn takeover_bound(&self) -> Duration {
        self.ttl + self.try_every
    }
}

/// Who holds the lease, as the database says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Holder {
    pub name: String,
    pub address: String,
    pub epoch: i64,
    /// When this holder took the lease (Unix ms, the database's clock).
    pub since_ms: i64,
    /// When the lease runs out unless renewed (Unix ms, the database's clock).
    pub expires_ms: i64,
}

/// This server's part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "role")]
pub enum Role {
    /// Waiting; `leader` is the holder of an unexpired lease, if any.
    Standby { leader: Option<Holder> },
    /// Leading as `holder` (itself).
    Leader { holder: Holder },
    /// Was leader and lost the lease: acting no more.
    Deposed { epoch: i64, why: String },
}

/// The lease as this server sees it, shared with whoever answers `/readyz` and `/v1/ha`.
#[derive(Debug, Clone)]
pub struct Status {
    role: Arc<Mutex<Role>>,
}

impl Default for Status {
    fn default() -> Status {
        Status {
            role: Arc::new(Mutex::new(Role::Standby { leader: None })),
        }
    }
}

impl Status {
    pub fn role(&self) -> Role {
        self.role.lock().clone()
    }

    fn set(&self, role: Role) {
        *self.role.lock() = role;
    }
}

/// Serialises the first servers' marking of the shared data directory (`Lease::check_data_dir`).
const DATA_DIR_LOCK: i64 = 0x0070_6572_6369;

const HOLDER_COLUMNS: &str = "holder, address, epoch, (extract(epoch from since) * 1000)::bigint, (extract(epoch from expires) * 1000)::bigint";

fn holder(row: &postgres::Row) -> Holder {
    Holder {
        name: row.get(0),
        address: row.get(1),
        epoch: row.get(2),
        since_ms: row.get(3),
        expires_ms: row.get(4),
    }
}

/// The lease, held through a connection of its own.
pub struct Lease {
    config: LeaseConfig,
    db: postgres::Config,
    client: Option<postgres::Client>,
    status: Status,
}

impl Lease {
    /// Connects and makes sure the schema exists. Blocking; call from a thread of its own or
    /// before the async runtime starts.
    /// `status` is where the lease is shown as it changes.
    pub fn connect(
        db: &postgres::Config,
        config: LeaseConfig,
        status: Status,
    ) -> Result<Lease, DbError> {
        let mut client = pg::connect(db)?;
        pg::migrate(&mut client)?;
        Ok(Lease {
            config,
            db: db.clone(),
            client: Some(client),
            status,
        })
    }

    pub fn status(&self) -> Status {
        self.status.clone()
    }

    fn client(&mut self) -> Result<&mut postgres::Client, DbError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = None;
            self.client = Some(pg::connect(&self.db)?);
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// Checks that `dir` is the deployment's shared data directory: the first server marks it
    /// (`ha/deployment`, a random id) and records the mark in the database; a server whose
    /// directory lacks the recorded mark (a standby started on an empty local disk, a wrong
    /// mount) is refused before it could lead on it with no telemetry and no job output.
    pub fn check_data_dir(&mut self, dir: &std::path::Path) -> Result<(), DbError> {
        let path = dir.join("ha").join("deployment");
        let c = self.client()?;
        let mut tx = c.transaction().map_err(pg_error)?;
        // Servers of a new deployment started together: one marks, the others find its mark.
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&DATA_DIR_LOCK])
            .map_err(pg_error)?;
        let local: Option<i64> = match std::fs::read_to_string(&path) {
            Ok(text) => Some(text.trim().parse().map_err(|_| {
                DbError::new(format!("{} does not hold a deployment id", path.display()))
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(DbError::new(format!("{}: {e}", path.display()))),
        };
        let recorded: Option<i64> = tx
            .query_opt("SELECT value FROM perch_meta WHERE key = 'data_dir'", &[])
            .map_err(pg_error)?
            .map(|row| row.get(0));
        match (recorded, local) {
            (Some(r), Some(l)) if r == l => Ok(()),
            (Some(r), found) => Err(DbError::new(format!(
                "{} is not this deployment's shared data directory: the job database names directory {r}, and {} {}; set server.data_dir to the directory the other servers share (docs/ha.md)",
                dir.display(),
                path.display(),
                found.map_or("does not exist".to_owned(), |l| format!("names {l}"))
            ))),
            (None, found) => {
                let id = match found {
                    Some(l) => l,
                    None => {
                        let mut bytes = [0u8; 8];
                        getrandom::fill(&mut bytes).map_err(|e| DbError::new(e.to_string()))?;
                        let id = (i64::from_le_bytes(bytes) & i64::MAX).max(1);
                        std::fs::create_dir_all(dir.join("ha"))
                            .and_then(|()| std::fs::write(&path, format!("{id}\n")))
                            .map_err(|e| DbError::new(format!("{}: {e}", path.display())))?;
                        id
                    }
                };
                tx.execute("INSERT INTO perch_meta VALUES ('data_dir', $1)", &[&id])
                    .map_err(pg_error)?;
                tx.commit().map_err(pg_error)
            }
        }
    }

    /// Takes the lease if it has expired: Ok(Some) with the new epoch's holder, Ok(None) with
    /// the status showing who holds it.
    pub fn try_acquire(&mut self) -> Result<Option<Holder>, DbError> {
        let (name, address, ttl) = (
            self.config.name.clone(),
            self.config.address.clone(),
            self.config.ttl.as_secs_f64(),
        );
        let c = self.client()?;
        let sql = format!(
            "UPDATE perch_leader SET holder = $1, address = $2, epoch = epoch + 1, since = clock_timestamp(), \
             renewed = clock_timestamp(), expires = clock_timestamp() + make_interval(secs => $3) \
             WHERE id = 1 AND expires <= clock_timestamp() RETURNING {HOLDER_COLUMNS}"
        );
        if let Some(row) = c
            .query_opt(&sql, &[&name, &address, &ttl])
            .map_err(pg_error)?
        {
            return Ok(Some(holder(&row)));
        }
        let row = c
            .query_one(
                &format!(
                    "SELECT {HOLDER_COLUMNS}, expires > clock_timestamp() FROM perch_leader WHERE id = 1"
                ),
                &[],
            )
            .map_err(pg_error)?;
        let alive: bool = row.get(5);
        self.status.set(Role::Standby {
            leader: alive.then(|| holder(&row)),
        });
        Ok(None)
    }

    /// Renews the lease held as `epoch`: Ok(Some) renewed, Ok(None) someone else holds it now.
    pub fn renew(&mut self, epoch: i64) -> Result<Option<Holder>, DbError> {
        let (name, ttl) = (self.config.name.clone(), self.config.ttl.as_secs_f64());
        let c = self.client()?;
        let sql = format!(
            "UPDATE perch_leader SET renewed = clock_timestamp(), expires = clock_timestamp() + make_interval(secs => $3) \
             WHERE id = 1 AND holder = $1 AND epoch = $2 AND expires > clock_timestamp() RETURNING {HOLDER_COLUMNS}"
        );
        let row = c
            .query_opt(&sql, &[&name, &epoch, &ttl])
            .map_err(pg_error)?;
        Ok(row.as_ref().map(holder))
    }

    /// Ends the lease held as `epoch` now (a clean shutdown), so a standby takes over at its
    /// next try rather than when the lease would have run out.
    pub fn release(&mut self, epoch: i64) -> Result<(), DbError> {
        let name = self.config.name.clone();
        let c = self.client()?;
        c.execute(
            "UPDATE perch_leader SET expires = clock_timestamp() WHERE id = 1 AND holder = $1 AND epoch = $2",
            &[&name, &epoch],
        )
        .map_err(pg_error)?;
        Ok(())
    }

    /// Waits as standby until this server takes the lease (trying every `try_every`, the
    /// database unreachable included), or `stop` says to give up. Returns the holder
    /// (this server at its new epoch) and when the request that took it was sent, which
    /// [`Lease::hold`] counts the lease from. Blocking.
    pub fn acquire(&mut self, stop: &dyn Fn() -> bool) -> Option<(Holder, Instant)> {
        let mut unreachable = false;
        while !stop() {
            let sent = Instant::now();
            match self.try_acquire() {
                Ok(Some(holder)) => {
                    self.status.set(Role::Leader {
                        holder: holder.clone(),
                    });
                    return Some((holder, sent));
                }
                Ok(None) => unreachable = false,
                Err(e) => {
                    if !unreachable {
                        tracing::warn!(error = %e, "standby: the job database cannot be reached; trying again");
                    }
                    unreachable = true;
                    self.status.set(Role::Standby { leader: None });
                }
            }
            std::thread::sleep(self.config.try_every);
        }
        None
    }

    /// Keeps the lease held as `holder` (taken by a request sent at `taken_at`), renewing
    /// every `renew_every`, until it is lost or `stop` receives (or is dropped): then it is
    /// released. `lost` is called once, from a watchdog thread the moment the deadline passes
    /// (whatever a renewal in flight is waiting for), or when the database says another
    /// server holds the lease. Blocking.
    pub fn hold(
        mut self,
        holder: Holder,
        taken_at: Instant,
        stop: std::sync::mpsc::Receiver<()>,
        lost: Arc<dyn Fn(String) + Send + Sync>,
    ) {
        let epoch = holder.epoch;
        let keep = self.config.ttl.saturating_sub(self.config.margin);
        let deadline = Arc::new(Mutex::new(taken_at + keep));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watchdog = {
            let (deadline, done, lost, status) = (
                deadline.clone(),
                done.clone(),
                lost.clone(),
                self.status.clone(),
            );
            std::thread::Builder::new()
                .name("perch-lease-watchdog".into())
                .spawn(move || {
                    while !done.load(std::sync::atomic::Ordering::Acquire) {
                        let until = *deadline.lock();
                        let now = Instant::now();
                        if now >= until {
                            done.store(true, std::sync::atomic::Ordering::Release);
                            let why = format!(
                                "the lease of epoch {epoch} could not be renewed in time (the job database unreachable?)"
                            );
                            status.set(Role::Deposed {
                                epoch,
                                why: why.clone(),
                            });
                            lost(why);
                            return;
                        }
                        std::thread::sleep((until - now).min(Duration::from_millis(100)));
                    }
                })
                .expect("spawning a thread")
        };
        let mut failing = false;
        loop {
            let stopped = !matches!(
                stop.recv_timeout(self.config.renew_every),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout)
            );
            if done.load(std::sync::atomic::Ordering::Acquire) {
                break;
            }
            if stopped {
                done.store(true, std::sync::atomic::Ordering::Release);
                if let Err(e) = self.release(epoch) {
                    tracing::warn!(error = %e, "could not release the lease; a standby takes over once it runs out");
                }
                break;
            }
            let sent = Instant::now();
            match self.renew(epoch) {
                Ok(Some(renewed)) => {
                    *deadline.lock() = sent + keep;
                    if failing {
                        tracing::info!(epoch, "the lease is renewed again");
                    }
                    failing = false;
                    self.status.set(Role::Leader { holder: renewed });
                }
                Ok(None) => {
                    done.store(true, std::sync::atomic::Ordering::Release);
                    let why =
                        format!("another server holds the lease now (this one held epoch {epoch})");
                    self.status.set(Role::Deposed {
                        epoch,
                        why: why.clone(),
                    });
                    lost(why);
                    break;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, epoch, "the lease could not be renewed; trying again until it runs out");
                    }
                    failing = true;
                }
            }
        }
        let _ = watchdog.join();
    }
}

/// A database error, with PostgreSQL's own message when it has one ("db error" says nothing).
fn pg_error(x: postgres::Error) -> DbError {
    match x.as_db_error() {
        Some(db) => DbError::new(format!("PostgreSQL: {}", db.message())),
        None => DbError::new(format!("PostgreSQL: {x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_renewals_may_fail_before_the_leader_gives_up() {
        let c = LeaseConfig::new("a".into(), "http://a".into(), Duration::from_secs(10));
        assert!(c.renew_every * 3 < c.ttl - c.margin, "three renewals fit");
        assert!(c.try_every <= Duration::from_secs(1));
        assert_eq!(c.takeover_bound(), Duration::from_secs(11));
    }
}
