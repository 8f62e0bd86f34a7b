//! Statements as deep or as long as a hostile user can write them. Each is answered, refused
//! with [`Error::TooComplex`] before it is planned, or refused as a bad query; none may
//! overflow a thread's stack, which aborts the whole process (and fails this test binary).
//!
//! `SELECT 1+1+...+1` with 2,000 terms, or an `OR` chain of 2,500, aborted the server before
//! statements were bounded.

use perch_query::guard::{DEFAULT_MAX_DEPTH, check_statement};
use perch_query::{Error, QueryLimits, SqlEngine, Store, StoreConfig};
use proptest::prelude::*;
use std::sync::Arc;

fn engine() -> (tempfile::TempDir, SqlEngine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("store");
    (dir, SqlEngine::new(store, QueryLimits::default()))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn joined(n: usize, item: impl Fn(usize) -> String, sep: &str) -> String {
    (0..n).map(item).collect::<Vec<_>>().join(sep)
}

/// Shapes that nest as deep as `n` makes them, each the way a parser or planner recurses.
fn shapes(n: usize) -> Vec<(&'static str, String)> {
    vec![
        ("plus", format!("SELECT {}", vec!["1"; n].join("+"))),
        (
            "mixed arithmetic",
            format!(
                "SELECT 1{}",
                joined(n, |i| ["+2", "*3", "-4", "/5", "%6"][i % 5].to_owned(), "")
            ),
        ),
        (
            "or",
            format!(
                "SELECT count(*) FROM gpu_samples WHERE {}",
                joined(n, |i| format!("gpu = {i}"), " OR ")
            ),
        ),
        (
            "and",
            format!(
                "SELECT count(*) FROM gpu_samples WHERE {}",
                joined(n, |i| format!("gpu <> {i}"), " AND ")
            ),
        ),
        ("not", format!("SELECT {}true", "NOT ".repeat(n))),
        ("unary minus", format!("SELECT {}1", "- ".repeat(n))),
        ("concat", format!("SELECT {}", vec!["'a'"; n].join(" || "))),
        ("is null", format!("SELECT 1{}", " IS NULL".repeat(n))),
        ("cast", format!("SELECT 1{}", "::bigint".repeat(n))),
        (
            "brackets",
            format!("SELECT {}1{}", "(".repeat(n), ")".repeat(n)),
        ),
        (
            "functions",
            format!("SELECT {}1{}", "abs(".repeat(n), ")".repeat(n)),
        ),
        (
            "case",
            format!(
                "SELECT {}1{}",
                "CASE WHEN random() < 2 THEN ".repeat(n),
                " END".repeat(n)
            ),
        ),
        (
            "scalar subqueries",
            format!("SELECT {}1{}", "(SELECT ".repeat(n), ")".repeat(n)),
        ),
        (
            "an IS NULL chain in subqueries",
            format!(
                "SELECT {}1{}{}",
                "(SELECT ".repeat(17),
                " IS NULL".repeat(n),
                " FROM gpu_samples LIMIT 1)".repeat(17)
            ),
        ),
        (
            "derived tables",
            format!(
                "SELECT * FROM {}SELECT 1 AS x{}",
                "(SELECT * FROM ".repeat(n),
                ") s".repeat(n)
            ),
        ),
        ("union", vec!["SELECT 1 AS x"; n].join(" UNION ALL ")),
        (
            "from list",
            format!(
                "SELECT count(*) FROM {}",
                joined(n, |i| format!("(SELECT 1 AS k{i}) t{i}"), ", ")
            ),
        ),
        (
            "joins",
            format!(
                "SELECT count(*) FROM (SELECT 1 AS k) t{}",
                joined(n, |i| format!(" JOIN (SELECT 1 AS k{i}) t{i} ON true"), "")
            ),
        ),
        (
            "subscripts",
            format!("SELECT make_array(1){}", "[1]".repeat(n)),
        ),
    ]
}

/// Runs `sql` with `engine`: `Ok` when answered.
fn run(rt: &tokio::runtime::Runtime, engine: &SqlEngine, sql: &str) -> Result<(), Error> {
    rt.block_on(engine.query(sql)).map(|_| ())
}

#[test]
fn every_shape_past_the_bound_is_refused_with_what_to_change() {
    let (_dir, engine) = engine();
    let rt = runtime();
    for n in [2 * DEFAULT_MAX_DEPTH, 50_000] {
        for (shape, sql) in shapes(n) {
            match run(&rt, &engine, &sql) {
                Err(Error::TooComplex(why)) => {
                    assert!(why.contains("query.max_"), "{shape} x{n}: {why}")
                }
                other => panic!("{shape} x{n} was not refused: {other:?}"),
            }
        }
    }
    // A long flat list is shallow: 100,000 values in an IN list are answered.
    let list = joined(100_000, |i| i.to_string(), ",");
    run(
        &rt,
        &engine,
        &format!("SELECT count(*) FROM gpu_samples WHERE gpu IN ({list})"),
    )
    .expect("a long IN list");
    // Past the length bound, refused before it is read.
    let long = format!("SELECT '{}'", "x".repeat(2 << 20));
    assert!(matches!(
        run(&rt, &engine, &long),
        Err(Error::TooComplex(_))
    ));
}

/// A statement far past the length bound is refused for its length before anything reads
/// it: a gigabyte of short words was split into words first (for `SHOW TABLES`), which took
/// more than the query's timeout and gigabytes of memory.
#[test]
fn a_statement_far_past_the_length_bound_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(StoreConfig::new(dir.path())).expect("store");
    let limits = QueryLimits {
        timeout: std::time::Duration::from_secs(5),
        ..QueryLimits::default()
    };
    let engine = SqlEngine::new(store, limits);
    let rt = runtime();
    let sql = format!("SELECT 1{}", " ,1".repeat(40 << 20));
    match run(&rt, &engine, &sql) {
        Err(Error::TooComplex(why)) => assert!(why.contains("query.max_statement_kb"), "{why}"),
        other => panic!("a {} MiB statement: {other:?}", sql.len() >> 20),
    }
}

