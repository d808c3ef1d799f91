//! llama.cpp's GBNF grammars (`root ::= ...`, which vLLM's `xgrammar` backend takes too) in llguidance's Lark
//! dialect, so a grammar written for either serves here: rules become Lark rules (renamed apart, `root` the start),
//! literals Lark strings, character classes and `.` regular expressions, and groups, alternatives and repetitions
//! (`*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`) stay as they are. A rule runs up to the next `name ::=`, so its
//! alternatives may span lines as llama.cpp's parser lets them.

use std::collections::HashMap;
use std::fmt::Write;

/// Why a text is not a GBNF grammar.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("GBNF: {0}")]
pub struct GbnfError(String);

fn bad<T>(why: impl Into<String>) -> Result<T, GbnfError> {
    Err(GbnfError(why.into()))
}

/// Whether `text` reads as GBNF: some line opens with a rule name and `::=` (Lark writes `name:`).
pub fn is_gbnf(text: &str) -> bool {
    text.lines().any(|line| {
        let line = line.trim_start();
        let name = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
        name > 0 && line[name..].trim_start().starts_with("::=")
    })
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Name(String),
    Defines,
    /// A literal's characters.
    Literal(String),
    /// A character class: negated, and its ranges of characters.
    Class(bool, Vec<(char, char)>),
    Any,
    Open,
    Close,
    Or,
    /// `*`, `+`, `?`, or a `{m}`, `{m,}`, `{m,n}` repetition, as written.
    Repeat(String),
}

/// The grammar `gbnf` in Lark.
pub fn to_lark(gbnf: &str) -> Result<String, GbnfError> {
    let tokens = tokenize(gbnf)?;
    // Rules: a name followed by `::=` opens one, which runs to the next such pair.
    let mut rules: Vec<(String, Vec<Token>)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        match (&tokens[i], tokens.get(i + 1)) {
            (Token::Name(name), Some(Token::Defines)) => {
                rules.push((name.clone(), Vec::new()));
                i += 2;
            }
            (Token::Defines, _) => return bad("a `::=` without a rule's name before it"),
            (t, _) => match rules.last_mut() {
                Some((_, body)) => {
                    body.push(t.clone());
                    i += 1;
                }
                None => return bad("the grammar opens with no rule (`name ::= ...`)"),
            },
        }
    }
    let mut names = HashMap::new();
    for (k, (name, _)) in rules.iter().enumerate() {
        let lark = format!("g{k}_{}", name.to_ascii_lowercase().replace('-', "_"));
        if names.insert(name.clone(), lark).is_some() {
            return bad(format!("rule `{name}` is defined twice"));
        }
    }
    let Some(root) = names.get("root") else { return bad("no `root` rule") };
    let mut out = format!("start: {root}\n");
    for (name, body) in &rules {
        out.push_str(&names[name]);
        out.push(':');
        for t in body {
            out.push(' ');
            match t {
                Token::Name(n) => match names.get(n) {
                    Some(lark) => out.push_str(lark),
                    None => return bad(format!("rule `{n}` is used in `{name}` but not defined")),
                },
                Token::Literal(s) => literal(s, &mut out),
                Token::Class(negated, ranges) => class(*negated, ranges, &mut out),
                Token::Any => out.push_str("/(?s:.)/"),
                Token::Open => out.push('('),
                Token::Close => out.push(')'),
                Token::Or => out.push('|'),
                Token::Repeat(r) => {
                    if out.ends_with(' ') {
                        out.pop();
                    }
                    out.push_str(r);
                }
                // Never in a body: each `::=` opened a rule above, and a stray one is refused there.
                Token::Defines => {}
            }
        }
        out.push('\n');
    }
    Ok(out)
}

