//! Strings inside the engine are string views; strings leaving it are plain `Utf8`.
//!
//! The stored tables declare their text columns (`node`, `uuid`, `model`...) as `Utf8`, and
//! that is what ingest builds, what the Parquet files hold and what every client receives.
//! Scans read them as `Utf8View` instead: the Parquet reader then builds 16-byte views that
//! point into the pages (short strings such as node names are inlined in the view) rather than
//! copying every value into a new buffer, and DataFusion groups, joins and compares views
//! without touching the string bytes when they fit in the view. Results are cast back to the
//! plain types at the edge ([`crate::SqlEngine`]), so the switch is invisible to clients, the
//! PostgreSQL protocol's type mapping, and perch's own readers of query results.

use arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, FieldRef, Fields, Schema, SchemaRef};
use arrow::error::ArrowError;
use std::sync::Arc;

/// `schema` with its `Utf8` columns as `Utf8View`: how scans produce a stored table's rows.
pub(crate) fn as_views(schema: &Schema) -> SchemaRef {
    let fields: Vec<FieldRef> = schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::Utf8 => Arc::new(f.as_ref().clone().with_data_type(DataType::Utf8View)),
            _ => f.clone(),
        })
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// The type a client receives for `data_type`: views become their plain counterparts, also
/// inside lists, structs and maps (`array_agg(node)` is a list of views).
fn plain(data_type: &DataType) -> DataType {
    let field = |f: &FieldRef| -> FieldRef {
        Arc::new(f.as_ref().clone().with_data_type(plain(f.data_type())))
    };
    match data_type {
        DataType::Utf8View => DataType::Utf8,
        DataType::BinaryView => DataType::Binary,
        DataType::List(f) => DataType::List(field(f)),
        DataType::LargeList(f) => DataType::LargeList(field(f)),
        DataType::FixedSizeList(f, n) => DataType::FixedSizeList(field(f), *n),
        DataType::Struct(fields) => DataType::Struct(fields.iter().map(field).collect::<Fields>()),
        DataType::Map(f, sorted) => DataType::Map(field(f), *sorted),
        DataType::Dictionary(k, v) => DataType::Dictionary(k.clone(), Box::new(plain(v))),
        other => other.clone(),
    }
}

/// `schema` as clients receive it: views as their plain types.
pub(crate) fn plain_schema(schema: &Schema) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| f.as_ref().clone().with_data_type(plain(f.data_type())))
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// `batch` as clients receive it: its own schema (nullability as the batch has it, which
/// can differ from the plan's) with views as their plain types. Returned as is when it has
/// no views.
pub(crate) fn plain_batch(batch: RecordBatch) -> Result<RecordBatch, ArrowError> {
    let schema = plain_schema(batch.schema_ref());
    if schema.fields() == batch.schema_ref().fields() {
        return Ok(batch);
    }
    cast_batch(&batch, &schema)
}

/// `batch` with every column cast to the type of the same column in `schema` (which must
/// otherwise match the batch's fields). Columns already of the right type are shared, not
/// copied.
pub(crate) fn cast_batch(
    batch: &RecordBatch,
    schema: &SchemaRef,
) -> Result<RecordBatch, ArrowError> {
    if batch.schema_ref() == schema {
        return Ok(batch.clone());
    }
    let columns = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                cast(c, f.data_type())
            }
        })
        .collect::<Result<Vec<ArrayRef>, ArrowError>>()?;
    let rows = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(schema.clone(), columns, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        Array, AsArray, Int64Array, ListBuilder, StringArray, StringViewArray, StringViewBuilder,
    };

    #[test]
    fn views_in_plain_out() {
        let schema = Schema::new(vec![
            Field::new("node", DataType::Utf8, false),
            Field::new("gpu", DataType::Int64, false),
        ]);
        let views = as_views(&schema);
        assert_eq!(views.field(0).data_type(), &DataType::Utf8View);
        assert_eq!(views.field(1).data_type(), &DataType::Int64);
        assert!(!views.field(0).is_nullable());

        let long = "a-node-name-longer-than-twelve-bytes";
        let batch = RecordBatch::try_new(
            Arc::new(schema.clone()),
            vec![
                Arc::new(StringArray::from(vec!["n1", long])),
                Arc::new(Int64Array::from(vec![0, 7])),
            ],
        )
        .expect("batch");
        let viewed = cast_batch(&batch, &views).expect("to views");
        let strings: &StringViewArray = viewed.column(0).as_string_view();
        assert_eq!(strings.value(1), long);

        let back_schema = plain_schema(&views);
        assert_eq!(back_schema.as_ref(), &schema);
        let back = plain_batch(viewed).expect("to plain");
        assert_eq!(back, batch);
    }

    #[test]
    fn nested_views_become_plain() {
        let mut list = ListBuilder::new(StringViewBuilder::new());
        list.values().append_value("gpu-0");
        list.values().append_null();
        list.append(true);
        list.append(false);
        let array: ArrayRef = Arc::new(list.finish());
        let schema = Schema::new(vec![Field::new("names", array.data_type().clone(), true)]);
        let batch = RecordBatch::try_new(Arc::new(schema.clone()), vec![array]).expect("batch");

        let out_schema = plain_schema(&schema);
        let DataType::List(item) = out_schema.field(0).data_type() else {
            panic!("a list stays a list: {out_schema:?}");
        };
        assert_eq!(item.data_type(), &DataType::Utf8);
        let out = plain_batch(batch).expect("cast");
        let lists = out.column(0).as_list::<i32>();
        assert!(lists.is_null(1));
        let first = lists.value(0);
        let first = first.as_string::<i32>();
        assert_eq!(first.value(0), "gpu-0");
        assert!(first.is_null(1));
    }
}
