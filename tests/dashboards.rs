//! The Grafana dashboards in dashboards/ are valid: parseable JSON in Grafana's schema, unique
//! uids and panel ids, known panel types, the `${datasource}` variable everywhere, and only
//! metric names perch documents (docs/metrics.md). The Prometheus config passes promtool.

use std::collections::HashSet;
use std::path::Path;

const PANEL_TYPES: [&str; 8] = [
    "timeseries",
    "stat",
    "gauge",
    "heatmap",
    "table",
    "bargauge",
    "text",
    "piechart",
];

fn dashboards() -> Vec<(String, serde_json::Value)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("dashboards/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(&path).expect("read");
            let json =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((path.display().to_string(), json));
        }
    }
    assert!(out.len() >= 2, "expected the cluster and node dashboards");
    out
}

fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("perch_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

#[test]
fn dashboards_are_valid_and_use_documented_metrics() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"))
            .expect("docs/metrics.md");
    let mut uids = HashSet::new();
    for (file, d) in dashboards() {
        let uid = d["uid"]
            .as_str()
            .unwrap_or_else(|| panic!("{file}: no uid"));
        assert!(uids.insert(uid.to_owned()), "{file}: uid {uid} used twice");
        assert!(
            d["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
            "{file}: schemaVersion"
        );
        assert!(
            d["title"].is_string() && d["time"]["from"].is_string(),
            "{file}: title/time"
        );
        let vars = d["templating"]["list"].as_array().expect("templating.list");
        assert!(
            vars.iter().any(|v| v["type"] == "datasource"),
            "{file}: a datasource variable"
        );
        let mut ids = HashSet::new();
        for panel in d["panels"].as_array().expect("panels") {
            let title = panel["title"].as_str().unwrap_or("?");
            let ty = panel["type"].as_str().unwrap_or("");
            assert!(
                PANEL_TYPES.contains(&ty),
                "{file}: panel {title}: unknown type {ty}"
            );
            assert!(
                ids.insert(panel["id"].as_u64().expect("panel id")),
                "{file}: panel id repeated"
            );
            assert_eq!(
                panel["datasource"]["uid"], "${datasource}",
                "{file}: panel {title}"
            );
            for key in ["x", "y", "w", "h"] {
                assert!(
                    panel["gridPos"][key].is_u64(),
                    "{file}: panel {title}: gridPos.{key}"
                );
            }
            let targets = panel["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{file}: panel {title} has no query");
            for t in targets {
                let expr = t["expr"].as_str().expect("expr");
                let names = metric_names(expr);
                assert!(
                    !names.is_empty(),
                    "{file}: panel {title}: {expr} reads no perch metric"
                );
                for name in names {
                    let family = ["_bucket", "_sum", "_count"]
                        .iter()
                        .fold(name.as_str(), |n, s| n.strip_suffix(s).unwrap_or(n));
                    assert!(
                        doc.contains(&format!("| `{name}` |"))
                            || doc.contains(&format!("| `{family}` |")),
                        "{file}: panel {title}: {name} is not a documented perch metric"
                    );
                }
            }
        }
    }
}

#[test]
fn prometheus_config_passes_promtool() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards/prometheus.yml");
    let out = std::process::Command::new("promtool")
        .args(["check", "config"])
        .arg(&config)
        .output()
        .expect("promtool (install Debian's prometheus package; scripts/test.sh does)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
