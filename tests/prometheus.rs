//! A real Prometheus (Debian's package) scrapes `perch demo`; then every query of every
//! dashboard panel and template variable runs against Prometheus's HTTP API and must succeed
//! with data. This is what a user's Grafana would do.

mod common;

use common::{Perch, wait_for};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

struct Prometheus {
    child: std::process::Child,
    url: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Starts Prometheus with the shipped `dashboards/prometheus.yml` (its scrape job is named
/// `perch`, so a perch label called `job` would come out as `exported_job`), pointed at
/// `target` and scraping every second.
fn start_prometheus(dir: &Path, target: &str) -> Prometheus {
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards/prometheus.yml"),
    )
    .expect("read dashboards/prometheus.yml");
    assert!(shipped.contains("127.0.0.1:7300") && shipped.contains("scrape_interval: 15s"));
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        shipped
            .replace("127.0.0.1:7300", target)
            .replace("scrape_interval: 15s", "scrape_interval: 1s"),
    )
    .expect("write config");
    let port = free_port();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("log"))
        .spawn()
        .expect("start prometheus (install Debian's prometheus package; scripts/test.sh does)");
    Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
    }
}

fn query(prom: &Prometheus, expr: &str) -> serde_json::Value {
    let r = reqwest::blocking::Client::new()
        .get(format!("{}/api/v1/query", prom.url))
        .query(&[("query", expr)])
        .send()
        .expect("query prometheus");
    r.json().expect("json")
}

/// Dashboard variables as Grafana would fill them: the value picked in `chosen`, else "All"
/// for multi-value variables; the first node for single-node dashboards, and a 10-minute
/// dashboard range.
fn fill(expr: &str, node: &str, chosen: &BTreeMap<String, String>) -> String {
    let mut expr = expr
        .replace("=\"$node\"", &format!("=\"{node}\""))
        .replace("$__range", "10m");
    for var in ["node", "gpu", "job", "user", "account", "alertname"] {
        let value = chosen.get(var).map_or(".*", String::as_str);
        expr = expr.replace(&format!("=~\"${var}\""), &format!("=~\"{value}\""));
    }
    expr
}

#[test]
fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    let dir = tempfile::tempdir().expect("tempdir");
    let perch = Perch::start(
        &dir.path().join("perch"),
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
    let target = perch.url.trim_start_matches("http://").to_owned();
    let prom = start_prometheus(dir.path(), &target);
    // Enough scrapes for rate() over any window: three, a second apart.
    wait_for("three successful scrapes", || {
        let r = reqwest::blocking::get(format!(
            "{}/api/v1/query?query=count_over_time(up[1m])",
            prom.url
        ))
        .ok()?;
        let v: serde_json::Value = r.json().ok()?;
        let n: f64 = v["data"]["result"][0]["value"][1].as_str()?.parse().ok()?;
        let up = query(&prom, "up")["data"]["result"][0]["value"][1] == "1";
        (n >= 3.0 && up).then_some(())
    });
    let node = "sim-node-000";
    // Every job perch knows: one Prometheus still shows may have ended since.
    let jobs = || -> Vec<String> {
        perch.get("/v1/jobs?limit=10000")["jobs"]
            .as_array()
            .expect("jobs")
            .iter()
            .map(|j| j["id"].to_string())
            .collect()
    };
    let mut checked = 0;
    let dashboards = Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards");
    for entry in std::fs::read_dir(&dashboards).expect("dashboards/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        // Variables picked on this dashboard, as a user selecting one job would.
        let mut chosen = BTreeMap::new();
        for var in d["templating"]["list"].as_array().expect("templating") {
            let Some(q) = var["query"]["query"].as_str() else {
                continue;
            };
            let Some(inner) = q
                .strip_prefix("label_values(")
                .and_then(|r| r.strip_suffix(')'))
            else {
                continue;
            };
            let (metric, label) = inner.rsplit_once(',').expect("label_values(metric, label)");
            let result = query(
                &prom,
                &format!(
                    "count by ({}) ({})",
                    label.trim(),
                    fill(metric.trim(), node, &BTreeMap::new())
                ),
            );
            assert_eq!(
                result["status"],
                "success",
                "{}: variable {q}: {result}",
                path.display()
            );
            assert!(
                !result["data"]["result"]
                    .as_array()
                    .expect("result")
                    .is_empty(),
                "{}: variable {q} has no values",
                path.display()
            );
            let values: Vec<String> = result["data"]["result"]
                .as_array()
                .expect("result")
                .iter()
                .filter_map(|r| r["metric"][label.trim()].as_str().map(str::to_owned))
                .collect();
            let name = var["name"].as_str().expect("variable name");
            if name == "job" {
                // With a `job` label, Prometheus offered its scrape job, `perch`.
                let known = jobs();
                for v in &values {
                    assert!(
                        known.contains(v),
                        "{}: variable {q} offers {v:?}, not one of perch's jobs {known:?}",
                        path.display()
                    );
                }
                // Pick one that pushed its own metrics, as a user looking at a training run
                // would: then every panel of the dashboard has something to show.
                let pushed = query(&prom, "count by (job_id) (perch_job_metric)");
                let pick = pushed["data"]["result"]
                    .as_array()
                    .expect("result")
                    .iter()
                    .filter_map(|r| r["metric"]["job_id"].as_str())
                    .find(|j| values.iter().any(|v| v == j))
                    .unwrap_or_else(|| {
                        panic!("no job offered by {q} ({values:?}) pushed metrics: {pushed}")
                    });
                chosen.insert(name.to_owned(), pick.to_owned());
            }
            checked += 1;
        }
        for panel in d["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = fill(target["expr"].as_str().expect("expr"), node, &chosen);
                let result = query(&prom, &expr);
                assert_eq!(
                    result["status"],
                    "success",
                    "{}: panel {:?}: {expr}: {result}",
                    path.display(),
                    panel["title"]
                );
                let series = result["data"]["result"].as_array().expect("result");
                assert!(
                    !series.is_empty(),
                    "{}: panel {:?}: {expr} returned nothing",
                    path.display(),
                    panel["title"]
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 20, "checked only {checked} queries");
}
