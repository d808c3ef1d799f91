//! Pre-tokenizers, by the GGUF's `tokenizer.ggml.pre` name: GPT-2-style vocabularies (`smollm`, `gpt2`,
//! `starcoder` and kin: every digit on its own, then GPT-2's split into contractions, letter runs, number runs,
//! other-symbol runs and whitespace), and Llama 3's and Qwen 2's patterns (contractions in any case, a letter run
//! with one leading non-letter, digits in threes or one by one, symbol runs with their line breaks, line breaks with
//! the whitespace before them), and DeepSeek V3's (digits in threes, then runs of Chinese and Japanese characters,
//! each isolated, then a pattern of its own over what is left), Mistral's Tekken (letter runs cut at a change from
//! lower to upper case, every digit on its own, symbol runs with their line breaks and slashes), and GPT-4o's
//! (o200k: Tekken's, with contractions kept on their word and digits in threes), Kimi K2's (GPT-4o's, with Han
//! characters in runs of their own) and Seed-Coder's (Qwen 2's, symbol runs without their line breaks). Each pattern is checked against
//! Python's `regex` module, which applies look-aheads itself (`engine/tests/hf_vocabularies.rs`).

use std::sync::OnceLock;

use regex::Regex;

use super::TokenizerError;

/// Pre-tokenizers whose rule is "isolate digits, then GPT-2's pattern".
const DIGITS_THEN_GPT2: &[&str] = &["smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r"];
/// Pre-tokenizers whose rule is GPT-2's pattern alone.
const GPT2_ONLY: &[&str] = &["gpt2", "gpt-2", "default"];

/// GPT-2's pattern without its one look-ahead (`\s+(?!\S)`), which [`split_gpt2`] applies by hand.
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// Llama 3's names (llama.cpp's `LLAMA3` pre-tokenizer type, and `glm4`/`glm5` for GLM 4.5 on, which llama.cpp
/// splits by the same pattern, whole pieces first, and starts without BOS: [`NO_BOS`]).
const LLAMA3: &[&str] = &["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "glm4", "glm5"];
/// Vocabularies whose prompts never start with a BOS, whatever their files say (GLM's templates write `[gMASK]<sop>`
/// themselves; llama.cpp drops their BOS the same way).
pub const NO_BOS: &[&str] = &["glm4", "glm5"];
/// Qwen 2's (and Qwen 2.5's, Qwen 3's, the R1 distillations of Qwen's).
const QWEN2: &[&str] = &["qwen2", "deepseek-r1-qwen"];

/// Llama 3's pattern as Hugging Face's `tokenizer.json` states it; [`split_pattern`] applies its look-ahead
/// (`\s+(?!\S)`) by hand.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 3.5's: Qwen 2's, with combining marks (`\p{M}`) counted with letters.
pub const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's: Llama 3's, with every digit on its own.
pub const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's Tekken vocabularies' (Mistral NeMo's and later; `config.pattern` in `tekken.json`, Hugging Face's
/// conversion states the same): a letter run of upper-case letters then lower-case ones, or upper-case ones alone
/// (title case, modifiers, other letters and marks on both sides), with one leading character that is neither a
/// letter, a digit nor a line break; each digit alone; a symbol run with the line breaks and slashes after it; line
/// breaks with the whitespace before them; whitespace. No contractions.
pub const TEKKEN_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's (OpenAI's o200k vocabulary: gpt-oss's, and Llama 4's and MiniMax M2's, whose GGUFs llama.cpp names
/// `llama4` and `minimax-m2`): Tekken's, with a contraction (in any case) ending a letter run and digits in threes.
pub const GPT4O_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's names (llama.cpp's `GPT4O` pre-tokenizer type).
const GPT4O: &[&str] = &["gpt-4o", "llama4", "minimax-m2"];

/// Kimi K2's (`tokenization_kimi.py`, tiktoken's; llama.cpp's `kimi-k2`): a run of Han characters, then GPT-4o's
/// pattern with Han characters taken out of its letter classes, and symbol runs without slashes.
pub const KIMI_K2_PATTERN: &str = r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Seed-Coder's (ByteDance Seed's vocabularies; llama.cpp's `seed-coder`): Qwen 2's, with a symbol run that stops
/// at a line break instead of taking the line breaks after it.
pub const SEED_CODER_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek V3's (and V3.1's, R1's, V4's) three splits, as its `tokenizer.json` states them, applied one after the
/// other (each to every piece the one before made, its matches isolated): digits in threes; runs of CJK ideographs,
/// hiragana and katakana; then a punctuation mark that leads ASCII letters, a letter run (with combining marks) with
/// one leading character that is no letter, punctuation or symbol, punctuation and symbol runs with their line
/// breaks, line breaks with the whitespace before them, and whitespace.
pub const DEEPSEEK_V3_PATTERNS: [&str; 3] = [
    r"\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// A vocabulary's pre-tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pre {
    /// Every digit on its own, then GPT-2's pattern.
    DigitsThenGpt2,
    Gpt2,
    Llama3,
    Qwen2,
    Qwen35,
    DeepSeekV3,
    Tekken,
    Gpt4o,
    KimiK2,
    SeedCoder,
}

