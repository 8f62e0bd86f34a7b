//! Identity and access: every request under `/v1` carries `Authorization: Bearer <token>`, and
//! the token maps to a user and a role from the tokens file (`server.tokens_file`).
//!
//! - `user`: submits jobs as itself, lists and shows jobs, runs SQL, and cancels or reads the
//!   logs of its own jobs only.
//! - `operator`: everything, including draining and resuming nodes and acting on any job.
//! - `agent`: only what node agents do (`/v1/ingest`, `/v1/agent/sync`).
//!
//! Liveness, readiness, `/metrics` (for Prometheus) and the OTLP receiver (jobs push with no
//! token) need none. With no tokens file the server runs open, as operator for everyone, and
//! refuses to listen on anything but a loopback address in that mode.

use crate::jobs::job_token::JobTokens;
use crate::{ApiError, AppState};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Operator,
    Agent,
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub role: Role,
    /// For an agent token: the nodes it may report for and sync as (`nodes` in the tokens
    /// file); `None` lets it speak for any node.
    pub nodes: Option<Vec<String>>,
    /// For a job's metrics token: the job. It may only push that job's metrics.
    pub job: Option<u64>,
}

impl Identity {
    /// May send telemetry for, and sync as, node `node`: an agent bound to other nodes may
    /// not (one stolen node's token cannot forge another node's data or take its jobs).
    pub fn may_speak_for(&self, node: &str) -> Result<(), ApiError> {
        match &self.nodes {
            Some(nodes) if !nodes.iter().any(|n| n == node) => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "this token ({}) is bound to node(s) {}; it may not report as {node}: give this node its own token, or add it to the token's `nodes` in the tokens file",
                    self.user,
                    nodes.join(", ")
                ),
            )),
            _ => Ok(()),
        }
    }

    /// May act on a job that belongs to `owner`.
    pub fn may_act_on(&self, owner: &str) -> bool {
        self.role == Role::Operator || self.user == owner
    }
}

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

type ByHash = HashMap<[u8; 32], Identity>;

/// How the tokens file writes a token's hash.
pub const HASH_PREFIX: &str = "blake3:";

/// The hash of `token` as the tokens file's `token_hash` holds it.
pub fn token_hash(token: &str) -> String {
    format!("{HASH_PREFIX}{}", blake3::hash(token.as_bytes()).to_hex())
}

impl Tokens {
    /// No authentication: everyone is an operator. Only for loopback listeners.
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
            if t.role == Role::Agent && t.nodes.is_none() {
                tracing::warn!(
                    user = %t.user,
                    "agent token tokens[{i}] is bound to no node: it may report as any node; give each node its own token with nodes = [\"<node>\"]"
                );
            }
            if map
                .insert(
                    hash,
                    Identity {
                        user: t.user,
                        role: t.role,
                        nodes: t.nodes,
                        job: None,
                    },
                )
                .is_some()
            {
                return Err(format!("tokens[{i}]: its token appears twice"));
            }
        }
        Ok(map)
    }

    /// Who `token` belongs to: `None` when the server does not know it, or runs open. The
    /// PostgreSQL listener takes the token as the connection's password.
    pub fn identify(&self, token: &str) -> Option<Identity> {
        self.map
            .as_ref()?
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(blake3::hash(token.as_bytes()).as_bytes())
            .cloned()
    }

    /// Who sends `header`; `job_of` checks a job's metrics token (the control plane knows
    /// which attempts run).
    fn lookup(
        &self,
        header: Option<&str>,
        job_of: &dyn Fn(&str) -> Option<(u64, String)>,
    ) -> Result<Identity, ApiError> {
        let Some(map) = &self.map else {
            return Ok(Identity {
                user: "local".into(),
                role: Role::Operator,
                nodes: None,
                job: None,
            });
        };
        let token = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthenticated",
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
                        "unauthenticated",
                        "this job token is not valid: its job attempt is not running (or is not from this server)",
                    )
                });
        }
        map.read()
            .unwrap_or_else(|p| p.into_inner())
            .get(blake3::hash(token.as_bytes()).as_bytes())
            .cloned()
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthenticated",
                    "the token is not known to this server",
                )
            })
    }
}

fn parse_hash(text: &str) -> Option<[u8; 32]> {
    let hex = text.strip_prefix(HASH_PREFIX)?;
    Some(*blake3::Hash::from_hex(hex).ok()?.as_bytes())
}

