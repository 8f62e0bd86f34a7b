//! The Postgres catalog, as far as Postgres clients ask it: Grafana's PostgreSQL data source
//! (its query builder lists schemas, tables and columns, and reads the server version),
//! psql's `\dt`, and what drivers and DBeaver ask on connecting (`version()`,
//! `current_database()`, `SHOW ...`).
//!
//! DataFusion has none of Postgres's catalog functions or `pg_catalog` tables, but it has
//! `information_schema`. So a statement is parsed (Postgres dialect) and rewritten before it
//! reaches [`perch_query::SqlEngine`]: catalog functions become constants or plain
//! expressions, `pg_catalog` tables become subqueries over `information_schema`, the column
//! types in `information_schema.columns` become the Postgres types perch sends them as, and
//! Grafana's search-path subquery (which needs `generate_series` over an array, `s[i]` and
//! `user`) becomes the one schema perch has, `public`. The rewritten statement still goes
//! through the engine's read-only check. A statement that needs none of this is sent on
//! exactly as the client wrote it.

use datafusion::sql::sqlparser::ast::{
    BinaryOperator, Expr, FunctionArg, FunctionArgExpr, FunctionArguments, Ident, ObjectName,
    Query, Select, SelectItem, Statement, TableAlias, TableFactor, Value, VisitMut, VisitorMut,
};
use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
use datafusion::sql::sqlparser::parser::Parser;
use std::ops::ControlFlow;

/// The version perch reports to Postgres clients: the protocol and catalog it imitates.
pub const SERVER_VERSION: &str = "16.6";

/// Who asks, for `current_user` and `current_database()`.
#[derive(Debug, Clone)]
pub struct Session {
    pub user: String,
    pub database: String,
}

/// Settings a client may read with `SHOW` or `current_setting()`, lower-case names.
const SETTINGS: &[(&str, &str)] = &[
    ("server_version", SERVER_VERSION),
    ("server_version_num", "160006"),
    ("search_path", "public"),
    ("server_encoding", "UTF8"),
    ("client_encoding", "UTF8"),
    ("datestyle", "ISO, YMD"),
    ("intervalstyle", "postgres"),
    ("timezone", "Etc/UTC"),
    ("integer_datetimes", "on"),
    ("standard_conforming_strings", "on"),
    ("transaction_isolation", "read committed"),
    ("default_transaction_isolation", "read committed"),
    ("transaction_read_only", "on"),
    ("default_transaction_read_only", "on"),
    ("is_superuser", "off"),
    ("max_identifier_length", "63"),
    ("lc_collate", "C"),
    ("lc_ctype", "C"),
    ("statement_timeout", "0"),
];

fn setting(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase();
    SETTINGS.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}

/// Postgres's type name for an Arrow type as `information_schema.columns` spells it, matching
/// the wire types in `pg::pg_type`.
const PG_DATA_TYPE: &str = "CASE \
     WHEN data_type LIKE 'Timestamp(%' AND data_type LIKE '%UTC%' THEN 'timestamp with time zone' \
     WHEN data_type LIKE 'Timestamp(%' THEN 'timestamp without time zone' \
     WHEN data_type LIKE 'Float%' THEN 'double precision' \
     WHEN data_type LIKE 'Int%' OR data_type LIKE 'UInt%' THEN 'bigint' \
     WHEN data_type = 'Boolean' THEN 'boolean' \
     ELSE 'text' END";

/// Postgres's internal type name (`udt_name`) for the same: what Grafana 9 and older match on.
const PG_UDT_NAME: &str = "CASE \
     WHEN data_type LIKE 'Timestamp(%' AND data_type LIKE '%UTC%' THEN 'timestamptz' \
     WHEN data_type LIKE 'Timestamp(%' THEN 'timestamp' \
     WHEN data_type LIKE 'Float%' THEN 'float8' \
     WHEN data_type LIKE 'Int%' OR data_type LIKE 'UInt%' THEN 'int8' \
     WHEN data_type = 'Boolean' THEN 'bool' \
     ELSE 'text' END";

/// Namespace OIDs as Postgres numbers them (`public` is 2200 everywhere).
const NAMESPACE_OID: &str = "CASE table_schema WHEN 'public' THEN 2200 \
     WHEN 'information_schema' THEN 13000 ELSE 11 END";

