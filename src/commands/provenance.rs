//! What `perch submit` records of the directory it runs in (the job's provenance, submit
//! side): the git commit, branch and a bounded diff of uncommitted changes, untracked files by
//! name, the container image the command runs and its digest, and the Python packages when
//! asked; and `perch show --provenance`, which prints a job's record. Every reading is bounded
//! (`perch_control::provenance`'s limits) and none fails a submission: what cannot be read is
//! recorded as a note saying why.

use perch_control::provenance::{
    ContainerProvenance, GitProvenance, MAX_DIFF_BYTES, MAX_PACKAGES_BYTES, MAX_UNTRACKED,
    ProvenanceRecord, PythonProvenance, SubmitProvenance,
};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one program perch runs to read the submit directory may take.
const PROGRAM_TIMEOUT: Duration = Duration::from_secs(30);

/// A program's output: its first `limit` bytes, the whole length, and whether it succeeded.
struct Captured {
    out: Vec<u8>,
    total: u64,
    ok: bool,
    stderr: String,
}

/// Runs `program args` in `dir`, keeping the first `limit` bytes of its standard output and
/// counting the rest; killed after [`PROGRAM_TIMEOUT`]. Err: why it could not be run.
fn capture(program: &str, args: &[&str], dir: &Path, limit: usize) -> Result<Captured, String> {
    let mut child = Command::new(program)
        .args(args)
        .current_dir(dir)
        // Reading must not take the repository's index lock from a concurrent git.
        .env("GIT_OPTIONAL_LOCKS", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!("{program} is not installed here"),
            _ => format!("cannot run {program}: {e}"),
        })?;
    let mut stdout = child.stdout.take().ok_or("no standard output")?;
    let mut stderr = child.stderr.take().ok_or("no standard error")?;
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let mut total = 0u64;
        let mut buf = [0u8; 64 << 10];
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    total += n as u64;
                    let room = limit.saturating_sub(out.len());
                    out.extend_from_slice(&buf[..n.min(room)]);
                }
            }
        }
        (out, total)
    });
    let errors = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = (&mut stderr).take(4096).read_to_end(&mut text);
        String::from_utf8_lossy(&text).trim().to_owned()
    });
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if start.elapsed() > PROGRAM_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("waiting for {program}: {e}")),
        }
    };
    let (out, total) = reader.join().map_err(|_| "reading its output failed")?;
    let stderr = errors.join().unwrap_or_default();
    match status {
        None => Err(format!(
            "{program} {} took longer than {} s",
            args.join(" "),
            PROGRAM_TIMEOUT.as_secs()
        )),
        Some(s) => Ok(Captured {
            out,
            total,
            ok: s.success(),
            stderr,
        }),
    }
}

