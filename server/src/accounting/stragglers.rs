//! `job_stragglers`: the ranks of running gangs that are consistently behind the others.
//!
//! One definition, in SQL, so the view users query and the built-in alert `JobStraggler`
//! (which reads the view) cannot disagree. Per running job, each of its GPUs is compared with
//! the gang's median over the trailing window, in 10-second intervals: SM clock, power,
//! utilization, memory bandwidth (memory utilization) and PCIe throughput. NVLink throughput
//! per GPU, NIC throughput per node and the job's own counters (OpenTelemetry sums such as a
//! step count, per node) are compared as rates over the whole window. A rank is behind on a
//! measure when it is below [`MARGIN`] × the gang's median in at least [`SHARE`] of the
//! intervals compared (at least [`MIN_INTERVALS`] of them, so a job must have run 30 s).
//!
//! False positives are what this must avoid, so:
//! - only intervals where the gang is busy count (median utilization at least [`BUSY_PCT`]):
//!   an idle or loading phase, where the whole gang sits at 0, compares nothing;
//! - a measure compares only where its median is above a floor (PCIe and NVLink 100 MB/s,
//!   NICs 10 MB/s, memory utilization 5%): near zero, small absolute differences are huge
//!   ratios;
//! - with two members the median is their mean, so the margin means the slower is below 0.74×
//!   the other, and only the slower can be flagged. That is still one GPU against one, so a
//!   rank of a two-member comparison is flagged only with a second measure behind, or a
//!   slowdown throttle reason (thermal, hardware slowdown, power brake) in at least half of
//!   its samples. Gangs of one have no stragglers.
//!
//! Ranks are numbered as perch starts them: `NODE_RANK` is the node's place in the job's
//! `nodes` list, and `RANK` = `NODE_RANK` × GPUs per node + the GPU's place among the node's
//! GPUs of the job, by index (the order of `CUDA_VISIBLE_DEVICES`).

/// The trailing window, seconds.
pub(crate) const WINDOW_SECS: u32 = 60;
/// The comparison interval within it, seconds.
pub(crate) const INTERVAL_SECS: u32 = 10;
/// Behind: below this fraction of the gang's median.
pub(crate) const MARGIN: f64 = 0.85;
/// Consistently: in at least this share of the intervals compared.
pub(crate) const SHARE: f64 = 0.8;
/// Intervals (of the gauges) a rank needs compared before it can be flagged.
pub(crate) const MIN_INTERVALS: u32 = 3;
/// An interval counts only when the gang's median utilization reaches this.
pub(crate) const BUSY_PCT: f64 = 10.0;

