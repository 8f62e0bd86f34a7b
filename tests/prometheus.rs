//! A real Prometheus (Debian's package) scrapes `perch demo`; then every query of every
//! dashboard panel and template variable runs against Prometheus's HTTP API and must succeed
//! with data. This is what a user's Grafana would do.

mod common;

use common::{Perch, wait_for};
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

fn start_prometheus(dir: &Path, target: &str) -> Prometheus {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: perch\n    static_configs:\n      - targets: [\"{target}\"]\n"),
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

/// Dashboard variables as Grafana would fill them: "All" for multi-value variables, the first
/// node for single-node dashboards, and a 10-minute dashboard range.
fn fill(expr: &str, node: &str) -> String {
    let mut expr = expr
        .replace("=\"$node\"", &format!("=\"{node}\""))
        .replace("$__range", "10m");
    for var in ["node", "gpu", "job", "user", "account", "alertname"] {
        expr = expr.replace(&format!("=~\"${var}\""), "=~\".*\"");
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
    let mut checked = 0;
    let dashboards = Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards");
    for entry in std::fs::read_dir(&dashboards).expect("dashboards/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
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
                    fill(metric.trim(), node)
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
            checked += 1;
        }
        for panel in d["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = fill(target["expr"].as_str().expect("expr"), node);
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
