//! The standby control plane end to end: two real `perch server` processes sharing a data
//! directory and a real PostgreSQL (Debian's, started per test on a socket of its own), an
//! agent given both servers, and clients that follow the leader.
//!
//! - `kill -9` of the leader under steady ingest, submissions and a running job, while it is
//!   delivering a notification: the standby leads within 15 s; every acknowledged sample and
//!   submission is there (counted); the job runs on as its one attempt; the notification cut
//!   short is delivered by the new leader, once;
//! - the leader cut from the database (its connections go through a proxy the test cuts): it
//!   stops (exit status 3) before the standby takes over;
//! - the database restarted under the leader, then both servers restarted: nothing lost, the
//!   job still runs as its first attempt.

mod common;

use common::{Agent, PATIENCE, assert_one_at_a_time, attempt_script, attempts, wait_for};
use perch_control::pg_testing::TempPostgres;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The takeover the issue asks for: a dead leader replaced within 15 s.
const TAKEOVER: Duration = Duration::from_secs(15);

/// One `perch server` of the pair.
struct Server {
    child: Child,
    name: String,
    url: String,
    log: PathBuf,
}

impl Server {
    /// Starts `perch server` named `name` on the shared data directory `shared`, leasing
    /// through `database`, and waits until it answers.
    fn start(dir: &Path, shared: &Path, database: &str, name: &str) -> Server {
        Server::start_on(dir, shared, database, name, "127.0.0.1:0", "")
    }

    /// [`Server::start`] with more configuration (whole sections) after perch's own.
    fn start_with(dir: &Path, shared: &Path, database: &str, name: &str, more: &str) -> Server {
        Server::start_on(dir, shared, database, name, "127.0.0.1:0", more)
    }

    /// Starts it again on the address it had, which agents and clients were given (as a
    /// restarted server keeps its address).
    fn restart(mut self, dir: &Path, shared: &Path, database: &str) -> Server {
        self.terminate();
        let listen = self.url.trim_start_matches("http://").to_owned();
        Server::start_on(dir, shared, database, &self.name.clone(), &listen, "")
    }

