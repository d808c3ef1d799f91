//! A streamed chat completion's chunks as the Responses API's events: `response.created`, then each output item
//! opened (`response.output_item.added`), its text in deltas (reasoning, output text, or a call's arguments) and
//! closed (`...done`, `response.output_item.done`), and `response.completed` (or `response.incomplete`) with the
//! whole response. Every event carries its `sequence_number`.

use serde_json::{Value, json};

use super::{
    Asked, Done, call_item, call_item_id, ids, message_id, message_item, reasoning_id, reasoning_item, response,
    text_logprobs, usage,
};

/// The item being streamed.
#[derive(Debug)]
enum Open {
    Reasoning(String),
    Message(String),
    Call { k: usize, call_id: Value, name: Value, arguments: String },
}

/// The events of one streamed response.
#[derive(Debug)]
pub struct Events {
    asked: Asked,
    id: String,
    created: Value,
    model: Value,
    sequence: u64,
    /// The items done so far.
    output: Vec<Value>,
    open: Option<Open>,
    cut: bool,
    usage: Value,
    started: bool,
    /// Every token's log-probabilities so far (when asked for), and whether the answer thought.
    logprobs: Vec<Value>,
    thought: bool,
}

impl Events {
    pub fn new(asked: Asked) -> Events {
        Events {
            asked,
            id: String::new(),
            created: Value::Null,
            model: Value::Null,
            sequence: 0,
            output: Vec::new(),
            open: None,
            cut: false,
            usage: Value::Null,
            started: false,
            logprobs: Vec::new(),
            thought: false,
        }
    }

    /// The events one chat chunk makes.
    pub fn chunk(&mut self, chunk: &Value) -> Vec<Value> {
        let mut out = Vec::new();
        if let Some(e) = chunk.get("error") {
            out.push(
                self.event(json!({"type": "error", "code": e["code"], "message": e["message"], "param": e["param"]})),
            );
            return out;
        }
        if !self.started {
            self.started = true;
            self.id = ids(chunk["id"].as_str().unwrap_or(""));
            (self.created, self.model) = (chunk["created"].clone(), chunk["model"].clone());
            let r = self.response(Done::InProgress);
            out.push(self.event(json!({"type": "response.created", "response": r})));
            out.push(self.event(json!({"type": "response.in_progress", "response": r})));
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = usage(u);
        }
        let Some(choice) = chunk["choices"].get(0) else { return out };
        let delta = &choice["delta"];
        let entries = choice["logprobs"]["content"].as_array().filter(|_| self.asked.logprobs);
        self.logprobs.extend(entries.into_iter().flatten().cloned());
        if let Some(thought) = delta["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
            if !matches!(self.open, Some(Open::Reasoning(_))) {
                self.close(&mut out);
                let item = json!({"type": "reasoning", "id": reasoning_id(&self.id), "summary": [], "content": []});
                out.push(self.added(item));
                self.open = Some(Open::Reasoning(String::new()));
            }
            if let Some(Open::Reasoning(text)) = &mut self.open {
                text.push_str(thought);
            }
            self.thought = true;
            let e = json!({"type": "response.reasoning_text.delta", "item_id": reasoning_id(&self.id),
                           "output_index": self.output.len(), "content_index": 0, "delta": thought});
            out.push(self.event(e));
        }
        if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
            if !matches!(self.open, Some(Open::Message(_))) {
                self.close(&mut out);
                out.push(self.added(message_item(&self.id, "", "in_progress")));
                let part = json!({"type": "output_text", "text": "", "annotations": []});
                out.push(self.event(json!({"type": "response.content_part.added", "item_id": message_id(&self.id),
                                           "output_index": self.output.len(), "content_index": 0, "part": part})));
                self.open = Some(Open::Message(String::new()));
            }
            if let Some(Open::Message(all)) = &mut self.open {
                all.push_str(text);
            }
            let lps = entries.map_or(json!([]), |e| Value::Array(e.clone()));
            let e = json!({"type": "response.output_text.delta", "item_id": message_id(&self.id),
                           "output_index": self.output.len(), "content_index": 0, "delta": text, "logprobs": lps});
            out.push(self.event(e));
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let k = call["index"].as_u64().unwrap_or(0) as usize;
            let piece = call["function"]["arguments"].as_str().unwrap_or("");
            let same = matches!(&self.open, Some(Open::Call { k: open, .. }) if *open == k);
            if !same {
                self.close(&mut out);
                let (call_id, name) = (call["id"].clone(), call["function"]["name"].clone());
                out.push(self.added(call_item(&self.id, k, &call_id, &name, "", "in_progress")));
                self.open = Some(Open::Call { k, call_id, name, arguments: String::new() });
            }
            if let Some(Open::Call { arguments, .. }) = &mut self.open {
                arguments.push_str(piece);
            }
            if !piece.is_empty() {
                let e = json!({"type": "response.function_call_arguments.delta", "item_id": call_item_id(&self.id, k),
                               "output_index": self.output.len(), "delta": piece});
                out.push(self.event(e));
            }
        }
        if choice["finish_reason"] == "length" {
            self.cut = true;
        }
        out
    }

    /// The events that end the response: the open item closed, and the whole response.
    pub fn end(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (kind, done) =
            if self.cut { ("response.incomplete", Done::Cut) } else { ("response.completed", Done::Completed) };
        let mut r = self.response(done);
        r["usage"] = self.usage.clone();
        out.push(self.event(json!({"type": kind, "response": r})));
        out
    }

    fn response(&self, done: Done) -> Value {
        response(&self.id, &self.created, &self.model, &self.asked, self.output.clone(), done)
    }

    fn event(&mut self, mut e: Value) -> Value {
        e["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        e
    }

    fn added(&mut self, item: Value) -> Value {
        let index = self.output.len();
        self.event(json!({"type": "response.output_item.added", "output_index": index, "item": item}))
    }

    /// Closes the open item, if any, into `output`.
    fn close(&mut self, out: &mut Vec<Value>) {
        let index = self.output.len();
        let item = match self.open.take() {
            None => return,
            Some(Open::Reasoning(text)) => {
                let e = json!({"type": "response.reasoning_text.done", "item_id": reasoning_id(&self.id),
                               "output_index": index, "content_index": 0, "text": text});
                out.push(self.event(e));
                reasoning_item(&self.id, &text)
            }
            Some(Open::Message(text)) => {
                let item_id = message_id(&self.id);
                let lps = text_logprobs(&Value::Array(self.logprobs.clone()), &text, self.thought);
                let e = json!({"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                               "content_index": 0, "text": text, "logprobs": lps});
                out.push(self.event(e));
                let mut part = json!({"type": "output_text", "text": text, "annotations": []});
                if self.asked.logprobs {
                    part["logprobs"] = lps;
                }
                let e = json!({"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                               "content_index": 0, "part": part});
                out.push(self.event(e));
                let mut item = message_item(&self.id, &text, if self.cut { "incomplete" } else { "completed" });
                if self.asked.logprobs {
                    item["content"][0] = part;
                }
                item
            }
            Some(Open::Call { k, call_id, name, arguments }) => {
                let e = json!({"type": "response.function_call_arguments.done", "item_id": call_item_id(&self.id, k),
                               "output_index": index, "arguments": arguments});
                out.push(self.event(e));
                call_item(&self.id, k, &call_id, &name, &arguments, "completed")
            }
        };
        out.push(self.event(json!({"type": "response.output_item.done", "output_index": index, "item": item})));
        self.output.push(item);
    }
}
