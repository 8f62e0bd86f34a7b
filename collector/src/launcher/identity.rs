//! Whose identity a job runs under.
//!
//! A job should run as the user who submitted it, not as the agent (usually root): its files,
//! its GPU processes and its limits are then that user's, as under Slurm. When the agent runs
//! as root and the user exists on the node (looked up through the system's user database, so
//! LDAP and SSSD users work), the job gets the user's uid, primary gid and supplementary
//! groups, and `HOME`, `USER` and `LOGNAME`. What happens otherwise is
//! [`RunAsUser`]'s choice, and every job's record says which identity it got.
//!
//! Supplementary groups: std's `CommandExt::groups` is not stable and the crate allows no
//! `unsafe` (`pre_exec`), so the switch goes through util-linux's `setpriv` when the node has
//! it (it sets groups, gid and uid, then executes the job); without `setpriv` std switches uid
//! and gid and clears the supplementary groups, and the job's record says so.

use std::ffi::CString;
use std::path::{Path, PathBuf};

/// `agent.run_as_user`: whether jobs run as their submitting user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunAsUser {
    /// As the user, or the job fails to start (the agent is not root, or the user is unknown).
    Required,
    /// As the user when the agent is root; as the agent's user otherwise. A user unknown on
    /// the node still fails the job: running it as root instead would hand root to anyone
    /// who submits under a made-up name.
    #[default]
    IfPossible,
    /// Always as the agent's user.
    Never,
}

impl RunAsUser {
    /// Parses the configuration value; the error lists the allowed ones.
    pub fn parse(text: &str) -> Result<RunAsUser, String> {
        match text {
            "required" => Ok(RunAsUser::Required),
            "if_possible" => Ok(RunAsUser::IfPossible),
            "never" => Ok(RunAsUser::Never),
            other => Err(format!(
                "{other:?} is not one of required, if_possible, never"
            )),
        }
    }
}

/// Which users jobs may be switched to (`agent.min_uid`, `agent.allowed_system_users`): root
/// never; system accounts (a uid below `min_uid`: daemons, services with keys and sockets of
/// their own) only when the operator lists them by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UidPolicy {
    pub min_uid: u32,
    pub allowed_system_users: Vec<String>,
}

/// `agent.min_uid`'s default: where ordinary accounts start on most distributions.
pub const DEFAULT_MIN_UID: u32 = 1000;

impl Default for UidPolicy {
    fn default() -> Self {
        UidPolicy {
            min_uid: DEFAULT_MIN_UID,
            allowed_system_users: Vec::new(),
        }
    }
}

impl UidPolicy {
    /// Why a job may not run as `id`, or `None` when it may.
    pub fn refuses(&self, id: &Identity) -> Option<String> {
        if id.uid == 0 {
            return Some(format!(
                "jobs never run as root: {:?} has uid 0 (agent.min_uid)",
                id.name
            ));
        }
        (id.uid < self.min_uid && !self.allowed_system_users.contains(&id.name)).then(|| {
            format!(
                "user {:?} has uid {}, below agent.min_uid = {}: system accounts do not run jobs unless an operator lists them in agent.allowed_system_users",
                id.name, id.uid, self.min_uid
            )
        })
    }
}

/// A user of this node, as the job will run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary group included, as `id -G` shows them).
    pub groups: Vec<u32>,
    pub home: PathBuf,
}

/// What the launcher does about a job's user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Switch to this user.
    Switch(Identity),
    /// Run as the agent's own user; the text is the note for the job's record (none when the
    /// agent's user is the job's).
    AsAgent(Option<String>),
    /// Do not start the job; the text is the reason.
    Refuse(String),
}

/// The agent's own user: (uid, name when known).
pub fn agent_user() -> (u32, String) {
    let uid = rustix::process::getuid().as_raw();
    let name = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or_else(|| format!("uid {uid}"), |u| u.name);
    (uid, name)
}

/// Looks `name` up in the system's user database. `Ok(None)`: no such user.
pub fn lookup(name: &str) -> Result<Option<Identity>, String> {
    let user =
        nix::unistd::User::from_name(name).map_err(|e| format!("looking up user {name:?}: {e}"))?;
    let Some(user) = user else {
        return Ok(None);
    };
    let cname = CString::new(name).map_err(|_| format!("user name {name:?} contains NUL"))?;
    let mut groups: Vec<u32> = nix::unistd::getgrouplist(&cname, user.gid)
        .map_err(|e| format!("listing the groups of {name:?}: {e}"))?
        .into_iter()
        .map(|g| g.as_raw())
        .collect();
    groups.sort_unstable();
    groups.dedup();
    Ok(Some(Identity {
        name: user.name,
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        groups,
        home: user.dir,
    }))
}

