//! What the planner decides: actions, outcomes, and the audit records they produce.

use crate::alert::AlertKey;
use perch_model::ClusterEvent;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Something perch can do to the cluster. The server carries out an `Execute` decision and
/// reports the result with [`crate::Engine::complete`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// No new jobs on the node; running ones finish (or are requeued if `RequeueJobs` is also
    /// decided).
    DrainNode {
        /// The node.
        node: String,
    },
    /// Stop the node's running jobs and put them back in the queue, to run elsewhere.
    RequeueJobs {
        /// The node.
        node: String,
    },
    /// Take one GPU out of scheduling.
    GpuOut {
        /// The node.
        node: String,
        /// The GPU index.
        gpu: u32,
    },
    /// Run a configured command on the node through its agent.
    RunCommand {
        /// The node.
        node: String,
        /// The command's name in `[alerts.remediation.commands]`.
        command: String,
        /// Program and arguments, templates filled in.
        argv: Vec<String>,
        /// Time limit; the agent kills the command after it.
        timeout_ms: i64,
    },
    /// Run the health check on a node perch drained; exit 0 means healthy.
    HealthCheck {
        /// The node.
        node: String,
        /// Program and arguments.
        argv: Vec<String>,
        /// Time limit.
        timeout_ms: i64,
    },
    /// Put a node perch drained back in service (only after its health check passed).
    ResumeNode {
        /// The node.
        node: String,
    },
}

impl Action {
    /// The node acted on.
    pub fn node(&self) -> &str {
        match self {
            Self::DrainNode { node }
            | Self::RequeueJobs { node }
            | Self::GpuOut { node, .. }
            | Self::RunCommand { node, .. }
            | Self::HealthCheck { node, .. }
            | Self::ResumeNode { node } => node,
        }
    }

    /// The action's name in the `events` table (`drain_node`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Self::DrainNode { .. } => "drain_node",
            Self::RequeueJobs { .. } => "requeue_jobs",
            Self::GpuOut { .. } => "gpu_out",
            Self::RunCommand { .. } => "run_command",
            Self::HealthCheck { .. } => "health_check",
            Self::ResumeNode { .. } => "resume_node",
        }
    }

    /// Identity for cooldown and de-duplication on one node: the name plus the GPU or
    /// the command line.
    pub(crate) fn identity(&self) -> String {
        match self {
            Self::GpuOut { gpu, .. } => format!("gpu_out:{gpu}"),
            Self::RunCommand { command, argv, .. } => {
                format!("run_command:{command}:{}", argv.join(" "))
            }
            other => other.name().to_owned(),
        }
    }

    fn gpu(&self) -> Option<u32> {
        match self {
            Self::GpuOut { gpu, .. } => Some(*gpu),
            _ => None,
        }
    }

    /// What the action does, as a verb phrase: "drain n1", "run gpu_reset on n1".
    pub fn describe(&self) -> String {
        match self {
            Self::DrainNode { node } => format!("drain {node}"),
            Self::RequeueJobs { node } => format!("requeue the jobs of {node}"),
            Self::GpuOut { node, gpu } => format!("take GPU {gpu} of {node} out of scheduling"),
            Self::RunCommand { node, command, .. } => format!("run {command} on {node}"),
            Self::HealthCheck { node, .. } => format!("run the health check on {node}"),
            Self::ResumeNode { node } => format!("resume {node}"),
        }
    }

    /// What was done, as a sentence: "Drained n1: no new jobs start there."
    pub fn done(&self) -> String {
        match self {
            Self::DrainNode { node } => format!("Drained {node}: no new jobs start there."),
            Self::RequeueJobs { node } => format!("Requeued the jobs of {node}."),
            Self::GpuOut { node, gpu } => {
                format!("Took GPU {gpu} of {node} out of scheduling.")
            }
            Self::RunCommand { node, command, .. } => format!("Ran {command} on {node}."),
            Self::HealthCheck { node, .. } => format!("Health check of {node} passed."),
            Self::ResumeNode { node } => format!("Resumed {node}."),
        }
    }
}