/// The longest `n` of `shape` the guard lets through.
fn at_the_bound(shape: &str) -> (usize, String) {
    let sql = |n| {
        shapes(n)
            .into_iter()
            .find(|(s, _)| *s == shape)
            .expect("shape")
            .1
    };
    let passes = |n| check_statement(&sql(n), usize::MAX, DEFAULT_MAX_DEPTH).is_ok();
    let (mut lo, mut hi) = (1, 2 * DEFAULT_MAX_DEPTH);
    assert!(passes(lo) && !passes(hi), "{shape}");
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if passes(mid) { lo = mid } else { hi = mid }
    }
    (lo, sql(lo))
}

#[test]
fn every_shape_at_the_bound_runs_in_the_stack_it_gets() {
    let (_dir, engine) = engine();
    let engine = Arc::new(engine);
    // Two threads: each shape at its bound takes up to seconds to plan in a debug build.
    let names: Vec<&str> = shapes(1).into_iter().map(|(s, _)| s).collect();
    let (even, odd): (Vec<_>, Vec<_>) = names.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    std::thread::scope(|scope| {
        for half in [even, odd] {
            let engine = engine.clone();
            scope.spawn(move || {
                let rt = runtime();
                for (_, shape) in half {
                    let (n, sql) = at_the_bound(shape);
                    assert!(n >= 100, "{shape}: only {n} let through");
                    // A tree deeper than its statement was estimated is refused after
                    // planning; none is known, so the estimate is an upper bound. Any other
                    // answer will do: the process is still here.
                    if let Err(Error::TooComplex(why)) = run(&rt, &engine, &sql) {
                        panic!("{shape} x{n} refused once planned: {why}")
                    }
                }
            });
        }
    });
}

