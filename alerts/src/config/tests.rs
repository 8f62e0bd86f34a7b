use super::*;
use crate::builtin::BUILTIN_RULE_NAMES;

/// perch's config file embeds the section as `[alerts]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    alerts: AlertsConfig,
}

const README: &str = include_str!("../../README.md");

fn readme_example() -> &'static str {
    let start = README
        .find("```toml\n[alerts]")
        .expect("README has the example")
        + "```toml\n".len();
    let len = README[start..].find("```").expect("example ends");
    &README[start..start + len]
}

#[test]
fn readme_example_parses_and_validates() {
    let file: File = toml::from_str(readme_example()).expect("README example parses");
    file.alerts.validate().expect("README example is valid");
    let rules = file.alerts.rules();
    assert_eq!(
        rules.len(),
        BUILTIN_RULE_NAMES.len() - 1 + 1,
        "one disabled, one added"
    );
    let hot = rules
        .iter()
        .find(|r| r.name == "GpuTooHot")
        .expect("custom rule");
    assert_eq!(hot.for_ms, 300_000);
    assert_eq!(hot.keep_firing_for_ms, 120_000);
    assert_eq!(hot.interval_ms, 60_000);
    assert_eq!(hot.label_columns, ["gpu"]);
    let reset = rules
        .iter()
        .find(|r| r.name == "XidResetGpu")
        .expect("builtin");
    assert_eq!(reset.actions.len(), 3);
    assert_eq!(
        file.alerts.route.routes[0].matchers[0].to_string(),
        r#"account="vision""#
    );
}

#[test]
fn readme_documents_every_builtin_rule() {
    for name in BUILTIN_RULE_NAMES {
        assert!(
            README.contains(&format!("| `{name}` |")),
            "README table lacks {name}"
        );
    }
    let defaults = crate::builtin::builtin_summary(&BuiltinConfig::default());
    for (name, (severity, actions)) in defaults {
        let row = README
            .lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
            .unwrap_or_default();
        assert!(
            row.contains(&format!("| {severity} |")),
            "{name}: severity in {row}"
        );
        for a in actions {
            assert!(
                row.contains(&format!("`{a}`")),
                "{name}: action {a} in {row}"
            );
        }
    }
}

#[test]
fn an_empty_section_gives_the_documented_defaults() {
    let c = AlertsConfig::from_toml("").expect("empty is valid");
    assert!(c.enabled && !c.dry_run);
    assert_eq!(c.evaluation_interval.as_ms(), 30_000);
    assert_eq!(c.rules().len(), BUILTIN_RULE_NAMES.len());
    assert_eq!(c.route.group_by, ["alertname", "node"]);
    assert_eq!(c.route.group_wait.as_ms(), 30_000);
    assert_eq!(c.route.group_interval.as_ms(), 300_000);
    assert_eq!(c.route.repeat_interval.as_ms(), 14_400_000);
    assert_eq!(c.remediation.max_fraction_out, 0.2);
    assert!(c.inhibit_rules.is_none());
}

fn check(toml: &str, fragment: &str) {
    let err = AlertsConfig::from_toml(toml)
        .expect_err(fragment)
        .to_string();
    assert!(err.contains(fragment), "expected {fragment:?} in: {err}");
}

