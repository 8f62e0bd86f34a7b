//! Starting one attempt of a job: the steps from a launch order to a running process group.
//!
//! [`Launcher::spawn`] takes them in turn: the job's directory and fresh logs, the identity it
//! runs under ([`identity`](super::identity)), its working directory checked as that user, the
//! rendezvous it needs (hostfile, master port), its files given to its user, its cgroup, the
//! command ([`command`](super::command)) and the process itself, recorded for a restarted agent
//! before and after it starts ([`groups`](super::groups)). A step that fails ends the start
//! with a [`NotStarted`], whose text becomes the job's reason on the server.

use super::cgroup::JobCgroup;
use super::groups::{self, RunRecord};
use super::identity::{self, Decision, Identity};
use super::shim::{ExitRecord, ShimArgs};
use super::{
    Launcher, NotStarted, Running, command, create_log, file_id, lease, otel, pick_master_port,
};
use perch_model::control::JobLaunch;
use rustix::process::Pid;
use std::borrow::Cow;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a launch waits for its supervisor to start the job.
const SUPERVISOR_START: Duration = Duration::from_secs(10);

impl NotStarted {
    /// A step that failed on an I/O error: reported as a shell reports a program it cannot run
    /// (127), `what` saying which step.
    fn io(what: &str, e: std::io::Error) -> NotStarted {
        NotStarted {
            code: 127,
            why: format!("{what}: {e}"),
        }
    }
}

/// A job's first process, just started: what [`Launcher::start_process`] returns.
struct Started {
    child: Child,
    /// The job's process group leader (its first process, or the one its supervisor started).
    leader: i32,
    pgid: Pid,
    /// The supervisor's (pid, start time), when the job has one.
    supervisor: Option<(i32, u64)>,
}

impl Launcher {
    /// Starts attempt `l` of a job, step by step (the module's doc lists them); the first step
    /// that fails says why the job did not start.
    pub(super) fn spawn(&mut self, l: &JobLaunch) -> Result<Running, NotStarted> {
        let dir = self.job_dir(l.job);
        let [stdout, mut stderr] = self.create_logs(l, &dir)?;
        let user = self.identity(l)?;
        self.check_workdir(l, user.as_ref())?;
        let hostfile = write_hostfile(l, &dir)?;
        let master_port = l.pick_master_port.then(|| pick_master_port(l));
        let hostfile_path = hostfile.as_ref().map(|(path, _)| path.as_path());
        let launch = with_rendezvous(l, master_port, hostfile_path);
        let l: &JobLaunch = &launch;
        if let Some(id) = &user {
            let hostfile = hostfile.as_ref().map(|(_, f)| f);
            give_to_user(id, &dir, [&stdout, &stderr], hostfile)?;
        }
        let cgroup = self.cgroup(l, &mut stderr);
        let logs = [file_id(&stdout), file_id(&stderr)];
        let state = self.state_dir().to_path_buf();
        // What an earlier attempt left here is not this attempt's.
        self.groups.forget(l.job);
        ExitRecord::remove(&state, l.job);
        let (cmd, env) = self.command(l, user.as_ref(), cgroup.as_ref(), &dir, [stdout, stderr])?;
        // Recorded before the supervisor starts, so that an agent that dies at any point from
        // here on leaves the job to its successor; completed below.
        let mut record = self
            .supervisor
            .is_some()
            .then(|| run_record(l, cgroup.as_ref(), logs, master_port));
        if let Some(r) = &record {
            write_record(&state, l.job, r);
        }
        let mut started = self.start_process(l, cmd, cgroup.as_ref())?;
        self.report_start(l, &env);
        let cgroup = self.enter_cgroup(l.job, cgroup, started.leader, &mut started.child);
        let running = Running {
            attempt: l.attempt,
            child: Some(started.child),
            supervisor: started.supervisor,
            gpus: l.gpus.clone(),
            shared: l.gpu_share.is_some(),
            cgroup,
            pgid: started.pgid,
            started: Instant::now(),
            limit: Duration::from_secs(l.time_limit_secs),
            signal: l.checkpoint_signal.clone(),
            grace: Duration::from_secs(l.grace_secs),
            stopping: None,
            stopped_by_perch: false,
            stopped_for: None,
            master_port,
        };
        if let Some(r) = &mut record {
            r.supervisor = started.supervisor;
            r.pgid = Some(started.leader);
            r.cgroup = running.cgroup.as_ref().map(|c| c.path.clone());
            write_record(&state, l.job, r);
        }
        Ok(running)
    }

