//! The job commands: `perch submit`, `jobs`, `show`, `cancel`, `logs`, `queue`, `nodes`,
//! `drain`, `resume`. Thin clients of the server's HTTP API, with output shaped like Slurm's
//! (sbatch, squeue, scontrol show job, scancel, sinfo) so its users feel at home.

use crate::client::{ClientConfig, Connection};
use crate::config::ConfigFile;
use anyhow::{Context, Result, bail};
use clap::Args;
use perch_control::api::{
    CancelAnswer, ErrorBody, JobView, JobsPage, NodeList, NodeStateChange, QueueView, Submitted,
};
use perch_control::record::{JobRecord, JobState};
use perch_control::spec::JobRequest;
use perch_model::ErrorCode;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// `--server` and `--token` of every client command; the rest of the resolution (environment,
/// config file, per-user file, default) is in client.rs.
#[derive(Debug, Args)]
pub struct ServerArg {
    /// Server URL; several, separated by commas, for a leader and its standbys. Else
    /// PERCH_SERVER, else the --config file's [client] server(s) or server.listen, else
    /// ~/.config/perch/config.toml, else http://127.0.0.1:7300.
    #[arg(long, global = true)]
    server: Option<String>,
    /// Bearer token, when the server requires one. Else PERCH_TOKEN, else [client] token of the
    /// --config file or ~/.config/perch/config.toml.
    #[arg(long, global = true)]
    token: Option<String>,
}

impl ServerArg {
    /// The server and token to use, from these flags, the environment and `config_file`.
    pub(crate) fn resolve(&self, config_file: Option<&ConfigFile>) -> Result<ClientConfig> {
        crate::client::load(self.server.as_deref(), self.token.as_deref(), config_file)
    }
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    server: ServerArg,
    /// A file with the job request: the JSON object POST /v1/jobs takes, or its fields in TOML;
    /// flags override it.
    #[arg(long)]
    file: Option<PathBuf>,
    /// GPUs per node.
    #[arg(long, short = 'g')]
    gpus: Option<u32>,
    /// Nodes (the job gets gpus x nodes GPUs, all at once).
    #[arg(long, short = 'N')]
    nodes: Option<u32>,
    /// Part of one GPU instead of whole GPUs, 0.01 to 0.99 (on nodes with agent.gpu_sharing);
    /// needs --gpu-memory-gb.
    #[arg(long, requires = "gpu_memory_gb", conflicts_with = "gpus", value_parser = finite)]
    gpu_fraction: Option<f64>,
    /// GPU memory a shared job needs, GiB.
    #[arg(long, requires = "gpu_fraction", value_parser = finite)]
    gpu_memory_gb: Option<f64>,
    /// One MIG instance of this profile instead of whole GPUs, e.g. 3g.40gb (on nodes whose
    /// GPUs an operator partitioned with nvidia-smi mig; `perch nodes` lists them).
    #[arg(long, conflicts_with_all = ["gpu_fraction", "gpu_memory_gb"], value_parser = mig_profile)]
    gpu_profile: Option<String>,
    /// CPUs (the job's cgroup cpu.max, where the node can set one).
    #[arg(long, short = 'c')]
    cpus: Option<u32>,
    /// Host memory in MiB (the job's cgroup memory.max).
    #[arg(long)]
    mem: Option<u64>,
    /// Time limit: seconds, 90s, 30m, 2h, 1d, or HH:MM:SS.
    #[arg(long, short = 't')]
    time: Option<String>,
    #[arg(long, short = 'J')]
    name: Option<String>,
    /// Who runs the job. Default: the --file's `user`, else $USER, else the name of the user
    /// running perch; with a token and no $USER, the token's user. Only operators (root, with
    /// no tokens file) may name another user; jobs never run as root, so root names one.
    #[arg(long)]
    user: Option<String>,
    /// The account charged (default: the user's own).
    #[arg(long, short = 'A')]
    account: Option<String>,
    /// low, normal or high.
    #[arg(long)]
    qos: Option<String>,
    /// Only GPUs of this model (as `perch nodes` names it).
    #[arg(long)]
    gpu_model: Option<String>,
    /// The scheduler may stop the job (checkpoint signal, then its grace) and requeue it: for
    /// a higher-priority job, to give an account its quota back, or when it sits idle. Only
    /// preemptible jobs run past their account's GPU quota on idle GPUs; a job asking for more
    /// than its account's quota is refused without it.
    #[arg(long)]
    preemptible: bool,
    /// Times the job may be requeued (after a preemption or a node failure) before it ends.
    #[arg(long)]
    max_requeues: Option<u32>,
    /// Signal sent first when the job must stop: SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP.
    #[arg(long)]
    signal: Option<String>,
    /// Seconds between that signal and SIGKILL (at most 3600; when the scheduler stops the job
    /// for another job, at most the server's scheduler.preemption_grace_max, 5 min by default).
    #[arg(long)]
    grace: Option<u64>,
    /// On simulated GPUs, the load the job shows: idle, steady or bursty.
    #[arg(long)]
    sim_profile: Option<String>,
    /// Accept the job even when no node the cluster has seen could run it, and hold it until
    /// nodes that can join (without it, such a job is refused, saying what fits).
    #[arg(long)]
    hold_until_fits: bool,
    /// Submit N copies (a job array; PERCH_ARRAY_TASK_ID tells them apart).
    #[arg(long)]
    array: Option<u32>,
    /// Start after these jobs completed successfully (comma-separated ids; an array's id
    /// waits for every task of the array).
    #[arg(long, value_delimiter = ',')]
    after_ok: Vec<u64>,
    /// Start after these jobs ended, however (comma-separated ids; an array's id waits for
    /// every task).
    #[arg(long, value_delimiter = ',')]
    after_any: Vec<u64>,
    /// Start after these jobs ended without completing: failed, cancelled, timed out
    /// (comma-separated ids; an array's id waits for every task, and is met when one did not
    /// complete). The job is cancelled if they complete.
    #[arg(long, value_delimiter = ',')]
    after_not_ok: Vec<u64>,
    /// KEY=VALUE, repeatable.
    #[arg(long = "env", short = 'e')]
    env: Vec<String>,
    /// The directory the job runs in, on its nodes (relative: under the current directory;
    /// `-D .` runs it where you submit, as sbatch does). Default: the job's own directory under
    /// the agent's data directory, where its hostfile is.
    #[arg(long, short = 'D')]
    workdir: Option<String>,
    /// Also record the Python environment's packages (`python3 -m pip freeze`, at most
    /// 256 KiB) with the job's provenance.
    #[arg(long)]
    provenance_python: bool,
    /// Record no provenance (git commit, diff, container image) for this job.
    #[arg(long, conflicts_with = "provenance_python")]
    no_provenance: bool,
    /// Program and arguments (after --).
    #[arg(last = true)]
    command: Vec<String>,
}

