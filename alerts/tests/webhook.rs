//! Webhooks against a small HTTP server in the test (axum on 127.0.0.1:0) that records what
//! it receives and answers with the status the test asks for: Alertmanager's JSON with a
//! bearer token, Slack's text, retries on 503, none on 400, nothing posted when an
//! integration does not want resolved notices.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use perch_alerts::notify::{Notifier, RetryPolicy};
use perch_alerts::{AlertsConfig, Engine, Instance, Notification};
use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The authorization header and body of one request.
type Request = (Option<String>, Value);

#[derive(Clone, Default)]
struct Hook {
    /// Every request received.
    received: Arc<Mutex<Vec<Request>>>,
    /// Statuses to answer with, in order; 200 once they run out.
    statuses: Arc<Mutex<Vec<u16>>>,
}

impl Hook {
    fn received(&self) -> Vec<Request> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

async fn receive(
    State(hook): State<Hook>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> StatusCode {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if let Ok(mut r) = hook.received.lock() {
        r.push((auth, body));
    }
    let next = hook
        .statuses
        .lock()
        .ok()
        .and_then(|mut s| (!s.is_empty()).then(|| s.remove(0)));
    StatusCode::from_u16(next.unwrap_or(200)).unwrap_or(StatusCode::OK)
}

/// Starts the hook server; returns its base URL.
async fn serve(hook: Hook) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = Router::new().route("/hook", post(receive)).with_state(hook);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}/hook")
}

fn config(url: &str, extra: &str) -> AlertsConfig {
    AlertsConfig::from_toml(&format!(
        r#"
        [[receivers]]
        name = "team"
        [[receivers.webhook]]
        url = "{url}"
        {extra}

        [route]
        receiver = "team"
        group_wait = "0s"
        "#
    ))
    .expect("valid config")
}

fn notifier(cfg: &AlertsConfig) -> Notifier {
    Notifier::new(cfg)
        .expect("notifier")
        .with_retry(RetryPolicy {
            attempts: 3,
            first_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(50),
        })
}

/// Two GPUs of node-7 with XID 79 (one group), then optionally resolved.
fn notifications(cfg: &AlertsConfig, resolve: bool) -> Vec<Notification> {
    let mut engine = Engine::new(cfg.clone()).expect("engine");
    let xids: Vec<Instance> = (0..2)
        .map(|g| {
            Instance::with_labels([
                ("node", "node-7"),
                ("gpu", if g == 0 { "0" } else { "1" }),
                ("xid", "79"),
            ])
            .value("events", 1.0)
        })
        .collect();
    engine.evaluate("XidReboot", &xids, 0).expect("evaluate");
    let mut out = engine.notifications(0);
    if resolve {
        engine.evaluate("XidReboot", &[], 60_000).expect("evaluate");
        out.extend(engine.notifications(400_000));
    }
    out
}

