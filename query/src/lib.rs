//! perch's telemetry store and its SQL front.
//!
//! Data arrives as validated [`perch_model::Batch`]es. [`Store::ingest`] makes each one durable
//! in the write-ahead log ([`wal`]) before it returns, then appends it to an in-memory buffer of
//! Arrow record batches that SQL sees at once. A flush moves the buffer to sorted, zstd-compressed
//! Parquet files partitioned by table and day, records them in the [`manifest`], and only then
//! drops the write-ahead log segments they cover. [`SqlEngine`] answers read-only SQL through
//! DataFusion over one table provider per table that unions the Parquet files with the buffer
//! (see [`provider`]), so fresh and old data are one table and nothing is counted twice.
//! Each flush also writes 1-minute and 1-hour rollups of GPU and host samples ([`rollup`]),
//! kept longer than the raw rows. The files and the manifest live in the data directory or in
//! an S3-compatible bucket ([`storage`]); the write-ahead log is always local.

mod budget;
mod by_key;
mod error;
mod files;
mod functions;
pub mod guard;
mod live;
mod maintenance;
mod manifest;
mod median;
pub mod optimizer;
mod peers;
mod provider;
mod rollup;
mod rounding;
pub mod schema;
mod sql;
mod storage;
mod store;
mod strings;
pub mod wal;

pub use error::{Error, Result};
pub use live::{Caller, LiveTable, Pruning, Room, project};
pub use maintenance::MaintenanceStats;
pub use peers::{PEER_REFRESH, PeerConfig, PeerStatus};
pub use schema::Table;
pub use sql::{QueryLimits, QueryOutput, SqlEngine, check_read_only, sql_runtime};
pub use storage::{S3Config, StorageConfig};
pub use store::{FlushStats, IngestOutcome, Source, Store, StoreConfig, StoreStats};
