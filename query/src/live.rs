//! Tables and views that are not stored telemetry.
//!
//! A [`LiveTable`] is data another part of perch owns and keeps current (the job database, the
//! control plane's view of the nodes); SQL reads a fresh snapshot of it each time a query
//! scans it, so `jobs` joined with `gpu_samples` sees the jobs as they are now. A view is a
//! named SELECT over any of the tables, planned in each query's session like a table.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::{MemTable, TableProvider, TableType};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::ExecutionPlan;
use std::sync::Arc;

/// Rows owned outside the store, exposed to SQL as a table.
pub trait LiveTable: Send + Sync + std::fmt::Debug {
    /// The table's columns; every snapshot has exactly this schema.
    fn schema(&self) -> SchemaRef;
    /// The rows as of now. Called once for each query that reads the table.
    fn snapshot(&self) -> std::result::Result<Vec<RecordBatch>, String>;

    /// The rows as of now, of the columns at `projection` (every column if `None`): what a
    /// query reads of the table. A table that can make fewer columns for less overrides it.
    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
    ) -> std::result::Result<Vec<RecordBatch>, String> {
        project(self.snapshot()?, projection)
    }
}

/// `batches`' columns at `projection` (all if `None`).
pub fn project(
    batches: Vec<RecordBatch>,
    projection: Option<&[usize]>,
) -> std::result::Result<Vec<RecordBatch>, String> {
    match projection {
        None => Ok(batches),
        Some(p) => batches
            .iter()
            .map(|b| b.project(p).map_err(|e| e.to_string()))
            .collect(),
    }
}

/// A [`LiveTable`] that could not make its rows: the server's failure, not the query's
/// (answered as [`crate::Error::Execution`], not as a bad query).
#[derive(Debug)]
pub(crate) struct LiveFailure {
    pub(crate) table: String,
    pub(crate) message: String,
}

impl std::fmt::Display for LiveFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "reading table {}: {}", self.table, self.message)
    }
}

impl std::error::Error for LiveFailure {}

/// The DataFusion face of a [`LiveTable`].
#[derive(Debug)]
pub(crate) struct LiveProvider {
    pub(crate) table: Arc<dyn LiveTable>,
    pub(crate) name: String,
}

#[async_trait]
impl TableProvider for LiveProvider {
    fn schema(&self) -> SchemaRef {
        self.table.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let schema = match projection {
            Some(p) => Arc::new(self.table.schema().project(p)?),
            None => self.table.schema(),
        };
        let batches = self
            .table
            .snapshot_of(projection.map(Vec::as_slice))
            .map_err(|message| {
                DataFusionError::External(Box::new(LiveFailure {
                    table: self.name.clone(),
                    message,
                }))
            })?;
        let table = MemTable::try_new(schema, vec![batches])?;
        table.scan(state, None, filters, limit).await
    }
}
