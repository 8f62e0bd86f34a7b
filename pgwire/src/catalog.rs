//! The Postgres catalog, as far as Postgres clients ask it: Grafana's PostgreSQL data source
//! (its query builder lists schemas, tables and columns, and reads the server version),
//! psql's `\dt`, `\d`, `\d+ NAME`, `\dv`, `\dn` and `\l`, and what drivers and DBeaver ask
//! on connecting (`version()`, `current_database()`, `SHOW ...`).
//!
//! DataFusion has none of Postgres's catalog functions or `pg_catalog` tables, but it has
//! `information_schema`. So a statement is parsed (Postgres dialect) and rewritten before it
//! reaches [`perch_query::SqlEngine`]: catalog functions become constants or plain
//! expressions, `pg_catalog` tables become subqueries over `information_schema` (see
//! [`tables`]), the column types in `information_schema.columns` become the Postgres types
//! perch sends them as, and Grafana's search-path subquery (which needs `generate_series`
//! over an array, `s[i]` and `user`) becomes the one schema perch has, `public`. Postgres's
//! own syntax becomes DataFusion's: `OPERATOR(pg_catalog.~)`, `COLLATE`, casts to `oid`,
//! `regclass` or `pg_catalog.text`, `ARRAY(SELECT ...)`, `pg_catalog.unnest(a) x`.
//!
//! A `SELECT` that needs a row of a catalog table perch has none in (indexes, constraints,
//! policies, publications...; see [`tables::is_empty`]) has no rows, so it is answered as its
//! column names over no rows, whatever Postgres-only expressions it computes: psql's
//! describe commands ask a dozen such questions of every table. The rewritten statement still
//! goes through the engine's read-only check. A statement that needs none of this is sent on
//! exactly as the client wrote it.

mod dialect;
mod no_rows;
mod tables;

use datafusion::sql::sqlparser::ast::{
    BinaryOperator, Expr, FunctionArg, FunctionArgExpr, FunctionArguments, GroupByExpr, Ident,
    ObjectName, Query, Select, SelectItem, Statement, TableAlias, TableAliasColumnDef, TableFactor,
    Value, Visit, VisitMut, Visitor, VisitorMut,
};
use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
use datafusion::sql::sqlparser::parser::Parser;
use std::collections::HashMap;
use std::ops::ControlFlow;
use tables::{ORDINAL_POSITION, PG_DATA_TYPE, catalog_table};

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

/// Whether `select` has a `GROUP BY`.
fn grouped(select: &Select) -> bool {
    !matches!(&select.group_by, GroupByExpr::Expressions(g, _) if g.is_empty())
}

/// The catalog table a name in a `FROM` stands for: `pg_catalog.t`, or `pg_t` unqualified.
fn catalog_name(parts: &[String]) -> Option<&str> {
    match parts {
        [schema, t] if schema == "pg_catalog" => Some(t),
        [t] if t.starts_with("pg_") => Some(t),
        _ => None,
    }
}

fn ident_name(i: &Ident) -> String {
    if i.quote_style.is_some() {
        i.value.clone()
    } else {
        i.value.to_ascii_lowercase()
    }
}

/// A read-only visit of a statement. sqlparser's walk over the syntax tree is compiled once
/// for each visitor type, a few hundred thousand lines of LLVM IR each time, so the read-only
/// visitors share one type, [`Reads`], and differ behind a trait object.
trait ReadVisitor {
    fn pre_visit_query(&mut self, _: &Query) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }

    fn post_visit_query(&mut self, _: &Query) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, _: &TableFactor) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }

    fn pre_visit_expr(&mut self, _: &Expr) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
}

struct Reads<'a>(&'a mut dyn ReadVisitor);

impl Visitor for Reads<'_> {
    type Break = ();

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        self.0.pre_visit_query(query)
    }

    fn post_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        self.0.post_visit_query(query)
    }

    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<()> {
        self.0.pre_visit_table_factor(factor)
    }

    fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<()> {
        self.0.pre_visit_expr(expr)
    }
}

/// Visits `node` with `visitor`, read-only.
fn visit_read<T: Visit + ?Sized>(node: &T, visitor: &mut dyn ReadVisitor) -> ControlFlow<()> {
    node.visit(&mut Reads(visitor))
}

/// What each table alias (or unaliased table name) in a statement stands for: a catalog
/// table's name, or `None` for anything else and for a name given to different tables.
#[derive(Default)]
struct Aliases(HashMap<String, Option<String>>);

