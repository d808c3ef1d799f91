//! Server-sent events, as OpenAI-compatible servers stream them: a byte stream split into each event's `data`.

/// Splits a byte stream into server-sent events' `data` payloads.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    /// Whether `data: [DONE]` was seen.
    pub done: bool,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = find_event_end(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..end.0 + end.1).collect();
            let text = String::from_utf8_lossy(&raw[..end.0]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if data.is_empty() {
                continue;
            }
            let data = data.join("\n");
            if data == "[DONE]" {
                self.done = true;
            }
            events.push(data);
        }
        events
    }
}

/// The end of the first complete event: its length and the separator's.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 < b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_reads_come_out_whole() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(p.push(b"1}\n\ndata: [DO"), vec!["{\"a\":1}".to_string()]);
        assert_eq!(p.push(b"NE]\r\n\r\n: comment\n\n"), vec!["[DONE]".to_string()]);
        assert!(p.done);
    }
}
