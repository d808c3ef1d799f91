//! The generated code works end to end: a tonic server on 127.0.0.1:0 answers a generated client, server
//! streams included; arbitrary bytes never panic the message decoders.

use std::pin::Pin;

use proptest::prelude::*;
use prost::Message;
use proto::worker::worker_client::WorkerClient;
use proto::worker::worker_server::{Worker, WorkerServer};
use proto::worker::*;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

struct Fake;

#[tonic::async_trait]
impl Worker for Fake {
    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoResponse>, Status> {
        Ok(Response::new(InfoResponse {
            role: Role::Decode as i32,
            model_id: "smollm2-135m-instruct".into(),
            block_size: 16,
            instance_id: "i-1".into(),
            ..InfoResponse::default()
        }))
    }

    async fn prefill(&self, _: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        Err(Status::unimplemented("decode role"))
    }

    type GenerateStream = Streamed<GenerateResponse>;
    async fn generate(&self, _: Request<GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn prefetch(&self, _: Request<PrefetchRequest>) -> Result<Response<PrefetchResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn cancel(&self, _: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        Ok(Response::new(CancelResponse { found: false }))
    }

    type SubscribeKvEventsStream = Streamed<KvEventBatch>;
    async fn subscribe_kv_events(
        &self,
        req: Request<SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let after = req.into_inner().after_event_id;
        let snapshot = KvEventBatch {
            instance_id: "i-1".into(),
            body: Some(kv_event_batch::Body::Snapshot(Snapshot { as_of: after, tiers: vec![] })),
        };
        let stored = KvEvent {
            id: after.map_or(0, |a| a + 1),
            kind: Some(kv_event::Kind::Stored(Stored {
                tier: Tier::Device as i32,
                parent: None,
                blocks: vec![StoredBlock { seq_hash: 7, local_hash: 7 }],
            })),
        };
        let events = KvEventBatch {
            instance_id: "i-1".into(),
            body: Some(kv_event_batch::Body::Events(KvEvents { events: vec![stored] })),
        };
        Ok(Response::new(Box::pin(tokio_stream::iter([Ok(snapshot), Ok(events)]))))
    }

    type WatchLoadStream = Streamed<LoadReport>;
    async fn watch_load(&self, _: Request<WatchLoadRequest>) -> Result<Response<Self::WatchLoadStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse { serving: true }))
    }
}

#[tokio::test]
async fn a_generated_client_talks_to_a_generated_server() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let server = tokio::spawn(
        tonic::transport::Server::builder().add_service(WorkerServer::new(Fake)).serve_with_incoming(incoming),
    );
    let mut client = WorkerClient::connect(format!("http://{addr}")).await.expect("connects");
    let info = client.info(InfoRequest {}).await.expect("info").into_inner();
    assert_eq!((info.role(), info.block_size, info.model_id.as_str()), (Role::Decode, 16, "smollm2-135m-instruct"));
    let status = client.prefill(PrefillRequest::default()).await.expect_err("unimplemented");
    assert_eq!(status.code(), tonic::Code::Unimplemented);
    let mut stream = client
        .subscribe_kv_events(SubscribeKvEventsRequest { after_event_id: Some(41) })
        .await
        .expect("stream")
        .into_inner();
    let first = stream.message().await.expect("ok").expect("a snapshot");
    assert!(matches!(first.body, Some(kv_event_batch::Body::Snapshot(Snapshot { as_of: Some(41), .. }))));
    let second = stream.message().await.expect("ok").expect("events");
    let Some(kv_event_batch::Body::Events(KvEvents { events })) = second.body else { panic!("events expected") };
    assert_eq!(events[0].id, 42);
    assert!(stream.message().await.expect("ok").is_none(), "the stream ends");
    server.abort();
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = KvEventBatch::decode(bytes.as_slice());
        let _ = GenerateRequest::decode(bytes.as_slice());
        let _ = PrefillResponse::decode(bytes.as_slice());
        let _ = LoadReport::decode(bytes.as_slice());
    }
}
