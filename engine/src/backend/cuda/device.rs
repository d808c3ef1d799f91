//! [`Gpu`] on a CUDA device, for the fused forward (`backend::gpu`): memory from the driver, kernels from
//! `kernels.cu` compiled by NVRTC, matmuls through cuBLAS, recordings as CUDA graphs. All of it on one stream of
//! its own (the legacy default stream cannot be captured into a graph), so cudarc's tracking of which stream
//! touched which buffer is turned off: nothing here is ever used from a second stream.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, result};

use super::profile::Profile;
use super::{CudaError, DeviceInfo, KERNEL_NAMES, fail, runtime};
use crate::backend::gpu::{Arg, DevicePtr as Ptr, Gpu};
use crate::forward::ForwardError;

/// cuBLAS's workspace, given to it up front: a matmul being captured into a graph must not allocate.
const BLAS_WORKSPACE: usize = 32 << 20;

/// One CUDA device as a [`Gpu`].
pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
    /// Every allocation, by address (dropping one frees it, in order on the stream).
    memory: HashMap<Ptr, CudaSlice<u8>>,
    info: DeviceInfo,
    /// Device time by kernel, when asked for (`TANDEM_CUDA_PROFILE=1`).
    profile: Option<Profile>,
}

impl CudaGpu {
    /// Opens device `ordinal` and compiles the kernels for it.
    pub fn open(ordinal: usize) -> Result<CudaGpu, CudaError> {
        let (ctx, info) = super::open(ordinal)?;
        let ptx = super::compile(&super::arch(info.compute_capability))?;
        let module = ctx.load_module(ptx).map_err(runtime)?;
        let mut functions = HashMap::new();
        for name in KERNEL_NAMES {
            let f = module.load_function(name).map_err(|e| CudaError::Runtime(format!("kernel {name}: {e}")))?;
            functions.insert(name, f);
        }
        if !super::cublas_present() {
            return Err(CudaError::NoCublas);
        }
        // SAFETY: every buffer of this device is used on `stream` alone, so no cross-stream waits are needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(runtime)?;
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(runtime)?;
        let profile = super::profile::wanted().then(Profile::default);
        let mut gpu = CudaGpu { ctx, stream, blas, functions, memory: HashMap::new(), info, profile };
        let workspace = gpu.alloc(BLAS_WORKSPACE).map_err(runtime)?;
        // SAFETY: the workspace lives as long as the handle (both are the device's until it drops).
        let status =
            unsafe { blas_sys::cublasSetWorkspace_v2(*gpu.blas.handle(), workspace as *mut c_void, BLAS_WORKSPACE) };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::Runtime(format!("cublasSetWorkspace: {status:?}")));
        }
        Ok(gpu)
    }

    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    fn bind(&self) -> Result<(), ForwardError> {
        // The engine's thread may not be the one that opened the device.
        self.ctx.bind_to_thread().map_err(fail)
    }
}

/// A recorded step: a CUDA graph, instantiated.
pub struct Graph(CudaGraph);

// SAFETY: a graph is launched only through the backend that owns it, which one thread uses at a time (the
// engine's); CUDA requires no more than that calls on one graph not overlap.
unsafe impl Send for Graph {}

impl Gpu for CudaGpu {
    type Recording = Graph;

    fn tensor_cores(&self) -> bool {
        self.info.compute_capability.0 >= 8
    }

    fn alloc(&mut self, bytes: usize) -> Result<Ptr, ForwardError> {
        let slice = self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(fail)?;
        let (at, _) = slice.device_ptr(&self.stream);
        self.memory.insert(at, slice);
        Ok(at)
    }

    fn free(&mut self, at: Ptr) {
        self.memory.remove(&at);
    }

    fn upload(&mut self, to: Ptr, bytes: &[u8]) -> Result<(), ForwardError> {
        self.bind()?;
        // SAFETY: `to` lies in an allocation of this device sized by the caller for `bytes`; from pageable memory
        // the call returns once `bytes` has been staged, so it may be dropped after.
        unsafe { result::memcpy_htod_async(to, bytes, self.stream.cu_stream()) }.map_err(fail)
    }

