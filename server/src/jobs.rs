//! HTTP routes for jobs, the queue, nodes, and agents' sync. See `GET /` for the list.

use crate::auth::{Identity, Role};
use crate::{ApiError, AppState};
use axum::Extension;
use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use perch_control::ControlError;
use perch_control::api::{
    CancelAnswer, GpuJob, GpuNow, JobUsage, JobView, NodeGpu, NodeInfo, NodeList, NodeStateChange,
    QueueEntry, StartEstimate, Submitted,
};
use perch_control::control::{self, NodeDetail};
use perch_control::record::{JobRecord, JobState, NodeState};
use perch_control::spec::JobRequest;
use perch_model::control::{LogStream, SyncRequest, SyncResponse};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

fn body<T>(payload: Result<Json<T>, JsonRejection>, what: &str) -> Result<T, ApiError> {
    payload.map(|Json(v)| v).map_err(|e| {
        ApiError::json_body(
            &e,
            crate::ErrorCode::MalformedRequest,
            format!("the body is not a valid {what}: {}", e.body_text()),
        )
    })
}

pub async fn submit(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    payload: Result<Json<JobRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    let mut request = body(payload, "job request")?;
    let operator = who.role == Role::Operator;
    if !operator {
        match &request.user {
            Some(u) if *u != who.user => {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    crate::ErrorCode::Forbidden,
                    format!(
                        "you are {}; only operators submit jobs as another user ({u})",
                        who.user
                    ),
                ));
            }
            _ => request.user = Some(who.user.clone()),
        }
    }
    let (job, array_jobs, warning) = state.jobs.submit(request, operator).await?;
    let answer = Submitted {
        job,
        warning,
        array_jobs,
    };
    Ok((StatusCode::CREATED, answer_of(&answer)?))
}

/// `value` as a JSON answer, written through a `serde_json::Value`: its objects' keys come out
/// sorted, as the API has always written them, whatever the order of the fields of the types
/// in `perch_control::api`.
fn to_json(value: &impl Serialize) -> Result<serde_json::Value, ApiError> {
    serde_json::to_value(value).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            crate::ErrorCode::Internal,
            format!("writing the answer failed: {e}"),
        )
    })
}

/// [`to_json`] as the answer's body.
fn answer_of(value: &impl Serialize) -> Result<Json<serde_json::Value>, ApiError> {
    to_json(value).map(Json)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    /// One state or several, comma-separated (`pending,running`).
    state: Option<String>,
    user: Option<String>,
    account: Option<String>,
    limit: Option<usize>,
    /// Only jobs with a smaller id: the `next_before` of the previous page.
    before: Option<u64>,
}

/// Jobs a page holds unless the request says.
const DEFAULT_PAGE: usize = 1_000;

/// `limit`, checked: at least 1 and at most [`perch_control::MAX_PAGE`] (`hint` says what to do then).
fn page_limit(limit: Option<usize>, hint: &str) -> Result<usize, ApiError> {
    match limit.unwrap_or(DEFAULT_PAGE) {
        0 => Err(ApiError::bad_request(
            crate::ErrorCode::BadParameters,
            "limit must be at least 1",
        )),
        n if n > perch_control::MAX_PAGE => Err(ApiError::bad_request(
            crate::ErrorCode::BadParameters,
            format!("limit {n} is above {}{hint}", perch_control::MAX_PAGE),
        )),
        n => Ok(n),
    }
}

/// The states named in `states` (comma-separated), each once: a list of thousands of
/// repeats was compared against every job of the history.
fn parse_states(states: &str) -> Result<Vec<JobState>, ApiError> {
    let mut wanted = Vec::new();
    for s in states.split(',') {
        let state = JobState::parse(s.trim()).ok_or_else(|| {
            ApiError::bad_request(
                crate::ErrorCode::BadParameters,
                format!("state {s:?} is not one of pending, running, completed, failed, cancelled, timeout, preempted, node_fail (several: comma-separated)"),
            )
        })?;
        if !wanted.contains(&state) {
            wanted.push(state);
        }
    }
    Ok(wanted)
}

