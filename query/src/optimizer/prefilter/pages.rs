//! `column op constant` over one column chunk, read straight from its Parquet pages.
//!
//! The Parquet reader decodes a dictionary-encoded float column into 8 bytes per row before a
//! filter can look at it. Here the comparison is made once per dictionary entry (`util > 90`
//! over the 55 distinct utilizations of a day), and each row only looks its index up: a
//! bit-unpacking and a table read, with no value materialized. Plain-encoded pages (a
//! dictionary that grew too large) compare each value.
//!
//! Supported: a flat column (no repetition), optional or required, of a physical type that
//! matches the constant (DOUBLE, FLOAT, INT64, INT32), in data pages of version 1 or 2,
//! PLAIN or dictionary encoded. Anything else answers `None`, and the caller reads the chunk
//! through the Parquet reader instead. Where it answers, a row passes exactly where
//! DataFusion's filter keeps it: floats compared in DataFusion's total order, NULLs never.

use bytes::Bytes;
use parquet::basic::{ConvertedType, Encoding, IntType, LogicalType, Type as PhysicalType};
use parquet::column::page::{Page, PageReader};
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::page_index::offset_index::PageLocation;
use parquet::file::reader::{ChunkReader, Length};
use parquet::file::serialized_reader::SerializedPageReader;
use std::sync::Arc;

use crate::optimizer::float_compare::{key32, key64};

/// A constant of one of the physical types this reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Constant {
    Double(f64),
    Float(f32),
    Int64(i64),
    Int32(i32),
    UInt64(u64),
    UInt32(u32),
}

/// A comparison of a value with the constant, in the order `value op constant`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Cmp {
    Eq,
    NotEq,
    Lt,
    LtEq,
    Gt,
    GtEq,
}

impl Cmp {
    /// `v cmp c`, on values in a total order: integers as they are, floats by their
    /// total-order keys, so a row passes exactly where DataFusion's comparison passes it.
    #[inline]
    fn holds<T: Ord>(self, v: T, c: T) -> bool {
        match self {
            Cmp::Eq => v == c,
            Cmp::NotEq => v != c,
            Cmp::Lt => v < c,
            Cmp::LtEq => v <= c,
            Cmp::Gt => v > c,
            Cmp::GtEq => v >= c,
        }
    }
}

/// Rows as bits, 64 to a word.
#[derive(Default)]
pub(crate) struct Bits {
    words: Vec<u64>,
    len: usize,
}

impl Bits {
    fn with_capacity(rows: usize) -> Self {
        Self {
            words: Vec::with_capacity(rows.div_ceil(64)),
            len: 0,
        }
    }

    #[inline]
    fn push(&mut self, bit: bool) {
        if self.len.is_multiple_of(64) {
            self.words.push(0);
        }
        if bit {
            self.words[self.len / 64] |= 1 << (self.len % 64);
        }
        self.len += 1;
    }

    #[inline]
    pub(crate) fn push_n(&mut self, bit: bool, mut n: usize) {
        if n == 1 {
            self.push(bit);
            return;
        }
        while n > 0 && !self.len.is_multiple_of(64) {
            self.push(bit);
            n -= 1;
        }
        let whole = n / 64;
        self.words
            .extend(std::iter::repeat_n(if bit { u64::MAX } else { 0 }, whole));
        self.len += whole * 64;
        for _ in 0..n % 64 {
            self.push(bit);
        }
    }

    /// Appends the low `n` bits of `bits` (`n` at most 8), lowest first.
    #[inline]
    fn push_bits(&mut self, bits: u8, n: usize) {
        let bits = u64::from(bits) & ((1u64 << n) - 1);
        let at = self.len % 64;
        if at == 0 {
            self.words.push(bits);
        } else {
            let last = self.words.len() - 1;
            self.words[last] |= bits << at;
            if at + n > 64 {
                self.words.push(bits >> (64 - at));
            }
        }
        self.len += n;
    }

    /// Appends 64 bits, lowest first.
    #[inline]
    fn push_word(&mut self, bits: u64) {
        let at = self.len % 64;
        if at == 0 {
            self.words.push(bits);
        } else {
            let last = self.words.len() - 1;
            self.words[last] |= bits << at;
            self.words.push(bits >> (64 - at));
        }
        self.len += 64;
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends bits `start..end` of `other`.
    pub(crate) fn append(&mut self, other: &Bits, start: usize, end: usize) {
        let mut at = start;
        while at + 64 <= end {
            let (word, shift) = (at / 64, at % 64);
            let low = other.words[word] >> shift;
            let high = if shift == 0 {
                0
            } else {
                other.words.get(word + 1).map_or(0, |w| w << (64 - shift))
            };
            self.push_word(low | high);
            at += 64;
        }
        for i in at..end {
            self.push(other.get(i));
        }
    }

    /// The words, bit `i` as bit `i % 64` of word `i / 64` (Arrow's bitmap layout, in
    /// little-endian words).
    pub(crate) fn into_words(self) -> Vec<u64> {
        self.words
    }

    fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    fn all(&self) -> bool {
        self.count() == self.len
    }

    /// Whether bit `i` is set.
    pub(crate) fn get(&self, i: usize) -> bool {
        self.words[i / 64] >> (i % 64) & 1 == 1
    }

    /// `self` and `other`, bit by bit (both of the same length).
    pub(crate) fn and(&mut self, other: &Bits) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= b;
        }
    }

    pub(crate) fn none(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The runs of set bits, as `[start, end)`, in order.
    pub(crate) fn runs(&self) -> Vec<(usize, usize)> {
        // Arrow's bitmap layout is this one: bit `i` is bit `i % 8` of byte `i / 8`.
        let bytes = arrow::buffer::Buffer::from_slice_ref(&self.words);
        arrow::util::bit_iterator::BitSliceIterator::new(bytes.as_slice(), 0, self.len).collect()
    }
}

