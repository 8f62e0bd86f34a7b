//! Read-only SQL over the store through DataFusion.
//!
//! Each query gets its own session with its own memory pool, charged also to the server's
//! budget ([`budget`](crate::budget)): users' queries run at most `max_concurrent` at a time,
//! within one memory budget and one spill allowance for the whole server. Planning and
//! execution both run on the SQL runtime, never on the caller's. Plans are checked before they run: DDL, DML (COPY and INSERT among
//! them) and statements such as SET are refused, and no table can be read from a file path.
//! A timeout covers planning and the whole result stream, and results are capped at a row
//! limit with a flag saying so.

use crate::budget::{Asker, Budget, QueryPool, Slot};
use crate::live::{LiveProvider, LiveTable};
use crate::provider::{Pins, StoreTable};
use crate::{Error, Result, Store, Table};
use crate::{functions, median, optimizer, strings};
use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::datasource::ViewTable;
use datafusion::error::DataFusionError;
use datafusion::execution::cache::cache_manager::{CacheManager, CacheManagerConfig};
use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryPool, MemoryReservation};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::session_state::{SessionState, SessionStateBuilder};
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::{SQLOptions, SessionConfig, SessionContext};
use futures::StreamExt;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;

/// Bounds applied to every query.
#[derive(Debug, Clone, Copy)]
pub struct QueryLimits {
    pub timeout: Duration,
    pub max_rows: usize,
    pub memory_bytes: usize,
    /// Memory all users' queries may hold together.
    pub total_memory_bytes: usize,
    /// Users' queries that run at once; more wait (within their own timeout), up to eight
    /// per slot, and beyond that are refused as busy. The slots are shared by user, and from
    /// three up one is kept for operators ([`SqlEngine::query_as`]).
    pub max_concurrent: usize,
    /// Temporary files all queries together may spill to (bytes); 0 turns spilling off.
    pub spill_bytes: u64,
    /// The longest statement taken, in bytes ([`crate::guard`]).
    pub max_statement_bytes: usize,
    /// The deepest statement taken ([`crate::guard::expression_depth`]); the SQL threads'
    /// stacks are sized for it ([`crate::guard::stack_bytes`]).
    pub max_expression_depth: usize,
}

impl Default for QueryLimits {
    fn default() -> Self {
        QueryLimits {
            timeout: Duration::from_secs(30),
            max_rows: 100_000,
            memory_bytes: 1 << 30,
            total_memory_bytes: 2 << 30,
            max_concurrent: 4,
            spill_bytes: 4 << 30,
            max_statement_bytes: crate::guard::DEFAULT_MAX_BYTES,
            max_expression_depth: crate::guard::DEFAULT_MAX_DEPTH,
        }
    }
}

/// A query's result.
#[derive(Debug)]
pub struct QueryOutput {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
    pub rows: usize,
    /// The result had more rows than `max_rows`; only the first `max_rows` are here.
    pub truncated: bool,
    /// The result's memory, charged to the query's limit and the server's budget until the
    /// output is dropped (answered). Only held, never read.
    _held: Option<MemoryReservation>,
}

/// Cheap to clone: a query runs on a clone moved onto the SQL runtime.
#[derive(Clone)]
pub struct SqlEngine {
    store: Arc<Store>,
    limits: QueryLimits,
    /// Parquet footers, file statistics and object metadata, kept across queries (each query
    /// has its own runtime for its own memory pool). Safe because a stored file never changes:
    /// new data gets new file names. Saves a round trip or two per file on object storage.
    caches: Option<Arc<CacheManager>>,
    /// Tables owned outside the store (jobs, nodes), by name.
    live: Arc<Vec<(String, Arc<dyn LiveTable>)>>,
    /// Views by name, in the order they were added (a view may use the ones before it).
    views: Arc<Vec<(String, String)>>,
    /// What all users' queries share.
    budget: Arc<Budget>,
    /// The session every query's starts as a copy of: functions, stored and live tables, and
    /// views (each planned once here, not in every query), built at the first session after
    /// the last table or view was added. The copies share its catalog, which is safe because
    /// every table reads its rows when a query scans it, never when it is registered.
    template: Arc<tokio::sync::OnceCell<SessionState>>,
}

impl std::fmt::Debug for SqlEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlEngine")
            .field("limits", &self.limits)
            .finish()
    }
}

impl SqlEngine {
    pub fn new(store: Arc<Store>, limits: QueryLimits) -> Self {
        SqlEngine {
            store,
            limits,
            caches: CacheManager::try_new(&CacheManagerConfig::default()).ok(),
            live: Arc::default(),
            views: Arc::default(),
            budget: Arc::new(Budget::new(&limits)),
            template: Arc::default(),
        }
    }