#[tokio::test]
async fn json_payload_is_alertmanagers_with_the_bearer_token() {
    let hook = Hook::default();
    let url = serve(hook.clone()).await;
    let cfg = config(&url, r#"bearer_token = "t0ken""#);
    let sent = notifications(&cfg, false);
    assert_eq!(sent.len(), 1);
    let deliveries = notifier(&cfg).send(&sent[0]).await;
    assert_eq!(deliveries[0].error, None, "{deliveries:?}");
    assert_eq!(deliveries[0].attempts, 1);
    assert!(
        deliveries[0]
            .integration
            .starts_with("webhook http://127.0.0.1:"),
        "{deliveries:?}"
    );
    assert!(
        !deliveries[0].integration.contains("/hook"),
        "no path: it may be secret"
    );
    let got = hook.received();
    assert_eq!(got.len(), 1);
    let (auth, body) = &got[0];
    assert_eq!(auth.as_deref(), Some("Bearer t0ken"));
    assert_eq!(body["version"], "4");
    assert_eq!(body["status"], "firing");
    assert_eq!(body["receiver"], "team");
    assert_eq!(body["groupLabels"]["alertname"], "XidReboot");
    assert_eq!(body["groupLabels"]["node"], "node-7");
    assert_eq!(body["commonLabels"]["severity"], "critical");
    let alerts = body["alerts"].as_array().expect("alerts");
    assert_eq!(alerts.len(), 2);
    assert_eq!(alerts[0]["labels"]["xid"], "79");
    assert_eq!(
        alerts[0]["annotations"]["summary"],
        "XID 79 on node-7 GPU 0"
    );
    assert_eq!(alerts[0]["endsAt"], "0001-01-01T00:00:00Z");
    assert!(body["actionsTaken"].as_array().is_some());
}

#[tokio::test]
async fn resolved_notice_is_posted_by_default() {
    let hook = Hook::default();
    let url = serve(hook.clone()).await;
    let cfg = config(&url, "");
    let sent = notifications(&cfg, true);
    assert_eq!(sent.len(), 2);
    let n = notifier(&cfg);
    for s in &sent {
        assert_eq!(n.send(s).await[0].error, None);
    }
    let got = hook.received();
    assert_eq!(got.len(), 2);
    assert_eq!(got[1].1["status"], "resolved");
    assert_eq!(got[1].1["alerts"][0]["status"], "resolved");
    assert_ne!(got[1].1["alerts"][0]["endsAt"], "0001-01-01T00:00:00Z");
}

#[tokio::test]
async fn without_send_resolved_nothing_is_posted_for_a_resolved_group() {
    let hook = Hook::default();
    let url = serve(hook.clone()).await;
    let cfg = config(&url, "send_resolved = false");
    let sent = notifications(&cfg, true);
    let n = notifier(&cfg);
    let resolved = n.send(&sent[1]).await;
    assert_eq!(resolved[0].attempts, 0, "nothing to send: {resolved:?}");
    assert_eq!(resolved[0].error, None);
    assert!(hook.received().is_empty());
}

#[tokio::test]
async fn slack_format_posts_text() {
    let hook = Hook::default();
    let url = serve(hook.clone()).await;
    let cfg = config(&url, r#"format = "slack""#);
    let sent = notifications(&cfg, false);
    assert_eq!(notifier(&cfg).send(&sent[0]).await[0].error, None);
    let got = hook.received();
    assert_eq!(got[0].0, None, "no token configured");
    let text = got[0].1["text"].as_str().expect("text");
    assert!(
        text.starts_with("*[FIRING:2] XidReboot node-7 (critical)*\n"),
        "{text}"
    );
    assert!(text.contains("• XID 79 on node-7 GPU 1"), "{text}");
    assert_eq!(got[0].1.as_object().map(|o| o.len()), Some(1), "only text");
}

#[tokio::test]
async fn server_errors_are_retried_and_client_errors_are_not() {
    let hook = Hook::default();
    if let Ok(mut s) = hook.statuses.lock() {
        *s = vec![503, 503];
    }
    let url = serve(hook.clone()).await;
    let cfg = config(&url, "");
    let sent = notifications(&cfg, false);
    let n = notifier(&cfg);
    let d = n.send(&sent[0]).await;
    assert_eq!((d[0].attempts, d[0].error.as_deref()), (3, None), "{d:?}");
    assert_eq!(hook.received().len(), 3);

    if let Ok(mut s) = hook.statuses.lock() {
        *s = vec![400];
    }
    let d = n.send(&sent[0]).await;
    assert_eq!(d[0].attempts, 1);
    assert!(
        d[0].error
            .as_deref()
            .is_some_and(|e| e.starts_with("HTTP 400")),
        "{d:?}"
    );

    if let Ok(mut s) = hook.statuses.lock() {
        *s = vec![500, 500, 500];
    }
    let d = n.send(&sent[0]).await;
    assert_eq!(d[0].attempts, 3);
    assert!(
        d[0].error
            .as_deref()
            .is_some_and(|e| e.starts_with("HTTP 500")),
        "{d:?}"
    );
}

#[tokio::test]
async fn an_unreachable_endpoint_is_reported_not_panicked() {
    // A port nothing listens on: bind, learn the port, close.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let cfg = config(&format!("http://127.0.0.1:{port}/hook"), "");
    let sent = notifications(&cfg, false);
    let d = notifier(&cfg).send(&sent[0]).await;
    assert_eq!(d[0].attempts, 3);
    assert!(
        d[0].error
            .as_deref()
            .is_some_and(|e| e.starts_with("request failed")),
        "{d:?}"
    );
}
