//! Values written as Python writes them, for chat templates made for transformers' Jinja2: `tojson` is Python's
//! `json.dumps`, and a list, dict, boolean or None printed by a template is Python's `repr` of it (`{'a': True}`).

/// transformers' `tojson` arguments (Python's `json.dumps`'s).
pub struct JsonOptions {
    pub indent: Option<usize>,
    /// `ensure_ascii`: non-ASCII text as `\uXXXX` escapes (default false: as it is).
    pub ascii: bool,
    /// Between items and between a key and its value; default `", "` and `": "` (`","` with `indent`).
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// JSON as Python's `json.dumps` writes it for transformers' `tojson` (what the models' templates were trained on):
/// `", "` and `": "` between items and keys (`","` and newlines with `indent`), keys in their given order, non-ASCII
/// text as it is, unless `options` say otherwise.
pub fn json(v: &serde_json::Value, options: &JsonOptions, depth: usize, out: &mut String) {
    use serde_json::Value;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = options.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let (item_separator, key_separator) = match &options.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None => (if options.indent.is_some() { "," } else { ", " }, ": "),
    };
    let string = |s: &str, out: &mut String| {
        let quoted = Value::from(s).to_string();
        if !options.ascii {
            return out.push_str(&quoted);
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                json(item, options, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (k, (key, item)) in entries.into_iter().enumerate() {
                if k > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                string(key, out);
                out.push_str(key_separator);
                json(item, options, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Value::String(s) => string(s, out),
        other => out.push_str(&other.to_string()),
    }
}

/// Python's `repr` of `v` (what Jinja2 prints for a list or dict, and `str` of a boolean or None).
pub fn repr(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Null => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => repr_str(s, out),
        Value::Array(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push_str(", ");
                }
                repr(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (k, (key, item)) in map.iter().enumerate() {
                if k > 0 {
                    out.push_str(", ");
                }
                repr_str(key, out);
                out.push_str(": ");
                repr(item, out);
            }
            out.push('}');
        }
    }
}

/// Python's `repr` of a string: single quotes, or double ones when it has a single quote and no double one;
/// backslashes, that quote and control characters escaped.
fn repr_str(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c == '\u{7f}' => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_written_as_python_writes_them() {
        let v = serde_json::json!({"b": [true, null, 1.5, "it's"], "a": {"q": "say \"hi\"\n"}});
        let mut out = String::new();
        repr(&v, &mut out);
        assert_eq!(out, r#"{'b': [True, None, 1.5, "it's"], 'a': {'q': 'say "hi"\n'}}"#);
        let options = |ascii, sort_keys| JsonOptions { indent: None, ascii, separators: None, sort_keys };
        let mut out = String::new();
        json(&serde_json::json!({"z": "é", "a": 1}), &options(true, true), 0, &mut out);
        assert_eq!(out, r#"{"a": 1, "z": "\u00e9"}"#);
        let mut out = String::new();
        let tight = JsonOptions { separators: Some((",".into(), ":".into())), ..options(false, false) };
        json(&serde_json::json!({"z": ["é", 2], "a": 1}), &tight, 0, &mut out);
        assert_eq!(out, r#"{"z":["é",2],"a":1}"#);
    }
}
