//! Shared by the worker's integration tests.

#![allow(dead_code)]

use std::net::SocketAddr;

pub fn model() -> std::path::PathBuf {
    engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("the embedded model")
}

/// A plain HTTP/1.1 GET on loopback; the status line must say 200. Returns the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connects");
    sock.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("writes");
    let mut reply = String::new();
    sock.read_to_string(&mut reply).await.expect("reads");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    reply.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}
