//! `[server]` and `[server.storage]`: the control plane's listeners, ingest and storage,
//! retention, connection limits, job limits, tokens and TLS.

use super::{DAY, MIB, PIB, SECONDS, WEEK, bad, within};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// `[server]`: what `perch server` (and `up`, `demo`) listens on, stores and bounds; every key
/// is documented in `perch.example.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    pub listen: String,
    pub data_dir: PathBuf,
    pub flush_interval_secs: u64,
    pub flush_max_rows: usize,
    /// Most rows held in memory before ingest is refused with 503 (flushes failing).
    pub max_buffered_rows: usize,
    pub max_body_mb: usize,
    pub node_stale_after_secs: u64,
    /// How long a silent node's jobs count as running (its lease) before they are requeued.
    pub node_lease_secs: u64,
    /// Most pending jobs one user may have (array tasks count one each).
    pub max_pending_jobs_per_user: usize,
    /// Most MiB of command and environment one user's pending jobs may hold.
    pub max_pending_job_mb_per_user: usize,
    /// Most HTTP connections open at once; past it the one idle longest is closed for a new one,
    /// which waits when none is idle.
    pub max_connections: usize,
    /// Most HTTP connections open at once from one address; past it one idle of its own is
    /// closed for a new one, else 16 more are served on probation for agents' routes only.
    pub max_connections_per_ip: usize,
    /// An HTTP connection on which nothing moves this long is closed.
    pub idle_timeout_secs: u64,
    /// The most a request's head and body may take from their first byte (s).
    pub request_timeout_secs: u64,
    pub maintenance_interval_secs: u64,
    pub compact_below_mb: u64,
    pub compact_min_files: usize,
    /// Days of data kept per table, over the store's defaults (raw GPU and host samples 30,
    /// their 1-minute rollups 180, their 1-hour rollups 1095); 0 keeps a table forever.
    pub retention_days: std::collections::BTreeMap<String, u64>,
    /// Days a job's stored output (`perch logs`) is kept after the job ended; 0: for ever.
    pub job_output_days: u64,
    /// Most MiB of the server's disk one user's jobs' stored output may occupy; past it their
    /// new output is not stored (the job's timeline says so). 0: no bound.
    pub max_job_output_mb_per_user: u64,
    /// Most MiB of the server's disk all stored job output may occupy; past it no new output
    /// is stored. 0: no bound.
    pub max_job_output_total_mb: u64,
    /// Where the Parquet files and the manifest live.
    pub storage: StorageSection,
    /// Address of the PostgreSQL-protocol SQL listener; empty turns it off. With a tokens file
    /// clients log in with a token as their password; without one it is trust mode, loopback only.
    pub pg_listen: String,
    /// Most PostgreSQL-protocol connections served at once; the next waits until one closes.
    pub pg_max_connections: usize,
    /// The agents' syncs a second the whole fleet is paced to: each sync answer tells its node
    /// how long to wait before the next (at least the agent's own 500 ms).
    pub max_syncs_per_second: u32,
    /// TOML file of accepted bearer tokens; empty runs open (loopback only).
    pub tokens_file: PathBuf,
    /// PEM certificate chain (the server's first) for TLS on HTTP and PostgreSQL; with
    /// `tls_key`. Empty: plain text.
    pub tls_cert: PathBuf,
    /// PEM private key of `tls_cert`.
    pub tls_key: PathBuf,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            listen: "127.0.0.1:7300".into(),
            data_dir: "./perch-data".into(),
            flush_interval_secs: 60,
            flush_max_rows: 1_000_000,
            max_buffered_rows: 4_000_000,
            max_body_mb: 64,
            node_stale_after_secs: 60,
            node_lease_secs: perch_control::DEFAULT_LEASE.as_secs(),
            max_pending_jobs_per_user: perch_control::DEFAULT_MAX_PENDING_PER_USER,
            max_pending_job_mb_per_user: perch_control::DEFAULT_MAX_PENDING_BYTES_PER_USER >> 20,
            max_connections: perch_server::listener::ConnectionLimits::default().max_connections,
            max_connections_per_ip: perch_server::listener::ConnectionLimits::default().max_per_ip,
            idle_timeout_secs: perch_server::listener::ConnectionLimits::default()
                .idle_timeout
                .as_secs(),
            request_timeout_secs: perch_server::listener::ConnectionLimits::default()
                .request_timeout
                .as_secs(),
            maintenance_interval_secs: 300,
            compact_below_mb: 64,
            compact_min_files: 8,
            retention_days: Default::default(),
            job_output_days: perch_control::DEFAULT_OUTPUT_RETENTION.as_secs() / 86_400,
            max_job_output_mb_per_user: perch_control::JobsConfig::default()
                .max_output_bytes_per_user
                .map_or(0, |b| b >> 20),
            max_job_output_total_mb: perch_control::JobsConfig::default()
                .max_output_bytes_total
                .map_or(0, |b| b >> 20),
            storage: StorageSection::default(),
            pg_listen: "127.0.0.1:7432".into(),
            pg_max_connections: perch_server::PG_MAX_CONNECTIONS,
            max_syncs_per_second: perch_server::MAX_SYNCS_PER_SECOND,
            tokens_file: PathBuf::new(),
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
        }
    }
}

