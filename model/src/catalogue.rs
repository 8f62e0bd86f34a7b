//! The catalogue of measured columns: one declaration per column of each sample type, from
//! which the rest of perch is derived or checked.
//!
//! A [`Column`] says how to read the value from its sample, its unit, what the server refuses
//! ([`Check`]) and, when it is exported, its Prometheus [`Series`] (name, kind, extra labels,
//! help, the dcgm-exporter or node_exporter name it replaces, and how the stored value becomes
//! the exported one). From it:
//! - `perch-query` builds each table's Arrow schema and record batches (after the table's key
//!   columns: `time`, `node`, the device keys and `simulated`);
//! - the server's `/metrics` and the agent's node-local `/metrics` render every exported column
//!   the same way;
//! - [`crate::Batch::validate`] applies each column's check;
//! - tests hold `docs/schema.md` (type and unit of each column) and `docs/metrics.md` (name,
//!   kind, labels, replaced names of each series) to it.
//!
//! Adding a GPU metric: the field on [`crate::GpuSample`], its line in [`GPU`], and the agent's
//! reading of it (`collector/src/gpu`); the doc tests then name the two rows to add.

use crate::{GpuSample, HostSample, IbPortSample, JobSample, NicSample};

/// How a column's value is read from its sample, which also fixes its SQL type.
pub enum Read<R: 'static> {
    F64(fn(&R) -> Option<f64>),
    U64(fn(&R) -> Option<u64>),
    U32(fn(&R) -> Option<u32>),
    Bool(fn(&R) -> Option<bool>),
    Text(fn(&R) -> Option<String>),
}

impl<R> Read<R> {
    /// The value as a number (a boolean is 0 or 1); `None` for text or when absent.
    pub fn number(&self, row: &R) -> Option<f64> {
        match self {
            Read::F64(f) => f(row),
            Read::U64(f) => f(row).map(|v| v as f64),
            Read::U32(f) => f(row).map(f64::from),
            Read::Bool(f) => f(row).map(|b| f64::from(u8::from(b))),
            Read::Text(_) => None,
        }
    }

    /// The SQL type as `docs/schema.md` names it.
    pub fn type_name(&self) -> &'static str {
        match self {
            Read::F64(_) => "float64",
            Read::U64(_) => "uint64",
            Read::U32(_) => "uint32",
            Read::Bool(_) => "boolean",
            Read::Text(_) => "string",
        }
    }
}

/// What the server refuses in an ingested value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    None,
    /// 0 to 100.
    Percent,
    /// Finite and at least 0.
    NonNegative,
}

/// A Prometheus series kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// How the exported value follows from the row.
pub enum Value<R: 'static> {
    /// The column's number times this factor (MHz to hertz...).
    Scaled(f64),
    /// The column's number divided by this (percent to ratio): `37 / 100` is `0.37`, where
    /// `37 * 0.01` would be `0.37000000000000005` on the wire.
    Divided(f64),
    /// Computed from the row (a state string as 0 or 1).
    From(fn(&R) -> Option<f64>),
}

/// The Prometheus series a column is exported as.
pub struct Series<R: 'static> {
    /// As exposed: a counter's name ends in `_total`.
    pub name: &'static str,
    pub kind: Kind,
    /// Labels beyond the sample type's own (`node`, `gpu`, `simulated`...), when several
    /// columns share one family (`kind="corrected", scope="volatile"`).
    pub labels: &'static [(&'static str, &'static str)],
    /// `# HELP`; the same for every column of a family.
    pub help: &'static str,
    /// The dcgm-exporter or node_exporter series it replaces, as `docs/metrics.md` names it;
    /// empty when there is none.
    pub replaces: &'static str,
    pub value: Value<R>,
}