/// A JSON object written straight into bytes: `{"<key>": [<items>], <tail fields>}`, each item
/// serialized and dropped in turn, so a page is held once, as its text. The items end with the
/// one that takes the text past [`perch_control::MAX_PAGE_BYTES`] (a job's environment full of
/// characters JSON escapes is six times its size); `tail` is told how many were written.
/// Each item goes through a `serde_json::Value` ([`to_json`]), whose keys are sorted. The
/// page's own keys are those of a `perch_control::api` page (its tests read pages back as
/// one).
fn write_page<T: Serialize>(
    key: &str,
    items: impl IntoIterator<Item = T>,
    tail: impl FnOnce(usize) -> serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<u8>, ApiError> {
    let failed = |e: serde_json::Error| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            crate::ErrorCode::Internal,
            format!("writing the page failed: {e}"),
        )
    };
    let mut out = format!("{{{}:[", serde_json::Value::from(key)).into_bytes();
    let mut written = 0;
    for item in items {
        if written > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, &to_json(&item)?).map_err(failed)?;
        written += 1;
        if out.len() >= perch_control::MAX_PAGE_BYTES {
            break;
        }
    }
    out.push(b']');
    for (k, v) in tail(written) {
        out.push(b',');
        serde_json::to_writer(&mut out, &k).map_err(failed)?;
        out.push(b':');
        serde_json::to_writer(&mut out, &v).map_err(failed)?;
    }
    out.push(b'}');
    Ok(out)
}

/// A job as `who` may see it: everything for its owner and operators; for other users the
/// scheduling facts (state, placement, timing, user, account) but not what it runs with, since
/// its command line and environment carry other people's secrets (an API key in `env`, a
/// `--password=` argument). Its logs are the owner's already.
fn as_seen_by<'a>(job: Cow<'a, JobRecord>, who: &Identity) -> JobView<'a> {
    if who.may_act_on(job.request.user()) {
        return JobView::of(job);
    }
    let mut job = job.into_owned();
    job.request.command = vec![HIDDEN.to_owned()];
    job.request.env.clear();
    job.request.workdir = None;
    JobView {
        private: true,
        ..JobView::of(Cow::Owned(job))
    }
}

/// A route's query string, or 400 `bad_parameters` saying what went wrong and which
/// parameters it takes (`hint`).
fn query_params<T>(
    params: Result<Query<T>, axum::extract::rejection::QueryRejection>,
    hint: &str,
) -> Result<T, ApiError> {
    params.map(|Query(p)| p).map_err(|e| {
        ApiError::bad_request(
            crate::ErrorCode::BadParameters,
            format!("{}; use {hint}", e.body_text()),
        )
    })
}

/// What stands for another user's command line.
const HIDDEN: &str = "(hidden: not your job)";

pub async fn list(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    let p = query_params(params, "state, user, account, limit, before")?;
    let wanted = p.state.as_deref().map(parse_states).transpose()?;
    let limit = page_limit(
        p.limit,
        ": ask for pages of at most that many, each with before=<the last page's next_before>",
    )?;
    let before = p.before.unwrap_or(u64::MAX);
    let user = who.user.clone();
    state
        .jobs
        .listing(&user, move |jobs| {
            let (page, next) = jobs.list_jobs(before, limit, |j| {
                wanted.as_ref().is_none_or(|w| w.contains(&j.state))
                    && p.user.as_deref().is_none_or(|u| j.user == u)
                    && p.account.as_deref().is_none_or(|a| j.account == a)
            })?;
            jobs_page(&page, next, &who)
        })
        .await
        .map(page_response)
}

/// A page of jobs as `who` may see them ([`perch_control::api::JobsPage`]); `next` is the `next_before` of a page
/// that holds them all.
fn jobs_page(page: &[JobRecord], next: Option<u64>, who: &Identity) -> Result<Vec<u8>, ApiError> {
    write_page(
        "jobs",
        page.iter().map(|j| as_seen_by(Cow::Borrowed(j), who)),
        |written| {
            // A page cut short by its text goes on after its last job.
            let next = if written < page.len() {
                Some(page[written - 1].id)
            } else {
                next
            };
            serde_json::Map::from_iter([("next_before".into(), next.into())])
        },
    )
}

/// A job listing's page as the answer: its pieces streamed, holding their room among the pages
/// in flight until the client has read the last, or has gone.
fn page_response(page: perch_control::Page) -> axum::response::Response {
    axum::response::IntoResponse::into_response((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(page.into_stream()),
    ))
}

fn live_utilization(state: &AppState, job: &JobRecord) -> Vec<GpuNow> {
    let latest = state.latest.snapshot();
    let mut gpus = Vec::new();
    for p in &job.placement {
        for &gpu in &p.gpus {
            let sample = latest.get(&p.node).and_then(|n| n.gpus.get(&gpu));
            gpus.push(GpuNow {
                node: p.node.clone(),
                gpu,
                utilization_gpu_pct: sample.and_then(|s| s.utilization_gpu_pct),
                memory_used_bytes: sample.and_then(|s| s.memory_used_bytes),
                power_watts: sample.and_then(|s| s.power_watts),
                simulated: sample.map(|s| s.simulated),
            });
        }
    }
    gpus
}

