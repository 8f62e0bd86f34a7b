//! Trace loading: the Philly CSV and a documented generic CSV, into [`TraceJob`]s, plus the two
//! deterministic transformations the experiments need (user time limits and idle tails).
//!
//! Generic CSV (header line required, comma-separated, no quoting, `#` lines ignored):
//!
//! | column | required | meaning |
//! |---|---|---|
//! | `submit` | yes | submission time, seconds (any origin; the replay starts at the earliest) |
//! | `duration` | yes | seconds the job runs once it has its GPUs |
//! | `gpus` | yes | GPUs asked for, as one gang |
//! | `account` | one of the two | the account (team) charged; defaults to `user` |
//! | `user` | one of the two | the user; defaults to `account` |
//! | `utilization` | no | `percent:seconds` segments separated by `;`, in run time order; the last segment lasts to the end. Empty: busy throughout |
//!
//! Example: `submit,duration,gpus,account,user,utilization` /
//! `0,3600,8,vision,alice,100:1200;0:2400` (busy 20 minutes, then idle 40).

use crate::error::{Error, Result};
use crate::ids::{MINUTE, Millis, SECOND, Time};

/// One job of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceJob {
    /// Position in the file (0-based), the job's id in the replay.
    pub id: u64,
    /// Submission, milliseconds from the trace's first submission.
    pub submit: Time,
    /// Run time once started, milliseconds.
    pub duration: Millis,
    /// GPUs, one gang.
    pub gpus: u32,
    /// Account charged.
    pub account: String,
    /// User.
    pub user: String,
    /// Utilization steps `(run-time offset, percent)`, ascending; empty means 100% throughout.
    pub utilization: Vec<(Millis, f32)>,
}

/// Which loader reads the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    /// `timestamp,duration,num_gpus,gpu_time,cluster`.
    Philly,
    /// The generic CSV above.
    Generic,
}

/// Reads `path` as `format`, or guessed from the header when `None`.
pub fn load(path: &str, format: Option<TraceFormat>) -> Result<Vec<TraceJob>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_string(),
        source,
    })?;
    parse(path, &text, format)
}

