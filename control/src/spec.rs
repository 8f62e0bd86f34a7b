//! What a user submits: the job request as JSON over HTTP (the CLI builds it from flags or a
//! TOML file), checked field by field so every error names the field and what is allowed.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Longest time limit accepted.
pub const MAX_TIME_LIMIT_SECS: u64 = 30 * 24 * 3600;
/// Signals a job may ask for before it is killed.
pub const SIGNALS: [&str; 5] = ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"];

fn one() -> u32 {
    1
}

fn hour() -> u64 {
    3600
}

fn thirty() -> u64 {
    30
}

/// The most bytes of environment (names and values) one job may carry.
pub const MAX_ENV_BYTES: usize = 64 << 10;
/// The most host memory a job may ask for, MiB (64 TiB): past any node, and far from the
/// bytes (`MiB << 20`) a cgroup limit is written in overflowing.
pub const MAX_MEMORY_MB: u64 = 64 << 20;
/// The most CPUs a job may ask for.
pub const MAX_CPUS: u32 = 65_536;

/// The most bytes of command line one job may carry: an exec takes about 2 MiB of arguments
/// and environment in all, and a 16 MiB command (which no exec takes) was kept in memory for
/// every job of a loop of submissions.
pub const MAX_COMMAND_BYTES: usize = 256 << 10;
/// The longest argument the kernel passes to a program (`MAX_ARG_STRLEN`, 32 pages, with the
/// terminating NUL).
pub const MAX_ARG_BYTES: usize = (128 << 10) - 1;

/// The most bytes of command and environment one submission may make the server keep, over
/// all its array tasks.
pub const MAX_SUBMISSION_BYTES: usize = 16 << 20;

/// A job request. Only `command` is required.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobRequest {
    /// A name to recognise the job by.
    #[serde(default)]
    pub name: Option<String>,
    /// Program and arguments, run without a shell (use `["sh", "-c", "..."]` for one).
    pub command: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory on the node (default: the agent's job directory for the job).
    #[serde(default)]
    pub workdir: Option<String>,
    /// Nodes in the gang.
    #[serde(default = "one")]
    pub nodes: u32,
    /// GPUs on each node.
    #[serde(default = "one")]
    pub gpus_per_node: u32,
    /// A part of one GPU instead of whole GPUs (on nodes that allow sharing).
    #[serde(default)]
    pub gpu_share: Option<GpuShareRequest>,
    /// One MIG instance of this profile (`3g.40gb`) instead of whole GPUs, on a node whose
    /// agent reports one (operators partition GPUs with `nvidia-smi mig`; perch creates none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_profile: Option<String>,
    /// CPUs; enforced as the job's cgroup `cpu.max` where the agent can create cgroups.
    #[serde(default)]
    pub cpus: Option<u32>,
    /// Host memory, MiB; enforced as the job's cgroup `memory.max` likewise.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Only GPUs of this model (as NVML names it).
    #[serde(default)]
    pub gpu_model: Option<String>,
    #[serde(default = "hour")]
    pub time_limit_secs: u64,
    /// Who runs it (filled from the caller's identity when the server has authentication).
    #[serde(default)]
    pub user: Option<String>,
    /// Who pays; defaults to the user.
    #[serde(default)]
    pub account: Option<String>,
    #[serde(default)]
    pub queue: Option<String>,
    /// low, normal or high.
    #[serde(default)]
    pub qos: Option<String>,
    #[serde(default)]
    pub preemptible: bool,
    #[serde(default)]
    pub max_requeues: u32,
    /// Sent first when the job must stop; `grace_secs` later it is killed.
    #[serde(default)]
    pub checkpoint_signal: Option<String>,
    #[serde(default = "thirty")]
    pub grace_secs: u64,
    /// On simulated GPUs (labelled simulated), the load the job shows: idle (allocated but
    /// idle), steady or bursty. Real GPUs show what the job really does.
    #[serde(default)]
    pub sim_profile: Option<String>,
    /// Start only after these jobs completed successfully (Slurm's afterok); if one of them
    /// ends otherwise, this job is cancelled. An array's id (the one `perch submit --array`
    /// prints, its task 0's) stands for every task of the array, as in Slurm.
    #[serde(default)]
    pub after_ok: Vec<u64>,
    /// Start only after these jobs ended, however they ended (Slurm's afterany); an array's
    /// id waits for every task.
    #[serde(default)]
    pub after_any: Vec<u64>,
    /// Start only after these jobs ended without completing: failed, cancelled, timed out
    /// (Slurm's afternotok); if one of them completes, this job is cancelled. An array's id
    /// waits for every task and is met when one of them did not complete. Written only when
    /// set, so records without it read as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after_not_ok: Vec<u64>,
    /// Submit this many copies (a job array); each gets `PERCH_ARRAY_JOB_ID` (the first
    /// copy's id) and `PERCH_ARRAY_TASK_ID` (0, 1, ...).
    #[serde(default)]
    pub array: Option<u32>,
    /// Accept the job even when no node this cluster has seen could run it, to wait for
    /// larger nodes to join (otherwise such a job is refused, saying what fits). Read at
    /// submission only: never stored nor sent on.
    #[serde(default, skip_serializing)]
    pub hold_until_fits: bool,
    /// What the submit directory holds (git commit, diff, container, Python packages), as the
    /// CLI found it ([`crate::provenance`]). Taken out at submission and stored in the job's
    /// provenance record, never in the job's own record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Box<crate::provenance::SubmitProvenance>>,
}

