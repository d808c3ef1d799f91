//! The CUDA backend (feature `cuda`): finding the device, compiling the kernels, the forward pass.
//!
//! Nothing CUDA is linked at build time (cudarc loads `libcuda`, `libnvrtc` and `libcublas` when first used), so
//! the engine builds and lints with this feature on machines without a GPU. Each library's presence is checked
//! before its first call: cudarc panics when a library it needs cannot be loaded, and a missing driver must be
//! one clear sentence at start-up instead. Kernels are the `.cu` source next to this file, compiled by NVRTC for
//! the device's own compute capability (PTX from a toolkit newer than the driver would not load), once per
//! process.
//!
//! [`CudaBackend`] is the forward pass over these kernels and cuBLAS, checked on an H100 (docs/cuda.md).

mod device;
mod forward;
mod profile;

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::forward::ForwardError;

pub use device::CudaGpu;
pub use forward::CudaBackend;

/// Which forward pass the CUDA backend runs, from `TANDEM_CUDA_FORWARD` (unset: `plain`): `plain`, the first
/// forward, checked on an H100 ([`CudaBackend`]); `fused`, the fused forward over [`CudaGpu`]
/// (`backend::gpu`), checked on the CPU with the same kernels but not yet on a GPU; `graphs`, the fused forward
/// with decode steps recorded as CUDA graphs; `graphs-mv`, that with steps of up to four rows through
/// matrix-vector kernels over the quantized weights instead of cuBLAS (`backend::gpu::Options::matvec`,
/// `quantized`); `graphs-mv-tc`, that with prompts' attention on tensor cores (`tensor_cores`). The choice stays
/// an environment variable until the fused forward has been measured on a GPU and replaces the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardKind {
    Plain,
    Fused,
    Graphs,
    GraphsMatvec,
    /// `graphs-mv` with prompts' attention on tensor cores.
    GraphsMatvecTensorCores,
}

/// The variable [`ForwardKind`] is read from.
pub const FORWARD_VAR: &str = "TANDEM_CUDA_FORWARD";

impl ForwardKind {
    /// The kind `value` names; `Err` is a sentence for the user.
    pub fn parse(value: Option<&str>) -> Result<ForwardKind, String> {
        match value.map(str::trim) {
            None | Some("") | Some("plain") => Ok(ForwardKind::Plain),
            Some("fused") => Ok(ForwardKind::Fused),
            Some("graphs") => Ok(ForwardKind::Graphs),
            Some("graphs-mv") => Ok(ForwardKind::GraphsMatvec),
            Some("graphs-mv-tc") => Ok(ForwardKind::GraphsMatvecTensorCores),
            Some(other) => Err(format!(
                "{FORWARD_VAR}={other:?} is not a CUDA forward pass: plain, fused, graphs, graphs-mv or graphs-mv-tc"
            )),
        }
    }

    /// The kind the environment asks for.
    pub fn from_env() -> Result<ForwardKind, String> {
        ForwardKind::parse(std::env::var(FORWARD_VAR).ok().as_deref())
    }
}

/// The kernels' source.
pub const KERNELS: &str = include_str!("kernels.cu");

/// Every kernel the source defines, by name (each is looked up after loading; a missing one is an error).
pub const KERNEL_NAMES: [&str; 23] = [
    "dequant_q8_0_f16",
    "dequant_q4_1_f16",
    "embed_f16",
    "rms_norm",
    "rope",
    "store_kv",
    "attention",
    "silu_mul",
    "add",
    "to_f16",
    "residual_norm",
    "rope_store",
    "attend",
    "swiglu",
    "norm_matvec",
    "norm_swiglu",
    "matvec_add",
    "attend_rows",
    "attend_split",
    "norm_qkv_rope",
    "combine_matvec_add",
    "argmax_rows",
    "attend_rows_tc",
];

