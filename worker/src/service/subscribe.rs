//! The worker's two streams to routers: KV events (a snapshot unless resuming after a still-buffered id, then
//! live events, with heartbeats while nothing happens) and load reports (from the state the engine publishes, so
//! they keep coming while the engine is in a long step).

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::generate::{EngineHandle, EngineStats, LoadMark};
use kv_cache::events::EventId;
use proto::worker as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::{Streamed, WorkerService, stopped};
use crate::convert;
use crate::metrics::WorkerMetrics;
use crate::requests::InFlight;

/// How often a KV event subscription looks for new events.
const EVENT_POLL: Duration = Duration::from_millis(20);
/// An empty event batch is sent after this much silence, so a router can tell a quiet worker from a hung one.
pub const EVENT_HEARTBEAT: Duration = Duration::from_secs(1);
/// Load reports when the subscriber names no period.
pub const DEFAULT_LOAD_INTERVAL: Duration = Duration::from_millis(100);
fn load_report(stats: &EngineStats, request_ids: Vec<String>, metrics: &WorkerMetrics) -> pb::LoadReport {
    let usage = kv_cache::events::Tier::ALL
        .iter()
        .map(|&t| {
            let u = stats.usage[t.index()];
            let used = if t == kv_cache::events::Tier::Device { stats.sequence_blocks() } else { u.used };
            pb::TierUsage {
                tier: convert::tier_to_pb(t) as i32,
                used: used as u64,
                cached: u.cached as u64,
                total: (u.used + u.cached + u.free) as u64,
            }
        })
        .collect();
    let (transfer_bytes_total, transfer_nanos_total) = metrics.pulled_totals();
    pb::LoadReport {
        running: stats.running as u32,
        waiting: stats.waiting as u32,
        active_prefill_tokens: stats.prefill_tokens_pending as u64,
        blocks_to_come: stats.blocks_to_come as u64,
        usage,
        request_ids,
        computed_tokens_total: stats.counters.prefill_tokens,
        compute_nanos_total: stats.counters.compute_nanos,
        transfer_bytes_total,
        transfer_nanos_total,
        step_overrun_steps: stats.pacing.map(|p| p.overrun_buckets.to_vec()).unwrap_or_default(),
    }
}

/// Sends a load report every `period`, and at once when the load changes a lot, until the reader goes away.
async fn report_load(
    engine: Arc<EngineHandle>,
    in_flight: Arc<InFlight>,
    metrics: Arc<WorkerMetrics>,
    period: Duration,
    tx: mpsc::Sender<Result<pb::LoadReport, Status>>,
) {
    let mut state = engine.watch_stats();
    let mut last: Option<(LoadMark, Instant)> = None;
    loop {
        // The calls the figures count, told by the tags published with them: a report never counts a request's
        // work without naming it (a router would add its own record of it on top), nor names one it does not count.
        let stats = state.borrow_and_update().clone();
        let ids = in_flight.ids_of(&stats.tags);
        let mark = stats.mark();
        let due = last.as_ref().is_none_or(|(prev, at)| at.elapsed() >= period || mark.moved_since(prev));
        if due {
            if tx.send(Ok(load_report(&stats, ids, &metrics))).await.is_err() {
                return;
            }
            last = Some((mark, Instant::now()));
        }
        let wait = last.as_ref().map_or(period, |(_, at)| period.saturating_sub(at.elapsed()));
        tokio::select! {
            changed = state.changed() => {
                if changed.is_err() {
                    // The engine is gone: report what there is, on the period, until the reader leaves.
                    tokio::time::sleep(wait).await;
                }
            }
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Awaits `work`, sending an empty event batch (a heartbeat) every [`EVENT_HEARTBEAT`] meanwhile; `None` when the
/// reader went away.
async fn with_heartbeats<T>(
    work: impl std::future::Future<Output = T>,
    tx: &mpsc::Sender<Result<pb::KvEventBatch, Status>>,
    heartbeat: &(dyn Fn() -> pb::KvEventBatch + Sync),
) -> Option<T> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => return Some(out),
            _ = tokio::time::sleep(EVENT_HEARTBEAT) => {
                if tx.send(Ok(heartbeat())).await.is_err() {
                    return None;
                }
            }
        }
    }
}

/// Feeds one subscription: a snapshot when needed, then events as they come, until the reader goes away.
async fn follow_events(
    engine: Arc<EngineHandle>,
    instance: String,
    after: Option<EventId>,
    tx: mpsc::Sender<Result<pb::KvEventBatch, Status>>,
) {
    let batch = |body| pb::KvEventBatch { instance_id: instance.clone(), body: Some(body) };
    let heartbeat = || batch(pb::kv_event_batch::Body::Events(pb::KvEvents { events: Vec::new() }));
    let mut last = after;
    let mut need_snapshot = after.is_none();
    let mut quiet_since = Instant::now();
    loop {
        if need_snapshot {
            let Some(Some(snap)) = with_heartbeats(engine.snapshot(), &tx, &heartbeat).await else { return };
            last = snap.as_of;
            let body = pb::kv_event_batch::Body::Snapshot(convert::snapshot_to_pb(&snap));
            if tx.send(Ok(batch(body))).await.is_err() {
                return;
            }
            need_snapshot = false;
            quiet_since = Instant::now();
        }
        // The engine answers between steps: heartbeats go on while it is in a long one.
        let Some(fetched) = with_heartbeats(engine.events_after(last), &tx, &heartbeat).await else { return };
        match fetched {
            None => return,
            Some(Err(_too_old)) => need_snapshot = true,
            Some(Ok(events)) if events.is_empty() => {
                if quiet_since.elapsed() >= EVENT_HEARTBEAT {
                    if tx.send(Ok(heartbeat())).await.is_err() {
                        return;
                    }
                    quiet_since = Instant::now();
                }
                tokio::time::sleep(EVENT_POLL).await;
            }
            Some(Ok(events)) => {
                last = events.last().map(|(id, _)| *id);
                let events = events.iter().map(|(id, e)| convert::event_to_pb(id.0, e)).collect();
                if tx.send(Ok(batch(pb::kv_event_batch::Body::Events(pb::KvEvents { events })))).await.is_err() {
                    return;
                }
                quiet_since = Instant::now();
            }
        }
    }
}

impl WorkerService {
    pub(super) fn kv_events(&self, req: pb::SubscribeKvEventsRequest) -> Streamed<pb::KvEventBatch> {
        let after = req.after_event_id.map(EventId);
        let (tx, rx) = mpsc::channel(64);
        let follow = follow_events(Arc::clone(&self.engine), self.info.instance_id.clone(), after, tx);
        let stop = self.stopping.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stopped(stop) => {}
                _ = follow => {}
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }

    pub(super) fn load_reports(&self, req: pb::WatchLoadRequest) -> Streamed<pb::LoadReport> {
        let ms = req.interval_ms;
        let period = if ms == 0 { DEFAULT_LOAD_INTERVAL } else { Duration::from_millis(u64::from(ms)) };
        let (tx, rx) = mpsc::channel(4);
        let report =
            report_load(Arc::clone(&self.engine), Arc::clone(&self.in_flight), Arc::clone(&self.metrics), period, tx);
        let stop = self.stopping.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stopped(stop) => {}
                _ = report => {}
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }
}
