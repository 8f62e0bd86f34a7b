//! The GPU catalogue: one line per measured column of `gpu_samples`. Each line is at once a
//! field of [`GpuSample`] and a [`Column`](super::Column) of [`GPU`], with every attribute of
//! the column, so nothing else in perch lists GPU metrics.
//!
//! A line reads `name: KIND, "unit"` followed by the column's builders (see
//! [`Column`](super::Column)): `KIND` is `F64`, `U64`, `U32`, `Bool` or `Text` and fixes both
//! the field's type (`Option<f64>`...) and the SQL type; the line's doc comment and `serde`
//! attributes go to the field. A line `name = READ, "unit"` is a column computed from other
//! fields, without a field of its own. New lines go at the end: the order is the order of the
//! columns of `gpu_samples`, and of the fields on the wire.
//!
//! The lines live in a macro (`__gpu_lines`) so that a test can expand the catalogue with one
//! line more ([`crate::probe_gpu_catalogue`]) and see that line reach every consumer.

/// Expands the GPU catalogue's lines, followed by `$extra` lines, into `GpuSample` and `GPU`
/// in the calling module (through `__gpu_catalogue`).
#[doc(hidden)]
#[macro_export]
macro_rules! __gpu_lines {
    ($($extra:tt)*) => {
        $crate::__gpu_catalogue! {
            @fields [] @columns []

            /// Percent of time a kernel was running, 0 to 100.
            #[serde(default)]
            utilization_gpu_pct: F64, "percent"
                .check(Percent)
                .gauge(
                    "perch_gpu_utilization_ratio",
                    "Share of time a kernel ran (dcgm GPU_UTIL / 100)",
                    "`DCGM_FI_DEV_GPU_UTIL` / 100"
                )
                .divided(100.0)
                .rollup_gauge(0);

            /// Percent of time device memory was read or written, 0 to 100.
            #[serde(default)]
            utilization_memory_pct: F64, "percent"
                .check(Percent)
                .gauge(
                    "perch_gpu_memory_utilization_ratio",
                    "Share of time memory was read or written (dcgm MEM_COPY_UTIL / 100)",
                    "`DCGM_FI_DEV_MEM_COPY_UTIL` / 100"
                )
                .divided(100.0)
                .rollup_gauge(1);

            #[serde(default)]
            memory_used_bytes: U64, "bytes"
                .gauge(
                    "perch_gpu_memory_used_bytes",
                    "Device memory in use (dcgm FB_USED, in bytes)",
                    "`DCGM_FI_DEV_FB_USED` (MiB)"
                )
                .rollup_gauge(2);

            #[serde(default)]
            memory_total_bytes: U64, "bytes"
                .gauge(
                    "perch_gpu_memory_total_bytes",
                    "Device memory installed",
                    "`FB_USED + FB_FREE` (MiB)"
                )
                .rollup_range(10);

            #[serde(default)]
            power_watts: F64, "watts"
                .check(NonNegative)
                .gauge(
                    "perch_gpu_power_watts",
                    "Board power draw (dcgm POWER_USAGE)",
                    "`DCGM_FI_DEV_POWER_USAGE`"
                )
                .rollup_gauge(3);

            /// Energy since the driver loaded, in joules (Volta and later).
            #[serde(default)]
            energy_joules: F64, "joules"
                .check(NonNegative)
                .counter(
                    "perch_gpu_energy_joules_total",
                    "Energy since the driver loaded (dcgm TOTAL_ENERGY_CONSUMPTION, in joules)",
                    "`DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` (mJ)"
                )
                .rollup_range(9)
                .slow();

            #[serde(default)]
            temperature_celsius: F64, "°C"
                .gauge(
                    "perch_gpu_temperature_celsius",
                    "GPU temperature (dcgm GPU_TEMP)",
                    "`DCGM_FI_DEV_GPU_TEMP`"
                )
                .rollup_gauge(4);

            #[serde(default)]
            sm_clock_mhz: U32, "MHz"
                .gauge(
                    "perch_gpu_sm_clock_hertz",
                    "SM clock (dcgm SM_CLOCK, in hertz)",
                    "`DCGM_FI_DEV_SM_CLOCK` (MHz)"
                )
                .scaled(1e6)
                .rollup_gauge(5);

            #[serde(default)]
            memory_clock_mhz: U32, "MHz"
                .gauge(
                    "perch_gpu_memory_clock_hertz",
                    "Memory clock (dcgm MEM_CLOCK, in hertz)",
                    "`DCGM_FI_DEV_MEM_CLOCK` (MHz)"
                )
                .scaled(1e6)
                .rollup_gauge(6);

            /// NVML's clock throttle reasons bitmask (`nvmlClocksThrottleReason*`); see
            /// [`throttle_reason_names`](crate::throttle_reason_names).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            throttle_reasons: U64, "bitmask"
                .gauge(
                    "perch_gpu_clock_throttle_reasons",
                    "Clock throttle reasons bitmask, nvmlClocksThrottleReason* (dcgm CLOCK_THROTTLE_REASONS)",
                    "`DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`"
                );

            throttle_reason_names = Text(|r| r.throttle_reasons.map($crate::throttle_reason_names)), "";

            /// ECC error counts: volatile since the driver loaded, aggregate over the GPU's life.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            ecc_corrected_volatile: U64, "errors"
                .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_SBE_VOL_TOTAL`")
                .labels(&[("kind", "corrected"), ("scope", "volatile")])
                .simulated(0.0);

            #[serde(default, skip_serializing_if = "Option::is_none")]
            ecc_uncorrected_volatile: U64, "errors"
                .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`")
                .labels(&[("kind", "uncorrected"), ("scope", "volatile")])
                .simulated(0.0);

            #[serde(default, skip_serializing_if = "Option::is_none")]
            ecc_corrected_aggregate: U64, "errors"
                .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_SBE_AGG_TOTAL`")
                .labels(&[("kind", "corrected"), ("scope", "aggregate")])
                .simulated(0.0);

            #[serde(default, skip_serializing_if = "Option::is_none")]
            ecc_uncorrected_aggregate: U64, "errors"
                .counter(ECC, ECC_HELP, "`DCGM_FI_DEV_ECC_DBE_AGG_TOTAL`")
                .labels(&[("kind", "uncorrected"), ("scope", "aggregate")])
                .simulated(0.0);

            /// Pages retired for multiple single-bit / for double-bit ECC errors.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            retired_pages_single_bit: U32, "pages"
                .gauge(RETIRED, RETIRED_HELP, "`DCGM_FI_DEV_RETIRED_SBE`")
                .labels(&[("cause", "single_bit")])
                .simulated(0.0);

            #[serde(default, skip_serializing_if = "Option::is_none")]
            retired_pages_double_bit: U32, "pages"
                .gauge(RETIRED, RETIRED_HELP, "`DCGM_FI_DEV_RETIRED_DBE`")
                .labels(&[("cause", "double_bit")])
                .simulated(0.0);

            /// Pages waiting for a reboot to be retired.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            retired_pages_pending: Bool, ""
                .gauge(
                    "perch_gpu_retired_pages_pending",
                    "1 if pages wait for a reboot to be retired (dcgm RETIRED_PENDING)",
                    "`DCGM_FI_DEV_RETIRED_PENDING`"
                )
                .simulated(0.0);

            /// PCIe throughput over NVML's last 20 ms window, bytes per second.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pcie_tx_bytes_per_second: F64, "bytes/s"
                .check(NonNegative)
                .gauge(PCIE, PCIE_HELP, "`DCGM_FI_DEV_PCIE_TX_THROUGHPUT` (KB/s)")
                .labels(&[("direction", "transmit")])
                .rollup_gauge(7)
                .slow();

            #[serde(default, skip_serializing_if = "Option::is_none")]
            pcie_rx_bytes_per_second: F64, "bytes/s"
                .check(NonNegative)
                .gauge(PCIE, PCIE_HELP, "`DCGM_FI_DEV_PCIE_RX_THROUGHPUT` (KB/s)")
                .labels(&[("direction", "receive")])
                .rollup_gauge(8)
                .slow();

            /// PCIe replays (counter).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pcie_replay_total: U64, "replays"
                .counter(
                    "perch_gpu_pcie_replays_total",
                    "PCIe replays (dcgm PCIE_REPLAY_COUNTER)",
                    "`DCGM_FI_DEV_PCIE_REPLAY_COUNTER`"
                )
                .slow()
                .simulated(0.0);

            /// NVLinks present and active.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            nvlink_links: U32, "links"
                .gauge("perch_gpu_nvlink_links", "NVLinks the GPU has", "")
                .simulated(18.0);

            #[serde(default, skip_serializing_if = "Option::is_none")]
            nvlink_links_up: U32, "links"
                .gauge("perch_gpu_nvlink_links_up", "NVLinks that are active", "")
                .simulated(18.0);

            /// NVLink CRC, replay and recovery errors over all links (counter).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            nvlink_errors_total: U64, "errors"
                .counter(
                    "perch_gpu_nvlink_errors_total",
                    "NVLink replay, recovery and CRC errors over all links (dcgm NVLINK_*_ERROR_COUNT_TOTAL)",
                    "`DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL`"
                )
                .simulated(0.0);

            /// NVLink bytes over all links (counter).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            nvlink_rx_bytes: U64, "bytes"
                .counter(NVLINK_BYTES, NVLINK_BYTES_HELP, "`DCGM_FI_PROF_NVLINK_RX_BYTES`")
                .labels(&[("direction", "receive")]);

            #[serde(default, skip_serializing_if = "Option::is_none")]
            nvlink_tx_bytes: U64, "bytes"
                .counter(NVLINK_BYTES, NVLINK_BYTES_HELP, "`DCGM_FI_PROF_NVLINK_TX_BYTES`")
                .labels(&[("direction", "transmit")]);

            /// Compute processes on the GPU (see `Batch::gpu_processes` for each).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            processes: U32, ""
                .gauge("perch_gpu_processes", "Compute processes on the GPU", "");

            #[serde(default, skip_serializing_if = "Option::is_none")]
            mig_enabled: Bool, ""
                .gauge("perch_gpu_mig_enabled", "1 if MIG mode is on", "`DCGM_FI_DEV_MIG_MODE`")
                .slow()
                .simulated(0.0);

            /// MIG devices configured, when MIG is on.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            mig_instances: U32, ""
                .gauge("perch_gpu_mig_instances", "MIG devices configured", "")
                .slow();

            /// XID errors the agent has seen on this GPU since it started (counter).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            xid_errors_total: U64, "events"
                .counter(
                    "perch_gpu_xid_errors_total",
                    "XID errors seen since the agent started (dcgm XID_ERRORS is only the last code)",
                    "`DCGM_FI_DEV_XID_ERRORS`"
                )
                .rollup_range(11)
                .simulated(0.0);

            /// ECC error events (single- and double-bit) seen since the agent started (counter).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            ecc_error_events_total: U64, "events"
                .counter(
                    "perch_gpu_ecc_error_events_total",
                    "ECC error events (single- and double-bit) seen since the agent started",
                    ""
                )
                .simulated(0.0);

            $($extra)*
        }
    };
}

/// The GPU catalogue with one line more: a counter NVML reports as a field
/// (`NVML_FI_DEV_PCIE_REPLAY_ROLLOVER_COUNTER`), rolled up, exported, read slowly and
/// simulated. Expanded in a test module (`mod probe { perch_model::probe_gpu_catalogue!(); }`)
/// it gives that module a `GpuSample` and a `GPU` of its own, which a crate's tests pass to
/// the same code it derives everything from the real catalogue with: the line must reach the
/// schema, the rollups, `/metrics`, the agent's reading and the stand-in NVML without any
/// other edit, so a consumer that keeps a list of its own fails them.
#[macro_export]
macro_rules! probe_gpu_catalogue {
    () => {
        $crate::__gpu_lines! {
            /// A test-only counter: PCIe replay counter rollovers.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            probe_rollovers_total: U64, "events"
                .counter(
                    "perch_gpu_probe_rollovers_total",
                    "PCIe replay counter rollovers (a test-only line)",
                    "`DCGM_FI_DEV_PCIE_REPLAY_ROLLOVER_COUNTER`"
                )
                .rollup_range(12)
                .slow()
                .nvml_field(95)
                .simulated(0.0);
        }
    };
}

/// Builds `GpuSample` and `GPU` from catalogue lines (see the module's documentation); the
/// `@fields` and `@columns` lists accumulate as the lines are read.
#[doc(hidden)]
#[macro_export]
macro_rules! __gpu_catalogue {
    // A line with a field of its own.
    (@fields [$($fields:tt)*] @columns [$($columns:tt)*]
     $(#[$attr:meta])*
     $name:ident : $kind:ident, $unit:literal $(.$builder:ident($($arg:expr),*))* ;
     $($rest:tt)*) => {
        $crate::__gpu_catalogue! {
            @fields [
                $($fields)*
                $(#[$attr])*
                pub $name: Option<$crate::__gpu_catalogue!(@type $kind)>,
            ]
            @columns [
                $($columns)*
                $crate::catalogue::Column::<GpuSample>::new(
                    stringify!($name),
                    $crate::__gpu_catalogue!(@read $kind $name),
                    $unit,
                )
                .writes($crate::catalogue::Write::$kind(|r, v| r.$name = v))
                $(.$builder($($arg),*))*,
            ]
            $($rest)*
        }
    };
    // A column computed from other fields.
    (@fields [$($fields:tt)*] @columns [$($columns:tt)*]
     $name:ident = $read:expr, $unit:literal $(.$builder:ident($($arg:expr),*))* ;
     $($rest:tt)*) => {
        $crate::__gpu_catalogue! {
            @fields [$($fields)*]
            @columns [
                $($columns)*
                $crate::catalogue::Column::<GpuSample>::new(stringify!($name), $read, $unit)
                $(.$builder($($arg),*))*,
            ]
            $($rest)*
        }
    };
    (@fields [$($fields:tt)*] @columns [$($columns:tt)*]) => {
        /// One GPU at one instant, one field per line of the GPU catalogue after the keys.
        ///
        /// The fields after `memory_clock_mhz` are health and interconnect counters that many
        /// GPUs do not report; they are left out of the JSON when absent.
        #[derive(
            Debug,
            Clone,
            Default,
            PartialEq,
            $crate::__private::serde::Serialize,
            $crate::__private::serde::Deserialize
        )]
        #[serde(crate = "perch_model::__private::serde", deny_unknown_fields)]
        pub struct GpuSample {
            /// Unix time in milliseconds.
            pub time_ms: i64,
            pub gpu: $crate::GpuIndex,
            pub uuid: String,
            pub model: String,
            pub simulated: bool,
            $($fields)*
        }

        /// `gpu_samples`, after `time`, `node`, `gpu`, `uuid`, `model`, `simulated`.
        pub static GPU: &[$crate::catalogue::Column<GpuSample>] = {
            #[allow(unused_imports)]
            use $crate::catalogue::prelude::*;
            &[$($columns)*]
        };
    };
    (@type F64) => { f64 };
    (@type U64) => { u64 };
    (@type U32) => { u32 };
    (@type Bool) => { bool };
    (@type Text) => { String };
    (@read Text $name:ident) => { $crate::catalogue::Read::Text(|r| r.$name.clone()) };
    (@read $kind:ident $name:ident) => { $crate::catalogue::Read::$kind(|r| r.$name) };
}

crate::__gpu_lines! {}

/// Series families several GPU lines share (one `# HELP` each).
pub mod families {
    pub const ECC: &str = "perch_gpu_ecc_errors_total";
    pub const ECC_HELP: &str = "ECC errors by kind and scope (dcgm ECC_SBE/DBE_VOL/AGG_TOTAL)";
    pub const RETIRED: &str = "perch_gpu_retired_pages";
    pub const RETIRED_HELP: &str = "Retired memory pages by cause (dcgm RETIRED_SBE / RETIRED_DBE)";
    pub const PCIE: &str = "perch_gpu_pcie_throughput_bytes_per_second";
    pub const PCIE_HELP: &str =
        "PCIe throughput over NVML's 20 ms window (dcgm PCIE_TX/RX_THROUGHPUT, in bytes)";
    pub const NVLINK_BYTES: &str = "perch_gpu_nvlink_bytes_total";
    pub const NVLINK_BYTES_HELP: &str =
        "NVLink bytes over all links (dcgm NVLINK_BANDWIDTH_TOTAL, PROF_NVLINK_RX/TX_BYTES)";
}
