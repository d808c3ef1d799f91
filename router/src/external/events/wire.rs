//! The KV event batches vLLM and SGLang publish, read from their MessagePack bytes.
//!
//! Both engines encode with msgspec: a batch is `[ts, events, rank]` (or a map with those names), each event a map
//! tagged by `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) or, in older releases, an array with the
//! tag first and the fields in declaration order. Block hashes are the engine's own (integers, or SHA-256 bytes in
//! vLLM): they name blocks in later removals but mean nothing to our index, which hashes the token ids instead
//! ([`super::chain`]). Unknown event types are skipped, so a newer engine's additions do not stop the stream.

use kv_cache::events::Tier;

use super::msgpack::{self, Value};

/// An engine's name for one of its blocks (an integer hash as its 64 bits, a byte-string hash digested to 64).
pub type EngineHash = u64;

/// One published batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The engine's clock when it published (seconds).
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published it (each rank has its own cache).
    pub rank: Option<i64>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Blocks became cached, in chain order after `parent`, with `block_size` token ids each.
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        tokens: Vec<u32>,
        block_size: u32,
        /// `None`: a medium Tandem does not model (e.g. SGLang's `EXTERNAL` pool).
        tier: Option<Tier>,
        /// The cache salt of the request that stored a chain's first blocks (vLLM's first extra key, SGLang's
        /// `cache_salt`): the router hashes them in the namespace of that name, as it hashes such a request.
        salt: Option<String>,
        /// Their KV depends on more than the token ids and a salt (a LoRA adapter, multimodal inputs, another KV
        /// cache group): a prompt with the same tokens would not hit them.
        keyed: bool,
    },
    Removed {
        hashes: Vec<EngineHash>,
        tier: Option<Tier>,
        /// A KV cache group other than the first (hybrid models): not what the index follows.
        other_group: bool,
    },
    Cleared,
    /// A type this reader does not know.
    Unknown(String),
}

/// Why a payload is not an event batch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("not MessagePack: {0}")]
    Bytes(#[from] msgpack::Error),
    #[error("{0}")]
    Shape(String),
}

fn shape<T>(what: impl Into<String>) -> Result<T, Malformed> {
    Err(Malformed::Shape(what.into()))
}

/// Block size an event may claim at most (vLLM's largest is 256; this only bounds garbage).
const MAX_BLOCK_SIZE: u32 = 1 << 20;

/// Reads one batch payload.
pub fn decode(payload: &[u8]) -> Result<Batch, Malformed> {
    let v = msgpack::decode(payload)?;
    let (ts, events, rank) = match &v {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(_) => (v.get("ts"), v.get("events"), v.get("data_parallel_rank").or_else(|| v.get("attn_dp_rank"))),
        _ => return shape("a batch is neither an array nor a map"),
    };
    let ts = match ts {
        Some(Value::Float(f)) => *f,
        Some(Value::Int(i)) => *i as f64,
        _ => return shape("a batch has no timestamp"),
    };
    let Some(events) = events.and_then(Value::as_array) else { return shape("a batch has no event list") };
    let rank = match rank {
        None | Some(Value::Nil) => None,
        Some(r) => Some(r.as_int().and_then(|r| i64::try_from(r).ok()).ok_or_else(|| bad("the rank", r))?),
    };
    let events = events.iter().map(event).collect::<Result<_, _>>()?;
    Ok(Batch { ts, events, rank })
}

fn bad(what: &str, v: &Value<'_>) -> Malformed {
    Malformed::Shape(format!("{what} is {v:?}"))
}

/// One event's fields, by name (a tagged map) or by position (a tagged array, fields in declaration order).
struct Fields<'v, 'a> {
    value: &'v Value<'a>,
    names: &'static [&'static str],
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field, `None` when absent or nil (msgspec omits fields left at their default).
    fn get(&self, name: &str) -> Option<&'v Value<'a>> {
        let v = match self.value {
            Value::Map(_) => self.value.get(name),
            Value::Array(a) => self.names.iter().position(|n| *n == name).and_then(|i| a.get(i + 1)),
            _ => None,
        };
        v.filter(|v| **v != Value::Nil)
    }
}

const STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx"];