/// `gpu_share = { fraction = 0.25, memory_gb = 10 }`: the job gets a quarter of one GPU's
/// compute and needs 10 GiB of its memory. The scheduler packs it onto a GPU whose shares,
/// measured load and free memory leave room; the agent tells MPS the same numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuShareRequest {
    /// Part of the GPU's compute: 0.01 to 0.99 in steps of 0.01 (MPS takes whole percents).
    pub fraction: f64,
    /// GPU memory the job needs, GiB (as nvidia-smi counts them).
    pub memory_gb: f64,
}

impl GpuShareRequest {
    /// The fraction in whole percents (validated to be one).
    pub fn percent(&self) -> u32 {
        (self.fraction * 100.0).round().clamp(1.0, 99.0) as u32
    }

    /// The memory in MiB, rounded up.
    pub fn memory_mb(&self) -> u64 {
        (self.memory_gb * 1024.0).ceil().max(1.0) as u64
    }

    fn validate(&self, nodes: u32, gpus_per_node: u32) -> Result<(), FieldError> {
        let f = self.fraction;
        let pct = f * 100.0;
        if !f.is_finite()
            || !(0.01 - 1e-9..=0.99 + 1e-9).contains(&f)
            || (pct - pct.round()).abs() > 1e-6
        {
            return Err(err(
                "gpu_share.fraction",
                format!(
                    "{f} must be a multiple of 0.01 between 0.01 and 0.99 (for whole GPUs leave gpu_share out and set gpus_per_node)"
                ),
            ));
        }
        if !self.memory_gb.is_finite() || self.memory_gb <= 0.0 || self.memory_gb > 1024.0 {
            return Err(err(
                "gpu_share.memory_gb",
                format!(
                    "{} must be above 0 and at most 1024 (GiB of GPU memory the job needs)",
                    self.memory_gb
                ),
            ));
        }
        if gpus_per_node != 1 {
            return Err(err(
                "gpu_share",
                format!(
                    "a shared job runs on part of one GPU: leave gpus_per_node at 1 (got {gpus_per_node}), or drop gpu_share for whole GPUs"
                ),
            ));
        }
        if nodes != 1 {
            return Err(err(
                "gpu_share",
                format!("a shared job runs on one node: leave nodes at 1 (got {nodes})"),
            ));
        }
        Ok(())
    }
}