/// `pg_catalog` tables as subqueries over `information_schema`. OIDs are numbered within one
/// statement (tables in name order), which is all a join between them needs.
fn catalog_table(name: &str) -> Option<String> {
    let pg_class = format!(
        "SELECT CAST(16384 + row_number() OVER (ORDER BY table_schema, table_name) AS BIGINT) AS oid, \
         table_name AS relname, CAST({NAMESPACE_OID} AS BIGINT) AS relnamespace, \
         CASE table_type WHEN 'VIEW' THEN 'v' ELSE 'r' END AS relkind, \
         CAST(10 AS BIGINT) AS relowner, CAST(2 AS BIGINT) AS relam, \
         CAST(0 AS BIGINT) AS reltuples, false AS relhasindex, false AS relispartition, \
         table_schema AS nspname \
         FROM information_schema.tables"
    );
    Some(match name {
        "pg_namespace" => "SELECT CAST(2200 AS BIGINT) AS oid, 'public' AS nspname, CAST(10 AS BIGINT) AS nspowner \
             UNION ALL SELECT CAST(11 AS BIGINT), 'pg_catalog', CAST(10 AS BIGINT) \
             UNION ALL SELECT CAST(13000 AS BIGINT), 'information_schema', CAST(10 AS BIGINT)"
            .to_owned(),
        "pg_class" => pg_class,
        "pg_tables" => "SELECT table_schema AS schemaname, table_name AS tablename, 'perch' AS tableowner, \
             false AS hasindexes FROM information_schema.tables WHERE table_type = 'BASE TABLE'"
            .to_owned(),
        "pg_attribute" => format!(
            "SELECT c.oid AS attrelid, col.column_name AS attname, \
             CAST(CASE {PG_DATA_TYPE} WHEN 'boolean' THEN 16 WHEN 'bigint' THEN 20 \
                  WHEN 'double precision' THEN 701 WHEN 'timestamp without time zone' THEN 1114 \
                  WHEN 'timestamp with time zone' THEN 1184 ELSE 25 END AS BIGINT) AS atttypid, \
             CAST(col.ordinal_position AS BIGINT) AS attnum, col.is_nullable = 'NO' AS attnotnull, \
             false AS attisdropped, CAST(-1 AS BIGINT) AS atttypmod \
             FROM information_schema.columns col \
             JOIN ({pg_class}) c ON c.relname = col.table_name AND c.nspname = col.table_schema"
        ),
        "pg_type" => "SELECT CAST(oid AS BIGINT) AS oid, typname, CAST(11 AS BIGINT) AS typnamespace \
             FROM (VALUES (16, 'bool'), (20, 'int8'), (25, 'text'), (701, 'float8'), \
             (1114, 'timestamp'), (1184, 'timestamptz')) AS t(oid, typname)"
            .to_owned(),
        "pg_database" => "SELECT CAST(16383 AS BIGINT) AS oid, 'perch' AS datname, \
             CAST(10 AS BIGINT) AS datdba, CAST(6 AS BIGINT) AS encoding, 'C' AS datcollate, \
             'C' AS datctype, CAST(NULL AS VARCHAR) AS daticulocale, 'c' AS datlocprovider, \
             make_array('=Tc/perch') AS datacl, false AS datistemplate, true AS datallowconn"
            .to_owned(),
        "pg_am" => "SELECT CAST(2 AS BIGINT) AS oid, 'heap' AS amname, 't' AS amtype".to_owned(),
        "pg_extension" => "SELECT CAST(NULL AS BIGINT) AS oid, CAST(NULL AS VARCHAR) AS extname, \
             CAST(NULL AS VARCHAR) AS extversion WHERE false"
            .to_owned(),
        "pg_settings" => {
            let rows: Vec<String> = SETTINGS
                .iter()
                .map(|(n, v)| format!("('{n}', '{v}')"))
                .collect();
            format!(
                "SELECT name, setting FROM (VALUES {}) AS s(name, setting)",
                rows.join(", ")
            )
        }
        _ => return None,
    })
}

fn parse_query(sql: &str) -> Option<Box<Query>> {
    match Parser::parse_sql(&PostgreSqlDialect {}, sql).ok()?.pop()? {
        Statement::Query(q) => Some(q),
        _ => None,
    }
}

fn parse_expr(sql: &str) -> Option<Expr> {
    Parser::new(&PostgreSqlDialect {})
        .try_with_sql(sql)
        .ok()?
        .parse_expr()
        .ok()
}

