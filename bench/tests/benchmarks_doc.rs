//! BENCHMARKS.md's summary table stays in step with its sections: each row links to the
//! section holding the output behind it, and every figure the row gives (dates aside) appears
//! in that section or in a BENCHMARKS.md the section links to, so the summary cannot say
//! 1.50 M where the output says 1.81 M. A row's verdict (met, missed) is the section's too.
//!
//! And every verdict follows from its figures: BENCHMARKS.md, collector/BENCHMARKS.md and
//! scheduler/BENCHMARKS.md each hold a `## Verdicts` table (target, measure, bound, runs,
//! verdict). Each bound and run is parsed with its unit; a part is met only if every run meets
//! its bound, a target only if all its parts are (where measures name builds, `` `dist`: ``,
//! only if one build meets all of them), each run's figure must stand in the section the
//! target links to, and the summary row of each target must end on the verdict computed.

use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// GitHub's anchor for a heading: lower case, spaces to `-`, punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The `# `, `## ` and `### ` sections of `doc` by anchor, each with its text up to the next
/// heading of its level or above (a `## ` section holds its `### ` ones, a `# ` one all).
fn sections(doc: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let (mut title, mut section, mut subsection) = (None, None, None);
    let mut fenced = false;
    for line in doc.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        let heading = |prefix: &str| (!fenced).then(|| line.strip_prefix(prefix)).flatten();
        if let Some(heading) = heading("# ") {
            out.push((slug(heading), String::new()));
            (title, section, subsection) = (Some(out.len() - 1), None, None);
        } else if let Some(heading) = heading("## ") {
            out.push((slug(heading), String::new()));
            (section, subsection) = (Some(out.len() - 1), None);
        } else if let Some(heading) = heading("### ") {
            out.push((slug(heading), String::new()));
            subsection = Some(out.len() - 1);
        } else {
            for i in [title, section, subsection].into_iter().flatten() {
                out[i].1.push_str(line);
                out[i].1.push('\n');
            }
        }
    }
    out
}

/// Thousands separators out (`2,538` reads as `2538`), so a figure matches however it is
/// grouped.
fn ungroup(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    for (i, &c) in chars.iter().enumerate() {
        let between_digits = i > 0
            && chars[i - 1].is_ascii_digit()
            && chars.get(i + 1).is_some_and(char::is_ascii_digit);
        if !(c == ',' && between_digits) {
            out.push(c);
        }
    }
    out
}

/// The figures of a cell: numbers such as `70.7`, `2538` or `3.8`; dates (`2026-11-24`) and
/// issue numbers (`issue 20`) left out.
fn figures(cell: &str) -> Vec<String> {
    let text = ungroup(cell);
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len()
            && (chars[i].is_ascii_digit()
                || (chars[i] == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)))
        {
            i += 1;
        }
        let is_date = chars.get(i) == Some(&'-') && i - start == 4
            || start > 0 && chars[start - 1] == '-' && i - start == 2;
        let before: String = chars[start.saturating_sub(6)..start].iter().collect();
        let is_issue = before.ends_with("issue ") || before.ends_with("ssues ");
        if !is_date && !is_issue {
            out.push(chars[start..i].iter().collect());
        }
    }
    out
}

/// Whether `figure` stands in `text` as a whole number (not inside `170.75`).
fn mentions(text: &str, figure: &str) -> bool {
    text.match_indices(figure).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after: Vec<char> = text[at + figure.len()..].chars().take(2).collect();
        let digit_before = before.is_some_and(|c| c.is_ascii_digit() || c == '.');
        let digit_after = after.first().is_some_and(char::is_ascii_digit)
            || (after.first() == Some(&'.') && after.get(1).is_some_and(char::is_ascii_digit));
        !digit_before && !digit_after
    })
}

/// The anchor a cell links to: `[text](#anchor)`.
fn anchor(cell: &str) -> Option<&str> {
    let start = cell.find("](#")? + 3;
    let end = start + cell[start..].find(')')?;
    Some(&cell[start..end])
}

