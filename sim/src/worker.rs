//! One simulated worker: the real engine (scheduler, block pool, export and import) over a mock backend in
//! virtual time, plus what the worker process around it does that routing sees: KV events and load reports.

use engine::generate::{EngineConfig, EngineStats, LoadMark, Output, Stepper};
use kv_cache::events::{EventId, KvEvent};
use router::load::Report;
use router::scheduler::view::{WorkerId, WorkerRole};

/// A worker reports its load at least this often (the router's `WatchLoad` period), and at once when it moves a
/// lot (`LoadMark::moved_since`, the rule a worker applies).
pub const REPORT_PERIOD: f64 = 0.100;

pub struct SimWorker {
    pub id: WorkerId,
    pub name: String,
    pub role: WorkerRole,
    pub engine: Stepper,
    /// Whether a step is under way (its end is scheduled).
    pub stepping: bool,
    /// It failed: it computes and reports nothing more (`crate::run`'s failover)…
    pub down: bool,
    /// …until it comes back, which waits for the step it failed in to end.
    pub back: bool,
    /// It hangs: it computes and sends nothing, and the calls it gets wait unanswered, but the routers learn of it
    /// only when their watchdogs and connections time out (then it is also `down`)…
    pub hung: bool,
    /// …and how many times it has hung (a timeout from an earlier hang is stale).
    pub hangs: u64,
    /// It answers every call at once with an error, while its streams go on (`crate::run::Fault::Errors`).
    pub erring: bool,
    /// Its engine is stuck: no step ends while set, though its process answers and reports
    /// (`crate::run::Fault::Stall`)…
    pub stuck: bool,
    /// …and a step's end waits for it to be unstuck.
    pub held: bool,
    /// Times it got stuck: a stall check from an earlier time is stale.
    pub stuck_epoch: u64,
    /// When the step under way began (its engine's last progress).
    pub step_started: f64,
    /// When it joined the cluster (before the run, unless it came back).
    pub joined: f64,
    /// Its engine's configuration, for a fresh engine when it comes back.
    pub config: EngineConfig,
    /// What the step under way produced, delivered at its end.
    pub pending: Vec<Output>,
    /// Requests sent while a step ran: the engine takes them when it ends (`crate::run`).
    pub(crate) sent: Vec<crate::run::Job>,
    /// Calls that reached it while it hung: it reads them when it goes on, if their connection is still open.
    pub(crate) frozen: Vec<crate::run::Job>,
    /// A lease ended while a step ran: the engine takes its blocks back when it ends.
    pub(crate) reclaim: bool,
    /// Requests the router gave up on while a step ran: the engine drops them when it ends.
    pub(crate) cancels: Vec<u64>,
    /// Per router replica (each follows its own load stream): the load the last report carried and when it was
    /// sent.
    reported: Vec<Option<(LoadMark, f64)>>,
    /// When the worker's network link is next free (transfers queue on it).
    pub link_free: f64,
    /// Modelled KV bytes pulled and the seconds it took (what a mock worker reports).
    pub pulled_bytes: u64,
    pub pulled_nanos: u64,
    /// Blocks of prompt KV it may hold for decode workers at once, reserved or leased (`worker::leases`: half its
    /// device tier)…
    pub lease_room: u64,
    /// …and the blocks reserved for prefills under way or leased until their decode worker's engine takes them.
    pub leased: u64,
}

impl SimWorker {
    pub fn new(
        id: WorkerId,
        name: String,
        role: WorkerRole,
        engine: Stepper,
        routers: usize,
        config: EngineConfig,
    ) -> SimWorker {
        // In blocks: the bytes of a block of one byte.
        let lease_room = worker::leases::pool_cap(config.kv_blocks, 1);
        SimWorker {
            id,
            name,
            role,
            engine,
            stepping: false,
            down: false,
            back: false,
            hung: false,
            hangs: 0,
            erring: false,
            stuck: false,
            held: false,
            stuck_epoch: 0,
            step_started: 0.0,
            joined: f64::NEG_INFINITY,
            config,
            pending: Vec::new(),
            sent: Vec::new(),
            frozen: Vec::new(),
            reclaim: false,
            cancels: Vec::new(),
            reported: vec![None; routers],
            link_free: 0.0,
            pulled_bytes: 0,
            pulled_nanos: 0,
            lease_room,
            leased: 0,
        }
    }

    /// The routers joined it again (after their watchdog had dropped it): a report goes out on every stream at
    /// its next state change.
    pub fn rejoined(&mut self) {
        self.reported.iter_mut().for_each(|r| *r = None);
    }

