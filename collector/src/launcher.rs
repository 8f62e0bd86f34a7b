//! Runs the jobs the server places on this node.
//!
//! Each job runs in its own process group with `CUDA_VISIBLE_DEVICES` set to its GPUs, its
//! output in `<data-dir>/jobs/<id>/{stdout,stderr}`. Stopping a job (cancel, preemption, time
//! limit) sends its checkpoint signal to the whole group, waits its grace period, then sends
//! SIGKILL. The agent enforces the time limit itself too, so a job cannot outrun it while the
//! server is away. Every job's process group is recorded, with the boot id and its leader's
//! start time, in a root-only state directory ([`groups`]); a restarted agent kills the groups
//! it can prove its predecessor started in this boot (it cannot wait on them), and the server,
//! seeing the job missing from the agent's report, requeues it. Nothing in a job's own
//! directory, which its user owns, decides what the agent kills.
//!
//! Isolation ([`Isolation`]): a job runs as its submitting user when the agent can switch to
//! it ([`identity`]) and in its own cgroup with its memory and CPU request as limits when the
//! agent can create cgroups ([`cgroup`]); a job whose request holds a part of a GPU shares it
//! with other shared jobs, and gets the MPS limits in its environment ([`command`]). Facts
//! about a start (the identity it runs under when not its user's, limits not enforced) go to
//! the job's log and, through [`Launcher::take_notes`], to its record on the server.

pub mod cgroup;
mod command;
pub mod groups;
pub mod identity;
mod otel;

pub use cgroup::CgroupMode;
pub use identity::{RunAsUser, UidPolicy};
pub use otel::OtelTarget;

use crate::jobs::{JobRegistry, JobSpec, JobTarget};
use cgroup::{JobCgroup, JobCgroups};
use groups::GroupState;
use identity::{Decision, Identity};
use perch_model::control::{
    JobExit, JobLaunch, JobNote, JobStop, LogChunk, LogStream, SyncResponse,
};
use rustix::process::{Pid, Signal, kill_process_group};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// Most bytes of one stream of one job sent per sync.
const LOG_CHUNK: u64 = 256 << 10;
/// Extra time past the limit before the agent acts on its own (the server normally acts first).
const LIMIT_MARGIN: Duration = Duration::from_secs(5);

fn signal_named(name: &str) -> Signal {
    match name {
        "SIGINT" => Signal::INT,
        "SIGUSR1" => Signal::USR1,
        "SIGUSR2" => Signal::USR2,
        "SIGHUP" => Signal::HUP,
        _ => Signal::TERM,
    }
}

struct Stopping {
    kill_at: Instant,
}

/// How jobs are confined on this node (`agent.run_as_user`, `agent.cgroups`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Isolation {
    pub run_as_user: RunAsUser,
    pub cgroups: CgroupMode,
    /// Root of `/proc` for finding the agent's own cgroup (`/`; tests use fixture trees).
    pub root: PathBuf,
    /// Which users jobs may be switched to (`agent.min_uid`, `agent.allowed_system_users`).
    pub uids: UidPolicy,
}

/// Why a job did not start: the text becomes its reason on the server.
struct NotStarted {
    /// 126 when perch refused it, 127 when its program could not be run (as a shell says).
    code: i32,
    why: String,
}

struct Running {
    child: Child,
    gpus: Vec<u32>,
    /// Holds a part of its GPU (shares it with other shared jobs).
    shared: bool,
    cgroup: Option<JobCgroup>,
    pgid: Pid,
    started: Instant,
    limit: Duration,
    signal: String,
    grace: Duration,
    stopping: Option<Stopping>,
    stopped_by_perch: bool,
}

/// The state directory inside the jobs directory (root-only; see [`groups`]).
const STATE_DIR: &str = ".state";