    fn start_on(
        dir: &Path,
        shared: &Path,
        database: &str,
        name: &str,
        listen: &str,
        more: &str,
    ) -> Server {
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"{listen}\"\ndata_dir = \"{}\"\npg_listen = \"\"\n\
                 node_stale_after_secs = 5\nnode_lease_secs = 120\nflush_interval_secs = 1\n\
                 [ha]\ndatabase = \"{database}\"\nname = \"{name}\"\n{more}",
                shared.display()
            ),
        )
        .expect("config");
        let addr_file = shared.join("ha").join(format!("{name}.addr"));
        let _ = std::fs::remove_file(&addr_file);
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log");
        let child = Command::new(common::PERCH)
            .args(["server", "--config"])
            .arg(&config)
            .env("PERCH_RUN_AS_USER", "never")
            .env("PERCH_LOG", "info")
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("spawn perch server");
        let mut server = Server {
            child,
            name: name.into(),
            url: String::new(),
            log,
        };
        let addr = wait_for(&format!("{name} to write its address"), || {
            server.assert_running();
            std::fs::read_to_string(&addr_file)
                .ok()
                .filter(|s| s.ends_with('\n'))
        });
        server.url = format!("http://{}", addr.trim());
        wait_for(&format!("{name} to answer"), || {
            server.assert_running();
            reqwest::blocking::get(format!("{}/healthz", server.url))
                .ok()
                .filter(|r| r.status().is_success())
        });
        server
    }

    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited ({status}); log:\n{}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    /// `GET /v1/ha`, if it answers.
    fn ha(&self) -> Option<Value> {
        reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .ok()?
            .get(format!("{}/v1/ha", self.url))
            .send()
            .ok()?
            .json()
            .ok()
    }

    /// Whether it leads and is ready (`/readyz` 200).
    fn leads(&self) -> bool {
        reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .ok()
            .and_then(|c| c.get(format!("{}/readyz", self.url)).send().ok())
            .is_some_and(|r| r.status().is_success())
    }

    fn wait_leads(&self) {
        wait_for(&format!("{} to lead", self.name), || {
            self.leads().then_some(())
        });
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn terminate(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }

    fn sql(&self, query: &str) -> Vec<Value> {
        let r = reqwest::blocking::Client::new()
            .post(format!("{}/v1/sql", self.url))
            .json(&json!({ "sql": query }))
            .send()
            .expect("POST /v1/sql");
        let status = r.status();
        let body: Value = r.json().expect("JSON");
        assert!(status.is_success(), "{query}: {status} {body}");
        body["rows"].as_array().expect("rows").clone()
    }

    fn job(&self, id: u64) -> Value {
        reqwest::blocking::get(format!("{}/v1/jobs/{id}", self.url))
            .expect("GET job")
            .json()
            .expect("JSON")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The servers' URLs, comma-separated, as clients and agents are given them.
fn list(servers: &[&Server]) -> String {
    servers
        .iter()
        .map(|s| s.url.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// Load that follows the leader as a careful client does: each request goes to the server
/// that last answered, moving to the next on a refused connection, a standby's redirect or
/// 503. Records what was acknowledged.
#[derive(Clone)]
struct Load {
    urls: Vec<String>,
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<BTreeSet<u64>>>,
    jobs: Arc<Mutex<BTreeSet<u64>>>,
}

impl Load {
    fn new(urls: Vec<String>) -> Load {
        Load {
            urls,
            stop: Arc::default(),
            samples: Arc::default(),
            jobs: Arc::default(),
        }
    }

    /// Sends `body` to `path` until one server acknowledges it; its answer.
    fn send(
        &self,
        client: &reqwest::blocking::Client,
        at: &mut usize,
        path: &str,
        body: &Value,
    ) -> Option<Value> {
        while !self.stop.load(Ordering::Relaxed) {
            let url = format!("{}{path}", self.urls[*at % self.urls.len()]);
            match client.post(&url).json(body).send() {
                Ok(r) if r.status().is_success() => return r.json().ok(),
                Ok(r) if r.status().is_client_error() => {
                    panic!(
                        "{path} refused: {} {}",
                        r.status(),
                        r.text().unwrap_or_default()
                    )
                }
                // Redirected by a standby, or unavailable: the next server. The pace of a
                // retrying client, not a wait for a condition.
                _ => {
                    *at += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        None
    }

    /// A client that follows no redirect: [`Load::send`] decides where to go next.
    fn client() -> reqwest::blocking::Client {
        reqwest::blocking::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(5))
            .build()
            .expect("client")
    }

    /// Sends numbered telemetry batches of node `ingest-ha`, one after another.
    fn ingest(self) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let client = Load::client();
            let mut at = 0;
            for seq in 1u64.. {
                let batch = common::marked_batch("ingest-ha", seq);
                if self.send(&client, &mut at, "/v1/ingest", &batch).is_none() {
                    return;
                }
                self.samples.lock().expect("samples").insert(seq);
            }
        })
    }

    /// Submits small jobs (they wait: the one GPU is busy), one after another.
    fn submit(self) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let client = Load::client();
            let mut at = 0;
            let job = json!({ "command": ["true"], "user": "alice", "gpus_per_node": 1 });
            while let Some(answer) = self.send(&client, &mut at, "/v1/jobs", &job) {
                let id = answer["id"].as_u64().expect("the job's id");
                self.jobs.lock().expect("jobs").insert(id);
            }
        })
    }

    fn counts(&self) -> (usize, usize) {
        (
            self.samples.lock().expect("samples").len(),
            self.jobs.lock().expect("jobs").len(),
        )
    }
}

/// `perch agent` for node gpu-a with one simulated GPU, given every server.
fn agent(dir: &Path, servers: &str) -> Agent {
    Agent::start(
        servers,
        "gpu-a",
        &dir.join("gpu-a"),
        1,
        None,
        &["--interval-ms", "200"],
    )
}

/// Submits the attempt-stamped job to `leader` and waits until it ticks.
fn start_job(leader: &Server, file: &Path) -> u64 {
    let answer: Value = reqwest::blocking::Client::new()
        .post(format!("{}/v1/jobs", leader.url))
        .json(&json!({
            "command": ["sh", "-c", attempt_script(file)],
            "user": "alice",
            "gpus_per_node": 1,
            "grace_secs": 1,
            "max_requeues": 3,
        }))
        .send()
        .expect("submit")
        .json()
        .expect("JSON");
    let id = answer["id"].as_u64().unwrap_or_else(|| panic!("{answer}"));
    wait_for("the job's first ticks", || {
        (attempts(file).first()?.3 > 3).then_some(())
    });
    id
}

