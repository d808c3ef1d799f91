//! Where a step's values lie in device memory: the scratch buffers, laid out once for a number of rows and kept
//! from step to step, and the step's indices, packed into one upload. Pure: offsets and vectors, no device.

use crate::forward::SeqChunk;
use crate::model::ModelConfig;

/// Key splits of `attend_split` (`ATTEND_SPLITS` in kernels.cu).
pub const ATTEND_SPLITS: usize = 8;
/// Decode steps of up to this many rows may split their attention (the matrix-vector kernels' limit).
pub const SPLIT_MAX_ROWS: usize = 4;

/// Offsets are multiples of this (the alignment cuBLAS and vector loads like best).
const ALIGN: usize = 256;

fn align(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// The byte offsets of a step's buffers within one allocation that holds up to `rows` rows, `logit_rows` of them
/// with logits (a prompt's step has thousands of rows and a few logit rows). A buffer's offset depends on these
/// two only, never on a step's own size, so a recorded step (a CUDA graph) stays valid for every later step of its
/// shape until the scratch grows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scratch {
    /// Rows it holds…
    pub rows: usize,
    /// …and rows of logits.
    pub logit_rows: usize,
    /// The residual stream, `[row][n_embd]` f32.
    pub x: usize,
    /// A matmul's output that goes into the residual stream (the output projection's, the down projection's),
    /// `[row][n_embd]` f32.
    pub y: usize,
    /// The normed rows into the next matmul, `[row][n_embd]` f16.
    pub normed: usize,
    /// The stacked Q/K/V projection's output, `[row][n_embd + 2 kv_dim]` f32.
    pub qkv: usize,
    /// Attention's output, `[row][n_embd]` f16.
    pub attended: usize,
    /// The stacked gate/up projection's output, `[row][2 n_ff]` f32.
    pub gate_up: usize,
    /// SiLU(gate) · up, `[row][n_ff]` f16.
    pub act: usize,
    /// Logits, `[logit row][n_vocab]` f32.
    pub logits: usize,
    /// Per logit row, its largest logit's token, `[logit row]` i32 (`argmax_rows`).
    pub top: usize,
    /// A small decode step's split attention, `[row][head][split][2 + head_dim]` f32, for up to
    /// [`SPLIT_MAX_ROWS`] rows.
    pub partials: usize,
    /// Bytes in all.
    pub bytes: usize,
}

impl Scratch {
    /// The layout for up to `rows` rows, `logit_rows` of them with logits, of model `c`.
    pub fn for_rows(c: &ModelConfig, rows: usize, logit_rows: usize) -> Scratch {
        let (d, kv, ff) = (c.n_embd, c.kv_dim(), c.n_ff);
        let mut at = 0;
        let mut next = |bytes: usize| {
            let here = at;
            at += align(bytes);
            here
        };
        let x = next(rows * d * 4);
        let y = next(rows * d * 4);
        let normed = next(rows * d * 2);
        let qkv = next(rows * (d + 2 * kv) * 4);
        let attended = next(rows * d * 2);
        let gate_up = next(rows * 2 * ff * 4);
        let act = next(rows * ff * 2);
        let logits = next(logit_rows * c.n_vocab * 4);
        let top = next(logit_rows * 4);
        let partials = next(SPLIT_MAX_ROWS * c.n_heads * ATTEND_SPLITS * (2 + c.head_dim) * 4);
        Scratch { rows, logit_rows, x, y, normed, qkv, attended, gate_up, act, logits, top, partials, bytes: at }
    }

    /// The rows (or logit rows) to lay out for a step of `n`: a power of two, at least 16, so that the scratch
    /// grows a few times and then stays.
    pub fn rows_for(n: usize) -> usize {
        n.next_power_of_two().max(16)
    }
}

/// Rows per tile of `attend_rows` (`ROWS_TILE` in kernels.cu).
pub const ROWS_TILE: usize = 16;

