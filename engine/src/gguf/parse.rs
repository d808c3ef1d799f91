//! Parsing of the GGUF header, metadata and tensor infos from bytes, with every count bounds-checked.

use std::collections::HashMap;

use super::{GgufLayout, MetaArray, MetaValue, TensorInfo, TensorType};

const MAGIC: &[u8; 4] = b"GGUF";
/// GGUF's default tensor-data alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Deeper nesting than this is certainly not a model file, and would let a file drive recursion.
const MAX_ARRAY_DEPTH: u32 = 4;
/// More dimensions than GGML supports.
const MAX_DIMS: u32 = 4;

/// Why parsing stopped, as a sentence for the user.
#[derive(Debug)]
pub struct ParseError(String);

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(what: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError(what.into()))
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ParseError> {
        if n > self.remaining() {
            return err(format!("truncated: {what} needs {n} bytes at offset {}, {} left", self.pos, self.remaining()));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ParseError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, ParseError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, ParseError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, ParseError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, ParseError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must fit in the remaining bytes when every item takes at least `min_item_bytes`.
    fn count(&mut self, min_item_bytes: usize, what: &str) -> Result<usize, ParseError> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n).ok().filter(|&n| n.saturating_mul(min_item_bytes.max(1)) <= self.remaining());
        match fits {
            Some(n) => Ok(n),
            None => err(format!("{what} is {n}, more than the {} bytes left can hold", self.remaining())),
        }
    }

    fn string(&mut self, what: &str) -> Result<String, ParseError> {
        let len = self.count(1, what)?;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => err(format!("{what} is not UTF-8: {e}")),
        }
    }
}

/// Smallest encoded size of one value of GGUF type `ty`, for bounding array counts.
fn min_size(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        _ => 8,
    }
}

fn value(c: &mut Cursor<'_>, ty: u32, key: &str, depth: u32) -> Result<MetaValue, ParseError> {
    Ok(match ty {
        0 => MetaValue::U8(c.u8(key)?),
        1 => MetaValue::I8(c.u8(key)? as i8),
        2 => MetaValue::U16(c.u16(key)?),
        3 => MetaValue::I16(c.u16(key)? as i16),
        4 => MetaValue::U32(c.u32(key)?),
        5 => MetaValue::I32(c.u32(key)? as i32),
        6 => MetaValue::F32(f32::from_bits(c.u32(key)?)),
        7 => match c.u8(key)? {
            0 => MetaValue::Bool(false),
            1 => MetaValue::Bool(true),
            b => return err(format!("metadata {key}: bool byte {b}")),
        },
        8 => MetaValue::String(c.string(key)?),
        9 => MetaValue::Array(array(c, key, depth + 1)?),
        10 => MetaValue::U64(c.u64(key)?),
        11 => MetaValue::I64(c.u64(key)? as i64),
        12 => MetaValue::F64(f64::from_bits(c.u64(key)?)),
        other => return err(format!("metadata {key}: unknown value type {other}")),
    })
}

fn array(c: &mut Cursor<'_>, key: &str, depth: u32) -> Result<MetaArray, ParseError> {
    if depth > MAX_ARRAY_DEPTH {
        return err(format!("metadata {key}: arrays nested deeper than {MAX_ARRAY_DEPTH}"));
    }
    let ty = c.u32(key)?;
    let n = c.count(min_size(ty), key)?;
    macro_rules! collect {
        ($variant:ident, $read:expr) => {{
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push($read);
            }
            MetaArray::$variant(v)
        }};
    }
    Ok(match ty {
        0 => collect!(U8, c.u8(key)?),
        1 => collect!(I8, c.u8(key)? as i8),
        2 => collect!(U16, c.u16(key)?),
        3 => collect!(I16, c.u16(key)? as i16),
        4 => collect!(U32, c.u32(key)?),
        5 => collect!(I32, c.u32(key)? as i32),
        6 => collect!(F32, f32::from_bits(c.u32(key)?)),
        7 => collect!(Bool, c.u8(key)? != 0),
        8 => collect!(String, c.string(key)?),
        9 => collect!(Array, array(c, key, depth + 1)?),
        10 => collect!(U64, c.u64(key)?),
        11 => collect!(I64, c.u64(key)? as i64),
        12 => collect!(F64, f64::from_bits(c.u64(key)?)),
        other => return err(format!("metadata {key}: unknown array element type {other}")),
    })
}

struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
}

fn tensor_info(c: &mut Cursor<'_>) -> Result<RawTensor, ParseError> {
    let name = c.string("tensor name")?;
    let n_dims = c.u32("tensor dimension count")?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return err(format!("tensor {name}: {n_dims} dimensions"));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64("tensor dimension")?);
    }
    let ty = c.u32("tensor type")?;
    let offset = c.u64("tensor offset")?;
    Ok(RawTensor { name, dims, ty, offset })
}

/// Checks a tensor's type, size and byte range against the file, returning its final description.
fn place(raw: RawTensor, data_start: u64, file_len: u64) -> Result<TensorInfo, ParseError> {
    let RawTensor { name, dims, ty, offset } = raw;
    let ty = match TensorType::from_ggml(ty) {
        Ok(t) => t,
        Err(type_name) => {
            return err(format!(
                "tensor {name} has type {type_name}, which the engine does not support (F32, F16, Q4_0, Q4_1, Q8_0)"
            ));
        }
    };
    let elems = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    let Some(elems) = elems else { return err(format!("tensor {name}: element count overflows")) };
    let block = ty.block_elems() as u64;
    if dims[0] % block != 0 {
        return err(format!("tensor {name}: row length {} is not a multiple of the {block}-element block", dims[0]));
    }
    let len = (elems / block).checked_mul(ty.block_bytes() as u64);
    let start = data_start.checked_add(offset);
    let end = start.zip(len).and_then(|(s, l)| s.checked_add(l));
    match (start, len, end) {
        (Some(start), Some(len), Some(end)) if end <= file_len => {
            Ok(TensorInfo { name, dims, ty, start: start as usize, len: len as usize })
        }
        _ => err(format!("tensor {name}: data at offset {offset} runs past the end of the file ({file_len} bytes)")),
    }
}

/// Parses a whole GGUF file held in `bytes`.
pub fn parse_layout(bytes: &[u8]) -> Result<GgufLayout, ParseError> {
    let mut c = Cursor { bytes, pos: 0 };
    if c.take(4, "magic").ok() != Some(MAGIC.as_slice()) {
        return err("not a GGUF file (bad magic)");
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return err(format!("GGUF version {version} is not supported (2 and 3 are)"));
    }
    // Minimum encoded sizes: a tensor info is at least 8+4+8+4+8 bytes, a metadata pair at least 8+4+1.
    let n_tensors = c.count(32, "tensor count")?;
    let n_meta = c.count(13, "metadata count")?;
    let mut metadata = HashMap::with_capacity(n_meta);
    for _ in 0..n_meta {
        let key = c.string("metadata key")?;
        let ty = c.u32("metadata value type")?;
        let v = value(&mut c, ty, &key, 0)?;
        metadata.insert(key, v);
    }
    let mut raw = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        raw.push(tensor_info(&mut c)?);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return err(format!("general.alignment {v:?} is not a power of two")),
        },
    };
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = bytes.len() as u64;
    let mut tensors = Vec::with_capacity(raw.len());
    for r in raw {
        if r.offset % alignment != 0 {
            return err(format!("tensor {}: offset {} is not aligned to {alignment}", r.name, r.offset));
        }
        tensors.push(place(r, data_start, file_len)?);
    }
    Ok(GgufLayout { version, metadata, tensors })
}
