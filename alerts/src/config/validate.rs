//! [`AlertsConfig::validate`](super::AlertsConfig::validate): every check serde cannot make,
//! each error naming the field by its path in perch's config file and what is allowed.

use super::{AlertsConfig, EmailConfig, WebhookConfig};
use crate::builtin::BUILTIN_RULE_NAMES;
use crate::error::{Error, Result};
use crate::matcher::is_label_name;
use crate::rules::{ActionSpec, RESERVED_LABELS};
use std::collections::BTreeSet;

const MIN_INTERVAL_MS: i64 = 1_000;

pub(super) fn validate(c: &AlertsConfig) -> Result<()> {
    if c.evaluation_interval.as_ms() < MIN_INTERVAL_MS {
        return Err(Error::config(
            "alerts.evaluation_interval",
            "must be at least \"1s\"",
        ));
    }
    validate_builtin(c)?;
    validate_rules(c)?;
    validate_receivers(c)?;
    validate_route(c)?;
    validate_inhibit(c)?;
    validate_remediation(c)
}

fn validate_builtin(c: &AlertsConfig) -> Result<()> {
    let b = &c.builtin;
    let known = BUILTIN_RULE_NAMES.join(", ");
    for name in b.disable.iter().chain(b.actions.keys()) {
        if !BUILTIN_RULE_NAMES.contains(&name.as_str()) {
            return Err(Error::config(
                "alerts.builtin",
                format!("names {name:?}, which is not a built-in rule; the built-ins are {known}"),
            ));
        }
    }
    for (name, actions) in &b.actions {
        check_actions(c, &format!("alerts.builtin.actions.{name}"), actions)?;
    }
    if !(b.idle_utilization_percent >= 0.0 && b.idle_utilization_percent <= 100.0) {
        return Err(Error::config(
            "alerts.builtin.idle_utilization_percent",
            "must be between 0 and 100",
        ));
    }
    if !(b.disk_free_percent > 0.0 && b.disk_free_percent < 100.0) {
        return Err(Error::config(
            "alerts.builtin.disk_free_percent",
            "must be above 0 and below 100",
        ));
    }
    if let Err(e) = regex::Regex::new(&b.nic_devices) {
        return Err(Error::config(
            "alerts.builtin.nic_devices",
            format!("is not a valid regular expression: {e}"),
        ));
    }
    if b.nic_devices.contains('\'') {
        return Err(Error::config(
            "alerts.builtin.nic_devices",
            "must not contain a single quote (it is placed in a SQL string)",
        ));
    }
    for (field, d) in [
        ("heartbeat_timeout", b.heartbeat_timeout),
        ("event_window", b.event_window),
        ("no_progress_for", b.no_progress_for),
    ] {
        if d.as_ms() < MIN_INTERVAL_MS {
            return Err(Error::config(
                format!("alerts.builtin.{field}"),
                "must be at least \"1s\"",
            ));
        }
    }
    Ok(())
}

fn validate_rules(c: &AlertsConfig) -> Result<()> {
    let mut names = BTreeSet::new();
    for (i, r) in c.rules.iter().enumerate() {
        let field = |f: &str| format!("alerts.rules[{i}].{f}");
        if r.name.trim().is_empty() {
            return Err(Error::config(field("name"), "is empty; name the rule"));
        }
        if r.name.chars().any(char::is_control) {
            return Err(Error::config(field("name"), "contains control characters"));
        }
        if !names.insert(r.name.as_str()) {
            return Err(Error::config(
                field("name"),
                format!(
                    "{:?} is used by an earlier rule; rule names must be unique",
                    r.name
                ),
            ));
        }
        if r.name == crate::engine::BREAKER_ALERT {
            return Err(Error::config(
                field("name"),
                format!(
                    "{:?} is the alert perch raises itself; pick another name",
                    r.name
                ),
            ));
        }
        let builtin_active = c.builtin.enabled && !c.builtin.disable.iter().any(|d| d == &r.name);
        if builtin_active && BUILTIN_RULE_NAMES.contains(&r.name.as_str()) {
            return Err(Error::config(
                field("name"),
                format!(
                    "{:?} is a built-in rule; add it to alerts.builtin.disable to replace it, or pick another name",
                    r.name
                ),
            ));
        }
        if r.sql.trim().is_empty() {
            return Err(Error::config(
                field("sql"),
                "is empty; write one SELECT whose rows are the alert instances",
            ));
        }
        for key in r.labels.keys() {
            if !is_label_name(key) || RESERVED_LABELS.contains(&key.as_str()) {
                return Err(Error::config(
                    field("labels"),
                    format!(
                        "has key {key:?}; use letters, digits and '_' (not starting with a digit), and not {}",
                        RESERVED_LABELS.join(" or ")
                    ),
                ));
            }
        }
        if let Some(interval) = r.interval
            && interval.as_ms() < MIN_INTERVAL_MS
        {
            return Err(Error::config(field("interval"), "must be at least \"1s\""));
        }
        for col in r.label_columns.iter().flatten() {
            if !is_label_name(col) {
                return Err(Error::config(
                    field("label_columns"),
                    format!("has {col:?}, which is not a column name"),
                ));
            }
        }
        check_actions(c, &field("actions"), &r.actions)?;
    }
    Ok(())
}

