//! Fair share from the caller's accounting: `Event::AccountUsage` replaces the core's usage
//! tally, so a restarted server (a fresh core) still orders the queue by real past usage.

mod common;

use common::{one, started};
use perch_scheduler::{Account, Action, Cluster, Config, Event, JobId, MINUTE, Scheduler};

fn step(s: &mut Scheduler, now: i64, ev: Event) -> Vec<Action> {
    match s.step(now, ev) {
        Ok(a) => a,
        Err(e) => panic!("step at {now}: {e}"),
    }
}

/// A fresh one-node core told `usage`; a job of "heavy" then one of "light" wait behind a
/// running job: which one starts when it ends?
fn first_started_after(usage: Vec<(Account, f64)>) -> Vec<u64> {
    let mut s = match Cluster::uniform(1, 8, "H100", 1) {
        Ok(c) => Scheduler::new(c, Config::perch(vec![])),
        Err(e) => panic!("cluster: {e}"),
    };
    step(&mut s, 0, Event::AccountUsage(usage));
    step(&mut s, 0, Event::Submit(one(1, 8, "other", 60, 0)));
    step(&mut s, 1, Event::Submit(one(2, 8, "heavy", 60, 1)));
    step(&mut s, 2, Event::Submit(one(3, 8, "light", 60, 2)));
    let a = step(
        &mut s,
        10 * MINUTE,
        Event::JobExited {
            job: JobId(1),
            code: 0,
        },
    );
    started(&a)
}

#[test]
fn usage_from_the_caller_orders_the_queue() {
    let hours = |h: f64| h * 3_600_000.0 * 8.0;
    // Without history the older submission goes first.
    assert_eq!(first_started_after(vec![]), vec![2]);
    // With "heavy" known to have used the node for ten hours, "light" goes first.
    assert_eq!(
        first_started_after(vec![(Account("heavy".into()), hours(10.0))]),
        vec![3]
    );
    // Nonsense values are treated as no usage, never as a panic or a NaN priority.
    assert_eq!(
        first_started_after(vec![
            (Account("heavy".into()), f64::NAN),
            (Account("light".into()), -5.0)
        ]),
        vec![2]
    );
}
