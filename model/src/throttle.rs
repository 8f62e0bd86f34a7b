//! Names of NVML's clock throttle reasons (`nvmlClocksThrottleReason*`, also called clock event
//! reasons), so a stored bitmask can be read without the NVML headers at hand.

/// Each reason's bit and the name perch shows for it.
pub const THROTTLE_REASONS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

/// The names of the reasons set in `mask`, comma-separated in bit order ("" for none); unknown
/// bits show as `bit_N`.
pub fn throttle_reason_names(mask: u64) -> String {
    let mut names: Vec<String> = Vec::new();
    for bit in 0..64 {
        let b = 1u64 << bit;
        if mask & b == 0 {
            continue;
        }
        match THROTTLE_REASONS.iter().find(|(v, _)| *v == b) {
            Some((_, name)) => names.push((*name).to_string()),
            None => names.push(format!("bit_{bit}")),
        }
    }
    names.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_bits() {
        for (mask, want) in [
            (0, ""),
            (0x1, "gpu_idle"),
            (0x4 | 0x40, "sw_power_cap,hw_thermal_slowdown"),
            (1 << 40, "bit_40"),
        ] {
            assert_eq!(throttle_reason_names(mask), want, "mask {mask:#x}");
        }
    }
}