impl Pre {
    /// The pre-tokenizer `name` names, or an error when this module does not implement it.
    pub fn of(name: &str) -> Result<Pre, TokenizerError> {
        match name {
            n if DIGITS_THEN_GPT2.contains(&n) => Ok(Pre::DigitsThenGpt2),
            n if GPT2_ONLY.contains(&n) => Ok(Pre::Gpt2),
            n if LLAMA3.contains(&n) => Ok(Pre::Llama3),
            n if QWEN2.contains(&n) => Ok(Pre::Qwen2),
            "qwen35" => Ok(Pre::Qwen35),
            "deepseek-v3" => Ok(Pre::DeepSeekV3),
            "tekken" => Ok(Pre::Tekken),
            n if GPT4O.contains(&n) => Ok(Pre::Gpt4o),
            "kimi-k2" => Ok(Pre::KimiK2),
            "seed-coder" => Ok(Pre::SeedCoder),
            n => Err(TokenizerError::UnsupportedPre(n.to_string())),
        }
    }

    /// Whether a piece that is a whole token of the vocabulary is that token, merges or not (Llama 3's
    /// `ignore_merges`, as Hugging Face's tokenizer and llama.cpp apply it; tiktoken, which Tekken and Kimi K2
    /// vocabularies are encoded with, looks a piece up whole before merging too: llama.cpp reads a Kimi K2 GGUF
    /// without this, and Kimi's own tokenizer, which vLLM runs, with it).
    pub fn ignores_merges(self) -> bool {
        matches!(self, Pre::Llama3 | Pre::Tekken | Pre::KimiK2)
    }

    /// The patterns Hugging Face's `tokenizer.json` states for it, each an isolating split applied after the one
    /// before, when it is not GPT-2's.
    pub fn patterns(self) -> &'static [&'static str] {
        match self {
            Pre::Llama3 => &[LLAMA3_PATTERN],
            Pre::Qwen2 => &[QWEN2_PATTERN],
            Pre::Qwen35 => &[QWEN35_PATTERN],
            Pre::DeepSeekV3 => &DEEPSEEK_V3_PATTERNS,
            Pre::Tekken => &[TEKKEN_PATTERN],
            Pre::Gpt4o => &[GPT4O_PATTERN],
            Pre::KimiK2 => &[KIMI_K2_PATTERN],
            Pre::SeedCoder => &[SEED_CODER_PATTERN],
            Pre::DigitsThenGpt2 | Pre::Gpt2 => &[],
        }
    }

    /// Calls `piece` for every pre-token of `text`, in order.
    pub fn split(self, text: &str, piece: impl FnMut(&str)) {
        match self {
            Pre::DigitsThenGpt2 => split(text, piece),
            Pre::Gpt2 => {
                let mut piece = piece;
                split_gpt2(text, &mut piece);
            }
            Pre::Llama3 => split_pattern(pattern_regex(&LLAMA3_RE, LLAMA3_PATTERN), text, piece),
            Pre::Qwen2 => split_pattern(pattern_regex(&QWEN2_RE, QWEN2_PATTERN), text, piece),
            Pre::Qwen35 => split_pattern(pattern_regex(&QWEN35_RE, QWEN35_PATTERN), text, piece),
            Pre::DeepSeekV3 => split_deepseek_v3(text, piece),
            Pre::Tekken => split_pattern(pattern_regex(&TEKKEN_RE, TEKKEN_PATTERN), text, piece),
            Pre::Gpt4o => split_pattern(pattern_regex(&GPT4O_RE, GPT4O_PATTERN), text, piece),
            Pre::KimiK2 => split_pattern(pattern_regex(&KIMI_K2_RE, KIMI_K2_PATTERN), text, piece),
            Pre::SeedCoder => split_pattern(pattern_regex(&SEED_CODER_RE, SEED_CODER_PATTERN), text, piece),
        }
    }
}

