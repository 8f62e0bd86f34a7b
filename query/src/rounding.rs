//! `floor` and `ceil` of floating-point columns with the CPU's rounding instruction.
//!
//! DataFusion maps `f64::floor` over a column. The baseline x86-64 target has no rounding
//! instruction (SSE4.1's `roundpd` came in 2008), so each value is a call into libm: in a
//! histogram of power in 50 W buckets over a week (`floor(power_watts / 50) * 50`, 31 M
//! values) those calls were a fifth of perch's time. Where the CPU has SSE4.1, the same loop
//! is compiled for it here, two values an instruction (four with AVX). The results are bit
//! for bit those of `f64::floor` and `f64::ceil`, which are exact IEEE operations (NaN,
//! infinities, -0.0 and values past 2^52 come out as they went in). Everything else (a
//! constant, a decimal, another CPU) goes to DataFusion's own function, as does every
//! question the planner asks (types, ordering, bounds, preimages).

use arrow::array::{Array, ArrayRef, AsArray, PrimitiveArray};
use arrow::buffer::ScalarBuffer;
use arrow::datatypes::FieldRef;
use arrow::datatypes::{DataType, Float32Type, Float64Type};
use datafusion::common::{Result, ScalarValue};
use datafusion::config::ConfigOptions;
use datafusion::functions::math::ceil::CeilFunc;
use datafusion::functions::math::floor::FloorFunc;
use datafusion::logical_expr::interval_arithmetic::Interval;
use datafusion::logical_expr::preimage::PreimageResult;
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    ColumnarValue, Documentation, Expr, ExpressionPlacement, ReturnFieldArgs, ScalarFunctionArgs,
    ScalarUDF, ScalarUDFImpl, Signature,
};
use std::sync::Arc;

/// `floor`, fast on float columns.
pub(crate) fn floor() -> ScalarUDF {
    ScalarUDF::new_from_impl(Rounded {
        inner: FloorFunc::new(),
        op: Op::Floor,
    })
}

