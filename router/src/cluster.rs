//! The router's picture of the cluster: members, the prefix index and the load tracker, kept current by one
//! follower task per worker (its `SubscribeKvEvents` and `WatchLoad` streams). The state sits behind one lock
//! with short critical sections; the pure parts (`PrefixIndex`, `LoadTracker`, the scheduler) do the work.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_cache::SeqHash;
use kv_transfer::tls::Identity;
use proto::worker as pb;
use proto::worker::worker_client::WorkerClient;
use tokio::sync::watch;
use tonic::transport::Channel;

use crate::external::predicted::Predicted;
use crate::external::{Engine, ExternalSettings};
use crate::indexer::{ApplyError, IndexStats, PrefixIndex};
use crate::load::{LoadTracker, Report};
use crate::resilience::{Breaker, BreakerSettings, StallChange, StallSettings, StallWatch, counts_against_worker};
use crate::scheduler::view::{WorkerId, WorkerRole, WorkerView};

/// How long a follower waits before reconnecting to a worker that went away.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(500);
/// Workers followed at most, so that registrations cannot grow the router without bound.
pub const DEFAULT_MAX_WORKERS: usize = 1024;

/// How the router follows workers (typed, with named defaults in [`defaults`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FollowSettings {
    /// Workers followed at most.
    pub max_workers: usize,
    /// A worker that registered itself and has not answered for this long is forgotten (a live one re-announces
    /// itself every 15 s, so it comes back on its own).
    pub forget_registered_after: Duration,
    /// A worker whose event or load stream says nothing for this long is down (its blocks leave the index) until
    /// it answers again: it reports load every 100 ms and sends an event heartbeat every second.
    pub silence: Duration,
    /// How long `Info` may take.
    pub info_timeout: Duration,
    /// `/ready` waits at most this long after start for every known worker's first snapshot.
    pub ready_timeout: Duration,
    /// When a failing worker is ejected, and for how long.
    pub breaker: BreakerSettings,
    /// When a worker holding work whose engine computes nothing counts as stalled.
    pub stall: StallSettings,
}

/// Named defaults of [`FollowSettings`].
pub mod defaults {
    use std::time::Duration;

    /// Four times the registration period: a worker that missed that many announcements is gone.
    pub const FORGET_REGISTERED_AFTER: Duration = Duration::from_secs(60);
    /// A hundred load periods and ten event heartbeats: only a hung or unreachable worker is that quiet.
    pub const SILENCE: Duration = Duration::from_secs(10);
    /// `Info` is answered from the worker's memory; a worker that takes longer is not well.
    pub const INFO_TIMEOUT: Duration = Duration::from_secs(5);
    /// A snapshot waits for the worker's current engine step: a long CPU prefill step, plus connecting.
    pub const READY_TIMEOUT: Duration = Duration::from_secs(60);
}

impl Default for FollowSettings {
    fn default() -> FollowSettings {
        FollowSettings {
            max_workers: DEFAULT_MAX_WORKERS,
            forget_registered_after: defaults::FORGET_REGISTERED_AFTER,
            silence: defaults::SILENCE,
            info_timeout: defaults::INFO_TIMEOUT,
            ready_timeout: defaults::READY_TIMEOUT,
            breaker: BreakerSettings::default(),
            stall: StallSettings::default(),
        }
    }
}

/// How the router learned of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The operator's list (fixed addresses, or what DNS names resolve to): followed until removed.
    Configured,
    /// It registered itself (`POST /admin/workers`): forgotten after a while without an answer.
    Registered,
}

/// The router already follows as many workers as it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the router follows at most {0} workers")]
pub struct TooManyWorkers(pub usize);
/// Load report period asked of workers (`routing.md`: reports every ~100 ms).
const LOAD_PERIOD_MS: u32 = 100;

/// What every worker must share with the router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    pub fingerprint: String,
    pub block_size: u32,
}

/// How the router talks to a worker.
#[derive(Clone, Debug)]
pub enum Transport {
    /// One of Tandem's own workers: gRPC, with KV events and load reports.
    Tandem(WorkerClient<Channel>),
    /// An engine server Tandem does not own ([`crate::external`]): whole requests over HTTP, its cache followed
    /// from its KV events or predicted.
    External(Arc<crate::external::Engine>),
}

/// A worker the router knows.
#[derive(Clone, Debug)]
pub struct Member {
    pub name: String,
    pub addr: SocketAddr,
    pub role: WorkerRole,
    pub capacity_blocks: u64,
    /// Tokens its engine computes per step (0: it did not say).
    pub max_num_batched_tokens: u64,
    /// Bytes of one of its KV blocks.
    pub block_bytes: u64,
    pub instance: String,
    pub transport: Transport,
    /// When it last joined (slow start counts from here).
    pub joined: Instant,
    /// Streams are flowing; only up members are routed to.
    pub up: bool,
    /// The worker protocol it speaks (this build's or an older one back to `OLDEST_PROTOCOL`).
    pub protocol: u32,
    /// Its first snapshot since the router started has been applied: the index knows what it holds.
    pub synced: bool,
}

/// What a request needs of the worker that serves it: a worker protocol version (a Tandem worker of an older one
/// would ignore what the request asks), and whether an external engine, which takes the sampling fields in its own
/// API, may serve it when its own version (3) is older: log-probabilities only where the router relays them
/// ([`crate::external::EngineKind::relays_logprobs`]), a regular expression or allowed tokens only where the engine
/// takes them ([`crate::external::EngineKind::takes_regex`], [`crate::external::EngineKind::takes_allowed_tokens`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    pub protocol: u32,
    pub external: bool,
    pub logprobs: bool,
    /// Log-probabilities asked at a temperature other than 0 and 1, where engines differ in the distribution they
    /// report ([`crate::external::EngineKind::relays_logprobs`]).
    pub tempered: bool,
    pub regex: bool,
    pub allowed: bool,
    /// A priority other than 0, which only a server started with priority scheduling takes.
    pub priority: bool,
}

