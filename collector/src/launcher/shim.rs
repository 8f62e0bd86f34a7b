//! Each job's supervisor: a small root process between the agent and the job, like Slurm's
//! `slurmstepd`, started as `perch __job-shim ... -- <job command line>`.
//!
//! It exists so that a job never outlives the node's lease with nobody to stop it. The agent
//! may die (`kill -9`, a crash, an upgrade) while its jobs run on; the supervisor, in its own
//! session, keeps watching:
//!
//! - it starts the job in a process group of its own and records the group in the root-only
//!   state directory ([`super::groups`]), where the agent (this one or a restarted one) finds it;
//! - it is a child subreaper, so whatever the job leaves behind (a `setsid` daemon, a double
//!   fork, a chain of processes that each fork and exit at once) is re-parented to it: when the
//!   job's first process exits (cancelled, or at its time limit, too), every descendant gets
//!   SIGTERM, then SIGKILL after the job's grace (at most [`LEFTOVER_GRACE_MAX`]), the job's
//!   cgroup `cgroup.kill`, and the supervisor reaps until it has no child left ([`super::tree`]);
//! - it reads the node's lease ([`super::lease`]) once a second: when the agent has not renewed
//!   it in time, it sends the job's checkpoint signal and, at the deadline, SIGKILLs everything,
//!   before the server may start the job elsewhere;
//! - when the job ends it writes `<job>.exit` (attempt, exit code, whether it was fenced) to the
//!   state directory, which the agent reports, even when it was restarted in between.
//!
//! It runs with perch's environment only (the job's variables travel as `PERCH_ENV_*`, applied
//! after the switch to the job's user: see [`super::command`]) and switches to the job's user,
//! when asked, only for the job's process.

use super::groups::GroupState;
use super::lease::{Lease, boot_ms};
use rustix::process::{Pid, Signal, WaitOptions};
use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The hidden subcommand of the `perch` binary that runs [`main`].
pub const SUBCOMMAND: &str = "__job-shim";

const EXIT_HEADER: &str = "perch-exit v1";

/// How one attempt of a job ended, as its supervisor saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitRecord {
    pub attempt: u32,
    /// The exit code, or 128 + the signal that killed it.
    pub code: i32,
    /// The supervisor stopped it because the node's lease was not renewed.
    pub fenced: bool,
}

impl ExitRecord {
    fn path(dir: &Path, job: u64) -> PathBuf {
        dir.join(format!("{job}.exit"))
    }

    /// The exit recorded for `job` in state directory `dir`, if any.
    pub fn read(dir: &Path, job: u64) -> Option<ExitRecord> {
        let text = fs::read_to_string(Self::path(dir, job)).ok()?;
        let mut parts = text.trim().strip_prefix(EXIT_HEADER)?.split_whitespace();
        let rec = ExitRecord {
            attempt: parts.next()?.parse().ok()?,
            code: parts.next()?.parse().ok()?,
            fenced: parts.next()? == "1",
        };
        parts.next().is_none().then_some(rec)
    }

    fn write(self, dir: &Path, job: u64) -> std::io::Result<()> {
        let line = format!(
            "{EXIT_HEADER} {} {} {}\n",
            self.attempt,
            self.code,
            u8::from(self.fenced)
        );
        super::groups::write_private(dir, &format!("{job}.exit"), line.as_bytes(), true)
    }

    /// Forgets `job`'s exit (the server has it).
    pub fn remove(dir: &Path, job: u64) {
        let _ = fs::remove_file(Self::path(dir, job));
    }
}

/// What the agent passes on the supervisor's command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimArgs {
    pub state: PathBuf,
    pub job: u64,
    pub attempt: u32,
    pub signal: String,
    pub grace_secs: u64,
    /// Switch the job to this uid and gid (when `setpriv` does not).
    pub uid_gid: Option<(u32, u32)>,
    /// The job's cgroup, killed whole at the end.
    pub cgroup: Option<PathBuf>,
}