/// A column chunk's bytes, read from the file at `start`: the page reader asks for file
/// offsets.
struct Chunk {
    start: u64,
    bytes: Bytes,
}

impl Length for Chunk {
    fn len(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

impl ChunkReader for Chunk {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        use bytes::Buf;
        Ok(self.slice(start, None)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.slice(start, Some(length))
    }
}

impl Chunk {
    fn slice(&self, start: u64, length: Option<usize>) -> parquet::errors::Result<Bytes> {
        let from = start
            .checked_sub(self.start)
            .and_then(|f| usize::try_from(f).ok())
            .filter(|&f| f <= self.bytes.len());
        let to = from.map(|f| length.map_or(self.bytes.len(), |l| f.saturating_add(l)));
        match (from, to) {
            (Some(f), Some(t)) if t <= self.bytes.len() => Ok(self.bytes.slice(f..t)),
            _ => Err(parquet::errors::ParquetError::EOF(format!(
                "offset {start} is outside the column chunk read from {}",
                self.start
            ))),
        }
    }
}

/// The rows of the chunk (`rows` of them) that pass `value cmp constant`, as DataFusion's
/// filter decides: NULL rows never do. `bytes` is the chunk as read from the file at `meta.byte_range()`. `None` where the
/// chunk is of a shape this does not read, or does not decode.
///
/// `read`, where given, is the chunk's page locations and the row ranges worth testing (those
/// the scan's page index keeps): pages outside them are skipped undecoded, their rows left
/// out.
pub(crate) fn chunk_rows(
    bytes: Bytes,
    meta: &ColumnChunkMetaData,
    rows: usize,
    cmp: Cmp,
    constant: Constant,
    read: Option<PagesToRead<'_>>,
) -> Option<Bits> {
    let descr = meta.column_descr();
    if descr.max_rep_level() != 0 || descr.max_def_level() > 1 {
        return None;
    }
    let optional = descr.max_def_level() == 1;
    let (start, _) = meta.byte_range();
    let chunk = Arc::new(Chunk { start, bytes });
    let (locations, ranges) = match read {
        Some((locations, ranges)) => (Some(locations.to_vec()), Some(ranges)),
        None => (None, None),
    };
    let pages = SerializedPageReader::new(chunk, meta, rows, locations).ok()?;
    let pages = Pages { pages, ranges };
    // An integer column must be of the constant's signedness: INT64 holds both.
    let unsigned = matches!(
        descr.logical_type_ref(),
        Some(LogicalType::Integer(IntType {
            is_signed: false,
            ..
        }))
    ) || matches!(
        descr.converted_type(),
        ConvertedType::UINT_8
            | ConvertedType::UINT_16
            | ConvertedType::UINT_32
            | ConvertedType::UINT_64
    );
    let plain_integer = descr.logical_type_ref().is_none_or(|t| {
        matches!(
            t,
            LogicalType::Integer(IntType {
                is_signed: true,
                ..
            })
        )
    });
    match (meta.column_type(), constant) {
        // DataFusion orders floats totally, NaN above every number (a negative NaN below),
        // with `-0.0` equal to `0.0`: compared on the same keys as its filters are.
        (PhysicalType::DOUBLE, Constant::Double(c)) => {
            let c = key64(c);
            decode(pages, rows, optional, |v: f64| cmp.holds(key64(v), c))
        }
        (PhysicalType::FLOAT, Constant::Float(c)) => {
            let c = key32(c);
            decode(pages, rows, optional, |v: f32| cmp.holds(key32(v), c))
        }
        (PhysicalType::INT64, Constant::Int64(c)) if plain_integer && !unsigned => {
            decode(pages, rows, optional, |v: i64| cmp.holds(v, c))
        }
        (PhysicalType::INT32, Constant::Int32(c)) if plain_integer && !unsigned => {
            decode(pages, rows, optional, |v: i32| cmp.holds(v, c))
        }
        // Unsigned values are stored in the signed type's bits.
        (PhysicalType::INT64, Constant::UInt64(c)) if unsigned => {
            decode(pages, rows, optional, |v: i64| cmp.holds(v as u64, c))
        }
        (PhysicalType::INT32, Constant::UInt32(c)) if unsigned => {
            decode(pages, rows, optional, |v: i32| cmp.holds(v as u32, c))
        }
        _ => None,
    }
}

/// A chunk's page locations, and the row ranges worth testing.
pub(crate) type PagesToRead<'a> = (&'a [PageLocation], &'a [(usize, usize)]);

/// A fixed-width value as PLAIN encoding stores it.
trait Plain: Copy {
    const SIZE: usize;
    fn read(bytes: &[u8]) -> Self;
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl Plain for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline]
            fn read(bytes: &[u8]) -> Self {
                let mut b = [0u8; std::mem::size_of::<$t>()];
                b.copy_from_slice(&bytes[..Self::SIZE]);
                <$t>::from_le_bytes(b)
            }
        }
    )*};
}
plain!(f64, f32, i64, i32);

