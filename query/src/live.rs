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
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
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
    /// query reads of the table, each batch counted in `room` as it is made. A table that
    /// can make fewer columns for less, or is large, overrides it and counts its batches as
    /// it goes, so one too big for the query's memory stops being made part way.
    fn snapshot_of(
        &self,
        projection: Option<&[usize]>,
        room: &mut Room<'_>,
    ) -> std::result::Result<Vec<RecordBatch>, String> {
        let batches = project(self.snapshot()?, projection)?;
        room.take(&batches)?;
        Ok(batches)
    }
}

/// Room in a query's memory for the rows a live table makes for it: counted against the
/// query's limit (and the server's SQL budget) as they are made and held until the query
/// ends, as an operator's state is. A table too big for it fails the query with the memory
/// limit's message, not the server with its memory.
pub struct Room<'a> {
    grow: &'a mut dyn FnMut(usize) -> std::result::Result<(), String>,
}

impl<'a> Room<'a> {
    /// Room that `grow` grants (an error: no more).
    pub fn new(grow: &'a mut dyn FnMut(usize) -> std::result::Result<(), String>) -> Self {
        Room { grow }
    }

    /// `f` with room that is never short: for reads outside a query's memory (a table's
    /// whole snapshot, tests).
    pub fn unlimited<T>(f: impl FnOnce(&mut Room<'_>) -> T) -> T {
        let mut grant = |_| Ok(());
        f(&mut Room::new(&mut grant))
    }

    /// Counts `batches`, made for the query: an error once they pass its room.
    pub fn take(&mut self, batches: &[RecordBatch]) -> std::result::Result<(), String> {
        let bytes = batches.iter().map(RecordBatch::get_array_memory_size).sum();
        (self.grow)(bytes)
    }
}

/// The rows' reservations a query's live tables made, held by its session (an extension of
/// its configuration) until the query ends.
#[derive(Debug, Default)]
pub(crate) struct Held(std::sync::Mutex<Vec<MemoryReservation>>);

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

/// Why a [`LiveTable`] made no rows for a query.
#[derive(Debug)]
pub(crate) enum LiveError {
    /// It could not: the server's failure, not the query's (answered as
    /// [`crate::Error::Execution`], not as a bad query).
    Failed { table: String, message: String },
    /// Its rows passed the query's memory ([`Room`]).
    NoRoom {
        table: String,
        refused: DataFusionError,
    },
}

impl std::fmt::Display for LiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LiveError::Failed { table, message } => write!(f, "reading table {table}: {message}"),
            LiveError::NoRoom { table, refused } => write!(f, "rows of table {table}: {refused}"),
        }
    }
}

impl std::error::Error for LiveError {}

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
        let reservation = MemoryConsumer::new(format!("live table {}", self.name))
            .register(&state.runtime_env().memory_pool);
        let mut refused = None;
        let made = {
            let mut grow = |bytes| {
                reservation.try_grow(bytes).map_err(|e| {
                    let said = e.to_string();
                    refused = Some(e);
                    said
                })
            };
            self.table
                .snapshot_of(projection.map(Vec::as_slice), &mut Room::new(&mut grow))
        };
        let table = self.name.clone();
        let batches = made.map_err(|message| {
            DataFusionError::External(Box::new(match refused {
                // Past the query's memory: that error, which says what to change.
                Some(refused) => LiveError::NoRoom { table, refused },
                None => LiveError::Failed { table, message },
            }))
        })?;
        // Held while the query runs: the batches are.
        if let Some(held) = state.config().get_extension::<Held>() {
            held.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(reservation);
        }
        let table = MemTable::try_new(schema, vec![batches])?;
        table.scan(state, None, filters, limit).await
    }
}
