//! The tokenizer and chat template against the reference (Hugging Face tokenizers and transformers'
//! apply_chat_template), on the committed corpus made by `scripts/reference/tokenizer.py`.

mod common;

use engine::chat::{ChatMessage, ChatTemplate};
use engine::tokenizer::{StreamDecoder, Tokenizer};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&common::model_file()).expect("tokenizer builds")
}

#[test]
fn corpus_ids_match_the_reference_exactly() {
    let tok = tokenizer();
    let reference = common::data("tokenizer_reference.json");
    let cases = reference["cases"].as_array().expect("cases");
    assert!(cases.len() >= 200, "the corpus has at least 200 strings");
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want = common::ids(&case["ids"]);
        let got = tok.encode(text);
        assert_eq!(tok.encode(text), got, "encoding {text:?} again (its pieces now cached) gives the same ids");
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        assert_eq!(tok.decode(&want), case["decoded"].as_str().expect("decoded"), "decoding {text:?}");
    }
    assert!(failures.is_empty(), "{} of {} strings differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn the_spec_chat_prompt_tokenizes_as_documented() {
    let ids = tokenizer().encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(ids, [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]);
}

#[test]
fn chat_template_matches_transformers() {
    let file = common::model_file();
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer builds");
    let source = file.metadata()["tokenizer.chat_template"].as_str().expect("template");
    let template = ChatTemplate::new(source, "<|im_start|>", "<|im_end|>").expect("compiles");
    let reference = common::data("tokenizer_reference.json");
    for chat in reference["chats"].as_array().expect("chats") {
        let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).expect("messages");
        let text = template.render(&messages, true).expect("renders");
        assert_eq!(text, chat["text"].as_str().expect("text"), "rendering {messages:?}");
        assert_eq!(tok.encode(&text), common::ids(&chat["ids"]), "tokenizing {text:?}");
    }
}

#[test]
fn streaming_decode_never_splits_a_character() {
    let tok = tokenizer();
    let reference = common::data("tokenizer_reference.json");
    let mut split_chars = 0;
    for case in reference["cases"].as_array().expect("cases") {
        let ids = common::ids(&case["ids"]);
        let mut dec = StreamDecoder::new();
        let mut streamed = String::new();
        for &id in &ids {
            let piece = dec.push(&tok, id);
            // A piece is a `String`, so it is valid UTF-8; count tokens that end inside a character.
            if std::str::from_utf8(tok.token_bytes(id)).is_err() {
                split_chars += 1;
            }
            streamed.push_str(&piece);
        }
        streamed.push_str(&dec.finish());
        assert_eq!(streamed, tok.decode(&ids), "streaming {:?}", case["text"]);
    }
    assert!(split_chars > 0, "the corpus has characters that span tokens");
}

#[test]
fn end_of_generation_ids_are_the_ones_llama_cpp_uses() {
    assert_eq!(tokenizer().special().end_of_generation, [0, 2, 4]);
}

#[test]
fn plain_words_re_tokenize_to_themselves_in_any_order() {
    let tok = tokenizer();
    let words = tok.plain_words();
    assert!(words.len() > 5000, "only {} plain words", words.len());
    assert!(words.iter().all(|&w| !tok.is_end_of_generation(w)));
    // A pseudo-random sequence of them, as the load generator builds prompts: the text encodes back exactly.
    let mut x = 7u64;
    let ids: Vec<u32> = (0..2000)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            words[(x >> 33) as usize % words.len()]
        })
        .collect();
    assert_eq!(tok.encode(&tok.decode(&ids)), ids);
}

