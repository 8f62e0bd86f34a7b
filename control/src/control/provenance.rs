//! Provenance as the control plane handles it: a submission's checked and queued for the
//! commit that adds the job, each node's start report added to its job's record. The records
//! themselves live in the job store only (`crate::provenance`).

use super::*;
use crate::provenance::{ProvenanceChange, ProvenanceRecord, RunProvenance, SubmitProvenance};
use perch_model::provenance::JobStartReport;

impl Control {
    /// Refuses provenance past its bounds, or naming as rerun a job that does not exist or
    /// that `user` may not run again (an operator may).
    pub fn check_provenance(
        &self,
        p: &SubmitProvenance,
        user: &str,
        operator: bool,
    ) -> Result<(), ControlError> {
        p.validate()?;
        if let Some(of) = p.rerun_of {
            let owner = self.find(of).map(|j| j.user().to_owned());
            match owner {
                None => {
                    return Err(ControlError::Invalid(FieldError {
                        field: "provenance.rerun_of",
                        message: format!("no job {of}; `perch jobs --all` lists them"),
                    }));
                }
                Some(owner) if !operator && owner != user => {
                    return Err(ControlError::Forbidden(format!(
                        "job {of} belongs to {owner}; only its owner or an operator may run it again"
                    )));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Queues job `job`'s submit-side provenance for the commit that adds it.
    pub fn record_provenance(&mut self, job: u64, user: &str, p: SubmitProvenance, now: i64) {
        self.provenance
            .push(ProvenanceChange::Submitted(ProvenanceRecord {
                job,
                user: user.to_owned(),
                submit_ms: now,
                submit: Some(p),
                runs: Vec::new(),
                runs_dropped: 0,
            }));
    }

    /// Node `node`'s reports of attempts it started: each added to its job's record, for a
    /// job placed there (a report of another node's job is dropped).
    pub(super) fn take_start_reports(&mut self, node: &str, reports: &[JobStartReport], now: i64) {
        for report in reports {
            let Some(job) = self.jobs.get(&report.job) else {
                continue;
            };
            let placed = job
                .allocations
                .iter()
                .any(|a| a.attempt == report.attempt && a.node == node);
            if !placed {
                tracing::debug!(
                    job = report.job,
                    node,
                    "a start report for a run not placed on this node; dropped"
                );
                continue;
            }
            self.provenance.push(ProvenanceChange::Ran {
                job: report.job,
                user: job.request.user().to_owned(),
                submit_ms: job.submit_ms,
                run: RunProvenance::of(node, report, now),
            });
        }
    }
}
