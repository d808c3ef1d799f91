//! The fused forward pass (`engine::backend::gpu`) run over the kernels compiled for the CPU, against the CPU
//! engine's logits: the order of the work, the stacked weights, the buffers' offsets, the packed indices, the
//! paged mirror and the write-back to the host's store are the ones the CUDA device gets; only the memory, the
//! launches and the matmuls are this file's. Recording is a list of the work issued, replayed as it was issued, so
//! that a replayed decode step reads the indices uploaded for it, as a CUDA graph does.

use std::collections::HashMap;

use engine::backend::gpu::{Arg, DevicePtr, Gpu, GpuForward, Options, SHARED_LIMIT, matvec_fits};
use engine::backend::{Backend, Next};
use engine::forward::ForwardError;
use engine::model::Model;
use engine::parity::{self, Plan};
use engine::synth::{self, SynthShape};
use half::f16;

/// One piece of work, as issued.
#[derive(Clone, Debug)]
pub enum Work {
    Launch { kernel: &'static str, grid: (u32, u32), threads: u32, shared: u32, args: Vec<Arg> },
    Gemm { w: DevicePtr, rows: usize, cols: usize, x: DevicePtr, n: usize, y: DevicePtr },
}

/// Host memory as device memory; work runs when issued, unless it is being recorded.
#[derive(Default)]
pub struct HostGpu {
    memory: HashMap<DevicePtr, Vec<u8>>,
    recording: Option<Vec<Work>>,
    /// Recordings made and replays run: the test checks the recorded path was taken.
    recorded: usize,
    replayed: usize,
    /// Bytes copied back to the host.
    downloaded: usize,
}

impl HostGpu {
    fn run(&mut self, work: Work) -> Result<(), ForwardError> {
        if let Some(r) = self.recording.as_mut() {
            r.push(work);
            return Ok(());
        }
        match work {
            Work::Launch { kernel, grid, threads, shared, args } => {
                // As on a device: a launch asking for more shared memory than it gives unasked fails.
                if shared as usize > SHARED_LIMIT {
                    return Err(ForwardError::Device(format!(
                        "kernel {kernel} asked for {shared} bytes of shared memory"
                    )));
                }
                match super::try_launch(kernel, grid, threads, shared, &args) {
                    0 => Ok(()),
                    _ => Err(ForwardError::Device(format!("kernel {kernel} did not launch"))),
                }
            }
            Work::Gemm { w, rows, cols, x, n, y } => {
                // SAFETY: the three addresses lie in allocations of this device that the forward sized for
                // rows*cols and n*cols f16 values and n*rows f32 values.
                #[allow(unsafe_code)]
                let (w, x, y) = unsafe {
                    (
                        std::slice::from_raw_parts(w as *const f16, rows * cols),
                        std::slice::from_raw_parts(x as *const f16, n * cols),
                        std::slice::from_raw_parts_mut(y as *mut f32, n * rows),
                    )
                };
                for (xi, yi) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows)) {
                    for (wr, out) in w.chunks_exact(cols).zip(yi.iter_mut()) {
                        *out = wr.iter().zip(xi).map(|(a, b)| a.to_f32() * b.to_f32()).sum();
                    }
                }
                Ok(())
            }
        }
    }
}

impl Gpu for HostGpu {
    type Recording = Vec<Work>;

    fn tensor_cores(&self) -> bool {
        true
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError> {
        // 256 bytes of room to align the start.
        let v = vec![0u8; bytes + 256];
        let at = (v.as_ptr() as u64).next_multiple_of(256);
        self.memory.insert(at, v);
        Ok(at)
    }

    fn free(&mut self, at: DevicePtr) {
        self.memory.remove(&at);
    }

    fn upload(&mut self, to: DevicePtr, bytes: &[u8]) -> Result<(), ForwardError> {
        assert!(self.recording.is_none(), "an upload while recording");
        // SAFETY: `to` lies in an allocation of this device with room for `bytes` (the forward's layout).
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), to as *mut u8, bytes.len())
        };
        Ok(())
    }

    fn download(&mut self, from: DevicePtr, bytes: &mut [u8]) -> Result<(), ForwardError> {
        assert!(self.recording.is_none(), "a download while recording");
        self.downloaded += bytes.len();
        // SAFETY: as `upload`.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(from as *const u8, bytes.as_mut_ptr(), bytes.len())
        };
        Ok(())
    }

    fn launch(
        &mut self,
        kernel: &'static str,
        grid: (u32, u32),
        threads: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), ForwardError> {
        self.run(Work::Launch { kernel, grid, threads, shared, args: args.to_vec() })
    }

    fn gemm(
        &mut self,
        w: DevicePtr,
        rows: usize,
        cols: usize,
        x: DevicePtr,
        n: usize,
        y: DevicePtr,
    ) -> Result<(), ForwardError> {
        self.run(Work::Gemm { w, rows, cols, x, n, y })
    }

    fn begin_recording(&mut self) -> Result<bool, ForwardError> {
        self.recording = Some(Vec::new());
        Ok(true)
    }

    fn end_recording(&mut self) -> Result<Vec<Work>, ForwardError> {
        self.recorded += 1;
        self.recording.take().ok_or_else(|| ForwardError::Device("not recording".into()))
    }

    fn replay(&mut self, recording: &Vec<Work>) -> Result<(), ForwardError> {
        self.replayed += 1;
        recording.iter().try_for_each(|w| self.run(w.clone()))
    }
}

