//! Helpers for end-to-end tests: start the real `perch` binary on a temporary data directory
//! and an OS-chosen port, wait for readiness, and talk to it over HTTP like a user would.
#![allow(dead_code)]

pub mod standin;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

pub const PERCH: &str = env!("CARGO_BIN_EXE_perch");

/// Upper bound for anything a test waits on; only reached when something is broken.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// `perch` for a client command (sql, submit, jobs, ...), apart from the developer's own
/// settings: no `PERCH_SERVER`, `PERCH_TOKEN` or `PERCH_CONFIG`, and `XDG_CONFIG_HOME` pointing
/// at an empty directory, so no `~/.config/perch/config.toml` is read. Callers add their own.
pub fn client() -> Command {
    let no_user_config = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-user-config");
    let mut cmd = Command::new(PERCH);
    cmd.env_remove("PERCH_SERVER")
        .env_remove("PERCH_TOKEN")
        .env_remove("PERCH_CONFIG")
        .env("XDG_CONFIG_HOME", no_user_config);
    cmd
}

/// A running perch process, killed when dropped.
pub struct Perch {
    pub child: Child,
    pub data_dir: PathBuf,
    pub url: String,
    log: PathBuf,
}

impl Perch {
    /// Starts `perch <args> --data-dir <dir>` (plus `--listen 127.0.0.1:0` unless `args` has
    /// `--listen`) and waits until `/readyz` answers.
    pub fn start(data_dir: &Path, args: &[&str]) -> Perch {
        Self::start_with_env(data_dir, args, &[])
    }

    /// [`Perch::start`] with more environment variables.
    pub fn start_with_env(data_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Perch {
        Self::start_inner(data_dir, args, env, None)
    }

    /// [`Perch::start`] for a server that speaks TLS with a certificate `ca_pem` signed: its
    /// URL is `https://`, and readiness is asked over TLS trusting that CA.
    pub fn start_tls(data_dir: &Path, args: &[&str], ca_pem: &str) -> Perch {
        Self::start_inner(data_dir, args, &[], Some(ca_pem))
    }

    fn start_inner(
        data_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        ca_pem: Option<&str>,
    ) -> Perch {
        std::fs::create_dir_all(data_dir).expect("create data dir");
        let addr_file = data_dir.join("server.addr");
        let _ = std::fs::remove_file(&addr_file);
        let log = data_dir.join(format!("perch-{}.log", args[0]));
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("create log");
        let mut cmd = Command::new(PERCH);
        cmd.args(args).arg("--data-dir").arg(data_dir);
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        // The tests' users (alice, bob) do not exist on the machine: jobs run as the agent's.
        cmd.env("PERCH_RUN_AS_USER", "never");
        cmd.envs(env.iter().copied());
        let child = cmd
            .env(
                "PERCH_LOG",
                std::env::var("PERCH_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(log_file.try_clone().expect("clone log"))
            .stderr(log_file)
            .spawn()
            .expect("spawn perch");
        let mut perch = Perch {
            child,
            data_dir: data_dir.to_path_buf(),
            url: String::new(),
            log,
        };
        let addr = wait_for(
            &format!("{} to write {}", args[0], addr_file.display()),
            || {
                perch.assert_running();
                std::fs::read_to_string(&addr_file)
                    .ok()
                    .filter(|s| s.ends_with('\n'))
            },
        );
        let mut client = reqwest::blocking::Client::builder();
        let scheme = match ca_pem {
            Some(pem) => {
                client = client.add_root_certificate(
                    reqwest::Certificate::from_pem(pem.as_bytes()).expect("CA certificate"),
                );
                "https"
            }
            None => "http",
        };
        let client = client.build().expect("client");
        perch.url = format!("{scheme}://{}", addr.trim());
        let ready = format!("{}/readyz", perch.url);
        wait_for("readiness", || {
            perch.assert_running();
            client
                .get(&ready)
                .send()
                .ok()
                .filter(|r| r.status().is_success())
        });
        perch
    }

    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("perch exited early ({status}); log:\n{}", self.log());
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("wait");
    }

    /// SIGTERM, then wait for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("send SIGTERM");
        wait_for("perch to exit after SIGTERM", || {
            self.child.try_wait().ok().flatten()
        })
    }

    /// Runs `perch sql --server <url> <extra> <query>`.
    pub fn sql_cli(&self, query: &str, extra: &[&str]) -> Output {
        client()
            .args(["sql", "--server", &self.url])
            .args(extra)
            .arg(query)
            .output()
            .expect("run perch sql")
    }

    /// Runs a query over HTTP and returns the JSON rows. The client waits up to 180 s, past
    /// reqwest's default of 30: a statement at a planning bound (a 1,000-term sum, at
    /// `query.max_expression_depth`) took over 30 s to plan in a debug build beside another
    /// build on the same two cores; the server's `query.timeout_secs` decides what is too
    /// slow.
    pub fn sql(&self, query: &str) -> Vec<serde_json::Value> {
        let response = reqwest::blocking::Client::builder()
            .timeout(std::time::Duration::from_secs(180))
            .build()
            .expect("HTTP client")
            .post(format!("{}/v1/sql", self.url))
            .json(&serde_json::json!({"sql": query}))
            .send()
            .expect("POST /v1/sql");
        let status = response.status();
        let body: serde_json::Value = response.json().expect("JSON answer");
        assert!(status.is_success(), "{query}: {status} {body}");
        body["rows"].as_array().expect("rows").clone()
    }

    /// Runs the `perch` CLI against this server as `user`: (success, stdout, stderr).
    pub fn cli_as(&self, user: &str, args: &[&str]) -> (bool, String, String) {
        let out = client()
            .args(args)
            .env("PERCH_SERVER", &self.url)
            .env("USER", user)
            .output()
            .expect("run perch");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `GET <path>` as JSON.
    pub fn get(&self, path: &str) -> serde_json::Value {
        reqwest::blocking::get(format!("{}{path}", self.url))
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .json()
            .unwrap_or_else(|e| panic!("GET {path}: not JSON: {e}"))
    }

    /// Waits until `GET /v1/nodes` shows `n` nodes up.
    pub fn wait_nodes_up(&self, n: usize) {
        wait_for(&format!("{n} nodes up"), || {
            (nodes_up(&self.get("/v1/nodes")) == n).then_some(())
        });
    }

    /// One job as `GET /v1/jobs/{id}` shows it.
    pub fn job(&self, id: u64) -> serde_json::Value {
        self.get(&format!("/v1/jobs/{id}"))
    }

    /// A single integer from a query returning one row and one column.
    pub fn scalar(&self, query: &str) -> i64 {
        let rows = self.sql(query);
        let row = rows.first().and_then(|r| r.as_object()).expect("one row");
        row.values()
            .next()
            .and_then(serde_json::Value::as_i64)
            .unwrap_or_else(|| panic!("{query}: {row:?}"))
    }
}

impl Drop for Perch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How many nodes a `GET /v1/nodes` answer shows up with their agent synced. A node whose
/// telemetry arrived before its agent's first sync is listed up too, but the scheduler does not
/// know it yet (nor its rack): a test that placed a gang then saw it split across racks.
pub fn nodes_up(answer: &serde_json::Value) -> usize {
    answer["nodes"].as_array().map_or(0, |nodes| {
        nodes
            .iter()
            .filter(|n| n["state"] == "up" && !n["last_sync_secs_ago"].is_null())
            .count()
    })
}

/// Polls `f` until it returns `Some`, panicking with `what` after [`PATIENCE`].
pub fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of the first series of `name` in a Prometheus text exposition (`name` alone or
/// with labels), if it has one.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let value = if rest.starts_with('{') {
            rest.rsplit_once("} ")?.1
        } else {
            rest.strip_prefix(' ')?
        };
        value.split_whitespace().next()?.parse().ok()
    })
}

