//! Validation: a node proves its GPUs healthy before it takes work again. After a remediation
//! (its drain, a GPU reset, a reboot) or on an operator's request, the node is drained with
//! the reason `validating`, its agent runs the validation command, and the result decides:
//! passed, the node is resumed if the drain is still perch's own; failed (or timed out, or no
//! answer), it stays drained with the reason `validation failed: ...`. An operator's drain for
//! another reason is never lifted by a validation.
//!
//! This module is the decisions, pure: [`begin`] and [`finish`] take the node's drain and the
//! run and answer what to do, and [`Validations`] keeps the runs (the one in progress per
//! node, and the latest finished ones for the `node_validations` table). The control plane
//! carries the decisions out (`control/validation.rs`).

use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

/// Who drains and resumes for validation (and for remediation).
pub const PERCH: &str = "perch";
/// The start of the drain reason while a validation runs.
pub const VALIDATING: &str = "validating";
/// The start of the drain reason once a validation failed.
pub const FAILED: &str = "validation failed";
/// Finished runs kept for the `node_validations` table (the `events` table keeps them all).
pub const KEPT_RUNS: usize = 10_000;
/// Output kept per run, in bytes: the end of it, where errors are.
pub const OUTPUT_EXCERPT: usize = 2_048;
/// Characters of the output's last line quoted in the drain reason.
const REASON_LINE: usize = 160;

/// The built-in check as the server asks for it: the agent runs its own `perch` binary's
/// `__validate-gpus` (collector `validation::SERVER_ARGV`, the same two words).
pub const BUILTIN_ARGV: [&str; 2] = ["perch", "__validate-gpus"];

/// `[validation]`: what a node runs to prove its GPUs healthy, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Program and arguments, run without a shell; empty: the built-in check.
    pub command: Vec<String>,
    /// The agent kills the command after this long; the node then stays drained.
    pub timeout: std::time::Duration,
    /// Seconds of GPU burn for the built-in check (when CUDA and torch are present).
    pub burn_secs: u32,
    /// Perch's remediation resumes a node it drained only after a validation passed.
    pub after_remediation: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            command: Vec::new(),
            timeout: std::time::Duration::from_secs(300),
            burn_secs: 30,
            after_remediation: true,
        }
    }
}

impl Config {
    /// The command line the agent is asked to run.
    pub fn argv(&self) -> Vec<String> {
        if self.command.is_empty() {
            let mut argv: Vec<String> = BUILTIN_ARGV.iter().map(|s| (*s).to_owned()).collect();
            argv.extend(["--burn-secs".to_owned(), self.burn_secs.to_string()]);
            argv
        } else {
            self.command.clone()
        }
    }
}

/// Why a validation ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// Perch's remediation drained the node (a GPU reset, a reboot, an alert's drain).
    Remediation,
    /// An operator asked (`perch validate NODE`).
    Operator,
}

impl Trigger {
    /// Its name in SQL and events.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Remediation => "remediation",
            Self::Operator => "operator",
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Passed,
    Failed,
    /// The command ran past its timeout and was killed.
    TimedOut,
    /// The agent did not answer in time (node down, agent gone), or could not run it.
    NoAnswer,
}

impl Verdict {
    /// Its name in SQL and events.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Passed => "passed",
            Self::Failed => "failed",
            Self::TimedOut => "timed_out",
            Self::NoAnswer => "no_answer",
        }
    }
}

/// What the agent reported (or the server found: no answer), before judging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    /// Why it could not be run or why no answer came.
    pub error: Option<String>,
    pub output: String,
}

/// One validation run, in progress or finished.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Run {
    pub id: u64,
    pub node: String,
    pub trigger: Trigger,
    /// Who asked: an operator's name, `perch`.
    pub by: String,
    pub command: String,
    pub started_ms: i64,
    pub finished_ms: Option<i64>,
    pub verdict: Option<Verdict>,
    pub exit_code: Option<i32>,
    /// The end of the output (at most [`OUTPUT_EXCERPT`] bytes), or why there is none.
    pub output: String,
    /// The validation drained the node, or took over perch's own drain of it: only then does
    /// a pass resume it.
    pub owns_drain: bool,
}

/// A node's drain as the control plane has it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Drain {
    pub drained: bool,
    pub by: Option<String>,
    pub reason: Option<String>,
}

impl Drain {
    fn perchs(&self) -> bool {
        self.drained && self.by.as_deref() == Some(PERCH)
    }
}

/// A change to the node's drain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Drain it (by perch) with this reason, or set the reason of perch's drain.
    Drain { reason: String },
    /// Resume it.
    Resume,
    /// Leave it as it is.
    Keep,
}

/// Why a validation cannot start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(
        "{node} is already validating (run {id}, since {since_ms} ms Unix time); wait for its result"
    )]
    Running {
        node: String,
        id: u64,
        since_ms: i64,
    },
}

