//! Commands the server asks the agent to run on its node (a GPU reset script, the health
//! check before a drained node is resumed): run without a shell in their own process group,
//! killed as a group at their timeout, with the tail of their output kept for the audit trail.

use perch_model::control::{CommandResult, NodeCommand};
use rustix::process::{Pid, Signal, kill_process_group};
use std::process::Stdio;
use std::time::Duration;

/// Output kept per command (the end of it: where errors are).
const OUTPUT_TAIL: usize = 4096;

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let start = text.len().saturating_sub(OUTPUT_TAIL);
    let start = (start..=text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    text[start..].to_owned()
}

/// Runs `cmd` to completion or its timeout.
pub async fn run(cmd: NodeCommand) -> CommandResult {
    let mut result = CommandResult {
        id: cmd.id,
        exit_code: None,
        timed_out: false,
        output: String::new(),
        error: None,
    };
    let Some((program, args)) = cmd.argv.split_first() else {
        result.error = Some("empty command".into());
        return result;
    };
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            result.error = Some(format!("cannot run {program}: {e}"));
            return result;
        }
    };
    let pgid = child.id().and_then(|id| Pid::from_raw(id as i32));
    let limit = Duration::from_millis(cmd.timeout_ms.max(1));
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(Ok(out)) => {
            result.exit_code = out.status.code();
            let mut all = out.stdout;
            all.extend_from_slice(&out.stderr);
            result.output = tail(&all);
        }
        Ok(Err(e)) => result.error = Some(format!("waiting for {program}: {e}")),
        Err(_) => {
            result.timed_out = true;
            // The child itself is killed on drop; this takes whatever it started with it.
            if let Some(pgid) = pgid {
                let _ = kill_process_group(pgid, Signal::KILL);
            }
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(argv: &[&str], timeout_ms: u64) -> NodeCommand {
        NodeCommand {
            id: 7,
            argv: argv.iter().map(|s| (*s).to_owned()).collect(),
            timeout_ms,
        }
    }

    #[tokio::test]
    async fn exit_code_output_timeout_and_missing_program() {
        let ok = run(cmd(
            &["sh", "-c", "echo reset done; echo warn >&2; exit 3"],
            5000,
        ))
        .await;
        assert_eq!((ok.id, ok.exit_code, ok.timed_out), (7, Some(3), false));
        assert!(
            ok.output.contains("reset done") && ok.output.contains("warn"),
            "{ok:?}"
        );
        let slow = run(cmd(&["sleep", "30"], 200)).await;
        assert!(slow.timed_out && slow.exit_code.is_none(), "{slow:?}");
        let missing = run(cmd(&["/nonexistent/gpu-reset"], 1000)).await;
        assert!(
            missing
                .error
                .is_some_and(|e| e.contains("/nonexistent/gpu-reset"))
        );
        let long = run(cmd(
            &["sh", "-c", "head -c 10000 /dev/zero | tr '\\\\0' x"],
            5000,
        ))
        .await;
        assert_eq!(long.output.len(), OUTPUT_TAIL);
    }
}
