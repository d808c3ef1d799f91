//! The KV transfer's frame decoder on a byte stream cut at arbitrary points: frames or a `FrameError`, never a
//! panic, and never more buffered than the decoder's limit allows.
#![no_main]

use bytes::BytesMut;
use kv_transfer::frame::FrameDecoder;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, stream)) = data.split_first() else { return };
    let dec = FrameDecoder::new(64 << 10);
    let mut buf = BytesMut::new();
    // Feed the stream in pieces of `cut + 1` bytes, decoding after each, as the QUIC reader does.
    for piece in stream.chunks(usize::from(cut) + 1) {
        buf.extend_from_slice(piece);
        loop {
            match dec.decode(&mut buf) {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