impl Needs {
    /// Any worker will do.
    pub const ANY: Needs = Needs {
        protocol: 0,
        external: true,
        logprobs: false,
        tempered: false,
        regex: false,
        allowed: false,
        priority: false,
    };

    pub fn met_by(&self, m: &Member) -> bool {
        m.protocol >= self.protocol
            || match &m.transport {
                Transport::External(e) => self.met_by_external(e),
                Transport::Tandem(_) => false,
            }
    }

    /// Whether external engine `e` serves all the request asks.
    pub fn met_by_external(&self, e: &Engine) -> bool {
        self.external
            && (!self.logprobs || e.kind.relays_logprobs(self.tempered))
            && (!self.regex || e.kind.takes_regex())
            && (!self.allowed || e.kind.takes_allowed_tokens())
            && (!self.priority || e.priority.is_some())
    }
}

impl Member {
    /// What the index holds for it is a prediction (an external engine that publishes no KV events).
    pub fn predicted(&self) -> bool {
        matches!(&self.transport, Transport::External(e) if e.events.is_none())
    }
}

#[derive(Debug, Default)]
struct State {
    members: BTreeMap<WorkerId, Member>,
    index: PrefixIndex,
    load: LoadTracker,
    breakers: HashMap<WorkerId, Breaker>,
    /// When each worker's signals last arrived: (load report, KV event batch or heartbeat).
    heard: HashMap<WorkerId, (Option<Instant>, Option<Instant>)>,
    /// KV event batches of external workers left unapplied, by why ([`Refused`]).
    refused: HashMap<WorkerId, [u64; Refused::ALL.len()]>,
    /// What each external worker is predicted to hold.
    predicted: HashMap<WorkerId, Predicted>,
    /// Each Tandem worker's engine progress, from its load reports.
    stalls: HashMap<WorkerId, StallWatch>,
    /// Told `true` when a worker stalls, so that the calls waiting on it give up (`Cluster::stalls`).
    stall_signals: HashMap<WorkerId, watch::Sender<bool>>,
    /// Calls waiting on each worker now (each watching for its stall): work it holds, whatever its reports say.
    open_calls: HashMap<WorkerId, usize>,
}

impl State {
    /// Up, not ejected by its breaker, and not stalled.
    fn routable(&self, id: WorkerId, m: &Member, now: Instant) -> bool {
        m.up && self.breakers.get(&id).is_none_or(|b| b.admits(now))
            && !self.stalls.get(&id).is_some_and(|w| w.stalled())
    }

    fn stall_signal(&mut self, id: WorkerId) -> &watch::Sender<bool> {
        self.stall_signals.entry(id).or_insert_with(|| watch::channel(false).0)
    }
}

/// Why a KV event batch of an external worker was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// It could not be decoded.
    Unreadable,
    /// Another data-parallel rank published it: the rank's event ports are configured wrong.
    OtherRank,
}

impl Refused {
    pub const ALL: [Refused; 2] = [Refused::Unreadable, Refused::OtherRank];

    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Unreadable => "unreadable",
            Refused::OtherRank => "other_rank",
        }
    }
}

/// The cluster as the router sees it.
#[derive(Debug)]
pub struct Cluster {
    model: ModelIdentity,
    /// What new connections to workers present and trust (replaced when the certificates rotate).
    identity: std::sync::RwLock<Arc<Identity>>,
    state: Mutex<State>,
    /// One follower task per worker: its address and, for an external server's data-parallel rank, the rank (0
    /// otherwise).
    followers: Mutex<HashMap<(SocketAddr, u32), (WorkerId, tokio::task::AbortHandle)>>,
    next_id: AtomicU32,
    /// Stalls seen (`tandem_router_worker_stalls_total`).
    stalls_total: AtomicU64,
    started: Instant,
    settings: FollowSettings,
    stop: watch::Receiver<bool>,
}

/// Why a worker was refused.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error(transparent)]
    Connect(#[from] worker::grpc_tls::ConnectError),
    #[error("worker {0}: Info failed: {1}")]
    Info(SocketAddr, tonic::Status),
    #[error("worker {0}: no answer to Info within {1:?}")]
    InfoTimeout(SocketAddr, Duration),
    #[error("worker {addr} serves another model: {what}")]
    Mismatch { addr: SocketAddr, what: String },
    #[error("worker {addr} speaks worker protocol {theirs}; this router speaks {ours} and accepts {oldest} and later")]
    Protocol { addr: SocketAddr, theirs: u32, ours: u32, oldest: u32 },
}

/// The oldest worker protocol version this router works with, so that a rolling upgrade can replace workers and
/// routers in any order: version 4 (log-probabilities and grammars), three before its own. What came since (version
/// 5's streamed KV, version 6's `min_p`, version 7's prompt log-probabilities) is only asked of workers that speak
/// it, so an older worker is routed around for those requests and serves the rest.
pub const OLDEST_PROTOCOL: u32 = worker::LOGPROBS_PROTOCOL;

/// The protocol version a worker's `Info` names (absent: 1, which sent none), if this router works with it.
pub fn protocol_version(sent: u32) -> Result<u32, u32> {
    let v = sent.max(1);
    if (OLDEST_PROTOCOL..=worker::PROTOCOL_VERSION).contains(&v) { Ok(v) } else { Err(v) }
}

fn role(r: i32) -> WorkerRole {
    match pb::Role::try_from(r) {
        Ok(pb::Role::Prefill) => WorkerRole::Prefill,
        Ok(pb::Role::Decode) => WorkerRole::Decode,
        _ => WorkerRole::Both,
    }
}

impl Cluster {
    pub fn new(
        model: ModelIdentity,
        identity: Identity,
        settings: FollowSettings,
        stop: watch::Receiver<bool>,
    ) -> Arc<Cluster> {
        Arc::new(Cluster {
            model,
            identity: std::sync::RwLock::new(Arc::new(identity)),
            state: Mutex::default(),
            followers: Mutex::default(),
            next_id: AtomicU32::new(0),
            stalls_total: AtomicU64::new(0),
            started: Instant::now(),
            settings,
            stop,
        })
    }

