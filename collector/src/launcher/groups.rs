//! Which process groups a restarted agent may kill.
//!
//! An agent that dies leaves its jobs running; the next agent kills them (the server has
//! requeued them). It must kill only what it can prove its predecessor started: a file in the
//! job's directory (which the job's user owns) could name any group, even `1`, and a record
//! from before a reboot names whatever group now has that id. So each job's group is kept in
//! a root-only state directory (mode 700, `<jobs dir>/.state/`, not in the job's directory),
//! one file per job, `<job>.group`, replaced atomically:
//!
//! ```text
//! perch-group v1 <pgid> <boot id> <leader start time>
//! ```
//!
//! `boot id` is `/proc/sys/kernel/random/boot_id` when the job started and `leader start time`
//! field 22 of `/proc/<pgid>/stat` (clock ticks since boot). A group is killed only when the
//! boot id is this boot's and a process `<pgid>` still leads group `<pgid>` with that start
//! time: the very process the agent started. Anything else (another version, an unreadable
//! or foreign record, a group whose leader has exited) is left alone and logged. A record
//! whose version is unknown is ignored (and removed), never guessed at.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

const HEADER: &str = "perch-group v1";

/// One job's process group as the agent started it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    pub pgid: i32,
    pub boot_id: String,
    pub start_time: u64,
}

impl GroupRecord {
    fn to_line(&self) -> String {
        format!(
            "{HEADER} {} {} {}\n",
            self.pgid, self.boot_id, self.start_time
        )
    }

    fn parse(text: &str) -> Option<GroupRecord> {
        let rest = text.trim().strip_prefix(HEADER)?;
        let mut parts = rest.split_whitespace();
        let pgid = parts.next()?.parse().ok().filter(|&p: &i32| p > 1)?;
        let boot_id = parts.next()?.to_owned();
        let start_time = parts.next()?.parse().ok()?;
        parts.next().is_none().then_some(GroupRecord {
            pgid,
            boot_id,
            start_time,
        })
    }
}

/// Replaces `dir/name` with `bytes` atomically (a temporary file, then a rename), readable by
/// root only; `durable` fsyncs it first. Every record of the state directory is written so.
pub fn write_private(dir: &Path, name: &str, bytes: &[u8], durable: bool) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    if durable {
        f.sync_all()?;
    }
    fs::rename(&tmp, dir.join(name))
}

/// This boot's id.
pub fn boot_id(proc_root: &Path) -> Option<String> {
    fs::read_to_string(proc_root.join("sys/kernel/random/boot_id"))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// What perch reads of a process in `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// `R`, `S`, `Z` (a zombie: exited, not reaped)...
    pub state: char,
    pub ppid: i32,
    pub pgrp: i32,
    /// Clock ticks since boot.
    pub start: u64,
}

/// Process `pid`'s [`ProcStat`] under `proc_root` (`/proc`).
pub fn proc_stat(proc_root: &Path, pid: i32) -> Option<ProcStat> {
    let stat = fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    // The command name may hold spaces and ')': the fields start after the last ')'.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    // fields[0] is field 3 (state): ppid is field 4, pgrp field 5, starttime field 22.
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: fields.get(2)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
    })
}

/// (process group, start time) of process `pid`.
pub fn group_and_start(proc_root: &Path, pid: i32) -> Option<(i32, u64)> {
    proc_stat(proc_root, pid).map(|s| (s.pgrp, s.start))
}

/// The state directory: root-only, one record per running job.
#[derive(Debug, Clone)]
pub struct GroupState {
    dir: PathBuf,
    proc_root: PathBuf,
}

