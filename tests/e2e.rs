//! End-to-end: `perch up` and `perch demo` as a new user runs them, SQL from the CLI, the
//! Prometheus endpoint checked by the real promtool, and bad input answered with 4xx.

mod common;

use common::{Perch, marked_batch, wait_for};
use std::process::Command;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A newcomer's config for `perch up` that moves only the server's data directory: the local
/// agent's spool and its jobs' directories go there too, not into `./perch-data` of whatever
/// directory perch was started from (under systemd, `/`). A file that names the agent's own
/// directory keeps it.
#[test]
fn up_keeps_the_local_agents_data_where_the_config_puts_the_servers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let started_in = dir.path().join("cwd");
    std::fs::create_dir_all(&started_in).expect("cwd");
    let up = |config: &str, wait_in: &std::path::Path| {
        let file = dir.path().join("perch.toml");
        std::fs::write(&file, config).expect("config");
        let mut child = Command::new(common::PERCH)
            .args(["up", "--config", file.to_str().expect("utf-8")])
            .args(["--simulate-gpus", "1", "--interval-ms", "200"])
            .current_dir(&started_in)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("perch up");
        let spool = wait_in.join("agent-spool");
        let start = std::time::Instant::now();
        while !spool.is_dir() && start.elapsed() < common::PATIENCE {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(spool.is_dir(), "no agent spool in {}", wait_in.display());
    };
    let data = dir.path().join("data");
    up(
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\npg_listen = \"\"\ndata_dir = {:?}\n",
            data.to_str().expect("utf-8")
        ),
        &data,
    );
    assert!(
        !started_in.join("perch-data").exists(),
        "the agent wrote into the directory perch up was started from"
    );
    let agent = dir.path().join("agent");
    up(
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\npg_listen = \"\"\ndata_dir = {:?}\n\
             [agent]\ndata_dir = {:?}\n",
            data.to_str().expect("utf-8"),
            agent.to_str().expect("utf-8")
        ),
        &agent,
    );
    assert!(!started_in.join("perch-data").exists());
}

#[test]
fn up_with_simulated_gpus_counts_gpu_and_host_rows_from_the_cli() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &["up", "--simulate-gpus", "2", "--interval-ms", "200"],
    );
    wait_for("GPU and host rows", || {
        let gpu = perch.scalar("SELECT count(*) FROM gpu_samples");
        let host = perch.scalar("SELECT count(*) FROM host_samples");
        (gpu > 0 && host > 0).then_some(())
    });
    let out = perch.sql_cli(
        "SELECT count(*) AS gpu_rows FROM gpu_samples WHERE simulated",
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let table = stdout(&out);
    assert!(
        table.contains("gpu_rows") && table.contains("+--"),
        "aligned table: {table}"
    );
    // Simulated GPUs are labelled as such in SQL, on /metrics and in what perch printed.
    assert_eq!(
        perch.scalar(
            "SELECT count(*) FROM gpu_samples WHERE NOT simulated OR model NOT LIKE '%Simulated%'"
        ),
        0
    );
    let metrics = reqwest::blocking::get(format!("{}/metrics", perch.url))
        .expect("metrics")
        .text()
        .expect("text");
    assert!(
        metrics.contains("perch_gpu_info{") && metrics.contains("simulated=\"true\""),
        "{metrics}"
    );
    let banner = perch.log();
    assert!(
        banner.contains("Simulating 2 GPUs") || banner.contains("SIMULATED GPUs"),
        "{banner}"
    );
    // Colour codes were written into redirected logs.
    assert!(
        !banner.contains('\x1b'),
        "ANSI escapes in a log file:\n{banner}"
    );
}

/// The README says `perch up` on a machine without GPUs adds four simulated ones;
/// it recorded no GPU samples at all.
#[test]
fn up_without_gpus_simulates_four_labelled_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(dir.path(), &["up", "--nvml", "off", "--interval-ms", "200"]);
    wait_for("GPU rows", || {
        (perch.scalar("SELECT count(DISTINCT gpu) FROM gpu_samples") == 4).then_some(())
    });
    assert_eq!(
        perch.scalar("SELECT count(*) FROM gpu_samples WHERE NOT simulated"),
        0
    );
    let log = perch.log();
    assert!(log.contains("Simulating 4 GPUs instead"), "{log}");
}

