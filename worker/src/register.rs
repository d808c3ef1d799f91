//! Self-registration: a worker tells the router where to reach it (`POST /admin/workers`), again every little
//! while so that a restarted router learns it too, and says goodbye on shutdown (`DELETE /admin/workers`).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Re-announcement period: a restarted router finds every worker within this time.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(15);
/// One announcement gives up after this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Where and how to register.
#[derive(Clone, Debug)]
pub struct Registration {
    /// The router's HTTP address, `host:port` (an `http://` prefix is accepted).
    pub router: String,
    /// The gRPC address the router should dial for this worker.
    pub advertise: SocketAddr,
    /// The router's API key, when it requires one.
    pub api_key: Option<String>,
}

impl Registration {
    fn host(&self) -> &str {
        self.router.trim_start_matches("http://").trim_end_matches('/')
    }

    async fn call(&self, method: &str) -> Result<u16, String> {
        let body = format!("{{\"address\":\"{}\"}}", self.advertise);
        let auth = self.api_key.as_ref().map(|k| format!("authorization: Bearer {k}\r\n")).unwrap_or_default();
        let host = self.host();
        let request = format!(
            "{method} /admin/workers HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{auth}connection: close\r\n\r\n{body}",
            body.len()
        );
        let exchange = async {
            let mut sock = tokio::net::TcpStream::connect(host).await.map_err(|e| format!("router {host}: {e}"))?;
            sock.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
            let mut reply = Vec::new();
            sock.read_to_end(&mut reply).await.map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&reply);
            text.split(' ').nth(1).and_then(|s| s.parse::<u16>().ok()).ok_or_else(|| "no HTTP status".to_string())
        };
        tokio::time::timeout(CALL_TIMEOUT, exchange).await.map_err(|_| format!("router {host}: no answer"))?
    }

    /// Announces this worker once.
    pub async fn announce(&self) -> Result<(), String> {
        match self.call("POST").await? {
            200..=299 => Ok(()),
            s => Err(format!("the router refused the registration (HTTP {s})")),
        }
    }

    /// Withdraws this worker.
    pub async fn withdraw(&self) -> Result<(), String> {
        match self.call("DELETE").await? {
            200..=299 | 404 => Ok(()),
            s => Err(format!("the router refused the withdrawal (HTTP {s})")),
        }
    }

    /// Announces now and every [`ANNOUNCE_EVERY`] until the task is aborted.
    pub fn keep_announcing(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                if let Err(e) = self.announce().await {
                    tracing::warn!(error = %e, "registration with the router failed; retrying");
                }
                tokio::time::sleep(ANNOUNCE_EVERY).await;
            }
        })
    }
}
