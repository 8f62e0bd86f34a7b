//! What the control plane shows: jobs, the queue with reasons, nodes, start estimates and
//! idle consequences. Plain data; the HTTP edge turns it into JSON.

use super::*;

/// One node as the control plane sees it (`GET /v1/nodes` adds its state).
#[derive(Debug, Clone, PartialEq)]
pub struct NodeDetail {
    pub name: String,
    pub gpus: u32,
    pub gpu_model: String,
    pub rack: String,
    /// GPUs held by at least one job.
    pub allocated_gpus: usize,
    /// The jobs holding its GPUs.
    pub jobs: BTreeSet<u64>,
    pub gpu_sharing: bool,
    pub nvlink_islands: Vec<Vec<u32>>,
    /// When its agent last synced (server time, ms).
    pub last_sync_ms: i64,
    /// Each GPU, by index: who holds it and its health.
    pub gpu_detail: Vec<GpuDetail>,
}

/// One GPU as the control plane sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuDetail {
    /// The jobs on it: its whole owner, or its sharers with the percent each was granted.
    pub holders: Vec<GpuHolder>,
    pub health: perch_scheduler::GpuHealth,
    /// Its MIG instances, each with the job holding it.
    pub mig: Vec<crate::api::GpuMig>,
}

/// A job holding (part of) a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuHolder {
    pub job: u64,
    pub user: String,
    pub account: String,
    /// The granted percent of a shared GPU; `None` when the job holds it whole.
    pub share_percent: Option<u32>,
}

/// The head of the queue, each job with its priority (`None`: held for dependencies), and
/// how many jobs are pending in all ([`Control::queue`]).
pub type QueuePage = (Vec<(JobRecord, Option<f64>)>, usize);

impl Control {
    /// About how many bytes job `id`'s record takes ([`JobRecord::weight`]); a job not held in
    /// memory (settled, or none) counts as an empty record: changing it writes nothing.
    pub fn weight(&self, id: u64) -> usize {
        self.jobs
            .get(&id)
            .map_or(crate::record::RECORD_BYTES, JobRecord::weight)
    }

    /// A record with its live pending reason filled in; a settled job's is read from the
    /// job database.
    pub fn view(&self, id: u64) -> Result<Option<JobRecord>, ControlError> {
        match self.jobs.get(&id) {
            Some(job) => Ok(Some(self.view_of(job))),
            None => Ok(self.record(id)?.map(|job| job.into_owned())),
        }
    }

    /// A copy of `job`, held in memory, with its live pending reason filled in.
    pub fn view_of(&self, job: &JobRecord) -> JobRecord {
        let id = job.id;
        let mut job = job.clone();
        if self.held.contains(&id) {
            let r = &job.request;
            let not_ok = if r.after_not_ok.is_empty() {
                String::new()
            } else {
                format!(", after_not_ok {:?}", r.after_not_ok)
            };
            job.reason = Some(format!(
                "waiting for dependencies: after_ok {:?}, after_any {:?}{not_ok}",
                r.after_ok, r.after_any
            ));
        } else if job.state == JobState::Pending {
            let shared = job.request.gpu_share.is_some();
            let profile = job.request.gpu_profile.as_deref();
            job.reason = self
                .scheduler
                .pending_reason(JobId(id))
                .as_ref()
                .map(|r| match r {
                    PendingReason::Unsatisfiable if shared => "no node in the cluster takes shared GPU jobs (agent.gpu_sharing) with that much GPU memory; cancel it or enable sharing on a node".into(),
                    PendingReason::Resources if shared => "waiting for a GPU whose shares, measured utilization and free memory leave room".into(),
                PendingReason::Unsatisfiable if profile.is_some() => format!("no node reports a MIG instance of profile {} (operators partition GPUs with nvidia-smi mig); cancel it or ask for a profile `perch nodes` lists", profile.unwrap_or_default()),
                PendingReason::Resources if profile.is_some() => format!("waiting for a free {} MIG instance (every one is held)", profile.unwrap_or_default()),
                    r => {
                        let text = reason_text(r, self.now);
                        match self.reason_detail(&job, r) {
                            Some(detail) => format!("{text}: {detail}"),
                            None => text,
                        }
                    }
                });
        }
        job
    }