/// A number that is one (not NaN or infinite, which JSON cannot carry).
fn finite(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err("must be a finite number, such as 0.25".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    #[command(flatten)]
    server: ServerArg,
    /// pending, running, completed, failed, cancelled, timeout, preempted, node_fail.
    #[arg(long)]
    state: Option<String>,
    #[arg(long, short = 'u')]
    user: Option<String>,
    #[arg(long, short = 'A')]
    account: Option<String>,
    /// Include ended jobs (by default only pending and running ones are listed).
    #[arg(long, short = 'a')]
    all: bool,
    /// List at most this many, newest first (fetched 10,000 a request).
    #[arg(long, default_value_t = 100)]
    limit: usize,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Job id.
    id: u64,
    /// What the job ran: the submit directory's git commit, branch and uncommitted diff,
    /// container image, Python packages, and each attempt's environment and node versions.
    #[arg(long)]
    provenance: bool,
    /// With --provenance: the record as JSON.
    #[arg(long, requires = "provenance")]
    json: bool,
}

#[derive(Debug, Args)]
#[command(group(
    clap::ArgGroup::new("which")
        .required(true)
        .multiple(true)
        .args(["ids", "array", "user", "account", "name", "state"])
))]
pub struct CancelArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Job ids (or filters instead: every unfinished job that matches all of them).
    #[arg(conflicts_with_all = ["array", "user", "account", "name", "state"])]
    ids: Vec<u64>,
    /// Every unfinished task of this array (its id, as `perch submit --array` printed it).
    #[arg(long)]
    array: Option<u64>,
    /// This user's jobs (yours unless you are an operator).
    #[arg(long, short = 'u')]
    user: Option<String>,
    #[arg(long, short = 'A')]
    account: Option<String>,
    /// Jobs of this name (an array's tasks answer to their array's name).
    #[arg(long, short = 'n')]
    name: Option<String>,
    /// pending or running.
    #[arg(long, short = 't')]
    state: Option<String>,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    #[command(flatten)]
    server: ServerArg,
    id: u64,
    /// Show standard error instead of standard output.
    #[arg(long)]
    stderr: bool,
    /// Keep printing new output until the job ends and its node has sent all of it (across
    /// requeues: each new attempt's output follows a line on standard error). A pending job
    /// is waited for (without -f, a pending job is an error: it has no output yet).
    #[arg(long, short = 'f')]
    follow: bool,
    /// Which node of a multi-node job, by rank (0 is where MASTER_ADDR points).
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Which attempt of a requeued job (default: the latest).
    #[arg(long)]
    attempt: Option<u32>,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    server: ServerArg,
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Node name.
    node: String,
}

/// The server's answer to a request it refused: its status, and the code and message of
/// its error body (`{"error": {"code", "message"}}`).
#[derive(Debug)]
pub(crate) struct Refused {
    status: reqwest::StatusCode,
    /// `None` when the body names no code this build knows, or is not the API's error body
    /// (a proxy's page, which is then the message).
    code: Option<ErrorCode>,
    message: String,
    /// For a 401 or 403: which server refused, and which token was sent.
    credentials: Option<String>,
}

impl Refused {
    /// The refusal `body` says, with `status`, from the server in use of `connection`.
    pub(crate) fn new(
        status: reqwest::StatusCode,
        body: &[u8],
        connection: &Connection,
    ) -> Refused {
        let (code, message) = match serde_json::from_slice::<ErrorBody>(body) {
            Ok(ErrorBody { error }) => (error.code, error.message),
            Err(_) => (None, String::from_utf8_lossy(body).into_owned()),
        };
        // Who sent it matters to a 401 or 403, except to a refusal of what a statement does
        // (SQL is read-only for everyone, whatever the token).
        let credentials = match (status.as_u16(), &code) {
            (403, Some(ErrorCode::ReadOnly)) => None,
            (401, _) => Some(connection.refused(false)),
            (403, _) => Some(connection.refused(true)),
            _ => None,
        };
        Refused {
            status,
            code,
            message,
            credentials,
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (message, status) = (&self.message, self.status);
        match &self.credentials {
            Some(credentials) => write!(f, "{message} (HTTP {status}; {credentials})"),
            None => write!(f, "{message} (HTTP {status})"),
        }
    }
}

impl std::error::Error for Refused {}

/// A client of the server's HTTP API: each call answers the type `perch_control::api` says
/// the route answers, or [`Refused`].
pub(crate) struct Api {
    connection: Connection,
}

/// Makes a request from the HTTP client and a server's base URL.
type Build<'a> = &'a dyn Fn(&reqwest::blocking::Client, &str) -> reqwest::blocking::RequestBuilder;

impl Api {
    /// A client of the server (or the leader among the servers) that `server` and the config
    /// resolve to.
    pub(crate) fn new(server: &ServerArg, config_file: Option<&ConfigFile>) -> Result<Api> {
        let config = server.resolve(config_file)?;
        let connection = Connection::new(config, Some(std::time::Duration::from_secs(30)))?;
        Ok(Api { connection })
    }