    /// KV events not yet sent to the router.
    pub fn new_events(&mut self) -> Vec<(EventId, KvEvent)> {
        // Err cannot happen: the simulator's workers keep every event until it is taken (`replay_events`
        // unbounded).
        self.engine.take_kv_events().unwrap_or_default()
    }

    /// The load reports due at `now`, by router replica (the period passed on that stream, or the load changed a
    /// lot since the report that stream last carried). Whether any is due is told from the few figures that
    /// decide it; the engine's whole state is read only for a report that goes out (this runs after every step).
    pub fn reports_due(&mut self, now: f64) -> Vec<(usize, Report)> {
        let load = self.engine.load_mark();
        let is_due = |r: &Option<(LoadMark, f64)>| {
            r.as_ref().is_none_or(|(prev, at)| now - at >= REPORT_PERIOD || load.moved_since(prev))
        };
        if !self.reported.iter().any(is_due) {
            return Vec::new();
        }
        let report = self.report(&self.engine.stats());
        let mut streams = Vec::new();
        for (r, reported) in self.reported.iter_mut().enumerate() {
            if is_due(reported) {
                *reported = Some((load, now));
                streams.push(r);
            }
        }
        // Copies to every stream but the last, which takes the report itself.
        let Some((&last, others)) = streams.split_last() else { return Vec::new() };
        let mut due: Vec<(usize, Report)> = others.iter().map(|&r| (r, report.clone())).collect();
        due.push((last, report));
        due
    }

    fn report(&self, stats: &EngineStats) -> Report {
        let device = stats.usage[0];
        Report {
            running: stats.running as u64,
            waiting: stats.waiting as u64,
            active_prefill_tokens: stats.prefill_tokens_pending as u64,
            // As a worker reports it: blocks held only for a lease are not load.
            device_used: stats.sequence_blocks() as u64,
            device_total: (device.used + device.cached + device.free) as u64,
            blocks_to_come: stats.blocks_to_come as u64,
            covered: self.engine.ids().map(|id| id.to_string()).collect(),
            computed_tokens_total: stats.counters.prefill_tokens,
            compute_nanos_total: stats.counters.compute_nanos,
            transfer_bytes_total: self.pulled_bytes,
            transfer_nanos_total: self.pulled_nanos,
            step_overrun_steps: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::sync::Arc;

    use engine::backend::mock::MockSettings;
    use engine::generate::{BackendChoice, Engine, Request};
    use kv_cache::events::Tier;

    use super::*;

    /// A lease ending frees device blocks no sequence used. A worker does not count them as load, so no report is
    /// due before its period; the simulated worker applies the same rule (it used to count them, and reported at
    /// once).
    #[test]
    fn a_lease_ending_alone_sends_no_early_report() {
        let model = engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("the embedded model");
        let text = Arc::new(engine::text::TextModel::open(&model).expect("the model opens"));
        let words: Arc<[u32]> = text.tokenizer().plain_words().as_slice().into();
        let mock = MockSettings { virtual_time: true, context_len: 1024, ..MockSettings::gpu_default() };
        let config =
            EngineConfig { backend: BackendChoice::Mock(Box::new(mock)), kv_blocks: 64, ..EngineConfig::default() };
        let engine = Engine::open_mock(text, words, config.clone()).expect("the engine opens");
        let mut w =
            SimWorker::new(WorkerId(0), "prefill-0".into(), WorkerRole::Prefill, Stepper::new(engine), 1, config);
        // A 256-token prompt (16 blocks, a quarter of the device tier) prefilled for a decode worker.
        let prompt: Vec<u32> = (0..256).map(|i| 1000 + i).collect();
        let none: &[(usize, &[u8])] = &[];
        let one = NonZeroU32::new(1).expect("one");
        w.engine.submit(1, Request::greedy(prompt, one), true, &none).expect("queued");
        let mut exported = None;
        while w.engine.busy() {
            for out in w.engine.step().outputs {
                if let Output::Finished { exported: e, .. } = out {
                    exported = e;
                }
            }
        }
        let lease = exported.expect("the prompt's KV");
        assert!(w.engine.engine().kv_usage(Tier::Device).used >= 16, "the lease holds the prompt's blocks");
        assert_eq!(w.engine.load_mark().used, 0, "no sequence holds them");
        assert_eq!(w.reports_due(0.0).len(), 1, "the first report");
        drop(lease);
        w.engine.reclaim_pinned();
        assert_eq!(w.engine.load_mark(), w.engine.stats().mark());
        assert!(w.reports_due(0.010).is_empty(), "nothing a router counts moved: the report waits for its period");
        assert_eq!(w.reports_due(REPORT_PERIOD).len(), 1);
    }
}
