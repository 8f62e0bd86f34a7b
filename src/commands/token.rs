//! `perch token create`: a new random token, shown once, and the tokens-file entry (its hash)
//! that grants it.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use perch_server::auth::{Tokens, datetime_epoch_ms, token_hash};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct TokenArgs {
    #[command(subcommand)]
    command: TokenCommand,
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Make a new token: print it once (stdout), with the entry granting it (its hash, no
    /// secret) for the tokens file.
    Create(CreateArgs),
}

#[derive(Debug, Args)]
struct CreateArgs {
    /// Who the token speaks for: a user name (for an agent token, a name for the agent).
    #[arg(long)]
    user: String,
    /// user, operator or agent.
    #[arg(long, value_parser = ["user", "operator", "agent"])]
    role: String,
    /// For an agent token: a node it may report and sync as (repeat for several). An agent
    /// token without one may speak for any node.
    #[arg(long = "node")]
    nodes: Vec<String>,
    /// When the token stops working: a duration from now (`90d`, `12h`, `2w`) or a date or
    /// date-time (`2027-03-01`, `2027-03-01T12:00:00Z`). Without it the token works until its
    /// entry is removed.
    #[arg(long)]
    expires: Option<String>,
    /// Append the entry to this tokens file (created, mode 600, if missing; locked while it is
    /// read and written, so two of these at once both land), then send the server SIGHUP to
    /// use it without a restart.
    #[arg(long)]
    append: Option<PathBuf>,
}

/// `--expires` as milliseconds since the epoch, after `now_ms`.
fn expiry(text: &str, now_ms: i64) -> Result<i64> {
    let at = match perch_alerts::HumanDuration::parse(text) {
        Ok(d) => now_ms + d.as_ms(),
        Err(_) => {
            let when: toml::value::Datetime = text.trim().parse().map_err(|_| {
                anyhow::anyhow!(
                    "--expires {text:?}: give a duration (90d, 12h, 2w) or a date or date-time (2027-03-01, 2027-03-01T12:00:00Z)"
                )
            })?;
            datetime_epoch_ms(&when).map_err(|e| anyhow::anyhow!("--expires: {e}"))?
        }
    };
    if at <= now_ms {
        bail!("--expires {text}: that is not in the future");
    }
    Ok(at)
}

pub fn run(args: TokenArgs) -> Result<()> {
    let TokenCommand::Create(args) = args.command;
    if !args.nodes.is_empty() && args.role != "agent" {
        bail!(
            "--node binds agent tokens to nodes; this token's role is {}",
            args.role
        );
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let expires = args
        .expires
        .as_deref()
        .map(|e| expiry(e, now_ms))
        .transpose()?;
    let token = new_token()?;
    let entry = entry(&token, &args, expires);
    // The entry must be one the server accepts, alone and after what the file holds.
    Tokens::parse(&entry).map_err(|e| anyhow::anyhow!("{e}"))?;
    match &args.append {
        Some(path) => {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .read(true)
                .append(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            // Another `perch token create --append` waits here: each reads what the other
            // wrote, so neither entry is lost or interleaved.
            file.lock()
                .with_context(|| format!("locking {}", path.display()))?;
            let mut existing = String::new();
            file.read_to_string(&mut existing)
                .with_context(|| format!("reading {}", path.display()))?;
            let separator = if existing.is_empty() || existing.ends_with('\n') {
                ""
            } else {
                "\n"
            };
            let combined = format!("{existing}{separator}{entry}");
            Tokens::parse(&combined)
                .map_err(|e| anyhow::anyhow!("{}: {e}; nothing was written", path.display()))?;
            file.write_all(format!("{separator}{entry}").as_bytes())
                .and_then(|()| file.sync_all())
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!(
                "added to {}; send the server SIGHUP (or restart it) to accept the token. It is shown only now:",
                path.display()
            );
        }
        None => {
            eprintln!(
                "add this to the server's tokens file (server.tokens_file), then send the server SIGHUP:\n\n{entry}\nThe token, shown only now:"
            );
        }
    }
    println!("{token}");
    Ok(())
}

/// 32 bytes from the kernel's random source, as `perch_` and 64 hex digits (the prefix lets
/// secret scanners find a leaked one).
fn new_token() -> Result<String> {
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(format!(
        "perch_{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ))
}

fn entry(token: &str, args: &CreateArgs, expires: Option<i64>) -> String {
    let quote = |s: &str| toml::Value::String(s.to_owned()).to_string();
    let mut entry = format!(
        "[[tokens]]\ntoken_hash = \"{}\"\nuser = {}\nrole = \"{}\"\n",
        token_hash(token),
        quote(&args.user),
        args.role
    );
    if !args.nodes.is_empty() {
        let nodes: Vec<String> = args.nodes.iter().map(|n| quote(n)).collect();
        entry.push_str(&format!("nodes = [{}]\n", nodes.join(", ")));
    }
    if let Some(at) = expires {
        entry.push_str(&format!(
            "expires = {}\n",
            perch_alerts::rfc3339_seconds(at)
        ));
    }
    entry
}
