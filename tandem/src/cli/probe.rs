//! `tandem probe URL`: one plain-HTTP GET, success on a 2xx answer. Container health checks and Kubernetes exec
//! probes use it, since the runtime image holds no HTTP client of its own.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// `http://host:port/path` (the router's `/ready`, a worker's `/ready` on its metrics port); the image sets
    /// the default for its role.
    #[arg(env = "TANDEM_HEALTH_URL")]
    url: String,
    /// Give up after this many milliseconds (connecting and answering together).
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
}

/// Host, port and path of a plain-HTTP URL.
fn parse(url: &str) -> Result<(&str, u16, &str), String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| format!("{url:?} is not an http:// URL"))?;
    let (authority, path) = rest.find('/').map_or((rest, "/"), |i| (&rest[..i], &rest[i..]));
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
            (h, p.parse::<u16>().map_err(|_| format!("{url:?}: port {p:?} is not a number"))?)
        }
        _ => (authority, 80),
    };
    if host.is_empty() {
        return Err(format!("{url:?} names no host"));
    }
    Ok((host.trim_start_matches('[').trim_end_matches(']'), port, path))
}

/// The status code of an HTTP/1.x status line.
fn status(head: &str) -> Option<u16> {
    let mut parts = head.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/1."))?;
    parts.next()?.parse().ok()
}

pub fn run(args: Args) -> Result<ExitCode, String> {
    let (host, port, path) = parse(&args.url)?;
    let timeout = Duration::from_millis(args.timeout_ms.max(1));
    let addr = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("{host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("{addr}: {e}"))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(|e| format!("{addr}: {e}"))?;
    let mut head = [0u8; 256];
    let n = stream.read(&mut head).map_err(|e| format!("{addr}: {e}"))?;
    let line = String::from_utf8_lossy(&head[..n]);
    let line = line.lines().next().unwrap_or_default();
    match status(line) {
        Some(code) if (200..300).contains(&code) => Ok(ExitCode::SUCCESS),
        Some(code) => {
            eprintln!("{}: HTTP {code}", args.url);
            Ok(ExitCode::FAILURE)
        }
        None => Err(format!("{}: not an HTTP answer: {line:?}", args.url)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_port_and_path() {
        assert_eq!(parse("http://router:8000/ready"), Ok(("router", 8000, "/ready")));
        assert_eq!(parse("http://127.0.0.1:9200"), Ok(("127.0.0.1", 9200, "/")));
        assert_eq!(parse("http://[::1]:9200/health"), Ok(("::1", 9200, "/health")));
        assert_eq!(parse("http://router/ready"), Ok(("router", 80, "/ready")));
        assert!(parse("https://router:8000/ready").is_err(), "no TLS client here");
        assert!(parse("http://router:x/ready").is_err());
        assert!(parse("http://:80/").is_err());
    }

    #[test]
    fn status_lines() {
        assert_eq!(status("HTTP/1.1 200 OK"), Some(200));
        assert_eq!(status("HTTP/1.1 503 Service Unavailable"), Some(503));
        assert_eq!(status("SSH-2.0-OpenSSH"), None);
        assert_eq!(status(""), None);
    }
}
