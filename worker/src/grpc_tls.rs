//! Mutual TLS for the worker service: the server accepts only clients whose certificate chains to the cluster
//! CA, and clients (the router, other workers) present theirs.

use std::net::SocketAddr;

use kv_transfer::tls::Identity;
use proto::worker::worker_client::WorkerClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity as TlsIdentity, ServerTlsConfig};

/// Server settings: this component's certificate, and the CA that client certificates must chain to.
pub fn server(identity: &Identity) -> ServerTlsConfig {
    ServerTlsConfig::new()
        .identity(TlsIdentity::from_pem(identity.cert_pem(), identity.key_pem()))
        .client_ca_root(Certificate::from_pem(identity.ca_pem()))
}

/// Client settings for a worker reached at `host` (a name or address its certificate carries).
pub fn client(identity: &Identity, host: &str) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(identity.ca_pem()))
        .identity(TlsIdentity::from_pem(identity.cert_pem(), identity.key_pem()))
        .domain_name(host)
}

/// Why a worker could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("worker address {0}: {1}")]
    Address(SocketAddr, String),
    #[error("cannot reach the worker at {0}: {1}")]
    Transport(SocketAddr, tonic::transport::Error),
}

/// A client of the worker at `addr`, over mutual TLS.
pub async fn connect(addr: SocketAddr, identity: &Identity) -> Result<WorkerClient<Channel>, ConnectError> {
    let endpoint =
        Channel::from_shared(format!("https://{addr}")).map_err(|e| ConnectError::Address(addr, e.to_string()))?;
    let channel = endpoint
        .tls_config(client(identity, &addr.ip().to_string()))
        .map_err(|e| ConnectError::Transport(addr, e))?
        .connect()
        .await
        .map_err(|e| ConnectError::Transport(addr, e))?;
    Ok(WorkerClient::new(channel))
}
