"""perch's accounting answers, computed by Apache Spark straight from the files perch writes.

    python3 tests/accounting_spark.py DATA_DIR [--config perch.toml] [--until TIME]
                                      [--usage telemetry|settled|both] [--store URL]
                                      [--settled URL] [--master local[2]]

The recipe of docs/spark.md. DATA_DIR is perch's data directory: a local path, or any URL
Spark's Hadoop file systems read (`s3a://bucket/prefix` with hadoop-aws on the class path). It
reads, with Spark and nothing else:

- the telemetry: the Parquet files `manifest.json` lists for `gpu_samples` and `events`
  (`<store>/tables/<table>/date=YYYY-MM-DD/*.parquet`; `--store` where the store is in a
  bucket, once per store where several servers write their own; default DATA_DIR). Only listed
  files: one a compaction replaced can lie beside them for a while, and reading it too would
  count its rows twice;
- the settled jobs and their allocations: `<settled>/<lo>-<hi>.{jobs,allocations}.parquet`
  (default DATA_DIR/control/settled), the whole pairs not inside a wider pair's range, as perch
  itself reads them.

Then it runs the Spark SQL below (the statements docs/spark.md shows) and prints one JSON
object: for each source of usage asked for ("telemetry": what each allocated GPU did, from the
raw `gpu_samples` rows; "settled": the figures perch folded, as the settled rows hold them),
the rows of `job_allocations` (figures and costs), `job_costs`, `account_usage`, `user_usage`,
`top_users` and `cluster_utilization_daily` (node states from the `events` table, up to
`--until`, default now); then the inputs' sizes and the time Spark took. Prices are the
`[accounting]` section of perch's config file, as the server applies them (`--gpu-price`,
`--model-price MODEL=PRICE` and `--energy-price` override it). tests/spark.rs compares every
figure with perch's SQL. Exits non-zero (never skips) without pyspark or a Java runtime.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import time


def fail(message):
    print(f"accounting_spark.py: {message}", file=sys.stderr)
    sys.exit(2)


try:
    from pyspark.sql import SparkSession
except ImportError:
    fail("pyspark is not installed: `pip install pyspark` (scripts/test.sh installs it)")

# The columns each settled file must have (docs/schema.md, `jobs` and `job_allocations`).
SETTLED_COLUMNS = {
    "jobs": ["job", "user_name", "account", "attempts"],
    "allocations": [
        "job", "attempt", "node", "gpu", "gpu_model", "start_time", "end_time",
        "accounted_until", "gpu_seconds_allocated", "gpu_seconds_accounted", "gpu_seconds_used",
        "utilization_peak_pct", "memory_peak_bytes", "energy_joules", "samples",
    ],
}
SETTLED_NAME = re.compile(r"^(\d{10})-(\d{10})\.(jobs|allocations)\.parquet$")
# The store format versions whose files this recipe reads (docs/format/manifest.md).
STORE_VERSIONS = (1, 2, 3)

# --- The recipe: Spark SQL over the views `gpu_samples`, `events`, `settled_jobs`,
# `settled_allocations`, `params` (until_ms, default_per_hour, energy_per_kwh) and
# `model_prices` (gpu_model, per_hour). docs/spark.md shows each statement; tests/spark.rs
# checks that every SQL block there is here, word for word.

ALLOCATIONS = """
CREATE OR REPLACE TEMP VIEW allocations AS
SELECT CAST(job AS BIGINT) AS job, CAST(attempt AS BIGINT) AS attempt, node,
       CAST(gpu AS BIGINT) AS gpu, gpu_model,
       unix_millis(start_time) AS start_ms, unix_millis(end_time) AS end_ms,
       -- where the folded telemetry ends: accounted_until, not past the end
       greatest(least(unix_millis(accounted_until),
                      coalesce(unix_millis(end_time), unix_millis(accounted_until))),
                unix_millis(start_time)) AS fold_end_ms,
       gpu_seconds_allocated AS allocated_s, gpu_seconds_accounted, gpu_seconds_used,
       utilization_peak_pct, CAST(memory_peak_bytes AS BIGINT) AS memory_peak_bytes,
       energy_joules, CAST(samples AS BIGINT) AS samples
