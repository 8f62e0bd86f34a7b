//! Tokens that let a running job push its own metrics (`POST /v1/metrics`) when the server
//! requires tokens, and nothing else.
//!
//! Each attempt of a job gets `perch-job.<id>.<attempt>.<mac>`, where `mac` is a keyed BLAKE3
//! hash of the id and attempt under a key only the server holds (`<jobs dir>/job-token.key`,
//! 32 random bytes, mode 600, made at first start). Nothing is stored per job: the server
//! recomputes the hash to check a token, and the control plane then checks that this attempt
//! is the job's current one and still running (or ended less than [`GRACE_MS`] ago, for an
//! SDK's last flush). The token reaches the job in `OTEL_EXPORTER_OTLP_HEADERS`, so an
//! OpenTelemetry SDK sends it with no code change, and the receiver files every point under
//! the token's job and user, whatever the resource attributes claim.

use std::io::Write as _;
use std::path::Path;

/// How long after its job ended a token is still taken (an SDK flushes at exit).
pub const GRACE_MS: i64 = 60_000;

const PREFIX: &str = "perch-job.";

/// The server's key for job tokens.
#[derive(Clone)]
pub struct JobTokens {
    key: [u8; 32],
}

impl std::fmt::Debug for JobTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobTokens(..)")
    }
}

impl JobTokens {
    /// Reads the key in `dir`, or makes one there (readable by the server's user only).
    pub fn load_or_create(dir: &Path) -> std::io::Result<JobTokens> {
        let path = dir.join("job-token.key");
        match std::fs::read(&path) {
            Ok(bytes) => {
                let key: [u8; 32] = bytes.try_into().map_err(|_| {
                    std::io::Error::other(format!(
                        "{} is not 32 bytes; delete it and restart (running jobs' metric tokens then stop working)",
                        path.display()
                    ))
                })?;
                Ok(JobTokens { key })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut key = [0u8; 32];
                getrandom::fill(&mut key).map_err(|e| std::io::Error::other(e.to_string()))?;
                let tmp = dir.join("job-token.key.tmp");
                {
                    use std::os::unix::fs::OpenOptionsExt as _;
                    let mut f = std::fs::OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(true)
                        .mode(0o600)
                        .open(&tmp)?;
                    f.write_all(&key)?;
                    f.sync_all()?;
                }
                std::fs::rename(&tmp, &path)?;
                Ok(JobTokens { key })
            }
            Err(e) => Err(e),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn with_key(key: [u8; 32]) -> JobTokens {
        JobTokens { key }
    }

    fn mac(&self, job: u64, attempt: u32) -> blake3::Hash {
        blake3::keyed_hash(&self.key, format!("{job}.{attempt}").as_bytes())
    }

    /// The token of attempt `attempt` of job `job`.
    pub fn token(&self, job: u64, attempt: u32) -> String {
        format!(
            "{PREFIX}{job}.{attempt}.{}",
            self.mac(job, attempt).to_hex()
        )
    }

    /// Whether `token` looks like a job token at all (so it is checked as one).
    pub fn is_job_token(token: &str) -> bool {
        token.starts_with(PREFIX)
    }

    /// The job and attempt `token` was made for, if this server made it.
    pub fn verify(&self, token: &str) -> Option<(u64, u32)> {
        let rest = token.strip_prefix(PREFIX)?;
        let mut parts = rest.splitn(3, '.');
        let job: u64 = parts.next()?.parse().ok()?;
        let attempt: u32 = parts.next()?.parse().ok()?;
        let given = blake3::Hash::from_hex(parts.next()?).ok()?;
        // blake3::Hash compares in constant time.
        (given == self.mac(job, attempt)).then_some((job, attempt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_its_attempt_and_cannot_be_forged() {
        let tokens = JobTokens::with_key([7; 32]);
        let t = tokens.token(42, 3);
        assert!(JobTokens::is_job_token(&t));
        assert_eq!(tokens.verify(&t), Some((42, 3)));
        // Another job's or attempt's number with this MAC, another key, garbage: refused.
        let mac = t.rsplit('.').next().unwrap_or_default();
        assert_eq!(tokens.verify(&format!("perch-job.43.3.{mac}")), None);
        assert_eq!(tokens.verify(&format!("perch-job.42.4.{mac}")), None);
        assert_eq!(JobTokens::with_key([8; 32]).verify(&t), None);
        for bad in ["perch-job.", "perch-job.1", "perch-job.1.1.zz", "nope", ""] {
            assert_eq!(tokens.verify(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_key_is_made_once_private_and_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = JobTokens::load_or_create(dir.path()).expect("create");
        let b = JobTokens::load_or_create(dir.path()).expect("load");
        assert_eq!(a.token(1, 1), b.token(1, 1));
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join("job-token.key"))
            .expect("key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        std::fs::write(dir.path().join("job-token.key"), b"short").expect("write");
        let err = JobTokens::load_or_create(dir.path()).expect_err("a broken key");
        assert!(err.to_string().contains("not 32 bytes"), "{err}");
    }
}