    /// Sends the request `build` makes for the server in use (see [`Connection::send`]); an
    /// answer other than a success is [`Refused`].
    fn send(&self, build: Build<'_>) -> Result<reqwest::blocking::Response> {
        let response = self.connection.send(build)?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let body = response.bytes().unwrap_or_default();
        Err(Refused::new(status, &body, &self.connection).into())
    }

    /// The answer to the request `build` makes (`what` names it in errors), read as a `T`.
    fn answer<T: DeserializeOwned>(&self, build: Build<'_>, what: &str) -> Result<T> {
        let body = self.send(build)?.bytes()?;
        serde_json::from_slice(&body).with_context(|| {
            format!(
                "the server's answer to {what} is not what this perch expects; is the server another version of perch?"
            )
        })
    }

    /// GET `path`.
    pub(crate) fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.answer(
            &|client, server| client.get(format!("{server}{path}")),
            &format!("GET {path}"),
        )
    }

    /// GET `path` with `query`'s pairs, encoded.
    pub(crate) fn get_query<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T> {
        // Each server's URL, with the query.
        let mut urls = Vec::new();
        for server in &self.connection.config.servers {
            let mut url = reqwest::Url::parse(&format!("{server}{path}"))
                .with_context(|| format!("{server}{path} is not a URL"))?;
            url.query_pairs_mut()
                .extend_pairs(query.iter().map(|(k, v)| (k, v)));
            urls.push((server.as_str(), url));
        }
        self.answer(
            &|client, server| {
                let url = urls
                    .iter()
                    .find(|(s, _)| *s == server)
                    .map(|(_, u)| u.clone());
                client.get(url.expect("the server is one of the configured ones"))
            },
            &format!("GET {path}"),
        )
    }

    /// DELETE `path`.
    pub(crate) fn delete<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.answer(
            &|client, server| client.delete(format!("{server}{path}")),
            &format!("DELETE {path}"),
        )
    }

    /// POST `body`, as JSON, to `path`.
    pub(crate) fn post<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Result<T> {
        self.answer(
            &|client, server| client.post(format!("{server}{path}")).json(body),
            &format!("POST {path}"),
        )
    }
}

/// `$USER`, else (with `of_uid`) the name of the effective uid: a shell without `USER` (root
/// in a container, cron, a service) still submits as who it is, not as the server's `nobody`.
fn login_name(of_uid: bool) -> Option<String> {
    std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty())
        .or_else(|| {
            of_uid
                .then(|| {
                    nix::unistd::User::from_uid(nix::unistd::geteuid())
                        .ok()
                        .flatten()
                })
                .flatten()
                .map(|u| u.name)
        })
}