    /// What a pending job waits for, in numbers ("needs 2 nodes x 8 GPUs; 1 node has 8 free,
    /// 12 free in all"; "account vision holds 32 of its quota of 32").
    pub(super) fn reason_detail(&self, job: &JobRecord, reason: &PendingReason) -> Option<String> {
        let id = JobId(job.id);
        match reason {
            PendingReason::QuotaExceeded => {
                let account = Account(job.request.account().to_owned());
                let mut held = Vec::new();
                if let Some(quota) = self.scheduler.account_quota(&account) {
                    let holds = self.scheduler.account_alloc(&account);
                    held.push(format!("{holds} of its quota of {quota} GPUs"));
                }
                let wanted = job.request.gpu_model.as_deref();
                for (model, holds, cap) in self.scheduler.model_quota_use(&account) {
                    if wanted.is_none_or(|w| w == model.0) {
                        held.push(format!("{holds} of its {cap} {} GPUs", model.0));
                    }
                }
                if held.is_empty() {
                    return None;
                }
                Some(format!(
                    "account {} holds {}{}",
                    account.0,
                    held.join(", "),
                    if !self.config.policy.borrowing {
                        " (borrowing is off)"
                    } else if !job.request.preemptible {
                        "; only preemptible jobs borrow idle GPUs (the accounts they belong to \
                         take them back): cancel it and resubmit it with --preemptible to borrow"
                    } else {
                        "; no idle GPUs to borrow"
                    }
                ))
            }
            PendingReason::Resources
            | PendingReason::Reserved { .. }
            | PendingReason::Priority
            | PendingReason::FifoBlocked => {
                let (nodes, per_node, fitting, free) = self.scheduler.room_for(id)?;
                let model = job
                    .request
                    .gpu_model
                    .as_deref()
                    .map(|m| format!(" {m}"))
                    .unwrap_or_default();
                let gpus = if per_node == 1 { "GPU" } else { "GPUs" };
                let shape = if nodes == 1 {
                    format!("{per_node}{model} {gpus} on one node")
                } else {
                    format!("{nodes} nodes x {per_node}{model} {gpus}")
                };
                let nodes_word = if fitting == 1 {
                    "node has"
                } else {
                    "nodes have"
                };
                Some(format!(
                    "needs {shape}; {fitting} {nodes_word} {per_node} free now, {free} GPUs free in all"
                ))
            }
            PendingReason::New | PendingReason::Unsatisfiable => None,
        }
    }

    /// The job and user a job metrics token speaks for: the token must be this server's, for
    /// the job's current attempt, and the job running or ended less than a minute ago.
    pub fn job_of_token(&self, token: &str, now: i64) -> Option<(u64, String)> {
        let (id, attempt) = self.job_tokens.verify(token)?;
        let job = self.jobs.get(&id)?;
        let live = job.state == JobState::Running
            || job
                .end_ms
                .is_some_and(|end| now - end <= crate::job_token::GRACE_MS);
        (job.attempts == attempt && live).then(|| (id, job.request.user().to_owned()))
    }

    /// Why no set of the nodes this cluster has seen (up, down or drained) could ever run
    /// `req`, saying what would fit, or `None` when one could (or no node has joined yet: the
    /// cluster is still forming). Such a job is refused unless it asks to wait for larger
    /// nodes (`hold_until_fits`), and then its submitter is told this at once.
    pub fn shape_warning(&self, req: &JobRequest) -> Option<String> {
        if self.nodes.is_empty() || req.gpu_share.is_some() {
            return None;
        }
        if let Some(profile) = &req.gpu_profile {
            return self.profile_warning(req, profile);
        }
        let model_ok = |n: &Node| req.gpu_model.as_ref().is_none_or(|m| *m == n.record.model);
        let fitting = self
            .nodes
            .iter()
            .filter(|n| model_ok(n) && n.record.gpus >= req.gpus_per_node)
            .count();
        if fitting >= req.nodes as usize {
            return None;
        }
        let seen = format!("the {} node(s) this cluster has seen", self.nodes.len());
        let model = req
            .gpu_model
            .as_ref()
            .map_or(String::new(), |m| format!(" {m}"));
        let of_model: Vec<u32> = self
            .nodes
            .iter()
            .filter(|n| model_ok(n))
            .map(|n| n.record.gpus)
            .collect();
        let Some(&widest) = of_model.iter().max() else {
            let models: BTreeSet<&str> =
                self.nodes.iter().map(|n| n.record.model.as_str()).collect();
            let models: Vec<&str> = models.into_iter().collect();
            return Some(format!(
                "none of {seen} has{model} GPUs: ask for one of their models ({}), or for any model",
                models.join(", ")
            ));
        };
        let fits = if fitting == 0 {
            let widest_nodes = of_model.iter().filter(|&&g| g == widest).count();
            format!(
                "the largest has {widest}{model} GPUs: ask for at most {widest} GPUs per node (up to {widest_nodes} node(s) x {widest})"
            )
        } else {
            format!(
                "{fitting} node(s) have {} or more{model} GPUs, and the largest has {widest}: ask for at most {fitting} node(s) x {} GPUs, or fewer GPUs per node",
                req.gpus_per_node, req.gpus_per_node
            )
        };
        Some(format!(
            "no set of {seen} can run {} node(s) x {}{model} GPUs: {fits}",
            req.nodes, req.gpus_per_node
        ))
    }