/// The job is still its attempt 1, running on; the node's agent syncs with `leader` (it
/// followed the leader) and the node is up there.
fn still_first_attempt(leader: &Server, id: u64, file: &Path) {
    let nodes = || {
        reqwest::blocking::get(format!("{}/v1/nodes", leader.url))
            .expect("GET /v1/nodes")
            .json::<Value>()
            .expect("JSON")
    };
    common::wait_syncs("gpu-a", 2, nodes);
    let node = nodes()["nodes"]
        .as_array()
        .and_then(|n| n.iter().find(|x| x["name"] == "gpu-a").cloned())
        .expect("gpu-a");
    assert_eq!(node["state"], "up", "{node}");
    let lines = attempts(file).first().map_or(0, |r| r.3);
    wait_for("the job to tick on", || {
        (attempts(file).first()?.3 > lines + 5).then_some(())
    });
    let j = leader.job(id);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("running"), Some(1)),
        "{j}"
    );
    assert_eq!(
        attempts(file).len(),
        1,
        "one attempt only: {:?}",
        attempts(file)
    );
    assert_one_at_a_time(file);
}

/// Every acknowledged sample and submission is on `leader`.
fn nothing_lost(leader: &Server, load: &Load) {
    let acked = load.samples.lock().expect("samples").clone();
    let stored: BTreeSet<u64> = wait_for("the acknowledged samples in SQL", || {
        let rows = leader
            .sql("SELECT DISTINCT sm_clock_mhz AS seq FROM gpu_samples WHERE node = 'ingest-ha'");
        let stored: BTreeSet<u64> = rows.iter().filter_map(|r| r["seq"].as_u64()).collect();
        acked.is_subset(&stored).then_some(stored)
    });
    assert!(acked.is_subset(&stored));
    for id in load.jobs.lock().expect("jobs").iter() {
        let j = leader.job(*id);
        assert_eq!(j["id"].as_u64(), Some(*id), "acknowledged job {id}: {j}");
    }
}

/// A webhook receiver on port 0 that leaves its first request unanswered (the leader sending
/// it is killed meanwhile) and answers every later one; it keeps each request's
/// `(groupKey, status)` and whether it was answered.
struct Hook {
    url: String,
    seen: Arc<Mutex<Vec<(String, String, bool)>>>,
}

impl Hook {
    fn start() -> Hook {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
        let seen: Arc<Mutex<Vec<(String, String, bool)>>> = Arc::default();
        let record = seen.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let Some(body) = read_request(&mut stream) else {
                    continue;
                };
                let v: Value = serde_json::from_slice(&body).unwrap_or_default();
                let key = v["groupKey"].as_str().unwrap_or_default().to_owned();
                let status = v["status"].as_str().unwrap_or_default().to_owned();
                let mut seen = record.lock().expect("seen");
                let answer = !seen.is_empty();
                seen.push((key, status, answer));
                drop(seen);
                if answer {
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                    );
                } else {
                    held.push(stream);
                }
            }
        });
        Hook { url, seen }
    }

    fn seen(&self) -> Vec<(String, String, bool)> {
        self.seen.lock().expect("seen").clone()
    }
}

/// The body of one HTTP/1.1 request with a `content-length`.
fn read_request(stream: &mut std::net::TcpStream) -> Option<Vec<u8>> {
    let mut data = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = stream.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        data.extend_from_slice(&buf[..n]);
        let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&data[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while data.len() < end + 4 + length {
            let n = stream.read(&mut buf).ok()?;
            if n == 0 {
                return None;
            }
            data.extend_from_slice(&buf[..n]);
        }
        return Some(data[end + 4..end + 4 + length].to_vec());
    }
}

/// An alert that fires once node ingest-ha has samples, notified to `hook` only.
fn alerting_to(hook: &Hook) -> String {
    format!(
        r#"[alerts]
evaluation_interval = "1s"
[alerts.builtin]
enabled = false
[[alerts.rules]]
name = "IngestSeen"
sql = "SELECT node FROM gpu_samples WHERE node = 'ingest-ha' GROUP BY node"
interval = "1s"
[[alerts.receivers]]
name = "hook"
[[alerts.receivers.webhook]]
url = "{}"
timeout = "5m"
send_resolved = false
[alerts.route]
receiver = "hook"
group_wait = "1s"
group_interval = "1h"
repeat_interval = "4h"
"#,
        hook.url
    )
}