    /// Creates the job's directory and a fresh stdout and stderr for this attempt, and starts
    /// shipping them. A new attempt starts new output; the server's copy is kept per job. The
    /// agent reads the output through the descriptors it creates here, never by path again.
    fn create_logs(&mut self, l: &JobLaunch, dir: &Path) -> Result<[File; 2], NotStarted> {
        let io = NotStarted::io;
        fs::create_dir_all(dir).map_err(|e| io(&format!("creating {}", dir.display()), e))?;
        let stdout = create_log(&dir.join("stdout")).map_err(|e| io("creating its stdout", e))?;
        let stderr = create_log(&dir.join("stderr")).map_err(|e| io("creating its stderr", e))?;
        let readers = [
            stdout
                .try_clone()
                .map_err(|e| io("keeping its stdout", e))?,
            stderr
                .try_clone()
                .map_err(|e| io("keeping its stderr", e))?,
        ];
        self.outputs.insert(l.job, l.attempt, readers);
        Ok([stdout, stderr])
    }

    /// Whose identity the job runs under, noted in its record unless it is its user's.
    fn identity(&mut self, l: &JobLaunch) -> Result<Option<Identity>, NotStarted> {
        let (uid, name) = (self.agent_user.0, self.agent_user.1.clone());
        match identity::decide(self.run_as_user, &l.user, (uid, &name), &self.uids) {
            Decision::Switch(id) => {
                if self.setpriv.is_none() && id.groups.iter().any(|&g| g != id.gid) {
                    self.note(
                        l.job,
                        format!(
                            "runs as {} without its supplementary groups (setpriv, from util-linux, is not installed)",
                            id.name
                        ),
                    );
                }
                Ok(Some(id))
            }
            Decision::AsAgent(note) => {
                if let Some(note) = note {
                    self.note(l.job, note);
                }
                Ok(None)
            }
            Decision::Refuse(why) => Err(NotStarted { code: 126, why }),
        }
    }

    /// Refuses a working directory the job's user cannot enter. A missing one would fail the
    /// spawn with the same error as a missing program ("cannot run \"python\": No such file or
    /// directory"): this names it instead. Tried as the job's user, so that one it may not
    /// enter fails alike whether or not it exists (as root, the check would tell the user what
    /// a root-only directory holds).
    fn check_workdir(&self, l: &JobLaunch, user: Option<&Identity>) -> Result<(), NotStarted> {
        if let Some(w) = l.workdir.as_deref()
            && !self.can_enter(w, user)
        {
            let who = user.map_or(self.agent_user.1.as_str(), |id| &id.name);
            return Err(NotStarted {
                code: 127,
                why: format!(
                    "its working directory {w:?} is not a directory on this node that {who} can enter"
                ),
            });
        }
        Ok(())
    }

    /// Whether `dir` is a directory the job's user (`user`, else the agent's) can enter: tried by
    /// `sh -c 'cd -P'` switched to the user exactly as the job is (uid, gid and supplementary
    /// groups), the path in its environment, not on a command line others can read.
    fn can_enter(&self, dir: &str, user: Option<&Identity>) -> bool {
        let Some(id) = user else {
            return Path::new(dir).is_dir();
        };
        let mut cmd = match &self.setpriv {
            Some(setpriv) => {
                let args = identity::setpriv_args(setpriv, id);
                let mut c = std::process::Command::new(&args[0]);
                c.args(&args[1..]).arg("/bin/sh");
                c
            }
            None => {
                let mut c = std::process::Command::new("/bin/sh");
                c.uid(id.uid).gid(id.gid);
                c
            }
        };
        cmd.args(["-c", "cd -P -- \"$PERCH_WORKDIR\""])
            .env_clear()
            .env("PATH", command::PREFIX_PATH)
            .env("PERCH_WORKDIR", dir)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd.status().is_ok_and(|s| s.success())
    }

    /// The job's cgroup, when it gets one; notes limits not enforced, in its log too.
    fn cgroup(&mut self, l: &JobLaunch, log: &mut File) -> Option<JobCgroup> {
        let asked = l.memory_mb.is_some() || l.cpus.is_some();
        let requested = || {
            let mut parts = Vec::new();
            if let Some(m) = l.memory_mb {
                parts.push(format!("memory {m} MiB"));
            }
            if let Some(c) = l.cpus {
                parts.push(format!("{c} CPUs"));
            }
            parts.join(", ")
        };
        let (cgroup, line) = match &self.cgroups {
            Ok(c) => match c.create(l.job, l.memory_mb, l.cpus) {
                Ok(cg) => {
                    let line = (asked && !cg.enforced).then(|| cg.note.clone());
                    if asked && cg.enforced {
                        self.note(l.job, cg.note.clone());
                    }
                    (Some(cg), line)
                }
                Err(why) => (
                    None,
                    asked.then(|| format!("limits not enforced ({}): {why}", requested())),
                ),
            },
            Err(why) => (
                None,
                asked.then(|| format!("limits not enforced ({}): {why}", requested())),
            ),
        };
        if let Some(line) = line {
            let _ = writeln!(log, "perch: {line}");
            self.note(l.job, line);
        }
        cgroup
    }