impl GroupState {
    /// The state directory `dir` as it is (a job's supervisor records its group there).
    pub fn at(dir: &Path, proc_root: &Path) -> GroupState {
        GroupState {
            dir: dir.to_path_buf(),
            proc_root: proc_root.to_path_buf(),
        }
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The group recorded for `job`, when it is provably still the one that was started (this
    /// boot, the same leader): see the module documentation.
    pub fn provable(&self, job: u64) -> Option<i32> {
        let rec = GroupRecord::parse(&fs::read_to_string(self.path(job)).ok()?)?;
        self.proves(&rec).then_some(rec.pgid)
    }

    fn proves(&self, rec: &GroupRecord) -> bool {
        boot_id(&self.proc_root).as_deref() == Some(rec.boot_id.as_str())
            && group_and_start(&self.proc_root, rec.pgid) == Some((rec.pgid, rec.start_time))
    }

    /// Opens (creating, mode 700) the state directory `dir`; `proc_root` is `/proc`.
    pub fn open(dir: &Path, proc_root: &Path) -> std::io::Result<GroupState> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
        Ok(GroupState {
            dir: dir.to_path_buf(),
            proc_root: proc_root.to_path_buf(),
        })
    }

    fn path(&self, job: u64) -> PathBuf {
        self.dir.join(format!("{job}.group"))
    }

    /// Records job `job`'s group, led by `pgid` (the agent's child, not yet reaped).
    pub fn record(&self, job: u64, pgid: i32) -> std::io::Result<()> {
        let boot_id = boot_id(&self.proc_root)
            .ok_or_else(|| std::io::Error::other("cannot read this boot's id"))?;
        let (_, start_time) = group_and_start(&self.proc_root, pgid)
            .ok_or_else(|| std::io::Error::other(format!("cannot read /proc/{pgid}/stat")))?;
        let rec = GroupRecord {
            pgid,
            boot_id,
            start_time,
        };
        write_private(
            &self.dir,
            &format!("{job}.group"),
            rec.to_line().as_bytes(),
            true,
        )
    }

    /// Forgets job `job`'s group (it ended).
    pub fn forget(&self, job: u64) {
        let _ = fs::remove_file(self.path(job));
    }

    /// The groups recorded by a previous agent that are provably its jobs' still, by job,
    /// except the jobs in `keep` (re-adopted); every other group record is removed. What
    /// cannot be proved is logged and left alone. Files other than group records are kept.
    pub fn take_provable(&self, keep: &std::collections::HashSet<u64>) -> Vec<(String, i32)> {
        let boot = boot_id(&self.proc_root);
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(job) = name.strip_suffix(".group") else {
                continue;
            };
            if job.parse().is_ok_and(|j| keep.contains(&j)) {
                continue;
            }
            let rec = fs::read_to_string(&path)
                .ok()
                .and_then(|t| GroupRecord::parse(&t));
            let _ = fs::remove_file(&path);
            let Some(rec) = rec else {
                tracing::warn!(job, "unreadable process group record; nothing killed");
                continue;
            };
            if boot.as_deref() != Some(rec.boot_id.as_str()) {
                tracing::info!(
                    job,
                    "process group record from an earlier boot; nothing killed"
                );
                continue;
            }
            match group_and_start(&self.proc_root, rec.pgid) {
                Some((pgrp, start)) if pgrp == rec.pgid && start == rec.start_time => {
                    out.push((job.to_owned(), rec.pgid));
                }
                _ => tracing::info!(
                    job,
                    pgid = rec.pgid,
                    "the job's group leader is gone or another process has its id; nothing killed"
                ),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let rec = GroupRecord {
            pgid: 4242,
            boot_id: "b0".into(),
            start_time: 77,
        };
        assert_eq!(GroupRecord::parse(&rec.to_line()), Some(rec));
        for bad in [
            "4242",
            "perch-group v2 4242 b0 77",
            "perch-group v1 1 b0 77",
            "perch-group v1 -5 b0 77",
            "perch-group v1 4242 b0",
            "perch-group v1 4242 b0 77 extra",
        ] {
            assert_eq!(GroupRecord::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_the_group_the_agent_started_in_this_boot_is_provable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let proc_root = Path::new("/proc");
        let state = GroupState::open(&dir.path().join("state"), proc_root).expect("state");
        let mode = fs::metadata(dir.path().join("state"))
            .expect("state dir")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("sleep");
        let pid = i32::try_from(child.id()).expect("pid");
        state.record(1, pid).expect("record");
        // A forged record (the right boot, a wrong start time) and one from another boot.
        let (_, start) = group_and_start(proc_root, pid).expect("stat");
        let boot = boot_id(proc_root).expect("boot id");
        fs::write(
            dir.path().join("state/2.group"),
            format!("{HEADER} {pid} {boot} {}\n", start + 1),
        )
        .expect("write");
        fs::write(
            dir.path().join("state/3.group"),
            format!("{HEADER} {pid} another-boot {start}\n"),
        )
        .expect("write");
        assert_eq!(state.provable(1), Some(pid));
        assert_eq!(state.provable(2), None, "wrong start time");
        assert_eq!(state.provable(3), None, "another boot");
        assert_eq!(
            state.take_provable(&[1].into_iter().collect()),
            vec![],
            "job 1 is kept (re-adopted)"
        );
        assert_eq!(
            state.take_provable(&Default::default()),
            vec![("1".to_owned(), pid)]
        );
        assert!(
            fs::read_dir(dir.path().join("state"))
                .expect("dir")
                .next()
                .is_none(),
            "records removed"
        );
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// What a restarted agent needs to take over a supervised job that still runs (or to report
/// how it ended): written by the agent to `<job>.run` in the state directory once the job
/// started, removed once the server has its exit.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunRecord {
    pub version: u32,
    pub attempt: u32,
    pub boot_id: String,
    /// The supervisor: pid and start time (it is alive only while both match). `None` (with
    /// `pgid`) in the record written before the supervisor starts: an agent that dies right
    /// then leaves the job findable, its supervisor being the parent of its recorded group.
    pub supervisor: Option<(i32, u64)>,
    pub pgid: Option<i32>,
    pub user: String,
    pub gpus: Vec<u32>,
    pub shared: bool,
    pub sim_profile: Option<String>,
    pub time_limit_secs: u64,
    /// When it started, `CLOCK_BOOTTIME` ms.
    pub started_boot_ms: i64,
    pub signal: String,
    pub grace_secs: u64,
    pub cgroup: Option<PathBuf>,
    /// (device, inode) of its stdout and stderr as the agent created them: a restarted agent
    /// reads a log only if the entry is still that very file (the job's user owns the
    /// directory and could put a link to any file there).
    pub logs: [(u64, u64); 2],
    /// The rendezvous port picked for the job here, reported to the server while it runs.
    #[serde(default)]
    pub master_port: Option<u16>,
}

const RUN_VERSION: u32 = 1;

impl RunRecord {
    pub fn new_version() -> u32 {
        RUN_VERSION
    }

    fn path(dir: &Path, job: u64) -> PathBuf {
        dir.join(format!("{job}.run"))
    }

    /// Writes the record for `job` (replaced atomically, root-only).
    pub fn write(&self, dir: &Path, job: u64) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        write_private(dir, &format!("{job}.run"), &bytes, true)
    }

    /// Every job's record in `dir`; unreadable ones (or another version's) are removed.
    pub fn all(dir: &Path) -> Vec<(u64, RunRecord)> {
        let mut out = Vec::new();
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(job) = name.strip_suffix(".run").and_then(|j| j.parse().ok()) else {
                continue;
            };
            match fs::read(entry.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<RunRecord>(&b).ok())
                .filter(|r| r.version == RUN_VERSION)
            {
                Some(r) => out.push((job, r)),
                None => {
                    tracing::warn!(job, "unreadable job record; the job is not taken over");
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        out.sort_by_key(|(j, _)| *j);
        out
    }

    /// Forgets `job`'s record.
    pub fn remove(dir: &Path, job: u64) {
        let _ = fs::remove_file(Self::path(dir, job));
    }
}

/// Whether process `pid` is alive (not a zombie) and started at `start` (clock ticks since boot).
pub fn alive(proc_root: &Path, (pid, start): (i32, u64)) -> bool {
    proc_stat(proc_root, pid).is_some_and(|s| s.state != 'Z' && s.start == start)
}