fn event(v: &Value<'_>) -> Result<EngineEvent, Malformed> {
    let tag = match v {
        Value::Map(_) => v.get("type"),
        Value::Array(a) => a.first(),
        _ => None,
    };
    let Some(tag) = tag.and_then(Value::as_str) else { return shape(format!("an event has no type tag: {v:?}")) };
    match tag {
        "BlockStored" => {
            let f = Fields { value: v, names: STORED };
            let hashes = hash_list(f.get("block_hashes"))?;
            let parent = f.get("parent_block_hash").map(hash).transpose()?;
            let block_size = f
                .get("block_size")
                .and_then(Value::as_int)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|b| (1..=MAX_BLOCK_SIZE).contains(b))
                .ok_or_else(|| Malformed::Shape("BlockStored has no usable block_size".into()))?;
            let tokens = token_list(f.get("token_ids"))?;
            if tokens.len() != hashes.len() * block_size as usize {
                return shape(format!(
                    "BlockStored has {} token ids for {} blocks of {block_size}",
                    tokens.len(),
                    hashes.len()
                ));
            }
            let (mut salt, extra_keys) = extra_keys(f.get("extra_keys"), parent.is_none());
            let salt_field = match f.get("cache_salt") {
                None => false,
                Some(Value::Str(s)) => {
                    salt.get_or_insert_with(|| s.to_string());
                    false
                }
                Some(_) => true,
            };
            let keyed = extra_keys
                || salt_field
                || ["lora_id", "lora_name"].iter().any(|k| f.get(k).is_some())
                || other_group(&f);
            // A salt names a chain's first block only: a child's namespace is its parent's.
            let salt = salt.filter(|_| parent.is_none());
            Ok(EngineEvent::Stored { hashes, parent, tokens, block_size, tier: tier(f.get("medium"))?, salt, keyed })
        }
        "BlockRemoved" => {
            let f = Fields { value: v, names: REMOVED };
            Ok(EngineEvent::Removed {
                hashes: hash_list(f.get("block_hashes"))?,
                tier: tier(f.get("medium"))?,
                other_group: other_group(&f),
            })
        }
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Ok(EngineEvent::Unknown(other.to_string())),
    }
}

/// vLLM's `extra_keys`, one entry per block: (the cache salt, whether any key but it is there). The salt is the
/// only key of a chain's first block (`first`: the event starts a chain) when the request had one and no LoRA
/// adapter or multimodal input; any other key (adapter names, `(identifier, offset)` pairs, embedding digests)
/// keys the blocks by more than tokens.
fn extra_keys(v: Option<&Value<'_>>, first: bool) -> (Option<String>, bool) {
    let Some(v) = v else { return (None, false) };
    let Some(keys) = v.as_array() else { return (None, true) };
    let mut salt = None;
    for (i, key) in keys.iter().enumerate() {
        match (key, key.as_array()) {
            (Value::Nil, _) => {}
            (_, Some([Value::Str(s)])) if i == 0 && first => salt = Some(s.to_string()),
            _ => return (None, true),
        }
    }
    (salt, false)
}

fn other_group(f: &Fields<'_, '_>) -> bool {
    f.get("group_idx").is_some_and(|g| g.as_int() != Some(0))
}

/// The tier a medium names: vLLM's `GPU`/`CPU`/`STORAGE`, SGLang's `GPU`/`CPU_PINNED`/`DISK`; none means the device.
fn tier(medium: Option<&Value<'_>>) -> Result<Option<Tier>, Malformed> {
    let Some(m) = medium else { return Ok(Some(Tier::Device)) };
    let Some(m) = m.as_str() else { return Err(bad("a medium", m)) };
    Ok(match m.to_ascii_uppercase().as_str() {
        "GPU" | "DEVICE" => Some(Tier::Device),
        "CPU" | "CPU_PINNED" | "HOST" => Some(Tier::Host),
        "STORAGE" | "DISK" => Some(Tier::Disk),
        _ => None,
    })
}

fn hash(v: &Value<'_>) -> Result<EngineHash, Malformed> {
    match v {
        // Signed (SGLang) or unsigned (vLLM's integer mode): the same 64 bits either way.
        Value::Int(i) if (i64::MIN as i128..=u64::MAX as i128).contains(i) => Ok(*i as u64),
        Value::Bin(b) => Ok(xxhash_rust::xxh3::xxh3_64(b)),
        other => Err(bad("a block hash", other)),
    }
}

fn hash_list(v: Option<&Value<'_>>) -> Result<Vec<EngineHash>, Malformed> {
    let Some(list) = v.and_then(Value::as_array) else { return shape("an event has no block_hashes list") };
    list.iter().map(hash).collect()
}

