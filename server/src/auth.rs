//! Identity and access: every request under `/v1` carries `Authorization: Bearer <token>`, and
//! the token maps to a user and a role from the tokens file (`server.tokens_file`).
//!
//! - `user`: submits jobs as itself, lists and shows jobs, runs SQL, and cancels or reads the
//!   logs of its own jobs only.
//! - `operator`: everything, including draining and resuming nodes and acting on any job.
//! - `agent`: only what node agents do (`/v1/ingest`, `/v1/agent/sync`).
//!
//! Liveness, readiness, `/metrics` (for Prometheus) and the OTLP receiver (jobs push with no
//! token) need none. With no tokens file the server runs open: it listens on loopback only and
//! identifies each caller by the local uid that owns its connection ([`peer`]); root and the
//! server's own user are operators, every other local user a `user` under their login name,
//! and a caller it cannot identify is refused.

pub mod peer;

use crate::{ApiError, AppState};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use perch_control::job_token::JobTokens;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

pub use perch_model::identity::{Identity, Role};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    /// The token itself (accepted, with a warning: the file then holds a secret).
    #[serde(default)]
    token: Option<String>,
    /// `blake3:<64 hex digits>`, the token's hash (what `perch token create` prints).
    #[serde(default)]
    token_hash: Option<String>,
    user: String,
    role: Role,
    /// Agent tokens: the nodes it may speak for.
    #[serde(default)]
    nodes: Option<Vec<String>>,
    /// When the token stops working: a TOML date-time with its offset
    /// (`2027-03-01T00:00:00Z`), or a date (midnight UTC), bare or quoted.
    #[serde(default)]
    expires: Option<Expires>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Expires {
    At(toml::value::Datetime),
    Text(String),
}

impl Expires {
    /// Milliseconds since the epoch, or what to write instead.
    fn epoch_ms(&self) -> Result<i64, String> {
        let at = match self {
            Expires::At(at) => *at,
            Expires::Text(text) => text.trim().parse::<toml::value::Datetime>().map_err(|_| {
                format!(
                    "{text:?} is not a date-time; write it as 2027-03-01T00:00:00Z or 2027-03-01"
                )
            })?,
        };
        datetime_epoch_ms(&at)
    }
}

/// A TOML date-time as milliseconds since the epoch: a date alone is midnight UTC; a time needs
/// its offset (a token's end must not depend on the server's time zone).
pub fn datetime_epoch_ms(at: &toml::value::Datetime) -> Result<i64, String> {
    let Some(date) = at.date else {
        return Err(format!(
            "{at} has no date; write it as 2027-03-01T00:00:00Z"
        ));
    };
    let (secs_of_day, offset_min) = match (at.time, at.offset) {
        (None, _) => (0, 0),
        (Some(_), None) => {
            return Err(format!("{at} has no UTC offset; add one, e.g. {at}Z"));
        }
        (Some(t), Some(o)) => {
            let secs = i64::from(t.hour) * 3600
                + i64::from(t.minute) * 60
                + i64::from(t.second.unwrap_or(0));
            let offset = match o {
                toml::value::Offset::Z => 0,
                toml::value::Offset::Custom { minutes } => i64::from(minutes),
            };
            (secs, offset)
        }
    };
    // Days from 1970-01-01 (Howard Hinnant's days_from_civil).
    let (y, m, d) = (
        i64::from(date.year),
        i64::from(date.month),
        i64::from(date.day),
    );
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Ok((days * 86_400 + secs_of_day - offset_min * 60) * 1000)
}

/// The tokens the server accepts, by their BLAKE3 hash; `None` means open mode.
///
/// Only hashes are kept, and a presented token is hashed before it is looked up: the file need
/// not hold secrets, and how long a lookup takes tells an attacker about a hash, never about a
/// token (so no byte-by-byte guessing).
/// Clones share the tokens, so a reload ([`Tokens::reload`], on SIGHUP) reaches every
/// listener.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    map: Option<Arc<RwLock<ByHash>>>,
    /// The file they came from, read again by [`Tokens::reload`].
    path: Option<PathBuf>,
}

