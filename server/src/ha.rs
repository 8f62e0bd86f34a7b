//! The standby control plane at the HTTP edge: `GET /v1/ha` (who leads, since when, at which
//! epoch), the words of `/readyz`, and what a standby answers until it leads
//! ([`serve_standby`]): reads of its own status, and for everything else a redirect to the
//! leader (`307`, `x-perch-leader`) or, with no leader known, `503` `standby` with
//! `x-perch-standby` and `Retry-After`. The lease itself is the control plane's
//! ([`perch_control::ha`]).

use crate::{ApiError, AppState, ErrorCode, ServerConfig, listener};
use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use perch_control::ha::{Holder, Role, Status};
use serde::Serialize;
use tokio::net::TcpListener;

/// The header naming the leader's base URL on a standby's redirect.
pub const LEADER_HEADER: &str = "x-perch-leader";
/// The header on a standby's 503 when it knows no leader.
pub const STANDBY_HEADER: &str = "x-perch-standby";

/// This server in a deployment with a standby: its name and address in the lease, and the
/// lease as it sees it.
#[derive(Debug, Clone)]
pub struct Ha {
    pub name: String,
    pub address: String,
    pub status: Status,
}

#[derive(Debug, Serialize)]
struct ServerView<'a> {
    name: &'a str,
    address: &'a str,
}

#[derive(Debug, Serialize)]
struct LeaderView {
    name: String,
    address: String,
    epoch: i64,
    since: String,
    since_ms: i64,
    lease_expires_ms: i64,
}

impl From<Holder> for LeaderView {
    fn from(h: Holder) -> LeaderView {
        LeaderView {
            since: perch_model::timefmt::rfc3339(h.since_ms),
            name: h.name,
            address: h.address,
            epoch: h.epoch,
            since_ms: h.since_ms,
            lease_expires_ms: h.expires_ms,
        }
    }
}

#[derive(Debug, Serialize)]
struct HaView<'a> {
    /// `single`: one server, the embedded job database; `ha`: leader and standbys.
    mode: &'static str,
    role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    server: Option<ServerView<'a>>,
    leader: Option<LeaderView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    why: Option<String>,
}

fn view(ha: Option<&Ha>) -> HaView<'_> {
    let Some(ha) = ha else {
        return HaView {
            mode: "single",
            role: "leader",
            server: None,
            leader: None,
            why: None,
        };
    };
    let server = Some(ServerView {
        name: &ha.name,
        address: &ha.address,
    });
    let (role, leader, why) = match ha.status.role() {
        Role::Leader { holder } => ("leader", Some(holder.into()), None),
        Role::Standby { leader } => ("standby", leader.map(Into::into), None),
        Role::Deposed { why, .. } => ("deposed", None, Some(why)),
    };
    HaView {
        mode: "ha",
        role,
        server,
        leader,
        why,
    }
}

/// `GET /v1/ha`.
pub(crate) async fn status(State(state): State<AppState>) -> Response {
    Json(view(state.config.ha.as_ref())).into_response()
}

/// What `/readyz` adds on a leader of a deployment with a standby.
pub(crate) fn leader_words(ha: &Ha) -> String {
    match ha.status.role() {
        Role::Leader { holder } => format!(
            " (leader {} at epoch {} since {})",
            holder.name,
            holder.epoch,
            perch_model::timefmt::rfc3339_seconds(holder.since_ms)
        ),
        Role::Standby { .. } => " (standby)".into(),
        Role::Deposed { why, .. } => format!(" (deposed: {why})"),
    }
}

/// A standby's answer to `request`.
async fn standby(State(ha): State<Ha>, request: Request) -> Response {
    let path = request.uri().path();
    match path {
        "/healthz" => return "ok (standby)\n".into_response(),
        "/v1/ha" => return Json(view(Some(&ha))).into_response(),
        // Its own series only: a redirect would have a scraper of both count the leader's twice.
        "/metrics" => {
            return (
                [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                format!(
                    "# HELP perch_ha_standby This server is a standby (the leader serves every other series)\n# TYPE perch_ha_standby gauge\nperch_ha_standby{{server=\"{}\"}} 1\n",
                    ha.name.replace('\\', "\\\\").replace('"', "\\\"")
                ),
            )
                .into_response();
        }
        _ => {}
    }
    let leader = ha.status.role();
    let leader = match &leader {
        Role::Standby {
            leader: Some(holder),
        } => Some(holder),
        _ => None,
    };
    if path == "/readyz" {
        let words = match leader {
            Some(h) => format!(
                "standby: the leader is {} at {} (epoch {} since {})\n",
                h.name,
                h.address,
                h.epoch,
                perch_model::timefmt::rfc3339_seconds(h.since_ms)
            ),
            None => "standby: no leader yet\n".into(),
        };
        return (StatusCode::SERVICE_UNAVAILABLE, words).into_response();
    }
    match leader {
        Some(h) => {
            let target = format!(
                "{}{}",
                h.address.trim_end_matches('/'),
                request.uri().path_and_query().map_or(path, |p| p.as_str())
            );
            let (Ok(location), Ok(base)) = (
                HeaderValue::from_str(&target),
                HeaderValue::from_str(h.address.trim_end_matches('/')),
            ) else {
                return no_leader(&ha);
            };
            let mut response = (
                StatusCode::TEMPORARY_REDIRECT,
                format!(
                    "this perch server ({}) is a standby; the leader is {} at {}\n",
                    ha.name, h.name, h.address
                ),
            )
                .into_response();
            response.headers_mut().insert(header::LOCATION, location);
            response.headers_mut().insert(LEADER_HEADER, base);
            response
        }
        None => no_leader(&ha),
    }
}

fn no_leader(ha: &Ha) -> Response {
    let mut response = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Standby,
        format!(
            "this perch server ({}) is a standby and knows no leader yet (the lease is being taken over, or the job database cannot be reached); retry, or ask another server",
            ha.name
        ),
    )
    .retry_after(1)
    .into_response();
    response
        .headers_mut()
        .insert(STANDBY_HEADER, HeaderValue::from_static("1"));
    response
}

/// Serves a standby's answers on `listener` until `until` resolves (this server took the
/// lease, or shuts down); requests in flight are answered first. Over TLS when `config` has a
/// certificate, with the same connection limits as the leader's listener.
pub async fn serve_standby(
    listener: TcpListener,
    ha: Ha,
    config: &ServerConfig,
    until: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new().fallback(standby).with_state(ha);
    let tls = config
        .tls
        .as_ref()
        .map(|certs| {
            certs
                .acceptor(&[b"http/1.1"])
                .map_err(std::io::Error::other)
        })
        .transpose()?;
    let limits = listener::fit_descriptor_limit(config.connections);
    let listener = listener::LimitedListener::new(listener, limits, tls);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<listener::Peer>(),
    )
    .with_graceful_shutdown(until)
    .await
}