/// A step's indices, in one vector of `i32` for one upload: per row its token (the bits of the `u32`), its
/// position, the block and slot its K/V go to, and where its sequence's block table starts; the rows whose
/// logits are asked for; for a step that is not a decode step, the rows of single-token chunks (for `attend`) and
/// the tiles of the longer chunks' rows (first row and count, for `attend_rows`); then every sequence's block
/// table. The parts lie in that order, so where each starts depends only on the counts before it: for a decode
/// step, on its row count alone ([`StepIndex::offsets`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepIndex {
    pub ints: Vec<i32>,
    /// Rows.
    pub n: usize,
    /// Rows whose logits are asked for.
    pub m: usize,
    /// Every chunk is one token that asks for its logits (a decode step): `attend` takes every row, and the
    /// launches depend on `n` alone.
    pub decode: bool,
    /// Rows listed for `attend` (none in a decode step: it takes them all)…
    pub singles: usize,
    /// …and tiles for `attend_rows`.
    pub tiles: usize,
    pub o: IndexOffsets,
    /// Per logit row, whether its chunk takes only the top token ([`SeqChunk::greedy`]); not uploaded.
    pub greedy: Vec<bool>,
}

/// Where each part of a [`StepIndex`] starts, in `i32`s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexOffsets {
    pub tokens: usize,
    pub positions: usize,
    pub slot_block: usize,
    pub slot_pos: usize,
    pub table_of: usize,
    pub logit_rows: usize,
    pub singles: usize,
    pub tiles: usize,
    pub tables: usize,
}

