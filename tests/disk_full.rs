//! A full disk must not lose acknowledged telemetry, and perch must recover by itself
//! once there is room again. The server's data directory is a small tmpfs (a real filesystem
//! that fills up); the test fills it while an agent streams samples, then frees it.

mod common;

use common::{Agent, wait_for};
use std::process::Command;
use std::time::Duration;

/// Unmounts the tmpfs however the test ends.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A temporary directory whose `server` subdirectory (the server's data directory) is a
/// 24 MiB tmpfs, unmounted when the returned guard drops.
fn small_disk() -> (tempfile::TempDir, std::path::PathBuf, Mount) {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("server");
    std::fs::create_dir_all(&data).expect("mkdir");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=24m", "tmpfs"])
        .arg(&data)
        .status()
        .expect("mount");
    assert!(
        mounted.success(),
        "mounting a tmpfs needs root (CI runs as root)"
    );
    let mount = Mount(data.clone());
    (dir, data, mount)
}

#[test]
fn a_full_disk_loses_no_acknowledged_sample_and_perch_recovers_by_itself() {
    let (dir, data, _mount) = small_disk();
    let mut perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nflush_interval_secs = 2\n[alerts]\nevaluation_interval = \"2s\"\n",
        &[],
    );
    let _agent = Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        2,
        None,
        &["--interval-ms", "200"],
    );
    let count = |perch: &common::Perch, from: i64, to: i64| {
        perch.scalar(&format!(
            "SELECT count(*) FROM gpu_samples WHERE node = 'gpu-a' \
             AND to_unixtime(time) * 1000 >= {from} AND to_unixtime(time) * 1000 < {to}"
        ))
    };
    wait_for("samples before the disk fills", || {
        (count(&perch, 0, i64::MAX / 2) > 20).then_some(())
    });

    // Fill the disk to the last byte.
    let full_from = common::now_ms();
    let filler = data.join("filler");
    let written = Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", filler.display()))
        .output()
        .expect("dd");
    assert!(
        String::from_utf8_lossy(&written.stderr).contains("No space left"),
        "{}",
        String::from_utf8_lossy(&written.stderr)
    );
    // Ingest is refused (the write-ahead log cannot grow), flushes fail, and perch says so.
    wait_for("StoreFlushFailing firing", || {
        let alerts = perch.get("/v1/alerts");
        alerts["alerts"]
            .as_array()?
            .iter()
            .any(|a| a["labels"]["alertname"] == "StoreFlushFailing" && a["state"] == "firing")
            .then_some(())
    });
    let before = count(&perch, 0, i64::MAX / 2);
    std::thread::sleep(Duration::from_secs(2));
    let full_to = common::now_ms();

    // Room again: nothing to do but wait.
    std::fs::remove_file(&filler).expect("free the disk");
    wait_for("the samples taken while the disk was full", || {
        (count(&perch, full_from + 1000, full_to) > 0).then_some(())
    });
    wait_for("flushes working again", || {
        let metrics = reqwest::blocking::get(format!("{}/metrics", perch.url))
            .ok()?
            .text()
            .ok()?;
        metrics
            .lines()
            .filter(|l| l.starts_with("perch_store_flush_failures_in_a_row"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .any(|v| v == 0.0)
            .then_some(())
    });
    let after = count(&perch, 0, i64::MAX / 2);
    assert!(after > before, "{after} <= {before}");

    // Every acknowledged sample is still there after a kill -9.
    let acknowledged = count(&perch, 0, full_to);
    perch.kill();
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nflush_interval_secs = 2\n",
        &[],
    );
    assert!(count(&perch, 0, full_to) >= acknowledged);
}

