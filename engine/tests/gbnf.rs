//! llama.cpp's own GBNF grammars (its `grammars/` directory, in the source `scripts/llama-cpp.sh` fetches from PyPI)
//! converted to Lark ([`engine::gbnf`]) compile against the model's vocabulary and hold: sentences of each are taken
//! whole, others are refused or left unfinished.

mod common;

use std::sync::Arc;

use engine::grammar::{Grammar, Grammars, Thinking};

#[test]
fn llama_cpps_grammars_compile_and_hold_as_lark() {
    let dir = common::llama_cpp_models().parent().expect("the source").join("grammars");
    let text = Arc::new(engine::text::TextModel::open(&common::model_path()).expect("the model"));
    let grammars = Grammars::new(Arc::clone(&text));
    let files = common::files(&dir, "gbnf");
    assert!(files.len() >= 8, "{files:?}");
    // (file, sentences, non-sentences) for the grammars whose language is easy to write down.
    let samples: &[(&str, &[&str], &[&str])] = &[
        (
            "json.gbnf",
            &[r#"{"a": [1, 2.5e3, "x\n"], "b": {"c": null}}"#, "{}"],
            &[r#"{"a" 1}"#, "[1]", r#"{"a": tru}"#],
        ),
        // Its array puts a line break after `[` and each comma.
        ("json_arr.gbnf", &["[\n{\"a\": 1},\n\"b\"]", "[\n]"], &[r#"{"a": 1}"#, "[1]", "[\n1,]"]),
        // Its operators take no space after them.
        ("arithmetic.gbnf", &["x +1 = 2\n", "a*(b -3) = c\ny = 4\n"], &["= 1\n", "x = 1", "x + 1 = 2\n"]),
        ("list.gbnf", &["- milk\n- eggs\n"], &["milk\n", "- \n"]),
        ("chess.gbnf", &["1. e4 e5\n2. Nf3 Nc6\n"], &["1. e9 e5\n2. d4 d5\n", "e4 e5\n"]),
    ];
    for file in &files {
        let name = file.file_name().expect("a name").to_string_lossy().into_owned();
        let gbnf = std::fs::read_to_string(file).expect("a grammar");
        assert!(engine::gbnf::is_gbnf(&gbnf), "{name}");
        let lark = engine::gbnf::to_lark(&gbnf).unwrap_or_else(|e| panic!("{name}: {e}"));
        let grammar = Grammar::Gbnf(gbnf);
        grammars.matcher(&grammar, Thinking::None, &[]).unwrap_or_else(|e| panic!("{name}: {e}\n{lark}"));
        let Some((_, good, bad)) = samples.iter().find(|(f, ..)| *f == name) else { continue };
        let whole = |s: &str| {
            let tokens = text.tokenizer().encode(s);
            grammars.matcher(&grammar, Thinking::None, &tokens).is_ok_and(|mut m| m.may_end())
        };
        for s in *good {
            assert!(whole(s), "{name} takes {s:?}\n{lark}");
        }
        for s in *bad {
            assert!(!whole(s), "{name} does not take {s:?}\n{lark}");
        }
    }
}
