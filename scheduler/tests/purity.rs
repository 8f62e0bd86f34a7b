//! The core's invariant, checked: no file of the scheduling core (everything outside
//! `src/sim/`) reads a clock, touches the file system or the network, or draws randomness.
//! The simulator may read trace files; the core may not.

#[test]
fn the_core_does_no_io_and_reads_no_clock() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let forbidden = [
        "std::time",
        "Instant",
        "SystemTime",
        "std::fs",
        "std::net",
        "std::env",
        "std::process",
        "rand::",
        "tokio",
    ];
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => panic!("{dir}: {e}"),
    };
    let mut checked = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for word in forbidden {
            assert!(
                !text.contains(word),
                "{} uses `{word}`: the core must stay pure",
                path.display()
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 9,
        "expected the core's files under {dir}, checked {checked}"
    );
}
