//! Pulling a prompt's leading blocks ahead of its request: the decode worker stores the blocks of a prefill
//! worker's handle that it lacks in its cache, computing nothing, while the prefill worker computes the rest of the
//! prompt. The `Generate` that follows finds them as any cached prefix and pulls only what is left.

use kv_cache::CacheNamespace;
use proto::worker as pb;
use tonic::{Response, Status};

use super::{WorkerService, submit_status};
use crate::convert;

impl WorkerService {
    pub(super) async fn prefetch_inner(
        &self,
        r: pb::PrefetchRequest,
        traceparent: Option<String>,
    ) -> Result<Response<pb::PrefetchResponse>, Status> {
        let handle = convert::handle_from_pb(r.handle.ok_or_else(|| Status::invalid_argument("no KV handle"))?)?;
        let namespace = r.cache_namespace.map(CacheNamespace::new);
        // A cancel for the request reaches the pull too.
        let (_ticket, cancelled) = self.in_flight.enter(&r.request_id);
        let work = async {
            let (pulled, timing) =
                self.puller.pull_missing(&self.engine, &r.tokens, namespace.as_ref(), handle, traceparent).await?;
            let stored = self.engine.import(namespace, r.tokens, pulled).await;
            if let Some(t) = timing {
                self.puller.finish(t, stored.is_ok());
            }
            stored.map_err(submit_status)
        };
        let stored = tokio::select! {
            s = work => s?,
            _ = cancelled => return Err(Status::cancelled("cancelled")),
        };
        Ok(Response::new(pb::PrefetchResponse { stored_blocks: stored as u32 }))
    }
}