/// A field that is wrong and what would be right.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("field `{field}`: {message}")]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

fn err(field: &'static str, message: impl Into<String>) -> FieldError {
    FieldError {
        field,
        message: message.into(),
    }
}

fn check_name(field: &'static str, value: &str) -> Result<(), FieldError> {
    if value.is_empty()
        || value.len() > 64
        || !value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(err(
            field,
            format!("{value:?} must be 1 to 64 ASCII letters, digits, '.', '_' or '-'"),
        ));
    }
    Ok(())
}

/// Characters that reorder or isolate the text around them (bidirectional overrides,
/// embeddings, isolates and marks): in a name shown by `perch jobs` or the web view they make
/// it read as something else (`job\u{202E}txt.exe`), so displayed free text may not hold them.
pub const REFUSED_DISPLAY_CHARS: [(char, &str); 12] = [
    ('\u{200E}', "left-to-right mark"),
    ('\u{200F}', "right-to-left mark"),
    ('\u{061C}', "Arabic letter mark"),
    ('\u{202A}', "left-to-right embedding"),
    ('\u{202B}', "right-to-left embedding"),
    ('\u{202C}', "pop directional formatting"),
    ('\u{202D}', "left-to-right override"),
    ('\u{202E}', "right-to-left override"),
    ('\u{2066}', "left-to-right isolate"),
    ('\u{2067}', "right-to-left isolate"),
    ('\u{2068}', "first strong isolate"),
    ('\u{2069}', "pop directional isolate"),
];

/// Refuses a bidirectional control character in displayed free text, naming it and where it is
/// (counted in characters from 1).
fn check_display(field: &'static str, value: &str) -> Result<(), FieldError> {
    let found = value.chars().enumerate().find_map(|(i, c)| {
        REFUSED_DISPLAY_CHARS
            .iter()
            .find(|(bad, _)| *bad == c)
            .map(|(bad, what)| (i + 1, *bad, *what))
    });
    match found {
        Some((at, c, what)) => Err(err(
            field,
            format!(
                "holds U+{:04X} ({what}) at character {at}: text direction controls make it display as something else; remove it",
                u32::from(c)
            ),
        )),
        None => Ok(()),
    }
}

/// Accounts no job runs as, though their uid is above `agent.min_uid`: the overflow user
/// (uid 65534) that NFS maps unknown and root users to, owner of files nobody should share.
pub const REFUSED_USERS: [&str; 2] = ["nobody", "nfsnobody"];

/// Variables a job's `env` may never set, with why. perch applies a job's environment only
/// after the switch to its user (the agent's `launcher/command.rs`), so none of these could
/// reach a program running as root; they are refused anyway, so that no future wrapper, helper
/// or misconfigured node can turn them into root's, and so the user learns at once.
/// `LD_LIBRARY_PATH` and the `MALLOC_*` tuning variables are allowed: they apply to the job's
/// own programs, as its user, and CUDA and conda setups rely on the former.
pub const REFUSED_ENV: [(&str, &str); 5] = [
    (
        "LD_PRELOAD",
        "it loads a library into every program the job starts; load it from the job's own command instead",
    ),
    (
        "LD_AUDIT",
        "it loads an auditing library into every program the job starts",
    ),
    (
        "GCONV_PATH",
        "it makes the C library load code from a directory of the user's choosing",
    ),
    (
        "LD_DEBUG_OUTPUT",
        "it makes the dynamic loader write to a file of the user's choosing",
    ),
    (
        "GLIBC_TUNABLES",
        "it tunes the dynamic loader itself (CVE-2023-4911); set it inside the job's command if needed",
    ),
];

