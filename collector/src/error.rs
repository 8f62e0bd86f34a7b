//! The collector's one error type. Sampling problems (a missing `/proc` file, an NVML call a GPU
//! does not support) are mostly absorbed where they happen and turn into absent values; what
//! reaches a caller as a [`CollectorError`] is something the operator has to act on.

use std::path::PathBuf;

/// Everything that can go wrong in the collector.
#[derive(Debug, thiserror::Error)]
pub enum CollectorError {
    /// A file under `/proc`, `/sys` or the data directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A kernel file had a shape this parser does not understand.
    #[error("cannot parse {what}: {message}")]
    Parse { what: &'static str, message: String },
    /// NVML could not be loaded or initialised.
    #[error("NVML: {0}")]
    Nvml(String),
    /// The agent configuration cannot work; the message says what to change.
    #[error("invalid agent configuration: {0}")]
    Config(String),
    /// Building the HTTP client or encoding a batch failed.
    #[error("cannot prepare batch for sending: {0}")]
    Encode(String),
    /// An agent task panicked or was cancelled.
    #[error("agent task stopped abnormally: {0}")]
    Task(String),
    /// The agent's spool on disk could not be used.
    #[error("spool {path}: {message}")]
    Spool { path: PathBuf, message: String },
}

impl CollectorError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn parse(what: &'static str, message: impl Into<String>) -> Self {
        Self::Parse {
            what,
            message: message.into(),
        }
    }
}

/// The collector's result type.
pub type Result<T, E = CollectorError> = std::result::Result<T, E>;
