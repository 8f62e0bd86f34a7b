//! The catalogue of measured columns: one declaration per column of each sample type, from
//! which the rest of perch is derived or checked.
//!
//! A [`Column`] says how to read the value from its sample (and, for a column with a field of
//! its own, how to write it), its unit, what the server refuses ([`Check`]) and, when it is
//! exported, its Prometheus [`Series`] (name, kind, extra labels, help, the dcgm-exporter or
//! node_exporter name it replaces, and how the stored value becomes the exported one). It also
//! says how the rollups summarise it ([`Rollup`]), how often the agent reads it ([`Cadence`]),
//! the NVML field it is read from when NVML has one ([`Column::nvml_field`]), and the value
//! perch's GPU simulator reports for it ([`Column::simulated`]). From it:
//! - `perch-query` builds each table's Arrow schema and record batches (after the table's key
//!   columns: `time`, `node`, the device keys and `simulated`), and the columns of the 1-minute
//!   and 1-hour rollups;
//! - the server's `/metrics` and the agent's node-local `/metrics` render every exported column
//!   the same way;
//! - [`crate::Batch::validate`] applies each column's check;
//! - the agent reads every column with an NVML field in one call per cadence, repeats its slow
//!   columns between their reads, and its simulator fills the columns it does not model;
//! - tests hold `docs/schema.md` (type and unit of each column) and `docs/metrics.md` (name,
//!   kind, labels, replaced names of each series) to it.
//!
//! The GPU catalogue ([`GPU`], in `catalogue/gpu.rs`) also declares [`GpuSample`]: each of its
//! lines is a field of the sample and a column at once, so adding a GPU counter is one line
//! there (docs/metrics.md, "Adding a GPU counter", lists the other places, at most two).

mod gpu;
mod node;

pub use gpu::{GPU, GpuSample};
pub use node::{HOST, IB_PORT, JOB, NIC};

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

/// How a value is stored into its field: the same kinds as [`Read`].
pub enum Write<R: 'static> {
    F64(fn(&mut R, Option<f64>)),
    U64(fn(&mut R, Option<u64>)),
    U32(fn(&mut R, Option<u32>)),
    Bool(fn(&mut R, Option<bool>)),
    Text(fn(&mut R, Option<String>)),
}

/// A value from a source (an NVML field, a simulator constant) before it is stored in its
/// column's type by [`Column::set`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    F64(f64),
    U64(u64),
    I64(i64),
}

impl Number {
    fn as_f64(self) -> f64 {
        match self {
            Number::F64(v) => v,
            Number::U64(v) => v as f64,
            Number::I64(v) => v as f64,
        }
    }

    /// The value as an unsigned integer, when it is one exactly.
    fn as_u64(self) -> Option<u64> {
        match self {
            Number::U64(v) => Some(v),
            Number::I64(v) => u64::try_from(v).ok(),
            // Below 2^64 and integral: it converts exactly.
            Number::F64(v)
                if (0.0..18_446_744_073_709_551_616.0).contains(&v) && v.fract() == 0.0 =>
            {
                Some(v as u64)
            }
            Number::F64(_) => None,
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

/// How a rollup summarises a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Summary {
    /// A value that goes up and down: count of non-null values, sum, min and max.
    Gauge,
    /// A counter or a capacity: min and max (a counter's increase is max - min).
    Range,
}

/// A column's place in its table's rollups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rollup {
    pub summary: Summary,
    /// Its position among the table's rolled-up columns, which is their order in the stored
    /// rollup files: 0, 1, 2... A new column takes the next slot, so its columns come after
    /// every existing one and files written before keep their layout.
    pub slot: u16,
}

/// How often the agent reads a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cadence {
    /// Every sample.
    EverySample,
    /// Costly to read: every `agent.nvml_slow_interval_ms` (30 s); the samples between repeat
    /// the last reading (the energy counter alone advances by the measured power instead).
    Slow,
}

