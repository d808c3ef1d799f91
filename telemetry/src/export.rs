//! Span export that never blocks a request and counts what it drops: a bounded gate in front of the SDK's batch
//! processor. A span that finds `QUEUE_LIMIT` spans already waiting is dropped and counted
//! (`tandem_trace_spans_dropped_total`); the batch processor behind the gate has room for twice as many, so it
//! never drops one uncounted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, Span, SpanData, SpanExporter, SpanProcessor};

/// Spans allowed to wait for export.
pub const QUEUE_LIMIT: usize = 2048;

static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Spans dropped because the export queue was full, in this process.
pub fn dropped_spans() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Hands batches to the real exporter, marking them as no longer waiting.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    waiting: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        self.waiting.fetch_sub(batch.len(), Ordering::AcqRel);
        self.inner.export(batch)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The gate: admits a span while fewer than `limit` wait, else counts it as dropped.
#[derive(Debug)]
pub struct Gate {
    inner: BatchSpanProcessor,
    waiting: Arc<AtomicUsize>,
    limit: usize,
}

impl Gate {
    /// A batch processor over `exporter` behind a gate of `limit` waiting spans.
    pub fn new<E: SpanExporter + 'static>(exporter: E, limit: usize, delay: Duration) -> Gate {
        let waiting = Arc::new(AtomicUsize::new(0));
        let config = BatchConfigBuilder::default().with_max_queue_size(limit * 2).with_scheduled_delay(delay).build();
        let inner = BatchSpanProcessor::builder(Counted { inner: exporter, waiting: Arc::clone(&waiting) })
            .with_batch_config(config)
            .build();
        Gate { inner, waiting, limit }
    }
}

impl SpanProcessor for Gate {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.limit {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{Tracer, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};

    use super::*;

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_blocking() {
        let exporter = InMemorySpanExporter::default();
        // A long delay: nothing leaves the queue until the flush.
        let gate = Gate::new(exporter.clone(), 3, Duration::from_secs(3600));
        let provider = SdkTracerProvider::builder().with_span_processor(gate).build();
        let tracer = provider.tracer("test");
        let before = dropped_spans();
        for _ in 0..5 {
            tracer.in_span("work", |_| {});
        }
        assert_eq!(dropped_spans() - before, 2, "two spans found the queue full");
        provider.force_flush().expect("flushes");
        assert_eq!(exporter.get_finished_spans().expect("spans").len(), 3);
        // The queue drained: new spans are admitted again.
        tracer.in_span("work", |_| {});
        assert_eq!(dropped_spans() - before, 2);
        let _ = provider.shutdown();
    }
}