/// Seconds from `90`, `90s`, `30m`, `2h`, `1d` or `HH:MM:SS` / `MM:SS`.
pub fn parse_duration(text: &str) -> Result<u64> {
    let bad = || anyhow::anyhow!("time limit {text:?}: use seconds, 90s, 30m, 2h, 1d or HH:MM:SS");
    if text.contains(':') {
        let parts: Vec<u64> = text
            .split(':')
            .map(|p| p.parse().map_err(|_| bad()))
            .collect::<Result<_>>()?;
        return match parts.as_slice() {
            [m, s] => Ok(m * 60 + s),
            [h, m, s] => Ok(h * 3600 + m * 60 + s),
            _ => Err(bad()),
        };
    }
    let (number, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = number.parse().map_err(|_| bad())?;
    let factor = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(factor).ok_or_else(bad)
}

/// The server's answer to a request made from a `--file`, in the file's terms: a malformed
/// request's message speaks of a "JSON body" and of positions in the JSON perch sent, neither
/// of which the user wrote.
fn in_file_terms(e: &anyhow::Error, file: &std::path::Path) -> String {
    const PREFIX: &str = "Failed to deserialize the JSON body into the target type: ";
    let message = e.to_string();
    let malformed = e
        .downcast_ref::<Refused>()
        .is_some_and(|r| r.code == Some(ErrorCode::MalformedRequest));
    let Some((_, rest)) = message.split_once(PREFIX).filter(|_| malformed) else {
        return format!("{}: {message}", file.display());
    };
    let rest = match rest.find(" at line ") {
        Some(at) => &rest[..at],
        None => rest,
    };
    format!("{}: {rest}; fix that key in the file", file.display())
}

pub fn submit(args: SubmitArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    // The request stays JSON as the file has it, rather than a `JobRequest`: the server checks
    // every key (naming it, in the file's terms, when it is wrong), fills in the defaults, and
    // takes the keys of its own version, which this build's `JobRequest` may not know; the
    // flags only replace keys.
    let mut request: serde_json::Map<String, Value> = match &args.file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            // The body of POST /v1/jobs as it is (a JSON object), or the same keys in TOML.
            if text.trim_start().starts_with('{') {
                serde_json::from_str(&text).with_context(|| {
                    format!(
                        "parsing {} as a JSON object (the body of POST /v1/jobs)",
                        path.display()
                    )
                })?
            } else {
                let table: toml::Table = toml::from_str(&text).with_context(|| {
                    format!(
                        "parsing {} as TOML (or give the JSON object POST /v1/jobs takes)",
                        path.display()
                    )
                })?;
                serde_json::to_value(table)?
                    .as_object()
                    .cloned()
                    .unwrap_or_default()
            }
        }
        None => serde_json::Map::new(),
    };
    let mut set = |key: &str, value: Value| {
        request.insert(key.to_owned(), value);
    };
    if !args.command.is_empty() {
        set("command", args.command.clone().into());
    }
    if let Some(v) = args.gpus {
        set("gpus_per_node", v.into());
    }
    if let Some(v) = args.nodes {
        set("nodes", v.into());
    }
    if let Some(profile) = &args.gpu_profile {
        if args.gpus.is_some_and(|g| g != 1) || args.nodes.is_some_and(|n| n != 1) {
            anyhow::bail!(
                "--gpu-profile {profile} runs on one MIG instance of one GPU: drop --gpus and --nodes (or set them to 1), or drop --gpu-profile for whole GPUs"
            );
        }
        set("gpu_profile", profile.clone().into());
    }
    if let (Some(fraction), Some(memory_gb)) = (args.gpu_fraction, args.gpu_memory_gb) {
        set(
            "gpu_share",
            serde_json::json!({"fraction": fraction, "memory_gb": memory_gb}),
        );
    }
    if let Some(v) = args.cpus {
        set("cpus", v.into());
    }
    if let Some(v) = args.mem {
        set("memory_mb", v.into());
    }
    if let Some(v) = &args.time {
        set("time_limit_secs", parse_duration(v)?.into());
    }
    if let Some(v) = &args.name {
        set("name", v.clone().into());
    }
    if let Some(v) = &args.account {
        set("account", v.clone().into());
    }
    if let Some(v) = &args.qos {
        set("qos", v.clone().into());
    }
    if let Some(v) = &args.gpu_model {
        set("gpu_model", v.clone().into());
    }
    if args.preemptible {
        set("preemptible", true.into());
    }
    if let Some(v) = args.max_requeues {
        set("max_requeues", v.into());
    }
    if let Some(v) = &args.signal {
        set("checkpoint_signal", v.clone().into());
    }
    if let Some(v) = args.grace {
        set("grace_secs", v.into());
    }
    if let Some(v) = &args.sim_profile {
        set("sim_profile", v.clone().into());
    }
    if let Some(v) = args.array {
        set("array", v.into());
    }
    if args.hold_until_fits {
        set("hold_until_fits", true.into());
    }
    if !args.after_ok.is_empty() {
        set("after_ok", args.after_ok.clone().into());
    }
    if !args.after_any.is_empty() {
        set("after_any", args.after_any.clone().into());
    }
    if !args.after_not_ok.is_empty() {
        set("after_not_ok", args.after_not_ok.clone().into());
    }
    if let Some(v) = &args.workdir {
        // As sbatch --chdir: a relative directory is the one under where you submit.
        let dir = std::path::Path::new(v);
        let dir = if dir.is_absolute() {
            dir.to_path_buf()
        } else {
            std::env::current_dir()
                .context("reading the current directory, to make --workdir absolute")?
                .join(dir)
        };
        set("workdir", dir.to_string_lossy().into_owned().into());
    }
    if !args.env.is_empty() {
        let mut env = BTreeMap::new();
        for kv in &args.env {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--env {kv:?}: use KEY=VALUE"))?;
            env.insert(k, v);
        }
        set("env", serde_json::to_value(env)?);
    }
    if !request.contains_key("command") {
        bail!("give the command after --, e.g. perch submit --gpus 1 -- python train.py");
    }
    if !args.no_provenance && !request.contains_key("provenance") {
        let dir = std::env::current_dir().context("reading the current directory")?;
        let command: Vec<String> = request
            .get("command")
            .and_then(|c| serde_json::from_value(c.clone()).ok())
            .unwrap_or_default();
        let p = super::provenance::collect(&dir, &command, args.provenance_python);
        request.insert("provenance".to_owned(), serde_json::to_value(&p)?);
    }
    let api = Api::new(&args.server, config_file)?;
    // `--user` wins, then the file's `user =`, then `$USER`; with a token the server knows
    // who submits, so without any of them it is left to the server. The server decides
    // whether the caller may submit as that user (operators may; others only as themselves).
    if let Some(v) = args.user.clone() {
        request.insert("user".to_owned(), v.into());
    } else if !request.contains_key("user")
        && let Some(v) = login_name(api.connection.config.token.is_none())
    {
        request.insert("user".to_owned(), v.into());
    }
    let submitted: Submitted = match (api.post("/v1/jobs", &request), &args.file) {
        (Err(e), Some(file)) => bail!("{}", in_file_terms(&e, file)),
        (result, _) => result?,
    };
    let id = submitted.job.id;
    match (submitted.array_jobs.first(), submitted.array_jobs.last()) {
        (Some(first), Some(last)) => {
            println!("Submitted array job {id} (tasks {first}-{last})")
        }
        _ => println!("Submitted job {id}"),
    }
    if let Some(warning) = &submitted.warning {
        eprintln!("warning: {warning}");
    }
    Ok(())
}

/// A `--gpu-profile` value: a MIG profile `<n>g.<m>gb`.
fn mig_profile(text: &str) -> std::result::Result<String, String> {
    match perch_model::control::mig_profile_slices(text) {
        Some(_) => Ok(text.to_owned()),
        None => Err(format!(
            "{text:?} is not a MIG profile: use the form <n>g.<m>gb with n from 1 to 7, as `nvidia-smi mig -lgip` and `perch nodes` list them (e.g. 3g.40gb)"
        )),
    }
}