    fn download(&mut self, from: Ptr, bytes: &mut [u8]) -> Result<(), ForwardError> {
        self.bind()?;
        // SAFETY: as `upload`; into pageable memory the copy has completed when the call returns, and the stream
        // is synchronized before `bytes` is read.
        unsafe { result::memcpy_dtoh_async(bytes, from, self.stream.cu_stream()) }.map_err(fail)?;
        self.stream.synchronize().map_err(fail)?;
        match self.profile.as_mut() {
            Some(p) => p.collect().map_err(fail),
            None => Ok(()),
        }
    }

    fn begin_step(&mut self, label: &'static str) {
        if let Some(p) = self.profile.as_mut() {
            p.begin_step(label);
        }
    }

    fn launch(
        &mut self,
        kernel: &'static str,
        grid: (u32, u32),
        threads: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), ForwardError> {
        self.bind()?;
        let f = self.functions.get(kernel).ok_or_else(|| fail(format!("no kernel {kernel}")))?;
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        let stream = &self.stream;
        let mut run = move || {
            // SAFETY: the arguments follow the kernel's signature (`backend::gpu` issues them in kernels.cu's
            // order and types), every pointer lies in this device's memory sized by the caller, and the slots
            // outlive the call (the driver copies the values at launch).
            unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    (grid.0, grid.1, 1),
                    (threads, 1, 1),
                    shared,
                    stream.cu_stream(),
                    &mut params,
                )
            }
            .map_err(fail)
        };
        match self.profile.as_mut() {
            Some(p) => p.around(stream, kernel, run),
            None => run(),
        }
    }

    fn gemm(&mut self, w: Ptr, rows: usize, cols: usize, x: Ptr, n: usize, y: Ptr) -> Result<(), ForwardError> {
        let blas = &self.blas;
        let run = || gemm(blas, w, rows, cols, x, n, y);
        match self.profile.as_mut() {
            Some(p) => p.around(&self.stream, "gemm", run),
            None => run(),
        }
    }

    fn begin_recording(&mut self) -> Result<bool, ForwardError> {
        if self.profile.is_some() {
            // The profile times each launch: the work runs as issued.
            return Ok(false);
        }
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(fail)?;
        Ok(true)
    }

    fn end_recording(&mut self) -> Result<Graph, ForwardError> {
        self.stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(fail)?
            .map(Graph)
            .ok_or_else(|| fail("the capture recorded nothing"))
    }

    fn replay(&mut self, recording: &Graph) -> Result<(), ForwardError> {
        recording.0.launch().map_err(fail)
    }
}

/// `y[n][rows] = x[n][cols] · w[rows][cols]ᵀ` through cuBLAS (f16 in, f32 accumulated and out), on the handle's
/// stream; both forward passes' matmuls.
pub(super) fn gemm(
    blas: &CudaBlas,
    w: Ptr,
    rows: usize,
    cols: usize,
    x: Ptr,
    n: usize,
    y: Ptr,
) -> Result<(), ForwardError> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // Column-major: yᵀ[rows][n] = (wᵀ)ᵀ · xᵀ, with w read transposed.
    // SAFETY: the three buffers hold rows*cols, n*cols and n*rows elements (the caller's layout), on the
    // handle's stream after the work that wrote x.
    unsafe {
        blas::gemm_ex(
            *blas.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            rows as i32,
            n as i32,
            cols as i32,
            (&alpha as *const f32).cast::<c_void>(),
            w as *const c_void,
            blas_sys::cudaDataType_t::CUDA_R_16F,
            cols as i32,
            x as *const c_void,
            blas_sys::cudaDataType_t::CUDA_R_16F,
            cols as i32,
            (&beta as *const f32).cast::<c_void>(),
            y as *mut c_void,
            blas_sys::cudaDataType_t::CUDA_R_32F,
            rows as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(fail)
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", p.report());
        }
    }
}
