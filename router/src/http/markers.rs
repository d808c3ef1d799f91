//! What a parser reading a streamed answer holds back: an end of the text so far that may be the start of a marker
//! it looks for, until the next piece shows whether it is one (the reasoning split, the harmony reader, the tool-call
//! scan); and, for their tests, a text cut into streamed pieces.

/// How long the longest end of `text` is that is the start, not the whole, of one of `markers` (0 when none).
pub fn held(text: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .filter_map(|m| (1..m.len()).rev().find(|&k| m.is_char_boundary(k) && text.ends_with(&m[..k])))
        .max()
        .unwrap_or(0)
}

/// `text` cut into streamed pieces of `cuts` characters, taken in turn (and again from the first).
#[cfg(test)]
pub fn pieces(text: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut at = 0;
    for cut in cuts.iter().cycle() {
        if at >= chars.len() {
            break;
        }
        let end = (at + cut.max(&1)).min(chars.len());
        out.push(chars[at..end].iter().collect());
        at = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_that_may_start_a_marker_is_held() {
        assert_eq!(held("Hmm </thi", &["</think>"]), 5);
        assert_eq!(held("Hmm </think>", &["</think>"]), 0, "a whole marker is found, not held");
        assert_eq!(held("a<|e", &["<|end|>", "<|start|>"]), 3);
        assert_eq!(held("a<|s", &["<|end|>", "<|start|>"]), 3);
        assert_eq!(held("plain", &["<|end|>"]), 0);
        // Within a multi-byte marker only whole characters are compared.
        let marker = "<｜tool▁calls▁begin｜>";
        assert_eq!(held("text<｜tool", &[marker]), "<｜tool".len());
        assert_eq!(held("é", &[marker]), 0);
    }
}