/// The jobs of this node.
pub struct Launcher {
    dir: PathBuf,
    /// Where each running job's process group is recorded for a restarted agent.
    groups: GroupState,
    running: HashMap<u64, Running>,
    /// Exits not yet acknowledged by the server.
    exited: BTreeMap<u64, JobExit>,
    /// Each job's stdout and stderr as the agent created them, read until its exit is
    /// acknowledged (never reopened by path: the job's user owns the directory).
    outputs: HashMap<u64, [File; 2]>,
    /// Where each job's streams continue from, as the server last said.
    sent: HashMap<(u64, LogStream), u64>,
    /// Where the agent's sampler learns which processes and GPUs belong to which job.
    registry: JobRegistry,
    /// Launches waiting for a stopping job to release their GPUs (the server frees a job's
    /// GPUs when it decides to stop it; the processes may need their grace period first).
    waiting: Vec<JobLaunch>,
    /// Where jobs' OpenTelemetry SDKs export to; `None` sets no `OTEL_*` variables.
    otel: Option<OtelTarget>,
    run_as_user: RunAsUser,
    uids: UidPolicy,
    /// The agent's own (uid, name).
    agent_user: (u32, String),
    setpriv: Option<PathBuf>,
    /// Where job cgroups go, or why there are none.
    cgroups: Result<JobCgroups, String>,
    /// Facts for the jobs' records, not yet handed to the server.
    notes: Vec<JobNote>,
    /// Cgroups of ended jobs that still held processes when last tried.
    leftover_cgroups: Vec<JobCgroup>,
}

impl std::fmt::Debug for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launcher")
            .field("dir", &self.dir)
            .field("running", &self.running.len())
            .finish()
    }
}

fn signal_group(pgid: Pid, signal: Signal) {
    if let Err(e) = kill_process_group(pgid, signal)
        && e != rustix::io::Errno::SRCH
    {
        tracing::warn!(pgid = pgid.as_raw_nonzero().get(), error = %e, "could not signal a job's process group");
    }
}

/// Creates a job's log afresh, as root, in a directory the job's user owns: whatever the entry
/// is now (a link the job left, say) is removed, never followed, and the new file is created
/// exclusively without following links, readable and writable through the one descriptor.
fn create_log(path: &Path) -> std::io::Result<File> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )?;
    Ok(File::from(fd))
}

/// Up to `max` bytes of `f` from `offset`, without moving the offset the job writes at.
fn read_from(f: &File, offset: u64, max: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let len = f.metadata()?.len();
    let want = usize::try_from(len.saturating_sub(offset).min(max)).unwrap_or(0);
    let mut buf = vec![0; want];
    let mut got = 0;
    while got < want {
        let n = f.read_at(&mut buf[got..], offset + got as u64)?;
        if n == 0 {
            break;
        }
        got += n;
    }
    buf.truncate(got);
    Ok(buf)
}

/// The job's cgroup as the usage sampler reads it (`/sys/fs/cgroup`-relative, memory
/// accounted), or `None` to sample its process tree instead.
fn sampled_cgroup(cg: &JobCgroup) -> Option<JobTarget> {
    let rel = cg.path.strip_prefix("/sys/fs/cgroup").ok()?;
    let unified = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    (unified && cg.path.join("memory.current").exists())
        .then(|| JobTarget::Cgroup(Path::new("/").join(rel)))
}

/// Text that keeps every byte's place: invalid UTF-8 becomes one '?' per byte, so the server's
/// copy has the same length and offsets stay aligned. An incomplete character at the very end
/// is held back (returns fewer bytes) unless `final_` is set.
fn text_of(bytes: &[u8], final_: bool) -> (String, usize) {
    let mut out = String::with_capacity(bytes.len());
    let mut used = 0;
    let chunks: Vec<_> = bytes.utf8_chunks().collect();
    for (i, chunk) in chunks.iter().enumerate() {
        out.push_str(chunk.valid());
        used += chunk.valid().len();
        let invalid = chunk.invalid();
        let last = i + 1 == chunks.len();
        if last
            && !final_
            && !invalid.is_empty()
            && used + invalid.len() == bytes.len()
            && invalid.len() < 4
        {
            break;
        }
        out.extend(std::iter::repeat_n('?', invalid.len()));
        used += invalid.len();
    }
    (out, used)
}

impl Launcher {
    /// Opens the job directory and kills job process groups a previous agent left behind.
    pub fn new(dir: &Path) -> std::io::Result<Launcher> {
        Self::with_registry(dir, JobRegistry::default())
    }

