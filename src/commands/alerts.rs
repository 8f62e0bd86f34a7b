//! `perch alerts`: what fires and what perch did about it; silences; the remediation circuit
//! breaker. A client of `GET /v1/alerts`, `/v1/silences` and `/v1/alerts/breaker/reset`.

use super::jobs::{Api, ServerArg, parse_duration, print_table};
use crate::config::ConfigFile;
use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::{Value, json};

#[derive(Debug, Args)]
pub struct AlertsArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Also list resolved alerts and expired silences.
    #[arg(long)]
    all: bool,
    #[command(subcommand)]
    what: Option<What>,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Every configured rule, with its state (firing, pending, failing, ok), last evaluation,
    /// error and alerts per state.
    Rules,
    /// Silences: list them, or add or expire one (operators).
    Silence {
        #[command(subcommand)]
        what: Option<SilenceCmd>,
    },
    /// The remediation circuit breaker: show it, or reset it so automatic actions resume.
    Breaker {
        #[command(subcommand)]
        what: Option<BreakerCmd>,
    },
}

#[derive(Debug, Subcommand)]
enum SilenceCmd {
    /// Mute alerts whose labels match every matcher, e.g. `node=gpu-07` `alertname=~Xid.*`.
    Add {
        /// Label matchers: name=value, name!=value, name=~regex, name!~regex.
        #[arg(required = true)]
        matchers: Vec<String>,
        /// How long: 30m, 2h, 1d...
        #[arg(long = "for", default_value = "2h")]
        duration: String,
        /// Why (shown with the silence).
        #[arg(long, short = 'c')]
        comment: String,
    },
    /// Expire a silence now.
    Expire {
        /// Its id (s-N).
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum BreakerCmd {
    /// Close the breaker: automatic remediation resumes.
    Reset,
}

fn ago(ms: Option<i64>) -> String {
    let Some(ms) = ms else { return "-".into() };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(ms, |d| d.as_millis() as i64);
    let s = (now - ms).max(0) / 1000;
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m ago", s / 60),
        3600..86400 => format!("{}h{:02}m ago", s / 3600, s / 60 % 60),
        _ => format!("{}d ago", s / 86400),
    }
}

pub fn run(args: AlertsArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    let api = Api::new(&args.server, config_file)?;
    match args.what {
        None => list(&api, args.all),
        Some(What::Rules) => rules(&api),
        Some(What::Silence { what: None }) => silences(&api, args.all),
        Some(What::Silence {
            what:
                Some(SilenceCmd::Add {
                    matchers,
                    duration,
                    comment,
                }),
        }) => {
            let secs = parse_duration(&duration)?;
            let body = json!({
                "matchers": matchers,
                "duration": format!("{secs}s"),
                "comment": comment,
            });
            let v: Value = api.post("/v1/silences", &body)?;
            println!(
                "silence {} for {duration}: alerts matching {} are not notified",
                s(&v["silence"]["id"]),
                matchers.join(", ")
            );
            Ok(())
        }
        Some(What::Silence {
            what: Some(SilenceCmd::Expire { id }),
        }) => {
            // The id goes into the URL's path: one that is no silence's (`../../x`) would send
            // the request to another endpoint.
            if id.is_empty()
                || !id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                anyhow::bail!(
                    "{id:?} is no silence id (they look like s-3); `perch alerts silence` lists them"
                );
            }
            api.delete::<Value>(&format!("/v1/silences/{id}"))?;
            println!("silence {id} expired");
            Ok(())
        }
        Some(What::Breaker { what: None }) => {
            let v: Value = api.get("/v1/alerts")?;
            let r = &v["remediation"];
            match r["circuit_breaker"].as_object() {
                Some(trip) => println!(
                    "OPEN since {}: {}\nreset with: perch alerts breaker reset",
                    ago(trip.get("opened_at_ms").and_then(Value::as_i64)),
                    s(trip.get("reason").unwrap_or(&Value::Null))
                ),
                None => println!(
                    "closed: automatic remediation is on{}",
                    if r["dry_run"] == true {
                        " (dry run)"
                    } else {
                        ""
                    }
                ),
            }
            Ok(())
        }
        Some(What::Breaker {
            what: Some(BreakerCmd::Reset),
        }) => {
            let v: Value = api.post("/v1/alerts/breaker/reset", &json!({}))?;
            if v["was_open"] == true {
                println!("circuit breaker closed: automatic remediation resumes");
            } else {
                println!("the circuit breaker was already closed");
            }
            Ok(())
        }
    }
}