pub async fn show(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(id): Path<u64>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let job = state
        .jobs
        .run(move |c, _| c.view(id)?.ok_or(ControlError::NoSuchJob(id)))
        .await?;
    let mut view = as_seen_by(Cow::Borrowed(&job), &who);
    if job.state == JobState::Running {
        view.gpus_now = Some(live_utilization(&state, &job));
    }
    if job.state == JobState::Pending {
        let at = state
            .jobs
            .estimated_starts(Some(id))
            .await?
            .get(&id)
            .copied();
        view.estimate = Some(estimate(at));
    }
    if job.attempts > 0 {
        view.usage = Some(usage(&state, &job));
    }
    answer_of(&view)
}

/// A job's provenance record (what it ran: commit, diff, image, packages, each attempt's
/// environment and node versions), to its user and operators only, as its output is. A job
/// with nothing recorded answers an empty record (`submit` null, no `runs`), so asking is
/// never an error for a job that exists; 404 only for a job that does not.
pub async fn provenance(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(id): Path<u64>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let jobs = state.jobs.clone();
    let record = tokio::task::spawn_blocking(move || jobs.provenance_for(id, &who))
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))??;
    answer_of(&record)
}

/// The job's accounting as the `jobs` table has it (the one definition), with a note while
/// its telemetry figures lag behind: they are folded every `fold_interval` from samples at
/// least `settle` old, so a job's first figures come minutes after it starts. `None` when the
/// row could not be read.
fn usage(state: &AppState, job: &JobRecord) -> Option<JobUsage> {
    let (id, running) = (job.id, job.state == JobState::Running);
    let row =
        crate::accounting::tables::job_json(job, &state.config.accounting, state.jobs.now_ms())
            .and_then(|row| {
                // The row's other columns are not part of the answer.
                serde_json::from_value::<JobUsage>(serde_json::Value::Object(row))
                    .map_err(|e| e.to_string())
            });
    let mut usage = match row {
        Ok(usage) => usage,
        Err(e) => {
            tracing::warn!(job = id, error = %e, "could not read the job's accounting");
            return None;
        }
    };
    // Within the accounted window, as `cost_accounted` and `idle_cost` are (the row's).
    usage.efficiency =
        perch_control::cost::efficiency(usage.gpu_seconds_used, usage.gpu_seconds_accounted);
    let config = &state.config.accounting;
    let (fold, settle) = (config.fold_interval.as_secs(), config.settle.as_secs());
    let folded = usage.gpu_seconds_accounted.unwrap_or(0.0) > 0.0;
    let elapsed = usage.elapsed_seconds.unwrap_or(0.0);
    let complete = !running && usage.accounted_until == usage.end_time;
    let note = if running && !folded && elapsed <= (fold + settle) as f64 {
        Some(format!(
            "telemetry figures (GPU-seconds accounted and used, efficiency, utilization, energy, cost accounted, used and idle) are folded every {fold} s from samples at least {settle} s old: the first ones appear within {} s of the job's start",
            fold + settle
        ))
    } else if running && !folded {
        Some("no utilization folded yet: its GPUs have not reported any (see gpu_samples)".into())
    } else if running {
        Some(format!(
            "telemetry figures (GPU-seconds accounted and used, efficiency, energy, cost accounted, used and idle) cover the job up to accounted_until and lag it by {settle} to {} s; GPU-seconds and cost allocated run to now",
            fold + settle
        ))
    } else if !complete {
        Some(format!(
            "the rest of its telemetry is folded once its last samples are {settle} s old"
        ))
    } else {
        None
    };
    usage.note = note;
    Some(usage)
}

pub async fn cancel(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(id): Path<u64>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let job = state
        .jobs
        .run(move |c, now| {
            c.check_owner(id, &who)?;
            c.cancel(id, &who.user, now)
        })
        .await?;
    Ok(Json(serde_json::to_value(job).unwrap_or_default()))
}

/// A batch cancel (`POST /v1/jobs/cancel`): job ids, or filters that every job to cancel
/// matches.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    #[serde(default)]
    ids: Vec<u64>,
    /// An array's id (its first task's).
    array: Option<u64>,
    user: Option<String>,
    account: Option<String>,
    name: Option<String>,
    /// `pending` or `running`.
    state: Option<JobState>,
}

