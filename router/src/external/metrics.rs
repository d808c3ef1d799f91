//! An engine server's load as its Prometheus metrics give it: requests running and waiting, and the share of its KV
//! cache in use. The names differ per engine (the table in `docs/external-engines.md`); a server runs several
//! engines (data-parallel ranks) under one name with a label each (vLLM's `engine`, SGLang's `dp_rank`): for the
//! server as a whole counts are summed and usage averaged, for one rank only its own samples are read.

use super::{EngineKind, Rank};

/// Where each engine serves its metrics (llama-server with `--metrics`, SGLang with `--enable-metrics`).
pub const PATH: &str = "/metrics";

/// What an engine's metrics say about its load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    pub running: u64,
    pub waiting: u64,
    /// The share of its KV cache in use (0 to 1), where it says.
    pub kv_usage: Option<f64>,
}

/// The metric names an engine uses for (running, waiting, KV usage).
fn names(kind: EngineKind) -> (&'static str, &'static str, Option<&'static str>) {
    match kind {
        EngineKind::Vllm => {
            ("vllm:num_requests_running", "vllm:num_requests_waiting", Some("vllm:kv_cache_usage_perc"))
        }
        EngineKind::Sglang => ("sglang:num_running_reqs", "sglang:num_queue_reqs", Some("sglang:token_usage")),
        EngineKind::LlamaServer => ("llamacpp:requests_processing", "llamacpp:requests_deferred", None),
    }
}

/// The label naming a data-parallel rank's samples.
fn rank_label(kind: EngineKind) -> &'static str {
    match kind {
        EngineKind::Sglang => "dp_rank",
        EngineKind::Vllm | EngineKind::LlamaServer => "engine",
    }
}

/// Every sample of `name` in Prometheus text (any labels), with its labels' text.
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        // The name must end here: `name{...} v` or `name v`.
        let (labels, value) = match rest.chars().next()? {
            '{' => rest[1..].rsplit_once('}')?,
            ' ' => ("", rest),
            _ => return None,
        };
        let value = value.split_whitespace().next()?.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)?;
        Some((labels, value))
    })
}

/// The value of label `key` in a sample's labels' text (`k="v",...`; a value may hold commas and escaped quotes).
pub(super) fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        let (k, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let mut escaped = false;
        let end = after.char_indices().find_map(|(i, c)| match (escaped, c) {
            (false, '"') => Some(i),
            (false, '\\') => {
                escaped = true;
                None
            }
            _ => {
                escaped = false;
                None
            }
        })?;
        if k.trim() == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
}

/// The samples of `name` that are `rank`'s (all for the server as a whole). A server whose samples carry no rank
/// label gives each rank an equal share of the whole (`share` < 1).
fn rank_samples(kind: EngineKind, text: &str, name: &str, rank: Option<Rank>) -> (Vec<f64>, f64) {
    let all: Vec<(&str, f64)> = samples(text, name).collect();
    let Some(Rank { rank, of }) = rank else { return (all.into_iter().map(|(_, v)| v).collect(), 1.0) };
    let key = rank_label(kind);
    if !all.iter().any(|(labels, _)| label(labels, key).is_some()) {
        return (all.into_iter().map(|(_, v)| v).collect(), 1.0 / f64::from(of.max(1)));
    }
    let own = rank.to_string();
    (all.into_iter().filter(|(labels, _)| label(labels, key) == Some(own.as_str())).map(|(_, v)| v).collect(), 1.0)
}

/// The load in `text` of the server, or of its data-parallel rank `rank`; `None` when it has neither count (not
/// this engine's metrics).
pub fn parse(kind: EngineKind, text: &str, rank: Option<Rank>) -> Option<EngineLoad> {
    let (running, waiting, usage) = names(kind);
    let count = |name| {
        let (s, share) = rank_samples(kind, text, name, rank);
        (!s.is_empty()).then(|| (s.iter().sum::<f64>() * share).round() as u64)
    };
    let (r, w) = (count(running), count(waiting));
    if r.is_none() && w.is_none() {
        return None;
    }
    let kv_usage = usage.and_then(|name| {
        let (v, _) = rank_samples(kind, text, name, rank);
        (!v.is_empty()).then(|| (v.iter().sum::<f64>() / v.len() as f64).min(1.0))
    });
    Some(EngineLoad { running: r.unwrap_or(0), waiting: w.unwrap_or(0), kv_usage })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_engines_names() {
        let vllm = "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
                    vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"capacity\"} 9.0\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
                    vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.3\n";
        let l = parse(EngineKind::Vllm, vllm, None).expect("vLLM's metrics");
        assert_eq!((l.running, l.waiting), (5, 4), "summed over engines; a longer name is another metric");
        assert!((l.kv_usage.expect("usage") - 0.4).abs() < 1e-9);
        let sglang = "sglang:num_running_reqs{model_name=\"m\",engine_type=\"unified\"} 7.0\n\
                      sglang:num_queue_reqs{model_name=\"m\",engine_type=\"unified\"} 1.0\n\
                      sglang:token_usage{model_name=\"m\",engine_type=\"unified\"} 0.25\n";
        assert_eq!(
            parse(EngineKind::Sglang, sglang, None),
            Some(EngineLoad { running: 7, waiting: 1, kv_usage: Some(0.25) })
        );
        let llama = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n";
        assert_eq!(
            parse(EngineKind::LlamaServer, llama, None),
            Some(EngineLoad { running: 1, waiting: 2, kv_usage: None })
        );
        assert_eq!(parse(EngineKind::Vllm, llama, None), None);
        assert_eq!(parse(EngineKind::Vllm, "vllm:num_requests_running NaN\n", None), None);
    }

    #[test]
    fn a_data_parallel_ranks_own_samples() {
        let rank = |rank| Some(Rank { rank, of: 2 });
        let vllm = "vllm:num_requests_running{engine=\"0\",model_name=\"a,\\\"b\"} 3.0\n\
                    vllm:num_requests_running{model_name=\"a,\\\"b\",engine=\"1\"} 2.0\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 4.0\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
                    vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.3\n";
        assert_eq!(
            parse(EngineKind::Vllm, vllm, rank(0)),
            Some(EngineLoad { running: 3, waiting: 0, kv_usage: Some(0.5) })
        );
        assert_eq!(
            parse(EngineKind::Vllm, vllm, rank(1)),
            Some(EngineLoad { running: 2, waiting: 4, kv_usage: Some(0.3) })
        );
        let sglang = "sglang:num_running_reqs{dp_rank=\"1\",tp_rank=\"0\"} 6.0\n\
                      sglang:num_running_reqs{dp_rank=\"0\",tp_rank=\"0\"} 1.0\n\
                      sglang:num_queue_reqs{dp_rank=\"1\",tp_rank=\"0\"} 2.0\n";
        assert_eq!(parse(EngineKind::Sglang, sglang, rank(1)).map(|l| (l.running, l.waiting)), Some((6, 2)));
        // A server that does not label its ranks: each rank gets its share of the whole.
        let unlabelled = "sglang:num_running_reqs{model_name=\"m\"} 6.0\nsglang:num_queue_reqs 3.0\n";
        assert_eq!(parse(EngineKind::Sglang, unlabelled, rank(0)).map(|l| (l.running, l.waiting)), Some((3, 2)));
    }
}
