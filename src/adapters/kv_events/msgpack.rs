//! A borrowing msgpack reader: one walk over the payload's bytes, no value tree,
//! nothing allocated. [`decode`](super::decode) reads engine batches with it.
//!
//! Markers come from `rmp` (the crate `rmpv` is built on); the rest is reading
//! big-endian lengths and numbers off a slice. The nesting limit is counted the way
//! `rmpv::decode::read_value_with_max_depth` counts it (one unit per value, one more
//! per array or map body, two more for a string, one for binary, two for an
//! extension), so a payload this reader refuses for depth is exactly one `rmpv`
//! refused before.

use rmp::Marker;

/// Why bytes are not msgpack (truncated, too deep).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// An integer as msgpack carries it: unsigned, or negative (signed markers with a
/// non-negative value count as unsigned, as in `rmpv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int {
    Pos(u64),
    Neg(i64),
}

impl Int {
    pub fn as_u64(self) -> Option<u64> {
        match self {
            Self::Pos(v) => Some(v),
            Self::Neg(_) => None,
        }
    }

    pub fn as_i64(self) -> Option<i64> {
        match self {
            Self::Pos(v) => i64::try_from(v).ok(),
            Self::Neg(v) => Some(v),
        }
    }

    pub fn as_f64(self) -> f64 {
        match self {
            Self::Pos(v) => v as f64,
            Self::Neg(v) => v as f64,
        }
    }

    fn of_signed(v: i64) -> Self {
        if v >= 0 {
            Self::Pos(v as u64)
        } else {
            Self::Neg(v)
        }
    }
}

/// The head of one value; an array's or map's items follow it in the stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    Int(Int),
    F32(f32),
    F64(f64),
    /// The string's bytes, not checked for UTF-8 (as `rmpv` keeps them).
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    /// Items follow.
    Array(u32),
    /// Key-value pairs follow.
    Map(u32),
}

const TRUNCATED: Malformed = Malformed("truncated");
const TOO_DEEP: Malformed = Malformed("nested too deep");

