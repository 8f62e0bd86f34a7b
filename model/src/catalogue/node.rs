//! The catalogues of the node's other samples: host, network interfaces, InfiniBand ports and
//! jobs (see [`super`]).

use super::Check::NonNegative;
use super::Read::{Bool, F64, Text, U32, U64};
use super::{Column, column};
use crate::{HostSample, IbPortSample, JobSample, NicSample};

// One constructor per sample type, so each closure's argument type is known.
const fn host(
    name: &'static str,
    read: super::Read<HostSample>,
    unit: &'static str,
) -> Column<HostSample> {
    column(name, read, unit)
}
const fn nic(
    name: &'static str,
    read: super::Read<NicSample>,
    unit: &'static str,
) -> Column<NicSample> {
    column(name, read, unit)
}
const fn ib_port(
    name: &'static str,
    read: super::Read<IbPortSample>,
    unit: &'static str,
) -> Column<IbPortSample> {
    column(name, read, unit)
}
const fn job(
    name: &'static str,
    read: super::Read<JobSample>,
    unit: &'static str,
) -> Column<JobSample> {
    column(name, read, unit)
}

const CPU: &str = "perch_node_cpu_seconds_total";
const CPU_HELP: &str = "CPU time by mode, all cores";
const CPU_REPLACES: &str = "`node_cpu_seconds_total` (per cpu)";

/// `host_samples`, after `time`, `node`, `simulated`.
pub static HOST: &[Column<HostSample>] = &[
    host("cpu_user_seconds", F64(|r| r.cpu_user_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "user")])
        .rollup_range(5),
    host("cpu_nice_seconds", F64(|r| r.cpu_nice_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "nice")])
        .rollup_range(6),
    host(
        "cpu_system_seconds",
        F64(|r| r.cpu_system_seconds),
        "seconds",
    )
    .check(NonNegative)
    .counter(CPU, CPU_HELP, CPU_REPLACES)
    .labels(&[("mode", "system")])
    .rollup_range(7),
    host("cpu_idle_seconds", F64(|r| r.cpu_idle_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "idle")])
        .rollup_range(8),
    host(
        "cpu_iowait_seconds",
        F64(|r| r.cpu_iowait_seconds),
        "seconds",
    )
    .check(NonNegative)
    .counter(CPU, CPU_HELP, CPU_REPLACES)
    .labels(&[("mode", "iowait")])
    .rollup_range(9),
    host("cpu_irq_seconds", F64(|r| r.cpu_irq_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "irq")])
        .rollup_range(10),
    host(
        "cpu_softirq_seconds",
        F64(|r| r.cpu_softirq_seconds),
        "seconds",
    )
    .check(NonNegative)
    .counter(CPU, CPU_HELP, CPU_REPLACES)
    .labels(&[("mode", "softirq")])
    .rollup_range(11),
    host("cpu_steal_seconds", F64(|r| r.cpu_steal_seconds), "seconds")
        .check(NonNegative)
        .counter(CPU, CPU_HELP, CPU_REPLACES)
        .labels(&[("mode", "steal")])
        .rollup_range(12),
    host("cpu_count", U32(|r| r.cpu_count), "")
        .gauge(
            "perch_node_cpus",
            "Online CPUs",
            "`count(node_cpu_seconds_total{mode=\"idle\"})`",
        )
        .rollup_range(13),
    host("memory_total_bytes", U64(|r| r.memory_total_bytes), "bytes")
        .gauge(
            "perch_node_memory_total_bytes",
            "Physical memory",
            "`node_memory_MemTotal_bytes`",
        )
        .rollup_range(14),
    host(
        "memory_available_bytes",
        U64(|r| r.memory_available_bytes),
        "bytes",
    )
    .gauge(
        "perch_node_memory_available_bytes",
        "Memory available to new work",
        "`node_memory_MemAvailable_bytes`",
    )
    .rollup_gauge(3),
    host("load1", F64(|r| r.load1), "")
        .check(NonNegative)
        .gauge("perch_node_load1", "1-minute load average", "`node_load1`")
        .rollup_gauge(0),
    host("load5", F64(|r| r.load5), "")
        .check(NonNegative)
        .gauge("perch_node_load5", "5-minute load average", "`node_load5`")
        .rollup_gauge(1),
    host("load15", F64(|r| r.load15), "")
        .check(NonNegative)
        .gauge(
            "perch_node_load15",
            "15-minute load average",
            "`node_load15`",
        )
        .rollup_gauge(2),
    host("disk_free_bytes", U64(|r| r.disk_free_bytes), "bytes")
        .gauge(
            "perch_node_data_disk_free_bytes",
            "Free space on the agent's data filesystem",
            "`node_filesystem_avail_bytes`",
        )
        .rollup_gauge(4),
    host("disk_total_bytes", U64(|r| r.disk_total_bytes), "bytes")
        .gauge(
            "perch_node_data_disk_size_bytes",
            "Size of the agent's data filesystem",
            "`node_filesystem_size_bytes`",
        )
        .rollup_range(15),
    host("uptime_seconds", F64(|r| r.uptime_seconds), "seconds")
        .check(NonNegative)
        .gauge(
            "perch_node_uptime_seconds",
            "Time since boot",
            "`time() - node_boot_time_seconds`",
        )
        .rollup_range(16),
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