/// Parses trace text; `name` appears in errors.
pub fn parse(name: &str, text: &str, format: Option<TraceFormat>) -> Result<Vec<TraceJob>> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'));
    let Some((_, header)) = lines.next() else {
        return Err(Error::Trace {
            file: name.into(),
            line: 1,
            column: String::new(),
            message: "empty file".into(),
        });
    };
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let format = format.unwrap_or(if cols.contains(&"num_gpus") {
        TraceFormat::Philly
    } else {
        TraceFormat::Generic
    });
    let err = |line: usize, column: &str, message: String| Error::Trace {
        file: name.into(),
        line,
        column: column.into(),
        message,
    };
    let col = |c: &str| cols.iter().position(|x| *x == c);
    let need = |c: &str| {
        col(c).ok_or_else(|| {
            err(
                1,
                c,
                format!("missing column (header has: {})", cols.join(",")),
            )
        })
    };
    let mut raw: Vec<(f64, TraceJob)> = Vec::new();
    match format {
        TraceFormat::Philly => {
            let (ts, du, ng, cl) = (
                need("timestamp")?,
                need("duration")?,
                need("num_gpus")?,
                need("cluster")?,
            );
            for (i, l) in lines {
                let f: Vec<&str> = l.split(',').map(str::trim).collect();
                let line = i + 1;
                let get = |idx: usize, c: &str| {
                    f.get(idx)
                        .copied()
                        .ok_or_else(|| err(line, c, "missing field".into()))
                };
                let submit = parse_datetime(get(ts, "timestamp")?).ok_or_else(|| {
                    err(
                        line,
                        "timestamp",
                        format!("`{}` is not YYYY-MM-DD HH:MM:SS", f.get(ts).unwrap_or(&"")),
                    )
                })?;
                let duration =
                    seconds(get(du, "duration")?).map_err(|m| err(line, "duration", m))?;
                let gpus = count(get(ng, "num_gpus")?).map_err(|m| err(line, "num_gpus", m))?;
                let account = get(cl, "cluster")?.to_string();
                raw.push((
                    submit,
                    TraceJob {
                        id: 0,
                        submit: 0,
                        duration,
                        gpus,
                        user: account.clone(),
                        account,
                        utilization: vec![],
                    },
                ));
            }
        }
        TraceFormat::Generic => {
            let (su, du, gp) = (need("submit")?, need("duration")?, need("gpus")?);
            let (ac, us, ut) = (col("account"), col("user"), col("utilization"));
            if ac.is_none() && us.is_none() {
                return Err(err(
                    1,
                    "account",
                    "need an `account` or a `user` column".into(),
                ));
            }
            for (i, l) in lines {
                let f: Vec<&str> = l.split(',').map(str::trim).collect();
                let line = i + 1;
                let get = |idx: usize, c: &str| {
                    f.get(idx)
                        .copied()
                        .ok_or_else(|| err(line, c, "missing field".into()))
                };
                let submit: f64 = get(su, "submit")?.parse().map_err(|_| {
                    err(
                        line,
                        "submit",
                        format!("`{}` is not a number of seconds", f[su]),
                    )
                })?;
                if !submit.is_finite() {
                    return Err(err(line, "submit", "must be finite".into()));
                }
                let duration =
                    seconds(get(du, "duration")?).map_err(|m| err(line, "duration", m))?;
                let gpus = count(get(gp, "gpus")?).map_err(|m| err(line, "gpus", m))?;
                let account = ac
                    .and_then(|c| f.get(c))
                    .filter(|s| !s.is_empty())
                    .map(|s| s.to_string());
                let user = us
                    .and_then(|c| f.get(c))
                    .filter(|s| !s.is_empty())
                    .map(|s| s.to_string());
                let (account, user) = match (account, user) {
                    (Some(a), Some(u)) => (a, u),
                    (Some(a), None) => (a.clone(), a),
                    (None, Some(u)) => (u.clone(), u),
                    (None, None) => {
                        return Err(err(line, "account", "empty account and user".into()));
                    }
                };
                let utilization = match ut.and_then(|c| f.get(c)).filter(|s| !s.is_empty()) {
                    Some(p) => profile(p).map_err(|m| err(line, "utilization", m))?,
                    None => vec![],
                };
                raw.push((
                    submit,
                    TraceJob {
                        id: 0,
                        submit: 0,
                        duration,
                        gpus,
                        account,
                        user,
                        utilization,
                    },
                ));
            }
        }
    }
    let origin = raw.iter().map(|(s, _)| *s).fold(f64::INFINITY, f64::min);
    let mut jobs: Vec<TraceJob> = raw
        .into_iter()
        .map(|(s, mut j)| {
            j.submit = ((s - origin) * 1000.0).round() as Time;
            j
        })
        .collect();
    jobs.sort_by_key(|j| j.submit);
    for (i, j) in jobs.iter_mut().enumerate() {
        j.id = i as u64;
    }
    Ok(jobs)
}

fn seconds(s: &str) -> std::result::Result<Millis, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..1e12).contains(&v) => {
            Ok((v * SECOND as f64).round() as Millis)
        }
        _ => Err(format!("`{s}` is not a non-negative number of seconds")),
    }
}

fn count(s: &str) -> std::result::Result<u32, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a GPU count"))?;
    if v.fract() != 0.0 || !(1.0..=4096.0).contains(&v) {
        return Err(format!("`{s}` must be a whole number from 1 to 4096"));
    }
    Ok(v as u32)
}

fn profile(s: &str) -> std::result::Result<Vec<(Millis, f32)>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    for seg in s.split(';') {
        let (p, d) = seg
            .split_once(':')
            .ok_or_else(|| format!("segment `{seg}` is not percent:seconds"))?;
        let pct: f32 = p
            .trim()
            .parse()
            .map_err(|_| format!("`{p}` is not a percent"))?;
        if !(0.0..=100.0).contains(&pct) {
            return Err(format!("percent `{p}` is not between 0 and 100"));
        }
        out.push((at, pct));
        at += seconds(d.trim())?;
    }
    Ok(out)
}

/// `YYYY-MM-DD HH:MM:SS` to seconds since 1970 (UTC, proleptic Gregorian).
fn parse_datetime(s: &str) -> Option<f64> {
    let (date, time) = s.split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':').map(|x| x.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + hh * 3600 + mm * 60 + ss) as f64)
}

