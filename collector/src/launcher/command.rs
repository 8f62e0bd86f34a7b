//! The command line and environment of one job's first process.
//!
//! On top of the job's own program, arguments and environment:
//!
//! - `CUDA_VISIBLE_DEVICES` (its GPUs), `PERCH_NODE_RANK`, `PERCH_NUM_NODES`;
//! - for a job holding part of a GPU: `PERCH_GPU_FRACTION` (e.g. `0.25`),
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (25) and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`0=10240M`),
//!   which the MPS server enforces when it runs on the node, and `PERCH_GPU_MEMORY_MB`;
//! - for a job switched to its user: `HOME`, `USER`, `LOGNAME`, and the switch itself
//!   (`setpriv`, or std's uid and gid: see [`super::identity`]);
//! - for a job with a cgroup: a `sh` prefix that waits for one line on its standard input and
//!   then `exec`s the job. The launcher writes the child's pid into the cgroup before sending
//!   that line, so every process of the job starts inside its cgroup; the line sent, the pipe
//!   closes and the job sees an empty standard input, as without a cgroup.

use super::identity::{Identity, setpriv_args};
use perch_model::control::JobLaunch;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// The script of the waiting prefix; `$0` is a label, `$@` the job's command line.
const WAIT_THEN_EXEC: &str = "read -r perch_go || exit 125; exec \"$@\"";

/// How the first process is started.
#[derive(Debug, Default)]
pub struct Shape<'a> {
    /// Switch to this user (with `setpriv` when given, else std's uid and gid).
    pub user: Option<(&'a Identity, Option<&'a Path>)>,
    /// Wait for the launcher's go on standard input (the cgroup hand-over).
    pub wait_for_go: bool,
}

/// The environment perch adds for job `l` (the job's own `env` is applied before these, so
/// perch's values win where both set one).
pub fn perch_env(l: &JobLaunch) -> Vec<(String, String)> {
    let gpus: Vec<String> = l.gpus.iter().map(u32::to_string).collect();
    let mut env = vec![
        ("CUDA_VISIBLE_DEVICES".to_owned(), gpus.join(",")),
        ("PERCH_NODE_RANK".to_owned(), l.node_rank.to_string()),
        ("PERCH_NUM_NODES".to_owned(), l.nodes.to_string()),
    ];
    if let Some(share) = l.gpu_share {
        env.extend([
            (
                "PERCH_GPU_FRACTION".to_owned(),
                format!("{:.2}", f64::from(share.percent) / 100.0),
            ),
            (
                "PERCH_GPU_MEMORY_MB".to_owned(),
                share.memory_mb.to_string(),
            ),
            (
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(),
                share.percent.to_string(),
            ),
            // Device 0 is the job's one GPU once CUDA_VISIBLE_DEVICES applies.
            (
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_owned(),
                format!("0={}M", share.memory_mb),
            ),
        ]);
    }
    env
}

/// The job's command, ready to spawn but for stdio, working directory and process group.
pub fn build(l: &JobLaunch, shape: &Shape<'_>) -> std::io::Result<Command> {
    let mut argv: Vec<String> = Vec::with_capacity(l.command.len() + 8);
    if shape.wait_for_go {
        argv.extend([
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            WAIT_THEN_EXEC.to_owned(),
            format!("perch-job-{}", l.job),
        ]);
    }
    if let Some((id, Some(setpriv))) = shape.user {
        argv.extend(setpriv_args(setpriv, id));
    }
    argv.extend(l.command.iter().cloned());
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("empty command"))?;
    let mut cmd = Command::new(program);
    cmd.args(args).envs(&l.env).envs(perch_env(l));
    if let Some((id, setpriv)) = shape.user {
        cmd.env("HOME", &id.home)
            .env("USER", &id.name)
            .env("LOGNAME", &id.name);
        if setpriv.is_none() {
            cmd.uid(id.uid).gid(id.gid);
        }
    }
    Ok(cmd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_model::control::LaunchShare;

    fn launch() -> JobLaunch {
        JobLaunch {
            job: 9,
            command: vec!["python".into(), "train.py".into()],
            env: [("CUDA_VISIBLE_DEVICES".to_owned(), "7".to_owned())].into(),
            workdir: None,
            gpus: vec![3],
            user: "alice".into(),
            node_rank: 0,
            nodes: 1,
            time_limit_secs: 60,
            checkpoint_signal: "SIGTERM".into(),
            grace_secs: 1,
            sim_profile: None,
            gpu_share: Some(LaunchShare {
                percent: 25,
                memory_mb: 10_240,
            }),
            cpus: None,
            memory_mb: None,
        }
    }

    fn env_of(cmd: &Command) -> Vec<(String, String)> {
        cmd.get_envs()
            .filter_map(|(k, v)| Some((k.to_str()?.to_owned(), v?.to_str()?.to_owned())))
            .collect()
    }

    #[test]
    fn a_share_gets_its_gpu_and_the_mps_limits() {
        let cmd = build(&launch(), &Shape::default()).expect("command");
        let env = env_of(&cmd);
        for (k, v) in [
            ("CUDA_VISIBLE_DEVICES", "3"),
            ("PERCH_GPU_FRACTION", "0.25"),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=10240M"),
            ("PERCH_GPU_MEMORY_MB", "10240"),
        ] {
            assert!(
                env.contains(&(k.to_owned(), v.to_owned())),
                "{k}={v} missing from {env:?}"
            );
        }
        assert_eq!(cmd.get_program(), "python");
    }

    #[test]
    fn the_cgroup_hand_over_and_the_user_switch_prefix_the_command() {
        let id = Identity {
            name: "alice".into(),
            uid: 1001,
            gid: 1002,
            groups: vec![1002, 27],
            home: "/home/alice".into(),
        };
        let setpriv = Path::new("/usr/bin/setpriv");
        let cmd = build(
            &launch(),
            &Shape {
                user: Some((&id, Some(setpriv))),
                wait_for_go: true,
            },
        )
        .expect("command");
        let argv: Vec<String> = std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            argv,
            vec![
                "/bin/sh",
                "-c",
                WAIT_THEN_EXEC,
                "perch-job-9",
                "/usr/bin/setpriv",
                "--reuid=1001",
                "--regid=1002",
                "--groups=1002,27",
                "--",
                "python",
                "train.py"
            ]
        );
        let env = env_of(&cmd);
        assert!(env.contains(&("HOME".into(), "/home/alice".into())));
        assert!(env.contains(&("USER".into(), "alice".into())));
    }
}