/// Why the CUDA backend cannot start, as a sentence for whoever started it.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no NVIDIA driver on this machine (libcuda.so could not be loaded): CUDA needs an NVIDIA GPU and its \
         driver; compute on the CPU instead (--device cpu; --engine cpu for workers)"
    )]
    NoDriver,
    #[error("CUDA device {ordinal}: {why}")]
    Device { ordinal: usize, why: String },
    #[error(
        "the CUDA runtime compiler (libnvrtc.so.13) could not be loaded: install CUDA 13's NVRTC (e.g. `pip \
         install nvidia-cuda-nvrtc==13.0.*`) and put its lib directory on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("the CUDA kernels did not compile for {arch}: {log}")]
    Compile { arch: String, log: String },
    #[error(
        "cuBLAS (libcublas.so.13) could not be loaded: install CUDA 13's cuBLAS (e.g. `pip install \
         nvidia-cublas==13.0.*`) and put its lib directory on LD_LIBRARY_PATH"
    )]
    NoCublas,
    #[error("CUDA: {0}")]
    Runtime(String),
}

/// A driver or library failure while opening the device or loading the model, as [`CudaError`].
fn runtime(e: impl std::fmt::Display) -> CudaError {
    CudaError::Runtime(e.to_string())
}

/// A driver or library failure during a step, as the engine's [`ForwardError`].
fn fail(e: impl std::fmt::Display) -> ForwardError {
    ForwardError::Device(format!("CUDA: {e}"))
}

/// The device a backend runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor).
    pub compute_capability: (i32, i32),
    pub memory_bytes: usize,
}

/// Whether the NVIDIA driver library can be loaded here.
#[allow(unsafe_code)]
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its known names; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded here.
#[allow(unsafe_code)]
pub fn nvrtc_present() -> bool {
    // SAFETY: as `driver_present`.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether cuBLAS can be loaded here.
#[allow(unsafe_code)]
pub fn cublas_present() -> bool {
    // SAFETY: as `driver_present`.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// Opens device `ordinal`: its context and what it is.
pub fn open(ordinal: usize) -> Result<(Arc<CudaContext>, DeviceInfo), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let device = |why: String| CudaError::Device { ordinal, why };
    let count = CudaContext::device_count().map_err(|e| device(format!("cannot count devices: {e}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(device(format!("this machine has {count} CUDA device(s)")));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| device(format!("cannot create a context: {e}")))?;
    let info = DeviceInfo {
        ordinal,
        name: ctx.name().map_err(|e| device(e.to_string()))?,
        compute_capability: ctx.compute_capability().map_err(|e| device(e.to_string()))?,
        memory_bytes: ctx.total_mem().map_err(|e| device(e.to_string()))?,
    };
    Ok((ctx, info))
}

/// NVRTC's name for the virtual architecture of compute capability `cc`.
pub fn arch(cc: (i32, i32)) -> String {
    format!("compute_{}{}", cc.0, cc.1)
}

/// The kernels compiled for `arch` (e.g. `compute_90`), compiled once per process and architecture.
pub fn compile(arch: &str) -> Result<Ptx, CudaError> {
    static DONE: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, ptx)) = done.iter().find(|(a, _)| a == arch) {
        return Ok(Ptx::from_src(ptx.clone()));
    }
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("tandem_kernels.cu".into()),
        ..CompileOptions::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts).map_err(|e| CudaError::Compile {
        arch: arch.to_string(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })?;
    let src = ptx.to_src();
    done.push((arch.to_string(), src.clone()));
    Ok(Ptx::from_src(src))
}

#[cfg(test)]
mod tests {
    use super::ForwardKind;

    #[test]
    fn the_forward_pass_is_named_by_the_environment_and_a_wrong_name_is_a_sentence() {
        assert_eq!(ForwardKind::parse(None), Ok(ForwardKind::Plain));
        assert_eq!(ForwardKind::parse(Some("")), Ok(ForwardKind::Plain));
        assert_eq!(ForwardKind::parse(Some("fused")), Ok(ForwardKind::Fused));
        assert_eq!(ForwardKind::parse(Some(" graphs ")), Ok(ForwardKind::Graphs));
        assert_eq!(ForwardKind::parse(Some("graphs-mv")), Ok(ForwardKind::GraphsMatvec));
        assert_eq!(ForwardKind::parse(Some("graphs-mv-tc")), Ok(ForwardKind::GraphsMatvecTensorCores));
        let e = ForwardKind::parse(Some("fast")).expect_err("no such pass");
        assert!(
            e.contains("TANDEM_CUDA_FORWARD=\"fast\"") && e.contains("plain, fused, graphs, graphs-mv or graphs-mv-tc"),
            "{e}"
        );
    }
}