#[test]
fn metrics_endpoint_passes_promtool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &[
            "demo",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--interval-ms",
            "200",
        ],
    );
    wait_for("GPU series", || {
        let text = reqwest::blocking::get(format!("{}/metrics", perch.url))
            .ok()?
            .text()
            .ok()?;
        text.contains("perch_gpu_power_watts").then_some(())
    });
    let _ = perch.sql("SELECT 1"); // so the SQL series exist too
    let script = format!("curl -s {}/metrics | promtool check metrics", perch.url);
    let out = Command::new("sh")
        .args(["-c", &script])
        .output()
        .expect("run sh");
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool (install Debian's prometheus package) reported: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Every exported family is documented.
    let text = reqwest::blocking::get(format!("{}/metrics", perch.url))
        .expect("metrics")
        .text()
        .expect("text");
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md"))
        .expect("docs/metrics.md");
    for family in text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
    {
        assert!(
            doc.contains(&format!("| `{family}` |")),
            "docs/metrics.md does not document {family}"
        );
    }
    // Prometheus itself asks for OpenMetrics and gets it.
    let om = reqwest::blocking::Client::new()
        .get(format!("{}/metrics", perch.url))
        .header("accept", "application/openmetrics-text;version=1.0.0")
        .send()
        .expect("metrics");
    assert!(
        om.headers()["content-type"]
            .to_str()
            .expect("ascii")
            .starts_with("application/openmetrics-text")
    );
    assert!(om.text().expect("text").ends_with("# EOF\n"));
}

/// `perch agent --metrics-listen` serves the node's latest round under the server's names and
/// labels (one catalogue renders both), in a text promtool accepts; an address that is not
/// one is refused at startup, naming the setting.
#[test]
fn an_agents_node_local_metrics_are_the_servers_series_for_that_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(dir.path(), "[server]\npg_listen = \"\"\n", &[]);
    let port = common::free_port();
    let local = format!("http://127.0.0.1:{port}/metrics");
    let listen = format!("127.0.0.1:{port}");
    let _agent = common::Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        2,
        None,
        &["--interval-ms", "200", "--metrics-listen", &listen],
    );
    let get = |url: &str| reqwest::blocking::get(url).ok()?.text().ok();
    let series = |text: &str, prefix: &str| -> std::collections::BTreeSet<String> {
        text.lines()
            .filter(|l| l.starts_with(prefix) && l.contains("node=\"gpu-a\""))
            .filter_map(|l| l.rsplit_once(' ').map(|(series, _)| series.to_owned()))
            .collect()
    };
    let agent_text = wait_for("the agent's GPU series", || {
        get(&local).filter(|t| t.contains("perch_gpu_power_watts{"))
    });
    let server_text = wait_for("the server's GPU series of gpu-a", || {
        get(&format!("{}/metrics", perch.url))
            .filter(|t| t.contains("perch_gpu_power_watts{node=\"gpu-a\""))
    });
    for prefix in [
        "perch_gpu_",
        "perch_node_cpu",
        "perch_node_memory",
        "perch_node_load",
    ] {
        let mine = series(&agent_text, prefix);
        assert!(!mine.is_empty(), "the agent exports no {prefix} series");
        let theirs = series(&server_text, prefix);
        let missing: Vec<_> = mine.difference(&theirs).collect();
        assert!(
            missing.is_empty(),
            "not on the server's /metrics: {missing:?}"
        );
    }
    assert!(agent_text.contains("simulated=\"true\""));
    let out = Command::new("sh")
        .args(["-c", &format!("curl -s {local} | promtool check metrics")])
        .output()
        .expect("run sh");
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool on the agent's /metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = Command::new(common::PERCH)
        .args(["agent", "--nvml", "off", "--metrics-listen", "localhost"])
        .output()
        .expect("run perch agent");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success()
            && err.contains("agent.metrics_listen")
            && err.contains("127.0.0.1:9400"),
        "{err}"
    );
}

