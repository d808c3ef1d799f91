//! W3C trace context across processes: a span continues a caller's `traceparent`, and hands its own on to the
//! next hop (gRPC metadata, the KV transfer's Read frame).

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The parts of a `traceparent` header (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`).
fn parse(header: &str) -> Option<SpanContext> {
    let mut parts = header.trim().split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let trace = TraceId::from_hex(trace).ok()?;
    let span = SpanId::from_hex(span).ok()?;
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?);
    let cx = SpanContext::new(trace, span, flags, true, TraceState::default());
    cx.is_valid().then_some(cx)
}

/// Makes `span` a child of the remote span named by `traceparent` (ignored when malformed).
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(cx) = traceparent.and_then(parse) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(cx));
    }
}

/// `span`'s own context as a `traceparent` for the next hop; `None` when spans are not being recorded.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8()))
}

/// The trace id a log line should carry for `span`: its own trace's when spans are recorded, else the one the
/// caller's `traceparent` names (so logs and the client's trace still meet); `None` when there is neither.
pub fn trace_id(span: &tracing::Span, traceparent: Option<&str>) -> Option<String> {
    let own = span.context().span().span_context().clone();
    if own.is_valid() {
        return Some(own.trace_id().to_string());
    }
    traceparent.and_then(parse).map(|cx| cx.trace_id().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse_or_are_ignored() {
        let cx = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").expect("valid");
        assert_eq!(cx.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(cx.is_sampled() && cx.is_remote());
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-xyz-00f067aa0ba902b7-01",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }
}
