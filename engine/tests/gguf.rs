//! The GGUF reader on well-formed, truncated, corrupt and arbitrary input: errors, never panics, and never an
//! allocation sized by an unchecked count.

mod common;

use engine::gguf::{GgufFile, MetaArray, MetaValue, TensorType, parse_layout};
use proptest::prelude::*;

/// Writes GGUF files for tests.
struct Writer {
    out: Vec<u8>,
}

impl Writer {
    fn new(version: u32, tensors: u64, kvs: u64) -> Writer {
        let mut w = Writer { out: b"GGUF".to_vec() };
        w.u32(version);
        w.u64(tensors);
        w.u64(kvs);
        w
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.out.extend_from_slice(s.as_bytes());
    }
    fn kv(&mut self, key: &str, ty: u32, value: &[u8]) {
        self.str(key);
        self.u32(ty);
        self.out.extend_from_slice(value);
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) {
        self.str(name);
        self.u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty);
        self.u64(offset);
    }
    fn align(&mut self, a: usize) {
        while !self.out.len().is_multiple_of(a) {
            self.out.push(0);
        }
    }
}

fn every_type(version: u32) -> Vec<u8> {
    let mut w = Writer::new(version, 1, 14);
    w.kv("u8", 0, &[200]);
    w.kv("i8", 1, &[0xFF]);
    w.kv("u16", 2, &500u16.to_le_bytes());
    w.kv("i16", 3, &(-500i16).to_le_bytes());
    w.kv("u32", 4, &70_000u32.to_le_bytes());
    w.kv("i32", 5, &(-70_000i32).to_le_bytes());
    w.kv("f32", 6, &1.5f32.to_le_bytes());
    w.kv("bool", 7, &[1]);
    let mut s = Vec::new();
    s.extend_from_slice(&5u64.to_le_bytes());
    s.extend_from_slice(b"hello");
    w.kv("string", 8, &s);
    let mut a = Vec::new();
    a.extend_from_slice(&4u32.to_le_bytes());
    a.extend_from_slice(&3u64.to_le_bytes());
    for v in [1u32, 2, 3] {
        a.extend_from_slice(&v.to_le_bytes());
    }
    w.kv("array", 9, &a);
    w.kv("u64", 10, &u64::MAX.to_le_bytes());
    w.kv("i64", 11, &(-1i64).to_le_bytes());
    w.kv("f64", 12, &2.25f64.to_le_bytes());
    // An array of arrays of strings.
    let mut nested = Vec::new();
    nested.extend_from_slice(&9u32.to_le_bytes());
    nested.extend_from_slice(&1u64.to_le_bytes());
    nested.extend_from_slice(&8u32.to_le_bytes());
    nested.extend_from_slice(&1u64.to_le_bytes());
    nested.extend_from_slice(&2u64.to_le_bytes());
    nested.extend_from_slice(b"ok");
    w.kv("nested", 9, &nested);
    w.tensor("t", &[32, 2], 8, 0);
    w.align(32);
    w.out.extend(std::iter::repeat_n(0u8, 2 * 34));
    w.out
}

#[test]
fn reads_every_metadata_type_in_v2_and_v3() {
    for version in [2, 3] {
        let layout = parse_layout(&every_type(version)).expect("parses");
        let m = &layout.metadata;
        assert_eq!(layout.version, version);
        assert_eq!(m["u8"], MetaValue::U8(200));
        assert_eq!(m["i8"], MetaValue::I8(-1));
        assert_eq!(m["u16"], MetaValue::U16(500));
        assert_eq!(m["i16"], MetaValue::I16(-500));
        assert_eq!(m["u32"], MetaValue::U32(70_000));
        assert_eq!(m["i32"], MetaValue::I32(-70_000));
        assert_eq!(m["f32"], MetaValue::F32(1.5));
        assert_eq!(m["bool"], MetaValue::Bool(true));
        assert_eq!(m["string"], MetaValue::String("hello".into()));
        assert_eq!(m["array"], MetaValue::Array(MetaArray::U32(vec![1, 2, 3])));
        assert_eq!(m["u64"], MetaValue::U64(u64::MAX));
        assert_eq!(m["i64"], MetaValue::I64(-1));
        assert_eq!(m["f64"], MetaValue::F64(2.25));
        assert_eq!(m["nested"], MetaValue::Array(MetaArray::Array(vec![MetaArray::String(vec!["ok".into()])])));
        let t = &layout.tensors[0];
        assert_eq!((t.name.as_str(), t.ty, t.dims.as_slice(), t.len), ("t", TensorType::Q8_0, &[32u64, 2][..], 68));
        assert_eq!(t.start % 32, 0);
    }
}

