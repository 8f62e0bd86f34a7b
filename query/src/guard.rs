//! What a statement may be before anything parses or plans it: at most
//! [`QueryLimits::max_statement_bytes`] long, and no deeper than
//! [`QueryLimits::max_expression_depth`].
//!
//! The depth matters because the SQL parser, DataFusion's planner and the trees they build are
//! walked by recursive code: formatting an expression's name, hashing, comparing and dropping
//! it. `SELECT 1+1+...+1` with 2,000 terms overflowed a 2 MiB thread stack in the planner
//! (`SchemaDisplay`), and an overflowed stack aborts the whole process, not the query. The
//! parser bounds its own recursion (parentheses, subqueries) but builds operator chains in a
//! loop, so a chain of any length parses into a tree as deep as it is long. DataFusion's own
//! walks are protected (`recursive_protection`); the derived ones are not.
//!
//! So the statement's depth is bounded from its tokens, before any tree exists, by
//! [`expression_depth`]: an upper bound on how deep any tree built from it can be, however it is
//! parsed. Every token that can wrap what came before it in one more node (an operator, `AND`,
//! `NOT`, `IS`, `JOIN`, a comma between the tables of a `FROM`, a subscript...) counts one level
//! in its part of the statement (a `||` and a join count more: their planning time grows
//! faster than their number, and planning cannot be interrupted); brackets and `CASE ... END` nest, each adding its own level to
//! the deepest part inside. Commas elsewhere (select lists, `IN` lists, arguments) and the
//! branches of a `CASE` build flat lists, so they start a new part instead: a 100,000-item `IN`
//! list is shallow. Set operations (`UNION`) and `WHEN`s chain the parts they join, so they
//! count once for every part of their bracket. The bound is conservative: `a.x = 1 AND b.y = 2`
//! is counted 5 deep where its tree is 3.
//!
//! Planning and execution then run on threads whose stack fits a tree of the bound with room to
//! spare ([`stack_bytes`]), and the plan is measured again once made ([`plan_depth`]), so a
//! tree DataFusion builds deeper than its statement (none known) is refused before it runs.
//!
//! [`QueryLimits::max_statement_bytes`]: crate::QueryLimits::max_statement_bytes
//! [`QueryLimits::max_expression_depth`]: crate::QueryLimits::max_expression_depth

use crate::{Error, Result};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::LogicalPlan;
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::keywords::Keyword;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};

/// The default bound on a statement's depth (`query.max_expression_depth`): DuckDB's
/// `max_expression_depth` default. Dashboards and the web view stay under 40.
pub const DEFAULT_MAX_DEPTH: usize = 1_000;

/// The largest depth an operator may configure: the SQL threads' stacks grow with it
/// ([`stack_bytes`]).
pub const MAX_MAX_DEPTH: usize = 10_000;

/// The default bound on a statement's length (`query.max_statement_kb`): a 100,000-item `IN`
/// list fits; the syntax tree of a statement this long is tens of MiB.
pub const DEFAULT_MAX_BYTES: usize = 1 << 20;

/// Stack per level of depth a SQL thread gets. A debug build's planner used about 6 KiB per
/// level of `1+1+...` (its deepest walk); the release build under 1 KiB (measured, see
/// `tests::depth_at_the_bound_runs_in_the_stack_it_gets`).
const STACK_PER_LEVEL: usize = 32 << 10;

/// The stack of every thread that parses, plans or executes SQL, for statements up to
/// `max_depth` deep: [`STACK_PER_LEVEL`] a level and never under 16 MiB. Only what a thread
/// touches is committed; the rest is address space.
pub fn stack_bytes(max_depth: usize) -> usize {
    (max_depth.min(MAX_MAX_DEPTH) * STACK_PER_LEVEL).max(16 << 20)
}

/// Refuses `sql` when it is longer or deeper than the limits allow, with a message that says
/// what to change. A statement the tokenizer cannot read passes: the parser refuses it with
/// its own message, building nothing.
pub fn check_statement(sql: &str, max_bytes: usize, max_depth: usize) -> Result<()> {
    if sql.len() > max_bytes {
        return Err(Error::TooComplex(format!(
            "the statement is {} KiB long; perch takes statements of at most {} KiB (query.max_statement_kb): filter with a join or a subquery instead of a long literal list, or split it",
            sql.len().div_ceil(1024),
            max_bytes / 1024
        )));
    }
    let Ok(depth) = expression_depth(sql) else {
        return Ok(());
    };
    if depth > max_depth {
        return Err(Error::TooComplex(format!(
            "the statement nests about {depth} levels deep (operators chained one after another, nested brackets, CASE or UNION); perch plans at most {max_depth} (query.max_expression_depth): write a long OR of equalities as IN (...), join against the values, or split the statement"
        )));
    }
    Ok(())
}

