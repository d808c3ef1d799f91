//! Protobuf from a peer, decoded and converted to domain types the way the router and the workers do: any bytes
//! give a value or a typed error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use proto::worker as pb;

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else { return };
    match which % 6 {
        0 => {
            if let Ok(b) = pb::KvEventBatch::decode(bytes) {
                match b.body {
                    Some(pb::kv_event_batch::Body::Snapshot(s)) => {
                        let _ = worker::convert::snapshot_from_pb(&s);
                    }
                    Some(pb::kv_event_batch::Body::Events(es)) => {
                        for e in &es.events {
                            let _ = worker::convert::event_from_pb(e);
                        }
                    }
                    None => {}
                }
            }
        }
        1 => {
            if let Ok(h) = pb::KvHandle::decode(bytes) {
                let _ = worker::convert::handle_from_pb(h);
            }
        }
        2 => {
            if let Ok(r) = pb::GenerateRequest::decode(bytes) {
                let _ = worker::convert::sampling(r.sampling, None);
                let _ = worker::convert::deadline(
                    r.deadline_unix_ms,
                    std::time::SystemTime::now(),
                    std::time::Instant::now(),
                );
                if let Some(h) = r.handle {
                    let _ = worker::convert::handle_from_pb(h);
                }
            }
        }
        3 => {
            if let Ok(r) = pb::PrefillRequest::decode(bytes) {
                let _ = worker::convert::sampling(r.sampling, Some(1));
            }
        }
        4 => {
            let _ = pb::LoadReport::decode(bytes);
        }
        _ => {
            let _ = pb::InfoResponse::decode(bytes);
        }
    }
});