impl ReadVisitor for Aliases {
    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<()> {
        let (alias, table) = match factor {
            TableFactor::Table {
                name,
                alias,
                args: None,
                ..
            } => {
                let parts = parts(name);
                let alias = alias
                    .as_ref()
                    .map(|a| ident_name(&a.name))
                    .or_else(|| parts.last().cloned());
                (alias, catalog_name(&parts).map(str::to_owned))
            }
            TableFactor::Table { alias, .. }
            | TableFactor::Derived { alias, .. }
            | TableFactor::UNNEST { alias, .. } => {
                (alias.as_ref().map(|a| ident_name(&a.name)), None)
            }
            _ => (None, None),
        };
        if let Some(alias) = alias {
            self.0
                .entry(alias)
                .and_modify(|seen| {
                    if *seen != table {
                        *seen = None;
                    }
                })
                .or_insert(table);
        }
        ControlFlow::Continue(())
    }
}

struct Rewriter<'a> {
    session: &'a Session,
    aliases: Aliases,
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
            ("format_type", [oid, _]) => parse_expr(&tables::format_type(&oid.to_string()))?,
            ("pg_get_viewdef", [oid] | [oid, _]) => {
                parse_expr(&tables::view_definition(&oid.to_string()))?
            }
            // perch keeps no expressions: no defaults, partition bounds or policies.
            ("pg_get_expr", [_, _] | [_, _, _]) => Expr::value(Value::Null),
            // Nor sizes: a table is Parquet files in the store, not pages.
            (
                "pg_table_size" | "pg_relation_size" | "pg_total_relation_size" | "pg_indexes_size",
                [_] | [_, _],
            ) => parse_expr("CAST(NULL AS BIGINT)")?,
            ("pg_size_pretty", [bytes]) => parse_expr(&dialect::size_pretty(bytes))?,
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

    fn pre_visit_query(&mut self, query: &mut Query) -> ControlFlow<()> {
        if no_rows::empty_body(&mut query.body, &mut self.changed) {
            // Nothing to order, and the order may name columns that are gone.
            query.order_by = None;
        }
        ControlFlow::Continue(())
    }

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
            Expr::Function(f) if parts(&f.name) == ["array"] => match &f.args {
                FunctionArguments::Subquery(query) => dialect::array_of(query),
                _ => None,
            },
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
            Expr::CompoundIdentifier(ids) => match ids.as_slice() {
                [table, column] => self
                    .aliases
                    .0
                    .get(&ident_name(table))
                    .and_then(|t| t.as_deref())
                    .and_then(|t| tables::constant_column(t, &ident_name(column)))
                    .and_then(parse_expr),
                _ => None,
            },
            Expr::Cast { data_type, .. } => {
                if let Some(t) = dialect::datafusion_type(data_type) {
                    *data_type = t;
                    self.changed = true;
                }
                None
            }
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
        let parts = parts(name);
        if args.is_some() {
            // `pg_catalog.unnest(a) x`: DataFusion's `unnest`, and, as in Postgres, `x` names
            // its column as well as the table.
            if parts.len() == 2 && parts[0] == "pg_catalog" {
                name.0.remove(0);
                self.changed = true;
            }
            if parts.last().is_some_and(|n| n == "unnest")
                && let Some(alias) = alias
                && alias.columns.is_empty()
            {
                alias.columns.push(TableAliasColumnDef {
                    name: alias.name.clone(),
                    data_type: None,
                });
                self.changed = true;
            }
            return ControlFlow::Continue(());
        }
        let (table, sql) = match parts.as_slice() {
            [schema, t] if schema == "information_schema" && t == "columns" => (
                t.clone(),
                Some(format!(
                    "SELECT table_catalog, table_schema, table_name, column_name, \
                     {ORDINAL_POSITION} AS ordinal_position, \
                     column_default, is_nullable, {PG_DATA_TYPE} AS data_type, \
                     {} AS udt_name FROM information_schema.columns",
                    tables::udt_name()
                )),
            ),
            _ => match catalog_name(&parts) {
                Some(t) => (t.to_owned(), catalog_table(t)),
                None => return ControlFlow::Continue(()),
            },
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
    let mut aliases = Aliases::default();
    let _ = visit_read(&*statement, &mut aliases);
    let mut rewriter = Rewriter {
        session,
        aliases,
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
    fn answers_psql_describe() {
        let check = |sql: &str, want: &str| {
            let got = rewrite(sql, &session()).unwrap_or_else(|| panic!("{sql} not rewritten"));
            assert!(got.contains(want), "{sql} -> {got}");
        };
        // \d's table question: toast and storage options that perch's tables do not have.
        check(
            "SELECT c.relchecks, pg_catalog.array_to_string(c.reloptions || array(select 'toast.' || x from pg_catalog.unnest(tc.reloptions) x), ', '), \
             CASE WHEN c.reloftype = 0 THEN '' ELSE c.reloftype::pg_catalog.regtype::pg_catalog.text END \
             FROM pg_catalog.pg_class c LEFT JOIN pg_catalog.pg_class tc ON (c.reltoastrelid = tc.oid) WHERE c.oid = '16385'",
            "array_to_string(CAST(NULL AS VARCHAR[]) || coalesce((SELECT array_agg('toast.' || x) \
             FROM UNNEST(CAST(NULL AS VARCHAR[])) x (x)), make_array()), ', '), \
             CASE WHEN c.reloftype = 0 THEN '' ELSE c.reloftype::BIGINT::TEXT END",
        );
        check(
            "SELECT pg_catalog.format_type(a.atttypid, a.atttypmod) FROM pg_catalog.pg_attribute a",
            "WHEN 1184 THEN 'timestamp with time zone'",
        );
        check(
            "SELECT pg_catalog.pg_get_viewdef('16395'::pg_catalog.oid, true)",
            "WHERE c.oid = ('16395'::BIGINT)) AS \"pg_get_viewdef\"",
        );
        // Questions about rows perch has none of are no rows, whatever they compute.
        check(
            "SELECT pol.polname, CASE WHEN pol.polroles = '{0}' THEN NULL ELSE pg_catalog.array_to_string(array(select rolname from pg_catalog.pg_roles where oid = any (pol.polroles) order by 1),',') END \
             FROM pg_catalog.pg_policy pol WHERE pol.polrelid = '16385' ORDER BY 1",
            "SELECT NULL AS \"polname\", NULL AS \"?column?\" WHERE false",
        );
        check(
            "SELECT pubname, NULL, NULL FROM pg_catalog.pg_publication p WHERE p.puballtables \
             UNION SELECT pubname, NULL, NULL FROM pg_catalog.pg_publication p JOIN pg_catalog.pg_publication_rel pr ON p.oid = pr.prpubid \
             ORDER BY 1",
            "SELECT NULL AS \"pubname\", NULL AS \"?column?\", NULL AS \"?column?_3\" WHERE false UNION SELECT",
        );
        check(
            "SELECT a.attname, (SELECT pg_catalog.pg_get_expr(d.adbin, d.adrelid, true) FROM pg_catalog.pg_attrdef d WHERE d.adrelid = a.attrelid AND a.atthasdef) \
             FROM pg_catalog.pg_attribute a",
            "SELECT a.attname, (SELECT NULL AS \"pg_get_expr\" WHERE false) FROM (SELECT",
        );
        check(
            "SELECT c.oid::pg_catalog.regclass FROM pg_catalog.pg_class c, pg_catalog.pg_inherits i WHERE c.oid = i.inhparent ORDER BY inhseqno",
            "SELECT NULL AS \"oid\" WHERE false",
        );
        check(
            "SELECT c.oid::regclass, c.relname::name FROM pg_class c",
            "SELECT c.oid::BIGINT, c.relname::TEXT FROM (SELECT",
        );
        // An outer join keeps its rows; an aggregate has one row even over none.
        check(
            "SELECT c.relname FROM pg_class c LEFT JOIN pg_inherits i ON i.inhrelid = c.oid",
            "LEFT JOIN pg_inherits i ON i.inhrelid = c.oid",
        );
        assert_eq!(
            rewrite("SELECT count(*) FROM pg_catalog.pg_policy", &session()),
            None
        );
        // Only pg_class's reloptions is a constant, not a column of the same name elsewhere.
        check(
            "SELECT c.reloptions FROM pg_class c UNION ALL SELECT c.reloptions FROM jobs c",
            "SELECT c.reloptions FROM jobs c",
        );
        check(
            "SELECT pg_size_pretty(pg_table_size(c.oid)) FROM pg_class c",
            "CAST((CAST(NULL AS BIGINT)) AS BIGINT) AS VARCHAR) || ' bytes'",
        );
    }

    #[test]
    fn parses_identifiers_like_postgres() {
        assert_eq!(parse_ident("Public.Gpu"), ["public", "gpu"]);
        assert_eq!(parse_ident("\"a.b\".\"C\"\"d\""), ["a.b", "C\"d"]);
        assert_eq!(parse_ident("t"), ["t"]);
    }
}
