//! Label matchers, written as Alertmanager writes them: `node="gpu-07"`, `severity=~"warning|critical"`,
//! `alertname!="NodeHeartbeatLost"`, `account!~"test-.*"`.
//!
//! Routes, inhibition rules and silences all select alerts by their labels with these. A label
//! the alert does not have matches as the empty string, as in Alertmanager, so `team=""` selects
//! alerts without a team. Regular expressions are anchored at both ends.

use crate::error::{Error, Result};
use regex::Regex;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;

/// How a matcher compares a label's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchOp {
    /// `=`: equal.
    Equal,
    /// `!=`: not equal.
    NotEqual,
    /// `=~`: the whole value matches the regular expression.
    Regex,
    /// `!~`: the whole value does not match the regular expression.
    NotRegex,
}

impl MatchOp {
    fn as_str(self) -> &'static str {
        match self {
            Self::Equal => "=",
            Self::NotEqual => "!=",
            Self::Regex => "=~",
            Self::NotRegex => "!~",
        }
    }
}

/// One condition on one label.
#[derive(Debug, Clone)]
pub struct Matcher {
    name: String,
    op: MatchOp,
    value: String,
    regex: Option<Regex>,
}

impl PartialEq for Matcher {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.op == other.op && self.value == other.value
    }
}

impl Eq for Matcher {}

/// True when `name` is a valid label name: `[A-Za-z_][A-Za-z0-9_]*`, as in Prometheus.
pub fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Matcher {
    /// Builds a matcher; fails when the label name is invalid or a regex does not compile.
    pub fn new(name: &str, op: MatchOp, value: &str) -> Result<Self> {
        let text = format!("{name}{}{value:?}", op.as_str());
        if !is_label_name(name) {
            return Err(Error::Matcher {
                text,
                message: "label names are letters, digits and '_', not starting with a digit"
                    .into(),
            });
        }
        let regex = match op {
            MatchOp::Regex | MatchOp::NotRegex => Some(
                Regex::new(&format!("^(?:{value})$")).map_err(|e| Error::Matcher {
                    text: text.clone(),
                    message: format!("invalid regular expression: {e}"),
                })?,
            ),
            MatchOp::Equal | MatchOp::NotEqual => None,
        };
        Ok(Self {
            name: name.to_owned(),
            op,
            value: value.to_owned(),
            regex,
        })
    }

    /// An equality matcher (`name="value"`); `name` must be a valid label name.
    pub fn equal(name: &str, value: &str) -> Result<Self> {
        Self::new(name, MatchOp::Equal, value)
    }

    /// Parses `name="value"`, `name=value`, `name!="v"`, `name=~"re"`, `name!~"re"`.
    /// Spaces around the operator are allowed; a quoted value may contain `\"` and `\\`.
    pub fn parse(text: &str) -> Result<Self> {
        let fail = |message: &str| Error::Matcher {
            text: text.to_owned(),
            message: format!(
                "{message}; write name=\"value\", name!=\"value\", name=~\"regex\" or name!~\"regex\""
            ),
        };
        let s = text.trim();
        let name_len = s
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        let (name, rest) = s.split_at(name_len);
        if name.is_empty() {
            return Err(fail("no label name"));
        }
        let rest = rest.trim_start();
        let (op, rest) = if let Some(r) = rest.strip_prefix("=~") {
            (MatchOp::Regex, r)
        } else if let Some(r) = rest.strip_prefix("!~") {
            (MatchOp::NotRegex, r)
        } else if let Some(r) = rest.strip_prefix("!=") {
            (MatchOp::NotEqual, r)
        } else if let Some(r) = rest.strip_prefix('=') {
            (MatchOp::Equal, r)
        } else {
            return Err(fail("no operator after the label name"));
        };
        let rest = rest.trim();
        let value = if let Some(inner) = rest.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = inner.chars();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some(escaped) => value.push(escaped),
                        None => return Err(fail("the value ends in a lone backslash")),
                    },
                    '"' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                return Err(fail("the quoted value has no closing quote"));
            }
            if !chars.as_str().trim().is_empty() {
                return Err(fail("text after the closing quote"));
            }
            value
        } else {
            rest.to_owned()
        };
        Self::new(name, op, &value)
    }

    /// The label this matcher looks at.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The operator.
    pub fn op(&self) -> MatchOp {
        self.op
    }

    /// The value or pattern.
    pub fn value(&self) -> &str {
        &self.value
    }

    /// Does a label value (`""` when the label is absent) satisfy this matcher?
    pub fn matches_value(&self, value: &str) -> bool {
        match (self.op, &self.regex) {
            (MatchOp::Equal, _) => value == self.value,
            (MatchOp::NotEqual, _) => value != self.value,
            (MatchOp::Regex, Some(re)) => re.is_match(value),
            (MatchOp::NotRegex, Some(re)) => !re.is_match(value),
            // `new` always compiles the regex for the regex operators.
            (MatchOp::Regex | MatchOp::NotRegex, None) => false,
        }
    }

    /// Does this label set satisfy this matcher?
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.matches_value(labels.get(&self.name).map_or("", String::as_str))
    }
}