#[test]
fn demo_simulates_a_labelled_cluster() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        dir.path(),
        &[
            "demo",
            "--nodes",
            "3",
            "--gpus-per-node",
            "2",
            "--interval-ms",
            "200",
        ],
    );
    wait_for("three nodes of GPUs, hosts and NICs", || {
        let gpus = perch
            .scalar("SELECT count(DISTINCT node || '/' || CAST(gpu AS VARCHAR)) FROM gpu_samples");
        let hosts = perch.scalar("SELECT count(DISTINCT node) FROM host_samples");
        let nics = perch.scalar("SELECT count(DISTINCT node) FROM nic_samples");
        (gpus == 6 && hosts == 3 && nics == 3).then_some(())
    });
    for table in ["gpu_samples", "host_samples", "nic_samples"] {
        assert_eq!(
            perch.scalar(&format!("SELECT count(*) FROM {table} WHERE NOT simulated")),
            0,
            "{table}"
        );
    }
    assert!(perch.log().contains("SIMULATED cluster"));
    // `perch nodes` came in no particular order.
    let nodes = perch.get("/v1/nodes");
    let names: Vec<&str> = nodes["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter_map(|n| n["name"].as_str())
        .collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert!(names.len() == 3 && names == sorted, "{names:?}");
    // The banner promised a queue that never formed.
    wait_for("two jobs in the demo's queue", || {
        let q = perch.get("/v1/queue");
        (q["queue"].as_array().map_or(0, Vec::len) >= 2).then_some(())
    });
    // Each simulated node reports its own jobs only: the demo's agents shared one job
    // registry, so every node sampled every job (a thousand nodes wrote a thousand times the
    // job samples and choked the server).
    wait_for("job samples from every node", || {
        (perch.scalar("SELECT count(DISTINCT node) FROM job_samples") == 3).then_some(())
    });
    let misplaced = perch.sql(
        "SELECT s.job, s.node FROM job_samples s JOIN job_allocations a \
         ON s.job = CAST(a.job AS VARCHAR) AND a.end_time IS NULL \
         WHERE s.node <> a.node LIMIT 5",
    );
    assert!(
        misplaced.is_empty(),
        "job samples from nodes not running the job: {misplaced:?}"
    );
}