#[test]
fn bad_configs_name_the_field_and_what_is_allowed() {
    check(
        "evaluation_intervall = \"1m\"",
        "unknown field `evaluation_intervall`",
    );
    check("evaluation_interval = \"soon\"", "write a duration like");
    check(
        "evaluation_interval = \"0s\"",
        "`alerts.evaluation_interval` must be at least",
    );
    check(
        "[[rules]]\nname = \"a\"\nsql = \"SELECT 1\"\nseverity = \"page\"",
        "expected one of `info`, `warning`, `critical`",
    );
    check(
        "[[rules]]\nname = \"a\"\nsql = \" \"",
        "`alerts.rules[0].sql` is empty",
    );
    check(
        "[[rules]]\nname = \"a\"\nsql = \"x\"\n[[rules]]\nname = \"a\"\nsql = \"y\"",
        "`alerts.rules[1].name`",
    );
    check(
        "[[rules]]\nname = \"XidReboot\"\nsql = \"x\"",
        "add it to alerts.builtin.disable",
    );
    check(
        "[[rules]]\nname = \"RemediationCircuitOpen\"\nsql = \"x\"",
        "the alert perch raises itself",
    );
    check(
        "[[rules]]\nname = \"a\"\nsql = \"x\"\nlabels = { alertname = \"b\" }",
        "`alerts.rules[0].labels` has key \"alertname\"",
    );
    check(
        "[[rules]]\nname = \"a\"\nsql = \"x\"\nactions = [\"reboot\"]",
        "use \"drain_node\", \"requeue_jobs\", \"gpu_out\" or \"run_command:NAME\"",
    );
    check(
        "[[rules]]\nname = \"a\"\nsql = \"x\"\nactions = [\"run_command:fix\"]",
        "alerts.remediation.commands does not define (defined: none)",
    );
    check(
        "[builtin]\ndisable = [\"Nope\"]",
        "the built-ins are NodeHeartbeatLost",
    );
    check(
        "[builtin]\ndisk_free_percent = 0.0",
        "`alerts.builtin.disk_free_percent`",
    );
    check(
        "[builtin]\nnic_devices = \"(\"",
        "`alerts.builtin.nic_devices` is not a valid regular expression",
    );
    check(
        "[route]\nreceiver = \"ops\"",
        "names receiver \"ops\", which alerts.receivers does not define (defined: none)",
    );
    check(
        "[[receivers]]\nname = \"ops\"",
        "`alerts.route.receiver` names receiver \"\"",
    );
    check(
        "[[receivers]]\nname = \"ops\"\n[route]\nreceiver = \"ops\"\ngroup_by = [\"...\", \"node\"]",
        "mixes \"...\"",
    );
    check(
        "[[receivers]]\nname = \"ops\"\n[[receivers.email]]\nsmtp_host = \"h\"\nfrom = \"not an address\"\nto = [\"a@b.c\"]\n[route]\nreceiver = \"ops\"",
        "`alerts.receivers[0].email[0].from`",
    );
    check(
        "[[receivers]]\nname = \"ops\"\n[[receivers.email]]\nsmtp_host = \"h\"\nfrom = \"p@b.c\"\nto = [\"a@b.c\"]\nusername = \"u\"\n[route]\nreceiver = \"ops\"",
        "and a password (password or password_env) go together",
    );
    check(
        "[[receivers]]\nname = \"ops\"\n[[receivers.email]]\nsmtp_host = \"h\"\nfrom = \"p@b.c\"\nto = [\"a@b.c\"]\ntls = \"ssl\"\n[route]\nreceiver = \"ops\"",
        "expected one of `none`, `starttls`, `tls`",
    );
    check(
        "[[receivers]]\nname = \"ops\"\n[[receivers.webhook]]\nurl = \"ftp://x\"\n[route]\nreceiver = \"ops\"",
        "is not an http:// or https:// URL",
    );
    check(
        "[[inhibit_rules]]\nsource_matchers = []\ntarget_matchers = ['a=\"b\"']",
        "`alerts.inhibit_rules[0].source_matchers` is empty",
    );
    check(
        "[[inhibit_rules]]\nsource_matchers = ['a=']\ntarget_matchers = ['a']",
        "no operator",
    );
    check(
        "[remediation]\nmax_fraction_out = 1.5",
        "`alerts.remediation.max_fraction_out` must be above 0 and at most 1",
    );
    check(
        "[remediation]\nmax_concurrent_drains = 0",
        "set alerts.remediation.enabled = false",
    );
    check(
        "[remediation.commands.fix]\nargv = []",
        "`alerts.remediation.commands.fix.argv` needs a program",
    );
}
