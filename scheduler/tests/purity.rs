//! The core's invariant, checked on the code rather than its text: no file of the scheduling
//! core (everything under `src/` outside `src/sim/`) reads a clock, touches the file system,
//! the network, the environment or other processes, prints, or draws randomness; and the crate
//! depends on nothing that does. The simulator may read trace files; the core may not.
//!
//! Each core file is tokenized the way rustc sees it (comments, strings and character
//! literals dropped), `use` trees are expanded into whole paths, and every path into `std`,
//! `core` or `alloc` must name a module on the pure list. A comment that mentions
//! `SystemTime` passes; `std::time::SystemTime::now()`, `use std::{fs, time::Instant}` or a
//! `tokio` dependency fails.

use std::path::{Path, PathBuf};

/// Modules of the standard library the core may use: data structures, traits and arithmetic,
/// nothing that reaches the machine.
const PURE_STD: [&str; 26] = [
    "any",
    "array",
    "borrow",
    "boxed",
    "char",
    "cmp",
    "collections",
    "convert",
    "default",
    "error",
    "f32",
    "f64",
    "fmt",
    "hash",
    "iter",
    "marker",
    "mem",
    "num",
    "ops",
    "option",
    "rc",
    "result",
    "slice",
    "str",
    "string",
    "vec",
];

/// More of the standard library the core may name: `std::io`'s error types (the simulator's
/// errors carry them; holding one reads nothing).
const PURE_PATHS: [&str; 2] = ["std::io::Error", "std::io::ErrorKind"];

/// Names that mean a clock or randomness wherever they come from.
const FORBIDDEN_NAMES: [&str; 4] = ["SystemTime", "Instant", "UNIX_EPOCH", "thread_rng"];

/// Macros that write to the process's output.
const FORBIDDEN_MACROS: [&str; 5] = ["println", "eprintln", "print", "eprint", "dbg"];

/// Crates that do I/O, read clocks or draw randomness: neither the core's code nor the
/// crate's dependencies (direct or not) may name them.
const FORBIDDEN_CRATES: [&str; 16] = [
    "tokio",
    "mio",
    "async-std",
    "smol",
    "futures",
    "rand",
    "rand_core",
    "getrandom",
    "fastrand",
    "libc",
    "nix",
    "rustix",
    "socket2",
    "chrono",
    "time",
    "reqwest",
];

/// The crate's own direct dependencies, each for a reason (see Cargo.toml): adding one means
/// adding it here, where its purity is judged.
const DIRECT_DEPENDENCIES: [&str; 4] = ["serde", "thiserror", "rustc-hash", "plotters"];

/// A token of Rust source as far as this check cares: an identifier (raw ones without `r#`),
/// a path separator, or one punctuation character. Literals and comments are dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// Tokenizes `source`, dropping comments (nested block comments included), string, byte
/// string, raw string and character literals, and lifetimes.
fn tokens(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if let Some(end) = raw_string_end(&chars, i) {
            i = end;
        } else if c == '"' || (c == 'b' && at(i + 1) == '"') {
            i += if c == 'b' { 2 } else { 1 };
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '\'' || (c == 'b' && at(i + 1) == '\'') {
            // A character literal ('a', '\n', '\u{1F600}') or a lifetime ('a): a literal
            // closes with a quote within a few characters, a lifetime does not.
            let start = if c == 'b' { i + 1 } else { i };
            let close = if at(start + 1) == '\\' {
                (start + 3..chars.len().min(start + 12)).find(|&j| chars[j] == '\'')
            } else {
                (at(start + 2) == '\'').then_some(start + 2)
            };
            match close {
                Some(j) => i = j + 1,
                None => {
                    i = start + 1;
                    while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                        i += 1;
                    }
                }
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let mut word: String = chars[start..i].iter().collect();
            if word == "r" && at(i) == '#' {
                i += 1;
                let rest = i;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                word = chars[rest..i].iter().collect();
            }
            out.push(Token::Ident(word));
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token::PathSep);
            i += 2;
        } else {
            out.push(Token::Punct(c));
            i += 1;
        }
    }
    out
}