#[test]
fn bad_input_gets_a_4xx_that_says_what_to_change_and_the_server_keeps_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(dir.path(), &["server"]);
    let client = reqwest::blocking::Client::new();
    let ingest = format!("{}/v1/ingest", perch.url);
    let check_ingest = |body: &str, status: u16, says: &str| {
        let r = client
            .post(&ingest)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .expect("send");
        assert_eq!(r.status().as_u16(), status, "{body}");
        let json: serde_json::Value = r.json().expect("JSON error body");
        let message = json["error"]["message"].as_str().expect("error.message");
        assert!(message.contains(says), "{body}: {message}");
    };
    check_ingest("", 400, "EOF");
    check_ingest("{\"node\": \"n\"", 400, "EOF while parsing");
    check_ingest("[1, 2]", 400, "not a valid telemetry batch");
    check_ingest(
        "{\"node\":\"n\",\"seq\":1,\"gpuz\":[]}",
        400,
        "unknown field `gpuz`",
    );
    check_ingest(
        "{\"node\":\"a b\",\"seq\":1,\"hosts\":[{\"time_ms\":1800000000000,\"simulated\":false}]}",
        400,
        "node name",
    );
    check_ingest("{\"node\":\"n\",\"seq\":1}", 400, "no samples");
    let mut bad_util = marked_batch("n", 1);
    bad_util["gpus"][0]["utilization_gpu_pct"] = 250.0.into();
    check_ingest(&bad_util.to_string(), 400, "gpus[0].utilization_gpu_pct");
    let mut seconds = marked_batch("n", 1);
    seconds["gpus"][0]["time_ms"] = 1_700_000_000.into();
    check_ingest(&seconds.to_string(), 400, "milliseconds");
    let r = client
        .post(&ingest)
        .header("content-encoding", "zstd")
        .body("not zstd")
        .send()
        .expect("send");
    assert_eq!(r.status().as_u16(), 400);
    let huge = " ".repeat((64 << 20) + 1);
    let r = client.post(&ingest).body(huge).send().expect("send");
    assert_eq!(r.status().as_u16(), 413, "body over the limit");

    let sql = format!("{}/v1/sql", perch.url);
    let check_sql = |query: &str, status: u16, says: &str| {
        let r = client
            .post(&sql)
            .json(&serde_json::json!({"sql": query}))
            .send()
            .expect("send");
        assert_eq!(r.status().as_u16(), status, "{query}");
        let json: serde_json::Value = r.json().expect("JSON error body");
        let message = json["error"]["message"].as_str().expect("error.message");
        assert!(message.contains(says), "{query}: {message}");
    };
    check_sql("SELEC 1", 400, "Expected");
    check_sql("SELECT nope FROM gpu_samples", 400, "Valid fields are");
    check_sql("SELECT * FROM gpus", 400, "the tables are account_usage, ");
    check_sql("", 400, "empty");
    check_sql("SELECT 1; SELECT 2", 400, "single SQL statement");
    check_sql("CREATE TABLE t AS SELECT 1", 403, "read-only");
    check_sql(
        "INSERT INTO gpu_samples SELECT * FROM gpu_samples",
        403,
        "read-only",
    );
    check_sql("COPY (SELECT 1) TO '/tmp/perch-copy.csv'", 403, "read-only");
    check_sql("SET datafusion.execution.batch_size = 1", 403, "read-only");
    check_sql("SELECT * FROM '/etc/passwd'", 400, "not found");
    check_sql(
        "CREATE EXTERNAL TABLE p STORED AS CSV LOCATION '/etc/passwd'",
        403,
        "read-only",
    );
    let r = client
        .post(&sql)
        .header("content-type", "application/json")
        .body("{\"sql\": 1}")
        .send()
        .expect("send");
    assert_eq!(r.status().as_u16(), 400);
    let r = client
        .post(format!("{sql}?format=xml"))
        .body("SELECT 1")
        .send()
        .expect("send");
    assert_eq!(r.status().as_u16(), 400);

    // What the web framework answers itself (a path segment that is not a number, a query
    // string that does not parse, a method a route lacks) had a plain-text body, or none:
    // every API error is the same JSON now, with a code.
    let framework = |method: reqwest::Method, path: &str, status: u16, code: &str, says: &str| {
        let r = client
            .request(method.clone(), format!("{}{path}", perch.url))
            .send()
            .expect("send");
        assert_eq!(r.status().as_u16(), status, "{method} {path}");
        let allow = r.headers().get("allow").cloned();
        let json: serde_json::Value = r.json().expect("JSON error body");
        assert_eq!(json["error"]["code"], code, "{method} {path}: {json}");
        let message = json["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{method} {path}: {message}");
        allow
    };
    framework(
        reqwest::Method::GET,
        "/v1/jobs/abc",
        400,
        "bad_parameters",
        "abc",
    );
    framework(
        reqwest::Method::GET,
        "/v1/queue?start=yes",
        400,
        "bad_parameters",
        "start",
    );
    let allow = framework(
        reqwest::Method::GET,
        "/v1/sql",
        405,
        "method_not_allowed",
        "/v1/sql does not take GET; the Allow header lists the methods it takes",
    );
    assert_eq!(allow.as_ref().and_then(|a| a.to_str().ok()), Some("POST"));
    let allow = framework(
        reqwest::Method::DELETE,
        "/v1/jobs",
        405,
        "method_not_allowed",
        "/v1/jobs does not take DELETE",
    );
    let allow = allow
        .as_ref()
        .and_then(|a| a.to_str().ok())
        .unwrap_or_default();
    assert!(allow.contains("GET") && allow.contains("POST"), "{allow}");

    // Still serving, and a good batch still lands.
    assert!(
        reqwest::blocking::get(format!("{}/healthz", perch.url))
            .expect("healthz")
            .status()
            .is_success()
    );
    let r = client
        .post(&ingest)
        .json(&marked_batch("n", 1))
        .send()
        .expect("send");
    assert!(r.status().is_success());
    assert_eq!(perch.scalar("SELECT count(*) FROM gpu_samples"), 1);
}