fn text(s: &str) -> Expr {
    Expr::value(Value::SingleQuotedString(s.to_owned()))
}

/// The name's parts, lower-cased unless quoted.
fn parts(name: &ObjectName) -> Vec<String> {
    name.0
        .iter()
        .filter_map(|p| p.as_ident())
        .map(|i| {
            if i.quote_style.is_some() {
                i.value.clone()
            } else {
                i.value.to_ascii_lowercase()
            }
        })
        .collect()
}

/// A function's unnamed arguments, when it has a plain argument list.
fn args(args: &FunctionArguments) -> Option<Vec<&Expr>> {
    match args {
        FunctionArguments::None => Some(Vec::new()),
        FunctionArguments::List(list) => list
            .args
            .iter()
            .map(|a| match a {
                FunctionArg::Unnamed(FunctionArgExpr::Expr(e)) => Some(e),
                _ => None,
            })
            .collect(),
        FunctionArguments::Subquery(_) => None,
    }
}

fn string_literal(e: &Expr) -> Option<&str> {
    match e {
        Expr::Value(v) => match &v.value {
            Value::SingleQuotedString(s) => Some(s),
            _ => None,
        },
        _ => None,
    }
}

/// Postgres's `parse_ident`: `a."B".c` into `a`, `B`, `c`.
fn parse_ident(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = s.trim().chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            '.' if !quoted => out.push(std::mem::take(&mut cur)),
            c if quoted => cur.push(c),
            c => cur.push(c.to_ascii_lowercase()),
        }
    }
    out.push(cur);
    out
}

/// `current_schema`, `current_user` and `session_user` written without parentheses.
fn bare_function(i: &Ident) -> Option<String> {
    let name = i.value.to_ascii_lowercase();
    let known = matches!(
        name.as_str(),
        "current_schema" | "current_user" | "session_user"
    );
    (i.quote_style.is_none() && known).then_some(name)
}

struct Rewriter<'a> {
    session: &'a Session,
    changed: bool,
}

impl Rewriter<'_> {
    /// The replacement for a call of `name` with `args`, if perch answers it itself.
    fn function(&self, name: &[String], args: &[&Expr]) -> Option<Expr> {
        let name = match name {
            [n] => n.as_str(),
            [schema, n] if schema == "pg_catalog" => n.as_str(),
            _ => return None,
        };
        Some(match (name, args) {
            ("version", []) => text(&format!(
                "PostgreSQL {SERVER_VERSION} (perch {}, Apache DataFusion; read-only)",
                env!("CARGO_PKG_VERSION")
            )),
            ("current_database", []) => text(&self.session.database),
            ("current_schema", []) => text("public"),
            ("current_schemas", [_]) => parse_expr("make_array('public')")?,
            ("current_user" | "session_user" | "user" | "current_role", []) => {
                text(&self.session.user)
            }
            ("current_setting", [arg, ..]) => text(setting(string_literal(arg)?)?),
            ("quote_ident", [arg]) => (*arg).clone(),
            ("quote_literal", [arg]) => parse_expr(&format!(
                "'''' || replace(CAST(({arg}) AS VARCHAR), '''', '''''') || ''''"
            ))?,
            ("pg_get_userbyid", [_]) => text("perch"),
            ("pg_encoding_to_char", [_]) => text("UTF8"),
            ("pg_table_is_visible" | "pg_type_is_visible" | "has_table_privilege", _) => {
                Expr::value(Value::Boolean(true))
            }
            ("obj_description" | "col_description" | "shobj_description", _) => {
                Expr::value(Value::Null)
            }
            ("parse_ident", [arg]) => {
                let list: Vec<String> = parse_ident(string_literal(arg)?)
                    .iter()
                    .map(|p| format!("'{}'", p.replace('\'', "''")))
                    .collect();
                parse_expr(&format!("make_array({})", list.join(", ")))?
            }
            _ => return None,
        })
    }
}

impl Rewriter<'_> {
    /// The name Postgres gives the column of an unaliased select item that perch answers
    /// itself (`SELECT version()` has a column `version`), so the constant keeps it.
    fn column_name(&self, expr: &Expr) -> Option<String> {
        let name = match expr {
            Expr::Function(f) => {
                let name = parts(&f.name);
                let a = args(&f.args)?;
                self.function(&name, &a)?;
                name.last()?.clone()
            }
            Expr::Identifier(i) => bare_function(i)?,
            _ => return None,
        };
        Some(name)
    }
}

