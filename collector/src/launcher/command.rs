//! The command line and environment of one job's first process.
//!
//! On top of the job's own program, arguments and environment:
//!
//! - from the agent's environment only [`INHERITED`] (`PATH`, `LANG`, `LANGUAGE`, `TZ`) and
//!   `LC_*`: never the agent's token, proxies or anything else it was started with;
//! - `CUDA_VISIBLE_DEVICES` (its GPUs, by NVML index) with `CUDA_DEVICE_ORDER=PCI_BUS_ID` (so
//!   CUDA counts them as NVML does), `PERCH_NODE_RANK`, `PERCH_NUM_NODES`;
//! - for a job holding part of a GPU: `PERCH_GPU_FRACTION` (e.g. `0.25`),
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (25) and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`0=10240M`),
//!   which the MPS server enforces when it runs on the node, and `PERCH_GPU_MEMORY_MB`;
//! - for a job placed on a MIG instance: `CUDA_VISIBLE_DEVICES` is the instance's UUID
//!   (`MIG-...`, how CUDA selects a MIG device) and `PERCH_GPU_PROFILE` its profile (`3g.40gb`);
//! - for a job switched to its user: `HOME`, `USER`, `LOGNAME`, and the switch itself
//!   (`setpriv`, or std's uid and gid: see [`super::identity`]);
//! - for a job with a cgroup: a `sh` prefix that waits for one line on its standard input and
//!   then `exec`s the job. The launcher writes the child's pid into the cgroup before sending
//!   that line, so every process of the job starts inside its cgroup; the line sent, the pipe
//!   closes and the job sees an empty standard input, as without a cgroup.
//!
//! **Nothing of the job's environment reaches a program that runs before the switch to its
//! user.** The cgroup prefix and `setpriv` run as root when the agent is root; a variable such
//! as `LD_PRELOAD` in their environment would run the user's code as root. So whenever such a
//! prefix runs, the spawned process gets [`PREFIX_PATH`] and nothing else the loader or a shell
//! acts on: the job's final environment travels as `PERCH_ENV_<name>` variables (names the
//! loader ignores), and a last `sh` step, run as the job's user after the switch, turns them
//! back into `<name>` and `exec`s the job with exactly that environment ([`APPLY_ENV`]). The
//! values never appear on a command line (`/proc/<pid>/cmdline` is readable by every user of
//! the node; `/proc/<pid>/environ` only by the process's owner). Without a prefix the job is
//! spawned directly with its environment (std switches the uid before `exec`, so the loader
//! already runs as the user).

use super::identity::{Identity, setpriv_args};
use super::shim::ShimArgs;
use perch_model::control::JobLaunch;
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// The script of the waiting prefix; `$0` is a label, `$@` the job's command line.
const WAIT_THEN_EXEC: &str = "read -r perch_go || exit 125; exec \"$@\"";

/// The only environment of the programs that run before the switch to the job's user (besides
/// the `PERCH_ENV_*` values they pass on untouched).
pub const PREFIX_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Run by `/bin/sh` as the job's user: `$@` is the names of the job's variables, `--`, and the
/// job's command line. Each `PERCH_ENV_<name>` becomes `<name>` (names are checked to be shell
/// identifiers, so the `eval` only ever reads a variable), then the job runs.
pub const APPLY_ENV: &str = "while [ \"$#\" -gt 0 ] && [ \"$1\" != -- ]; do \
eval \"export $1=\\\"\\${PERCH_ENV_$1}\\\"\"; unset \"PERCH_ENV_$1\"; shift; done; \
shift; exec \"$@\"";

/// The prefix of the carried variables ([`APPLY_ENV`]).
const CARRIED: &str = "PERCH_ENV_";

/// How the first process is started.
#[derive(Debug, Default)]
pub struct Shape<'a> {
    /// Run under this supervisor program with these arguments ([`super::shim`]): it runs as
    /// root before everything else, so it always gets perch's environment only.
    pub supervisor: Option<(&'a Path, ShimArgs)>,
    /// Switch to this user (with `setpriv` when given, else std's uid and gid).
    pub user: Option<(&'a Identity, Option<&'a Path>)>,
    /// Wait for the launcher's go on standard input (the cgroup hand-over).
    pub wait_for_go: bool,
    /// Variables the agent passes on from its own environment (the job's own `env` wins).
    pub inherited: Vec<(String, String)>,
    /// Variables set last (the `OTEL_*` ones, already merged with the job's own).
    pub extra: Vec<(String, String)>,
}