/// A variable name a job may set: a shell identifier (the agent passes the environment through
/// a shell after the switch to the job's user), not perch's, not a refused loader variable.
fn check_env_name(key: &str) -> Result<(), FieldError> {
    let mut chars = key.chars();
    let identifier = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !identifier {
        return Err(err(
            "env",
            format!(
                "{key:?} is not a valid variable name (letters, digits and '_', not starting with a digit)"
            ),
        ));
    }
    if key == "CUDA_VISIBLE_DEVICES" || key.starts_with("PERCH_") {
        return Err(err("env", format!("{key} is set by perch; leave it out")));
    }
    if let Some((_, why)) = REFUSED_ENV.iter().find(|(name, _)| *name == key) {
        return Err(err(
            "env",
            format!("{key} is refused on every node: {why} (docs/security.md)"),
        ));
    }
    Ok(())
}

/// Checks a MIG profile request: `<n>g.<m>gb` (n from 1 to 7), one instance on one node, not
/// with a share.
fn check_gpu_profile(
    profile: &str,
    nodes: u32,
    gpus_per_node: u32,
    shared: bool,
) -> Result<(), FieldError> {
    if perch_model::control::mig_profile_slices(profile).is_none() {
        return Err(err(
            "gpu_profile",
            format!(
                "{profile:?} is not a MIG profile: use the form <n>g.<m>gb with n from 1 to 7, as nvidia-smi mig -lgip lists them (e.g. 3g.40gb)"
            ),
        ));
    }
    if shared {
        return Err(err(
            "gpu_profile",
            "a MIG instance is not shared: drop gpu_share (--gpu-fraction, --gpu-memory-gb) or gpu_profile",
        ));
    }
    if gpus_per_node != 1 || nodes != 1 {
        return Err(err(
            "gpu_profile",
            format!(
                "a job on a MIG instance gets one instance on one node: leave gpus_per_node and nodes at 1 (got {gpus_per_node} GPUs on {nodes} nodes), or drop gpu_profile for whole GPUs"
            ),
        ));
    }
    Ok(())
}

impl JobRequest {
    /// Bytes of command and environment: what the server keeps of the job beyond a fixed size.
    pub fn kept_bytes(&self) -> usize {
        let env: usize = self.env.iter().map(|(k, v)| k.len() + v.len()).sum();
        env + self.command.iter().map(String::len).sum::<usize>()
    }

    /// [`JobRequest::kept_bytes`] of each of its array tasks, with the variables a task adds
    /// (`PERCH_ARRAY_JOB_ID`, `PERCH_ARRAY_TASK_ID`).
    pub fn task_bytes(&self) -> usize {
        self.kept_bytes() + if self.array.is_some() { 64 } else { 0 }
    }