/// A synthetic model of [`SHAPE`] from `seed`, written to a file of this process's own (the caller removes it).
pub fn synthetic(seed: u64) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("tandem-cuda-host-{seed}-{}.gguf", std::process::id()));
    synth::write(&path, &SHAPE, seed).expect("written");
    path
}

/// Small enough for the fibers: two layers, four query heads over two KV heads; prompts that cross `attend`'s
/// 128-key tiles, a chunked prefill, three batched decode steps and a mixed step.
pub const SHAPE: SynthShape =
    SynthShape { n_layers: 2, n_embd: 64, n_ff: 128, n_heads: 4, n_kv_heads: 2, n_vocab: 1024, context_len: 512 };
const PLAN: Plan = Plan { prompts: &[1, 17, 150], chunk: 64, decode_steps: 3 };

#[test]
fn the_fused_forward_over_these_kernels_gives_the_cpu_engines_logits() {
    let path = synthetic(7);
    let team = engine::team::Team::new(0, "test").expect("team");
    let mut cpu = engine::backend::cpu::CpuBackend::new(Model::open(&path).expect("loads"), team);
    let (want, want_kv) = parity::run_plan(&mut cpu, &PLAN).expect("the CPU runs");
    let model = Model::open(&path).expect("loads");
    // As issued with prompts' attention on tensor cores, recorded, and recorded through the matrix-vector kernels
    // reading the weights as the file stores them (Q4_1, and the output projection Q8_0). (The other tests take the
    // matrix-vector kernels over f16 weights.)
    let configurations = [(false, false, true, false), (true, false, false, false), (true, true, false, true)];
    for (record, matvec, tensor_cores, quantized) in configurations {
        let options = Options { record, matvec, tensor_cores, quantized };
        let mut fused = GpuForward::new(HostGpu::default(), &model, "host", options).expect("weights up");
        let (got, got_kv) = parity::run_plan(&mut fused, &PLAN).expect("the fused forward runs");
        assert_eq!(fused.name(), "host");
        for c in parity::compare(&want, &got).expect("the same steps") {
            assert!(c.passes(0.01), "{options:?}: {c:?}");
        }
        // Every K/V row the steps computed came back to the host's store, where the CPU engine put its own
        // (within the f16 inputs' rounding: the CPU's matmuls read f32 activations).
        let (mut worst, mut largest) = (0f32, 0f32);
        for b in 0..want_kv.capacity() {
            let block = engine::kv::BlockId(b as u32);
            for (w, g) in want_kv.block(block).iter().zip(got_kv.block(block)) {
                worst = worst.max((w.to_f32() - g.to_f32()).abs());
                largest = largest.max(w.to_f32().abs());
            }
        }
        assert!(largest > 0.0 && worst <= 0.01 * largest, "{options:?}: K/V off by {worst} of {largest}");
        // Recording on: two shapes were recorded, the one-token prompt's step (one sequence, one token, its logits:
        // a decode step's shape) and the first decode step of three sequences, which the two after it replayed
        // too; the longer prompts, the chunks and the mixed step ran as issued.
        let gpu = fused.gpu();
        assert_eq!((gpu.recorded, gpu.replayed), if record { (2, 4) } else { (0, 0) }, "{options:?}");
    }
    std::fs::remove_file(path).ok();
}