/// One measured column of a sample type.
pub struct Column<R: 'static> {
    /// Its name in SQL and on the wire.
    pub name: &'static str,
    pub read: Read<R>,
    /// How a value is stored in its field; `None` for a column computed from other fields
    /// (`throttle_reason_names`).
    pub write: Option<Write<R>>,
    /// As `docs/schema.md` gives it; empty for counts and flags without one.
    pub unit: &'static str,
    pub check: Check,
    pub series: Option<Series<R>>,
    /// How the 1-minute and 1-hour rollups summarise it; `None`: they leave it out.
    pub rollup: Option<Rollup>,
    /// How often the agent reads it.
    pub cadence: Cadence,
    /// The NVML field (`NVML_FI_DEV_*`, numbered as before driver 580.82; nvml-wrapper
    /// translates) the agent reads it from with `nvmlDeviceGetFieldValues`, together with the
    /// other such columns of its cadence, and the stand-in NVML answers from a scenario's
    /// `fields`; `None`: the agent reads it with code of its own (`collector/src/gpu/nvml*`).
    pub nvml_field: Option<u32>,
    /// What perch's GPU simulator reports for it (a healthy GPU's value), when the simulator
    /// does not model it; `None` and not modelled: simulated GPUs do not report it.
    pub simulated: Option<f64>,
}

const fn column<R>(name: &'static str, read: Read<R>, unit: &'static str) -> Column<R> {
    Column {
        name,
        read,
        write: None,
        unit,
        check: Check::None,
        series: None,
        rollup: None,
        cadence: Cadence::EverySample,
        nvml_field: None,
        simulated: None,
    }
}

/// The builders a catalogue line is written with: `Column::new(...)` (or the sample type's
/// shorthand) followed by its attributes. They are `const`, so a mistake in a line (labels
/// before the series, a text column rolled up) fails the build.
impl<R> Column<R> {
    /// A column named `name`, read by `read`, in `unit`; neither checked, exported, rolled up
    /// nor simulated until the line says so.
    pub const fn new(name: &'static str, read: Read<R>, unit: &'static str) -> Self {
        column(name, read, unit)
    }

    /// Stores values with `write` (a column with a field of its own).
    pub const fn writes(mut self, write: Write<R>) -> Self {
        self.write = Some(write);
        self
    }