    /// Presents `identity` (and trusts its CA) on the next connection to a worker; open ones keep theirs.
    pub fn set_identity(&self, identity: Identity) {
        *self.identity.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(identity);
    }

    pub fn model(&self) -> &ModelIdentity {
        &self.model
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the pure structures half-updated in a way that matters
        // more than stopping routing would; carry on with what is there.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts following the worker at `addr` (once, however often it is asked): joins it when it answers, and
    /// again whenever it comes back; a registered one that stays silent is forgotten.
    /// `tls_name` is the name its certificate must carry (the DNS name it was found under); `None`: its address.
    pub fn follow(
        self: &Arc<Cluster>,
        addr: SocketAddr,
        origin: Origin,
        tls_name: Option<String>,
    ) -> Result<WorkerId, TooManyWorkers> {
        let tls_name = tls_name.unwrap_or_else(|| addr.ip().to_string());
        self.start_follower(
            (addr, 0),
            |cluster, id| async move { cluster.run_follower(id, addr, origin, tls_name).await },
        )
    }

    /// Runs `follower` (given the cluster and the worker's new id) for `key` (address and rank), unless it is
    /// followed already or the limit is reached.
    fn start_follower<F: std::future::Future<Output = ()> + Send + 'static>(
        self: &Arc<Cluster>,
        key: (SocketAddr, u32),
        follower: impl FnOnce(Arc<Cluster>, WorkerId) -> F,
    ) -> Result<WorkerId, TooManyWorkers> {
        let mut followers = self.followers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((id, _)) = followers.get(&key) {
            return Ok(*id);
        }
        if followers.len() >= self.settings.max_workers {
            return Err(TooManyWorkers(self.settings.max_workers));
        }
        let id = WorkerId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let task = tokio::spawn(follower(Arc::clone(self), id));
        followers.insert(key, (id, task.abort_handle()));
        Ok(id)
    }

    /// Starts following an engine server Tandem does not own (once per address): up while it answers its health
    /// check ([`crate::external::follow`]).
    pub fn follow_external(
        self: &Arc<Cluster>,
        addr: SocketAddr,
        engine: Arc<Engine>,
        settings: ExternalSettings,
    ) -> Result<WorkerId, TooManyWorkers> {
        let stop = self.stop.clone();
        let key = (addr, engine.rank.map_or(0, |r| r.rank));
        self.start_follower(key, |cluster, id| crate::external::follow(cluster, id, addr, engine, settings, stop))
    }

    /// External worker `id` (at `addr`) answers: it is a member, up, with an empty predicted cache.
    /// `capacity_tokens`: its KV as it says (else the predicted cache's own limit).
    pub(crate) fn external_up(
        &self,
        id: WorkerId,
        addr: SocketAddr,
        engine: &Arc<Engine>,
        capacity_tokens: Option<u64>,
        settings: &ExternalSettings,
    ) {
        let block = u64::from(self.model.block_size.max(1));
        let capacity_blocks = capacity_tokens.map(|t| t / block).or(settings.predicted_blocks).unwrap_or_else(|| {
            let assumed = crate::external::defaults::ASSUMED_CAPACITY_TOKENS;
            tracing::warn!(worker = %engine.name, assumed, "the server does not say how much KV it holds; assuming tokens");
            assumed / block
        });
        let limit = settings.predicted_blocks.unwrap_or(capacity_blocks).max(1);
        let mut s = self.lock();
        s.members.insert(
            id,
            Member {
                name: engine.name.clone(),
                addr,
                role: WorkerRole::Both,
                capacity_blocks,
                max_num_batched_tokens: 0,
                block_bytes: 0,
                instance: engine.name.clone(),
                transport: Transport::External(Arc::clone(engine)),
                joined: Instant::now(),
                up: true,
                // Spoken over HTTP: the router maps the logits rules to the engine's own fields; what else it
                // relays is for `Needs::met_by` to say.
                protocol: worker::LOGITS_RULES_PROTOCOL,
                synced: true,
            },
        );
        s.index.replace(id, &kv_cache::events::Snapshot { as_of: None, tiers: Default::default() });
        if engine.events.is_none() {
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            s.predicted.insert(id, Predicted::new(limit, settings.predicted_ttl));
        }
    }

    /// What external worker `id`'s metrics say about its load ([`crate::external::metrics`]).
    pub(crate) fn engine_load(&self, id: WorkerId, load: crate::external::metrics::EngineLoad) {
        let mut s = self.lock();
        s.load.engine_load(id, load);
        s.heard.entry(id).or_default().0 = Some(Instant::now());
    }

    /// Events external worker `id` published, in the router's terms ([`crate::external::events`]); `false` (and
    /// nothing applied) while it is down: the index does not have it.
    pub(crate) fn apply_engine_events(&self, id: WorkerId, events: &[kv_cache::events::KvEvent]) -> bool {
        let mut s = self.lock();
        if !s.members.get(&id).is_some_and(|m| m.up) {
            return false;
        }
        s.heard.entry(id).or_default().1 = Some(Instant::now());
        apply_own(&mut s, id, events);
        true
    }

    /// A KV event batch of external worker `id` was left unapplied.
    pub(crate) fn refused_batch(&self, id: WorkerId, why: Refused) {
        self.lock().refused.entry(id).or_default()[why as usize] += 1;
    }

    /// The KV event batches of `worker` left unapplied, by why (in [`Refused::ALL`]'s order).
    pub fn refused_batches(&self, worker: WorkerId) -> [u64; Refused::ALL.len()] {
        self.lock().refused.get(&worker).copied().unwrap_or_default()
    }

    /// A prompt with these blocks was sent to external worker `id`: they are predicted there from now on.
    pub fn predict(&self, id: WorkerId, blocks: &[(SeqHash, kv_cache::LocalHash)], now: Instant) {
        let mut s = self.lock();
        let Some(p) = s.predicted.get_mut(&id) else { return };
        let events = p.sent(blocks, now);
        apply_own(&mut s, id, &events);
    }

