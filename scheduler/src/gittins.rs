//! The Gittins index of a job's attained service, over the distribution of the service
//! finished jobs used (Tiresias, NSDI'19, §3.2: 2D-Gittins when the distribution is known;
//! Gittins, 1979): the scorecard's anchor that learns durations from what it has seen rather
//! than from an oracle or the declared limits.
//!
//! A job's service is its GPU-time (GPUs × run time, over all its runs), as LAS counts it. For
//! a job that has attained `a`, with `S` the service of a job drawn from the distribution,
//! the index is
//!
//! `G(a) = max over Δ > 0 of P(S − a ≤ Δ | S > a) / E[min(S − a, Δ) | S > a]`,
//!
//! the best rate at which a quantum of service spent on the job may finish it. The job with
//! the highest index runs first. For a distribution whose hazard falls with age (the heavy
//! tails of GPU clusters) a fresh job ranks high and a job that outlived the common lengths
//! falls behind, as under LAS; but where lengths cluster (a mode of 2-hour jobs) a job close
//! to the end of that mode ranks above a fresh one, which LAS cannot tell.
//!
//! The distribution is learned as jobs finish (completed, or ended at their time limit; a
//! server restoring its state gives its finished jobs again), in log-spaced bins: the index
//! of any attained service costs one pass over [`BINS`] bins. With fewer than [`AT_LEAST`]
//! finished jobs there is no index, and the policy falls back to LAS's two queues.

/// Bins of service, each `2^(1/2)` times as wide as the one before, from 1 GPU-second to
/// `2^32` (the last bin holds everything above).
pub(crate) const BINS: usize = 64;
/// Finished jobs needed before an index is given.
pub(crate) const AT_LEAST: u64 = 20;

fn bin(service: f64) -> usize {
    if service < 2f64.sqrt() {
        return 0;
    }
    ((service.log2() * 2.0).floor() as usize).min(BINS - 1)
}

/// The service finished jobs used, binned.
#[derive(Clone, Debug)]
pub(crate) struct Service {
    /// Jobs in each bin.
    counts: [u64; BINS],
    /// Their service, summed, in GPU-seconds.
    sums: [f64; BINS],
    total: u64,
}

impl Default for Service {
    fn default() -> Self {
        Service {
            counts: [0; BINS],
            sums: [0.0; BINS],
            total: 0,
        }
    }
}

impl Service {
    /// Records a finished job's service, in GPU-seconds (a negative or non-finite value, which
    /// no job has, is not recorded).
    pub(crate) fn record(&mut self, service: f64) {
        if !service.is_finite() || service < 0.0 {
            return;
        }
        let k = bin(service);
        self.counts[k] += 1;
        self.sums[k] += service;
        self.total += 1;
    }

    /// Whether enough jobs have finished for an index.
    pub(crate) fn learned(&self) -> bool {
        self.total >= AT_LEAST
    }

    /// The Gittins index of a job that has attained `attained` GPU-seconds, in finishes per
    /// GPU-second (between 0 and 1); `None` before [`AT_LEAST`] jobs have finished. A job that has outlived
    /// every finished one is taken to need as much again as it has had (at least the longest
    /// ones' mean): the older, the lower.
    pub(crate) fn index(&self, attained: f64) -> Option<f64> {
        if !self.learned() {
            return None;
        }
        let a = attained.max(0.0);
        // The finished jobs still longer than `a`: each bin's jobs at their mean, the bin
        // holding `a` counting only where its mean is past `a`.
        let mut best: f64 = 0.0;
        let (mut done, mut spent) = (0.0f64, 0.0f64);
        let mut above: f64 = (bin(a)..BINS)
            .filter(|&k| self.counts[k] > 0 && self.sums[k] / self.counts[k] as f64 > a)
            .map(|k| self.counts[k] as f64)
            .sum();
        if above == 0.0 {
            let longest = (0..BINS).rev().find(|&k| self.counts[k] > 0)?;
            let mean = self.sums[longest] / self.counts[longest] as f64;
            return Some(1.0 / mean.max(a).max(1.0));
        }
        for k in bin(a)..BINS {
            if self.counts[k] == 0 {
                continue;
            }
            let n = self.counts[k] as f64;
            let mean = self.sums[k] / n;
            if mean <= a {
                continue;
            }
            // Serving up to this bin's mean: its jobs and those before finish, having used
            // their remaining service; every longer one uses the whole quantum.
            above -= n;
            done += n;
            spent += n * (mean - a);
            let quantum = mean - a;
            // Each job counted as at least one GPU-second: the index is at most 1.
            let rate = done / (spent + above * quantum).max(done);
            best = best.max(rate);
        }
        Some(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lower edge of bin `k`, in GPU-seconds (bin 0 starts at 0).
    fn edge(k: usize) -> f64 {
        if k == 0 { 0.0 } else { (k as f64 / 2.0).exp2() }
    }

    fn of(services: &[(f64, usize)]) -> Service {
        let mut s = Service::default();
        for &(v, n) in services {
            for _ in 0..n {
                s.record(v);
            }
        }
        s
    }

    #[test]
    fn bins_grow_by_the_square_root_of_two() {
        assert_eq!(bin(0.0), 0);
        assert_eq!(bin(1.0), 0);
        assert_eq!(bin(1.5), 1);
        assert_eq!(bin(2.0), 2);
        assert_eq!(bin(1e30), BINS - 1);
        for k in 1..BINS {
            assert_eq!(bin(edge(k) * 1.000_001), k, "bin {k}");
        }
    }

    /// No index before enough jobs finished, and nothing recorded that no job could use.
    #[test]
    fn needs_history() {
        let mut s = of(&[(100.0, (AT_LEAST - 1) as usize)]);
        s.record(f64::NAN);
        s.record(-1.0);
        assert_eq!(s.index(0.0), None);
        s.record(100.0);
        assert!(s.index(0.0).is_some());
    }

    /// Heavy tail (90% of jobs of 10 GPU-seconds, 10% of 10,000): a fresh job ranks above one
    /// that outlived the short ones, as under least attained service.
    #[test]
    fn a_job_past_the_common_length_falls_behind() {
        let s = of(&[(10.0, 90), (10_000.0, 10)]);
        let fresh = s.index(0.0).expect("index");
        let past = s.index(20.0).expect("index");
        assert!(fresh > 10.0 * past, "{fresh} {past}");
    }

    /// Lengths clustered at 7,200 GPU-seconds: a job near the end of the cluster ranks above
    /// a fresh one (LAS would put it behind).
    #[test]
    fn a_job_near_its_likely_end_ranks_first() {
        let s = of(&[(7_200.0, 80), (72_000.0, 20)]);
        let fresh = s.index(0.0).expect("index");
        let near = s.index(7_000.0).expect("index");
        assert!(near > fresh, "{near} {fresh}");
        // Past the cluster it falls behind the fresh job.
        let past = s.index(8_000.0).expect("index");
        assert!(past < fresh, "{past} {fresh}");
    }

    /// A job older than every finished one still gets an index, below the others', and
    /// lower the older it is.
    #[test]
    fn a_job_older_than_all_falls_with_age() {
        let s = of(&[(10.0, 30), (1_000.0, 10)]);
        let old = s.index(2_000.0).expect("index");
        let older = s.index(1e6).expect("index");
        assert!(older > 0.0 && older < old && old < s.index(0.0).expect("index"));
    }
}
