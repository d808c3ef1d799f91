//! Plain HTTP/1.1 requests on a connection of their own: what the router needs to talk to engine servers (and the
//! load generator to talk to any OpenAI-compatible endpoint).

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;

/// A connection's driver task, ended when dropped: dropping it mid-stream closes the connection, which is how a
/// server learns that nobody waits for the rest.
#[derive(Debug)]
pub struct Connection(tokio::task::JoinHandle<Result<(), hyper::Error>>);

impl Drop for Connection {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sends `request` (its `host` header set here) with `body` to `authority` (`host:port`); the response's body can
/// be read while the returned connection lives.
pub async fn send(
    authority: &str,
    request: hyper::http::request::Builder,
    body: Bytes,
) -> Result<(hyper::Response<hyper::body::Incoming>, Connection), String> {
    let stream = tokio::net::TcpStream::connect(authority).await.map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| format!("handshake: {e}"))?;
    let connection = Connection(tokio::spawn(conn));
    let request = request.header("host", authority).body(Full::new(body)).map_err(|e| format!("building: {e}"))?;
    let response = sender.send_request(request).await.map_err(|e| format!("sending: {e}"))?;
    Ok((response, connection))
}