/// `ceil`, fast on float columns.
pub(crate) fn ceil() -> ScalarUDF {
    ScalarUDF::new_from_impl(Rounded {
        inner: CeilFunc::new(),
        op: Op::Ceil,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Op {
    Floor,
    Ceil,
}

/// Rounding of floats, computed without a call per value where the CPU allows.
trait Round: Copy {
    fn floor(self) -> Self;
    fn ceil(self) -> Self;
}

impl Round for f64 {
    #[inline(always)]
    fn floor(self) -> Self {
        f64::floor(self)
    }
    #[inline(always)]
    fn ceil(self) -> Self {
        f64::ceil(self)
    }
}

impl Round for f32 {
    #[inline(always)]
    fn floor(self) -> Self {
        f32::floor(self)
    }
    #[inline(always)]
    fn ceil(self) -> Self {
        f32::ceil(self)
    }
}

/// `op` of every value.
fn round<T: Round>(values: &[T], op: Op) -> Vec<T> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        return round_avx(values, op);
    } else if std::arch::is_x86_feature_detected!("sse4.1") {
        return round_sse41(values, op);
    }
    each(values, op)
}

/// `$name`: [`each`] compiled with the CPU feature `$feature` enabled; the only caller,
/// [`round`], checks that this CPU has it.
macro_rules! compiled_for {
    ($name:ident, $feature:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        fn $name<T: Round>(values: &[T], op: Op) -> Vec<T> {
            #[target_feature(enable = $feature)]
            fn compiled<T: Round>(values: &[T], op: Op) -> Vec<T> {
                each(values, op)
            }
            // SAFETY: the only caller checked that this CPU has the feature.
            unsafe { compiled(values, op) }
        }
    };
}

compiled_for!(round_avx, "avx");
compiled_for!(round_sse41, "sse4.1");

#[inline(always)]
fn each<T: Round>(values: &[T], op: Op) -> Vec<T> {
    match op {
        Op::Floor => values.iter().map(|v| v.floor()).collect(),
        Op::Ceil => values.iter().map(|v| v.ceil()).collect(),
    }
}

/// `floor` or `ceil`: DataFusion's function, with float columns rounded by [`round`].
#[derive(Debug, PartialEq, Eq, Hash)]
struct Rounded<F> {
    inner: F,
    op: Op,
}

impl<F: ScalarUDFImpl + PartialEq + Eq + std::hash::Hash> ScalarUDFImpl for Rounded<F> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn with_updated_config(&self, config: &ConfigOptions) -> Option<ScalarUDF> {
        // Neither function reads the configuration; were one to, it would lose the fast path
        // rather than its behaviour.
        self.inner.with_updated_config(config)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.inner.return_field_from_args(args)
    }

    fn is_strict(&self) -> bool {
        self.inner.is_strict()
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let rounded: Option<ArrayRef> = match args.args.as_slice() {
            [ColumnarValue::Array(a)] => match a.data_type() {
                DataType::Float64 => {
                    let a = a.as_primitive::<Float64Type>();
                    let values = ScalarBuffer::from(round(a.values(), self.op));
                    Some(Arc::new(PrimitiveArray::<Float64Type>::new(
                        values,
                        a.nulls().cloned(),
                    )))
                }
                DataType::Float32 => {
                    let a = a.as_primitive::<Float32Type>();
                    let values = ScalarBuffer::from(round(a.values(), self.op));
                    Some(Arc::new(PrimitiveArray::<Float32Type>::new(
                        values,
                        a.nulls().cloned(),
                    )))
                }
                _ => None,
            },
            _ => None,
        };
        match rounded {
            Some(array) => Ok(ColumnarValue::Array(array)),
            None => self.inner.invoke_with_args(args),
        }
    }

    fn simplify(&self, args: Vec<Expr>, info: &SimplifyContext) -> Result<ExprSimplifyResult> {
        self.inner.simplify(args, info)
    }

    fn preimage(
        &self,
        args: &[Expr],
        lit_expr: &Expr,
        info: &SimplifyContext,
    ) -> Result<PreimageResult> {
        self.inner.preimage(args, lit_expr, info)
    }

    fn short_circuits(&self) -> bool {
        self.inner.short_circuits()
    }

    fn evaluate_bounds(&self, input: &[&Interval]) -> Result<Interval> {
        self.inner.evaluate_bounds(input)
    }

    fn propagate_constraints(
        &self,
        interval: &Interval,
        inputs: &[&Interval],
    ) -> Result<Option<Vec<Interval>>> {
        self.inner.propagate_constraints(interval, inputs)
    }

    fn output_ordering(&self, inputs: &[ExprProperties]) -> Result<SortProperties> {
        self.inner.output_ordering(inputs)
    }

    fn preserves_lex_ordering(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.preserves_lex_ordering(inputs)
    }

    fn strictly_order_preserving(&self, inputs: &[ExprProperties]) -> Result<bool> {
        self.inner.strictly_order_preserving(inputs)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn struct_field_mapping(
        &self,
        literal_args: &[Option<ScalarValue>],
    ) -> Option<datafusion::logical_expr::StructFieldMapping> {
        self.inner.struct_field_mapping(literal_args)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }

    fn placement(&self, args: &[ExpressionPlacement]) -> ExpressionPlacement {
        self.inner.placement(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float32Array, Float64Array, RecordBatch};
    use arrow::datatypes::{Field, Schema};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;

    /// Values where rounding has edges: halves, signed zeros, the last fractions below 2^52
    /// (and 2^23 for f32), magnitudes past them, subnormals, infinities, NaN, NULL.
    fn values() -> Vec<Option<f64>> {
        let mut v: Vec<Option<f64>> = [
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.0,
            -1.0,
            1.5,
            -2.5,
            0.999_999_999_999_999_9,
            -0.999_999_999_999_999_9,
            4_503_599_627_370_495.5,
            -4_503_599_627_370_495.5,
            8_388_607.5,
            -8_388_607.5,
            1e300,
            -1e300,
            f64::MIN_POSITIVE,
            -f64::MIN_POSITIVE / 4.0,
            5e-324,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            -f64::NAN,
            575.7,
            -49.99,
        ]
        .into_iter()
        .map(Some)
        .collect();
        v.push(None);
        v
    }

    fn context(perch: bool) -> SessionContext {
        let ctx = SessionContext::new();
        if perch {
            ctx.register_udf(floor());
            ctx.register_udf(ceil());
        }
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Float64, true),
            Field::new("y", DataType::Float32, true),
        ]));
        let x = Float64Array::from(values());
        let y: Float32Array = values().iter().map(|v| v.map(|v| v as f32)).collect();
        let batch =
            RecordBatch::try_new(schema.clone(), vec![Arc::new(x), Arc::new(y)]).expect("batch");
        let table = MemTable::try_new(schema, vec![vec![batch]]).expect("table");
        ctx.register_table("t", Arc::new(table)).expect("register");
        ctx
    }

    /// Every column of `sql`'s answer as (type, bit patterns, nulls): -0.0 and 0.0, and NaN
    /// payloads, count as different.
    async fn bits(ctx: &SessionContext, sql: &str) -> Vec<(DataType, Vec<Option<u64>>)> {
        let batches = ctx
            .sql(sql)
            .await
            .expect("plan")
            .collect()
            .await
            .expect("run");
        let batch = arrow::compute::concat_batches(&batches[0].schema(), &batches).expect("concat");
        batch
            .columns()
            .iter()
            .map(|c| {
                let bits = match c.data_type() {
                    DataType::Float64 => c
                        .as_primitive::<Float64Type>()
                        .iter()
                        .map(|v| v.map(f64::to_bits))
                        .collect(),
                    DataType::Float32 => c
                        .as_primitive::<Float32Type>()
                        .iter()
                        .map(|v| v.map(|v| u64::from(v.to_bits())))
                        .collect(),
                    t => panic!("{sql}: a column of {t}"),
                };
                (c.data_type().clone(), bits)
            })
            .collect()
    }

    #[tokio::test]
    async fn floor_and_ceil_agree_with_datafusion_bit_for_bit() {
        let (stock, perch) = (context(false), context(true));
        for sql in [
            "SELECT floor(x), ceil(x), floor(y), ceil(y) FROM t",
            "SELECT floor(x / 50) * 50, ceil(-x), floor(y * 3) FROM t",
            "SELECT floor(x) FROM t WHERE x IS NOT NULL ORDER BY floor(x) DESC",
            "SELECT floor(2.5), ceil(-0.5), floor(CAST(NULL AS DOUBLE)), ceil(arrow_cast(1.5, 'Float32'))",
            "SELECT floor(x) FROM t WHERE floor(x) = 1",
        ] {
            let want = bits(&stock, sql).await;
            assert!(!want.is_empty() && !want[0].1.is_empty(), "{sql}: no rows");
            assert_eq!(bits(&perch, sql).await, want, "{sql}");
        }
    }

    /// The planner asks the same questions of perch's functions as of DataFusion's: a
    /// predicate on `floor(x)` becomes a range of `x` (its preimage), and an order by
    /// `floor(x)` is known to follow `x`.
    #[tokio::test]
    async fn plans_are_datafusions() {
        let (stock, perch) = (context(false), context(true));
        for sql in [
            "EXPLAIN SELECT x FROM t WHERE floor(x) = 1 AND ceil(y) > 2",
            "EXPLAIN SELECT x FROM (SELECT x FROM t ORDER BY x) ORDER BY floor(x), ceil(x)",
        ] {
            let plan = |ctx: SessionContext| async move {
                let batches = ctx
                    .sql(sql)
                    .await
                    .expect("plan")
                    .collect()
                    .await
                    .expect("run");
                arrow::util::pretty::pretty_format_batches(&batches)
                    .expect("format")
                    .to_string()
            };
            assert_eq!(
                plan(perch.clone()).await,
                plan(stock.clone()).await,
                "{sql}"
            );
        }
        let floor = perch.state().scalar_functions()["floor"].clone();
        assert!(floor.inner().is::<Rounded<FloorFunc>>());
    }

    /// The kernel, whichever instructions this CPU has, against Rust's own rounding, over a
    /// sweep of magnitudes and fractions.
    #[test]
    fn the_kernel_rounds_as_rust_does() {
        let mut xs: Vec<f64> = values().into_iter().flatten().collect();
        for e in -30..60 {
            for f in [0.0, 0.25, 0.5, 0.75, 0.999] {
                let x = (2f64).powi(e) * (1.0 + f);
                xs.extend([x, -x, x + 0.5, -x - 0.5]);
            }
        }
        let ys: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
        for (op, f, g) in [
            (
                Op::Floor,
                f64::floor as fn(f64) -> f64,
                f32::floor as fn(f32) -> f32,
            ),
            (Op::Ceil, f64::ceil, f32::ceil),
        ] {
            for (x, got) in xs.iter().zip(round(&xs, op)) {
                assert_eq!(got.to_bits(), f(*x).to_bits(), "{op:?} of {x:e}: {got:e}");
            }
            for (y, got) in ys.iter().zip(round(&ys, op)) {
                assert_eq!(
                    got.to_bits(),
                    g(*y).to_bits(),
                    "{op:?} of {y:e}f32: {got:e}"
                );
            }
        }
    }
}