/// `[server.storage]`: local disk, or an S3-compatible bucket. Empty values in the S3 settings
/// come from the usual `AWS_*` environment variables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageSection {
    /// "local" or "s3".
    pub kind: String,
    pub bucket: String,
    pub prefix: String,
    pub endpoint: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub allow_http: bool,
}

impl Default for StorageSection {
    fn default() -> Self {
        StorageSection {
            kind: "local".into(),
            bucket: String::new(),
            prefix: String::new(),
            endpoint: String::new(),
            region: String::new(),
            access_key_id: String::new(),
            secret_access_key: String::new(),
            allow_http: false,
        }
    }
}

impl StorageSection {
    fn store_config(&self) -> perch_query::StorageConfig {
        if self.kind != "s3" {
            return perch_query::StorageConfig::Local;
        }
        let set = |v: &String| Some(v.clone()).filter(|v| !v.is_empty());
        perch_query::StorageConfig::S3(perch_query::S3Config {
            bucket: self.bucket.clone(),
            prefix: self.prefix.clone(),
            endpoint: set(&self.endpoint),
            region: set(&self.region),
            access_key_id: set(&self.access_key_id),
            secret_access_key: set(&self.secret_access_key),
            allow_http: self.allow_http,
        })
    }
}

impl ServerSection {
    /// Checks the keys of `[server]` and `[server.storage]`; the message names the key.
    pub(super) fn check(&self) -> Result<()> {
        self.check_listeners()?;
        self.check_bounds()?;
        self.check_store()?;
        if self.max_connections_per_ip == 0 || self.max_connections_per_ip > self.max_connections {
            return bad(
                "server.max_connections_per_ip",
                &format!(
                    "must be between 1 and server.max_connections ({})",
                    self.max_connections
                ),
            );
        }
        Ok(())
    }

