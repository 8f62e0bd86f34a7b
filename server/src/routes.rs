//! The one route table: every HTTP route's method, path, what it is for, who may call it and
//! its handler. The router ([`crate::router`]), the index at `GET /`, authorisation
//! ([`crate::auth`]) and the tests against `openapi.json` are all derived from [`ROUTES`]; a
//! request no route of it matches reaches no handler (404 or 405), whatever its caller's role.
//! To add a route: one entry here (its roles are a required field) and its operation in
//! `openapi.json`.

use crate::AppState;
use crate::{alerting, jobs};
use axum::extract::DefaultBodyLimit;
use axum::routing::{MethodRouter, delete, get, post};
use perch_model::identity::Role;

/// An HTTP method of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    GET,
    POST,
    DELETE,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::GET => "GET",
            Method::POST => "POST",
            Method::DELETE => "DELETE",
        }
    }

    fn is(self, m: &axum::http::Method) -> bool {
        m.as_str() == self.as_str()
    }
}

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone, with no token (liveness, readiness, Prometheus, the web view's files).
    Public,
    /// Callers whose token has one of these roles.
    Roles(&'static [Role]),
}

/// Users and operators: what people do.
const PEOPLE: Access = Access::Roles(&[Role::User, Role::Operator]);
/// Operators only.
const OPERATORS: Access = Access::Roles(&[Role::Operator]);
/// Node agents (and operators, who may do anything).
const AGENTS: Access = Access::Roles(&[Role::Agent, Role::Operator]);
const PUBLIC: Access = Access::Public;

/// One route.
pub struct Route {
    pub method: Method,
    /// The path as the router and `openapi.json` write it (`{name}` is one segment).
    pub path: &'static str,
    /// What it is for (the index at `GET /`).
    pub what: &'static str,
    pub access: Access,
    /// A job's metrics token may call it (and nothing else).
    pub job_token: bool,
    /// The handler, given `server.max_body_mb` in bytes.
    handler: fn(usize) -> MethodRouter<AppState>,
}

impl Route {
    /// Whether a caller in `role` may call it.
    pub fn allows(&self, role: Role) -> bool {
        match self.access {
            Access::Public => true,
            Access::Roles(roles) => roles.contains(&role),
        }
    }

    /// Whether `path` is one of this route's paths.
    pub fn matches(&self, path: &str) -> bool {
        let mut want = self.path.split('/');
        let mut got = path.split('/');
        loop {
            match (want.next(), got.next()) {
                (None, None) => return true,
                (Some(w), Some(g)) if w.starts_with('{') && w.ends_with('}') => {
                    if g.is_empty() {
                        return false;
                    }
                }
                (Some(w), Some(g)) if w == g => {}
                _ => return false,
            }
        }
    }

    /// The handler, as the router mounts it.
    pub(crate) fn handler(&self, max_body_bytes: usize) -> MethodRouter<AppState> {
        (self.handler)(max_body_bytes)
    }
}

/// The route `method` and `path` call, if any.
pub fn find(method: &axum::http::Method, path: &str) -> Option<&'static Route> {
    ROUTES
        .iter()
        .find(|r| r.method.is(method) && r.matches(path))
}

/// Whether `path` is a public route's (with any method: a wrong method is the router's 405,
/// not a 401).
pub fn public(path: &str) -> bool {
    ROUTES
        .iter()
        .any(|r| r.access == Access::Public && r.matches(path))
}

/// Whether `path` is a route agents call (what a connection on probation is served,
/// [`crate::listener`]).
pub fn for_agents(path: &str) -> bool {
    ROUTES.iter().any(|r| r.access == AGENTS && r.matches(path))
}

/// The paths of the routes agents call, in the table's order.
pub fn agent_paths() -> Vec<&'static str> {
    ROUTES
        .iter()
        .filter(|r| r.access == AGENTS)
        .map(|r| r.path)
        .collect()
}