    /// Forgets what external worker `id` has not been sent for the predicted cache's time to live.
    pub(crate) fn expire_predicted(&self, id: WorkerId, now: Instant) {
        let mut s = self.lock();
        let Some(event) = s.predicted.get_mut(&id).and_then(|p| p.expire(now)) else { return };
        apply_own(&mut s, id, &[event]);
    }

    /// Stops following the worker at `addr` and forgets it (it left the cluster).
    pub fn unfollow(&self, addr: SocketAddr) -> bool {
        let removed = self.followers.lock().unwrap_or_else(|p| p.into_inner()).remove(&(addr, 0));
        let Some((id, task)) = removed else { return false };
        task.abort();
        self.drop_member(id);
        tracing::info!(worker = %addr, "worker left");
        true
    }

    /// The follower of `addr` forgets it (from inside its own task, which then ends).
    fn forget(&self, addr: SocketAddr) {
        let removed = self.followers.lock().unwrap_or_else(|p| p.into_inner()).remove(&(addr, 0));
        if let Some((id, _)) = removed {
            self.drop_member(id);
        }
    }

    fn drop_member(&self, id: WorkerId) {
        let mut s = self.lock();
        s.members.remove(&id);
        s.breakers.remove(&id);
        s.stalls.remove(&id);
        s.stall_signals.remove(&id);
        s.index.remove_worker(id);
        s.load.forget(id);
        s.heard.remove(&id);
        s.predicted.remove(&id);
        s.refused.remove(&id);
    }

    /// Addresses being followed (once each, however many ranks a server has).
    pub fn followed(&self) -> Vec<SocketAddr> {
        let mut addrs: Vec<SocketAddr> =
            self.followers.lock().unwrap_or_else(|p| p.into_inner()).keys().map(|(a, _)| *a).collect();
        addrs.sort();
        addrs.dedup();
        addrs
    }

