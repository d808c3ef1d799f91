//! The tokenizer against llama.cpp's own tokenizer tests: the vocabulary-only GGUFs in its `models/` directory,
//! each with its test strings (`.inp`) and the ids llama.cpp's `test-tokenizer-0` expects for them (`.out`, made
//! from Hugging Face's tokenizers), encoded as that test encodes them (no BOS, special tokens' text as text). The
//! files come with llama.cpp's source, which `scripts/llama-cpp.sh` fetches from llama-cpp-python's package on
//! PyPI (CI fetches it before the tests, for `tests/external.rs`).

use std::path::Path;

use engine::gguf::{GgufFile, MetaValue};
use engine::tokenizer::{Tokenizer, TokenizerError};

mod common;

use common::llama_cpp_models as models;

/// Every test string of `vocab` and the ids expected for it.
fn cases(models: &Path, vocab: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(models.join(format!("ggml-vocab-{vocab}.gguf.inp"))).expect("inputs");
    let out = std::fs::read_to_string(models.join(format!("ggml-vocab-{vocab}.gguf.out"))).expect("outputs");
    // The inputs end with a separator, or (Gemma 4's) without one; the outputs with a newline.
    let inp = inp.strip_suffix("\n__ggml_vocab_test__\n").unwrap_or(&inp);
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let out = out.strip_suffix('\n').expect("a last newline");
    let ids: Vec<Vec<u32>> =
        out.split('\n').map(|l| l.split_whitespace().map(|t| t.parse().expect("an id")).collect()).collect();
    assert_eq!(texts.len(), ids.len(), "{vocab}: one line of ids per test string");
    texts.iter().zip(ids).map(|(t, i)| (t.to_string(), i)).collect()
}

#[test]
fn every_vocabulary_this_tokenizer_reads_encodes_as_llama_cpp_expects() {
    let models = models();
    // Byte-level BPE with the pre-tokenizers implemented (GPT-2's, digits isolated or not; Llama 3's; Qwen 2's),
    // SentencePiece BPE (Llama 2's, Phi-3's), and Gemma 4's BPE over spaces written `▁`.
    let supported =
        ["gpt-2", "starcoder", "refact", "command-r", "llama-bpe", "qwen2", "qwen35", "llama-spm", "phi-3", "gemma-4"];
    let sentencepiece = ["llama-spm", "phi-3"];
    let mut failures = Vec::new();
    let mut checked = 0;
    for vocab in supported {
        let file = GgufFile::open(&models.join(format!("ggml-vocab-{vocab}.gguf"))).expect("a vocabulary GGUF");
        let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{vocab}: {e}"));
        for (text, want) in cases(&models, vocab) {
            let got = tok.encode_ordinary(&text);
            checked += 1;
            if got != want {
                failures.push(format!("{vocab} {text:?}: got {got:?}, want {want:?}"));
            }
            // SentencePiece puts a space before the text (the `▁` that starts it), which its decoders take off.
            let spaced = sentencepiece.contains(&vocab) && !text.is_empty();
            let decoded = tok.decode(&want);
            assert_eq!(
                if spaced { decoded.strip_prefix(' ') } else { Some(decoded.as_str()) },
                Some(text.as_str()),
                "{vocab}"
            );
        }
    }
    assert_eq!(checked, 464, "every test string of the ten vocabularies");
    assert!(failures.is_empty(), "{} of {checked} differ:\n{}", failures.len(), failures.join("\n"));
    // One this tokenizer does not implement is refused by name, not tokenized some other way.
    let file = GgufFile::open(&models.join("ggml-vocab-deepseek-llm.gguf")).expect("a vocabulary GGUF");
    assert!(matches!(Tokenizer::from_gguf(&file), Err(TokenizerError::UnsupportedPre(_))));
}

/// A GLM 4.5+ GGUF (llama.cpp names its pre-tokenizer `glm4` or `glm5`) is split as Llama 3's and never starts with
/// a BOS, though its file names one and asks for it: Llama 3's test vocabulary relabelled `glm4` encodes llama.cpp's
/// test strings alike, and a prompt gets no BOS where the same file labelled `llama-bpe` gets one.
#[test]
fn a_glm_vocabulary_is_split_as_llama_3s_and_starts_without_bos() {
    let models = models();
    let file = GgufFile::open(&models.join("ggml-vocab-llama-bpe.gguf")).expect("a vocabulary GGUF");
    let relabelled = |pre: &str| {
        let mut w = engine::gguf::GgufWriter::new();
        for (key, value) in file.metadata() {
            w.meta(key, value.clone());
        }
        w.meta("tokenizer.ggml.pre", MetaValue::String(pre.into()))
            .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(true))
            .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(128_000));
        let path = std::env::temp_dir().join(format!("tandem-vocab-{pre}-{}.gguf", std::process::id()));
        w.write(&path).expect("written");
        let tok = Tokenizer::from_gguf(&GgufFile::open(&path).expect("opens")).expect("loads");
        let _ = std::fs::remove_file(&path);
        tok
    };
    let (glm, llama) = (relabelled("glm4"), relabelled("llama-bpe"));
    for (text, want) in cases(&models, "llama-bpe") {
        assert_eq!(glm.encode_ordinary(&text), want, "{text:?}");
    }
    assert_eq!(llama.encode("Hi")[0], 128_000, "Llama 3's prompts start with BOS");
    assert_eq!(glm.encode("Hi"), glm.encode_ordinary("Hi"), "GLM's do not");
    assert_eq!(glm.special().bos, None);
}