impl<R> Series<R> {
    /// The family's name without the `_total` a counter carries.
    pub fn family(&self) -> &'static str {
        match self.kind {
            Kind::Counter => self.name.strip_suffix("_total").unwrap_or(self.name),
            Kind::Gauge => self.name,
        }
    }

    pub fn value(&self, column: &Column<R>, row: &R) -> Option<f64> {
        match self.value {
            Value::Scaled(factor) => column.read.number(row).map(|v| v * factor),
            Value::Divided(divisor) => column.read.number(row).map(|v| v / divisor),
            Value::From(f) => f(row),
        }
    }
}

/// One measured column of a sample type.
pub struct Column<R: 'static> {
    /// Its name in SQL and on the wire.
    pub name: &'static str,
    pub read: Read<R>,
    /// As `docs/schema.md` gives it; empty for counts and flags without one.
    pub unit: &'static str,
    pub check: Check,
    pub series: Option<Series<R>>,
}

const fn column<R>(name: &'static str, read: Read<R>, unit: &'static str) -> Column<R> {
    Column {
        name,
        read,
        unit,
        check: Check::None,
        series: None,
    }
}

// One constructor per sample type, so each closure's argument type is known.
const fn gpu(name: &'static str, read: Read<GpuSample>, unit: &'static str) -> Column<GpuSample> {
    column(name, read, unit)
}
const fn host(
    name: &'static str,
    read: Read<HostSample>,
    unit: &'static str,
) -> Column<HostSample> {
    column(name, read, unit)
}
const fn nic(name: &'static str, read: Read<NicSample>, unit: &'static str) -> Column<NicSample> {
    column(name, read, unit)
}
const fn ib_port(
    name: &'static str,
    read: Read<IbPortSample>,
    unit: &'static str,
) -> Column<IbPortSample> {
    column(name, read, unit)
}
const fn job(name: &'static str, read: Read<JobSample>, unit: &'static str) -> Column<JobSample> {
    column(name, read, unit)
}

impl<R> Column<R> {
    const fn check(mut self, check: Check) -> Self {
        self.check = check;
        self
    }

    const fn export(
        mut self,
        kind: Kind,
        name: &'static str,
        help: &'static str,
        replaces: &'static str,
    ) -> Self {
        self.series = Some(Series {
            name,
            kind,
            labels: &[],
            help,
            replaces,
            value: Value::Scaled(1.0),
        });
        self
    }

    const fn gauge(self, name: &'static str, help: &'static str, replaces: &'static str) -> Self {
        self.export(Kind::Gauge, name, help, replaces)
    }

    const fn counter(self, name: &'static str, help: &'static str, replaces: &'static str) -> Self {
        self.export(Kind::Counter, name, help, replaces)
    }

    const fn labels(mut self, labels: &'static [(&'static str, &'static str)]) -> Self {
        match &mut self.series {
            Some(s) => s.labels = labels,
            None => panic!("labels before gauge or counter"),
        }
        self
    }

    const fn scaled(mut self, factor: f64) -> Self {
        match &mut self.series {
            Some(s) => s.value = Value::Scaled(factor),
            None => panic!("scaled before gauge or counter"),
        }
        self
    }

    const fn divided(mut self, divisor: f64) -> Self {
        match &mut self.series {
            Some(s) => s.value = Value::Divided(divisor),
            None => panic!("divided before gauge or counter"),
        }
        self
    }

    const fn computed(mut self, f: fn(&R) -> Option<f64>) -> Self {
        match &mut self.series {
            Some(s) => s.value = Value::From(f),
            None => panic!("computed before gauge or counter"),
        }
        self
    }

    /// What is wrong with the value, if anything, as [`crate::Batch::validate`] says it
    /// after the field's name. Nothing is formatted unless something is wrong: this runs for
    /// every column of every ingested row.
    pub fn problem(&self, row: &R) -> Option<String> {
        let value = match (self.check, &self.read) {
            (Check::None, _) => return None,
            (_, Read::F64(f)) => f(row)?,
            _ => return None,
        };
        match self.check {
            Check::Percent if !(0.0..=100.0).contains(&value) => {
                Some(format!("{value} is outside 0..=100 percent"))
            }
            Check::NonNegative if !value.is_finite() || value < 0.0 => {
                Some(format!("{value} must be a finite number >= 0"))
            }
            _ => None,
        }
    }

