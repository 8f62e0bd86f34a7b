//! What a job ran, kept so that it can be run again: the submit side (the submit directory's
//! git commit, branch and a bounded diff of its uncommitted changes, the container image and
//! its digest, the Python packages when asked), recorded by the CLI and checked here, and the
//! node side of every attempt (the environment after perch's additions, secrets redacted, and
//! the node's driver and CUDA versions), reported by the agent as it starts it.
//!
//! One [`ProvenanceRecord`] per job, in the job store beside the job's record but not in it:
//! a diff of 256 KiB is not held in memory for every job, only read when asked for
//! (`GET /v1/jobs/{id}/provenance`, the `job_provenance` table). Every size is bounded; a
//! submission past a bound is refused saying which and by how much. Only the job's user and
//! operators read it.

use crate::spec::FieldError;
use perch_model::provenance::JobStartReport;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The most bytes of uncommitted diff recorded; the CLI cuts a larger one and says so.
pub const MAX_DIFF_BYTES: usize = 256 << 10;
/// The most untracked files named (by name only, never their contents).
pub const MAX_UNTRACKED: usize = 1000;
/// The most bytes of Python package list (`pip freeze`) recorded.
pub const MAX_PACKAGES_BYTES: usize = 256 << 10;
/// The longest path, branch, image reference or other single value.
pub const MAX_VALUE_BYTES: usize = 4096;
/// The most node reports kept per job (attempts times nodes); later ones are counted only.
pub const MAX_RUNS: usize = 64;

