//! One trace per request across router, prefill worker, KV transfer and decode worker, exported over OTLP to an
//! in-process receiver: the span tree, the parent links and the key attributes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_transfer::tls::DevCa;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use tandem_tests::*;
use telemetry::TraceExport;
use worker::Role;

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = req.into_inner().resource_spans.into_iter().flat_map(|r| r.scope_spans).flat_map(|s| s.spans);
        self.0.lock().expect("lock").extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

async fn receiver() -> (SocketAddr, Receiver) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    let rx = Receiver::default();
    let svc = TraceServiceServer::new(rx.clone());
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let _ = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await;
    });
    (addr, rx)
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().rev().find(|a| a.key == key).and_then(|a| a.value.as_ref()?.value.as_ref()).map(
        |v| match v {
            Value::StringValue(s) => s.clone(),
            Value::IntValue(i) => i.to_string(),
            Value::BoolValue(b) => b.to_string(),
            Value::DoubleValue(d) => d.to_string(),
            other => format!("{other:?}"),
        },
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The spans of trace `trace` received so far, once `complete` says they are all there (flushing the exporter
/// every 100 ms, for up to 5 s).
async fn spans_of(
    guard: &telemetry::Guard,
    received: &Receiver,
    trace: &str,
    complete: impl Fn(&[Span]) -> bool,
) -> Vec<Span> {
    let mut spans = Vec::new();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        guard.flush();
        spans = received.0.lock().expect("lock").iter().filter(|s| hex(&s.trace_id) == trace).cloned().collect();
        if complete(&spans) {
            break;
        }
    }
    spans
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_follows_a_request_across_every_component() {
    let (otlp, received) = receiver().await;
    let export = TraceExport { endpoint: Some(format!("http://{otlp}")), timeout: Some(Duration::from_secs(2)) };
    let guard = telemetry::init_with("tandem-test", export);
    assert!(guard.exporting(), "this test process exports its spans");

    let ca = DevCa::generate().expect("ca");
    let (workers, router) = cluster(&ca, &[Role::Prefill, Role::Decode]).await;
    let (p, d) = (&workers[0], &workers[1]);

    let client_trace = "0af7651916cd43dd8448eb211c80319c";
    let client_span = "b7ad6b7169203331";
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about the longest rivers of the world, one by one, briefly."}]})
    .to_string();
    let tp = format!("00-{client_trace}-{client_span}-01");
    let reply = http(router.addr, "POST", "/v1/chat/completions", &body, &[("traceparent", &tp)]).await;
    assert_eq!(reply.status, 200, "{}", reply.body);

    // Spans end as the request finishes; give the batch exporter a moment and flush.
    let wanted = [
        "POST /v1/chat/completions",
        "tokenize",
        "route",
        "prefill",
        "generate",
        "kv_transfer.pull",
        "kv_transfer.serve",
        "decode",
    ];
    let spans = spans_of(&guard, &received, client_trace, |spans| {
        wanted.iter().all(|w| spans.iter().any(|s| s.name == *w))
            && spans.iter().filter(|s| s.name == "generate").count() == 2
    })
    .await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let by_id: HashMap<String, &Span> = spans.iter().map(|s| (hex(&s.span_id), s)).collect();
    let parent_name = |s: &Span| by_id.get(&hex(&s.parent_span_id)).map(|p| p.name.clone());
    let find = |name: &str, kind: i32| {
        spans
            .iter()
            .find(|s| s.name == name && (kind == 0 || s.kind == kind))
            .unwrap_or_else(|| panic!("no {name} span (kind {kind}) in {names:?}"))
    };
    const SERVER: i32 = 2;
    const CLIENT: i32 = 3;

    let root = find("POST /v1/chat/completions", SERVER);
    assert_eq!(hex(&root.parent_span_id), client_span, "the router continued the client's trace");
    assert_eq!(attr(root, "gen_ai.operation.name").as_deref(), Some("chat"));
    assert_eq!(attr(root, "gen_ai.request.model").as_deref(), Some("smollm2-135m-instruct"));
    assert!(attr(root, "gen_ai.usage.input_tokens").is_some() && attr(root, "gen_ai.usage.output_tokens").is_some());
    assert!(attr(root, "gen_ai.response.finish_reasons").is_some());

    let route = find("route", 0);
    assert_eq!(parent_name(route).as_deref(), Some(root.name.as_str()));
    assert_eq!(attr(route, "policy").as_deref(), Some("kv"));
    assert_eq!(attr(route, "disaggregate").as_deref(), Some("true"));
    assert_eq!(attr(route, "reason").as_deref(), Some("prefill_remote"));
    assert_eq!(attr(route, "prefill_worker"), Some(p.grpc.to_string()));
    assert_eq!(attr(route, "decode_worker"), Some(d.grpc.to_string()));
    assert!(attr(route, "cost").is_some() && attr(route, "overlap_device").is_some());
    assert_eq!(parent_name(find("tokenize", 0)).as_deref(), Some(root.name.as_str()));

    let prefill_client = find("prefill", CLIENT);
    assert_eq!(hex(&prefill_client.parent_span_id), hex(&root.span_id));
    let prefill_server = find("prefill", SERVER);
    assert_eq!(hex(&prefill_server.parent_span_id), hex(&prefill_client.span_id), "P continued the router's span");
    assert!(attr(prefill_server, "computed_tokens").is_some() && attr(prefill_server, "cached_tokens").is_some());

    let generate_client = find("generate", CLIENT);
    assert_eq!(hex(&generate_client.parent_span_id), hex(&root.span_id));
    let generate_server = find("generate", SERVER);
    assert_eq!(hex(&generate_server.parent_span_id), hex(&generate_client.span_id), "D continued the router's span");
    let pull = find("kv_transfer.pull", 0);
    assert_eq!(hex(&pull.parent_span_id), hex(&generate_server.span_id));
    assert_eq!(attr(pull, "transport").as_deref(), Some("quic"));
    assert!(attr(pull, "bytes").is_some_and(|b| b != "0") && attr(pull, "throughput_bytes_per_s").is_some());
    let serve = find("kv_transfer.serve", 0);
    assert_eq!(hex(&serve.parent_span_id), hex(&pull.span_id), "the Read frame carried the pull's context to P");
    let decode = find("decode", 0);
    assert_eq!(hex(&decode.parent_span_id), hex(&generate_server.span_id));
    assert!(attr(decode, "output_tokens").is_some());
    // The client and server spans of the decode stream last as long as the stream, not just its headers.
    for s in [generate_client, generate_server] {
        assert!(
            s.end_time_unix_nano >= decode.end_time_unix_nano,
            "{} {} ends before decode: {} < {} (start {} vs {})",
            s.name,
            s.kind,
            s.end_time_unix_nano,
            decode.end_time_unix_nano,
            s.start_time_unix_nano,
            decode.start_time_unix_nano
        );
    }
    assert_eq!(attr(root, "request_id"), reply.json()["id"].as_str().map(str::to_string), "logs can name it");
    assert_eq!(attr(root, "trace_id").as_deref(), Some(client_trace));

    // A streamed answer records its usage and finish reason on its request span too.
    let streamed_trace = "1af7651916cd43dd8448eb211c80319d";
    let tp = format!("00-{streamed_trace}-{client_span}-01");
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "max_tokens": 3, "stream": true,
        "messages": [{"role": "user", "content": "Name a river."}]})
    .to_string();
    let reply = http(router.addr, "POST", "/v1/chat/completions", &body, &[("traceparent", &tp)]).await;
    assert!(reply.events().last().is_some_and(|e| e == "[DONE]"), "{}", reply.body);
    let is_root = |s: &Span| s.name == "POST /v1/chat/completions";
    let spans = spans_of(&guard, &received, streamed_trace, |spans| spans.iter().any(is_root)).await;
    let root = spans.into_iter().find(is_root);
    let root = root.expect("the streamed request's span");
    assert_eq!(attr(&root, "gen_ai.usage.output_tokens").as_deref(), Some("3"));
    assert_eq!(attr(&root, "gen_ai.response.finish_reasons").as_deref(), Some("length"));

    stop(router, workers).await;
    drop(guard);
}
