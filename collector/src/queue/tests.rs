//! The send queue: merging, freezing of attempted batches, the bound and its accounting.

use super::*;
use perch_model::NicSample;

fn round(tag: i64) -> Round {
    let nic = NicSample {
        time_ms: 1_800_000_000_000 + tag,
        device: "eth0".into(),
        simulated: true,
        rx_bytes: None,
        rx_packets: None,
        rx_errors: None,
        rx_dropped: None,
        tx_bytes: None,
        tx_packets: None,
        tx_errors: None,
        tx_dropped: None,
        link_up: None,
        speed_mbps: None,
    };
    Round {
        hosts: vec![],
        gpus: vec![],
        nics: vec![nic],
        ..Round::default()
    }
}

fn queue(max_rounds: usize, max_batches: usize) -> SendQueue {
    SendQueue::new(
        NodeId::new("q").expect("valid"),
        100,
        max_rounds,
        max_batches,
    )
}

fn seqs(q: &mut SendQueue) -> Vec<(u64, usize)> {
    q.drain()
        .iter()
        .map(|b| (b.seq, b.sample_count()))
        .collect()
}

#[test]
fn one_round_per_batch_when_merging_is_off() {
    let mut q = queue(1, 10);
    for i in 0..3 {
        assert_eq!(
            q.push(round(i)),
            PushOutcome {
                merged: false,
                evicted: None
            }
        );
    }
    assert_eq!(seqs(&mut q), [(100, 1), (101, 1), (102, 1)]);
}

#[test]
fn merges_up_to_max_rounds() {
    let mut q = queue(3, 10);
    let merged: Vec<bool> = (0..7).map(|i| q.push(round(i)).merged).collect();
    assert_eq!(merged, [false, true, true, false, true, true, false]);
    assert_eq!(q.sample_count(), 7);
    assert_eq!(seqs(&mut q), [(100, 3), (101, 3), (102, 1)]);
}

#[test]
fn an_attempted_batch_is_never_changed() {
    let mut q = queue(5, 10);
    q.push(round(0));
    let sent = q.next_to_send().expect("one batch");
    q.retry_later(sent.seq);
    // The server may have stored seq 100 already: new samples must go into a new batch.
    assert!(!q.push(round(1)).merged);
    assert!(q.push(round(2)).merged);
    let again = q.next_to_send().expect("front");
    assert_eq!(again, sent, "a retry resends exactly what was sent");
    assert!(q.complete(again.seq));
    assert_eq!(seqs(&mut q), [(101, 2)]);
}

#[test]
fn the_bound_drops_the_oldest_and_reports_it() {
    let mut q = queue(1, 3);
    let evicted: Vec<Option<u64>> = (0..5)
        .map(|i| q.push(round(i)).evicted.map(|b| b.seq))
        .collect();
    assert_eq!(evicted, [None, None, None, Some(100), Some(101)]);
    assert_eq!(q.len(), 3);
    assert_eq!(seqs(&mut q), [(102, 1), (103, 1), (104, 1)]);
}

#[test]
fn the_bound_spares_the_batch_in_flight() {
    let mut q = queue(1, 2);
    q.push(round(0));
    q.push(round(1));
    let sent = q.next_to_send().expect("front");
    let evicted = q.push(round(2)).evicted;
    assert_eq!(evicted.map(|b| (b.seq, b.sample_count())), Some((101, 1)));
    assert_eq!(q.front_seq(), Some(100));
    assert!(q.complete(sent.seq));
    assert_eq!(seqs(&mut q), [(102, 1)]);
}

#[test]
fn empty_rounds_are_ignored_and_completion_of_unknown_is_false() {
    let mut q = queue(1, 2);
    assert_eq!(q.push(Round::default()), PushOutcome::default());
    assert!(q.is_empty());
    assert_eq!(q.next_seq(), 100);
    assert!(q.next_to_send().is_none());
    assert!(!q.complete(7));
}