impl ShimArgs {
    /// The arguments after the program, up to and including `--`.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec![
            SUBCOMMAND.into(),
            "--state".into(),
            self.state.clone().into(),
            "--job".into(),
            self.job.to_string().into(),
            "--attempt".into(),
            self.attempt.to_string().into(),
            "--signal".into(),
            self.signal.clone().into(),
            "--grace".into(),
            self.grace_secs.to_string().into(),
        ];
        if let Some((uid, gid)) = self.uid_gid {
            a.extend([
                "--uid".into(),
                uid.to_string().into(),
                "--gid".into(),
                gid.to_string().into(),
            ]);
        }
        if let Some(cg) = &self.cgroup {
            a.extend(["--cgroup".into(), cg.clone().into()]);
        }
        a.push("--".into());
        a
    }

    /// Parses what [`ShimArgs::to_args`] wrote (without the subcommand); returns the job's
    /// command line too.
    pub fn parse(args: &[OsString]) -> Result<(ShimArgs, Vec<OsString>), String> {
        let mut state = None;
        let (mut job, mut attempt, mut signal, mut grace) = (None, None, None, None);
        let (mut uid, mut gid, mut cgroup) = (None, None, None);
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            if flag == "--" {
                let command: Vec<OsString> = it.cloned().collect();
                if command.is_empty() {
                    return Err("no command after --".into());
                }
                let num = |v: Option<String>, what: &str| -> Result<u64, String> {
                    v.ok_or(format!("missing --{what}"))?
                        .parse()
                        .map_err(|e| format!("--{what}: {e}"))
                };
                let parsed = ShimArgs {
                    state: state.ok_or("missing --state")?,
                    job: num(job, "job")?,
                    attempt: u32::try_from(num(attempt, "attempt")?).map_err(|e| e.to_string())?,
                    signal: signal.ok_or("missing --signal")?,
                    grace_secs: num(grace, "grace")?,
                    uid_gid: match (uid, gid) {
                        (Some(u), Some(g)) => Some((
                            u32::try_from(num(Some(u), "uid")?).map_err(|e| e.to_string())?,
                            u32::try_from(num(Some(g), "gid")?).map_err(|e| e.to_string())?,
                        )),
                        (None, None) => None,
                        _ => return Err("--uid and --gid go together".into()),
                    },
                    cgroup,
                };
                return Ok((parsed, command));
            }
            let value = it
                .next()
                .ok_or_else(|| format!("{} needs a value", flag.to_string_lossy()))?;
            let text = || value.to_string_lossy().into_owned();
            match flag.to_str() {
                Some("--state") => state = Some(PathBuf::from(value)),
                Some("--job") => job = Some(text()),
                Some("--attempt") => attempt = Some(text()),
                Some("--signal") => signal = Some(text()),
                Some("--grace") => grace = Some(text()),
                Some("--uid") => uid = Some(text()),
                Some("--gid") => gid = Some(text()),
                Some("--cgroup") => cgroup = Some(PathBuf::from(value)),
                _ => return Err(format!("unknown flag {}", flag.to_string_lossy())),
            }
        }
        Err("missing -- and the job's command".into())
    }
}

fn exit_code(status: rustix::process::WaitStatus) -> i32 {
    status
        .exit_status()
        .or_else(|| status.terminating_signal().map(|s| 128 + s))
        .unwrap_or(128)
}

/// Kills everything of the job: its group, its cgroup, and every descendant of this process.
fn kill_all(pgid: Pid, cgroup: Option<&Path>) {
    let _ = rustix::process::kill_process_group(pgid, Signal::KILL);
    if let Some(cg) = cgroup {
        let _ = fs::write(cg.join("cgroup.kill"), "1");
    }
    super::tree::kill_descendants(rustix::process::getpid().as_raw_nonzero().get());
}

/// The most a process the job left gets between SIGTERM and SIGKILL once the job's first
/// process ended, whatever the job's grace (which its first process had when it was stopped).
const LEFTOVER_GRACE_MAX: Duration = Duration::from_secs(10);

