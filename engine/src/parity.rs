//! Backend parity: fixed steps (whole prefills, a chunked prefill, batched decodes, a mixed batch) run through a
//! backend over its own KV store, and the logits of every row that asks for them. The CPU engine's reference mode
//! computes them here and writes them to a file; the GPU machine, which has no Rust toolchain and cannot receive
//! the real model, recomputes them with the CUDA backend on the same synthetic model and compares
//! (`tandem model parity`, `scripts/device/check.sh`).

use std::io::{Read, Write};
use std::path::Path;

use crate::backend::{Backend, StepContext};
use crate::forward::{ForwardError, SeqChunk};
use crate::kv::{BlockId, KvStore};

/// Tokens per KV block in the parity runs (the engine's default).
pub const BLOCK_TOKENS: usize = 16;

/// The steps' sizes.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Prompt lengths of the sequences the steps use (the last is also prefilled in chunks).
    pub prompts: &'static [usize],
    /// Chunk size of the chunked prefill.
    pub chunk: usize,
    /// Batched decode steps after the prefills.
    pub decode_steps: usize,
}

/// The steps `tandem model parity` runs.
pub const PLAN: Plan = Plan { prompts: &[1, 17, 129, 600], chunk: 64, decode_steps: 3 };

/// One step's logits, by name (`prefill/600`, `decode/2/seq1`, …).
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    pub name: String,
    pub values: Vec<f32>,
}

/// A deterministic token id for position `i` of sequence `seq` (the benchmark's prompts: no specials).
fn token(seq: usize, i: usize, vocab: usize) -> u32 {
    crate::bench::prompt_token(i, seq, vocab)
}

/// Runs every parity step through `backend` and returns the logits in order. Sequence `s` owns blocks
/// `s * per_seq ..`; the chunked prefill recomputes the last sequence's prompt into blocks of its own.
pub fn run(backend: &mut dyn Backend) -> Result<Vec<Logits>, ForwardError> {
    run_plan(backend, &PLAN).map(|(logits, _)| logits)
}

/// [`run`] with other sizes; also returns the KV store the steps filled.
pub fn run_plan(backend: &mut dyn Backend, plan: &Plan) -> Result<(Vec<Logits>, KvStore), ForwardError> {
    let (lengths, chunk_len, decode_steps) = (plan.prompts, plan.chunk, plan.decode_steps);
    let vocab = backend.vocab();
    let layout = backend.kv_layout(BLOCK_TOKENS);
    let longest = lengths.iter().max().copied().unwrap_or(1) + decode_steps + 1;
    let per_seq = longest.div_ceil(BLOCK_TOKENS);
    let seqs = lengths.len() + 1;
    let mut kv = KvStore::new(layout, seqs * per_seq);
    let tables: Vec<Vec<BlockId>> =
        (0..seqs).map(|s| (0..per_seq).map(|b| BlockId((s * per_seq + b) as u32)).collect()).collect();
    let prompts: Vec<Vec<u32>> =
        lengths.iter().enumerate().map(|(s, &n)| (0..n).map(|i| token(s, i, vocab)).collect()).collect();
    let context = StepContext { started: std::time::Instant::now(), onboarded: [0, 0] };
    let mut out = Vec::new();
    let mut push = |name: String, logits: Vec<crate::backend::Next>| {
        for (k, next) in logits.into_iter().enumerate() {
            if let crate::backend::Next::Logits(values) = next {
                let name = if k == 0 { name.clone() } else { format!("{name}/{k}") };
                out.push(Logits { name, values });
            }
        }
    };
    // Whole prefills, one sequence per step.
    for (s, p) in prompts.iter().enumerate() {
        let chunk = SeqChunk { tokens: p, start: 0, blocks: &tables[s], logits: true, greedy: false, scored: None };
        push(format!("prefill/{}", p.len()), backend.forward(&mut kv, &[chunk], context)?);
    }
    // The longest prompt again in chunks, into blocks of its own: the last chunk's logits.
    let (last, chunked) = (prompts.len() - 1, prompts.len());
    for (k, piece) in prompts[last].chunks(chunk_len).enumerate() {
        let is_last = (k + 1) * chunk_len >= prompts[last].len();
        let chunk = SeqChunk {
            tokens: piece,
            start: k * chunk_len,
            blocks: &tables[chunked],
            logits: is_last,
            greedy: false,
            scored: None,
        };
        push(format!("chunked/{}", prompts[last].len()), backend.forward(&mut kv, &[chunk], context)?);
    }
    // Batched decodes: every sequence one token per step, all in one batch.
    let mut lens: Vec<usize> = lengths.to_vec();
    for step in 0..decode_steps {
        let next: Vec<[u32; 1]> = (0..lengths.len()).map(|s| [token(s, lens[s], vocab)]).collect();
        let batch: Vec<SeqChunk<'_>> = (0..lengths.len())
            .map(|s| SeqChunk {
                tokens: &next[s],
                start: lens[s],
                blocks: &tables[s],
                logits: true,
                greedy: false,
                scored: None,
            })
            .collect();
        push(format!("decode/{step}"), backend.forward(&mut kv, &batch, context)?);
        lens.iter_mut().for_each(|l| *l += 1);
    }
    // A mixed batch: the chunked sequence's next token decoding next to sequence 0's next two tokens as a chunk.
    let (a, b) =
        ([token(chunked, lens[last] - decode_steps, vocab)], [token(0, lens[0], vocab), token(0, lens[0] + 1, vocab)]);
    let batch = [
        SeqChunk {
            tokens: &a,
            start: lengths[last],
            blocks: &tables[chunked],
            logits: true,
            greedy: false,
            scored: None,
        },
        SeqChunk { tokens: &b, start: lens[0], blocks: &tables[0], logits: true, greedy: false, scored: None },
    ];
    push("mixed".to_string(), backend.forward(&mut kv, &batch, context)?);
    // The store whole: a backend that keeps K/V of its own hands them back.
    let all: Vec<BlockId> = (0..kv.capacity() as u32).map(BlockId).collect();
    backend.write_back(&mut kv, &all)?;
    Ok((out, kv))
}