/// A Qwen 2 GGUF serves as a router's text model: its chat template renders a conversation, whose turn markers
/// tokenize to their special tokens and the rest as llama.cpp tokenizes it, and the ids decode back to the text.
#[test]
fn a_qwen_vocabulary_renders_and_tokenizes_a_conversation() {
    use engine::chat::ChatMessage;
    let text = engine::text::TextModel::open(&models().join("ggml-vocab-qwen2.gguf")).expect("a text model");
    let rendered = text.render_chat(&[ChatMessage::new("user", "Count to 1234, please.")]).expect("renders");
    assert!(
        rendered.starts_with("<|im_start|>system\n") && rendered.ends_with("<|im_start|>assistant\n"),
        "{rendered}"
    );
    let tok = text.tokenizer();
    let ids = tok.encode_chat(&rendered);
    let start = tok.encode("<|im_start|>");
    assert_eq!(start.len(), 1, "one special token: {start:?}");
    assert_eq!(ids.iter().filter(|&&i| i == start[0]).count(), 3, "three turns open: {ids:?}");
    assert_eq!(tok.decode(&ids), rendered);
    let digits = tok.encode_ordinary(" 1234");
    assert_eq!(digits.len(), 5, "a space and Qwen's digits one by one: {digits:?}");
}

/// Qwen 3's thinking markers are tokens of their own, user-defined (Qwen 3's vocabulary is Qwen 2.5's and these,
/// as 151667 and 151668), which no text spells: a grammar held after the thinking (`Thinking::Optional`, Qwen 3's
/// way) lets the answer open the block with `<think>` and close it with `</think>`, any text and tokens between but
/// the end of generation, then holds the answer to the grammar; text that only spells the marker does not close it.
#[test]
fn a_grammar_after_the_thinking_knows_the_markers_as_special_tokens() {
    use engine::gguf::{GgufWriter, MetaArray, MetaValue};
    use engine::grammar::{Grammar, Grammars, Thinking};
    let qwen2 = GgufFile::open(&models().join("ggml-vocab-qwen2.gguf")).expect("a vocabulary GGUF");
    let mut w = GgufWriter::new();
    for (key, value) in qwen2.metadata() {
        let value = match (key.as_str(), value.clone()) {
            ("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::String(mut t))) => {
                // Padded past Qwen 2.5's 151,665 tokens; Qwen 3 puts its four new ones first in the padding.
                assert!(t[151_665].starts_with("[PAD"), "{}", t[151_665]);
                for (i, s) in ["<tool_response>", "</tool_response>", "<think>", "</think>"].into_iter().enumerate() {
                    t[151_665 + i] = s.to_string();
                }
                MetaValue::Array(MetaArray::String(t))
            }
            ("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(mut t))) => {
                t[151_665..151_669].fill(4);
                MetaValue::Array(MetaArray::I32(t))
            }
            (_, v) => v,
        };
        w.meta(key, value);
    }
    let path = std::env::temp_dir().join(format!("tandem-qwen3-vocab-{}.gguf", std::process::id()));
    w.write(&path).expect("writes");
    let text = engine::text::TextModel::open(&path).expect("a text model");
    std::fs::remove_file(&path).expect("removes");
    let text = std::sync::Arc::new(text);
    let tok = text.tokenizer();
    let (open, close) = (tok.special_id("<think>").expect("<think>"), tok.special_id("</think>").expect("</think>"));
    assert_eq!((open, close), (151_667, 151_668));
    let eog = tok.special().end_of_generation.clone();
    let grammars = Grammars::new(std::sync::Arc::clone(&text));
    let allowed = |generated: &[u32], thinking| {
        let mut m = grammars.matcher(&Grammar::JsonObject, thinking, generated).expect("takes the tokens");
        let mut logits = vec![0.0f32; tok.vocab_size()];
        m.mask(&mut logits).expect("a mask");
        move |id: u32| logits[id as usize] > f32::NEG_INFINITY
    };
    let [brace] = tok.encode_ordinary("{")[..] else { panic!("one token") };
    let [word] = tok.encode_ordinary("Hmm")[..] else { panic!("one token") };
    // At the start: the block's opening or the answer's.
    let start = allowed(&[], Thinking::Optional);
    assert!(start(open) && start(brace) && !start(word) && !start(close));
    // Inside: anything but the end of generation.
    let inside = allowed(&[open, word], Thinking::Optional);
    assert!(inside(word) && inside(brace) && inside(close) && inside(open));
    assert!(eog.iter().all(|&e| !inside(e)), "the thinking ends before the output can");
    // The marker spelled as text does not close it; its token does.
    let spelled = [&[open][..], &tok.encode_ordinary("Hmm.</think>")].concat();
    assert!(allowed(&spelled, Thinking::Optional)(word), "still thinking");
    let after = allowed(&[open, word, close], Thinking::Optional);
    assert!(after(brace) && !after(word) && !after(open));
    // Open: thinking from the first token.
    let opened = allowed(&[], Thinking::Open);
    assert!(opened(word) && opened(close));
    assert!(allowed(&[word, close], Thinking::Open)(brace));
}

