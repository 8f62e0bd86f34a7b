//! Validation runs as control-plane operations: starting one drains the node (the reason
//! `validating ...`) and records the run; its result resumes the node or keeps it drained with
//! the reason, as [`crate::validation`] decides, and each step is an event in `events`.

use super::{Control, ControlError};
use crate::validation::{self, Drain, Refused, Report, Run, Step, Trigger, Verdict};
use perch_model::ClusterEvent;

impl Control {
    fn drain_of(&self, name: &str) -> Result<Drain, ControlError> {
        let &idx = self
            .node_index
            .get(name)
            .ok_or_else(|| ControlError::NoSuchNode(name.to_owned()))?;
        let r = &self.nodes[idx].record;
        Ok(Drain {
            drained: r.drained,
            by: r.drained_by.clone(),
            reason: r.drain_reason.clone(),
        })
    }

    fn validation_event(&mut self, now: i64, run: &Run, kind: &str, message: String) {
        let mut event = ClusterEvent::new(now, kind, run.by.clone(), message);
        event.node = Some(run.node.clone());
        event.action = Some(run.trigger.as_str().to_owned());
        event.outcome = run.verdict.map(|v| v.as_str().to_owned());
        self.ledger.events.push(event);
    }

    fn carry_out(&mut self, node: &str, step: Step, now: i64) -> Result<(), ControlError> {
        match step {
            Step::Drain { reason } => {
                self.set_drained(node, true, validation::PERCH, Some(reason), now)
            }
            Step::Resume => self.set_drained(node, false, validation::PERCH, None, now),
            Step::Keep => Ok(()),
        }
    }

    /// Starts a validation of node `name` running `command` (shown as it is run), for
    /// `trigger`, asked by `by`: drains the node unless someone else holds it drained. The
    /// inner error says a validation already runs there.
    pub fn validation_begin(
        &mut self,
        name: &str,
        trigger: Trigger,
        by: &str,
        command: String,
        now: i64,
    ) -> Result<Result<Run, Refused>, ControlError> {
        let drain = self.drain_of(name)?;
        if let Some(r) = self.validations.running(name) {
            return Ok(Err(Refused::Running {
                node: name.to_owned(),
                id: r.id,
                since_ms: r.started_ms,
            }));
        }
        let (step, owns) = validation::begin(&drain, trigger, by);
        let run = match self
            .validations
            .start(name, trigger, by, command, owns, now)
        {
            Ok(run) => run,
            Err(refused) => return Ok(Err(refused)),
        };
        self.carry_out(name, step, now)?;
        let held = if owns {
            String::new()
        } else {
            format!(
                "; it stays drained by {} whatever the result",
                drain.by.as_deref().unwrap_or("an operator")
            )
        };
        let message = format!(
            "validating {name} ({}, asked by {by}): `{}`{held}",
            trigger.as_str(),
            run.command
        );
        self.validation_event(now, &run, "validation_started", message);
        Ok(Ok(run))
    }

    /// Ends validation run `id` with the agent's `report` (`timeout_ms` was its limit):
    /// resumes the node or keeps it drained with the reason. `None` when the run had already
    /// ended.
    pub fn validation_end(
        &mut self,
        id: u64,
        report: Report,
        timeout_ms: u64,
        now: i64,
    ) -> Result<Option<Run>, ControlError> {
        let verdict = validation::judge(&report);
        let Some(run) = self.validations.end(id, verdict, &report, now) else {
            return Ok(None);
        };
        let reason = validation::failed_reason(verdict, &report, timeout_ms);
        let drain = self.drain_of(&run.node)?;
        let step = validation::finish(&drain, &run, verdict, reason.clone());
        let after = match (&step, verdict) {
            (Step::Resume, _) => "; resumed".to_owned(),
            (Step::Keep, Verdict::Passed) if drain.drained => format!(
                "; it stays drained ({})",
                drain.reason.as_deref().unwrap_or("by an operator")
            ),
            (Step::Keep, Verdict::Passed) => String::new(),
            (Step::Keep, _) => format!(
                "; it stays drained by {}",
                drain.by.as_deref().unwrap_or("an operator")
            ),
            (Step::Drain { .. }, _) => "; it stays drained".to_owned(),
        };
        let node = run.node.clone();
        self.carry_out(&node, step, now)?;
        let what = match verdict {
            Verdict::Passed => "passed".to_owned(),
            _ => reason,
        };
        let message = format!(
            "validation of {node} ({}): {what}{after}",
            run.trigger.as_str()
        );
        self.validation_event(now, &run, "validation_finished", message);
        Ok(Some(run))
    }