/// Waits until the server has answered `n` more syncs from `node`'s agent than when called,
/// as `GET /v1/nodes` (from `nodes`) shows them: each time the node's `last_sync_secs_ago`
/// drops, a new sync was answered. Tests use it where the thing they check could only go
/// wrong on a later sync (a stop ordered, an attempt requeued), instead of sleeping.
pub fn wait_syncs(node: &str, n: usize, mut nodes: impl FnMut() -> serde_json::Value) {
    let ago = |answer: &serde_json::Value| {
        answer["nodes"]
            .as_array()?
            .iter()
            .find(|x| x["name"] == node)?["last_sync_secs_ago"]
            .as_f64()
    };
    let mut last = ago(&nodes());
    let mut seen = 0;
    wait_for(&format!("{n} more syncs from {node}"), || {
        let now = ago(&nodes());
        if let (Some(before), Some(now)) = (last, now)
            && now < before
        {
            seen += 1;
        }
        last = now.or(last);
        (seen >= n).then_some(())
    });
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
}

/// One batch with one GPU sample whose `sm_clock_mhz` carries `seq`, so tests can find it.
pub fn marked_batch(node: &str, seq: u64) -> serde_json::Value {
    serde_json::json!({
        "node": node,
        "seq": seq,
        "gpus": [{
            "time_ms": now_ms(), "gpu": 0, "uuid": "GPU-TEST-0", "model": "Test GPU (simulated)",
            "simulated": true, "utilization_gpu_pct": 50.0, "sm_clock_mhz": seq
        }]
    })
}

/// A port that is free now, for a server that must come back on the same address after a
/// restart (agents keep its URL).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// `perch server <extra>` in `dir/server` with the config file `dir/perch.toml` holding
/// `config`.
pub fn server_with_config(dir: &Path, config: &str, extra: &[&str]) -> Perch {
    let file = dir.join("perch.toml");
    std::fs::write(&file, config).expect("config");
    let mut args = vec!["server", "--config", file.to_str().expect("utf-8")];
    args.extend_from_slice(extra);
    Perch::start(&dir.join("server"), &args)
}