/// A chunk's pages, and the row ranges worth reading of them.
struct Pages<'a, R: ChunkReader> {
    pages: SerializedPageReader<R>,
    ranges: Option<&'a [(usize, usize)]>,
}

impl<R: ChunkReader> Pages<'_, R> {
    /// The next page to decode, after appending `false` for every row of the pages before it
    /// that hold no row worth reading (skipped without being read).
    fn next(&mut self, out: &mut Bits) -> Option<Option<Page>> {
        if let Some(ranges) = self.ranges {
            while let Some(page) = self.pages.peek_next_page().ok()? {
                let Some(rows) = page.num_rows.filter(|_| !page.is_dict) else {
                    break;
                };
                let (first, end) = (out.len(), out.len() + rows);
                if ranges.iter().any(|&(s, e)| s < end && first < e) {
                    break;
                }
                self.pages.skip_next_page().ok()?;
                out.push_n(false, rows);
            }
        }
        self.pages.get_next_page().ok()
    }
}

fn decode<T: Plain>(
    mut pages: Pages<'_, impl ChunkReader>,
    rows: usize,
    optional: bool,
    keep: impl Fn(T) -> bool,
) -> Option<Bits> {
    let mut out = Bits::with_capacity(rows);
    let mut dictionary: Option<Vec<bool>> = None;
    while let Some(page) = pages.next(&mut out)? {
        match page {
            Page::DictionaryPage {
                buf,
                num_values,
                encoding,
                ..
            } => {
                if !matches!(encoding, Encoding::PLAIN | Encoding::PLAIN_DICTIONARY) {
                    return None;
                }
                let n = num_values as usize;
                if buf.len() < n.checked_mul(T::SIZE)? {
                    return None;
                }
                dictionary = Some(
                    buf.chunks_exact(T::SIZE)
                        .take(n)
                        .map(|b| keep(T::read(b)))
                        .collect(),
                );
            }
            Page::DataPage {
                buf,
                num_values,
                encoding,
                def_level_encoding,
                ..
            } => {
                let n = num_values as usize;
                let (defined, values) = if optional {
                    if def_level_encoding != Encoding::RLE {
                        return None;
                    }
                    let len = u32::from_le_bytes(buf.get(..4)?.try_into().ok()?) as usize;
                    let levels = buf.get(4..4usize.checked_add(len)?)?;
                    (levels_of(levels, n)?, buf.get(4 + len..)?)
                } else {
                    (None, &buf[..])
                };
                append_page(
                    &mut out,
                    defined.as_ref(),
                    values,
                    n,
                    encoding,
                    dictionary.as_deref(),
                    &keep,
                )?;
            }
            Page::DataPageV2 {
                buf,
                num_values,
                encoding,
                num_rows,
                def_levels_byte_len,
                rep_levels_byte_len,
                ..
            } => {
                let n = num_values as usize;
                if rep_levels_byte_len != 0 || num_rows != num_values {
                    return None;
                }
                let split = def_levels_byte_len as usize;
                let levels = buf.get(..split)?;
                let defined = if optional {
                    levels_of(levels, n)?
                } else {
                    None
                };
                append_page(
                    &mut out,
                    defined.as_ref(),
                    buf.get(split..)?,
                    n,
                    encoding,
                    dictionary.as_deref(),
                    &keep,
                )?;
            }
        }
    }
    (out.len() == rows).then_some(out)
}

/// Which of `n` rows are defined (not NULL), from their definition levels (bit width 1);
/// `None` inside where all are.
fn levels_of(levels: &[u8], n: usize) -> Option<Option<Bits>> {
    let mut defined = Bits::with_capacity(n);
    hybrid(levels, 1, n, &[false, true], &mut defined)?;
    Some((!defined.all()).then_some(defined))
}