/// The trimmed text `program args` prints, when it succeeds.
fn line(program: &str, args: &[&str], dir: &Path) -> Option<String> {
    let c = capture(program, args, dir, 64 << 10).ok()?;
    let text = String::from_utf8_lossy(&c.out).trim().to_owned();
    (c.ok && !text.is_empty()).then_some(text)
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn cut(s: &str, max: usize) -> String {
    s[..s.floor_char_boundary(max)].to_owned()
}

/// The repository `dir` is in, or why there is none.
pub fn git(dir: &Path) -> Result<GitProvenance, String> {
    let top = capture("git", &["rev-parse", "--show-toplevel"], dir, 8192)?;
    if !top.ok {
        // Anything else (git's "dubious ownership" of another user's repository) is said.
        return Err(if top.stderr.contains("not a git repository") {
            format!("{} is not in a git repository", dir.display())
        } else {
            format!(
                "git cannot read the repository at {}: {}",
                dir.display(),
                cut(&top.stderr, 512)
            )
        });
    }
    let root = String::from_utf8_lossy(&top.out).trim().to_owned();
    let commit = line("git", &["rev-parse", "--verify", "-q", "HEAD"], dir)
        .ok_or_else(|| format!("the repository at {root} has no commit yet"))?;
    let branch = line("git", &["symbolic-ref", "--short", "-q", "HEAD"], dir);
    // Against HEAD, from the top (paths as `git apply` takes them there), binary files too.
    let diff = capture(
        "git",
        &[
            "-C",
            &root,
            "diff",
            "HEAD",
            "--binary",
            "--no-color",
            "--no-ext-diff",
        ],
        dir,
        MAX_DIFF_BYTES,
    )?;
    if !diff.ok {
        return Err(format!("git diff failed: {}", diff.stderr));
    }
    let text = String::from_utf8_lossy(&diff.out);
    let diff_truncated =
        diff.total > diff.out.len() as u64 || matches!(text, std::borrow::Cow::Owned(_));
    let untracked = capture(
        "git",
        &[
            "-C",
            &root,
            "ls-files",
            "--others",
            "--exclude-standard",
            "-z",
        ],
        dir,
        4 << 20,
    )?;
    let names: Vec<String> = untracked
        .out
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| cut(&String::from_utf8_lossy(n), 4096))
        .collect();
    let untracked_truncated =
        names.len() > MAX_UNTRACKED || untracked.total > untracked.out.len() as u64;
    Ok(GitProvenance {
        root,
        commit,
        branch,
        dirty: diff.total > 0,
        diff: cut(&text, MAX_DIFF_BYTES),
        diff_bytes: diff.total,
        diff_truncated,
        untracked: names.into_iter().take(MAX_UNTRACKED).collect(),
        untracked_truncated,
    })
}

/// Options of `docker run` and `podman run` that take no value (every other option does,
/// unless written `--name=value`).
const DOCKER_FLAGS: [&str; 18] = [
    "--rm",
    "-i",
    "-t",
    "-it",
    "-ti",
    "-d",
    "--detach",
    "--interactive",
    "--tty",
    "--privileged",
    "--init",
    "--read-only",
    "-P",
    "--publish-all",
    "--no-healthcheck",
    "-q",
    "--quiet",
    "--oom-kill-disable",
];

/// Options of `apptainer`/`singularity run|exec` that take a value.
const APPTAINER_VALUES: [&str; 20] = [
    "-B",
    "--bind",
    "--env",
    "--env-file",
    "-H",
    "--home",
    "--pwd",
    "-o",
    "--overlay",
    "--mount",
    "-W",
    "--workdir",
    "--security",
    "--network",
    "--network-args",
    "--hostname",
    "--fusemount",
    "-S",
    "--scratch",
    "--app",
];

/// The container runtime and image `command` runs, when it runs one directly.
pub fn container_of(command: &[String]) -> Option<(String, String)> {
    let program = Path::new(command.first()?)
        .file_name()?
        .to_str()?
        .to_owned();
    let sub = command.get(1)?.as_str();
    let rest = command.get(2..)?;
    let image = match (program.as_str(), sub) {
        ("docker" | "podman", "run" | "create") => {
            let mut args = rest.iter();
            loop {
                let a = args.next()?;
                if !a.starts_with('-') {
                    break a.clone();
                }
                if !a.contains('=') && !DOCKER_FLAGS.contains(&a.as_str()) {
                    args.next();
                }
            }
        }
        ("apptainer" | "singularity", "run" | "exec" | "shell" | "instance") => {
            let mut args = rest.iter();
            loop {
                let a = args.next()?;
                if !a.starts_with('-') {
                    break a.clone();
                }
                if !a.contains('=') && APPTAINER_VALUES.contains(&a.as_str()) {
                    args.next();
                }
            }
        }
        _ => return None,
    };
    Some((program, image))
}

/// The container `command` runs, with its digest where it can be resolved here.
pub fn container(command: &[String], dir: &Path) -> Option<ContainerProvenance> {
    let (runtime, image) = container_of(command)?;
    let (digest, digest_note) = match image.split_once("@sha256:") {
        Some((_, d)) => (Some(format!("sha256:{d}")), None),
        None => match runtime.as_str() {
            "docker" | "podman" => resolve_digest(&runtime, &image, dir),
            _ => (
                None,
                Some(format!(
                    "{runtime} images are files or remote references; pin one with @sha256:... to record its digest"
                )),
            ),
        },
    };
    Some(ContainerProvenance {
        runtime,
        image: cut(&image, 4096),
        digest,
        digest_note,
    })
}