/// The reason a validation in progress drains the node with.
pub fn validating_reason(trigger: Trigger, by: &str) -> String {
    match trigger {
        Trigger::Operator => format!("{VALIDATING} (asked by {by})"),
        Trigger::Remediation => format!("{VALIDATING} after remediation"),
    }
}

/// Starting a run on a node drained as `drain`: the step, and whether the run owns the drain.
/// An operator's (or anyone else's) drain stays theirs; perch's own (a remediation's) is
/// taken over, so a pass lifts it.
pub fn begin(drain: &Drain, trigger: Trigger, by: &str) -> (Step, bool) {
    if !drain.drained || drain.perchs() {
        let reason = validating_reason(trigger, by);
        (Step::Drain { reason }, true)
    } else {
        (Step::Keep, false)
    }
}

/// The verdict on `report`.
pub fn judge(report: &Report) -> Verdict {
    match (report.exit_code, report.timed_out, &report.error) {
        (_, true, _) => Verdict::TimedOut,
        (_, _, Some(_)) => Verdict::NoAnswer,
        (Some(0), _, _) => Verdict::Passed,
        _ => Verdict::Failed,
    }
}

/// The drain reason after a failed run: the verdict, exit code and the output's last line.
pub fn failed_reason(verdict: Verdict, report: &Report, timeout_ms: u64) -> String {
    let last = report
        .output
        .trim()
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let last: String = last.chars().take(REASON_LINE).collect();
    let what = match (verdict, report.exit_code, &report.error) {
        (Verdict::TimedOut, _, _) => format!("timed out after {} s", timeout_ms / 1000),
        (_, _, Some(e)) => e.chars().take(REASON_LINE).collect(),
        (_, Some(code), _) => format!("exit code {code}"),
        (_, None, _) => "killed by a signal".to_owned(),
    };
    if last.is_empty() || report.error.is_some() {
        format!("{FAILED}: {what}")
    } else {
        format!("{FAILED}: {what}: {last}")
    }
}

/// What to do with the node when `run` ended as `verdict`, its drain being `drain` now.
/// Passed: resume, only if the run owns the drain and it is still a validation's (nobody
/// drained it again for another reason meanwhile). Otherwise: drain it with `reason` unless
/// someone other than perch holds it drained (their drain, and their reason, stay).
pub fn finish(drain: &Drain, run: &Run, verdict: Verdict, reason: String) -> Step {
    let still_validating = drain.perchs()
        && drain
            .reason
            .as_deref()
            .is_some_and(|r| r.starts_with(VALIDATING));
    match verdict {
        Verdict::Passed if run.owns_drain && still_validating => Step::Resume,
        Verdict::Passed => Step::Keep,
        _ if drain.drained && !drain.perchs() => Step::Keep,
        _ => Step::Drain { reason },
    }
}

/// The end of `output`, at most [`OUTPUT_EXCERPT`] bytes, cut at a character boundary.
pub fn excerpt(output: &str) -> String {
    let start = output.len().saturating_sub(OUTPUT_EXCERPT);
    let start = (start..=output.len())
        .find(|&i| output.is_char_boundary(i))
        .unwrap_or(output.len());
    output[start..].to_owned()
}

/// The runs: one in progress per node at most, and the latest finished ones.
#[derive(Debug, Default)]
pub struct Validations {
    next_id: u64,
    running: BTreeMap<String, Run>,
    finished: VecDeque<Run>,
}

impl Validations {
    /// A new run on `node`, unless one runs there already.
    pub fn start(
        &mut self,
        node: &str,
        trigger: Trigger,
        by: &str,
        command: String,
        owns_drain: bool,
        now: i64,
    ) -> Result<Run, Refused> {
        if let Some(r) = self.running.get(node) {
            return Err(Refused::Running {
                node: node.to_owned(),
                id: r.id,
                since_ms: r.started_ms,
            });
        }
        self.next_id += 1;
        let run = Run {
            id: self.next_id,
            node: node.to_owned(),
            trigger,
            by: by.to_owned(),
            command,
            started_ms: now,
            finished_ms: None,
            verdict: None,
            exit_code: None,
            output: String::new(),
            owns_drain,
        };
        self.running.insert(node.to_owned(), run.clone());
        Ok(run)
    }

    /// The run in progress on `node`.
    pub fn running(&self, node: &str) -> Option<&Run> {
        self.running.get(node)
    }

    /// Ends run `id`, returning it finished; `None` if it is not in progress (already ended).
    pub fn end(&mut self, id: u64, verdict: Verdict, report: &Report, now: i64) -> Option<Run> {
        let node = self
            .running
            .iter()
            .find(|(_, r)| r.id == id)
            .map(|(n, _)| n.clone())?;
        let mut run = self.running.remove(&node)?;
        run.finished_ms = Some(now);
        run.verdict = Some(verdict);
        run.exit_code = report.exit_code;
        run.output = match &report.error {
            Some(e) if report.output.is_empty() => excerpt(e),
            _ => excerpt(&report.output),
        };
        if self.finished.len() >= KEPT_RUNS {
            self.finished.pop_front();
        }
        self.finished.push_back(run.clone());
        Some(run)
    }