/// A Lark string literal for `s` (JSON's escapes; an empty literal, which Lark has no lexeme for, is an empty
/// group).
fn literal(s: &str, out: &mut String) {
    if s.is_empty() {
        out.push_str("()");
        return;
    }
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A Lark regular expression for a character class, every character written by its code point.
fn class(negated: bool, ranges: &[(char, char)], out: &mut String) {
    out.push_str(if negated { "/[^" } else { "/[" });
    for &(lo, hi) in ranges {
        let _ = write!(out, "\\x{{{:x}}}", lo as u32);
        if hi != lo {
            let _ = write!(out, "-\\x{{{:x}}}", hi as u32);
        }
    }
    out.push_str("]/");
}

fn tokenize(s: &str) -> Result<Vec<Token>, GbnfError> {
    let chars: Vec<char> = s.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                tokens.push(Token::Defines);
                i += 3;
            }
            '"' => {
                i += 1;
                let mut text = String::new();
                loop {
                    match chars.get(i) {
                        None => return bad("a literal is not closed"),
                        Some('"') => break,
                        Some('\\') => {
                            let (c, next) = escape(&chars, i)?;
                            text.push(c);
                            i = next;
                        }
                        Some(&c) => {
                            text.push(c);
                            i += 1;
                        }
                    }
                }
                tokens.push(Token::Literal(text));
                i += 1;
            }
            '[' => {
                i += 1;
                let negated = chars.get(i) == Some(&'^');
                if negated {
                    i += 1;
                }
                let mut ranges = Vec::new();
                loop {
                    let lo = match chars.get(i) {
                        None => return bad("a character class is not closed"),
                        Some(']') => break,
                        Some('\\') => {
                            let (c, next) = escape(&chars, i)?;
                            i = next;
                            c
                        }
                        Some(&c) => {
                            i += 1;
                            c
                        }
                    };
                    let mut hi = lo;
                    if chars.get(i) == Some(&'-') && chars.get(i + 1).is_some_and(|&c| c != ']') {
                        hi = match chars[i + 1] {
                            '\\' => {
                                let (c, next) = escape(&chars, i + 1)?;
                                i = next;
                                c
                            }
                            c => {
                                i += 2;
                                c
                            }
                        };
                        if hi < lo {
                            return bad(format!("the range {lo:?}-{hi:?} runs backwards"));
                        }
                    }
                    ranges.push((lo, hi));
                }
                if ranges.is_empty() {
                    return bad("an empty character class");
                }
                tokens.push(Token::Class(negated, ranges));
                i += 1;
            }
            '.' | '(' | ')' | '|' | '*' | '+' | '?' => {
                tokens.push(match c {
                    '.' => Token::Any,
                    '(' => Token::Open,
                    ')' => Token::Close,
                    '|' => Token::Or,
                    _ => Token::Repeat(c.to_string()),
                });
                i += 1;
            }
            '{' => {
                let end =
                    chars[i..].iter().position(|&c| c == '}').ok_or_else(|| GbnfError("a `{` is not closed".into()))?;
                let inner: String = chars[i + 1..i + end].iter().filter(|c| !c.is_whitespace()).collect();
                let valid = match inner.split_once(',') {
                    None => inner.parse::<u32>().is_ok_and(|n| n > 0),
                    Some((m, n)) => m.parse::<u32>().is_ok() && (n.is_empty() || n.parse::<u32>().is_ok_and(|n| n > 0)),
                };
                if !valid {
                    return bad(format!("a repetition is {{m}}, {{m,}} or {{m,n}} with n > 0, not {{{inner}}}"));
                }
                tokens.push(Token::Repeat(format!("{{{inner}}}")));
                i += end + 1;
            }
            c if is_name_char(c) => {
                let start = i;
                while i < chars.len() && is_name_char(chars[i]) {
                    i += 1;
                }
                tokens.push(Token::Name(chars[start..i].iter().collect()));
            }
            c => return bad(format!("unexpected {c:?}")),
        }
    }
    Ok(tokens)
}

/// The character the escape at `chars[i]` (a backslash) stands for, and where the text goes on.
fn escape(chars: &[char], i: usize) -> Result<(char, usize), GbnfError> {
    let hex = |n: usize| -> Result<(char, usize), GbnfError> {
        let digits: String = chars.get(i + 2..i + 2 + n).map(|d| d.iter().collect()).unwrap_or_default();
        u32::from_str_radix(&digits, 16)
            .ok()
            .filter(|_| digits.len() == n)
            .and_then(char::from_u32)
            .map(|c| (c, i + 2 + n))
            .ok_or_else(|| GbnfError(format!("a bad escape \\{}{digits}", chars[i + 1])))
    };
    match chars.get(i + 1) {
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some('n') => Ok(('\n', i + 2)),
        Some('r') => Ok(('\r', i + 2)),
        Some('t') => Ok(('\t', i + 2)),
        Some(&c @ ('\\' | '"' | '[' | ']' | '-' | '^')) => Ok((c, i + 2)),
        Some(c) => bad(format!("an unknown escape \\{c}")),
        None => bad("an escape at the end"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_literals_classes_and_repetitions_become_lark() {
        let gbnf = "root ::= item+ # a list\nitem ::= \"- \" [^\\n\\x0b]+ \"\\n\" | nums\n\
                    nums ::=\n  [0-9]{1,3} (\",\" [0-9]{3})* | \"\"\nlast-one ::= . \"\\\"\"";
        assert!(is_gbnf(gbnf) && !is_gbnf("start: item+\nitem: \"a\""));
        let lark = to_lark(gbnf).expect("converts");
        assert_eq!(
            lark,
            "start: g0_root\n\
             g0_root: g1_item+\n\
             g1_item: \"- \" /[^\\x{a}\\x{b}]/+ \"\\n\" | g2_nums\n\
             g2_nums: /[\\x{30}-\\x{39}]/{1,3} ( \",\" /[\\x{30}-\\x{39}]/{3} )* | ()\n\
             g3_last_one: /(?s:.)/ \"\\\"\"\n"
        );
    }

    #[test]
    fn what_is_not_gbnf_is_refused_with_the_reason() {
        for (gbnf, why) in [
            ("item ::= \"a\"", "no `root`"),
            ("root ::= item", "not defined"),
            ("root ::= \"a", "not closed"),
            ("root ::= [z-a]", "backwards"),
            ("root ::= \"a\"{0}", "repetition"),
            ("root ::= \"a\"\nroot ::= \"b\"", "twice"),
            ("\"a\" root ::= \"b\"", "no rule"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= ::= \"a\"", "without a rule's name"),
        ] {
            let e = to_lark(gbnf).expect_err(gbnf);
            assert!(e.to_string().contains(why), "{gbnf}: {e}");
        }
    }
}
