//! Trace loading: the Philly CSV and a documented generic CSV, into [`TraceJob`]s, plus the two
//! deterministic transformations the experiments need (user time limits and idle tails).
//!
//! Generic CSV (header line required, comma-separated, no quoting, `#` lines ignored):
//!
//! | column | required | meaning |
//! |---|---|---|
//! | `submit` | yes | submission time, seconds (any origin; the replay starts at the earliest) |
//! | `duration` | yes | seconds the job runs once it has its GPUs |
//! | `gpus` | yes | GPUs asked for, as one gang: a whole number, or a fraction of one GPU below 1 (`0.25`: a quarter of one GPU, shared with other fractions) |
//! | `account` | one of the two | the account (team) charged; defaults to `user` |
//! | `user` | one of the two | the user; defaults to `account` |
//! | `utilization` | no | `percent:seconds` segments separated by `;`, in run time order; the last segment lasts to the end. Empty: busy throughout |
//! | `gpu_model` | no | only GPUs of this model (as the cluster file names them); empty: any |
//! | `priority` (or `qos`) | no | `low`, `normal` (default) or `high`: the QOS tier |
//! | `preemptible` | no | `true` (default) or `false` (`1`/`0`, `yes`/`no` too): may the scheduler stop it |
//! | `gpu_memory_gb` | no | GPU memory a fraction needs; default: its fraction of the GPU's memory |
//! | `cpus`, `memory_gb` | no | read and checked, not scheduled: the core places GPUs (a warning says so) |
//!
//! Any other column is named in a warning (a typo in `preemptible` should not silently make every
//! job preemptible). Example: `submit,duration,gpus,account,user,utilization` /
//! `0,3600,8,vision,alice,100:1200;0:2400` (busy 20 minutes, then idle 40).

use super::csv::{Table, flag};
use crate::error::{Error, Result};
use crate::ids::{MINUTE, Millis, SECOND, Time};
use crate::job::Qos;

/// One job of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceJob {
    /// Position in the file (0-based), the job's id in the replay.
    pub id: u64,
    /// Submission, milliseconds from the trace's first submission.
    pub submit: Time,
    /// Run time once started, milliseconds.
    pub duration: Millis,
    /// Whole GPUs, one gang; 1 for a fraction of a GPU.
    pub gpus: u32,
    /// Percent of one GPU (1 to 99) when the job asks for a fraction; then `gpus` is 1.
    pub fraction: Option<u32>,
    /// GPU memory a fraction needs, MiB; `None`: its fraction of the GPU's memory.
    pub gpu_memory_mb: Option<u64>,
    /// Only GPUs of this model, when set.
    pub gpu_model: Option<String>,
    /// QOS tier.
    pub qos: Qos,
    /// May be preempted.
    pub preemptible: bool,
    /// Account charged.
    pub account: String,
    /// User.
    pub user: String,
    /// Utilization steps `(run-time offset, percent)`, ascending; empty means 100% throughout.
    pub utilization: Vec<(Millis, f32)>,
}

impl TraceJob {
    /// A whole-GPU job with the defaults of a trace that says nothing else (normal QOS,
    /// preemptible, any model, busy throughout).
    pub fn new(submit: Time, duration: Millis, gpus: u32, account: &str, user: &str) -> TraceJob {
        TraceJob {
            id: 0,
            submit,
            duration,
            gpus,
            fraction: None,
            gpu_memory_mb: None,
            gpu_model: None,
            qos: Qos::Normal,
            preemptible: true,
            account: account.into(),
            user: user.into(),
            utilization: vec![],
        }
    }

    /// What the job holds, in hundredths of a GPU (a fraction holds its percent).
    pub fn hundredths(&self) -> u32 {
        self.fraction.unwrap_or(self.gpus * 100)
    }

    /// What the job holds, in GPUs.
    pub fn gpu_amount(&self) -> f64 {
        f64::from(self.hundredths()) / 100.0
    }
}

/// A loaded trace: its jobs, and what the loader noticed but did not refuse.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// Jobs in submission order; `id` is the position.
    pub jobs: Vec<TraceJob>,
    /// One line per thing the user should know (unknown columns, columns read but not
    /// modelled).
    pub warnings: Vec<String>,
}

/// Which loader reads the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    /// `timestamp,duration,num_gpus,gpu_time,cluster`.
    Philly,
    /// The generic CSV above.
    Generic,
}