/// Refuses a plan deeper than `max_depth`: its nodes nested, or an expression in one of them.
/// The statement passed [`check_statement`], so this only fails for a tree DataFusion made
/// deeper than the statement; the walks are DataFusion's own, which grow their stack on the
/// heap when it runs low.
pub fn plan_depth(plan: &LogicalPlan, max_depth: usize) -> Result<()> {
    let mut deepest = 0usize;
    let mut measure_plan = |plan: &LogicalPlan, depth: usize| {
        deepest = deepest.max(depth);
        for e in plan.expressions() {
            deepest = deepest.max(depth + expr_depth(&e));
        }
    };
    // The root counts no level of its own: an expression in it is as deep as its statement.
    visit_plan(plan, 0, &mut measure_plan);
    if deepest > max_depth {
        return Err(Error::TooComplex(format!(
            "the query's plan nests {deepest} levels deep; perch runs at most {max_depth} (query.max_expression_depth): split the statement or simplify its expressions"
        )));
    }
    Ok(())
}

/// Calls `f` with each node of `plan` and its depth (the root at `depth`), subqueries included.
fn visit_plan(plan: &LogicalPlan, depth: usize, f: &mut impl FnMut(&LogicalPlan, usize)) {
    // An explicit stack: a plan may be as deep as its statement allows.
    let mut todo = vec![(plan.clone(), depth)];
    while let Some((node, depth)) = todo.pop() {
        f(&node, depth);
        for child in node.inputs() {
            todo.push((child.clone(), depth + 1));
        }
        let _ = node.apply_subqueries(|sub| {
            todo.push((sub.clone(), depth + 1));
            Ok(TreeNodeRecursion::Jump)
        });
    }
}

/// The depth of one expression tree, by DataFusion's protected walk.
fn expr_depth(e: &datafusion::logical_expr::Expr) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let _ = e.visit(&mut DepthVisitor {
        depth: &mut depth,
        deepest: &mut deepest,
    });
    deepest
}

struct DepthVisitor<'a> {
    depth: &'a mut usize,
    deepest: &'a mut usize,
}

impl<'n> datafusion::common::tree_node::TreeNodeVisitor<'n> for DepthVisitor<'_> {
    type Node = datafusion::logical_expr::Expr;

    fn f_down(&mut self, _: &'n Self::Node) -> datafusion::error::Result<TreeNodeRecursion> {
        *self.depth += 1;
        *self.deepest = (*self.deepest).max(*self.depth);
        Ok(TreeNodeRecursion::Continue)
    }

    fn f_up(&mut self, _: &'n Self::Node) -> datafusion::error::Result<TreeNodeRecursion> {
        *self.depth -= 1;
        Ok(TreeNodeRecursion::Continue)
    }
}

/// Levels a `||` counts. DataFusion's planner takes time cubic in a chain of them (a debug
/// build: 100 in 0.9 s, 200 in 6.2 s, 400 in 49 s; `+` chains of 1,000 in 4.3 s), and planning
/// cannot be interrupted, so a chain is held to a quarter of the depth other operators get.
const CONCAT_LEVELS: usize = 4;

/// Levels a join (`JOIN`, or a comma between the tables of a `FROM`) counts: planning a join
/// of many tables grows faster than their number (a debug build: 125 tables in 0.7 s, 250 in
/// 3.2 s).
const JOIN_LEVELS: usize = 4;

/// Levels a query block in a bracket (a subquery, a derived table) adds over the expressions
/// in it: the plan nodes one block can stack above them (limit, sort, projection, window,
/// `HAVING`'s filter, aggregate, `WHERE`'s filter, an alias) and the subquery's own level in
/// the expression that holds it. A chain of `(SELECT ...)` was counted one level each, and
/// its plan is two or more each deeper.
const QUERY_LEVELS: usize = 8;