    /// Like [`Launcher::new`], registering every job it runs in `registry` for per-job
    /// sampling and GPU attribution.
    pub fn with_registry(dir: &Path, registry: JobRegistry) -> std::io::Result<Launcher> {
        fs::create_dir_all(dir)?;
        let groups = GroupState::open(&dir.join(STATE_DIR), Path::new("/proc"))?;
        for (job, pgid) in groups.take_provable() {
            if let Some(pgid) = Pid::from_raw(pgid) {
                tracing::warn!(%job, "killing a job left running by a previous agent; the server requeues it");
                signal_group(pgid, Signal::KILL);
            }
        }
        for entry in fs::read_dir(dir)?.flatten() {
            // Where older agents kept the group: in the job's (user-owned) directory. Never read.
            let _ = fs::remove_file(entry.path().join("pgid"));
        }
        Ok(Launcher {
            groups,
            dir: dir.to_path_buf(),
            running: HashMap::new(),
            exited: BTreeMap::new(),
            outputs: HashMap::new(),
            sent: HashMap::new(),
            registry,
            waiting: Vec::new(),
            otel: None,
            run_as_user: RunAsUser::Never,
            uids: UidPolicy::default(),
            agent_user: identity::agent_user(),
            setpriv: None,
            cgroups: Err("cgroups are off (agent.cgroups = off)".into()),
            notes: Vec::new(),
            leftover_cgroups: Vec::new(),
        })
    }

