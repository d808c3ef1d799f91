//! Where workers come from: fixed addresses, DNS names re-resolved periodically (a Kubernetes headless Service
//! resolves to every ready pod), and workers that register themselves with `POST /admin/workers`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::cluster::{Cluster, Origin};

/// How often DNS names are resolved again; pods come and go on this scale.
pub const DEFAULT_DNS_REFRESH: Duration = Duration::from_secs(10);

/// One entry of the worker list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerSource {
    /// A fixed address.
    Static(SocketAddr),
    /// `host:port`, resolved again every refresh; every address it yields is a worker.
    Dns(String),
}

impl WorkerSource {
    /// `1.2.3.4:9000` is static; anything else with a port is a DNS name.
    pub fn parse(s: &str) -> Result<WorkerSource, String> {
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(WorkerSource::Static(a));
        }
        match s.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(WorkerSource::Dns(s.to_string()))
            }
            _ => Err(format!("worker {s:?} is not host:port")),
        }
    }
}

/// Follows every static worker now, and keeps DNS names' workers in step with what they resolve to until `stop`.
pub fn start(cluster: &Arc<Cluster>, sources: &[WorkerSource], refresh: Duration, stop: watch::Receiver<bool>) {
    let mut names = Vec::new();
    for s in sources {
        match s {
            WorkerSource::Static(a) => {
                if let Err(e) = cluster.follow(*a, Origin::Configured) {
                    tracing::warn!(worker = %a, error = %e, "worker not followed");
                }
            }
            WorkerSource::Dns(n) => names.push(n.clone()),
        }
    }
    if names.is_empty() {
        return;
    }
    let cluster = Arc::clone(cluster);
    tokio::spawn(async move {
        let mut stop = stop;
        // What each name resolved to last time: only those addresses are dropped when they disappear.
        let mut known: HashMap<String, HashSet<SocketAddr>> = HashMap::new();
        loop {
            for name in &names {
                let Ok(found) = tokio::net::lookup_host(name.as_str()).await else {
                    // A failed lookup changes nothing: a DNS hiccup must not empty the cluster.
                    tracing::warn!(name = %name, "worker name did not resolve");
                    continue;
                };
                let now: HashSet<SocketAddr> = found.collect();
                let before = known.remove(name).unwrap_or_default();
                for a in now.difference(&before) {
                    if let Err(e) = cluster.follow(*a, Origin::Configured) {
                        tracing::warn!(worker = %a, error = %e, "worker not followed");
                    }
                }
                for a in before.difference(&now) {
                    cluster.unfollow(*a);
                }
                known.insert(name.clone(), now);
            }
            tokio::select! {
                _ = tokio::time::sleep(refresh) => {}
                _ = stop.wait_for(|&s| s) => return,
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse() {
        assert_eq!(WorkerSource::parse("127.0.0.1:9000"), Ok(WorkerSource::Static(([127, 0, 0, 1], 9000).into())));
        assert_eq!(WorkerSource::parse("[::1]:9000").map(|s| matches!(s, WorkerSource::Static(_))), Ok(true));
        assert_eq!(
            WorkerSource::parse("decode.tandem.svc:9000"),
            Ok(WorkerSource::Dns("decode.tandem.svc:9000".into()))
        );
        assert!(WorkerSource::parse("decode").is_err());
        assert!(WorkerSource::parse("decode:http").is_err());
    }
}
