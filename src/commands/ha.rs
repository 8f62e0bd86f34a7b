//! `perch ha status`: who leads a control plane with standbys, as each server says
//! (`GET /v1/ha`, which a standby answers itself): every server given (`--server`,
//! `PERCH_SERVER`, `[client] servers`) is asked, so a server that is down or disagrees shows.

use super::jobs::{ServerArg, print_table};
use crate::config::ConfigFile;
use anyhow::Result;
use clap::{Args, Subcommand};
use serde::Deserialize;

#[derive(Debug, Args)]
pub struct HaArgs {
    #[command(subcommand)]
    command: HaCommand,
}

#[derive(Debug, Subcommand)]
enum HaCommand {
    /// Each server's part (leader, standby), who leads, since when and at which epoch.
    Status(StatusArgs),
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    server: ServerArg,
}

#[derive(Debug, Deserialize)]
struct Named {
    name: String,
}

#[derive(Debug, Deserialize)]
struct Leader {
    name: String,
    address: String,
    epoch: i64,
    since: String,
}

/// The answer of `GET /v1/ha`.
#[derive(Debug, Deserialize)]
struct HaView {
    mode: String,
    role: String,
    server: Option<Named>,
    leader: Option<Leader>,
    why: Option<String>,
}

pub fn run(args: HaArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    let HaCommand::Status(args) = args.command;
    let config = args.server.resolve(config_file)?;
    let http = config.blocking_http(Some(std::time::Duration::from_secs(5)))?;
    let mut rows = Vec::new();
    let mut leaders = std::collections::BTreeSet::new();
    for server in &config.servers {
        let mut request = http.get(format!("{server}/v1/ha"));
        if let Some(token) = &config.token {
            request = request.bearer_auth(token);
        }
        let answer = request
            .send()
            .map_err(|e| format!("unreachable: {e}"))
            .and_then(|r| {
                if r.status().is_success() {
                    r.json::<HaView>()
                        .map_err(|e| format!("not perch's answer: {e}"))
                } else {
                    Err(format!("answered {}", r.status()))
                }
            });
        rows.push(match answer {
            Ok(v) => {
                let name = v.server.map_or_else(|| "-".to_owned(), |s| s.name);
                let role = match (&v.mode[..], v.why) {
                    ("single", _) => "leader (one server, no standby)".to_owned(),
                    (_, Some(why)) => format!("{} ({why})", v.role),
                    _ => v.role,
                };
                match v.leader {
                    Some(l) => {
                        leaders.insert((l.name.clone(), l.epoch));
                        vec![
                            server.clone(),
                            name,
                            role,
                            format!("{} {}", l.name, l.address),
                            l.epoch.to_string(),
                            l.since,
                        ]
                    }
                    None if v.mode == "single" => {
                        leaders.insert(("-".into(), 0));
                        vec![
                            server.clone(),
                            name,
                            role,
                            "itself".into(),
                            "-".into(),
                            "-".into(),
                        ]
                    }
                    None => vec![
                        server.clone(),
                        name,
                        role,
                        "none known".into(),
                        "-".into(),
                        "-".into(),
                    ],
                }
            }
            Err(why) => vec![
                server.clone(),
                "-".into(),
                why,
                "-".into(),
                "-".into(),
                "-".into(),
            ],
        });
    }
    print_table(
        &["SERVER", "NAME", "ROLE", "LEADER", "EPOCH", "SINCE"],
        rows,
    );
    match leaders.len() {
        0 => anyhow::bail!(
            "no server named a leader: a takeover may be under way (retry in a few seconds), or the job database cannot be reached"
        ),
        1 => Ok(()),
        _ => anyhow::bail!(
            "the servers disagree on the leader ({leaders:?}): one is behind by a renewal; ask again"
        ),
    }
}