/// A model whose feed-forward is too wide for the matrix-vector kernels' shared memory (two rows of 8,192 floats
/// are 64 KiB) takes the matmuls for its small steps too, and gives the CPU's logits; SmolLM2-135M's shape and the
/// tests' fit, a Llama-3-8B's (4,096 wide) does not.
#[test]
fn a_model_too_wide_for_the_matrix_vector_kernels_takes_the_matmuls() {
    let shape = SynthShape { n_layers: 1, n_ff: 8192, ..SHAPE };
    let path = std::env::temp_dir().join(format!("tandem-cuda-host-wide-{}.gguf", std::process::id()));
    synth::write(&path, &shape, 11).expect("written");
    let model = Model::open(&path).expect("loads");
    assert!(!matvec_fits(&model.config));
    let fits = |shape: &SynthShape| {
        let config = engine::model::ModelConfig {
            n_layers: shape.n_layers,
            n_embd: shape.n_embd,
            n_ff: shape.n_ff,
            n_heads: shape.n_heads,
            n_kv_heads: shape.n_kv_heads,
            head_dim: shape.n_embd / shape.n_heads,
            rope_base: 10_000.0,
            rms_eps: 1e-5,
            n_vocab: shape.n_vocab,
            context_len: shape.context_len,
        };
        matvec_fits(&config)
    };
    assert!(fits(&SHAPE) && fits(&SynthShape::SMOLLM2_135M));
    assert!(!fits(&SynthShape { n_embd: 4096, n_ff: 14_336, n_heads: 32, n_kv_heads: 8, ..SynthShape::SMOLLM2_135M }));
    let team = engine::team::Team::new(0, "test").expect("team");
    let mut cpu = engine::backend::cpu::CpuBackend::new(Model::open(&path).expect("loads"), team);
    // Two sequences decoding together: their rows of the feed-forward's output would ask for 64 KiB.
    let plan = Plan { prompts: &[1, 17], chunk: 64, decode_steps: 2 };
    let (want, _) = parity::run_plan(&mut cpu, &plan).expect("the CPU runs");
    let options = Options { record: true, matvec: true, tensor_cores: false, quantized: true };
    let mut fused = GpuForward::new(HostGpu::default(), &model, "host", options).expect("weights up");
    let (got, _) = parity::run_plan(&mut fused, &plan).expect("the fused forward runs");
    for c in parity::compare(&want, &got).expect("the same steps") {
        assert!(c.passes(0.01), "{c:?}");
    }
    std::fs::remove_file(path).ok();
}

/// Decode steps of one and two sequences, alternating, after their prompts: each batch size is recorded once and
/// replayed with the other's recording kept, so a replay must be the one of its own size. `greedy(step, sequence)`
/// says which chunks ask for their top token only (the prompts' steps are steps 0 and 1, the decodes' 2 to 7).
fn alternating_decodes(backend: &mut dyn Backend, greedy: &dyn Fn(u32, usize) -> bool) -> Vec<Next> {
    use engine::backend::StepContext;
    use engine::forward::SeqChunk;
    use engine::kv::{BlockId, KvStore};
    let layout = backend.kv_layout(parity::BLOCK_TOKENS);
    let mut kv = KvStore::new(layout, 8);
    let tables = [[0, 1, 2, 3].map(BlockId), [4, 5, 6, 7].map(BlockId)];
    let context = StepContext { started: std::time::Instant::now(), onboarded: [0, 0] };
    let mut lens = [20usize, 40];
    let mut out = Vec::new();
    for (s, &len) in lens.iter().enumerate() {
        let prompt: Vec<u32> = (0..len as u32).map(|i| 300 + 7 * i + s as u32).collect();
        let greedy = greedy(s as u32, s);
        let chunk = SeqChunk { tokens: &prompt, start: 0, blocks: &tables[s], logits: true, greedy, scored: None };
        out.extend(backend.forward(&mut kv, &[chunk], context).expect("a prompt"));
    }
    for step in 0..6u32 {
        let seqs = if step % 2 == 0 { 1 } else { 2 };
        let tokens: Vec<[u32; 1]> = (0..seqs).map(|s| [500 + step * 3 + s as u32]).collect();
        let batch: Vec<SeqChunk<'_>> = (0..seqs)
            .map(|s| {
                let greedy = greedy(step + 2, s);
                SeqChunk { tokens: &tokens[s], start: lens[s], blocks: &tables[s], logits: true, greedy, scored: None }
            })
            .collect();
        out.extend(backend.forward(&mut kv, &batch, context).expect("a decode step"));
        lens.iter_mut().take(seqs).for_each(|l| *l += 1);
    }
    out
}

fn logits(next: &Next) -> &[f32] {
    match next {
        Next::Logits(v) => v,
        other => panic!("logits were asked for, not {other:?}"),
    }
}

#[test]
fn a_recorded_decode_step_is_replayed_for_its_own_batch_size() {
    let path = synthetic(8);
    let team = engine::team::Team::new(0, "test").expect("team");
    let never = |_, _| false;
    let mut cpu = engine::backend::cpu::CpuBackend::new(Model::open(&path).expect("loads"), team);
    let want = alternating_decodes(&mut cpu, &never);
    let model = Model::open(&path).expect("loads");
    for matvec in [false, true] {
        let options = Options { record: true, matvec, ..Options::default() };
        let mut fused = GpuForward::new(HostGpu::default(), &model, "host", options).expect("weights up");
        let got = alternating_decodes(&mut fused, &never);
        assert_eq!(got.len(), want.len());
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let (g, w) = (logits(g), logits(w));
            let largest = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 0.01 * largest, "{options:?}, logits {k}: off by {worst} of {largest}");
        }
        // Two recordings (one sequence, two sequences), each made at its first step; six decode steps replayed.
        assert_eq!((fused.gpu().recorded, fused.gpu().replayed), (2, 6), "{options:?}");
    }
    std::fs::remove_file(path).ok();
}