    /// [`Column::problem`] as the batch's error, naming the field `at(self.name)`.
    pub fn validate(&self, row: &R, at: impl Fn(&str) -> String) -> Result<(), crate::BatchError> {
        match self.problem(row) {
            None => Ok(()),
            Some(message) => Err(crate::telemetry::field_error(at(self.name), message)),
        }
    }
}

use Check::{NonNegative, Percent};
use Read::{Bool, F64, Text, U32, U64};

/// `gpu_samples`, after `time`, `node`, `gpu`, `uuid`, `model`, `simulated`.
pub static GPU: &[Column<GpuSample>] = &[
    gpu(
        "utilization_gpu_pct",
        F64(|r| r.utilization_gpu_pct),
        "percent",
    )
    .check(Percent)
    .gauge(
        "perch_gpu_utilization_ratio",
        "Share of time a kernel ran (dcgm GPU_UTIL / 100)",
        "`DCGM_FI_DEV_GPU_UTIL` / 100",
    )
    .divided(100.0),
    gpu(
        "utilization_memory_pct",
        F64(|r| r.utilization_memory_pct),
        "percent",
    )
    .check(Percent)
    .gauge(
        "perch_gpu_memory_utilization_ratio",
        "Share of time memory was read or written (dcgm MEM_COPY_UTIL / 100)",
        "`DCGM_FI_DEV_MEM_COPY_UTIL` / 100",
    )
    .divided(100.0),
    gpu("memory_used_bytes", U64(|r| r.memory_used_bytes), "bytes").gauge(
        "perch_gpu_memory_used_bytes",
        "Device memory in use (dcgm FB_USED, in bytes)",
        "`DCGM_FI_DEV_FB_USED` (MiB)",
    ),
    gpu("memory_total_bytes", U64(|r| r.memory_total_bytes), "bytes").gauge(
        "perch_gpu_memory_total_bytes",
        "Device memory installed",
        "`FB_USED + FB_FREE` (MiB)",
    ),
    gpu("power_watts", F64(|r| r.power_watts), "watts")
        .check(NonNegative)
        .gauge(
            "perch_gpu_power_watts",
            "Board power draw (dcgm POWER_USAGE)",
            "`DCGM_FI_DEV_POWER_USAGE`",
        ),
    gpu("energy_joules", F64(|r| r.energy_joules), "joules")
        .check(NonNegative)
        .counter(
            "perch_gpu_energy_joules_total",
            "Energy since the driver loaded (dcgm TOTAL_ENERGY_CONSUMPTION, in joules)",
            "`DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` (mJ)",
        ),
    gpu("temperature_celsius", F64(|r| r.temperature_celsius), "°C").gauge(
        "perch_gpu_temperature_celsius",
        "GPU temperature (dcgm GPU_TEMP)",
        "`DCGM_FI_DEV_GPU_TEMP`",
    ),
    gpu("sm_clock_mhz", U32(|r| r.sm_clock_mhz), "MHz")
        .gauge(
            "perch_gpu_sm_clock_hertz",
            "SM clock (dcgm SM_CLOCK, in hertz)",
            "`DCGM_FI_DEV_SM_CLOCK` (MHz)",
        )
        .scaled(1e6),
    gpu("memory_clock_mhz", U32(|r| r.memory_clock_mhz), "MHz")
        .gauge(
            "perch_gpu_memory_clock_hertz",
            "Memory clock (dcgm MEM_CLOCK, in hertz)",
            "`DCGM_FI_DEV_MEM_CLOCK` (MHz)",
        )
        .scaled(1e6),
    gpu("throttle_reasons", U64(|r| r.throttle_reasons), "bitmask").gauge(
        "perch_gpu_clock_throttle_reasons",
        "Clock throttle reasons bitmask, nvmlClocksThrottleReason* (dcgm CLOCK_THROTTLE_REASONS)",
        "`DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`",
    ),
    gpu(
        "throttle_reason_names",
        Text(|r| r.throttle_reasons.map(crate::throttle_reason_names)),
        "",
    ),
    gpu(
        "ecc_corrected_volatile",
        U64(|r| r.ecc_corrected_volatile),
        "errors",
    )
    .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_SBE_VOL_TOTAL`")
    .labels(&[("kind", "corrected"), ("scope", "volatile")]),
    gpu(
        "ecc_uncorrected_volatile",
        U64(|r| r.ecc_uncorrected_volatile),
        "errors",
    )
    .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`")
    .labels(&[("kind", "uncorrected"), ("scope", "volatile")]),
    gpu(
        "ecc_corrected_aggregate",
        U64(|r| r.ecc_corrected_aggregate),
        "errors",
    )
    .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_SBE_AGG_TOTAL`")
    .labels(&[("kind", "corrected"), ("scope", "aggregate")]),
    gpu(
        "ecc_uncorrected_aggregate",
        U64(|r| r.ecc_uncorrected_aggregate),
        "errors",
    )
    .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_DBE_AGG_TOTAL`")
    .labels(&[("kind", "uncorrected"), ("scope", "aggregate")]),
    gpu(
        "retired_pages_single_bit",
        U32(|r| r.retired_pages_single_bit),
        "pages",
    )
    .gauge(RETIRED, RETIRED_HELP, "`DCGM_FI_DEV_RETIRED_SBE`")
    .labels(&[("cause", "single_bit")]),
    gpu(
        "retired_pages_double_bit",
        U32(|r| r.retired_pages_double_bit),
        "pages",
    )
    .gauge(RETIRED, RETIRED_HELP, "`DCGM_FI_DEV_RETIRED_DBE`")
    .labels(&[("cause", "double_bit")]),
    gpu(
        "retired_pages_pending",
        Bool(|r| r.retired_pages_pending),
        "",
    )
    .gauge(
        "perch_gpu_retired_pages_pending",
        "1 if pages wait for a reboot to be retired (dcgm RETIRED_PENDING)",
        "`DCGM_FI_DEV_RETIRED_PENDING`",
    ),
    gpu(
        "pcie_tx_bytes_per_second",
        F64(|r| r.pcie_tx_bytes_per_second),
        "bytes/s",
    )
    .check(NonNegative)
    .gauge(PCIE, PCIE_HELP, "`DCGM_FI_DEV_PCIE_TX_THROUGHPUT` (KB/s)")
    .labels(&[("direction", "transmit")]),
    gpu(
        "pcie_rx_bytes_per_second",
        F64(|r| r.pcie_rx_bytes_per_second),
        "bytes/s",
    )
    .check(NonNegative)
    .gauge(PCIE, PCIE_HELP, "`DCGM_FI_DEV_PCIE_RX_THROUGHPUT` (KB/s)")
    .labels(&[("direction", "receive")]),
    gpu("pcie_replay_total", U64(|r| r.pcie_replay_total), "replays").counter(
        "perch_gpu_pcie_replays_total",
        "PCIe replays (dcgm PCIE_REPLAY_COUNTER)",
        "`DCGM_FI_DEV_PCIE_REPLAY_COUNTER`",
    ),
    gpu("nvlink_links", U32(|r| r.nvlink_links), "links").gauge(
        "perch_gpu_nvlink_links",
        "NVLinks the GPU has",
        "",
    ),
    gpu("nvlink_links_up", U32(|r| r.nvlink_links_up), "links").gauge(
        "perch_gpu_nvlink_links_up",
        "NVLinks that are active",
        "",
    ),
    gpu(
        "nvlink_errors_total",
        U64(|r| r.nvlink_errors_total),
        "errors",
    )
    .counter(
        "perch_gpu_nvlink_errors_total",
        "NVLink replay, recovery and CRC errors over all links (dcgm NVLINK_*_ERROR_COUNT_TOTAL)",
        "`DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL`",
    ),
    gpu("nvlink_rx_bytes", U64(|r| r.nvlink_rx_bytes), "bytes")
        .counter(
            NVLINK_BYTES,
            NVLINK_BYTES_HELP,
            "`DCGM_FI_PROF_NVLINK_RX_BYTES`",
        )
        .labels(&[("direction", "receive")]),
    gpu("nvlink_tx_bytes", U64(|r| r.nvlink_tx_bytes), "bytes")
        .counter(
            NVLINK_BYTES,
            NVLINK_BYTES_HELP,
            "`DCGM_FI_PROF_NVLINK_TX_BYTES`",
        )
        .labels(&[("direction", "transmit")]),
    gpu("processes", U32(|r| r.processes), "").gauge(
        "perch_gpu_processes",
        "Compute processes on the GPU",
        "",
    ),
    gpu("mig_enabled", Bool(|r| r.mig_enabled), "").gauge(
        "perch_gpu_mig_enabled",
        "1 if MIG mode is on",
        "`DCGM_FI_DEV_MIG_MODE`",
    ),
    gpu("mig_instances", U32(|r| r.mig_instances), "").gauge(
        "perch_gpu_mig_instances",
        "MIG devices configured",
        "",
    ),
    gpu("xid_errors_total", U64(|r| r.xid_errors_total), "events").counter(
        "perch_gpu_xid_errors_total",
        "XID errors seen since the agent started (dcgm XID_ERRORS is only the last code)",
        "`DCGM_FI_DEV_XID_ERRORS`",
    ),
    gpu(
        "ecc_error_events_total",
        U64(|r| r.ecc_error_events_total),
        "events",
    )
    .counter(
        "perch_gpu_ecc_error_events_total",
        "ECC error events (single- and double-bit) seen since the agent started",
        "",
    ),
];