    /// Adds a table whose rows live outside the store; each query reads a fresh snapshot.
    pub fn with_table(mut self, name: &str, table: Arc<dyn LiveTable>) -> Self {
        Arc::make_mut(&mut self.live).push((name.to_owned(), table));
        self.template = Arc::default();
        self
    }

    /// Adds a view: `select` is planned once, after the tables and the views added before
    /// it, and every query's session has it. [`SqlEngine::check_views`] reports a view that does not plan.
    pub fn with_view(mut self, name: &str, select: &str) -> Self {
        Arc::make_mut(&mut self.views).push((name.to_owned(), select.to_owned()));
        self.template = Arc::default();
        self
    }

    /// Plans every view once, so a broken definition is found at startup, not by a user, and
    /// starts the runtime the first query runs on.
    ///
    /// This and the other entry points return a boxed future from a function that is never
    /// inlined. A small `async fn` is inlined into the crates that await it, and with it every
    /// generic function it reaches: DataFusion's SQL planner (`SqlToRel<S>` and sqlparser's
    /// visitors) was compiled again in the `perch` binary, 1.1 M of its 2.3 M lines of LLVM IR
    /// and 65 s of its release build. Behind the boundary it stays in this crate (and the
    /// planner itself in `perch-planner`).
    #[inline(never)]
    pub fn check_views(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.check_views_inner())
    }

    async fn check_views_inner(&self) -> Result<()> {
        self.session(self.budget.pool(self.limits.memory_bytes))
            .await?;
        // Start the runtime of the slot the first query gets (slots are reused last freed
        // first), so that query does not wait for its threads to start.
        let deadline = tokio::time::Instant::now() + self.limits.timeout;
        drop(
            self.budget
                .slot(Asker::anyone(), deadline, || self.timeout())
                .await?,
        );
        Ok(())
    }

    /// The names of the tables and views SQL can read, stored tables first (each rollup
    /// twice: its merged view and its `_partial` rows).
    pub fn table_names(&self) -> Vec<String> {
        Table::ALL
            .iter()
            .map(|t| t.name().to_owned())
            .chain(
                Table::ALL
                    .iter()
                    .filter(|t| t.rollup().is_some())
                    .map(|t| t.stored_sql_name()),
            )
            .chain(self.live.iter().map(|(n, _)| n.clone()))
            .chain(self.views.iter().map(|(n, _)| n.clone()))
            .collect()
    }

    /// The tables and views a user reads, sorted: [`SqlEngine::table_names`] without the
    /// rollups' stored `_partial` rows, which only their merged views should be read through.
    pub fn public_table_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .table_names()
            .into_iter()
            .filter(|n| !n.ends_with(PARTIAL_SUFFIX))
            .collect();
        names.sort();
        names
    }

    pub fn limits(&self) -> QueryLimits {
        self.limits
    }

    /// Bytes all queries hold now (the server's SQL memory budget in use).
    pub fn memory_in_use(&self) -> usize {
        self.budget.memory_in_use()
    }

    /// A query's session: a copy of the template with the query's own runtime (its memory
    /// pool, charged to the server's budget, and the spill allowance).
    async fn session(&self, pool: Arc<QueryPool>) -> Result<SessionContext> {
        let mut runtime = RuntimeEnvBuilder::new().with_memory_pool(pool);
        if self.budget.spill().is_none() {
            runtime = runtime.with_disk_manager_builder(
                DiskManagerBuilder::default().with_mode(DiskManagerMode::Disabled),
            );
        }
        if let Some(caches) = &self.caches {
            runtime = runtime.with_cache_manager(
                CacheManagerConfig::default()
                    .with_file_statistics_cache(caches.get_file_statistic_cache())
                    .with_list_files_cache(caches.get_list_files_cache())
                    .with_file_metadata_cache(Some(caches.get_file_metadata_cache())),
            );
        }
        let mut runtime = runtime
            .build()
            .map_err(|e| Error::Execution(e.to_string()))?;
        if let Some(spill) = self.budget.spill() {
            runtime.disk_manager = spill;
        }
        let runtime = Arc::new(runtime);
        if let Some((url, store)) = self.store.storage.object_store() {
            runtime.register_object_store(url.as_ref(), store.clone());
        }
        let template = self
            .template
            .get_or_try_init(|| self.build_template())
            .await?;
        // Not a default catalogue of its own: building one would replace the shared one.
        let config = template
            .config()
            .clone()
            .with_create_default_catalog_and_schema(false)
            .with_extension(Arc::new(Pins::default()))
            .with_extension(Arc::new(crate::live::Held::default()));
        Ok(SessionContext::new_with_state(
            SessionStateBuilder::new_from_existing(template.clone())
                .with_config(config)
                .with_runtime_env(runtime)
                .build(),
        ))
    }

    /// The template session: functions, planners and rules, every table, and every view
    /// planned. Its own runtime is never used: each query's session replaces it.
    async fn build_template(&self) -> Result<SessionState> {
        let mut config = SessionConfig::new().with_information_schema(true);
        // Each sort sets this aside for its merge before it sorts a row (DataFusion's default
        // 10 MiB): under a query limit below it every ORDER BY was refused, however few its
        // rows. An eighth of the query's memory at most.
        let merge = &mut config.options_mut().execution.sort_spill_reservation_bytes;
        *merge = (*merge).min(self.limits.memory_bytes / 8);
        // The store's files are sorted by series and time, and each scan partition reads them
        // in that order: a window over each series (`PARTITION BY node, gpu ORDER BY time`)
        // needs only its rows regrouped by series, merged in order, not sorted again.
        // DataFusion's default repartitions for parallelism and then sorts every partition.
        config.options_mut().optimizer.prefer_existing_sort = true;
        let ctx = SessionContext::new_with_state(
            SessionStateBuilder::new()
                .with_config(config)
                .with_default_features()
                .with_expr_planners(
                    std::iter::once(Arc::new(functions::StringConcatPlanner::new(
                        self.limits.memory_bytes,
                    ))
                        as Arc<dyn datafusion::logical_expr::planner::ExprPlanner>)
                    .chain(datafusion::execution::SessionStateDefaults::default_expr_planners())
                    .collect(),
                )
                .with_optimizer_rule(Arc::new(optimizer::first_row::FirstRowPerPartition))
                .with_optimizer_rule(Arc::new(
                    optimizer::merge_aggregates::MergeStackedAggregates,
                ))
                .with_optimizer_rule(Arc::new(optimizer::distinct_inputs::DistinctInputsFirst))
                .with_physical_optimizer_rules(optimizer::physical_optimizer_rules())
                .build(),
        );
        ctx.register_udf(functions::date_trunc());
        ctx.register_udf(crate::rounding::floor());
        ctx.register_udf(crate::rounding::ceil());
        ctx.register_udaf(median::median());
        ctx.register_udaf(median::percentile_cont());
        ctx.register_udaf(crate::by_key::arg_max());
        ctx.register_udaf(crate::by_key::arg_min());
        // DuckDB's, Spark's and BigQuery's name for DataFusion's `approx_distinct`, so a query
        // written for them runs here unchanged.
        ctx.register_udaf(
            datafusion::functions_aggregate::approx_distinct::approx_distinct_udaf()
                .as_ref()
                .clone()
                .with_aliases(["approx_count_distinct"]),
        );
        for f in functions::size_capped(self.limits.memory_bytes) {
            ctx.register_udf(f);
        }

        for table in Table::ALL {
            ctx.register_table(
                table.stored_sql_name(),
                Arc::new(StoreTable::new(self.store.clone(), table)),
            )
            .map_err(|e| Error::Execution(e.to_string()))?;
        }
        // Each rollup is a view merging its partial rows into one exact row per bucket.
        for table in Table::ALL {
            if let Some(select) = table.rollup_view_sql(&table.stored_sql_name()) {
                let plan = perch_planner::plan(&ctx.state(), &select)
                    .await
                    .map_err(|e| Error::Execution(format!("rollup view {}: {e}", table.name())))?;
                ctx.register_table(table.name(), Arc::new(ViewTable::new(plan, Some(select))))
                    .map_err(|e| Error::Execution(e.to_string()))?;
            }
        }
        for (name, table) in self.live.iter() {
            ctx.register_table(
                name.as_str(),
                Arc::new(LiveProvider {
                    table: table.clone(),
                    name: name.clone(),
                }),
            )
            .map_err(|e| Error::Execution(e.to_string()))?;
        }
        for (name, select) in self.views.iter() {
            let plan = perch_planner::plan(&ctx.state(), select)
                .await
                .map_err(|e| Error::Execution(format!("view {name} does not plan: {e}")))?;
            ctx.register_table(
                name.as_str(),
                Arc::new(ViewTable::new(plan, Some(select.clone()))),
            )
            .map_err(|e| Error::Execution(e.to_string()))?;
        }
        Ok(ctx.state())
    }

    /// Runs one read-only statement for `user` (an operator when `operator`): it waits for
    /// one of the server's SQL slots (the wait counts against its timeout), within the user's
    /// share of them ([`budget`](crate::budget)), and its memory counts against the server's
    /// budget as well as its own limit.
    #[inline(never)]
    pub fn query_as<'a>(
        &'a self,
        sql: &'a str,
        user: &'a str,
        operator: bool,
    ) -> BoxFuture<'a, Result<QueryOutput>> {
        Box::pin(self.query_inner(sql, Asker::user(user, operator)))
    }

    /// [`SqlEngine::query_as`] for no user in particular (tests, benchmarks): held only to
    /// the cap on all queries, not to a user's share. Front ends that answer users call
    /// `query_as`.
    #[inline(never)]
    pub fn query<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<QueryOutput>> {
        Box::pin(self.query_inner(sql, Asker::anyone()))
    }

    #[tracing::instrument(name = "sql.query", skip_all, fields(db.query.text = &sql[..sql.floor_char_boundary(2048)]))]
    async fn query_inner(&self, sql: &str, asker: Asker) -> Result<QueryOutput> {
        let deadline = tokio::time::Instant::now() + self.limits.timeout;
        let caller = asker.name.clone().map(|user| crate::live::Caller {
            user,
            operator: asker.operator,
        });
        let slot = self.budget.slot(asker, deadline, || self.timeout()).await?;
        self.run(sql, deadline, Some(slot), caller).await
    }

    /// Runs one read-only statement for perch itself (alert rules, the accounting fold):
    /// under its own limits, with no slot to wait for, so users' queries cannot hold up
    /// alerting.
    #[inline(never)]
    pub fn query_internal<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<QueryOutput>> {
        Box::pin(self.query_internal_inner(sql))
    }

    async fn query_internal_inner(&self, sql: &str) -> Result<QueryOutput> {
        let deadline = tokio::time::Instant::now() + self.limits.timeout;
        self.run(sql, deadline, None, None).await
    }

    /// Plans and executes `sql` on its slot's runtime (perch's own queries on [`sql_runtime`]),
    /// so neither a CPU-heavy plan nor its execution can starve the caller's runtime (the
    /// server's health probes and agent syncs share its workers) or another user's query; at
    /// the deadline the work is aborted and the caller answered. A user's slot is held until
    /// the work has really stopped.
    async fn run(
        &self,
        sql: &str,
        deadline: tokio::time::Instant,
        slot: Option<Slot>,
        caller: Option<crate::live::Caller>,
    ) -> Result<QueryOutput> {
        let engine = self.clone();
        let sql = sql.to_owned();
        let pool = if slot.is_some() {
            self.budget.pool(self.limits.memory_bytes)
        } else {
            Budget::own_pool(self.limits.memory_bytes)
        };
        let runtime = slot
            .as_ref()
            .map_or_else(|| sql_runtime().clone(), |s| s.runtime().clone());
        let work = runtime.spawn(async move {
            let _slot = slot;
            let df = engine.prepare(&sql, pool.clone(), caller).await;
            let result = match df {
                Ok(df) => execute(df, engine.limits.max_rows, pool.clone()).await,
                Err(e) => Err(e),
            };
            if result.is_err() {
                released(&pool).await;
            }
            result.map_err(|e| engine.map_error(e, &pool))
        });
        let abort = work.abort_handle();
        match tokio::time::timeout_at(deadline, work).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(Error::Execution(format!(
                "the query's execution failed: {e}"
            ))),
            Err(_) => {
                abort.abort();
                Err(self.timeout())
            }
        }
    }

    fn timeout(&self) -> Error {
        Error::Timeout {
            limit_s: self.limits.timeout.as_secs_f64(),
        }
    }

    /// Plans `sql` into a DataFrame ready to execute.
    async fn prepare(
        &self,
        sql: &str,
        pool: Arc<QueryPool>,
        caller: Option<crate::live::Caller>,
    ) -> Result<datafusion::dataframe::DataFrame, Failure> {
        if sql.trim().is_empty() {
            return Err(Failure::Perch(Error::BadQuery("the query is empty; send one SQL statement such as SELECT count(*) FROM gpu_samples".into())));
        }
        let ctx = self.session(pool).await.map_err(Failure::Perch)?;
        if let Some(caller) = caller {
            // Live tables of private rows show the caller its own ([`crate::live::Caller`]).
            ctx.state_ref()
                .write()
                .config_mut()
                .set_extension(Arc::new(caller));
        }
        let plan = self.plan(&ctx, sql).await?;
        let default_rows = ctx.state().config().batch_size();
        if let Some(rows) =
            functions::batch_rows_for(&ctx.state(), &plan, self.limits.memory_bytes, default_rows)?
        {
            ctx.state_ref()
                .write()
                .config_mut()
                .options_mut()
                .execution
                .batch_size = datafusion::config::ConfigNonZeroUsize::try_new(rows)?;
        }
        Ok(ctx.execute_logical_plan(plan).await?)
    }

    /// The columns `sql` would return, without running it: planned in a fresh session and
    /// checked read-only exactly like [`SqlEngine::query_as`], under the same timeout. Clients
    /// of the PostgreSQL protocol ask for this before they execute (Parse, Describe).
    ///
    /// Like a query it takes one of the users' slots, within `user`'s share, and runs on its
    /// runtime, so a client that only ever asks to describe (psql's Parse) is held to the same
    /// cap.
    #[inline(never)]
    pub fn describe_as<'a>(
        &'a self,
        sql: &'a str,
        user: &'a str,
        operator: bool,
    ) -> BoxFuture<'a, Result<SchemaRef>> {
        Box::pin(self.describe_inner(sql, Asker::user(user, operator)))
    }

    /// [`SqlEngine::describe_as`] for no user in particular, like [`SqlEngine::query`].
    #[inline(never)]
    pub fn describe<'a>(&'a self, sql: &'a str) -> BoxFuture<'a, Result<SchemaRef>> {
        Box::pin(self.describe_inner(sql, Asker::anyone()))
    }

    async fn describe_inner(&self, sql: &str, asker: Asker) -> Result<SchemaRef> {
        let deadline = tokio::time::Instant::now() + self.limits.timeout;
        let slot = self.budget.slot(asker, deadline, || self.timeout()).await?;
        let runtime = slot.runtime().clone();
        let engine = self.clone();
        let sql = sql.to_owned();
        let work = runtime.spawn(async move {
            let _slot = slot;
            let pool = engine.budget.pool(engine.limits.memory_bytes);
            let ctx = engine.session(pool.clone()).await?;
            let plan = engine
                .plan(&ctx, &sql)
                .await
                .map_err(|e| engine.map_error(e, &pool))?;
            Ok(strings::plain_schema(plan.schema().as_arrow()))
        });
        let abort = work.abort_handle();
        match tokio::time::timeout_at(deadline, work).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(Error::Execution(format!("planning the query failed: {e}"))),
            Err(_) => {
                abort.abort();
                Err(self.timeout())
            }
        }
    }

    /// Refuses a statement longer or deeper than [`QueryLimits`] allow ([`crate::guard`]),
    /// before anything parses it. Every query is checked; a front end that parses the text
    /// itself (the PostgreSQL catalog rewrite) checks first, and parses on [`sql_runtime`].
    pub fn check(&self, sql: &str) -> Result<()> {
        crate::guard::check_statement(
            sql,
            self.limits.max_statement_bytes,
            self.limits.max_expression_depth,
        )
    }

    async fn plan(&self, ctx: &SessionContext, sql: &str) -> Result<LogicalPlan, Failure> {
        // Checked first: nothing may read a statement past the length bound word by word.
        self.check(sql).map_err(Failure::Perch)?;
        let shown;
        let sql = if is_show_tables(sql) {
            shown = SHOW_TABLES.to_owned();
            shown.as_str()
        } else {
            sql
        };
        let plan = perch_planner::plan(&ctx.state(), sql).await?;
        // Analysed (types coerced) here, so that its schema is what execution yields: before
        // coercion `CASE WHEN .. THEN 0 ELSE <float> END` is typed by its first branch
        // (Int64), and clients told Int64 read the floats' bits. Execution analyses it again,
        // which changes nothing.
        let state = ctx.state();
        let plan = state
            .analyzer()
            .execute_and_check(plan, state.config_options(), |_, _| {})?;
        check_read_only(&plan).map_err(Failure::Perch)?;
        crate::guard::plan_depth(&plan, self.limits.max_expression_depth)
            .map_err(Failure::Perch)?;
        Ok(plan)
    }

    /// A failure as perch's error; a query refused memory by the server's budget rather than
    /// its own limit is told the server is busy.
    fn map_error(&self, e: Failure, pool: &QueryPool) -> Error {
        match e {
            Failure::Perch(e) => e,
            Failure::Engine(e) => {
                match map_error(e, self.limits.memory_bytes, &self.public_table_names()) {
                    Error::ResourcesExhausted { .. } if pool.server_refused() => {
                        Error::Busy(format!(
                            "the server's SQL memory budget ({} MiB for all queries) is taken by other queries; retry shortly, or narrow the query",
                            pool.server_bytes() >> 20
                        ))
                    }
                    other => other,
                }
            }
        }
    }
}