/// A section's text with that of every other BENCHMARKS.md it links to.
fn with_linked(text: &str) -> String {
    let mut all = text.to_owned();
    for (at, _) in text.match_indices("](") {
        let target = &text[at + 2..];
        let Some(end) = target.find(')') else {
            continue;
        };
        let path = &target[..end];
        if path.ends_with("BENCHMARKS.md") {
            let file = Path::new(ROOT).join(path);
            all.push_str(
                &std::fs::read_to_string(&file)
                    .unwrap_or_else(|e| panic!("{} (linked): {e}", file.display())),
            );
        }
    }
    all
}

#[test]
fn every_summary_figure_is_in_the_section_it_links_to() {
    let doc =
        std::fs::read_to_string(Path::new(ROOT).join("BENCHMARKS.md")).expect("BENCHMARKS.md");
    let sections = sections(&doc);
    let summary: Vec<&str> = doc
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with("| ") && !l.starts_with("| what"))
        .collect();
    assert!(
        summary.len() >= 10,
        "the summary table has {} rows",
        summary.len()
    );
    let mut problems = Vec::new();
    for row in summary {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").map(str::trim).collect();
        let [what, _target, measured, ..] = cells[..] else {
            problems.push(format!("a row without what | target | measured: {row}"));
            continue;
        };
        let Some(anchor) = anchor(what) else {
            problems.push(format!(
                "{what}: link it to its section, [{what}](#section)"
            ));
            continue;
        };
        let Some((_, text)) = sections.iter().find(|(slug, _)| slug == anchor) else {
            problems.push(format!("{what}: no section #{anchor}"));
            continue;
        };
        let text = ungroup(&with_linked(text));
        for figure in figures(measured) {
            if !mentions(&text, &figure) {
                problems.push(format!("{what}: {figure} is not in #{anchor}"));
            }
        }
        let measured = measured.to_lowercase();
        for verdict in ["missed", "met"] {
            let said = |t: &str| {
                t.split(|c: char| !c.is_alphanumeric())
                    .any(|w| w == verdict)
            };
            if said(&measured) && !said(&text.to_lowercase()) {
                problems.push(format!("{what}: says {verdict}, #{anchor} does not"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "BENCHMARKS.md:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_check_reads_figures_as_written() {
    assert_eq!(
        figures("2,538 jobs/s on 2026-11-25, 70.7 ms, 3.8% of FIFO, 0.41× (issue 20)"),
        ["2538", "70.7", "3.8", "0.41"]
    );
    assert!(mentions("median 70.7 ms", "70.7"));
    assert!(!mentions("median 170.75 ms", "70.7"));
    assert!(mentions(&ungroup("12,747 jobs"), "12747"));
    assert_eq!(slug("Ingest (issue 4)"), "ingest-issue-4");
    let parts = sections("# T\n## A\none\n### B\ntwo\n```\n# not a heading\n```\n## C\nthree\n");
    assert_eq!(
        parts,
        [
            (
                "t".to_owned(),
                "one\ntwo\n```\n# not a heading\n```\nthree\n".to_owned()
            ),
            (
                "a".to_owned(),
                "one\ntwo\n```\n# not a heading\n```\n".to_owned()
            ),
            (
                "b".to_owned(),
                "two\n```\n# not a heading\n```\n".to_owned()
            ),
            ("c".to_owned(), "three\n".to_owned()),
        ]
    );
    assert_eq!(
        slug("Queries against DuckDB (issue 4)"),
        "queries-against-duckdb-issue-4"
    );
}

/// What a quantity measures; bounds and runs compare only within one.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Dim {
    /// Seconds.
    Time,
    /// Megabytes (10^6 bytes).
    Size,
    Percent,
    /// `0.46×`: a time over another's.
    Ratio,
    /// A plain number (`2,538` jobs a second, `26` cases, `1.5 M` values).
    Count,
}

/// A figure with its unit, read from the start of `text` (`14 min 17 s`, `202 MB`, `0.10%`,
/// `0.46×`, `1.5 M`, `1,428,556`); what follows it (a note in brackets) is left alone.
fn quantity(text: &str) -> Option<(f64, Dim)> {
    let text = ungroup(text.trim());
    let mut words = text.split_whitespace().peekable();
    let first = words.next()?;
    let (number, dim) = if let Some(n) = first.strip_suffix('%') {
        (n, Some(Dim::Percent))
    } else if let Some(n) = first.strip_suffix('×') {
        (n, Some(Dim::Ratio))
    } else {
        (first, None)
    };
    let value: f64 = number.parse().ok().filter(|v: &f64| v.is_finite())?;
    if let Some(dim) = dim {
        return Some((value, dim));
    }
    let unit = words.peek().copied().unwrap_or("");
    // Multiplied, or divided, into the dimension's unit.
    let (times, per, dim) = match unit {
        "ms" => (1.0, 1000.0, Dim::Time),
        "s" => (1.0, 1.0, Dim::Time),
        "min" => (60.0, 1.0, Dim::Time),
        "h" => (3600.0, 1.0, Dim::Time),
        "KB" | "kB" => (1.0, 1000.0, Dim::Size),
        "MB" => (1.0, 1.0, Dim::Size),
        "GB" => (1000.0, 1.0, Dim::Size),
        "M" => (1e6, 1.0, Dim::Count),
        "k" => (1e3, 1.0, Dim::Count),
        _ => return Some((value, Dim::Count)),
    };
    words.next();
    let mut value = value * times / per;
    // `14 min 17 s`: the seconds after the minutes.
    if unit == "min"
        && let Some(seconds) = words.next().and_then(|w| w.parse::<f64>().ok())
        && words.next() == Some("s")
    {
        value += seconds;
    }
    Some((value, dim))
}

/// A bound: `≤ 1%`, `< 1 s`, `≥ 1.5 M`, `= 0`.
fn bound(text: &str) -> Option<(&'static str, f64, Dim)> {
    let text = text.trim();
    let (op, rest) = ["≤", "≥", "<", ">", "="]
        .into_iter()
        .find_map(|op| text.strip_prefix(op).map(|rest| (op, rest)))?;
    let (value, dim) = quantity(rest)?;
    Some((op, value, dim))
}

fn holds(op: &str, run: f64, bound: f64) -> bool {
    match op {
        "≤" => run <= bound,
        "≥" => run >= bound,
        "<" => run < bound,
        ">" => run > bound,
        _ => run == bound,
    }
}

/// One line of a `## Verdicts` table.
#[derive(Debug)]
struct VerdictLine {
    target: String,
    measure: String,
    bound: String,
    runs: String,
    verdict: String,
}

impl VerdictLine {
    /// The build a measure names (`` `release`: wall time ``), or none.
    fn candidate(&self) -> &str {
        self.measure
            .strip_prefix('`')
            .and_then(|m| m.split_once("`: "))
            .map_or("", |(name, _)| name)
    }
}

/// The lines of `doc`'s verdict table.
fn verdict_table(doc: &str) -> Vec<VerdictLine> {
    doc.lines()
        .skip_while(|l| *l != "| target | measure | bound | runs | verdict |")
        .skip(2)
        .take_while(|l| l.starts_with("| "))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_owned())
                .collect();
            let cell = |i: usize| cells.get(i).cloned().unwrap_or_default();
            VerdictLine {
                target: cell(0),
                measure: cell(1),
                bound: cell(2),
                runs: cell(3),
                verdict: cell(4).trim_matches('*').to_owned(),
            }
        })
        .collect()
}

