//! The accounting of one GPU of one allocation, kept as a partial aggregate of its samples
//! (counts, sums, minima and maxima) rather than as finished numbers, so that folding the
//! samples of two windows one after the other gives exactly what one fold over both would.
//! That is what lets a running job be accounted a few minutes at a time, each piece folded
//! from raw telemetry while it still exists, and still come out exact.

use serde::{Deserialize, Serialize};

/// What the samples of one GPU within one allocation's folded windows add up to.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuUsage {
    /// Rows of `gpu_samples` folded.
    pub samples: u64,
    /// Of those, rows that reported `utilization_gpu_pct`.
    pub util_samples: u64,
    /// Sum of `utilization_gpu_pct` over those rows (percent).
    pub util_sum: f64,
    /// Highest `utilization_gpu_pct` seen (percent).
    pub util_max: Option<f64>,
    /// Highest `memory_used_bytes` seen.
    pub memory_max_bytes: Option<u64>,
    /// Lowest and highest reading of the `energy_joules` counter.
    pub energy_min_joules: Option<f64>,
    pub energy_max_joules: Option<f64>,
    /// When the counter was first and last read (sample times, ms): the stretch its rise
    /// covers. `None` in usage folded before perch recorded them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub energy_first_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub energy_last_ms: Option<i64>,
    /// Rows that reported `power_watts`, and the sum of their readings.
    pub power_samples: u64,
    pub power_sum_watts: f64,
}

