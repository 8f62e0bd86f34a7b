//! Kill -9 the server while a client and a real agent are sending; after a restart every
//! acknowledged sample is there exactly once, and the agent carried on by itself.

mod common;

use common::{Perch, marked_batch, wait_for};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Sends numbered batches as fast as the server acknowledges them, resending the current one
/// until it is acknowledged (as a retrying agent would). Returns the acknowledged numbers.
fn sender(url: Arc<Mutex<String>>, stop: Arc<AtomicBool>, acked: Arc<Mutex<BTreeSet<u64>>>) {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let mut seq = 1u64;
    while !stop.load(Ordering::Relaxed) {
        let target = format!("{}/v1/ingest", url.lock().expect("url").clone());
        match client
            .post(&target)
            .json(&marked_batch("durability-test", seq))
            .send()
        {
            Ok(r) if r.status().is_success() => {
                acked.lock().expect("acked").insert(seq);
                seq += 1;
            }
            Ok(r) => panic!(
                "batch {seq} refused: {} {}",
                r.status(),
                r.text().unwrap_or_default()
            ),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[test]
fn sigkill_loses_no_acknowledged_sample() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A fixed port, so the agent finds the restarted server at the same address.
    let port = common::free_port();
    let listen = format!("127.0.0.1:{port}");
    let server_args = ["server", "--listen", &listen, "--flush-interval-secs", "1"];
    let mut server = Perch::start(dir.path(), &server_args);

    let agent_dir = tempfile::tempdir().expect("tempdir");
    let mut agent = common::Agent::start(
        &server.url,
        "real-agent",
        agent_dir.path(),
        1,
        None,
        &["--interval-ms", "100"],
    );

    let url = Arc::new(Mutex::new(server.url.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(BTreeSet::new()));
    let thread = std::thread::spawn({
        let (url, stop, acked) = (url.clone(), stop.clone(), acked.clone());
        move || sender(url, stop, acked)
    });

    // Let some batches reach Parquet (flush every second) and some stay in the log only.
    wait_for("acknowledged batches and a flush", || {
        let flushed = std::fs::read_to_string(dir.path().join("manifest.json"))
            .is_ok_and(|m| m.contains(".parquet"));
        (flushed && acked.lock().expect("acked").len() > 200).then_some(())
    });
    server.kill();
    let acked_before_kill = acked.lock().expect("acked").clone();
    let agent_rows_before = {
        server = Perch::start(dir.path(), &server_args);
        server.scalar("SELECT count(*) FROM host_samples WHERE node = 'real-agent'")
    };
    *url.lock().expect("url") = server.url.clone();
    // The sender resends its pending batch and carries on against the new process.
    let resumed_from = acked_before_kill.len();
    wait_for("sending to resume after the restart", || {
        (acked.lock().expect("acked").len() > resumed_from + 50).then_some(())
    });
    stop.store(true, Ordering::Relaxed);
    thread.join().expect("sender thread");
    let acked = acked.lock().expect("acked").clone();

    let rows = server.sql("SELECT sm_clock_mhz AS seq, count(*) AS n FROM gpu_samples WHERE node = 'durability-test' GROUP BY 1");
    let mut stored = BTreeSet::new();
    for row in &rows {
        let seq = row["seq"].as_u64().expect("seq");
        assert_eq!(row["n"], 1, "batch {seq} stored more than once");
        stored.insert(seq);
    }
    let lost: Vec<_> = acked_before_kill.difference(&stored).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged batches lost across kill -9: {lost:?}",
        lost.len()
    );
    let lost_after: Vec<_> = acked.difference(&stored).collect();
    assert!(
        lost_after.is_empty(),
        "acknowledged after restart but missing: {lost_after:?}"
    );

    // The real agent kept running through the outage and delivers to the new process.
    assert!(agent.is_running(), "the agent exited when the server died");
    wait_for("the agent to deliver to the restarted server", || {
        (server.scalar("SELECT count(*) FROM host_samples WHERE node = 'real-agent'")
            > agent_rows_before)
            .then_some(())
    });
}

#[test]
fn clean_shutdown_flushes_and_restart_keeps_every_row_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut server = Perch::start(dir.path(), &["server"]);
    let client = reqwest::blocking::Client::new();
    for seq in 1..=20 {
        let r = client
            .post(format!("{}/v1/ingest", server.url))
            .json(&marked_batch("n1", seq))
            .send()
            .expect("ingest");
        assert!(r.status().is_success());
    }
    // A retry of an acknowledged batch is acknowledged as a duplicate and not stored again.
    let dup: serde_json::Value = client
        .post(format!("{}/v1/ingest", server.url))
        .json(&marked_batch("n1", 7))
        .send()
        .expect("ingest")
        .json()
        .expect("json");
    assert_eq!(dup["duplicate"], true);
    assert!(
        server.terminate().success(),
        "clean exit; log:\n{}",
        server.log()
    );
    let manifest =
        std::fs::read_to_string(dir.path().join("manifest.json")).expect("manifest after shutdown");
    assert!(
        manifest.contains("gpu_samples"),
        "shutdown flushed to parquet: {manifest}"
    );
    let server = Perch::start(dir.path(), &["server"]);
    assert_eq!(server.scalar("SELECT count(*) FROM gpu_samples"), 20);
    assert_eq!(
        server.scalar("SELECT count(DISTINCT sm_clock_mhz) FROM gpu_samples"),
        20
    );
    // The deduplication state survived the restart too.
    let dup: serde_json::Value = client
        .post(format!("{}/v1/ingest", server.url))
        .json(&marked_batch("n1", 20))
        .send()
        .expect("ingest")
        .json()
        .expect("json");
    assert_eq!(dup["duplicate"], true);
}

/// A batch cancel of a 10,000-task array cut by SIGKILL part way: what it committed stays
/// cancelled, the rest is still pending (nothing lost, nothing half-written), and the same
/// command after the restart cancels the rest.
#[test]
fn a_batch_cancel_cut_by_sigkill_keeps_its_steps_and_finishes_when_asked_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut server = Perch::start(dir.path(), &["server"]);
    let client = reqwest::blocking::Client::new();
    let submitted: serde_json::Value = client
        .post(format!("{}/v1/jobs", server.url))
        .json(&serde_json::json!({ "command": ["true"], "array": 10000 }))
        .send()
        .expect("submit")
        .json()
        .expect("json");
    let array = submitted["id"].as_u64().expect("array id");
    let cancel = {
        let url = server.url.clone();
        std::thread::spawn(move || {
            reqwest::blocking::Client::new()
                .post(format!("{url}/v1/jobs/cancel"))
                .json(&serde_json::json!({ "array": array }))
                .send()
        })
    };
    // Cut it once the second step has begun: the first is then durable, since a step starts
    // only when the one before it is committed (SQL reads the control plane as it is, so a
    // step it shows may not be yet). A fast machine may finish the whole cancel first.
    wait_for("the second step of the cancel", || {
        let n = server.scalar("SELECT count(*) FROM jobs WHERE state = 'cancelled'");
        (n > 1_000).then_some(())
    });
    server.kill();
    let _ = cancel.join().expect("cancel thread");
    server = Perch::start(dir.path(), &["server"]);
    let states = |server: &Perch| {
        (
            server.scalar("SELECT count(*) FROM jobs WHERE state = 'cancelled'"),
            server.scalar("SELECT count(*) FROM jobs WHERE state = 'pending'"),
        )
    };
    let (c, p) = states(&server);
    assert_eq!(c + p, 10_000, "every task cancelled or pending");
    assert!(c >= 1_000, "at least the first step stayed cancelled: {c}");
    let out = common::client()
        .args([
            "cancel",
            "--server",
            &server.url,
            "--array",
            &array.to_string(),
        ])
        .output()
        .expect("perch cancel");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(states(&server), (10_000, 0));
}

/// A second server started on a data directory another one serves (a careless restart, a
/// second unit) is refused before it reads or writes anything there, saying why once, and the
/// first goes on serving.
#[test]
fn a_second_server_on_the_same_data_directory_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = Perch::start(dir.path(), &["server"]);
    let out = common::client()
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("run a second server");
    assert!(!out.status.success(), "a second server started");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is another perch server using it?"), "{err}");
    assert_eq!(err.matches("already locked").count(), 1, "said once: {err}");
    assert_eq!(first.scalar("SELECT count(*) FROM jobs"), 0);
}