/// The statement, with `{end}` the window's end (`now()` in the view), and the constants
/// above in their places.
const SELECT: &str = "WITH ranks AS (
  SELECT a.job, a.attempt, a.user_name, a.node, a.gpu, a.start_time, a.simulated,
    CAST(array_position(string_to_array(j.nodes, ','), a.node) - 1 AS BIGINT) AS node_rank,
    CAST(row_number() OVER (PARTITION BY a.job, a.attempt, a.node ORDER BY a.gpu) - 1 AS BIGINT) AS local_rank,
    CAST(j.gpus / greatest(j.node_count, 1) AS BIGINT) AS gpus_per_node
  FROM job_allocations a JOIN jobs j ON j.job = a.job
  WHERE a.end_time IS NULL AND j.state = 'running' AND a.start_time <= {end}
),
gpu_window AS (
  SELECT r.job, r.node, r.gpu, s.time, s.utilization_gpu_pct, s.utilization_memory_pct, s.sm_clock_mhz,
    s.power_watts, s.pcie_tx_bytes_per_second + s.pcie_rx_bytes_per_second AS pcie,
    s.nvlink_rx_bytes + s.nvlink_tx_bytes AS nvlink, s.throttle_reason_names, s.temperature_celsius,
    s.ecc_corrected_volatile,
    date_bin(INTERVAL '{interval} seconds', s.time, TIMESTAMP '1970-01-01') AS bucket
  FROM ranks r JOIN gpu_samples s ON s.node = r.node AND s.gpu = r.gpu
  WHERE s.time > {end} - INTERVAL '{window} seconds' AND s.time <= {end} AND s.time >= r.start_time
),
gpu_buckets AS (
  SELECT job, node, gpu, bucket, avg(utilization_gpu_pct) AS util, avg(utilization_memory_pct) AS mem,
    avg(CAST(sm_clock_mhz AS DOUBLE)) AS sm, avg(power_watts) AS power, avg(pcie) AS pcie
  FROM gpu_window GROUP BY job, node, gpu, bucket
),
busy AS (
  SELECT job, bucket FROM gpu_buckets GROUP BY job, bucket HAVING median(util) >= {busy}
),
busy_jobs AS (
  SELECT job FROM busy GROUP BY job
),
gpu_evidence AS (
  SELECT job, node, gpu,
    arg_max(throttle_reason_names, time) AS throttle_reasons,
    avg(CASE WHEN throttle_reason_names ~ '(hw_slowdown|thermal|power_brake)' THEN 1.0 ELSE 0.0 END) AS slowdown_share,
    avg(temperature_celsius) AS temperature_celsius,
    CAST(max(ecc_corrected_volatile) - min(ecc_corrected_volatile) AS BIGINT) AS ecc_corrected_errors,
    CAST(max(nvlink) - min(nvlink) AS DOUBLE)
      / nullif(date_part('epoch', max(time)) - date_part('epoch', min(time)), 0) AS nvlink,
    date_part('epoch', max(time)) - date_part('epoch', min(time)) AS span
  FROM gpu_window GROUP BY job, node, gpu
),
nic AS (
  SELECT r.job, r.node, sum(d.rate) AS rate, min(d.span) AS span
  FROM (SELECT DISTINCT job, node FROM ranks) r JOIN (
    SELECT node, device,
      CAST((max(rx_bytes) - min(rx_bytes)) + (max(tx_bytes) - min(tx_bytes)) AS DOUBLE)
        / nullif(date_part('epoch', max(time)) - date_part('epoch', min(time)), 0) AS rate,
      date_part('epoch', max(time)) - date_part('epoch', min(time)) AS span
    FROM nic_samples
    WHERE time > {end} - INTERVAL '{window} seconds' AND time <= {end} AND device <> 'lo'
    GROUP BY node, device) d ON d.node = r.node
  GROUP BY r.job, r.node
),
steps AS (
  SELECT r.job, r.node, m.metric,
    (max(m.value) - min(m.value)) / nullif(date_part('epoch', max(m.time)) - date_part('epoch', min(m.time)), 0) AS rate,
    date_part('epoch', max(m.time)) - date_part('epoch', min(m.time)) AS span
  FROM (SELECT job, node, min(start_time) AS start_time FROM ranks GROUP BY job, node) r
  JOIN job_metrics m ON m.job = CAST(r.job AS VARCHAR) AND m.node = r.node
  WHERE m.kind = 'sum' AND m.time > {end} - INTERVAL '{window} seconds' AND m.time <= {end}
    AND m.time >= r.start_time
  GROUP BY r.job, r.node, m.metric
),
measures AS (
  SELECT g.job, g.node, g.gpu, g.bucket, m.metric,
    CASE m.metric WHEN 'utilization_gpu_pct' THEN g.util WHEN 'utilization_memory_pct' THEN g.mem
      WHEN 'sm_clock_mhz' THEN g.sm WHEN 'power_watts' THEN g.power ELSE g.pcie END AS value,
    CASE m.metric WHEN 'utilization_memory_pct' THEN 5.0 WHEN 'pcie_bytes_per_second' THEN 1e8 ELSE 1.0 END AS floor
  FROM gpu_buckets g JOIN busy b ON b.job = g.job AND b.bucket = g.bucket
  CROSS JOIN (VALUES ('utilization_gpu_pct'), ('utilization_memory_pct'), ('sm_clock_mhz'),
    ('power_watts'), ('pcie_bytes_per_second')) AS m(metric)
  UNION ALL
  SELECT e.job, e.node, e.gpu, NULL, 'nvlink_bytes_per_second', e.nvlink, 1e8
  FROM gpu_evidence e JOIN busy_jobs USING (job) WHERE e.span >= {min_span}
  UNION ALL
  SELECT n.job, n.node, CAST(NULL AS INT UNSIGNED), NULL, 'nic_bytes_per_second', n.rate, 1e7
  FROM nic n JOIN busy_jobs USING (job) WHERE n.span >= {min_span}
  UNION ALL
  SELECT s.job, s.node, CAST(NULL AS INT UNSIGNED), NULL, 'job:' || s.metric, s.rate, 0.0
  FROM steps s WHERE s.span >= {min_span}
),
gang AS (
  SELECT job, bucket, metric, median(value) AS gang_median, count(value) AS members
  FROM measures GROUP BY job, bucket, metric
),
compared AS (
  SELECT x.job, x.node, x.gpu, x.bucket, x.metric, x.value, g.gang_median, g.members,
    CASE WHEN x.value < {margin} * g.gang_median THEN 1 ELSE 0 END AS behind
  FROM measures x JOIN gang g ON g.job = x.job AND g.metric = x.metric
    AND (g.bucket = x.bucket OR (g.bucket IS NULL AND x.bucket IS NULL))
  WHERE x.value IS NOT NULL AND g.members >= 2 AND g.gang_median > x.floor
),
per_metric AS (
  SELECT job, node, gpu, metric, avg(value) AS value, avg(gang_median) AS gang_median,
    min(members) AS gang_size, CAST(sum(behind) AS BIGINT) AS intervals_behind,
    count(*) AS intervals_compared
  FROM compared GROUP BY job, node, gpu, metric
  HAVING sum(behind) >= {share} * count(*) AND (count(*) >= {min_intervals} OR max(bucket) IS NULL)
),
flagged AS (
  SELECT p.*, count(*) OVER (PARTITION BY p.job, p.node, p.gpu) AS measures_behind FROM per_metric p
)
SELECT f.job, n.attempt, n.user_name, f.node, f.gpu, n.node_rank * n.gpus_per_node + r.local_rank AS rank,
  n.node_rank, f.metric, f.value, f.gang_median, f.value / f.gang_median AS ratio, f.gang_size,
  f.intervals_behind, f.intervals_compared, f.measures_behind,
  e.throttle_reasons, e.slowdown_share, e.temperature_celsius, e.ecc_corrected_errors,
  {end} - INTERVAL '{window} seconds' AS window_start, {end} AS window_end, n.simulated
