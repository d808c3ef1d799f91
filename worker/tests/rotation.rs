//! Certificates rotated under a running worker (cert-manager renews them, or the CA itself changes): the worker
//! presents and trusts the new ones on its next connections, without a restart.

use std::time::{Duration, Instant};

use kv_transfer::tls::{DevCa, Identity, IdentityFiles};
use proto::worker as pb;
use worker::{Role, RunningWorker, WorkerConfig};

fn model() -> std::path::PathBuf {
    engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("the embedded model")
}

/// Whether a client presenting `identity` (and trusting its CA) gets an answer from the worker at `addr`.
async fn answers(addr: std::net::SocketAddr, identity: &Identity) -> bool {
    match worker::grpc_tls::connect(addr, identity).await {
        Ok(mut c) => c.info(pb::InfoRequest {}).await.is_ok(),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_takes_rotated_certificates_on_its_next_connections() {
    let dir = std::env::temp_dir().join(format!("tandem-rotation-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let old = DevCa::generate().expect("ca");
    old.write(&dir).expect("writes");
    old.issue("worker-0", &[]).expect("cert").write(&dir, "worker-0").expect("writes");
    let files = IdentityFiles { dir: dir.clone(), name: "worker-0".into() };
    let identity = Identity::load(&dir, "worker-0").expect("reads");
    let w =
        RunningWorker::start(WorkerConfig { certs: Some(files), ..WorkerConfig::local(Role::Both, model(), identity) })
            .await
            .expect("worker");
    let (old_router, new) = (old.issue("router", &[]).expect("cert"), DevCa::generate().expect("another ca"));
    let new_router = new.issue("router", &[]).expect("cert");
    assert!(answers(w.grpc, &old_router).await);
    assert!(!answers(w.grpc, &new_router).await, "not yet: another CA");

    // The CA and the worker's certificate are replaced in place.
    new.write(&dir).expect("writes");
    new.issue("worker-0", &[]).expect("cert").write(&dir, "worker-0").expect("writes");
    let start = Instant::now();
    while !answers(w.grpc, &new_router).await {
        assert!(start.elapsed() < Duration::from_secs(15), "the worker never took the new certificates");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!answers(w.grpc, &old_router).await, "the old CA is no longer trusted");
    w.shutdown(Duration::from_secs(5)).await;
    let _ = std::fs::remove_dir_all(&dir);
}
