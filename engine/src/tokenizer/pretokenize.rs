//! The pre-tokenizer of GPT-2-style vocabularies (`smollm`, `gpt2`, `starcoder` and kin): every digit on its own,
//! then GPT-2's split into contractions, letter runs, number runs, other-symbol runs and whitespace.

use std::sync::OnceLock;

use regex::Regex;

use super::TokenizerError;

/// Pre-tokenizers whose rule is "isolate digits, then GPT-2's pattern".
const DIGITS_THEN_GPT2: &[&str] = &["smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"];
/// Pre-tokenizers whose rule is GPT-2's pattern alone.
const GPT2_ONLY: &[&str] = &["gpt2", "default"];

/// GPT-2's pattern without its one look-ahead (`\s+(?!\S)`), which [`split_gpt2`] applies by hand.
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// An error unless `pre` names a pre-tokenizer this module implements.
pub fn check_supported(pre: &str) -> Result<(), TokenizerError> {
    if DIGITS_THEN_GPT2.contains(&pre) || GPT2_ONLY.contains(&pre) {
        Ok(())
    } else {
        Err(TokenizerError::UnsupportedPre(pre.to_string()))
    }
}

/// Whether `pre` isolates every digit before GPT-2's split.
pub fn isolates_digits(pre: &str) -> bool {
    DIGITS_THEN_GPT2.contains(&pre)
}

fn gpt2() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(GPT2_PATTERN).expect("the GPT-2 pattern is a valid regex"))
}

/// Calls `piece` for every pre-token of `text`, in order. (All supported vocabularies isolate digits: `gpt2`'s
/// own pattern never joins a digit to a letter, and `\p{N}+` runs are the only difference; see the tests.)
pub fn split(text: &str, mut piece: impl FnMut(&str)) {
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
}