    async fn run_follower(self: Arc<Cluster>, id: WorkerId, addr: SocketAddr, origin: Origin, tls_name: String) {
        let mut stop = self.stop.clone();
        let mut silent_since = Instant::now();
        loop {
            if *stop.borrow() {
                return;
            }
            match self.join(id, addr, &tls_name).await {
                Ok(client) => {
                    tokio::select! {
                        _ = self.stream_events(id, client.clone()) => {}
                        _ = self.stream_load(id, client) => {}
                        _ = stop.wait_for(|&s| s) => return,
                    }
                    tracing::warn!(worker = %addr, "worker streams ended; dropping its blocks from the index");
                    self.leave(id);
                    // Losing a worker's streams counts against it like a failed request: one that keeps rejoining
                    // and going silent is ejected for a growing time instead of flapping in and out.
                    let _ = self.outcome(id, Err(tonic::Code::Unavailable));
                    silent_since = Instant::now();
                }
                Err(e) => {
                    tracing::debug!(worker = %addr, error = %e, "worker not joined");
                    if origin == Origin::Registered && silent_since.elapsed() >= self.settings.forget_registered_after {
                        tracing::warn!(worker = %addr, "registered worker never answered; forgetting it");
                        self.forget(addr);
                        return;
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(RECONNECT_BACKOFF) => {}
                _ = stop.wait_for(|&s| s) => return,
            }
        }
    }

    /// Connects, checks the model, and (re)registers the worker.
    async fn join(&self, id: WorkerId, addr: SocketAddr, tls_name: &str) -> Result<WorkerClient<Channel>, JoinError> {
        let identity = Arc::clone(&self.identity.read().unwrap_or_else(|p| p.into_inner()));
        let mut client = worker::grpc_tls::connect_named(addr, tls_name, &identity).await?;
        let timeout = self.settings.info_timeout;
        let info = tokio::time::timeout(timeout, client.info(pb::InfoRequest {}))
            .await
            .map_err(|_| JoinError::InfoTimeout(addr, timeout))?
            .map_err(|s| JoinError::Info(addr, s))?
            .into_inner();
        let protocol = protocol_version(info.protocol_version).map_err(|theirs| JoinError::Protocol {
            addr,
            theirs,
            ours: worker::PROTOCOL_VERSION,
            oldest: OLDEST_PROTOCOL,
        })?;
        let mismatch = |what: String| JoinError::Mismatch { addr, what };
        if info.model_fingerprint != self.model.fingerprint {
            return Err(mismatch(format!(
                "model fingerprint {} (the router's is {})",
                info.model_fingerprint, self.model.fingerprint
            )));
        }
        if info.block_size != self.model.block_size {
            return Err(mismatch(format!(
                "block size {} (the router's is {})",
                info.block_size, self.model.block_size
            )));
        }
        let capacity = info.tiers.iter().find(|t| t.tier == pb::Tier::Device as i32).map_or(0, |t| t.blocks);
        let block_bytes = info.layout.as_ref().map_or(0, |l| {
            let dtype: u64 = if l.dtype == pb::KvDtype::F32 as i32 { 4 } else { 2 };
            2 * u64::from(l.layers) * u64::from(l.kv_heads) * u64::from(l.head_dim) * u64::from(l.block_tokens) * dtype
        });
        let mut s = self.lock();
        let restarted = s.members.get(&id).is_some_and(|m| m.instance != info.instance_id);
        let synced = s.members.get(&id).is_some_and(|m| m.synced);
        if restarted {
            s.index.remove_worker(id);
            s.load.forget(id);
        }
        s.members.insert(
            id,
            Member {
                name: if info.name.is_empty() { addr.to_string() } else { info.name },
                addr,
                role: role(info.role),
                capacity_blocks: capacity,
                max_num_batched_tokens: u64::from(info.max_num_batched_tokens),
                block_bytes,
                instance: info.instance_id,
                transport: Transport::Tandem(client.clone()),
                joined: Instant::now(),
                up: false,
                protocol,
                synced,
            },
        );
        tracing::info!(worker = %addr, role = ?role(info.role), "worker joined");
        Ok(client)
    }

    /// Worker `id` went down: its blocks (reported or predicted) leave the index.
    pub(crate) fn leave(&self, id: WorkerId) {
        let mut s = self.lock();
        if let Some(m) = s.members.get_mut(&id) {
            m.up = false;
        }
        s.index.remove_worker(id);
        s.load.forget(id);
        s.heard.remove(&id);
        s.predicted.remove(&id);
    }

    /// Follows the worker's KV events until the stream ends or goes silent; resubscribes after a gap. The worker
    /// is up once a snapshot is applied (or, when resuming, once the worker answers).
    async fn stream_events(&self, id: WorkerId, mut client: WorkerClient<Channel>) {
        let silence = self.settings.silence;
        loop {
            let after = self.lock().index.last_event(id).map(|e| e.0);
            let subscribe = client.subscribe_kv_events(pb::SubscribeKvEventsRequest { after_event_id: after });
            let Ok(Ok(resp)) = tokio::time::timeout(silence, subscribe).await else { return };
            let mut stream = resp.into_inner();
            let mut gap = false;
            // A worker silent past the watchdog is treated as gone: its stream ends here.
            while let Ok(Ok(Some(batch))) = tokio::time::timeout(silence, stream.message()).await {
                match batch.body {
                    Some(pb::kv_event_batch::Body::Snapshot(snap)) => {
                        let Ok(snap) = worker::convert::snapshot_from_pb(&snap) else { return };
                        let mut s = self.lock();
                        s.heard.entry(id).or_default().1 = Some(Instant::now());
                        s.index.replace(id, &snap);
                        if let Some(m) = s.members.get_mut(&id) {
                            m.up = true;
                            m.synced = true;
                        }
                    }
                    Some(pb::kv_event_batch::Body::Events(events)) => {
                        let mut s = self.lock();
                        s.heard.entry(id).or_default().1 = Some(Instant::now());
                        // A heartbeat before the first snapshot says the worker lives, not what it holds.
                        if after.is_some()
                            && let Some(m) = s.members.get_mut(&id)
                        {
                            m.up = true;
                        }
                        for e in &events.events {
                            let Ok((eid, event)) = worker::convert::event_from_pb(e) else { return };
                            match s.index.apply(id, eid, &event) {
                                Ok(()) => {}
                                Err(ApplyError::Gap { .. }) => {
                                    gap = true;
                                    break;
                                }
                                Err(ApplyError::UnknownWorker) => return,
                            }
                        }
                    }
                    None => {}
                }
                if gap {
                    break;
                }
            }
            if !gap {
                return;
            }
        }
    }

    /// Follows the worker's load reports until the stream ends or goes silent.
    async fn stream_load(&self, id: WorkerId, mut client: WorkerClient<Channel>) {
        let silence = self.settings.silence;
        let watch = client.watch_load(pb::WatchLoadRequest { interval_ms: LOAD_PERIOD_MS });
        let Ok(Ok(resp)) = tokio::time::timeout(silence, watch).await else { return };
        let mut stream = resp.into_inner();
        while let Ok(Ok(Some(r))) = tokio::time::timeout(silence, stream.message()).await {
            let device = r.usage.iter().find(|u| u.tier == pb::Tier::Device as i32);
            let report = Report {
                running: u64::from(r.running),
                waiting: u64::from(r.waiting),
                active_prefill_tokens: r.active_prefill_tokens,
                device_used: device.map_or(0, |u| u.used),
                device_total: device.map_or(0, |u| u.total),
                blocks_to_come: r.blocks_to_come,
                covered: r.request_ids.into_iter().collect(),
                computed_tokens_total: r.computed_tokens_total,
                compute_nanos_total: r.compute_nanos_total,
                transfer_bytes_total: r.transfer_bytes_total,
                transfer_nanos_total: r.transfer_nanos_total,
                step_overrun_steps: r.step_overrun_steps,
            };
            let now = Instant::now();
            let (total, engine_work) = (report.computed_tokens_total, report.running + report.waiting > 0);
            let mut s = self.lock();
            s.load.report(id, report);
            s.heard.entry(id).or_default().0 = Some(now);
            // Requests only reserved there (a decode waiting for its prompt's prefill elsewhere) are not its work.
            let holds_work = engine_work || s.open_calls.get(&id).is_some_and(|&n| n > 0);
            let change = s.stalls.entry(id).or_default().report(now, total, holds_work, &self.settings.stall);
            if change == StallChange::None {
                continue;
            }
            let name = s.members.get(&id).map_or_else(String::new, |m| m.name.clone());
            let stalled = change == StallChange::Stalled;
            if stalled {
                tracing::warn!(worker = %name, after = ?self.settings.stall.after,
                    "worker stalled: it holds work and its engine computed nothing; its calls move elsewhere");
                self.stalls_total.fetch_add(1, Ordering::Relaxed);
            } else {
                tracing::info!(worker = %name, "stalled worker computes again");
            }
            s.stall_signal(id).send_replace(stalled);
        }
    }

    /// Resolves once `worker` is found stalled (at once if it is now): what a call waiting on it gives up on.
    /// While polled and not dropped it counts as a call open on the worker (work it holds). Pending forever for a
    /// worker the router no longer follows.
    pub async fn stalls(&self, worker: WorkerId) {
        let mut rx = {
            let mut s = self.lock();
            *s.open_calls.entry(worker).or_default() += 1;
            s.stall_signal(worker).subscribe()
        };
        let _open = OpenCall { cluster: self, worker };
        if rx.wait_for(|stalled| *stalled).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Workers stalled now, and stalls seen since the router started.
    pub fn stalled(&self) -> (usize, u64) {
        let now = self.lock().stalls.values().filter(|w| w.stalled()).count();
        (now, self.stalls_total.load(Ordering::Relaxed))
    }

    /// Every routable worker that meets `needs` as a scheduling candidate for a request with chained hashes
    /// `hashes`.
    pub fn view(&self, hashes: &[SeqHash], needs: Needs, slow_start: Duration, now: Instant) -> Vec<WorkerView> {
        let s = self.lock();
        let overlap = s.index.overlap(hashes);
        s.members
            .iter()
            .filter(|(id, m)| s.routable(**id, m, now) && needs.met_by(m))
            .map(|(&id, m)| {
                let age = now.saturating_duration_since(m.joined);
                let ramp = if slow_start.is_zero() {
                    1.0
                } else {
                    (age.as_secs_f64() / slow_start.as_secs_f64()).clamp(0.05, 1.0)
                };
                WorkerView {
                    id,
                    name: m.name.clone(),
                    role: m.role,
                    overlap: overlap.get(&id).copied().unwrap_or_default(),
                    active_overlap: s.load.active_overlap(id, hashes),
                    load: s.load.load(id, m.capacity_blocks),
                    ramp,
                    max_num_batched_tokens: m.max_num_batched_tokens,
                    block_bytes: m.block_bytes,
                    speed: s.load.speed(id),
                    predicted: m.predicted(),
                }
            })
            .collect()
    }

    /// Whether the router knows what every worker it follows holds: each has had a snapshot applied, or the ready
    /// timeout has passed since start. Returns that, with the addresses still awaited.
    pub fn synced(&self, now: Instant) -> (bool, Vec<SocketAddr>) {
        let followed: Vec<(SocketAddr, WorkerId)> = self
            .followers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|((a, _), (id, _))| (*a, *id))
            .collect();
        let s = self.lock();
        let mut waiting: Vec<SocketAddr> = followed
            .into_iter()
            .filter(|(_, id)| !s.members.get(id).is_some_and(|m| m.synced))
            .map(|(a, _)| a)
            .collect();
        waiting.sort();
        waiting.dedup();
        let timed_out = now.saturating_duration_since(self.started) >= self.settings.ready_timeout;
        (waiting.is_empty() || timed_out, waiting)
    }

    pub fn member(&self, id: WorkerId) -> Option<Member> {
        self.lock().members.get(&id).cloned()
    }

    /// Seconds since `worker`'s last load report and since its last KV event batch (events or a heartbeat):
    /// how stale the router's view of it may be. `None` until the first arrives.
    pub fn signal_ages(&self, worker: WorkerId, now: Instant) -> (Option<f64>, Option<f64>) {
        let age = |t: Option<Instant>| t.map(|t| now.saturating_duration_since(t).as_secs_f64());
        let (load, events) = self.lock().heard.get(&worker).copied().unwrap_or_default();
        (age(load), age(events))
    }

    /// Members that are up.
    pub fn up_members(&self) -> Vec<(WorkerId, Member)> {
        self.lock().members.iter().filter(|(_, m)| m.up).map(|(id, m)| (*id, m.clone())).collect()
    }

    /// Members that are up and not ejected: the ones requests may go to.
    pub fn routable_members(&self, now: Instant) -> Vec<(WorkerId, Member)> {
        let s = self.lock();
        s.members.iter().filter(|(id, m)| s.routable(**id, m, now)).map(|(id, m)| (*id, m.clone())).collect()
    }

    /// Whether `worker` is a member that is up, not ejected by its breaker and not stalled: one requests may go to.
    pub fn is_routable(&self, worker: WorkerId, now: Instant) -> bool {
        let s = self.lock();
        s.members.get(&worker).is_some_and(|m| s.routable(worker, m, now))
    }

    /// How a request to `worker` went (`Err` with the gRPC code when it failed); a worker failing again and again
    /// is ejected for a while. Returns the ejection when this outcome caused one.
    pub fn outcome(&self, worker: WorkerId, result: Result<(), tonic::Code>) -> Option<Duration> {
        let mut s = self.lock();
        let breaker = s.breakers.entry(worker).or_default();
        match result {
            Ok(()) => {
                breaker.success();
                None
            }
            Err(code) if counts_against_worker(code) => breaker.failure(Instant::now(), &self.settings.breaker),
            Err(_) => None,
        }
    }

    /// Workers ejected by their breaker now.
    pub fn ejected(&self, now: Instant) -> usize {
        self.lock().breakers.values().filter(|b| !b.admits(now)).count()
    }

    /// How many blocks the index holds for `worker` per tier (device, host, disk); `None` when it is not indexed.
    pub fn indexed_blocks(&self, worker: WorkerId) -> Option<[u64; 3]> {
        self.lock().index.held(worker)
    }

    pub fn index_stats(&self) -> (usize, IndexStats) {
        let s = self.lock();
        (s.index.len(), s.index.stats())
    }

    /// Own-sent accounting (see [`LoadTracker`]): request number `request` (id `request_id`) went to `worker`
    /// with `prefill_tokens` uncached tokens to compute and these blocks.
    pub fn sent(
        &self,
        worker: WorkerId,
        request: u64,
        request_id: &str,
        prefill_tokens: u64,
        blocks: u64,
        hashes: &[SeqHash],
    ) {
        self.lock().load.sent(worker, request, request_id, prefill_tokens, blocks, hashes);
    }

    /// [`sent`](Self::sent), as a [`Reservation`] that ends the count when dropped.
    pub fn reserve(
        self: &Arc<Cluster>,
        worker: WorkerId,
        request: u64,
        request_id: &str,
        prefill_tokens: u64,
        blocks: u64,
        hashes: &[SeqHash],
    ) -> Reservation {
        self.sent(worker, request, request_id, prefill_tokens, blocks, hashes);
        Reservation { cluster: Arc::clone(self), worker, request }
    }

    /// Mock workers' steps by overrun bucket, summed over the workers followed now (empty without mock workers).
    pub fn step_overrun_steps(&self) -> Vec<u64> {
        self.lock().load.step_overrun_steps()
    }

    /// Requests the router has sent `worker` that have not finished.
    pub fn in_flight(&self, worker: WorkerId) -> u64 {
        self.lock().load.own_requests(worker)
    }

    pub fn first_token(&self, worker: WorkerId, request: u64) {
        self.lock().load.first_token(worker, request);
    }

    pub fn done(&self, worker: WorkerId, request: u64) {
        self.lock().load.done(worker, request);
    }
}

/// Applies events the router made itself (a predicted cache's, or an external engine's translated) to `id`'s
/// entry in the index, numbered on from its last.
fn apply_own(s: &mut State, id: WorkerId, events: &[kv_cache::events::KvEvent]) {
    for event in events {
        let next = kv_cache::events::EventId(s.index.last_event(id).map_or(0, |e| e.0 + 1));
        if let Err(e) = s.index.apply(id, next, event) {
            tracing::warn!(worker = ?id, error = %e, "external worker's blocks not indexed");
        }
    }
}

/// The router's count of a routed request's prompt on the worker that will compute it, taken in the same critical
/// section as the decision, so requests routed at the same moment see each other's work instead of all choosing
/// the same idle worker. The serving path counts the request again (the same entry) when it sends it; dropping the
/// reservation ends the count however the request ends, also when it never started.
#[derive(Debug)]
pub struct Reservation {
    cluster: Arc<Cluster>,
    worker: WorkerId,
    request: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.cluster.done(self.worker, self.request);
    }
}

/// A call open on a worker, counted until dropped (`Cluster::stalls`).
struct OpenCall<'a> {
    cluster: &'a Cluster,
    worker: WorkerId,
}

