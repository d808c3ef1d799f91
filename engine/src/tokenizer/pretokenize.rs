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