FROM settled_allocations
"""

GPU_USAGE_TELEMETRY = """
CREATE OR REPLACE TEMP VIEW gpu_usage AS
WITH folded AS (
  SELECT a.job, a.attempt, a.node, a.gpu, a.gpu_model, a.start_ms, a.end_ms, a.fold_end_ms,
         a.allocated_s, (a.fold_end_ms - a.start_ms) / 1000D AS folded_s,
         -- a share of a GPU is allocated its fraction of the time
         coalesce(a.allocated_s < (a.end_ms - a.start_ms) / 1000D, false) AS share,
         count(s.time) AS samples,
         avg(s.utilization_gpu_pct) AS util_mean, max(s.utilization_gpu_pct) AS util_peak,
         max(CAST(s.memory_used_bytes AS BIGINT)) AS memory_peak,
         min(s.energy_joules) AS energy_min, max(s.energy_joules) AS energy_max,
         -- the stretch the counter's readings span
         (max(IF(s.energy_joules IS NULL, NULL, unix_millis(s.time)))
           - min(IF(s.energy_joules IS NULL, NULL, unix_millis(s.time)))) / 1000D AS energy_span_s,
         avg(s.power_watts) AS power_mean
  FROM allocations a
  LEFT JOIN gpu_samples s
    ON s.node = a.node AND CAST(s.gpu AS BIGINT) = a.gpu
   AND unix_millis(s.time) >= a.start_ms AND unix_millis(s.time) < a.fold_end_ms
  GROUP BY a.job, a.attempt, a.node, a.gpu, a.gpu_model, a.start_ms, a.end_ms, a.fold_end_ms,
           a.allocated_s)
SELECT job, attempt, node, gpu, gpu_model, start_ms, end_ms, fold_end_ms, allocated_s, samples,
       -- a share's telemetry is the whole GPU's: not split among the jobs sharing it
       IF(share, NULL, folded_s * util_mean / 100D) AS used_s,
       IF(share OR util_mean IS NULL, NULL, folded_s) AS accounted_s,
       IF(share, NULL, util_peak) AS peak,
       IF(share, NULL, memory_peak) AS memory,
       -- the counter's rise, plus mean power (else its own rate) over what it does not span;
       -- read once or never: mean power x time
       CASE WHEN share THEN NULL
            WHEN energy_span_s > 0D
              THEN greatest(energy_max - energy_min, 0D)
                   + coalesce(power_mean, greatest(energy_max - energy_min, 0D) / energy_span_s)
                     * greatest(folded_s - energy_span_s, 0D)
            ELSE power_mean * folded_s END AS energy
FROM folded
"""

GPU_USAGE_SETTLED = """
CREATE OR REPLACE TEMP VIEW gpu_usage AS
SELECT job, attempt, node, gpu, gpu_model, start_ms, end_ms, fold_end_ms, allocated_s, samples,
       gpu_seconds_used AS used_s, gpu_seconds_accounted AS accounted_s,
       utilization_peak_pct AS peak, memory_peak_bytes AS memory, energy_joules AS energy
FROM allocations
"""

GPU_COSTS = """
CREATE OR REPLACE TEMP VIEW gpu_costs AS
SELECT u.*,
       u.allocated_s / 3600D * coalesce(m.per_hour, p.default_per_hour)
         + coalesce(u.energy, 0D) / 3.6e6 * p.energy_per_kwh AS cost_allocated,
       u.used_s / 3600D * coalesce(m.per_hour, p.default_per_hour)
         + coalesce(u.energy, 0D) / 3.6e6 * p.energy_per_kwh AS cost_used,
       u.accounted_s / 3600D * coalesce(m.per_hour, p.default_per_hour)
         + coalesce(u.energy, 0D) / 3.6e6 * p.energy_per_kwh AS cost_accounted
