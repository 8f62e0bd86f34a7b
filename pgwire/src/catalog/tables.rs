//! `pg_catalog` as perch fills it: the Postgres types perch sends columns as, and the catalog
//! tables clients read, each one a query over `information_schema` or a few constant rows.
//!
//! perch has tables and views and nothing else Postgres keeps in its catalog: no defaults,
//! constraints, indexes, inheritance, rules, triggers, row security policies, statistics
//! objects, publications or comments, and no collations (text compares by bytes, as `C`
//! does, and `typcollation` is 0). Those tables are [`is_empty`]; a query that needs a row
//! of one has none (see `no_rows`), so perch spells out the columns of only the one a client
//! outer-joins (`pg_index`).

/// A Postgres type perch sends columns as (see `pg::pg_type`), as `pg_type` describes it.
struct PgType {
    oid: u32,
    /// Postgres's internal name (`udt_name` in `information_schema.columns`).
    typname: &'static str,
    /// The SQL name, as `format_type()` and `information_schema.columns.data_type` give it.
    name: &'static str,
    /// `typlen`: bytes, -1 for a variable length.
    len: i16,
    /// `typstorage`: `p` plain or `x` extended (psql's `\d+` shows it as Storage).
    storage: char,
}

const PG_TYPES: &[PgType] = &[
    PgType {
        oid: 16,
        typname: "bool",
        name: "boolean",
        len: 1,
        storage: 'p',
    },
    PgType {
        oid: 20,
        typname: "int8",
        name: "bigint",
        len: 8,
        storage: 'p',
    },
    PgType {
        oid: 25,
        typname: "text",
        name: "text",
        len: -1,
        storage: 'x',
    },
    PgType {
        oid: 701,
        typname: "float8",
        name: "double precision",
        len: 8,
        storage: 'p',
    },
    PgType {
        oid: 1114,
        typname: "timestamp",
        name: "timestamp without time zone",
        len: 8,
        storage: 'p',
    },
    PgType {
        oid: 1184,
        typname: "timestamptz",
        name: "timestamp with time zone",
        len: 8,
        storage: 'p',
    },
];

/// Postgres's type name for an Arrow type as `information_schema.columns` spells it (its
/// `data_type`), matching the wire types in `pg::pg_type`. Every name is one of [`PG_TYPES`].
pub const PG_DATA_TYPE: &str = "CASE \
     WHEN data_type LIKE 'Timestamp(%' AND data_type LIKE '%UTC%' THEN 'timestamp with time zone' \
     WHEN data_type LIKE 'Timestamp(%' THEN 'timestamp without time zone' \
     WHEN data_type LIKE 'Float%' THEN 'double precision' \
     WHEN data_type LIKE 'Int%' OR data_type LIKE 'UInt%' THEN 'bigint' \
     WHEN data_type = 'Boolean' THEN 'boolean' \
     ELSE 'text' END";

/// `CASE <expr> WHEN <key of each type> THEN <value of it> ... ELSE NULL END`.
fn type_case(
    expr: &str,
    key: impl Fn(&PgType) -> String,
    value: impl Fn(&PgType) -> String,
) -> String {
    let arms: String = PG_TYPES
        .iter()
        .map(|t| format!("WHEN {} THEN {} ", key(t), value(t)))
        .collect();
    format!("CASE {expr} {arms}ELSE NULL END")
}

/// Postgres's internal type name (`udt_name`) for a column: what Grafana 9 and older match on.
pub fn udt_name() -> String {
    type_case(
        &format!("({PG_DATA_TYPE})"),
        |t| format!("'{}'", t.name),
        |t| format!("'{}'", t.typname),
    )
}

/// `format_type(oid, typmod)`: the SQL name of the type `oid`, `???` for one perch does not
/// have, as Postgres answers. perch's types take no modifier.
pub fn format_type(oid: &str) -> String {
    let known = type_case(
        &format!("({oid})"),
        |t| t.oid.to_string(),
        |t| format!("'{}'", t.name),
    );
    format!(
        "CASE WHEN ({oid}) IS NULL THEN CAST(NULL AS VARCHAR) ELSE coalesce({known}, '???') END"
    )
}