/// How a query can fail before it is mapped to perch's error: by perch's own checks or in
/// DataFusion.
enum Failure {
    Perch(Error),
    Engine(DataFusionError),
}

impl From<DataFusionError> for Failure {
    fn from(e: DataFusionError) -> Self {
        Failure::Engine(e)
    }
}

/// DataFusion's error as perch's: a user's mistake (with a message that says what to change,
/// naming the tables when one is unknown), the memory limit, or a failure.
fn map_error(e: DataFusionError, memory_bytes: usize, names: &[String]) -> Error {
    use crate::live::LiveError;
    match e.find_root() {
        DataFusionError::External(inner) if inner.is::<LiveError>() => {
            match inner.downcast_ref::<LiveError>() {
                Some(LiveError::NoRoom { table, .. }) => Error::ResourcesExhausted {
                    limit_mb: memory_bytes >> 20,
                    table: Some(table.clone()),
                },
                _ => Error::Execution(inner.to_string()),
            }
        }
        DataFusionError::ResourcesExhausted(_) => Error::ResourcesExhausted {
            limit_mb: memory_bytes >> 20,
            table: None,
        },
        DataFusionError::SQL(..)
        | DataFusionError::Plan(_)
        | DataFusionError::SchemaError(..)
        | DataFusionError::NotImplemented(_)
        | DataFusionError::ArrowError(..)
        | DataFusionError::Execution(_)
        | DataFusionError::Configuration(_)
        | DataFusionError::Diagnostic(..) => Error::BadQuery(clean_message(&e, names)),
        other => Error::Execution(other.to_string()),
    }
}