#[test]
fn the_real_model_has_the_documented_shape() {
    let f = common::model_file();
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 272);
    let count = |ty| f.tensors().iter().filter(|t| t.ty == ty).count();
    assert_eq!(count(TensorType::Q4_1), 210);
    assert_eq!(f.tensor("token_embd.weight").map(|t| t.ty), Some(TensorType::Q8_0));
    assert!(f.tensor("output.weight").is_none(), "tied output");
}

#[test]
fn unsupported_tensor_types_are_named() {
    let mut w = Writer::new(3, 1, 0);
    w.tensor("blk.0.ffn_down.weight", &[256, 4], 12, 0);
    w.align(32);
    w.out.extend(std::iter::repeat_n(0u8, 4096));
    let err = parse_layout(&w.out).expect_err("Q4_K is not supported").to_string();
    assert!(err.contains("Q4_K") && err.contains("blk.0.ffn_down.weight"), "{err}");
}

#[test]
fn huge_counts_are_refused_before_allocating() {
    let w = Writer::new(3, u64::MAX / 2, 1);
    assert!(parse_layout(&w.out).is_err());
    let mut w = Writer::new(3, 0, 1);
    w.str("tokens");
    w.u32(9);
    w.u32(8);
    w.u64(1 << 60);
    let err = parse_layout(&w.out).expect_err("refused").to_string();
    assert!(err.contains("more than"), "{err}");
    let mut w = Writer::new(3, 1, 0);
    w.tensor("t", &[1 << 40, 1 << 40], 0, 0);
    assert!(parse_layout(&w.out).is_err());
}

#[test]
fn bad_magic_version_and_missing_files_are_clear() {
    assert!(parse_layout(b"GGML\x03\0\0\0").expect_err("magic").to_string().contains("magic"));
    let v1 = Writer::new(1, 0, 0).out;
    assert!(parse_layout(&v1).expect_err("v1").to_string().contains("version 1"));
    let missing = std::path::Path::new("/nonexistent/model.gguf");
    let err = GgufFile::open(missing).expect_err("missing").to_string();
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
    let dir = std::env::temp_dir().join(format!("tandem-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, b"this is not a model").expect("write");
    let err = GgufFile::open(&garbage).expect_err("garbage").to_string();
    assert!(err.contains("garbage.gguf") && err.contains("magic"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_truncation_of_the_real_header_is_an_error() {
    let bytes = std::fs::read(common::model_path()).expect("model bytes");
    let header_end = parse_layout(&bytes).expect("parses").tensors.iter().map(|t| t.start).min().expect("tensors");
    // Every cut in the first 16 KiB, then a stride through the rest of the header and into the tensor data.
    let cuts =
        (0..16_384).chain((16_384..header_end).step_by(9_973)).chain((header_end..bytes.len()).step_by(1_048_573));
    for cut in cuts {
        assert!(parse_layout(&bytes[..cut]).is_err(), "a file cut at {cut} bytes parsed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_layout(&bytes);
    }

    #[test]
    fn mutated_files_never_panic(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
                                 cut in any::<prop::sample::Index>()) {
        let mut bytes = every_type(3);
        for (at, v) in flips {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        let cut = cut.index(bytes.len() + 1);
        let _ = parse_layout(&bytes[..cut]);
    }
}
