//! Email against a real SMTP server: aiosmtpd (from PyPI; `scripts/test.sh` installs it)
//! delivering into a Maildir, which the test reads back with Python's `email` package.
//!
//! Covers plain SMTP, AUTH without TLS (password from an environment variable), STARTTLS with
//! AUTH, and TLS from the first byte, the last two against a CA the test generates and trusts
//! through `ca_file`. Each checks that exactly one message arrived, with the subject and the
//! body an operator needs: what happened, where, and what perch did.

use perch_alerts::notify::{Notifier, RetryPolicy};
use perch_alerts::remediate::{ClusterView, NodeState, NodeView, Outcome};
use perch_alerts::{AlertsConfig, Engine, Instance, Notification};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const SERVER: &str = r#"
import json, logging, socket, ssl, sys, warnings
# Quiet the expected: the AUTH-without-TLS warning and the untrusted-certificate handshake.
warnings.filterwarnings("ignore")
logging.getLogger("mail.log").setLevel(logging.CRITICAL)
from aiosmtpd.controller import Controller
from aiosmtpd.handlers import Mailbox
from aiosmtpd.smtp import AuthResult, LoginPassword

cfg = json.loads(sys.argv[1])

def authenticator(server, session, envelope, mechanism, auth_data):
    ok = (isinstance(auth_data, LoginPassword)
          and auth_data.login.decode() == cfg["user"]
          and auth_data.password.decode() == cfg["password"])
    return AuthResult(success=ok, handled=False)

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
kwargs = {}
if cfg["mode"] in ("starttls", "tls"):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg["cert"], cfg["key"])
    if cfg["mode"] == "starttls":
        kwargs.update(tls_context=ctx, require_starttls=True)
    else:
        kwargs.update(ssl_context=ctx)
if cfg.get("user"):
    kwargs.update(authenticator=authenticator, auth_required=True,
                  auth_require_tls=cfg["mode"] != "none")
controller = Controller(Mailbox(cfg["maildir"]), hostname="127.0.0.1", port=port, **kwargs)
controller.start()
print("ready", port, flush=True)
sys.stdin.read()
controller.stop()
"#;

const READ_MAIL: &str = r#"
import email, email.policy, json, os, sys
new = os.path.join(sys.argv[1], "new")
out = []
for name in sorted(os.listdir(new)) if os.path.isdir(new) else []:
    with open(os.path.join(new, name), "rb") as f:
        m = email.message_from_binary_file(f, policy=email.policy.default)
    out.append({"from": str(m["from"]), "to": str(m["to"]), "subject": str(m["subject"]),
                "body": m.get_content()})
print(json.dumps(out))
"#;

/// An aiosmtpd process; killed when dropped.
struct SmtpServer {
    child: Child,
    port: u16,
    maildir: PathBuf,
}