    /// Sets how jobs launched from now on are confined. Until called, jobs run as the agent's
    /// user without cgroups. Job cgroups a previous agent left are killed and removed.
    pub fn set_isolation(&mut self, isolation: &Isolation) {
        self.run_as_user = isolation.run_as_user;
        self.uids = isolation.uids.clone();
        self.setpriv = identity::find_setpriv();
        let root = if isolation.root.as_os_str().is_empty() {
            Path::new("/")
        } else {
            isolation.root.as_path()
        };
        let scope =
            cgroup::scope_of(&fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone()));
        self.cgroups = match JobCgroups::from_mode(&isolation.cgroups, root, &scope) {
            Ok(Some(c)) => {
                tracing::info!(parent = %c.parent().display(), "jobs get their own cgroups");
                Ok(c)
            }
            Ok(None) => Err("cgroups are off (agent.cgroups = off)".into()),
            Err(why) => {
                tracing::warn!(%why, "jobs run without cgroup limits");
                Err(why)
            }
        };
        if let Ok(c) = &self.cgroups {
            for entry in fs::read_dir(c.parent()).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("job-") && entry.path().is_dir() {
                    tracing::warn!(cgroup = %entry.path().display(), "killing a job cgroup left by a previous agent");
                    let left = JobCgroup {
                        path: entry.path(),
                        note: String::new(),
                        enforced: false,
                    };
                    left.kill();
                    self.leftover_cgroups.push(left);
                }
            }
        }
    }

    /// Notes for the jobs' records gathered since the last call (the control loop sends them
    /// and gives them back with [`Launcher::restore_notes`] when the server is unreachable).
    pub fn take_notes(&mut self) -> Vec<JobNote> {
        std::mem::take(&mut self.notes)
    }

    /// Puts back notes that could not be delivered.
    pub fn restore_notes(&mut self, mut notes: Vec<JobNote>) {
        notes.append(&mut self.notes);
        self.notes = notes;
    }

    fn note(&mut self, job: u64, text: String) {
        tracing::info!(job, "{text}");
        self.notes.push(JobNote { job, text });
    }

    /// Sets the `OTEL_*` variables of every job launched from now on (see [`OtelTarget`]).
    pub fn set_otel(&mut self, target: OtelTarget) {
        self.otel = Some(target);
    }

    fn job_dir(&self, job: u64) -> PathBuf {
        self.dir.join(job.to_string())
    }

    /// Starts a job unless it already runs here; waits while a stopping job still holds one
    /// of its GPUs.
    pub fn launch(&mut self, l: &JobLaunch) {
        if self.running.contains_key(&l.job) || self.waiting.iter().any(|w| w.job == l.job) {
            return;
        }
        if self.gpus_busy(l) {
            tracing::info!(job = l.job, gpus = ?l.gpus, "job waits for a stopping job to release its GPUs");
            self.waiting.push(l.clone());
            return;
        }
        self.start(l);
    }

    /// Whether a job on one of `l`'s GPUs must end first: any job there, except that shared
    /// jobs run beside running shared jobs (not beside stopping ones, whose memory is still
    /// held).
    fn gpus_busy(&self, l: &JobLaunch) -> bool {
        self.running.values().any(|r| {
            r.gpus.iter().any(|g| l.gpus.contains(g))
                && !(r.shared && l.gpu_share.is_some() && r.stopping.is_none())
        })
    }

    fn start(&mut self, l: &JobLaunch) {
        match self.spawn(l) {
            Ok(r) => {
                tracing::info!(job = l.job, gpus = ?l.gpus, "job started");
                let target = r
                    .cgroup
                    .as_ref()
                    .and_then(sampled_cgroup)
                    .unwrap_or(JobTarget::Pid(r.child.id()));
                self.registry.register(JobSpec {
                    job: l.job.to_string(),
                    user: Some(l.user.clone()),
                    gpus: l.gpus.clone(),
                    target,
                    sim_profile: match l.sim_profile.as_deref() {
                        Some("idle") => Some(crate::gpu::sim::Workload::AllocatedIdle),
                        Some("bursty") => Some(crate::gpu::sim::Workload::Bursty),
                        Some(_) => Some(crate::gpu::sim::Workload::Training),
                        None => None,
                    },
                });
                self.running.insert(l.job, r);
            }
            Err(NotStarted { code, why }) => {
                tracing::warn!(job = l.job, %why, "job could not start");
                let dir = self.job_dir(l.job);
                let _ = fs::create_dir_all(&dir);
                match (
                    create_log(&dir.join("stdout")),
                    create_log(&dir.join("stderr")),
                ) {
                    (Ok(out), Ok(mut err)) => {
                        let _ = writeln!(err, "perch: job not started: {why}");
                        self.sent.insert((l.job, LogStream::Stdout), 0);
                        self.sent.insert((l.job, LogStream::Stderr), 0);
                        self.outputs.insert(l.job, [out, err]);
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        tracing::warn!(job = l.job, error = %e, "cannot write why the job did not start to its log");
                    }
                }
                self.exited.insert(
                    l.job,
                    JobExit {
                        job: l.job,
                        code,
                        stopped: false,
                        error: Some(why),
                    },
                );
            }
        }
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

    fn spawn(&mut self, l: &JobLaunch) -> Result<Running, NotStarted> {
        let io = |what: &str, e: std::io::Error| NotStarted {
            code: 127,
            why: format!("{what}: {e}"),
        };
        let dir = self.job_dir(l.job);
        fs::create_dir_all(&dir).map_err(|e| io(&format!("creating {}", dir.display()), e))?;
        // A new attempt starts new output; the server's copy is kept per job. The agent reads
        // the output through the descriptors it creates here, never by path again.
        let stdout = create_log(&dir.join("stdout")).map_err(|e| io("creating its stdout", e))?;
        let mut stderr =
            create_log(&dir.join("stderr")).map_err(|e| io("creating its stderr", e))?;
        let readers = [
            stdout
                .try_clone()
                .map_err(|e| io("keeping its stdout", e))?,
            stderr
                .try_clone()
                .map_err(|e| io("keeping its stderr", e))?,
        ];
        self.outputs.insert(l.job, readers);
        self.sent.insert((l.job, LogStream::Stdout), 0);
        self.sent.insert((l.job, LogStream::Stderr), 0);
        let user = self.identity(l)?;
        if let Some(id) = &user {
            // The job's directory (its default working directory) and logs are its user's: the
            // logs through their descriptors, the directory by path (its parent is root's).
            let (uid, gid) = (
                Some(rustix::fs::Uid::from_raw(id.uid)),
                Some(rustix::fs::Gid::from_raw(id.gid)),
            );
            let give = |what: &str, r: rustix::io::Result<()>| {
                r.map_err(|e| io(&format!("giving its {what} to {}", id.name), e.into()))
            };
            give("stdout", rustix::fs::fchown(&stdout, uid, gid))?;
            give("stderr", rustix::fs::fchown(&stderr, uid, gid))?;
            give("directory", rustix::fs::chown(&dir, uid, gid))?;
        }
        let cgroup = self.cgroup(l, &mut stderr);
        let shape = command::Shape {
            user: user.as_ref().map(|id| (id, self.setpriv.as_deref())),
            wait_for_go: cgroup.is_some(),
            inherited: command::inherited(std::env::vars_os()),
            // After the job's own env: `variables` leaves out what the job sets itself.
            extra: self
                .otel
                .as_ref()
                .map(|target| otel::variables(target, l).into_iter().collect())
                .unwrap_or_default(),
        };
        let mut cmd = command::build(l, &shape).map_err(|e| io("building its command", e))?;
        cmd.current_dir(l.workdir.as_deref().map_or(dir.clone(), PathBuf::from))
            .stdin(if cgroup.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0);
        let program = l.command.first().map_or("", String::as_str);
        let mut child = cmd
            .spawn()
            .map_err(|e| io(&format!("cannot run {program:?}"), e))?;
        let mut cgroup = cgroup;
        if let Some(cg) = &cgroup {
            // The child waits for this line: it is in its cgroup before the job runs.
            if let Err(e) = cg.add(child.id()) {
                let line = format!(
                    "limits not enforced: cannot move the job into {}: {e}",
                    cg.path.display()
                );
                self.note(l.job, line);
                cg.remove();
                cgroup = None;
            }
            if let Some(mut go) = child.stdin.take() {
                let _ = go.write_all(b"go\n");
            }
        }
        let raw =
            i32::try_from(child.id()).map_err(|e| io("process id", std::io::Error::other(e)))?;
        let pgid =
            Pid::from_raw(raw).ok_or_else(|| io("process id", std::io::Error::other("0")))?;
        if let Err(e) = self.groups.record(l.job, raw) {
            tracing::warn!(job = l.job, error = %e, "cannot record the job's process group; a restarted agent will not kill it");
        }
        Ok(Running {
            child,
            gpus: l.gpus.clone(),
            shared: l.gpu_share.is_some(),
            cgroup,
            pgid,
            started: Instant::now(),
            limit: Duration::from_secs(l.time_limit_secs),
            signal: l.checkpoint_signal.clone(),
            grace: Duration::from_secs(l.grace_secs),
            stopping: None,
            stopped_by_perch: false,
        })
    }

    /// Starts stopping a job: its signal now, SIGKILL after the grace period. A job still
    /// waiting for its GPUs is simply dropped (reported as stopped).
    pub fn stop(&mut self, s: &JobStop) {
        if let Some(i) = self.waiting.iter().position(|w| w.job == s.job) {
            self.waiting.remove(i);
            self.exited.insert(
                s.job,
                JobExit {
                    job: s.job,
                    code: 128 + 15,
                    stopped: true,
                    error: None,
                },
            );
            return;
        }
        if let Some(r) = self.running.get_mut(&s.job)
            && r.stopping.is_none()
        {
            tracing::info!(job = s.job, signal = %s.signal, grace_secs = s.grace_secs, "stopping job");
            signal_group(r.pgid, signal_named(&s.signal));
            r.stopping = Some(Stopping {
                kill_at: Instant::now() + Duration::from_secs(s.grace_secs),
            });
            r.stopped_by_perch = true;
        }
    }

    /// Reaps exited jobs, enforces time limits and grace periods.
    pub fn poll(&mut self) {
        let now = Instant::now();
        let mut done = Vec::new();
        for (&job, r) in self.running.iter_mut() {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    // Whatever is left of the group (and of the cgroup) goes too.
                    signal_group(r.pgid, Signal::KILL);
                    if let Some(cg) = &r.cgroup {
                        cg.kill();
                    }
                    let code = status
                        .code()
                        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
                    done.push(JobExit {
                        job,
                        code,
                        stopped: r.stopped_by_perch,
                        error: None,
                    });
                }
                Ok(None) => {
                    if r.stopping.is_none()
                        && now.duration_since(r.started) > r.limit + LIMIT_MARGIN
                    {
                        tracing::warn!(job, "job ran past its time limit; stopping it");
                        signal_group(r.pgid, signal_named(&r.signal));
                        r.stopping = Some(Stopping {
                            kill_at: now + r.grace,
                        });
                        r.stopped_by_perch = true;
                    }
                    if r.stopping.as_ref().is_some_and(|s| now >= s.kill_at) {
                        signal_group(r.pgid, Signal::KILL);
                        if let Some(cg) = &r.cgroup {
                            cg.kill();
                        }
                    }
                }
                Err(e) => tracing::warn!(job, error = %e, "could not check a job's process"),
            }
        }
        self.leftover_cgroups.retain(|cg| {
            cg.remove();
            cg.path.exists()
        });
        for exit in done {
            if let Some(cg) = self.running.remove(&exit.job).and_then(|r| r.cgroup) {
                cg.remove();
                if cg.path.exists() {
                    self.leftover_cgroups.push(cg);
                }
            }
            self.registry.unregister(&exit.job.to_string());
            self.groups.forget(exit.job);
            tracing::info!(job = exit.job, code = exit.code, "job exited");
            self.exited.insert(exit.job, exit);
        }
        let waiting = std::mem::take(&mut self.waiting);
        for l in waiting {
            if self.gpus_busy(&l) {
                self.waiting.push(l);
            } else {
                self.start(&l);
            }
        }
    }

    /// Jobs running now, or accepted and waiting for their GPUs.
    pub fn running(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .running
            .keys()
            .chain(self.waiting.iter().map(|w| &w.job))
            .copied()
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Exits the server has not acknowledged yet.
    pub fn exited(&self) -> Vec<JobExit> {
        self.exited.values().cloned().collect()
    }

    /// New output of every job with unsent output.
    pub fn logs(&self) -> Vec<LogChunk> {
        let mut chunks = Vec::new();
        let jobs = self.running.keys().chain(self.exited.keys());
        for &job in jobs {
            let final_ = !self.running.contains_key(&job);
            for stream in [LogStream::Stdout, LogStream::Stderr] {
                let offset = self.sent.get(&(job, stream)).copied().unwrap_or(0);
                let Some(f) = self.outputs.get(&job).map(|o| match stream {
                    LogStream::Stdout => &o[0],
                    LogStream::Stderr => &o[1],
                }) else {
                    continue;
                };
                let Ok(buf) = read_from(f, offset, LOG_CHUNK) else {
                    continue;
                };
                if buf.is_empty() {
                    continue;
                }
                let (data, used) = text_of(&buf, final_ && (buf.len() as u64) < LOG_CHUNK);
                if used > 0 {
                    chunks.push(LogChunk {
                        job,
                        stream,
                        offset,
                        data,
                    });
                }
            }
        }
        chunks
    }

    /// Applies the server's answer: forget acknowledged exits, move log offsets, stop and start.
    pub fn apply(&mut self, response: &SyncResponse) {
        for &(job, stream, offset) in &response.log_offsets {
            self.sent.insert((job, stream), offset);
        }
        for job in &response.acknowledged {
            self.exited.remove(job);
            self.outputs.remove(job);
        }
        for s in &response.stop {
            self.stop(s);
        }
        for l in &response.start {
            self.launch(l);
        }
    }

    /// Stops every job (agent shutdown): signal, then SIGKILL after each job's grace, bounded
    /// by `within`.
    pub fn stop_all(&mut self, within: Duration) {
        let ids = self.running();
        for job in ids {
            let grace = self
                .running
                .get(&job)
                .map_or(0, |r| r.grace.as_secs())
                .min(within.as_secs());
            let signal = self
                .running
                .get(&job)
                .map_or_else(|| "SIGTERM".into(), |r| r.signal.clone());
            self.stop(&JobStop {
                job,
                signal,
                grace_secs: grace,
            });
        }
        let deadline = Instant::now() + within;
        while !self.running.is_empty() && Instant::now() < deadline {
            self.poll();
            std::thread::sleep(Duration::from_millis(50));
        }
        for r in self.running.values() {
            signal_group(r.pgid, Signal::KILL);
            if let Some(cg) = &r.cgroup {
                cg.kill();
            }
        }
        self.poll();
        if let Ok(c) = &self.cgroups {
            c.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(job: u64, script: &str) -> JobLaunch {
        JobLaunch {
            job,
            command: vec!["sh".into(), "-c".into(), script.into()],
            env: [("GREETING".to_owned(), "hi".to_owned())].into(),
            workdir: None,
            gpus: vec![2, 3],
            user: "alice".into(),
            node_rank: 0,
            nodes: 1,
            time_limit_secs: 3600,
            checkpoint_signal: "SIGTERM".into(),
            grace_secs: 1,
            sim_profile: None,
            gpu_share: None,
            cpus: None,
            memory_mb: None,
        }
    }

    fn wait_exit(l: &mut Launcher, job: u64) -> JobExit {
        for _ in 0..400 {
            l.poll();
            if let Some(e) = l.exited().into_iter().find(|e| e.job == job) {
                return e;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("job {job} did not exit");
    }

    #[test]
    fn runs_with_its_gpus_and_env_and_reports_exit_and_output() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        l.launch(&launch(
            1,
            "echo $CUDA_VISIBLE_DEVICES $GREETING $PERCH_NODE_RANK; echo oops >&2; exit 3",
        ));
        l.launch(&launch(1, "echo twice")); // already running: ignored
        let exit = wait_exit(&mut l, 1);
        assert_eq!((exit.code, exit.stopped), (3, false));
        let logs = l.logs();
        let out = logs
            .iter()
            .find(|c| c.stream == LogStream::Stdout)
            .expect("stdout");
        assert_eq!(out.data, "2,3 hi 0\n");
        assert!(
            logs.iter()
                .any(|c| c.stream == LogStream::Stderr && c.data == "oops\n")
        );
        l.apply(&SyncResponse {
            acknowledged: vec![1],
            log_offsets: vec![(1, LogStream::Stdout, 9)],
            ..Default::default()
        });
        assert!(l.exited().is_empty());
        assert!(
            l.logs().iter().all(|c| c.stream != LogStream::Stdout),
            "stdout fully sent"
        );
    }

    #[test]
    fn stop_signals_the_group_then_kills_after_grace() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        // The child shell ignores SIGTERM (and so does its own child): only SIGKILL ends it.
        l.launch(&launch(2, "trap '' TERM; sleep 30 & wait; sleep 30"));
        std::thread::sleep(Duration::from_millis(200));
        l.stop(&JobStop {
            job: 2,
            signal: "SIGTERM".into(),
            grace_secs: 1,
        });
        let exit = wait_exit(&mut l, 2);
        assert_eq!((exit.code, exit.stopped), (128 + 9, true));
    }

    #[test]
    fn a_missing_program_is_reported_as_127() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        let mut bad = launch(3, "");
        bad.command = vec!["/nonexistent/program".into()];
        l.launch(&bad);
        assert_eq!(l.exited()[0].code, 127);
    }

    #[test]
    fn a_restarted_launcher_kills_what_the_old_one_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut old = Launcher::new(dir.path()).expect("launcher");
        old.launch(&launch(4, "sleep 30"));
        let pid = old.running.get(&4).map(|r| r.child.id()).expect("running");
        std::mem::forget(old); // the agent died without cleaning up
        let _new = Launcher::new(dir.path()).expect("launcher");
        let mut gone = false;
        for _ in 0..100 {
            let state = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Killed: either reaped already or a zombie waiting for its (dead) parent.
            if state.is_empty() || state.split(' ').nth(2) == Some("Z") {
                gone = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(gone, "the orphaned job was killed");
    }

    #[test]
    fn text_keeps_byte_offsets() {
        assert_eq!(text_of(b"ab\xffc", true), ("ab?c".into(), 4));
        assert_eq!(text_of("é".as_bytes(), false), ("é".into(), 2));
        assert_eq!(
            text_of(&"é".as_bytes()[..1], false),
            (String::new(), 0),
            "held back until complete"
        );
        assert_eq!(text_of(&"é".as_bytes()[..1], true), ("?".into(), 1));
    }
}

#[cfg(test)]
mod isolation_tests;

#[cfg(test)]
mod gpu_handover_tests {
    use super::*;

    #[test]
    fn a_new_job_waits_until_the_stopping_job_on_its_gpus_is_gone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        let old = JobLaunch {
            job: 1,
            command: vec![
                "sh".into(),
                "-c".into(),
                "trap 'sleep 0.5; exit 0' TERM; while true; do sleep 0.05; done".into(),
            ],
            env: Default::default(),
            workdir: None,
            gpus: vec![0, 1],
            user: "a".into(),
            node_rank: 0,
            nodes: 1,
            time_limit_secs: 3600,
            checkpoint_signal: "SIGTERM".into(),
            grace_secs: 30,
            sim_profile: None,
            gpu_share: None,
            cpus: None,
            memory_mb: None,
        };
        l.launch(&old);
        std::thread::sleep(Duration::from_millis(100));
        l.stop(&JobStop {
            job: 1,
            signal: "SIGTERM".into(),
            grace_secs: 30,
        });
        let new = JobLaunch {
            job: 2,
            command: vec!["true".into()],
            gpus: vec![1],
            ..old.clone()
        };
        l.launch(&new);
        assert_eq!(l.running(), vec![1, 2], "job 2 is accepted");
        assert!(
            !l.running.contains_key(&2),
            "but not started while job 1 holds GPU 1"
        );
        for _ in 0..200 {
            l.poll();
            if l.exited().iter().any(|e| e.job == 2) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let exits = l.exited();
        assert_eq!(
            exits.iter().map(|e| e.job).collect::<Vec<_>>(),
            vec![1, 2],
            "job 1 ended, then job 2 ran"
        );
    }
}
