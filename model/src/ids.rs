//! Typed identifiers, so a node name is never confused with a job or account string.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The name a node reports itself under (its hostname by default).
///
/// Valid names are 1 to 128 characters of ASCII letters, digits, `.`, `_`, `-` and `:`, so they
/// are safe as Prometheus label values, file names and SQL literals alike.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(String);

impl NodeId {
    /// Checks `name` and wraps it; the error says what is wrong with it.
    pub fn new(name: impl Into<String>) -> Result<Self, String> {
        let name = name.into();
        Self::check(&name)?;
        Ok(Self(name))
    }

    fn check(name: &str) -> Result<(), String> {
        if name.is_empty() {
            return Err("node name is empty; give the node a name such as its hostname".into());
        }
        if name.len() > 128 {
            return Err(format!(
                "node name is {} characters long; the limit is 128",
                name.len()
            ));
        }
        // A name is a path segment of the API (`/v1/nodes/{name}/drain`): "." and ".." would
        // name another path, so no request could ever reach such a node.
        if name == "." || name == ".." {
            return Err(format!(
                "node name {name:?} cannot address the node in a URL; use a hostname"
            ));
        }
        if let Some(bad) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':')))
        {
            return Err(format!(
                "node name {name:?} contains {bad:?}; use ASCII letters, digits, '.', '_', '-' or ':'"
            ));
        }
        Ok(())
    }

    /// Re-checks a name that arrived through deserialization (serde does not call [`NodeId::new`]).
    pub fn validate(&self) -> Result<(), String> {
        Self::check(&self.0)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A GPU's index on its node, as NVML and `CUDA_VISIBLE_DEVICES` number them.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct GpuIndex(pub u32);

impl fmt::Display for GpuIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, ok: bool) {
        assert_eq!(NodeId::new(name).is_ok(), ok, "{name:?}");
    }

    #[test]
    fn node_names() {
        check("gpu-node-01", true);
        check("rack1.node_2:a", true);
        check("", false);
        check("has space", false);
        check("quote\"", false);
        check(&"x".repeat(129), false);
        check(&"x".repeat(128), true);
        check(".", false);
        check("..", false);
        check("...", true);
    }
}
