//! Silences: an operator's "I know, stop telling me" for alerts matching some labels, for a
//! while. They mute notifications only: alerts still evaluate, show in the API and on
//! `/metrics`, and still drive remediation. Kept in the engine's snapshot so a restart keeps them.

use crate::error::{Error, Result};
use crate::matcher::{Matcher, matches_all};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How long an expired silence stays listed before it is forgotten (Alertmanager: 5 days).
pub const EXPIRED_RETENTION_MS: i64 = 5 * 86_400_000;

/// A silence as stored and listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Silence {
    /// `s-<n>`, unique for the life of the state file.
    pub id: String,
    /// Alerts matching all of these are muted.
    pub matchers: Vec<Matcher>,
    /// Start (Unix ms).
    pub starts_at_ms: i64,
    /// End (Unix ms); expiring a silence moves this to now.
    pub ends_at_ms: i64,
    /// Who created it.
    pub created_by: String,
    /// Why.
    pub comment: String,
    /// When it was created.
    pub created_at_ms: i64,
}

/// Where a silence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SilenceState {
    /// Starts in the future.
    Pending,
    /// Muting now.
    Active,
    /// Over.
    Expired,
}

impl Silence {
    /// The state at `now_ms`.
    pub fn state(&self, now_ms: i64) -> SilenceState {
        if now_ms < self.starts_at_ms {
            SilenceState::Pending
        } else if now_ms < self.ends_at_ms {
            SilenceState::Active
        } else {
            SilenceState::Expired
        }
    }
}

/// What `POST /v1/silences` or `perch silence add` asks for.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SilenceRequest {
    /// At least one; at least one must not match the empty string (so it cannot mute all).
    pub matchers: Vec<Matcher>,
    /// Start (Unix ms); now when absent.
    #[serde(default)]
    pub starts_at_ms: Option<i64>,
    /// End (Unix ms); give this or `duration`.
    #[serde(default)]
    pub ends_at_ms: Option<i64>,
    /// How long from the start (`"2h"`); give this or `ends_at_ms`.
    #[serde(default)]
    pub duration: Option<crate::duration::HumanDuration>,
    /// Who asks (the API fills it from the caller's identity).
    pub created_by: String,
    /// Why: shown next to the silence, so the next operator knows.
    pub comment: String,
}

/// All silences, persisted with the engine.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Silences {
    silences: BTreeMap<String, Silence>,
    next_id: u64,
}

impl Silences {
    /// Adds a silence; the error says which field is wrong.
    pub fn add(&mut self, req: SilenceRequest, now_ms: i64) -> Result<Silence> {
        if req.matchers.is_empty() {
            return Err(Error::Silence(
                "no matchers; give at least one, e.g. node=\"gpu-07\"".into(),
            ));
        }
        if req.matchers.iter().all(|m| m.matches_value("")) {
            return Err(Error::Silence(
                "every matcher also matches alerts without that label, so it would mute everything; add one like alertname=\"...\" or node=\"...\"".into(),
            ));
        }
        let starts_at_ms = req.starts_at_ms.unwrap_or(now_ms);
        let ends_at_ms = match (req.ends_at_ms, req.duration) {
            (Some(end), None) => end,
            (None, Some(d)) => starts_at_ms.saturating_add(d.as_ms()),
            _ => {
                return Err(Error::Silence(
                    "give either ends_at_ms or duration (like \"2h\"), not both or neither".into(),
                ));
            }
        };
        if ends_at_ms <= starts_at_ms {
            return Err(Error::Silence(
                "ends_at_ms must be after starts_at_ms".into(),
            ));
        }
        if ends_at_ms <= now_ms {
            return Err(Error::Silence("ends_at_ms is in the past".into()));
        }
        if req.created_by.trim().is_empty() {
            return Err(Error::Silence(
                "created_by is empty; say who you are".into(),
            ));
        }
        if req.comment.trim().is_empty() {
            return Err(Error::Silence(
                "comment is empty; say why, for the next operator".into(),
            ));
        }
        self.next_id += 1;
        let silence = Silence {
            id: format!("s-{}", self.next_id),
            matchers: req.matchers,
            starts_at_ms,
            ends_at_ms,
            created_by: req.created_by,
            comment: req.comment,
            created_at_ms: now_ms,
        };
        self.silences.insert(silence.id.clone(), silence.clone());
        Ok(silence)
    }

    /// Ends a silence now (it stays listed as expired for a while).
    pub fn expire(&mut self, id: &str, now_ms: i64) -> Result<Silence> {
        let silence = self
            .silences
            .get_mut(id)
            .ok_or_else(|| Error::UnknownSilence(id.to_owned()))?;
        if silence.state(now_ms) == SilenceState::Expired {
            return Err(Error::Silence(format!("silence {id} has already expired")));
        }
        silence.ends_at_ms = now_ms;
        if silence.starts_at_ms > now_ms {
            silence.starts_at_ms = now_ms;
        }
        Ok(silence.clone())
    }