    /// What the server refuses.
    pub const fn check(mut self, check: Check) -> Self {
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

    /// Exported as the gauge `name` with `help`, replacing `replaces` ("" for none).
    pub const fn gauge(
        self,
        name: &'static str,
        help: &'static str,
        replaces: &'static str,
    ) -> Self {
        self.export(Kind::Gauge, name, help, replaces)
    }

    /// Exported as the counter `name` (ending in `_total`) with `help`, replacing `replaces`.
    pub const fn counter(
        self,
        name: &'static str,
        help: &'static str,
        replaces: &'static str,
    ) -> Self {
        self.export(Kind::Counter, name, help, replaces)
    }

    /// The series' own labels, after [`Column::gauge`] or [`Column::counter`].
    pub const fn labels(mut self, labels: &'static [(&'static str, &'static str)]) -> Self {
        match &mut self.series {
            Some(s) => s.labels = labels,
            None => panic!("labels before gauge or counter"),
        }
        self
    }

    /// Exported as the column's number times `factor`.
    pub const fn scaled(mut self, factor: f64) -> Self {
        match &mut self.series {
            Some(s) => s.value = Value::Scaled(factor),
            None => panic!("scaled before gauge or counter"),
        }
        self
    }

    /// Exported as the column's number divided by `divisor`.
    pub const fn divided(mut self, divisor: f64) -> Self {
        match &mut self.series {
            Some(s) => s.value = Value::Divided(divisor),
            None => panic!("divided before gauge or counter"),
        }
        self
    }

    /// Exported as `f` computes it from the row.
    pub const fn computed(mut self, f: fn(&R) -> Option<f64>) -> Self {
        match &mut self.series {
            Some(s) => s.value = Value::From(f),
            None => panic!("computed before gauge or counter"),
        }
        self
    }

    const fn rolled_up(mut self, summary: Summary, slot: u16) -> Self {
        match &self.read {
            Read::Bool(_) | Read::Text(_) => panic!("only a number can be rolled up"),
            _ => {}
        }
        self.rollup = Some(Rollup { summary, slot });
        self
    }

    /// Summarised by the rollups as a gauge (count, sum, min, max), in rollup slot `slot`.
    pub const fn rollup_gauge(self, slot: u16) -> Self {
        self.rolled_up(Summary::Gauge, slot)
    }

    /// Summarised by the rollups as a range (min, max), in rollup slot `slot`.
    pub const fn rollup_range(self, slot: u16) -> Self {
        self.rolled_up(Summary::Range, slot)
    }

    /// Read every `agent.nvml_slow_interval_ms` and repeated between ([`Cadence::Slow`]).
    pub const fn slow(mut self) -> Self {
        self.cadence = Cadence::Slow;
        self
    }

    /// Read from NVML field `id` (see [`Column::nvml_field`]).
    pub const fn nvml_field(mut self, id: u32) -> Self {
        self.nvml_field = Some(id);
        self
    }

    /// Reported as `value` by perch's GPU simulator.
    pub const fn simulated(mut self, value: f64) -> Self {
        self.simulated = Some(value);
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

    /// Stores `value` in the column's field, converted to its type; a value the type cannot
    /// hold exactly (a negative count, a fraction of an integer, more than `u32::MAX` in a
    /// `u32`) is stored as absent, never wrapped. Does nothing for a column without a field.
    pub fn set(&self, row: &mut R, value: Option<Number>) {
        match &self.write {
            None => {}
            Some(Write::F64(w)) => w(row, value.map(Number::as_f64)),
            Some(Write::U64(w)) => w(row, value.and_then(Number::as_u64)),
            Some(Write::U32(w)) => w(
                row,
                value
                    .and_then(Number::as_u64)
                    .and_then(|v| u32::try_from(v).ok()),
            ),
            Some(Write::Bool(w)) => w(row, value.map(|v| v.as_f64() != 0.0)),
            Some(Write::Text(w)) => w(row, None),
        }
    }

    /// Copies the column's value from `from` to `to`, exactly (the agent repeating a slow
    /// column's last reading). Does nothing for a column without a field.
    pub fn copy(&self, from: &R, to: &mut R) {
        match (&self.read, &self.write) {
            (Read::F64(r), Some(Write::F64(w))) => w(to, r(from)),
            (Read::U64(r), Some(Write::U64(w))) => w(to, r(from)),
            (Read::U32(r), Some(Write::U32(w))) => w(to, r(from)),
            (Read::Bool(r), Some(Write::Bool(w))) => w(to, r(from)),
            (Read::Text(r), Some(Write::Text(w))) => w(to, r(from)),
            _ => {}
        }
    }
}

/// The rolled-up columns of `columns` with their summaries, in slot order: the stored order
/// of the rollup's columns.
pub fn rolled_up<R>(columns: &[Column<R>]) -> Vec<(&Column<R>, Rollup)> {
    let mut out: Vec<_> = columns
        .iter()
        .filter_map(|c| c.rollup.map(|r| (c, r)))
        .collect();
    out.sort_by_key(|(_, r)| r.slot);
    out
}

/// A row with every column that has a field set to 1 (`true` for a flag): test fixtures
/// built from the catalogue, so a new line is in them without an edit.
pub fn every_value_set<R: Default>(columns: &[Column<R>]) -> R {
    let mut row = R::default();
    for c in columns {
        c.set(&mut row, Some(Number::U64(1)));
    }
    row
}

/// What a catalogue line names without a path: the readings, the checks and the GPU series
/// families several lines share. The GPU catalogue's expansion imports it.
#[doc(hidden)]
pub mod prelude {
    pub use super::Check::{NonNegative, Percent};
    pub use super::Read::{Bool, F64, Text, U32, U64};
    pub use super::gpu::families::*;
}

#[cfg(test)]
mod tests;
