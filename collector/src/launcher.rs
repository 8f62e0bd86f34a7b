//! Runs the jobs the server places on this node.
//!
//! Each job runs in its own process group with `CUDA_VISIBLE_DEVICES` set to its GPUs, its
//! output in `<data-dir>/jobs/<id>/{stdout,stderr}` until the server holds it ([`output`]).
//! Stopping a job (cancel, preemption, time limit, too much output) sends its checkpoint signal
//! to the whole group, waits its grace period, then sends SIGKILL. The agent enforces the time
//! limit itself too, so a job cannot outrun it while the server is away. Every order and exit names the job's attempt, so a stop meant for an old
//! attempt never touches a new one.
//!
//! **Supervised jobs** (the agent binary given as [`Launcher::set_supervisor`], as `perch agent`
//! does): each job runs under its own small supervisor ([`shim`]) that outlives the agent. It
//! stops the job when the node's lease ([`lease`]) is not renewed in time, whether the agent is
//! cut off from the server or dead, and kills whatever the job left behind, `setsid` daemons
//! included ([`tree`]). A restarted agent takes over the jobs whose supervisors still run (from
//! the records in the root-only state directory, [`groups`]) and reports those that ended while
//! it was away. Without a supervisor (library tests) the agent is the job's parent, and a
//! restarted agent kills the process groups it can prove its predecessor started in this boot
//! (it cannot wait on them); the server, seeing the job missing, requeues it. Nothing in a job's
//! own directory, which its user owns, decides what the agent kills or reads.
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
pub mod lease;
mod otel;
mod output;
pub mod shim;
mod spawn;
mod tree;

pub use cgroup::CgroupMode;
pub use identity::{RunAsUser, UidPolicy};
pub use otel::OtelTarget;

use crate::jobs::{JobRegistry, JobSpec, JobTarget};
use cgroup::{JobCgroup, JobCgroups};
use groups::{GroupState, RunRecord};
use output::Outputs;
use perch_model::control::{
    JobAttempt, JobExit, JobLaunch, JobNote, JobStop, LogChunk, MasterPort, SyncResponse,
};
use perch_model::provenance::JobStartReport;
use rustix::process::{Pid, Signal, kill_process_group};
use shim::ExitRecord;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// Most bytes of output (stdout and stderr together) a job may write on a node unless the agent
/// is told otherwise ([`Launcher::set_output_limit`], `agent.max_job_output_mb`): 4 GiB.
pub const DEFAULT_OUTPUT_LIMIT: u64 = 4 << 30;
/// Output a job stopped for its output may still write during its grace period before the
/// agent kills it at once.
const OUTPUT_SLACK: u64 = 256 << 20;
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
    attempt: u32,
    /// The process the agent spawned (the supervisor, or the job's first process without
    /// one); `None` for a job taken over from a previous agent.
    child: Option<Child>,
    /// The supervisor's (pid, start time), when the job has one.
    supervisor: Option<(i32, u64)>,
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
    /// Why the agent stopped it on its own accord, beyond its time limit (its output).
    stopped_for: Option<String>,
    /// The rendezvous port picked here for the job's ranks ([`JobLaunch::pick_master_port`]).
    master_port: Option<u16>,
}

/// The state directory inside the jobs directory (root-only; see [`groups`]).
const STATE_DIR: &str = ".state";

/// The node's GPU driver and CUDA versions as NVML reports them, for jobs' start reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeVersions {
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    /// The node's GPUs are simulated (no driver).
    pub simulated: bool,
}