fn check_actions(c: &AlertsConfig, field: &str, actions: &[ActionSpec]) -> Result<()> {
    for action in actions {
        if let ActionSpec::RunCommand(name) = action
            && !c.remediation.commands.contains_key(name)
        {
            let defined: Vec<&str> = c.remediation.commands.keys().map(String::as_str).collect();
            return Err(Error::config(
                field,
                format!(
                    "runs command {name:?}, which alerts.remediation.commands does not define (defined: {})",
                    if defined.is_empty() {
                        "none".to_owned()
                    } else {
                        defined.join(", ")
                    }
                ),
            ));
        }
    }
    Ok(())
}

fn validate_receivers(c: &AlertsConfig) -> Result<()> {
    let mut names = BTreeSet::new();
    for (i, r) in c.receivers.iter().enumerate() {
        let field = format!("alerts.receivers[{i}]");
        if r.name.trim().is_empty() {
            return Err(Error::config(format!("{field}.name"), "is empty"));
        }
        if !names.insert(r.name.as_str()) {
            return Err(Error::config(
                format!("{field}.name"),
                format!("{:?} is used twice; receiver names must be unique", r.name),
            ));
        }
        for (j, e) in r.email.iter().enumerate() {
            validate_email(&format!("{field}.email[{j}]"), e)?;
        }
        for (j, w) in r.webhook.iter().enumerate() {
            validate_webhook(&format!("{field}.webhook[{j}]"), w)?;
        }
    }
    Ok(())
}

fn validate_email(field: &str, e: &EmailConfig) -> Result<()> {
    if e.smtp_host.trim().is_empty() {
        return Err(Error::config(format!("{field}.smtp_host"), "is empty"));
    }
    if e.from.parse::<lettre::message::Mailbox>().is_err() {
        return Err(Error::config(
            format!("{field}.from"),
            format!(
                "{:?} is not an address; write \"perch@example.com\" or \"perch <perch@example.com>\"",
                e.from
            ),
        ));
    }
    if e.to.is_empty() {
        return Err(Error::config(format!("{field}.to"), "lists no recipient"));
    }
    for to in &e.to {
        if to.parse::<lettre::message::Mailbox>().is_err() {
            return Err(Error::config(
                format!("{field}.to"),
                format!(
                    "{to:?} is not an address; write \"ops@example.com\" or \"Ops <ops@example.com>\""
                ),
            ));
        }
    }
    if e.password.is_some() && e.password_env.is_some() {
        return Err(Error::config(
            format!("{field}.password"),
            "and password_env are both set; keep one (password_env keeps the secret out of the file)",
        ));
    }
    if e.username.is_some() != (e.password.is_some() || e.password_env.is_some()) {
        return Err(Error::config(
            format!("{field}.username"),
            "and a password (password or password_env) go together; set both or neither",
        ));
    }
    if e.timeout.is_zero() {
        return Err(Error::config(
            format!("{field}.timeout"),
            "must be above 0s",
        ));
    }
    Ok(())
}

fn validate_webhook(field: &str, w: &WebhookConfig) -> Result<()> {
    match reqwest::Url::parse(&w.url) {
        Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
        _ => {
            return Err(Error::config(
                format!("{field}.url"),
                format!("{:?} is not an http:// or https:// URL", w.url),
            ));
        }
    }
    if w.bearer_token.is_some() && w.bearer_token_env.is_some() {
        return Err(Error::config(
            format!("{field}.bearer_token"),
            "and bearer_token_env are both set; keep one",
        ));
    }
    if w.timeout.is_zero() {
        return Err(Error::config(
            format!("{field}.timeout"),
            "must be above 0s",
        ));
    }
    Ok(())
}