impl StepIndex {
    /// The indices of `batch` with blocks of `block_tokens` tokens.
    pub fn of(batch: &[SeqChunk<'_>], block_tokens: usize) -> StepIndex {
        let n: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let m = batch.iter().filter(|c| c.logits && !c.tokens.is_empty()).count();
        let decode = n > 0 && batch.iter().all(|c| c.tokens.len() == 1 && c.logits);
        let (singles, tiles) = if decode {
            (0, 0)
        } else {
            let singles = batch.iter().filter(|c| c.tokens.len() == 1).count();
            let tiles = batch.iter().filter(|c| c.tokens.len() > 1).map(|c| c.tokens.len().div_ceil(ROWS_TILE)).sum();
            (singles, tiles)
        };
        let tables: usize = batch.iter().map(|c| c.blocks.len()).sum();
        let o = StepIndex::offsets(n, m, singles, tiles);
        let mut ints = vec![0i32; o.tables + tables];
        let (mut row, mut logit, mut table, mut single, mut tile) = (0, 0, o.tables, o.singles, o.tiles);
        let mut greedy = Vec::with_capacity(m);
        for chunk in batch {
            let table_at = table;
            for (k, &b) in chunk.blocks.iter().enumerate() {
                ints[table_at + k] = b.0 as i32;
            }
            table += chunk.blocks.len();
            if !decode && chunk.tokens.len() == 1 {
                ints[single] = row as i32;
                single += 1;
            } else if !decode && chunk.tokens.len() > 1 {
                for first in (0..chunk.tokens.len()).step_by(ROWS_TILE) {
                    ints[tile] = (row + first) as i32;
                    ints[tile + 1] = ROWS_TILE.min(chunk.tokens.len() - first) as i32;
                    tile += 2;
                }
            }
            for (k, &t) in chunk.tokens.iter().enumerate() {
                let pos = chunk.start + k;
                ints[o.tokens + row] = t as i32;
                ints[o.positions + row] = pos as i32;
                ints[o.slot_block + row] = chunk.blocks[pos / block_tokens].0 as i32;
                ints[o.slot_pos + row] = (pos % block_tokens) as i32;
                // Relative to the tables' start: the kernels get a pointer to the first table.
                ints[o.table_of + row] = (table_at - o.tables) as i32;
                row += 1;
            }
            if chunk.logits && !chunk.tokens.is_empty() {
                ints[o.logit_rows + logit] = row as i32 - 1;
                logit += 1;
                greedy.push(chunk.greedy);
            }
        }
        StepIndex { ints, n, m, decode, singles, tiles, o, greedy }
    }

    /// Where the parts start for `n` rows, `m` logit rows, `singles` listed rows and `tiles` tiles.
    pub fn offsets(n: usize, m: usize, singles: usize, tiles: usize) -> IndexOffsets {
        let singles_at = 5 * n + m;
        IndexOffsets {
            tokens: 0,
            positions: n,
            slot_block: 2 * n,
            slot_pos: 3 * n,
            table_of: 4 * n,
            logit_rows: 5 * n,
            singles: singles_at,
            tiles: singles_at + singles,
            tables: singles_at + singles + 2 * tiles,
        }
    }

    /// Row `r`'s block and slot in it.
    pub fn slot(&self, r: usize) -> (u32, usize) {
        (self.ints[self.o.slot_block + r] as u32, self.ints[self.o.slot_pos + r] as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::BlockId;

    fn config() -> ModelConfig {
        ModelConfig {
            n_layers: 3,
            n_embd: 64,
            n_ff: 96,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            rope_base: 10_000.0,
            rms_eps: 1e-5,
            n_vocab: 1000,
            context_len: 256,
        }
    }

    #[test]
    fn the_scratch_buffers_are_aligned_apart_and_big_enough() {
        let c = config();
        let s = Scratch::for_rows(&c, 16, 16);
        let (d, kv, ff) = (c.n_embd, c.kv_dim(), c.n_ff);
        let mut parts = [
            (s.x, 16 * d * 4),
            (s.y, 16 * d * 4),
            (s.normed, 16 * d * 2),
            (s.qkv, 16 * (d + 2 * kv) * 4),
            (s.attended, 16 * d * 2),
            (s.gate_up, 16 * 2 * ff * 4),
            (s.act, 16 * ff * 2),
            (s.logits, 16 * c.n_vocab * 4),
            (s.top, 16 * 4),
            (s.partials, SPLIT_MAX_ROWS * c.n_heads * ATTEND_SPLITS * (2 + c.head_dim) * 4),
        ];
        parts.sort();
        for pair in parts.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{parts:?} overlap");
        }
        assert!(parts.iter().all(|(at, _)| at % ALIGN == 0));
        let (last, len) = parts[parts.len() - 1];
        assert!(last + len <= s.bytes);
        assert_eq!((Scratch::rows_for(1), Scratch::rows_for(17), Scratch::rows_for(256)), (16, 32, 256));
    }

    #[test]
    fn a_mixed_step_packs_rows_logit_rows_and_tables_where_its_offsets_say() {
        // A two-token chunk of a sequence at position 15 (it crosses into its second block), then a decode token
        // at position 3 of another; only the second asks for logits, and only for its top token.
        let (a, b) = ([BlockId(7), BlockId(2)], [BlockId(5)]);
        let batch = [
            SeqChunk { tokens: &[10, 11], start: 15, blocks: &a, logits: false, greedy: false, scored: None },
            SeqChunk { tokens: &[12], start: 3, blocks: &b, logits: true, greedy: true, scored: None },
        ];
        let ix = StepIndex::of(&batch, 16);
        assert_eq!((ix.n, ix.m, ix.decode, ix.singles, ix.tiles), (3, 1, false, 1, 1));
        let o = StepIndex::offsets(3, 1, 1, 1);
        assert_eq!(ix.o, o);
        let part = |from: usize, len: usize| ix.ints[from..from + len].to_vec();
        assert_eq!(part(o.tokens, 3), [10, 11, 12]);
        assert_eq!(part(o.positions, 3), [15, 16, 3]);
        assert_eq!(part(o.slot_block, 3), [7, 2, 5]);
        assert_eq!(part(o.slot_pos, 3), [15, 0, 3]);
        assert_eq!(part(o.table_of, 3), [0, 0, 2]);
        assert_eq!(part(o.logit_rows, 1), [2]);
        assert_eq!(ix.greedy, [true]);
        // The decode token's row for `attend`, the two-token chunk as one tile of two rows for `attend_rows`.
        assert_eq!(part(o.singles, 1), [2]);
        assert_eq!(part(o.tiles, 2), [0, 2]);
        assert_eq!(ix.ints[o.tables..], [7, 2, 5]);
        assert_eq!((ix.slot(1), ix.slot(2)), ((2, 0), (5, 3)));

        // A decode step lists no rows and no tiles: `attend` takes every row.
        let decode = StepIndex::of(&batch[1..], 16);
        assert!(decode.decode && decode.n == 1 && decode.m == 1);
        assert_eq!((decode.singles, decode.tiles, decode.o), (0, 0, StepIndex::offsets(1, 1, 0, 0)));
    }

    #[test]
    fn a_long_chunk_is_cut_into_tiles_of_rows_tile_rows() {
        let blocks: Vec<BlockId> = (0..3).map(BlockId).collect();
        let tokens: Vec<u32> = (0..40).collect();
        let batch =
            [SeqChunk { tokens: &tokens, start: 0, blocks: &blocks, logits: true, greedy: false, scored: None }];
        let ix = StepIndex::of(&batch, 16);
        assert_eq!((ix.singles, ix.tiles), (0, 3));
        assert_eq!(ix.ints[ix.o.tiles..ix.o.tiles + 6], [0, 16, 16, 16, 32, 8]);
    }
}
