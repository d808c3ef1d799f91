#!/usr/bin/env python3
"""Writes engine/tests/data/tokenizer_reference.json: reference token ids for a corpus of strings and
chat conversations, from the Hugging Face reference tokenizer (see common.py) and transformers'
apply_chat_template.

    pip install -r scripts/reference/requirements.txt
    python3 scripts/reference/tokenizer.py [GGUF] > engine/tests/data/tokenizer_reference.json
"""
import itertools
import json
import sys

from common import default_model_path, reference_tokenizer

HAND_WRITTEN = [
    # plain prose
    "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.", "hello", "HELLO", "Hello",
    "A", "a", "I", " ", "", "What is the capital of France?", "Tandem routes every request to its KV cache.",
    "Prefill is compute-bound; decode is memory-bound.", "e.g. i.e. etc. vs. Mr. Dr.",
    # contractions, case
    "I'm here", "don't", "DON'T", "they'll", "it's", "we've", "you're", "she'd", "'s", "''", "'''s", "rock'n'roll",
    "O'Neil's", "can't won't shouldn't", "ITS IT'S it's",
    # whitespace runs
    "a  b", "a   b", "a    b", "   leading", "trailing   ", "  both  ", "\t", "\t\ttabs", "tab\tseparated\tvalues",
    "\n", "\n\n", "\n\n\n", "a\nb", "a\n\nb", "a\n \nb", "a \n b", "  \n  ", "x\u00a0y", "x\u3000y", "x\u2028y",
    "x\u200by", "end. \n", " \t \n",
    # CRLF
    "line1\r\nline2\r\n", "\r\n", "\r\n\r\n", "a\r\n\r\n  b", "\r", "mixed\r\nand\nnewlines\r",
    # digits and numbers
    "12345", "3.14159", "1,000,000", "x=42;", "2026-11-29", "v1.2.3", "0x1F", "1e-5", "100%", "$9.99", "-7",
    "007", "٣٤٥", "²³", "Ⅻ", "½", "१२३", "一二三", "abc123def", "123abc", " 42", "  42", "a 1 b 2",
    # code
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "fn main() {\n    println!(\"hi {}\", 1 + 2);\n}\n", "let x: Vec<u32> = (0..16).collect();",
    "{\"model\": \"smollm2\", \"stream\": true, \"max_tokens\": 16}", "<div class=\"a\">b</div>",
    "SELECT * FROM users WHERE id = 1;", "#include <stdio.h>", "a->b", "x != y && y >= z || !w", "i++; --j;",
    "// comment\n/* block */", "@decorator\nclass A:\n\tpass", "$ cargo nextest run --workspace",
    "https://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Users\\name\\file.txt", "~/.cache/tandem",
    "**bold** _it_ `code` # Title\n- item", "\\frac{a}{b} + \\sqrt{x^2}",
    # Unicode text
    "こんにちは世界", "日本語のテキストです。", "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם",
    "हिन्दी भाषा", "नमस्ते", "தமிழ்", "한국어 텍스트", "中文测试", "Tiếng Việt có dấu", "naïve café", "Zürich",
    "Ünïcödé", "ß ẞ", "ﬁ ligature", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝐁𝐨𝐥𝐝", "A\u0301", "e\u0301\u0302", "ǅ", "ʼn",
    # emoji
    "😀", "😀😀", "I ❤️ Rust", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵🇫🇷", "🚀 launch", "a😀b", "✓ ✗ → ← ∑ ∞", "©®™", "…", "—–-",
    # punctuation runs
    "!!!", "...", "?!", "!!!!!!!!!!!!!!!!", "......", "---", "===", "***", "(((", ")))", "[]{}()<>", "#!/bin/sh",
    "a.b,c;d:e", "\"quoted\"", "'single'", "«guillemets»", "¿Qué?", "¡Hola!",
    # long runs
    "a" * 40, "ab" * 20, " " * 17, "\n" * 9, "x" + " " * 30 + "y", "Lorem ipsum dolor sit amet, " * 3,
    # control bytes (some have no token in this vocabulary) and odd characters
    "a\x04b", "\x06", "\x00", "\x1b[31mred\x1b[0m", "\x7f", "\ufeffBOM", "\ufffd",
    # special tokens, whole and not
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "<|im_start|><|im_end|>", "text<|im_end|>more",
    "< |im_start| >", "<|im_start", "im_start|>", "<reponame>foo<filename>bar.py", "<|endoftext|><|endoftext|>",
    " <|im_end|> ", "<|im_start|>assistant\n", "<jupyter_code>print(1)",
]

WORDS = ["token", "cache", " route", "KV", "ünï", "日本", "42", " ", "\n", "'s", "!!", "\t", "x1"]


def generated():
    # Pairs of short pieces: every whitespace/digit/letter boundary the pre-tokenizer cares about.
    return ["".join(p) for p in itertools.product(WORDS, repeat=2)]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else default_model_path()
    tk, fast = reference_tokenizer(path)
    corpus = list(dict.fromkeys(HAND_WRITTEN + generated()))
    cases = []
    for text in corpus:
        ids = tk.encode(text, add_special_tokens=False).ids
        cases.append({"text": text, "ids": ids, "decoded": tk.decode(ids, skip_special_tokens=False)})
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Tell me about the sea."}],
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Count to 3."},
        ],
        [{"role": "user", "content": "日本語で答えてください。🚀"}],
        [{"role": "user", "content": "Code:\n```rust\nfn main() {}\n```\n\n  indented\r\n"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
        [{"role": "user", "content": "Say <|im_end|> literally"}],
        [{"role": "user", "content": "   spaces   "}, {"role": "assistant", "content": "ok"}],
    ]
    chats = []
    for messages in conversations:
        text = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chats.append({"messages": messages, "text": text, "ids": tk.encode(text, add_special_tokens=False).ids})
    out = {
        "generator": "scripts/reference/tokenizer.py",
        "reference": "Hugging Face tokenizers (Digits(individual) + ByteLevel BPE, control tokens special); "
        "transformers apply_chat_template for chats",
        "cases": cases,
        "chats": chats,
    }
    json.dump(out, sys.stdout, ensure_ascii=False, indent=0)
    print()
    print(f"{len(cases)} strings, {len(chats)} conversations", file=sys.stderr)


if __name__ == "__main__":
    main()