#[test]
fn killing_the_leader_under_load_loses_nothing_and_runs_no_job_twice() {
    let pg = TempPostgres::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = dir.path().join("shared");
    let hook = Hook::start();
    let alerting = alerting_to(&hook);
    let mut a = Server::start_with(dir.path(), &shared, &pg.url(), "a", &alerting);
    a.wait_leads();
    let b = Server::start_with(dir.path(), &shared, &pg.url(), "b", &alerting);
    let ha = b.ha().expect("b's status");
    assert_eq!(
        (ha["role"].as_str(), ha["leader"]["name"].as_str()),
        (Some("standby"), Some("a")),
        "{ha}"
    );
    let epoch = ha["leader"]["epoch"].as_i64().expect("epoch");
    // A standby sends clients on to the leader.
    let redirect = reqwest::blocking::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
        .get(format!("{}/v1/jobs?limit=1", b.url))
        .send()
        .expect("GET");
    assert_eq!(redirect.status(), 307);
    assert_eq!(
        redirect.headers()["location"],
        format!("{}/v1/jobs?limit=1", a.url).as_str()
    );

    let _agent = agent(dir.path(), &list(&[&a, &b]));
    let file = dir.path().join("job.lines");
    let id = start_job(&a, &file);
    let load = Load::new(vec![a.url.clone(), b.url.clone()]);
    let threads = [load.clone().ingest(), load.clone().submit()];
    wait_for("steady load", || {
        let (samples, jobs) = load.counts();
        (samples > 50 && jobs > 10).then_some(())
    });
    // The leader is sending the alert's notification, and the receiver does not answer.
    wait_for("the notification on its way", || {
        (!hook.seen().is_empty()).then_some(())
    });

    a.kill();
    let killed = Instant::now();
    b.wait_leads();
    let takeover = killed.elapsed();
    assert!(takeover <= TAKEOVER, "the standby led after {takeover:?}");
    let ha = b.ha().expect("status");
    assert_eq!(ha["role"], "leader", "{ha}");
    assert_eq!(ha["leader"]["epoch"].as_i64(), Some(epoch + 1), "{ha}");
    let before = load.counts();
    wait_for("load on the new leader", || {
        let now = load.counts();
        (now.0 > before.0 + 50 && now.1 > before.1 + 10).then_some(())
    });
    load.stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("load thread");
    }
    nothing_lost(&b, &load);
    still_first_attempt(&b, id, &file);
    // The notification cut short was made once and is delivered by the new leader: the
    // receiver saw the same group's firing message twice, answered once.
    let seen = wait_for("the notification delivered by the new leader", || {
        let seen = hook.seen();
        seen.iter().any(|s| s.2).then_some(seen)
    });
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        (&seen[0].0, &seen[0].1),
        (&seen[1].0, &seen[1].1),
        "{seen:?}"
    );
    assert_eq!(seen[1].1, "firing");
    // `perch ha status` asks each server: the killed one is unreachable, b leads.
    let out = common::client()
        .args(["ha", "status", "--server", &format!("{},{}", a.url, b.url)])
        .output()
        .expect("perch ha status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("unreachable") && text.contains(&format!("b {}", b.url)),
        "{text}"
    );
    eprintln!(
        "takeover after kill -9: {takeover:?}; acknowledged {:?} (samples, jobs)",
        load.counts()
    );
    assert_eq!(
        hook.seen().len(),
        2,
        "no notification sent again: {:?}",
        hook.seen()
    );

    // The killed server, started again, is a standby that knows the new leader.
    let a = Server::start(dir.path(), &shared, &pg.url(), "a");
    let ha = a.ha().expect("a's status");
    assert_eq!(
        (ha["role"].as_str(), ha["leader"]["name"].as_str()),
        (Some("standby"), Some("b")),
        "{ha}"
    );
}