    /// The HTTP and PostgreSQL listen addresses: well formed, and on loopback unless clients
    /// must authenticate (`tokens_file`).
    fn check_listeners(&self) -> Result<()> {
        // Without tokens the PostgreSQL listener runs in trust mode (no password): loopback only.
        // With tokens, clients log in with a token as their password, as on HTTP.
        if self.tokens_file.as_os_str().is_empty()
            && let Ok(a) = self.pg_listen.parse::<std::net::SocketAddr>()
            && !a.ip().is_loopback()
        {
            return bad(
                "server.pg_listen",
                &format!(
                    "{a} is not a loopback address; without server.tokens_file the PostgreSQL listener runs in trust mode (no password) and listens on loopback only: set tokens_file, and clients log in with a token as their password"
                ),
            );
        }
        if self.tokens_file.as_os_str().is_empty()
            && let Ok(a) = self.listen.parse::<std::net::SocketAddr>()
            && !a.ip().is_loopback()
        {
            return bad(
                "server.listen",
                &format!(
                    "{a} is not a loopback address; without server.tokens_file perch runs open (no authentication) and listens on loopback only: set tokens_file"
                ),
            );
        }
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return bad(
                "server.listen",
                &format!("{:?} is not an address like 127.0.0.1:7300", self.listen),
            );
        }
        if !self.pg_listen.is_empty() && self.pg_listen.parse::<std::net::SocketAddr>().is_err() {
            return bad(
                "server.pg_listen",
                &format!(
                    "{:?} is not an address like 127.0.0.1:7432 (empty turns the listener off)",
                    self.pg_listen
                ),
            );
        }
        Ok(())
    }

    /// Durations, sizes and counts: each within its bounds, and a node's lease longer than the
    /// time it takes to be marked down.
    fn check_bounds(&self) -> Result<()> {
        within(
            "server.flush_interval_secs",
            self.flush_interval_secs,
            1,
            DAY,
            SECONDS,
        )?;
        within(
            "server.node_stale_after_secs",
            self.node_stale_after_secs,
            2,
            DAY,
            SECONDS,
        )?;
        let lease = self.node_lease_secs;
        within("server.node_lease_secs", lease, 3, WEEK, SECONDS)?;
        within(
            "server.idle_timeout_secs",
            self.idle_timeout_secs,
            1,
            WEEK,
            SECONDS,
        )?;
        within(
            "server.request_timeout_secs",
            self.request_timeout_secs,
            1,
            DAY,
            SECONDS,
        )?;
        within(
            "server.maintenance_interval_secs",
            self.maintenance_interval_secs,
            1,
            DAY,
            SECONDS,
        )?;
        within("server.max_body_mb", self.max_body_mb as u64, 1, 4096, MIB)?;
        within(
            "server.compact_below_mb",
            self.compact_below_mb,
            0,
            PIB,
            MIB,
        )?;
        if self.job_output_days > 36_500 {
            return bad(
                "server.job_output_days",
                &format!(
                    "must be at most 36500 days (100 years; 0 keeps output for ever), got {}",
                    self.job_output_days
                ),
            );
        }
        for (key, mb) in [
            (
                "server.max_job_output_mb_per_user",
                self.max_job_output_mb_per_user,
            ),
            (
                "server.max_job_output_total_mb",
                self.max_job_output_total_mb,
            ),
        ] {
            if mb > 1 << 30 {
                return bad(
                    key,
                    &format!("must be at most 1073741824 MiB (1 PiB; 0 is no bound), got {mb}"),
                );
            }
        }
        for (table, days) in &self.retention_days {
            if *days > 36_500 {
                return bad(
                    &format!("server.retention_days.{table}"),
                    &format!("must be at most 36500 days (100 years), got {days}"),
                );
            }
        }
        if self.node_lease_secs <= self.node_stale_after_secs {
            return bad(
                "server.node_lease_secs",
                &format!(
                    "must be longer than server.node_stale_after_secs ({} s): a node is marked down first, and its jobs are requeued only when its lease runs out",
                    self.node_stale_after_secs
                ),
            );
        }
        if self.max_connections < 16 {
            return bad(
                "server.max_connections",
                "must be at least 16 (agents, clients and scrapers share them)",
            );
        }
        if !(1..=512).contains(&self.pg_max_connections) {
            return bad(
                "server.pg_max_connections",
                "must be 1 to 512 (PostgreSQL-protocol connections at once; they share the descriptors the HTTP listener leaves)",
            );
        }
        if !(10..=1_000_000).contains(&self.max_syncs_per_second) {
            return bad(
                "server.max_syncs_per_second",
                &format!(
                    "must be 10 to 1000000 (agents' syncs a second, all nodes together), got {}",
                    self.max_syncs_per_second
                ),
            );
        }
        if self.max_pending_jobs_per_user == 0 {
            return bad("server.max_pending_jobs_per_user", "must be at least 1");
        }
        if !(1..=1 << 20).contains(&self.max_pending_job_mb_per_user) {
            return bad(
                "server.max_pending_job_mb_per_user",
                "must be 1 to 1048576 (MiB of command and environment of one user's pending jobs)",
            );
        }
        Ok(())
    }

    /// The store: tables named in `retention_days` exist, the storage kind fits its bucket,
    /// compaction has files to merge, and the ingest buffer holds a flush and more.
    fn check_store(&self) -> Result<()> {
        for table in self.retention_days.keys() {
            if perch_query::Table::from_name(table).is_none() {
                let names: Vec<_> = perch_query::Table::ALL.iter().map(|t| t.name()).collect();
                return bad(
                    &format!("server.retention_days.{table}"),
                    &format!("no such table; the tables are {}", names.join(", ")),
                );
            }
        }
        let storage = &self.storage;
        match storage.kind.as_str() {
            "local" if !storage.bucket.is_empty() => {
                return bad(
                    "server.storage.bucket",
                    "is set but server.storage.kind is \"local\"; set kind = \"s3\" to use the bucket",
                );
            }
            "local" => {}
            "s3" if storage.bucket.is_empty() => {
                return bad(
                    "server.storage.bucket",
                    "kind = \"s3\" needs the bucket's name",
                );
            }
            "s3" => {}
            other => {
                return bad(
                    "server.storage.kind",
                    &format!("{other:?} is not a storage kind; use \"local\" or \"s3\""),
                );
            }
        }
        if self.compact_min_files < 2 || self.maintenance_interval_secs == 0 {
            return bad(
                "server.compact_min_files / server.maintenance_interval_secs",
                "must be at least 2 and 1",
            );
        }
        if self.max_buffered_rows < self.flush_max_rows.saturating_mul(2) {
            return bad(
                "server.max_buffered_rows",
                &format!(
                    "must be at least twice server.flush_max_rows ({}), so ingest goes on while a flush is written",
                    self.flush_max_rows
                ),
            );
        }
        Ok(())
    }

    /// The store's configuration: where data goes, how often it is flushed and compacted,
    /// and how long each table keeps it.
    pub(super) fn store(&self) -> perch_query::StoreConfig {
        let mut store = perch_query::StoreConfig::new(&self.data_dir);
        store.flush_interval = Duration::from_secs(self.flush_interval_secs);
        store.flush_max_rows = self.flush_max_rows;
        store.max_buffered_rows = self.max_buffered_rows;
        store.maintenance_interval = Duration::from_secs(self.maintenance_interval_secs);
        store.compact_below_bytes = self.compact_below_mb << 20;
        store.compact_min_files = self.compact_min_files;
        store.storage = self.storage.store_config();
        for (name, days) in &self.retention_days {
            if let Some(table) = perch_query::Table::from_name(name) {
                if *days == 0 {
                    store.retention.remove(&table);
                } else {
                    store
                        .retention
                        .insert(table, Duration::from_secs(days * 86_400));
                }
            }
        }
        store
    }

    /// The TLS certificate and key, read from `tls_cert` and `tls_key`; `None` when neither
    /// is set.
    pub(super) fn tls(&self) -> Result<Option<std::sync::Arc<perch_server::tls::Certificates>>> {
        match (
            self.tls_cert.as_os_str().is_empty(),
            self.tls_key.as_os_str().is_empty(),
        ) {
            (true, true) => Ok(None),
            (false, false) => Ok(Some(
                perch_server::tls::Certificates::load(perch_server::tls::TlsFiles {
                    cert: self.tls_cert.clone(),
                    key: self.tls_key.clone(),
                })
                .map_err(|e| anyhow::anyhow!("config key {e}"))?,
            )),
            (true, false) => anyhow::bail!(
                "config key server.tls_key is set without server.tls_cert: give both, or neither"
            ),
            (false, true) => anyhow::bail!(
                "config key server.tls_cert is set without server.tls_key: give both, or neither"
            ),
        }
    }
}