/// Each known token's identity and when it expires (ms since the epoch), by its hash.
type ByHash = HashMap<[u8; 32], (Identity, Option<i64>)>;

/// How the tokens file writes a token's hash.
pub const HASH_PREFIX: &str = "blake3:";

/// The hash of `token` as the tokens file's `token_hash` holds it.
pub fn token_hash(token: &str) -> String {
    format!("{HASH_PREFIX}{}", blake3::hash(token.as_bytes()).to_hex())
}

impl Tokens {
    /// No tokens: callers are identified by the local user owning their connection
    /// ([`peer`]). Only for loopback listeners.
    pub fn open() -> Tokens {
        Tokens {
            map: None,
            path: None,
        }
    }

    pub fn is_open(&self) -> bool {
        self.map.is_none()
    }

    /// Reads a TOML file of `[[tokens]]` entries with `token`, `user` and `role`.
    pub fn load(path: &Path) -> Result<Tokens, String> {
        Ok(Tokens {
            map: Some(Arc::new(RwLock::new(Self::read(path)?))),
            path: Some(path.to_owned()),
        })
    }

    /// Reads the tokens file again (on SIGHUP): added tokens work and removed ones stop at
    /// once, without a restart. A file that does not parse changes nothing. Returns how many
    /// tokens there are now.
    pub fn reload(&self) -> Result<usize, String> {
        let (Some(map), Some(path)) = (&self.map, &self.path) else {
            return Err(
                "the server runs without a tokens file; set server.tokens_file and restart".into(),
            );
        };
        let fresh = Self::read(path)?;
        let count = fresh.len();
        *map.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(count)
    }

