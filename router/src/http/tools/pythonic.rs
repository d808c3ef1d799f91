//! Python calls as Llama 3.2 and 4 write them, `[f(a=1, b="x"), g()]`: a list of calls by name with keyword
//! arguments whose values are Python literals (strings, numbers, `True`, `False`, `None`, lists, tuples and dicts),
//! read into JSON as Python's `ast.literal_eval` and `json.dumps` would (tuples as arrays, number keys as text).
//! Anything else (a positional argument, a variable, an expression) is not a call this reads.

use serde_json::{Map, Number, Value};

/// How deep lists, tuples and dicts may nest (serde_json's own limit): a model's answer is untrusted text, and
/// reading it must not run the stack out.
const MAX_DEPTH: usize = 128;

/// A call: the function's name and its arguments by keyword.
pub type Call = (String, Map<String, Value>);

/// The list of calls `s` starts with, and the text after the list.
pub fn calls(s: &str) -> Option<(Vec<Call>, &str)> {
    let mut p = Reader { s, at: 0, depth: 0 };
    p.expect('[')?;
    let mut calls = Vec::new();
    p.items(']', |p| {
        calls.push(p.call()?);
        Some(())
    })?;
    Some((calls, &s[p.at..]))
}

/// The Python literal `s` is, whole (surrounding whitespace aside), as JSON: how Python's `ast.literal_eval` reads a
/// value a model wrote as a template shows Python's values (`['C', 'mm']`, `{'a': True}`).
pub fn literal(s: &str) -> Option<Value> {
    let mut p = Reader { s: s.trim(), at: 0, depth: 0 };
    let value = p.value()?;
    p.rest().is_empty().then_some(value)
}

/// Reads a text from `at` on.
struct Reader<'a> {
    s: &'a str,
    at: usize,
    /// Containers open around `at`.
    depth: usize,
}

