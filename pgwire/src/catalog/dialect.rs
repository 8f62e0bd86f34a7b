//! Postgres's spellings that DataFusion lacks, in DataFusion's terms: casts to `oid`, the
//! `reg*` types and `pg_catalog.` types, `ARRAY(SELECT ...)`, and `pg_size_pretty`.

use super::{grouped, parse_expr, parts};
use datafusion::sql::sqlparser::ast::{
    ArrayElemTypeDef, DataType, ExactNumberInfo, Expr, Query, SelectItem, SetExpr,
};

/// Postgres's `ARRAY(SELECT e FROM ...)`: the values of `e` as one array, `{}` for none.
pub fn array_of(query: &Query) -> Option<Expr> {
    let mut query = query.clone();
    if query.order_by.is_some() {
        return None;
    }
    let SetExpr::Select(select) = query.body.as_mut() else {
        return None;
    };
    if grouped(select) || select.distinct.is_some() {
        return None;
    }
    let element = match select.projection.as_slice() {
        [SelectItem::UnnamedExpr(e) | SelectItem::ExprWithAlias { expr: e, .. }] => e.clone(),
        _ => return None,
    };
    select.projection = vec![SelectItem::UnnamedExpr(parse_expr(&format!(
        "array_agg({element})"
    ))?)];
    parse_expr(&format!("coalesce(({query}), make_array())"))
}

/// The DataFusion type for a Postgres one it does not know by that name: OIDs and the
/// `reg*` types that name catalog rows are numbers, and `pg_catalog.` types are the plain
/// ones.
pub fn datafusion_type(data_type: &DataType) -> Option<DataType> {
    match data_type {
        DataType::Custom(name, modifiers) if modifiers.is_empty() => {
            let parts = parts(name);
            let name = match parts.as_slice() {
                [n] => n,
                [schema, n] if schema == "pg_catalog" => n,
                _ => return None,
            };
            Some(match name.as_str() {
                "oid" | "regclass" | "regtype" | "regnamespace" | "regproc" | "regprocedure"
                | "regrole" | "regoper" | "regoperator" | "int8" => DataType::BigInt(None),
                "text" | "name" | "varchar" => DataType::Text,
                "int2" => DataType::SmallInt(None),
                "int4" => DataType::Int(None),
                "float4" => DataType::Real,
                "float8" => DataType::Double(ExactNumberInfo::None),
                "bool" => DataType::Boolean,
                _ => return None,
            })
        }
        DataType::Regclass => Some(DataType::BigInt(None)),
        DataType::Array(ArrayElemTypeDef::SquareBracket(element, size)) => Some(DataType::Array(
            ArrayElemTypeDef::SquareBracket(Box::new(datafusion_type(element)?), *size),
        )),
        _ => None,
    }
}

/// `pg_size_pretty(bytes)` as Postgres rounds it: bytes below 10 kB, then the largest unit
/// that keeps the number below 20480, rounded half away from zero.
pub fn size_pretty(bytes: &Expr) -> String {
    let b = format!("CAST(({bytes}) AS BIGINT)");
    let half = |shift: u32| {
        let h = format!("({b} / {})", 1i64 << shift);
        format!("CAST(({h} + CASE WHEN {h} < 0 THEN -1 ELSE 1 END) / 2 AS VARCHAR)")
    };
    let unit = |shift: u32| format!("abs({b} / {}) < 20479", 1i64 << shift);
    format!(
        "CASE WHEN abs({b}) < 10240 THEN CAST({b} AS VARCHAR) || ' bytes' \
         WHEN {} THEN {} || ' kB' WHEN {} THEN {} || ' MB' WHEN {} THEN {} || ' GB' \
         WHEN {} THEN {} || ' TB' ELSE {} || ' PB' END",
        unit(9),
        half(9),
        unit(19),
        half(19),
        unit(29),
        half(29),
        unit(39),
        half(39),
        half(49)
    )
}