    fn read(path: &Path) -> Result<ByHash, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading tokens file {}: {e}", path.display()))?;
        Self::parse_entries(&text).map_err(|e| format!("tokens file {}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Tokens, String> {
        Ok(Tokens {
            map: Some(Arc::new(RwLock::new(Self::parse_entries(text)?))),
            path: None,
        })
    }

    fn parse_entries(text: &str) -> Result<ByHash, String> {
        let file: TokensFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut map = HashMap::new();
        for (i, t) in file.tokens.into_iter().enumerate() {
            let hash = match (&t.token, &t.token_hash) {
                (Some(token), None) => {
                    if token.len() < 16 {
                        return Err(format!(
                            "tokens[{i}].token is shorter than 16 characters; use a long random string (`perch token create` makes one)"
                        ));
                    }
                    tracing::warn!(
                        user = %t.user,
                        "tokens[{i}] keeps its token in plain text; replace its `token = ...` with token_hash = \"{}\"",
                        token_hash(token)
                    );
                    *blake3::hash(token.as_bytes()).as_bytes()
                }
                (None, Some(hash)) => parse_hash(hash).ok_or_else(|| {
                    format!(
                        "tokens[{i}].token_hash must be \"{HASH_PREFIX}\" and 64 hex digits, as `perch token create` prints it"
                    )
                })?,
                _ => {
                    return Err(format!(
                        "tokens[{i}] needs exactly one of token_hash (preferred, from `perch token create`) or token"
                    ));
                }
            };
            if perch_model::NodeId::new(t.user.clone()).is_err() {
                return Err(format!(
                    "tokens[{i}].user {:?} must be letters, digits, '.', '_', '-'",
                    t.user
                ));
            }
            if t.nodes.is_some() && t.role != Role::Agent {
                return Err(format!(
                    "tokens[{i}].nodes is set but its role is not agent; only agent tokens are bound to nodes"
                ));
            }
            for node in t.nodes.iter().flatten() {
                perch_model::NodeId::new(node.clone())
                    .map_err(|e| format!("tokens[{i}].nodes: {e}"))?;
            }
            let expires = t
                .expires
                .as_ref()
                .map(Expires::epoch_ms)
                .transpose()
                .map_err(|e| format!("tokens[{i}].expires: {e}"))?;
            if t.role == Role::Agent && t.nodes.is_none() {
                tracing::warn!(
                    user = %t.user,
                    "agent token tokens[{i}] is bound to no node: it may report as any node; give each node its own token with nodes = [\"<node>\"]"
                );
            }
            if map
                .insert(
                    hash,
                    (
                        Identity {
                            user: t.user,
                            role: t.role,
                            nodes: t.nodes,
                            job: None,
                        },
                        expires,
                    ),
                )
                .is_some()
            {
                return Err(format!("tokens[{i}]: its token appears twice"));
            }
        }
        Ok(map)
    }

    /// Who `token` belongs to at `now_ms`: `Err` with the reason when the server does not
    /// know it or it has expired; `Ok(None)` when the server runs open. The PostgreSQL
    /// listener takes the token as the connection's password.
    pub fn identify(&self, token: &str, now_ms: i64) -> Result<Option<Identity>, String> {
        let Some(map) = &self.map else {
            return Ok(None);
        };
        let map = map.read().unwrap_or_else(|p| p.into_inner());
        let Some((identity, expires)) = map.get(blake3::hash(token.as_bytes()).as_bytes()) else {
            return Err("the token is not known to this server".into());
        };
        match expires {
            Some(at) if *at <= now_ms => Err(format!(
                "this token of {} expired at {}; ask an operator for a new one (`perch token create --expires ...`)",
                identity.user,
                perch_alerts::rfc3339_seconds(*at)
            )),
            _ => Ok(Some(identity.clone())),
        }
    }

    /// Who sends `header`; `job_of` checks a job's metrics token (the control plane knows
    /// which attempts run).
    fn lookup(
        &self,
        header: Option<&str>,
        job_of: &dyn Fn(&str) -> Option<(u64, String)>,
        now_ms: i64,
    ) -> Result<Identity, ApiError> {
        if self.map.is_none() {
            // Open mode names callers by their connection ([`peer`]), never by what they send.
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                crate::ErrorCode::Unauthenticated,
                "this server runs open (no tokens file) and identifies callers by the local user that owns their connection",
            ));
        }
        let token = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    crate::ErrorCode::Unauthenticated,
                    "send Authorization: Bearer <token> (the CLI reads PERCH_TOKEN or --token)",
                )
            })?;
        if JobTokens::is_job_token(token) {
            return job_of(token)
                .map(|(job, user)| Identity {
                    user,
                    role: Role::User,
                    nodes: None,
                    job: Some(job),
                })
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::UNAUTHORIZED,
                        crate::ErrorCode::Unauthenticated,
                        "this job token is not valid: its job attempt is not running (or is not from this server)",
                    )
                });
        }
        match self.identify(token, now_ms) {
            Ok(Some(identity)) => Ok(identity),
            Ok(None) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                crate::ErrorCode::Unauthenticated,
                "the token is not known to this server",
            )),
            Err(why) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                crate::ErrorCode::Unauthenticated,
                why,
            )),
        }
    }

    /// Logs a warning for each token expired at `now_ms` or expiring within a week (when the
    /// file is read, so an operator sees it before its user does).
    pub fn warn_expiring(&self, now_ms: i64) {
        const WEEK_MS: i64 = 7 * 86_400_000;
        for (user, at) in self.expiring(now_ms, WEEK_MS) {
            if at <= now_ms {
                tracing::warn!(user = %user, expired = %perch_alerts::rfc3339_seconds(at), "a token in the tokens file has expired; it is refused (remove its entry, or give the user a new one)");
            } else {
                tracing::warn!(user = %user, expires = %perch_alerts::rfc3339_seconds(at), "a token in the tokens file expires within a week");
            }
        }
    }

    /// Tokens that expire within `within_ms` of `now_ms` (or have already): (user, expiry),
    /// for a warning when the file is loaded.
    pub fn expiring(&self, now_ms: i64, within_ms: i64) -> Vec<(String, i64)> {
        let Some(map) = &self.map else {
            return Vec::new();
        };
        let mut out: Vec<(String, i64)> = map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(|(i, e)| {
                e.filter(|&at| at <= now_ms + within_ms)
                    .map(|at| (i.user.clone(), at))
            })
            .collect();
        out.sort();
        out
    }
}