    /// Checks every field; the first wrong one is named, and the error says what to change.
    pub fn validate(&self) -> Result<(), FieldError> {
        match self.command.first() {
            None => {
                return Err(err(
                    "command",
                    "give the program and its arguments, e.g. [\"python\", \"train.py\"]",
                ));
            }
            Some(p) if p.is_empty() => return Err(err("command", "the program name is empty")),
            _ => {}
        }
        if self.command.iter().any(|a| a.contains('\0')) {
            return Err(err("command", "arguments cannot contain NUL bytes"));
        }
        if let Some((i, a)) = self
            .command
            .iter()
            .enumerate()
            .find(|(_, a)| a.len() > MAX_ARG_BYTES)
        {
            return Err(err(
                "command",
                format!(
                    "argument {i} is {} bytes; the kernel passes at most {MAX_ARG_BYTES} in one argument: pass large values in a file the job reads",
                    a.len()
                ),
            ));
        }
        let command_bytes: usize = self.command.iter().map(String::len).sum();
        if command_bytes > MAX_COMMAND_BYTES {
            return Err(err(
                "command",
                format!(
                    "holds {command_bytes} bytes; the limit is {MAX_COMMAND_BYTES}: pass large values in a file the job reads"
                ),
            ));
        }
        if let Some(name) = &self.name
            && (name.is_empty() || name.len() > 128 || name.chars().any(char::is_control))
        {
            return Err(err(
                "name",
                "must be 1 to 128 characters without control characters",
            ));
        }
        if let Some(name) = &self.name {
            check_display("name", name)?;
        }
        for key in self.env.keys() {
            check_env_name(key)?;
        }
        if !(1..=1024).contains(&self.nodes) {
            return Err(err("nodes", "must be between 1 and 1024"));
        }
        if !(1..=64).contains(&self.gpus_per_node) {
            return Err(err("gpus_per_node", "must be between 1 and 64"));
        }
        if let Some(share) = &self.gpu_share {
            share.validate(self.nodes, self.gpus_per_node)?;
        }
        if let Some(profile) = &self.gpu_profile {
            check_gpu_profile(
                profile,
                self.nodes,
                self.gpus_per_node,
                self.gpu_share.is_some(),
            )?;
        }
        if self.cpus == Some(0) {
            return Err(err("cpus", "must be at least 1 when given"));
        }
        if let Some(c) = self.cpus
            && c > MAX_CPUS
        {
            return Err(err(
                "cpus",
                format!("must be 1 to {MAX_CPUS} when given, got {c}"),
            ));
        }
        if self.memory_mb == Some(0) {
            return Err(err("memory_mb", "must be at least 1 when given"));
        }
        if let Some(m) = self.memory_mb
            && m > MAX_MEMORY_MB
        {
            return Err(err(
                "memory_mb",
                format!("must be 1 to {MAX_MEMORY_MB} (64 TiB) when given, got {m}"),
            ));
        }
        if let Some(m) = &self.gpu_model {
            if m.trim().is_empty() {
                return Err(err(
                    "gpu_model",
                    "is empty: leave it out to run on any model, or name one as `perch nodes` shows it",
                ));
            }
            if m.len() > 128 || m.chars().any(char::is_control) {
                return Err(err(
                    "gpu_model",
                    "must be 1 to 128 characters without control characters, as `perch nodes` shows it",
                ));
            }
            check_display("gpu_model", m)?;
        }
        if let Some(w) = &self.workdir
            && (!w.starts_with('/') || w.len() > 4096 || w.contains('\0'))
        {
            return Err(err(
                "workdir",
                format!(
                    "{w:?} must be an absolute path on the nodes (such as /home/alice/project), \
                     at most 4096 bytes; `perch submit -D` makes a relative one absolute from the \
                     directory you submit in"
                ),
            ));
        }
        if let Some(w) = &self.workdir {
            check_display("workdir", w)?;
        }
        if !(1..=MAX_TIME_LIMIT_SECS).contains(&self.time_limit_secs) {
            return Err(err(
                "time_limit_secs",
                format!("must be between 1 and {MAX_TIME_LIMIT_SECS} (30 days)"),
            ));
        }
        if let Some(u) = &self.user {
            check_name("user", u)?;
            if u == "root" {
                return Err(err(
                    "user",
                    "jobs never run as root: every agent refuses users below agent.min_uid (1000 by default), and root cannot be allowed in agent.allowed_system_users; name an ordinary user of the nodes the job runs as: `perch submit --user NAME` (or `user = \"NAME\"` in a --file)",
                ));
            }
            if REFUSED_USERS.contains(&u.as_str()) {
                return Err(err(
                    "user",
                    format!(
                        "jobs never run as {u}: it is the overflow account (uid 65534) that NFS maps unknown users to, so its files are everyone's; submit as your own user"
                    ),
                ));
            }
        }
        if let Some(a) = &self.account {
            check_name("account", a)?;
        }
        if let Some(q) = &self.queue {
            check_name("queue", q)?;
        }
        if let Some(q) = &self.qos
            && !matches!(q.as_str(), "low" | "normal" | "high")
        {
            return Err(err("qos", format!("{q:?} is not one of low, normal, high")));
        }
        if self.max_requeues > 100 {
            return Err(err("max_requeues", "must be at most 100"));
        }
        if let Some(s) = &self.checkpoint_signal
            && !SIGNALS.contains(&s.as_str())
        {
            return Err(err(
                "checkpoint_signal",
                format!("{s:?} is not one of {}", SIGNALS.join(", ")),
            ));
        }
        if let Some(p) = &self.sim_profile
            && !matches!(p.as_str(), "idle" | "steady" | "bursty")
        {
            return Err(err(
                "sim_profile",
                format!("{p:?} is not one of idle, steady, bursty"),
            ));
        }
        if let Some(n) = self.array
            && !(1..=10_000).contains(&n)
        {
            return Err(err("array", "must be between 1 and 10000"));
        }
        // What one submission may make the server keep: each array task keeps its own copy of
        // the command and environment (a 10,000-task array with a 100 KB env took 13 s and
        // 3.6 GB, and starved agent syncs until nodes were marked down).
        let env_bytes: usize = self.env.iter().map(|(k, v)| k.len() + v.len()).sum();
        if env_bytes > MAX_ENV_BYTES {
            return Err(err(
                "env",
                format!(
                    "holds {env_bytes} bytes; the limit is {MAX_ENV_BYTES}: pass large values in a file the job reads"
                ),
            ));
        }
        let tasks = self.array.unwrap_or(1) as usize;
        let total = (env_bytes + command_bytes).saturating_mul(tasks);
        if total > MAX_SUBMISSION_BYTES {
            return Err(err(
                "array",
                format!(
                    "{tasks} tasks x {} bytes of command and env is {total} bytes; one submission may hold {MAX_SUBMISSION_BYTES}: submit fewer tasks at a time, or move the large values into a file",
                    env_bytes + command_bytes
                ),
            ));
        }
        if self.after_ok.len() + self.after_any.len() + self.after_not_ok.len() > 100 {
            return Err(err("after_ok", "at most 100 dependencies in all"));
        }
        if self.grace_secs > 3600 {
            return Err(err("grace_secs", "must be at most 3600"));
        }
        Ok(())
    }

