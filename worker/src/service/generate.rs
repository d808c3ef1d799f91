//! The decode role (and aggregated serving): pull the blocks a prefill worker's handle offers that this worker
//! lacks, then stream the sequence's tokens until it finishes, the caller goes away, or `Cancel` names it.

use std::sync::Arc;
use std::time::Instant;

use engine::generate::{Request, SeqEvent, SubmitError};
use kv_cache::CacheNamespace;
use proto::worker as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Response, Status};
use tracing::Instrument;

use super::{Streamed, WorkerService, stopped, submit_status};
use crate::convert;
use crate::pull::Pulled;

/// A finished sequence as the decode stream reports it.
fn finished(c: &engine::generate::Completion) -> pb::GenerateResponse {
    let f = pb::Finished {
        reason: convert::finish_to_pb(c.finish_reason) as i32,
        prompt_tokens: c.prompt_ids.len() as u32,
        completion_tokens: c.token_ids.len() as u32,
        cached_tokens: c.cached_tokens as u32,
    };
    pb::GenerateResponse { event: Some(pb::generate_response::Event::Finished(f)) }
}

impl WorkerService {
    pub(super) async fn generate_inner(
        &self,
        r: pb::GenerateRequest,
        traceparent: Option<String>,
        arrived: Instant,
    ) -> Result<Response<Streamed<pb::GenerateResponse>>, Status> {
        let priority = r.sampling.as_ref().map_or(0, |s| s.priority);
        let sampling = convert::sampling(r.sampling, None)?;
        let deadline = convert::deadline(r.deadline_unix_ms, std::time::SystemTime::now(), Instant::now())?;
        let namespace = r.cache_namespace.map(CacheNamespace::new);
        let (ticket, mut cancelled) = self.in_flight.enter(&r.request_id);
        let (pulled, timing) = match r.handle {
            Some(h) => {
                let handle = convert::handle_from_pb(h)?;
                self.puller.pull_missing(&self.engine, &r.tokens, namespace.as_ref(), handle, traceparent).await?
            }
            None => (Pulled::Received(Vec::new()), None),
        };
        let capacity = sampling.max_tokens() as usize + 2;
        let request = Request { namespace, prompt: r.tokens, sampling, deadline, priority };
        let submitted = self.engine.submit_with_blocks(request, pulled, Some(ticket.tag())).await;
        // A block that failed its check in the engine makes the pull a failed one, as one failing on receipt is.
        if let Some(t) = timing {
            self.puller.finish(t, !matches!(submitted, Err(SubmitError::Transfer(_))));
        }
        let mut stream = submitted.map_err(submit_status)?;
        let (tx, rx) = mpsc::channel(capacity);
        let metrics = Arc::clone(&self.metrics);
        let abort = self.aborting.clone();
        let decode =
            tracing::info_span!("decode", output_tokens = tracing::field::Empty, cached_tokens = tracing::field::Empty);
        // The server span lasts as long as the stream it answers with, not just until the headers go out: a span
        // ends when it is last left, so the task runs inside it.
        let server = tracing::Span::current();
        tokio::spawn(
            async move {
                // The ticket lives as long as this task: the call leaves the in-flight table however it ends.
                let _ticket = ticket;
                let mut first_at = None;
                loop {
                    let ev = tokio::select! {
                        _ = &mut cancelled => break,
                        _ = stopped(abort.clone()) => {
                            let _ = tx.send(Err(Status::unavailable("the worker stopped"))).await;
                            break;
                        }
                        ev = stream.next() => ev,
                    };
                    let Some(ev) = ev else { break };
                    let (msg, last) = match ev {
                        SeqEvent::Token { token, text, logprobs, prompt_logprobs } => {
                            if first_at.is_none() {
                                metrics.time_to_first_token.observe(arrived.elapsed());
                                first_at = Some(Instant::now());
                            }
                            let logprobs = logprobs.as_ref().map(convert::logprobs_to_pb);
                            let prompt_logprobs = prompt_logprobs.iter().map(convert::logprobs_to_pb).collect();
                            let token = pb::Token { id: token, text, logprobs, prompt_logprobs };
                            let event = pb::generate_response::Event::Token(token);
                            (Ok(pb::GenerateResponse { event: Some(event) }), false)
                        }
                        SeqEvent::Finished(c) => {
                            let n = c.token_ids.len();
                            if let (Some(at), true) = (first_at, n > 1) {
                                metrics.time_per_output_token.observe(at.elapsed() / (n as u32 - 1));
                            }
                            tracing::Span::current()
                                .record("output_tokens", n)
                                .record("cached_tokens", c.cached_tokens);
                            (Ok(finished(&c)), true)
                        }
                        SeqEvent::Failed(e) => (Err(Status::internal(e)), true),
                        SeqEvent::Refused(e) => (Err(Status::invalid_argument(e)), true),
                        SeqEvent::Expired => (Err(Status::deadline_exceeded("the request's deadline passed")), true),
                        SeqEvent::Exported(_) => continue,
                    };
                    // A client that went away drops the engine stream here, which cancels the sequence.
                    if tx.send(msg).await.is_err() || last {
                        break;
                    }
                }
            }
            .instrument(decode)
            .instrument(server),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
