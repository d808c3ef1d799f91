//! Chained block hashes, as `routing.md` specifies them (xxh3-64 with seed 1337 over little-endian token ids).

use std::fmt;
use std::num::NonZeroU32;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed every block hash uses unless a cache namespace changes the first block's seed.
pub const HASH_SEED: u64 = 1337;

/// Number of tokens in one KV block. Router and workers must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockSize(NonZeroU32);

impl BlockSize {
    /// Tandem's default: 16 tokens, the block size vLLM and Dynamo use, small enough for fine-grained sharing.
    pub const DEFAULT: BlockSize = BlockSize(NonZeroU32::new(16).expect("16 is not zero"));

    /// A block size of `tokens`, or `None` for zero.
    pub fn new(tokens: u32) -> Option<BlockSize> {
        NonZeroU32::new(tokens).map(BlockSize)
    }

    /// The size in tokens.
    pub fn tokens(self) -> usize {
        self.0.get() as usize
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        BlockSize::DEFAULT
    }
}

impl fmt::Display for BlockSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Hash of one block's own tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalHash(pub u64);

/// Hash naming a whole prefix: every block up to and including this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHash(pub u64);

/// A cache namespace (tenant id or `cache_salt`). Requests in different namespaces never share blocks, because
/// prefix sharing is observable through time to first token.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheNamespace(String);

impl CacheNamespace {
    /// A namespace named `name`.
    pub fn new(name: impl Into<String>) -> CacheNamespace {
        CacheNamespace(name.into())
    }

    /// The seed of the first block in this namespace: the default seed mixed with the name's hash.
    fn seed(&self) -> u64 {
        xxh3_64_with_seed(self.0.as_bytes(), HASH_SEED) ^ HASH_SEED
    }
}

/// The local hash of one block of token ids.
pub fn local_hash(tokens: &[u32]) -> LocalHash {
    local_hash_seeded(tokens, HASH_SEED)
}

/// The local hash of a chain's first block in `namespace` (its seed is the namespace's): what [`block_hashes`]
/// gives the first block, for a reader that hashes a chain block by block.
pub fn first_local_hash(tokens: &[u32], namespace: Option<&CacheNamespace>) -> LocalHash {
    local_hash_seeded(tokens, namespace.map_or(HASH_SEED, CacheNamespace::seed))
}

fn local_hash_seeded(tokens: &[u32], seed: u64) -> LocalHash {
    LocalHash(xxh3_64_with_seed(bytemuck::cast_slice(&le_tokens(tokens)), seed))
}

/// The tokens as the hash reads them, little-endian: on a little-endian machine the slice itself (a copy per
/// block was a tenth of the simulator's allocations, then, on the stack, a zeroing and a copy per block).
#[cfg(target_endian = "little")]
fn le_tokens(tokens: &[u32]) -> std::borrow::Cow<'_, [u32]> {
    std::borrow::Cow::Borrowed(tokens)
}

#[cfg(not(target_endian = "little"))]
fn le_tokens(tokens: &[u32]) -> std::borrow::Cow<'_, [u32]> {
    std::borrow::Cow::Owned(tokens.iter().map(|t| t.to_le()).collect())
}

/// The chained hash of a block with local hash `local` after the block `parent` (`None`: the first block, whose
/// chained hash is its local hash). What lets a reader check that a list of blocks really is a chain.
pub fn chained(parent: Option<SeqHash>, local: LocalHash) -> SeqHash {
    match parent {
        None => SeqHash(local.0),
        Some(p) => chain(p, local),
    }
}

fn chain(parent: SeqHash, local: LocalHash) -> SeqHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SeqHash(xxh3_64_with_seed(&bytes, HASH_SEED))
}

/// Local and sequence hashes of a prompt's full blocks, in chain order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockHashes {
    /// One per full block: the hash of that block's tokens alone.
    pub local: Vec<LocalHash>,
    /// One per full block: the hash of the prefix ending with that block.
    pub seq: Vec<SeqHash>,
}

