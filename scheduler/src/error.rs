//! The crate's one error type: what a caller did wrong when feeding the core, or what is wrong
//! in a trace file, said precisely enough to fix it.

use crate::ids::{JobId, NodeId};

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A job spec field is out of range; `field` names it.
    #[error("invalid job {job}: field `{field}` {message}")]
    InvalidJob {
        /// The job.
        job: JobId,
        /// The field at fault.
        field: &'static str,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// A job id was submitted twice.
    #[error("job {0} was already submitted")]
    DuplicateJob(JobId),
    /// An event named a job the core does not know (never submitted, or already finished).
    #[error("unknown job {0}")]
    UnknownJob(JobId),
    /// An event named a node or GPU outside the cluster.
    #[error("unknown node {node} or GPU index {gpu:?}")]
    UnknownNode {
        /// The node.
        node: NodeId,
        /// The GPU index, when one was named.
        gpu: Option<u32>,
    },
    /// A node spec is unusable.
    #[error("invalid node `{name}`: {message}")]
    InvalidNode {
        /// The node's name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A trace file line could not be read.
    #[error("{file}: line {line}, column `{column}`: {message}")]
    Trace {
        /// The file.
        file: String,
        /// 1-based line number.
        line: usize,
        /// The column name.
        column: String,
        /// What is wrong.
        message: String,
    },
    /// Reading a file or writing the plot failed.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// Drawing the plot failed.
    #[error("plot {path}: {message}")]
    Plot {
        /// The output path.
        path: String,
        /// What failed.
        message: String,
    },
    /// A simulator option is out of range.
    #[error("invalid simulation option `{option}`: {message}")]
    SimConfig {
        /// The option.
        option: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// The crate's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
