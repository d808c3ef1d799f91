//! Writing GGUF (version 3): what `tandem model synth` uses to make a model file, and what tests use to make
//! files the reader must take. Metadata keeps its insertion order and tensors are laid out in the order given,
//! each at the next aligned offset, so the same inputs give the same bytes.

use std::io::Write;
use std::path::Path;

use super::{MetaArray, MetaValue, TensorType};

/// Tensor data alignment (GGUF's default, so no `general.alignment` is written).
const ALIGNMENT: usize = 32;

/// A GGUF file being assembled in memory.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, TensorType, Vec<u8>)>,
}

/// Why a tensor was refused.
#[derive(Debug, thiserror::Error)]
#[error("tensor {name}: {what}")]
pub struct WriteError {
    pub name: String,
    pub what: String,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata pair.
    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut GgufWriter {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor: `dims` in GGML order (row length first), `bytes` already encoded as `ty`.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: TensorType, bytes: Vec<u8>) -> Result<(), WriteError> {
        let fail = |what: String| WriteError { name: name.to_string(), what };
        let elems: u64 = dims.iter().product();
        let block = ty.block_elems() as u64;
        if dims.is_empty() || !dims[0].is_multiple_of(block) {
            return Err(fail(format!("row length {:?} is not a multiple of {block}", dims.first())));
        }
        let want = elems / block * ty.block_bytes() as u64;
        if bytes.len() as u64 != want {
            return Err(fail(format!("{} bytes given, the shape needs {want}", bytes.len())));
        }
        self.tensors.push((name.to_string(), dims.to_vec(), ty, bytes));
        Ok(())
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            string(&mut out, key);
            out.extend(value_type(value).to_le_bytes());
            encode(&mut out, value);
        }
        let mut offset = 0usize;
        for (name, dims, ty, bytes) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ggml_id(*ty).to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + bytes.len()).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        for (_, _, _, bytes) in &self.tensors {
            out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
            out.extend_from_slice(bytes);
        }
        out
    }

    /// Writes the file to `path` (through a temporary name, so a reader never sees half a file).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("partial");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&self.to_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    }
}

fn ggml_id(ty: TensorType) -> u32 {
    match ty {
        TensorType::F32 => 0,
        TensorType::F16 => 1,
        TensorType::Q4_0 => 2,
        TensorType::Q4_1 => 3,
        TensorType::Q8_0 => 8,
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn array_type(a: &MetaArray) -> u32 {
    match a {
        MetaArray::U8(_) => 0,
        MetaArray::I8(_) => 1,
        MetaArray::U16(_) => 2,
        MetaArray::I16(_) => 3,
        MetaArray::U32(_) => 4,
        MetaArray::I32(_) => 5,
        MetaArray::F32(_) => 6,
        MetaArray::Bool(_) => 7,
        MetaArray::String(_) => 8,
        MetaArray::Array(_) => 9,
        MetaArray::U64(_) => 10,
        MetaArray::I64(_) => 11,
        MetaArray::F64(_) => 12,
    }
}

fn encode(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => string(out, s),
        MetaValue::Array(a) => encode_array(out, a),
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

fn encode_array(out: &mut Vec<u8>, a: &MetaArray) {
    out.extend(array_type(a).to_le_bytes());
    out.extend((a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr, $f:expr) => {
            for x in $v {
                $f(out, x)
            }
        };
    }
    match a {
        MetaArray::U8(v) => out.extend_from_slice(v),
        MetaArray::I8(v) => each!(v, |o: &mut Vec<u8>, x: &i8| o.push(*x as u8)),
        MetaArray::U16(v) => each!(v, |o: &mut Vec<u8>, x: &u16| o.extend(x.to_le_bytes())),
        MetaArray::I16(v) => each!(v, |o: &mut Vec<u8>, x: &i16| o.extend(x.to_le_bytes())),
        MetaArray::U32(v) => each!(v, |o: &mut Vec<u8>, x: &u32| o.extend(x.to_le_bytes())),
        MetaArray::I32(v) => each!(v, |o: &mut Vec<u8>, x: &i32| o.extend(x.to_le_bytes())),
        MetaArray::F32(v) => each!(v, |o: &mut Vec<u8>, x: &f32| o.extend(x.to_le_bytes())),
        MetaArray::Bool(v) => each!(v, |o: &mut Vec<u8>, x: &bool| o.push(u8::from(*x))),
        MetaArray::String(v) => each!(v, |o: &mut Vec<u8>, x: &String| string(o, x)),
        MetaArray::Array(v) => each!(v, encode_array),
        MetaArray::U64(v) => each!(v, |o: &mut Vec<u8>, x: &u64| o.extend(x.to_le_bytes())),
        MetaArray::I64(v) => each!(v, |o: &mut Vec<u8>, x: &i64| o.extend(x.to_le_bytes())),
        MetaArray::F64(v) => each!(v, |o: &mut Vec<u8>, x: &f64| o.extend(x.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::parse_layout;

    #[test]
    fn what_is_written_reads_back_the_same() {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::String("llama".into()))
            .meta("a.u8", MetaValue::U8(7))
            .meta("a.i16", MetaValue::I16(-3))
            .meta("a.f64", MetaValue::F64(0.25))
            .meta("a.bool", MetaValue::Bool(true))
            .meta("a.strings", MetaValue::Array(MetaArray::String(vec!["x".into(), "yz".into()])))
            .meta("a.nested", MetaValue::Array(MetaArray::Array(vec![MetaArray::I32(vec![1, -2])])))
            .meta("a.empty", MetaValue::Array(MetaArray::U64(Vec::new())));
        w.tensor("t.f32", &[3], TensorType::F32, vec![1; 12]).expect("fits");
        w.tensor("t.q8", &[32, 2], TensorType::Q8_0, vec![2; 68]).expect("fits");
        let bytes = w.to_bytes();
        let layout = parse_layout(&bytes).expect("parses");
        assert_eq!(layout.version, 3);
        for (k, v) in &w.metadata {
            assert_eq!(layout.metadata.get(k), Some(v), "{k}");
        }
        let t = &layout.tensors;
        assert_eq!((t[0].name.as_str(), t[0].dims.as_slice(), t[0].ty), ("t.f32", &[3u64][..], TensorType::F32));
        assert_eq!(&bytes[t[0].start..t[0].start + t[0].len], &[1; 12]);
        assert_eq!(t[1].start % ALIGNMENT, 0);
        assert_eq!(&bytes[t[1].start..t[1].start + t[1].len], &[2; 68]);
        assert_eq!(w.to_bytes(), bytes, "the same inputs give the same bytes");
    }

    #[test]
    fn a_tensor_whose_bytes_do_not_fit_its_shape_is_refused() {
        let mut w = GgufWriter::new();
        let e = w.tensor("w", &[32, 2], TensorType::Q4_1, vec![0; 39]).expect_err("too short");
        assert!(e.to_string().contains("39 bytes given, the shape needs 40"), "{e}");
        assert!(w.tensor("w", &[30], TensorType::Q8_0, vec![0; 34]).is_err());
    }
}