fn parse_hash(text: &str) -> Option<[u8; 32]> {
    let hex = text.strip_prefix(HASH_PREFIX)?;
    Some(*blake3::Hash::from_hex(hex).ok()?.as_bytes())
}

/// Paths anyone may call: the web view's files carry no data (the page signs in to call the
/// API).
/// `GET /v1/whoami`: who the token is, for the web view's sign-in and `perch` scripts.
pub async fn whoami(
    axum::extract::State(state): axum::extract::State<crate::AppState>,
    axum::Extension(who): axum::Extension<Identity>,
) -> axum::Json<serde_json::Value> {
    let role = who.role.as_str();
    axum::Json(serde_json::json!({
        "user": who.user,
        "role": role,
        "open": state.tokens.is_open(),
    }))
}

/// What keeps other web sites out, now that perch serves pages to browsers.
///
/// - A browser sends `Origin` with a state-changing request; one from another site (a form on
///   a page the user happens to visit, posting to `/v1/jobs/1/cancel`) is refused. Clients that
///   are not browsers send no `Origin` and are not affected.
/// - An open server (no tokens, loopback only) answers API calls only when they are addressed
///   to a loopback name: a site that rebinds its own DNS name to 127.0.0.1 makes the browser
///   treat the server as that site, Origin and all, and would otherwise reach an API with no
///   authentication (and submit jobs).
fn browser_checks(
    headers: &axum::http::HeaderMap,
    method: &axum::http::Method,
    open: bool,
) -> Result<(), String> {
    use axum::http::header::{HOST, ORIGIN};
    let host = headers.get(HOST).and_then(|v| v.to_str().ok());
    if open && let Some(host) = host {
        let name = match host.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or_default(),
            None => host.rsplit_once(':').map_or(host, |(name, _)| name),
        };
        let loopback = name.eq_ignore_ascii_case("localhost")
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if !loopback {
            return Err(format!(
                "this server is open (no tokens) and answers only requests addressed to a                  loopback name (localhost, 127.0.0.1, [::1]), not Host: {host}; give the                  server a tokens file (server.tokens_file) to reach it by another name"
            ));
        }
    }
    let changes = !matches!(
        *method,
        axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS
    );
    if changes && let Some(origin) = headers.get(ORIGIN) {
        let origin = origin.to_str().unwrap_or_default();
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        if authority.is_none() || authority != host {
            return Err(format!(
                "a request from the web page at {origin} may not change anything here: perch                  takes changes from its own pages and from clients that are not browsers"
            ));
        }
    }
    Ok(())
}