    pub fn user(&self) -> &str {
        self.user.as_deref().unwrap_or("nobody")
    }

    pub fn account(&self) -> &str {
        self.account.as_deref().unwrap_or_else(|| self.user())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, expected: Option<&str>) {
        let got = serde_json::from_str::<JobRequest>(json)
            .map_err(|e| e.to_string())
            .and_then(|r| r.validate().map_err(|e| e.to_string()));
        match (got, expected) {
            (Ok(()), None) => {}
            (Err(msg), Some(want)) => assert!(msg.contains(want), "{json}: {msg:?} lacks {want:?}"),
            (got, want) => panic!("{json}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn every_bad_field_is_named() {
        check(r#"{"command": ["python", "train.py"]}"#, None);
        // One request for 10,000 tasks with a 100 KB env starved the server.
        let big = "v".repeat(100 << 10);
        check(
            &format!(r#"{{"command": ["x"], "env": {{"A": "{big}"}}}}"#),
            Some("field `env`: holds 102401 bytes; the limit is 65536"),
        );
        let value = "v".repeat(60 << 10);
        check(
            &format!(r#"{{"command": ["x"], "array": 10000, "env": {{"A": "{value}"}}}}"#),
            Some("field `array`: 10000 tasks x 61442 bytes"),
        );
        check(
            &format!(r#"{{"command": ["x"], "array": 200, "env": {{"A": "{value}"}}}}"#),
            None,
        );
        check(r#"{"command": []}"#, Some("field `command`"));
        // A command no exec takes, kept for every job of a loop of submissions.
        let arg = "a".repeat(100 << 10);
        check(
            &format!(r#"{{"command": ["x", "{arg}", "{arg}", "{arg}"]}}"#),
            Some("field `command`: holds 307201 bytes; the limit is 262144"),
        );
        check(&format!(r#"{{"command": ["x", "{arg}", "{arg}"]}}"#), None);
        let arg = "a".repeat(128 << 10);
        check(
            &format!(r#"{{"command": ["x", "{arg}"]}}"#),
            Some("field `command`: argument 1 is 131072 bytes; the kernel passes at most 131071"),
        );
        check(
            r#"{"comand": ["x"]}"#,
            Some("unknown field `comand`, expected one of"),
        );
        check(
            r#"{"command": ["x"], "gpus_per_node": 0}"#,
            Some("field `gpus_per_node`: must be between 1 and 64"),
        );
        check(r#"{"command": ["x"], "nodes": 0}"#, Some("field `nodes`"));
        // Sizes past any node: a memory limit in MiB that overflowed the cgroup's bytes
        // (2^44 + 1 MiB wrapped to 1 MiB), a CPU count no node has.
        check(
            r#"{"command": ["x"], "memory_mb": 17592186044417}"#,
            Some("field `memory_mb`: must be 1 to 67108864 (64 TiB)"),
        );
        check(r#"{"command": ["x"], "memory_mb": 67108864}"#, None);
        check(
            r#"{"command": ["x"], "cpus": 4294967295}"#,
            Some("field `cpus`: must be 1 to 65536"),
        );
        // A model left empty by an unset shell variable waited for ever on no node.
        check(
            r#"{"command": ["x"], "gpu_model": ""}"#,
            Some("field `gpu_model`: is empty: leave it out"),
        );
        check(
            r#"{"command": ["x"], "gpu_model": "A\u0007"}"#,
            Some("field `gpu_model`: must be 1 to 128 characters"),
        );
        check(
            r#"{"command": ["x"], "gpu_model": "NVIDIA H100 80GB HBM3"}"#,
            None,
        );
        // A relative directory is relative to the agent's own, which no user means.
        check(
            r#"{"command": ["x"], "workdir": "project"}"#,
            Some("field `workdir`: \"project\" must be an absolute path"),
        );
        check(
            r#"{"command": ["x"], "workdir": "/home/alice/project"}"#,
            None,
        );
        check(
            r#"{"command": ["x"], "qos": "urgent"}"#,
            Some("not one of low, normal, high"),
        );
        check(
            r#"{"command": ["x"], "checkpoint_signal": "SIGKILL"}"#,
            Some("not one of SIGTERM"),
        );
        check(
            r#"{"command": ["x"], "time_limit_secs": 0}"#,
            Some("field `time_limit_secs`"),
        );
        check(r#"{"command": ["x"], "user": "a b"}"#, Some("field `user`"));
        check(
            r#"{"command": ["x"], "user": "root"}"#,
            Some(
                "field `user`: jobs never run as root: every agent refuses users below agent.min_uid",
            ),
        );
        check(
            r#"{"command": ["x"], "env": {"CUDA_VISIBLE_DEVICES": "0"}}"#,
            Some("set by perch"),
        );
        check(
            r#"{"command": ["x"], "env": {"LD_PRELOAD": "/tmp/x.so"}}"#,
            Some("field `env`: LD_PRELOAD is refused on every node: it loads a library"),
        );
        for (name, _) in REFUSED_ENV {
            check(
                &format!(r#"{{"command": ["x"], "env": {{"{name}": "x"}}}}"#),
                Some(&format!("{name} is refused on every node")),
            );
        }
        check(
            r#"{"command": ["x"], "env": {"LD_LIBRARY_PATH": "/opt/cuda/lib64", "MALLOC_ARENA_MAX": "2"}}"#,
            None,
        );
        check(
            r#"{"command": ["x"], "env": {"A-B": "x"}}"#,
            Some("\"A-B\" is not a valid variable name"),
        );
        check(
            r#"{"command": ["x"], "gpus_per_node": -1}"#,
            Some("invalid value"),
        );
    }

    /// `nobody` (uid 65534, above `agent.min_uid`) ran jobs; a right-to-left override made a
    /// job's name display backwards.
    #[test]
    fn nobody_and_text_direction_controls_are_refused() {
        for user in REFUSED_USERS {
            check(
                &format!(r#"{{"command": ["x"], "user": "{user}"}}"#),
                Some(&format!(
                    "field `user`: jobs never run as {user}: it is the overflow account (uid 65534)"
                )),
            );
        }
        check(r#"{"command": ["x"], "user": "nobodyelse"}"#, None);
        check(
            r#"{"command": ["x"], "name": "report\u202Efdp.exe"}"#,
            Some(
                "field `name`: holds U+202E (right-to-left override) at character 7: text direction controls",
            ),
        );
        for (c, what) in REFUSED_DISPLAY_CHARS {
            let json = serde_json::json!({"command": ["x"], "name": format!("ab{c}")}).to_string();
            check(
                &json,
                Some(&format!(
                    "field `name`: holds U+{:04X} ({what}) at character 3",
                    u32::from(c)
                )),
            );
        }
        check(
            r#"{"command": ["x"], "gpu_model": "H100\u2066"}"#,
            Some("field `gpu_model`: holds U+2066 (left-to-right isolate) at character 5"),
        );
        check(
            r#"{"command": ["x"], "workdir": "/home/a/\u200Fx"}"#,
            Some("field `workdir`: holds U+200F (right-to-left mark) at character 9"),
        );
        // Right-to-left script itself is a name like any other.
        check(r#"{"command": ["x"], "name": "تدريب-نموذج ✓ 训练"}"#, None);
    }

    #[test]
    fn gpu_profiles_are_checked() {
        let job = |rest: &str| format!(r#"{{"command": ["x"], {rest}}}"#);
        check(&job(r#""gpu_profile": "3g.40gb""#), None);
        for bad in ["3g", "3g.40GB", "8g.80gb", "three"] {
            check(
                &job(&format!(r#""gpu_profile": "{bad}""#)),
                Some("field `gpu_profile`: "),
            );
        }
        check(
            &job(r#""gpu_profile": "3g.4gb", "gpus_per_node": 2"#),
            Some(
                "field `gpu_profile`: a job on a MIG instance gets one instance on one node: leave gpus_per_node and nodes at 1 (got 2 GPUs on 1 nodes)",
            ),
        );
        check(
            &job(r#""gpu_profile": "3g.40gb", "gpu_share": {"fraction": 0.5, "memory_gb": 1}"#),
            Some("field `gpu_profile`: a MIG instance is not shared"),
        );
    }

    #[test]
    fn gpu_shares_are_checked() {
        let share = |rest: &str| format!(r#"{{"command": ["x"], {rest}}}"#);
        check(
            &share(r#""gpu_share": {"fraction": 0.25, "memory_gb": 10}"#),
            None,
        );
        check(
            &share(r#""gpu_share": {"fraction": 0.25, "memory_gb": 10}, "gpus_per_node": 2"#),
            Some(
                "field `gpu_share`: a shared job runs on part of one GPU: leave gpus_per_node at 1 (got 2)",
            ),
        );
        check(
            &share(r#""gpu_share": {"fraction": 0.25, "memory_gb": 10}, "nodes": 2"#),
            Some("field `gpu_share`: a shared job runs on one node"),
        );
        for bad in ["0", "1", "1.5", "0.255", "-0.5"] {
            check(
                &share(&format!(
                    r#""gpu_share": {{"fraction": {bad}, "memory_gb": 1}}"#
                )),
                Some("field `gpu_share.fraction`: "),
            );
        }
        check(
            &share(r#""gpu_share": {"fraction": 0.5, "memory_gb": 0}"#),
            Some("field `gpu_share.memory_gb`"),
        );
        check(
            &share(r#""gpu_share": {"fraction": 0.5}"#),
            Some("missing field `memory_gb`"),
        );
        let r: JobRequest = serde_json::from_str(&share(
            r#""gpu_share": {"fraction": 0.07, "memory_gb": 1.5}"#,
        ))
        .expect("parses");
        let s = r.gpu_share.expect("share");
        assert_eq!((s.percent(), s.memory_mb()), (7, 1536));
    }
}