/// The verdict (`met` or `missed`) the runs of `line` give, or why none can be computed.
fn computed(line: &VerdictLine) -> Result<&'static str, String> {
    let (op, limit, dim) =
        bound(&line.bound).ok_or_else(|| format!("bound {:?} does not parse", line.bound))?;
    let mut met = true;
    for run in line.runs.split("; ") {
        let (value, run_dim) =
            quantity(run).ok_or_else(|| format!("run {run:?} does not parse"))?;
        if run_dim != dim {
            return Err(format!(
                "run {run:?} ({run_dim:?}) is not in the bound's unit ({dim:?})"
            ));
        }
        met &= holds(op, value, limit);
    }
    Ok(if met { "met" } else { "missed" })
}

/// The verdict of each target of `lines`: met where one build (or the one target without
/// builds) meets every part.
fn target_verdicts(lines: &[VerdictLine]) -> Vec<(String, &'static str)> {
    let mut out: Vec<(String, &'static str)> = Vec::new();
    for line in lines {
        if out.iter().any(|(t, _)| *t == line.target) {
            continue;
        }
        let parts: Vec<&VerdictLine> = lines.iter().filter(|l| l.target == line.target).collect();
        let met = parts.iter().any(|candidate| {
            parts
                .iter()
                .filter(|l| l.candidate() == candidate.candidate())
                .all(|l| computed(l) == Ok("met"))
        });
        out.push((line.target.clone(), if met { "met" } else { "missed" }));
    }
    out
}

/// The last `met` or `missed` of a summary cell: the row's verdict.
fn last_verdict(cell: &str) -> Option<&'static str> {
    cell.to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter_map(|w| match w {
            "met" => Some("met"),
            "missed" => Some("missed"),
            _ => None,
        })
        .next_back()
}

