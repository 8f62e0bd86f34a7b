//! `perch rerun JOB`: submits the same thing again (command, resources, environment as
//! submitted, working directory, the same user) from the code it ran.
//!
//! Where the job recorded a git commit, the rerun runs that commit: when the recorded
//! repository's `HEAD` is still that commit and its uncommitted changes are the ones recorded,
//! as it stands; otherwise in a fresh `git worktree` of the commit beside the repository
//! (`<repository>.perch-rerun/job-<id>-<time>`), with the recorded diff applied, and the job's
//! working directory moved into it when it was inside the repository. It refuses, saying
//! why, when the commit is gone from the repository, when the recorded diff was cut or no
//! longer applies, or when the repository is not here. `--here` runs the current state
//! instead. The new job records `rerun_of`.

use super::jobs::{Api, ServerArg};
use super::provenance;
use crate::config::ConfigFile;
use anyhow::{Context, Result, bail};
use clap::Args;
use perch_control::api::{JobView, Submitted};
use perch_control::provenance::{GitProvenance, ProvenanceRecord};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, Args)]
pub struct RerunArgs {
    #[command(flatten)]
    server: ServerArg,
    /// The job to run again.
    id: u64,
    /// Run from the repository as it is now, without checking out the recorded commit.
    #[arg(long)]
    here: bool,
    /// Record the Python environment's packages again (`pip freeze`).
    #[arg(long)]
    provenance_python: bool,
}