/// What a bracket is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The whole statement.
    Statement,
    /// `(`, `[` or `{`, closed by the matching token.
    Bracket(char),
    /// `CASE`, closed by `END`.
    Case,
}

/// One open bracket and what is known of its parts so far.
#[derive(Debug)]
struct Open {
    kind: Kind,
    /// Set operations and `WHEN`s in it: each may wrap every part of the bracket before it.
    chained: usize,
    /// The deepest part so far.
    deepest: usize,
    /// The part being read: the levels its tokens add, and its deepest bracket.
    part_levels: usize,
    part_inner: usize,
    /// After `FROM` (until the next clause): commas join tables, one level each.
    in_from: bool,
    /// It holds a query (`SELECT`, `VALUES`): [`QUERY_LEVELS`] more, once, in a bracket.
    query: bool,
}

impl Open {
    fn new(kind: Kind) -> Open {
        Open {
            kind,
            chained: 0,
            deepest: 0,
            part_levels: 0,
            part_inner: 0,
            in_from: false,
            query: false,
        }
    }

    fn end_part(&mut self) {
        self.deepest = self
            .deepest
            .max(self.part_levels.saturating_add(self.part_inner));
        self.part_levels = 0;
        self.part_inner = 0;
    }

    /// Its depth once closed: its own level, what chains its parts, and its deepest part.
    fn close(mut self) -> usize {
        self.end_part();
        // The statement's own block: its plan's root holds its expressions at their depth.
        let query = if self.query && self.kind != Kind::Statement {
            QUERY_LEVELS
        } else {
            0
        };
        1usize
            .saturating_add(query)
            .saturating_add(self.chained)
            .saturating_add(self.deepest)
    }
}

/// An upper bound on the depth of any tree built from `sql` (see the module's docs); `Err`
/// when it does not tokenize.
pub fn expression_depth(sql: &str) -> Result<usize, String> {
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .tokenize()
        .map_err(|e| e.to_string())?;
    let mut open = vec![Open::new(Kind::Statement)];
    for token in &tokens {
        let top = open.len() - 1;
        match token {
            Token::Whitespace(_) | Token::EOF => {}
            Token::LParen => open.push(Open::new(Kind::Bracket(')'))),
            // A subscript wraps what it follows (`a[1][2]` is two levels), besides nesting.
            Token::LBracket => {
                open[top].part_levels += 1;
                open.push(Open::new(Kind::Bracket(']')));
            }
            Token::LBrace => open.push(Open::new(Kind::Bracket('}'))),
            Token::RParen | Token::RBracket | Token::RBrace => {
                let closing = match token {
                    Token::RParen => ')',
                    Token::RBracket => ']',
                    _ => '}',
                };
                // An unmatched closing bracket is the parser's to refuse; a CASE left open
                // inside the bracket closes with it.
                if let Some(at) = open.iter().rposition(|o| o.kind == Kind::Bracket(closing)) {
                    close_down_to(&mut open, at);
                }
            }
            Token::Comma if open[top].in_from => open[top].part_levels += JOIN_LEVELS,
            Token::StringConcat => open[top].part_levels += CONCAT_LEVELS,
            Token::Comma | Token::SemiColon => open[top].end_part(),
            Token::Word(w) if w.quote_style.is_none() => word(&mut open, w.keyword),
            // Names, literals and placeholders nest nothing.
            Token::Word(_)
            | Token::Number(..)
            | Token::Char(_)
            | Token::SingleQuotedString(_)
            | Token::DoubleQuotedString(_)
            | Token::TripleSingleQuotedString(_)
            | Token::TripleDoubleQuotedString(_)
            | Token::DollarQuotedString(_)
            | Token::SingleQuotedByteStringLiteral(_)
            | Token::DoubleQuotedByteStringLiteral(_)
            | Token::TripleSingleQuotedByteStringLiteral(_)
            | Token::TripleDoubleQuotedByteStringLiteral(_)
            | Token::SingleQuotedRawStringLiteral(_)
            | Token::DoubleQuotedRawStringLiteral(_)
            | Token::TripleSingleQuotedRawStringLiteral(_)
            | Token::TripleDoubleQuotedRawStringLiteral(_)
            | Token::NationalStringLiteral(_)
            | Token::QuoteDelimitedStringLiteral(_)
            | Token::NationalQuoteDelimitedStringLiteral(_)
            | Token::EscapedStringLiteral(_)
            | Token::UnicodeStringLiteral(_)
            | Token::HexStringLiteral(_)
            | Token::Placeholder(_) => {}
            // Every other token is an operator of some kind (`+`, `||`, `::`, `.`, `->`...):
            // one level. New kinds of token count too.
            _ => open[top].part_levels += 1,
        }
    }
    close_down_to(&mut open, 0);
    Ok(open.pop().map_or(0, Open::close))
}