#[test]
fn sql_answers_in_every_format_and_cuts_long_results_with_a_note() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("perch.toml");
    std::fs::write(&config, "[query]\nmax_rows = 5\n").expect("write config");
    let perch = Perch::start(
        &dir.path().join("data"),
        &["server", "--config", config.to_str().expect("utf-8")],
    );
    let client = reqwest::blocking::Client::new();
    for seq in 1..=8 {
        client
            .post(format!("{}/v1/ingest", perch.url))
            .json(&marked_batch("n", seq))
            .send()
            .expect("ingest");
    }
    let q = "SELECT sm_clock_mhz FROM gpu_samples ORDER BY 1";
    let json: serde_json::Value = client
        .post(format!("{}/v1/sql", perch.url))
        .json(&serde_json::json!({"sql": q}))
        .send()
        .expect("sql")
        .json()
        .expect("json");
    assert_eq!(json["row_count"], 5);
    assert_eq!(json["truncated"], true);
    assert!(
        json["note"]
            .as_str()
            .expect("note")
            .contains("cut at 5 rows")
    );
    assert_eq!(json["rows"][0]["sm_clock_mhz"], 1);
    assert_eq!(json["columns"][0]["name"], "sm_clock_mhz");

    let csv = perch.sql_cli(q, &["--format", "csv"]);
    assert_eq!(stdout(&csv), "sm_clock_mhz\n1\n2\n3\n4\n5\n");
    assert!(String::from_utf8_lossy(&csv.stderr).contains("cut at the server's row limit"));
    let table = perch.sql_cli("SELECT count(*) AS n FROM gpu_samples", &[]);
    assert!(stdout(&table).contains("| 8 |"), "{}", stdout(&table));
    let explain = perch.sql_cli("SELECT count(*) FROM gpu_samples", &["--explain"]);
    assert!(
        stdout(&explain).contains("physical_plan"),
        "{}",
        stdout(&explain)
    );
    let failed = perch.sql_cli("SELECT nope FROM gpu_samples", &[]);
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("No field named nope"));
}

/// When a node's telemetry stopped while its agent kept syncing, `perch nodes` said
/// `up`, `perch_node_up` said 0, nothing alerted and nothing was logged. Here a second writer
/// under the node's name takes its sequence far ahead, so the real agent's batches are
/// answered as duplicates: the server warns, the node is `no_telemetry` in both views, and
/// `NodeTelemetryStopped` fires.
#[test]
fn a_node_whose_samples_stop_while_its_agent_syncs_is_flagged_everywhere() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        "[server]\nnode_stale_after_secs = 2\npg_listen = \"\"\n[alerts]\nevaluation_interval = \"1s\"\n",
        &[],
    );
    let _agent = common::Agent::start(
        &perch.url,
        "gpu-a",
        &dir.path().join("agent"),
        1,
        None,
        &["--interval-ms", "200"],
    );
    let state = |perch: &Perch| -> Option<String> {
        let nodes = perch.get("/v1/nodes");
        let n = nodes["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == "gpu-a")?;
        n["state"].as_str().map(str::to_owned)
    };
    wait_for("gpu-a up", || {
        (state(&perch).as_deref() == Some("up")).then_some(())
    });
    let client = reqwest::blocking::Client::new();
    let mut ahead = marked_batch("gpu-a", 1);
    ahead["seq"] = (u64::MAX / 2).into();
    let r = client
        .post(format!("{}/v1/ingest", perch.url))
        .json(&ahead)
        .send()
        .expect("ingest");
    assert_eq!(r.status(), 200);
    wait_for("gpu-a no_telemetry", || {
        (state(&perch).as_deref() == Some("no_telemetry")).then_some(())
    });
    let metrics = client
        .get(format!("{}/metrics", perch.url))
        .send()
        .expect("metrics")
        .text()
        .expect("text");
    for line in [
        "perch_node_up{node=\"gpu-a\"} 0",
        "perch_node_state{node=\"gpu-a\",state=\"no_telemetry\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing");
    }
    let alert = wait_for("NodeTelemetryStopped to fire", || {
        let a = perch.get("/v1/alerts");
        a["alerts"]
            .as_array()?
            .iter()
            .find(|a| {
                a["labels"]["alertname"] == "NodeTelemetryStopped" && a["labels"]["node"] == "gpu-a"
            })
            .cloned()
    });
    assert_eq!(alert["state"], "firing", "{alert}");
    let log = perch.log();
    assert!(log.contains("answered as duplicates"), "{log}");
}

