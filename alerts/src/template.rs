//! The tiny template language of rule summaries and descriptions.
//!
//! `{{ labels.node }}`, `{{ values.xid }}`, `{{ rule }}` and `{{ severity }}` are replaced by
//! the alert's data; nothing else is evaluated. A name that is not there renders as
//! `<missing:name>` so a typo shows in the message instead of silently vanishing, and no input
//! can make rendering fail or panic: a template is operator text, rendering must always work.

use std::collections::BTreeMap;

/// What a template can refer to.
#[derive(Debug, Clone, Copy)]
pub struct TemplateContext<'a> {
    /// The rule's name (`{{ rule }}`).
    pub rule: &'a str,
    /// The rule's severity (`{{ severity }}`).
    pub severity: &'a str,
    /// The alert's labels (`{{ labels.NAME }}`).
    pub labels: &'a BTreeMap<String, String>,
    /// The alert's values (`{{ values.NAME }}`).
    pub values: &'a BTreeMap<String, f64>,
}

/// Renders `template` against `ctx`.
pub fn render(template: &str, ctx: &TemplateContext<'_>) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            // An unclosed `{{` is text, not an error.
            out.push_str(&rest[start..]);
            return out;
        };
        out.push_str(&lookup(after[..end].trim(), ctx));
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

fn lookup(name: &str, ctx: &TemplateContext<'_>) -> String {
    let found = match name {
        "rule" | "alertname" => Some(ctx.rule.to_owned()),
        "severity" => Some(ctx.severity.to_owned()),
        _ => {
            if let Some(label) = name.strip_prefix("labels.") {
                ctx.labels.get(label).cloned()
            } else if let Some(value) = name.strip_prefix("values.") {
                ctx.values.get(value).map(|v| format_value(*v))
            } else {
                None
            }
        }
    };
    found.unwrap_or_else(|| format!("<missing:{name}>"))
}

/// Formats a value for people: integers without a fraction, others with up to 3 decimals.
pub fn format_value(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return format!("{v:.0}");
    }
    let text = format!("{v:.3}");
    let trimmed = text.trim_end_matches('0').trim_end_matches('.');
    if matches!(trimmed, "0" | "-0" | "") {
        // Tiny values would round to zero; show them as they are instead.
        return format!("{v:e}");
    }
    trimmed.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(template: &str, expected: &str) {
        let labels = BTreeMap::from([("node".to_string(), "gpu-3".to_string())]);
        let values = BTreeMap::from([("xid".to_string(), 79.0), ("util".to_string(), 12.345)]);
        let ctx = TemplateContext {
            rule: "XidReboot",
            severity: "critical",
            labels: &labels,
            values: &values,
        };
        assert_eq!(render(template, &ctx), expected, "{template:?}");
    }

    #[test]
    fn substitutes_known_names() {
        check("XID {{ values.xid }} on {{labels.node}}", "XID 79 on gpu-3");
        check("{{ rule }} ({{ severity }})", "XidReboot (critical)");
        check("{{ values.util }}%", "12.345%");
        check("plain text", "plain text");
        check("", "");
    }

    #[test]
    fn unknown_and_malformed_never_fail() {
        check("{{ labels.gpu }}", "<missing:labels.gpu>");
        check("{{ nonsense }}", "<missing:nonsense>");
        check("{{}}", "<missing:>");
        check("open {{ labels.node", "open {{ labels.node");
        check("}} {{ rule }} {{", "}} XidReboot {{");
        check("é{{ rule }}ü", "éXidRebootü");
    }

    #[test]
    fn formats_values_for_people() {
        assert_eq!(format_value(3.0), "3");
        assert_eq!(format_value(0.5), "0.5");
        assert_eq!(format_value(2.0 / 3.0), "0.667");
        assert_eq!(format_value(-4.0), "-4");
        assert_eq!(format_value(0.0001), "1e-4");
        assert_eq!(format_value(f64::NAN), "NaN");
    }
}