/// The GPUs a request holds: `nodes x gpus_per_node`, its fraction of one GPU, or its MIG
/// profile.
fn gpu_count(request: &JobRequest) -> String {
    if let Some(profile) = &request.gpu_profile {
        return profile.clone();
    }
    match &request.gpu_share {
        Some(share) => format!("{:.2}", share.fraction),
        None => (u64::from(request.nodes) * u64::from(request.gpus_per_node)).to_string(),
    }
}

fn gpus_of(job: &JobRecord) -> String {
    if job.placement.is_empty() {
        return "-".into();
    }
    job.placement
        .iter()
        .map(|p| {
            let gpus: Vec<String> = p.gpus.iter().map(u32::to_string).collect();
            format!("{}[{}]", p.node, gpus.join(","))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn elapsed(job: &JobRecord) -> String {
    let Some(start) = job.start_ms else {
        return "-".into();
    };
    let end = job.end_ms.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(start, |d| d.as_millis() as i64)
    });
    let s = (end - start).max(0) / 1000;
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

pub(crate) fn print_table(header: &[&str], rows: Vec<Vec<String>>) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        line(row);
    }
}

/// `v` as a cell or field: `-` for none.
fn or_dash(v: Option<impl std::fmt::Display>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// `v` as JSON text: a command line as the JSON array it is, a number as JSON writes it
/// (`10.0`, where Rust's `{}` writes `10`).
fn json_text(v: &impl Serialize) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// Jobs the server returns in one page at most (its `MAX_PAGE`).
const MAX_PAGE: usize = 10_000;

pub fn jobs(args: JobsArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    // The server filters: a running job older than the last `--limit` jobs that ended is
    // still listed.
    let state = match (&args.state, args.all) {
        (Some(state), _) => Some(state.as_str()),
        (None, false) => Some("pending,running"),
        (None, true) => None,
    };
    let mut query = Vec::new();
    for (k, v) in [
        ("state", state),
        ("user", args.user.as_deref()),
        ("account", args.account.as_deref()),
    ] {
        if let Some(v) = v {
            query.push((k, v.to_owned()));
        }
    }
    let api = Api::new(&args.server, config_file)?;
    let (mut listed, mut before) = (Vec::new(), None::<u64>);
    let more = loop {
        let want = (args.limit - listed.len()).min(MAX_PAGE);
        if want == 0 {
            break before.is_some();
        }
        let mut page_query = query.clone();
        page_query.push(("limit", want.to_string()));
        if let Some(before) = before {
            page_query.push(("before", before.to_string()));
        }
        let page: JobsPage<'static> = api.get_query("/v1/jobs", &page_query)?;
        listed.extend(page.jobs);
        before = page.next_before;
        if before.is_none() {
            break false;
        }
    };
    if more {
        eprintln!("the newest {} shown; more with --limit", listed.len());
    }
    let rows = listed
        .iter()
        .map(|view| {
            let (j, r) = (&*view.record, &view.record.request);
            let pending = j.state == JobState::Pending;
            vec![
                j.id.to_string(),
                or_dash(r.name.as_deref()),
                or_dash(r.user.as_deref()),
                or_dash(r.account.as_deref()),
                j.state.as_str().to_owned(),
                gpu_count(r),
                // A requeued job keeps its last run's start and placement: pending, it runs
                // nowhere and for no time.
                if pending { "-".into() } else { elapsed(j) },
                if pending { "-".into() } else { gpus_of(j) },
                or_dash(j.reason.as_deref()),
            ]
        })
        .collect();
    print_table(
        &[
            "JOBID",
            "NAME",
            "USER",
            "ACCOUNT",
            "STATE",
            "GPUS",
            "TIME",
            "NODES[GPUS]",
            "REASON",
        ],
        rows,
    );
    Ok(())
}

pub fn show(args: ShowArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    if args.provenance {
        let record: perch_control::provenance::ProvenanceRecord =
            Api::new(&args.server, config_file)?
                .get(&format!("/v1/jobs/{}/provenance", args.id))?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&record)?);
        } else {
            super::provenance::print(&record);
        }
        return Ok(());
    }
    let view: JobView<'static> =
        Api::new(&args.server, config_file)?.get(&format!("/v1/jobs/{}", args.id))?;
    let (j, r) = (&*view.record, &view.record.request);
    println!(
        "JobId={} Name={} User={} Account={}",
        j.id,
        or_dash(r.name.as_deref()),
        or_dash(r.user.as_deref()),
        or_dash(r.account.as_deref())
    );
    if let Some(task) = &j.array {
        // Slurm's ArrayJobId and ArrayTaskId.
        println!("   ArrayJobId={} ArrayTaskId={}", task.job_id, task.task_id);
    }
    println!(
        "   State={} Reason={} ExitCode={}",
        j.state.as_str(),
        or_dash(j.reason.as_deref()),
        or_dash(j.exit_code)
    );
    let pending = j.state == JobState::Pending;
    if pending {
        let at = view
            .estimate
            .as_ref()
            .and_then(|e| e.estimated_start.as_deref());
        println!("   StartTime={} (estimated)", start_of(at));
    }
    println!("   Command={}", json_text(&r.command));
    println!(
        "   Nodes={} GPUsPerNode={} TimeLimit={}s QOS={} Preemptible={} MaxRequeues={}",
        r.nodes,
        r.gpus_per_node,
        r.time_limit_secs,
        or_dash(r.qos.as_deref()),
        r.preemptible,
        r.max_requeues
    );
    println!(
        "   Attempts={} Requeues={} Preemptions={} Elapsed={}",
        j.attempts,
        j.requeues,
        j.preemptions,
        elapsed(j)
    );
    if let Some(share) = &r.gpu_share {
        println!(
            "   GpuShare={} of a GPU, {} GiB of its memory",
            json_text(&share.fraction),
            json_text(&share.memory_gb)
        );
    }
    if let Some(profile) = &r.gpu_profile {
        println!("   GpuProfile={profile} (one MIG instance)");
    }
    if r.cpus.is_some() || r.memory_mb.is_some() {
        println!(
            "   CPUs={} MemoryMiB={}",
            or_dash(r.cpus),
            or_dash(r.memory_mb)
        );
    }
    if pending && !j.placement.is_empty() {
        println!("   Placement=- (last run: {})", gpus_of(j));
    } else {
        println!("   Placement={}", gpus_of(j));
    }
    if j.placement.len() > 1 {
        // A job on several nodes: how far each rank got (rank = position in the placement).
        let each: Vec<String> = j
            .placement
            .iter()
            .enumerate()
            .map(|(rank, p)| {
                let state = match p.exit_code {
                    Some(code) => format!("exited {code}"),
                    None if j.state == JobState::Running => "running".into(),
                    None => "stopped".into(),
                };
                format!("{rank}:{}={state}", p.node)
            })
            .collect();
        println!("   Ranks={}", each.join(" "));
    }
    if let Some(gpus) = &view.gpus_now {
        println!("   GPUs now:");
        for g in gpus {
            let util = g
                .utilization_gpu_pct
                .map_or("-".into(), |u| format!("{u:.0}%"));
            let mem = g.memory_used_bytes.map_or("-".into(), |m| {
                format!("{:.1} GiB", m as f64 / f64::from(1u32 << 30))
            });
            let sim = if g.simulated == Some(true) {
                " (simulated)"
            } else {
                ""
            };
            println!("     {}[{}] util {util} mem {mem}{sim}", g.node, g.gpu);
        }
    }
    if let Some(Some(u)) = &view.usage {
        let hours = |v: Option<f64>| v.map_or("-".into(), |s| format!("{:.2}", s / 3600.0));
        let num = |v: Option<f64>, unit: &str| v.map_or("-".into(), |x| format!("{x:.1}{unit}"));
        // Money to the cent: a 45 s job on a $0.95 GPU-hour read 0.0 before.
        let money = |v: Option<f64>| v.map_or("-".into(), |x| format!("{x:.2}"));
        // Two windows, each named: allocation runs to now; what telemetry says (and the
        // efficiency and idle cost worked out from it) covers the job up to AccountedUntil.
        println!(
            "   Usage: GPUHoursAllocated={} CostAllocated={} (to now)",
            hours(u.gpu_seconds_allocated),
            money(u.cost_allocated),
        );
        println!(
            "   Accounted until {}: GPUHoursAccounted={} GPUHoursUsed={} Efficiency={} EnergyKWh={} CostAccounted={} CostUsed={} IdleCost={}",
            or_dash(u.accounted_until.as_deref()),
            hours(u.gpu_seconds_accounted),
            hours(u.gpu_seconds_used),
            num(u.efficiency.map(|e| 100.0 * e), "%"),
            u.energy_joules
                .map_or("-".into(), |e| format!("{:.3}", e / 3.6e6)),
            money(u.cost_accounted),
            money(u.cost_used),
            money(u.idle_cost),
        );
        if let Some(note) = &u.note {
            println!("   Note: {note}");
        }
    }
    println!("   Timeline:");
    for t in &j.timeline {
        let at = (t.time_ms - j.submit_ms) as f64 / 1000.0;
        println!("     +{at:>8.1}s  {}", t.event);
    }
    Ok(())
}

