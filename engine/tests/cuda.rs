//! The CUDA backend's parts that need no GPU: the kernels compile with NVRTC for the GPUs Tandem targets, and a
//! machine without a driver gets one clear error. Built only with `--features cuda`; NVRTC must be loadable
//! (`pip install nvidia-cuda-nvrtc==13.0.*`, its lib directory on LD_LIBRARY_PATH: `.ci/run` does both).

#![cfg(feature = "cuda")]

use engine::backend::cuda::{self, CudaError};

#[test]
fn the_kernels_compile_for_ampere_and_hopper() {
    assert!(cuda::nvrtc_present(), "{}", CudaError::NoNvrtc);
    for cc in [(8, 0), (9, 0)] {
        let arch = cuda::arch(cc);
        let ptx = cuda::compile(&arch).unwrap_or_else(|e| panic!("{e}")).to_src();
        for name in cuda::KERNEL_NAMES {
            assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: kernel {name} missing from the PTX");
        }
        assert!(ptx.contains(&format!(".target sm_{}{}", cc.0, cc.1)), "{arch}");
        // The second request for an architecture is served from the process's cache: the same text.
        assert_eq!(cuda::compile(&arch).expect("cached").to_src(), ptx);
    }
}

#[test]
fn an_architecture_nvrtc_does_not_know_is_reported_with_its_log() {
    let e = cuda::compile("compute_1").expect_err("no such architecture");
    assert!(matches!(e, CudaError::Compile { .. }), "{e}");
}

#[test]
fn opening_a_device_is_a_clear_error_where_there_is_none() {
    if !cuda::driver_present() {
        let e = cuda::open(0).expect_err("no driver here");
        assert!(matches!(e, CudaError::NoDriver));
        assert!(e.to_string().contains("no NVIDIA driver"), "{e}");
        return;
    }
    // A GPU machine: device 0 opens, and one past the last is refused by number.
    let (_, info) = cuda::open(0).unwrap_or_else(|e| panic!("{e}"));
    assert!(info.compute_capability.0 >= 7 && info.memory_bytes > 0, "{info:?}");
    let e = cuda::open(1024).expect_err("no such device");
    assert!(e.to_string().contains("CUDA device(s)"), "{e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU with CUDA 13's driver, NVRTC and cuBLAS: run with --run-ignored on one \
            (scripts/device/check.sh makes the same comparison on the GPU machine with the release binary)"]
fn the_cuda_backends_logits_match_the_cpu_reference_on_a_synthetic_model() {
    use engine::model::Model;
    use engine::synth::{self, SynthShape};
    let shape =
        SynthShape { n_layers: 4, n_embd: 256, n_ff: 512, n_heads: 4, n_kv_heads: 2, n_vocab: 4096, context_len: 1024 };
    let path = std::env::temp_dir().join(format!("tandem-cuda-parity-{}.gguf", std::process::id()));
    synth::write(&path, &shape, 11).expect("written");
    let team = engine::team::Team::new(0, "test").expect("team");
    let mut cpu = engine::backend::cpu::CpuBackend::new(Model::open(&path).expect("loads"), team);
    let want = engine::parity::run(&mut cpu).expect("cpu runs");
    let mut gpu = cuda::CudaBackend::new(&Model::open(&path).expect("loads"), 0).unwrap_or_else(|e| panic!("{e}"));
    let got = engine::parity::run(&mut gpu).expect("cuda runs");
    for c in engine::parity::compare(&want, &got).expect("same steps") {
        assert!(c.passes(0.02), "{c:?}");
    }
    std::fs::remove_file(path).ok();
}
