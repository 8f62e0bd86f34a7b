//! The store's error type: one enum whose variants tell the HTTP edge which status to answer.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The SQL text or plan is at fault: the message says what to change.
    #[error("{0}")]
    BadQuery(String),
    /// The statement is longer or nests deeper than perch plans ([`crate::guard`]): the
    /// message says what to change.
    #[error("{0}")]
    TooComplex(String),
    /// The statement tries to change something; the SQL interface is read-only.
    #[error("{0}")]
    ReadOnly(String),
    #[error("query ran longer than the {limit_s} s limit; narrow the time range or aggregate more")]
    Timeout { limit_s: f64 },
    #[error("query needs more memory than the {limit_mb} MiB limit; {}", room_advice(table.as_deref()))]
    ResourcesExhausted {
        limit_mb: usize,
        /// The live table whose rows passed it, if they did.
        table: Option<String>,
    },
    /// The server's SQL capacity (running queries, memory budget) is taken; retrying later
    /// works.
    #[error("{0}")]
    Busy(String),
    /// A failure of the engine itself (not of the query text).
    #[error("query failed: {0}")]
    Execution(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the server holds {held} rows it has not yet written to Parquet (server.max_buffered_rows = {limit}){}; keep the data and retry later",
        flush_error.as_ref().map_or(String::new(), |e| format!(": flushes are failing ({e})"))
    )]
    Backpressure {
        held: usize,
        limit: usize,
        flush_error: Option<String>,
    },
    #[error("batch {seq} from node {node} is being written by an earlier request; retry shortly")]
    InFlight { node: String, seq: u64 },
    #[error("write-ahead log is unavailable: {0}")]
    WalClosed(String),
    #[error("corrupt {what}: {message}")]
    Corrupt { what: &'static str, message: String },
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
}

impl Error {
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Error::Io { what, path, source }
    }
}

/// What to change when a query needs more memory than its limit: a live table (`jobs`,
/// `job_allocations`, ...) holds the rows of the columns a query reads that its filters on
/// that table keep ([`crate::Room::keep`]), so fewer columns or narrower filters on it help.
fn room_advice(table: Option<&str>) -> String {
    match table {
        None => "narrow the time range, select fewer columns, or aggregate".into(),
        Some(t) => format!(
            "the rows of {t} it keeps pass it: select fewer of that table's columns, or filter its rows more narrowly in WHERE (by time, job, user or account)"
        ),
    }
}
