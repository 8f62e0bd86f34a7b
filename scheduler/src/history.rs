//! Run times predicted from each user's history (after Helios, SC'21: a user's recent jobs
//! tell how far the next one's declared time limit overstates its run; some users declare the
//! partition's maximum every time, others a close guess).
//!
//! Each user's last [`KEEP`] finished runs (completed, or ended at their time limit) are kept
//! with their GPU request, as the part of its time limit each one ran. A job's predicted run
//! time is its own time limit times the median of that part over the user's runs of the same
//! request, or over all their runs when fewer than [`AT_LEAST`] match; with fewer than
//! [`AT_LEAST`] runs in all there is no prediction. So the prediction keeps what each job's
//! own limit says and corrects only the user's habit; it never exceeds the limit, which still
//! bounds the run and every reservation. Failed and cancelled jobs are not counted, since a
//! crash a minute in says nothing of a run's length.
//!
//! The median is weighted by the GPU-time each run used, so history costs what it buys: a
//! user who ends a stream of trivial jobs with huge limits at once, to make their next long
//! job look short, moves the median by the seconds those jobs ran, next to nothing. For the
//! same reason a prediction from runs of other requests is used only when those runs used at
//! least the GPU-time it predicts for the job: three one-GPU runs of ten minutes do not make a
//! 64-GPU job of a week look like ten minutes.

use crate::ids::{Millis, User};
use std::collections::{HashMap, VecDeque};

/// Runs kept per user.
pub(crate) const KEEP: usize = 32;
/// Runs needed before a prediction is made.
pub(crate) const AT_LEAST: usize = 3;
/// Users remembered at most; runs of users past this many are not recorded (their jobs are
/// ordered by their time limits), so the table stays bounded whatever names jobs carry.
pub(crate) const MAX_USERS: usize = 100_000;

#[derive(Clone, Debug, Default)]
pub(crate) struct History {
    users: HashMap<User, Runs>,
}

/// One user's runs and the predictions they give, worked out when a run is recorded (a pass
/// reads them for every waiting job, far more often than jobs end).
#[derive(Clone, Debug, Default)]
struct Runs {
    /// (GPU request in hundredths, part of its time limit the run took in 0..=1, GPU-ms used).
    runs: VecDeque<(u32, f64, f64)>,
    /// The part predicted for each request with at least [`AT_LEAST`] runs.
    by_request: Vec<(u32, f64)>,
    /// The part predicted over all runs, with at least [`AT_LEAST`] of them, and the GPU-ms
    /// those runs used.
    all: Option<(f64, f64)>,
}

/// The median of `parts`, weighted by GPU-time: the first part at which half the GPU-time is
/// reached (runs that used none at all count alike); `None` below [`AT_LEAST`] runs.
fn weighted_median(mut parts: Vec<(f64, f64)>) -> Option<f64> {
    if parts.len() < AT_LEAST {
        return None;
    }
    parts.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = parts.iter().map(|(_, w)| w).sum();
    if total <= 0.0 {
        return Some(parts[parts.len() / 2].0);
    }
    let mut seen = 0.0;
    parts
        .iter()
        .find(|(_, w)| {
            seen += w;
            seen >= total / 2.0
        })
        .map(|(p, _)| *p)
        .or(Some(1.0))
}

impl History {
    /// Records a finished run: `gpus` in hundredths of a GPU, `ran` its run time over all its
    /// runs, `limit` its time limit.
    pub(crate) fn record(&mut self, user: &User, gpus: u32, ran: Millis, limit: Millis) {
        if limit <= 0 {
            return;
        }
        if !self.users.contains_key(user) && self.users.len() >= MAX_USERS {
            return;
        }
        let r = self.users.entry(user.clone()).or_default();
        if r.runs.len() == KEEP {
            r.runs.pop_front();
        }
        let ran = ran.max(0);
        r.runs.push_back((
            gpus,
            (ran as f64 / limit as f64).min(1.0),
            f64::from(gpus) / 100.0 * ran as f64,
        ));
        let used: f64 = r.runs.iter().map(|(_, _, w)| w).sum();
        r.all = weighted_median(r.runs.iter().map(|(_, p, w)| (*p, *w)).collect())
            .map(|part| (part, used));
        let mut requests: Vec<u32> = r.runs.iter().map(|(g, _, _)| *g).collect();
        requests.sort_unstable();
        requests.dedup();
        r.by_request = requests
            .into_iter()
            .filter_map(|g| {
                let parts = r
                    .runs
                    .iter()
                    .filter(|(x, _, _)| *x == g)
                    .map(|(_, p, w)| (*p, *w))
                    .collect();
                weighted_median(parts).map(|p| (g, p))
            })
            .collect();
    }

