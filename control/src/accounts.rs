//! Which users may charge which accounts, and which QOS each account's jobs may use
//! (`[accounts.<name>]` in the server's config).
//!
//! Every user may charge the account named after them (the default when a job names none). Any
//! other account must list the user (or `"*"`) in its `users`. An account's jobs may use the
//! QOS levels in its `qos`, `low` and `normal` unless configured: `high`, which preempts, is
//! the operator's to grant. Operators may charge any account at any QOS. Without the check, a
//! user could charge another team's account and jump the queue.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The QOS levels an account's jobs may use when its section does not say.
pub const DEFAULT_QOS: &[&str] = &["low", "normal"];

/// The levels there are.
pub const QOS_LEVELS: &[&str] = &["low", "normal", "high"];

/// `[accounts.<name>]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccountRule {
    /// Users who may charge the account besides the one it is named after; `"*"` is everyone.
    pub users: Vec<String>,
    /// QOS levels its jobs may use.
    pub qos: Vec<String>,
}

impl Default for AccountRule {
    fn default() -> Self {
        AccountRule {
            users: Vec::new(),
            qos: DEFAULT_QOS.iter().map(|q| (*q).to_owned()).collect(),
        }
    }
}

/// Every account's rule, by account.
pub type AccountRules = BTreeMap<String, AccountRule>;

/// Checks `[accounts]` as read from a config; the message names the key.
pub fn validate(rules: &AccountRules) -> Result<(), String> {
    for (name, rule) in rules {
        if let Some(bad) = rule.qos.iter().find(|q| !QOS_LEVELS.contains(&q.as_str())) {
            return Err(format!(
                "accounts.{name}.qos: {bad:?} is not one of {}",
                QOS_LEVELS.join(", ")
            ));
        }
        if rule.users.iter().any(|u| u.trim().is_empty()) {
            return Err(format!("accounts.{name}.users: a user name is empty"));
        }
    }
    Ok(())
}

/// Whether `user` (not an operator) may submit a job charging `account` at `qos`; the error
/// says what to change.
pub fn may_charge(
    rules: &AccountRules,
    user: &str,
    account: &str,
    qos: &str,
) -> Result<(), String> {
    let rule = rules.get(account);
    let member =
        account == user || rule.is_some_and(|r| r.users.iter().any(|u| u == user || u == "*"));
    if !member {
        return Err(format!(
            "you ({user}) may not charge account {account:?}: only its users may ([accounts.{account}] users in the server's config); leave account unset to charge your own"
        ));
    }
    let allowed: Vec<&str> = rule.map_or_else(
        || DEFAULT_QOS.to_vec(),
        |r| r.qos.iter().map(String::as_str).collect(),
    );
    if !allowed.contains(&qos) {
        return Err(format!(
            "account {account:?} may not use qos {qos} (it may use: {}); ask an operator to add it to [accounts.{account}] qos in the server's config",
            if allowed.is_empty() {
                "none".to_owned()
            } else {
                allowed.join(", ")
            }
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_charge_their_own_and_listed_accounts_at_allowed_qos() {
        let rules: AccountRules = toml::from_str(
            "[vision]\nusers = [\"alice\"]\nqos = [\"low\", \"normal\", \"high\"]\n\
             [shared]\nusers = [\"*\"]\n",
        )
        .expect("rules");
        validate(&rules).expect("valid");
        assert!(
            may_charge(&rules, "bob", "bob", "normal").is_ok(),
            "own account"
        );
        assert!(may_charge(&rules, "bob", "bob", "low").is_ok());
        let e = may_charge(&rules, "bob", "bob", "high").expect_err("high not granted");
        assert!(
            e.contains("may not use qos high") && e.contains("[accounts.bob]"),
            "{e}"
        );
        let e = may_charge(&rules, "bob", "vision", "normal").expect_err("not a member");
        assert!(e.contains("may not charge account \"vision\""), "{e}");
        assert!(may_charge(&rules, "alice", "vision", "high").is_ok());
        assert!(
            may_charge(&rules, "bob", "shared", "normal").is_ok(),
            "\"*\""
        );
        assert!(may_charge(&rules, "bob", "shared", "high").is_err());
        assert!(
            may_charge(&rules, "bob", "alice", "normal").is_err(),
            "another user's"
        );
        let bad: AccountRules = toml::from_str("[x]\nqos = [\"urgent\"]\n").expect("toml");
        assert!(
            validate(&bad)
                .expect_err("bad qos")
                .contains("accounts.x.qos")
        );
    }
}