/// Where a raw (byte) string literal starting at `i` ends, if one starts there.
fn raw_string_end(chars: &[char], i: usize) -> Option<usize> {
    let mut j = i;
    if chars.get(j) == Some(&'b') {
        j += 1;
    }
    if chars.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = chars[j..].iter().take_while(|&&c| c == '#').count();
    j += hashes;
    if chars.get(j) != Some(&'"') {
        return None;
    }
    if i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_') {
        return None;
    }
    j += 1;
    while j < chars.len() {
        if chars[j] == '"'
            && chars[j + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == '#')
                .count()
                == hashes
        {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(chars.len())
}

/// The whole paths of a `use` tree starting at `tokens[0]` (after `use`), each as its
/// segments, and where the tree ends.
fn use_tree(tokens: &[Token], prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix.to_vec();
    let mut i = 0;
    loop {
        match tokens.get(i) {
            Some(Token::Ident(word)) if word == "as" => {
                // `as name`: the path is what it names.
                i += 2;
                break;
            }
            Some(Token::Ident(word)) => {
                path.push(word.clone());
                i += 1;
            }
            Some(Token::PathSep) => i += 1,
            Some(Token::Punct('*')) => {
                path.push("*".into());
                i += 1;
                break;
            }
            Some(Token::Punct('{')) => {
                i += 1;
                loop {
                    match tokens.get(i) {
                        Some(Token::Punct('}')) => {
                            i += 1;
                            break;
                        }
                        Some(Token::Punct(',')) => i += 1,
                        None => break,
                        _ => i += use_tree(&tokens[i..], &path, out),
                    }
                }
                return i;
            }
            _ => break,
        }
    }
    out.push(path);
    i
}

/// Every path in `source`: `use` trees expanded, and each `a::b::c` outside them (a leading
/// `::` dropped), plus every macro invoked (`name!`) as a one-segment path.
fn paths(source: &str) -> Vec<Vec<String>> {
    let tokens = tokens(source);
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            Token::Ident(word) if word == "use" => {
                i += 1;
                if tokens.get(i) == Some(&Token::PathSep) {
                    i += 1;
                }
                i += use_tree(&tokens[i..], &[], &mut out);
            }
            Token::Ident(word) => {
                let mut path = vec![word.clone()];
                i += 1;
                while tokens.get(i) == Some(&Token::PathSep) {
                    match tokens.get(i + 1) {
                        Some(Token::Ident(next)) => {
                            path.push(next.clone());
                            i += 2;
                        }
                        _ => {
                            i += 1;
                            break;
                        }
                    }
                }
                if tokens.get(i) == Some(&Token::Punct('!')) {
                    path.push("!".into());
                }
                out.push(path);
            }
            _ => i += 1,
        }
    }
    out
}

/// What in `source` breaks the core's purity, one line each.
fn violations(source: &str) -> Vec<String> {
    let mut found = Vec::new();
    for path in paths(source) {
        let shown = path.join("::");
        let root = path[0].as_str();
        if matches!(root, "std" | "core" | "alloc") {
            let pure = path.len() == 1
                || PURE_STD.contains(&path[1].as_str())
                || PURE_PATHS
                    .iter()
                    .any(|p| shown == *p || shown.starts_with(&format!("{p}::")));
            if !pure {
                found.push(format!(
                    "`{shown}`: not a pure part of the standard library"
                ));
            }
        }
        if FORBIDDEN_CRATES.contains(&root.replace('_', "-").as_str())
            && (path.len() > 1 || path.last().is_some_and(|s| s == "!"))
        {
            found.push(format!(
                "`{shown}`: the crate {root} does I/O, time or randomness"
            ));
        }
        for segment in &path {
            if FORBIDDEN_NAMES.contains(&segment.as_str()) {
                found.push(format!(
                    "`{shown}`: {segment} reads a clock or draws randomness"
                ));
            }
        }
        if path.last().is_some_and(|s| s == "!")
            && FORBIDDEN_MACROS.contains(&path[path.len() - 2].as_str())
        {
            found.push(format!(
                "`{shown}`: the core prints nothing (it returns actions)"
            ));
        }
    }
    found
}