/// Appends one data page's `n` rows to `out`: whether each may pass.
fn append_page<T: Plain>(
    out: &mut Bits,
    defined: Option<&Bits>,
    values: &[u8],
    n: usize,
    encoding: Encoding,
    dictionary: Option<&[bool]>,
    keep: &impl Fn(T) -> bool,
) -> Option<()> {
    let present = defined.map_or(n, Bits::count);
    // Each present value's verdict; rows that are all present write straight to `out`.
    let mut verdicts = Bits::with_capacity(if defined.is_some() { present } else { 0 });
    let sink: &mut Bits = if defined.is_some() {
        &mut verdicts
    } else {
        out
    };
    match encoding {
        Encoding::PLAIN => {
            if values.len() < present.checked_mul(T::SIZE)? {
                return None;
            }
            for b in values.chunks_exact(T::SIZE).take(present) {
                sink.push(keep(T::read(b)));
            }
        }
        Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY => {
            let dictionary = dictionary?;
            let (&width, indices) = values
                .split_first()
                .or((present == 0).then_some((&0, &[][..])))?;
            hybrid(indices, width, present, dictionary, sink)?;
        }
        _ => return None,
    }
    if let Some(defined) = defined {
        let mut next = 0;
        for i in 0..n {
            if defined.get(i) {
                out.push(verdicts.get(next));
                next += 1;
            } else {
                out.push(false);
            }
        }
    }
    Some(())
}

/// Decodes `count` values of Parquet's RLE / bit-packing hybrid of `width` bits, and
/// appends `verdicts[value]` of each to `out`. `None` where the data ends early, is malformed,
/// or holds a value with no verdict (an index past the dictionary).
fn hybrid(data: &[u8], width: u8, count: usize, verdicts: &[bool], out: &mut Bits) -> Option<()> {
    if width > 32 {
        return None;
    }
    let width = usize::from(width);
    let mask = if width == 0 {
        0
    } else {
        u64::MAX >> (64 - width)
    };
    let verdict = |v: u64| {
        usize::try_from(v)
            .ok()
            .and_then(|v| verdicts.get(v).copied())
    };
    // Every value of `width` bits as a byte: bit 0 its verdict, bit 1 set where it has none.
    let table: Vec<u8> = if width <= 16 {
        (0..1usize << width)
            .map(|v| verdicts.get(v).map_or(2, |&k| u8::from(k)))
            .collect()
    } else {
        Vec::new()
    };
    let mut at = 0;
    let mut left = count;
    while left > 0 {
        let header = uleb128(data, &mut at)?;
        if header & 1 == 0 {
            let repeat = usize::try_from(header >> 1).ok()?.min(left);
            let bytes = width.div_ceil(8);
            let mut value = [0u8; 8];
            value[..bytes].copy_from_slice(data.get(at..at + bytes)?);
            at += bytes;
            let value = u64::from_le_bytes(value);
            // A repeated value with bits past its width is malformed (readers disagree on it).
            if repeat == 0 || value & !mask != 0 {
                return None;
            }
            out.push_n(verdict(value)?, repeat);
            left -= repeat;
            continue;
        }
        let groups = usize::try_from(header >> 1).ok()?;
        let values = groups.checked_mul(8)?.min(left);
        if values == 0 {
            return None;
        }
        // Each group of 8 values takes `width` bytes; the last may be cut short of its padding.
        let packed = data.get(at..)?;
        let bytes = groups.checked_mul(width)?.min(packed.len());
        let packed = &packed[..bytes];
        at += bytes;
        let bad = if width <= 16 {
            unpack_dispatch(width, packed, values, &table, out)
        } else {
            let mut bad = false;
            for (g, first) in (0..values).step_by(8).enumerate() {
                let n = (values - first).min(8);
                let group = packed.get(g * width..).unwrap_or(&[]);
                let mut bits = 0u8;
                for i in 0..n {
                    let bit = i * width;
                    let mut w = [0u8; 8];
                    let tail = group.get(bit / 8..).unwrap_or(&[]);
                    let take = tail.len().min(8);
                    w[..take].copy_from_slice(&tail[..take]);
                    let k = verdict(u64::from_le_bytes(w) >> (bit % 8) & mask);
                    bad |= k.is_none();
                    bits |= u8::from(k.unwrap_or(false)) << i;
                }
                out.push_bits(bits, n);
            }
            bad
        };
        if bad {
            return None;
        }
        left -= values;
    }
    Some(())
}

