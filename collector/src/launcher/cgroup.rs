//! One cgroup (v2) per job, holding the job's memory and CPU request as limits.
//!
//! At start the agent takes a cgroup v2 directory it may manage (`agent.cgroups`: `auto` is
//! the agent's own cgroup, found from `/proc/self/mountinfo` and `/proc/self/cgroup`; or a
//! path; or `off`), enables the `memory` and `cpu` controllers for its children and creates
//! `perch-jobs/<scope>/` in it ([`scope_of`]: one directory per agent). Each job then gets
//! `perch-jobs/<scope>/job-<id>` with `memory.max` from its
//! `memory_mb` and `cpu.max` from its `cpus`, and its first process is put there before it
//! runs anything (see [`crate::launcher`]: the child waits on its standard input until the
//! agent has written its pid to `cgroup.procs`, so no process of the job ever starts outside).
//!
//! cgroup v2 forbids a non-root cgroup to both hold processes and hand controllers to its
//! children. When the agent's cgroup holds processes (it holds the agent itself), they are
//! moved into a `perch-agent/` leaf first, as systemd's delegation rules ask of a service that
//! manages its own subtree.
//!
//! Where any of this is impossible (cgroup v1 only, a read-only or undelegated hierarchy, the
//! agent not root, a controller missing), jobs still run, and each job's log and record say
//! in one line which limits were not enforced and why.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

/// `agent.cgroups`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CgroupMode {
    /// The agent's own cgroup v2 directory.
    #[default]
    Auto,
    /// No cgroups: jobs run unconfined.
    Off,
    /// This cgroup v2 directory (delegated to the agent).
    Path(PathBuf),
}

impl CgroupMode {
    /// `auto`, `off`, or an absolute path.
    pub fn parse(text: &str) -> Result<CgroupMode, String> {
        match text {
            "auto" => Ok(CgroupMode::Auto),
            "off" => Ok(CgroupMode::Off),
            p if p.starts_with('/') => Ok(CgroupMode::Path(PathBuf::from(p))),
            other => Err(format!(
                "{other:?} is not auto, off, or the absolute path of a cgroup v2 directory"
            )),
        }
    }
}

/// The name of one agent's directory of job cgroups: the last part of its jobs directory
/// (the node name) and a hash of the whole path. Several agents on one machine (`perch demo`,
/// tests, two clusters) then never touch each other's jobs, and a restarted agent finds the
/// cgroups its predecessor left.
pub fn scope_of(jobs_dir: &Path) -> String {
    // FNV-1a: stable across builds, unlike std's hasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in jobs_dir.as_os_str().as_encoded_bytes() {
        hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let name: String = jobs_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    format!("{name}-{:08x}", hash as u32)
}

/// The controllers perch uses.
const WANTED: [&str; 2] = ["memory", "cpu"];
/// `cpu.max` period, microseconds (the kernel's default).
const CPU_PERIOD_US: u64 = 100_000;

/// The parent of the jobs' cgroups, ready to create them in.
#[derive(Debug, Clone)]
pub struct JobCgroups {
    parent: PathBuf,
    /// Controllers enabled for job cgroups.
    enabled: Vec<&'static str>,
    /// Why each wanted controller that is not enabled is not.
    missing: Vec<(&'static str, String)>,
}

/// What one job's cgroup enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobCgroup {
    pub path: PathBuf,
    /// One line for the job's log and record: the limits set, and any not enforced and why.
    pub note: String,
    /// Whether every limit the job asked for is enforced.
    pub enforced: bool,
}

/// The cgroup v2 directory of this process: the unified mount point from `mountinfo` joined
/// with the `0::` line of `/proc/self/cgroup`, both read under `root` (`/` on a node).
pub fn own_cgroup(root: &Path) -> Result<PathBuf, String> {
    let mountinfo_path = root.join("proc/self/mountinfo");
    let mountinfo = fs::read_to_string(&mountinfo_path)
        .map_err(|e| format!("cannot read {}: {e}", mountinfo_path.display()))?;
    // Fields: id parent major:minor root mount-point options ... - fstype source options.
    let mount = mountinfo
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            (right.split_whitespace().next() == Some("cgroup2"))
                .then(|| left.split_whitespace().nth(4).map(str::to_owned))
                .flatten()
        })
        .ok_or("no cgroup v2 hierarchy is mounted (the node uses cgroup v1 only)")?;
    let cgroup_path = root.join("proc/self/cgroup");
    let cgroup = fs::read_to_string(&cgroup_path)
        .map_err(|e| format!("cannot read {}: {e}", cgroup_path.display()))?;
    let own = cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("this process is in no cgroup v2 (no 0:: line in /proc/self/cgroup)")?;
    let mount = root.join(mount.trim_start_matches('/'));
    let own = own.trim().trim_start_matches('/');
    Ok(if own.is_empty() {
        mount
    } else {
        mount.join(own)
    })
}

