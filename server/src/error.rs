//! The one mapping from failures to HTTP answers: a status code and a JSON body
//! `{"error": {"code": "...", "message": "..."}}` whose message says what to change.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

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
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
    /// Seconds after which a retry may work, sent as `Retry-After` (busy and throttled
    /// answers).
    pub retry_after_secs: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// The same answer, telling the client when to retry.
    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }

    pub fn bad_request(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// A JSON body the framework could not take: 413 when it is larger than the server's limit
    /// (a submission of a 2 MiB command was answered 400 "malformed"), else 400 with `code` and
    /// `message`.
    pub fn json_body(
        e: &axum::extract::rejection::JsonRejection,
        code: ErrorCode,
        message: impl Into<String>,
    ) -> Self {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::UnreadableBody,
                format!(
                    "the body is larger than this server takes ({}); send less, or ask its operator to raise server.max_body_mb",
                    e.body_text()
                ),
            );
        }
        Self::bad_request(code, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(code = self.code.as_str(), message = %self.message, "request failed");
        }
        let body =
            serde_json::json!({"error": {"code": self.code.as_str(), "message": self.message}});
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

impl From<perch_query::Error> for ApiError {
    fn from(e: perch_query::Error) -> Self {
        use perch_query::Error as E;
        let message = e.to_string();
        match e {
            E::BadQuery(_) => ApiError::bad_request(crate::ErrorCode::BadQuery, message),
            E::TooComplex(_) => ApiError::bad_request(crate::ErrorCode::QueryTooComplex, message),
            E::ReadOnly(_) => {
                ApiError::new(StatusCode::FORBIDDEN, crate::ErrorCode::ReadOnly, message)
            }
            E::Timeout { .. } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                crate::ErrorCode::QueryTimeout,
                message,
            ),
            E::Backpressure { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                crate::ErrorCode::StoreBusy,
                message,
            )
            .retry_after(5),
            E::Busy(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                crate::ErrorCode::SqlBusy,
                message,
            )
            .retry_after(1),
            E::InFlight { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                crate::ErrorCode::BatchInFlight,
                message,
            )
            .retry_after(1),
            E::ResourcesExhausted { .. } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                crate::ErrorCode::QueryMemoryLimit,
                message,
            ),
            E::WalClosed(_) | E::Io { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                crate::ErrorCode::StorageUnavailable,
                message,
            ),
            E::Execution(_) | E::Corrupt { .. } | E::Parquet(_) | E::Arrow(_) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                crate::ErrorCode::Internal,
                message,
            ),
        }
    }
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        crate::ErrorCode::NotFound,
        format!("no endpoint at {uri}; GET / lists the endpoints"),
    )
}

/// Errors the web framework answers itself (a path segment that is not a number, a query
/// string that does not parse, a method the route does not take) come as plain text, or with
/// no body at all for a 405: under `/v1/` they get the JSON shape every other API error has,
/// with a code from the status, so a client reads one format. Other paths (`/metrics`,
/// `/readyz`, the web view) keep their own.
pub async fn json_errors(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let api = request.uri().path().starts_with("/v1/");
    let (path, method) = (request.uri().path().to_owned(), request.method().clone());
    let response = next.run(request).await;
    let status = response.status();
    let json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !api || json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (parts, body) = response.into_parts();
    // The framework's own messages are a line; anything longer is cut, not buffered.
    let text = axum::body::to_bytes(body, 16 << 10)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_owned();
    let code = match status {
        StatusCode::NOT_FOUND => ErrorCode::NotFound,
        StatusCode::METHOD_NOT_ALLOWED => ErrorCode::MethodNotAllowed,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::UnreadableBody,
        StatusCode::UNAUTHORIZED => ErrorCode::Unauthenticated,
        StatusCode::FORBIDDEN => ErrorCode::Forbidden,
        s if s.is_server_error() => ErrorCode::Internal,
        _ => ErrorCode::BadParameters,
    };
    let message = match (text.is_empty(), status) {
        (false, _) => text,
        // The router adds the `Allow` header outside this layer: point at it.
        (true, StatusCode::METHOD_NOT_ALLOWED) => {
            format!("{path} does not take {method}; the Allow header lists the methods it takes")
        }
        (true, s) => s.canonical_reason().unwrap_or("error").to_owned(),
    };
    let mut response = ApiError::new(status, code, message).into_response();
    // Allow, WWW-Authenticate, Retry-After: what the framework said besides its text.
    for (name, value) in &parts.headers {
        if name != axum::http::header::CONTENT_TYPE && name != axum::http::header::CONTENT_LENGTH {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    response
}
