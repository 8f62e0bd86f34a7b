//! `SELECT`s that need a row of a catalog table perch has none in (see [`super::tables`]):
//! psql's describe commands ask a dozen of them about every table (its policies, statistics
//! objects, publications, parent tables, rules...). Such a `SELECT` has no rows, so it is
//! answered as its column names over no rows, without planning what it computes: those
//! expressions (`ARRAY(SELECT ...)` over `unnest`, `pg_get_statisticsobjdef_columns`,
//! `polroles = '{0}'`...) are Postgres's alone. An aggregate without `GROUP BY` keeps its one
//! row, so such a `SELECT` is left to the engine.

use super::{
    ReadVisitor, catalog_name, grouped, ident_name, parse_query, parts, tables, visit_read,
};
use datafusion::sql::sqlparser::ast::{
    Expr, Ident, JoinOperator, Query, Select, SelectItem, SetExpr, SetOperator, TableFactor,
    TableWithJoins,
};
use std::ops::ControlFlow;

/// Aggregate functions: a `SELECT` of one without `GROUP BY` has a row even over no rows.
const AGGREGATES: &str = "count sum min max avg array_agg string_agg bool_and bool_or every \
     bit_and bit_or bit_xor json_agg jsonb_agg json_object_agg jsonb_object_agg xmlagg any_value \
     stddev stddev_pop stddev_samp variance var_pop var_samp corr covar_pop covar_samp mode \
     percentile_cont percentile_disc range_agg range_intersect_agg";

/// Finds an aggregate call of the `SELECT` it visits, not of the subqueries within it.
#[derive(Default)]
struct Aggregates {
    depth: usize,
}

impl ReadVisitor for Aggregates {
    fn pre_visit_query(&mut self, _: &Query) -> ControlFlow<()> {
        self.depth += 1;
        ControlFlow::Continue(())
    }

    fn post_visit_query(&mut self, _: &Query) -> ControlFlow<()> {
        self.depth -= 1;
        ControlFlow::Continue(())
    }

    fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<()> {
        match expr {
            Expr::Function(f)
                if self.depth == 0
                    && (f.filter.is_some()
                        || !f.within_group.is_empty()
                        || parts(&f.name).last().is_some_and(|n| {
                            AGGREGATES.split_whitespace().any(|a| a == n) || n.starts_with("regr_")
                        })) =>
            {
                ControlFlow::Break(())
            }
            _ => ControlFlow::Continue(()),
        }
    }
}

fn has_aggregate(items: &Vec<SelectItem>) -> bool {
    visit_read(items, &mut Aggregates::default()).is_break()
}

/// Whether `factor` is a catalog table perch has no rows in (or a join that needs one).
fn empty_factor(factor: &TableFactor) -> bool {
    match factor {
        TableFactor::Table {
            name, args: None, ..
        } => catalog_name(&parts(name)).is_some_and(tables::is_empty),
        TableFactor::NestedJoin {
            table_with_joins, ..
        } => empty_join(table_with_joins),
        _ => false,
    }
}

/// Whether a `FROM` item has no rows because it needs a row of an empty catalog table.
fn empty_join(t: &TableWithJoins) -> bool {
    t.joins
        .iter()
        .fold(empty_factor(&t.relation), |left, join| {
            let right = empty_factor(&join.relation);
            match join.join_operator {
                JoinOperator::Join(_)
                | JoinOperator::Inner(_)
                | JoinOperator::CrossJoin(_)
                | JoinOperator::Semi(_)
                | JoinOperator::LeftSemi(_)
                | JoinOperator::RightSemi(_)
                | JoinOperator::StraightJoin(_)
                | JoinOperator::CrossApply => left || right,
                JoinOperator::Left(_)
                | JoinOperator::LeftOuter(_)
                | JoinOperator::Anti(_)
                | JoinOperator::LeftAnti(_)
                | JoinOperator::OuterApply => left,
                JoinOperator::Right(_)
                | JoinOperator::RightOuter(_)
                | JoinOperator::RightAnti(_) => right,
                JoinOperator::FullOuter(_) => left && right,
                _ => false,
            }
        })
}

/// The name Postgres gives an unaliased select item, near enough: a column's or function's
/// name, else `?column?`.
fn item_name(expr: &Expr) -> String {
    match expr {
        Expr::Identifier(i) => ident_name(i),
        Expr::CompoundIdentifier(ids) => ids.last().map(ident_name).unwrap_or_default(),
        Expr::Function(f) => parts(&f.name).pop().unwrap_or_default(),
        Expr::Cast { expr, .. } | Expr::Nested(expr) => item_name(expr),
        _ => "?column?".to_owned(),
    }
}

/// `select`'s columns over no rows, if it needs a row of an empty catalog table: its
/// expressions are never computed, so they need not be ones DataFusion has.
fn no_rows(select: &Select) -> Option<Select> {
    if !grouped(select) && (select.having.is_some() || has_aggregate(&select.projection)) {
        return None;
    }
    if !select.from.iter().any(empty_join) {
        return None;
    }
    let mut names: Vec<String> = Vec::new();
    for item in &select.projection {
        let name = match item {
            SelectItem::ExprWithAlias { alias, .. } => ident_name(alias),
            SelectItem::UnnamedExpr(e) => item_name(e),
            _ => return None,
        };
        // DataFusion wants distinct names where Postgres does not.
        let name = if names.contains(&name) {
            format!("{name}_{}", names.len() + 1)
        } else {
            name
        };
        names.push(name);
    }
    let columns: Vec<String> = names
        .iter()
        .map(|n| format!("NULL AS {}", Ident::with_quote('"', n)))
        .collect();
    let query = parse_query(&format!("SELECT {} WHERE false", columns.join(", ")))?;
    match *query.body {
        SetExpr::Select(s) => Some(*s),
        _ => None,
    }
}

/// Replaces each `SELECT` in `body` that has [`no_rows`]; returns whether all of `body` has
/// none.
pub fn empty_body(body: &mut SetExpr, changed: &mut bool) -> bool {
    match body {
        SetExpr::Select(select) => match no_rows(select) {
            Some(none) => {
                **select = none;
                *changed = true;
                true
            }
            None => false,
        },
        SetExpr::SetOperation {
            op, left, right, ..
        } => {
            let left = empty_body(left, changed);
            let right = empty_body(right, changed);
            match op {
                SetOperator::Union => left && right,
                SetOperator::Intersect => left || right,
                SetOperator::Except | SetOperator::Minus => left,
            }
        }
        _ => false,
    }
}