FROM gpu_usage u
CROSS JOIN params p
LEFT JOIN model_prices m ON m.gpu_model = u.gpu_model
"""

JOB_TOTALS = """
CREATE OR REPLACE TEMP VIEW job_totals AS
SELECT j.job, j.user_name, j.account,
       coalesce(sum(c.allocated_s), 0D) AS allocated_s, sum(c.accounted_s) AS accounted_s,
       sum(c.used_s) AS used_s, sum(c.energy) AS energy,
       coalesce(sum(c.cost_allocated), 0D) AS cost_allocated, sum(c.cost_used) AS cost_used,
       sum(c.cost_accounted) AS cost_accounted
FROM (SELECT CAST(job AS BIGINT) AS job, user_name, account
      FROM settled_jobs WHERE attempts > 0) j
LEFT JOIN gpu_costs c ON c.job = j.job
GROUP BY j.job, j.user_name, j.account
"""

JOB_ALLOCATIONS = """
SELECT job, attempt, node, gpu, samples, allocated_s AS gpu_seconds_allocated,
       accounted_s AS gpu_seconds_accounted, used_s AS gpu_seconds_used,
       100D * used_s / nullif(accounted_s, 0D) AS utilization_mean_pct,
       peak AS utilization_peak_pct, memory AS memory_peak_bytes, energy AS energy_joules,
       cost_allocated, cost_used, cost_accounted,
       IF(cost_accounted < cost_used, 0D, cost_accounted - cost_used) AS idle_cost
FROM gpu_costs
"""

JOB_COSTS = """
SELECT job, user_name, account,
       allocated_s / 3600D AS gpu_hours_allocated, accounted_s / 3600D AS gpu_hours_accounted,
       used_s / 3600D AS gpu_hours_used,
       used_s / nullif(accounted_s, 0D) AS efficiency, energy / 3600000D AS energy_kwh,
       cost_allocated, cost_accounted, cost_used,
       IF(cost_accounted < cost_used, 0D, cost_accounted - cost_used) AS idle_cost
FROM job_totals
"""

ACCOUNT_USAGE = """
SELECT account, user_name, count(*) AS jobs,
       sum(allocated_s) / 3600D AS gpu_hours_allocated,
       sum(accounted_s) / 3600D AS gpu_hours_accounted, sum(used_s) / 3600D AS gpu_hours_used,
       sum(used_s) / nullif(sum(accounted_s), 0D) AS efficiency,
       sum(cost_allocated) AS cost_allocated, sum(cost_accounted) AS cost_accounted,
       sum(cost_used) AS cost_used,
       IF(sum(cost_accounted) < sum(cost_used), 0D,
          sum(cost_accounted) - sum(cost_used)) AS idle_cost
FROM job_totals
GROUP BY account, user_name
"""

USER_USAGE = """
SELECT user_name, count(*) AS jobs,
       sum(allocated_s) / 3600D AS gpu_hours_allocated,
       sum(accounted_s) / 3600D AS gpu_hours_accounted, sum(used_s) / 3600D AS gpu_hours_used,
       sum(used_s) / nullif(sum(accounted_s), 0D) AS efficiency,
       sum(cost_allocated) AS cost_allocated, sum(cost_accounted) AS cost_accounted,
       sum(cost_used) AS cost_used,
       IF(sum(cost_accounted) < sum(cost_used), 0D,
          sum(cost_accounted) - sum(cost_used)) AS idle_cost
FROM job_totals
GROUP BY user_name
"""

TOP_USERS = """
SELECT user_name, sum(allocated_s) / 3600D AS gpu_hours_allocated
FROM job_totals
GROUP BY user_name
ORDER BY gpu_hours_allocated DESC, user_name
LIMIT 10
"""

NODE_SPANS = """
CREATE OR REPLACE TEMP VIEW node_spans AS
WITH e AS (
  SELECT node, kind, unix_millis(time) AS t, IF(kind = 'node_joined', 0, 1) AS ord,
         try_cast(regexp_extract(message, ' joined with ([0-9]+) ', 1) AS BIGINT) AS joined_gpus
  FROM events
  WHERE kind IN ('node_joined', 'node_down', 'node_up', 'node_drained', 'node_resumed')
    AND node IS NOT NULL),
