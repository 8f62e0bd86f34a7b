//! The crate's one error type. Every variant says which thing is wrong (a config field, a rule,
//! a receiver, a file) and what to change, because these errors end up in front of an operator
//! who edits a config file or reads a log line, not in front of the code's author.

use std::path::PathBuf;

/// Everything that can go wrong in perch-alerts.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is invalid; `field` is its dotted path (`alerts.rules[2].for`).
    #[error("invalid alerts config: `{field}` {message}")]
    Config {
        /// Dotted path of the field at fault.
        field: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// The rows a rule's query returned cannot become alert instances.
    #[error("rule `{rule}`: {message}")]
    Rule {
        /// The rule's name.
        rule: String,
        /// What is wrong with the rows.
        message: String,
    },
    /// A label matcher could not be parsed.
    #[error("matcher {text:?}: {message}")]
    Matcher {
        /// The text as given.
        text: String,
        /// What is wrong and the accepted forms.
        message: String,
    },
    /// A silence request is invalid.
    #[error("silence: {0}")]
    Silence(String),
    /// No silence has this id.
    #[error("no silence with id `{0}`; list them with GET /v1/silences or `perch alerts silence`")]
    UnknownSilence(String),
    /// Reading or writing a state file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A state file exists but does not hold a snapshot this version can read.
    #[error("{}: not a perch alerts state file ({message}); move it away to start with empty state", path.display())]
    Snapshot {
        /// The file.
        path: PathBuf,
        /// The parse error.
        message: String,
    },
    /// Delivering a notification failed (after retries, when the caller retried).
    #[error("receiver `{receiver}`: {message}")]
    Send {
        /// The receiver's name.
        receiver: String,
        /// What failed.
        message: String,
    },
}

/// The crate's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for a [`Error::Config`] error.
    pub(crate) fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}