#[test]
fn the_hugging_face_export_carries_the_whole_vocabulary() {
    let tok = tokenizer();
    let (json, config) = engine::tokenizer::export::hugging_face_files(&common::model_file()).expect("exports");
    let vocab = json["model"]["vocab"].as_object().expect("vocab");
    assert_eq!(vocab.len(), tok.vocab_size());
    for id in [0u32, 1, 100, 5000] {
        let text = tok.token_text(id).expect("a token");
        assert_eq!(vocab[text], id, "token {id} keeps its id");
    }
    let added: Vec<&str> =
        json["added_tokens"].as_array().expect("added").iter().filter_map(|t| t["content"].as_str()).collect();
    assert!(added.contains(&"<|im_start|>") && added.contains(&"<|im_end|>"), "{added:?}");
    assert_eq!(json["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits", "SmolLM2 isolates digits");
    assert!(config["chat_template"].as_str().is_some_and(|t| t.contains("im_start")));
}

/// Generated text: control tokens make none unless kept (vLLM's `skip_special_tokens`), and a stop string ends it,
/// cut off or kept (`include_stop_str_in_output`).
#[test]
fn generated_text_leaves_control_tokens_out_and_ends_at_stop_strings() {
    use engine::generate::TextStream;
    let tok = tokenizer();
    let ids = tok.encode("Yes.<|im_end|>\n<|im_start|>user\nHi there");
    assert!(ids.iter().filter(|&&id| tok.is_control(id)).count() == 2, "{ids:?}");
    let run = |mut s: TextStream| {
        let mut out = String::new();
        for &id in &ids {
            let (text, hit) = s.push(&tok, id);
            out.push_str(&text);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&s.finish(false));
        (out, false)
    };
    assert_eq!(run(TextStream::new(vec![])), ("Yes.\nuser\nHi there".into(), false));
    let kept = run(TextStream::new(vec![]).keeping_control(true));
    assert_eq!(kept, ("Yes.<|im_end|>\n<|im_start|>user\nHi there".into(), false));
    assert_eq!(run(TextStream::new(vec!["user".into()])), ("Yes.\n".into(), true));
    assert_eq!(run(TextStream::new(vec!["user".into()]).keeping_stop(true)), ("Yes.\nuser".into(), true));
    // The first stop string complete ends the text, though a longer one would have matched later.
    let both = TextStream::new(vec!["Hi".into(), "Hi there".into()]).keeping_stop(true);
    assert_eq!(run(both).0, "Yes.\nuser\nHi");
}

/// A model whose tokenizer adds a BOS, with a chat template that writes one too (as Llama's and Mistral's do): a
/// rendered conversation gets one BOS, not two; a template without one still gets the tokenizer's; a plain
/// prompt is encoded as before.
#[test]
fn a_conversation_gets_one_bos_where_the_template_writes_it() {
    use engine::gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
    let tokens: Vec<String> = ["<unk>", "<s>", "</s>", "a", "b", "Ġ", "[", "]"].iter().map(|t| t.to_string()).collect();
    let types = vec![2, 3, 3, 1, 1, 1, 1, 1];
    let write = |template: &str| {
        let mut w = GgufWriter::new();
        w.meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
            .meta("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::String(tokens.clone())))
            .meta("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(types.clone())))
            .meta("tokenizer.ggml.merges", MetaValue::Array(MetaArray::String(vec![])))
            .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
            .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
            .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(true))
            .meta("tokenizer.chat_template", MetaValue::String(template.into()));
        let path = std::env::temp_dir().join(format!("tandem-bos-{}-{}.gguf", std::process::id(), template.len()));
        std::fs::write(&path, w.to_bytes()).expect("write");
        let text = engine::text::TextModel::from_gguf(&GgufFile::open(&path).expect("opens")).expect("text model");
        std::fs::remove_file(&path).ok();
        text
    };
    let chat = [ChatMessage::new("user", "ab")];
    let with_bos = write("{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}");
    let rendered = with_bos.render_chat(&chat).expect("renders");
    assert_eq!(rendered, "<s>[ab]");
    let tok = with_bos.tokenizer();
    assert_eq!(tok.encode(&rendered), [1, 1, 6, 3, 4, 7], "a plain prompt: the tokenizer's BOS, then the text's");
    assert_eq!(tok.encode_chat(&rendered), [1, 6, 3, 4, 7], "a conversation: the template's BOS only");
    // As a request asks (vLLM's `add_special_tokens`), or by default as each endpoint does.
    assert_eq!(tok.encode_prompt(&rendered, true, None), tok.encode_chat(&rendered));
    assert_eq!(tok.encode_prompt(&rendered, true, Some(true)), [1, 1, 6, 3, 4, 7], "asked for: the BOS again");
    assert_eq!(tok.encode_prompt("ab", false, None), [1, 3, 4], "a completion's prompt gets the BOS");
    assert_eq!(tok.encode_prompt("ab", false, Some(false)), [3, 4], "unless asked not to");
    assert_eq!(tok.encode_prompt("ab", true, Some(false)), [3, 4]);
    let without = write("{% for m in messages %}[{{ m.content }}]{% endfor %}");
    let rendered = without.render_chat(&chat).expect("renders");
    assert_eq!(
        without.tokenizer().encode_chat(&rendered),
        [1, 6, 3, 4, 7],
        "the tokenizer's BOS where none is written"
    );
}