/// Waits (2 s at most) until a failed query's operators have given back their memory: the
/// tasks a plan spawned (repartitioning, merging partitions) are aborted when its stream is
/// dropped and let go of their reservations at their next await, after the error is already
/// known. Answering only then keeps the server's budget true when the caller hears of the
/// failure, and the slot held until the work has really stopped.
async fn released(pool: &Arc<crate::budget::QueryPool>) {
    use datafusion::execution::memory_pool::MemoryPool;
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    while pool.reserved() > 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// The runtime perch's own queries (alert rules, the accounting fold) run on: its own worker threads (`perch-sql`), as many as the machine has
/// cores, so SQL gets the CPU it can use without taking the server's workers. Users' queries
/// run on their slots' runtimes.
pub fn sql_runtime() -> &'static tokio::runtime::Handle {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name("perch-sql")
                // Perch's own statements are bounded like users' (`query.max_expression_depth`,
                // at most its largest setting).
                .thread_stack_size(crate::guard::stack_bytes(crate::guard::MAX_MAX_DEPTH))
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("cannot start the SQL runtime: {e}"))
        })
        .handle()
}

/// Executes a planned query and collects its result, up to the row cap.
async fn execute(
    df: datafusion::dataframe::DataFrame,
    max_rows: usize,
    pool: Arc<QueryPool>,
) -> Result<QueryOutput, Failure> {
    let schema = strings::plain_schema(df.schema().as_arrow());
    let mut stream = df.execute_stream().await?;
    // The rows collected count against the query's memory like its operators' state: a
    // result of 100,000 rows of megabyte strings is refused, not built.
    let pool: Arc<dyn MemoryPool> = pool;
    let held = MemoryConsumer::new("perch query result").register(&pool);
    let mut batches = Vec::new();
    let mut rows = 0usize;
    let mut truncated = false;
    while let Some(batch) = stream.next().await {
        let batch = strings::plain_batch(batch?).map_err(|e| {
            Failure::Perch(Error::Execution(format!(
                "converting the result's strings: {e}"
            )))
        })?;
        let room = max_rows - rows;
        held.try_grow(batch.get_array_memory_size())?;
        if batch.num_rows() > room {
            batches.push(batch.slice(0, room));
            rows += room;
            truncated = true;
            break;
        }
        rows += batch.num_rows();
        batches.push(batch);
    }
    Ok(QueryOutput {
        schema,
        batches,
        rows,
        truncated,
        _held: Some(held),
    })
}