    /// Why no node this cluster has seen could run a job asking for a MIG instance of
    /// `profile`: none (of its model) reports one. Naming the profiles they do report.
    fn profile_warning(&self, req: &JobRequest, profile: &str) -> Option<String> {
        let model_ok = |n: &Node| req.gpu_model.as_ref().is_none_or(|m| *m == n.record.model);
        let candidates = self.nodes.iter().filter(|n| model_ok(n));
        let mut have: BTreeSet<&str> = BTreeSet::new();
        for n in candidates {
            for m in &n.record.mig_instances {
                if m.profile == profile {
                    return None;
                }
                have.insert(&m.profile);
            }
        }
        let seen = format!("the {} node(s) this cluster has seen", self.nodes.len());
        let model = req
            .gpu_model
            .as_ref()
            .map_or(String::new(), |m| format!(" of model {m}"));
        let fits = if have.is_empty() {
            format!(
                "none{model} has a GPU in MIG mode (operators partition GPUs with nvidia-smi mig; perch creates no instance): ask for whole GPUs (--gpus) or a share (--gpu-fraction)"
            )
        } else {
            let have: Vec<&str> = have.into_iter().collect();
            format!("ask for one of the profiles they have: {}", have.join(", "))
        };
        Some(format!(
            "no node of {seen}{model} reports a MIG instance of profile {profile}: {fits}"
        ))
    }

    /// The queue in the scheduler's order with each job's priority, then the jobs held back
    /// for their dependencies (not in line yet, so no priority), oldest first: every pending
    /// job `perch jobs` shows. The first `limit` of them (fewer if they pass
    /// [`crate::MAX_PAGE_BYTES`]), and how many there are.
    pub fn queue(&self, limit: usize) -> QueuePage {
        let in_line = self.scheduler.queue();
        let total = in_line.len() + self.held.len();
        let in_line = in_line.into_iter().map(|q| (q.job.0, Some(q.priority)));
        let held = self.held.iter().map(|&id| (id, None));
        let (mut entries, mut bytes) = (Vec::new(), 0);
        for (id, priority) in in_line.chain(held) {
            if entries.len() == limit || bytes >= crate::MAX_PAGE_BYTES {
                break;
            }
            // Pending jobs are held whole: no database read here.
            if let Ok(Some(job)) = self.view(id) {
                bytes += job.weight();
                entries.push((job, priority));
            }
        }
        (entries, total)
    }

    /// Node `idx`'s GPUs held by at least one job, and the jobs holding them: one reading of
    /// the scheduler's cluster for `GET /v1/nodes` and the `/metrics` snapshot alike.
    pub(super) fn occupancy(&self, idx: usize) -> (usize, BTreeSet<u64>) {
        let cluster = self.scheduler.cluster();
        let id = NodeId(idx as u32);
        let gpus = self.nodes[idx].record.gpus;
        let allocated = (0..gpus)
            .filter(|&g| !cluster.holders(id, g).is_empty())
            .count();
        let jobs = (0..gpus)
            .flat_map(|g| cluster.holders(id, g))
            .map(|j| j.0)
            .collect();
        (allocated, jobs)
    }