pub async fn cancel_many(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    payload: Result<Json<CancelRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let r = body(
        payload,
        "cancel request (ids, or array, user, account, name, state)",
    )?;
    let selection = control::CancelSelection {
        ids: r.ids,
        array: r.array,
        user: r.user,
        account: r.account,
        name: r.name,
        state: r.state,
    };
    let outcome = state.jobs.cancel_many(selection, who).await?;
    answer_of(&CancelAnswer::from(outcome))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogParams {
    stream: Option<LogStream>,
    offset: Option<u64>,
    /// Which attempt (default: the latest).
    attempt: Option<u32>,
    /// Which node of a multi-node job, by rank (default 0).
    rank: Option<usize>,
}

pub async fn logs(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(id): Path<u64>,
    params: Result<Query<LogParams>, axum::extract::rejection::QueryRejection>,
) -> Result<(axum::http::HeaderMap, Vec<u8>), ApiError> {
    let p = query_params(
        params,
        "stream=stdout|stderr, offset, attempt and rank (numbers)",
    )?;
    let stream = p.stream.unwrap_or(LogStream::Stdout);
    let offset = p.offset.unwrap_or(0);
    let (attempt, rank) = (p.attempt, p.rank);
    let (source, finished) = state
        .jobs
        .run(move |c, _| {
            c.check_owner(id, &who)?;
            let source = c.log_source(id, stream, attempt, rank)?;
            Ok((source, c.find(id).is_some_and(|j| j.state().is_final())))
        })
        .await?;
    // Read outside the control plane, a page at a time: a job's output may be gigabytes.
    let page = tokio::task::spawn_blocking(move || source.read(offset, control::LOG_PAGE))
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))?
        .map_err(ControlError::Logs)?;
    let mut headers = axum::http::HeaderMap::new();
    headers.insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(
        "x-perch-job-finished",
        axum::http::HeaderValue::from_static(if finished { "true" } else { "false" }),
    );
    // A follower sees a requeue here: the new attempt's output starts again at offset 0.
    headers.insert(
        "x-perch-attempt",
        axum::http::HeaderValue::from(page.attempt),
    );
    // More is stored past this page: read on from `offset` + its length.
    headers.insert(
        "x-perch-log-more",
        axum::http::HeaderValue::from_static(if page.more { "true" } else { "false" }),
    );
    headers.insert(
        "x-perch-log-size",
        axum::http::HeaderValue::from(page.stored),
    );
    // Bytes the node has yet to send (it ships a job's output on after the job ends).
    if let Some(pending) = page.pending {
        headers.insert(
            "x-perch-log-pending",
            axum::http::HeaderValue::from(pending),
        );
    }
    Ok((headers, page.data))
}