/// How the stored rows of a rollup are named beside its merged view.
const PARTIAL_SUFFIX: &str = "_partial";

/// What `SHOW TABLES` runs: DataFusion's own listing lists the rollups' stored `_partial` rows
/// and comes in no particular order; this one leaves them out and sorts.
const SHOW_TABLES: &str = "SELECT table_catalog, table_schema, table_name, table_type \
     FROM information_schema.tables \
     WHERE NOT (table_schema = 'public' AND ends_with(table_name, '_partial')) \
     ORDER BY table_schema, table_name";

/// `SHOW TABLES`, in any case and spacing, with or without a semicolon.
fn is_show_tables(sql: &str) -> bool {
    let mut words = sql.trim().trim_end_matches(';').split_whitespace();
    let mut next = |want: &str| words.next().is_some_and(|w| w.eq_ignore_ascii_case(want));
    next("show") && next("tables") && words.next().is_none()
}

/// Refuses DDL, DML (INSERT, COPY...) and statements such as SET: perch's SQL is read-only
/// on every protocol.
pub fn check_read_only(plan: &LogicalPlan) -> Result<()> {
    SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false)
        .verify_plan(plan)
        .map_err(|e| {
            Error::ReadOnly(format!(
                "perch's SQL is read-only ({}); use SELECT, WITH, SHOW or EXPLAIN",
                e.find_root()
            ))
        })
}