/// Decides whose identity job of `user` runs under, the agent being `agent` (uid, name).
pub fn decide(mode: RunAsUser, user: &str, agent: (u32, &str), uids: &UidPolicy) -> Decision {
    let (agent_uid, agent_name) = agent;
    if user == agent_name && (agent_uid != 0 || mode == RunAsUser::Never) {
        // Already the job's user (`perch up` run by the user who submits).
        return Decision::AsAgent(None);
    }
    if mode == RunAsUser::Never {
        return Decision::AsAgent(Some(format!(
            "runs as {agent_name}, the agent's user (agent.run_as_user = never), not as {user}"
        )));
    }
    if agent_uid != 0 {
        let why =
            format!("the agent runs as {agent_name}, not root, so it cannot switch to {user}");
        return match mode {
            RunAsUser::Required => Decision::Refuse(format!(
                "{why} (agent.run_as_user = required; run the agent as root or set it to if_possible)"
            )),
            _ => Decision::AsAgent(Some(format!("runs as {agent_name}: {why}"))),
        };
    }
    match lookup(user) {
        Ok(Some(identity)) => match uids.refuses(&identity) {
            Some(why) => Decision::Refuse(why),
            None => Decision::Switch(identity),
        },
        Ok(None) => Decision::Refuse(format!(
            "user {user:?} does not exist on this node (create it, e.g. from the cluster's directory service, or set agent.run_as_user = never to run jobs as the agent's user)"
        )),
        Err(e) => Decision::Refuse(e),
    }
}

/// Where `setpriv` (util-linux) is, when the node has it.
pub fn find_setpriv() -> Option<PathBuf> {
    [
        "/usr/bin/setpriv",
        "/bin/setpriv",
        "/usr/sbin/setpriv",
        "/sbin/setpriv",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

/// The arguments that make `setpriv` switch to `id` and execute the rest of the command line.
pub fn setpriv_args(setpriv: &Path, id: &Identity) -> Vec<String> {
    let groups = if id.groups.is_empty() {
        "--clear-groups".to_owned()
    } else {
        let list: Vec<String> = id.groups.iter().map(u32::to_string).collect();
        format!("--groups={}", list.join(","))
    };
    vec![
        setpriv.display().to_string(),
        format!("--reuid={}", id.uid),
        format!("--regid={}", id.gid),
        groups,
        "--".to_owned(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_bad_ones_are_named() {
        assert_eq!(RunAsUser::parse("required"), Ok(RunAsUser::Required));
        assert_eq!(RunAsUser::parse("if_possible"), Ok(RunAsUser::IfPossible));
        assert_eq!(RunAsUser::parse("never"), Ok(RunAsUser::Never));
        let err = RunAsUser::parse("always").expect_err("not a mode");
        assert!(
            err.contains("not one of required, if_possible, never"),
            "{err}"
        );
    }

    #[test]
    fn a_non_root_agent_runs_jobs_as_itself_or_refuses_when_required() {
        let agent = (1000, "perch");
        match decide(RunAsUser::IfPossible, "alice", agent, &UidPolicy::default()) {
            Decision::AsAgent(Some(note)) => assert!(
                note.contains("runs as perch") && note.contains("not root"),
                "{note}"
            ),
            other => panic!("{other:?}"),
        }
        // The agent's user submitting: it runs as itself, nothing to note.
        assert_eq!(
            decide(RunAsUser::Required, "perch", agent, &UidPolicy::default()),
            Decision::AsAgent(None)
        );
        match decide(RunAsUser::Required, "alice", agent, &UidPolicy::default()) {
            Decision::Refuse(why) => assert!(why.contains("run_as_user = required"), "{why}"),
            other => panic!("{other:?}"),
        }
        match decide(
            RunAsUser::Never,
            "alice",
            (0, "root"),
            &UidPolicy::default(),
        ) {
            Decision::AsAgent(Some(note)) => {
                assert!(note.contains("run_as_user = never"), "{note}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_root_agent_refuses_users_the_node_does_not_know() {
        match decide(
            RunAsUser::IfPossible,
            "no-such-user-perch",
            (0, "root"),
            &UidPolicy::default(),
        ) {
            Decision::Refuse(why) => assert!(why.contains("does not exist on this node"), "{why}"),
            other => panic!("{other:?}"),
        }
        // root is in every user database: looked up with its groups.
        let root = lookup("root").expect("lookup").expect("root exists");
        assert_eq!((root.uid, root.gid), (0, 0));
        assert!(root.groups.contains(&0));
    }

    #[test]
    fn root_and_system_users_are_refused_unless_listed() {
        let id = |name: &str, uid: u32| Identity {
            name: name.into(),
            uid,
            gid: uid,
            groups: vec![],
            home: "/".into(),
        };
        let policy = UidPolicy {
            min_uid: 1000,
            allowed_system_users: vec!["backup".into(), "root".into()],
        };
        for (who, refused) in [
            (id("alice", 1000), None),
            (id("daemon", 1), Some("below agent.min_uid = 1000")),
            (id("backup", 34), None),
            (id("root", 0), Some("jobs never run as root")),
        ] {
            match (policy.refuses(&who), refused) {
                (None, None) => {}
                (Some(why), Some(want)) => assert!(why.contains(want), "{why}"),
                (got, want) => panic!("{}: {got:?}, want {want:?}", who.name),
            }
        }
        match decide(
            RunAsUser::Required,
            "root",
            (0, "root"),
            &UidPolicy::default(),
        ) {
            Decision::Refuse(why) => assert!(why.contains("agent.min_uid"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn setpriv_gets_uid_gid_and_groups() {
        let id = Identity {
            name: "alice".into(),
            uid: 1001,
            gid: 1001,
            groups: vec![27, 1001],
            home: "/home/alice".into(),
        };
        assert_eq!(
            setpriv_args(Path::new("/usr/bin/setpriv"), &id),
            vec![
                "/usr/bin/setpriv",
                "--reuid=1001",
                "--regid=1001",
                "--groups=27,1001",
                "--"
            ]
        );
    }
}
