//! Request ids the router hands to workers: `chatcmpl-`/`cmpl-` and 128 bits, the router instance's random 64
//! followed by its request counter, so ids differ across router replicas and restarts (a worker that sees the
//! same id twice is seeing a misbehaving client, not two routers).

/// A random id for this router process.
pub fn instance_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is keyed from the OS's random source once per process; the clock and pid separate instances
    // even if that source repeated.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

/// The id of request number `seq` of router `instance`, for a chat (`chatcmpl-`) or text (`cmpl-`) completion.
pub fn request_id(chat: bool, instance: u64, seq: u64) -> String {
    format!("{}-{instance:016x}{seq:016x}", if chat { "chatcmpl" } else { "cmpl" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_differ_across_instances_and_requests() {
        let (a, b) = (instance_id(), instance_id());
        assert_ne!(a, b, "two routers, or one restarted, never share ids");
        assert_ne!(request_id(true, a, 0), request_id(true, b, 0));
        assert_ne!(request_id(true, a, 0), request_id(true, a, 1));
        let id = request_id(false, 0xabc, 7);
        assert_eq!(id, "cmpl-0000000000000abc0000000000000007");
        assert_eq!(request_id(true, a, 0).len(), "chatcmpl-".len() + 32);
    }
}