impl BlockHashes {
    /// Hashes the full blocks of `tokens` past those already hashed: `tokens` is the whole sequence so far (it only
    /// ever grows), so a sequence's hashes cost each block once however often they are asked for. Nothing happens
    /// when every full block is already hashed.
    pub fn extend(&mut self, tokens: &[u32], block_size: BlockSize, namespace: Option<&CacheNamespace>) {
        let first_seed = namespace.map_or(HASH_SEED, CacheNamespace::seed);
        let done = self.seq.len();
        let more = (tokens.len() / block_size.tokens()).saturating_sub(done);
        self.local.reserve(more);
        self.seq.reserve(more);
        for (i, block) in tokens.chunks_exact(block_size.tokens()).enumerate().skip(done) {
            let seed = if i == 0 { first_seed } else { HASH_SEED };
            let local = local_hash_seeded(block, seed);
            let seq = match self.seq.last() {
                None => SeqHash(local.0),
                Some(&parent) => chain(parent, local),
            };
            self.local.push(local);
            self.seq.push(seq);
        }
    }
}

/// Hashes of every full block of `tokens`; a trailing partial block is never hashed. With a namespace, its seed
/// replaces the default for the first block, so the whole chain differs from every other namespace's.
pub fn block_hashes(tokens: &[u32], block_size: BlockSize, namespace: Option<&CacheNamespace>) -> BlockHashes {
    block_hashes_with_room(tokens, tokens.len(), block_size, namespace)
}

/// [`block_hashes`] with room for the blocks of `room` tokens in all (the sequence the tokens start, grown to its
/// end without moving its hashes).
fn block_hashes_with_room(
    tokens: &[u32],
    room: usize,
    block_size: BlockSize,
    namespace: Option<&CacheNamespace>,
) -> BlockHashes {
    let n = room.max(tokens.len()) / block_size.tokens();
    let mut out = BlockHashes { local: Vec::with_capacity(n), seq: Vec::with_capacity(n) };
    out.extend(tokens, block_size, namespace);
    out
}

/// Tokens and the hashes of their full blocks, made together so that they always agree: a caller that hashed a
/// prompt for routing (the simulator's router) hands both to the engine, which then does not hash it again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashedTokens {
    tokens: Vec<u32>,
    hashes: BlockHashes,
    block_size: BlockSize,
    namespace: Option<CacheNamespace>,
}