/// `perch simulate` ran for a minute without a word. Each policy's replay is
/// announced and timed on stderr; the table stays alone on stdout.
#[test]
fn simulate_reports_progress_on_stderr_and_the_table_on_stdout() {
    let trace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scheduler/tests/data/philly-300.csv");
    let out = Command::new(common::PERCH)
        .args(["simulate", "--trace", trace.to_str().expect("utf-8")])
        .args([
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--policy",
            "fifo,perch",
        ])
        .output()
        .expect("run perch simulate");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("[1/2] replaying") && err.contains("[2/2] perch done in"),
        "{err}"
    );
    assert!(
        !stdout(&out).contains("replaying"),
        "progress stays off stdout"
    );
}

/// Sizes no node or cluster can have, as a careless user types them: each is refused naming
/// the flag or key and its range, never a panic or an abort. Found by trying them on the
/// release binary: `perch simulate --nodes 0` panicked (index out of bounds), `--nodes
/// 4294967295` and `perch agent --simulate-gpus 4294967295` aborted asking for hundreds of GB,
/// and `perch up --simulate-gpus 65` ran with every sync of its node answered `500 internal`.
#[test]
fn impossible_cluster_sizes_are_refused_naming_what_to_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("two.csv");
    std::fs::write(&trace, "submit,duration,gpus,user\n0,10,1,a\n5,100,2,b\n").expect("trace");
    let trace = trace.to_str().expect("utf-8");
    let refused = |args: &[&str], says: &str| {
        let out = Command::new(common::PERCH)
            .args(args)
            .output()
            .expect("run perch");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("memory allocation"),
            "{err}"
        );
    };
    for (flag, value, range) in [
        ("--nodes", "0", "1..=100000"),
        ("--nodes", "4294967295", "1..=100000"),
        ("--gpus-per-node", "0", "1..=64"),
        ("--gpus-per-node", "65", "1..=64"),
        ("--nodes-per-rack", "0", "1..=100000"),
    ] {
        refused(
            &[
                "simulate", "--trace", trace, "--policy", "fifo", flag, value,
            ],
            &format!("for '{flag} <"),
        );
        refused(
            &[
                "simulate", "--trace", trace, "--policy", "fifo", flag, value,
            ],
            range,
        );
    }
    let agent_dir = dir.path().join("agent");
    let agent_dir = agent_dir.to_str().expect("utf-8");
    let agent_refused = |extra: &[&str], says: &str| {
        let mut args = vec![
            "agent",
            "--server",
            "http://127.0.0.1:9",
            "--data-dir",
            agent_dir,
        ];
        args.extend_from_slice(extra);
        refused(&args, says);
    };
    agent_refused(&["--simulate-gpus", "65"], "0..=64");
    agent_refused(&["--simulate-gpus", "4294967295"], "0..=64");
    let config = dir.path().join("big.toml");
    std::fs::write(&config, "[agent]\nsimulate_gpus = 4294967295\n").expect("config");
    let config = config.to_str().expect("utf-8");
    agent_refused(
        &["--config", config],
        "agent.simulate_gpus: must be 0 (none) to 64",
    );
    refused(
        &["up", "--config", config, "--data-dir", agent_dir],
        "agent.simulate_gpus: must be 0 (none) to 64",
    );

    // An agent that says its node has more GPUs than a node may have (an older or a patched
    // one) is told so, field and limit, with a 400: not a 500 on every sync.
    let perch = Perch::start(&dir.path().join("server"), &["server"]);
    let http = reqwest::blocking::Client::new();
    let sync = |gpus: u32| {
        http.post(format!("{}/v1/agent/sync", perch.url))
            .json(&serde_json::json!({"node": "big", "gpus": gpus, "gpu_model": "H100"}))
            .send()
            .expect("sync")
    };
    let answer = sync(65);
    assert_eq!(answer.status().as_u16(), 400);
    let body: serde_json::Value = answer.json().expect("json");
    assert_eq!(body["error"]["code"], "invalid_sync", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("field `gpus`")
            && message.contains("64")
            && message.contains("simulate_gpus"),
        "{message}"
    );
    assert!(sync(8).status().is_success(), "a node of 8 GPUs joins");
    let nodes = perch.get("/v1/nodes").to_string();
    assert!(nodes.contains("\"big\""), "{nodes}");
}