fn list(api: &Api, all: bool) -> Result<()> {
    let v: Value = api.get("/v1/alerts")?;
    let rows: Vec<Vec<String>> = v["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| all || a["state"] != "resolved")
        .map(|a| {
            let labels: Vec<String> = a["labels"]
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| *k != "alertname" && *k != "severity")
                .map(|(k, v)| format!("{k}={}", s(v)))
                .collect();
            vec![
                s(&a["state"]),
                s(&a["severity"]),
                s(&a["rule"]),
                labels.join(" "),
                ago(a["fired_at_ms"].as_i64().or(a["active_at_ms"].as_i64())),
                a["muted_by"].as_str().unwrap_or("-").to_owned(),
                s(&a["summary"]),
            ]
        })
        .collect();
    if rows.is_empty() {
        println!("no alerts");
    } else {
        print_table(
            &[
                "STATE", "SEVERITY", "RULE", "LABELS", "SINCE", "MUTED", "SUMMARY",
            ],
            rows,
        );
    }
    let r = &v["remediation"];
    if let Some(trip) = r["circuit_breaker"].as_object() {
        println!(
            "\nremediation circuit breaker OPEN: {} (perch alerts breaker reset)",
            s(trip.get("reason").unwrap_or(&Value::Null))
        );
    }
    if r["dry_run"] == true {
        println!(
            "\nremediation is in dry-run mode: actions are planned and audited, not carried out"
        );
    }
    Ok(())
}

/// A rule's state in one word: what fires first, then whether its last evaluation failed.
fn rule_state(r: &Value) -> &'static str {
    if r["firing"] != 0 {
        "firing"
    } else if r["pending"] != 0 {
        "pending"
    } else if !r["last_error"].is_null() {
        "failing"
    } else if r["last_evaluation_ms"].is_null() {
        "not evaluated yet"
    } else {
        "ok"
    }
}

/// Every configured rule (built-in and from `[alerts]`), quiet ones included, with its state.
fn rules(api: &Api) -> Result<()> {
    let v: Value = api.get("/v1/alerts")?;
    let rows = v["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            vec![
                s(&r["name"]),
                rule_state(r).to_owned(),
                if r["builtin"] == true {
                    "built-in"
                } else {
                    "config"
                }
                .to_owned(),
                s(&r["severity"]),
                r["firing"].to_string(),
                r["pending"].to_string(),
                ago(r["last_evaluation_ms"].as_i64()),
                r["last_error"].as_str().unwrap_or("-").to_owned(),
            ]
        })
        .collect();
    print_table(
        &[
            "RULE",
            "STATE",
            "FROM",
            "SEVERITY",
            "FIRING",
            "PENDING",
            "EVALUATED",
            "ERROR",
        ],
        rows,
    );
    Ok(())
}

fn silences(api: &Api, all: bool) -> Result<()> {
    let v: Value = api.get("/v1/silences")?;
    let rows: Vec<Vec<String>> = v["silences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|x| all || x["state"] != "expired")
        .map(|x| {
            let matchers: Vec<String> = x["matchers"]
                .as_array()
                .into_iter()
                .flatten()
                .map(s)
                .collect();
            vec![
                s(&x["id"]),
                s(&x["state"]),
                matchers.join(", "),
                s(&x["created_by"]),
                s(&x["comment"]),
            ]
        })
        .collect();
    if rows.is_empty() {
        println!("no silences");
    } else {
        print_table(&["ID", "STATE", "MATCHERS", "BY", "COMMENT"], rows);
    }
    Ok(())
}

/// A JSON value as a cell: a string as itself, `-` for null, anything else as JSON.
fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}