/// A Gemma 4 GGUF serves as a router's text model: its own chat template renders a conversation (it defines macros,
/// which the template engine takes as transformers' does), the prompt starts with one BOS (the template writes it;
/// none is added again), its turn markers are its special tokens, and its turn's end ends a generation.
#[test]
fn a_gemma_4_vocabulary_renders_and_tokenizes_a_conversation() {
    use engine::chat::ChatMessage;
    let text = engine::text::TextModel::open(&models().join("ggml-vocab-gemma-4.gguf")).expect("a text model");
    let messages = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Count to 3, please.")];
    let rendered = text.render_chat(&messages).expect("renders");
    let turns = "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nCount to 3, please.<turn|>\n<|turn>model\n";
    assert!(rendered.starts_with(turns), "{rendered}");
    let tok = text.tokenizer();
    let ids = tok.encode_chat(&rendered);
    let bos = tok.added_bos().expect("Gemma 4's prompts start with BOS");
    assert_eq!(ids.iter().filter(|&&i| i == bos).count(), 1, "{ids:?}");
    assert_eq!(ids[0], bos);
    let [turn] = tok.encode("<|turn>")[1..] else { panic!("one token") };
    assert_eq!(ids.iter().filter(|&&i| i == turn).count(), 3, "three turns open: {ids:?}");
    let [end] = tok.encode("<turn|>")[1..] else { panic!("one token") };
    assert!(tok.is_end_of_generation(end));
    assert_eq!(tok.decode(&ids), rendered);
}

/// Gemma 4's thinking channel markers are its own control tokens: a grammar held after the channel
/// (`Thinking::Channel`) lets the answer open it with `<|channel>` and close it with `<channel|>`, any tokens between
/// but the end of generation, then holds the answer to the grammar; an answer that opens no channel is the grammar's
/// from its first token.
#[test]
fn a_grammar_after_gemma_4s_channel_knows_its_markers() {
    use engine::grammar::{Grammar, Grammars, Thinking};
    let text = engine::text::TextModel::open(&models().join("ggml-vocab-gemma-4.gguf")).expect("a text model");
    let text = std::sync::Arc::new(text);
    let tok = text.tokenizer();
    let open = tok.special_id("<|channel>").expect("<|channel> is a token");
    let close = tok.special_id("<channel|>").expect("<channel|> is a token");
    let eog = tok.special().end_of_generation.clone();
    let grammars = Grammars::new(std::sync::Arc::clone(&text));
    let allowed = |generated: &[u32]| {
        let mut m = grammars.matcher(&Grammar::JsonObject, Thinking::Channel, generated).expect("takes the tokens");
        let mut logits = vec![0.0f32; tok.vocab_size()];
        m.mask(&mut logits).expect("a mask");
        move |id: u32| logits[id as usize] > f32::NEG_INFINITY
    };
    let one = |s: &str| match tok.encode_ordinary(s)[..] {
        [id] => id,
        ref ids => panic!("{s:?} is {ids:?}"),
    };
    let (brace, word) = (one("{"), one("thought"));
    let start = allowed(&[]);
    assert!(start(open) && start(brace) && !start(word) && !start(close));
    let inside = allowed(&[open, word]);
    assert!(inside(word) && inside(brace) && inside(close));
    assert!(eog.iter().all(|&e| !inside(e)), "the channel closes before the output can end");
    let after = allowed(&[open, word, close]);
    assert!(after(brace) && !after(word) && !after(open));
}
