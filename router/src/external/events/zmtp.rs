//! Just enough of ZeroMQ's wire protocol (ZMTP 3.0, NULL security) to subscribe to an engine's KV event socket
//! (SUB to its PUB) and to ask its replay socket for missed batches (DEALER to its ROUTER), over TCP.
//!
//! A connection opens with a 64-byte greeting each way, then a READY command naming the socket type; after that
//! every message is one or more frames: a flags byte (more frames follow, long size, command), the size in one
//! byte or eight, the body. We greet as ZMTP 3.0, so a newer peer speaks 3.0 to us and takes subscriptions as
//! messages whose first byte is 1.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bytes of a greeting.
pub const GREETING_LEN: usize = 64;
/// Largest frame accepted: an event batch is a step's worth of blocks with their token ids (kilobytes to a few
/// megabytes); anything this large is garbage or a different protocol.
pub const MAX_FRAME: u64 = 64 << 20;
/// Frames one message may have at most.
const MAX_FRAMES: usize = 16;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
        }
    }

    /// The peer types ZeroMQ lets this one talk to.
    fn accepts(self, peer: &str) -> bool {
        match self {
            SocketType::Sub => matches!(peer, "PUB" | "XPUB"),
            SocketType::Dealer => matches!(peer, "ROUTER" | "DEALER" | "REP"),
        }
    }
}

/// What went wrong on a ZMTP connection.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the peer does not speak ZMTP 3: {0}")]
    Protocol(String),
    #[error("{0:?} is not a tcp://host:port endpoint")]
    Endpoint(String),
}

fn protocol<T>(why: impl Into<String>) -> Result<T, Error> {
    Err(Error::Protocol(why.into()))
}

/// Our greeting: signature, version 3.0, the NULL mechanism, not a server.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting: ZMTP 3 or later with the NULL mechanism.
pub fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<(), Error> {
    if g[0] != 0xff || g[9] & 0x01 != 0x01 {
        return protocol("bad signature");
    }
    if g[10] < 3 {
        return protocol(format!("version {}.{}", g[10], g[11]));
    }
    let mechanism = &g[12..32];
    if !mechanism.starts_with(b"NULL") || mechanism[4..].iter().any(|&b| b != 0) {
        return protocol(format!(
            "security mechanism {:?} (only NULL is supported)",
            String::from_utf8_lossy(mechanism)
        ));
    }
    Ok(())
}

/// The READY command body for `socket`.
pub fn ready(socket: SocketType) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    let name = b"Socket-Type";
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    let value = socket.name().as_bytes();
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value);
    body
}

/// Reads a READY command body: the peer's socket type.
pub fn parse_ready(body: &[u8]) -> Result<String, Error> {
    let name_len = usize::from(*body.first().ok_or_else(|| Error::Protocol("an empty command".into()))?);
    let name = body.get(1..1 + name_len).ok_or_else(|| Error::Protocol("a truncated command".into()))?;
    if name != b"READY" {
        return protocol(format!("expected READY, got {:?}", String::from_utf8_lossy(name)));
    }
    let mut rest = &body[1 + name_len..];
    let mut socket_type = None;
    while !rest.is_empty() {
        let n = usize::from(rest[0]);
        let key = rest.get(1..1 + n).ok_or_else(|| Error::Protocol("a truncated property".into()))?;
        let len_at = 1 + n;
        let len = rest.get(len_at..len_at + 4).ok_or_else(|| Error::Protocol("a truncated property".into()))?;
        let len = u32::from_be_bytes(len.try_into().expect("four bytes")) as usize;
        let value = rest
            .get(len_at + 4..)
            .and_then(|v| v.get(..len))
            .ok_or_else(|| Error::Protocol("a truncated property".into()))?;
        if key.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(String::from_utf8_lossy(value).into_owned());
        }
        rest = &rest[len_at + 4 + len..];
    }
    socket_type.ok_or_else(|| Error::Protocol("READY names no socket type".into()))
}

/// Appends one frame.
pub fn encode_frame(body: &[u8], more: bool, command: bool, out: &mut Vec<u8>) {
    let mut flags = if more { MORE } else { 0 } | if command { COMMAND } else { 0 };
    if body.len() > 255 {
        flags |= LONG;
        out.push(flags);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// One frame read from the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub more: bool,
    pub command: bool,
    pub body: Vec<u8>,
}

/// The first frame in `buf`, with the bytes it took; `None` when `buf` holds only part of one.
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Frame, usize)>, Error> {
    let Some(&flags) = buf.first() else { return Ok(None) };
    if flags & !(MORE | LONG | COMMAND) != 0 {
        return protocol(format!("frame flags {flags:#04x}"));
    }
    let (size, header) = if flags & LONG != 0 {
        let Some(b) = buf.get(1..9) else { return Ok(None) };
        (u64::from_be_bytes(b.try_into().expect("eight bytes")), 9)
    } else {
        let Some(&b) = buf.get(1) else { return Ok(None) };
        (u64::from(b), 2)
    };
    if size > MAX_FRAME {
        return protocol(format!("a frame of {size} bytes"));
    }
    let end = header + size as usize;
    let Some(body) = buf.get(header..end) else { return Ok(None) };
    Ok(Some((Frame { more: flags & MORE != 0, command: flags & COMMAND != 0, body: body.to_vec() }, end)))
}