/// [`unpack`] for a width of 0 to 16 bits, each width compiled on its own.
fn unpack_dispatch(
    width: usize,
    packed: &[u8],
    values: usize,
    table: &[u8],
    out: &mut Bits,
) -> bool {
    macro_rules! widths {
        ($($w:literal)*) => {
            match width {
                $($w => unpack::<$w>(packed, values, table, out),)*
                _ => true,
            }
        };
    }
    widths!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

/// Appends the verdicts of `values` bit-packed values of `W` bits (at most 16) by `table`,
/// which has an entry for every value of `W` bits: bit 0 the verdict, bit 1 set where the
/// value has none. Whether a value had none.
fn unpack<const W: usize>(packed: &[u8], values: usize, table: &[u8], out: &mut Bits) -> bool {
    let mask = (1usize << W) - 1;
    let table = &table[..=mask];
    let mut none = 0u8;
    // The verdicts of the 8 values of one group, packed little-endian in `word`.
    macro_rules! group {
        ($word:expr, $n:expr) => {{
            let word = $word;
            let mut bits = 0u64;
            for i in 0..$n {
                let k = table[(word >> (i * W)) as usize & mask];
                bits |= u64::from(k & 1) << i;
                none |= k;
            }
            bits
        }};
    }
    // A group's first byte, and how many bytes a fixed-size load of it reads.
    let load = if W <= 8 { 8 } else { 16 };
    let mut v = 0;
    // Blocks of 64 values (8 groups, 8 * W bytes) whose loads stay inside the data.
    while v + 64 <= values && (v / 8 + 7) * W + load <= packed.len() {
        let mut bits = 0u64;
        for g in 0..8 {
            let at = (v / 8 + g) * W;
            let group = if W <= 8 {
                let word = u64::from_le_bytes(packed[at..at + 8].try_into().unwrap_or([0; 8]));
                group!(word, 8)
            } else {
                let word = u128::from_le_bytes(packed[at..at + 16].try_into().unwrap_or([0; 16]));
                group!(word, 8)
            };
            bits |= group << (g * 8);
        }
        out.push_word(bits);
        v += 64;
    }
    // The rest, a group at a time, from a copy padded with zeros.
    while v < values {
        let mut word = [0u8; 16];
        let tail = packed.get(v / 8 * W..).unwrap_or(&[]);
        let take = tail.len().min(16);
        word[..take].copy_from_slice(&tail[..take]);
        let n = (values - v).min(8);
        let bits = group!(u128::from_le_bytes(word), n);
        out.push_bits(bits as u8, n);
        v += n;
    }
    none & 2 != 0
}

fn uleb128(data: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *data.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        Array, ArrayRef, BooleanArray, Float32Array, Float64Array, Int32Array, Int64Array,
        RecordBatch, UInt64Array,
    };
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::PhysicalExpr;
    use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
    use parquet::arrow::ArrowWriter;
    use parquet::file::metadata::ParquetMetaDataReader;
    use parquet::file::properties::{WriterProperties, WriterVersion};

    const CMPS: [(Cmp, Operator); 6] = [
        (Cmp::Eq, Operator::Eq),
        (Cmp::NotEq, Operator::NotEq),
        (Cmp::Lt, Operator::Lt),
        (Cmp::LtEq, Operator::LtEq),
        (Cmp::Gt, Operator::Gt),
        (Cmp::GtEq, Operator::GtEq),
    ];

    /// 5,000 rows: runs, noise from a small and a large set of values, NULLs, NaN of both
    /// signs, both zeros and the extremes.
    fn batch() -> RecordBatch {
        let mut state = 7u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 33
        };
        let rows = 5_000;
        let mut f = Vec::with_capacity(rows);
        let mut i = Vec::with_capacity(rows);
        for r in 0..rows {
            let x = next();
            let v = match r {
                _ if r % 997 == 0 => None,
                _ if r % 1_301 == 0 => Some(f64::NAN),
                _ if r % 1_303 == 0 => Some(-f64::NAN),
                _ if r % 701 == 0 => Some(-0.0),
                _ if r % 703 == 0 => Some(f64::INFINITY),
                1_000..=1_600 => Some(42.0),
                2_000..=2_999 => Some((x % 4_000) as f64 / 7.0),
                _ => Some((x % 101) as f64),
            };
            f.push(v);
            i.push(match r {
                _ if r % 499 == 0 => None,
                _ if r % 883 == 0 => Some(i64::MIN),
                _ if r % 887 == 0 => Some(i64::MAX),
                3_000..=3_999 => Some((x % 100_000) as i64 - 50_000),
                _ => Some((x % 50) as i64 - 25),
            });
        }
        let columns: Vec<(&str, ArrayRef)> = vec![
            ("f64", Arc::new(Float64Array::from(f.clone()))),
            (
                "f32",
                Arc::new(Float32Array::from(
                    f.iter().map(|v| v.map(|v| v as f32)).collect::<Vec<_>>(),
                )),
            ),
            ("i64", Arc::new(Int64Array::from(i.clone()))),
            (
                "i32",
                Arc::new(Int32Array::from(
                    i.iter().map(|v| v.map(|v| v as i32)).collect::<Vec<_>>(),
                )),
            ),
            (
                "u64",
                Arc::new(UInt64Array::from(
                    i.iter().map(|v| v.map(|v| v as u64)).collect::<Vec<_>>(),
                )),
            ),
            (
                "required",
                Arc::new(Float64Array::from(
                    f.iter().map(|v| v.unwrap_or(1.5)).collect::<Vec<_>>(),
                )),
            ),
        ];
        RecordBatch::try_from_iter(columns).expect("batch")
    }

    /// `batch` written as Parquet: dictionary or plain (or a dictionary that overflows into
    /// plain pages), page format 1 or 2, 300-row pages.
    fn file(batch: &RecordBatch, dictionary: bool, dictionary_limit: usize, v2: bool) -> Bytes {
        let props = WriterProperties::builder()
            .set_dictionary_enabled(dictionary)
            .set_dictionary_page_size_limit(dictionary_limit)
            .set_writer_version(if v2 {
                WriterVersion::PARQUET_2_0
            } else {
                WriterVersion::PARQUET_1_0
            })
            .set_data_page_row_count_limit(300)
            .set_write_batch_size(300)
            .set_compression(parquet::basic::Compression::ZSTD(Default::default()))
            .build();
        let mut out = Vec::new();
        let mut writer =
            ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).expect("writer");
        writer.write(batch).expect("write");
        writer.close().expect("close");
        Bytes::from(out)
    }

    fn constant(column: &str, c: f64) -> (Constant, ScalarValue) {
        match column {
            "f64" | "required" => (Constant::Double(c), ScalarValue::Float64(Some(c))),
            "f32" => (
                Constant::Float(c as f32),
                ScalarValue::Float32(Some(c as f32)),
            ),
            "i64" => (
                Constant::Int64(c as i64),
                ScalarValue::Int64(Some(c as i64)),
            ),
            "i32" => (
                Constant::Int32(c as i32),
                ScalarValue::Int32(Some(c as i32)),
            ),
            _ => (
                Constant::UInt64(c as u64),
                ScalarValue::UInt64(Some(c as u64)),
            ),
        }
    }

    /// Every column, comparison and constant (NaN, both zeros and infinity among them), in
    /// every layout: the rows kept are exactly those DataFusion's own comparison keeps.
    #[test]
    fn keeps_exactly_the_rows_the_filter_keeps() {
        let batch = batch();
        let layouts = [
            (true, 1 << 20, false),
            (true, 1 << 20, true),
            (false, 0, false),
            (false, 0, true),
            (true, 2_000, false),
        ];
        for (dictionary, limit, v2) in layouts {
            let bytes = file(&batch, dictionary, limit, v2);
            let meta = ParquetMetaDataReader::new()
                .parse_and_finish(&bytes)
                .expect("footer");
            let group = meta.row_group(0);
            for (index, field) in batch.schema().fields().iter().enumerate() {
                let chunk = group.column(index);
                let (start, len) = chunk.byte_range();
                let chunk_bytes = bytes.slice(start as usize..(start + len) as usize);
                for c in [
                    -25.0,
                    0.0,
                    -0.0,
                    7.0,
                    42.0,
                    90.0,
                    1e30,
                    f64::INFINITY,
                    f64::NAN,
                ] {
                    let (constant, scalar) = constant(field.name(), c);
                    for (cmp, op) in CMPS {
                        let layout = format!(
                            "{} {op:?} {c} (dictionary {dictionary}/{limit}, v2 {v2})",
                            field.name()
                        );
                        let kept = match chunk_rows(
                            chunk_bytes.clone(),
                            chunk,
                            batch.num_rows(),
                            cmp,
                            constant,
                            None,
                        ) {
                            Some(kept) => kept,
                            // Version 2 writes integers without a dictionary as
                            // DELTA_BINARY_PACKED, which is not read here.
                            None if v2
                                && !dictionary
                                && !field.name().starts_with('f')
                                && field.name() != "required" =>
                            {
                                continue;
                            }
                            None => panic!("{layout}: not read"),
                        };
                        let exact = BinaryExpr::new(
                            Arc::new(Column::new(field.name(), index)),
                            op,
                            Arc::new(Literal::new(scalar.clone())),
                        )
                        .evaluate(&batch)
                        .and_then(|v| v.into_array(batch.num_rows()))
                        .expect("evaluate");
                        let exact = exact
                            .as_any()
                            .downcast_ref::<BooleanArray>()
                            .expect("booleans");
                        for row in 0..batch.num_rows() {
                            let passes = exact.is_valid(row) && exact.value(row);
                            assert_eq!(kept.get(row), passes, "{layout}: row {row}");
                        }
                    }
                }
            }
        }
    }

    /// Bits appended from any offset to any other, across word boundaries, are the same bits.
    #[test]
    fn append_copies_any_range() {
        let mut source = Bits::default();
        for i in 0..300 {
            source.push(i % 3 == 0 || i % 7 == 0);
        }
        for lead in [0, 1, 63, 64, 65] {
            for (start, end) in [(0, 300), (1, 299), (63, 130), (64, 128), (5, 5), (200, 300)] {
                let mut out = Bits::default();
                out.push_n(true, lead);
                out.append(&source, start, end);
                assert_eq!(out.len(), lead + end - start);
                for i in 0..lead {
                    assert!(out.get(i));
                }
                for i in start..end {
                    assert_eq!(
                        out.get(lead + i - start),
                        source.get(i),
                        "{lead} {start}..{end} at {i}"
                    );
                }
            }
        }
    }

    /// A constant of another type, or a signed constant on an unsigned column, is not read.
    #[test]
    fn refuses_what_it_cannot_compare() {
        let batch = batch();
        let bytes = file(&batch, true, 1 << 20, false);
        let meta = ParquetMetaDataReader::new()
            .parse_and_finish(&bytes)
            .expect("footer");
        let group = meta.row_group(0);
        let read = |index: usize, constant| {
            let chunk = group.column(index);
            let (start, len) = chunk.byte_range();
            chunk_rows(
                bytes.slice(start as usize..(start + len) as usize),
                chunk,
                batch.num_rows(),
                Cmp::Gt,
                constant,
                None,
            )
        };
        assert!(
            read(0, Constant::Int64(1)).is_none(),
            "an integer on a float column"
        );
        assert!(
            read(2, Constant::Double(1.0)).is_none(),
            "a float on an integer column"
        );
        assert!(
            read(4, Constant::Int64(1)).is_none(),
            "a signed constant on UInt64"
        );
        assert!(
            read(2, Constant::UInt64(1)).is_none(),
            "an unsigned constant on Int64"
        );
        assert!(read(4, Constant::UInt64(1)).is_some());
    }

    /// The rows DataFusion keeps for `f64 > 50` when the Parquet reader reads `file` itself;
    /// `None` where the reader refuses it (or panics on it, as arrow's bitmap code does on
    /// some damaged pages).
    fn reader_keeps(file: Bytes) -> Option<Vec<bool>> {
        std::panic::catch_unwind(|| reader_keeps_or_panics(file)).ok()?
    }

    fn reader_keeps_or_panics(file: Bytes) -> Option<Vec<bool>> {
        let reader =
            parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).ok()?;
        let mask = parquet::arrow::ProjectionMask::roots(reader.parquet_schema(), [0]);
        let batches = reader
            .with_projection(mask)
            .build()
            .ok()?
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let mut kept = Vec::new();
        for batch in &batches {
            let passes = BinaryExpr::new(
                Arc::new(Column::new("f64", 0)),
                Operator::Gt,
                Arc::new(Literal::new(ScalarValue::Float64(Some(50.0)))),
            )
            .evaluate(batch)
            .and_then(|v| v.into_array(batch.num_rows()))
            .ok()?;
            let passes = passes.as_any().downcast_ref::<BooleanArray>()?;
            kept.extend((0..passes.len()).map(|r| passes.is_valid(r) && passes.value(r)));
        }
        Some(kept)
    }

    /// A chunk cut short answers `None` (never the rows of the pages it still has, which would
    /// leave the rest out of the query); a scrambled one answers `None` or a verdict for every
    /// row, and where the Parquet reader decodes the same bytes, the rows DataFusion keeps from
    /// what it decodes. Uncompressed layouts let the scrambling reach values and indices, not
    /// only the compressed stream.
    #[test]
    fn damaged_chunks_answer_none_or_what_the_reader_reads() {
        let batch = batch();
        let rows = batch.num_rows();
        let (mut refused, mut compared) = (0, 0);
        for (dictionary, v2, compression) in [
            (
                true,
                false,
                parquet::basic::Compression::ZSTD(Default::default()),
            ),
            (
                true,
                true,
                parquet::basic::Compression::ZSTD(Default::default()),
            ),
            (
                false,
                false,
                parquet::basic::Compression::ZSTD(Default::default()),
            ),
            (true, false, parquet::basic::Compression::UNCOMPRESSED),
            (false, false, parquet::basic::Compression::UNCOMPRESSED),
            (true, true, parquet::basic::Compression::UNCOMPRESSED),
        ] {
            let layout = format!("dictionary {dictionary}, v2 {v2}, {compression}");
            let props = WriterProperties::builder()
                .set_dictionary_enabled(dictionary)
                .set_writer_version(if v2 {
                    WriterVersion::PARQUET_2_0
                } else {
                    WriterVersion::PARQUET_1_0
                })
                .set_data_page_row_count_limit(300)
                .set_write_batch_size(300)
                .set_compression(compression)
                .build();
            let mut out = Vec::new();
            let mut writer =
                ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).expect("writer");
            writer.write(&batch).expect("write");
            writer.close().expect("close");
            let bytes = Bytes::from(out);
            let meta = ParquetMetaDataReader::new()
                .parse_and_finish(&bytes)
                .expect("footer");
            let chunk = meta.row_group(0).column(0);
            let (start, len) = chunk.byte_range();
            let (start, len) = (start as usize, len as usize);
            let whole = bytes.slice(start..start + len);
            let read = |b: Bytes| chunk_rows(b, chunk, rows, Cmp::Gt, Constant::Double(50.0), None);
            let intact = read(whole.clone()).unwrap_or_else(|| panic!("{layout}: not read"));
            let expected = reader_keeps(bytes.clone()).expect("the reader reads the file");
            assert_eq!(
                (0..rows).map(|r| intact.get(r)).collect::<Vec<_>>(),
                expected
            );
            for cut in (0..len).step_by(97) {
                assert!(
                    read(whole.slice(..cut)).is_none(),
                    "{layout}: {cut} of {len} bytes answered"
                );
                refused += 1;
            }
            let mut state = 11u64;
            for attempt in 0..300 {
                let mut file = bytes.to_vec();
                for _ in 0..4 {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    let at = start + (state >> 33) as usize % len;
                    file[at] ^= (state >> 20) as u8 | 1;
                }
                let file = Bytes::from(file);
                let Some(kept) = read(file.slice(start..start + len)) else {
                    refused += 1;
                    continue;
                };
                assert_eq!(kept.len(), rows, "{layout}, scramble {attempt}");
                let kept: Vec<bool> = (0..rows).map(|r| kept.get(r)).collect();
                // Where the reader refuses what was answered, the scan fails on it anyway.
                if let Some(reader) = reader_keeps(file) {
                    assert!(
                        kept == reader,
                        "{layout}, scramble {attempt}: rows differ from the reader's"
                    );
                    compared += 1;
                }
            }
        }
        eprintln!("{refused} refused, {compared} compared");
        assert!(
            refused > 0 && compared > 0,
            "{refused} refused, {compared} compared"
        );
    }

    /// Given the row ranges worth reading, pages outside them are skipped: their rows are left
    /// out, and the rows of the pages read are as without ranges.
    #[test]
    fn skips_pages_outside_the_ranges() {
        let batch = batch();
        let bytes = file(&batch, true, 1 << 20, false);
        let meta = ParquetMetaDataReader::new()
            .with_page_index_policy(parquet::file::metadata::PageIndexPolicy::Required)
            .parse_and_finish(&bytes)
            .expect("footer");
        let chunk = meta.row_group(0).column(0);
        let locations = meta.offset_index().expect("offset index")[0][0]
            .page_locations()
            .clone();
        assert!(locations.len() > 10, "{} pages", locations.len());
        let (start, len) = chunk.byte_range();
        let chunk_bytes = bytes.slice(start as usize..(start + len) as usize);
        let rows = batch.num_rows();
        let all = chunk_rows(
            chunk_bytes.clone(),
            chunk,
            rows,
            Cmp::Gt,
            Constant::Double(50.0),
            None,
        )
        .expect("read");
        let ranges = [(1_000, 1_500), (4_950, 4_951)];
        let some = chunk_rows(
            chunk_bytes,
            chunk,
            rows,
            Cmp::Gt,
            Constant::Double(50.0),
            Some((&locations, &ranges)),
        )
        .expect("read");
        assert_eq!(some.len(), rows);
        let page_of = |row: usize| {
            locations
                .iter()
                .rposition(|l| l.first_row_index as usize <= row)
                .expect("page")
        };
        let read: Vec<usize> = ranges
            .iter()
            .flat_map(|&(s, e)| page_of(s)..=page_of(e - 1))
            .collect();
        for row in 0..rows {
            let expected = read.contains(&page_of(row)) && all.get(row);
            assert_eq!(some.get(row), expected, "row {row}");
        }
        assert!(some.count() < all.count());
    }

    #[test]
    fn bits_push_and_runs() {
        let mut bits = Bits::default();
        bits.push_n(false, 3);
        bits.push_bits(0b1011, 4);
        bits.push_n(true, 130);
        bits.push_n(false, 61);
        bits.push_bits(0xff, 8);
        bits.push(false);
        assert_eq!(bits.len(), 207);
        assert_eq!(bits.runs(), vec![(3, 5), (6, 137), (198, 206)]);
        assert_eq!(bits.count(), 2 + 131 + 8);
        let mut other = Bits::default();
        other.push_n(true, 100);
        other.push_n(false, 107);
        bits.and(&other);
        assert_eq!(bits.runs(), vec![(3, 5), (6, 100)]);
        assert!(!bits.none());
    }
}

