//! GPT-2's reversible map between bytes and printable characters, used by byte-level BPE vocabularies.

/// The printable character that stands for byte `b` (looked up: a tokenizer spells every piece of text with it).
pub fn byte_to_char(b: u8) -> char {
    static TABLE: std::sync::OnceLock<[char; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| spell(b as u8)))[b as usize]
}

/// Printable Latin-1 bytes stand for themselves, the others are moved to U+0100 and up in byte order.
fn spell(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The byte a printable character stands for, if it is one of the 256.
pub fn char_to_byte(c: char) -> Option<u8> {
    let code = c as u32;
    match code {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => Some(code as u8),
        256..=511 => shifted_bytes().get((code - 256) as usize).copied(),
        _ => None,
    }
}

/// The bytes that are not printable, in order: the n-th of them is written as U+0100 + n.
fn shifted_bytes() -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=255u8).filter(|&b| byte_to_char(b) as u32 >= 256).collect())
}

/// Bytes of an ordinary token's text; characters outside the alphabet are kept as their UTF-8.
pub fn token_to_bytes(token: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_is_a_bijection() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c));
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
    }
}