flags AS (
  SELECT node, t, max(joined_gpus) OVER (PARTITION BY node) AS gpus,
         coalesce(last(CASE kind WHEN 'node_down' THEN true
                                 WHEN 'node_up' THEN false WHEN 'node_joined' THEN false END, true)
           OVER (PARTITION BY node ORDER BY t, ord
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), false) AS down,
         coalesce(last(CASE kind WHEN 'node_drained' THEN true WHEN 'node_resumed' THEN false END,
                       true)
           OVER (PARTITION BY node ORDER BY t, ord
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), false) AS drained,
         row_number() OVER (PARTITION BY node, t ORDER BY ord DESC) AS nth
  FROM e),
states AS (
  -- the state after the last event of each instant; down wins over drained
  SELECT node, gpus, t,
         CASE WHEN down THEN 'down' WHEN drained THEN 'drained' ELSE 'up' END AS state,
         lag(CASE WHEN down THEN 'down' WHEN drained THEN 'drained' ELSE 'up' END)
           OVER (PARTITION BY node ORDER BY t) AS before
  FROM flags WHERE nth = 1)
SELECT node, gpus, state, least(t, p.until_ms) AS start_ms,
       least(coalesce(lead(t) OVER (PARTITION BY node ORDER BY t), p.until_ms),
             p.until_ms) AS end_ms
FROM states CROSS JOIN params p
WHERE (before IS NULL OR before <> state) AND gpus IS NOT NULL
"""

CAPACITY_PIECES = """
CREATE OR REPLACE TEMP VIEW capacity_pieces AS
WITH gpus AS (
  SELECT node, explode(sequence(0L, gpus - 1)) AS gpu
  FROM (SELECT DISTINCT node, gpus FROM node_spans)),
held AS (
  SELECT a.node, a.gpu, least(a.start_ms, p.until_ms) AS a,
         least(coalesce(a.end_ms, p.until_ms), p.until_ms) AS b
  FROM allocations a CROSS JOIN params p),
points AS (
  SELECT s.node, g.gpu, s.start_ms AS t, 0 AS delta, s.state
  FROM node_spans s JOIN gpus g USING (node)
  UNION ALL
  SELECT s.node, g.gpu, s.end_ms, 0, NULL FROM node_spans s JOIN gpus g USING (node)
  UNION ALL
  SELECT node, gpu, a, 1, NULL FROM held WHERE a < b
  UNION ALL
  SELECT node, gpu, b, -1, NULL FROM held WHERE a < b),
instants AS (
  SELECT node, gpu, t, sum(delta) AS delta, max(state) AS state FROM points GROUP BY node, gpu, t),