/// `pg_type`'s rows, plus `name` (the SQL name) to join columns on.
fn types() -> String {
    let rows: Vec<String> = PG_TYPES
        .iter()
        .map(|t| {
            format!(
                "({}, '{}', '{}', {}, '{}')",
                t.oid, t.typname, t.name, t.len, t.storage
            )
        })
        .collect();
    format!(
        "SELECT CAST(oid AS BIGINT) AS oid, typname, name, CAST(typlen AS BIGINT) AS typlen, \
         typstorage, CAST(0 AS BIGINT) AS typcollation \
         FROM (VALUES {}) AS t(oid, typname, name, typlen, typstorage)",
        rows.join(", ")
    )
}

/// A column's position from 1, as Postgres counts (DataFusion's `ordinal_position` counts
/// from 0).
pub const ORDINAL_POSITION: &str = "CAST(ordinal_position + 1 AS BIGINT)";

/// Namespace OIDs as Postgres numbers them (`public` is 2200 everywhere).
const NAMESPACE_OID: &str = "CASE table_schema WHEN 'public' THEN 2200 \
     WHEN 'information_schema' THEN 13000 ELSE 11 END";

/// `pg_class.reloptions`: perch's tables have no storage options.
const NO_OPTIONS: &str = "CAST(NULL AS VARCHAR[])";

/// The value of a catalog column that is the same in every row, so a reference to it can be
/// the value itself: DataFusion cannot correlate a subquery on it (psql's `\d+` unnests
/// `reloptions` of a joined row).
pub fn constant_column(table: &str, column: &str) -> Option<&'static str> {
    match (table, column) {
        ("pg_class", "reloptions") => Some(NO_OPTIONS),
        _ => None,
    }
}

/// Catalog tables perch has no rows in (see the module docs).
pub fn is_empty(table: &str) -> bool {
    matches!(
        table,
        "pg_attrdef"
            | "pg_collation"
            | "pg_constraint"
            | "pg_description"
            | "pg_index"
            | "pg_inherits"
            | "pg_policy"
            | "pg_publication"
            | "pg_publication_namespace"
            | "pg_publication_rel"
            | "pg_rewrite"
            | "pg_statistic_ext"
            | "pg_trigger"
    )
}

/// The tables `SHOW TABLES` lists: not the rollups' stored partial rows (`<rollup>_partial`,
/// still readable by name), so psql's `\d` and `\dt` list what `SHOW TABLES` does.
const LISTED: &str = "NOT (table_schema = 'public' AND ends_with(table_name, '_partial'))";

/// `pg_class`: every table and view `SHOW TABLES` lists, numbered within one statement
/// (tables in name order), which is all a join between catalog tables needs. `nspname` is
/// perch's own, to join on.
fn pg_class() -> String {
    format!(
        "SELECT CAST(16384 + row_number() OVER (ORDER BY table_schema, table_name) AS BIGINT) AS oid, \
         table_name AS relname, CAST({NAMESPACE_OID} AS BIGINT) AS relnamespace, \
         CASE table_type WHEN 'VIEW' THEN 'v' ELSE 'r' END AS relkind, \
         CAST(10 AS BIGINT) AS relowner, \
         CAST(CASE table_type WHEN 'VIEW' THEN 0 ELSE 2 END AS BIGINT) AS relam, \
         CAST(0 AS BIGINT) AS reltype, CAST(0 AS BIGINT) AS reloftype, \
         CAST(0 AS BIGINT) AS reltablespace, CAST(0 AS BIGINT) AS reltoastrelid, \
         CAST(0 AS BIGINT) AS reltuples, CAST(0 AS BIGINT) AS relchecks, \
         false AS relhasindex, false AS relispartition, false AS relhasrules, \
         false AS relhastriggers, false AS relrowsecurity, false AS relforcerowsecurity, \
         'p' AS relpersistence, CASE table_type WHEN 'VIEW' THEN 'n' ELSE 'd' END AS relreplident, \
         {NO_OPTIONS} AS reloptions, CAST(NULL AS VARCHAR) AS relpartbound, \
         table_schema AS nspname \
         FROM information_schema.tables WHERE {LISTED}"
    )
}

/// `pg_get_viewdef(oid)`: the view's SQL as perch defines it.
pub fn view_definition(oid: &str) -> String {
    format!(
        "(SELECT v.definition FROM information_schema.views v \
         JOIN ({}) c ON c.relname = v.table_name AND c.nspname = v.table_schema \
         WHERE c.oid = ({oid}))",
        pg_class()
    )
}

/// The settings a client may read with `SHOW` or `current_setting()`, as `pg_settings` rows.
fn pg_settings() -> String {
    let rows: Vec<String> = super::SETTINGS
        .iter()
        .map(|(n, v)| format!("('{n}', '{v}')"))
        .collect();
    format!(
        "SELECT name, setting FROM (VALUES {}) AS s(name, setting)",
        rows.join(", ")
    )
}