#[cfg(test)]
mod wide {
    use super::*;
    use arrow::array::{Int64Array, RecordBatch};
    use parquet::arrow::ArrowWriter;
    use parquet::file::metadata::ParquetMetaDataReader;
    use parquet::file::properties::WriterProperties;

    /// A dictionary of 70,000 entries takes 17-bit indices, past the widths unpacked in
    /// blocks.
    #[test]
    fn reads_indices_wider_than_16_bits() {
        let rows = 70_000i64;
        let values: Vec<i64> = (0..rows).map(|i| (i * 7_919) % rows).collect();
        let batch = RecordBatch::try_from_iter([(
            "v",
            Arc::new(Int64Array::from(values.clone())) as arrow::array::ArrayRef,
        )])
        .expect("batch");
        let props = WriterProperties::builder()
            .set_dictionary_page_size_limit(1 << 24)
            .set_data_page_row_count_limit(20_000)
            .set_write_batch_size(20_000)
            .build();
        let mut out = Vec::new();
        let mut writer =
            ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
        let bytes = Bytes::from(out);
        let meta = ParquetMetaDataReader::new()
            .parse_and_finish(&bytes)
            .expect("footer");
        let chunk = meta.row_group(0).column(0);
        assert!(
            chunk.encodings().any(|e| e == Encoding::RLE_DICTIONARY),
            "{:?}",
            chunk.encodings().collect::<Vec<_>>()
        );
        let (start, len) = chunk.byte_range();
        let kept = chunk_rows(
            bytes.slice(start as usize..(start + len) as usize),
            chunk,
            rows as usize,
            Cmp::Lt,
            Constant::Int64(1_000),
            None,
        )
        .expect("read");
        for (row, v) in values.iter().enumerate() {
            assert_eq!(kept.get(row), *v < 1_000, "row {row}");
        }
    }
}
