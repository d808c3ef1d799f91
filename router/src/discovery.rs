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

/// The name a worker found under `host:port` must carry in its certificate: the host, as HTTPS verifies the name
/// it dialled (a headless Service's name; every replica's certificate carries it).
fn tls_name(source: &str) -> &str {
    source.rsplit_once(':').map_or(source, |(host, _)| host)
}

/// Follows every static worker now, and keeps DNS names' workers in step with what they resolve to until `stop`.
pub fn start(cluster: &Arc<Cluster>, sources: &[WorkerSource], refresh: Duration, stop: watch::Receiver<bool>) {
    let mut names = Vec::new();
    let mut statics = HashSet::new();
    for s in sources {
        match s {
            WorkerSource::Static(a) => {
                statics.insert(*a);
                if let Err(e) = cluster.follow(*a, Origin::Configured, None) {
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
        // What each name resolved to last time it did: a failed lookup changes nothing (a DNS hiccup must not
        // empty the cluster).
        let mut resolved: HashMap<String, HashSet<SocketAddr>> = HashMap::new();
        // Every address followed through a name, with that name.
        let mut followed: HashMap<SocketAddr, String> = HashMap::new();
        loop {
            for name in &names {
                match tokio::net::lookup_host(name.as_str()).await {
                    Ok(found) => {
                        resolved.insert(name.clone(), found.collect());
                    }
                    Err(_) => tracing::warn!(name = %name, "worker name did not resolve"),
                }
            }
            let now: HashMap<SocketAddr, String> = names
                .iter()
                .flat_map(|n| resolved.get(n).into_iter().flatten().map(move |a| (*a, n.clone())))
                .filter(|(a, _)| !statics.contains(a))
                .collect();
            let (gone, new) = changes(&followed, &now);
            for a in gone {
                cluster.unfollow(a);
            }
            for (a, name) in new {
                if let Err(e) = cluster.follow(a, Origin::Configured, Some(tls_name(&name).to_string())) {
                    tracing::warn!(worker = %a, error = %e, "worker not followed");
                }
            }
            followed = now;
            tokio::select! {
                _ = tokio::time::sleep(refresh) => {}
                _ = stop.wait_for(|&s| s) => return,
            }
        }
    });
}

/// What to stop and start following when the names' addresses go from `before` to `now` (each address with the
/// name it was found under). Addresses are compared across all names at once: one that moved from a name to
/// another (a container or pod restarted under another role got a freed address) is followed again under its new
/// name, whose certificate name differs, and is not dropped because its old name lost it.
fn changes(
    before: &HashMap<SocketAddr, String>,
    now: &HashMap<SocketAddr, String>,
) -> (Vec<SocketAddr>, Vec<(SocketAddr, String)>) {
    let moved = |a: &SocketAddr, n: &String| before.get(a) != Some(n);
    let gone = before.iter().filter(|(a, n)| now.get(a) != Some(n)).map(|(a, _)| *a).collect();
    let new = now.iter().filter(|(a, n)| moved(a, n)).map(|(a, n)| (*a, n.clone())).collect();
    (gone, new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_that_moves_to_another_name_is_followed_again_under_it() {
        let a: SocketAddr = "172.21.0.5:9000".parse().expect("addr");
        let b: SocketAddr = "172.21.0.6:9000".parse().expect("addr");
        let map = |v: &[(SocketAddr, &str)]| v.iter().map(|(a, n)| (*a, n.to_string())).collect::<HashMap<_, _>>();
        let before = map(&[(a, "decode:9000"), (b, "prefill:9000")]);
        let (mut gone, new) = changes(&before, &map(&[(a, "prefill:9000"), (b, "prefill:9000")]));
        gone.sort();
        assert_eq!(gone, vec![a], "dropped under its old name");
        assert_eq!(new, vec![(a, "prefill:9000".to_string())], "and followed under its new one; b untouched");
        let (gone, new) = changes(&before, &before);
        assert!(gone.is_empty() && new.is_empty(), "nothing changed");
        let (gone, new) = changes(&before, &map(&[(b, "prefill:9000")]));
        assert_eq!((gone, new), (vec![a], vec![]), "a disappeared");
    }

    #[test]
    fn a_worker_found_by_name_must_carry_that_name() {
        assert_eq!(tls_name("prefill:9000"), "prefill");
        assert_eq!(
            tls_name("tandem-prefill.default.svc.cluster.local:9000"),
            "tandem-prefill.default.svc.cluster.local"
        );
    }

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