impl Drop for SmtpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn require_aiosmtpd() {
    let ok = Command::new("python3")
        .args(["-c", "import aiosmtpd"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "aiosmtpd is not installed: run scripts/test.sh, or \
         PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install aiosmtpd"
    );
}

fn start_server(
    dir: &Path,
    mode: &str,
    auth: Option<(&str, &str)>,
    tls: Option<&TlsFiles>,
) -> SmtpServer {
    require_aiosmtpd();
    let maildir = dir.join(format!("maildir-{mode}"));
    let cfg = serde_json::json!({
        "mode": mode,
        "maildir": maildir,
        "user": auth.map(|a| a.0),
        "password": auth.map(|a| a.1),
        "cert": tls.map(|t| &t.cert),
        "key": tls.map(|t| &t.key),
    });
    let mut child = Command::new("python3")
        .args(["-c", SERVER, &cfg.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start python3 with aiosmtpd");
    let stdout = child.stdout.take().expect("server stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the server's ready line");
    let port = line
        .strip_prefix("ready ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("aiosmtpd did not start: {line:?}"));
    SmtpServer {
        child,
        port,
        maildir,
    }
}

#[derive(Debug, serde::Deserialize)]
struct Mail {
    from: String,
    to: String,
    subject: String,
    body: String,
}

fn mailbox(server: &SmtpServer) -> Vec<Mail> {
    let out = Command::new("python3")
        .args(["-c", READ_MAIL])
        .arg(&server.maildir)
        .output()
        .expect("run python3 to read the Maildir");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("mailbox JSON")
}

struct TlsFiles {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// A CA and a server certificate for 127.0.0.1 signed by it, as PEM files.
fn tls_files(dir: &Path) -> TlsFiles {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("server key");
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).expect("server params");
    params
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().expect("ip")));
    let cert = params.signed_by(&key, &issuer).expect("server certificate");
    let files = TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    };
    std::fs::write(&files.ca, ca_cert.pem()).expect("write CA");
    std::fs::write(&files.cert, cert.pem()).expect("write cert");
    std::fs::write(&files.key, key.serialize_pem()).expect("write key");
    files
}

fn config(port: u16, email_extra: &str) -> AlertsConfig {
    AlertsConfig::from_toml(&format!(
        r#"
        [[receivers]]
        name = "oncall"
        [[receivers.email]]
        smtp_host = "127.0.0.1"
        smtp_port = {port}
        from = "perch <perch@example.com>"
        to = ["oncall@example.com"]
        {email_extra}

        [route]
        receiver = "oncall"
        group_wait = "30s"
        "#
    ))
    .expect("valid config")
}

/// An XID 79 on one GPU of node-3: the engine fires, drains and requeues, and makes the one
/// notification of the group.
fn xid_notification(config: AlertsConfig) -> Notification {
    let mut engine = Engine::new(config).expect("engine");
    let xid = Instance::with_labels([
        ("node", "node-3"),
        ("gpu", "0"),
        ("xid", "79"),
        ("simulated", "false"),
    ])
    .value("gpu", 0.0)
    .value("xid", 79.0)
    .value("events", 1.0);
    engine.evaluate("XidReboot", &[xid], 0).expect("evaluate");
    let view = ClusterView {
        nodes: (0..10)
            .map(|i| NodeView {
                node: format!("node-{i}"),
                state: NodeState::Up,
                running_jobs: 2,
            })
            .collect(),
    };
    let plan = engine.plan_remediation(&view, 1_000);
    for d in plan
        .decisions
        .iter()
        .filter(|d| d.outcome == Outcome::Execute)
    {
        let detail = if d.action.name() == "requeue_jobs" {
            "Jobs 41 and 42 went back to the queue."
        } else {
            ""
        };
        engine.complete(d, &Ok(detail.into()), 1_000);
    }
    assert!(engine.notifications(1_000).is_empty(), "group_wait");
    let mut sent = engine.notifications(31_000);
    assert_eq!(sent.len(), 1);
    sent.remove(0)
}

fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        attempts: 3,
        first_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
    }
}

fn assert_one_xid_mail(server: &SmtpServer) {
    let mail = mailbox(server);
    assert_eq!(mail.len(), 1, "exactly one message: {mail:#?}");
    let m = &mail[0];
    assert_eq!(m.subject, "[FIRING:1] XidReboot node-3 (critical)");
    assert_eq!(m.from, "perch <perch@example.com>");
    assert_eq!(m.to, "oncall@example.com");
    for needle in [
        "1 alert firing:",
        "* XID 79 on node-3 GPU 0",
        "needing a reboot",
        "labels: gpu=0, node=node-3, simulated=false, xid=79, xid_class=reboot",
        "What perch did:",
        "* Drained node-3: no new jobs start there.",
        "* Requeued the jobs of node-3. Jobs 41 and 42 went back to the queue.",
    ] {
        assert!(
            m.body.contains(needle),
            "missing {needle:?} in:\n{}",
            m.body
        );
    }
}