/// With the data directory full, a commit of the job database failed and every
/// later submit, listing and agent sync answered 500, even after space returned, while
/// `/readyz` said ready; agents could not renew their leases. Now: refusals are 503
/// `job_db_unavailable`, `/readyz` and the built-in alert `JobDatabaseFailing` say why, agents'
/// syncs renew their leases (the running job outlives its 5 s lease several times over), and
/// once there is room the job database is reopened by itself: submissions work again, the job
/// still runs its first attempt, and no refused submission became a job.
#[test]
fn a_full_disk_refuses_job_changes_keeps_leases_and_the_job_database_recovers() {
    let (dir, data, _mount) = small_disk();
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\nnode_stale_after_secs = 2\nnode_lease_secs = 5\n\
         [alerts]\nevaluation_interval = \"1s\"\n",
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
    let client = reqwest::blocking::Client::new();
    let submit = |command: Vec<&str>, pad: usize| {
        // Up to 180 KiB a job: the environment's limit is 64 KiB, an argument's 128 KiB.
        let env = serde_json::json!({ "PAD": "x".repeat(pad.min(60 << 10)) });
        let mut command: Vec<String> = command.into_iter().map(str::to_owned).collect();
        if pad > 0 {
            command.push("x".repeat(pad.saturating_sub(60 << 10).min(120 << 10)));
        }
        client
            .post(format!("{}/v1/jobs", perch.url))
            .json(&serde_json::json!({
                "name": "pad", "command": command, "gpus_per_node": 1,
                "env": env, "time_limit_secs": 3600
            }))
            .send()
            .expect("submit")
    };
    let marker = format!("sleep {}", 600 + std::process::id() % 300);
    let first = submit(vec!["sh", "-c", &marker], 0);
    assert!(first.status().is_success(), "{:?}", first.text());
    let running = || {
        let job = perch.get("/v1/jobs/1");
        (job["state"] == "running").then_some(job)
    };
    wait_for("the job to run", running);
    let alive = || {
        Command::new("pgrep")
            .args(["-f", &marker])
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    wait_for("its process", || alive().then_some(()));

    // Fill the disk to the last byte, then submit until a commit cannot be written.
    let filler = data.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", filler.display()))
        .output()
        .expect("dd");
    let mut accepted = 1;
    let refused = loop {
        let response = submit(vec!["true"], 180 << 10);
        let status = response.status().as_u16();
        let body: serde_json::Value = response.json().expect("JSON");
        match status {
            201 | 200 => accepted += 1,
            503 => break body,
            other => panic!("a submission on a full disk answered {other}: {body}"),
        }
        assert!(accepted < 200, "24 MiB never filled");
    };
    assert_eq!(refused["error"]["code"], "job_db_unavailable", "{refused}");
    let full_since = std::time::Instant::now();
    let ready = || {
        client
            .get(format!("{}/readyz", perch.url))
            .send()
            .expect("readyz")
    };
    let not_ready = ready();
    assert_eq!(not_ready.status().as_u16(), 503);
    assert!(
        not_ready
            .text()
            .unwrap_or_default()
            .contains("job database")
    );
    wait_for("JobDatabaseFailing firing", || {
        // The job database may reopen on a full disk (redb reuses pages inside its file): a
        // change too large for what is left fails it again, so the failure lasts until the
        // alert has seen it. One that fits is accepted, and counted.
        let response = submit(vec!["true"], 180 << 10);
        match response.status().as_u16() {
            201 | 200 => accepted += 1,
            503 => {}
            other => panic!("a submission on a full disk answered {other}"),
        }
        let alerts = perch.get("/v1/alerts");
        alerts["alerts"]
            .as_array()?
            .iter()
            .any(|a| a["labels"]["alertname"] == "JobDatabaseFailing" && a["state"] == "firing")
            .then_some(())
    });
    // Three leases long: without renewals the agent would have stopped the job.
    while full_since.elapsed() < Duration::from_secs(15) {
        assert!(
            alive(),
            "the job was stopped while the job database could not commit"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Whatever perch gave back meanwhile (a write-ahead log segment it could not begin, pages
    // redb freed inside its file) is taken again: the disk is full when this is sent.
    let topped_up = data.join("filler-2");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4k"])
        .arg(format!("of={}", topped_up.display()))
        .output()
        .expect("dd");
    let still = submit(vec!["true"], 180 << 10);
    assert_eq!(still.status().as_u16(), 503, "{:?}", still.text());

    // Room again: the job database comes back by itself.
    std::fs::remove_file(&filler).expect("free the disk");
    std::fs::remove_file(&topped_up).expect("free the disk");
    wait_for("/readyz ready again", || {
        (ready().status().as_u16() == 200).then_some(())
    });
    let again = submit(vec!["true"], 0);
    assert!(again.status().is_success(), "{:?}", again.text());
    let job = perch.get("/v1/jobs/1");
    assert_eq!(job["state"], "running", "{job}");
    assert_eq!(job["attempts"], 1, "{job}");
    assert!(alive());
    // Every accepted job is there, and nothing refused became one: ids run 1..=accepted, then
    // the one submitted since.
    let listed = perch.get("/v1/jobs?limit=1000");
    let mut ids: Vec<u64> = listed["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .filter_map(|j| j["id"].as_u64())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids.len(), accepted + 1, "{ids:?}");
    assert_eq!(
        ids[..accepted],
        (1..=accepted as u64).collect::<Vec<_>>()[..]
    );
}