fn max_f(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

fn min_f(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

impl GpuUsage {
    /// Adds the aggregate of a later (or earlier: the order does not matter) window.
    pub fn merge(&mut self, other: &GpuUsage) {
        self.samples += other.samples;
        self.util_samples += other.util_samples;
        self.util_sum += other.util_sum;
        self.util_max = max_f(self.util_max, other.util_max);
        self.memory_max_bytes = match (self.memory_max_bytes, other.memory_max_bytes) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        self.energy_min_joules = min_f(self.energy_min_joules, other.energy_min_joules);
        self.energy_max_joules = max_f(self.energy_max_joules, other.energy_max_joules);
        self.energy_first_ms = match (self.energy_first_ms, other.energy_first_ms) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        self.energy_last_ms = self.energy_last_ms.max(other.energy_last_ms);
        self.power_samples += other.power_samples;
        self.power_sum_watts += other.power_sum_watts;
    }

    /// Mean `utilization_gpu_pct` of the folded samples; `None` when none reported it.
    pub fn mean_utilization_pct(&self) -> Option<f64> {
        (self.util_samples > 0).then(|| self.util_sum / self.util_samples as f64)
    }

    /// GPU-seconds actually used over `seconds` of folded allocation: the seconds times the
    /// mean utilization. `None` when no sample reported utilization (unknown, not idle).
    pub fn used_seconds(&self, seconds: f64) -> Option<f64> {
        self.mean_utilization_pct().map(|pct| seconds * pct / 100.0)
    }

    /// Mean `power_watts` of the folded samples; `None` when none reported it.
    pub fn mean_power_watts(&self) -> Option<f64> {
        (self.power_samples > 0).then(|| self.power_sum_watts / self.power_samples as f64)
    }

    /// Energy drawn over `seconds` of folded allocation (docs/schema.md, "Accounting and
    /// cost"): when the energy counter was read at two different times, its rise between them
    /// plus, for the part of the `seconds` those readings do not span, the mean power times
    /// that part (the counter's own mean rate where no power was reported); else the mean
    /// power times the seconds; `None` when the GPU reported neither. A job with one sample
    /// per GPU is therefore not a false 0: its counter has no rise to read.
    pub fn energy_joules(&self, seconds: f64) -> Option<f64> {
        let power = self.mean_power_watts();
        match (
            self.energy_min_joules,
            self.energy_max_joules,
            self.energy_first_ms,
            self.energy_last_ms,
        ) {
            (Some(lo), Some(hi), Some(first), Some(last)) if last > first => {
                let rise = (hi - lo).max(0.0);
                let span = (last - first) as f64 / 1000.0;
                let rate = power.unwrap_or(rise / span);
                Some(rise + rate * (seconds - span).max(0.0))
            }
            // Folded before the readings' times were recorded: the rise alone, as then.
            (Some(lo), Some(hi), None, None) if hi > lo => Some(hi - lo),
            _ => power.map(|w| w * seconds),
        }
    }
}

/// Sums that skip unknown values but stay unknown when every value is: a job whose GPUs
/// reported nothing has NULL usage, not 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KnownSum(Option<f64>);

impl KnownSum {
    pub fn add(&mut self, v: Option<f64>) {
        if let Some(v) = v {
            self.0 = Some(self.0.unwrap_or(0.0) + v);
        }
    }

    pub fn get(self) -> Option<f64> {
        self.0
    }
}

/// Fair-share usage of one allocation as the scheduler counts it: GPU-milliseconds, each
/// decayed by its age with half-life `half_life_ms` at `now`. The allocation is charged
/// continuously over [start, end), so this is the exact integral
/// `gpus * ∫ 2^(-(now - t) / h) dt` over that interval (a plain product when `h` is huge).
pub fn decayed_gpu_ms(
    gpus: f64,
    start_ms: i64,
    end_ms: i64,
    now_ms: i64,
    half_life_ms: i64,
) -> f64 {
    let end = end_ms.min(now_ms);
    if end <= start_ms || gpus <= 0.0 {
        return 0.0;
    }
    let h = half_life_ms.max(1) as f64;
    let age_end = (now_ms - end) as f64;
    let age_start = (now_ms - start_ms) as f64;
    let k = std::f64::consts::LN_2 / h;
    // ∫ 2^(-a/h) da from age_end to age_start = (e^{-k a_end} - e^{-k a_start}) / k; written
    // with exp_m1 so short intervals and long half-lives keep their precision.
    let v = (-k * age_end).exp() * -(-k * (age_start - age_end)).exp_m1() / k;
    gpus * v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One sample: utilization, memory, energy counter, power.
    type Row = (Option<f64>, Option<u64>, Option<f64>, Option<f64>);

    fn usage(rows: &[Row]) -> GpuUsage {
        usage_from(rows, 0)
    }

    /// The rows as samples one second apart, the first at second `first`.
    fn usage_from(rows: &[Row], first: i64) -> GpuUsage {
        let mut u = GpuUsage::default();
        for (t, &(util, mem, energy, power)) in (first..).map(|i| i * 1000).zip(rows) {
            u.merge(&GpuUsage {
                samples: 1,
                util_samples: u64::from(util.is_some()),
                util_sum: util.unwrap_or(0.0),
                util_max: util,
                memory_max_bytes: mem,
                energy_min_joules: energy,
                energy_max_joules: energy,
                energy_first_ms: energy.map(|_| t),
                energy_last_ms: energy.map(|_| t),
                power_samples: u64::from(power.is_some()),
                power_sum_watts: power.unwrap_or(0.0),
            });
        }
        u
    }

    #[test]
    fn derived_values_follow_the_definition() {
        let u = usage(&[
            (Some(100.0), Some(10), Some(1000.0), Some(300.0)),
            (Some(50.0), Some(30), Some(1600.0), Some(200.0)),
            (None, None, None, None),
        ]);
        assert_eq!(u.samples, 3);
        assert_eq!(u.mean_utilization_pct(), Some(75.0));
        assert_eq!(u.used_seconds(10.0), Some(7.5));
        assert_eq!(u.util_max, Some(100.0));
        assert_eq!(u.memory_max_bytes, Some(30));
        assert_eq!(
            u.energy_joules(1.0),
            Some(600.0),
            "the counter's rise over the second its readings span"
        );
        assert_eq!(
            u.energy_joules(10.0),
            Some(600.0 + 250.0 * 9.0),
            "plus the mean power over the nine seconds they do not"
        );
        // One sample per GPU (a short job): the counter has no rise to read, so the energy is
        // the mean power x time, never a false 0; unknown without power.
        let once = usage(&[(Some(90.0), None, Some(5.0e6), Some(650.0))]);
        assert_eq!(once.energy_joules(4.0), Some(2600.0), "not a false 0");
        let counter_only = usage(&[(Some(90.0), None, Some(5.0e6), None)]);
        assert_eq!(counter_only.energy_joules(4.0), None, "unknown, not 0");
        let no_power = usage(&[
            (Some(90.0), None, Some(1000.0), None),
            (Some(90.0), None, Some(1500.0), None),
        ]);
        assert_eq!(
            no_power.energy_joules(3.0),
            Some(1500.0),
            "without power, the counter's own rate over the rest"
        );
        let no_counter = usage(&[(Some(0.0), None, None, Some(100.0))]);
        assert_eq!(
            no_counter.energy_joules(4.0),
            Some(400.0),
            "mean power x time"
        );
        assert_eq!(
            no_counter.used_seconds(4.0),
            Some(0.0),
            "idle is 0, not unknown"
        );
        let silent = usage(&[(None, None, None, None)]);
        assert_eq!(silent.used_seconds(4.0), None, "unknown, not 0");
        assert_eq!(silent.energy_joules(4.0), None);
    }

    #[test]
    fn known_sum_is_null_only_when_everything_is() {
        let mut s = KnownSum::default();
        s.add(None);
        assert_eq!(s.get(), None);
        s.add(Some(0.0));
        s.add(None);
        s.add(Some(2.5));
        assert_eq!(s.get(), Some(2.5));
    }

    #[test]
    fn decay_is_the_integral_of_a_halving_charge() {
        let hour = 3_600_000;
        // A huge half-life: plain GPU-milliseconds.
        let plain = decayed_gpu_ms(2.0, 0, hour, 2 * hour, i64::MAX / 4);
        assert!((plain - 2.0 * hour as f64).abs() < 1e-3, "{plain}");
        // One GPU-hour that ended one half-life ago: every part of it is between h and
        // h + 1 hour old, so it counts between 2^-(1 + 1/10) and 2^-1 of an hour.
        let h = 10 * hour;
        let v = decayed_gpu_ms(1.0, 0, hour, hour + h, h);
        let lo = 0.5 * hour as f64 * (-(1.0f64 / 10.0)).exp2();
        assert!(v > lo && v < 0.5 * hour as f64, "{v}");
        assert_eq!(decayed_gpu_ms(1.0, 5, 5, 10, h), 0.0);
        assert_eq!(
            decayed_gpu_ms(1.0, 20, 30, 10, h),
            0.0,
            "not started yet at now"
        );
    }

    proptest! {
        /// Folding samples in any split gives the same aggregate as folding them at once.
        #[test]
        fn merging_windows_is_exact(
            rows in prop::collection::vec(
                (prop::option::of(0.0f64..100.0), prop::option::of(0u64..1 << 40),
                 prop::option::of(0.0f64..1e9), prop::option::of(0.0f64..700.0)), 0..40),
            split in 0usize..40,
        ) {
            let split = split.min(rows.len());
            let whole = usage(&rows);
            let mut parts = usage(&rows[..split]);
            parts.merge(&usage_from(&rows[split..], split as i64));
            prop_assert_eq!(whole.samples, parts.samples);
            prop_assert_eq!(whole.util_max, parts.util_max);
            prop_assert_eq!(whole.memory_max_bytes, parts.memory_max_bytes);
            // Sums may round differently in the last bits; minima, maxima and counts never do.
            for (a, b) in [
                (whole.used_seconds(60.0), parts.used_seconds(60.0)),
                (whole.energy_joules(60.0), parts.energy_joules(60.0)),
            ] {
                match (a, b) {
                    (Some(a), Some(b)) => prop_assert!((a - b).abs() <= 1e-9 * a.abs().max(1.0)),
                    (a, b) => prop_assert_eq!(a, b),
                }
            }
        }

        /// Used never exceeds allocated: utilization is at most 100 %.
        #[test]
        fn used_is_at_most_allocated(
            utils in prop::collection::vec(0.0f64..=100.0, 1..50),
            seconds in 0.0f64..1e7,
        ) {
            let rows: Vec<_> = utils.iter().map(|u| (Some(*u), None, None, None)).collect();
            let used = usage(&rows).used_seconds(seconds).unwrap_or(f64::NAN);
            prop_assert!(used <= seconds * (1.0 + 1e-12) && used >= 0.0);
        }
    }
}
