//! The one mapping from failures to HTTP answers: a status code and a JSON body
//! `{"error": {"code": "...", "message": "..."}}` whose message says what to change.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use perch_control::ControlError;
pub use perch_model::ErrorCode;

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

/// The one mapping from the control plane's errors to HTTP answers.
impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        let message = e.to_string();
        match e {
            ControlError::Invalid(_) => ApiError::bad_request(ErrorCode::InvalidJob, message),
            ControlError::BadRequest(_) => ApiError::bad_request(ErrorCode::BadParameters, message),
            ControlError::Scheduler(perch_scheduler::Error::InvalidJob { .. }) => {
                ApiError::bad_request(ErrorCode::InvalidJob, message)
            }
            // What an agent said of its node (an impossible GPU count, say): the agent's
            // configuration is to change, not the server.
            ControlError::Scheduler(perch_scheduler::Error::InvalidNode { .. }) => {
                ApiError::bad_request(ErrorCode::InvalidSync, message)
            }
            ControlError::NoSuchJob(_)
            | ControlError::NoSuchNode(_)
            | ControlError::NoSuchArray(_) => {
                ApiError::new(StatusCode::NOT_FOUND, ErrorCode::NotFound, message)
            }
            ControlError::Forbidden(_) => {
                ApiError::new(StatusCode::FORBIDDEN, ErrorCode::Forbidden, message)
            }
            ControlError::TooManyPending { .. } | ControlError::TooManyPendingBytes { .. } => {
                ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    ErrorCode::TooManyPending,
                    message,
                )
            }
            ControlError::NodeClaimed { .. } => {
                ApiError::new(StatusCode::CONFLICT, ErrorCode::NodeClaimed, message).retry_after(5)
            }
            ControlError::OutputDeleted { .. } => {
                ApiError::new(StatusCode::GONE, ErrorCode::OutputDeleted, message)
            }
            ControlError::AlreadyEnded { .. } => {
                ApiError::new(StatusCode::CONFLICT, ErrorCode::AlreadyEnded, message)
            }
            ControlError::Unavailable(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::JobDbUnavailable,
                message,
            )
            .retry_after(5),
            ControlError::ShuttingDown(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::ShuttingDown,
                message,
            ),
            ControlError::ListingBusy(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::ListingBusy,
                message,
            )
            .retry_after(1),
            ControlError::Scheduler(_)
            | ControlError::Db(_)
            | ControlError::Logs(_)
            | ControlError::SettledRows(_)
            | ControlError::TaskFailed(_) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorCode::Internal,
                message,
            ),
        }
    }
}