/// Writes logits as a small binary file: per entry, the name's length (u32) and bytes, the value count (u32)
/// and the f32 values, all little-endian.
pub fn write(path: &Path, logits: &[Logits]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for l in logits {
        f.write_all(&(l.name.len() as u32).to_le_bytes())?;
        f.write_all(l.name.as_bytes())?;
        f.write_all(&(l.values.len() as u32).to_le_bytes())?;
        for v in &l.values {
            f.write_all(&v.to_le_bytes())?;
        }
    }
    f.flush()
}

/// Reads what [`write`] wrote.
pub fn read(path: &Path) -> std::io::Result<Vec<Logits>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut bytes)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "truncated parity file");
    let mut rest: &[u8] = &bytes;
    let mut take = |n: usize| -> std::io::Result<&[u8]> {
        if rest.len() < n {
            return Err(bad());
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let mut out = Vec::new();
    // Entries until the bytes end exactly: a partial entry, however short, is an error.
    let mut left = bytes.len();
    while left > 0 {
        let len = u32::from_le_bytes(take(4)?.try_into().map_err(|_| bad())?) as usize;
        let name = String::from_utf8_lossy(take(len)?).into_owned();
        let count = u32::from_le_bytes(take(4)?.try_into().map_err(|_| bad())?) as usize;
        let values = take(count * 4)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        out.push(Logits { name, values });
        left -= 8 + len + count * 4;
    }
    Ok(out)
}

/// How one entry compares with its reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub name: String,
    /// Largest absolute difference over the vocabulary.
    pub max_abs: f32,
    /// `max_abs` over the reference's largest magnitude.
    pub max_rel: f32,
    /// Whether both pick the same top token.
    pub same_top1: bool,
    /// The reference's lead of its top logit over the runner-up.
    pub margin: f32,
}

impl Comparison {
    /// Within `max_rel`, and the same top token wherever the reference's margin is clear (more than twice the
    /// largest error: a closer race may go either way at this precision).
    pub fn passes(&self, max_rel: f32) -> bool {
        self.max_rel <= max_rel && (self.same_top1 || self.margin <= 2.0 * self.max_abs)
    }
}

/// Compares `got` with `reference` entry by entry (by name; an entry missing from `got` is an error).
pub fn compare(reference: &[Logits], got: &[Logits]) -> Result<Vec<Comparison>, String> {
    reference
        .iter()
        .map(|r| {
            let g = got.iter().find(|g| g.name == r.name).ok_or_else(|| format!("{}: not computed", r.name))?;
            if g.values.len() != r.values.len() {
                return Err(format!("{}: {} logits, the reference has {}", r.name, g.values.len(), r.values.len()));
            }
            let max_abs = r.values.iter().zip(&g.values).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let scale = r.values.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
            let top = |v: &[f32]| {
                v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
            };
            let (best, lead) = top(&r.values);
            let second =
                r.values.iter().enumerate().filter(|&(i, _)| i != best).fold(f32::NEG_INFINITY, |m, (_, &x)| m.max(x));
            Ok(Comparison {
                name: r.name.clone(),
                max_abs,
                max_rel: max_abs / scale,
                same_top1: best == top(&g.values).0,
                margin: lead - second,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_files_read_back_and_compare() {
        let path = std::env::temp_dir().join(format!("tandem-parity-{}.bin", std::process::id()));
        let a = vec![
            Logits { name: "prefill/1".into(), values: vec![0.5, -1.0, 2.0] },
            Logits { name: "decode/0/1".into(), values: vec![1.0, 3.0, -2.0] },
        ];
        write(&path, &a).expect("written");
        assert_eq!(read(&path).expect("read"), a);
        // Any cut is an error, however few bytes the last entry lost or kept.
        let bytes = std::fs::read(&path).expect("bytes");
        for cut in [1, 2, 3, 5, bytes.len() - 4, bytes.len() - 1] {
            std::fs::write(&path, &bytes[..cut]).expect("cut");
            assert!(read(&path).is_err(), "{cut} of {} bytes read as whole", bytes.len());
        }
        let mut b = a.clone();
        b[1].values[0] = 3.5;
        let c = compare(&a, &b).expect("comparable");
        assert_eq!((c[0].max_abs, c[0].same_top1), (0.0, true));
        assert_eq!((c[1].max_abs, c[1].same_top1, c[1].margin), (2.5, false, 2.0));
        assert!((c[1].max_rel - 2.5 / 3.0).abs() < 1e-6);
        // A top token lost to an error larger than half the reference's margin is a close race, not a failure.
        assert!(c[1].passes(1.0) && !c[1].passes(0.5));
        let mut clear = c[1].clone();
        clear.margin = 6.0;
        assert!(!clear.passes(1.0));
        assert!(compare(&a, &b[..1]).is_err());
        std::fs::remove_file(path).ok();
    }
}