/// A chunk that takes only its top token gets the index of its largest logit, computed on the device, and its logits
/// stay there; the other chunks of the same steps, recorded or not, get their logits as before.
#[test]
fn greedy_rows_get_their_top_token_and_leave_their_logits_on_the_device() {
    let path = synthetic(9);
    let model = Model::open(&path).expect("loads");
    let vocab = model.config.n_vocab;
    // The second prompt, then each decode step's sequence 0 but every third step's sequence 1 too.
    let some = |step: u32, s: usize| (step == 1 && s == 1) || (step >= 2 && (s == 0 || step.is_multiple_of(3)));
    // Issued through the matmuls, and recorded through the matrix-vector kernels (the third way of the test above
    // takes nothing new here: the top tokens come after the logits, whichever computed them).
    for (record, matvec) in [(false, false), (true, true)] {
        let options = Options { record, matvec, ..Options::default() };
        let mut all_logits = GpuForward::new(HostGpu::default(), &model, "host", options).expect("weights up");
        let want = alternating_decodes(&mut all_logits, &|_, _| false);
        let mut fused = GpuForward::new(HostGpu::default(), &model, "host", options).expect("weights up");
        let got = alternating_decodes(&mut fused, &some);
        assert_eq!(got.len(), want.len());
        let mut tokens = 0;
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let w = logits(w);
            match g {
                Next::Token(t) => {
                    assert_eq!(*t, engine::sampling::argmax(w), "{options:?}, row {k}");
                    tokens += 1;
                }
                // The same kernels over the same inputs: the same values.
                Next::Logits(g) => assert_eq!(g, w, "{options:?}, row {k}"),
                Next::Draw(_) => panic!("a draw from the fused forward"),
            }
        }
        // The second prompt's, sequence 0's in each of the six decode steps, sequence 1's in the step numbered 3.
        assert_eq!(tokens, 1 + 6 + 1, "{options:?}: the rows that asked for their top token");
        // Those rows' logits stayed on the device; a step with a greedy row brings back every row's token instead
        // (4 bytes each: the second prompt's step, then the decode steps of 1, 2, 1, 2, 1 and 2 rows).
        let (all, fewer) = (all_logits.gpu().downloaded, fused.gpu().downloaded);
        assert_eq!(all - fewer, tokens * vocab * 4 - 4 * (1 + 9), "{options:?}: bytes copied back");
    }
    std::fs::remove_file(path).ok();
}

/// A block a step wrote on the device and the store then overwrote whole (an import into a block freed and taken
/// again) keeps the store's values when it is handed back: only blocks the device holds the newest of come back.
#[test]
fn a_block_the_store_overwrote_since_is_not_handed_back_over_it() {
    use engine::backend::StepContext;
    use engine::forward::SeqChunk;
    use engine::kv::{BlockId, KvStore};
    let path = synthetic(12);
    let model = Model::open(&path).expect("loads");
    let mut fused = GpuForward::new(HostGpu::default(), &model, "host", Options::default()).expect("weights up");
    let mut kv = KvStore::new(fused.kv_layout(parity::BLOCK_TOKENS), 4);
    let blocks = [BlockId(0), BlockId(1)];
    let context = StepContext { started: std::time::Instant::now(), onboarded: [0, 0] };
    let prompt: Vec<u32> = (0..20).map(|i| 100 + 3 * i).collect();
    let chunk = SeqChunk { tokens: &prompt, start: 0, blocks: &blocks, logits: true, greedy: true, scored: None };
    fused.forward(&mut kv, &[chunk], context).expect("a prompt");
    // Block 1 overwritten whole in the store; block 0 left to the device.
    let imported = half::f16::from_f32(0.5);
    kv.block_mut(blocks[1]).fill(imported);
    assert!(kv.block(blocks[0]).iter().all(|v| v.to_f32() == 0.0), "the device's K/V stay there until asked for");
    fused.write_back(&mut kv, &blocks).expect("handed back");
    assert!(kv.block(blocks[0]).iter().any(|v| v.to_f32() != 0.0), "the device's K/V of block 0 came back");
    assert!(kv.block(blocks[1]).iter().all(|&v| v == imported), "block 1 kept what the store wrote");
    std::fs::remove_file(path).ok();
}
