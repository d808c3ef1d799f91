//! A reader for GGUF files (versions 2 and 3): header, metadata, tensor infos and memory-mapped tensor data.
//!
//! Every length and count read from the file is checked against the bytes that remain before anything is
//! allocated, so a truncated or hostile file gives a [`GgufError`], never a panic or a huge allocation.

mod parse;
mod value;
mod write;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use parse::parse_layout;
pub use value::{MetaArray, MetaValue};
pub use write::{GgufWriter, WriteError};

/// The tensor element types the engine can compute with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl TensorType {
    /// The type for a GGML type id, or `Err(name)` with the type's name when the engine does not support it.
    pub fn from_ggml(id: u32) -> Result<TensorType, String> {
        Ok(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            8 => TensorType::Q8_0,
            other => return Err(ggml_type_name(other)),
        })
    }

    /// Elements per quantization block.
    pub fn block_elems(self) -> usize {
        match self {
            TensorType::F32 | TensorType::F16 => 1,
            TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q8_0 => 32,
        }
    }

    /// Bytes per quantization block.
    pub fn block_bytes(self) -> usize {
        match self {
            TensorType::F32 => 4,
            TensorType::F16 => 2,
            TensorType::Q4_0 => 18,
            TensorType::Q4_1 => 20,
            TensorType::Q8_0 => 34,
        }
    }
}

fn ggml_type_name(id: u32) -> String {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16",
        "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    NAMES.get(id as usize).map_or_else(|| format!("unknown type {id}"), |n| (*n).to_string())
}

/// Why a GGUF file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot open: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{path}: {what}")]
    Malformed { path: PathBuf, what: String },
}

/// One tensor's description; its bytes live in the mapped file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the fastest-varying (row length).
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// What the header, metadata and tensor infos say, independent of where the bytes come from.
#[derive(Debug)]
pub struct GgufLayout {
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
}

/// An open GGUF file: its layout plus the mapped bytes.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    layout: GgufLayout,
    data: Arc<memmap2::Mmap>,
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let open_err = |source| GgufError::Open { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(open_err)?;
        let data = map(&file).map_err(open_err)?;
        let layout = parse_layout(&data)
            .map_err(|what| GgufError::Malformed { path: path.to_path_buf(), what: what.to_string() })?;
        Ok(GgufFile { path: path.to_path_buf(), layout, data: Arc::new(data) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.layout.version
    }

    pub fn metadata(&self) -> &HashMap<String, MetaValue> {
        &self.layout.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.layout.tensors
    }

    /// The tensor called `name`, if any.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.layout.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor of this file (bounds were checked when the file was parsed).
    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.data[t.start..t.start + t.len]
    }

    /// An identity for the file's exact contents: `xxh3:` and the 64-bit xxh3 of every byte, in hex.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.data)
    }

    /// A shared handle on the mapped bytes, for weights that outlive this reader.
    pub fn mapping(&self) -> Arc<memmap2::Mmap> {
        Arc::clone(&self.data)
    }

    /// An error about this file, for callers that find something wrong in its contents.
    pub fn malformed(&self, what: impl Into<String>) -> GgufError {
        GgufError::Malformed { path: self.path.clone(), what: what.into() }
    }
}

/// [`GgufFile::fingerprint`] of a file's bytes.
pub fn fingerprint(bytes: &[u8]) -> String {
    format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

#[allow(unsafe_code)]
fn map(file: &File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the mapping is read-only and model files are not modified while a worker runs; a file truncated
    // underneath us is the one case mmap cannot guard against, as for every mmap-based model loader.
    unsafe { memmap2::Mmap::map(file) }
}
