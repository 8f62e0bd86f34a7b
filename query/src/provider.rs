//! The DataFusion table provider for one stored table: the union of its Parquet files and its
//! in-memory buffer, taken from one consistent [`Store::snapshot`], so a row is seen exactly
//! once whether or not a flush is under way.
//!
//! Files are declared sorted by the table's sort key, so DataFusion can skip sorts; filters are
//! passed to the Parquet scan for row-group pruning and re-applied above the union.

use crate::Store;
use crate::manifest::FileEntry;
use crate::schema::Table;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::datasource::{MemTable, TableProvider, TableType};
use datafusion::error::Result;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown, col};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::union::UnionExec;
use std::sync::{Arc, Mutex};

/// A file set and the listing table built over it.
type CachedListing = (Arc<Vec<FileEntry>>, Arc<ListingTable>);

pub(crate) struct StoreTable {
    store: Arc<Store>,
    table: Table,
    /// The listing table for the last file set seen; rebuilt when a flush changes the files.
    cache: Mutex<Option<CachedListing>>,
}

impl std::fmt::Debug for StoreTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreTable")
            .field("table", &self.table)
            .finish()
    }
}

impl StoreTable {
    pub(crate) fn new(store: Arc<Store>, table: Table) -> Self {
        StoreTable {
            store,
            table,
            cache: Mutex::new(None),
        }
    }

    fn listing(&self, files: &Arc<Vec<FileEntry>>) -> Result<Arc<ListingTable>> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((cached_files, table)) = cache.as_ref()
            && Arc::ptr_eq(cached_files, files)
        {
            return Ok(table.clone());
        }
        let dir = self.store.data_dir();
        let urls = files
            .iter()
            .map(|f| ListingTableUrl::parse(dir.join(&f.path).to_string_lossy()))
            .collect::<Result<Vec<_>>>()?;
        let sort = self
            .table
            .sort_key()
            .iter()
            .map(|c| col(*c).sort(true, false))
            .collect();
        let options = ListingOptions::new(Arc::new(ParquetFormat::default()))
            .with_file_extension(".parquet")
            .with_file_sort_order(vec![sort]);
        let config = ListingTableConfig::new_with_multi_paths(urls)
            .with_listing_options(options)
            .with_schema(self.table.schema());
        let table = Arc::new(ListingTable::try_new(config)?);
        *cache = Some((files.clone(), table.clone()));
        Ok(table)
    }
}

#[async_trait]
impl TableProvider for StoreTable {
    fn schema(&self) -> SchemaRef {
        self.table.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let (files, buffered) = self.store.snapshot(self.table);
        let mut inputs = Vec::with_capacity(2);
        if !files.is_empty() {
            inputs.push(
                self.listing(&files)?
                    .scan(state, projection, filters, limit)
                    .await?,
            );
        }
        if !buffered.is_empty() || inputs.is_empty() {
            let mem = MemTable::try_new(self.table.schema(), vec![buffered])?;
            inputs.push(mem.scan(state, projection, &[], limit).await?);
        }
        UnionExec::try_new(inputs)
    }
}
