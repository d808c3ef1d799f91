//! Protobuf at the edge: conversions between the worker service's messages and domain types, with typed errors
//! that map to gRPC statuses once.

use engine::generate::FinishReason;
use engine::kv::KvLayout;
use engine::sampling::{LogitsRules, RawSampling, SamplingParams};
use kv_cache::events::{BlockMeta, EventId, KvEvent, Snapshot, Tier};
use kv_cache::{LocalHash, SeqHash};
use kv_transfer::descriptor::{BlockDescriptor, KvDtype, KvHandle, KvLayoutDesc, KvOrder, RegionKey};
use kv_transfer::lease::LeaseId;
use proto::worker as pb;

/// A message that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("missing field {0}")]
    Missing(&'static str),
    #[error("invalid {field}: {why}")]
    Invalid { field: &'static str, why: String },
}

impl From<ProtoError> for tonic::Status {
    fn from(e: ProtoError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// A request's deadline (Unix milliseconds from the router) as an instant of this process's clock, given the
/// wall clock and the monotonic clock read together; `Err` when it has already passed: nobody waits for that work.
pub fn deadline(
    unix_ms: Option<u64>,
    now: std::time::SystemTime,
    now_instant: std::time::Instant,
) -> Result<Option<std::time::Instant>, tonic::Status> {
    let Some(ms) = unix_ms else { return Ok(None) };
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    match at.duration_since(now) {
        Ok(left) if !left.is_zero() => Ok(Some(now_instant + left)),
        _ => Err(tonic::Status::deadline_exceeded("the request's deadline has passed")),
    }
}

/// Where a grammar's thinking comes, on the wire.
pub fn thinking_to_pb(t: engine::grammar::Thinking) -> pb::Thinking {
    match t {
        engine::grammar::Thinking::None => pb::Thinking::Unspecified,
        engine::grammar::Thinking::Open => pb::Thinking::Open,
        engine::grammar::Thinking::Optional => pb::Thinking::Optional,
        engine::grammar::Thinking::Channel => pb::Thinking::Channel,
    }
}

/// Where a grammar's thinking comes, from the wire (an unknown value refused).
pub fn thinking_from_pb(t: i32) -> Result<engine::grammar::Thinking, ProtoError> {
    match pb::Thinking::try_from(t) {
        Ok(pb::Thinking::Unspecified) => Ok(engine::grammar::Thinking::None),
        Ok(pb::Thinking::Open) => Ok(engine::grammar::Thinking::Open),
        Ok(pb::Thinking::Optional) => Ok(engine::grammar::Thinking::Optional),
        Ok(pb::Thinking::Channel) => Ok(engine::grammar::Thinking::Channel),
        Err(e) => Err(ProtoError::Invalid { field: "sampling.grammar.thinking", why: e.to_string() }),
    }
}

/// Sampling parameters, validated; `force_max_tokens` overrides the request's (prefill makes one token).
pub fn sampling(s: Option<pb::Sampling>, force_max_tokens: Option<u32>) -> Result<SamplingParams, ProtoError> {
    let s = s.ok_or(ProtoError::Missing("sampling"))?;
    let thinking = s.grammar.as_ref().map_or(Ok(engine::grammar::Thinking::None), |g| thinking_from_pb(g.thinking))?;
    let raw = RawSampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        seed: s.seed,
        max_tokens: force_max_tokens.unwrap_or(s.max_tokens),
        stop: s.stop,
        ignore_eos: s.ignore_eos,
        detokenize: true,
        logits: LogitsRules {
            logit_bias: s.logit_bias.into_iter().collect(),
            frequency_penalty: s.frequency_penalty,
            presence_penalty: s.presence_penalty,
            repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
            min_tokens: s.min_tokens,
            stop_token_ids: s.stop_token_ids,
            prior_generated: s.prior_generated,
            allowed_token_ids: s.allowed_token_ids,
            bad_words: s.bad_words.into_iter().map(|w| w.ids).collect(),
        },
        logprobs: s.logprobs,
        prompt_logprobs: s.prompt_logprobs,
        grammar: s
            .grammar
            .map(|g| engine::grammar::Grammar::from_parts(&g.kind, &g.data))
            .transpose()
            .map_err(|e| ProtoError::Invalid { field: "sampling.grammar", why: e.to_string() })?,
        thinking,
    };
    SamplingParams::new(raw).map_err(|e| ProtoError::Invalid { field: "sampling", why: e.to_string() })
}

/// A token's log-probabilities for the wire.
pub fn logprobs_to_pb(lp: &engine::sampling::TokenLogprobs) -> pb::TokenLogprobs {
    pb::TokenLogprobs {
        logprob: lp.logprob,
        rank: lp.rank,
        top_ids: lp.top.iter().map(|(id, _)| *id).collect(),
        top_logprobs: lp.top.iter().map(|(_, l)| *l).collect(),
    }
}

pub fn layout_desc(l: &KvLayout) -> KvLayoutDesc {
    KvLayoutDesc {
        dtype: KvDtype::F16,
        order: KvOrder::LayerKvHeadTokenDim,
        layers: l.layers as u32,
        kv_heads: l.kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_tokens: l.block_tokens as u32,
    }
}

pub fn layout_to_pb(l: &KvLayoutDesc) -> pb::KvLayout {
    pb::KvLayout {
        dtype: match l.dtype {
            KvDtype::F16 => pb::KvDtype::F16,
            KvDtype::F32 => pb::KvDtype::F32,
        } as i32,
        order: pb::KvOrder::LayerKvHeadTokenDim as i32,
        layers: l.layers,
        kv_heads: l.kv_heads,
        head_dim: l.head_dim,
        block_tokens: l.block_tokens,
    }
}

fn layout_from_pb(l: pb::KvLayout) -> Result<KvLayoutDesc, ProtoError> {
    let dtype = match l.dtype() {
        pb::KvDtype::F16 => KvDtype::F16,
        pb::KvDtype::F32 => KvDtype::F32,
        pb::KvDtype::Unspecified => {
            return Err(ProtoError::Invalid { field: "layout.dtype", why: "unspecified".into() });
        }
    };
    let order = match l.order() {
        pb::KvOrder::LayerKvHeadTokenDim => KvOrder::LayerKvHeadTokenDim,
        pb::KvOrder::Unspecified => {
            return Err(ProtoError::Invalid { field: "layout.order", why: "unspecified".into() });
        }
    };
    Ok(KvLayoutDesc {
        dtype,
        order,
        layers: l.layers,
        kv_heads: l.kv_heads,
        head_dim: l.head_dim,
        block_tokens: l.block_tokens,
    })
}

pub fn handle_to_pb(h: &KvHandle) -> pb::KvHandle {
    pb::KvHandle {
        endpoint: h.endpoint.clone(),
        lease_id: h.lease.0.to_le_bytes().to_vec(),
        model_fingerprint: h.model_fingerprint.clone(),
        layout: Some(layout_to_pb(&h.layout)),
        tokens: h.tokens,
        blocks: h
            .blocks
            .iter()
            .map(|b| pb::BlockDescriptor {
                seq_hash: b.seq_hash.map(|s| s.0),
                region: b.region.0,
                offset: b.offset,
                len: b.len,
                checksum: b.checksum,
            })
            .collect(),
        shm_region: h.shm_region.clone(),
        host_id: h.host_id.clone(),
        server_name: h.server_name.clone(),
    }
}

pub fn handle_from_pb(h: pb::KvHandle) -> Result<KvHandle, ProtoError> {
    let lease: [u8; 16] = h.lease_id.as_slice().try_into().map_err(|_| ProtoError::Invalid {
        field: "handle.lease_id",
        why: format!("{} bytes, not 16", h.lease_id.len()),
    })?;
    let layout = layout_from_pb(h.layout.ok_or(ProtoError::Missing("handle.layout"))?)?;
    Ok(KvHandle {
        endpoint: h.endpoint,
        lease: LeaseId(u128::from_le_bytes(lease)),
        model_fingerprint: h.model_fingerprint,
        layout,
        tokens: h.tokens,
        blocks: h
            .blocks
            .into_iter()
            .map(|b| BlockDescriptor {
                seq_hash: b.seq_hash.map(SeqHash),
                region: RegionKey(b.region),
                offset: b.offset,
                len: b.len,
                checksum: b.checksum,
            })
            .collect(),
        shm_region: h.shm_region,
        host_id: h.host_id,
        server_name: h.server_name,
    })
}

pub fn tier_to_pb(t: Tier) -> pb::Tier {
    match t {
        Tier::Device => pb::Tier::Device,
        Tier::Host => pb::Tier::Host,
        Tier::Disk => pb::Tier::Disk,
    }
}

pub fn event_to_pb(id: u64, e: &KvEvent) -> pb::KvEvent {
    use pb::kv_event::Kind;
    let kind = match e {
        KvEvent::Stored { tier, parent, blocks } => Kind::Stored(pb::Stored {
            tier: tier_to_pb(*tier) as i32,
            parent: parent.map(|p| p.0),
            blocks: blocks.iter().map(|(s, l)| pb::StoredBlock { seq_hash: s.0, local_hash: l.0 }).collect(),
        }),
        KvEvent::Removed { tier, seqs } => Kind::Removed(pb::Removed {
            tier: tier_to_pb(*tier) as i32,
            seq_hashes: seqs.iter().map(|s| s.0).collect(),
        }),
        KvEvent::Cleared { tier } => {
            Kind::Cleared(pb::Cleared { tier: tier.map_or(pb::Tier::Unspecified, tier_to_pb) as i32 })
        }
    };
    pb::KvEvent { id, kind: Some(kind) }
}

pub fn snapshot_to_pb(s: &Snapshot) -> pb::Snapshot {
    pb::Snapshot {
        as_of: s.as_of.map(|e| e.0),
        tiers: Tier::ALL
            .iter()
            .map(|&t| pb::TierBlocks {
                tier: tier_to_pb(t) as i32,
                blocks: s.tiers[t.index()]
                    .iter()
                    .map(|m| pb::SnapshotBlock {
                        seq_hash: m.seq.0,
                        local_hash: m.local.0,
                        parent: m.parent.map(|p| p.0),
                    })
                    .collect(),
            })
            .collect(),
    }
}

pub fn finish_to_pb(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Cancelled => pb::FinishReason::Cancelled,
    }
}

pub fn tier_from_pb(t: i32) -> Result<Tier, ProtoError> {
    match pb::Tier::try_from(t) {
        Ok(pb::Tier::Device) => Ok(Tier::Device),
        Ok(pb::Tier::Host) => Ok(Tier::Host),
        Ok(pb::Tier::Disk) => Ok(Tier::Disk),
        _ => Err(ProtoError::Invalid { field: "tier", why: format!("{t} is not a tier") }),
    }
}

/// A KV event with its id, in domain terms.
pub fn event_from_pb(e: &pb::KvEvent) -> Result<(EventId, KvEvent), ProtoError> {
    use pb::kv_event::Kind;
    let event = match e.kind.as_ref().ok_or(ProtoError::Missing("kv_event.kind"))? {
        Kind::Stored(s) => KvEvent::Stored {
            tier: tier_from_pb(s.tier)?,
            parent: s.parent.map(SeqHash),
            blocks: s.blocks.iter().map(|b| (SeqHash(b.seq_hash), LocalHash(b.local_hash))).collect(),
        },
        Kind::Removed(r) => {
            KvEvent::Removed { tier: tier_from_pb(r.tier)?, seqs: r.seq_hashes.iter().map(|&s| SeqHash(s)).collect() }
        }
        Kind::Cleared(c) => KvEvent::Cleared {
            tier: if c.tier == pb::Tier::Unspecified as i32 { None } else { Some(tier_from_pb(c.tier)?) },
        },
    };
    Ok((EventId(e.id), event))
}

pub fn snapshot_from_pb(s: &pb::Snapshot) -> Result<Snapshot, ProtoError> {
    let mut tiers: [Vec<BlockMeta>; 3] = Default::default();
    for t in &s.tiers {
        tiers[tier_from_pb(t.tier)?.index()] = t
            .blocks
            .iter()
            .map(|b| BlockMeta {
                seq: SeqHash(b.seq_hash),
                local: LocalHash(b.local_hash),
                parent: b.parent.map(SeqHash),
            })
            .collect();
    }
    Ok(Snapshot { as_of: s.as_of.map(EventId), tiers })
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, UNIX_EPOCH};

    use super::*;

    #[test]
    fn deadlines_become_instants_and_past_ones_are_refused() {
        let (now, mono) = (UNIX_EPOCH + Duration::from_millis(1_000_000), Instant::now());
        assert_eq!(deadline(None, now, mono).expect("none"), None);
        assert_eq!(deadline(Some(1_000_250), now, mono).expect("ahead"), Some(mono + Duration::from_millis(250)));
        for past in [1_000_000, 999_999, 0] {
            assert_eq!(deadline(Some(past), now, mono).expect_err("past").code(), tonic::Code::DeadlineExceeded);
        }
    }

    #[test]
    fn a_grammars_thinking_comes_from_the_wire_and_an_unknown_one_is_refused() {
        use engine::grammar::Thinking;
        let with = |thinking: i32| {
            let grammar = Some(pb::Grammar { kind: "json_object".into(), thinking, ..Default::default() });
            sampling(Some(pb::Sampling { max_tokens: 8, top_p: 1.0, grammar, ..Default::default() }), None)
        };
        for (wire, want) in [
            (pb::Thinking::Unspecified, Thinking::None),
            (pb::Thinking::Open, Thinking::Open),
            (pb::Thinking::Optional, Thinking::Optional),
        ] {
            assert_eq!(with(wire as i32).expect("valid").thinking(), want);
            assert_eq!(thinking_to_pb(want), wire, "and back");
        }
        let e = with(7).expect_err("unknown");
        assert!(e.to_string().contains("sampling.grammar.thinking"), "{e}");
    }
}