/// Cancels in one request (`POST /v1/jobs/cancel`), then says what became of each job: one
/// line a job for a few, a count and the ids for many. Fails if a named job was not found,
/// was not the caller's or had ended: the others are cancelled all the same.
pub fn cancel(args: CancelArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    /// `POST /v1/jobs/cancel`'s body: only what was given. (The server's own type reads
    /// `state` as a `JobState`; a name that is none is the server's to refuse.)
    #[derive(Serialize)]
    struct CancelBody<'a> {
        #[serde(skip_serializing_if = "<[u64]>::is_empty")]
        ids: &'a [u64],
        #[serde(skip_serializing_if = "Option::is_none")]
        array: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        user: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        account: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        name: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        state: Option<&'a str>,
    }
    let api = Api::new(&args.server, config_file)?;
    let body = CancelBody {
        ids: &args.ids,
        array: args.array,
        user: args.user.as_deref(),
        account: args.account.as_deref(),
        name: args.name.as_deref(),
        state: args.state.as_deref(),
    };
    let out: CancelAnswer = api.post("/v1/jobs/cancel", &body)?;
    let cancelled = &out.cancelled;
    if cancelled.len() <= 20 {
        for id in cancelled {
            println!("job {id}: cancelled");
        }
    } else {
        println!(
            "cancelled {} jobs: {}",
            cancelled.len(),
            id_ranges(cancelled)
        );
    }
    let mut failed = 0;
    for ended in &out.already_ended {
        eprintln!("job {}: already ended ({})", ended.id, ended.state);
        failed += 1;
    }
    for id in &out.not_found {
        eprintln!("job {id}: no job {id}; `perch jobs --all` lists them");
        failed += 1;
    }
    for job in &out.forbidden {
        eprintln!(
            "job {}: belongs to {}; only its owner or an operator may cancel it",
            job.id, job.user
        );
        failed += 1;
    }
    if args.ids.is_empty() {
        if cancelled.is_empty() && failed == 0 {
            eprintln!("no unfinished job matched; `perch jobs` lists yours");
        }
        // Filters name no ended job: one that ended while the cancel ran is not a failure.
        return Ok(());
    }
    if failed > 0 {
        bail!("{failed} of {} jobs not cancelled", args.ids.len());
    }
    Ok(())
}