/// A deterministic uniform number in `[0, 1)` for (`seed`, `key`, `salt`) (SplitMix64).
pub fn unit(seed: u64, key: u64, salt: u64) -> f64 {
    let mut z =
        seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The time limit a user would have declared: the real duration times a per-job factor drawn
/// uniformly from `[lo, hi]` (deterministic in `seed` and the job id), at least 5 minutes,
/// rounded up to a whole minute.
pub fn user_time_limit(job: &TraceJob, seed: u64, lo: f64, hi: f64) -> Millis {
    let f = lo + (hi - lo) * unit(seed, job.id, 1);
    let raw = ((job.duration as f64 * f).ceil() as Millis).max(5 * MINUTE);
    (raw + MINUTE - 1) / MINUTE * MINUTE
}

/// Gives jobs an idle tail until about `share` of all GPU-time is idle: jobs are taken in an
/// order shuffled by `seed`; each gets its last 50-90% of run time at 0% utilization (busy at
/// 100% before). Returns the idle share reached.
pub fn add_idle_tails(jobs: &mut [TraceJob], share: f64, seed: u64) -> f64 {
    let total: f64 = jobs.iter().map(|j| j.duration as f64 * j.gpus as f64).sum();
    if total <= 0.0 || share <= 0.0 {
        return 0.0;
    }
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| unit(seed, jobs[a].id, 2).total_cmp(&unit(seed, jobs[b].id, 2)));
    let mut idle = 0.0;
    for i in order {
        if idle >= share * total {
            break;
        }
        let j = &mut jobs[i];
        let frac = 0.5 + 0.4 * unit(seed, j.id, 3);
        let busy = (j.duration as f64 * (1.0 - frac)).round() as Millis;
        j.utilization = vec![(0, 100.0), (busy, 0.0)];
        idle += (j.duration - busy) as f64 * j.gpus as f64;
    }
    idle / total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datetime_matches_known_epochs() {
        assert_eq!(parse_datetime("1970-01-01 00:00:00"), Some(0.0));
        assert_eq!(parse_datetime("2017-10-09 07:01:55"), Some(1_507_532_515.0));
        assert_eq!(parse_datetime("2017-13-09 07:01:55"), None);
    }

    #[test]
    fn malformed_lines_name_line_and_column() {
        let check = |text: &str, line: usize, column: &str| match parse("t.csv", text, None) {
            Err(Error::Trace {
                line: l, column: c, ..
            }) => assert_eq!((l, c.as_str()), (line, column), "{text}"),
            other => panic!("expected a trace error for {text:?}, got {other:?}"),
        };
        let philly = "timestamp,duration,num_gpus,gpu_time,cluster\n";
        check(
            &format!("{philly}2017-10-09 07:01:55,66.0,1,66.0,a\n2017-10-09 07:01:55,abc,1,1,a\n"),
            3,
            "duration",
        );
        check(
            &format!("{philly}2017-10-09 07:01:55,66.0,0,66.0,a\n"),
            2,
            "num_gpus",
        );
        check(
            &format!("{philly}yesterday,66.0,1,66.0,a\n"),
            2,
            "timestamp",
        );
        check(
            &format!("{philly}2017-10-09 07:01:55,66.0\n"),
            2,
            "num_gpus",
        );
        check(
            "submit,duration,gpus,user\n0,10,1,al\n5,10,1.5,al\n",
            3,
            "gpus",
        );
        check(
            "submit,duration,gpus,user,utilization\n0,10,1,al,100:5;zero:5\n",
            2,
            "utilization",
        );
        check("submit,duration,gpus\n0,10,1\n", 1, "account");
    }

    #[test]
    fn generic_reads_profiles_and_rebases_time() -> Result<()> {
        let jobs = parse(
            "g.csv",
            "submit,duration,gpus,account,user,utilization\n100,60,8,vision,al,100:20;0:40\n90,5,1,nlp,,\n",
            None,
        )?;
        assert_eq!(jobs.len(), 2);
        assert_eq!(
            (
                jobs[0].submit,
                jobs[0].account.as_str(),
                jobs[0].user.as_str()
            ),
            (0, "nlp", "nlp")
        );
        assert_eq!(jobs[1].submit, 10_000);
        assert_eq!(jobs[1].utilization, vec![(0, 100.0), (20_000, 0.0)]);
        Ok(())
    }

    #[test]
    fn time_limits_overestimate_deterministically() {
        let j = TraceJob {
            id: 7,
            submit: 0,
            duration: 3_600_000,
            gpus: 1,
            account: "a".into(),
            user: "a".into(),
            utilization: vec![],
        };
        let a = user_time_limit(&j, 1, 1.5, 5.0);
        assert_eq!(a, user_time_limit(&j, 1, 1.5, 5.0));
        assert!((5_400_000..=18_000_000 + MINUTE).contains(&a), "{a}");
        assert_eq!(a % MINUTE, 0);
    }
}
