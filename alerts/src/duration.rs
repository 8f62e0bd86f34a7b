//! Durations as people write them in config files: `"30s"`, `"5m"`, `"4h"`, `"1h30m"`.
//!
//! Alertmanager and Prometheus users write durations this way, so perch's `[alerts]` section
//! does too. Everything inside the crate works in milliseconds (`i64`, like every `now_ms`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

const UNITS: &[(&str, i64)] = &[
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
    ("w", 604_800_000),
];

/// The largest duration accepted: 10 years, far beyond any sensible alerting window, and small
/// enough that adding it to any plausible `now_ms` cannot overflow.
const MAX_MS: i64 = 10 * 365 * 86_400_000;

/// A non-negative duration read from a humane string; serializes back to one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(i64);

impl HumanDuration {
    /// A duration of `ms` milliseconds (clamped to 0 ..= 10 years).
    pub const fn from_ms(ms: i64) -> Self {
        Self(if ms < 0 {
            0
        } else if ms > MAX_MS {
            MAX_MS
        } else {
            ms
        })
    }

    /// A duration of `secs` seconds.
    pub const fn from_secs(secs: i64) -> Self {
        Self::from_ms(secs.saturating_mul(1_000))
    }

    /// A duration of `mins` minutes.
    pub const fn from_mins(mins: i64) -> Self {
        Self::from_ms(mins.saturating_mul(60_000))
    }

    /// The duration in milliseconds.
    pub const fn as_ms(self) -> i64 {
        self.0
    }

    /// True for a zero duration.
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// Parses `"30s"`, `"5m"`, `"1h30m"`, `"250ms"`, `"0"` (units ms, s, m, h, d, w).
    ///
    /// The error says what was wrong and shows the accepted form.
    pub fn parse(text: &str) -> Result<Self, String> {
        let hint =
            "write a duration like \"30s\", \"5m\", \"4h\" or \"1h30m\" (units ms, s, m, h, d, w)";
        let s = text.trim();
        if s == "0" {
            return Ok(Self(0));
        }
        if s.is_empty() {
            return Err(format!("empty duration; {hint}"));
        }
        let mut rest = s;
        let mut total: i64 = 0;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return Err(format!("{text:?} is not a duration; {hint}"));
            }
            let (number, tail) = rest.split_at(digits);
            let unit_len = tail.bytes().take_while(u8::is_ascii_alphabetic).count();
            let (unit, tail) = tail.split_at(unit_len);
            let Some(&(_, factor)) = UNITS.iter().find(|(name, _)| *name == unit) else {
                return Err(if unit.is_empty() {
                    format!("{text:?} has a number without a unit; {hint}")
                } else {
                    format!("{text:?} has unknown unit {unit:?}; {hint}")
                });
            };
            let value: i64 = number
                .parse()
                .map_err(|_| format!("{text:?} is too large; the limit is 10 years"))?;
            total = value
                .checked_mul(factor)
                .and_then(|v| total.checked_add(v))
                .filter(|v| *v <= MAX_MS)
                .ok_or_else(|| format!("{text:?} is too large; the limit is 10 years"))?;
            rest = tail;
        }
        Ok(Self(total))
    }
}

impl fmt::Display for HumanDuration {
    /// The shortest exact humane form: `"1h30m"`, `"45s"`, `"250ms"`, `"0s"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("0s");
        }
        let mut rest = self.0;
        for (name, factor) in UNITS.iter().rev().filter(|(name, _)| *name != "w") {
            if rest >= *factor {
                write!(f, "{}{name}", rest / factor)?;
                rest %= factor;
            }
        }
        Ok(())
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expected: Result<i64, &str>) {
        let got = HumanDuration::parse(text);
        match expected {
            Ok(ms) => assert_eq!(got, Ok(HumanDuration(ms)), "{text:?}"),
            Err(fragment) => {
                let err = got.expect_err(text);
                assert!(err.contains(fragment), "{text:?}: {err}");
            }
        }
    }

    #[test]
    fn parses_humane_durations() {
        check("30s", Ok(30_000));
        check("5m", Ok(300_000));
        check("4h", Ok(14_400_000));
        check("1h30m", Ok(5_400_000));
        check("250ms", Ok(250));
        check("2d", Ok(172_800_000));
        check("1w", Ok(604_800_000));
        check("0", Ok(0));
        check(" 10s ", Ok(10_000));
        check("", Err("empty"));
        check("10", Err("without a unit"));
        check("10x", Err("unknown unit \"x\""));
        check("-5m", Err("not a duration"));
        check("5 m", Err("without a unit"));
        check("99999999999999999999s", Err("too large"));
        check("5000w", Err("too large"));
    }

    #[test]
    fn displays_the_shortest_exact_form() {
        for (ms, text) in [
            (0, "0s"),
            (250, "250ms"),
            (30_000, "30s"),
            (5_400_000, "1h30m"),
            (90_061_001, "1d1h1m1s1ms"),
        ] {
            let d = HumanDuration(ms);
            assert_eq!(d.to_string(), text);
            assert_eq!(HumanDuration::parse(text), Ok(d), "round trip of {text}");
        }
    }
}
