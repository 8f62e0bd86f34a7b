//! `perch validate NODE` (operators): drains the node and runs its validation command
//! (`[validation]`, docs/validation.md), then waits for the result: the node is resumed when it
//! passed and stays drained with the reason when not. Also the hidden `perch __validate-gpus`,
//! the built-in check an agent runs ([`perch_collector::validation`]).

use super::jobs::{Api, ServerArg};
use crate::config::ConfigFile;
use anyhow::{Result, bail};
use clap::Args;
use serde::Deserialize;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct ValidateArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Node name.
    node: String,
    /// Answer once the validation has started, without waiting for its result (see it with
    /// `perch sql "SELECT * FROM node_validations"`).
    #[arg(long)]
    no_wait: bool,
}

#[derive(Debug, Deserialize)]
struct Started {
    validation: StartedRun,
}

#[derive(Debug, Deserialize)]
struct StartedRun {
    id: u64,
    command: String,
    owns_drain: bool,
}

#[derive(Debug, Deserialize)]
struct Rows {
    rows: Vec<Outcome>,
}

#[derive(Debug, Deserialize)]
struct Outcome {
    result: Option<String>,
    exit_code: Option<i32>,
    output: String,
    state: Option<String>,
    reason: Option<String>,
}

/// How often the result is asked for while waiting.
const POLL: Duration = Duration::from_millis(500);

/// Runs `perch validate`; fails (exit status 1) when the validation did not pass.
pub fn run(args: ValidateArgs, config_file: Option<&ConfigFile>) -> Result<()> {
    perch_model::NodeId::new(args.node.as_str())
        .map_err(|e| anyhow::anyhow!("{e}; `perch nodes` lists the nodes"))?;
    let api = Api::new(&args.server, config_file)?;
    let started: Started = api.post(
        &format!("/v1/nodes/{}/validate", args.node),
        &serde_json::Value::Null,
    )?;
    let run = started.validation;
    println!(
        "node {}: validating (run {}): {}{}",
        args.node,
        run.id,
        run.command,
        if run.owns_drain {
            ""
        } else {
            " (it stays drained by whoever drained it, whatever the result)"
        }
    );
    if args.no_wait {
        return Ok(());
    }
    let sql = format!(
        "SELECT v.result, v.exit_code, v.output, n.state, n.reason FROM node_validations v \
         LEFT JOIN nodes n ON n.node = v.node WHERE v.id = {}",
        run.id
    );
    let body = serde_json::json!({ "sql": sql, "format": "json" });
    let outcome = loop {
        let rows: Rows = api.post("/v1/sql", &body)?;
        match rows.rows.into_iter().next() {
            Some(o) if o.result.is_some() => break o,
            Some(_) => std::thread::sleep(POLL),
            None => bail!(
                "validation run {} is no longer listed (the server restarted?); `perch nodes` shows {}'s state",
                run.id,
                args.node
            ),
        }
    };
    let result = outcome.result.unwrap_or_default();
    for line in outcome.output.trim_end().lines() {
        println!("  {line}");
    }
    let state = outcome.state.unwrap_or_default();
    let reason = outcome
        .reason
        .map(|r| format!(" ({r})"))
        .unwrap_or_default();
    let code = outcome
        .exit_code
        .map(|c| format!(", exit code {c}"))
        .unwrap_or_default();
    println!(
        "node {}: validation {result}{code}; {state}{reason}",
        args.node
    );
    if result != "passed" {
        bail!("the validation of {} did not pass: {result}", args.node);
    }
    Ok(())
}

/// `perch __validate-gpus ...`: the built-in check; its exit status is the verdict.
pub fn builtin(args: &[std::ffi::OsString]) -> u8 {
    let args: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    match perch_collector::validation::Options::parse(&args) {
        Ok(options) => u8::from(!perch_collector::validation::run(&options)),
        Err(e) => {
            println!("perch {}: {e}", perch_collector::validation::SUBCOMMAND);
            2
        }
    }
}