FROM flagged f
JOIN (SELECT job, node, min(attempt) AS attempt, min(user_name) AS user_name, min(node_rank) AS node_rank,
        min(gpus_per_node) AS gpus_per_node, bool_or(simulated) AS simulated
      FROM ranks GROUP BY job, node) n ON n.job = f.job AND n.node = f.node
LEFT JOIN ranks r ON r.job = f.job AND r.node = f.node AND r.gpu = f.gpu
LEFT JOIN gpu_evidence e ON e.job = f.job AND e.node = f.node AND e.gpu = f.gpu
WHERE f.gang_size >= 3 OR f.measures_behind >= 2 OR coalesce(e.slowdown_share, 0) >= 0.5";

/// The statement over the window that ends at `end`, a SQL timestamp expression.
pub(crate) fn select(end: &str) -> String {
    SELECT
        .replace("{end}", end)
        .replace("{window}", &WINDOW_SECS.to_string())
        .replace("{interval}", &INTERVAL_SECS.to_string())
        .replace("{margin}", &format!("{MARGIN:?}"))
        .replace("{share}", &format!("{SHARE:?}"))
        .replace("{min_intervals}", &MIN_INTERVALS.to_string())
        .replace("{min_span}", &(MIN_INTERVALS * INTERVAL_SECS).to_string())
        .replace("{busy}", &format!("{BUSY_PCT:?}"))
}

/// The view's definition: the window that ends now.
pub(crate) fn view() -> String {
    select("now()")
}

#[cfg(test)]
mod tests;