const ECC: &str = "perch_gpu_ecc_errors_total";
const ECC_HELP: &str = "ECC errors by kind and scope (dcgm ECC_SBE/DBE_VOL/AGG_TOTAL)";
const RETIRED: &str = "perch_gpu_retired_pages";
const RETIRED_HELP: &str = "Retired memory pages by cause (dcgm RETIRED_SBE / RETIRED_DBE)";
const PCIE: &str = "perch_gpu_pcie_throughput_bytes_per_second";
const PCIE_HELP: &str =
    "PCIe throughput over NVML's 20 ms window (dcgm PCIE_TX/RX_THROUGHPUT, in bytes)";
const NVLINK_BYTES: &str = "perch_gpu_nvlink_bytes_total";
const NVLINK_BYTES_HELP: &str =
    "NVLink bytes over all links (dcgm NVLINK_BANDWIDTH_TOTAL, PROF_NVLINK_RX/TX_BYTES)";

const CPU: &str = "perch_node_cpu_seconds_total";
const CPU_HELP: &str = "CPU time by mode, all cores";
const CPU_REPLACES: &str = "`node_cpu_seconds_total` (per cpu)";

/// `host_samples`, after `time`, `node`, `simulated`.
pub static HOST: &[Column<HostSample>] = &[
    host("cpu_user_seconds", F64(|r| r.cpu_user_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "user")]),
    host("cpu_nice_seconds", F64(|r| r.cpu_nice_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "nice")]),
    host(
        "cpu_system_seconds",
        F64(|r| r.cpu_system_seconds),
        "seconds",
    )
    .check(NonNegative)
    .counter(CPU, CPU_HELP, CPU_REPLACES)
    .labels(&[("mode", "system")]),
    host("cpu_idle_seconds", F64(|r| r.cpu_idle_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "idle")]),
    host(
        "cpu_iowait_seconds",
        F64(|r| r.cpu_iowait_seconds),
        "seconds",
    )
    .check(NonNegative)
    .counter(CPU, CPU_HELP, CPU_REPLACES)
    .labels(&[("mode", "iowait")]),
    host("cpu_irq_seconds", F64(|r| r.cpu_irq_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "irq")]),
    host(
        "cpu_softirq_seconds",
        F64(|r| r.cpu_softirq_seconds),
        "seconds",
    )
    .check(NonNegative)
    .counter(CPU, CPU_HELP, CPU_REPLACES)
    .labels(&[("mode", "softirq")]),
    host("cpu_steal_seconds", F64(|r| r.cpu_steal_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "steal")]),
    host("cpu_count", U32(|r| r.cpu_count), "").gauge(
        "perch_node_cpus",
        "Online CPUs",
        "`count(node_cpu_seconds_total{mode=\"idle\"})`",
    ),
    host("memory_total_bytes", U64(|r| r.memory_total_bytes), "bytes").gauge(
        "perch_node_memory_total_bytes",
        "Physical memory",
        "`node_memory_MemTotal_bytes`",
    ),
    host(
        "memory_available_bytes",
        U64(|r| r.memory_available_bytes),
        "bytes",
    )
    .gauge(
        "perch_node_memory_available_bytes",
        "Memory available to new work",
        "`node_memory_MemAvailable_bytes`",
    ),
    host("load1", F64(|r| r.load1), "")
        .check(NonNegative)
        .gauge("perch_node_load1", "1-minute load average", "`node_load1`"),
    host("load5", F64(|r| r.load5), "")
        .check(NonNegative)
        .gauge("perch_node_load5", "5-minute load average", "`node_load5`"),
    host("load15", F64(|r| r.load15), "")
        .check(NonNegative)
        .gauge(
            "perch_node_load15",
            "15-minute load average",
            "`node_load15`",
        ),
    host("disk_free_bytes", U64(|r| r.disk_free_bytes), "bytes").gauge(
        "perch_node_data_disk_free_bytes",
        "Free space on the agent's data filesystem",
        "`node_filesystem_avail_bytes`",
    ),
    host("disk_total_bytes", U64(|r| r.disk_total_bytes), "bytes").gauge(
        "perch_node_data_disk_size_bytes",
        "Size of the agent's data filesystem",
        "`node_filesystem_size_bytes`",
    ),
    host("uptime_seconds", F64(|r| r.uptime_seconds), "seconds")
        .check(NonNegative)
        .gauge(
            "perch_node_uptime_seconds",
            "Time since boot",
            "`time() - node_boot_time_seconds`",
        ),
];

