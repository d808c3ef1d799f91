//! The wire format of a read: the reader sends one `Read` naming a lease and the block positions it wants; the
//! owner answers with one `Block` frame per block (its position, checksum and bytes) and then `Done`, or with an
//! `Error`. Every frame is `u32 body length | u8 kind | body`, little-endian.
//!
//! The decoder is incremental and bounded: a declared length over the limit is refused as soon as the 5-byte
//! header is in, so a peer can never make us buffer more than one maximum frame; garbage is an error, never a
//! panic.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::lease::LeaseId;

const KIND_READ: u8 = 1;
pub(crate) const KIND_BLOCK: u8 = 2;
const KIND_ERROR: u8 = 3;
const KIND_DONE: u8 = 4;
const KIND_RELEASE: u8 = 5;
/// Longest `traceparent` accepted (the W3C header is 55 characters).
pub const MAX_TRACEPARENT: usize = 256;
/// Largest frame body accepted by default: one 8 MiB block plus its header, far above a SmolLM2 block (360 KiB).
pub const DEFAULT_MAX_BODY: usize = 8 << 20;

/// What went wrong, as the owner reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    LeaseNotFound,
    LeaseExpired,
    BadRequest,
    Internal,
}

impl ErrorCode {
    fn to_wire(self) -> u16 {
        match self {
            ErrorCode::LeaseNotFound => 1,
            ErrorCode::LeaseExpired => 2,
            ErrorCode::BadRequest => 3,
            ErrorCode::Internal => 4,
        }
    }

    fn from_wire(v: u16) -> Option<ErrorCode> {
        Some(match v {
            1 => ErrorCode::LeaseNotFound,
            2 => ErrorCode::LeaseExpired,
            3 => ErrorCode::BadRequest,
            4 => ErrorCode::Internal,
            _ => return None,
        })
    }
}

/// A read request: which lease, which block positions, and the caller's trace context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    pub lease: LeaseId,
    pub traceparent: Option<String>,
    pub blocks: Vec<u32>,
}

/// One decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Read(ReadRequest),
    Block {
        index: u32,
        checksum: u64,
        payload: Bytes,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
    Done,
    /// The reader has what it needs: the owner may end the lease now.
    Release(LeaseId),
}

/// Why bytes are not a valid frame stream. After any of these the stream is closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes is over the {max}-byte limit")]
    Oversize { len: usize, max: usize },
    #[error("empty frame")]
    Empty,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("malformed {kind} frame: {what}")]
    Malformed { kind: &'static str, what: &'static str },
}

/// Appends a `Read` frame.
pub fn encode_read(r: &ReadRequest, out: &mut BytesMut) {
    let tp = r.traceparent.as_deref().unwrap_or("").as_bytes();
    let tp = &tp[..tp.len().min(MAX_TRACEPARENT)];
    let body = 1 + 16 + 2 + tp.len() + 4 + 4 * r.blocks.len();
    out.reserve(4 + body);
    out.put_u32_le(body as u32);
    out.put_u8(KIND_READ);
    out.put_u128_le(r.lease.0);
    out.put_u16_le(tp.len() as u16);
    out.put_slice(tp);
    out.put_u32_le(r.blocks.len() as u32);
    for &b in &r.blocks {
        out.put_u32_le(b);
    }
}

/// Body bytes of a `Block` frame before its payload: kind, index, checksum.
pub const BLOCK_HEADER: usize = 1 + 4 + 8;

/// Appends the header of a `Block` frame whose `len` payload bytes the caller sends next (no copy of the block).
pub fn encode_block_header(index: u32, checksum: u64, len: usize, out: &mut BytesMut) {
    out.put_u32_le((BLOCK_HEADER + len) as u32);
    out.put_u8(KIND_BLOCK);
    out.put_u32_le(index);
    out.put_u64_le(checksum);
}

/// Appends an `Error` frame.
pub fn encode_error(code: ErrorCode, message: &str, out: &mut BytesMut) {
    let msg = &message.as_bytes()[..message.len().min(1024)];
    out.put_u32_le((1 + 2 + msg.len()) as u32);
    out.put_u8(KIND_ERROR);
    out.put_u16_le(code.to_wire());
    out.put_slice(msg);
}

