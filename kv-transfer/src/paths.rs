//! QUIC datagram and window settings by the path a connection runs over.
//!
//! Bulk KV moves in as few packets as the path allows: quinn's per-packet work (encryption, header protection,
//! acknowledgement tracking) is most of a transfer's cost. Two things decide the packet size:
//! - MTU discovery never probes past the payload size the *receiver* advertises, so both endpoints advertise
//!   [`MAX_PAYLOAD`] (quinn's default, 1,472 bytes, had kept discovery at Ethernet sizes on every path);
//! - quinn's segmentation offload sends up to 10 datagrams in one `sendmsg`, and the kernel refuses a batch over
//!   64 KiB, silently for quinn (it takes `EMSGSIZE` for a failed MTU probe): every batch of large datagrams was
//!   lost, taken for a black hole, and discovery fell back to 1,200 bytes.
//!
//! So a loopback path sends single datagrams of up to [`MAX_PAYLOAD`] without offload, and a network path keeps
//! offload with datagrams of at most [`NETWORK_MAX_PAYLOAD`] (ten to a batch still fit; Ethernet paths stop at
//! their MTU as before, jumbo frames get up to 6,500 bytes). Flow control keeps what is in flight within the
//! receiver's socket buffer, so bursts of large datagrams are not dropped by the kernel.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The largest UDP payload either endpoint accepts (a loopback datagram: 65,535 bytes less IP and UDP headers,
/// rounded down).
pub const MAX_PAYLOAD: u16 = 65_000;
/// The largest UDP payload on a network path: ten of them (quinn's offload batch) stay under 64 KiB.
pub const NETWORK_MAX_PAYLOAD: u16 = 6_500;
/// Socket buffers asked for on each side (the kernel caps them at `net.core.rmem_max` / `wmem_max`).
pub const SOCKET_BUFFER: usize = 8 << 20;
/// Flow-control windows at most (a 2,048-token SmolLM2 prompt is 47 MB), less where the socket buffer is smaller.
const MAX_STREAM_WINDOW: u32 = 16 << 20;
const MAX_CONNECTION_WINDOW: u32 = 64 << 20;
/// Flow-control windows at least, whatever the socket buffer.
const MIN_WINDOW: u32 = 256 << 10;

/// What a connection runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    /// Both ends on this host's loopback interface (MTU 64 KiB).
    Loopback,
    /// Anything else: Ethernet or jumbo frames, found by MTU discovery.
    Network,
}

impl PathKind {
    /// The path to or from `peer`.
    pub fn of(peer: SocketAddr) -> PathKind {
        let loopback = match peer {
            SocketAddr::V4(a) => a.ip().is_loopback(),
            SocketAddr::V6(a) => a.ip().is_loopback() || a.ip().to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
        };
        if loopback { PathKind::Loopback } else { PathKind::Network }
    }
}

/// Endpoint settings for both ends: advertise [`MAX_PAYLOAD`].
pub fn endpoint_config() -> quinn::EndpointConfig {
    let mut config = quinn::EndpointConfig::default();
    config.max_udp_payload_size(MAX_PAYLOAD).expect("within QUIC's bounds (1,200..=65,527)");
    config
}

/// The flow-control window for a socket whose receive buffer is `recv_buffer` bytes as the kernel reports it
/// (Linux reports twice what it counts as payload room: the rest is its bookkeeping).
pub fn window_for(recv_buffer: usize) -> u32 {
    u32::try_from(recv_buffer / 2).unwrap_or(u32::MAX).clamp(MIN_WINDOW, MAX_CONNECTION_WINDOW)
}

/// Transport settings for a connection over `path`, with at most `window` bytes unread in flight towards us.
pub fn transport(path: PathKind, window: u32) -> Arc<quinn::TransportConfig> {
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    let mut t = quinn::TransportConfig::default();
    match path {
        PathKind::Loopback => {
            mtu.upper_bound(MAX_PAYLOAD);
            t.enable_segmentation_offload(false);
        }
        PathKind::Network => {
            mtu.upper_bound(NETWORK_MAX_PAYLOAD);
        }
    }
    // A black hole declared by mistake (a burst lost to a full buffer) is retried soon, not after a minute.
    mtu.black_hole_cooldown(Duration::from_secs(5));
    t.mtu_discovery_config(Some(mtu));
    t.stream_receive_window(quinn::VarInt::from_u32(window.min(MAX_STREAM_WINDOW)));
    t.receive_window(quinn::VarInt::from_u32(window));
    t.send_window(u64::from(MAX_CONNECTION_WINDOW));
    Arc::new(t)
}

/// A UDP socket bound to `addr` with [`SOCKET_BUFFER`] asked for, and the receive buffer it got.
pub fn bind(addr: SocketAddr) -> std::io::Result<(std::net::UdpSocket, usize)> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::DGRAM, None)?;
    if addr.is_ipv6() {
        // Dual-stack, as quinn's own client endpoints are: an IPv6 wildcard also reaches IPv4 owners.
        let _ = socket.set_only_v6(false);
    }
    // Best effort: a smaller buffer than asked for still works, with a smaller window.
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    socket.bind(&addr.into())?;
    let got = socket.recv_buffer_size()?;
    Ok((socket.into(), got))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_peers_are_told_apart_from_network_ones() {
        for (addr, kind) in [
            ("127.0.0.1:1", PathKind::Loopback),
            ("127.3.2.1:1", PathKind::Loopback),
            ("[::1]:1", PathKind::Loopback),
            ("[::ffff:127.0.0.1]:1", PathKind::Loopback),
            ("10.0.0.2:1", PathKind::Network),
            ("[::ffff:10.0.0.2]:1", PathKind::Network),
            ("[2001:db8::1]:1", PathKind::Network),
        ] {
            assert_eq!(PathKind::of(addr.parse().expect("an address")), kind, "{addr}");
        }
    }

    #[test]
    fn offload_batches_of_network_datagrams_fit_the_kernels_limit() {
        // quinn batches up to 10 datagrams; the kernel refuses a UDP send over 65,535 bytes with its headers.
        assert!(10 * u32::from(NETWORK_MAX_PAYLOAD) + 48 <= 65_535);
        assert!(u32::from(MAX_PAYLOAD) + 48 <= 65_535);
    }

    #[test]
    fn the_window_follows_the_socket_buffer_within_bounds() {
        assert_eq!(window_for(8 << 20), 4 << 20);
        assert_eq!(window_for(212_992 * 2), 256 << 10, "a default-sized buffer still gets the floor");
        assert_eq!(window_for(1 << 30), MAX_CONNECTION_WINDOW);
    }
}