/// The image's repository digest (else its local id) as `runtime image inspect` reports it.
fn resolve_digest(runtime: &str, image: &str, dir: &Path) -> (Option<String>, Option<String>) {
    let format = "{{range .RepoDigests}}{{.}} {{end}}|{{.Id}}";
    match capture(
        runtime,
        &["image", "inspect", "--format", format, image],
        dir,
        8192,
    ) {
        Err(why) => (
            None,
            Some(format!("{why}: the digest could not be resolved")),
        ),
        Ok(c) if !c.ok => (
            None,
            Some(format!(
                "{runtime} image inspect {image} failed (not pulled here?): {}",
                cut(&c.stderr, 512)
            )),
        ),
        Ok(c) => {
            let text = String::from_utf8_lossy(&c.out).trim().to_owned();
            let (repo, id) = text.split_once('|').unwrap_or(("", text.as_str()));
            let digest = repo
                .split_whitespace()
                .find_map(|d| d.split_once('@').map(|(_, d)| d.to_owned()))
                .or_else(|| (!id.trim().is_empty()).then(|| id.trim().to_owned()));
            match digest {
                Some(d) => (Some(cut(&d, 256)), None),
                None => (
                    None,
                    Some(format!("{runtime} reported no digest for {image}")),
                ),
            }
        }
    }
}

/// `python3 --version` and `python3 -m pip freeze` as run here.
pub fn python(dir: &Path) -> PythonProvenance {
    let version = line("python3", &["--version"], dir);
    match capture(
        "python3",
        &["-m", "pip", "freeze", "--disable-pip-version-check"],
        dir,
        MAX_PACKAGES_BYTES,
    ) {
        Ok(c) if c.ok => {
            let text = String::from_utf8_lossy(&c.out);
            PythonProvenance {
                version,
                packages: cut(&text, MAX_PACKAGES_BYTES),
                packages_truncated: c.total > c.out.len() as u64,
                note: None,
            }
        }
        Ok(c) => PythonProvenance {
            version,
            note: Some(format!("pip freeze failed: {}", cut(&c.stderr, 512))),
            ..PythonProvenance::default()
        },
        Err(why) => PythonProvenance {
            version,
            note: Some(why),
            ..PythonProvenance::default()
        },
    }
}