fn controllers(dir: &Path) -> Result<Vec<String>, String> {
    let path = dir.join("cgroup.controllers");
    fs::read_to_string(&path)
        .map(|t| t.split_whitespace().map(str::to_owned).collect())
        .map_err(|e| {
            format!(
                "{} is not a cgroup v2 directory ({}: {e})",
                dir.display(),
                path.display()
            )
        })
}

fn write(path: &Path, value: &str) -> std::io::Result<()> {
    fs::write(path, value)
}

/// Moves every process of `dir` into its `perch-agent` leaf, so `dir` may hand controllers
/// to its children.
fn vacate(dir: &Path) -> std::io::Result<()> {
    let leaf = dir.join("perch-agent");
    match fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let procs = fs::read_to_string(dir.join("cgroup.procs"))?;
    for pid in procs.split_whitespace() {
        // A process may exit meanwhile; that one needs no moving.
        match write(&leaf.join("cgroup.procs"), pid) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl JobCgroups {
    /// Prepares `base`, a cgroup v2 directory the agent may manage, for the jobs of one agent
    /// known by `scope` (see [`scope_of`]): they go in `base/perch-jobs/<scope>/`. An error says
    /// in one line why job cgroups cannot be made there.
    pub fn open(base: &Path, scope: &str) -> Result<JobCgroups, String> {
        let available = controllers(base)?;
        let jobs = base.join("perch-jobs");
        let parent = jobs.join(scope);
        for dir in [&jobs, &parent] {
            let created = match fs::create_dir(dir) {
                Err(e) if e.kind() == ErrorKind::AlreadyExists && !dir.is_dir() => Err(
                    std::io::Error::new(ErrorKind::AlreadyExists, "a file is in the way"),
                ),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
                other => other,
            };
            if let Err(e) = created {
                return Err(format!(
                    "cannot create {}: {e} (run the agent as root, or delegate a cgroup v2 subtree to it and set agent.cgroups to its path)",
                    dir.display()
                ));
            }
        }
        let mut enabled = Vec::new();
        let mut missing = Vec::new();
        for c in WANTED {
            if !available.iter().any(|a| a == c) {
                let listed = if available.is_empty() {
                    "none".to_owned()
                } else {
                    available.join(" ")
                };
                missing.push((
                    c,
                    format!(
                        "the {c} controller is not available in {} (it lists: {listed})",
                        base.display()
                    ),
                ));
                continue;
            }
            let enable = |dir: &Path| write(&dir.join("cgroup.subtree_control"), &format!("+{c}"));
            let mut result = enable(base);
            // EBUSY: `base` holds processes; move them to a leaf and try again.
            let busy = rustix::io::Errno::BUSY.raw_os_error();
            if matches!(&result, Err(e) if e.raw_os_error() == Some(busy)) {
                result = vacate(base).and_then(|()| enable(base));
            }
            match result
                .and_then(|()| enable(&jobs))
                .and_then(|()| enable(&parent))
            {
                Ok(()) => enabled.push(c),
                Err(e) => missing.push((
                    c,
                    format!(
                        "cannot enable the {c} controller under {}: {e}",
                        base.display()
                    ),
                )),
            }
        }
        Ok(JobCgroups {
            parent,
            enabled,
            missing,
        })
    }

    /// Finds the cgroup directory `mode` names (under `root`, `/` on a node) and prepares it
    /// for the agent known by `scope`; `Ok(None)` when cgroups are off.
    pub fn from_mode(
        mode: &CgroupMode,
        root: &Path,
        scope: &str,
    ) -> Result<Option<JobCgroups>, String> {
        let base = match mode {
            CgroupMode::Off => return Ok(None),
            CgroupMode::Auto => own_cgroup(root)?,
            CgroupMode::Path(p) => p.clone(),
        };
        JobCgroups::open(&base, scope).map(Some)
    }

    /// Removes this agent's (empty) directory of job cgroups, at shutdown.
    pub fn close(&self) {
        if let Err(e) = fs::remove_dir(&self.parent)
            && e.kind() != ErrorKind::NotFound
        {
            tracing::debug!(cgroup = %self.parent.display(), error = %e, "job cgroup directory not removed");
        }
    }

    /// The directory job cgroups are created in.
    pub fn parent(&self) -> &Path {
        &self.parent
    }

    /// Creates job `job`'s cgroup with limits from its request. An error means the job gets
    /// no cgroup at all (it still runs); the text says why.
    pub fn create(
        &self,
        job: u64,
        memory_mb: Option<u64>,
        cpus: Option<u32>,
    ) -> Result<JobCgroup, String> {
        let path = self.parent.join(format!("job-{job}"));
        // A cgroup left by an earlier attempt is empty once its processes are gone; reuse it.
        match fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create {}: {e}", path.display())),
        }
        let mut set = Vec::new();
        let mut unset = Vec::new();
        let mut limit = |controller: &str, file: &str, value: Option<String>, shown: String| {
            let Some(value) = value else {
                return;
            };
            if !self.enabled.contains(&controller) {
                let why = self
                    .missing
                    .iter()
                    .find(|(c, _)| *c == controller)
                    .map_or("its controller is not enabled", |(_, why)| why.as_str());
                unset.push(format!("{shown} ({why})"));
                return;
            }
            match write(&path.join(file), &value) {
                Ok(()) => set.push(format!("{file} {value}")),
                Err(e) => unset.push(format!("{shown} ({file}: {e})")),
            }
        };
        limit(
            "memory",
            "memory.max",
            memory_mb.map(memory_max),
            format!("memory {} MiB", memory_mb.unwrap_or(0)),
        );
        limit(
            "cpu",
            "cpu.max",
            cpus.map(|c| format!("{} {CPU_PERIOD_US}", u64::from(c) * CPU_PERIOD_US)),
            format!("{} CPUs", cpus.unwrap_or(0)),
        );
        let enforced = unset.is_empty();
        let note = match (set.is_empty(), enforced) {
            (_, false) => format!(
                "cgroup {}: limits not enforced: {}{}",
                path.display(),
                unset.join(", "),
                if set.is_empty() {
                    String::new()
                } else {
                    format!("; set: {}", set.join(", "))
                }
            ),
            (true, true) => format!(
                "cgroup {} (no memory or CPU limit requested)",
                path.display()
            ),
            (false, true) => format!("cgroup {}: {}", path.display(), set.join(", ")),
        };
        Ok(JobCgroup {
            path,
            note,
            enforced,
        })
    }
}

impl JobCgroup {
    /// Puts process `pid` into the cgroup.
    pub fn add(&self, pid: u32) -> std::io::Result<()> {
        write(&self.path.join("cgroup.procs"), &pid.to_string())
    }

    /// Kills every process in the cgroup (`cgroup.kill`, Linux 5.14+), also those that left
    /// the job's process group. Best effort: the process group is signalled too.
    pub fn kill(&self) {
        let kill = self.path.join("cgroup.kill");
        if kill.exists()
            && let Err(e) = write(&kill, "1")
        {
            tracing::debug!(cgroup = %self.path.display(), error = %e, "cgroup.kill failed");
        }
    }

    /// Removes the (empty) cgroup; a cgroup still holding processes stays, logged.
    pub fn remove(&self) {
        if let Err(e) = fs::remove_dir(&self.path)
            && e.kind() != ErrorKind::NotFound
        {
            tracing::debug!(cgroup = %self.path.display(), error = %e, "job cgroup not removed");
        }
    }
}

#[cfg(test)]
mod tests;

/// `memory.max` for a limit of `mb` MiB, in bytes. Saturating: a limit too large to write in
/// bytes is no limit at all, never a wrapped small one (`(2^44 + 1) << 20` is 1 MiB).
fn memory_max(mb: u64) -> String {
    mb.saturating_mul(1 << 20).to_string()
}