/// Paths anyone may call.
fn public(path: &str) -> bool {
    matches!(
        path,
        "/" | "/healthz" | "/readyz" | "/metrics" | "/v1/openapi.json"
    )
}

/// Which roles may call `path` (before per-job ownership checks in the handlers).
fn allowed(role: Role, method: &axum::http::Method, path: &str) -> bool {
    let agent_path = path == "/v1/ingest" || path.starts_with("/v1/agent/");
    let operator_path = (method == axum::http::Method::POST
        && path.starts_with("/v1/nodes/")
        && (path.ends_with("/drain") || path.ends_with("/resume")))
        || (method != axum::http::Method::GET && path.starts_with("/v1/silences"))
        || path == "/v1/alerts/breaker/reset";
    match role {
        Role::Operator => true,
        Role::Agent => agent_path,
        Role::User => !agent_path && !operator_path,
    }
}

pub async fn middleware(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path().to_owned();
    if public(&path) {
        return next.run(request).await;
    }
    let header = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let identity = match state
        .tokens
        .lookup(header, &|token| state.jobs.job_of_token(token))
    {
        Ok(i) => i,
        Err(e) => return e.into_response(),
    };
    // A job's token pushes that job's metrics and does nothing else.
    if identity.job.is_some() && path != "/v1/metrics" {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("a job's metrics token may only call POST /v1/metrics, not {path}"),
        )
        .into_response();
    }
    if !allowed(identity.role, request.method(), &path) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
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
    fn roles_reach_what_they_should() {
        let cases = [
            (Role::User, Method::POST, "/v1/jobs", true),
            (Role::User, Method::POST, "/v1/sql", true),
            (Role::User, Method::POST, "/v1/nodes/n1/drain", false),
            (Role::User, Method::POST, "/v1/ingest", false),
            (Role::User, Method::POST, "/v1/agent/sync", false),
            (Role::Agent, Method::POST, "/v1/ingest", true),
            (Role::Agent, Method::POST, "/v1/agent/sync", true),
            (Role::Agent, Method::POST, "/v1/jobs", false),
            (Role::Agent, Method::POST, "/v1/sql", false),
            (Role::Operator, Method::POST, "/v1/nodes/n1/drain", true),
            (Role::Operator, Method::POST, "/v1/ingest", true),
        ];
        for (role, method, path, want) in cases {
            assert_eq!(
                allowed(role, &method, path),
                want,
                "{role:?} {method} {path}"
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
            ok.lookup(Some("Bearer 0123456789abcdef0"), &|_| None)
                .expect("known")
                .user,
            "alice"
        );
        assert!(ok.lookup(Some("Bearer nope"), &|_| None).is_err());
        // The same token given by its hash: the file holds no secret.
        let hashed = Tokens::parse(&format!(
            "[[tokens]]\ntoken_hash = \"{}\"\nuser = \"alice\"\nrole = \"user\"\n",
            token_hash("0123456789abcdef0")
        ))
        .expect("valid");
        assert_eq!(
            hashed.identify("0123456789abcdef0").map(|i| i.user),
            Some("alice".to_owned())
        );
        assert!(hashed.identify("0123456789abcdef1").is_none());
        assert!(
            hashed.identify(&token_hash("0123456789abcdef0")).is_none(),
            "the hash is not a token"
        );
        assert!(ok.lookup(None, &|_| None).is_err());
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
        assert!(Tokens::open().lookup(None, &|_| None).is_ok());
    }
}

#[cfg(test)]
mod openapi_tests {
    /// Every route the router serves is described in the OpenAPI document, and nothing else.
    #[test]
    fn openapi_describes_every_route() {
        let doc: serde_json::Value =
            serde_json::from_str(crate::OPENAPI).expect("openapi.json is JSON");
        let documented: std::collections::BTreeSet<String> = doc["paths"]
            .as_object()
            .expect("paths")
            .keys()
            .cloned()
            .collect();
        let source = include_str!("lib.rs");
        let mut routed = std::collections::BTreeSet::new();
        for piece in source.split(".route(").skip(1) {
            let path = piece.trim_start().trim_start_matches('"');
            routed.insert(path.split('"').next().unwrap_or_default().to_owned());
        }
        assert!(routed.len() > 10, "found the routes: {routed:?}");
        assert_eq!(documented, routed);
    }
}