/// Whether `name` can be carried through [`APPLY_ENV`]: a shell identifier.
pub fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The environment perch adds for job `l` (the job's own `env` is applied before these, so
/// perch's values win where both set one).
pub fn perch_env(l: &JobLaunch) -> Vec<(String, String)> {
    let gpus: Vec<String> = match &l.gpu_mig {
        // CUDA selects a MIG instance by its UUID; the job sees it as device 0.
        Some(mig) => vec![mig.uuid.clone()],
        None => l.gpus.iter().map(u32::to_string).collect(),
    };
    let mut env = vec![
        ("CUDA_VISIBLE_DEVICES".to_owned(), gpus.join(",")),
        // The indices are NVML's, which count GPUs in PCI bus order. CUDA counts fastest first
        // unless told otherwise, so on a node with GPUs of different models `3` would be
        // another GPU, one that may be another job's.
        ("CUDA_DEVICE_ORDER".to_owned(), "PCI_BUS_ID".to_owned()),
        ("PERCH_NODE_RANK".to_owned(), l.node_rank.to_string()),
        ("PERCH_NUM_NODES".to_owned(), l.nodes.to_string()),
    ];
    if let Some(mig) = &l.gpu_mig {
        env.push(("PERCH_GPU_PROFILE".to_owned(), mig.profile.clone()));
    }
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

/// The variables a job takes from the agent's environment; nothing else of it (the agent's
/// `PERCH_TOKEN`, its proxies, its credentials) reaches a job. `LC_*` too.
pub const INHERITED: [&str; 4] = ["PATH", "LANG", "LANGUAGE", "TZ"];

/// What a job takes from the agent's own environment: [`INHERITED`] and `LC_*`, and
/// [`PREFIX_PATH`] as `PATH` when the agent has none.
pub fn inherited(
    agent: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = agent
        .into_iter()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| INHERITED.contains(&k.as_str()) || k.starts_with("LC_"))
        .collect();
    if !vars.iter().any(|(k, _)| k == "PATH") {
        vars.push(("PATH".into(), PREFIX_PATH.into()));
    }
    vars
}

/// The job's complete environment: inherited, then its own `env`, perch's variables, its
/// user's `HOME`, `USER` and `LOGNAME`, and the extra ones (later ones win).
pub fn environment(l: &JobLaunch, shape: &Shape<'_>) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = shape.inherited.iter().cloned().collect();
    env.extend(l.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(perch_env(l));
    if let Some((id, _)) = shape.user {
        env.insert("HOME".into(), id.home.display().to_string());
        env.insert("USER".into(), id.name.clone());
        env.insert("LOGNAME".into(), id.name.clone());
    }
    env.extend(shape.extra.iter().cloned());
    env
}

/// The job's command, ready to spawn but for stdio, working directory and process group.
pub fn build(l: &JobLaunch, shape: &Shape<'_>) -> std::io::Result<Command> {
    let env = environment(l, shape);
    let switch_by_setpriv = matches!(shape.user, Some((_, Some(_))));
    // Programs of perch's run before the job: they get perch's environment only.
    let prefixed = shape.wait_for_go || switch_by_setpriv || shape.supervisor.is_some();
    let mut argv: Vec<std::ffi::OsString> = Vec::with_capacity(l.command.len() + env.len() + 24);
    if let Some((program, args)) = &shape.supervisor {
        let mut args = args.clone();
        if let Some((id, None)) = shape.user {
            // The supervisor stays root; it switches the job's first process.
            args.uid_gid = Some((id.uid, id.gid));
        }
        argv.push(program.as_os_str().to_owned());
        argv.extend(args.to_args());
    }
    if shape.wait_for_go {
        argv.extend([
            "/bin/sh".into(),
            "-c".into(),
            WAIT_THEN_EXEC.into(),
            format!("perch-job-{}", l.job).into(),
        ]);
    }
    if let Some((id, Some(setpriv))) = shape.user {
        argv.extend(setpriv_args(setpriv, id).into_iter().map(Into::into));
    }
    if prefixed {
        if let Some(bad) = env.keys().find(|k| !is_identifier(k)) {
            return Err(std::io::Error::other(format!(
                "the variable name {bad:?} cannot be passed to the job (letters, digits and '_' only)"
            )));
        }
        argv.extend([
            "/bin/sh".into(),
            "-c".into(),
            APPLY_ENV.into(),
            "perch-env".into(),
        ]);
        argv.extend(env.keys().map(Into::into));
        argv.push("--".into());
    }
    argv.extend(l.command.iter().map(Into::into));
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| std::io::Error::other("empty command"))?;
    let mut cmd = Command::new(program);
    cmd.args(args).env_clear();
    if prefixed {
        cmd.env("PATH", PREFIX_PATH);
        cmd.envs(env.iter().map(|(k, v)| (format!("{CARRIED}{k}"), v)));
    } else {
        cmd.envs(&env);
    }
    if let Some((id, None)) = shape.user
        && shape.supervisor.is_none()
    {
        cmd.uid(id.uid).gid(id.gid);
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
            attempt: 1,
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
            gpu_mig: None,
            cpus: None,
            memory_mb: None,
            pick_master_port: false,
            hosts: Vec::new(),
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
            ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
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
                ..Shape::default()
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
                "/bin/sh",
                "-c",
                APPLY_ENV,
                "perch-env",
                "CUDA_DEVICE_ORDER",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                "CUDA_VISIBLE_DEVICES",
                "HOME",
                "LOGNAME",
                "PERCH_GPU_FRACTION",
                "PERCH_GPU_MEMORY_MB",
                "PERCH_NODE_RANK",
                "PERCH_NUM_NODES",
                "USER",
                "--",
                "python",
                "train.py"
            ]
        );
        let env = env_of(&cmd);
        assert!(env.contains(&("PERCH_ENV_HOME".into(), "/home/alice".into())));
        assert!(env.contains(&("PERCH_ENV_USER".into(), "alice".into())));
    }

    #[test]
    fn programs_before_the_switch_get_perchs_environment_only() {
        let id = Identity {
            name: "alice".into(),
            uid: 1001,
            gid: 1001,
            groups: vec![],
            home: "/home/alice".into(),
        };
        let mut l = launch();
        l.env = [
            ("LD_PRELOAD".to_owned(), "/tmp/evil.so".to_owned()),
            ("GREETING".to_owned(), "hi".to_owned()),
        ]
        .into();
        let cmd = build(
            &l,
            &Shape {
                user: Some((&id, Some(Path::new("/usr/bin/setpriv")))),
                inherited: vec![("LANG".into(), "C.UTF-8".into())],
                ..Shape::default()
            },
        )
        .expect("command");
        let env = env_of(&cmd);
        let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert!(
            names
                .iter()
                .all(|k| *k == "PATH" || k.starts_with("PERCH_ENV_")),
            "{names:?}"
        );
        assert!(env.contains(&("PATH".into(), PREFIX_PATH.into())));
        assert!(env.contains(&("PERCH_ENV_LD_PRELOAD".into(), "/tmp/evil.so".into())));
        assert!(env.contains(&("PERCH_ENV_LANG".into(), "C.UTF-8".into())));
        // Without a prefix the job gets its environment directly, and nothing else.
        let cmd = build(&l, &Shape::default()).expect("command");
        let env = env_of(&cmd);
        assert!(env.contains(&("GREETING".into(), "hi".into())));
        assert!(env.iter().all(|(k, _)| !k.starts_with("PERCH_ENV_")));
        // A name the carrying shell could not take is refused, not mangled.
        l.env = [("A-B".to_owned(), "x".to_owned())].into();
        let shape = Shape {
            wait_for_go: true,
            ..Shape::default()
        };
        let err = build(&l, &shape).expect_err("not an identifier");
        assert!(err.to_string().contains("\"A-B\""), "{err}");
    }

    #[test]
    fn jobs_inherit_only_the_allowed_variables_of_the_agent() {
        let agent = [
            ("PATH", "/opt/bin:/usr/bin"),
            ("LANG", "C.UTF-8"),
            ("LC_TIME", "en_GB.UTF-8"),
            ("PERCH_TOKEN", "secret"),
            ("HTTPS_PROXY", "http://proxy"),
            ("LD_PRELOAD", "/x.so"),
        ]
        .map(|(k, v)| (k.into(), v.into()));
        let got = inherited(agent);
        let names: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["PATH", "LANG", "LC_TIME"]);
        assert_eq!(
            inherited([("HOME".into(), "/root".into())]),
            vec![("PATH".to_owned(), PREFIX_PATH.to_owned())],
            "a default PATH"
        );
    }

    #[test]
    fn identifiers() {
        for (name, ok) in [
            ("A", true),
            ("_a1", true),
            ("1A", false),
            ("A-B", false),
            ("", false),
        ] {
            assert_eq!(is_identifier(name), ok, "{name}");
        }
    }
}
