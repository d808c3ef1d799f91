//! The model's forward pass on the engine's own thread pool.

use super::{Backend, Next, StepContext};
use crate::forward::{ForwardError, SeqChunk};
use crate::kv::{KvLayout, KvStore};
use crate::model::Model;
use crate::sampling::TokenLogprobs;
use crate::team::Team;

/// Computes steps with the real model on CPU.
#[derive(Debug)]
pub struct CpuBackend {
    model: Model,
    team: Team,
}

impl CpuBackend {
    pub fn new(model: Model, team: Team) -> CpuBackend {
        CpuBackend { model, team }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn vocab(&self) -> usize {
        self.model.config.n_vocab
    }

    fn context_len(&self) -> usize {
        self.model.config.context_len
    }

    fn kv_layout(&self, block_tokens: usize) -> KvLayout {
        KvLayout::for_model(&self.model.config, block_tokens)
    }

    fn threads(&self) -> usize {
        self.team.threads()
    }

    fn forward_into(
        &mut self,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        context: StepContext,
        next: &mut Vec<Next>,
    ) -> Result<(), ForwardError> {
        self.forward_scored(kv, batch, context, next, &mut Vec::new())
    }

    fn scores_prompts(&self) -> bool {
        true
    }

    fn forward_scored(
        &mut self,
        kv: &mut KvStore,
        batch: &[SeqChunk<'_>],
        _: StepContext,
        next: &mut Vec<Next>,
        scores: &mut Vec<TokenLogprobs>,
    ) -> Result<(), ForwardError> {
        let logits = self.model.forward_scored(&self.team, kv, batch, scores)?;
        next.extend(logits.into_iter().map(Next::Logits));
        Ok(())
    }
}