impl HashedTokens {
    /// Hashes the full blocks of `tokens` in `block_size` under `namespace`, with room for the hashes of as many
    /// tokens as the vector has room for (a prompt made with room for its output keeps its hashes in place as the
    /// output's blocks complete).
    pub fn new(tokens: Vec<u32>, block_size: BlockSize, namespace: Option<CacheNamespace>) -> HashedTokens {
        let hashes = block_hashes_with_room(&tokens, tokens.capacity(), block_size, namespace.as_ref());
        HashedTokens { tokens, hashes, block_size, namespace }
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn hashes(&self) -> &BlockHashes {
        &self.hashes
    }

    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    pub fn namespace(&self) -> Option<&CacheNamespace> {
        self.namespace.as_ref()
    }

    /// Appends `tokens`, hashing the blocks they complete.
    pub fn extend(&mut self, tokens: impl IntoIterator<Item = u32>) {
        self.tokens.extend(tokens);
        self.hashes.extend(&self.tokens, self.block_size, self.namespace.as_ref());
    }

    /// The tokens, their namespace, and their hashes.
    pub fn into_parts(self) -> (Vec<u32>, Option<CacheNamespace>, BlockHashes) {
        (self.tokens, self.namespace, self.hashes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bs(n: u32) -> BlockSize {
        BlockSize::new(n).expect("non-zero")
    }

    #[test]
    fn matches_the_spec_test_vectors() {
        assert_eq!(local_hash(&[1, 2, 3, 4]), LocalHash(14643705804678351452));
        assert_eq!(local_hash(&[5, 6, 7, 8]), LocalHash(16777012769546811212));
        let h = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], bs(4), None);
        assert_eq!(h.seq[0], SeqHash(14643705804678351452));
        assert_eq!(h.seq[1], SeqHash(4945711292740353085));
        assert_eq!(h.local[1], LocalHash(16777012769546811212));
    }

    #[test]
    fn hashed_tokens_keep_their_hashes_those_of_their_tokens() {
        let ns = CacheNamespace::new("tenant");
        let mut t = HashedTokens::new(vec![1, 2, 3, 4, 5, 6], bs(4), Some(ns.clone()));
        assert_eq!(t.hashes(), &block_hashes(&[1, 2, 3, 4, 5, 6], bs(4), Some(&ns)));
        t.extend([7, 8, 9]);
        assert_eq!(t.tokens(), &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(t.hashes(), &block_hashes(t.tokens(), bs(4), Some(&ns)));
        assert_eq!(t.hashes().seq.len(), 2);
    }

    #[test]
    fn partial_block_is_not_hashed() {
        assert_eq!(block_hashes(&[1, 2, 3], bs(4), None), BlockHashes::default());
        assert_eq!(block_hashes(&[1, 2, 3, 4, 5, 6, 7], bs(4), None).seq.len(), 1);
    }

    #[test]
    fn namespaces_never_share_blocks() {
        let tokens: Vec<u32> = (0..64).collect();
        let plain = block_hashes(&tokens, bs(16), None);
        let a = block_hashes(&tokens, bs(16), Some(&CacheNamespace::new("tenant-a")));
        let b = block_hashes(&tokens, bs(16), Some(&CacheNamespace::new("tenant-b")));
        for i in 0..4 {
            assert_ne!(a.seq[i], b.seq[i]);
            assert_ne!(a.seq[i], plain.seq[i]);
        }
        // Only the first block's seed changes; later local hashes are the plain ones.
        assert_eq!(a.local[1..], plain.local[1..]);
        // Which a reader hashing block by block gets the same way.
        assert_eq!(first_local_hash(&tokens[..16], Some(&CacheNamespace::new("tenant-a"))), a.local[0]);
        assert_eq!(first_local_hash(&tokens[..16], None), plain.local[0]);
    }

    proptest! {
        /// A block's bytes are its token ids, little-endian, whatever its size (blocks over 256 tokens are laid
        /// out on the heap, shorter ones on the stack).
        #[test]
        fn a_local_hash_is_the_hash_of_the_little_endian_token_bytes(
            tokens in proptest::collection::vec(any::<u32>(), 0..600),
        ) {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            prop_assert_eq!(local_hash(&tokens), LocalHash(xxh3_64_with_seed(&bytes, HASH_SEED)));
        }

        #[test]
        fn a_prefix_has_the_same_hashes(tokens in proptest::collection::vec(any::<u32>(), 0..200), cut in 0usize..200) {
            let cut = cut.min(tokens.len());
            let whole = block_hashes(&tokens, bs(16), None);
            let prefix = block_hashes(&tokens[..cut], bs(16), None);
            prop_assert_eq!(&whole.seq[..prefix.seq.len()], &prefix.seq[..]);
            prop_assert_eq!(&whole.local[..prefix.local.len()], &prefix.local[..]);
        }

        #[test]
        fn hashing_a_growing_sequence_step_by_step_equals_hashing_it_whole(
            tokens in proptest::collection::vec(any::<u32>(), 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..6),
            salted in any::<bool>(),
        ) {
            let ns = salted.then(|| CacheNamespace::new("tenant"));
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(tokens.len())).collect();
            cuts.sort_unstable();
            let mut grown = BlockHashes::default();
            for c in cuts.into_iter().chain([tokens.len()]) {
                grown.extend(&tokens[..c], bs(16), ns.as_ref());
            }
            prop_assert_eq!(grown, block_hashes(&tokens, bs(16), ns.as_ref()));
        }
    }
}