/// True when every matcher matches (and so for an empty list).
pub fn matches_all(matchers: &[Matcher], labels: &BTreeMap<String, String>) -> bool {
    matchers.iter().all(|m| m.matches(labels))
}

impl fmt::Display for Matcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}\"", self.name, self.op.as_str())?;
        for c in self.value.chars() {
            if matches!(c, '"' | '\\') {
                f.write_str("\\")?;
            }
            write!(f, "{c}")?;
        }
        f.write_str("\"")
    }
}

impl Serialize for Matcher {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Matcher {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn check(text: &str, set: &[(&str, &str)], expected: bool) {
        let m = Matcher::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(m.matches(&labels(set)), expected, "{text} on {set:?}");
    }

    #[test]
    fn matches_like_alertmanager() {
        check(r#"node="gpu-1""#, &[("node", "gpu-1")], true);
        check("node=gpu-1", &[("node", "gpu-1")], true);
        check(r#"node = "gpu-1""#, &[("node", "gpu-2")], false);
        check(r#"node!="gpu-1""#, &[("node", "gpu-2")], true);
        check(r#"node!="gpu-1""#, &[], true);
        check(
            r#"severity=~"warning|critical""#,
            &[("severity", "critical")],
            true,
        );
        check(r#"severity=~"warn""#, &[("severity", "warning")], false);
        check(r#"account!~"test-.*""#, &[("account", "test-a")], false);
        check(r#"account!~"test-.*""#, &[("account", "ml")], true);
        check(r#"team="""#, &[], true);
        check(r#"team="""#, &[("team", "x")], false);
        check(r#"msg="say \"hi\"""#, &[("msg", "say \"hi\"")], true);
    }

    #[test]
    fn rejects_bad_matchers_with_the_accepted_forms() {
        for (text, fragment) in [
            ("", "no label name"),
            ("=x", "no label name"),
            ("node", "no operator"),
            ("node~x", "no operator"),
            (r#"node="x"#, "no closing quote"),
            (r#"node="x" y"#, "after the closing quote"),
            (r#"node=~"(""#, "invalid regular expression"),
            ("1node=x", "label names"),
        ] {
            let err = Matcher::parse(text).expect_err(text).to_string();
            assert!(err.contains(fragment), "{text}: {err}");
        }
    }

    #[test]
    fn display_round_trips() {
        for text in [r#"a="b""#, r#"a!~"x|y""#, r#"msg="q\"\\""#] {
            let m = Matcher::parse(text).expect("valid");
            assert_eq!(m.to_string(), text);
            assert_eq!(Matcher::parse(&m.to_string()).expect("round trip"), m);
        }
    }
}