/// A TCP proxy to the database's socket that the test can cut: from then on it passes no
/// byte either way and takes new connections without answering, as a partition does.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    fn start(socket: PathBuf) -> Proxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let cut = Arc::new(AtomicBool::new(false));
        let flag = cut.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if flag.load(Ordering::Relaxed) {
                    // Held open, never answered.
                    std::mem::forget(client);
                    continue;
                }
                let Ok(server) = std::os::unix::net::UnixStream::connect(&socket) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (
                        Box::new(client.try_clone().expect("clone"))
                            as Box<dyn std::io::Read + Send>,
                        Box::new(server.try_clone().expect("clone"))
                            as Box<dyn std::io::Write + Send>,
                    ),
                    (Box::new(server) as _, Box::new(client) as _),
                ] {
                    let flag = flag.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                return;
                            }
                            if flag.load(Ordering::Relaxed) {
                                continue; // dropped on the floor
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Proxy { port, cut }
    }
}

#[test]
fn a_leader_cut_from_the_database_stops_before_the_standby_takes_over() {
    let pg = TempPostgres::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = dir.path().join("shared");
    let proxy = Proxy::start(pg.socket_dir().join(".s.PGSQL.5432"));
    let through_proxy = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        proxy.port
    );
    let mut a = Server::start(dir.path(), &shared, &through_proxy, "a");
    a.wait_leads();
    let b = Server::start(dir.path(), &shared, &pg.url(), "b");
    let _agent = agent(dir.path(), &list(&[&a, &b]));
    let file = dir.path().join("job.lines");
    let id = start_job(&a, &file);

    proxy.cut.store(true, Ordering::Relaxed);
    let cut = Instant::now();
    // Watch both: when a stops acting (its process ends) and when b leads.
    let mut a_stopped = None;
    let mut b_leads = None;
    while a_stopped.is_none() || b_leads.is_none() {
        assert!(
            cut.elapsed() < PATIENCE,
            "a stopped {a_stopped:?}, b leads {b_leads:?}"
        );
        if a_stopped.is_none()
            && let Ok(Some(status)) = a.child.try_wait()
        {
            assert_eq!(status.code(), Some(3), "a exits saying it lost the lease");
            a_stopped = Some(cut.elapsed());
        }
        if b_leads.is_none() && b.leads() {
            b_leads = Some(cut.elapsed());
        }
        // The pace of the watch; both conditions are polled.
        std::thread::sleep(Duration::from_millis(20));
    }
    let (a_stopped, b_leads) = (a_stopped.expect("a"), b_leads.expect("b"));
    eprintln!("cut from the database: a stopped after {a_stopped:?}, b led after {b_leads:?}");
    assert!(
        a_stopped < b_leads,
        "the old leader stopped ({a_stopped:?}) before the standby led ({b_leads:?})"
    );
    assert!(b_leads <= TAKEOVER);
    let log = std::fs::read_to_string(&a.log).unwrap_or_default();
    assert!(log.contains("lost the leader lease"), "{log}");
    still_first_attempt(&b, id, &file);
}

#[test]
fn a_database_restart_and_both_servers_restarted_lose_nothing() {
    let mut pg = TempPostgres::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("tempdir");
    let shared = dir.path().join("shared");
    let a = Server::start(dir.path(), &shared, &pg.url(), "a");
    a.wait_leads();
    let b = Server::start(dir.path(), &shared, &pg.url(), "b");
    let _agent = agent(dir.path(), &list(&[&a, &b]));
    let file = dir.path().join("job.lines");
    let id = start_job(&a, &file);
    let load = Load::new(vec![a.url.clone(), b.url.clone()]);
    let threads = [load.clone().ingest(), load.clone().submit()];
    wait_for("steady load", || {
        let (samples, jobs) = load.counts();
        (samples > 20 && jobs > 5).then_some(())
    });

    // The database goes away and comes back, well within the lease.
    pg.stop();
    pg.resume().expect("PostgreSQL again");
    let before = load.counts();
    wait_for("submissions accepted again", || {
        (load.counts().1 > before.1 + 5).then_some(())
    });
    assert!(
        a.leads(),
        "a still leads: {}",
        std::fs::read_to_string(&a.log).unwrap_or_default()
    );

    // Both servers stopped, then started again: one leads, with everything.
    load.stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("load thread");
    }
    let b = b.restart(dir.path(), &shared, &pg.url());
    let a = a.restart(dir.path(), &shared, &pg.url());
    let leader = wait_for("a leader", || [&a, &b].into_iter().find(|s| s.leads()));
    nothing_lost(leader, &load);
    still_first_attempt(leader, id, &file);
}