impl Reader<'_> {
    fn rest(&self) -> &str {
        &self.s[self.at..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn space(&mut self) {
        let rest = self.rest();
        self.at += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, c: char) -> bool {
        let yes = self.peek() == Some(c);
        if yes {
            self.at += c.len_utf8();
        }
        yes
    }

    fn expect(&mut self, c: char) -> Option<()> {
        self.space();
        self.eat(c).then_some(())
    }

    /// The comma-separated items up to `close` (a trailing comma allowed), each read by `item`; whether the last
    /// one had a comma after it.
    fn items(&mut self, close: char, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<bool> {
        let mut comma = false;
        loop {
            self.space();
            if self.eat(close) {
                return Some(comma);
            }
            item(self)?;
            self.space();
            comma = self.eat(',');
            if !comma {
                self.expect(close)?;
                return Some(false);
            }
        }
    }

    fn identifier(&mut self) -> Option<&str> {
        let rest = self.rest();
        let len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if len == 0 || rest.starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
        let start = self.at;
        self.at += len;
        Some(&self.s[start..start + len])
    }

    /// `name(key=value, ...)`.
    fn call(&mut self) -> Option<Call> {
        let name = self.identifier()?.to_string();
        self.expect('(')?;
        let mut arguments = Map::new();
        self.items(')', |p| {
            let key = p.identifier()?.to_string();
            p.expect('=')?;
            p.space();
            let value = p.value()?;
            // Python refuses a keyword given twice.
            arguments.insert(key, value).is_none().then_some(())
        })?;
        Some((name, arguments))
    }

    fn value(&mut self) -> Option<Value> {
        match self.peek()? {
            '\'' | '"' => self.string().map(Value::String),
            '[' | '(' | '{' => {
                self.depth += 1;
                let value = match self.peek()? {
                    _ if self.depth > MAX_DEPTH => None,
                    '[' => self.sequence('[', ']'),
                    '(' => self.sequence('(', ')'),
                    _ => self.dict(),
                };
                self.depth -= 1;
                value
            }
            c if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => self.number(),
            _ => match self.identifier()? {
                "True" => Some(Value::Bool(true)),
                "False" => Some(Value::Bool(false)),
                "None" => Some(Value::Null),
                _ => None,
            },
        }
    }

    /// A list or a tuple, as an array (`(x)` alone is `x`, as in Python).
    fn sequence(&mut self, open: char, close: char) -> Option<Value> {
        self.eat(open);
        let mut items = Vec::new();
        let comma = self.items(close, |p| {
            items.push(p.value()?);
            Some(())
        })?;
        if open == '(' && items.len() == 1 && !comma {
            return items.pop();
        }
        Some(Value::Array(items))
    }

    fn dict(&mut self) -> Option<Value> {
        self.eat('{');
        let mut map = Map::new();
        self.items('}', |p| {
            let key = match p.value()? {
                Value::String(s) => s,
                // As `json.dumps` writes number and constant keys.
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                Value::Null => "null".to_string(),
                _ => return None,
            };
            p.expect(':')?;
            p.space();
            map.insert(key, p.value()?);
            Some(())
        })?;
        Some(Value::Object(map))
    }

    /// An integer (as an integer while it fits 64 bits) or a finite float; `_` between digits allowed.
    fn number(&mut self) -> Option<Value> {
        let rest = self.rest();
        let len = rest
            .char_indices()
            .find(|&(i, c)| {
                let sign_ok = (c == '-' || c == '+') && (i == 0 || rest[..i].ends_with(['e', 'E']));
                !(c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '_') || sign_ok)
            })
            .map_or(rest.len(), |(i, _)| i);
        let text = &rest[..len];
        if text.contains("__") || text.ends_with('_') || text.contains("_.") || text.contains("._") {
            return None;
        }
        let plain: String = text.chars().filter(|&c| c != '_').collect();
        self.at += len;
        let digits = plain.trim_start_matches(['-', '+']);
        if digits.bytes().all(|b| b.is_ascii_digit()) {
            // Python 3 refuses leading zeros in a decimal integer.
            if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
                return None;
            }
            if let Ok(i) = plain.parse::<i64>() {
                return Some(Value::Number(i.into()));
            }
            if let Ok(u) = plain.trim_start_matches('+').parse::<u64>() {
                return Some(Value::Number(u.into()));
            }
        }
        plain.parse::<f64>().ok().and_then(Number::from_f64).map(Value::Number)
    }

    /// A string in single or double quotes, or tripled, with Python's escapes (an unknown one keeps its backslash).
    fn string(&mut self) -> Option<String> {
        let quote = self.peek()?;
        let triple: String = std::iter::repeat_n(quote, 3).collect();
        let closing = if self.rest().starts_with(&triple) { triple.as_str() } else { &triple[..1] };
        self.at += closing.len();
        let mut out = String::new();
        loop {
            let rest = self.rest();
            if rest.starts_with(closing) {
                self.at += closing.len();
                return Some(out);
            }
            let c = rest.chars().next()?;
            self.at += c.len_utf8();
            match c {
                '\\' => self.escape(&mut out)?,
                '\n' if closing.len() == 1 => return None,
                c => out.push(c),
            }
        }
    }

    /// The escape after a backslash, added to `out`.
    fn escape(&mut self, out: &mut String) -> Option<()> {
        let c = self.peek()?;
        self.at += c.len_utf8();
        let simple = match c {
            '\n' => Some(None),
            '\\' | '\'' | '"' => Some(Some(c)),
            'n' => Some(Some('\n')),
            't' => Some(Some('\t')),
            'r' => Some(Some('\r')),
            'a' => Some(Some('\u{7}')),
            'b' => Some(Some('\u{8}')),
            'f' => Some(Some('\u{c}')),
            'v' => Some(Some('\u{b}')),
            _ => None,
        };
        if let Some(c) = simple {
            out.extend(c);
            return Some(());
        }
        let code = |reader: &mut Self, len: usize, radix: u32| {
            let digits = reader.rest().get(..len)?;
            let n = u32::from_str_radix(digits, radix).ok().filter(|_| digits.chars().all(|d| d.is_digit(radix)))?;
            reader.at += len;
            char::from_u32(n)
        };
        match c {
            'x' => out.push(code(self, 2, 16)?),
            'u' => out.push(code(self, 4, 16)?),
            'U' => out.push(code(self, 8, 16)?),
            '0'..='7' => {
                let rest = self.rest();
                let more = rest.chars().take(2).take_while(|d| ('0'..='7').contains(d)).count();
                let n = u32::from_str_radix(&self.s[self.at - 1..self.at + more], 8).ok()?;
                self.at += more;
                out.push(char::from_u32(n)?);
            }
            other => {
                out.push('\\');
                out.push(other);
            }
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn one(s: &str) -> Option<Value> {
        let text = format!("[f(x={s})]");
        let (calls, rest) = calls(&text)?;
        assert_eq!(rest, "");
        calls.into_iter().next().map(|(_, mut args)| args.remove("x").expect("x"))
    }

    #[test]
    fn literals_read_as_python_reads_them() {
        let cases = [
            ("'it''s'", None),
            (r#"'it\'s'"#, Some(json!("it's"))),
            (r#""tab\there""#, Some(json!("tab\there"))),
            (r#"'\x41\u00e9\U0001F600\101\d'"#, Some(json!("Aé😀A\\d"))),
            ("'''two\nlines'''", Some(json!("two\nlines"))),
            ("'no\nbreak'", None),
            ("42", Some(json!(42))),
            ("-7", Some(json!(-7))),
            ("1_000", Some(json!(1000))),
            ("1__0", None),
            ("007", None),
            ("0", Some(json!(0))),
            ("18446744073709551615", Some(json!(18446744073709551615u64))),
            ("2.5e-3", Some(json!(0.0025))),
            (".5", Some(json!(0.5))),
            ("True", Some(json!(true))),
            ("None", Some(Value::Null)),
            ("none", None),
            ("[1, 'a', [None]]", Some(json!([1, "a", [null]]))),
            ("(1, 2)", Some(json!([1, 2]))),
            ("(1,)", Some(json!([1]))),
            ("(1)", Some(json!(1))),
            ("{'a': 1, 2: [True], }", Some(json!({"a": 1, "2": [true]}))),
            ("{[1]: 2}", None),
            ("x", None),
            ("1 + 2", None),
            ("'é'", Some(json!("é"))),
        ];
        for (text, want) in cases {
            assert_eq!(one(text), want, "{text}");
        }
    }

    #[test]
    fn calls_take_keywords_only_once_each() {
        let (list, rest) = calls("[ a(x=1, y='b',), b() , ] tail").expect("calls");
        assert_eq!(rest, " tail");
        assert_eq!(list.len(), 2);
        assert_eq!((list[0].0.as_str(), Value::Object(list[0].1.clone())), ("a", json!({"x": 1, "y": "b"})));
        assert_eq!((list[1].0.as_str(), list[1].1.len()), ("b", 0));
        for not in ["[a(1)]", "[a(x=1, x=2)]", "[a(x=1 y=2)]", "[1a()]", "a()", "[a(x=)]", "[a.b()]"] {
            assert!(calls(not).is_none(), "{not}");
        }
        assert_eq!(calls("[]").map(|(c, _)| c.len()), Some(0));
    }

    /// Nesting is bounded, so an answer of a million brackets is refused, not a stack overflow.
    #[test]
    fn nesting_is_bounded() {
        let nested = |n: usize| format!("[f(x={}1{})]", "[".repeat(n), "]".repeat(n));
        assert!(calls(&nested(MAX_DEPTH)).is_some());
        assert!(calls(&nested(MAX_DEPTH + 1)).is_none());
        assert!(calls(&nested(1_000_000)).is_none());
        assert!(calls(&format!("[f(x={})]", "({".repeat(500_000))).is_none());
    }
}