/// How long the supervisor waits for SIGKILLed processes to go: one in uninterruptible sleep
/// (a hung file system, a device) dies only when it wakes.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Ends what the job left once its first process exited: SIGTERM to its group and to every
/// descendant of this process (a child subreaper, so every orphan of the job is one, whatever
/// group or session it moved to), SIGKILL to all of them, its cgroup too, after `grace` or once
/// `lease_out` says the lease's kill deadline passed; and reaps until this process has no
/// child at all (`ECHILD`). Each round looks again, so a process that forks and exits at once,
/// over and over, is caught when it next shows up. Gives up [`KILL_WAIT`] after the SIGKILL,
/// saying so in the job's log.
fn end_leftovers(pgid: Pid, cgroup: Option<&Path>, grace: Duration, lease_out: impl Fn() -> bool) {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let start = Instant::now();
    let mut kill_from = start + grace;
    let mut termed = HashSet::new();
    let mut kill_started = None;
    loop {
        if reap_all() {
            return;
        }
        let now = Instant::now();
        if kill_started.is_none() && now < kill_from && lease_out() {
            kill_from = now;
        }
        let left = super::tree::descendants(Path::new("/proc"), me);
        if now < kill_from {
            if termed.is_empty() {
                let _ = rustix::process::kill_process_group(pgid, Signal::TERM);
            }
            for pid in left {
                if termed.insert(pid)
                    && let Some(pid) = Pid::from_raw(pid)
                {
                    let _ = rustix::process::kill_process(pid, Signal::TERM);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        let since = *kill_started.get_or_insert(now);
        let _ = rustix::process::kill_process_group(pgid, Signal::KILL);
        if let Some(cg) = cgroup {
            let _ = fs::write(cg.join("cgroup.kill"), "1");
        }
        for pid in &left {
            if let Some(pid) = Pid::from_raw(*pid) {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
            }
        }
        if now.duration_since(since) >= KILL_WAIT {
            eprintln!(
                "perch: {} process(es) of the job did not die within {} s of SIGKILL (in uninterruptible sleep?): {left:?}; recording the job's end, they die when they wake",
                left.len(),
                KILL_WAIT.as_secs()
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Reaps every exited child without blocking; true once this process has no child left.
fn reap_all() -> bool {
    loop {
        match rustix::process::wait(WaitOptions::NOHANG) {
            Ok(Some(_)) => {}
            Ok(None) => return false,
            Err(e) => return e == rustix::io::Errno::CHILD,
        }
    }
}

/// Reaps every exited child without blocking; returns the leader's code once it exited.
fn reap(leader: Pid) -> Option<i32> {
    let mut code = None;
    while let Ok(Some((pid, status))) = rustix::process::wait(WaitOptions::NOHANG) {
        if pid == leader {
            code = Some(exit_code(status));
        }
    }
    code
}

/// Runs the supervisor with `args` (after the subcommand); returns the process's exit code.
pub fn main(args: &[OsString]) -> i32 {
    let (a, command) = match ShimArgs::parse(args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("perch {SUBCOMMAND}: {e}");
            return 2;
        }
    };
    // Its own session: no terminal's or agent's signal reaches it by accident.
    let _ = rustix::process::setsid();
    let me = rustix::process::getpid();
    if let Err(e) = rustix::process::set_child_subreaper(Some(me)) {
        eprintln!(
            "perch: cannot adopt the job's orphans ({e}); processes that leave its group may outlive it"
        );
    }
    let fail = |code: i32| {
        let rec = ExitRecord {
            attempt: a.attempt,
            code,
            fenced: false,
        };
        if let Err(e) = rec.write(&a.state, a.job) {
            eprintln!("perch: cannot record the job's exit: {e}");
        }
        code
    };
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..]).process_group(0);
    if let Some((uid, gid)) = a.uid_gid {
        cmd.uid(uid).gid(gid);
    }
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "perch: job not started: cannot run {:?}: {e}",
                command[0].to_string_lossy()
            );
            return fail(127);
        }
    };
    let raw = i32::try_from(child.id()).unwrap_or(i32::MAX);
    let Some(leader) = Pid::from_raw(raw) else {
        return fail(127);
    };
    let groups = GroupState::at(&a.state, Path::new("/proc"));
    if let Err(e) = groups.record(a.job, raw) {
        eprintln!("perch: cannot record the job's process group ({e}); stopping it");
        kill_all(leader, a.cgroup.as_deref());
        return fail(128 + 9);
    }
    // std's `Child` is not used past here: the leader is reaped by `reap`, with the orphans.
    drop(child);
    let grace_ms = i64::try_from(a.grace_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    let mut fenced = false;
    let mut killed = false;
    let code = loop {
        if let Some(code) = reap(leader) {
            break code;
        }
        let now = boot_ms();
        let deadlines = Lease::read(&a.state).map(|l| l.deadlines(grace_ms));
        let (signal_at, kill_at) =
            deadlines.map_or((i64::MIN, i64::MIN), |d| (d.signal_at, d.kill_at));
        if now >= signal_at && !fenced {
            fenced = true;
            eprintln!(
                "perch: this node's lease was not renewed (its agent is gone or cannot reach the server); stopping the job ({}) before the server may run it elsewhere",
                a.signal
            );
            let _ = rustix::process::kill_process_group(leader, super::signal_named(&a.signal));
        }
        if now >= kill_at && !killed {
            killed = true;
            kill_all(leader, a.cgroup.as_deref());
        }
        std::thread::sleep(Duration::from_millis(if fenced { 100 } else { 500 }));
    };
    // The job's first process ended: whatever it left goes too, then the record. Left over
    // after a SIGKILL of everything (the lease ran out) it gets no grace.
    let grace = if killed {
        Duration::ZERO
    } else {
        Duration::from_secs(a.grace_secs).min(LEFTOVER_GRACE_MAX)
    };
    end_leftovers(leader, a.cgroup.as_deref(), grace, || {
        Lease::read(&a.state).is_none_or(|l| boot_ms() >= l.deadlines(grace_ms).kill_at)
    });
    let rec = ExitRecord {
        attempt: a.attempt,
        code,
        fenced,
    };
    if let Err(e) = rec.write(&a.state, a.job) {
        eprintln!("perch: cannot record the job's exit: {e}");
        return 1;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_round_trip() {
        let a = ShimArgs {
            state: "/var/lib/perch/jobs/.state".into(),
            job: 42,
            attempt: 3,
            signal: "SIGUSR1".into(),
            grace_secs: 60,
            uid_gid: Some((1001, 1001)),
            cgroup: Some("/sys/fs/cgroup/perch/job-42".into()),
        };
        let mut args = a.to_args();
        assert_eq!(args.remove(0), SUBCOMMAND);
        args.extend(["python".into(), "--".into(), "train.py".into()]);
        let (parsed, command) = ShimArgs::parse(&args).expect("parse");
        assert_eq!(parsed, a);
        assert_eq!(command, vec!["python", "--", "train.py"]);
        for bad in [
            vec!["--job", "1"],
            vec!["--job", "x", "--"],
            vec![
                "--state",
                "/s",
                "--job",
                "1",
                "--attempt",
                "1",
                "--signal",
                "SIGTERM",
                "--grace",
                "1",
                "--",
            ],
            vec![
                "--uid",
                "5",
                "--state",
                "/s",
                "--job",
                "1",
                "--attempt",
                "1",
                "--signal",
                "S",
                "--grace",
                "1",
                "--",
                "x",
            ],
            vec!["--bogus", "1"],
        ] {
            let args: Vec<OsString> = bad.iter().map(OsString::from).collect();
            assert!(ShimArgs::parse(&args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn exit_records_round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(ExitRecord::read(dir.path(), 7), None);
        let rec = ExitRecord {
            attempt: 2,
            code: 137,
            fenced: true,
        };
        rec.write(dir.path(), 7).expect("write");
        assert_eq!(ExitRecord::read(dir.path(), 7), Some(rec));
        ExitRecord::remove(dir.path(), 7);
        assert_eq!(ExitRecord::read(dir.path(), 7), None);
    }
}