/// The longest statement the strategies make: four times the default bound, so statements
/// refused for their length are made too, but never so long (nested repetitions multiply)
/// that making one takes gigabytes. One of a gigabyte killed CI's test run.
const MAX_GENERATED: usize = 4 * perch_query::guard::DEFAULT_MAX_BYTES;

/// `e` joined `n` times by `sep`, fewer times where that would pass [`MAX_GENERATED`].
fn chain(e: &str, n: usize, sep: &str) -> String {
    let n = n.min(MAX_GENERATED / (e.len() + sep.len())).max(1);
    vec![e; n].join(sep)
}

/// `e` inside `n` pairs of `open` and `close`, fewer where that would pass [`MAX_GENERATED`].
fn wrap(open: &str, e: &str, close: &str, n: usize) -> String {
    let n = n.min(MAX_GENERATED.saturating_sub(e.len()) / (open.len() + close.len()));
    format!("{}{e}{}", open.repeat(n), close.repeat(n))
}

/// A random statement: leaves combined by chains of operators, brackets, CASE, functions,
/// subqueries and lists, each as long as the strategy likes.
fn expression() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("1".to_owned()),
        Just("gpu".to_owned()),
        Just("'a'".to_owned()),
        Just("NULL".to_owned()),
        Just("true".to_owned()),
        Just("utilization_gpu_pct".to_owned()),
    ];
    let ops = [
        " + ",
        " - ",
        " * ",
        " / ",
        " || ",
        " AND ",
        " OR ",
        " = ",
        " < ",
        " IS DISTINCT FROM ",
        " LIKE ",
    ];
    leaf.prop_recursive(4, 64, 8, move |inner| {
        prop_oneof![
            (inner.clone(), 1..1_500usize, 0..ops.len()).prop_map(move |(e, n, op)| chain(
                &e,
                n + 1,
                ops[op]
            )),
            (inner.clone(), 1..600usize).prop_map(|(e, n)| wrap("(", &e, ")", n)),
            (inner.clone(), 1..300usize).prop_map(|(e, n)| wrap(
                "CASE WHEN gpu > 0 THEN ",
                &e,
                " ELSE 0 END",
                n
            )),
            (inner.clone(), 1..400usize).prop_map(|(e, n)| wrap("coalesce(", &e, ")", n)),
            (inner.clone(), 1..200usize).prop_map(|(e, n)| wrap(
                "(SELECT ",
                &e,
                " FROM gpu_samples LIMIT 1)",
                n
            )),
            (inner.clone(), 1..5_000usize)
                .prop_map(|(e, n)| format!("{e} IN ({})", joined(n, |i| i.to_string(), ","))),
            (inner.clone(), 1..1_500usize).prop_map(|(e, n)| wrap("", &e, " IS NULL", n)),
            (inner, 1..1_500usize).prop_map(|(e, n)| wrap("NOT ", &e, "", n)),
        ]
    })
}

fn statement() -> impl Strategy<Value = String> {
    (expression(), 0..4usize, 1..400usize).prop_map(|(e, form, n)| match form {
        0 => format!("SELECT {e}"),
        1 => format!("SELECT count(*) FROM gpu_samples WHERE {e}"),
        2 => chain(&format!("SELECT {e} AS x"), n, " UNION ALL "),
        _ => format!("SELECT {e} FROM gpu_samples GROUP BY 1 HAVING {e} IS NOT NULL"),
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the statement, the engine answers; a stack overflow would abort the binary.
    #[test]
    fn no_statement_overflows_a_stack(sql in statement()) {
        let (_dir, engine) = engine();
        let rt = runtime();
        let guarded = check_statement(&sql, usize::MAX, DEFAULT_MAX_DEPTH).is_ok();
        if let Err(Error::TooComplex(why)) = run(&rt, &engine, &sql) {
            prop_assert!(!guarded || why.contains("KiB"), "refused once planned: {why}");
        }
    }
}
