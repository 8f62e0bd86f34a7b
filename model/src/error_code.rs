//! The codes the HTTP API answers errors with (`{"error": {"code", "message"}}`), shared by
//! the server, the control plane (whose errors name one) and the CLI (which matches on them).

/// Declares [`ErrorCode`] from one list: variant, wire name and meaning, so the enum, its
/// names and [`ErrorCode::ALL`] cannot drift apart.
macro_rules! error_codes {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// Every code the HTTP API answers errors with (`{"error": {"code", "message"}}`):
        /// clients may match on them. `openapi.json`'s `Error` schema lists the same codes
        /// (a test checks).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[doc = $doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in the order `openapi.json` lists them.
            pub const ALL: &[ErrorCode] = &[$(ErrorCode::$variant,)*];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $name,)*
                }
            }
        }
    };
}

error_codes! {
    /// The job has already ended (409).
    AlreadyEnded => "already_ended",
    /// An unknown result format was asked for.
    BadFormat => "bad_format",
    /// Query-string or body parameters out of range or unknown.
    BadParameters => "bad_parameters",
    /// SQL that does not parse or plan.
    BadQuery => "bad_query",
    /// A silence that is not valid (matchers, times).
    BadSilence => "bad_silence",
    /// The same batch is being written by another request; retry.
    BatchInFlight => "batch_in_flight",
    /// The token may not do this (403).
    Forbidden => "forbidden",
    /// An ingest server was asked what only the control server does; the message and the
    /// `x-perch-control` header name the control server (421).
    IngestOnly => "ingest_only",
    /// A failure on the server side (500).
    Internal => "internal",
    /// A telemetry batch whose values are not valid.
    InvalidBatch => "invalid_batch",
    /// A job request whose fields are not valid.
    InvalidJob => "invalid_job",
    /// OTLP data whose values are not valid.
    InvalidOtlp => "invalid_otlp",
    /// An agent sync whose fields are not valid.
    InvalidSync => "invalid_sync",
    /// The job database cannot commit (a full disk); nothing was changed, and perch reopens
    /// it by itself: retry (503).
    JobDbUnavailable => "job_db_unavailable",
    /// Job listings made and not yet read by their clients hold all the memory they may;
    /// retry (503).
    ListingBusy => "listing_busy",
    /// A telemetry batch that does not parse.
    MalformedBatch => "malformed_batch",
    /// OTLP data that does not parse.
    MalformedOtlp => "malformed_otlp",
    /// A body that does not parse as the route expects.
    MalformedRequest => "malformed_request",
    /// A method the route does not take (405; the `Allow` header lists those it does).
    MethodNotAllowed => "method_not_allowed",
    /// No silence with that id (404).
    NoSuchSilence => "no_such_silence",
    /// Another agent serves the node this agent claims (409).
    NodeClaimed => "node_claimed",
    /// No such route, job or node (404).
    NotFound => "not_found",
    /// The server is still starting (503).
    NotReady => "not_ready",
    /// The job's stored output was deleted, `server.job_output_days` after it ended (410).
    OutputDeleted => "output_deleted",
    /// The query needed more memory than its limit.
    QueryMemoryLimit => "query_memory_limit",
    /// The query ran past its time limit.
    QueryTimeout => "query_timeout",
    /// The statement is longer or nests deeper than the server plans
    /// (`query.max_statement_kb`, `query.max_expression_depth`).
    QueryTooComplex => "query_too_complex",
    /// SQL that would change data; perch's SQL is read-only.
    ReadOnly => "read_only",
    /// The server is shutting down (503).
    ShuttingDown => "shutting_down",
    /// Every SQL slot is taken; retry (503).
    SqlBusy => "sql_busy",
    /// A standby server that knows no leader yet; retry, or ask another server (503).
    Standby => "standby",
    /// The store cannot be read or written (503).
    StorageUnavailable => "storage_unavailable",
    /// The store holds too many unflushed rows; retry (503).
    StoreBusy => "store_busy",
    /// The client's address holds all the connections it may; only agents' routes are served
    /// beyond them (429).
    TooManyConnections => "too_many_connections",
    /// The user is at the pending-jobs cap (429).
    TooManyPending => "too_many_pending",
    /// No token, or one the server does not accept (401).
    Unauthenticated => "unauthenticated",
    /// A body that cannot be read (encoding, size).
    UnreadableBody => "unreadable_body",
    /// A content type the route does not take (415).
    UnsupportedMediaType => "unsupported_media_type",
    /// A validation already runs on the node; its result comes first (409).
    ValidationRunning => "validation_running",
    /// A request for a server of another role (an ingest server's push to a server that is
    /// not a control server of ingest servers) (409).
    WrongServer => "wrong_server",
}
