//! sreport's cluster utilization, per UTC day: every GPU-millisecond of every GPU the
//! cluster had is exactly one of allocated, idle, drained or down, so the four add up to the
//! capacity. Computed from the node state history and the allocations (both kept by the
//! control plane), not from telemetry: a GPU is allocated when a job holds it, whatever it
//! did with it. Used GPU-hours come from the allocations' folded telemetry.

use std::collections::{BTreeMap, BTreeSet, HashMap};

pub const DAY_MS: i64 = 86_400_000;

/// What a node was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Availability {
    Up,
    Drained,
    Down,
}

/// A node's state over a time range; `end_ms` is `None` while it lasts.
#[derive(Debug, Clone)]
pub struct Span<'a> {
    pub node: &'a str,
    pub gpus: u32,
    pub state: Availability,
    pub start_ms: i64,
    pub end_ms: Option<i64>,
}

/// One GPU held by one allocation, with the GPU-seconds it used over [start, used_until).
#[derive(Debug, Clone)]
pub struct Held<'a> {
    pub node: &'a str,
    pub gpu: u32,
    pub start_ms: i64,
    pub end_ms: Option<i64>,
    pub used_seconds: Option<f64>,
    /// Telemetry up to here is folded into `used_seconds`.
    pub used_until_ms: i64,
}

/// One day's GPU-time, in GPU-milliseconds except `used_seconds`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Day {
    /// Start of the day (Unix ms).
    pub start_ms: i64,
    pub capacity_ms: i64,
    pub allocated_ms: i64,
    pub idle_ms: i64,
    pub drained_ms: i64,
    pub down_ms: i64,
    pub used_seconds: f64,
    /// GPU-seconds of the allocations' folded time (GPUs whose use is known) in the day: what
    /// `used_seconds` is measured against.
    pub accounted_seconds: f64,
}

#[derive(Clone, Copy)]
enum Class {
    Allocated,
    Idle,
    Drained,
    Down,
}

impl Day {
    fn add(&mut self, class: Class, ms: i64) {
        self.capacity_ms += ms;
        match class {
            Class::Allocated => self.allocated_ms += ms,
            Class::Idle => self.idle_ms += ms,
            Class::Drained => self.drained_ms += ms,
            Class::Down => self.down_ms += ms,
        }
    }
}

/// Adds `[a, b)` to the days it covers.
fn spread(
    days: &mut BTreeMap<i64, Day>,
    day_ms: i64,
    mut a: i64,
    b: i64,
    mut f: impl FnMut(&mut Day, i64),
) {
    while a < b {
        let d = a.div_euclid(day_ms);
        let e = b.min((d + 1) * day_ms);
        f(
            days.entry(d).or_insert_with(|| Day {
                start_ms: d * day_ms,
                ..Day::default()
            }),
            e - a,
        );
        a = e;
    }
}