/// The jobs of this node.
pub struct Launcher {
    dir: PathBuf,
    /// Where each running job's process group is recorded for a restarted agent.
    groups: GroupState,
    running: HashMap<u64, Running>,
    /// Exits not yet acknowledged by the server.
    exited: BTreeMap<JobAttempt, JobExit>,
    /// The program that supervises each job (`perch`, run as `perch __job-shim`).
    supervisor: Option<PathBuf>,
    /// Each job's stdout and stderr as the agent created them, shipped until the server holds
    /// all of it ([`output`]).
    outputs: Outputs,
    /// Most bytes of output a job may write here before the agent stops it.
    output_limit: u64,
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
    /// What each attempt started here ran with, not yet handed to the server.
    started: Vec<JobStartReport>,
    /// The node's driver and CUDA versions, for those reports.
    versions: NodeVersions,
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

/// The load simulated GPUs show for a job's `sim_profile`.
fn sim_workload(profile: Option<&str>) -> Option<crate::gpu::sim::Workload> {
    match profile {
        Some("idle") => Some(crate::gpu::sim::Workload::AllocatedIdle),
        Some("bursty") => Some(crate::gpu::sim::Workload::Bursty),
        Some(_) => Some(crate::gpu::sim::Workload::Training),
        None => None,
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
/// A TCP port free on this node for job `l`'s rendezvous (the store rank 0 opens for its
/// peers): the first free one from a port derived from the job and attempt within
/// 29500-31499 (torch's default range, so firewalls opened for it fit), else any free one.
/// Free when tried: the job binds it moments later.
fn pick_master_port(l: &JobLaunch) -> u16 {
    const FIRST: u64 = 29_500;
    const SPAN: u64 = 2_000;
    let start = l.job.wrapping_mul(7_919).wrapping_add(u64::from(l.attempt)) % SPAN;
    let free = |port: u16| std::net::TcpListener::bind(("0.0.0.0", port)).is_ok();
    (0..SPAN)
        .map(|i| (FIRST + (start + i) % SPAN) as u16)
        .find(|&p| free(p))
        .or_else(|| {
            std::net::TcpListener::bind(("0.0.0.0", 0))
                .and_then(|s| s.local_addr())
                .map(|a| a.port())
                .ok()
        })
        .unwrap_or((FIRST + start) as u16)
}

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

/// (device, inode) of an open file.
fn file_id(f: &File) -> (u64, u64) {
    f.metadata().map_or((0, 0), |m| (m.dev(), m.ino()))
}

/// The job's cgroup as the usage sampler reads it (`/sys/fs/cgroup`-relative, memory
/// accounted), or `None` to sample its process tree instead.
fn sampled_cgroup(cg: &JobCgroup) -> Option<JobTarget> {
    let rel = cg.path.strip_prefix("/sys/fs/cgroup").ok()?;
    let unified = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    (unified && cg.path.join("memory.current").exists())
        .then(|| JobTarget::Cgroup(Path::new("/").join(rel)))
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
        // Absolute: jobs and their supervisors run in their own working directories, and a
        // relative state directory would name another place there (`--data-dir ./perch-data`).
        let dir = &fs::canonicalize(dir)?;
        let groups = GroupState::open(&dir.join(STATE_DIR), Path::new("/proc"))?;
        for entry in fs::read_dir(dir)?.flatten() {
            // Where older agents kept the group: in the job's (user-owned) directory. Never read.
            let _ = fs::remove_file(entry.path().join("pgid"));
        }
        let mut l = Launcher {
            groups,
            dir: dir.to_path_buf(),
            running: HashMap::new(),
            exited: BTreeMap::new(),
            supervisor: None,
            outputs: Outputs::new(dir),
            output_limit: DEFAULT_OUTPUT_LIMIT,
            registry,
            waiting: Vec::new(),
            otel: None,
            run_as_user: RunAsUser::Never,
            uids: UidPolicy::default(),
            agent_user: identity::agent_user(),
            setpriv: None,
            cgroups: Err("cgroups are off (agent.cgroups = off)".into()),
            notes: Vec::new(),
            started: Vec::new(),
            versions: NodeVersions::default(),
            leftover_cgroups: Vec::new(),
        };
        let keep = l.take_over();
        for (job, pgid) in l.groups.take_provable(&keep) {
            if let Some(pgid) = Pid::from_raw(pgid) {
                tracing::warn!(%job, "killing a job left running by a previous agent; the server requeues it");
                signal_group(pgid, Signal::KILL);
            }
        }
        Ok(l)
    }

    fn state_dir(&self) -> &Path {
        self.groups.dir()
    }

    /// Takes over the supervised jobs a previous agent left: those still running are adopted,
    /// those that ended are reported. Returns their ids. A job whose supervisor died without
    /// recording an exit is killed (provably its group) and left for the server to requeue.
    fn take_over(&mut self) -> std::collections::HashSet<u64> {
        let proc_root = Path::new("/proc");
        let boot = groups::boot_id(proc_root);
        let state = self.state_dir().to_path_buf();
        let mut kept = std::collections::HashSet::new();
        for (job, rec) in RunRecord::all(&state) {
            let run = JobAttempt {
                job,
                attempt: rec.attempt,
            };
            if boot.as_deref() != Some(rec.boot_id.as_str()) {
                RunRecord::remove(&state, job);
                ExitRecord::remove(&state, job);
                continue;
            }
            let logs = self.reopen_logs(job, rec.logs);
            if let Some(exit) = ExitRecord::read(&state, job).filter(|e| e.attempt == rec.attempt) {
                tracing::info!(
                    job,
                    attempt = rec.attempt,
                    code = exit.code,
                    "a job ended while the agent was away"
                );
                if let Some(logs) = logs {
                    self.outputs.insert(job, rec.attempt, logs);
                }
                self.exited.insert(
                    run,
                    JobExit {
                        job,
                        attempt: rec.attempt,
                        code: exit.code,
                        stopped: exit.fenced,
                        fenced: exit.fenced,
                        error: None,
                        reason: None,
                        output_bytes: self.outputs.lengths(job, self.ship_cap()),
                    },
                );
                kept.insert(job);
                continue;
            }
            // A record without its supervisor is one the previous agent wrote just before
            // starting it: the supervisor is the parent of the group it recorded.
            let started = match (rec.supervisor, rec.pgid) {
                (Some(sup), Some(pgid)) => Some((sup, pgid)),
                _ => self.groups.provable(job).and_then(|pgid| {
                    let ppid = groups::proc_stat(proc_root, pgid)?.ppid;
                    Some(((ppid, groups::proc_stat(proc_root, ppid)?.start), pgid))
                }),
            };
            let Some((supervisor, pgid)) =
                started.filter(|(sup, _)| groups::alive(proc_root, *sup))
            else {
                tracing::warn!(
                    job,
                    "a job's supervisor died with the previous agent; killing what is left of the job, the server requeues it"
                );
                if let Some(pgid) = self.groups.provable(job).and_then(Pid::from_raw) {
                    signal_group(pgid, Signal::KILL);
                }
                RunRecord::remove(&state, job);
                continue;
            };
            let Some(pgid) = Pid::from_raw(pgid) else {
                continue;
            };
            tracing::info!(
                job,
                attempt = rec.attempt,
                "taking over a job that runs on from the previous agent"
            );
            if logs.is_none() {
                self.note(job, "its output before the agent restarted is all the server has: its log files were replaced".into());
            }
            if let Some(logs) = logs {
                self.outputs.insert(job, rec.attempt, logs);
            }
            let cgroup = rec.cgroup.clone().map(|path| JobCgroup {
                path,
                note: String::new(),
                enforced: true,
            });
            let target = cgroup
                .as_ref()
                .and_then(sampled_cgroup)
                .unwrap_or(JobTarget::Pid(pgid.as_raw_nonzero().get() as u32));
            self.registry.register(JobSpec {
                job: job.to_string(),
                user: Some(rec.user.clone()),
                gpus: rec.gpus.clone(),
                target,
                sim_profile: sim_workload(rec.sim_profile.as_deref()),
            });
            let ran = Duration::from_millis(
                u64::try_from(lease::boot_ms() - rec.started_boot_ms).unwrap_or(0),
            );
            self.running.insert(
                job,
                Running {
                    attempt: rec.attempt,
                    child: None,
                    supervisor: Some(supervisor),
                    gpus: rec.gpus,
                    shared: rec.shared,
                    cgroup,
                    pgid,
                    started: Instant::now().checked_sub(ran).unwrap_or_else(Instant::now),
                    limit: Duration::from_secs(rec.time_limit_secs),
                    signal: rec.signal,
                    grace: Duration::from_secs(rec.grace_secs),
                    stopping: None,
                    stopped_by_perch: false,
                    stopped_for: None,
                    master_port: rec.master_port,
                },
            );
            kept.insert(job);
        }
        kept
    }

    /// Opens a taken-over job's logs again, read-only, without following links and only if
    /// each is still the very file the agent created (`(device, inode)` as recorded).
    fn reopen_logs(&self, job: u64, ids: [(u64, u64); 2]) -> Option<[File; 2]> {
        use rustix::fs::{Mode, OFlags};
        let dir = self.job_dir(job);
        let open = |name: &str, (dev, ino): (u64, u64)| -> Option<File> {
            let fd = rustix::fs::open(
                dir.join(name),
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .ok()?;
            let f = File::from(fd);
            let m = f.metadata().ok()?;
            (m.is_file() && m.dev() == dev && m.ino() == ino).then_some(f)
        };
        Some([open("stdout", ids[0])?, open("stderr", ids[1])?])
    }

    /// Runs every job launched from now on under a supervisor: `program` (the `perch` binary)
    /// run as `program __job-shim` ([`shim`]).
    pub fn set_supervisor(&mut self, program: PathBuf) {
        self.supervisor = Some(program);
    }

    /// Records the node's lease, renewed by a sync that was sent at `sent_boot_ms`
    /// ([`lease::boot_ms`]) and granted `lease_ms`. Supervisors stop their jobs before it ends.
    pub fn renew_lease(&self, sent_boot_ms: i64, lease_ms: u64) {
        if lease_ms == 0 {
            return;
        }
        let length_ms = i64::try_from(lease_ms).unwrap_or(i64::MAX / 2);
        let lease = lease::Lease {
            end_ms: sent_boot_ms.saturating_add(length_ms),
            length_ms,
        };
        if let Err(e) = lease.write(self.state_dir()) {
            tracing::error!(error = %e, "cannot record the node's lease; its jobs' supervisors will stop them when the last recorded one runs out");
        }
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
                let adopted = name
                    .strip_prefix("job-")
                    .and_then(|j| j.parse::<u64>().ok())
                    .is_some_and(|j| self.running.contains_key(&j));
                if name.starts_with("job-") && !adopted && entry.path().is_dir() {
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

    /// Start reports gathered since the last call (provenance; given back with
    /// [`Launcher::restore_start_reports`] when the server is unreachable).
    pub fn take_start_reports(&mut self) -> Vec<JobStartReport> {
        std::mem::take(&mut self.started)
    }

    /// Puts back start reports that could not be delivered.
    pub fn restore_start_reports(&mut self, mut reports: Vec<JobStartReport>) {
        reports.append(&mut self.started);
        self.started = reports;
    }

    /// The node's driver and CUDA versions, reported with every job started from now on.
    pub fn set_node_versions(&mut self, versions: NodeVersions) {
        self.versions = versions;
    }

    /// Records what attempt `l` started with ([`perch_model::provenance`]): its environment,
    /// secrets redacted, and the node's versions.
    fn report_start(&mut self, l: &JobLaunch, env: &BTreeMap<String, String>) {
        let (env, env_truncated) = perch_model::provenance::reportable_env(env);
        self.started.push(JobStartReport {
            job: l.job,
            attempt: l.attempt,
            env,
            env_truncated,
            driver_version: self.versions.driver_version.clone(),
            cuda_version: self.versions.cuda_version.clone(),
            simulated: self.versions.simulated,
        });
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

    /// Starts an attempt of a job unless it (or a later one) already runs or waits here; waits
    /// while an earlier attempt of the job still runs (the server stopped it) or a stopping
    /// job still holds one of its GPUs.
    pub fn launch(&mut self, l: &JobLaunch) {
        let newer = |attempt: u32| attempt >= l.attempt;
        if self.running.get(&l.job).is_some_and(|r| newer(r.attempt))
            || self
                .waiting
                .iter()
                .any(|w| w.job == l.job && newer(w.attempt))
        {
            return;
        }
        self.waiting.retain(|w| w.job != l.job);
        if self.running.contains_key(&l.job) || self.gpus_busy(l) {
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
                    .unwrap_or(JobTarget::Pid(r.pgid.as_raw_nonzero().get() as u32));
                self.registry.register(JobSpec {
                    job: l.job.to_string(),
                    user: Some(l.user.clone()),
                    gpus: l.gpus.clone(),
                    target,
                    sim_profile: sim_workload(l.sim_profile.as_deref()),
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
                        self.outputs.insert(l.job, l.attempt, [out, err]);
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        tracing::warn!(job = l.job, error = %e, "cannot write why the job did not start to its log");
                    }
                }
                self.exited.insert(
                    l.id(),
                    JobExit {
                        job: l.job,
                        attempt: l.attempt,
                        code,
                        stopped: false,
                        fenced: false,
                        error: Some(why),
                        reason: None,
                        output_bytes: self.outputs.lengths(l.job, self.ship_cap()),
                    },
                );
            }
        }
    }

    /// Starts stopping an attempt of a job: its signal now, SIGKILL after the grace period. An
    /// attempt still waiting for its GPUs is simply dropped (reported as stopped). Another
    /// attempt of the same job is left alone.
    pub fn stop(&mut self, s: &JobStop) {
        if let Some(i) = self
            .waiting
            .iter()
            .position(|w| w.job == s.job && w.attempt == s.attempt)
        {
            let w = self.waiting.remove(i);
            self.exited.insert(
                w.id(),
                JobExit {
                    job: s.job,
                    attempt: s.attempt,
                    code: 128 + 15,
                    stopped: true,
                    fenced: false,
                    error: None,
                    reason: None,
                    output_bytes: None,
                },
            );
            return;
        }
        if let Some(r) = self.running.get_mut(&s.job)
            && r.attempt == s.attempt
            && r.stopping.is_none()
        {
            tracing::info!(job = s.job, attempt = s.attempt, signal = %s.signal, grace_secs = s.grace_secs, "stopping job");
            signal_group(r.pgid, signal_named(&s.signal));
            r.stopping = Some(Stopping {
                kill_at: Instant::now() + Duration::from_secs(s.grace_secs),
            });
            r.stopped_by_perch = true;
        }
    }

    /// How a job's run ended, if it did: its exit code, and whether its supervisor stopped it
    /// (the lease ran out).
    fn ended(&mut self, job: u64, r: &mut Running) -> Option<(i32, bool)> {
        let Some(sup) = r.supervisor else {
            let status = match r.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => status,
                Some(Err(e)) => {
                    tracing::warn!(job, error = %e, "could not check a job's process");
                    return None;
                }
                _ => return None,
            };
            let code = status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
            return Some((code, false));
        };
        // Reap the supervisor when it is the agent's child; its report is the exit record.
        if let Some(child) = r.child.as_mut()
            && matches!(child.try_wait(), Ok(Some(_)))
        {
            r.child = None;
        }
        let state = self.groups.dir();
        let record = || ExitRecord::read(state, job).filter(|e| e.attempt == r.attempt);
        if let Some(exit) = record() {
            return Some((exit.code, exit.fenced));
        }
        if groups::alive(Path::new("/proc"), sup) {
            return None;
        }
        // Gone: its record may have landed just before it exited.
        if let Some(exit) = record() {
            return Some((exit.code, exit.fenced));
        }
        tracing::warn!(
            job,
            "the job's supervisor died without recording how the job ended; killing what is left of it"
        );
        self.notes.push(JobNote {
            job,
            text: "its supervisor (perch __job-shim) was killed; what was left of the job was killed too".into(),
        });
        Some((128 + 9, false))
    }

    /// Sends a job its checkpoint signal, to be killed after its grace period.
    fn start_stopping(r: &mut Running, now: Instant) {
        signal_group(r.pgid, signal_named(&r.signal));
        r.stopping = Some(Stopping {
            kill_at: now + r.grace,
        });
        r.stopped_by_perch = true;
    }

    /// Stops a job whose output passed the node's limit (checkpoint signal, then SIGKILL after
    /// its grace), and kills it at once if it goes on writing [`OUTPUT_SLACK`] more. A job
    /// already stopping (cancelled, preempted) keeps its reason; only the kill applies.
    fn limit_output(&self, job: u64, r: &mut Running, now: Instant) {
        let written = self
            .outputs
            .lengths(job, u64::MAX)
            .map_or(0, |[o, e]| o.saturating_add(e));
        if written <= self.output_limit {
            return;
        }
        if r.stopping.is_none() {
            let limit_mib = self.output_limit >> 20;
            tracing::warn!(
                job,
                written,
                limit_mib,
                "job wrote more output than the node keeps; stopping it"
            );
            r.stopped_for = Some(format!(
                "its output (stdout and stderr) passed {limit_mib} MiB, the most this node keeps per job (agent.max_job_output_mb); print less, or write large output to files in its working directory"
            ));
            Self::start_stopping(r, now);
        }
        // Still pouring out during its grace period: no more of the node's disk.
        if written > self.output_limit.saturating_add(OUTPUT_SLACK) {
            Self::kill_all(r);
        }
    }

    /// Applies the output limit to every running job (between syncs too: a job can write
    /// hundreds of MB in one sync interval).
    pub fn limit_outputs(&mut self) {
        let now = Instant::now();
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for job in ids {
            if let Some(mut r) = self.running.remove(&job) {
                self.limit_output(job, &mut r, now);
                self.running.insert(job, r);
            }
        }
    }

    /// Sets the most output a job may write here, bytes, before the agent stops it.
    pub fn set_output_limit(&mut self, bytes: u64) {
        self.output_limit = bytes.max(1);
    }

    /// Most bytes of one stream ever shipped: the limit and the slack past it.
    fn ship_cap(&self) -> u64 {
        self.output_limit.saturating_add(OUTPUT_SLACK)
    }

    /// SIGKILL to everything of a job: its group, its cgroup, and (supervised) every process
    /// under its supervisor, whatever group it moved to.
    fn kill_all(r: &Running) {
        signal_group(r.pgid, Signal::KILL);
        if let Some(cg) = &r.cgroup {
            cg.kill();
        }
        if let Some((pid, _)) = r.supervisor {
            tree::kill_descendants(pid);
        }
    }

    /// Reaps exited jobs, enforces time limits and grace periods.
    pub fn poll(&mut self) {
        let now = Instant::now();
        let mut done = Vec::new();
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for job in ids {
            let Some(mut r) = self.running.remove(&job) else {
                continue;
            };
            if let Some((code, fenced)) = self.ended(job, &mut r) {
                // Whatever is left of the job goes too.
                Self::kill_all(&r);
                done.push((
                    JobExit {
                        job,
                        attempt: r.attempt,
                        code,
                        stopped: r.stopped_by_perch || fenced,
                        fenced,
                        error: None,
                        reason: r.stopped_for.take(),
                        output_bytes: self.outputs.lengths(job, self.ship_cap()),
                    },
                    r.cgroup.take(),
                ));
                continue;
            }
            if r.stopping.is_none() && now.duration_since(r.started) > r.limit + LIMIT_MARGIN {
                tracing::warn!(job, "job ran past its time limit; stopping it");
                Self::start_stopping(&mut r, now);
            }
            self.limit_output(job, &mut r, now);
            if r.stopping.as_ref().is_some_and(|s| now >= s.kill_at) {
                Self::kill_all(&r);
            }
            self.running.insert(job, r);
        }
        self.leftover_cgroups.retain(|cg| {
            cg.remove();
            cg.path.exists()
        });
        for (exit, cgroup) in done {
            if let Some(cg) = cgroup {
                cg.remove();
                if cg.path.exists() {
                    self.leftover_cgroups.push(cg);
                }
            }
            self.registry.unregister(&exit.job.to_string());
            self.groups.forget(exit.job);
            tracing::info!(
                job = exit.job,
                attempt = exit.attempt,
                code = exit.code,
                "job exited"
            );
            self.exited.insert(exit.id(), exit);
        }
        let waiting = std::mem::take(&mut self.waiting);
        for l in waiting {
            if self.running.contains_key(&l.job) || self.gpus_busy(&l) {
                self.waiting.push(l);
            } else {
                self.start(&l);
            }
        }
    }

    /// Attempts running now, or accepted and waiting for their GPUs.
    pub fn running(&self) -> Vec<JobAttempt> {
        let mut ids: Vec<JobAttempt> = self
            .running
            .iter()
            .map(|(&job, r)| JobAttempt {
                job,
                attempt: r.attempt,
            })
            .chain(self.waiting.iter().map(JobLaunch::id))
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The rendezvous ports picked here for running jobs ([`JobLaunch::pick_master_port`]).
    pub fn master_ports(&self) -> Vec<MasterPort> {
        let mut ports: Vec<MasterPort> = self
            .running
            .iter()
            .filter_map(|(&job, r)| {
                Some(MasterPort {
                    job,
                    attempt: r.attempt,
                    port: r.master_port?,
                })
            })
            .collect();
        ports.sort_unstable_by_key(|p| p.job);
        ports
    }

    /// Exits the server has not acknowledged yet.
    pub fn exited(&self) -> Vec<JobExit> {
        self.exited.values().cloned().collect()
    }

    /// New output of every job with unsent output, ended jobs' included.
    pub fn logs(&self) -> Vec<LogChunk> {
        self.outputs
            .chunks(|job| self.running.contains_key(&job), self.ship_cap())
    }

    /// Applies the server's answer: forget acknowledged exits, move log offsets, stop and start.
    pub fn apply(&mut self, response: &SyncResponse) {
        for &(job, stream, offset) in &response.log_offsets {
            self.outputs.sent(job, stream, offset);
        }
        for run in &response.acknowledged {
            self.exited.remove(run);
            if !self.running.contains_key(&run.job) {
                self.outputs.acknowledged(run.job, run.attempt);
            }
        }
        // A job's records go with its output: an agent restarted before all of it was sent
        // finds the job ended while it was away, reports it again and ships the rest.
        let shipped = self.outputs.remove_shipped(self.ship_cap());
        let state = self.groups.dir();
        for job in response.acknowledged.iter().map(|r| r.job).chain(shipped) {
            if !self.running.contains_key(&job) && !self.outputs.holds(job) {
                RunRecord::remove(state, job);
                ExitRecord::remove(state, job);
            }
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
        for run in self.running() {
            let grace = self
                .running
                .get(&run.job)
                .map_or(0, |r| r.grace.as_secs())
                .min(within.as_secs());
            let signal = self
                .running
                .get(&run.job)
                .map_or_else(|| "SIGTERM".into(), |r| r.signal.clone());
            self.stop(&JobStop {
                job: run.job,
                attempt: run.attempt,
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
            Self::kill_all(r);
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
    use perch_model::control::LogStream;

    fn launch(job: u64, script: &str) -> JobLaunch {
        JobLaunch {
            job,
            attempt: 1,
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
            gpu_mig: None,
            cpus: None,
            memory_mb: None,
            pick_master_port: false,
            hosts: Vec::new(),
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

    /// Polls the job's standard output (as shipped to the server) until it holds `text`.
    pub(super) fn wait_stdout(l: &mut Launcher, job: u64, text: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let out: String = l
                .logs()
                .into_iter()
                .filter(|c| c.job == job && c.stream == LogStream::Stdout)
                .map(|c| c.data)
                .collect();
            if out.contains(text) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "job {job} did not print {text:?}: {out:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
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
            acknowledged: vec![JobAttempt { job: 1, attempt: 1 }],
            log_offsets: vec![(1, LogStream::Stdout, 9)],
            ..Default::default()
        });
        assert!(l.exited().is_empty());
        assert!(
            l.logs().iter().all(|c| c.stream != LogStream::Stdout),
            "stdout fully sent"
        );
    }

    /// Output the job wrote faster than a sync carries is still shipped after its exit is
    /// acknowledged (it was dropped there: a job that printed 6.9 MB and exited kept 512 KiB on
    /// the server), the exit says how much there is, and the node's copy goes once all is sent.
    #[test]
    fn output_is_shipped_whole_after_the_exit_and_then_removed_from_the_node() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        l.launch(&launch(1, "seq 1 300000")); // 1,988,895 bytes: 8 chunks
        let exit = wait_exit(&mut l, 1);
        let total = 1_988_895;
        assert_eq!(exit.output_bytes, Some([total, 0]));
        let mut server = Vec::new();
        for round in 0..20 {
            let chunks = l.logs();
            let mut offsets = Vec::new();
            for c in &chunks {
                assert_eq!(
                    (c.stream, c.offset),
                    (LogStream::Stdout, server.len() as u64)
                );
                server.extend_from_slice(c.data.as_bytes());
                offsets.push((1, LogStream::Stdout, server.len() as u64));
            }
            // The first answer acknowledges the exit, with a quarter of the output sent.
            let acknowledged = if round == 0 {
                vec![JobAttempt { job: 1, attempt: 1 }]
            } else {
                Vec::new()
            };
            l.apply(&SyncResponse {
                acknowledged,
                log_offsets: offsets,
                ..Default::default()
            });
            if chunks.is_empty() {
                break;
            }
        }
        assert_eq!(server.len() as u64, total);
        let expected: String = (1..=300_000).map(|i| format!("{i}\n")).collect();
        assert!(
            server == expected.as_bytes(),
            "the server's copy is the job's output"
        );
        assert!(l.logs().is_empty(), "nothing left to send");
        assert!(
            !dir.path().join("1").exists(),
            "the node's copy is removed once the server holds it"
        );
        // What a job without a working directory writes beside its output is its user's.
        l.launch(&launch(2, "echo done; echo model > weights.pt"));
        let exit = wait_exit(&mut l, 2);
        assert_eq!(exit.output_bytes, Some([5, 0]));
        l.apply(&SyncResponse {
            acknowledged: vec![JobAttempt { job: 2, attempt: 1 }],
            log_offsets: vec![(2, LogStream::Stdout, 5)],
            ..Default::default()
        });
        let job_dir = dir.path().join("2");
        assert!(!job_dir.join("stdout").exists() && !job_dir.join("stderr").exists());
        assert_eq!(
            std::fs::read_to_string(job_dir.join("weights.pt")).expect("kept"),
            "model\n"
        );
    }

    /// A job printing in a tight loop filled a node's disk (7.5 GB in 20 s): past the node's
    /// limit the agent stops it, names why, and kills it at once if it keeps writing.
    #[test]
    fn a_job_writing_past_the_output_limit_is_stopped_and_says_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        l.set_output_limit(1 << 20);
        // Ignores its checkpoint signal and goes on writing through its grace period.
        let mut job = launch(1, "trap '' TERM; yes perch-flood");
        job.grace_secs = 3600;
        l.launch(&job);
        let exit = wait_exit(&mut l, 1);
        assert!(exit.stopped, "{exit:?}");
        let reason = exit.reason.clone().expect("a reason");
        assert!(
            reason.contains("passed 1 MiB") && reason.contains("agent.max_job_output_mb"),
            "{reason}"
        );
        let [out, _] = exit.output_bytes.expect("output lengths");
        assert!(
            out > 1 << 20 && out < (1 << 20) + OUTPUT_SLACK + (256 << 20),
            "{out} bytes"
        );
        // A job under the limit is not touched.
        l.launch(&launch(2, "seq 1 1000"));
        let exit = wait_exit(&mut l, 2);
        assert_eq!((exit.code, exit.stopped, exit.reason), (0, false, None));
    }

    /// A job can make its output look terabytes long without using the disk (a write after a
    /// seek); the agent ships no more than the node's limit and the slack past it.
    #[test]
    fn a_sparse_output_file_is_shipped_only_up_to_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        l.set_output_limit(1 << 20);
        let cap = (1 << 20) + OUTPUT_SLACK;
        l.launch(&launch(
            1,
            "dd if=/dev/zero of=/dev/stdout bs=1 count=1 seek=1099511627776 conv=notrunc 2>/dev/null",
        ));
        let exit = wait_exit(&mut l, 1);
        assert_eq!(exit.output_bytes, Some([cap, 0]), "{exit:?}");
        l.apply(&SyncResponse {
            acknowledged: vec![JobAttempt { job: 1, attempt: 1 }],
            log_offsets: vec![(1, LogStream::Stdout, cap - 10)],
            ..Default::default()
        });
        // The rest up to the cap is a hole: an anchor and the cap, no zeros.
        let chunks: Vec<(u64, usize)> = l.logs().iter().map(|c| (c.offset, c.data.len())).collect();
        assert_eq!(chunks, vec![(cap - 10, 0), (cap, 0)]);
        l.apply(&SyncResponse {
            log_offsets: vec![(1, LogStream::Stdout, cap)],
            ..Default::default()
        });
        assert!(l.logs().is_empty(), "nothing past the cap");
        assert!(
            !dir.path().join("1").exists(),
            "and the sparse file is gone"
        );
    }

    /// Rank 0 gets a port free on this node (a port taken by someone else is skipped) and
    /// reports it while it runs; every rank gets its hostfile.
    #[test]
    fn rank_zero_picks_a_free_port_and_every_rank_gets_a_hostfile() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        let mut rank0 = launch(
            7,
            "echo $MASTER_PORT $PET_MASTER_PORT; cat \"$PERCH_HOSTFILE\"; sleep 30",
        );
        rank0.pick_master_port = true;
        rank0.hosts = vec![
            perch_model::control::LaunchHost {
                addr: "10.0.0.1".into(),
                slots: 2,
            },
            perch_model::control::LaunchHost {
                addr: "10.0.0.2".into(),
                slots: 8,
            },
        ];
        // The port this job would try first is taken.
        let first = pick_master_port(&rank0);
        let _taken = std::net::TcpListener::bind(("0.0.0.0", first)).expect("bind");
        l.launch(&rank0);
        let port = l.master_ports().first().expect("a port").port;
        assert_ne!(port, first, "a taken port is not picked");
        assert_eq!(
            l.master_ports(),
            vec![MasterPort {
                job: 7,
                attempt: 1,
                port
            }]
        );
        let mut out = String::new();
        for _ in 0..200 {
            out = l
                .logs()
                .iter()
                .filter(|c| c.stream == LogStream::Stdout)
                .map(|c| c.data.clone())
                .collect();
            if out.lines().count() >= 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        assert_eq!(
            out,
            format!("{port} {port}\n10.0.0.1 slots=2\n10.0.0.2 slots=8\n")
        );
        l.stop(&JobStop {
            job: 7,
            attempt: 1,
            signal: "SIGKILL".into(),
            grace_secs: 0,
        });
        wait_exit(&mut l, 7);
        assert!(l.master_ports().is_empty(), "only running jobs' ports");
    }

    #[test]
    fn stop_signals_the_group_then_kills_after_grace() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        // The child shell ignores SIGTERM (and so does its own child): only SIGKILL ends it.
        // It says when its trap is set, so the stop cannot come before.
        l.launch(&launch(
            2,
            "trap '' TERM; echo trapped; sleep 30 & wait; sleep 30",
        ));
        wait_stdout(&mut l, 2, "trapped");
        l.stop(&JobStop {
            job: 2,
            attempt: 1,
            signal: "SIGTERM".into(),
            grace_secs: 1,
        });
        let exit = wait_exit(&mut l, 2);
        assert_eq!((exit.code, exit.stopped), (128 + 9, true));
    }

    /// One sync answer can carry stop(X, 1) and start(X, 2). The stop touches only
    /// attempt 1; attempt 2 waits until attempt 1 is gone; each exit names its attempt.
    #[test]
    fn orders_name_attempts_and_a_new_attempt_waits_for_the_old_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut l = Launcher::new(dir.path()).expect("launcher");
        // The handler's sleep is the job taking its time to checkpoint; the test waits for the
        // trap to be set, not for time to pass.
        l.launch(&launch(
            5,
            "trap 'sleep 0.3; exit 0' TERM; echo trapped; while :; do sleep 0.05; done",
        ));
        wait_stdout(&mut l, 5, "trapped");
        l.stop(&JobStop {
            job: 5,
            attempt: 2,
            signal: "SIGTERM".into(),
            grace_secs: 1,
        });
        l.poll();
        assert!(
            l.running.get(&5).is_some_and(|r| r.stopping.is_none()),
            "a stop for another attempt leaves attempt 1 alone"
        );
        let mut second = launch(5, "exit 4");
        second.attempt = 2;
        l.apply(&SyncResponse {
            stop: vec![JobStop {
                job: 5,
                attempt: 1,
                signal: "SIGTERM".into(),
                grace_secs: 5,
            }],
            start: vec![second],
            ..Default::default()
        });
        assert_eq!(
            l.running(),
            vec![
                JobAttempt { job: 5, attempt: 1 },
                JobAttempt { job: 5, attempt: 2 }
            ],
            "attempt 2 accepted, waiting"
        );
        assert_eq!(l.running.get(&5).map(|r| r.attempt), Some(1));
        for _ in 0..200 {
            l.poll();
            if l.exited().len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let exits: Vec<(u32, i32, bool)> = l
            .exited()
            .iter()
            .map(|e| (e.attempt, e.code, e.stopped))
            .collect();
        assert_eq!(exits, vec![(1, 0, true), (2, 4, false)]);
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
        let pid = old
            .running
            .get(&4)
            .map(|r| r.pgid.as_raw_nonzero().get())
            .expect("running");
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
        assert_eq!(output::text_of(b"ab\xffc", true), ("ab?c".into(), 4));
        assert_eq!(output::text_of("é".as_bytes(), false), ("é".into(), 2));
        assert_eq!(
            output::text_of(&"é".as_bytes()[..1], false),
            (String::new(), 0),
            "held back until complete"
        );
        assert_eq!(output::text_of(&"é".as_bytes()[..1], true), ("?".into(), 1));
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
            attempt: 1,
            command: vec![
                "sh".into(),
                "-c".into(),
                "trap 'sleep 0.5; exit 0' TERM; echo trapped; while true; do sleep 0.05; done"
                    .into(),
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
            gpu_mig: None,
            cpus: None,
            memory_mb: None,
            pick_master_port: false,
            hosts: Vec::new(),
        };
        l.launch(&old);
        super::tests::wait_stdout(&mut l, 1, "trapped");
        l.stop(&JobStop {
            job: 1,
            attempt: 1,
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
        assert_eq!(
            l.running().iter().map(|r| r.job).collect::<Vec<_>>(),
            vec![1, 2],
            "job 2 is accepted"
        );
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