/// Every HTTP route.
pub static ROUTES: &[Route] = &[
    Route {
        method: Method::GET,
        path: "/",
        what: "this index (JSON); a browser asking for HTML gets the web view",
        access: PUBLIC,
        job_token: false,
        handler: |_| get(crate::index),
    },
    Route {
        method: Method::GET,
        path: "/ui/{file}",
        what: "the web view's files",
        access: PUBLIC,
        job_token: false,
        handler: |_| get(crate::web::asset),
    },
    Route {
        method: Method::GET,
        path: "/v1/whoami",
        what: "the caller's user and role, and whether the server is open (no tokens)",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(crate::auth::whoami),
    },
    Route {
        method: Method::GET,
        path: "/healthz",
        what: "liveness",
        access: PUBLIC,
        job_token: false,
        handler: |_| get(|| async { "ok\n" }),
    },
    Route {
        method: Method::GET,
        path: "/readyz",
        what: "readiness (the store is open and its log replayed)",
        access: PUBLIC,
        job_token: false,
        handler: |_| get(crate::readyz),
    },
    Route {
        method: Method::GET,
        path: "/v1/ha",
        what: "who leads: this server's part, the leader, its epoch and since when",
        access: PUBLIC,
        job_token: false,
        handler: |_| get(crate::ha::status),
    },
    Route {
        method: Method::GET,
        path: "/v1/openapi.json",
        what: "the OpenAPI 3 description of this API",
        access: PUBLIC,
        job_token: false,
        handler: |_| get(crate::openapi),
    },
    Route {
        method: Method::POST,
        path: "/v1/ingest",
        what: "agent telemetry batches (JSON, optionally zstd or gzip encoded)",
        access: AGENTS,
        job_token: false,
        handler: |_| post(crate::ingest::ingest),
    },
    Route {
        method: Method::POST,
        path: "/v1/cluster/latest",
        what: "an ingest server's push of its nodes' latest state (control server only)",
        access: AGENTS,
        job_token: false,
        handler: |_| post(crate::cluster::latest),
    },
    Route {
        method: Method::POST,
        path: "/v1/sql",
        what: "read-only SQL: body {\"sql\": \"...\", \"format\": \"json|csv|arrow\"} or text/plain",
        access: PEOPLE,
        job_token: false,
        handler: |_| post(crate::sql::sql),
    },
    Route {
        method: Method::GET,
        path: "/metrics",
        what: "Prometheus exposition",
        access: PUBLIC,
        job_token: false,
        handler: |_| get(crate::metrics::metrics),
    },
    Route {
        method: Method::POST,
        path: "/v1/metrics",
        what: "OpenTelemetry metrics (OTLP/HTTP, protobuf or JSON) into the job_metrics table",
        access: PEOPLE,
        job_token: true,
        handler: |_| post(crate::otlp::metrics),
    },
    Route {
        method: Method::POST,
        path: "/v1/jobs",
        what: "submit a job (JSON job request)",
        access: PEOPLE,
        job_token: false,
        handler: |_| post(jobs::submit),
    },
    Route {
        method: Method::GET,
        path: "/v1/jobs",
        what: "list jobs (?state=&user=&account=&limit=)",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(jobs::list),
    },
    Route {
        method: Method::GET,
        path: "/v1/jobs/{id}",
        what: "one job: state, reason, placement, timeline, live GPU use",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(jobs::show),
    },
    Route {
        method: Method::POST,
        path: "/v1/jobs/{id}/cancel",
        what: "cancel a job",
        access: PEOPLE,
        job_token: false,
        handler: |_| post(jobs::cancel),
    },
    Route {
        method: Method::POST,
        path: "/v1/jobs/cancel",
        what: "cancel many jobs: body {\"ids\": [...]} or filters {\"array\", \"user\", \"account\", \"name\", \"state\"}",
        access: PEOPLE,
        job_token: false,
        handler: |_| post(jobs::cancel_many),
    },
    Route {
        method: Method::GET,
        path: "/v1/jobs/{id}/logs",
        what: "a job's output (?stream=stdout|stderr&offset=N&rank=R&attempt=A: rank R (default 0) of attempt A (default the latest); the x-perch-attempt header says which)",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(jobs::logs),
    },
    Route {
        method: Method::GET,
        path: "/v1/jobs/{id}/provenance",
        what: "what a job ran: submit directory's git commit, branch and diff, container image, Python packages, and each attempt's environment and node driver/CUDA versions (its user and operators only)",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(jobs::provenance),
    },
    Route {
        method: Method::GET,
        path: "/v1/queue",
        what: "pending jobs in scheduling order, with the reason each waits; ?start=true adds each one's estimated start (estimated_start, RFC 3339)",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(jobs::queue),
    },
    Route {
        method: Method::GET,
        path: "/v1/nodes",
        what: "nodes, their GPUs and jobs",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(jobs::nodes),
    },
    Route {
        method: Method::POST,
        path: "/v1/nodes/{name}/drain",
        what: "stop placing jobs on a node",
        access: OPERATORS,
        job_token: false,
        handler: |_| post(jobs::drain),
    },
    Route {
        method: Method::POST,
        path: "/v1/nodes/{name}/resume",
        what: "place jobs on a drained node again",
        access: OPERATORS,
        job_token: false,
        handler: |_| post(jobs::resume),
    },
    Route {
        method: Method::POST,
        path: "/v1/nodes/{name}/validate",
        what: "drain a node and run its validation command; resumed when it passes, kept drained with the reason when not (operators)",
        access: OPERATORS,
        job_token: false,
        handler: |_| post(crate::validation::validate),
    },
    Route {
        method: Method::POST,
        path: "/v1/agent/sync",
        what: "agents report their jobs and receive launch and stop orders",
        access: AGENTS,
        job_token: false,
        handler: |limit| {
            post(jobs::sync).layer(DefaultBodyLimit::max(limit.max(crate::SYNC_BODY_MIN)))
        },
    },
    Route {
        method: Method::GET,
        path: "/v1/alerts",
        what: "alerts (pending, firing, recently resolved), rule health, remediation and its circuit breaker",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(alerting::routes::alerts),
    },
    Route {
        method: Method::POST,
        path: "/v1/alerts/breaker/reset",
        what: "close the remediation circuit breaker (operators)",
        access: OPERATORS,
        job_token: false,
        handler: |_| post(alerting::routes::reset_breaker),
    },
    Route {
        method: Method::GET,
        path: "/v1/silences",
        what: "silences and their state",
        access: PEOPLE,
        job_token: false,
        handler: |_| get(alerting::routes::silences),
    },
    Route {
        method: Method::POST,
        path: "/v1/silences",
        what: "mute alerts matching label matchers until a time (operators)",
        access: OPERATORS,
        job_token: false,
        handler: |_| post(alerting::routes::add_silence),
    },
    Route {
        method: Method::DELETE,
        path: "/v1/silences/{id}",
        what: "expire a silence now (operators)",
        access: OPERATORS,
        job_token: false,
        handler: |_| delete(alerting::routes::expire_silence),
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Who may call what, as reviewed: a route added to the table, or one whose roles change,
    /// fails here until this list says so too. `-` is public; `P` users and operators; `O`
    /// operators only; `A` agents and operators.
    const REVIEWED: &[&str] = &[
        "GET / -",
        "GET /ui/{file} -",
        "GET /v1/whoami P",
        "GET /healthz -",
        "GET /readyz -",
        "GET /v1/ha -",
        "GET /v1/openapi.json -",
        "POST /v1/ingest A",
        "POST /v1/cluster/latest A",
        "POST /v1/sql P",
        "GET /metrics -",
        "POST /v1/metrics P+job",
        "POST /v1/jobs P",
        "GET /v1/jobs P",
        "GET /v1/jobs/{id} P",
        "POST /v1/jobs/{id}/cancel P",
        "POST /v1/jobs/cancel P",
        "GET /v1/jobs/{id}/logs P",
        "GET /v1/jobs/{id}/provenance P",
        "GET /v1/queue P",
        "GET /v1/nodes P",
        "POST /v1/nodes/{name}/drain O",
        "POST /v1/nodes/{name}/resume O",
        "POST /v1/nodes/{name}/validate O",
        "POST /v1/agent/sync A",
        "GET /v1/alerts P",
        "POST /v1/alerts/breaker/reset O",
        "GET /v1/silences P",
        "POST /v1/silences O",
        "DELETE /v1/silences/{id} O",
    ];

    fn summary(r: &Route) -> String {
        let who = match r.access {
            PUBLIC => "-",
            PEOPLE => "P",
            OPERATORS => "O",
            AGENTS => "A",
            Access::Roles(roles) => panic!(
                "{} {}: roles {roles:?} are none of the table's sets",
                r.method.as_str(),
                r.path
            ),
        };
        let job = if r.job_token { "+job" } else { "" };
        format!("{} {} {who}{job}", r.method.as_str(), r.path)
    }

    #[test]
    fn every_route_says_who_may_call_it_as_reviewed() {
        let table: Vec<String> = ROUTES.iter().map(summary).collect();
        assert_eq!(
            table, REVIEWED,
            "the route table against the reviewed roles"
        );
        for r in ROUTES {
            if let Access::Roles(roles) = r.access {
                assert!(
                    !roles.is_empty(),
                    "{} {} has no role",
                    r.method.as_str(),
                    r.path
                );
                assert!(
                    roles.contains(&Role::Operator),
                    "{} {}: operators may call every route",
                    r.method.as_str(),
                    r.path
                );
            }
        }
        let unique: BTreeSet<(&str, &str)> =
            ROUTES.iter().map(|r| (r.method.as_str(), r.path)).collect();
        assert_eq!(unique.len(), ROUTES.len(), "a route twice in the table");
    }

    #[test]
    fn paths_match_their_patterns_one_segment_a_name() {
        let route = |m: axum::http::Method, p: &str| find(&m, p).map(|r| r.path);
        use axum::http::Method as M;
        assert_eq!(route(M::GET, "/v1/jobs/42"), Some("/v1/jobs/{id}"));
        assert_eq!(route(M::POST, "/v1/jobs/cancel"), Some("/v1/jobs/cancel"));
        assert_eq!(
            route(M::POST, "/v1/jobs/42/cancel"),
            Some("/v1/jobs/{id}/cancel")
        );
        assert_eq!(route(M::GET, "/v1/jobs/42/logs/x"), None);
        assert_eq!(route(M::GET, "/v1/jobs/"), None);
        assert_eq!(route(M::GET, "/v1/ingest"), None);
        assert_eq!(route(M::PUT, "/v1/jobs"), None);
        assert_eq!(route(M::POST, "/v1/agent/other"), None);
        assert!(public("/ui/app.js") && public("/metrics") && !public("/v1/metrics"));
        assert!(for_agents("/v1/agent/sync") && !for_agents("/v1/agent/other"));
        assert_eq!(
            agent_paths(),
            vec!["/v1/ingest", "/v1/cluster/latest", "/v1/agent/sync"]
        );
    }

    /// `openapi.json` describes exactly the table's operations, and says of each what the
    /// table does: public routes need no token (`"security": []`), the rest the bearer token.
    #[test]
    fn openapi_describes_the_table() {
        let doc: serde_json::Value =
            serde_json::from_str(crate::OPENAPI).expect("openapi.json is JSON");
        let mut documented = BTreeSet::new();
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for (method, op) in ops.as_object().expect("operations") {
                if !["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                    continue;
                }
                let public = op["security"].as_array().is_some_and(|s| s.is_empty());
                documented.insert((method.to_uppercase(), path.clone(), public));
            }
        }
        let table: BTreeSet<(String, String, bool)> = ROUTES
            .iter()
            .map(|r| {
                (
                    r.method.as_str().to_owned(),
                    r.path.to_owned(),
                    r.access == Access::Public,
                )
            })
            .collect();
        assert_eq!(documented, table, "openapi.json against the route table");
    }

    /// Through the real router and its authorisation, for every route and every role: a
    /// caller the table allows reaches the handler, any other is refused (403), and a path
    /// or method outside the table reaches none, for every role, operators too.
    #[tokio::test]
    async fn every_role_reaches_exactly_the_routes_the_table_gives_it() {
        use tower::ServiceExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = crate::ServerConfig::new(perch_query::StoreConfig::new(dir.path()));
        config.tokens = crate::auth::Tokens::parse(
            "[[tokens]]\ntoken = \"user-token-0123456\"\nuser = \"alice\"\nrole = \"user\"\n\
             [[tokens]]\ntoken = \"oper-token-0123456\"\nuser = \"ops\"\nrole = \"operator\"\n\
             [[tokens]]\ntoken = \"agent-token-012345\"\nuser = \"n1\"\nrole = \"agent\"\nnodes = [\"n1\"]\n",
        )
        .expect("tokens");
        let state = crate::AppState::open(config).expect("state");
        let router = crate::router(state);
        let call = |method: &str, path: &str, token: &str| {
            let request = axum::http::Request::builder()
                .method(method)
                .uri(path)
                .header("authorization", format!("Bearer {token}"))
                .header("content-type", "application/json")
                .body(axum::body::Body::from("{}"))
                .expect("request");
            let router = router.clone();
            async move {
                let answer = router.oneshot(request).await.expect("answer");
                let status = answer.status().as_u16();
                let body = axum::body::to_bytes(answer.into_body(), 1 << 20)
                    .await
                    .expect("body");
                (status, String::from_utf8_lossy(&body).into_owned())
            }
        };
        let roles = [
            (Role::User, "user-token-0123456"),
            (Role::Operator, "oper-token-0123456"),
            (Role::Agent, "agent-token-012345"),
        ];
        for r in ROUTES {
            // A concrete path: names filled in.
            let path = r
                .path
                .replace("{id}", "1")
                .replace("{name}", "n1")
                .replace("{file}", "app.js");
            for (role, token) in roles {
                let (status, body) = call(r.method.as_str(), &path, token).await;
                // Refused by authorisation, or by the router (no such route or method).
                let refused = (status == 403 && body.contains("may not call"))
                    || (status == 404 && body.contains("no endpoint at"))
                    || status == 405;
                assert_eq!(
                    refused,
                    !r.allows(role),
                    "{role:?} {} {path}: {status} {body}",
                    r.method.as_str()
                );
                if refused {
                    assert_eq!(status, 403, "{role:?} {} {path}: {body}", r.method.as_str());
                }
            }
        }
        for (method, path) in [
            ("GET", "/v1/admin"),
            ("PUT", "/v1/jobs"),
            ("GET", "/v1/agent/orders"),
            ("DELETE", "/v1/jobs/1"),
        ] {
            for (role, token) in roles {
                let (status, body) = call(method, path, token).await;
                assert!(
                    (status == 404 && body.contains("no endpoint at")) || status == 405,
                    "{role:?} {method} {path} outside the table: {status} {body}"
                );
            }
        }
    }
}
