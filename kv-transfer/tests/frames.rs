//! The frame codec: round trips under any split of the byte stream, and arbitrary bytes give errors, never panics
//! or unbounded buffering.

use bytes::{BufMut, Bytes, BytesMut};
use kv_transfer::frame::{
    ErrorCode, Frame, FrameDecoder, FrameError, ReadRequest, encode_block_header, encode_done, encode_error,
    encode_read, encode_release,
};
use kv_transfer::lease::LeaseId;
use proptest::prelude::*;

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u128>(), proptest::option::of("[ -~]{0,60}"), proptest::collection::vec(any::<u32>(), 0..40)).prop_map(
            |(l, tp, blocks)| Frame::Read(ReadRequest {
                lease: LeaseId(l),
                traceparent: tp.filter(|t| !t.is_empty()),
                blocks
            })
        ),
        (any::<u32>(), any::<u64>(), proptest::collection::vec(any::<u8>(), 0..2000))
            .prop_map(|(index, checksum, p)| Frame::Block { index, checksum, payload: Bytes::from(p) }),
        (0u16..4, "[ -~]{0,80}").prop_map(|(c, message)| Frame::Error {
            code: [ErrorCode::LeaseNotFound, ErrorCode::LeaseExpired, ErrorCode::BadRequest, ErrorCode::Internal]
                [c as usize],
            message
        }),
        Just(Frame::Done),
        any::<u128>().prop_map(|l| Frame::Release(LeaseId(l))),
    ]
}

fn encode(f: &Frame, out: &mut BytesMut) {
    match f {
        Frame::Read(r) => encode_read(r, out),
        Frame::Block { index, checksum, payload } => {
            encode_block_header(*index, *checksum, payload.len(), out);
            out.put_slice(payload);
        }
        Frame::Error { code, message } => encode_error(*code, message, out),
        Frame::Done => encode_done(out),
        Frame::Release(l) => encode_release(*l, out),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn frames_round_trip_under_any_split(frames in proptest::collection::vec(frame(), 1..8), cuts in proptest::collection::vec(1usize..700, 1..20)) {
        let mut wire = BytesMut::new();
        for f in &frames {
            encode(f, &mut wire);
        }
        let wire = wire.freeze();
        let dec = FrameDecoder::default();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        let mut at = 0;
        let mut cut = cuts.iter().cycle();
        while at < wire.len() {
            let n = (*cut.next().unwrap_or(&1)).min(wire.len() - at);
            buf.extend_from_slice(&wire[at..at + n]);
            at += n;
            while let Some(f) = dec.decode(&mut buf).expect("valid frames decode") {
                got.push(f);
            }
        }
        prop_assert_eq!(got, frames);
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn garbage_never_panics(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..32)) {
        let dec = FrameDecoder::new(4096);
        let mut buf = BytesMut::new();
        for c in chunks {
            buf.extend_from_slice(&c);
            loop {
                match dec.decode(&mut buf) {
                    Ok(Some(_)) => continue,
                    Ok(None) => break,
                    // The transport closes the stream here; nothing more is buffered.
                    Err(_) => return Ok(()),
                }
            }
            // Without an error, what is held is at most one unfinished frame under the limit.
            prop_assert!(buf.len() < 4 + 4096 + 64);
        }
    }
}

#[test]
fn an_oversize_frame_is_refused_from_its_header_alone() {
    let dec = FrameDecoder::new(1 << 20);
    let mut buf = BytesMut::new();
    buf.put_u32_le(u32::MAX);
    buf.put_u8(2);
    assert_eq!(dec.decode(&mut buf), Err(FrameError::Oversize { len: u32::MAX as usize, max: 1 << 20 }));
    let mut buf = BytesMut::from(&[0u8, 0, 0, 0][..]);
    assert_eq!(dec.decode(&mut buf), Err(FrameError::Empty));
    let mut buf = BytesMut::from(&[1u8, 0, 0, 0, 99][..]);
    assert_eq!(dec.decode(&mut buf), Err(FrameError::UnknownKind(99)));
    // A read whose block count does not match its length.
    let mut buf = BytesMut::new();
    encode_read(&ReadRequest { lease: LeaseId(1), traceparent: None, blocks: vec![1, 2] }, &mut buf);
    let body_len = buf.len() - 4;
    buf[4 + body_len - 9] = 9;
    assert!(matches!(dec.decode(&mut buf), Err(FrameError::Malformed { .. })));
}