/// Everything `perch submit` records of directory `dir` for `command`.
pub fn collect(dir: &Path, command: &[String], with_python: bool) -> SubmitProvenance {
    let (git, git_note) = match git(dir) {
        Ok(g) => (Some(g), None),
        Err(why) => (None, Some(cut(&why, 4096))),
    };
    SubmitProvenance {
        submit_dir: Some(cut(&dir.to_string_lossy(), 4096)),
        submit_host: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty()),
        git,
        git_note,
        container: container(command, dir),
        python: with_python.then(|| python(dir)),
        rerun_of: None,
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// `perch show JOB --provenance`: the record, as text.
pub fn print(p: &ProvenanceRecord) {
    println!(
        "JobId={} User={} Submitted={}",
        p.job,
        p.user,
        perch_model::timefmt::rfc3339_seconds(p.submit_ms)
    );
    match &p.submit {
        None => println!(
            "   Submit side: not recorded (submitted through the API without `provenance`, or by an older perch)"
        ),
        Some(s) => {
            println!(
                "   SubmitDir={} SubmitHost={}",
                s.submit_dir.as_deref().unwrap_or("-"),
                s.submit_host.as_deref().unwrap_or("-")
            );
            if let Some(of) = s.rerun_of {
                println!("   RerunOf={of}");
            }
            match (&s.git, &s.git_note) {
                (Some(g), _) => {
                    println!(
                        "   Git: Repository={} Commit={} Branch={} Dirty={}",
                        g.root,
                        g.commit,
                        g.branch.as_deref().unwrap_or("(detached)"),
                        yes_no(g.dirty)
                    );
                    if g.dirty {
                        println!(
                            "      Diff: {} bytes{}",
                            g.diff_bytes,
                            if g.diff_truncated {
                                format!(
                                    ", only the first {} recorded: it cannot be applied again",
                                    g.diff.len()
                                )
                            } else {
                                String::new()
                            }
                        );
                    }
                    if !g.untracked.is_empty() {
                        println!(
                            "      Untracked (names only, not recorded): {}{}",
                            g.untracked.join(", "),
                            if g.untracked_truncated { ", ..." } else { "" }
                        );
                    }
                }
                (None, Some(note)) => println!("   Git: none ({note})"),
                (None, None) => println!("   Git: none"),
            }
            if let Some(c) = &s.container {
                println!(
                    "   Container: Runtime={} Image={} Digest={}{}",
                    c.runtime,
                    c.image,
                    c.digest.as_deref().unwrap_or("-"),
                    c.digest_note
                        .as_deref()
                        .map(|n| format!(" ({n})"))
                        .unwrap_or_default()
                );
            }
            if let Some(py) = &s.python {
                let count = py.packages.lines().filter(|l| !l.trim().is_empty()).count();
                println!(
                    "   Python: {} Packages={count}{}{}",
                    py.version.as_deref().unwrap_or("-"),
                    if py.packages_truncated {
                        " (list cut)"
                    } else {
                        ""
                    },
                    py.note
                        .as_deref()
                        .map(|n| format!(" ({n})"))
                        .unwrap_or_default()
                );
            }
        }
    }
    if p.runs.is_empty() {
        println!("   Runs: none yet");
    }
    for r in &p.runs {
        println!(
            "   Run: Attempt={} Node={} Started={} Driver={} CUDA={}{}",
            r.attempt,
            r.node,
            perch_model::timefmt::rfc3339_seconds(r.start_ms),
            r.driver_version.as_deref().unwrap_or("-"),
            r.cuda_version.as_deref().unwrap_or("-"),
            if r.simulated {
                " (simulated GPUs: no driver)"
            } else {
                ""
            }
        );
        println!(
            "      Environment ({} variables, secrets redacted{}):",
            r.env.len(),
            if r.env_truncated { ", cut" } else { "" }
        );
        for (k, v) in &r.env {
            println!("         {k}={v}");
        }
    }
    if p.runs_dropped > 0 {
        println!("   ({} more runs not kept)", p.runs_dropped);
    }
    if let Some(g) = p.submit.as_ref().and_then(|s| s.git.as_ref())
        && g.dirty
    {
        println!("--- uncommitted changes (git diff HEAD) ---");
        print!("{}", g.diff);
        if !g.diff.ends_with('\n') {
            println!();
        }
    }
    if let Some(py) = p.submit.as_ref().and_then(|s| s.python.as_ref())
        && !py.packages.is_empty()
    {
        println!("--- Python packages (pip freeze) ---");
        print!("{}", py.packages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_image_a_command_runs_is_found() {
        let check = |cmd: &str, want: Option<(&str, &str)>| {
            assert_eq!(
                container_of(&argv(cmd)),
                want.map(|(r, i)| (r.to_owned(), i.to_owned())),
                "{cmd}"
            );
        };
        check(
            "docker run --rm -it -v /data:/data --gpus all nvcr.io/nvidia/pytorch:24.01-py3 python train.py",
            Some(("docker", "nvcr.io/nvidia/pytorch:24.01-py3")),
        );
        check(
            "/usr/bin/podman run --env=A=1 -e B=2 ubuntu@sha256:abcd true",
            Some(("podman", "ubuntu@sha256:abcd")),
        );
        check(
            "apptainer exec --nv -B /scratch:/scratch train.sif python x.py",
            Some(("apptainer", "train.sif")),
        );
        check("python train.py", None);
        check("docker ps", None);
        check("docker run --rm", None);
    }
}
