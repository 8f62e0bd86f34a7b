//! Runs the jobs the server places on this node.
//!
//! Each job runs in its own process group with `CUDA_VISIBLE_DEVICES` set to its GPUs, its
//! output in `<data-dir>/jobs/<id>/{stdout,stderr}`. Stopping a job (cancel, preemption, time
//! limit) sends its checkpoint signal to the whole group, waits its grace period, then sends
//! SIGKILL. The agent enforces the time limit itself too, so a job cannot outrun it while the
//! server is away. Every job's process group is written to `<id>/pgid`; a restarted agent kills
//! groups it finds there (it cannot wait on them), and the server, seeing the job missing from
//! the agent's report, requeues it: no job runs twice and none is orphaned.

mod otel;

pub use otel::OtelTarget;

use crate::jobs::{JobRegistry, JobSpec, JobTarget};
use perch_model::control::{JobExit, JobLaunch, JobStop, LogChunk, LogStream, SyncResponse};
use rustix::process::{Pid, Signal, kill_process_group};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

struct Running {
    child: Child,
    gpus: Vec<u32>,
    pgid: Pid,
    started: Instant,
    limit: Duration,
    signal: String,
    grace: Duration,
    stopping: Option<Stopping>,
    stopped_by_perch: bool,
}

/// The jobs of this node.
pub struct Launcher {
    dir: PathBuf,
    running: HashMap<u64, Running>,
    /// Exits not yet acknowledged by the server.
    exited: BTreeMap<u64, JobExit>,
    /// Where each job's streams continue from, as the server last said.
    sent: HashMap<(u64, LogStream), u64>,
    /// Where the agent's sampler learns which processes and GPUs belong to which job.
    registry: JobRegistry,
    /// Launches waiting for a stopping job to release their GPUs (the server frees a job's
    /// GPUs when it decides to stop it; the processes may need their grace period first).
    waiting: Vec<JobLaunch>,
    /// Where jobs' OpenTelemetry SDKs export to; `None` sets no `OTEL_*` variables.
    otel: Option<OtelTarget>,
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
        for entry in fs::read_dir(dir)?.flatten() {
            let pgid_file = entry.path().join("pgid");
            let Ok(text) = fs::read_to_string(&pgid_file) else {
                continue;
            };
            if let Some(pgid) = text.trim().parse::<i32>().ok().and_then(Pid::from_raw) {
                tracing::warn!(job = %entry.file_name().to_string_lossy(), "killing a job left running by a previous agent; the server requeues it");
                signal_group(pgid, Signal::KILL);
            }
            let _ = fs::remove_file(&pgid_file);
        }
        Ok(Launcher {
            dir: dir.to_path_buf(),
            running: HashMap::new(),
            exited: BTreeMap::new(),
            sent: HashMap::new(),
            registry,
            waiting: Vec::new(),
            otel: None,
        })
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

    fn gpus_busy(&self, l: &JobLaunch) -> bool {
        self.running
            .values()
            .any(|r| r.gpus.iter().any(|g| l.gpus.contains(g)))
    }

    fn start(&mut self, l: &JobLaunch) {
        match self.spawn(l) {
            Ok(r) => {
                tracing::info!(job = l.job, gpus = ?l.gpus, "job started");
                self.registry.register(JobSpec {
                    job: l.job.to_string(),
                    user: Some(l.user.clone()),
                    gpus: l.gpus.clone(),
                    target: JobTarget::Pid(r.child.id()),
                    sim_profile: match l.sim_profile.as_deref() {
                        Some("idle") => Some(crate::gpu::sim::Workload::AllocatedIdle),
                        Some("bursty") => Some(crate::gpu::sim::Workload::Bursty),
                        Some(_) => Some(crate::gpu::sim::Workload::Training),
                        None => None,
                    },
                });
                self.running.insert(l.job, r);
            }
            Err(e) => {
                tracing::warn!(job = l.job, error = %e, "job could not start");
                let dir = self.job_dir(l.job);
                let _ = fs::write(
                    dir.join("stderr"),
                    format!("perch: could not start {:?}: {e}\n", l.command),
                );
                // 127 is what a shell reports for a command it cannot run.
                self.exited.insert(
                    l.job,
                    JobExit {
                        job: l.job,
                        code: 127,
                        stopped: false,
                        error: None,
                    },
                );
            }
        }
    }

    fn spawn(&mut self, l: &JobLaunch) -> std::io::Result<Running> {
        let dir = self.job_dir(l.job);
        fs::create_dir_all(&dir)?;
        // A new attempt starts new output; the server's copy is kept per job.
        let stdout = File::create(dir.join("stdout"))?;
        let stderr = File::create(dir.join("stderr"))?;
        self.sent.insert((l.job, LogStream::Stdout), 0);
        self.sent.insert((l.job, LogStream::Stderr), 0);
        let program = l
            .command
            .first()
            .ok_or_else(|| std::io::Error::other("empty command"))?;
        let gpus: Vec<String> = l.gpus.iter().map(u32::to_string).collect();
        let mut cmd = Command::new(program);
        cmd.args(&l.command[1..])
            .envs(&l.env)
            .env("CUDA_VISIBLE_DEVICES", gpus.join(","))
            .env("PERCH_NODE_RANK", l.node_rank.to_string())
            .env("PERCH_NUM_NODES", l.nodes.to_string())
            .current_dir(l.workdir.as_deref().map_or(dir.clone(), PathBuf::from))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0);
        if let Some(target) = &self.otel {
            // After the job's own env: `variables` leaves out what the job sets itself.
            cmd.envs(otel::variables(target, l));
        }
        let child = cmd.spawn()?;
        let raw = i32::try_from(child.id()).map_err(std::io::Error::other)?;
        let pgid = Pid::from_raw(raw).ok_or_else(|| std::io::Error::other("process id 0"))?;
        fs::write(dir.join("pgid"), raw.to_string())?;
        Ok(Running {
            child,
            gpus: l.gpus.clone(),
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
                    // Whatever is left of the group goes too.
                    signal_group(r.pgid, Signal::KILL);
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
                    }
                }
                Err(e) => tracing::warn!(job, error = %e, "could not check a job's process"),
            }
        }
        for exit in done {
            self.running.remove(&exit.job);
            self.registry.unregister(&exit.job.to_string());
            let _ = fs::remove_file(self.job_dir(exit.job).join("pgid"));
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
                let path = self.job_dir(job).join(stream.as_str());
                let Ok(mut f) = File::open(&path) else {
                    continue;
                };
                let mut buf = Vec::new();
                if f.seek(SeekFrom::Start(offset)).is_err()
                    || f.take(LOG_CHUNK).read_to_end(&mut buf).is_err()
                {
                    continue;
                }
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
        }
        self.poll();
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