    /// What the control plane knows of each node; its state needs its telemetry too and is
    /// `perch_server::node_status`'s to say.
    pub fn nodes(&self) -> Vec<NodeDetail> {
        let cluster = self.scheduler.cluster();
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let (allocated_gpus, jobs) = self.occupancy(i);
                NodeDetail {
                    name: n.record.name.clone(),
                    gpus: n.record.gpus,
                    gpu_model: n.record.model.clone(),
                    rack: n.record.rack.clone(),
                    allocated_gpus,
                    jobs,
                    gpu_sharing: n.record.gpu_sharing,
                    nvlink_islands: cluster.nvlink_islands(NodeId(i as u32)),
                    last_sync_ms: n.last_sync_ms,
                    gpu_detail: (0..n.record.gpus)
                        .map(|g| self.gpu_detail(NodeId(i as u32), g))
                        .collect(),
                }
            })
            .collect()
    }

    fn gpu_detail(&self, node: NodeId, gpu: u32) -> GpuDetail {
        let cluster = self.scheduler.cluster();
        let holder = |job: JobId, share_percent: Option<u32>| {
            let request = self.jobs.get(&job.0).map(|j| &j.request);
            GpuHolder {
                job: job.0,
                user: request.map_or("", |r| r.user()).to_owned(),
                account: request.map_or("", |r| r.account()).to_owned(),
                share_percent,
            }
        };
        let holders = match cluster.owner(node, gpu) {
            Some(job) => vec![holder(job, None)],
            None => cluster
                .sharers(node, gpu)
                .iter()
                .map(|(job, share)| holder(*job, Some(share.percent)))
                .collect(),
        };
        let memory = |uuid: &str| {
            self.nodes
                .get(node.0 as usize)
                .and_then(|n| n.record.mig_instances.iter().find(|m| m.uuid == uuid))
                .and_then(|m| m.memory_mb)
        };
        let mig = cluster
            .mig_instances(node)
            .into_iter()
            .filter(|(m, _)| m.gpu == gpu)
            .map(|(m, job)| crate::api::GpuMig {
                memory_mb: memory(&m.uuid),
                profile: m.profile,
                uuid: m.uuid,
                job: job.map(|j| j.0),
                user: job
                    .and_then(|j| self.jobs.get(&j.0))
                    .map(|j| j.request.user().to_owned()),
            })
            .collect();
        GpuDetail {
            mig,
            holders,
            health: cluster
                .gpu_health(node, gpu)
                .unwrap_or(perch_scheduler::GpuHealth::Healthy),
        }
    }

    /// A snapshot for estimating the first `max` pending jobs' starts, off the lock; with
    /// `upto`, only as far as that job.
    pub fn start_plan(
        &self,
        now: i64,
        max: usize,
        upto: Option<u64>,
    ) -> perch_scheduler::StartPlan {
        self.scheduler.start_plan(now, max, upto.map(JobId))
    }

    /// What perch does with job `job`, idle since `since`, under the idle policy: in words, and
    /// when (if it acts at all).
    pub fn idle_consequence(&self, job: &JobRecord, since: i64) -> (String, Option<i64>) {
        let idle = &self.config.policy.idle;
        match idle.action {
            IdleAction::Reclaim { requeue } if job.request.preemptible => {
                let at = since + idle.window + idle.grace;
                let what = if requeue { "requeues" } else { "stops" };
                (
                    format!(
                        "Unless its GPUs get busy, perch {what} it from {} when other jobs wait ({}, then SIGKILL after {} s).",
                        perch_model::timefmt::rfc3339(at),
                        signal_of(&job.request),
                        job.request.grace_secs,
                    ),
                    Some(at),
                )
            }
            IdleAction::Reclaim { .. } => (
                "It is not preemptible, so perch only reports it.".to_owned(),
                None,
            ),
            IdleAction::Report | IdleAction::Off => (
                "perch only reports it ([scheduler.idle] action = \"report\").".to_owned(),
                None,
            ),
        }
    }

    /// Refuses unless `who` owns job `id` or is an operator.
    pub fn check_owner(
        &self,
        id: u64,
        who: &perch_model::identity::Identity,
    ) -> Result<(), ControlError> {
        let owner = self.find(id).ok_or(ControlError::NoSuchJob(id))?.user();
        if who.may_act_on(owner) {
            Ok(())
        } else {
            Err(ControlError::Forbidden(format!(
                "job {id} belongs to {owner}; only its owner or an operator may do that"
            )))
        }
    }
}