fn check_group_by(field: &str, group_by: &[String]) -> Result<()> {
    if group_by.iter().any(|g| g == "...") {
        if group_by.len() > 1 {
            return Err(Error::config(
                field,
                "mixes \"...\" (every label) with label names; use one or the other",
            ));
        }
        return Ok(());
    }
    for g in group_by {
        if !is_label_name(g) {
            return Err(Error::config(
                field,
                format!("has {g:?}; list label names, or [\"...\"] to group by every label"),
            ));
        }
    }
    Ok(())
}

fn validate_route(c: &AlertsConfig) -> Result<()> {
    let route = &c.route;
    let names: Vec<&str> = c.receivers.iter().map(|r| r.name.as_str()).collect();
    let check_receiver = |field: &str, name: &str| -> Result<()> {
        if names.contains(&name) {
            Ok(())
        } else {
            Err(Error::config(
                field,
                format!(
                    "names receiver {name:?}, which alerts.receivers does not define (defined: {})",
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                ),
            ))
        }
    };
    if !c.receivers.is_empty() || !route.receiver.is_empty() {
        check_receiver("alerts.route.receiver", &route.receiver)?;
    }
    check_group_by("alerts.route.group_by", &route.group_by)?;
    for (field, d) in [
        ("group_interval", route.group_interval),
        ("repeat_interval", route.repeat_interval),
    ] {
        if d.as_ms() < MIN_INTERVAL_MS {
            return Err(Error::config(
                format!("alerts.route.{field}"),
                "must be at least \"1s\"",
            ));
        }
    }
    for (i, child) in route.routes.iter().enumerate() {
        let field = |f: &str| format!("alerts.route.routes[{i}].{f}");
        if let Some(receiver) = &child.receiver {
            check_receiver(&field("receiver"), receiver)?;
        }
        if let Some(group_by) = &child.group_by {
            check_group_by(&field("group_by"), group_by)?;
        }
        for (f, d) in [
            ("group_interval", child.group_interval),
            ("repeat_interval", child.repeat_interval),
        ] {
            if d.is_some_and(|d| d.as_ms() < MIN_INTERVAL_MS) {
                return Err(Error::config(field(f), "must be at least \"1s\""));
            }
        }
    }
    Ok(())
}

fn validate_inhibit(c: &AlertsConfig) -> Result<()> {
    for (i, rule) in c.inhibit_rules.iter().flatten().enumerate() {
        let field = |f: &str| format!("alerts.inhibit_rules[{i}].{f}");
        if rule.source_matchers.is_empty() {
            return Err(Error::config(
                field("source_matchers"),
                "is empty; an inhibit rule needs matchers for the muting alert",
            ));
        }
        if rule.target_matchers.is_empty() {
            return Err(Error::config(
                field("target_matchers"),
                "is empty; an inhibit rule needs matchers for the muted alerts",
            ));
        }
        if let Some(bad) = rule.equal.iter().find(|l| !is_label_name(l)) {
            return Err(Error::config(
                field("equal"),
                format!("has {bad:?}, which is not a label name"),
            ));
        }
    }
    Ok(())
}

fn validate_remediation(c: &AlertsConfig) -> Result<()> {
    let r = &c.remediation;
    if !(r.max_fraction_out > 0.0 && r.max_fraction_out <= 1.0) {
        return Err(Error::config(
            "alerts.remediation.max_fraction_out",
            "must be above 0 and at most 1 (0.2 lets a fifth of the nodes be out)",
        ));
    }
    if r.max_concurrent_drains == 0 {
        return Err(Error::config(
            "alerts.remediation.max_concurrent_drains",
            "must be at least 1; set alerts.remediation.enabled = false to stop automatic actions",
        ));
    }
    if r.action_timeout.as_ms() < MIN_INTERVAL_MS {
        return Err(Error::config(
            "alerts.remediation.action_timeout",
            "must be at least \"1s\"",
        ));
    }
    if r.health_check.first().is_some_and(|p| p.trim().is_empty()) {
        return Err(Error::config(
            "alerts.remediation.health_check",
            "starts with an empty program name",
        ));
    }
    for (name, cmd) in &r.commands {
        let field = format!("alerts.remediation.commands.{name}");
        if cmd.argv.first().is_none_or(|p| p.trim().is_empty()) {
            return Err(Error::config(
                format!("{field}.argv"),
                "needs a program: argv = [\"/path/to/program\", \"arg\", ...]",
            ));
        }
        if cmd.timeout.is_some_and(|t| t.as_ms() < MIN_INTERVAL_MS) {
            return Err(Error::config(
                format!("{field}.timeout"),
                "must be at least \"1s\"",
            ));
        }
    }
    Ok(())
}
