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
            .push(ProvenanceChange::Submitted(Box::new(ProvenanceRecord {
                job,
                user: user.to_owned(),
                submit_ms: now,
                submit: Some(p),
                runs: Vec::new(),
                runs_dropped: 0,
            })));
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

#[cfg(test)]
mod tests {
    use crate::{ControlError, JobService, JobsConfig};
    use perch_model::control::SyncRequest;
    use perch_model::identity::{Identity, Role};
    use serde_json::json;

    fn who(user: &str, role: Role) -> Identity {
        Identity {
            user: user.into(),
            role,
            nodes: None,
            job: None,
        }
    }

    async fn sync(jobs: &JobService, node: &str, extra: serde_json::Value) {
        let mut req = json!({"node": node, "gpus": 1, "gpu_model": "Test H100"});
        if let (Some(r), Some(e)) = (req.as_object_mut(), extra.as_object()) {
            r.extend(e.clone());
        }
        let req: SyncRequest = serde_json::from_value(req).expect("sync request");
        let now = jobs.now_ms();
        jobs.run(move |c, _| c.sync(req, now)).await.expect("sync");
    }

    fn report(job: u64, token: &str) -> serde_json::Value {
        json!({"started": [{"job": job, "attempt": 1, "driver_version": "550.54.15",
            "env": {"CUDA_VISIBLE_DEVICES": "0", "WANDB_API_KEY": token}}]})
    }

    /// The submit side is stored with the job; a node's report is kept only from the node the
    /// run was placed on, its secrets redacted again; only the owner and operators read it;
    /// a rerun may name only a job its user may run.
    #[tokio::test]
    async fn reports_are_taken_from_the_runs_node_and_read_by_its_owner() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tx, _rx) = JobService::event_channel();
        let jobs = JobService::open_embedded(dir.path(), JobsConfig::default(), tx).expect("jobs");
        sync(&jobs, "a", json!({})).await;
        let request = serde_json::from_value(json!({
            "command": ["train"], "user": "alice",
            "provenance": {"submit_dir": "/src", "git": {"root": "/src", "commit": "abcdef12"}}
        }))
        .expect("request");
        let (job, _, _) = jobs.submit(request, false).await.expect("submit");
        assert!(
            job.request.provenance.is_none(),
            "not kept in the job's record"
        );
        sync(&jobs, "b", json!({})).await;
        sync(&jobs, "b", report(job.id, "from-b")).await;
        sync(&jobs, "a", report(job.id, "from-a")).await;
        let alice = who("alice", Role::User);
        let p = jobs.provenance_for(job.id, &alice).expect("read");
        let git = p.submit.and_then(|s| s.git).expect("git");
        assert_eq!(git.commit, "abcdef12");
        assert_eq!(p.runs.len(), 1, "{:?}", p.runs);
        assert_eq!(p.runs[0].node, "a");
        assert_eq!(p.runs[0].env["WANDB_API_KEY"], "<redacted>");
        assert!(matches!(
            jobs.provenance_for(job.id, &who("bob", Role::User)),
            Err(ControlError::Forbidden(_))
        ));
        assert!(
            jobs.provenance_for(job.id, &who("ops", Role::Operator))
                .expect("read")
                .submit
                .is_some()
        );
        let rerun = |user: &str| {
            serde_json::from_value(json!({
                "command": ["train"], "user": user, "provenance": {"rerun_of": job.id}
            }))
            .expect("request")
        };
        assert!(matches!(
            jobs.submit(rerun("bob"), false).await,
            Err(ControlError::Forbidden(_))
        ));
        let (again, _, _) = jobs.submit(rerun("alice"), false).await.expect("rerun");
        let p = jobs.provenance_for(again.id, &alice).expect("read");
        assert_eq!(p.submit.and_then(|s| s.rerun_of), Some(job.id));
        // Nothing recorded (the API without provenance): an empty record, not an error; a
        // job that does not exist is one.
        let plain = serde_json::from_value(json!({"command": ["train"], "user": "alice"}))
            .expect("request");
        let (plain, _, _) = jobs.submit(plain, false).await.expect("submit");
        let p = jobs.provenance_for(plain.id, &alice).expect("read");
        assert!(p.submit.is_none() && p.runs.is_empty(), "{p:?}");
        assert_eq!((p.job, p.user.as_str()), (plain.id, "alice"));
        assert!(matches!(
            jobs.provenance_for(plain.id + 100, &alice),
            Err(ControlError::NoSuchJob(_))
        ));
    }
}
