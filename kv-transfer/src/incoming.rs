//! Block frames read as they arrive, without gathering them into a buffer: a block's payload stays in the pieces
//! of the packets it came in (quinn hands out each packet's decrypted stream data as a shared slice), and the
//! reader copies it once, into where it is going (the decode engine's KV block), checking it there.
//!
//! Pure: [`Reader::feed`] takes a stream's chunks however they were split and yields whole blocks and the other
//! frames; only a frame's header (17 bytes for a block) is ever copied.

use bytes::{Bytes, BytesMut};

use crate::checksum;
use crate::frame::{BLOCK_HEADER, Frame, FrameDecoder, FrameError, KIND_BLOCK};

/// A block as it arrived: its position, the checksum its owner sent (checked against the descriptor by the
/// transport), and its bytes in pieces, not yet checked.
#[derive(Clone, Debug)]
pub struct Arrived {
    pub index: u32,
    pub checksum: u64,
    pieces: Vec<Bytes>,
}

impl Arrived {
    /// A block in one piece.
    pub fn whole(index: u32, checksum: u64, bytes: Bytes) -> Arrived {
        Arrived { index, checksum, pieces: vec![bytes] }
    }

    /// Bytes in the block.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the block into `dst`, which must be as long, and checks the copy against the checksum.
    pub fn copy_into(&self, dst: &mut [u8]) -> Result<(), &'static str> {
        if dst.len() != self.len() {
            return Err("wrong length");
        }
        let mut at = 0;
        for p in &self.pieces {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        if checksum(dst) != self.checksum {
            return Err("checksum mismatch");
        }
        Ok(())
    }

    /// The block in one piece: the piece it came in when there was one, else copied into `buf` (which grows when
    /// it has no room) and split off it.
    pub fn contiguous(self, buf: &mut BytesMut) -> Bytes {
        match <[Bytes; 1]>::try_from(self.pieces) {
            Ok([one]) => one,
            Err(pieces) => {
                for p in &pieces {
                    buf.extend_from_slice(p);
                }
                buf.split().freeze()
            }
        }
    }
}

/// What a reader yields.
#[derive(Debug)]
pub enum Item {
    Block(Arrived),
    /// Any other frame (an error, the end, or a frame only the owner should get).
    Frame(Frame),
}

/// A block whose payload is still arriving.
#[derive(Debug)]
struct Partial {
    index: u32,
    checksum: u64,
    remaining: usize,
    pieces: Vec<Bytes>,
}

/// Reads one stream's frames chunk by chunk.
#[derive(Debug)]
pub struct Reader {
    decoder: FrameDecoder,
    /// The start of a frame not yet whole enough to act on (a header, or a small frame).
    pending: BytesMut,
    current: Option<Partial>,
}

impl Reader {
    /// A reader refusing frames with bodies over `max_body` bytes.
    pub fn new(max_body: usize) -> Reader {
        Reader { decoder: FrameDecoder::new(max_body), pending: BytesMut::new(), current: None }
    }

    /// True between frames: where a stream may end.
    pub fn at_boundary(&self) -> bool {
        self.pending.is_empty() && self.current.is_none()
    }

    /// Consumes `chunk`, appending to `out` every item it completes.
    pub fn feed(&mut self, mut chunk: Bytes, out: &mut Vec<Item>) -> Result<(), FrameError> {
        while !chunk.is_empty() {
            if let Some(p) = &mut self.current {
                let n = p.remaining.min(chunk.len());
                p.pieces.push(chunk.split_to(n));
                p.remaining -= n;
                if p.remaining == 0
                    && let Some(p) = self.current.take()
                {
                    out.push(Item::Block(Arrived { index: p.index, checksum: p.checksum, pieces: p.pieces }));
                }
                continue;
            }
            let n = self.wanted().min(chunk.len());
            self.pending.extend_from_slice(&chunk.split_to(n));
            self.advance(out)?;
        }
        Ok(())
    }

    /// Bytes `pending` needs before the next step (at least one).
    fn wanted(&self) -> usize {
        let have = self.pending.len();
        if have < 5 {
            return 5 - have;
        }
        // A bad length was refused by `advance` before this is asked.
        let len = self.decoder.body_len(&self.pending).ok().flatten().unwrap_or(0);
        let whole = if self.pending[4] == KIND_BLOCK { 4 + BLOCK_HEADER } else { 4 + len };
        whole.saturating_sub(have).max(1)
    }

