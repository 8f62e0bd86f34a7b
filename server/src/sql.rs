//! `POST /v1/sql`: read-only SQL over the store.
//!
//! The body is either JSON `{"sql": "...", "format": "json" | "csv" | "arrow"}` or the SQL text
//! itself (any other content type) with the format in `?format=`. JSON answers
//! `{"columns": [{"name", "type"}], "rows": [{...}], "row_count", "truncated", "note"?}`; CSV
//! has a header line; `arrow` is an Arrow IPC stream. Every format reports the row count and a
//! cut result in the `x-perch-row-count` and `x-perch-truncated` headers.

use crate::auth::{Identity, Role};
use crate::{ApiError, AppState};
use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::Response;
use perch_query::QueryOutput;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Json,
    Csv,
    Arrow,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    sql: String,
    #[serde(default)]
    format: Option<Format>,
}

#[derive(Debug, Deserialize)]
pub struct Params {
    format: Option<String>,
}

fn parse_format(s: &str) -> Result<Format, ApiError> {
    match s {
        "json" => Ok(Format::Json),
        "csv" => Ok(Format::Csv),
        "arrow" => Ok(Format::Arrow),
        other => Err(ApiError::bad_request(
            crate::ErrorCode::BadFormat,
            format!("format {other:?} is not known; use json, csv or arrow"),
        )),
    }
}

pub async fn sql(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Query(params): Query<Params>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    let result = handle(&state, &who, params, &headers, &body).await;
    state.metrics.sql_query(result.is_ok(), started.elapsed());
    result
}

async fn handle(
    state: &AppState,
    who: &Identity,
    params: Params,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let mut format = params.format.as_deref().map(parse_format).transpose()?;
    let text = if is_json {
        let req: JsonRequest = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(
                crate::ErrorCode::MalformedRequest,
                format!(
                    "expected {{\"sql\": \"SELECT ...\", \"format\": \"json|csv|arrow\"}}: {e}"
                ),
            )
        })?;
        format = format.or(req.format);
        req.sql
    } else {
        String::from_utf8(body.to_vec()).map_err(|_| {
            ApiError::bad_request(
                crate::ErrorCode::MalformedRequest,
                "the SQL text is not valid UTF-8",
            )
        })?
    };
    // The user's share of the SQL slots; an operator may also take the one kept for operators.
    let output = state
        .sql
        .query_as(&text, &who.user, who.role == Role::Operator)
        .await?;
    let max_rows = state.sql.limits().max_rows;
    // Encoding up to max_rows rows is CPU work: off the runtime that answers agents' syncs.
    tokio::task::spawn_blocking(move || render(output, format.unwrap_or_default(), max_rows))
        .await
        .map_err(|e| {
            ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                crate::ErrorCode::Internal,
                format!("encoding the result: {e}"),
            )
        })?
}

fn render(output: QueryOutput, format: Format, max_rows: usize) -> Result<Response, ApiError> {
    let internal = |e: arrow::error::ArrowError| {
        ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            crate::ErrorCode::Internal,
            format!("encoding the result: {e}"),
        )
    };
    let (content_type, body) = match format {
        Format::Json => {
            let mut rows = Vec::new();
            {
                let mut writer = arrow::json::WriterBuilder::new()
                    .with_explicit_nulls(true)
                    .build::<_, arrow::json::writer::JsonArray>(&mut rows);
                for batch in &output.batches {
                    writer.write(batch).map_err(internal)?;
                }
                writer.finish().map_err(internal)?;
            }
            if rows.is_empty() {
                rows.extend_from_slice(b"[]");
            }
            let columns: Vec<_> = output
                .schema
                .fields()
                .iter()
                .map(|f| serde_json::json!({"name": f.name(), "type": f.data_type().to_string()}))
                .collect();
            let mut head = serde_json::json!({
                "columns": columns,
                "row_count": output.rows,
                "truncated": output.truncated,
            });
            if output.truncated {
                head["note"] = format!("result cut at {max_rows} rows; add a LIMIT, aggregate, or narrow the time range").into();
            }
            // Splice the rows array, already JSON, into the object without re-parsing it.
            let mut body = serde_json::to_vec(&head).map_err(|e| {
                ApiError::new(
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    crate::ErrorCode::Internal,
                    e.to_string(),
                )
            })?;
            body.pop();
            body.extend_from_slice(b",\"rows\":");
            body.extend_from_slice(&rows);
            body.push(b'}');
            ("application/json", body)
        }
        Format::Csv => {
            let mut body = Vec::new();
            {
                let mut writer = arrow::csv::WriterBuilder::new()
                    .with_header(true)
                    .build(&mut body);
                for batch in &output.batches {
                    writer.write(batch).map_err(internal)?;
                }
            }
            if output.batches.is_empty() {
                // The CSV writer only writes a header with the first batch.
                let header: Vec<_> = output
                    .schema
                    .fields()
                    .iter()
                    .map(|f| f.name().clone())
                    .collect();
                body = format!("{}\n", header.join(",")).into_bytes();
            }
            ("text/csv; charset=utf-8", body)
        }
        Format::Arrow => {
            let mut body = Vec::new();
            {
                let mut writer =
                    arrow::ipc::writer::StreamWriter::try_new(&mut body, &output.schema)
                        .map_err(internal)?;
                for batch in &output.batches {
                    writer.write(batch).map_err(internal)?;
                }
                writer.finish().map_err(internal)?;
            }
            ("application/vnd.apache.arrow.stream", body)
        }
    };
    let mut response = Response::new(Body::from(body));
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert("x-perch-row-count", HeaderValue::from(output.rows));
    h.insert(
        "x-perch-truncated",
        HeaderValue::from_static(if output.truncated { "true" } else { "false" }),
    );
    Ok(response)
}