/// Closes every bracket above `at` and `at` itself (unless it is the statement), each adding
/// its depth to the part of the one around it.
fn close_down_to(open: &mut Vec<Open>, at: usize) {
    while open.len() > at.max(1) {
        let Some(inner) = open.pop() else { return };
        let depth = inner.close();
        if let Some(outer) = open.last_mut() {
            outer.part_inner = outer.part_inner.max(depth);
        }
    }
}

/// A keyword (an unquoted word; names are `NoKeyword`).
fn word(open: &mut Vec<Open>, keyword: Keyword) {
    let top = open.len() - 1;
    match keyword {
        Keyword::CASE => open.push(Open::new(Kind::Case)),
        Keyword::END => {
            if let Some(at) = open.iter().rposition(|o| o.kind == Kind::Case) {
                // Only a CASE in the innermost bracket: `END` elsewhere is a name.
                if open[at + 1..].iter().all(|o| o.kind == Kind::Case) {
                    close_down_to(open, at);
                }
            }
        }
        // A CASE's branches are a flat list, but may become a chain of conditions.
        Keyword::WHEN if open[top].kind == Kind::Case => {
            open[top].chained += 1;
            open[top].end_part();
        }
        Keyword::THEN | Keyword::ELSE if open[top].kind == Kind::Case => open[top].end_part(),
        // Set operations chain whole queries.
        Keyword::UNION | Keyword::EXCEPT | Keyword::INTERSECT | Keyword::MINUS => {
            open[top].chained += 1;
            open[top].in_from = false;
            open[top].end_part();
        }
        Keyword::FROM => {
            open[top].end_part();
            open[top].in_from = true;
        }
        // Clauses: what follows is a new part of the query.
        Keyword::SELECT
        | Keyword::WHERE
        | Keyword::GROUP
        | Keyword::HAVING
        | Keyword::ORDER
        | Keyword::LIMIT
        | Keyword::OFFSET
        | Keyword::QUALIFY
        | Keyword::WINDOW
        | Keyword::FETCH
        | Keyword::WITH
        | Keyword::VALUES => {
            if matches!(keyword, Keyword::SELECT | Keyword::VALUES) {
                open[top].query = true;
            }
            open[top].end_part();
            open[top].in_from = false;
        }
        // Words that wrap an expression or a table in one more node: the parser's infix and
        // prefix operators, joins.
        Keyword::AND
        | Keyword::OR
        | Keyword::XOR
        | Keyword::NOT
        | Keyword::IS
        | Keyword::NOTNULL
        | Keyword::IN
        | Keyword::LIKE
        | Keyword::ILIKE
        | Keyword::RLIKE
        | Keyword::REGEXP
        | Keyword::SIMILAR
        | Keyword::MATCH
        | Keyword::BETWEEN
        | Keyword::ESCAPE
        | Keyword::COLLATE
        | Keyword::AT
        | Keyword::OVERLAPS
        | Keyword::OPERATOR
        | Keyword::MEMBER
        | Keyword::DIV
        | Keyword::ANY
        | Keyword::SOME
        | Keyword::ALL
        | Keyword::EXISTS
        | Keyword::INTERVAL
        | Keyword::PRIOR
        | Keyword::CONNECT_BY_ROOT => open[top].part_levels += 1,
        Keyword::JOIN | Keyword::APPLY => open[top].part_levels += JOIN_LEVELS,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth(sql: &str) -> usize {
        expression_depth(sql).expect("tokenizes")
    }

    #[test]
    fn chains_count_their_length_and_lists_do_not() {
        let plus = |n: usize| format!("SELECT {}", vec!["1"; n].join("+"));
        assert!(depth(&plus(2_000)) >= 2_000, "{}", depth(&plus(2_000)));
        assert!(depth(&plus(10)) < 20);
        let ors = (0..2_500)
            .map(|i| format!("gpu = {i}"))
            .collect::<Vec<_>>()
            .join(" OR ");
        assert!(depth(&format!("SELECT * FROM t WHERE {ors}")) >= 2_500);
        // Flat lists: an IN list, a select list, arguments, CASE branches bound only by their
        // number of WHENs.
        let list = (0..100_000)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        assert!(depth(&format!("SELECT * FROM t WHERE gpu IN ({list})")) < 10);
        assert!(depth(&format!("SELECT {list} FROM t")) < 10);
        assert!(depth(&format!("SELECT coalesce({list})")) < 10);
        let cases = (0..200)
            .map(|i| format!("WHEN x = {i} THEN 'v{i}'"))
            .collect::<String>();
        let d = depth(&format!("SELECT CASE {cases} ELSE 'z' END FROM t"));
        assert!((200..220).contains(&d), "{d}");
    }

    /// Each query block in a bracket counts its plan's levels: a chain of subqueries is as deep
    /// as the plan it makes, not one level a bracket.
    #[test]
    fn subqueries_count_the_levels_of_their_plans() {
        let chain = |n: usize| {
            format!(
                "SELECT {}x IS NULL{}",
                "(SELECT ".repeat(n),
                " FROM t LIMIT 1)".repeat(n)
            )
        };
        assert!(
            depth(&chain(17)) >= 17 * (1 + QUERY_LEVELS),
            "{}",
            depth(&chain(17))
        );
    }

    #[test]
    fn brackets_nest_and_siblings_do_not_add_up() {
        let nested = |n: usize| format!("SELECT {}1{}", "(".repeat(n), ")".repeat(n));
        assert!(depth(&nested(40)) > 40);
        let siblings = (0..500)
            .map(|_| "(1 + 1)".to_owned())
            .collect::<Vec<_>>()
            .join(", ");
        assert!(depth(&format!("SELECT {siblings}")) < 10);
        // Subscripts wrap what they follow.
        assert!(depth(&format!("SELECT a{}", "[1]".repeat(300))) >= 300);
        // CASE nests like a bracket; END outside a CASE is a name.
        let cases = format!(
            "SELECT {}1{}",
            "CASE WHEN true THEN ".repeat(30),
            " END".repeat(30)
        );
        assert!(depth(&cases) >= 60, "{}", depth(&cases));
        assert!(depth("SELECT end FROM t") < 5);
    }

    #[test]
    fn joins_set_operations_and_from_lists_chain() {
        let unions = vec!["SELECT 1"; 800].join(" UNION ALL ");
        assert!(depth(&unions) >= 800);
        let tables = (0..600)
            .map(|i| format!("t{i}"))
            .collect::<Vec<_>>()
            .join(", ");
        assert!(depth(&format!("SELECT * FROM {tables} WHERE a = 1")) >= 600);
        let joins = (0..600)
            .map(|i| format!(" JOIN t{i} USING (k)"))
            .collect::<String>();
        assert!(depth(&format!("SELECT * FROM t{joins}")) >= 600);
        // A chain of `||` counts more than its length.
        let concat = format!("SELECT {}", vec!["'a'"; 300].join(" || "));
        assert!(depth(&concat) >= 4 * 299, "{}", depth(&concat));
        // Commas after the FROM's tables are a list again.
        assert!(depth("SELECT a FROM t WHERE x IN (1, 2, 3) GROUP BY a, b, c, d") < 10);
    }

    #[test]
    fn too_long_or_too_deep_is_refused_with_what_to_change() {
        let deep = format!("SELECT {}", vec!["1"; 2_000].join("+"));
        let e = check_statement(&deep, DEFAULT_MAX_BYTES, DEFAULT_MAX_DEPTH).expect_err("deep");
        assert!(matches!(e, Error::TooComplex(_)));
        assert!(e.to_string().contains("query.max_expression_depth"), "{e}");
        let long = format!("SELECT '{}'", "x".repeat(2 << 20));
        let e = check_statement(&long, DEFAULT_MAX_BYTES, DEFAULT_MAX_DEPTH).expect_err("long");
        assert!(e.to_string().contains("query.max_statement_kb"), "{e}");
        check_statement("SELECT 1 + 1", DEFAULT_MAX_BYTES, DEFAULT_MAX_DEPTH).expect("fine");
        // Not tokenizable: the parser's to refuse.
        check_statement("SELECT 'open", DEFAULT_MAX_BYTES, DEFAULT_MAX_DEPTH).expect("passes");
    }
}
