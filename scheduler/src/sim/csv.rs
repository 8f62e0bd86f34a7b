//! What the simulator's two file formats (traces, cluster files) share: comma-separated lines
//! with a header, `#` comments and blank lines skipped, errors naming file, line and column,
//! and a warning for columns the format does not know.

use crate::error::{Error, Result};

/// A file's header and its data lines (1-based line number, fields trimmed).
pub(crate) struct Table<'a> {
    file: &'a str,
    /// The header's column names.
    pub(crate) cols: Vec<&'a str>,
    /// The data lines.
    pub(crate) rows: Vec<(usize, Vec<&'a str>)>,
}

impl<'a> Table<'a> {
    /// Splits `text` (file `file`); an empty file is an error.
    pub(crate) fn parse(file: &'a str, text: &'a str) -> Result<Table<'a>> {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'));
        let Some((_, header)) = lines.next() else {
            return Err(error(file, 1, "", "empty file".into()));
        };
        Ok(Table {
            file,
            cols: header.split(',').map(str::trim).collect(),
            rows: lines
                .map(|(i, l)| (i + 1, l.split(',').map(str::trim).collect()))
                .collect(),
        })
    }

    /// The error for `line` and `column` of this file.
    pub(crate) fn error(&self, line: usize, column: &str, message: String) -> Error {
        error(self.file, line, column, message)
    }

    /// Where column `c` is, if the header has it.
    pub(crate) fn col(&self, c: &str) -> Option<usize> {
        self.cols.iter().position(|x| *x == c)
    }

    /// Where column `c` is; its absence is an error (`needs` says what the format needs).
    pub(crate) fn need(&self, c: &str, needs: &str) -> Result<usize> {
        self.col(c).ok_or_else(|| {
            self.error(
                1,
                c,
                format!(
                    "missing column ({needs}header has: {})",
                    self.cols.join(",")
                ),
            )
        })
    }

    /// A warning naming the columns not in `known`, if any (`what`: the format, in words).
    pub(crate) fn unknown_columns(&self, known: &[&str], what: &str) -> Option<String> {
        let unknown: Vec<&str> = self
            .cols
            .iter()
            .copied()
            .filter(|c| !known.contains(c))
            .collect();
        (!unknown.is_empty()).then(|| {
            format!(
                "{}: column(s) {} ignored: not {what} column (known: {})",
                self.file,
                unknown.join(", "),
                known.join(", ")
            )
        })
    }
}

fn error(file: &str, line: usize, column: &str, message: String) -> Error {
    Error::Trace {
        file: file.into(),
        line,
        column: column.into(),
        message,
    }
}

/// `true`/`false` (also `1`/`0`, `yes`/`no`, any case).
pub(crate) fn flag(s: &str) -> std::result::Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(format!("`{s}` is not true or false")),
    }
}
