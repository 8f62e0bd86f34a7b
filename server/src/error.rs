//! The one mapping from failures to HTTP answers: a status code and a JSON body
//! `{"error": {"code": "...", "message": "..."}}` whose message says what to change.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Seconds after which a retry may work, sent as `Retry-After` (busy and throttled
    /// answers).
    pub retry_after_secs: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
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

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(code = self.code, message = %self.message, "request failed");
        }
        let body = serde_json::json!({"error": {"code": self.code, "message": self.message}});
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
            E::BadQuery(_) => ApiError::bad_request("bad_query", message),
            E::ReadOnly(_) => ApiError::new(StatusCode::FORBIDDEN, "read_only", message),
            E::Timeout { .. } => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "query_timeout", message)
            }
            E::Backpressure { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "store_busy", message).retry_after(5)
            }
            E::Busy(_) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "sql_busy", message).retry_after(1)
            }
            E::InFlight { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "batch_in_flight", message)
                    .retry_after(1)
            }
            E::ResourcesExhausted { .. } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "query_memory_limit",
                message,
            ),
            E::WalClosed(_) | E::Io { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "storage_unavailable",
                message,
            ),
            E::Execution(_) | E::Corrupt { .. } | E::Parquet(_) | E::Arrow(_) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
            }
        }
    }
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no endpoint at {uri}; GET / lists the endpoints"),
    )
}
