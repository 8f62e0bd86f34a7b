//! The control plane's clock work: a tick a second, settled rows written beside it, expired
//! output deleted, and a failed job store reopened, each retried with backoff.

use super::*;

/// How often stored job output past `server.job_output_days` is looked for.
pub const OUTPUT_EXPIRY_PERIOD: std::time::Duration = std::time::Duration::from_secs(600);

/// After a failed write of settled jobs' rows (a full disk, say), the next waits this long,
/// doubling after each failure up to [`RECORD_RETRY_MAX`].
pub(super) const RECORD_RETRY_MIN: std::time::Duration = std::time::Duration::from_secs(1);

pub(super) const RECORD_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(300);

/// After a failed reopen of the job database ([`JobService::recover`]), the next waits this
/// long, doubling up to [`RECOVER_RETRY_MAX`]: space that returns is found within seconds.
pub(super) const RECOVER_RETRY_MIN: std::time::Duration = std::time::Duration::from_secs(1);

pub(super) const RECOVER_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(8);

impl JobService {
    /// Ticks the control plane ([`Control::tick`]), and takes settled jobs' records out of
    /// memory once durable ([`Control::archive_settled`]).
    pub async fn tick(&self) -> Result<(), ControlError> {
        let commits = self.commits.clone();
        self.run(move |c, now| {
            c.tick(now)?;
            let (seen, committed) = commits.seqs();
            c.archive_settled(now, seen, committed);
            Ok(())
        })
        .await
    }

    /// Deletes the stored output of jobs that ended longer than `server.job_output_days` ago
    /// (their records stay, marked, so `perch logs` says so): the job directories are listed
    /// and removed outside the control lock, only the marking takes it. Returns how many
    /// directories were removed.
    pub async fn expire_output(&self) -> Result<usize, ControlError> {
        let control = self.control.clone();
        let present = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u64>> {
            let dir = control.lock().logs_dir();
            match std::fs::read_dir(&dir) {
                Ok(entries) => Ok(entries
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(e),
            }
        })
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))?
        .map_err(ControlError::Logs)?;
        if present.is_empty() {
            return Ok(0);
        }
        let remove = self
            .run(move |c, now| Ok(c.expire_output(now, &present)))
            .await?;
        tokio::task::spawn_blocking(move || {
            let mut removed = 0;
            for path in remove {
                match std::fs::remove_dir_all(&path) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "could not delete a job's expired output; trying again at the next check")
                    }
                }
            }
            removed
        })
        .await
        .map_err(|e| ControlError::TaskFailed(e.to_string()))
    }

    /// Ticks the control plane every second until `shutdown`, writes settled jobs' rows
    /// ([`JobService::record_settled`]) beside it, and deletes expired job output
    /// every [`OUTPUT_EXPIRY_PERIOD`] (first at start) in a task of its own, one at a time: a
    /// server upgraded with years of output to delete keeps ticking (time limits, silent
    /// nodes) while it does.
    pub async fn run_ticker(self, shutdown: impl std::future::Future<Output = ()>) {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        let mut expiry = tokio::time::interval(OUTPUT_EXPIRY_PERIOD);
        let mut expiring: Option<tokio::task::JoinHandle<()>> = None;
        let mut recording: Option<tokio::task::JoinHandle<Result<usize, ControlError>>> = None;
        let (mut record_after, mut record_backoff) =
            (tokio::time::Instant::now(), RECORD_RETRY_MIN);
        let (mut recover_after, mut recover_backoff) =
            (tokio::time::Instant::now(), RECOVER_RETRY_MIN);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tick.tick() => {
                    if self.failing().is_some() {
                        // Nothing ticks on a state the job database cannot take: reopen it.
                        if tokio::time::Instant::now() >= recover_after {
                            let service = self.clone();
                            let recovered = tokio::task::spawn_blocking(move || service.recover()).await;
                            match recovered.map_err(|e| ControlError::TaskFailed(e.to_string())).and_then(|r| r) {
                                Ok(()) => recover_backoff = RECOVER_RETRY_MIN,
                                Err(e) => {
                                    tracing::warn!(error = %e, retry_secs = recover_backoff.as_secs(), "the job database cannot be reopened yet");
                                    recover_after = tokio::time::Instant::now() + recover_backoff;
                                    recover_backoff = (recover_backoff * 2).min(RECOVER_RETRY_MAX);
                                }
                            }
                        }
                        continue;
                    }
                    if let Err(e) = self.tick().await {
                        tracing::error!(error = %e, "job control tick failed");
                    }
                    // Settled jobs' rows are written beside the ticks, one step at a time: a
                    // server upgraded with a long history writes it while it goes on ticking.
                    if recording.as_ref().is_some_and(|task| task.is_finished()) {
                        let done = recording.take().expect("checked").await;
                        match done.map_err(|e| ControlError::TaskFailed(e.to_string())).and_then(|r| r) {
                            Ok(_) => record_backoff = RECORD_RETRY_MIN,
                            Err(e) => {
                                tracing::error!(error = %e, retry_secs = record_backoff.as_secs(), "writing settled jobs' rows failed; SQL reads them from the job database until a later try works");
                                record_after = tokio::time::Instant::now() + record_backoff;
                                record_backoff = (record_backoff * 2).min(RECORD_RETRY_MAX);
                            }
                        }
                    }
                    if recording.is_none() && tokio::time::Instant::now() >= record_after {
                        let service = self.clone();
                        recording = Some(tokio::task::spawn_blocking(move || service.record_settled()));
                    }
                }
                _ = expiry.tick() => {
                    // One at a time: a check still deleting a backlog is not joined by another.
                    if expiring.as_ref().is_none_or(|task| task.is_finished()) {
                        let service = self.clone();
                        expiring = Some(tokio::spawn(async move {
                            match service.expire_output().await {
                                Ok(0) => {}
                                Ok(n) => tracing::info!(jobs = n, "deleted the stored output of jobs that ended longer ago than server.job_output_days"),
                                Err(e) => tracing::error!(error = %e, "deleting expired job output failed"),
                            }
                        }));
                    }
                }
            }
        }
        // A write of settled rows under way ends before the ticker does: nothing holds the
        // job database once the server has stopped.
        if let Some(task) = recording {
            let _ = task.await;
        }
    }
}