/// What is wrong with the verdicts of `doc` (named `name`), one line each. With a summary
/// table (BENCHMARKS.md), each of its rows with a target must end on its computed verdict.
fn verdict_problems(doc: &str, name: &str) -> Vec<String> {
    let lines = verdict_table(doc);
    let sections = sections(doc);
    let mut problems = Vec::new();
    if lines.is_empty() {
        problems.push(format!(
            "{name}: no `## Verdicts` table (target | measure | bound | runs | verdict)"
        ));
    }
    let summary: Vec<Vec<String>> = doc
        .lines()
        .skip_while(|l| *l != "| what | target | measured | command |")
        .skip(2)
        .take_while(|l| l.starts_with("| "))
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect();
    for line in &lines {
        let what = format!("{name}: {} ({})", line.target, line.measure);
        match computed(line) {
            Err(why) => problems.push(format!("{what}: {why}")),
            Ok(verdict) if verdict != line.verdict => problems.push(format!(
                "{what}: says {:?}, but {} against {} is {verdict}",
                line.verdict, line.runs, line.bound
            )),
            Ok(_) => {}
        }
        let Some(text) = anchor(&line.target)
            .and_then(|a| sections.iter().find(|(slug, _)| slug == a))
            .map(|(_, text)| ungroup(&with_linked(text)))
        else {
            problems.push(format!("{what}: link the target to its section"));
            continue;
        };
        for figure in figures(&line.runs) {
            if !mentions(&text, &figure) {
                problems.push(format!("{what}: run figure {figure} is not in its section"));
            }
        }
        let target_cell = summary
            .iter()
            .find(|row| row.first() == Some(&line.target))
            .and_then(|row| row.get(1))
            .map(|c| ungroup(c))
            .unwrap_or_default();
        for figure in figures(&line.bound) {
            if !mentions(&text, &figure) && !mentions(&target_cell, &figure) {
                problems.push(format!(
                    "{what}: bound {figure} is neither in its section nor in its summary row's target"
                ));
            }
        }
    }
    if !summary.is_empty() {
        let verdicts = target_verdicts(&lines);
        for row in &summary {
            let (Some(what), Some(target), Some(measured)) = (row.first(), row.get(1), row.get(2))
            else {
                continue;
            };
            let verdict = verdicts.iter().find(|(t, _)| t == what).map(|(_, v)| *v);
            match (target.as_str(), verdict) {
                ("-", None) => {}
                ("-", Some(_)) => problems.push(format!(
                    "{name}: {what}: verdicts for a row without a target"
                )),
                (_, None) => problems.push(format!(
                    "{name}: {what}: a target ({target}) with no line in the verdicts table"
                )),
                (_, Some(v)) if last_verdict(measured) != Some(v) => problems.push(format!(
                    "{name}: {what}: the summary says {:?}, its runs give {v}",
                    last_verdict(measured)
                )),
                _ => {}
            }
        }
        for (target, _) in &verdicts {
            if !summary.iter().any(|row| row.first() == Some(target)) {
                problems.push(format!(
                    "{name}: {target}: in the verdicts table, not in the summary"
                ));
            }
        }
    }
    problems
}

