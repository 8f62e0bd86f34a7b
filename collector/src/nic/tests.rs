//! NIC parsers on fixture text, and the reader on the fixture tree in `tests/fixtures/node1`.

use super::*;
use std::path::Path;

const HEADER: &str = "Inter-|   Receive                                                |  Transmit\n face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n";

fn counters(device: &str, v: [u64; 8]) -> NetDevCounters {
    NetDevCounters {
        device: device.into(),
        rx_bytes: v[0],
        rx_packets: v[1],
        rx_errors: v[2],
        rx_dropped: v[3],
        tx_bytes: v[4],
        tx_packets: v[5],
        tx_errors: v[6],
        tx_dropped: v[7],
    }
}

fn check(body: &str, expected: std::result::Result<Vec<NetDevCounters>, &str>) {
    let text = format!("{HEADER}{body}");
    match (parse_net_dev(&text), expected) {
        (Ok(got), Ok(want)) => assert_eq!(got, want, "{body:?}"),
        (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{e} lacks {want:?}"),
        (got, want) => panic!("{body:?}: got {got:?}, want {want:?}"),
    }
}

#[test]
fn net_dev() {
    check("", Ok(vec![]));
    check(
        "  eth0: 1 2 3 4 0 0 0 0 5 6 7 8 0 0 0 0\n",
        Ok(vec![counters("eth0", [1, 2, 3, 4, 5, 6, 7, 8])]),
    );
    // A wide counter touching the name, and a name with a dot and a dash.
    check(
        "ib0:9876543210 1 0 0 0 0 0 0 2 3 0 0 0 0 0 0\n vlan.10-x: 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n",
        Ok(vec![
            counters("ib0", [9_876_543_210, 1, 0, 0, 2, 3, 0, 0]),
            counters("vlan.10-x", [0; 8]),
        ]),
    );
    check("  eth0: 1 2 3\n", Err("expected 16"));
    check(
        "  eth0: 1 2 3 4 0 0 0 0 5 6 7 8 0 0 0 -1\n",
        Err("device eth0"),
    );
}

#[test]
fn operstate_and_speed() {
    for (text, want) in [
        ("up\n", Some(true)),
        ("down\n", Some(false)),
        ("lowerlayerdown\n", Some(false)),
        ("unknown\n", None),
        ("", None),
    ] {
        assert_eq!(parse_operstate(text), want, "{text:?}");
    }
    for (text, want) in [
        ("25000\n", Some(25_000)),
        ("-1\n", None),
        ("0\n", None),
        ("fast", None),
        ("", None),
    ] {
        assert_eq!(parse_speed(text), want, "{text:?}");
    }
}

#[test]
fn reader_on_fixture_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1");
    let nics = NicReader::new(root).sample(1_800_000_000_000);
    let names: Vec<&str> = nics.iter().map(|n| n.device.as_str()).collect();
    assert_eq!(names, ["lo", "eth0", "ib0"]);
    let eth0 = &nics[1];
    assert_eq!(
        (eth0.rx_bytes, eth0.rx_errors, eth0.rx_dropped),
        (Some(1_215_645), Some(1), Some(2))
    );
    assert_eq!(
        (eth0.tx_bytes, eth0.tx_errors, eth0.tx_dropped),
        (Some(1_782_404), Some(3), Some(4))
    );
    assert_eq!((eth0.link_up, eth0.speed_mbps), (Some(true), Some(25_000)));
    assert_eq!((nics[2].link_up, nics[2].speed_mbps), (Some(false), None));
    assert_eq!((nics[0].link_up, nics[0].speed_mbps), (None, None));
    assert!(
        nics.iter()
            .all(|n| !n.simulated && n.time_ms == 1_800_000_000_000)
    );
}

#[test]
fn missing_proc_gives_no_nics() {
    let empty = tempfile::tempdir().expect("temp dir");
    assert!(
        NicReader::new(empty.path())
            .sample(1_800_000_000_000)
            .is_empty()
    );
}