/// `git args` in `dir`; Err with its error output.
fn git(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run git: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

/// Where the rerun's code is: the recorded repository as it stands, or a new worktree of the
/// recorded commit with the recorded diff applied. Err: why the recorded code cannot be had.
fn checkout(job: u64, g: &GitProvenance) -> Result<(PathBuf, bool)> {
    let root = PathBuf::from(&g.root);
    if !root.is_dir() {
        bail!(
            "job {job} ran commit {} of the repository at {}, which is not here; run perch rerun where that repository is, or --here to run from this directory as it is",
            g.commit,
            g.root
        );
    }
    let object = format!("{}^{{commit}}", g.commit);
    if git(&root, &["cat-file", "-e", &object]).is_err() {
        bail!(
            "job {job}'s commit {} is gone from the repository at {} (rebased, or the branch deleted and garbage-collected?); fetch it back, or use --here to run what is there now",
            g.commit,
            g.root
        );
    }
    if g.diff_truncated {
        bail!(
            "job {job} ran with {} bytes of uncommitted changes, more than perch records ({} bytes were kept): they cannot be applied again; use --here to run the repository as it is",
            g.diff_bytes,
            g.diff.len()
        );
    }
    let head = git(&root, &["rev-parse", "HEAD"]).unwrap_or_default();
    if head == g.commit {
        let now = provenance::git(&root).map_err(anyhow::Error::msg)?;
        if now.diff == g.diff {
            return Ok((root, false));
        }
    }
    // The commit, in a worktree of its own, with the recorded changes.
    let parent = PathBuf::from(format!("{}.perch-rerun", g.root.trim_end_matches('/')));
    std::fs::create_dir_all(&parent)
        .with_context(|| format!("creating {} for the rerun's checkout", parent.display()))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let tree = parent.join(format!("job-{job}-{stamp}"));
    let tree_text = tree.to_string_lossy().into_owned();
    git(
        &root,
        &[
            "worktree", "add", "--detach", "--quiet", &tree_text, &g.commit,
        ],
    )
    .map_err(|e| anyhow::anyhow!("checking out commit {} at {tree_text}: {e}", g.commit))?;
    if g.dirty && !g.diff.is_empty() {
        let patch = tree.join(".perch-rerun.patch");
        std::fs::write(&patch, &g.diff).context("writing the recorded diff")?;
        let applied = git(
            &tree,
            &[
                "apply",
                "--binary",
                "--whitespace=nowarn",
                ".perch-rerun.patch",
            ],
        );
        let _ = std::fs::remove_file(&patch);
        if let Err(e) = applied {
            let _ = git(&root, &["worktree", "remove", "--force", &tree_text]);
            bail!(
                "job {job}'s recorded uncommitted changes do not apply to commit {}: {e}; use --here to run the repository as it is",
                g.commit
            );
        }
    }
    Ok((tree, true))
}

/// The working directory `workdir` (inside `from` or not) as it is under `to`.
fn moved(workdir: &str, from: &Path, to: &Path) -> Option<String> {
    let rel = Path::new(workdir).strip_prefix(from).ok()?;
    Some(to.join(rel).to_string_lossy().into_owned())
}

pub fn rerun(args: RerunArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    let api = Api::new(&args.server, config_file)?;
    let id = args.id;
    // The record first: the server refuses another user's (403), as for logs.
    let record: ProvenanceRecord = api.get(&format!("/v1/jobs/{id}/provenance"))?;
    let view: JobView<'static> = api.get(&format!("/v1/jobs/{id}"))?;
    if view.private {
        bail!(
            "job {id} belongs to {}; only its owner or an operator may run it again",
            record.user
        );
    }
    let mut request = match serde_json::to_value(&view.record.request)? {
        Value::Object(m) => m,
        _ => bail!("job {id}'s request is not an object"),
    };
    // Run now, as one job: the dependencies have ended and an array task is one task.
    for key in [
        "array",
        "after_ok",
        "after_any",
        "after_not_ok",
        "provenance",
    ] {
        request.remove(key);
    }
    if let Some(Value::Object(env)) = request.get_mut("env") {
        env.remove("PERCH_ARRAY_JOB_ID");
        env.remove("PERCH_ARRAY_TASK_ID");
    }
    let git = record.submit.as_ref().and_then(|s| s.git.as_ref());
    let recorded_dir = record
        .submit
        .as_ref()
        .and_then(|s| s.submit_dir.clone())
        .map(PathBuf::from);
    let here = std::env::current_dir().context("reading the current directory")?;
    let (dir, note) = match (git, args.here) {
        (_, true) => (
            here.clone(),
            "as the current directory stands (--here)".to_owned(),
        ),
        (None, false) => (
            recorded_dir.filter(|d| d.is_dir()).unwrap_or(here.clone()),
            "no commit was recorded: the same command, environment and resources".to_owned(),
        ),
        (Some(g), false) => {
            let (dir, fresh) = checkout(id, g)?;
            if fresh {
                let old = Path::new(&g.root);
                if let Some(Value::String(w)) = request.get("workdir")
                    && let Some(w) = moved(w, old, &dir)
                {
                    request.insert("workdir".into(), w.into());
                }
            }
            let mut note = format!(
                "commit {}{} in {}",
                &g.commit[..g.commit.len().min(12)],
                if g.dirty {
                    " with its recorded changes"
                } else {
                    ""
                },
                dir.display()
            );
            if !g.untracked.is_empty() {
                note.push_str(&format!(
                    "; {} untracked files were not recorded and are not there",
                    g.untracked.len()
                ));
            }
            // The submit directory's place in the repository, in the checkout.
            let sub = recorded_dir
                .as_deref()
                .and_then(|d| d.strip_prefix(old_root(g)).ok())
                .map(|rel| dir.join(rel))
                .filter(|d| d.is_dir())
                .unwrap_or(dir);
            (sub, note)
        }
    };
    let command: Vec<String> = view.record.request.command.clone();
    let mut p = provenance::collect(&dir, &command, args.provenance_python);
    p.rerun_of = Some(id);
    request.insert("provenance".into(), serde_json::to_value(&p)?);
    let submitted: Submitted = api.post("/v1/jobs", &request)?;
    println!("Submitted job {} (rerun of {id}: {note})", submitted.job.id);
    if let Some(warning) = &submitted.warning {
        eprintln!("warning: {warning}");
    }
    Ok(())
}

fn old_root(g: &GitProvenance) -> &Path {
    Path::new(&g.root)
}
