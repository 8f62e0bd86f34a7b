//! A process's descendants, read from `/proc`: what is left of a job after its leader exits,
//! including processes that left its process group (`setsid`, a daemonizing double fork).
//!
//! A job's supervisor ([`super::shim`]) is a child subreaper, so every orphan the job leaves is
//! re-parented to it rather than to init: the supervisor's descendants are exactly the job's
//! processes, whatever groups or sessions they moved to.

use rustix::process::{Pid, Signal};
use std::collections::HashMap;
use std::fs;
use std::path::Path;

/// The live (not zombie) descendants of `root`, parents before children.
pub fn descendants(proc_root: &Path, root: i32) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<(i32, char)>> = HashMap::new();
    for entry in fs::read_dir(proc_root).into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(s) = super::groups::proc_stat(proc_root, pid) {
            children.entry(s.ppid).or_default().push((pid, s.state));
        }
    }
    let mut out = Vec::new();
    let mut next = vec![root];
    while let Some(p) = next.pop() {
        for &(child, state) in children.get(&p).map(Vec::as_slice).unwrap_or_default() {
            if state != 'Z' {
                out.push(child);
            }
            next.push(child);
        }
    }
    out
}

/// SIGKILLs every descendant of `root` (not `root` itself), again while new ones appear (a
/// process may fork while the first round is sent), at most 50 rounds. Returns how many it
/// signalled.
pub fn kill_descendants(root: i32) -> usize {
    let mut killed = 0;
    for _ in 0..50 {
        let left = descendants(Path::new("/proc"), root);
        if left.is_empty() {
            break;
        }
        for pid in left {
            if let Some(pid) = Pid::from_raw(pid)
                && rustix::process::kill_process(pid, Signal::KILL).is_ok()
            {
                killed += 1;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_and_kills_grandchildren_that_left_the_group() {
        // sh starts a grandchild in a new session (setsid), then waits.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "setsid sleep 30 & sleep 30 & wait"])
            .spawn()
            .expect("sh");
        let root = i32::try_from(child.id()).expect("pid");
        let mut found = Vec::new();
        for _ in 0..100 {
            found = descendants(Path::new("/proc"), root);
            if found.len() >= 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(found.len() >= 2, "{found:?}");
        assert!(kill_descendants(root) >= 2);
        let _ = child.wait();
        assert!(
            descendants(Path::new("/proc"), root).is_empty(),
            "nothing left"
        );
    }

    #[test]
    fn fixture_trees_are_walked_parents_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (pid, ppid, state) in [
            (10, 1, 'S'),
            (11, 10, 'S'),
            (12, 11, 'Z'),
            (13, 12, 'R'),
            (20, 1, 'S'),
        ] {
            let d = dir.path().join(pid.to_string());
            fs::create_dir_all(&d).expect("dir");
            fs::write(
                d.join("stat"),
                format!("{pid} (a b) c) {state} {ppid} {pid}{}", " 0".repeat(17)),
            )
            .expect("stat");
        }
        let mut got = descendants(dir.path(), 10);
        got.sort_unstable();
        assert_eq!(got, vec![11, 13], "the zombie is skipped, its child is not");
    }
}
