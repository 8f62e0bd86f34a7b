//! The columns the catalogue reads by NVML field id ([`Column::nvml_field`]): NVML's
//! `nvmlDeviceGetFieldValues` answers any number of fields in one call, so the agent reads all
//! of a cadence's in one, and such a column needs no code of its own here (nor in the stand-in
//! NVML, which answers every field a scenario sets). A field the device does not report, or a
//! call that fails, leaves its column absent, never zero.

use nvml_wrapper::Device;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::structs::device::FieldId;
use perch_model::catalogue::{Cadence, Column, Number};

/// Reads into `row` every column of `columns` (a catalogue) with an NVML field and the given
/// cadence, in one NVML call; does nothing when there are none.
pub fn read<R>(device: &Device<'_>, columns: &[Column<R>], cadence: Cadence, row: &mut R) {
    let wanted: Vec<(&Column<R>, u32)> = columns
        .iter()
        .filter(|c| c.cadence == cadence)
        .filter_map(|c| c.nvml_field.map(|id| (c, id)))
        .collect();
    if wanted.is_empty() {
        return;
    }
    let ids: Vec<FieldId> = wanted.iter().map(|(_, id)| FieldId(*id)).collect();
    let samples = device.field_values_for(&ids).ok();
    for (i, (column, _)) in wanted.iter().enumerate() {
        let value = samples
            .as_ref()
            .and_then(|s| s.get(i))
            .and_then(|s| s.as_ref().ok())
            .and_then(|s| s.value.as_ref().ok())
            .map(|v| match *v {
                SampleValue::F64(v) => Number::F64(v),
                SampleValue::U32(v) => Number::U64(u64::from(v)),
                SampleValue::U64(v) => Number::U64(v),
                SampleValue::I64(v) => Number::I64(v),
            });
        column.set(row, value);
    }
}