    /// The job's command, ready to spawn: under its supervisor when the agent has one (else in
    /// a process group of its own), switched to its user, waiting for its go on standard input
    /// when it has a cgroup to enter first, in its working directory (else its job directory),
    /// its output going to `logs` (stdout, stderr); with the environment it gets.
    fn command(
        &self,
        l: &JobLaunch,
        user: Option<&Identity>,
        cgroup: Option<&JobCgroup>,
        dir: &Path,
        [stdout, stderr]: [File; 2],
    ) -> Result<(Command, std::collections::BTreeMap<String, String>), NotStarted> {
        let shim_args = ShimArgs {
            state: self.state_dir().to_path_buf(),
            job: l.job,
            attempt: l.attempt,
            signal: l.checkpoint_signal.clone(),
            grace_secs: l.grace_secs,
            uid_gid: None,
            cgroup: cgroup.map(|c| c.path.clone()),
        };
        let shape = command::Shape {
            user: user.map(|id| (id, self.setpriv.as_deref())),
            wait_for_go: cgroup.is_some(),
            inherited: command::inherited(std::env::vars_os()),
            // After the job's own env: `variables` leaves out what the job sets itself.
            extra: self
                .otel
                .as_ref()
                .map(|target| otel::variables(target, l).into_iter().collect())
                .unwrap_or_default(),
            supervisor: self.supervisor.as_deref().map(|p| (p, shim_args)),
        };
        let mut cmd =
            command::build(l, &shape).map_err(|e| NotStarted::io("building its command", e))?;
        let env = command::environment(l, &shape);
        let workdir = l
            .workdir
            .as_deref()
            .map_or(dir.to_path_buf(), PathBuf::from);
        cmd.current_dir(workdir)
            .stdin(if cgroup.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(stdout)
            .stderr(stderr);
        if self.supervisor.is_none() {
            cmd.process_group(0);
        }
        Ok((cmd, env))
    }

    /// Spawns `cmd` and finds the job's process group: the one its supervisor records, or,
    /// without a supervisor, the child's own (recorded here for a restarted agent). A job whose
    /// supervisor did not start it has its cgroup emptied and removed.
    fn start_process(
        &mut self,
        l: &JobLaunch,
        mut cmd: Command,
        cgroup: Option<&JobCgroup>,
    ) -> Result<Started, NotStarted> {
        let io = NotStarted::io;
        let program = l.command.first().map_or("", String::as_str);
        let mut child = cmd
            .spawn()
            .map_err(|e| io(&format!("cannot run {program:?}"), e))?;
        let (leader, supervisor) = if self.supervisor.is_some() {
            match self.supervised_group(l, &mut child) {
                Ok(found) => found,
                Err(e) => {
                    if let Some(cg) = cgroup {
                        cg.kill();
                        cg.remove();
                    }
                    return Err(e);
                }
            }
        } else {
            let raw = i32::try_from(child.id())
                .map_err(|e| io("process id", std::io::Error::other(e)))?;
            if let Err(e) = self.groups.record(l.job, raw) {
                tracing::warn!(job = l.job, error = %e, "cannot record the job's process group; a restarted agent will not kill it");
            }
            (raw, None)
        };
        let pgid =
            Pid::from_raw(leader).ok_or_else(|| io("process id", std::io::Error::other("0")))?;
        Ok(Started {
            child,
            leader,
            pgid,
            supervisor,
        })
    }

    /// Waits for a just-spawned supervisor to start job `l` and record its process group;
    /// returns the group and the supervisor's (pid, start time).
    fn supervised_group(
        &self,
        l: &JobLaunch,
        child: &mut Child,
    ) -> Result<(i32, Option<(i32, u64)>), NotStarted> {
        let state = self.state_dir();
        let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
        let deadline = Instant::now() + SUPERVISOR_START;
        loop {
            if let Some(pgid) = self.groups.provable(l.job) {
                let start = groups::group_and_start(Path::new("/proc"), pid).map(|(_, t)| t);
                return Ok((pgid, start.map(|t| (pid, t))));
            }
            if let Some(exit) = ExitRecord::read(state, l.job).filter(|e| e.attempt == l.attempt) {
                let _ = child.wait();
                return Err(NotStarted {
                    code: exit.code,
                    why: "its program could not be run (its log says why)".into(),
                });
            }
            if matches!(child.try_wait(), Ok(Some(_))) || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(NotStarted {
                    code: 127,
                    why: "its supervisor (perch __job-shim) did not start it".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Moves the job's first process (`leader`) into its cgroup, then sends the go line it
    /// waits for, so that it is in its cgroup before it runs. A cgroup it cannot be moved into
    /// is noted ("limits not enforced") and removed. Returns the cgroup the job runs in.
    fn enter_cgroup(
        &mut self,
        job: u64,
        cgroup: Option<JobCgroup>,
        leader: i32,
        child: &mut Child,
    ) -> Option<JobCgroup> {
        let cg = cgroup?;
        let entered = match cg.add(leader as u32) {
            Ok(()) => Some(cg),
            Err(e) => {
                let line = format!(
                    "limits not enforced: cannot move the job into {}: {e}",
                    cg.path.display()
                );
                self.note(job, line);
                cg.remove();
                None
            }
        };
        if let Some(mut go) = child.stdin.take() {
            let _ = go.write_all(b"go\n");
        }
        entered
    }
}

/// Writes the hostfile of a job spanning several nodes (`<addr> slots=<n>` a line, as MPI and
/// DeepSpeed read it) into its directory; `None` for a job on one node.
fn write_hostfile(l: &JobLaunch, dir: &Path) -> Result<Option<(PathBuf, File)>, NotStarted> {
    if l.hosts.is_empty() {
        return Ok(None);
    }
    let path = dir.join("hostfile");
    let mut f = create_log(&path).map_err(|e| NotStarted::io("creating its hostfile", e))?;
    for h in &l.hosts {
        writeln!(f, "{} slots={}", h.addr, h.slots)
            .map_err(|e| NotStarted::io("writing its hostfile", e))?;
    }
    Ok(Some((path, f)))
}

/// The launch with its rendezvous in its environment: `MASTER_PORT` and `PET_MASTER_PORT` for
/// the port picked here, `PERCH_HOSTFILE` for its hostfile; `l` itself when it has neither.
fn with_rendezvous<'a>(
    l: &'a JobLaunch,
    master_port: Option<u16>,
    hostfile: Option<&Path>,
) -> Cow<'a, JobLaunch> {
    if master_port.is_none() && hostfile.is_none() {
        return Cow::Borrowed(l);
    }
    let mut adjusted = l.clone();
    if let Some(port) = master_port {
        for key in ["MASTER_PORT", "PET_MASTER_PORT"] {
            adjusted.env.insert(key.into(), port.to_string());
        }
    }
    if let Some(path) = hostfile {
        adjusted
            .env
            .insert("PERCH_HOSTFILE".into(), path.display().to_string());
    }
    Cow::Owned(adjusted)
}

/// Gives the job's directory (its default working directory) and files to its user: the logs
/// and hostfile through their descriptors, the directory by path (its parent is root's).
fn give_to_user(
    id: &Identity,
    dir: &Path,
    [stdout, stderr]: [&File; 2],
    hostfile: Option<&File>,
) -> Result<(), NotStarted> {
    let (uid, gid) = (
        Some(rustix::fs::Uid::from_raw(id.uid)),
        Some(rustix::fs::Gid::from_raw(id.gid)),
    );
    let give = |what: &str, r: rustix::io::Result<()>| {
        r.map_err(|e| NotStarted::io(&format!("giving its {what} to {}", id.name), e.into()))
    };
    give("stdout", rustix::fs::fchown(stdout, uid, gid))?;
    give("stderr", rustix::fs::fchown(stderr, uid, gid))?;
    if let Some(f) = hostfile {
        give("hostfile", rustix::fs::fchown(f, uid, gid))?;
    }
    give("directory", rustix::fs::chown(dir, uid, gid))?;
    Ok(())
}

/// The record of a supervised job written before its supervisor starts (no supervisor or
/// process group yet), so that a restarted agent can find it whenever this one dies.
fn run_record(
    l: &JobLaunch,
    cgroup: Option<&JobCgroup>,
    logs: [(u64, u64); 2],
    master_port: Option<u16>,
) -> RunRecord {
    RunRecord {
        version: RunRecord::new_version(),
        attempt: l.attempt,
        boot_id: groups::boot_id(Path::new("/proc")).unwrap_or_default(),
        supervisor: None,
        pgid: None,
        user: l.user.clone(),
        gpus: l.gpus.clone(),
        shared: l.gpu_share.is_some(),
        sim_profile: l.sim_profile.clone(),
        time_limit_secs: l.time_limit_secs,
        started_boot_ms: lease::boot_ms(),
        signal: l.checkpoint_signal.clone(),
        grace_secs: l.grace_secs,
        cgroup: cgroup.map(|c| c.path.clone()),
        logs,
        master_port,
    }
}

/// Writes job `job`'s run record into the state directory; a failure is logged (a restarted
/// agent would not take the job over), not fatal.
fn write_record(state: &Path, job: u64, record: &RunRecord) {
    if let Err(e) = record.write(state, job) {
        tracing::warn!(job, error = %e, "cannot record the job for a restarted agent; one would not take it over");
    }
}