    /// Acts on `pending` once it holds a block's header or a whole other frame.
    fn advance(&mut self, out: &mut Vec<Item>) -> Result<(), FrameError> {
        if self.pending.len() < 5 {
            return Ok(());
        }
        let Some(len) = self.decoder.body_len(&self.pending)? else { return Ok(()) };
        if self.pending[4] != KIND_BLOCK {
            if let Some(frame) = self.decoder.decode(&mut self.pending)? {
                out.push(Item::Frame(frame));
            }
            return Ok(());
        }
        if len < BLOCK_HEADER {
            return Err(FrameError::Malformed { kind: "block", what: "too short" });
        }
        if self.pending.len() < 4 + BLOCK_HEADER {
            return Ok(());
        }
        let h = &self.pending[5..4 + BLOCK_HEADER];
        let index = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let checksum = u64::from_le_bytes([h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11]]);
        self.pending.clear();
        let remaining = len - BLOCK_HEADER;
        if remaining == 0 {
            out.push(Item::Block(Arrived { index, checksum, pieces: Vec::new() }));
        } else {
            self.current = Some(Partial { index, checksum, remaining, pieces: Vec::new() });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{ErrorCode, encode_block_header, encode_done, encode_error};
    use proptest::prelude::*;

    /// A stream of `blocks` block frames, then an error frame or the end.
    fn stream(blocks: &[Vec<u8>], error: bool) -> Vec<u8> {
        let mut out = BytesMut::new();
        for (i, b) in blocks.iter().enumerate() {
            encode_block_header(i as u32, checksum(b), b.len(), &mut out);
            out.extend_from_slice(b);
        }
        if error {
            encode_error(ErrorCode::LeaseExpired, "gone", &mut out);
        } else {
            encode_done(&mut out);
        }
        out.to_vec()
    }

    fn read(bytes: &[u8], cuts: &[usize], max_body: usize) -> Result<(Vec<Item>, bool), FrameError> {
        let mut reader = Reader::new(max_body);
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts.iter().chain([&bytes.len()]) {
            let c = c.clamp(at, bytes.len());
            reader.feed(Bytes::copy_from_slice(&bytes[at..c]), &mut out)?;
            at = c;
        }
        Ok((out, reader.at_boundary()))
    }

    proptest! {
        #[test]
        fn every_split_of_a_stream_yields_the_same_blocks_and_frames(
            blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6),
            mut cuts in proptest::collection::vec(0usize..2000, 0..40),
            error in any::<bool>(),
        ) {
            let bytes = stream(&blocks, error);
            cuts.sort_unstable();
            let (items, boundary) = read(&bytes, &cuts, 1024).expect("well formed");
            prop_assert!(boundary);
            prop_assert_eq!(items.len(), blocks.len() + 1);
            for (i, (item, want)) in items.iter().zip(&blocks).enumerate() {
                let Item::Block(b) = item else { return Err(TestCaseError::fail("not a block")) };
                prop_assert_eq!(b.index as usize, i);
                let mut copy = vec![0u8; b.len()];
                prop_assert!(b.copy_into(&mut copy).is_ok());
                prop_assert_eq!(&copy, want);
                prop_assert_eq!(&b.clone().contiguous(&mut BytesMut::new())[..], &want[..]);
            }
            let last = items.last().expect("the last frame");
            let ended = if error {
                matches!(last, Item::Frame(Frame::Error { code: ErrorCode::LeaseExpired, .. }))
            } else {
                matches!(last, Item::Frame(Frame::Done))
            };
            prop_assert!(ended, "{:?}", last);
        }
    }

    #[test]
    fn a_damaged_block_fails_its_check_in_the_copy_and_a_cut_stream_is_not_at_a_boundary() {
        let blocks = vec![vec![7u8; 100], vec![9u8; 50]];
        let mut bytes = stream(&blocks, false);
        bytes[4 + BLOCK_HEADER + 10] ^= 1;
        let (items, _) = read(&bytes, &[3, 30, 120], 1024).expect("frames are well formed");
        let Item::Block(b) = &items[0] else { panic!("a block") };
        assert_eq!(b.copy_into(&mut [0; 100]), Err("checksum mismatch"));
        assert_eq!(b.copy_into(&mut [0; 99]), Err("wrong length"));
        let Item::Block(b) = &items[1] else { panic!("a block") };
        assert_eq!(b.copy_into(&mut [0; 50]), Ok(()));
        let cut = &stream(&blocks, false)[..60];
        let (items, boundary) = read(cut, &[20], 1024).expect("no bad frame");
        assert!(items.is_empty() && !boundary, "inside the first block");
    }

    #[test]
    fn oversize_empty_and_short_block_frames_are_refused_from_their_headers() {
        let mut big = BytesMut::new();
        encode_block_header(0, 0, 5000, &mut big);
        assert!(matches!(read(&big, &[], 1024), Err(FrameError::Oversize { .. })));
        assert!(matches!(read(&[0, 0, 0, 0, 2], &[], 1024), Err(FrameError::Empty)));
        let short = [5u8, 0, 0, 0, KIND_BLOCK, 1, 2, 3, 4];
        assert!(matches!(read(&short, &[], 1024), Err(FrameError::Malformed { kind: "block", .. })));
    }
}