    /// Every run, finished ones oldest first, then those in progress.
    pub fn rows(&self) -> Vec<Run> {
        self.finished
            .iter()
            .chain(self.running.values())
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(drained: bool, by: Option<&str>, reason: Option<&str>) -> Drain {
        Drain {
            drained,
            by: by.map(str::to_owned),
            reason: reason.map(str::to_owned),
        }
    }

    fn report(code: Option<i32>, timed_out: bool, output: &str) -> Report {
        Report {
            exit_code: code,
            timed_out,
            error: None,
            output: output.into(),
        }
    }

    #[test]
    fn a_validation_takes_over_only_perchs_own_drains() {
        let up = drain(false, None, None);
        let (step, owns) = begin(&up, Trigger::Operator, "ops");
        assert_eq!(
            (step, owns),
            (
                Step::Drain {
                    reason: "validating (asked by ops)".into()
                },
                true
            )
        );
        let remediated = drain(true, Some(PERCH), Some("alert GpuXid"));
        assert!(begin(&remediated, Trigger::Remediation, PERCH).1);
        let operators = drain(true, Some("ops"), Some("fan noise"));
        assert_eq!(
            begin(&operators, Trigger::Operator, "ops"),
            (Step::Keep, false)
        );
    }

    #[test]
    fn a_pass_resumes_only_its_own_drain_and_a_failure_keeps_the_node_out() {
        let mut v = Validations::default();
        let run = v
            .start("n1", Trigger::Operator, "ops", "check".into(), true, 0)
            .expect("starts");
        assert!(matches!(
            v.start("n1", Trigger::Operator, "ops", "check".into(), true, 1),
            Err(Refused::Running { .. })
        ));
        let ours = drain(true, Some(PERCH), Some("validating (asked by ops)"));
        assert_eq!(
            finish(&ours, &run, Verdict::Passed, String::new()),
            Step::Resume
        );
        // Someone drained it again for another reason meanwhile: it stays drained.
        let theirs = drain(true, Some("ops"), Some("fan noise"));
        assert_eq!(
            finish(&theirs, &run, Verdict::Passed, String::new()),
            Step::Keep
        );
        assert_eq!(
            finish(&theirs, &run, Verdict::Failed, "x".into()),
            Step::Keep
        );
        let not_owned = Run {
            owns_drain: false,
            ..run.clone()
        };
        assert_eq!(
            finish(&ours, &not_owned, Verdict::Passed, String::new()),
            Step::Keep
        );
        // Resumed by an operator meanwhile, then failed: drained again.
        let up = drain(false, None, None);
        assert_eq!(
            finish(
                &up,
                &run,
                Verdict::TimedOut,
                "validation failed: timed out".into()
            ),
            Step::Drain {
                reason: "validation failed: timed out".into()
            }
        );
        let r = report(Some(3), false, "ok\nGPU 1: 2 uncorrected ECC errors\n\n");
        let ended = v.end(run.id, judge(&r), &r, 5).expect("in progress");
        assert_eq!(
            (ended.verdict, ended.exit_code, ended.finished_ms),
            (Some(Verdict::Failed), Some(3), Some(5))
        );
        assert!(
            v.end(run.id, Verdict::Passed, &r, 6).is_none(),
            "ended once"
        );
        assert_eq!(v.rows().len(), 1);
    }

    #[test]
    fn verdicts_and_reasons() {
        assert_eq!(judge(&report(Some(0), false, "")), Verdict::Passed);
        assert_eq!(judge(&report(Some(1), false, "")), Verdict::Failed);
        assert_eq!(judge(&report(None, false, "")), Verdict::Failed);
        assert_eq!(judge(&report(None, true, "")), Verdict::TimedOut);
        let lost = Report {
            error: Some("no answer from its agent within 40 s".into()),
            ..report(None, false, "")
        };
        assert_eq!(judge(&lost), Verdict::NoAnswer);
        assert_eq!(
            failed_reason(
                Verdict::Failed,
                &report(Some(2), false, "GPU 0 ok\nGPU 1: lost\n"),
                30_000
            ),
            "validation failed: exit code 2: GPU 1: lost"
        );
        assert_eq!(
            failed_reason(Verdict::TimedOut, &report(None, true, ""), 30_000),
            "validation failed: timed out after 30 s"
        );
        assert_eq!(
            failed_reason(Verdict::NoAnswer, &lost, 30_000),
            "validation failed: no answer from its agent within 40 s"
        );
        let long = "é".repeat(3_000);
        let kept = excerpt(&long);
        assert!(kept.len() <= OUTPUT_EXCERPT && kept.chars().all(|c| c == 'é'));
    }
}