/// Which roles may call `path` (before per-job ownership checks in the handlers).
pub async fn middleware(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path().to_owned();
    if crate::routes::public(&path) {
        return next.run(request).await;
    }
    if let Err(refusal) =
        browser_checks(request.headers(), request.method(), state.tokens.is_open())
    {
        return ApiError::new(StatusCode::FORBIDDEN, crate::ErrorCode::Forbidden, refusal)
            .into_response();
    }
    let identity = if state.tokens.is_open() {
        let from = request
            .extensions()
            .get::<axum::extract::ConnectInfo<crate::listener::Peer>>()
            .map(|info| info.0.clone());
        match peer::of_request(from.as_ref()).await {
            Ok(who) => who,
            Err(why) => {
                return ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    crate::ErrorCode::Unauthenticated,
                    why,
                )
                .into_response();
            }
        }
    } else {
        let header = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        match state.tokens.lookup(
            header,
            &|token| state.jobs.job_of_token(token),
            state.now_ms(),
        ) {
            Ok(i) => i,
            Err(e) => return e.into_response(),
        }
    };
    // A job's token pushes that job's metrics and does nothing else.
    let route = crate::routes::find(request.method(), &path);
    if identity.job.is_some() && !route.is_some_and(|r| r.job_token) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            crate::ErrorCode::Forbidden,
            format!("a job's metrics token may only call POST /v1/metrics, not {path}"),
        )
        .into_response();
    }
    // A request no route matches reaches no handler: the router answers 404 or 405.
    if route.is_some_and(|r| !r.allows(identity.role)) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            crate::ErrorCode::Forbidden,
            format!(
                "{} ({:?}) may not call {} {path}",
                identity.user,
                identity.role,
                request.method()
            ),
        )
        .into_response();
    }
    request.extensions_mut().insert(identity);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Method;

    #[test]
    fn other_sites_cannot_change_anything_and_an_open_server_answers_loopback_names_only() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut h = axum::http::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(
                    axum::http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                    v.parse().expect("value"),
                );
            }
            h
        };
        let post = Method::POST;
        // Its own page, and clients that send no Origin (curl, the CLI, agents).
        let own = headers(&[
            ("host", "127.0.0.1:7300"),
            ("origin", "http://127.0.0.1:7300"),
        ]);
        assert!(browser_checks(&own, &post, true).is_ok());
        assert!(browser_checks(&headers(&[("host", "127.0.0.1:7300")]), &post, true).is_ok());
        assert!(browser_checks(&headers(&[]), &post, false).is_ok());
        // A form on another site posting to a cancel.
        let evil = headers(&[
            ("host", "127.0.0.1:7300"),
            ("origin", "http://evil.example"),
        ]);
        let refused = browser_checks(&evil, &post, false).expect_err("cross-site");
        assert!(refused.contains("evil.example"), "{refused}");
        assert!(
            browser_checks(&evil, &Method::GET, false).is_ok(),
            "reads are harmless"
        );
        assert!(
            browser_checks(
                &headers(&[("host", "h:1"), ("origin", "null")]),
                &post,
                false
            )
            .is_err(),
            "a sandboxed page"
        );
        // Same host, another port: another site.
        let port = headers(&[
            ("host", "127.0.0.1:7300"),
            ("origin", "http://127.0.0.1:8080"),
        ]);
        assert!(browser_checks(&port, &post, false).is_err());
        // DNS rebinding against an open server.
        for host in ["evil.example:7300", "10.0.0.5:7300", "perch.internal"] {
            let h = headers(&[("host", host)]);
            let refused = browser_checks(&h, &Method::GET, true).expect_err(host);
            assert!(refused.contains("tokens file"), "{refused}");
            assert!(
                browser_checks(&h, &Method::GET, false).is_ok(),
                "with tokens: {host}"
            );
        }
        for host in [
            "localhost:7300",
            "LOCALHOST",
            "127.0.0.1",
            "127.8.9.1:1",
            "[::1]:7300",
        ] {
            assert!(
                browser_checks(&headers(&[("host", host)]), &Method::GET, true).is_ok(),
                "{host}"
            );
        }
    }

    #[test]
    fn tokens_file_is_checked() {
        let ok = Tokens::parse(
            "[[tokens]]\ntoken = \"0123456789abcdef0\"\nuser = \"alice\"\nrole = \"user\"\n",
        )
        .expect("valid");
        assert_eq!(
            ok.lookup(Some("Bearer 0123456789abcdef0"), &|_| None, 0)
                .expect("known")
                .user,
            "alice"
        );
        assert!(ok.lookup(Some("Bearer nope"), &|_| None, 0).is_err());
        // The same token given by its hash: the file holds no secret.
        let hashed = Tokens::parse(&format!(
            "[[tokens]]\ntoken_hash = \"{}\"\nuser = \"alice\"\nrole = \"user\"\n",
            token_hash("0123456789abcdef0")
        ))
        .expect("valid");
        assert_eq!(
            hashed
                .identify("0123456789abcdef0", 0)
                .map(|i| i.map(|i| i.user)),
            Ok(Some("alice".to_owned()))
        );
        assert!(hashed.identify("0123456789abcdef1", 0).is_err());
        assert!(
            hashed
                .identify(&token_hash("0123456789abcdef0"), 0)
                .is_err(),
            "the hash is not a token"
        );
        assert!(ok.lookup(None, &|_| None, 0).is_err());
        for (text, want) in [
            (
                "[[tokens]]\ntoken = \"short\"\nuser = \"a\"\nrole = \"user\"\n",
                "shorter than 16",
            ),
            (
                "[[tokens]]\ntoken = \"0123456789abcdef0\"\nuser = \"a b\"\nrole = \"user\"\n",
                "user",
            ),
            (
                "[[tokens]]\ntoken = \"0123456789abcdef0\"\nuser = \"a\"\nrole = \"root\"\n",
                "unknown variant",
            ),
            (
                "[[tokens]]\ntoken_hash = \"sha256:00\"\nuser = \"a\"\nrole = \"user\"\n",
                "tokens[0].token_hash must be \"blake3:\"",
            ),
            (
                "[[tokens]]\nuser = \"a\"\nrole = \"user\"\n",
                "needs exactly one of token_hash",
            ),
            (
                "[[tokens]]\ntoken = \"0123456789abcdef0\"\nuser = \"a\"\nrole = \"user\"\n\
                 [[tokens]]\ntoken = \"0123456789abcdef0\"\nuser = \"b\"\nrole = \"user\"\n",
                "tokens[1]: its token appears twice",
            ),
        ] {
            let err = Tokens::parse(text).expect_err(text);
            assert!(err.contains(want), "{err}");
        }
        assert!(
            Tokens::open().lookup(None, &|_| None, 0).is_err(),
            "open mode identifies callers by their connection, not by what they send"
        );
    }

    #[test]
    fn an_expired_token_is_refused_with_when_and_what_to_do() {
        let entry = |expires: &str| {
            format!(
                "[[tokens]]\ntoken = \"0123456789abcdef0\"\nuser = \"alice\"\nrole = \"user\"\nexpires = {expires}\n"
            )
        };
        // 2027-03-01T00:00:00Z
        let at = 1_803_859_200_000;
        for form in [
            "2027-03-01T00:00:00Z",
            "\"2027-03-01T00:00:00Z\"",
            "2027-03-01",
            "2027-03-01T01:00:00+01:00",
        ] {
            let tokens = Tokens::parse(&entry(form)).expect(form);
            let bearer = Some("Bearer 0123456789abcdef0");
            assert!(tokens.lookup(bearer, &|_| None, at - 1).is_ok(), "{form}");
            let err = tokens.lookup(bearer, &|_| None, at).expect_err("expired");
            let err = format!("{err:?}");
            assert!(
                err.contains("expired at 2027-03-01T00:00:00Z")
                    && err.contains("perch token create"),
                "{form}: {err}"
            );
            assert!(
                tokens.identify("0123456789abcdef0", at).is_err(),
                "psql too"
            );
            assert_eq!(
                tokens.expiring(at - 1000, 1000),
                vec![("alice".to_owned(), at)]
            );
            assert!(tokens.expiring(at - 2000, 1000).is_empty());
        }
        for (bad, want) in [
            ("2027-03-01T00:00:00", "no UTC offset"),
            ("\"next tuesday\"", "is not a date-time"),
            ("00:00:00", "has no date"),
        ] {
            let err = Tokens::parse(&entry(bad)).expect_err(bad);
            assert!(
                err.contains("tokens[0].expires") && err.contains(want),
                "{bad}: {err}"
            );
        }
    }
}

#[cfg(test)]
mod openapi_tests {
    /// `openapi.json` lists exactly the error codes [`crate::ErrorCode`] has, in its order.
    #[test]
    fn openapi_lists_every_error_code() {
        let doc: serde_json::Value =
            serde_json::from_str(crate::OPENAPI).expect("openapi.json is JSON");
        let listed: Vec<&str> = doc["components"]["schemas"]["Error"]["properties"]["error"]
            ["properties"]["code"]["enum"]
            .as_array()
            .expect("an enum of codes")
            .iter()
            .filter_map(|c| c.as_str())
            .collect();
        let codes: Vec<&str> = crate::ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(listed, codes);
    }
}