/// `nic_samples`, after `time`, `node`, `device`, `simulated`.
pub static NIC: &[Column<NicSample>] = &[
    nic("rx_bytes", U64(|r| r.rx_bytes), "bytes").counter(
        "perch_network_receive_bytes_total",
        "Bytes received",
        "`node_network_receive_bytes_total`",
    ),
    nic("rx_packets", U64(|r| r.rx_packets), "packets").counter(
        "perch_network_receive_packets_total",
        "Packets received",
        "`node_network_receive_packets_total`",
    ),
    nic("rx_errors", U64(|r| r.rx_errors), "packets").counter(
        "perch_network_receive_errs_total",
        "Receive errors",
        "`node_network_receive_errs_total`",
    ),
    nic("rx_dropped", U64(|r| r.rx_dropped), "packets").counter(
        "perch_network_receive_drop_total",
        "Received packets dropped",
        "`node_network_receive_drop_total`",
    ),
    nic("tx_bytes", U64(|r| r.tx_bytes), "bytes").counter(
        "perch_network_transmit_bytes_total",
        "Bytes sent",
        "`node_network_transmit_bytes_total`",
    ),
    nic("tx_packets", U64(|r| r.tx_packets), "packets").counter(
        "perch_network_transmit_packets_total",
        "Packets sent",
        "`node_network_transmit_packets_total`",
    ),
    nic("tx_errors", U64(|r| r.tx_errors), "packets").counter(
        "perch_network_transmit_errs_total",
        "Transmit errors",
        "`node_network_transmit_errs_total`",
    ),
    nic("tx_dropped", U64(|r| r.tx_dropped), "packets").counter(
        "perch_network_transmit_drop_total",
        "Packets dropped on transmit",
        "`node_network_transmit_drop_total`",
    ),
    nic("link_up", Bool(|r| r.link_up), "").gauge(
        "perch_network_up",
        "1 if the interface is operationally up",
        "`node_network_up`",
    ),
    nic("speed_mbps", U64(|r| r.speed_mbps), "Mbit/s")
        .gauge(
            "perch_network_speed_bytes",
            "Negotiated link speed in bytes per second",
            "`node_network_speed_bytes`",
        )
        .scaled(125_000.0),
];