/// Ids as ranges: `3-7, 9, 12-40`, at most ten ranges (then how many more ids).
fn id_ranges(ids: &[u64]) -> String {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &id in ids {
        match ranges.last_mut() {
            Some((_, end)) if id == *end + 1 => *end = id,
            _ => ranges.push((id, id)),
        }
    }
    let mut text: Vec<String> = ranges
        .iter()
        .take(10)
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    if ranges.len() > 10 {
        let shown: u64 = ranges[..10].iter().map(|(a, b)| b - a + 1).sum();
        text.push(format!("and {} more", ids.len() as u64 - shown));
    }
    text.join(", ")
}

pub fn logs(args: LogsArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    use std::io::Write;
    let api = Api::new(&args.server, config_file)?;
    let stream = if args.stderr { "stderr" } else { "stdout" };
    let mut offset = 0u64;
    let mut shown: Option<u32> = None;
    // When output last arrived: a follower of an ended job whose node stopped sending gives up.
    let mut progress = std::time::Instant::now();
    // Whether a pending job was reported (once): its output is empty because it has not run.
    let mut said_pending = false;
    loop {
        let attempt = args
            .attempt
            .map(|a| format!("&attempt={a}"))
            .unwrap_or_default();
        let response = api.send(&|client, server| {
            client.get(format!(
                "{server}/v1/jobs/{}/logs?stream={stream}&offset={offset}&rank={}{attempt}",
                args.id, args.rank
            ))
        })?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let finished = header("x-perch-job-finished").is_some_and(|v| v == "true");
        // The server answers a page at a time: more is stored past this one.
        let more = header("x-perch-log-more").is_some_and(|v| v == "true");
        // What the job's node has yet to send (it ships output on after the job ends).
        let pending = header("x-perch-log-pending")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let now_attempt = header("x-perch-attempt").and_then(|v| v.parse::<u32>().ok());
        if let (Some(before), Some(now)) = (shown, now_attempt)
            && now != before
        {
            // Requeued: the new attempt's output starts over.
            eprintln!("--- job {} attempt {now} ---", args.id);
            shown = Some(now);
            offset = 0;
            continue;
        }
        shown = shown.or(now_attempt);
        let data = response.bytes()?;
        offset += data.len() as u64;
        std::io::stdout().write_all(&data)?;
        std::io::stdout().flush()?;
        if !data.is_empty() {
            progress = std::time::Instant::now();
        }
        if more {
            continue;
        }
        if offset == 0 && !finished && !said_pending {
            let job: Value = api.get(&format!("/v1/jobs/{}", args.id))?;
            if job["state"] == "pending" {
                let reason = job["reason"]
                    .as_str()
                    .map_or(String::new(), |r| format!(" ({r})"));
                if !args.follow {
                    bail!(
                        "job {} is pending{reason}: it has no output yet; `perch logs -f {}` waits for it to start and follows it",
                        args.id,
                        args.id
                    );
                }
                eprintln!(
                    "perch: job {} is pending{reason}; waiting for it to start",
                    args.id
                );
                said_pending = true;
            }
        }
        let stalled = progress.elapsed() > LOGS_STALL;
        if !args.follow || (finished && data.is_empty() && (pending == 0 || stalled)) {
            if finished && pending > 0 {
                eprintln!(
                    "perch: {pending} more bytes of job {}'s output are still to come from its node{}",
                    args.id,
                    if args.follow {
                        format!(" (none arrived for {} s)", LOGS_STALL.as_secs())
                    } else {
                        format!("; `perch logs -f {}` waits for them", args.id)
                    }
                );
            }
            if offset == 0 && finished && !args.stderr {
                // A job that failed before printing anything said why on standard error.
                let probe = api.send(&|client, server| {
                    client.get(format!(
                        "{server}/v1/jobs/{}/logs?stream=stderr&offset=0&rank={}{attempt}",
                        args.id, args.rank
                    ))
                })?;
                if !probe.bytes()?.is_empty() {
                    eprintln!(
                        "perch: job {} wrote nothing to standard output; its standard error: perch logs {} --stderr",
                        args.id, args.id
                    );
                }
            }
            return Ok(());
        }
        if data.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }
}

/// How long `perch logs -f` waits for the rest of an ended job's output before it gives up.
const LOGS_STALL: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug, Args)]
pub struct QueueArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Each job's estimated start (like `squeue --start`): the backfill reservation's time for
    /// the job GPUs are reserved for, else the earliest time enough GPUs stay free for its
    /// time limit if running jobs run to theirs.
    #[arg(long)]
    start: bool,
    /// Show the first this many in line (at most 10,000).
    #[arg(long, default_value_t = 1000)]
    limit: usize,
}

