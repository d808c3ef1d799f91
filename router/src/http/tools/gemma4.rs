//! Gemma 4's tool calls, `<|tool_call>call:NAME{key:value,...}<tool_call|>`, blocks back to back, with values as
//! its chat template writes them back: text between `<|"|>` marks, `true` and `false`, numbers bare, objects
//! `{key:value,...}` with bare keys (or marked ones), lists `[value,...]`. A bare word that is no number or constant
//! is text, as a lenient reader of the model's writing takes it. The markers are control tokens, so the answer keeps
//! their text for this parser.

use serde_json::Value;

/// Where a call opens, and where it closes.
pub const OPEN: &str = "<|tool_call>";
const CLOSE: &str = "<tool_call|>";
/// What stands on both sides of text.
const QUOTE: &str = "<|\"|>";
/// Objects and lists deeper than this are refused (a model's answer cannot run the stack out).
const MAX_DEPTH: usize = 128;

/// The call `text` opens with (at its [`OPEN`]) by name and arguments, and how much of `text` it takes; `None` when
/// it is not one call, or not closed: at the `end`, a call cut short stands when its arguments are whole.
pub fn call(text: &str, end: bool) -> Option<(String, Value, usize)> {
    let mut r = Reader { s: text, pos: 0, depth: 0 };
    if !r.eat(OPEN) {
        return None;
    }
    r.space();
    if !r.eat("call:") {
        return None;
    }
    let name_len = r.rest().find('{')?;
    let name = r.rest()[..name_len].trim().to_string();
    if name.is_empty() {
        return None;
    }
    r.pos += name_len;
    let arguments = r.value()?;
    if !arguments.is_object() {
        return None;
    }
    r.space();
    let closed = r.eat(CLOSE) || (end && r.rest().is_empty());
    closed.then_some((name, arguments, r.pos))
}

struct Reader<'a> {
    s: &'a str,
    pos: usize,
    depth: usize,
}

impl<'a> Reader<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn space(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, token: &str) -> bool {
        let found = self.rest().starts_with(token);
        if found {
            self.pos += token.len();
        }
        found
    }

    fn value(&mut self) -> Option<Value> {
        self.space();
        if self.eat(QUOTE) {
            let end = self.rest().find(QUOTE)?;
            let text = self.rest()[..end].to_string();
            self.pos += end + QUOTE.len();
            return Some(Value::String(text));
        }
        if self.rest().starts_with(['{', '[']) {
            self.depth += 1;
            if self.depth > MAX_DEPTH {
                return None;
            }
            let v = if self.eat("{") { self.object() } else { self.eat("[").then(|| self.list()).flatten() };
            self.depth -= 1;
            return v;
        }
        let len = self.rest().find([',', '}', ']', '<']).unwrap_or(self.rest().len());
        let word = self.rest()[..len].trim();
        self.pos += len;
        Some(match word {
            "" => return None,
            "true" | "True" => Value::Bool(true),
            "false" | "False" => Value::Bool(false),
            "null" | "None" => Value::Null,
            w => match (w.parse::<i64>(), w.parse::<f64>()) {
                (Ok(i), _) => Value::from(i),
                (_, Ok(f)) if f.is_finite() => serde_json::Number::from_f64(f).map_or(Value::from(w), Value::Number),
                _ => Value::from(w),
            },
        })
    }

    /// The items of a list or object up to `close`, each read by `item`, separated by commas.
    fn items(&mut self, close: char, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.space();
        if self.rest().starts_with(close) {
            self.pos += 1;
            return Some(());
        }
        loop {
            item(self)?;
            self.space();
            if self.rest().starts_with(close) {
                self.pos += 1;
                return Some(());
            }
            if !self.eat(",") {
                return None;
            }
        }
    }

    fn list(&mut self) -> Option<Value> {
        let mut items = Vec::new();
        self.items(']', |r| {
            items.push(r.value()?);
            Some(())
        })?;
        Some(Value::Array(items))
    }

    fn object(&mut self) -> Option<Value> {
        let mut map = serde_json::Map::new();
        self.items('}', |r| {
            r.space();
            let key = if r.eat(QUOTE) {
                let end = r.rest().find(QUOTE)?;
                let key = r.rest()[..end].to_string();
                r.pos += end + QUOTE.len();
                r.space();
                key
            } else {
                let end = r.rest().find(':')?;
                let key = r.rest()[..end].trim().to_string();
                r.pos += end;
                key
            };
            if key.is_empty() || !r.eat(":") {
                return None;
            }
            let value = r.value()?;
            // A key written twice is not one call's arguments.
            map.insert(key, value).is_none().then_some(())
        })?;
        Some(Value::Object(map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The calls of a whole answer, one after the other, up to the first that is not one.
    fn calls(mut text: &str) -> Vec<(String, Value)> {
        let mut calls = Vec::new();
        while let Some((name, arguments, used)) = call(text, true) {
            calls.push((name, arguments));
            text = text[used..].trim_start();
        }
        calls
    }

    #[test]
    fn calls_read_as_gemma_4_writes_them() {
        let text = "<|tool_call>call:get_weather{city:<|\"|>Paris, France<|\"|>,days:3,metric:true,\
                    window:{from:<|\"|>mon<|\"|>,to:None},tags:[<|\"|>a<|\"|>,2.5,warm]}<tool_call|>\
                    <|tool_call>call:now{}<tool_call|> and after";
        assert_eq!(
            calls(text),
            vec![
                (
                    "get_weather".into(),
                    json!({"city": "Paris, France", "days": 3, "metric": true,
                           "window": {"from": "mon", "to": null}, "tags": ["a", 2.5, "warm"]})
                ),
                ("now".into(), json!({})),
            ]
        );
        // The last call cut short stands when its arguments are whole; keys may be marked too.
        assert_eq!(calls("<|tool_call>call:f{<|\"|>k<|\"|>:1}"), vec![("f".into(), json!({"k": 1}))]);
        // Before the end, a call is one once closed, and takes the text up to its close.
        let closed = "<|tool_call>call:f{}<tool_call|>";
        assert_eq!(call("<|tool_call>call:f{}", false), None);
        assert_eq!(call(&format!("{closed} more"), false), Some(("f".into(), json!({}), closed.len())));
        for bad in [
            "<|tool_call>get{}<tool_call|>",
            "<|tool_call>call:{a:1}<tool_call|>",
            "<|tool_call>call:f{a:1,a:2}<tool_call|>",
            "<|tool_call>call:f{a:<|\"|>open}<tool_call|>",
            "<|tool_call>call:f{a:1} trailing",
        ] {
            assert_eq!(call(bad, true), None, "{bad}");
        }
        let deep = format!("<|tool_call>call:f{{a:{}1{}}}", "[".repeat(200), "]".repeat(200));
        assert_eq!(call(&deep, true), None, "nesting is bounded");
    }
}