/// Every `.rs` file under `dir`, but for the simulator's.
fn core_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "sim") {
                core_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_core_does_no_io_and_reads_no_clock() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    core_files(&src, &mut files);
    assert!(
        files.len() >= 9 && files.iter().any(|f| f.ends_with("scheduler.rs")),
        "expected the core's files under {}, found {files:?}",
        src.display()
    );
    let mut problems = Vec::new();
    let mut std_paths = 0;
    for file in &files {
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        std_paths += paths(&text).iter().filter(|p| p[0] == "std").count();
        for v in violations(&text) {
            problems.push(format!("{}: {v}", file.display()));
        }
    }
    assert!(
        std_paths > 10,
        "the check saw {std_paths} paths into std: is it reading the code?"
    );
    assert!(
        problems.is_empty(),
        "the scheduling core must stay pure (inject time and data through Event and `now`):\n{}",
        problems.join("\n")
    );
}

/// `cargo tree` for the scheduler: its direct dependencies are the approved ones, and nothing
/// it pulls in (directly or not) is a crate that does I/O, reads a clock or draws randomness.
#[test]
fn the_crate_depends_on_nothing_that_does_io() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tree = |depth: Option<&str>| -> Vec<String> {
        let mut cmd = std::process::Command::new(&cargo);
        cmd.args(["tree", "--offline", "-p", "perch-scheduler", "-e", "normal"])
            .args(["--prefix", "none", "--format", "{p}"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if let Some(d) = depth {
            cmd.args(["--depth", d]);
        }
        let out = cmd.output().expect("run cargo tree");
        assert!(
            out.status.success(),
            "cargo tree: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .filter(|name| name != "perch-scheduler")
            .collect()
    };
    let direct = tree(Some("1"));
    assert!(
        direct.iter().any(|d| d == "serde"),
        "cargo tree lists {direct:?}: is it the scheduler's tree?"
    );
    let unapproved: Vec<&String> = direct
        .iter()
        .filter(|d| !DIRECT_DEPENDENCIES.contains(&d.as_str()))
        .collect();
    assert!(
        unapproved.is_empty(),
        "perch-scheduler depends on {unapproved:?}: the core is pure and the crate holds it; judge the dependency and add it to DIRECT_DEPENDENCIES in {}",
        file!()
    );
    let mut forbidden: Vec<String> = tree(None)
        .into_iter()
        .filter(|d| FORBIDDEN_CRATES.contains(&d.as_str()))
        .collect();
    forbidden.sort();
    forbidden.dedup();
    assert!(
        forbidden.is_empty(),
        "perch-scheduler pulls in {forbidden:?} (see `cargo tree -p perch-scheduler -i <crate>`): the core does no I/O, reads no clock and draws no randomness"
    );
}

/// The check itself: what it must catch, and what it must let through.
#[test]
fn the_check_reads_code_not_comments() {
    let caught = [
        "fn f() -> u64 { std::time::SystemTime::now().elapsed().unwrap().as_secs() }",
        "use std::time::Instant;",
        "use std::{collections::HashMap, fs};",
        "use ::std::net::TcpStream;",
        "fn f() { let _ = std::env::var(\"X\"); }",
        "fn f() { std::thread::sleep(d); }",
        "fn f() { tokio::spawn(async {}); }",
        "use rand::Rng;",
        "fn f() { println!(\"{}\", 1); }",
        "use std::io::{self, Read};",
        "use std::process as p;",
        "fn f() { let t = r#type::Instant::now(); }",
    ];
    for code in caught {
        assert!(!violations(code).is_empty(), "not caught: {code}");
    }
    let allowed = [
        "// std::time::SystemTime::now() would make the core impure\nfn f() {}",
        "/* nested /* Instant */ tokio */ fn f() {}",
        "/// A `std::fs` read belongs in the simulator.\nfn f() {}",
        "fn f() -> &'static str { \"std::fs::read\" }",
        "fn f() -> &'static str { r#\"tokio::spawn \"quoted\" \"# }",
        "fn f<'a>(x: &'a str) -> [char; 3] { let _ = x; ['b', '\\'', '\\u{1F600}'] }",
        "fn f(print: u32, time: u64) -> u64 { u64::from(print) + time }",
        "use std::collections::{BTreeMap, HashMap};",
        "use std::cmp::Reverse; fn f(e: std::io::Error) -> std::fmt::Result { let _ = e; Ok(()) }",
        "fn f(now: u64) -> u64 { now + 1 }",
    ];
    for code in allowed {
        assert_eq!(violations(code), Vec::<String>::new(), "{code}");
    }
}
