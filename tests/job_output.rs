//! Job output on the server's disk, on the real binary: a job's sparse stdout is stored sparse
//! (its holes are not shipped nor written), and a user's stored output is bounded by
//! `server.max_job_output_mb_per_user` without touching another user's.

mod common;

use common::{Perch, wait_for};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// The server's stored stdout of attempt 1 of `job` (`.../logs/<job>/a1/<node>.stdout`)
/// somewhere under `dir`.
fn stored_stdout(dir: &Path, job: u64) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry.file_type().ok()?.is_dir() {
            continue;
        }
        if path.file_name().is_some_and(|n| n == "logs") {
            let attempt = path.join(job.to_string()).join("a1");
            if let Some(file) = std::fs::read_dir(&attempt).ok().and_then(|files| {
                files
                    .flatten()
                    .map(|f| f.path())
                    .find(|f| f.extension().is_some_and(|e| e == "stdout"))
            }) {
                return Some(file);
            }
        }
        if let Some(found) = stored_stdout(&path, job) {
            return Some(found);
        }
    }
    None
}

fn up(dir: &Path, config: &str) -> Perch {
    let file = dir.join("perch.toml");
    std::fs::write(&file, config).expect("config");
    Perch::start(
        &dir.join("perch"),
        &[
            "--config",
            file.to_str().expect("utf-8"),
            "up",
            "--simulate-gpus",
            "2",
            "--interval-ms",
            "200",
        ],
    )
}

fn wait_state(perch: &Perch, id: u64, state: &str) -> serde_json::Value {
    wait_for(&format!("job {id} to be {state}"), || {
        let j = perch.job(id);
        (j["state"] == state).then_some(j)
    })
}

/// A one-second job whose stdout is 600 MiB of hole and `end`: it put 600 MiB on the server's
/// disk. Now the server's copy is as long, uses almost nothing, and ends in `end`.
#[test]
fn a_sparse_stdout_is_stored_sparse() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = up(dir.path(), "");
    let (ok, _, err) = perch.cli_as(
        "alice",
        &[
            "submit",
            "--",
            "python3",
            "-c",
            "import os; os.lseek(1, 600 << 20, 0); os.write(1, b'end\\n')",
        ],
    );
    assert!(ok, "{err}");
    wait_state(&perch, 1, "completed");
    let length = 600 * MIB + 4;
    let path = wait_for("the whole stdout on the server", || {
        let path = stored_stdout(dir.path(), 1)?;
        (std::fs::metadata(&path).ok()?.len() == length).then_some(path)
    });
    let used = std::fs::metadata(&path).expect("stored").blocks() * 512;
    assert!(used <= MIB, "the stored copy uses {used} bytes of disk");
    let file = std::fs::File::open(&path).expect("open");
    let mut tail = [0; 4];
    file.read_exact_at(&mut tail, length - 4).expect("read");
    assert_eq!(&tail, b"end\n");
    // What `perch logs` serves of it: its length, and the tail.
    let answer = reqwest::blocking::get(format!(
        "{}/v1/jobs/1/logs?offset={}",
        perch.url,
        length - 4
    ))
    .expect("logs");
    assert_eq!(
        answer.headers()["x-perch-log-size"].to_str().ok(),
        Some(length.to_string().as_str())
    );
    assert_eq!(answer.text().expect("body"), "end\n");
}

/// With `server.max_job_output_mb_per_user = 1`, alice's job printing 3 MiB stores at most
/// the bound (plus a chunk) and its timeline says why, naming the key; the node is told the
/// rest was taken (its copy goes); bob's job's output is stored whole.
#[test]
fn a_users_stored_output_is_bounded_and_another_users_is_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = up(dir.path(), "[server]\nmax_job_output_mb_per_user = 1\n");
    let (ok, _, err) = perch.cli_as(
        "alice",
        &[
            "submit",
            "--",
            "sh",
            "-c",
            "yes perch-output | head -c 3145728",
        ],
    );
    assert!(ok, "{err}");
    let j = wait_state(&perch, 1, "completed");
    let path = wait_for("all of alice's output taken", || {
        let path = stored_stdout(dir.path(), 1)?;
        (std::fs::metadata(&path).ok()?.len() == 3 * MIB).then_some(path)
    });
    let used = std::fs::metadata(&path).expect("stored").blocks() * 512;
    assert!(
        used <= MIB + (256 << 10),
        "alice's stored output uses {used} bytes of disk"
    );
    let note = wait_for("the job's note", || {
        let j = perch.job(1);
        j["timeline"]
            .as_array()?
            .iter()
            .filter_map(|t| t["event"].as_str())
            .find(|e| e.contains("was not stored"))
            .map(str::to_owned)
    });
    assert!(
        note.contains("server.max_job_output_mb_per_user") && note.contains("alice"),
        "{note} ({j})"
    );
    // The node's copy goes: it was told the output was taken.
    let jobs = dir.path().join("perch").join("jobs");
    wait_for("the node's copy of alice's output to go", || {
        let nodes = std::fs::read_dir(&jobs).ok()?;
        nodes
            .flatten()
            .all(|n| !n.path().join("1").join("stdout").exists())
            .then_some(())
    });
    let (ok, _, err) = perch.cli_as("bob", &["submit", "--", "echo", "bob-output"]);
    assert!(ok, "{err}");
    wait_state(&perch, 2, "completed");
    let out = wait_for("bob's output", || {
        let (_, out, _) = perch.cli_as("bob", &["logs", "2"]);
        (!out.is_empty()).then_some(out)
    });
    assert_eq!(out, "bob-output\n");
}