impl Drop for OpenCall<'_> {
    fn drop(&mut self) {
        let mut s = self.cluster.lock();
        if let Some(n) = s.open_calls.get_mut(&self.worker) {
            *n = n.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use proto::worker as pb;
    use proto::worker::worker_client::WorkerClient;
    use tonic::transport::Channel;

    use super::{Member, Transport, protocol_version};
    use crate::external::{Engine, EngineKind, PriorityOrder};
    use crate::scheduler::view::WorkerRole;
    use crate::serve::needs;

    fn member(transport: Transport, protocol: u32) -> Member {
        Member {
            name: "w".into(),
            addr: ([127, 0, 0, 1], 1).into(),
            role: WorkerRole::Both,
            capacity_blocks: 1,
            max_num_batched_tokens: 0,
            block_bytes: 0,
            instance: "i".into(),
            transport,
            joined: Instant::now(),
            up: true,
            protocol,
            synced: true,
        }
    }

    #[tokio::test]
    async fn a_request_goes_to_workers_that_apply_all_it_asks_and_to_external_engines_that_relay_it() {
        let tandem = |protocol| {
            let channel = Channel::from_static("http://127.0.0.1:1").connect_lazy();
            member(Transport::Tandem(WorkerClient::new(channel)), protocol)
        };
        let external = |kind| {
            let engine = Engine::new("http://127.0.0.1:1", kind).expect("an address");
            member(Transport::External(Arc::new(engine)), worker::LOGITS_RULES_PROTOCOL)
        };
        let [llama, vllm, sglang] = [EngineKind::LlamaServer, EngineKind::Vllm, EngineKind::Sglang].map(external);

        let plain = needs(&pb::Sampling::default());
        assert!([&tandem(worker::LOGITS_RULES_PROTOCOL), &llama, &vllm, &sglang].iter().all(|m| plain.met_by(m)));

        let logprobs = needs(&pb::Sampling { logprobs: Some(2), ..Default::default() });
        assert!(logprobs.met_by(&tandem(worker::LOGPROBS_PROTOCOL)));
        assert!(!logprobs.met_by(&tandem(worker::LOGPROBS_PROTOCOL - 1)), "an older worker would drop them");
        assert!(logprobs.met_by(&llama) && logprobs.met_by(&vllm), "relayed from llama-server and vLLM");
        assert!(logprobs.met_by(&sglang), "and from SGLang, greedy: the raw logits' distribution");
        for (temperature, by_sglang) in [(1.0, true), (0.7, false), (1.3, false)] {
            let at = needs(&pb::Sampling { logprobs: Some(2), temperature, ..Default::default() });
            assert!(at.met_by(&llama) && at.met_by(&vllm), "{temperature}");
            assert_eq!(at.met_by(&sglang), by_sglang, "SGLang's are the tempered distribution's at {temperature}");
        }

        let grammar = |kind: &str, data: &str, prior_generated| {
            let grammar = Some(pb::Grammar { kind: kind.into(), data: data.into(), ..Default::default() });
            needs(&pb::Sampling { grammar, prior_generated, ..Default::default() })
        };
        let schema = grammar("json_schema", r#"{"type": "integer"}"#, 0);
        assert!(schema.met_by(&tandem(worker::LOGPROBS_PROTOCOL)));
        assert!(!schema.met_by(&tandem(worker::LOGPROBS_PROTOCOL - 1)));
        assert!([&llama, &vllm, &sglang].iter().all(|m| schema.met_by(m)), "schemas are the engines' own");
        assert!([&llama, &vllm, &sglang].iter().all(|m| grammar("json_object", "", 0).met_by(m)));
        let regex = grammar("regex", "a+", 0);
        assert!(regex.met_by(&tandem(worker::LOGPROBS_PROTOCOL)));
        assert!(regex.met_by(&vllm) && regex.met_by(&sglang) && !regex.met_by(&llama), "llama-server takes none");
        for (what, n) in
            [("going on after a first token", grammar("json_schema", "{}", 1)), ("unknown", grammar("x", "", 0))]
        {
            assert!(n.met_by(&tandem(worker::LOGPROBS_PROTOCOL)), "{what}");
            assert!(![&llama, &vllm, &sglang].iter().any(|m| n.met_by(m)), "{what}");
        }
        // A grammar after the thinking: an older worker would hold it from the first token; an external engine holds
        // it where its own reasoning parser says.
        let thinking =
            pb::Grammar { kind: "json_object".into(), thinking: pb::Thinking::Open as i32, ..Default::default() };
        let thinking = needs(&pb::Sampling { grammar: Some(thinking), ..Default::default() });
        assert!(thinking.met_by(&tandem(worker::THINKING_PROTOCOL)));
        assert!(!thinking.met_by(&tandem(worker::THINKING_PROTOCOL - 1)), "an older worker would not let it think");
        assert!([&llama, &vllm, &sglang].iter().all(|m| thinking.met_by(m)), "relayed as the engines' own");
        // Gemma 4's channel: an older worker would refuse the value.
        let channel =
            pb::Grammar { kind: "json_object".into(), thinking: pb::Thinking::Channel as i32, ..Default::default() };
        let channel = needs(&pb::Sampling { grammar: Some(channel), ..Default::default() });
        assert!(channel.met_by(&tandem(worker::CHANNEL_PROTOCOL)));
        assert!(!channel.met_by(&tandem(worker::CHANNEL_PROTOCOL - 1)), "an older worker would refuse it");

        let min_p = needs(&pb::Sampling { min_p: 0.1, ..Default::default() });
        assert!(min_p.met_by(&tandem(worker::MIN_P_PROTOCOL)));
        assert!(!min_p.met_by(&tandem(worker::MIN_P_PROTOCOL - 1)));
        assert!([&llama, &vllm, &sglang].iter().all(|m| min_p.met_by(m)), "external engines take min_p natively");

        let scored = needs(&pb::Sampling { prompt_logprobs: Some(0), ..Default::default() });
        assert!(scored.met_by(&tandem(worker::PROMPT_LOGPROBS_PROTOCOL)));
        assert!(!scored.met_by(&tandem(worker::PROMPT_LOGPROBS_PROTOCOL - 1)), "an older worker would drop them");
        let allowed = needs(&pb::Sampling { allowed_token_ids: vec![1, 2], ..Default::default() });
        assert!(allowed.met_by(&tandem(worker::TOKEN_RULES_PROTOCOL)));
        assert!(!allowed.met_by(&tandem(worker::TOKEN_RULES_PROTOCOL - 1)), "an older worker would ignore them");
        assert!(allowed.met_by(&vllm) && !allowed.met_by(&llama) && !allowed.met_by(&sglang), "vLLM takes them");
        for (ruled, protocol) in [
            (
                pb::Sampling { bad_words: vec![pb::TokenSequence { ids: vec![3] }], ..Default::default() },
                worker::TOKEN_RULES_PROTOCOL,
            ),
            (pb::Sampling { priority: -2, ..Default::default() }, worker::PRIORITY_PROTOCOL),
            (
                pb::Sampling {
                    grammar: Some(pb::Grammar {
                        kind: "lark".into(),
                        data: "start: \"a\"".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                worker::LARK_PROTOCOL,
            ),
            (pb::Sampling { priority: 4, allowed_token_ids: vec![1], ..Default::default() }, worker::PRIORITY_PROTOCOL),
            (
                pb::Sampling {
                    allowed_token_ids: vec![1],
                    bad_words: vec![pb::TokenSequence { ids: vec![3] }],
                    ..Default::default()
                },
                worker::TOKEN_RULES_PROTOCOL,
            ),
        ] {
            let n = needs(&ruled);
            assert!(n.met_by(&tandem(protocol)), "{ruled:?}");
            assert!(![&llama, &vllm, &sglang].iter().any(|m| n.met_by(m)), "not relayed: {ruled:?}");
            assert!(!n.met_by(&tandem(protocol - 1)), "an older worker would ignore it: {ruled:?}");
        }
        assert!(![&llama, &vllm, &sglang].iter().any(|m| scored.met_by(m)), "the prompt's are not relayed");
        // A GBNF grammar: an older worker would refuse its kind; every external engine takes GBNF as its own.
        let gbnf = grammar("gbnf", "root ::= \"a\"", 0);
        assert!(gbnf.met_by(&tandem(worker::GBNF_PROTOCOL)) && !gbnf.met_by(&tandem(worker::GBNF_PROTOCOL - 1)));
        assert!([&llama, &vllm, &sglang].iter().all(|m| gbnf.met_by(m)), "relayed as the engines' own");
        // A priority goes to a server started with priority scheduling (above, none was).
        let scheduling = |kind, order| {
            let engine = Engine::new("http://127.0.0.1:1", kind).expect("an address").with_priority(Some(order));
            member(Transport::External(Arc::new(engine)), worker::LOGITS_RULES_PROTOCOL)
        };
        let prioritised = needs(&pb::Sampling { priority: 3, ..Default::default() });
        assert!(prioritised.met_by(&scheduling(EngineKind::Vllm, PriorityOrder::LowerFirst)));
        assert!(prioritised.met_by(&scheduling(EngineKind::Sglang, PriorityOrder::HigherFirst)));
        let with_allowed = needs(&pb::Sampling { priority: 3, allowed_token_ids: vec![1], ..Default::default() });
        assert!(!with_allowed.met_by(&scheduling(EngineKind::Sglang, PriorityOrder::HigherFirst)), "no allowed ids");
    }

    #[test]
    fn a_router_works_with_its_own_protocol_and_the_ones_back_to_the_oldest() {
        let ours = worker::PROTOCOL_VERSION;
        assert_eq!(protocol_version(ours), Ok(ours));
        assert_eq!(protocol_version(ours - 1), Ok(ours - 1), "a worker one version older (rolling upgrade)");
        assert_eq!(protocol_version(ours - 2), Ok(ours - 2), "two versions older");
        assert_eq!(protocol_version(super::OLDEST_PROTOCOL), Ok(super::OLDEST_PROTOCOL));
        assert_eq!(
            protocol_version(super::OLDEST_PROTOCOL - 1),
            Err(super::OLDEST_PROTOCOL - 1),
            "before the oldest is too old"
        );
        assert_eq!(protocol_version(0), Err(1), "version 1 workers sent no version");
        assert_eq!(protocol_version(ours + 1), Err(ours + 1), "a newer worker needs a newer router");
    }
}