/// The `pg_catalog` table `name` as a query, if perch has it.
pub fn catalog_table(name: &str) -> Option<String> {
    Some(match name {
        "pg_namespace" => "SELECT CAST(2200 AS BIGINT) AS oid, 'public' AS nspname, CAST(10 AS BIGINT) AS nspowner \
             UNION ALL SELECT CAST(11 AS BIGINT), 'pg_catalog', CAST(10 AS BIGINT) \
             UNION ALL SELECT CAST(13000 AS BIGINT), 'information_schema', CAST(10 AS BIGINT)"
            .to_owned(),
        "pg_class" => pg_class(),
        "pg_tables" => format!(
            "SELECT table_schema AS schemaname, table_name AS tablename, 'perch' AS tableowner, \
             false AS hasindexes FROM information_schema.tables \
             WHERE table_type = 'BASE TABLE' AND {LISTED}"
        ),
        "pg_attribute" => format!(
            "SELECT c.oid AS attrelid, col.column_name AS attname, t.oid AS atttypid, \
             col.attnum, col.is_nullable = 'NO' AS attnotnull, \
             false AS attisdropped, CAST(-1 AS BIGINT) AS atttypmod, t.typlen AS attlen, \
             CAST(0 AS BIGINT) AS attndims, false AS atthasdef, false AS atthasmissing, \
             '' AS attidentity, '' AS attgenerated, t.typstorage AS attstorage, \
             '' AS attcompression, CAST(-1 AS BIGINT) AS attstattarget, \
             t.typcollation AS attcollation, true AS attislocal, CAST(0 AS BIGINT) AS attinhcount \
             FROM (SELECT table_schema, table_name, column_name, is_nullable, {ORDINAL_POSITION} AS attnum, \
                   {PG_DATA_TYPE} AS type_name FROM information_schema.columns) col \
             JOIN ({}) c ON c.relname = col.table_name AND c.nspname = col.table_schema \
             JOIN ({}) t ON t.name = col.type_name",
            pg_class(),
            types()
        ),
        "pg_type" => format!(
            "SELECT oid, typname, CAST(11 AS BIGINT) AS typnamespace, typlen, 'b' AS typtype, \
             typstorage, typcollation FROM ({})",
            types()
        ),
        "pg_database" => "SELECT CAST(16383 AS BIGINT) AS oid, 'perch' AS datname, \
             CAST(10 AS BIGINT) AS datdba, CAST(6 AS BIGINT) AS encoding, 'C' AS datcollate, \
             'C' AS datctype, CAST(NULL AS VARCHAR) AS daticulocale, 'c' AS datlocprovider, \
             make_array('=Tc/perch') AS datacl, false AS datistemplate, true AS datallowconn"
            .to_owned(),
        "pg_am" => "SELECT CAST(2 AS BIGINT) AS oid, 'heap' AS amname, 't' AS amtype".to_owned(),
        "pg_extension" => "SELECT CAST(NULL AS BIGINT) AS oid, CAST(NULL AS VARCHAR) AS extname, \
             CAST(NULL AS VARCHAR) AS extversion WHERE false"
            .to_owned(),
        // Empty, but psql's `\di` joins it to pg_class rather than needing a row of it.
        "pg_index" => "SELECT CAST(NULL AS BIGINT) AS indexrelid, CAST(NULL AS BIGINT) AS indrelid, \
             CAST(NULL AS BOOLEAN) AS indisunique, CAST(NULL AS BOOLEAN) AS indisprimary, \
             CAST(NULL AS BOOLEAN) AS indisvalid WHERE false"
            .to_owned(),
        "pg_settings" => pg_settings(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::PG_TYPES;
    use arrow::datatypes::{DataType, TimeUnit};

    #[test]
    fn every_wire_type_is_in_pg_type() {
        for data_type in [
            DataType::Boolean,
            DataType::Int32,
            DataType::UInt64,
            DataType::Float32,
            DataType::Float64,
            DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
            DataType::Timestamp(TimeUnit::Microsecond, None),
            DataType::Utf8,
            DataType::Utf8View,
            DataType::Decimal128(10, 2),
        ] {
            let wire = crate::pg_type(&data_type);
            assert!(
                PG_TYPES
                    .iter()
                    .any(|t| t.oid == wire.oid() && t.typname == wire.name()),
                "{data_type} is sent as {wire}, which pg_type lacks"
            );
        }
    }
}
