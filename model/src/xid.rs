//! NVIDIA's XID resolution classes, and the SQL that applies them inside a query.
//!
//! NVIDIA's XID catalog gives every XID an immediate action (its "resolution bucket"). perch
//! folds those buckets into five classes an operator acts on: ignore it, restart the
//! application, reset the GPU, reboot the node, or contact support. The table lives here, in
//! one place, and [`xid_class_sql`] generates the SQL `CASE` the built-in XID rules run from the
//! same table, so Rust and SQL can never disagree about a code.
//!
//! How catalog buckets fold into classes: `IGNORE` is ignore; `RESTART_APP` and `CHECK_UVM`
//! restart the application, as does `WORKFLOW_XID_45` (preemptive cleanup after an earlier
//! error); `RESET_GPU` and the reset workflows (`WORKFLOW_XID_48` double-bit ECC,
//! `WORKFLOW_NVLINK_ERR`, `WORKFLOW_NVLINK5_ERR`) reset the GPU; `RESTART_BM` and `RESTART_VM`
//! reboot; `UNEXPECTED_ERR_REPORT_ISSUE`, `CHECK_MECHANICALS` and `UPDATE_SWFW` need a person
//! (contact support). XID 154 only announces the action another XID needs, so it is ignored
//! here; the other XID arrives on its own. Codes the catalog does not list are
//! [`XidClass::Unknown`].

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// What an operator (or perch) should do about an XID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum XidClass {
    /// Informational; no action.
    Ignore,
    /// The application faulted; restarting it is enough.
    RestartApp,
    /// The GPU needs a reset before it can be trusted again.
    ResetGpu,
    /// The node needs a reboot (the GPU fell off the bus, or a reset is not enough).
    Reboot,
    /// Unexpected for this hardware; report it to NVIDIA or the vendor.
    ContactSupport,
    /// Not in NVIDIA's catalog (a newer driver's code, or garbage).
    Unknown,
}

impl XidClass {
    /// Every class, in the order the generated SQL tests them.
    pub const ALL: [XidClass; 6] = [
        XidClass::Ignore,
        XidClass::RestartApp,
        XidClass::ResetGpu,
        XidClass::Reboot,
        XidClass::ContactSupport,
        XidClass::Unknown,
    ];

    /// The class's name as it appears in labels and SQL (`reset_gpu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ignore => "ignore",
            Self::RestartApp => "restart_app",
            Self::ResetGpu => "reset_gpu",
            Self::Reboot => "reboot",
            Self::ContactSupport => "contact_support",
            Self::Unknown => "unknown",
        }
    }
}

/// The highest code NVIDIA's catalog lists (as of the Blackwell-era catalog).
pub const MAX_CATALOGUED_XID: u64 = 162;

/// Classifies an XID code by NVIDIA's catalog.
pub fn xid_class(code: u64) -> XidClass {
    use XidClass::*;
    match code {
        14 | 37 | 38 | 43 | 44 | 63 | 66 | 67 | 92 | 93 | 106 | 107 | 121 | 137 | 141 | 152
        | 153 | 154 | 157 | 161 => Ignore,
        8
        | 11
        | 13
        | 25
        | 31
        | 32
        | 39..=41
        | 45
        | 60
        | 68..=72
        | 75..=77
        | 80
        | 82..=86
        | 88
        | 89
        | 94
        | 96..=105
        | 126..=135
        | 139
        | 159 => RestartApp,
        46
        | 48
        | 62
        | 64
        | 74
        | 95
        | 109
        | 110
        | 119
        | 120
        | 136
        | 140
        | 143..=150
        | 155
        | 156
        | 158
        | 162 => ResetGpu,
        79 | 151 | 160 => Reboot,
        1..=7
        | 9
        | 10
        | 12
        | 15..=24
        | 26..=30
        | 33..=36
        | 42
        | 47
        | 49..=59
        | 61
        | 65
        | 73
        | 78
        | 81
        | 87
        | 90
        | 91
        | 108
        | 111..=118
        | 122..=125
        | 138
        | 142 => ContactSupport,
        _ => Unknown,
    }
}

/// A SQL expression that evaluates to the class name (`'reset_gpu'`, ...) of the XID in
/// `column`, generated from [`xid_class`] so the two agree by construction.
pub fn xid_class_sql(column: &str) -> String {
    let mut sql = String::from("CASE");
    for class in XidClass::ALL {
        if class == XidClass::Unknown {
            continue;
        }
        let codes: Vec<String> = (0..=MAX_CATALOGUED_XID)
            .filter(|code| xid_class(*code) == class)
            .map(|code| code.to_string())
            .collect();
        // `write!` to a String cannot fail.
        let _ = write!(
            sql,
            " WHEN {column} IN ({}) THEN '{}'",
            codes.join(", "),
            class.as_str()
        );
    }
    let _ = write!(sql, " ELSE '{}' END", XidClass::Unknown.as_str());
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_well_known_codes() {
        for (code, class) in [
            (13, XidClass::RestartApp),
            (31, XidClass::RestartApp),
            (45, XidClass::RestartApp),
            (43, XidClass::Ignore),
            (63, XidClass::Ignore),
            (92, XidClass::Ignore),
            (94, XidClass::RestartApp),
            (48, XidClass::ResetGpu),
            (64, XidClass::ResetGpu),
            (74, XidClass::ResetGpu),
            (95, XidClass::ResetGpu),
            (119, XidClass::ResetGpu),
            (79, XidClass::Reboot),
            (61, XidClass::ContactSupport),
            (0, XidClass::Unknown),
            (163, XidClass::Unknown),
            (u64::MAX, XidClass::Unknown),
        ] {
            assert_eq!(xid_class(code), class, "XID {code}");
        }
    }

    #[test]
    fn every_catalogued_code_has_a_class() {
        for code in 1..=MAX_CATALOGUED_XID {
            assert_ne!(xid_class(code), XidClass::Unknown, "XID {code}");
        }
    }

    /// Evaluates the generated CASE for one code with a minimal interpreter of its own shape,
    /// so the SQL text is checked against `xid_class` for every code.
    #[test]
    fn generated_sql_agrees_with_the_rust_table() {
        let sql = xid_class_sql("xid");
        assert!(sql.starts_with("CASE WHEN xid IN ("), "{sql}");
        assert!(sql.ends_with(" ELSE 'unknown' END"), "{sql}");
        let body = sql
            .trim_start_matches("CASE")
            .trim_end_matches(" ELSE 'unknown' END");
        let arms: Vec<(Vec<u64>, String)> = body
            .split(" WHEN xid IN (")
            .filter(|arm| !arm.trim().is_empty())
            .map(|arm| {
                let (codes, class) = arm.split_once(") THEN '").expect("arm shape");
                let codes = codes
                    .split(", ")
                    .map(|c| c.parse().expect("code"))
                    .collect();
                (codes, class.trim_end_matches('\'').to_string())
            })
            .collect();
        for code in 0..=MAX_CATALOGUED_XID + 5 {
            let from_sql = arms
                .iter()
                .find(|(codes, _)| codes.contains(&code))
                .map_or("unknown", |(_, class)| class.as_str());
            assert_eq!(from_sql, xid_class(code).as_str(), "XID {code}");
        }
    }
}