/// DataFusion prefixes messages with its error kind and sometimes wraps them in context;
/// keep the part that tells the user what to change, and show the right form of a time
/// written wrong.
fn clean_message(e: &DataFusionError, names: &[String]) -> String {
    let message = cleaned(e, names);
    match time_hint(&message) {
        Some(hint) => format!("{message}; {hint}"),
        None => message,
    }
}

/// The right form of a time mistake `message` (a cleaned DataFusion message) reports: an
/// interval unit misspelled (`INTERVAL '5 minuts'`), an interval written as a bare string
/// (`now() - '5 minutes'`) or a number (`now() - 300`), a time compared with a number.
fn time_hint(message: &str) -> Option<&'static str> {
    if message.contains("Invalid input syntax for type interval")
        || message.contains("Invalid input syntax for type Interval")
    {
        return Some(
            "an interval is a number and a unit, such as INTERVAL '5 minutes' (units: \
             seconds, minutes, hours, days, weeks, months, years)",
        );
    }
    let arithmetic = message.contains("Cannot coerce arithmetic expression Timestamp")
        || message.contains("Cannot coerce arithmetic expression Date");
    let number = [
        "Int8", "Int16", "Int32", "Int64", "UInt", "Float", "Decimal",
    ]
    .iter()
    .any(|t| message.contains(&format!("- {t}")) || message.contains(&format!("+ {t}")));
    if arithmetic && number {
        return Some(
            "a number is not a duration: write now() - INTERVAL '300 seconds' \
             (or INTERVAL '5 minutes')",
        );
    }
    if arithmetic && (message.contains("Utf8") || message.contains("Null")) {
        return Some("write the duration as an interval: now() - INTERVAL '5 minutes'");
    }
    let comparison = message.contains("comparison operation Timestamp")
        || (message.contains("comparison operation") && message.contains("> Timestamp"))
        || (message.contains("comparison operation") && message.contains("< Timestamp"));
    if comparison {
        return Some(
            "compare a time with a time: time > now() - INTERVAL '5 minutes', or \
             time > TIMESTAMP '2026-01-31 12:00:00' (UTC)",
        );
    }
    None
}

