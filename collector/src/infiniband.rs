//! InfiniBand ports from `/sys/class/infiniband/<device>/ports/<port>/`: `state`, `rate` and
//! the `counters/` files. `port_rcv_data` and `port_xmit_data` count 4-byte words (the IBA
//! spec's unit); perch reports bytes, so they are multiplied by 4 here and nowhere else.
//!
//! The parsers are pure; [`IbReader`] reads under an injectable root so tests use a fixture
//! tree. A counter file that is missing or unreadable leaves that value absent.

use perch_model::IbPortSample;
use std::path::{Path, PathBuf};

/// Parses `state`, e.g. `4: ACTIVE`, into `ACTIVE`.
pub fn parse_state(text: &str) -> Option<String> {
    let t = text.trim();
    let name = t.split_once(':').map_or(t, |(_, n)| n).trim();
    (!name.is_empty()).then(|| name.to_string())
}

/// Parses `rate`, e.g. `400 Gb/sec (4X NDR)` or `2.5 Gb/sec (1X SDR)`, into Gbit/s.
pub fn parse_rate(text: &str) -> Option<f64> {
    let mut words = text.split_ascii_whitespace();
    let value: f64 = words.next()?.parse().ok()?;
    match words.next()? {
        "Gb/sec" => Some(value),
        "Mb/sec" => Some(value / 1000.0),
        _ => None,
    }
}

/// Parses one counter file: a decimal number.
pub fn parse_counter(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// Reads every port of every HCA under `<root>/sys/class/infiniband`.
#[derive(Debug, Clone)]
pub struct IbReader {
    dir: PathBuf,
}

fn sorted_entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    out.sort();
    out
}

impl IbReader {
    pub fn new(root: &Path) -> Self {
        Self {
            dir: root.join("sys/class/infiniband"),
        }
    }

    /// True when the machine has an InfiniBand class directory at all.
    pub fn present(&self) -> bool {
        self.dir.is_dir()
    }

    /// One sample per port, in device and port order.
    pub fn sample(&self, now_ms: i64) -> Vec<IbPortSample> {
        let mut out = Vec::new();
        for (device, path) in sorted_entries(&self.dir) {
            let mut ports: Vec<(u32, PathBuf)> = sorted_entries(&path.join("ports"))
                .into_iter()
                .filter_map(|(n, p)| Some((n.parse().ok()?, p)))
                .collect();
            ports.sort();
            for (port, p) in ports {
                let read = |name: &str| std::fs::read_to_string(p.join(name)).ok();
                let counter =
                    |name: &str| read(&format!("counters/{name}")).and_then(|t| parse_counter(&t));
                out.push(IbPortSample {
                    time_ms: now_ms,
                    device: device.clone(),
                    port,
                    simulated: false,
                    state: read("state").and_then(|t| parse_state(&t)),
                    rate_gbps: read("rate").and_then(|t| parse_rate(&t)),
                    rx_bytes: counter("port_rcv_data").map(|w| w.saturating_mul(4)),
                    tx_bytes: counter("port_xmit_data").map(|w| w.saturating_mul(4)),
                    rx_packets: counter("port_rcv_packets"),
                    tx_packets: counter("port_xmit_packets"),
                    symbol_errors: counter("symbol_error"),
                    link_downed: counter("link_downed"),
                    rx_errors: counter("port_rcv_errors"),
                    tx_wait: counter("port_xmit_wait"),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers() {
        for (text, want) in [
            ("4: ACTIVE\n", Some("ACTIVE")),
            ("1: DOWN", Some("DOWN")),
            ("", None),
        ] {
            assert_eq!(parse_state(text).as_deref(), want, "{text:?}");
        }
        for (text, want) in [
            ("400 Gb/sec (4X NDR)\n", Some(400.0)),
            ("2.5 Gb/sec (1X SDR)", Some(2.5)),
            ("100 Mb/sec", Some(0.1)),
            ("fast", None),
            ("", None),
        ] {
            assert_eq!(parse_rate(text), want, "{text:?}");
        }
        assert_eq!(parse_counter("18446744073709551615\n"), Some(u64::MAX));
        assert_eq!(parse_counter("x"), None);
    }

    #[test]
    fn fixture_tree_reports_bytes_not_words() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/node1");
        let ports = IbReader::new(&root).sample(1_800_000_000_000);
        let got: Vec<_> = ports
            .iter()
            .map(|p| {
                (
                    p.device.as_str(),
                    p.port,
                    p.state.as_deref(),
                    p.rate_gbps,
                    p.rx_bytes,
                    p.tx_bytes,
                    p.symbol_errors,
                    p.link_downed,
                    p.rx_errors,
                    p.tx_wait,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "mlx5_0",
                    1,
                    Some("ACTIVE"),
                    Some(400.0),
                    Some(4_000_000_000),
                    Some(8_000),
                    Some(3),
                    Some(1),
                    Some(2),
                    Some(12345),
                ),
                // Port 2 has no counters directory: absent, not zero.
                (
                    "mlx5_0",
                    2,
                    Some("DOWN"),
                    Some(2.5),
                    None,
                    None,
                    None,
                    None,
                    None,
                    None
                ),
            ]
        );
        assert!(
            IbReader::new(Path::new("/nonexistent"))
                .sample(0)
                .is_empty()
        );
    }
}