impl VisitorMut for Rewriter<'_> {
    type Break = ();

    fn pre_visit_select(&mut self, select: &mut Select) -> ControlFlow<()> {
        for item in &mut select.projection {
            if let SelectItem::UnnamedExpr(expr) = item
                && let Some(name) = self.column_name(expr)
            {
                *item = SelectItem::ExprWithAlias {
                    expr: expr.clone(),
                    alias: Ident::with_quote('"', name),
                };
            }
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_expr(&mut self, expr: &mut Expr) -> ControlFlow<()> {
        // Grafana's "schemas on the search path" subquery: the search path is `public`.
        if let Expr::InSubquery {
            expr: inner,
            subquery,
            negated,
        } = expr
            && subquery.to_string().contains("search_path")
        {
            *expr = Expr::InList {
                expr: inner.clone(),
                list: vec![text("public")],
                negated: *negated,
            };
            self.changed = true;
        }
        ControlFlow::Continue(())
    }

    fn post_visit_expr(&mut self, expr: &mut Expr) -> ControlFlow<()> {
        let replacement = match expr {
            Expr::Function(f) => {
                let name = parts(&f.name);
                let answer = args(&f.args).and_then(|a| self.function(&name, &a));
                // Any other `pg_catalog.f(...)` may be DataFusion's `f` (array_to_string...).
                if answer.is_none() && name.len() == 2 && name[0] == "pg_catalog" {
                    f.name.0.remove(0);
                    self.changed = true;
                }
                answer
            }
            Expr::Identifier(i) => bare_function(i).and_then(|n| self.function(&[n], &[])),
            // psql pins its patterns to the default collation, the only one perch has.
            Expr::Collate { expr: inner, .. } => Some((**inner).clone()),
            // `OPERATOR(pg_catalog.~)` (psql's pattern match) is the plain operator.
            Expr::BinaryOp {
                op: BinaryOperator::PGCustomBinaryOperator(path),
                ..
            } if matches!(path.first().map(String::as_str), Some("pg_catalog")) => {
                let op = match path.get(1).map(String::as_str) {
                    Some("~") => BinaryOperator::PGRegexMatch,
                    Some("~*") => BinaryOperator::PGRegexIMatch,
                    Some("!~") => BinaryOperator::PGRegexNotMatch,
                    Some("!~*") => BinaryOperator::PGRegexNotIMatch,
                    Some("=") => BinaryOperator::Eq,
                    _ => return ControlFlow::Continue(()),
                };
                if let Expr::BinaryOp { op: old, .. } = expr {
                    *old = op;
                }
                self.changed = true;
                None
            }
            _ => None,
        };
        if let Some(r) = replacement {
            *expr = r;
            self.changed = true;
        }
        ControlFlow::Continue(())
    }

    fn post_visit_table_factor(&mut self, factor: &mut TableFactor) -> ControlFlow<()> {
        let TableFactor::Table {
            name, alias, args, ..
        } = factor
        else {
            return ControlFlow::Continue(());
        };
        if args.is_some() {
            return ControlFlow::Continue(());
        }
        let parts = parts(name);
        let (table, sql) = match parts.as_slice() {
            [schema, t] if schema == "pg_catalog" => (t.clone(), catalog_table(t)),
            [t] if t.starts_with("pg_") => (t.clone(), catalog_table(t)),
            [schema, t] if schema == "information_schema" && t == "columns" => (
                t.clone(),
                Some(format!(
                    "SELECT table_catalog, table_schema, table_name, column_name, ordinal_position, \
                     column_default, is_nullable, {PG_DATA_TYPE} AS data_type, \
                     {PG_UDT_NAME} AS udt_name FROM information_schema.columns"
                )),
            ),
            _ => return ControlFlow::Continue(()),
        };
        if let Some(subquery) = sql.as_deref().and_then(parse_query) {
            let alias = alias.clone().unwrap_or(TableAlias {
                explicit: true,
                name: Ident::new(table),
                columns: Vec::new(),
                at: None,
            });
            *factor = TableFactor::Derived {
                lateral: false,
                subquery,
                alias: Some(alias),
                sample: None,
            };
            self.changed = true;
        }
        ControlFlow::Continue(())
    }
}

/// `SHOW name` (or `SHOW ALL`) answered from [`SETTINGS`], as a query.
fn show(variable: &[Ident]) -> Option<String> {
    let words: Vec<String> = variable
        .iter()
        .map(|i| i.value.to_ascii_lowercase())
        .collect();
    if words == ["all"] {
        return catalog_table("pg_settings");
    }
    let name = match words.as_slice() {
        [t, i, l] if t == "transaction" && i == "isolation" && l == "level" => {
            "transaction_isolation".to_owned()
        }
        [one] => one.clone(),
        _ => return None,
    };
    let value = setting(&name)?;
    Some(format!("SELECT '{value}' AS {name}"))
}

/// `sql` rewritten so DataFusion can answer its catalog questions (see the module docs), or
/// `None` when it asks none and runs as sent. A statement that does not parse as Postgres SQL
/// is left to the engine, whose error names the problem.
pub fn rewrite(sql: &str, session: &Session) -> Option<String> {
    let mut statements = Parser::parse_sql(&PostgreSqlDialect {}, sql).ok()?;
    let [statement] = statements.as_mut_slice() else {
        return None;
    };
    if let Statement::ShowVariable { variable } = statement {
        return show(variable);
    }
    let mut rewriter = Rewriter {
        session,
        changed: false,
    };
    let _ = statement.visit(&mut rewriter);
    rewriter.changed.then(|| statement.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> Session {
        Session {
            user: "alice".into(),
            database: "perch".into(),
        }
    }

    #[test]
    fn leaves_plain_queries_alone() {
        for sql in [
            "SELECT count(*) FROM gpu_samples",
            "SELECT table_name FROM information_schema.tables",
            "SELECT node, avg(utilization_gpu_pct) FROM gpu_samples WHERE time > now() - INTERVAL '1 hour' GROUP BY 1",
            "not sql at all",
        ] {
            assert_eq!(rewrite(sql, &session()), None, "{sql}");
        }
    }

    #[test]
    fn answers_functions_and_settings() {
        let check = |sql: &str, want: &str| {
            let got = rewrite(sql, &session()).unwrap_or_else(|| panic!("{sql} not rewritten"));
            assert!(got.contains(want), "{sql} -> {got}");
        };
        check("SELECT version()", "PostgreSQL 16.6 (perch");
        check(
            "SELECT current_database(), current_schema()",
            "'perch' AS \"current_database\", 'public' AS \"current_schema\"",
        );
        check("SELECT current_user", "'alice' AS \"current_user\"");
        check(
            "SELECT current_setting('server_version_num')::int/100 as version",
            "'160006'",
        );
        check("SHOW search_path", "SELECT 'public' AS search_path");
        check(
            "SHOW TRANSACTION ISOLATION LEVEL",
            "'read committed' AS transaction_isolation",
        );
        check("SHOW ALL", "VALUES");
        check(
            "SELECT quote_ident(table_name) FROM information_schema.tables",
            "SELECT table_name AS \"quote_ident\" FROM information_schema.tables",
        );
        check(
            "SELECT array_length(parse_ident('public.\"GPU\"'), 1)",
            "make_array('public', 'GPU')",
        );
        check("SELECT * FROM pg_catalog.pg_namespace n", ") AS n");
        check(
            "SELECT relname FROM pg_class c WHERE c.relname OPERATOR(pg_catalog.~) '^(gpu_samples)$' COLLATE pg_catalog.default",
            "c.relname ~ '^(gpu_samples)$'",
        );
        check(
            "SELECT pg_catalog.array_to_string(ARRAY['a'], ',')",
            "SELECT array_to_string(",
        );
        check(
            "SELECT DISTINCT quote_literal(node) FROM gpu_samples",
            "'''' || replace(CAST((node) AS VARCHAR)",
        );
        check(
            "SELECT udt_name FROM information_schema.columns",
            "THEN 'timestamptz'",
        );
        check("SELECT extversion FROM pg_extension", ") AS pg_extension");
    }

    #[test]
    fn parses_identifiers_like_postgres() {
        assert_eq!(parse_ident("Public.Gpu"), ["public", "gpu"]);
        assert_eq!(parse_ident("\"a.b\".\"C\"\"d\""), ["a.b", "C\"d"]);
        assert_eq!(parse_ident("t"), ["t"]);
    }
}