/// DeepSeek V3's splits ([`DEEPSEEK_V3_PATTERNS`]): the first two isolate their matches (and leave the text between
/// them whole), the third cuts each piece as Llama 3's pattern does.
fn split_deepseek_v3(text: &str, mut piece: impl FnMut(&str)) {
    static DIGITS: OnceLock<Regex> = OnceLock::new();
    static CJK: OnceLock<Regex> = OnceLock::new();
    static REST: OnceLock<Regex> = OnceLock::new();
    let compile = |cell: &'static OnceLock<Regex>, pattern: &str| {
        cell.get_or_init(|| Regex::new(pattern).expect("the pre-tokenizer's pattern is a valid regex"))
    };
    let (digits, cjk) = (compile(&DIGITS, DEEPSEEK_V3_PATTERNS[0]), compile(&CJK, DEEPSEEK_V3_PATTERNS[1]));
    let rest = pattern_regex(&REST, DEEPSEEK_V3_PATTERNS[2]);
    isolate(digits, text, &mut |p| isolate(cjk, p, &mut |p| split_pattern(rest, p, &mut piece)));
}

/// Cuts `text` at each match of `re`: the matches and the stretches between them are the pieces.
fn isolate(re: &Regex, text: &str, piece: &mut impl FnMut(&str)) {
    let mut pos = 0;
    for m in re.find_iter(text) {
        if m.start() > pos {
            piece(&text[pos..m.start()]);
        }
        piece(m.as_str());
        pos = m.end();
    }
    if pos < text.len() {
        piece(&text[pos..]);
    }
}

static LLAMA3_RE: OnceLock<Regex> = OnceLock::new();
static QWEN2_RE: OnceLock<Regex> = OnceLock::new();
static QWEN35_RE: OnceLock<Regex> = OnceLock::new();
static TEKKEN_RE: OnceLock<Regex> = OnceLock::new();
static GPT4O_RE: OnceLock<Regex> = OnceLock::new();
static KIMI_K2_RE: OnceLock<Regex> = OnceLock::new();
static SEED_CODER_RE: OnceLock<Regex> = OnceLock::new();

/// `pattern` compiled without its look-ahead alternative, which [`split_pattern`] applies, and with its
/// contractions' case spelled out in ASCII (as llama.cpp matches them: Unicode case folding would also take `'ſ`).
fn pattern_regex(cell: &'static OnceLock<Regex>, pattern: &str) -> &'static Regex {
    cell.get_or_init(|| {
        let plain = pattern
            .replace(r"|\s+(?!\S)", "")
            .replace("(?i:'s|'t|'re|'ve|'m|'ll|'d)", "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])");
        Regex::new(&plain).expect("the pre-tokenizer's pattern is a valid regex")
    })
}

/// Splits by a Llama 3-style pattern. Its `\s+(?!\S)` alternative (a whitespace run not followed by a non-space)
/// is applied to what the plain `\s+` alternative matched: a run of two or more without a line break (one with a
/// line break is taken by `\s*[\r\n]+` before) that more text follows gives its last character to the next piece.
/// Text no alternative matches (none in Llama 3's and Qwen's; a digit or a control character in DeepSeek V3's) is a
/// piece of its own, as Hugging Face's isolating split leaves it.
fn split_pattern(re: &Regex, text: &str, mut piece: impl FnMut(&str)) {
    let mut pos = 0;
    while let Some(m) = re.find_at(text, pos) {
        if m.start() > pos {
            piece(&text[pos..m.start()]);
        }
        let run = m.as_str();
        let mut end = m.end();
        if end < text.len()
            && run.chars().all(char::is_whitespace)
            && !run.contains(['\r', '\n'])
            && run.chars().nth(1).is_some()
            && let Some((last, _)) = run.char_indices().next_back()
        {
            end = m.start() + last;
        }
        piece(&text[m.start()..end]);
        pos = end;
    }
    if pos < text.len() {
        piece(&text[pos..]);
    }
}

fn gpt2() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(GPT2_PATTERN).expect("the GPT-2 pattern is a valid regex"))
}

/// Calls `piece` for every pre-token of `text` as a vocabulary that isolates digits splits it: each digit on its own,
/// GPT-2's pattern between them. (GPT-2's own keeps `\p{N}+` runs, as llama.cpp's tests of its vocabulary expect.)
fn split(text: &str, mut piece: impl FnMut(&str)) {
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c.is_numeric() {
            split_gpt2(&text[start..i], &mut piece);
            piece(&text[i..i + c.len_utf8()]);
            start = i + c.len_utf8();
        }
    }
    split_gpt2(&text[start..], &mut piece);
}