/// `host:port` of a `tcp://host:port` endpoint.
pub fn tcp_authority(endpoint: &str) -> Result<&str, Error> {
    endpoint
        .strip_prefix("tcp://")
        .filter(|a| a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()))
        .ok_or_else(|| Error::Endpoint(endpoint.to_string()))
}

/// An open ZMTP connection.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Connection {
    /// Connects to `endpoint` as `socket` and completes the handshake within `timeout`.
    pub async fn connect(endpoint: &str, socket: SocketType, timeout: Duration) -> Result<Connection, Error> {
        let authority = tcp_authority(endpoint)?;
        let work = async {
            let stream = TcpStream::connect(authority).await?;
            stream.set_nodelay(true)?;
            let mut c = Connection { stream, buf: Vec::new() };
            c.stream.write_all(&greeting()).await?;
            let mut theirs = [0u8; GREETING_LEN];
            c.stream.read_exact(&mut theirs).await?;
            check_greeting(&theirs)?;
            let mut out = Vec::new();
            encode_frame(&ready(socket), false, true, &mut out);
            c.stream.write_all(&out).await?;
            let frame = c.frame().await?;
            if !frame.command {
                return protocol("the peer sent a message before READY");
            }
            let peer = parse_ready(&frame.body)?;
            if !socket.accepts(&peer) {
                return protocol(format!("a {} socket cannot talk to a {peer} socket", socket.name()));
            }
            Ok(c)
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "ZMTP handshake timed out")))?
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), Error> {
        let mut out = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            encode_frame(f, i + 1 < frames.len(), false, &mut out);
        }
        self.stream.write_all(&out).await?;
        Ok(())
    }

    /// Subscribes a SUB connection to messages whose first frame starts with `topic`.
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), Error> {
        let mut body = vec![1];
        body.extend_from_slice(topic);
        self.send(&[&body]).await
    }

    async fn frame(&mut self) -> Result<Frame, Error> {
        loop {
            if let Some((frame, used)) = decode_frame(&self.buf)? {
                self.buf.drain(..used);
                return Ok(frame);
            }
            // Into the buffer itself: a read buffer on the stack would live in this future across the await.
            self.buf.reserve(64 * 1024);
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(Error::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }

    /// The next message (commands in between are skipped).
    pub async fn recv(&mut self) -> Result<Vec<Vec<u8>>, Error> {
        let mut parts = Vec::new();
        loop {
            let frame = self.frame().await?;
            if frame.command {
                continue;
            }
            if parts.len() == MAX_FRAMES {
                return protocol(format!("a message of more than {MAX_FRAMES} frames"));
            }
            let more = frame.more;
            parts.push(frame.body);
            if !more {
                return Ok(parts);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_partial_input_waits() {
        let mut out = Vec::new();
        encode_frame(b"abc", true, false, &mut out);
        encode_frame(&[7u8; 300], false, false, &mut out);
        let (f, n) = decode_frame(&out).expect("valid").expect("whole");
        assert_eq!((f.more, f.command, f.body.as_slice(), n), (true, false, &b"abc"[..], 5));
        let (g, m) = decode_frame(&out[n..]).expect("valid").expect("whole");
        assert_eq!((g.more, g.body.len(), m), (false, 300, 309));
        for cut in 0..m {
            assert_eq!(decode_frame(&out[n..n + cut]).expect("valid so far"), None);
        }
        assert!(decode_frame(&[0x80, 0]).is_err(), "unknown flags");
        assert!(decode_frame(&[LONG, 0xff, 0, 0, 0, 0, 0, 0, 0]).is_err(), "an absurd size");
    }

    #[test]
    fn handshake_pieces() {
        check_greeting(&greeting()).expect("ours is valid");
        let mut curve = greeting();
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(check_greeting(&curve).is_err());
        let mut v2 = greeting();
        v2[10] = 2;
        assert!(check_greeting(&v2).is_err());
        assert_eq!(parse_ready(&ready(SocketType::Dealer)).expect("valid"), "DEALER");
        assert!(parse_ready(&ready(SocketType::Sub)[..10]).is_err());
        assert!(SocketType::Sub.accepts("PUB") && !SocketType::Sub.accepts("ROUTER"));
        assert_eq!(tcp_authority("tcp://127.0.0.1:5557").expect("valid"), "127.0.0.1:5557");
        assert!(tcp_authority("ipc:///tmp/x").is_err() && tcp_authority("tcp://h:port").is_err());
    }
}
