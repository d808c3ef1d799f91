//! An engine server's load as its Prometheus metrics give it: requests running and waiting, and the share of its KV
//! cache in use. The names differ per engine (the table in `docs/external-engines.md`); a server runs several
//! engines (data-parallel ranks) under one name with a label each, so counts are summed and usage averaged.

use super::EngineKind;

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

/// Every sample of `name` in Prometheus text (any labels).
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        // The name must end here: `name{...} v` or `name v`.
        let value = match rest.chars().next()? {
            '{' => rest.rsplit_once('}')?.1,
            ' ' => rest,
            _ => return None,
        };
        value.split_whitespace().next()?.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
    })
}

/// The load in `text`, or `None` when it has neither count (not this engine's metrics).
pub fn parse(kind: EngineKind, text: &str) -> Option<EngineLoad> {
    let (running, waiting, usage) = names(kind);
    let count = |name| {
        let mut s = samples(text, name).peekable();
        s.peek().is_some().then(|| s.sum::<f64>().round() as u64)
    };
    let (r, w) = (count(running), count(waiting));
    if r.is_none() && w.is_none() {
        return None;
    }
    let kv_usage = usage.and_then(|name| {
        let v: Vec<f64> = samples(text, name).collect();
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
        let l = parse(EngineKind::Vllm, vllm).expect("vLLM's metrics");
        assert_eq!((l.running, l.waiting), (5, 4), "summed over engines; a longer name is another metric");
        assert!((l.kv_usage.expect("usage") - 0.4).abs() < 1e-9);
        let sglang = "sglang:num_running_reqs{model_name=\"m\",engine_type=\"unified\"} 7.0\n\
                      sglang:num_queue_reqs{model_name=\"m\",engine_type=\"unified\"} 1.0\n\
                      sglang:token_usage{model_name=\"m\",engine_type=\"unified\"} 0.25\n";
        assert_eq!(
            parse(EngineKind::Sglang, sglang),
            Some(EngineLoad { running: 7, waiting: 1, kv_usage: Some(0.25) })
        );
        let llama = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n";
        assert_eq!(parse(EngineKind::LlamaServer, llama), Some(EngineLoad { running: 1, waiting: 2, kv_usage: None }));
        assert_eq!(parse(EngineKind::Vllm, llama), None);
        assert_eq!(parse(EngineKind::Vllm, "vllm:num_requests_running NaN\n"), None);
    }
}