walked AS (
  SELECT node, gpu, t,
         sum(delta) OVER (PARTITION BY node, gpu ORDER BY t
                          ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS holding,
         last(state, true) OVER (PARTITION BY node, gpu ORDER BY t
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS state,
         lead(t) OVER (PARTITION BY node, gpu ORDER BY t) AS next
  FROM instants)
-- each stretch of one GPU: allocated while a job holds it, else its node's state
SELECT node, gpu, t AS a, next AS b, IF(holding > 0, 'allocated', state) AS class
FROM walked
WHERE next IS NOT NULL AND state IS NOT NULL AND t < next
"""

DAILY = """
WITH pieces AS (
  SELECT day, class, least(b, (day + 1) * 86400000) - greatest(a, day * 86400000) AS ms
  FROM capacity_pieces
  LATERAL VIEW explode(sequence(floor(a / 86400000), floor((b - 1) / 86400000))) d AS day),
folded AS (
  SELECT u.used_s, u.start_ms AS a, least(u.end_ms, p.until_ms, u.fold_end_ms) AS b
  FROM gpu_costs u CROSS JOIN params p
  WHERE u.used_s IS NOT NULL AND u.start_ms < least(u.end_ms, p.until_ms, u.fold_end_ms)),
used AS (
  -- each allocation's used GPU-seconds, spread evenly over its folded time
  SELECT day, sum(used_s / (b - a) * (least(b, (day + 1) * 86400000)
                                     - greatest(a, day * 86400000))) AS used_s,
         -- and the folded time itself, what used is measured against
         sum((least(b, (day + 1) * 86400000) - greatest(a, day * 86400000)) / 1000D)
           AS accounted_s
  FROM folded
  LATERAL VIEW explode(sequence(floor(a / 86400000), floor((b - 1) / 86400000))) d AS day
  GROUP BY day),
classes AS (
  SELECT day, sum(ms) AS capacity_ms, sum(IF(class = 'allocated', ms, 0)) AS allocated_ms,
         sum(IF(class = 'up', ms, 0)) AS idle_ms, sum(IF(class = 'drained', ms, 0)) AS drained_ms,
         sum(IF(class = 'down', ms, 0)) AS down_ms
  FROM pieces GROUP BY day),
days AS (
  SELECT explode(sequence(first_day, last_day)) AS day
  FROM (SELECT min(day) AS first_day, max(day) AS last_day
        FROM (SELECT day FROM classes UNION ALL SELECT day FROM used)))
SELECT d.day * 86400000 AS day_ms,
       coalesce(c.capacity_ms, 0) / 3.6e6 AS capacity_gpu_hours,
       coalesce(c.allocated_ms, 0) / 3.6e6 AS allocated_gpu_hours,
       coalesce(u.accounted_s, 0D) / 3600D AS accounted_gpu_hours,
       coalesce(u.used_s, 0D) / 3600D AS used_gpu_hours,
       coalesce(c.idle_ms, 0) / 3.6e6 AS idle_gpu_hours,
       coalesce(c.drained_ms, 0) / 3.6e6 AS drained_gpu_hours,
       coalesce(c.down_ms, 0) / 3.6e6 AS down_gpu_hours,
       100D * c.allocated_ms / nullif(c.capacity_ms, 0) AS allocated_pct
FROM days d LEFT JOIN classes c USING (day) LEFT JOIN used u USING (day)
"""


def arguments():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data_dir", help="perch's data directory: a path or a Hadoop URL (s3a://...)")
    p.add_argument("--store", action="append", default=[],
                   help="where manifest.json and tables/ are (default DATA_DIR); once per store "
                        "where several servers each write their own")
    p.add_argument("--settled",
                   help="the settled rows' directory (default DATA_DIR/control/settled)")
    p.add_argument("--config", help="perch's config file: prices from its [accounting]")
    p.add_argument("--gpu-price", type=float, help="per GPU-hour, models without their own price")
    p.add_argument("--model-price", action="append", default=[], metavar="MODEL=PRICE",
                   help="per GPU-hour for one model (as gpu_samples.model names it)")
    p.add_argument("--energy-price", type=float, help="per kWh of GPU energy")
    p.add_argument("--until",
                   help="'now' of the daily utilization: Unix ms or ISO 8601 (default now)")
    p.add_argument("--usage", choices=["telemetry", "settled", "both"], default="telemetry",
                   help="what each GPU used: recomputed from telemetry, or as perch folded it")
    p.add_argument("--master", help="Spark master (default local[2]; under spark-submit, its own)")
    return p.parse_args()


def prices_of(args):
    """(default per GPU-hour, {model: per GPU-hour}, per kWh): perch's defaults, then the
    config file's [accounting], then the flags."""
    default, models, energy = 0.95, {}, 0.0
    if args.config:
        import tomllib

        with open(args.config, "rb") as f:
            accounting = tomllib.load(f).get("accounting", {})
        default = float(accounting.get("gpu_price_per_hour", default))
        energy = float(accounting.get("energy_price_per_kwh", energy))
        models = {m: float(p) for m, p in accounting.get("gpu_prices", {}).items()}
    if args.gpu_price is not None:
        default = args.gpu_price
    if args.energy_price is not None:
        energy = args.energy_price
    for pair in args.model_price:
        model, _, price = pair.rpartition("=")
        models[model] = float(price)
    return default, models, energy


def until_ms(text):
    if text is None:
        return int(time.time() * 1000)
    if text.lstrip("-").isdigit():
        return int(text)
    t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return int(t.timestamp() * 1000)


def session(master):
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        fail("no Java runtime: Spark needs one (apt-get install default-jre-headless)")
    # Under spark-submit (which starts this script from its JVM) the master is spark-submit's.
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = "local[2]"
    builder = SparkSession.builder.appName("perch-accounting")
    if master is not None:
        builder = builder.master(master)
    # Days are UTC days, as perch's.
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    if master is not None and master.startswith("local"):
        # One machine, small inputs: no UI, a few shuffle partitions (not the default 200),
        # the driver on loopback.
        builder = (
            builder.config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def file_system(spark, url):
    path = spark._jvm.org.apache.hadoop.fs.Path(url)
    return path, path.getFileSystem(spark._jsc.hadoopConfiguration())


def names_in(spark, url):
    """The names of the files in directory `url` (none if it does not exist)."""
    path, fs = file_system(spark, url)
    if not fs.exists(path):
        return []
    return [s.getPath().getName() for s in fs.listStatus(path) if s.isFile()]


def read_manifest(spark, store):
    url = f"{store}/manifest.json"
    path, fs = file_system(spark, url)
    if not fs.exists(path):
        fail(f"{url} does not exist: is this perch's data directory (or --store its bucket)?")
    manifest = json.loads(spark.read.text(url, wholetext=True).first()[0])
    if manifest.get("version") not in STORE_VERSIONS:
        fail(f"the store is of format version {manifest.get('version')}; this recipe reads "
             f"versions {STORE_VERSIONS} (docs/format/manifest.md)")
    return manifest


def listed(manifest, store, table):
    """The files of `table` the manifest lists, with their rows."""
    return [(f"{store}/{e['path']}", e["rows"]) for e in manifest["files"].get(table, [])]


def register_table(spark, name, files, schema):
    """View `name` over the Parquet `files`, their schemas merged (an older file may lack a
    column added since: it reads as NULL); empty, of `schema`, when there are none."""
    if files:
        df = spark.read.option("mergeSchema", "true").parquet(*files)
    else:
        df = spark.createDataFrame([], schema)
    df.createOrReplaceTempView(name)


def settled_pairs(spark, url):
    """The settled rows' pairs perch itself reads: both files present, not inside a wider
    pair's range (what a merge cut short leaves), no `.tmp-` file."""
    found = {}
    for name in names_in(spark, url):
        m = SETTLED_NAME.match(name)
        if m:
            found.setdefault((int(m[1]), int(m[2])), set()).add(m[3])
    whole = [r for r, kinds in found.items() if kinds == {"jobs", "allocations"}]
    return sorted(
        r for r in whole if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in whole)
    )


def register_settled(spark, url):
    pairs = settled_pairs(spark, url)
    if not pairs:
        fail(f"no settled rows' files in {url}: perch writes them ten minutes after jobs end")
    for kind in ["jobs", "allocations"]:
        files = [f"{url}/{lo:010d}-{hi:010d}.{kind}.parquet" for lo, hi in pairs]
        df = spark.read.parquet(*files)
        missing = [c for c in SETTLED_COLUMNS[kind] if c not in df.columns]
        if missing:
            fail(f"the settled {kind} files lack {missing}: written by another perch version "
                 "(docs/format/settled-rows.md); start perch on them to have them written again")
        df.createOrReplaceTempView(f"settled_{kind}")
    return pairs


def materialize(spark, view):
    """Computes view `view` once and keeps its rows: the statements after it read them rather
    than computing it again (a cached view is not always matched in their plans)."""
    spark.table(view).localCheckpoint().createOrReplaceTempView(view)


def rows(spark, query):
    return [r.asDict() for r in spark.sql(query).collect()]


def answers(spark, usage_view):
    """Every answer, from the usage view `usage_view` (GPU_USAGE_TELEMETRY or
    GPU_USAGE_SETTLED) and the views every answer shares."""
    spark.sql(usage_view)
    spark.sql(GPU_COSTS)
    materialize(spark, "gpu_costs")
    spark.sql(JOB_TOTALS)
    materialize(spark, "job_totals")
    out = {
        "allocations": {
            f"{r['job']}/{r['attempt']}/{r['node']}/{r['gpu']}": r
            for r in rows(spark, JOB_ALLOCATIONS)
        },
        "job_costs": {str(r["job"]): r for r in rows(spark, JOB_COSTS)},
        "account_usage": {
            f"{r['account']}/{r['user_name']}": r for r in rows(spark, ACCOUNT_USAGE)
        },
        "user_usage": {r["user_name"]: r for r in rows(spark, USER_USAGE)},
        "top_users": [r["user_name"] for r in rows(spark, TOP_USERS)],
        "cluster_utilization_daily": {str(r["day_ms"]): r for r in rows(spark, DAILY)},
    }
    return out


def main():
    args = arguments()
    default_price, model_prices, energy_price = prices_of(args)
    until = until_ms(args.until)
    data = args.data_dir.rstrip("/")
    stores = [s.rstrip("/") for s in args.store] or [data]
    settled_url = (args.settled or f"{data}/control/settled").rstrip("/")
    started = time.monotonic()
    spark = session(args.master)
    ready = time.monotonic()

    manifests = [(read_manifest(spark, store), store) for store in stores]
    pairs = register_settled(spark, settled_url)
    samples = [f for m, store in manifests for f in listed(m, store, "gpu_samples")]
    events = [f for m, store in manifests for f in listed(m, store, "events")]
    register_table(
        spark, "gpu_samples", [f for f, _ in samples],
        "time timestamp, node string, gpu bigint, utilization_gpu_pct double, "
        "memory_used_bytes bigint, energy_joules double, power_watts double",
    )
    register_table(
        spark, "events", [f for f, _ in events],
        "time timestamp, kind string, node string, message string",
    )
    spark.createDataFrame(
        [(until, default_price, energy_price)],
        "until_ms bigint, default_per_hour double, energy_per_kwh double",
    ).createOrReplaceTempView("params")
    spark.createDataFrame(
        list(model_prices.items()), "gpu_model string, per_hour double"
    ).createOrReplaceTempView("model_prices")

    for statement, view in [
        (ALLOCATIONS, "allocations"),
        (NODE_SPANS, "node_spans"),
        (CAPACITY_PIECES, "capacity_pieces"),
    ]:
        spark.sql(statement)
        materialize(spark, view)
    counts = spark.sql(
        "SELECT count(*) AS jobs, count(DISTINCT job) AS distinct_jobs FROM settled_jobs"
    ).first()
    if counts["jobs"] != counts["distinct_jobs"]:
        fail("the settled rows' files hold a job twice (a merge cut short): start perch on "
             "them once, which puts them right (docs/format/settled-rows.md)")

    out = {"until_ms": until}
    if args.usage in ("telemetry", "both"):
        out["telemetry"] = answers(spark, GPU_USAGE_TELEMETRY)
    if args.usage in ("settled", "both"):
        out["settled"] = answers(spark, GPU_USAGE_SETTLED)
    done = time.monotonic()
    out["inputs"] = {
        "gpu_samples_files": len(samples),
        "gpu_samples_rows": sum(n for _, n in samples),
        "events_files": len(events),
        "settled_pairs": len(pairs),
        "settled_jobs": counts["jobs"],
        "settled_allocations": spark.table("allocations").count(),
    }
    out["timing"] = {
        "spark_start_s": round(ready - started, 2),
        "compute_s": round(done - ready, 2),
    }
    spark.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