/// Appends a `Release` frame.
pub fn encode_release(lease: LeaseId, out: &mut BytesMut) {
    out.put_u32_le(1 + 16);
    out.put_u8(KIND_RELEASE);
    out.put_u128_le(lease.0);
}

/// Appends a `Done` frame.
pub fn encode_done(out: &mut BytesMut) {
    out.put_u32_le(1);
    out.put_u8(KIND_DONE);
}

/// Incremental decoder with a bound on frame size.
#[derive(Clone, Copy, Debug)]
pub struct FrameDecoder {
    max_body: usize,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        FrameDecoder { max_body: DEFAULT_MAX_BODY }
    }
}

impl FrameDecoder {
    /// A decoder refusing bodies over `max_body` bytes.
    pub fn new(max_body: usize) -> FrameDecoder {
        FrameDecoder { max_body }
    }

    /// The body length of the frame at the front of `buf`, refused when empty or over the limit; `None` until its
    /// length prefix is there.
    pub fn body_len(&self, buf: &[u8]) -> Result<Option<usize>, FrameError> {
        let Some(prefix) = buf.first_chunk::<4>() else { return Ok(None) };
        let len = u32::from_le_bytes(*prefix) as usize;
        if len == 0 {
            return Err(FrameError::Empty);
        }
        if len > self.max_body {
            return Err(FrameError::Oversize { len, max: self.max_body });
        }
        Ok(Some(len))
    }

    /// The next whole frame at the front of `buf` (removed from it), `None` when more bytes are needed.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let Some(len) = self.body_len(buf)? else { return Ok(None) };
        if buf.len() < 4 + len {
            return Ok(None);
        }
        buf.advance(4);
        let mut body = buf.split_to(len).freeze();
        let kind = body.get_u8();
        parse(kind, body).map(Some)
    }
}

fn parse(kind: u8, mut body: Bytes) -> Result<Frame, FrameError> {
    let bad = |kind, what| FrameError::Malformed { kind, what };
    match kind {
        KIND_READ => {
            if body.remaining() < 16 + 2 {
                return Err(bad("read", "too short"));
            }
            let lease = LeaseId(body.get_u128_le());
            let tp_len = body.get_u16_le() as usize;
            if tp_len > MAX_TRACEPARENT || body.remaining() < tp_len + 4 {
                return Err(bad("read", "bad trace context length"));
            }
            let tp = body.split_to(tp_len);
            let traceparent = match std::str::from_utf8(&tp) {
                Ok("") => None,
                Ok(s) => Some(s.to_string()),
                Err(_) => return Err(bad("read", "trace context is not UTF-8")),
            };
            let count = body.get_u32_le() as usize;
            if body.remaining() != count.saturating_mul(4) {
                return Err(bad("read", "block count does not match the frame length"));
            }
            let blocks = (0..count).map(|_| body.get_u32_le()).collect();
            Ok(Frame::Read(ReadRequest { lease, traceparent, blocks }))
        }
        KIND_BLOCK => {
            if body.remaining() < BLOCK_HEADER - 1 {
                return Err(bad("block", "too short"));
            }
            let index = body.get_u32_le();
            let checksum = body.get_u64_le();
            Ok(Frame::Block { index, checksum, payload: body })
        }
        KIND_ERROR => {
            if body.remaining() < 2 {
                return Err(bad("error", "too short"));
            }
            let code = ErrorCode::from_wire(body.get_u16_le()).ok_or(bad("error", "unknown code"))?;
            let message = String::from_utf8_lossy(&body).into_owned();
            Ok(Frame::Error { code, message })
        }
        KIND_RELEASE if body.remaining() == 16 => Ok(Frame::Release(LeaseId(body.get_u128_le()))),
        KIND_RELEASE => Err(bad("release", "wrong length")),
        KIND_DONE if body.is_empty() => Ok(Frame::Done),
        KIND_DONE => Err(bad("done", "has a body")),
        other => Err(FrameError::UnknownKind(other)),
    }
}