/// `estimated_start_ms` and `estimated_start` (RFC 3339) of a pending job, `null` without one.
fn estimate(at: Option<i64>) -> StartEstimate {
    StartEstimate {
        estimated_start_ms: at,
        estimated_start: at.map(perch_alerts::rfc3339),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueParams {
    /// Estimate each job's start (`squeue --start`).
    #[serde(default)]
    start: bool,
    /// The first this many of the queue (`total` says how long it is).
    limit: Option<usize>,
}

pub async fn queue(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    params: Result<Query<QueueParams>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    let params = query_params(params, "start, limit")?;
    let limit = page_limit(params.limit, ": the queue is shown from its head")?;
    let estimates = if params.start {
        Some(state.jobs.estimated_starts(None).await?)
    } else {
        None
    };
    let user = who.user.clone();
    state
        .jobs
        .listing(&user, move |jobs| {
            // Made within the listing's room: the copies of the jobs are the page's memory.
            let (entries, total) = jobs.queue_page(limit)?;
            queue_page(entries, total, estimates.as_ref(), &who)
        })
        .await
        .map(page_response)
}

/// The head of the queue as `who` may see it ([`perch_control::api::QueueView`]), each job with its estimated
/// start when `estimates` are given.
fn queue_page(
    entries: Vec<(JobRecord, Option<f64>)>,
    total: usize,
    estimates: Option<&std::collections::HashMap<u64, i64>>,
    who: &Identity,
) -> Result<Vec<u8>, ApiError> {
    // Held jobs (waiting for dependencies) have no place in line yet: position and priority
    // are null.
    let entries = entries
        .into_iter()
        .enumerate()
        .map(|(i, (job, priority))| QueueEntry {
            position: priority.map(|_| i + 1),
            priority,
            estimate: estimates.map(|e| estimate(e.get(&job.id).copied())),
            job: as_seen_by(Cow::Owned(job), who),
        });
    write_page("queue", entries, |_| {
        serde_json::Map::from_iter([("total".into(), total.into())])
    })
}

/// Every node, sorted by name: those whose agents sync (nodes with GPUs) and those that only
/// send telemetry, each with its one state ([`crate::node_status`]).
pub async fn nodes(State(state): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    let mut details: std::collections::HashMap<String, NodeDetail> = state
        .jobs
        .run(|c, _| Ok(c.nodes()))
        .await?
        .into_iter()
        .map(|n| (n.name.clone(), n))
        .collect();
    let now = state.now_ms();
    let secs_ago = |t: i64| (now - t) as f64 / 1000.0;
    let statuses = crate::node_status::current(&state, now);
    let nodes: Vec<NodeInfo> = state.latest.read(|latest| {
        statuses
            .into_iter()
            .map(|(name, status)| {
                // A node that only sends telemetry (no GPUs) has no control-plane details.
                let detail = details.remove(&name);
                let d = detail.as_ref();
                let samples = latest.get(&name).map(|n| &n.gpus);
                NodeInfo {
                    gpu_status: gpu_status(d, samples, now),
                    gpus: d.map_or(0, |d| d.gpus),
                    gpu_model: d.map_or("", |d| &d.gpu_model).to_owned(),
                    rack: d.map_or("", |d| &d.rack).to_owned(),
                    allocated_gpus: d.map_or(0, |d| d.allocated_gpus),
                    jobs: d
                        .map(|d| d.jobs.iter().copied().collect())
                        .unwrap_or_default(),
                    gpu_sharing: d.is_some_and(|d| d.gpu_sharing),
                    nvlink_islands: d.map(|d| d.nvlink_islands.clone()).unwrap_or_default(),
                    last_sync_secs_ago: d.map(|d| secs_ago(d.last_sync_ms)),
                    state: status.state.as_str().to_owned(),
                    last_sample_secs_ago: status.last_sample_ms.map(secs_ago),
                    name,
                }
            })
            .collect()
    });
    answer_of(&NodeList { nodes })
}

/// Each GPU of a node: who holds it and its health from the control plane, what it does from
/// its latest sample. GPUs the control plane does not know (a node that only sends telemetry)
/// come from the samples alone.
fn gpu_status(
    detail: Option<&NodeDetail>,
    samples: Option<&std::collections::BTreeMap<u32, perch_model::GpuSample>>,
    now: i64,
) -> Vec<NodeGpu> {
    use perch_scheduler::GpuHealth;
    // The GPUs the control plane knows and those that sent samples, each once. Not a range
    // up to the highest sampled index: an agent may report GPU 4,000,000,000.
    let known = detail.map_or(0, |d| d.gpu_detail.len() as u32);
    let extra = samples
        .into_iter()
        .flat_map(|s| s.keys().copied())
        .filter(|&g| g >= known);
    (0..known)
        .chain(extra)
        .map(|index| {
            let d = detail.and_then(|d| d.gpu_detail.get(index as usize));
            let s = samples.and_then(|s| s.get(&index));
            let (health, xid) = match d.map_or(GpuHealth::Healthy, |d| d.health) {
                GpuHealth::Healthy => ("healthy", None),
                GpuHealth::Xid(code) => ("xid", Some(code)),
                GpuHealth::UncorrectableEcc => ("uncorrectable_ecc", None),
                GpuHealth::RogueProcess => ("rogue_process", None),
                GpuHealth::TakenOut => ("taken_out", None),
            };
            NodeGpu {
                index,
                jobs: d.map_or_else(Vec::new, |d| {
                    d.holders
                        .iter()
                        .map(|h| GpuJob {
                            job: h.job,
                            user: h.user.clone(),
                            account: h.account.clone(),
                            share_percent: h.share_percent,
                        })
                        .collect()
                }),
                health: health.to_owned(),
                xid,
                uuid: s.map(|s| s.uuid.clone()),
                simulated: s.map(|s| s.simulated),
                utilization_gpu_pct: s.and_then(|s| s.utilization_gpu_pct),
                memory_used_bytes: s.and_then(|s| s.memory_used_bytes),
                memory_total_bytes: s.and_then(|s| s.memory_total_bytes),
                power_watts: s.and_then(|s| s.power_watts),
                temperature_celsius: s.and_then(|s| s.temperature_celsius),
                sample_ms: s.map(|s| s.time_ms),
                sample_secs_ago: s.map(|s| (now - s.time_ms) as f64 / 1000.0),
                mig_instances: d.map_or_else(Vec::new, |d| d.mig.clone()),
            }
        })
        .collect()
}

async fn set_drained(
    state: AppState,
    who: Identity,
    name: String,
    drained: bool,
    reason: Option<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let n = name.clone();
    state
        .jobs
        .run(move |c, now| c.set_drained(&n, drained, &who.user, reason, now))
        .await?;
    let state = if drained {
        NodeState::Drained
    } else {
        NodeState::Up
    };
    answer_of(&NodeStateChange { node: name, state })
}

/// The optional body of `POST /v1/nodes/{name}/drain`: why the node is drained (the `nodes`
/// table's `reason`, the `node_drained` event's message).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    #[serde(default)]
    reason: Option<String>,
}

/// The drain's reason from its body: none (an empty body, `null`), or `{"reason": "..."}`.
fn drain_reason(raw: &[u8]) -> Result<Option<String>, ApiError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let body: Option<DrainBody> = serde_json::from_slice(raw).map_err(|e| {
        ApiError::bad_request(
            crate::ErrorCode::MalformedRequest,
            format!(
                "the drain's body is not valid: {e}; send nothing, or {{\"reason\": \"fan noise\"}}"
            ),
        )
    })?;
    Ok(body
        .and_then(|b| b.reason)
        .map(|r| r.trim().to_owned())
        .filter(|r| !r.is_empty()))
}