pub fn queue(args: QueueArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    let query = [
        ("start", args.start.to_string()),
        ("limit", args.limit.to_string()),
    ];
    let q: QueueView<'static> =
        Api::new(&args.server, config_file)?.get_query("/v1/queue", &query)?;
    let shown = q.queue.len();
    if q.total > shown {
        eprintln!(
            "the first {shown} of {} pending jobs shown; more with --limit",
            q.total
        );
    }
    let rows = q
        .queue
        .iter()
        .map(|e| {
            let (j, r) = (&*e.job.record, &e.job.record.request);
            let mut row = vec![
                or_dash(e.position),
                j.id.to_string(),
                or_dash(r.user.as_deref()),
                or_dash(r.account.as_deref()),
                gpu_count(r),
                e.priority
                    .map_or_else(|| "-".to_owned(), |p| format!("{p:.3}")),
            ];
            if args.start {
                let at = e
                    .estimate
                    .as_ref()
                    .and_then(|e| e.estimated_start.as_deref());
                row.push(start_of(at));
            }
            row.push(or_dash(j.reason.as_deref()));
            row
        })
        .collect();
    let mut headers = vec!["POS", "JOBID", "USER", "ACCOUNT", "GPUS", "PRIORITY"];
    if args.start {
        headers.push("START");
    }
    headers.push("REASON");
    print_table(&headers, rows);
    Ok(())
}

/// An estimated start as `squeue --start` shows it: the time, or N/A.
fn start_of(at: Option<&str>) -> String {
    at.unwrap_or("N/A").to_owned()
}

pub fn nodes(args: ListArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    let list: NodeList = Api::new(&args.server, config_file)?.get("/v1/nodes")?;
    let rows = list
        .nodes
        .iter()
        .map(|n| {
            let jobs: Vec<String> = n.jobs.iter().map(u64::to_string).collect();
            vec![
                n.name.clone(),
                n.state.clone(),
                format!("{}/{}", n.allocated_gpus, n.gpus),
                n.gpu_model.clone(),
                n.rack.clone(),
                nvlink_of(&n.nvlink_islands, n.gpu_sharing),
                if jobs.is_empty() {
                    "-".into()
                } else {
                    jobs.join(",")
                },
            ]
        })
        .collect();
    print_table(
        &[
            "NODE",
            "STATE",
            "ALLOC/GPUS",
            "MODEL",
            "RACK",
            "NVLINK",
            "JOBS",
        ],
        rows,
    );
    // MIG instances, for the nodes that have any: which profile, which job holds each.
    for n in &list.nodes {
        for g in &n.gpu_status {
            for m in &g.mig_instances {
                let holder = match (m.job, &m.user) {
                    (Some(job), Some(user)) => format!("job {job} ({user})"),
                    (Some(job), None) => format!("job {job}"),
                    _ => "free".into(),
                };
                println!(
                    "MIG {} GPU {} {} {} {holder}",
                    n.name, g.index, m.profile, m.uuid
                );
            }
        }
    }
    Ok(())
}

/// NVLink islands as `0-3|4-7`, then `shared` when the node takes shared jobs.
fn nvlink_of(islands: &[Vec<u32>], sharing: bool) -> String {
    let groups: Vec<String> = islands
        .iter()
        .map(|ids| match (ids.first(), ids.last()) {
            (Some(&a), Some(&b))
                if ids.len() > 1
                    && b.checked_sub(a).map(|d| u64::from(d) + 1) == Some(ids.len() as u64) =>
            {
                format!("{a}-{b}")
            }
            _ => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        })
        .collect();
    let mut text = if groups.is_empty() {
        "-".to_owned()
    } else {
        groups.join("|")
    };
    if sharing {
        text.push_str(" shared");
    }
    text
}

#[derive(Debug, Args)]
pub struct DrainArgs {
    #[command(flatten)]
    node: NodeArgs,
    /// Why: the nodes table's reason, the web view and the node_drained event say it.
    #[arg(long)]
    reason: Option<String>,
}

pub fn drain(args: DrainArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    let body = serde_json::json!({ "reason": args.reason });
    node_state(args.node, "drain", &body, config_file)
}

pub fn set_drained(args: NodeArgs, drain: bool, config_file: Option<&ConfigFile>) -> Result<()> {
    // Resume's body is `null`: the route takes none.
    let verb = if drain { "drain" } else { "resume" };
    node_state(args, verb, &serde_json::Value::Null, config_file)
}

fn node_state(
    args: NodeArgs,
    verb: &str,
    body: &serde_json::Value,
    config_file: Option<&ConfigFile>,
) -> Result<()> {
    // The name goes into the URL's path: one that is no node's name (`../jobs/5/cancel`) would
    // send the request to another endpoint.
    perch_model::NodeId::new(args.node.as_str())
        .map_err(|e| anyhow::anyhow!("{e}; `perch nodes` lists the nodes"))?;
    let r: NodeStateChange = Api::new(&args.server, config_file)?
        .post(&format!("/v1/nodes/{}/{verb}", args.node), body)?;
    println!("node {}: {}", args.node, r.state.as_str());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{nvlink_of, parse_duration};

    #[test]
    fn nvlink_islands_read_compactly() {
        assert_eq!(
            nvlink_of(&[vec![0, 1, 2, 3], vec![4, 5, 6, 7]], false),
            "0-3|4-7"
        );
        assert_eq!(nvlink_of(&[vec![0, 2], vec![1]], true), "0,2|1 shared");
        assert_eq!(nvlink_of(&[vec![3, 1]], false), "3,1", "out of order");
        assert_eq!(nvlink_of(&[], false), "-");
    }

    #[test]
    fn durations() {
        for (text, secs) in [
            ("90", 90),
            ("90s", 90),
            ("30m", 1800),
            ("2h", 7200),
            ("1d", 86_400),
            ("1:30", 90),
            ("1:00:00", 3600),
        ] {
            assert_eq!(parse_duration(text).expect(text), secs, "{text}");
        }
        for bad in ["", "h", "1w", "1:2:3:4", "-5", "1.5h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
