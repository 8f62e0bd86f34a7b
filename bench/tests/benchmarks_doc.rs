//! BENCHMARKS.md's summary table stays in step with its sections: each row links to the
//! section holding the output behind it, and every figure the row gives (dates aside) appears
//! in that section or in a BENCHMARKS.md the section links to, so the summary cannot say
//! 1.50 M where the output says 1.81 M. A row's verdict (met, missed) is the section's too.

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

/// The `## ` and `### ` sections of `doc` by anchor, each with its text up to the next
/// heading of its level or above (a `## ` section holds its `### ` ones).
fn sections(doc: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let (mut section, mut subsection) = (None, None);
    for line in doc.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            out.push((slug(heading), String::new()));
            (section, subsection) = (Some(out.len() - 1), None);
        } else if let Some(heading) = line.strip_prefix("### ") {
            out.push((slug(heading), String::new()));
            subsection = Some(out.len() - 1);
        } else {
            for i in [section, subsection].into_iter().flatten() {
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
    let parts = sections("## A\none\n### B\ntwo\n## C\nthree\n");
    assert_eq!(
        parts,
        [
            ("a".to_owned(), "one\ntwo\n".to_owned()),
            ("b".to_owned(), "two\n".to_owned()),
            ("c".to_owned(), "three\n".to_owned()),
        ]
    );
    assert_eq!(
        slug("Queries against DuckDB (issue 4)"),
        "queries-against-duckdb-issue-4"
    );
}