async fn send(config: &AlertsConfig, n: &Notification) -> Vec<perch_alerts::notify::Delivery> {
    Notifier::new(config)
        .expect("notifier")
        .with_retry(fast_retry())
        .send(n)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_smtp_delivers_one_message_saying_what_perch_did() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start_server(dir.path(), "none", None, None);
    let cfg = config(server.port, r#"tls = "none""#);
    let deliveries = send(&cfg, &xid_notification(cfg.clone())).await;
    assert_eq!(deliveries.len(), 1);
    assert_eq!(deliveries[0].error, None, "{deliveries:?}");
    assert_eq!(deliveries[0].attempts, 1);
    assert_eq!(deliveries[0].integration, "email to oncall@example.com");
    assert_one_xid_mail(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_without_tls_uses_the_password_from_the_environment() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Setting a variable is `unsafe` in edition 2024 (and unsafe code is denied here), so the
    // password is one cargo sets for every test process: CARGO_PKG_NAME = "perch-alerts".
    let password = env!("CARGO_PKG_NAME");
    assert_eq!(std::env::var("CARGO_PKG_NAME").as_deref(), Ok(password));
    let server = start_server(dir.path(), "none", Some(("perch", password)), None);
    let cfg = config(
        server.port,
        r#"tls = "none"
        username = "perch"
        password_env = "CARGO_PKG_NAME""#,
    );
    let deliveries = send(&cfg, &xid_notification(cfg.clone())).await;
    assert_eq!(deliveries[0].error, None, "{deliveries:?}");
    assert_one_xid_mail(&server);

    // A wrong password is a permanent failure: reported after one attempt, nothing sent.
    let bad = config(
        server.port,
        r#"tls = "none"
        username = "perch"
        password = "wrong""#,
    );
    let deliveries = send(&bad, &xid_notification(bad.clone())).await;
    assert_eq!(deliveries[0].attempts, 1, "{deliveries:?}");
    let error = deliveries[0].error.as_deref().unwrap_or_default();
    assert!(error.contains("SMTP"), "{error}");
    assert_eq!(mailbox(&server).len(), 1, "still only the first message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starttls_with_auth_trusts_the_configured_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tls = tls_files(dir.path());
    let server = start_server(
        dir.path(),
        "starttls",
        Some(("perch", "s3cret")),
        Some(&tls),
    );
    let cfg = config(
        server.port,
        &format!(
            r#"tls = "starttls"
            username = "perch"
            password = "s3cret"
            ca_file = "{}""#,
            tls.ca.display()
        ),
    );
    let deliveries = send(&cfg, &xid_notification(cfg.clone())).await;
    assert_eq!(deliveries[0].error, None, "{deliveries:?}");
    assert_one_xid_mail(&server);

    // Without the CA the server's certificate is not trusted: nothing is sent in clear.
    let untrusted = config(
        server.port,
        r#"tls = "starttls"
        username = "perch"
        password = "s3cret""#,
    );
    let deliveries = send(&untrusted, &xid_notification(untrusted.clone())).await;
    assert!(deliveries[0].error.is_some(), "{deliveries:?}");
    assert_eq!(mailbox(&server).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn implicit_tls_delivers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tls = tls_files(dir.path());
    let server = start_server(dir.path(), "tls", None, Some(&tls));
    let cfg = config(
        server.port,
        &format!(
            r#"tls = "tls"
            ca_file = "{}""#,
            tls.ca.display()
        ),
    );
    let deliveries = send(&cfg, &xid_notification(cfg.clone())).await;
    assert_eq!(deliveries[0].error, None, "{deliveries:?}");
    assert_one_xid_mail(&server);
}

/// A fault a real server will not produce on demand: it greets, then never answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_answering_times_out_and_is_retried() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let accepted = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut socket, _)) = listener.accept().await {
            let _ = socket.write_all(b"220 mute.example ESMTP\r\n").await;
            let mut buf = [0u8; 512];
            let _ = socket.read(&mut buf).await;
            held.push(socket);
        }
    });
    let cfg = config(
        port,
        r#"tls = "none"
        timeout = "1s""#,
    );
    let notifier = Notifier::new(&cfg)
        .expect("notifier")
        .with_retry(RetryPolicy {
            attempts: 2,
            first_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(50),
        });
    let started = std::time::Instant::now();
    let deliveries = notifier.send(&xid_notification(cfg.clone())).await;
    assert_eq!(deliveries[0].attempts, 2, "{deliveries:?}");
    assert_eq!(
        deliveries[0].error.as_deref(),
        Some("SMTP: no answer within 1 s")
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "bounded by the timeout"
    );
    accepted.abort();
}

#[test]
fn a_missing_password_variable_stops_startup_naming_the_field() {
    let cfg = config(
        25,
        r#"username = "perch"
        password_env = "PERCH_TEST_SMTP_PASSWORD_THAT_IS_NOT_SET""#,
    );
    let err = Notifier::new(&cfg).expect_err("unset variable").to_string();
    assert!(
        err.contains("alerts.receivers[0].email[0].password_env")
            && err.contains("PERCH_TEST_SMTP_PASSWORD_THAT_IS_NOT_SET"),
        "{err}"
    );
}