fn token_list(v: Option<&Value<'_>>) -> Result<Vec<u32>, Malformed> {
    let Some(list) = v.and_then(Value::as_array) else { return shape("BlockStored has no token_ids list") };
    list.iter().map(|t| t.as_int().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| bad("a token id", t))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal MessagePack writer for the tests' batches (the engines' own publishers are exercised in
    /// `tests/engine_events.rs`).
    #[derive(Clone)]
    enum W {
        I(i64),
        F(f64),
        S(&'static str),
        B(Vec<u8>),
        Nil,
        A(Vec<W>),
        M(Vec<(&'static str, W)>),
    }

    fn put(w: &W, out: &mut Vec<u8>) {
        match w {
            W::I(i) => {
                out.push(0xd3);
                out.extend_from_slice(&i.to_be_bytes());
            }
            W::F(f) => {
                out.push(0xcb);
                out.extend_from_slice(&f.to_bits().to_be_bytes());
            }
            W::S(s) => {
                out.push(0xd9);
                out.push(s.len() as u8);
                out.extend_from_slice(s.as_bytes());
            }
            W::B(b) => {
                out.push(0xc4);
                out.push(b.len() as u8);
                out.extend_from_slice(b);
            }
            W::Nil => out.push(0xc0),
            W::A(items) => {
                out.push(0xdc);
                out.extend_from_slice(&(items.len() as u16).to_be_bytes());
                items.iter().for_each(|i| put(i, out));
            }
            W::M(entries) => {
                out.push(0xde);
                out.extend_from_slice(&(entries.len() as u16).to_be_bytes());
                for (k, v) in entries {
                    put(&W::S(k), out);
                    put(v, out);
                }
            }
        }
    }

    fn bytes(w: W) -> Vec<u8> {
        let mut out = Vec::new();
        put(&w, &mut out);
        out
    }

    fn ints(v: &[i64]) -> W {
        W::A(v.iter().map(|&i| W::I(i)).collect())
    }

    #[test]
    fn reads_tagged_maps_in_a_positional_batch() {
        // vLLM 0.33 and SGLang 0.5: the batch positional, the events tagged maps with defaults omitted.
        let stored = W::M(vec![
            ("type", W::S("BlockStored")),
            ("block_hashes", W::A(vec![W::B(vec![1; 32]), W::B(vec![2; 32])])),
            ("parent_block_hash", W::Nil),
            ("token_ids", ints(&[1, 2, 3, 4])),
            ("block_size", W::I(2)),
            ("lora_id", W::Nil),
            ("medium", W::S("CPU_PINNED")),
        ]);
        let removed =
            W::M(vec![("type", W::S("BlockRemoved")), ("block_hashes", ints(&[-5])), ("medium", W::S("GPU"))]);
        let cleared = W::M(vec![("type", W::S("AllBlocksCleared"))]);
        let future = W::M(vec![("type", W::S("BlockTouched"))]);
        let batch = decode(&bytes(W::A(vec![W::F(1.5), W::A(vec![stored, removed, cleared, future]), W::I(0)])))
            .expect("a batch");
        assert_eq!(batch.ts, 1.5);
        assert_eq!(batch.rank, Some(0));
        assert_eq!(
            batch.events,
            vec![
                EngineEvent::Stored {
                    hashes: vec![xxhash_rust::xxh3::xxh3_64(&[1; 32]), xxhash_rust::xxh3::xxh3_64(&[2; 32])],
                    parent: None,
                    tokens: vec![1, 2, 3, 4],
                    block_size: 2,
                    tier: Some(Tier::Host),
                    salt: None,
                    keyed: false,
                },
                EngineEvent::Removed { hashes: vec![(-5i64) as u64], tier: Some(Tier::Device), other_group: false },
                EngineEvent::Cleared,
                EngineEvent::Unknown("BlockTouched".into()),
            ]
        );
    }

    #[test]
    fn reads_the_older_positional_events() {
        // Releases with `array_like` events: the tag, then the fields in declaration order.
        let stored = W::A(vec![W::S("BlockStored"), ints(&[7]), W::I(6), ints(&[9, 9]), W::I(2), W::Nil, W::S("GPU")]);
        let batch = decode(&bytes(W::A(vec![W::F(0.0), W::A(vec![stored])]))).expect("a batch");
        assert_eq!(
            batch.events,
            vec![EngineEvent::Stored {
                hashes: vec![7],
                parent: Some(6),
                tokens: vec![9, 9],
                block_size: 2,
                tier: Some(Tier::Device),
                salt: None,
                keyed: false
            }]
        );
        assert_eq!(batch.rank, None);
    }

    /// The salt and whether the blocks are keyed by more, of a stored event with `fields` (after a parent with
    /// `parent`).
    fn salt_and_keyed(fields: Vec<(&'static str, W)>, parent: bool) -> (Option<String>, bool) {
        let mut e = vec![
            ("type", W::S("BlockStored")),
            ("block_hashes", ints(&[1, 2])),
            ("parent_block_hash", if parent { W::I(9) } else { W::Nil }),
            ("token_ids", ints(&[1, 2])),
            ("block_size", W::I(1)),
        ];
        e.extend(fields);
        match &decode(&bytes(W::A(vec![W::F(0.0), W::A(vec![W::M(e)])]))).expect("batch").events[0] {
            EngineEvent::Stored { salt, keyed, .. } => (salt.clone(), *keyed),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn blocks_keyed_by_more_than_tokens_are_marked() {
        let keyed = |k: &'static str, v: W| salt_and_keyed(vec![(k, v)], false).1;
        assert!(keyed("lora_name", W::S("adapter")));
        assert!(keyed("lora_id", W::I(3)));
        // A multimodal input's (identifier, offset) pair; an embedding digest.
        assert!(keyed("extra_keys", W::A(vec![W::A(vec![W::S("img"), W::I(0)]), W::Nil])));
        assert!(keyed("extra_keys", W::A(vec![W::A(vec![W::B(vec![7; 32])]), W::Nil])));
        assert!(keyed("extra_keys", W::A(vec![W::Nil, W::A(vec![W::S("img"), W::I(3)])])));
        assert!(keyed("cache_salt", W::I(5)));
        assert!(keyed("group_idx", W::I(1)));
        assert!(!keyed("group_idx", W::I(0)));
        assert!(!keyed("extra_keys", W::A(vec![W::Nil, W::Nil])));
        assert!(!keyed("session_id", W::S("s")));
    }

    #[test]
    fn a_chains_cache_salt_is_read_from_either_engine() {
        // vLLM: the salt is the first block's only extra key, on the event that starts the chain.
        let first = W::A(vec![W::A(vec![W::S("tenant\0x")]), W::Nil]);
        assert_eq!(salt_and_keyed(vec![("extra_keys", first.clone())], false), (Some("tenant\0x".into()), false));
        // A single text key on a later block is no salt.
        let later = W::A(vec![W::Nil, W::A(vec![W::S("x")])]);
        assert_eq!(salt_and_keyed(vec![("extra_keys", later)], false), (None, true));
        // After a parent the first entry is no chain's first block: whatever it is keys the blocks.
        assert_eq!(salt_and_keyed(vec![("extra_keys", first)], true), (None, true));
        // With an adapter, the first key is its name.
        let adapter = W::A(vec![W::A(vec![W::S("adapter")]), W::Nil]);
        assert!(salt_and_keyed(vec![("extra_keys", adapter), ("lora_name", W::S("adapter"))], false).1);
        // SGLang: a field of the event; after a parent the chain's namespace is the parent's.
        assert_eq!(salt_and_keyed(vec![("cache_salt", W::S("t"))], false), (Some("t".into()), false));
        assert_eq!(salt_and_keyed(vec![("cache_salt", W::S("t"))], true), (None, false));
    }

    #[test]
    fn malformed_batches_are_errors() {
        let stored = |tokens: W| {
            bytes(W::A(vec![
                W::F(0.0),
                W::A(vec![W::M(vec![
                    ("type", W::S("BlockStored")),
                    ("block_hashes", ints(&[1, 2])),
                    ("token_ids", tokens),
                    ("block_size", W::I(2)),
                ])]),
            ]))
        };
        assert!(decode(&stored(ints(&[1, 2, 3]))).is_err(), "3 tokens for 2 blocks of 2");
        assert!(decode(&stored(ints(&[1, 2, 3, -4]))).is_err(), "a negative token id");
        assert!(decode(&stored(ints(&[1, 2, 3, 4]))).is_ok());
        assert!(decode(&bytes(W::A(vec![W::S("x")]))).is_err());
        assert!(decode(&bytes(W::I(3))).is_err());
        assert!(decode(&bytes(W::A(vec![W::F(0.0), W::A(vec![W::I(1)])]))).is_err());
        assert!(decode(b"\x92\xcb").is_err());
    }
}