/// The days from the first node's arrival to `now_ms` (days of `day_ms`; [`DAY_MS`] outside
/// tests), oldest first, gaps included as zeros.
///
/// A GPU counts from the start of the first span that has it. At each instant it is
/// allocated if any allocation holds it (whatever the node's state: the job holds it until it
/// is requeued), else down, drained or idle by its node's state. Allocations outside every
/// span of their node are ignored for capacity (they cannot happen: nodes are never removed).
/// Each allocation's used GPU-seconds are spread over its folded time in proportion.
pub fn daily(spans: &[Span<'_>], held: &[Held<'_>], now_ms: i64, day_ms: i64) -> Vec<Day> {
    let mut days: BTreeMap<i64, Day> = BTreeMap::new();
    let end_of = |end: Option<i64>| end.unwrap_or(now_ms).min(now_ms);
    let mut by_node: BTreeMap<&str, Vec<&Span<'_>>> = BTreeMap::new();
    for s in spans {
        by_node.entry(s.node).or_default().push(s);
    }
    let mut holds: HashMap<(&str, u32), Vec<&Held<'_>>> = HashMap::new();
    for h in held {
        holds.entry((h.node, h.gpu)).or_default().push(h);
    }
    for (node, node_spans) in &by_node {
        let gpus = node_spans.iter().map(|s| s.gpus).max().unwrap_or(0);
        for gpu in 0..gpus {
            let mine = holds.get(&(*node, gpu)).map_or(&[][..], Vec::as_slice);
            let mut times: BTreeSet<i64> = BTreeSet::new();
            let mut delta: BTreeMap<i64, i64> = BTreeMap::new();
            for s in node_spans.iter().filter(|s| gpu < s.gpus) {
                times.insert(s.start_ms.min(now_ms));
                times.insert(end_of(s.end_ms));
            }
            for h in mine {
                let (a, b) = (h.start_ms.min(now_ms), end_of(h.end_ms));
                if a < b {
                    times.insert(a);
                    times.insert(b);
                    *delta.entry(a).or_default() += 1;
                    *delta.entry(b).or_default() -= 1;
                }
            }
            let mut holding = 0i64;
            let times: Vec<i64> = times.into_iter().collect();
            for w in times.windows(2) {
                let (a, b) = (w[0], w[1]);
                holding += delta.get(&a).copied().unwrap_or(0);
                // The latest-started span with this GPU that covers [a, b).
                let Some(span) = node_spans
                    .iter()
                    .filter(|s| gpu < s.gpus && s.start_ms <= a && end_of(s.end_ms) >= b)
                    .max_by_key(|s| s.start_ms)
                else {
                    continue;
                };
                let class = if holding > 0 {
                    Class::Allocated
                } else {
                    match span.state {
                        Availability::Up => Class::Idle,
                        Availability::Drained => Class::Drained,
                        Availability::Down => Class::Down,
                    }
                };
                spread(&mut days, day_ms, a, b, |d, ms| d.add(class, ms));
            }
        }
    }
    for h in held {
        let (Some(used), a) = (h.used_seconds, h.start_ms) else {
            continue;
        };
        let b = end_of(h.end_ms).min(h.used_until_ms);
        if b <= a {
            continue;
        }
        let per_ms = used / (b - a) as f64;
        spread(&mut days, day_ms, a, b, |d, ms| {
            d.used_seconds += per_ms * ms as f64;
            d.accounted_seconds += ms as f64 / 1000.0;
        });
    }
    let (Some(&first), Some(&last)) = (days.keys().next(), days.keys().next_back()) else {
        return Vec::new();
    };
    (first..=last)
        .map(|d| {
            days.remove(&d).unwrap_or(Day {
                start_ms: d * day_ms,
                ..Day::default()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A node: joins at `join`, then changes state after each duration.
    #[derive(Debug, Clone)]
    struct NodeCase {
        gpus: u32,
        join: i64,
        changes: Vec<(i64, Availability)>,
    }

    fn spans_of<'a>(name: &'a str, n: &NodeCase) -> Vec<Span<'a>> {
        let mut out = Vec::new();
        let mut t = n.join;
        let mut state = Availability::Up;
        for &(len, next) in &n.changes {
            out.push(Span {
                node: name,
                gpus: n.gpus,
                state,
                start_ms: t,
                end_ms: Some(t + len),
            });
            t += len;
            state = next;
        }
        out.push(Span {
            node: name,
            gpus: n.gpus,
            state,
            start_ms: t,
            end_ms: None,
        });
        out
    }

    fn availability() -> impl Strategy<Value = Availability> {
        prop_oneof![
            Just(Availability::Up),
            Just(Availability::Drained),
            Just(Availability::Down)
        ]
    }

    fn node_case() -> impl Strategy<Value = NodeCase> {
        (
            1u32..4,
            0i64..40,
            prop::collection::vec((1i64..30, availability()), 0..6),
        )
            .prop_map(|(gpus, join, changes)| NodeCase {
                gpus,
                join,
                changes,
            })
    }

    /// Per GPU: a sequence of (gap, length, used fraction) allocations after the node joins,
    /// never overlapping (the scheduler never double-books a GPU).
    fn holds_case() -> impl Strategy<Value = Holds> {
        prop::collection::vec(
            prop::collection::vec((0i64..20, 1i64..30, 0.0f64..=1.0, 0i64..40), 0..4),
            4,
        )
    }

    /// Per node, per GPU: (gap, length, used fraction, folded length) of each allocation.
    type Holds = Vec<Vec<(i64, i64, f64, i64)>>;

    const NAMES: [&str; 4] = ["n0", "n1", "n2", "n3"];

    fn build<'a>(nodes: &[NodeCase], holds: &[Holds], now: i64) -> (Vec<Span<'a>>, Vec<Held<'a>>) {
        let mut spans = Vec::new();
        let mut held = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            spans.extend(spans_of(NAMES[i], n));
            for (gpu, seq) in holds[i].iter().enumerate().take(n.gpus as usize) {
                let mut t = n.join;
                for &(gap, len, frac, folded) in seq {
                    let start = t + gap;
                    let end = start + len;
                    // The last one may still run at `now`.
                    let end_ms = (end < now).then_some(end);
                    let until = (start + folded).min(end.min(now));
                    let used = frac * (until - start).max(0) as f64 / 1000.0;
                    held.push(Held {
                        node: NAMES[i],
                        gpu: gpu as u32,
                        start_ms: start,
                        end_ms,
                        used_seconds: Some(used),
                        used_until_ms: until,
                    });
                    t = end;
                }
            }
        }
        (spans, held)
    }

    /// The same, one millisecond at a time.
    fn brute(
        spans: &[Span<'_>],
        held: &[Held<'_>],
        now: i64,
        day_ms: i64,
    ) -> BTreeMap<i64, [i64; 5]> {
        let mut out: BTreeMap<i64, [i64; 5]> = BTreeMap::new();
        for t in 0..now {
            for name in NAMES {
                let Some(span) = spans
                    .iter()
                    .filter(|s| s.node == name && s.start_ms <= t && s.end_ms.is_none_or(|e| t < e))
                    .max_by_key(|s| s.start_ms)
                else {
                    continue;
                };
                for gpu in 0..span.gpus {
                    let held_now = held.iter().any(|h| {
                        h.node == name
                            && h.gpu == gpu
                            && h.start_ms <= t
                            && h.end_ms.is_none_or(|e| t < e)
                    });
                    let slot = if held_now {
                        1
                    } else {
                        match span.state {
                            Availability::Up => 2,
                            Availability::Drained => 3,
                            Availability::Down => 4,
                        }
                    };
                    let day = out.entry(t.div_euclid(day_ms)).or_default();
                    day[0] += 1;
                    day[slot] += 1;
                }
            }
        }
        out
    }

    proptest! {
        /// Allocated + idle + drained + down = capacity, every day and in total; the split
        /// matches a millisecond-by-millisecond count; used never exceeds allocated.
        #[test]
        fn gpu_time_is_conserved(
            nodes in prop::collection::vec(node_case(), 1..4),
            holds in prop::collection::vec(holds_case(), 4),
            now in 1i64..200,
            day_ms in 5i64..60,
        ) {
            let (spans, held) = build(&nodes, &holds, now);
            let days = daily(&spans, &held, now, day_ms);
            let expected = brute(&spans, &held, now, day_ms);
            let mut total = Day::default();
            for d in &days {
                prop_assert_eq!(d.capacity_ms, d.allocated_ms + d.idle_ms + d.drained_ms + d.down_ms);
                prop_assert!(d.used_seconds * 1000.0 <= d.allocated_ms as f64 + 1e-9, "{:?}", d);
                prop_assert!(d.used_seconds <= d.accounted_seconds * (1.0 + 1e-12) + 1e-9, "{:?}", d);
                prop_assert!(d.accounted_seconds * 1000.0 <= d.allocated_ms as f64 + 1e-6, "{:?}", d);
                let want = expected.get(&(d.start_ms / day_ms)).copied().unwrap_or_default();
                prop_assert_eq!(
                    [d.capacity_ms, d.allocated_ms, d.idle_ms, d.drained_ms, d.down_ms], want,
                    "day {}", d.start_ms
                );
                total.capacity_ms += d.capacity_ms;
                total.allocated_ms += d.allocated_ms;
                total.used_seconds += d.used_seconds;
            }
            // Every GPU-millisecond present since the nodes joined is counted once.
            let capacity: i64 = nodes
                .iter()
                .map(|n| i64::from(n.gpus) * (now - n.join).max(0))
                .sum();
            prop_assert_eq!(total.capacity_ms, capacity);
            // Used GPU-seconds are spread over days, never created or lost.
            let used: f64 = held.iter().filter_map(|h| h.used_seconds).sum();
            prop_assert!((total.used_seconds - used).abs() <= 1e-9 * used.max(1.0));
            // Consecutive days, no gaps.
            for w in days.windows(2) {
                prop_assert_eq!(w[1].start_ms - w[0].start_ms, day_ms);
            }
        }
    }

    #[test]
    fn a_job_across_midnight_is_split_between_the_days() {
        let spans = [Span {
            node: "n",
            gpus: 2,
            state: Availability::Up,
            start_ms: 0,
            end_ms: None,
        }];
        let held = [Held {
            node: "n",
            gpu: 1,
            start_ms: DAY_MS - 3_600_000,
            end_ms: Some(DAY_MS + 3 * 3_600_000),
            used_seconds: Some(4.0 * 3600.0 * 0.5),
            used_until_ms: DAY_MS + 3 * 3_600_000,
        }];
        let days = daily(&spans, &held, 2 * DAY_MS, DAY_MS);
        assert_eq!(days.len(), 2);
        assert_eq!(days[0].allocated_ms, 3_600_000);
        assert_eq!(days[1].allocated_ms, 3 * 3_600_000);
        assert_eq!(days[0].idle_ms, 2 * DAY_MS - 3_600_000);
        assert!((days[0].used_seconds - 1800.0).abs() < 1e-6);
        assert!((days[1].used_seconds - 5400.0).abs() < 1e-6);
    }
}
