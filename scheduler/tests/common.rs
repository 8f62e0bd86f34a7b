//! Builders shared by the scenario and property tests.
#![allow(dead_code)]

use perch_scheduler::{
    Account, Action, Event, JobId, JobSpec, MINUTE, Millis, Qos, Shape, Time, User,
};

pub fn spec(
    id: u64,
    nodes: u32,
    gpus_per_node: u32,
    account: &str,
    limit: Millis,
    submit: Time,
) -> JobSpec {
    JobSpec {
        id: JobId(id),
        user: User(format!("u-{account}")),
        account: Account(account.to_string()),
        shape: Shape {
            nodes,
            gpus_per_node,
        },
        gpu_model: None,
        time_limit: limit,
        qos: Qos::Normal,
        preemptible: true,
        max_requeues: 1,
        submit,
        oracle_duration: None,
        share: None,
        earlier_runs: 0,
        gpu_profile: None,
    }
}

pub fn one(id: u64, gpus: u32, account: &str, limit_min: i64, submit: Time) -> JobSpec {
    spec(id, 1, gpus, account, limit_min * MINUTE, submit)
}

/// Job `id`'s process exits with code 0.
pub fn exit(id: u64) -> Event {
    Event::JobExited {
        job: JobId(id),
        code: 0,
    }
}

pub fn started(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| {
            if let Action::Start { job, .. } = a {
                Some(job.0)
            } else {
                None
            }
        })
        .collect()
}

pub fn preempted(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| {
            if let Action::Preempt { job, .. } = a {
                Some(job.0)
            } else {
                None
            }
        })
        .collect()
}