const PHILLY_COLUMNS: [&str; 5] = ["timestamp", "duration", "num_gpus", "gpu_time", "cluster"];
const GENERIC_COLUMNS: [&str; 13] = [
    "submit",
    "duration",
    "gpus",
    "account",
    "user",
    "utilization",
    "gpu_model",
    "priority",
    "qos",
    "preemptible",
    "gpu_memory_gb",
    "cpus",
    "memory_gb",
];

/// Reads `path` as `format`, or guessed from the header when `None`.
pub fn load(path: &str, format: Option<TraceFormat>) -> Result<Trace> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_string(),
        source,
    })?;
    parse(path, &text, format)
}

/// Parses trace text; `name` appears in errors and warnings.
pub fn parse(name: &str, text: &str, format: Option<TraceFormat>) -> Result<Trace> {
    let table = Table::parse(name, text)?;
    let format = format.unwrap_or(if table.cols.contains(&"num_gpus") {
        TraceFormat::Philly
    } else {
        TraceFormat::Generic
    });
    let err = |line: usize, column: &str, message: String| table.error(line, column, message);
    let col = |c: &str| table.col(c);
    let need = |c: &str| table.need(c, "");
    let (known, what): (&[&str], &str) = match format {
        TraceFormat::Philly => (&PHILLY_COLUMNS, "a Philly format"),
        TraceFormat::Generic => (&GENERIC_COLUMNS, "a generic format"),
    };
    let mut warnings: Vec<String> = table.unknown_columns(known, what).into_iter().collect();
    let mut raw: Vec<(f64, TraceJob)> = Vec::new();
    match format {
        TraceFormat::Philly => {
            let (ts, du, ng, cl) = (
                need("timestamp")?,
                need("duration")?,
                need("num_gpus")?,
                need("cluster")?,
            );
            for (line, f) in &table.rows {
                let line = *line;
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
                let account = get(cl, "cluster")?;
                raw.push((submit, TraceJob::new(0, duration, gpus, account, account)));
            }
        }
        TraceFormat::Generic => {
            let (su, du, gp) = (need("submit")?, need("duration")?, need("gpus")?);
            let (ac, us, ut) = (col("account"), col("user"), col("utilization"));
            let (model, prio, pre, gmem) = (
                col("gpu_model"),
                col("priority").or(col("qos")),
                col("preemptible"),
                col("gpu_memory_gb"),
            );
            let (cpus, mem) = (col("cpus"), col("memory_gb"));
            if ac.is_none() && us.is_none() {
                return Err(err(
                    1,
                    "account",
                    "need an `account` or a `user` column".into(),
                ));
            }
            let unmodelled: Vec<&str> = [("cpus", cpus), ("memory_gb", mem)]
                .into_iter()
                .filter_map(|(n, c)| c.map(|_| n))
                .collect();
            if !unmodelled.is_empty() {
                warnings.push(format!(
                    "{name}: column(s) {} read and checked but not scheduled: the replay places \
                     GPUs only, as perch's scheduler does",
                    unmodelled.join(", ")
                ));
            }
            for (line, f) in &table.rows {
                let line = *line;
                let get = |idx: usize, c: &str| {
                    f.get(idx)
                        .copied()
                        .ok_or_else(|| err(line, c, "missing field".into()))
                };
                // An optional column's value on this line; empty is absent.
                let opt = |idx: Option<usize>| {
                    idx.and_then(|c| f.get(c))
                        .copied()
                        .filter(|s| !s.is_empty())
                };
                let submit: f64 = get(su, "submit")?.parse().map_err(|_| {
                    err(
                        line,
                        "submit",
                        format!("`{}` is not a number of seconds", f[su]),
                    )
                })?;
                // Bounded as durations are: a submission 10^16 s out overflowed the replay's
                // millisecond clock once a time limit was added to it.
                if !submit.is_finite() || submit.abs() >= MAX_SECONDS {
                    return Err(err(
                        line,
                        "submit",
                        format!(
                            "`{}` must be a number of seconds under 10^12 either side of 0 (any \
                             origin: the replay starts at the earliest)",
                            f[su]
                        ),
                    ));
                }
                let duration =
                    seconds(get(du, "duration")?).map_err(|m| err(line, "duration", m))?;
                let (gpus, fraction) =
                    gpu_request(get(gp, "gpus")?).map_err(|m| err(line, "gpus", m))?;
                let (account, user) = match (opt(ac), opt(us)) {
                    (Some(a), Some(u)) => (a, u),
                    (Some(a), None) => (a, a),
                    (None, Some(u)) => (u, u),
                    (None, None) => {
                        return Err(err(line, "account", "empty account and user".into()));
                    }
                };
                let mut job = TraceJob::new(0, duration, gpus, account, user);
                job.fraction = fraction;
                if let Some(p) = opt(ut) {
                    job.utilization = profile(p).map_err(|m| err(line, "utilization", m))?;
                }
                job.gpu_model = opt(model).map(str::to_string);
                if let Some(q) = opt(prio) {
                    job.qos = qos(q).map_err(|m| err(line, "priority", m))?;
                }
                if let Some(p) = opt(pre) {
                    job.preemptible = flag(p).map_err(|m| err(line, "preemptible", m))?;
                }
                if let Some(g) = opt(gmem) {
                    let gb = amount(g).map_err(|m| err(line, "gpu_memory_gb", m))?;
                    if fraction.is_none() {
                        return Err(err(
                            line,
                            "gpu_memory_gb",
                            "only a fraction of a GPU declares its memory (a whole GPU has all of it); leave it empty".into(),
                        ));
                    }
                    job.gpu_memory_mb = Some((gb * 1024.0).ceil() as u64);
                }
                for (c, n) in [(cpus, "cpus"), (mem, "memory_gb")] {
                    if let Some(v) = opt(c) {
                        amount(v).map_err(|m| err(line, n, m))?;
                    }
                }
                raw.push((submit, job));
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
    Ok(Trace { jobs, warnings })
}

/// A `gpus` field: whole GPUs, or a fraction of one as a percent.
fn gpu_request(s: &str) -> std::result::Result<(u32, Option<u32>), String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a GPU count"))?;
    if v.is_finite() && v > 0.0 && v < 1.0 {
        let percent = (v * 100.0).round();
        return match percent as u32 {
            0 => Err(format!(
                "`{s}` is less than 1% of a GPU: the smallest fraction is 0.01"
            )),
            100 => Ok((1, None)),
            p => Ok((1, Some(p))),
        };
    }
    if !(v.is_finite() && v > 0.0) {
        return Err(format!(
            "`{s}` must be a whole number of GPUs from 1 to 4096, or a fraction of one GPU such as 0.5"
        ));
    }
    if v.fract() != 0.0 && v > 1.0 {
        return Err(format!(
            "`{s}`: a fraction is only possible below one GPU (a gang takes whole GPUs); ask for {} or {}",
            v.floor(),
            v.ceil()
        ));
    }
    count(s).map(|g| (g, None))
}

fn qos(s: &str) -> std::result::Result<Qos, String> {
    match s.to_ascii_lowercase().as_str() {
        "low" => Ok(Qos::Low),
        "normal" => Ok(Qos::Normal),
        "high" => Ok(Qos::High),
        _ => Err(format!("`{s}` is not low, normal or high")),
    }
}

fn amount(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

/// The largest submission time or duration a trace may give, seconds (31,000 years): sums of
/// them and of time limits stay far inside the replay's millisecond clock.
const MAX_SECONDS: f64 = 1e12;

fn seconds(s: &str) -> std::result::Result<Millis, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..MAX_SECONDS).contains(&v) => {
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

/// How simulated users declare time limits (traces carry none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LimitModel {
    /// The true duration times a factor drawn uniformly per job from the options'
    /// `limit_factor`, rounded up to a whole minute: every limit says something of its job.
    #[default]
    Uniform,
    /// Users' habits, after Tsafrir, Etsion and Feitelson ("Modeling user runtime estimates",
    /// 2005): estimates are modal (a few round values cover most jobs, the queue's maximum the
    /// most popular one) and belong to the user more than to the job. A share
    /// [`MAX_HABIT_SHARE`] of users, drawn by the seed, always declare the maximum
    /// ([`MAX_LIMIT`], or the run rounded up to whole days when longer); the others take the
    /// uniform factor and round up to the next of [`ROUND_LIMITS`].
    Habits,
}

impl LimitModel {
    /// The name on the command line and in the scorecard.
    pub fn name(self) -> &'static str {
        match self {
            LimitModel::Uniform => "uniform",
            LimitModel::Habits => "habits",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<LimitModel> {
        [LimitModel::Uniform, LimitModel::Habits]
            .into_iter()
            .find(|m| m.name() == s)
    }
}

/// The queue's maximum time limit under [`LimitModel::Habits`]: 7 days.
pub const MAX_LIMIT: Millis = 7 * 24 * 60 * MINUTE;
/// The share of users who always declare [`MAX_LIMIT`] under [`LimitModel::Habits`].
pub const MAX_HABIT_SHARE: f64 = 0.3;
/// The round values the other users' limits are rounded up to under [`LimitModel::Habits`].
pub const ROUND_LIMITS: [Millis; 10] = [
    15 * MINUTE,
    30 * MINUTE,
    60 * MINUTE,
    2 * 60 * MINUTE,
    4 * 60 * MINUTE,
    8 * 60 * MINUTE,
    12 * 60 * MINUTE,
    24 * 60 * MINUTE,
    48 * 60 * MINUTE,
    72 * 60 * MINUTE,
];

/// A stable 64-bit key for a user name (FNV-1a), so habits follow the user across jobs and
/// runs.
fn user_key(user: &str) -> u64 {
    user.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The time limit a user would have declared under `model`: at least the real duration (a
/// job is never killed by its limit in a replay), drawn deterministically from `seed`, the
/// job id and (for habits) the user.
pub fn user_time_limit(job: &TraceJob, seed: u64, lo: f64, hi: f64, model: LimitModel) -> Millis {
    let f = lo + (hi - lo) * unit(seed, job.id, 1);
    let raw = ((job.duration as f64 * f).ceil() as Millis).max(5 * MINUTE);
    let minutes = raw.saturating_add(MINUTE - 1) / MINUTE * MINUTE;
    match model {
        LimitModel::Uniform => minutes,
        LimitModel::Habits => {
            let day = 24 * 60 * MINUTE;
            let whole_days = |t: Millis| (t + day - 1) / day * day;
            if unit(seed, user_key(&job.user), 4) < MAX_HABIT_SHARE {
                MAX_LIMIT.max(whole_days(job.duration))
            } else {
                ROUND_LIMITS
                    .into_iter()
                    .find(|&l| l >= minutes)
                    .unwrap_or_else(|| {
                        whole_days(minutes)
                            .min(MAX_LIMIT)
                            .max(whole_days(job.duration))
                    })
            }
        }
    }
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
        // A submission far out overflowed the replay's clock (a panic in the scheduler core).
        check(
            "submit,duration,gpus,user\n0,10,1,a\n9223372036854775,10,1,a\n",
            3,
            "submit",
        );
        check("submit,duration,gpus,user\n1e300,10,1,a\n", 2, "submit");
    }

    #[test]
    fn generic_reads_profiles_and_rebases_time() -> Result<()> {
        let jobs = parse(
            "g.csv",
            "submit,duration,gpus,account,user,utilization\n100,60,8,vision,al,100:20;0:40\n90,5,1,nlp,,\n",
            None,
        )?
        .jobs;
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
    fn generic_reads_fractions_models_priorities_and_preemptibility() -> Result<()> {
        let t = parse(
            "g.csv",
            "submit,duration,gpus,user,gpu_model,priority,preemptible,gpu_memory_gb,cpus,memory_gb\n\
             0,60,0.46,al,,HIGH,no,10,4,32\n\
             1,60,8,bo,A100,low,1,,,\n\
             2,60,0.999,cy,,,,,,\n",
            None,
        )?;
        let [a, b, c] = &t.jobs[..] else {
            panic!("three jobs: {:?}", t.jobs)
        };
        assert_eq!(
            (a.gpus, a.fraction, a.gpu_memory_mb, a.qos, a.preemptible),
            (1, Some(46), Some(10 * 1024), Qos::High, false)
        );
        assert_eq!(a.hundredths(), 46);
        assert_eq!(
            (
                b.gpus,
                b.fraction,
                b.gpu_model.as_deref(),
                b.qos,
                b.preemptible
            ),
            (8, None, Some("A100"), Qos::Low, true)
        );
        assert_eq!(
            (c.gpus, c.fraction),
            (1, None),
            "0.999 rounds to a whole GPU"
        );
        assert_eq!(t.warnings.len(), 1, "{:?}", t.warnings);
        assert!(
            t.warnings[0].contains("cpus, memory_gb") && t.warnings[0].contains("not scheduled")
        );
        Ok(())
    }

    /// A misspelt column would otherwise be dropped without a word (every job preemptible,
    /// say); the warning names it and lists the known columns.
    #[test]
    fn unknown_columns_are_named_in_a_warning() -> Result<()> {
        let t = parse(
            "g.csv",
            "submit,duration,gpus,user,preemtible\n0,60,1,al,false\n",
            None,
        )?;
        assert_eq!(t.jobs.len(), 1);
        assert!(t.jobs[0].preemptible);
        assert_eq!(t.warnings.len(), 1);
        assert!(
            t.warnings[0].contains("preemtible") && t.warnings[0].contains("known: submit"),
            "{:?}",
            t.warnings
        );
        let p = parse(
            "p.csv",
            "timestamp,duration,num_gpus,gpu_time,cluster,status\n2017-10-09 07:01:55,66.0,1,66.0,a,Pass\n",
            None,
        )?;
        assert!(p.warnings[0].contains("status") && p.warnings[0].contains("Philly"));
        Ok(())
    }

    #[test]
    fn impossible_requests_name_line_column_and_remedy() {
        let bad = |row: &str, column: &str, says: &str| {
            let text =
                format!("submit,duration,gpus,user,priority,preemptible,gpu_memory_gb\n{row}\n");
            match parse("g.csv", &text, None) {
                Err(Error::Trace {
                    column: c, message, ..
                }) => {
                    assert_eq!(c, column, "{row}");
                    assert!(message.contains(says), "{row}: {message}");
                }
                other => panic!("{row}: expected an error, got {other:?}"),
            }
        };
        bad("0,60,1.5,al,,,", "gpus", "ask for 1 or 2");
        bad("0,60,0.001,al,,,", "gpus", "smallest fraction is 0.01");
        bad("0,60,-1,al,,,", "gpus", "fraction of one GPU");
        bad("0,60,1,al,urgent,,", "priority", "low, normal or high");
        bad("0,60,1,al,,maybe,", "preemptible", "true or false");
        bad("0,60,2,al,,,10", "gpu_memory_gb", "only a fraction");
        bad("0,60,0.5,al,,,-3", "gpu_memory_gb", "positive");
    }

    #[test]
    fn time_limits_overestimate_deterministically() {
        let mut j = TraceJob::new(0, 3_600_000, 1, "a", "a");
        j.id = 7;
        let a = user_time_limit(&j, 1, 1.5, 5.0, LimitModel::Uniform);
        assert_eq!(a, user_time_limit(&j, 1, 1.5, 5.0, LimitModel::Uniform));
        assert!((5_400_000..=18_000_000 + MINUTE).contains(&a), "{a}");
        assert_eq!(a % MINUTE, 0);
    }

    /// Under habits a limit is never below the run, a user keeps one habit, about
    /// [`MAX_HABIT_SHARE`] of users declare the maximum, and the others' limits are round.
    #[test]
    fn habits_are_the_users_and_round() {
        let (mut max_users, mut users) = (0, 0);
        for u in 0..400u64 {
            let user = format!("user{u}");
            let limits: Vec<Millis> = (0..5u64)
                .map(|k| {
                    let mut j = TraceJob::new(
                        0,
                        (7 + 13 * k as i64 + u as i64 % 50) * MINUTE,
                        1,
                        "a",
                        &user,
                    );
                    j.id = u * 10 + k;
                    let l = user_time_limit(&j, 3, 1.5, 5.0, LimitModel::Habits);
                    assert!(l >= j.duration, "{l} < {}", j.duration);
                    l
                })
                .collect();
            users += 1;
            if limits.iter().all(|&l| l == MAX_LIMIT) {
                max_users += 1;
            } else {
                assert!(
                    limits.iter().all(|l| ROUND_LIMITS.contains(l)),
                    "{limits:?}"
                );
            }
        }
        let share = f64::from(max_users) / f64::from(users);
        assert!((share - MAX_HABIT_SHARE).abs() < 0.08, "{share}");
        // A run longer than the maximum gets whole days past it.
        let long = TraceJob::new(0, 9 * 24 * 60 * MINUTE + 1, 1, "a", "someone");
        let l = user_time_limit(&long, 3, 1.5, 5.0, LimitModel::Habits);
        assert!(l >= long.duration && l % (24 * 60 * MINUTE) == 0, "{l}");
    }
}