fn split_gpt2(text: &str, piece: &mut impl FnMut(&str)) {
    if text.is_ascii() {
        return split_gpt2_ascii(text, piece);
    }
    split_gpt2_regex(text, piece);
}

/// GPT-2's split by its pattern: the reference, and the way for text beyond ASCII.
fn split_gpt2_regex(text: &str, piece: &mut impl FnMut(&str)) {
    let re = gpt2();
    let mut pos = 0;
    while let Some(m) = re.find_at(text, pos) {
        let mut end = m.end();
        // `\s+(?!\S)`: a whitespace run followed by a non-space gives its last character to the next piece,
        // unless the run is a single character (then the plain `\s+` alternative takes it).
        let run = m.as_str();
        if end < text.len()
            && run.chars().all(char::is_whitespace)
            && run.chars().nth(1).is_some()
            && let Some((last, _)) = run.char_indices().next_back()
        {
            end = m.start() + last;
        }
        piece(&text[m.start()..end]);
        pos = end;
    }
}

/// What [`GPT2_PATTERN`] and the look-ahead rule of [`split_gpt2`] make of ASCII text, without the regex: the
/// pattern's alternatives tried in its order at each position (the first that matches wins, each taking all it
/// can). On ASCII, `\p{L}` is `[A-Za-z]`, `\p{N}` is `[0-9]` and `\s` is `[\t\n\x0B\x0C\r ]`. A router
/// tokenizes every prompt: the regex's forward and reverse searches per piece were most of that time.
fn split_gpt2_ascii(text: &str, piece: &mut impl FnMut(&str)) {
    #[derive(PartialEq)]
    enum Class {
        Letter,
        Digit,
        Space,
        Other,
    }
    let class = |b: u8| match b {
        b'A'..=b'Z' | b'a'..=b'z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ' => Class::Space,
        _ => Class::Other,
    };
    let bytes = text.as_bytes();
    // The end of the run of `c` from `i` on.
    let run = |mut i: usize, c: Class| {
        while i < bytes.len() && class(bytes[i]) == c {
            i += 1;
        }
        i
    };
    let mut pos = 0;
    while pos < bytes.len() {
        let rest = &bytes[pos..];
        let contraction =
            [&b"'s"[..], b"'t", b"'re", b"'ve", b"'m", b"'ll", b"'d"].into_iter().find(|c| rest.starts_with(c));
        // ` ?` takes a leading space only when the run it starts follows it.
        let spaced = usize::from(rest[0] == b' ' && rest.len() > 1 && class(rest[1]) != Class::Space);
        let end = match (contraction, class(rest[spaced])) {
            (Some(c), _) => pos + c.len(),
            (None, Class::Space) => {
                let end = run(pos, Class::Space);
                // `\s+(?!\S)`: a run of two or more followed by more text leaves its last character to the next piece.
                if end < bytes.len() && end - pos > 1 { end - 1 } else { end }
            }
            (None, c) => run(pos + spaced, c),
        };
        piece(&text[pos..end]);
        pos = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split(text, |p| out.push(p.to_string()));
        out
    }

    #[test]
    fn splits_like_the_reference() {
        assert_eq!(pieces("Hello world"), ["Hello", " world"]);
        assert_eq!(pieces("a   b"), ["a", "  ", " b"]);
        assert_eq!(pieces("a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(pieces("x 123"), ["x", " ", "1", "2", "3"]);
        assert_eq!(pieces("it's"), ["it", "'s"]);
        assert_eq!(pieces("end  "), ["end", "  "]);
    }

    proptest::proptest! {
        /// The ASCII splitter cuts every ASCII text where the pattern does: contractions and their near misses,
        /// every kind of whitespace run, leading spaces before each class, control characters.
        #[test]
        fn the_ascii_splitter_cuts_where_the_pattern_does(text in r"([ 'srtevmld\t\n\r\x0B\x0CAZaz09?(_\x00\x1C\x7F]|'s|'t|'re|'ve|'m|'ll|'d| '|  ){0,40}") {
            let (mut fast, mut reference) = (Vec::new(), Vec::new());
            split_gpt2_ascii(&text, &mut |p| fast.push(p.to_string()));
            split_gpt2_regex(&text, &mut |p| reference.push(p.to_string()));
            proptest::prop_assert_eq!(fast, reference);
        }
    }
}