    /// The validation in progress on node `name`.
    pub fn validation_running(&self, name: &str) -> Option<&Run> {
        self.validations.running(name)
    }

    /// Every validation run kept: finished ones oldest first, then those in progress.
    pub fn validation_runs(&self) -> Vec<Run> {
        self.validations.rows()
    }
}

#[cfg(test)]
mod tests {
    use crate::validation::{Report, Trigger};
    use crate::{JobService, JobsConfig};
    use perch_model::control::SyncRequest;

    async fn join(jobs: &JobService, node: &str) {
        let req: SyncRequest = serde_json::from_value(serde_json::json!({
            "node": node, "gpus": 2, "gpu_model": "Test H100", "running": [], "exited": [],
        }))
        .expect("sync request");
        jobs.run(move |c, now| c.sync(req, now))
            .await
            .expect("sync");
    }

    async fn drain(jobs: &JobService) -> (bool, Option<String>) {
        jobs.read(|c| {
            c.node_records()
                .find(|(n, _, _)| n.name == "n1")
                .map(|(n, _, _)| (n.drained, n.drain_reason.clone()))
                .expect("n1")
        })
    }

    #[tokio::test]
    async fn validation_drains_then_resumes_or_keeps_the_node_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tx, mut rx) = JobService::event_channel();
        let jobs = JobService::open_embedded(dir.path(), JobsConfig::default(), tx).expect("jobs");
        join(&jobs, "n1").await;
        let begin = |trigger| {
            jobs.run(move |c, now| c.validation_begin("n1", trigger, "ops", "check".into(), now))
        };
        let run = begin(Trigger::Operator)
            .await
            .expect("control")
            .expect("starts");
        assert_eq!(
            drain(&jobs).await,
            (true, Some("validating (asked by ops)".into()))
        );
        assert!(
            begin(Trigger::Operator).await.expect("control").is_err(),
            "one at a time"
        );
        let passed = Report {
            exit_code: Some(0),
            timed_out: false,
            error: None,
            output: "ok".into(),
        };
        let report = passed.clone();
        jobs.run(move |c, now| c.validation_end(run.id, report, 1000, now))
            .await
            .expect("control");
        assert_eq!(drain(&jobs).await, (false, None), "resumed");

        let run = begin(Trigger::Remediation)
            .await
            .expect("control")
            .expect("starts");
        let failed = Report {
            exit_code: Some(1),
            output: "GPU 1: lost\n".into(),
            ..passed
        };
        jobs.run(move |c, now| c.validation_end(run.id, failed, 1000, now))
            .await
            .expect("control");
        assert_eq!(
            drain(&jobs).await,
            (
                true,
                Some("validation failed: exit code 1: GPU 1: lost".into())
            )
        );
        let mut kinds = Vec::new();
        while let Ok(batch) = rx.try_recv() {
            kinds.extend(
                batch
                    .into_iter()
                    .filter(|e| e.kind.starts_with("validation"))
                    .map(|e| format!("{} {}", e.kind, e.outcome.unwrap_or_default())),
            );
        }
        assert_eq!(
            kinds,
            [
                "validation_started ",
                "validation_finished passed",
                "validation_started ",
                "validation_finished failed"
            ]
        );
        assert_eq!(jobs.read(|c| c.validation_runs().len()), 2);
    }
}
