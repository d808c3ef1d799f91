//! Mutual TLS for the worker service: the server accepts only clients whose certificate chains to the cluster
//! CA, and clients (the router, other workers) present theirs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kv_transfer::tls::{Identity, TlsError};
use proto::worker::worker_client::WorkerClient;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity as TlsIdentity};

/// Server settings for [`incoming`]: this component's certificate, HTTP/2 over TLS 1.3, and the CA that client
/// certificates must chain to.
pub fn server_config(identity: &Identity) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    Ok(Arc::new(identity.tls_server(b"h2")?))
}

/// The connections accepted on `listener`, each through a TLS handshake with the settings `current` holds when it
/// begins, so that new certificates apply to the next connection without a restart. A handshake that fails or
/// takes longer than [`CONNECT_TIMEOUT`] is dropped without holding up the others. The accepting task ends when
/// the stream is dropped.
pub fn incoming(
    listener: tokio::net::TcpListener,
    current: watch::Receiver<Arc<rustls::ServerConfig>>,
) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: the next accept may work.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // Tokens go out one small frame at a time: without TCP_NODELAY, Nagle's algorithm holds each behind
            // the peer's delayed ACK of the one before (about 40 ms on Linux). tonic sets it on the sockets it
            // accepts itself; these it does not see.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(peer = %peer, error = %e, "TCP_NODELAY not set");
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&current.borrow()));
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(CONNECT_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(peer = %peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::debug!(peer = %peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Client settings for a worker reached at `host` (a name or address its certificate carries).
pub fn client(identity: &Identity, host: &str) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(identity.ca_pem()))
        .identity(TlsIdentity::from_pem(identity.cert_pem(), identity.key_pem()))
        .domain_name(host)
}

/// A connection attempt (TCP and TLS) that takes longer than this has failed: a peer that accepts and then says
/// nothing must not hold anyone up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings this often on an otherwise quiet connection, both ways: a peer that vanished without closing (a
/// dead host, a cut network) is noticed within [`KEEPALIVE_TIMEOUT`] of the next ping.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// A ping unanswered this long closes the connection.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a worker could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("worker address {0}: {1}")]
    Address(SocketAddr, String),
    #[error("cannot reach the worker at {0}: {1}")]
    Transport(SocketAddr, tonic::transport::Error),
    #[error("the worker at {0} did not complete a connection within {1:?}")]
    Timeout(SocketAddr, Duration),
}

/// A client of the worker at `addr`, over mutual TLS, whose certificate must carry that address.
pub async fn connect(addr: SocketAddr, identity: &Identity) -> Result<WorkerClient<Channel>, ConnectError> {
    connect_named(addr, &addr.ip().to_string(), identity).await
}

/// A client of the worker at `addr`, over mutual TLS, whose certificate must carry `server_name` (the DNS name it
/// was found under, a role identity shared by its replicas) and chain to the cluster CA.
pub async fn connect_named(
    addr: SocketAddr,
    server_name: &str,
    identity: &Identity,
) -> Result<WorkerClient<Channel>, ConnectError> {
    let endpoint =
        Channel::from_shared(format!("https://{addr}")).map_err(|e| ConnectError::Address(addr, e.to_string()))?;
    let endpoint = endpoint
        .tls_config(client(identity, server_name))
        .map_err(|e| ConnectError::Transport(addr, e))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .tcp_keepalive(Some(KEEPALIVE_INTERVAL));
    // The TLS handshake too must finish in time: the connect timeout alone covers TCP.
    let channel = tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| ConnectError::Timeout(addr, CONNECT_TIMEOUT))?
        .map_err(|e| ConnectError::Transport(addr, e))?;
    Ok(WorkerClient::new(channel))
}

#[cfg(test)]
mod tests {
    use kv_transfer::tls::DevCa;
    use tokio_stream::StreamExt;

    use super::*;

    /// Accepted connections carry TCP_NODELAY: streamed tokens are small writes that Nagle's algorithm would hold
    /// behind the peer's delayed ACK of the one before (about 40 ms each on Linux).
    #[tokio::test]
    async fn accepted_connections_send_small_writes_at_once() {
        let ca = DevCa::generate().expect("ca");
        let (server, client) = (ca.issue("worker", &[]).expect("cert"), ca.issue("router", &[]).expect("cert"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (_keep, current) = watch::channel(server_config(&server).expect("config"));
        let mut accepted = incoming(listener, current);
        let dial = tokio::spawn(async move { connect(addr, &client).await.map(|_| ()) });
        let tls = accepted.next().await.expect("a connection").expect("accepted");
        assert!(tls.get_ref().0.nodelay().expect("the option reads"), "TCP_NODELAY on the accepted socket");
        dial.await.expect("joins").expect("the client connected");
    }
}