/// The identity tests' tokens: alice and bob are users, ops an operator, and the agent's.
pub const ALICE: &str = "alice-token-0123456789";
pub const BOB: &str = "bob-token-0123456789ab";
pub const OPERATOR: &str = "operator-token-01234567";
pub const AGENT: &str = "agent-token-0123456789a";

/// A tokens file's entries for [`ALICE`], [`BOB`], [`OPERATOR`] and [`AGENT`], the agent's
/// bound to node `agent_node`.
pub fn role_tokens(agent_node: &str) -> String {
    format!(
        "[[tokens]]\ntoken = \"{ALICE}\"\nuser = \"alice\"\nrole = \"user\"\n\
         [[tokens]]\ntoken = \"{BOB}\"\nuser = \"bob\"\nrole = \"user\"\n\
         [[tokens]]\ntoken = \"{OPERATOR}\"\nuser = \"ops\"\nrole = \"operator\"\n\
         [[tokens]]\ntoken = \"{AGENT}\"\nuser = \"node-agent\"\nrole = \"agent\"\nnodes = [\"{agent_node}\"]\n"
    )
}

/// `perch server` in `dir/server` with a tokens file holding `tokens` (TOML `[[tokens]]`
/// entries) and no PostgreSQL listener.
pub fn server_with_tokens(dir: &Path, tokens: &str) -> Perch {
    let file = dir.join("tokens.toml");
    std::fs::write(&file, tokens).expect("tokens file");
    server_with_tokens_file(dir, &file)
}

/// `perch server` in `dir/server` reading the tokens file `file` (SIGHUP reads it again), with
/// no PostgreSQL listener.
pub fn server_with_tokens_file(dir: &Path, file: &Path) -> Perch {
    server_with_config(
        dir,
        &format!(
            "[server]\ntokens_file = \"{}\"\npg_listen = \"\"\n",
            file.display()
        ),
        &[],
    )
}

/// A `perch agent` with NVML off and `gpus` simulated GPUs; killed when dropped.
pub struct Agent(pub Child);

impl Agent {
    /// `extra` are more flags (e.g. `--interval-ms 100`); `token` goes in `PERCH_TOKEN`.
    pub fn start(
        server_url: &str,
        node: &str,
        data_dir: &Path,
        gpus: u32,
        token: Option<&str>,
        extra: &[&str],
    ) -> Agent {
        Self::start_with_env(server_url, node, data_dir, gpus, token, extra, &[])
    }

    /// [`Agent::start`] with more environment variables, set last (so they may replace
    /// `PERCH_RUN_AS_USER=never`).
    pub fn start_with_env(
        server_url: &str,
        node: &str,
        data_dir: &Path,
        gpus: u32,
        token: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        let mut cmd = Command::new(PERCH);
        cmd.args([
            "agent", "--server", server_url, "--node", node, "--nvml", "off",
        ])
        .args(["--simulate-gpus", &gpus.to_string()])
        .args(extra)
        .arg("--data-dir")
        .arg(data_dir)
        .env_remove("PERCH_TOKEN")
        .env("PERCH_RUN_AS_USER", "never")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
        if let Some(t) = token {
            cmd.env("PERCH_TOKEN", t);
        }
        cmd.envs(env.iter().copied());
        Agent(cmd.spawn().expect("spawn perch agent"))
    }

    pub fn is_running(&mut self) -> bool {
        self.0.try_wait().expect("agent status").is_none()
    }

    /// SIGKILL: the agent's jobs, in their own process groups, live on as orphans.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A job that appends `start`, then a `tick` every 100 ms (and `end` on its signal), each
/// line with its attempt, the time in nanoseconds and the job shell's pid, to `file`. Its `sleep 0.1` is the job's own pace, not a wait of the
/// test's.
pub fn attempt_script(file: &Path) -> String {
    let f = file.display();
    format!(
        "line() {{ echo \"$1 $PERCH_JOB_ATTEMPT $(date +%s%N) $$\" >> {f}; }}; \
         trap 'line end; exit 0' TERM; line start; \
         while :; do line tick; sleep 0.1; done"
    )
}

/// (attempt, first line's time, last line's time, lines) of each attempt in `file`, by start.
pub fn attempts(file: &Path) -> Vec<(u64, u128, u128, usize)> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let mut runs: Vec<(u64, u128, u128, usize)> = Vec::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let (Some(a), Some(t)) = (
            parts.get(1).and_then(|a| a.parse().ok()),
            parts.get(2).and_then(|t| t.parse().ok()),
        ) else {
            continue;
        };
        match runs.iter_mut().find(|r| r.0 == a) {
            Some(r) => {
                r.1 = r.1.min(t);
                r.2 = r.2.max(t);
                r.3 += 1;
            }
            None => runs.push((a, t, t, 1)),
        }
    }
    runs.sort_by_key(|r| r.1);
    runs
}

/// Asserts that no two attempts' lines overlap in time.
pub fn assert_one_at_a_time(file: &Path) {
    let runs = attempts(file);
    for w in runs.windows(2) {
        assert!(
            w[1].1 > w[0].2,
            "attempt {} started while attempt {} still ran: {runs:?}",
            w[1].0,
            w[0].0
        );
    }
}