    /// The predicted run time of `user`'s job of `gpus` hundredths of a GPU and time limit
    /// `limit`.
    pub(crate) fn predict(&self, user: &User, gpus: u32, limit: Millis) -> Option<Millis> {
        let r = self.users.get(user)?;
        let run = |part: f64| (limit as f64 * part).ceil() as Millis;
        if let Some((_, part)) = r.by_request.iter().find(|(g, _)| *g == gpus) {
            return Some(run(*part));
        }
        let (part, used) = r.all?;
        // Runs of other requests vouch only for as much GPU-time as they used.
        (used >= f64::from(gpus) / 100.0 * run(part) as f64).then(|| run(part))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(s: &str) -> User {
        User(s.into())
    }

    #[test]
    fn the_limit_times_the_median_part_of_the_same_request_else_of_all() {
        let mut h = History::default();
        let (a, b) = (user("a"), user("b"));
        assert_eq!(h.predict(&a, 100, 1000), None);
        // One-GPU runs that took 10%, 30% and 20% of their limits; one eight-GPU run, 100%.
        for (g, r, l) in [
            (100, 10, 100),
            (100, 300, 1000),
            (800, 50, 50),
            (100, 40, 200),
        ] {
            h.record(&a, g, r, l);
        }
        // Weighted by GPU-time: the 30% run used 300 of the 350 GPU-ms.
        assert_eq!(h.predict(&a, 100, 1000), Some(300));
        // Only one eight-GPU run: all four parts, where the 8-GPU run's 100% holds 400 of 750.
        // Those runs used 750 GPU-ms: they vouch for 90 ms of 8 GPUs, not 1000.
        assert_eq!(h.predict(&a, 800, 90), Some(90));
        assert_eq!(h.predict(&a, 800, 1000), None);
        // Another user's runs say nothing of b's.
        assert_eq!(h.predict(&b, 100, 1000), None);
    }

    #[test]
    fn only_the_last_runs_count_and_a_part_is_at_most_the_limit() {
        let mut h = History::default();
        let a = user("a");
        for _ in 0..KEEP {
            h.record(&a, 100, 1000, 1000);
        }
        assert_eq!(h.predict(&a, 100, 60), Some(60));
        // The same number of runs at half their limits push every earlier one out.
        for _ in 0..KEEP {
            h.record(&a, 100, 50, 100);
        }
        assert_eq!(h.predict(&a, 100, 1000), Some(500));
        // A run past its limit (a grace period) counts as the whole limit; a zero limit not.
        h.record(&a, 100, 5000, 100);
        h.record(&a, 100, 5, 0);
        assert!(h.predict(&a, 100, 1000).is_some_and(|p| p <= 1000));
    }

    /// The attack: a user ends 29 trivial jobs of 7-day limits after a second each, then
    /// asks for 7 days again. Three earlier honest runs (half their limits) outweigh them.
    #[test]
    fn trivial_jobs_do_not_buy_a_short_prediction() {
        let mut h = History::default();
        let a = user("a");
        let week = 7 * 24 * 3600 * 1000;
        for _ in 0..3 {
            h.record(&a, 800, 3600 * 1000, 2 * 3600 * 1000);
        }
        for _ in 0..29 {
            h.record(&a, 800, 1000, week);
        }
        assert_eq!(h.predict(&a, 800, week), Some(week / 2));
    }

    /// The attack: three one-GPU runs of ten minutes against week-long limits, then a 64-GPU
    /// job of a week. The runs used 30 GPU-minutes, not the 640 the prediction would grant,
    /// so the job is ranked by its limit; eight GPUs' worth of such runs would vouch for it.
    #[test]
    fn cheap_runs_of_another_request_do_not_vouch_for_a_big_job() {
        let mut h = History::default();
        let a = user("a");
        let (week, ten_min) = (7 * 24 * 3600 * 1000, 600 * 1000);
        for _ in 0..3 {
            h.record(&a, 100, ten_min, week);
        }
        assert_eq!(h.predict(&a, 6400, week), None);
        assert_eq!(h.predict(&a, 100, week), Some(ten_min));
        assert_eq!(
            h.predict(&a, 300, week),
            Some(ten_min),
            "3 GPUs: 30 GPU-minutes vouch"
        );
        assert_eq!(h.predict(&a, 400, week), None);
    }

    #[test]
    fn the_table_is_bounded() {
        let mut h = History::default();
        for i in 0..MAX_USERS + 10 {
            h.record(&user(&format!("u{i}")), 100, 1, 10);
        }
        assert_eq!(h.users.len(), MAX_USERS);
        // A known user still records.
        h.record(&user("u0"), 100, 1, 10);
        assert_eq!(h.users[&user("u0")].runs.len(), 2);
    }
}