/// A position in a msgpack byte string.
#[derive(Clone, Copy, Debug)]
pub struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.buf
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if n > self.buf.len() {
            return Err(TRUNCATED);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let (head, rest) = self.buf.split_first_chunk::<N>().ok_or(TRUNCATED)?;
        self.buf = rest;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, Malformed> {
        self.array().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        self.array().map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Result<u64, Malformed> {
        self.array().map(u64::from_be_bytes)
    }

    /// Reads one value's head with `depth` units left, and returns it with the
    /// units its items (if any) have left.
    pub fn head(&mut self, depth: u16) -> Result<(Head<'a>, u16), Malformed> {
        let depth = depth.checked_sub(1).ok_or(TOO_DEEP)?;
        let body = |d: u16, units: u16| d.checked_sub(units).ok_or(TOO_DEEP);
        let head = match Marker::from_u8(self.u8()?) {
            Marker::Null => Head::Nil,
            Marker::True => Head::Bool(true),
            Marker::False => Head::Bool(false),
            Marker::FixPos(v) => Head::Int(Int::Pos(u64::from(v))),
            Marker::FixNeg(v) => Head::Int(Int::Neg(i64::from(v))),
            Marker::U8 => Head::Int(Int::Pos(u64::from(self.u8()?))),
            Marker::U16 => Head::Int(Int::Pos(u64::from(self.u16()?))),
            Marker::U32 => Head::Int(Int::Pos(u64::from(self.u32()?))),
            Marker::U64 => Head::Int(Int::Pos(self.u64()?)),
            Marker::I8 => Head::Int(Int::of_signed(i64::from(self.u8()? as i8))),
            Marker::I16 => Head::Int(Int::of_signed(i64::from(self.u16()? as i16))),
            Marker::I32 => Head::Int(Int::of_signed(i64::from(self.u32()? as i32))),
            Marker::I64 => Head::Int(Int::of_signed(self.u64()? as i64)),
            Marker::F32 => Head::F32(f32::from_bits(self.u32()?)),
            Marker::F64 => Head::F64(f64::from_bits(self.u64()?)),
            m @ (Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32) => {
                let len = match m {
                    Marker::FixStr(n) => usize::from(n),
                    Marker::Str8 => usize::from(self.u8()?),
                    Marker::Str16 => usize::from(self.u16()?),
                    _ => self.u32()? as usize,
                };
                body(depth, 2)?;
                Head::Str(self.take(len)?)
            }
            m @ (Marker::Bin8 | Marker::Bin16 | Marker::Bin32) => {
                let len = match m {
                    Marker::Bin8 => usize::from(self.u8()?),
                    Marker::Bin16 => usize::from(self.u16()?),
                    _ => self.u32()? as usize,
                };
                body(depth, 1)?;
                Head::Bin(self.take(len)?)
            }
            m @ (Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => {
                let len = match m {
                    Marker::FixArray(n) => u32::from(n),
                    Marker::Array16 => u32::from(self.u16()?),
                    _ => self.u32()?,
                };
                return Ok((Head::Array(len), body(depth, 1)?));
            }
            m @ (Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => {
                let len = match m {
                    Marker::FixMap(n) => u32::from(n),
                    Marker::Map16 => u32::from(self.u16()?),
                    _ => self.u32()?,
                };
                return Ok((Head::Map(len), body(depth, 1)?));
            }
            m @ (Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32) => {
                let len = match m {
                    Marker::FixExt1 => 1,
                    Marker::FixExt2 => 2,
                    Marker::FixExt4 => 4,
                    Marker::FixExt8 => 8,
                    Marker::FixExt16 => 16,
                    Marker::Ext8 => usize::from(self.u8()?),
                    Marker::Ext16 => usize::from(self.u16()?),
                    _ => self.u32()? as usize,
                };
                body(depth, 2)?;
                self.take(1)?; // the type
                self.take(len)?;
                Head::Ext
            }
            // The unused marker 0xc1 reads as nil, as in `rmpv`.
            Marker::Reserved => Head::Nil,
        };
        Ok((head, depth))
    }

    /// Reads one whole value and returns its head (an array's or map's items are
    /// read past, checked, and not returned).
    pub fn item(&mut self, depth: u16) -> Result<Head<'a>, Malformed> {
        let start = *self;
        let (head, _) = self.head(depth)?;
        if matches!(head, Head::Array(n) | Head::Map(n) if n > 0) {
            *self = start;
            self.skip(depth)?;
        }
        Ok(head)
    }

    /// An array's head, read only if the next value is an array: `(items, the
    /// units they have left)`.
    pub fn peek_array(&mut self, depth: u16) -> Result<Option<(u32, u16)>, Malformed> {
        let mut probe = *self;
        match probe.head(depth)? {
            (Head::Array(n), inner) => {
                *self = probe;
                Ok(Some((n, inner)))
            }
            _ => Ok(None),
        }
    }

    /// One whole value: `Some` if it is a non-negative integer. The encodings
    /// engines use for token ids are read without the general path.
    #[inline]
    pub fn uint(&mut self, depth: u16) -> Result<Option<u64>, Malformed> {
        if depth > 0 {
            match *self.buf {
                [b @ 0x00..=0x7f, ref rest @ ..] => {
                    self.buf = rest;
                    return Ok(Some(u64::from(b)));
                }
                [0xcc, b, ref rest @ ..] => {
                    self.buf = rest;
                    return Ok(Some(u64::from(b)));
                }
                [0xcd, a, b, ref rest @ ..] => {
                    self.buf = rest;
                    return Ok(Some(u64::from(u16::from_be_bytes([a, b]))));
                }
                [0xce, a, b, c, d, ref rest @ ..] => {
                    self.buf = rest;
                    return Ok(Some(u64::from(u32::from_be_bytes([a, b, c, d]))));
                }
                _ => {}
            }
        }
        Ok(match self.item(depth)? {
            Head::Int(i) => i.as_u64(),
            _ => None,
        })
    }

    /// Reads up to `n` leading items that are u32 integers in the encodings
    /// engines use for token ids (fixint, uint 8/16/32) into `out`, and returns how
    /// many it read; the caller reads the rest (if any) the general way. Token ids
    /// are most of an event's items, and an engine's ids come in runs of one width
    /// (all uint 16 or uint 32 in a large vocabulary), so each run is read in a
    /// loop of its own that only checks the marker: no dispatch per item, and the
    /// ids are written into place rather than pushed.
    pub fn u32s(&mut self, n: u32, out: &mut Vec<u32>) -> u32 {
        // Every item takes at least one byte: a count past the bytes left cannot
        // size the output.
        let want = (n as usize).min(self.buf.len());
        let base = out.len();
        out.resize(base + want, 0);
        let slots = &mut out[base..];
        let mut read = 0;
        while read < want {
            let left = &mut slots[read..];
            let got = match self.buf.first() {
                Some(0x00..=0x7f) => fixints(&mut self.buf, left),
                Some(0xcc) => run::<2>(&mut self.buf, 0xcc, left),
                Some(0xcd) => run::<3>(&mut self.buf, 0xcd, left),
                Some(0xce) => run::<5>(&mut self.buf, 0xce, left),
                _ => 0,
            };
            if got == 0 {
                break;
            }
            read += got;
        }
        out.truncate(base + read);
        read as u32
    }

    /// [`u32s`](Self::u32s) for block hashes: up to `n` leading items that are
    /// unsigned integers (fixint, uint 8/16/32/64), read into `out`; returns how
    /// many. Anything else (a signed or bytes hash, a cut item) is left for the
    /// general path.
    pub fn u64s(&mut self, n: u32, out: &mut Vec<u64>) -> u32 {
        let mut read = 0;
        while read < n {
            let (v, used) = match *self.buf {
                [b @ 0x00..=0x7f, ..] => (u64::from(b), 1),
                [0xcf, a, b, c, d, e, f, g, h, ..] => {
                    (u64::from_be_bytes([a, b, c, d, e, f, g, h]), 9)
                }
                [0xce, a, b, c, d, ..] => (u64::from(u32::from_be_bytes([a, b, c, d])), 5),
                [0xcd, a, b, ..] => (u64::from(u16::from_be_bytes([a, b])), 3),
                [0xcc, b, ..] => (u64::from(b), 2),
                _ => break,
            };
            out.push(v);
            self.buf = &self.buf[used..];
            read += 1;
        }
        read
    }

    /// Reads past one whole value (checking all of it) and returns its bytes.
    pub fn value(&mut self, depth: u16) -> Result<&'a [u8], Malformed> {
        let start = self.buf;
        self.skip(depth)?;
        Ok(&start[..start.len() - self.buf.len()])
    }

    /// Reads past one whole value, checking all of it.
    pub fn skip(&mut self, depth: u16) -> Result<(), Malformed> {
        // Items still to read per open array/map level, so deep nesting needs no
        // recursion (the depth limit bounds the stack anyway).
        let mut open: smallvec::SmallVec<[(u64, u16); 16]> = smallvec::SmallVec::new();
        let mut depth = depth;
        loop {
            let (head, inner) = self.head(depth)?;
            let items = match head {
                Head::Array(n) => u64::from(n),
                Head::Map(n) => u64::from(n) * 2,
                _ => 0,
            };
            if items > 0 {
                open.push((items, depth));
                depth = inner;
                continue;
            }
            // One item of the enclosing level done; close finished levels.
            loop {
                let Some((left, outer)) = open.last_mut() else {
                    return Ok(());
                };
                *left -= 1;
                if *left > 0 {
                    break;
                }
                depth = *outer;
                open.pop();
            }
        }
    }
}

/// A run of positive fixints at the start of `buf` into `slots` (as many as fit);
/// returns how many, past which `buf` is moved.
fn fixints(buf: &mut &[u8], slots: &mut [u32]) -> usize {
    let mut k = 0;
    for (slot, &b) in slots.iter_mut().zip(buf.iter()) {
        if b > 0x7f {
            break;
        }
        *slot = u32::from(b);
        k += 1;
    }
    *buf = &buf[k..];
    k
}

/// A run of `W`-byte items (the marker, then a big-endian value of `W - 1` bytes)
/// at the start of `buf` into `slots` (as many as fit); returns how many, past
/// which `buf` is moved. A cut item at the end is not read.
fn run<const W: usize>(buf: &mut &[u8], marker: u8, slots: &mut [u32]) -> usize {
    let mut k = 0;
    for (slot, item) in slots.iter_mut().zip(buf.chunks_exact(W)) {
        if item[0] != marker {
            break;
        }
        *slot = item[1..].iter().fold(0u32, |v, &b| (v << 8) | u32::from(b));
        k += 1;
    }
    *buf = &buf[k * W..];
    k
}

#[cfg(test)]
mod tests;