/// `ib_port_samples`, after `time`, `node`, `device`, `port`, `simulated`.
pub static IB_PORT: &[Column<IbPortSample>] = &[
    ib_port("state", Text(|r| r.state.clone()), "")
        .gauge(
            "perch_infiniband_up",
            "1 if the port state is ACTIVE",
            "`node_infiniband_state_id == 4`",
        )
        .computed(|r| r.state.as_ref().map(|s| f64::from(u8::from(s == "ACTIVE")))),
    ib_port("rate_gbps", F64(|r| r.rate_gbps), "Gbit/s")
        .check(NonNegative)
        .gauge(
            "perch_infiniband_rate_bytes_per_second",
            "Port signalling rate in bytes per second",
            "`node_infiniband_rate_bytes_per_second`",
        )
        .scaled(1.25e8),
    ib_port("rx_bytes", U64(|r| r.rx_bytes), "bytes").counter(
        "perch_infiniband_receive_bytes_total",
        "Bytes received (port_rcv_data x 4)",
        "`node_infiniband_port_data_received_bytes_total`",
    ),
    ib_port("tx_bytes", U64(|r| r.tx_bytes), "bytes").counter(
        "perch_infiniband_transmit_bytes_total",
        "Bytes sent (port_xmit_data x 4)",
        "`node_infiniband_port_data_transmitted_bytes_total`",
    ),
    ib_port("rx_packets", U64(|r| r.rx_packets), "packets").counter(
        "perch_infiniband_receive_packets_total",
        "Packets received",
        "`node_infiniband_port_packets_received_total`",
    ),
    ib_port("tx_packets", U64(|r| r.tx_packets), "packets").counter(
        "perch_infiniband_transmit_packets_total",
        "Packets sent",
        "`node_infiniband_port_packets_transmitted_total`",
    ),
    ib_port("symbol_errors", U64(|r| r.symbol_errors), "errors").counter(
        "perch_infiniband_symbol_errors_total",
        "Symbol errors",
        "`node_infiniband_symbol_error_total`",
    ),
    ib_port("link_downed", U64(|r| r.link_downed), "events").counter(
        "perch_infiniband_link_downed_total",
        "Times the link went down",
        "`node_infiniband_link_downed_total`",
    ),
    ib_port("rx_errors", U64(|r| r.rx_errors), "packets").counter(
        "perch_infiniband_receive_errors_total",
        "Receive errors",
        "`node_infiniband_port_errors_received_total`",
    ),
    ib_port("tx_wait", U64(|r| r.tx_wait), "ticks").counter(
        "perch_infiniband_transmit_wait_total",
        "Ticks with data to send and no credits",
        "`node_infiniband_port_transmit_wait_total`",
    ),
];