#[test]
fn every_verdict_follows_from_its_runs() {
    let mut problems = Vec::new();
    for name in [
        "BENCHMARKS.md",
        "collector/BENCHMARKS.md",
        "scheduler/BENCHMARKS.md",
    ] {
        let doc = std::fs::read_to_string(Path::new(ROOT).join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            verdict_table(&doc).len() >= 2,
            "{name}: the verdicts table has fewer than two lines"
        );
        problems.extend(verdict_problems(&doc, name));
    }
    assert!(problems.is_empty(), "verdicts:\n{}", problems.join("\n"));
}

#[test]
fn the_verdict_check_reads_units_and_refuses_what_does_not_follow() {
    assert_eq!(quantity("14 min 17 s"), Some((857.0, Dim::Time)));
    assert_eq!(quantity("1000 ms"), Some((1.0, Dim::Time)));
    assert!(
        quantity("12.4 ms (perch)")
            .is_some_and(|(v, d)| (v - 0.0124).abs() < 1e-12 && d == Dim::Time)
    );
    assert_eq!(quantity("1,428,556"), Some((1_428_556.0, Dim::Count)));
    assert_eq!(quantity("0.46×"), Some((0.46, Dim::Ratio)));
    assert_eq!(quantity("115.9 MB"), Some((115.9, Dim::Size)));
    assert_eq!(quantity("0.10% (300 s window)"), Some((0.1, Dim::Percent)));
    assert_eq!(bound("≥ 1.5 M"), Some(("≥", 1.5e6, Dim::Count)));
    assert_eq!(bound("< 1 s"), Some(("<", 1.0, Dim::Time)));
    assert_eq!(quantity("NaN ms"), None);
    assert_eq!(quantity("about 3"), None);
    let doc = "| what | target | measured | command |\n|---|---|---|---|\n\
        | [ingest](#ingest) | ≥ 1.5 M values/s | 1,428,556 and 1,612,673: met | x |\n\
        | [build](#build) | ≤ 15 min, ≤ 120 MB | 14 min 17 s, 202 MB; 25 min 48 s, 115.9 MB: met | x |\n\
        ## Verdicts\n\
        | target | measure | bound | runs | verdict |\n|---|---|---|---|---|\n\
        | [ingest](#ingest) | values per CPU-s | ≥ 1.5 M | 1,428,556; 1,612,673 | met |\n\
        | [build](#build) | `release`: time | ≤ 15 min | 14 min 17 s | met |\n\
        | [build](#build) | `release`: size | ≤ 120 MB | 202 MB | missed |\n\
        | [build](#build) | `dist`: time | ≤ 15 min | 25 min 48 s | missed |\n\
        | [build](#build) | `dist`: size | ≤ 120 MB | 115.9 MB | met |\n\
        ## Ingest\n1428556 and 1612673\n## Build\n14 min 17 s, 202 MB; 25 min 48 s, 115.9 MB\n";
    let problems = verdict_problems(doc, "doc");
    assert!(
        problems
            .iter()
            .any(|p| p.contains("(values per CPU-s): says \"met\"")),
        "a run under the bound, called met: {problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p
                .contains("[build](#build): the summary says Some(\"met\"), its runs give missed")),
        "no one build meets both, called met: {problems:?}"
    );
    let fixed = doc
        .replace("1,612,673 | met", "1,612,673 | missed")
        .replace("1,612,673: met", "1,612,673: missed")
        .replace("115.9 MB: met", "115.9 MB: missed");
    assert_eq!(verdict_problems(&fixed, "doc"), Vec::<String>::new());
}
