//! `[validation]`: what a node runs to prove its GPUs healthy before it takes work again
//! (after perch's remediation drained it, or when an operator runs `perch validate NODE`), and
//! for how long (docs/validation.md).

use super::{SECONDS, bad, within};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValidationSection {
    /// Program and arguments the node's agent runs, without a shell; exit 0 passes. Empty:
    /// the built-in check (NVML health of every GPU; with CUDA and torch, a GPU burn and a
    /// memory check).
    pub command: Vec<String>,
    /// The agent kills the command after this long, and the node stays drained.
    pub timeout_secs: u64,
    /// Seconds of GPU burn in the built-in check (when CUDA and torch are present).
    pub burn_secs: u64,
    /// Perch's remediation resumes a node it drained only once a validation passed: the
    /// remediation's health check runs as a validation, `[validation] command` when
    /// `alerts.remediation.health_check` is empty.
    pub after_remediation: bool,
}

impl Default for ValidationSection {
    fn default() -> Self {
        let d = perch_control::validation::Config::default();
        ValidationSection {
            command: d.command,
            timeout_secs: d.timeout.as_secs(),
            burn_secs: u64::from(d.burn_secs),
            after_remediation: d.after_remediation,
        }
    }
}

impl ValidationSection {
    pub(super) fn check(&self) -> Result<()> {
        within(
            "validation.timeout_secs",
            self.timeout_secs,
            1,
            86_400,
            SECONDS,
        )?;
        within("validation.burn_secs", self.burn_secs, 0, 3_600, SECONDS)?;
        if self.command.first().is_some_and(|p| p.trim().is_empty()) {
            return bad(
                "validation.command",
                "its first word, the program, is empty; name a program (an absolute path is safest), or leave the key out for the built-in check",
            );
        }
        if self.burn_secs >= self.timeout_secs && self.command.is_empty() {
            return bad(
                "validation.burn_secs",
                &format!(
                    "must be shorter than validation.timeout_secs ({} s), or every built-in check times out",
                    self.timeout_secs
                ),
            );
        }
        Ok(())
    }

    /// The server's validation settings.
    pub fn server_config(&self) -> perch_control::validation::Config {
        perch_control::validation::Config {
            command: self.command.clone(),
            timeout: Duration::from_secs(self.timeout_secs),
            burn_secs: u32::try_from(self.burn_secs).unwrap_or(u32::MAX),
            after_remediation: self.after_remediation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::refused;

    #[test]
    fn bad_validation_settings_name_the_key() {
        for (text, want) in [
            ("[validation]\ntimeout_secs = 0", "validation.timeout_secs"),
            ("[validation]\ncommand = [\"\"]", "validation.command"),
            (
                "[validation]\ntimeout_secs = 10\nburn_secs = 10",
                "validation.burn_secs: must be shorter",
            ),
        ] {
            let message = refused(text);
            assert!(message.contains(want), "{text}: {message}");
        }
    }
}