/// The submit side, as the CLI found it in the directory `perch submit` ran in.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitProvenance {
    /// The directory the job was submitted from.
    #[serde(default)]
    pub submit_dir: Option<String>,
    /// The machine it was submitted from.
    #[serde(default)]
    pub submit_host: Option<String>,
    /// The directory's repository, when it is in one.
    #[serde(default)]
    pub git: Option<GitProvenance>,
    /// Why there is no `git` (not a repository, no `git` program).
    #[serde(default)]
    pub git_note: Option<String>,
    /// The container the command runs, when it runs one (`docker run`, `podman run`,
    /// `apptainer run|exec`, `singularity run|exec`).
    #[serde(default)]
    pub container: Option<ContainerProvenance>,
    /// The Python environment's packages, when asked for (`perch submit --provenance-python`).
    #[serde(default)]
    pub python: Option<PythonProvenance>,
    /// The job this one runs again (`perch rerun`).
    #[serde(default)]
    pub rerun_of: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GitProvenance {
    /// The repository's top directory.
    pub root: String,
    /// `HEAD`'s commit (hex).
    pub commit: String,
    /// The branch checked out; `None` on a detached `HEAD`.
    #[serde(default)]
    pub branch: Option<String>,
    /// Tracked files differ from `HEAD`.
    #[serde(default)]
    pub dirty: bool,
    /// `git diff HEAD` (binary files as `git diff --binary` writes them), cut at
    /// [`MAX_DIFF_BYTES`].
    #[serde(default)]
    pub diff: String,
    /// The whole diff's length, bytes.
    #[serde(default)]
    pub diff_bytes: u64,
    /// `diff` is the start of a longer diff: it cannot be applied again.
    #[serde(default)]
    pub diff_truncated: bool,
    /// Files not tracked and not ignored, by name only (their contents are not recorded).
    #[serde(default)]
    pub untracked: Vec<String>,
    /// More untracked files than [`MAX_UNTRACKED`]: the list is the first of them.
    #[serde(default)]
    pub untracked_truncated: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerProvenance {
    /// `docker`, `podman`, `apptainer` or `singularity`.
    pub runtime: String,
    /// The image as the command names it.
    pub image: String,
    /// Its content digest (`sha256:...`) where it could be resolved at submit.
    #[serde(default)]
    pub digest: Option<String>,
    /// Why there is no digest (the runtime is not installed here, the image is not pulled).
    #[serde(default)]
    pub digest_note: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonProvenance {
    /// `python3 --version`.
    #[serde(default)]
    pub version: Option<String>,
    /// `python3 -m pip freeze`, cut at [`MAX_PACKAGES_BYTES`].
    #[serde(default)]
    pub packages: String,
    #[serde(default)]
    pub packages_truncated: bool,
    /// Why there is no package list.
    #[serde(default)]
    pub note: Option<String>,
}

/// One attempt's start on one node, as its agent reported it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunProvenance {
    pub attempt: u32,
    pub node: String,
    pub start_ms: i64,
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub env_truncated: bool,
    #[serde(default)]
    pub driver_version: Option<String>,
    #[serde(default)]
    pub cuda_version: Option<String>,
    #[serde(default)]
    pub simulated: bool,
}

impl RunProvenance {
    /// Node `node`'s report, bounded again here (an agent is trusted with its own node only).
    pub fn of(node: &str, report: &JobStartReport, now: i64) -> RunProvenance {
        let (env, cut) = perch_model::provenance::reportable_env(&report.env);
        let short = |v: &Option<String>| v.as_ref().map(|s| bounded(s, 64));
        RunProvenance {
            attempt: report.attempt,
            node: node.to_owned(),
            start_ms: now,
            env,
            env_truncated: report.env_truncated || cut,
            driver_version: short(&report.driver_version),
            cuda_version: short(&report.cuda_version),
            simulated: report.simulated,
        }
    }
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn bounded(s: &str, max: usize) -> String {
    s[..s.floor_char_boundary(max)].to_owned()
}

/// Everything recorded of one job's provenance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProvenanceRecord {
    pub job: u64,
    /// The job's user: who besides operators may read it.
    pub user: String,
    /// When the job was submitted.
    pub submit_ms: i64,
    /// What the CLI recorded; `None` for a job submitted another way (the API, an older CLI).
    #[serde(default)]
    pub submit: Option<SubmitProvenance>,
    /// Each attempt on each node, in the order they started.
    #[serde(default)]
    pub runs: Vec<RunProvenance>,
    /// Reports past [`MAX_RUNS`], counted and not kept.
    #[serde(default)]
    pub runs_dropped: u32,
}

impl ProvenanceRecord {
    /// Adds a node's report; one already kept (the same attempt on the same node, sent again)
    /// is not added twice.
    pub fn add_run(&mut self, run: RunProvenance) {
        if self
            .runs
            .iter()
            .any(|r| r.attempt == run.attempt && r.node == run.node)
        {
            return;
        }
        if self.runs.len() >= MAX_RUNS {
            self.runs_dropped = self.runs_dropped.saturating_add(1);
            return;
        }
        self.runs.push(run);
    }
}

/// A change to the stored records, committed with the operation that made it.
#[derive(Debug, Clone, PartialEq)]
pub enum ProvenanceChange {
    /// A job submitted: its record, first written.
    Submitted(Box<ProvenanceRecord>),
    /// An attempt started on a node: added to the job's record (one is made for a job that
    /// has none).
    Ran {
        job: u64,
        user: String,
        submit_ms: i64,
        run: RunProvenance,
    },
}

impl ProvenanceChange {
    pub fn job(&self) -> u64 {
        match self {
            ProvenanceChange::Submitted(r) => r.job,
            ProvenanceChange::Ran { job, .. } => *job,
        }
    }

    /// `stored` (the job's record so far, if any) with this change made.
    pub fn apply(&self, stored: Option<ProvenanceRecord>) -> ProvenanceRecord {
        match self {
            ProvenanceChange::Submitted(r) => {
                let mut r = ProvenanceRecord::clone(r);
                if let Some(old) = stored {
                    // Reports that came first (never, from one server) are not lost.
                    for run in old.runs {
                        r.add_run(run);
                    }
                }
                r
            }
            ProvenanceChange::Ran {
                job,
                user,
                submit_ms,
                run,
            } => {
                let mut r = stored.unwrap_or_else(|| ProvenanceRecord {
                    job: *job,
                    user: user.clone(),
                    submit_ms: *submit_ms,
                    submit: None,
                    runs: Vec::new(),
                    runs_dropped: 0,
                });
                r.add_run(run.clone());
                r
            }
        }
    }
}

fn err(field: &'static str, message: String) -> FieldError {
    FieldError { field, message }
}

fn check_len(field: &'static str, value: &str, max: usize) -> Result<(), FieldError> {
    if value.len() > max {
        return Err(err(
            field,
            format!(
                "is {} bytes; at most {max} are recorded (cut it, and set the matching *_truncated flag)",
                value.len()
            ),
        ));
    }
    Ok(())
}

fn check_opt(field: &'static str, value: &Option<String>) -> Result<(), FieldError> {
    value
        .as_deref()
        .map_or(Ok(()), |v| check_len(field, v, MAX_VALUE_BYTES))
}

impl SubmitProvenance {
    /// Checks every bound; the error names the field and its limit.
    pub fn validate(&self) -> Result<(), FieldError> {
        check_opt("provenance.submit_dir", &self.submit_dir)?;
        check_opt("provenance.submit_host", &self.submit_host)?;
        check_opt("provenance.git_note", &self.git_note)?;
        if let Some(g) = &self.git {
            check_len("provenance.git.root", &g.root, MAX_VALUE_BYTES)?;
            if g.commit.len() < 4
                || g.commit.len() > 64
                || !g.commit.chars().all(|c| c.is_ascii_hexdigit())
            {
                return Err(err(
                    "provenance.git.commit",
                    format!(
                        "{:?} is not a commit id: 4 to 64 hexadecimal digits, as `git rev-parse HEAD` prints",
                        bounded(&g.commit, 80)
                    ),
                ));
            }
            check_opt("provenance.git.branch", &g.branch)?;
            check_len("provenance.git.diff", &g.diff, MAX_DIFF_BYTES)?;
            if g.untracked.len() > MAX_UNTRACKED {
                return Err(err(
                    "provenance.git.untracked",
                    format!(
                        "names {} files; at most {MAX_UNTRACKED} are recorded (name the first and set untracked_truncated)",
                        g.untracked.len()
                    ),
                ));
            }
            for name in &g.untracked {
                check_len("provenance.git.untracked", name, MAX_VALUE_BYTES)?;
            }
        }
        if let Some(c) = &self.container {
            check_len("provenance.container.runtime", &c.runtime, 64)?;
            check_len("provenance.container.image", &c.image, MAX_VALUE_BYTES)?;
            check_opt("provenance.container.digest", &c.digest)?;
            check_opt("provenance.container.digest_note", &c.digest_note)?;
        }
        if let Some(p) = &self.python {
            check_opt("provenance.python.version", &p.version)?;
            check_len(
                "provenance.python.packages",
                &p.packages,
                MAX_PACKAGES_BYTES,
            )?;
            check_opt("provenance.python.note", &p.note)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git() -> GitProvenance {
        GitProvenance {
            root: "/src/model".into(),
            commit: "0123456789abcdef0123456789abcdef01234567".into(),
            branch: Some("main".into()),
            ..GitProvenance::default()
        }
    }

    #[test]
    fn bounds_are_checked_and_name_the_field_and_limit() {
        let mut p = SubmitProvenance {
            git: Some(git()),
            ..SubmitProvenance::default()
        };
        assert_eq!(p.validate(), Ok(()));
        if let Some(g) = &mut p.git {
            g.diff = "x".repeat(MAX_DIFF_BYTES + 1);
        }
        let e = p.validate().expect_err("oversize diff");
        assert_eq!(e.field, "provenance.git.diff");
        assert!(e.message.contains(&MAX_DIFF_BYTES.to_string()), "{e}");
        if let Some(g) = &mut p.git {
            g.diff.clear();
            g.commit = "HEAD; rm -rf /".into();
        }
        assert_eq!(
            p.validate().expect_err("bad commit").field,
            "provenance.git.commit"
        );
    }

    #[test]
    fn runs_are_kept_once_and_bounded() {
        let run = |attempt, node: &str| RunProvenance {
            attempt,
            node: node.into(),
            start_ms: 0,
            env: BTreeMap::new(),
            env_truncated: false,
            driver_version: None,
            cuda_version: None,
            simulated: true,
        };
        let change = |r| ProvenanceChange::Ran {
            job: 7,
            user: "alice".into(),
            submit_ms: 1,
            run: r,
        };
        let mut stored = change(run(1, "a")).apply(None);
        stored = change(run(1, "a")).apply(Some(stored));
        assert_eq!(stored.runs.len(), 1);
        for i in 0..(MAX_RUNS as u32 + 5) {
            stored = change(run(i + 2, "a")).apply(Some(stored));
        }
        assert_eq!(stored.runs.len(), MAX_RUNS);
        assert_eq!(stored.runs_dropped, 6);
    }
}