/// Why the planner did not let an action run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum RefuseReason {
    /// The circuit breaker is open: no automatic action until an operator resets it.
    CircuitOpen,
    /// Too many drains perch started are still in progress; retried next round.
    MaxConcurrentDrains {
        /// The configured limit.
        limit: usize,
    },
    /// Perch did the same thing to this node recently; retried after `until_ms`.
    Cooldown {
        /// When the cooldown ends.
        until_ms: i64,
    },
    /// The alert lacks a label the action needs (`node`, or `gpu` for `gpu_out`).
    MissingLabel {
        /// The label.
        label: String,
    },
    /// The alert's node is not one the server knows.
    UnknownNode,
    /// The rule names a command the config does not define.
    UnknownCommand {
        /// The name.
        command: String,
    },
}

impl RefuseReason {
    /// Refusals that cannot change by waiting; the planner does not retry them.
    pub(crate) fn is_final(&self) -> bool {
        matches!(
            self,
            Self::MissingLabel { .. } | Self::UnknownNode | Self::UnknownCommand { .. }
        )
    }
}

impl fmt::Display for RefuseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CircuitOpen => f.write_str("circuit breaker open"),
            Self::MaxConcurrentDrains { limit } => {
                write!(
                    f,
                    "{limit} drains already in progress (max_concurrent_drains)"
                )
            }
            Self::Cooldown { until_ms } => {
                write!(f, "cooldown until {}", crate::timefmt::utc(*until_ms))
            }
            Self::MissingLabel { label } => write!(f, "the alert has no `{label}` label"),
            Self::UnknownNode => f.write_str("unknown node"),
            Self::UnknownCommand { command } => write!(f, "command {command:?} is not configured"),
        }
    }
}

/// The planner's verdict on one action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Carry it out, then report with [`crate::Engine::complete`].
    Execute,
    /// Dry-run mode: it would have been carried out; nothing changes.
    DryRun,
    /// Not allowed now.
    Refused(RefuseReason),
    /// Not needed: its effect already holds (the node is already out, ...).
    Skipped {
        /// Why.
        why: String,
    },
}

/// One decision of the planner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// What.
    pub action: Action,
    /// The verdict.
    pub outcome: Outcome,
    /// The alert that asked for it (none for health checks and resumes).
    pub alert: Option<AlertKey>,
    /// The alert's episode, which [`crate::Engine::complete`] uses to find it.
    pub episode: Option<String>,
    /// The alert's rule.
    pub rule: Option<String>,
    /// When it was decided.
    pub at_ms: i64,
    /// The audit record to write now; `None` for `Execute`, whose record comes with the
    /// result, and for a refusal already recorded (it is not repeated every round).
    pub event: Option<ClusterEvent>,
}

impl Decision {
    /// The audit record for this decision with `outcome` and `message`.
    pub(crate) fn audit(&self, outcome: String, message: String, dry_run: bool) -> ClusterEvent {
        let mut event = ClusterEvent::new(self.at_ms, "remediation", "perch", message);
        event.node = Some(self.action.node().to_owned());
        // A refusal for a missing label has no real GPU to name.
        if !matches!(
            self.outcome,
            Outcome::Refused(RefuseReason::MissingLabel { .. })
        ) {
            event.gpu = self.action.gpu();
        }
        event.rule = self.rule.clone();
        event.action = Some(self.action.name().to_owned());
        event.outcome = Some(outcome);
        event.dry_run = dry_run;
        event
    }

    /// The line for the alert's "what perch did" list, if this decision deserves one.
    pub fn annotation(&self) -> Option<String> {
        match &self.outcome {
            Outcome::Execute | Outcome::Skipped { .. } => None,
            Outcome::DryRun => Some(format!("Dry run: would {}.", self.action.describe())),
            Outcome::Refused(reason) => {
                Some(format!("Did not {}: {reason}.", self.action.describe()))
            }
        }
    }
}
