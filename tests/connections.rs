//! Idle half-open connections stayed open forever; at 20,000 of them the server ran
//! out of descriptors and stopped answering. Here a few hundred connections that send nothing
//! neither slow SQL and agent syncs nor outlive `server.idle_timeout_secs`.

mod common;

use common::{Agent, wait_for};
use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[test]
fn half_open_connections_neither_starve_the_server_nor_stay_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nidle_timeout_secs = 3\nmax_connections_per_ip = 1000\n[query]\ntimeout_secs = 2\n",
        &[],
    );
    let _agent = Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        None,
        &["--interval-ms", "200"],
    );
    wait_for("the node up", || {
        (perch.get("/v1/nodes")["nodes"][0]["state"] == "up").then_some(())
    });
    let addr = perch.url.trim_start_matches("http://").to_owned();
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&addr).expect("connect"))
        .collect();
    let opened = Instant::now();
    // SQL answers at once, again and again, while they sit there.
    for _ in 0..5 {
        let started = Instant::now();
        let rows = perch.sql("SELECT count(*) AS n FROM gpu_samples");
        assert!(!rows.is_empty());
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "SQL took {:?}",
            started.elapsed()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // The server closes every one of them after the idle timeout.
    for mut c in idle {
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut buf = [0u8; 16];
        match c.read(&mut buf) {
            Ok(0) => {}
            Ok(n) => panic!("the server sent {n} bytes to a silent client"),
            Err(e) => assert!(
                e.kind() == std::io::ErrorKind::ConnectionReset,
                "not closed by the server: {e}"
            ),
        }
    }
    let closed_after = opened.elapsed();
    assert!(
        closed_after >= Duration::from_secs(3) && closed_after < Duration::from_secs(10),
        "closed after {closed_after:?}"
    );
    // The agent's syncs went on: the node never went down.
    assert_eq!(perch.get("/v1/nodes")["nodes"][0]["state"], "up");
}

/// A connection from `ip` (any of 127/8) to `addr`.
fn connect_from(ip: &str, addr: &str) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(format!("{ip}:0").parse().expect("ip"))
            .expect("bind");
        let stream = socket
            .connect(addr.parse().expect("addr"))
            .await
            .expect("connect");
        let stream = stream.into_std().expect("std");
        stream.set_nonblocking(false).expect("blocking");
        stream
    })
}

/// 4,250 connections from 17 loopback addresses stalled new clients (`/healthz` took
/// 19.5 s), a request sent a byte at a time stayed open past 150 s, and an unprivileged
/// reconnect loop from the agent's own address locked the restarted agent out until its node
/// went down. Here, with small caps: new clients are served at once past the global cap (the
/// connection idle longest makes room), a trickled request is closed at the request timeout,
/// and a reconnect loop from the agent's address never takes its node down (its idle
/// connections make room for the agent's; what is served beyond an address's cap is
/// `listener::tests`).
#[test]
fn floods_neither_stall_new_clients_nor_lock_out_the_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nmax_connections = 64\nmax_connections_per_ip = 16\n\
         request_timeout_secs = 2\nnode_stale_after_secs = 2\n",
        &[],
    );
    let _agent = Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        None,
        &["--interval-ms", "200"],
    );
    // The observer asks from an address of its own (the flood below shares the agent's), on a
    // new connection each time: an idle keep-alive connection may be closed to make room.
    let observer = reqwest::blocking::Client::builder()
        .local_address(Some("127.0.0.99".parse().expect("ip")))
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    // Whether the node is up, by the first answer the server gives (a new connection may meet
    // a reset while the flood below churns the server's places: asked again, at most 5 times).
    let up = || {
        (0..5)
            .find_map(|_| {
                observer
                    .get(format!("{}/v1/nodes", perch.url))
                    .send()
                    .and_then(|r| r.json::<serde_json::Value>())
                    .ok()
            })
            .is_some_and(|nodes| nodes["nodes"][0]["state"] == "up")
    };
    wait_for("the node up", || up().then_some(()));
    let addr = perch.url.trim_start_matches("http://").to_owned();

    // 200 idle connections from 17 addresses, three times the global cap.
    let mut idle: Vec<TcpStream> = (0..200)
        .map(|i| connect_from(&format!("127.0.0.{}", 2 + i % 17), &addr))
        .collect();
    for _ in 0..5 {
        let started = Instant::now();
        let ok = reqwest::blocking::Client::new()
            .get(format!("{}/healthz", perch.url))
            .timeout(Duration::from_secs(10))
            .send()
            .is_ok_and(|r| r.status().is_success());
        assert!(ok, "a new client was not served");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a new client waited {:?}",
            started.elapsed()
        );
    }
    idle.clear();

    // A request a byte at a time: closed at the request timeout, long before the idle one.
    let mut trickle = TcpStream::connect(&addr).expect("connect");
    let started = Instant::now();
    let mut closed = false;
    for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
        .iter()
        .cycle()
    {
        use std::io::Write;
        if trickle.write_all(&[*byte]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if started.elapsed() > Duration::from_secs(30) {
            break;
        }
    }
    assert!(closed, "a trickled request was still open after 30 s");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // A reconnect loop from the agent's own address (a job on its node) for 8 s.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let (stop, addr) = (stop.clone(), addr.clone());
        std::thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(c) = TcpStream::connect(&addr) {
                    held.push_back(c);
                }
                if held.len() > 40 {
                    held.pop_front();
                }
            }
        })
    };
    let flooding = Instant::now();
    while flooding.elapsed() < Duration::from_secs(8) {
        if !up() {
            let answer = observer
                .get(format!("{}/v1/nodes", perch.url))
                .send()
                .map(|r| r.text());
            panic!("the agent was locked out: its node went down: {answer:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flood.join().expect("flood");
    assert!(up());
}
