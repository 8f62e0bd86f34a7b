//! Jobs: the control plane ([`control`]), its durable records ([`db`], [`record`]), what
//! users submit ([`spec`]) and the HTTP routes ([`routes`]).

pub mod control;
pub mod db;
pub mod record;
pub mod routes;
pub mod spec;

use control::Control;
pub use control::{ControlError, JobsConfig};
use std::sync::{Arc, Mutex, MutexGuard};

/// The control plane behind a lock. Operations run on the blocking pool: each commits to the
/// job database (an fsync) before it returns.
#[derive(Clone)]
pub struct JobService {
    control: Arc<Mutex<Control>>,
}

impl JobService {
    pub fn open(dir: &std::path::Path, config: JobsConfig) -> Result<JobService, ControlError> {
        let control = Control::open(dir, config, crate::ingest::now_ms())?;
        Ok(JobService {
            control: Arc::new(Mutex::new(control)),
        })
    }

    fn lock(control: &Mutex<Control>) -> MutexGuard<'_, Control> {
        control.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the control plane off the async threads.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Control, i64) -> Result<T, ControlError> + Send + 'static,
    ) -> Result<T, crate::ApiError> {
        let control = self.control.clone();
        tokio::task::spawn_blocking(move || f(&mut Self::lock(&control), crate::ingest::now_ms()))
            .await
            .map_err(|e| {
                crate::ApiError::new(
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    e.to_string(),
                )
            })?
            .map_err(crate::ApiError::from)
    }

    /// Ticks the control plane every second until `shutdown`.
    pub async fn run_ticker(self, shutdown: impl std::future::Future<Output = ()>) {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.run(|c, now| c.tick(now)).await {
                tracing::error!(error = %e.message, "job control tick failed");
            }
        }
    }
}

impl From<ControlError> for crate::ApiError {
    fn from(e: ControlError) -> Self {
        use axum::http::StatusCode;
        let message = e.to_string();
        match e {
            ControlError::Invalid(_) => crate::ApiError::bad_request("invalid_job", message),
            ControlError::Scheduler(perch_scheduler::Error::InvalidJob { .. }) => {
                crate::ApiError::bad_request("invalid_job", message)
            }
            ControlError::NoSuchJob(_) | ControlError::NoSuchNode(_) => {
                crate::ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
            }
            ControlError::AlreadyEnded { .. } => {
                crate::ApiError::new(StatusCode::CONFLICT, "already_ended", message)
            }
            ControlError::Scheduler(_) | ControlError::Db(_) | ControlError::Logs(_) => {
                crate::ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
            }
        }
    }
}