    /// Every silence with its state, active first, then pending, then expired.
    pub fn list(&self, now_ms: i64) -> Vec<(Silence, SilenceState)> {
        let mut all: Vec<_> = self
            .silences
            .values()
            .map(|s| (s.clone(), s.state(now_ms)))
            .collect();
        all.sort_by_key(|(s, state)| {
            let rank = match state {
                SilenceState::Active => 0,
                SilenceState::Pending => 1,
                SilenceState::Expired => 2,
            };
            (rank, s.starts_at_ms, s.id.clone())
        });
        all
    }

    /// The id of an active silence muting this label set, if any.
    pub fn muting(&self, labels: &BTreeMap<String, String>, now_ms: i64) -> Option<&str> {
        self.silences
            .values()
            .find(|s| s.state(now_ms) == SilenceState::Active && matches_all(&s.matchers, labels))
            .map(|s| s.id.as_str())
    }

    /// Number of active silences.
    pub fn active_count(&self, now_ms: i64) -> usize {
        self.silences
            .values()
            .filter(|s| s.state(now_ms) == SilenceState::Active)
            .count()
    }

    /// Forgets silences expired longer than five days ago (as Alertmanager does).
    pub fn gc(&mut self, now_ms: i64) {
        self.silences
            .retain(|_, s| now_ms.saturating_sub(s.ends_at_ms) < EXPIRED_RETENTION_MS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(matchers: &[&str], ends: i64) -> SilenceRequest {
        SilenceRequest {
            matchers: matchers
                .iter()
                .map(|m| Matcher::parse(m).expect("matcher"))
                .collect(),
            starts_at_ms: None,
            ends_at_ms: Some(ends),
            duration: None,
            created_by: "ana".into(),
            comment: "replacing the PSU".into(),
        }
    }

    fn labels(node: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("node".to_string(), node.to_string()),
            ("alertname".to_string(), "XidResetGpu".to_string()),
        ])
    }

    #[test]
    fn add_mute_expire_list() {
        let mut s = Silences::default();
        let sil = s.add(request(&[r#"node="n1""#], 1_000), 0).expect("valid");
        assert_eq!(sil.id, "s-1");
        assert_eq!(s.muting(&labels("n1"), 10), Some("s-1"));
        assert_eq!(s.muting(&labels("n2"), 10), None);
        assert_eq!(s.muting(&labels("n1"), 1_000), None, "ends at ends_at");
        s.expire("s-1", 500).expect("expire");
        assert_eq!(s.muting(&labels("n1"), 600), None);
        let listed = s.list(600);
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].1, SilenceState::Expired);
        assert!(s.expire("s-1", 700).is_err(), "already expired");
        assert!(matches!(
            s.expire("s-9", 700),
            Err(Error::UnknownSilence(_))
        ));
        s.gc(500 + EXPIRED_RETENTION_MS);
        assert!(s.list(0).is_empty());
    }

    #[test]
    fn duration_counts_from_the_start() {
        let mut s = Silences::default();
        let req: SilenceRequest = serde_json::from_value(serde_json::json!({
            "matchers": ["node=\"n1\""],
            "duration": "2h",
            "created_by": "ana",
            "comment": "reseating GPUs"
        }))
        .expect("API body");
        let sil = s.add(req, 1_000).expect("valid");
        assert_eq!(
            (sil.starts_at_ms, sil.ends_at_ms),
            (1_000, 1_000 + 7_200_000)
        );
    }

    #[test]
    fn pending_silence_mutes_from_its_start() {
        let mut s = Silences::default();
        let mut req = request(&[r#"node="n1""#], 2_000);
        req.starts_at_ms = Some(1_000);
        s.add(req, 0).expect("valid");
        assert_eq!(s.list(10)[0].1, SilenceState::Pending);
        assert_eq!(s.muting(&labels("n1"), 999), None);
        assert_eq!(s.muting(&labels("n1"), 1_000), Some("s-1"));
    }

    #[test]
    fn rejects_silences_that_would_mute_everything_or_say_nothing() {
        let mut s = Silences::default();
        for (req, fragment) in [
            (request(&[], 1_000), "no matchers"),
            (request(&[r#"team="""#], 1_000), "mute everything"),
            (request(&[r#"node!="x""#], 1_000), "mute everything"),
            (request(&[r#"node="n1""#], 0), "after starts_at_ms"),
            (
                SilenceRequest {
                    duration: Some(crate::duration::HumanDuration::from_mins(5)),
                    ..request(&[r#"node="n1""#], 1_000)
                },
                "not both",
            ),
            (
                SilenceRequest {
                    comment: " ".into(),
                    ..request(&[r#"node="n1""#], 1_000)
                },
                "comment",
            ),
        ] {
            let err = s.add(req, 0).expect_err(fragment).to_string();
            assert!(err.contains(fragment), "{err}");
        }
    }
}