pub async fn drain(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(name): Path<String>,
    raw: axum::body::Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let reason = drain_reason(&raw)?;
    set_drained(state, who, name, true, reason).await
}

pub async fn resume(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    set_drained(state, who, name, false, None).await
}

/// How long a node waits before its next sync (ms): the fleet's syncs spread to at most
/// `server.max_syncs_per_second`, and never so slow that a quarter of the heartbeat timeout or
/// of the lease passes without one (a node is down only after four missed syncs).
pub fn sync_pace(state: &AppState) -> u64 {
    pace(
        state.jobs.known_node_count(),
        state.config.max_syncs_per_second,
        state
            .config
            .jobs
            .heartbeat_timeout
            .min(state.config.jobs.lease),
    )
}

fn pace(nodes: usize, per_second: u32, timeout: std::time::Duration) -> u64 {
    let spread = (nodes as u64).saturating_mul(1000) / u64::from(per_second.max(1));
    spread.min(u64::try_from(timeout.as_millis() / 4).unwrap_or(u64::MAX))
}

pub async fn sync(
    State(state): State<AppState>,
    Extension(who): Extension<Identity>,
    payload: Result<Json<SyncRequest>, JsonRejection>,
) -> Result<Json<SyncResponse>, ApiError> {
    let mut request = body(payload, "agent sync request")?;
    request.node.validate().map_err(|e| {
        ApiError::bad_request(crate::ErrorCode::InvalidSync, format!("field `node`: {e}"))
    })?;
    who.may_speak_for(request.node.as_str()).map_err(|m| {
        crate::ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            crate::ErrorCode::Forbidden,
            m,
        )
    })?;
    if who.role == crate::auth::Role::Agent && request.agent_id.is_none() {
        // The node's claim is checked against the agent's id: a sync without one would report
        // the node's jobs as gone, and have the claiming agent's jobs killed.
        return Err(ApiError::bad_request(
            crate::ErrorCode::InvalidSync,
            "field `agent_id`: an agent token's sync must carry its agent's id (perch agents send it); upgrade this node's agent",
        ));
    }
    if request.gpus > perch_scheduler::MAX_GPUS_PER_NODE {
        return Err(ApiError::bad_request(
            crate::ErrorCode::InvalidSync,
            format!(
                "field `gpus`: {} GPUs on one node, more than the {} a node may have; if they \
                 are simulated, give the agent fewer (agent.simulate_gpus, --simulate-gpus)",
                request.gpus,
                perch_scheduler::MAX_GPUS_PER_NODE
            ),
        ));
    }
    let node = request.node.as_str().to_owned();
    if state.jobs.failing().is_some() {
        // The node's lease is renewed however long the job database takes to come back; the
        // agent keeps its exits, output and command results for a later sync.
        let mut response = state.jobs.sync_degraded(request).await?;
        response.ingest_url = state.config.cluster.ingest_url(&node, state.now_ms());
        response.next_sync_ms = Some(sync_pace(&state));
        return Ok(Json(response));
    }
    state
        .node_commands
        .deliver(std::mem::take(&mut request.command_results));
    let mut response = state.jobs.run(move |c, now| c.sync(request, now)).await?;
    response.commands = state.node_commands.take(&node);
    response.ingest_url = state.config.cluster.ingest_url(&node, state.now_ms());
    response.next_sync_ms = Some(sync_pace(&state));
    Ok(Json(response))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Role;

    #[test]
    fn syncs_are_paced_to_the_fleet_and_never_past_a_quarter_of_the_timeout() {
        let minute = std::time::Duration::from_secs(60);
        assert_eq!(
            pace(100, 2_000, minute),
            50,
            "a small fleet: the agent's own pace"
        );
        assert_eq!(pace(1_000, 2_000, minute), 500);
        assert_eq!(pace(10_000, 2_000, minute), 5_000);
        assert_eq!(
            pace(1_000_000, 2_000, minute),
            15_000,
            "a quarter of the timeout"
        );
        assert_eq!(
            pace(10, 0, minute),
            10_000,
            "a zero rate is read as one a second"
        );
    }
    use perch_control::api::{JobsPage, QueueView};
    use perch_control::record::{Allocation, ArrayTask};

    fn caller(user: &str, role: Role) -> Identity {
        Identity {
            user: user.into(),
            role,
            nodes: None,
            job: None,
        }
    }

    /// Alice's job `id`, which ran once on `n1`: with an environment, a working directory and
    /// figures of every kind.
    fn job(id: u64, state: JobState) -> JobRecord {
        let mut job: JobRecord = serde_json::from_value(serde_json::json!({
            "id": id,
            "request": {
                "command": ["python", "train.py", "--password=\"s3cret\""],
                "env": {"API_KEY": "k\u{e9}y\n", "B": "2"},
                "workdir": "/home/alice/run",
                "user": "alice",
                "gpu_share": {"fraction": 0.25, "memory_gb": 10.0},
                "memory_mb": 2048,
            },
            "state": state,
            "reason": "Priority",
            "submit_ms": 1_000,
            "start_ms": 2_000,
            "end_ms": null,
            "placement": [{"node": "n1", "gpus": [0], "delivered": true, "exit_code": 0}],
            "attempts": 1,
            "requeues": 0,
            "preemptions": 0,
            "exit_code": null,
            "timeline": [{"time_ms": 1_000, "event": "submitted"}],
            "master_port": 29_500,
        }))
        .expect("record");
        let mut a = Allocation::new(1, "n1".into(), vec![0], "H100".into(), 2_000, true);
        a.end_ms = Some(62_000);
        a.folded_until_ms = 62_000;
        a.share_percent = Some(25);
        a.output_bytes = Some([10, 0]);
        a.usage[0].samples = 6;
        a.usage[0].util_sum = 300.0;
        a.usage[0].util_max = Some(75.5);
        job.allocations.push(a);
        job.array = Some(ArrayTask {
            job_id: id,
            task_id: 0,
        });
        job
    }

    /// A page of jobs reads back as the API's page type, another user's job hidden in it.
    #[test]
    fn a_page_of_jobs_reads_as_the_api_says() {
        let jobs = [job(2, JobState::Running), job(1, JobState::Pending)];
        let text = jobs_page(&jobs, Some(1), &caller("bob", Role::User)).expect("page");
        let page: JobsPage<'static> = serde_json::from_slice(&text).expect("a JobsPage");
        assert_eq!(page.next_before, Some(1));
        assert_eq!(page.jobs.len(), 2);
        let seen = &page.jobs[0];
        assert!(seen.private);
        assert_eq!(seen.record.request.command, [HIDDEN]);
        assert!(seen.record.request.env.is_empty());
        assert_eq!(seen.record.request.workdir, None);
        let hidden = JobRecord {
            request: seen.record.request.clone(),
            ..jobs[0].clone()
        };
        assert_eq!(*seen.record, hidden, "the rest as it is");
        let own = jobs_page(&jobs, None, &caller("alice", Role::User)).expect("page");
        let page: JobsPage<'static> = serde_json::from_slice(&own).expect("a JobsPage");
        assert!(!page.jobs[1].private);
        assert_eq!(*page.jobs[1].record, jobs[1]);
    }

    #[test]
    fn the_queue_reads_as_the_api_says() {
        let entries = vec![
            (job(3, JobState::Pending), Some(0.75)),
            (job(4, JobState::Pending), None),
        ];
        let estimates = std::collections::HashMap::from([(3, 5_000)]);
        let text =
            queue_page(entries, 9, Some(&estimates), &caller("ops", Role::Operator)).expect("page");
        let queue: QueueView<'static> = serde_json::from_slice(&text).expect("a QueueView");
        assert_eq!(queue.total, 9);
        let [first, held] = &queue.queue[..] else {
            panic!("two entries: {queue:?}")
        };
        assert_eq!((first.position, first.priority), (Some(1), Some(0.75)));
        assert_eq!(first.estimate, Some(estimate(Some(5_000))));
        assert_eq!((held.position, held.priority), (None, None));
        assert_eq!(held.estimate, Some(estimate(None)));
        assert!(!first.job.private, "an operator sees every job");
        let text = queue_page(
            vec![(job(3, JobState::Pending), Some(0.5))],
            1,
            None,
            &caller("ops", Role::Operator),
        )
        .expect("page");
        let queue: QueueView<'static> = serde_json::from_slice(&text).expect("a QueueView");
        assert_eq!(queue.queue[0].estimate, None, "estimates only when asked");
    }

    /// The accounting in `GET /v1/jobs/{id}` is the `jobs` table's row, each figure written as
    /// the table writes it.
    #[test]
    fn usage_holds_the_jobs_rows_figures() {
        let mut ended = job(5, JobState::Completed);
        ended.end_ms = Some(62_000);
        let config = crate::accounting::AccountingConfig::default();
        let row = crate::accounting::tables::job_json(&ended, &config, 100_000).expect("row");
        let usage: JobUsage =
            serde_json::from_value(serde_json::Value::Object(row.clone())).expect("usage");
        let written = serde_json::to_value(&usage).expect("json");
        let written = written.as_object().expect("an object");
        // Efficiency is worked out by `usage` from two of them; the rest are the row's.
        assert_eq!(written.len(), 13);
        for (key, value) in written.iter().filter(|(k, _)| *k != "efficiency") {
            assert_eq!(
                value.to_string(),
                row[key].to_string(),
                "{key}: as the row has it"
            );
        }
        assert_eq!(usage.gpu_seconds_allocated, Some(15.0));
        assert!(usage.accounted_until.is_some() && usage.accounted_until == usage.end_time);
    }

    /// A state list is each state once however often it is named (thousands of repeats were
    /// each compared against every job of the history); a wrong name is refused.
    #[test]
    fn states_are_each_taken_once() {
        let many = "pending,running,".repeat(4_000);
        let states = parse_states(many.trim_end_matches(',')).expect("states");
        assert_eq!(states, vec![JobState::Pending, JobState::Running]);
        let e = parse_states("running,sleeping").expect_err("no such state");
        assert!(
            e.message.contains("\"sleeping\" is not one of"),
            "{}",
            e.message
        );
    }

    /// A node that only sends telemetry lists the GPUs it sampled, however their indices run:
    /// an agent reporting GPU 4,000,000,000 gets one entry, not four billion.
    #[test]
    fn a_sampled_gpu_far_off_is_one_entry() {
        let sample = |gpu: u32| perch_model::GpuSample {
            gpu: perch_model::GpuIndex(gpu),
            time_ms: 1,
            ..perch_model::GpuSample::default()
        };
        let samples: std::collections::BTreeMap<u32, perch_model::GpuSample> =
            [(0, sample(0)), (4_000_000_000, sample(4_000_000_000))].into();
        let listed: Vec<u32> = gpu_status(None, Some(&samples), 2)
            .iter()
            .map(|g| g.index)
            .collect();
        assert_eq!(listed, vec![0, 4_000_000_000]);
        assert!(gpu_status(None, None, 2).is_empty());
    }

    #[test]
    fn a_drain_takes_an_optional_reason_and_says_what_to_send() {
        assert_eq!(drain_reason(b"").ok(), Some(None));
        assert_eq!(drain_reason(b" \n").ok(), Some(None));
        assert_eq!(drain_reason(b"{}").ok(), Some(None));
        assert_eq!(drain_reason(b"null").ok(), Some(None), "the CLI's body");
        assert_eq!(
            drain_reason(br#"{"reason": " fan noise "}"#).ok(),
            Some(Some("fan noise".to_owned()))
        );
        assert_eq!(drain_reason(br#"{"reason": "  "}"#).ok(), Some(None));
        for bad in [&br#"{"why": "x"}"#[..], b"fan noise", br#"{"reason": 3}"#] {
            let e = drain_reason(bad).expect_err("refused");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(
                e.message.contains(r#"{"reason": "fan noise"}"#),
                "{}",
                e.message
            );
        }
    }
}
