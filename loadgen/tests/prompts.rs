//! Prompts synthesized from trace block ids, through the real tokenizer: the text re-tokenizes to exactly the
//! synthesized ids, so requests sharing leading block ids share leading tokens at the server, block for block.

use engine::tokenizer::Tokenizer;
use loadgen::prompt::PromptBuilder;

fn tokenizer() -> Tokenizer {
    let path = engine::fetch::ensure_default_model(&engine::fetch::Quiet).expect("the embedded model");
    Tokenizer::from_gguf(&engine::gguf::GgufFile::open(&path).expect("opens")).expect("tokenizer")
}

#[test]
fn trace_prompts_re_tokenize_block_for_block() {
    let tok = tokenizer();
    let builder = PromptBuilder::new(tok.plain_words(), 512);
    let text = include_str!("../../data/traces/mooncake_conversation_1k.jsonl");
    let requests = loadgen::trace::parse_mooncake(text).expect("the committed sample parses");
    let mut shared_blocks = 0;
    for (i, r) in requests.iter().enumerate().take(12) {
        let p = builder.prompt(r, i, None);
        assert_eq!(p.tokens.len(), r.input_length);
        let again = tok.encode(&tok.decode(&p.tokens));
        for (b, (want, got)) in p.tokens.chunks(512).zip(again.chunks(512)).enumerate() {
            assert_eq!(want, got, "request {i}, block {b}: the text does not re-tokenize to its ids");
        }
        assert_eq!(again.len(), p.tokens.len());
        // Every request of the sample starts with block id 0: the same 512 tokens.
        if r.hash_ids.first() == Some(&0) {
            assert_eq!(p.tokens[..512], builder.block(0).collect::<Vec<_>>()[..]);
            shared_blocks += 1;
        }
    }
    assert!(shared_blocks > 1, "the sample shares prefixes");
}

#[test]
fn a_literal_prompt_is_sent_as_its_own_tokens() {
    let tok = tokenizer();
    let builder = PromptBuilder::new(tok.plain_words(), 512);
    let text =
        "{\"timestamp\": 0, \"text_input\": \"Explain quantum computing in simple terms.\", \"output_length\": 9}\n";
    let mut requests = loadgen::trace::parse_mooncake(text).expect("parses");
    loadgen::trace::tokenize_literals(&mut requests, &tok);
    let want = tok.encode("Explain quantum computing in simple terms.");
    assert_eq!(requests[0].input_length, want.len(), "its length is its token count");
    let p = builder.prompt(&requests[0], 0, None);
    assert_eq!((p.tokens.clone(), p.clipped), (want.clone(), false));
    let cut = builder.prompt(&requests[0], 0, Some(3));
    assert_eq!((cut.tokens.as_slice(), cut.clipped), (&want[..3], true), "cut to the longest prompt allowed");
}