/// `job_samples`, after `time`, `node`, `job`, `user_name`, `simulated`, `source`, `gpus`.
pub static JOB: &[Column<JobSample>] = &[
    job("cpu_seconds", F64(|r| r.cpu_seconds), "seconds")
        .check(NonNegative)
        .counter(
            "perch_job_cpu_seconds_total",
            "CPU time of the job",
            "cAdvisor `container_cpu_usage_seconds_total`",
        ),
    job("memory_bytes", U64(|r| r.memory_bytes), "bytes").gauge(
        "perch_job_memory_bytes",
        "Memory of the job now",
        "cAdvisor `container_memory_usage_bytes`",
    ),
    job("memory_peak_bytes", U64(|r| r.memory_peak_bytes), "bytes").gauge(
        "perch_job_memory_peak_bytes",
        "Peak memory of the job",
        "cAdvisor `container_memory_max_usage_bytes`",
    ),
    job("processes", U32(|r| r.processes), "").gauge(
        "perch_job_processes",
        "Processes in the job",
        "cAdvisor `container_processes`",
    ),
    job("gpu_memory_bytes", U64(|r| r.gpu_memory_bytes), "bytes").gauge(
        "perch_job_gpu_memory_bytes",
        "GPU memory held by the job's processes",
        "",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn families<R>(columns: &[Column<R>], out: &mut BTreeMap<&'static str, Vec<&'static str>>) {
        let mut names = BTreeSet::new();
        for c in columns {
            assert!(names.insert(c.name), "column {} declared twice", c.name);
            if let Some(s) = &c.series {
                assert!(
                    s.name.starts_with("perch_"),
                    "{}: series names start with perch_",
                    s.name
                );
                assert_eq!(
                    s.kind == Kind::Counter,
                    s.name.ends_with("_total"),
                    "{}: a counter's name, and only a counter's, ends in _total",
                    s.name
                );
                if matches!(c.read, Read::Text(_)) {
                    assert!(
                        matches!(s.value, Value::From(_)),
                        "{}: a text column needs its own reading to be exported",
                        c.name
                    );
                }
                out.entry(s.name).or_default().push(s.help);
            }
        }
    }

    /// Columns are declared once per table, series names follow the conventions, and every
    /// column of one family agrees on its help (Prometheus takes one per family).
    #[test]
    fn each_column_once_and_each_family_one_help() {
        let mut all = BTreeMap::new();
        families(GPU, &mut all);
        families(HOST, &mut all);
        families(NIC, &mut all);
        families(IB_PORT, &mut all);
        families(JOB, &mut all);
        for (name, helps) in all {
            assert!(
                helps.windows(2).all(|w| w[0] == w[1]),
                "{name}: columns of one family give different helps: {helps:?}"
            );
        }
    }

    #[test]
    fn exported_values_are_scaled_as_declared() {
        let g = GpuSample {
            utilization_gpu_pct: Some(50.0),
            sm_clock_mhz: Some(1980),
            mig_enabled: Some(true),
            ..GpuSample::default()
        };
        let value = |name: &str| {
            let c = GPU.iter().find(|c| c.name == name).expect("column");
            c.series.as_ref().expect("exported").value(c, &g)
        };
        assert_eq!(value("utilization_gpu_pct"), Some(0.5));
        let g37 = GpuSample {
            utilization_gpu_pct: Some(37.0),
            ..GpuSample::default()
        };
        let util = &GPU[0];
        assert_eq!(
            util.series.as_ref().expect("exported").value(util, &g37),
            Some(0.37),
            "a percent divided, not multiplied by 0.01"
        );
        assert_eq!(value("sm_clock_mhz"), Some(1.98e9));
        assert_eq!(value("mig_enabled"), Some(1.0));
        assert_eq!(value("power_watts"), None, "absent stays absent, never 0");
        let port = IbPortSample {
            state: Some("DOWN".into()),
            ..IbPortSample::default()
        };
        let up = &IB_PORT[0];
        assert_eq!(
            up.series.as_ref().expect("exported").value(up, &port),
            Some(0.0)
        );
    }
}