/// [`clean_message`] without its hint.
fn cleaned(e: &DataFusionError, names: &[String]) -> String {
    let root = match e.find_root() {
        DataFusionError::SQL(parser, _) => parser.to_string(),
        other => other.to_string(),
    };
    if root.starts_with("Error during planning: table '") && root.ends_with("' not found") {
        return format!(
            "{}; the tables are {} (SHOW TABLES lists them, SHOW COLUMNS FROM <table> their columns)",
            &root["Error during planning: ".len()..],
            names.join(", ")
        );
    }
    for prefix in [
        "Arrow error: Parser error: ",
        "Error during planning: ",
        "SQL error: ",
        "Schema error: ",
        "Execution error: ",
        "This feature is not implemented: ",
    ] {
        if let Some(rest) = root.strip_prefix(prefix) {
            return rest.to_owned();
        }
    }
    root
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoreConfig;

    #[test]
    fn time_mistakes_get_the_right_form() {
        let check = |message: &str, want: Option<&str>| {
            let hint = time_hint(message);
            match want {
                Some(w) => assert!(hint.is_some_and(|h| h.contains(w)), "{message}: {hint:?}"),
                None => assert_eq!(hint, None, "{message}"),
            }
        };
        check(
            "Arrow error: Parser error: Invalid input syntax for type interval: \"5 minuts\"",
            Some("INTERVAL '5 minutes'"),
        );
        check(
            "Cannot coerce arithmetic expression Timestamp(ns) - Int64 to valid types",
            Some("INTERVAL '300 seconds'"),
        );
        check(
            "Cannot coerce arithmetic expression Timestamp(ns) - Utf8 to valid types",
            Some("now() - INTERVAL '5 minutes'"),
        );
        check(
            "Cannot infer common argument type for comparison operation Timestamp(ms, \"UTC\") > Int64",
            Some("time > now() - INTERVAL '5 minutes'"),
        );
        check("table 'gpu_sample' not found", None);
    }

    #[test]
    fn file_statistics_are_read_once_across_queries() {
        const DAY_MS: i64 = 86_400_000;
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(StoreConfig::new(dir.path())).expect("open");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let day0 = 1_800_000_000_000 / DAY_MS * DAY_MS;
        rt.block_on(async {
            for day in 0..3 {
                let batch = perch_model::Batch {
                    gpus: vec![perch_model::GpuSample {
                        time_ms: day0 + i64::try_from(day).expect("day") * DAY_MS,
                        uuid: "GPU-0".into(),
                        model: "Test".into(),
                        ..perch_model::GpuSample::default()
                    }],
                    ..perch_model::Batch::new(
                        perch_model::NodeId::new("n1").expect("node"),
                        day + 1,
                    )
                };
                let raw = bytes::Bytes::from(serde_json::to_vec(&batch).expect("json"));
                store.ingest(raw, &batch).await.expect("ingest");
                store.flush().await.expect("flush");
            }
        });
        let engine = SqlEngine::new(store, QueryLimits::default());
        let statistics = engine
            .caches
            .as_ref()
            .and_then(|c| c.get_file_statistic_cache())
            .expect("a statistics cache");
        // A time filter keeps two of the three files: each query plans a new listing table.
        let sql = format!(
            "SELECT count(*) FROM gpu_samples WHERE time >= to_timestamp_millis({})",
            day0 + DAY_MS
        );
        for _ in 0..2 {
            let out = rt.block_on(engine.query(&sql)).expect("query");
            assert_eq!(out.rows, 1);
            assert_eq!(statistics.len(), 2, "each file's statistics read once");
        }
    }

    /// A result's declared column types are its rows' types, so clients (the CLI's table,
    /// psql's RowDescription) read the values as what they are. Before coercion a CASE is
    /// typed by its first branch: `THEN 0 ELSE 1.5` was declared Int64 over Float64 rows.
    #[test]
    fn declared_types_are_the_rows_types() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(StoreConfig::new(dir.path())).expect("open");
        let engine = SqlEngine::new(store, QueryLimits::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        for sql in [
            "SELECT CASE WHEN 1 > 2 THEN 0 ELSE 1.5 END AS x",
            "SELECT CASE WHEN random() > 2 THEN 0 ELSE random() END AS x",
            "SELECT coalesce(NULL, 1, 2.5) AS x",
            "SELECT CASE WHEN sum(power_watts) < 0 THEN 0 ELSE sum(power_watts) END AS x FROM gpu_samples",
            "SELECT 1 AS x UNION ALL SELECT 2.5",
        ] {
            let out = rt.block_on(engine.query(sql)).expect(sql);
            let declared = out.schema.field(0).data_type().clone();
            for batch in &out.batches {
                assert_eq!(
                    batch.column(0).data_type(),
                    &declared,
                    "{sql}: rows vs declared"
                );
            }
            assert_eq!(declared, arrow::datatypes::DataType::Float64, "{sql}");
            let described = rt.block_on(engine.describe(sql)).expect(sql);
            assert_eq!(
                described.field(0).data_type(),
                &declared,
                "{sql}: described"
            );
        }
    }

    #[test]
    fn the_start_starts_the_runtime_the_first_query_runs_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(StoreConfig::new(dir.path())).expect("open");
        let limits = QueryLimits {
            max_concurrent: 3,
            ..QueryLimits::default()
        };
        let engine = SqlEngine::new(store, limits);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        assert_eq!(engine.budget.started_runtimes(), vec![false; 3]);
        rt.block_on(engine.check_views()).expect("views");
        assert_eq!(engine.budget.started_runtimes(), vec![true, false, false]);
        rt.block_on(engine.query("SELECT 1")).expect("query");
        assert_eq!(
            engine.budget.started_runtimes(),
            vec![true, false, false],
            "the first query ran on the runtime the start started"
        );
    }
}