/// The simulator as a user would drive it: a synthetic trace generated by the CLI replays on a
/// heterogeneous cluster file; a misspelt column and a column that is not modelled are named on
/// stderr; a job pinned to a model the fleet lacks is refused naming the job and the models;
/// and the quick scorecard prints one line per case and the targets line.
#[test]
fn simulate_takes_cluster_files_warns_about_columns_and_scores_the_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = |args: &[&str]| {
        Command::new(common::PERCH)
            .args(args)
            .output()
            .expect("run perch simulate")
    };
    let trace = dir.path().join("frac.csv");
    let cluster = dir.path().join("fleet.csv");
    let out = perch(&["simulate", "--generate", "fractional", "--seed", "4"]);
    assert!(out.status.success());
    std::fs::write(&trace, &out.stdout).expect("write trace");
    let out = perch(&["simulate", "--generate", "mixed-cluster"]);
    std::fs::write(&cluster, &out.stdout).expect("write cluster");
    let (t, c) = (
        trace.to_str().expect("utf-8"),
        cluster.to_str().expect("utf-8"),
    );
    let out = perch(&[
        "simulate",
        "--trace",
        t,
        "--cluster",
        c,
        "--policy",
        "backfill,perch",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let table = stdout(&out);
    assert!(
        table.contains("cluster: 12 nodes, 56 GPUs (T4 8, A10 16, A100 32)"),
        "{table}"
    );
    assert!(table.contains("wasteGPUh") && table.lines().any(|l| l.starts_with("perch ")));
    // --cluster and --nodes are one or the other.
    let out = perch(&["simulate", "--trace", t, "--cluster", c, "--nodes", "4"]);
    assert!(!out.status.success());
    // A careless cost: refused naming the flag, never an overflow.
    for (flag, value) in [
        ("--restart-delay-s", "9223372036854775807"),
        ("--checkpoint-every-min", "-5"),
    ] {
        let arg = format!("{flag}={value}");
        let out = perch(&["simulate", "--trace", t, "--cluster", c, &arg]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value}");
        assert!(err.contains(flag) && !err.contains("panicked"), "{err}");
    }

    let odd = dir.path().join("odd.csv");
    std::fs::write(
        &odd,
        "submit,duration,gpus,user,preemtible,cpus\n0,600,1,al,false,4\n10,600,0.5,bo,,2\n",
    )
    .expect("write");
    let out = perch(&[
        "simulate",
        "--trace",
        odd.to_str().expect("utf-8"),
        "--nodes",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning:") && err.contains("preemtible") && err.contains("cpus"),
        "{err}"
    );

    let pinned = dir.path().join("pinned.csv");
    std::fs::write(
        &pinned,
        "submit,duration,gpus,user,gpu_model\n0,600,2,al,H100\n",
    )
    .expect("write");
    let out = perch(&[
        "simulate",
        "--trace",
        pinned.to_str().expect("utf-8"),
        "--cluster",
        c,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("job 0") && err.contains("`H100`") && err.contains("A10, A100, T4"),
        "{err}"
    );

    let out = perch(&["simulate", "--suite", "--quick"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let card = stdout(&out);
    // Two sizes, in each perch variant's table, for the tuning and the held-out seed.
    assert_eq!(
        card.lines().filter(|l| l.starts_with("gangs ")).count(),
        8,
        "{card}"
    );
    assert!(
        card.contains("perch meets, of ") && card.contains("perch-noquota meets, of "),
        "{card}"
    );
    // Each seed set with each way of declaring limits in its own section, with its verdicts.
    for section in [
        "== tuning seeds: what policy changes are measured on while they are made; time limits: uniform",
        "== tuning seeds: what policy changes are measured on while they are made; time limits: habits",
        "== held-out seeds: only ever scored, never used to choose a change; time limits: uniform",
        "== held-out seeds: only ever scored, never used to choose a change; time limits: habits",
    ] {
        assert!(card.contains(section), "{section} in {card}");
    }
    assert_eq!(
        card.matches("verdicts for perch-noquota").count(),
        4,
        "{card}"
    );
    assert_eq!(
        card.lines().filter(|l| l.starts_with("gangs/h ")).count(),
        8,
        "{card}"
    );
    assert!(
        err.contains("[64/64]") && err.contains("habits limits), 10 policies"),
        "{err}"
    );
    // --tuning: the held-out seeds are not replayed at all.
    let out = perch(&["simulate", "--suite", "--quick", "--tuning"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("[32/32]") && !err.contains("held-out"),
        "{err}"
    );
    assert!(!stdout(&out).contains("== held-out"));
}

/// A CPU-heavy query (a cross join of two generate_series) left health probes and
/// agent syncs unanswered for 36 s, and nodes were marked down. Queries execute on their own
/// runtime now: while two such queries run, the server keeps answering, and each query ends at
/// its timeout with a clear error.
#[test]
fn a_cpu_heavy_query_neither_starves_the_server_nor_outlives_its_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = common::server_with_config(
        dir.path(),
        "[server]\npg_listen = \"\"\n[query]\ntimeout_secs = 4.0\n",
        &[],
    );
    let heavy = "SELECT count(*) FROM generate_series(1, 200000) a, generate_series(1, 200000) b \
                 WHERE (a.value * b.value) % 7 = 3";
    let queries: Vec<_> = (0..2)
        .map(|_| {
            let url = perch.url.clone();
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                let r = reqwest::blocking::Client::builder()
                    .timeout(std::time::Duration::from_secs(60))
                    .build()
                    .expect("client")
                    .post(format!("{url}/v1/sql"))
                    .json(&serde_json::json!({"sql": heavy}))
                    .send()
                    .expect("send");
                (
                    r.status().as_u16(),
                    r.text().unwrap_or_default(),
                    started.elapsed(),
                )
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let mut slowest = std::time::Duration::ZERO;
    for _ in 0..10 {
        let started = std::time::Instant::now();
        let r = reqwest::blocking::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .expect("client")
            .get(format!("{}/healthz", perch.url))
            .send()
            .expect("healthz answered");
        assert!(r.status().is_success());
        slowest = slowest.max(started.elapsed());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // Generous for a loaded 2-core machine; it was 36 s.
    assert!(
        slowest < std::time::Duration::from_secs(3),
        "a health probe took {slowest:?}"
    );
    for q in queries {
        let (status, body, took) = q.join().expect("query thread");
        assert_eq!(status, 422, "{body}");
        assert!(
            body.contains("query_timeout") && body.contains("4 s limit"),
            "{body}"
        );
        assert!(
            took < std::time::Duration::from_secs(10),
            "answered after {took:?}"
        );
    }
}
