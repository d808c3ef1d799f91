//! A MessagePack reader for the engines' KV event batches: every type the format has, read into borrowed values,
//! with nothing allocated for a length the input cannot hold and nesting bounded, so garbage off the network is an
//! error, never a panic or a huge allocation.

/// One decoded value; strings and byte strings borrow from the input.
#[derive(Clone, Debug, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    /// Every integer (MessagePack's are at most 64 bits, signed or not).
    Int(i128),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
    /// An extension type (its type code and bytes).
    Ext(i8, &'a [u8]),
}

impl<'a> Value<'a> {
    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&'a str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value<'a>]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The value under string key `key` of a map.
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        match self {
            Value::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v),
            _ => None,
        }
    }
}

/// Why bytes are not one MessagePack value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("the input ends inside a value (at byte {0})")]
    Truncated(usize),
    #[error("byte {0:#04x} at {1} starts no MessagePack value")]
    Reserved(u8, usize),
    #[error("a string at byte {0} is not UTF-8")]
    Utf8(usize),
    #[error("values nest deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("{0} bytes follow the value")]
    Trailing(usize),
}

/// Nesting allowed: an event batch nests four deep; anything far past that is not one.
pub const MAX_DEPTH: usize = 32;

/// Reads exactly one value filling `input`.
pub fn decode(input: &[u8]) -> Result<Value<'_>, Error> {
    let mut r = Reader { input, pos: 0 };
    let v = r.value(0)?;
    match input.len() - r.pos {
        0 => Ok(v),
        n => Err(Error::Trailing(n)),
    }
}

struct Reader<'a> {
    input: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.input.len()).ok_or(Error::Truncated(self.pos))?;
        let s = &self.input[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, Error> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn len(&mut self, n: usize) -> Result<usize, Error> {
        usize::try_from(self.be(n)?).map_err(|_| Error::Truncated(self.pos))
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, Error> {
        if depth > MAX_DEPTH {
            return Err(Error::TooDeep);
        }
        let at = self.pos;
        let b = self.take(1)?[0];
        Ok(match b {
            0x00..=0x7f => Value::Int(i128::from(b)),
            0x80..=0x8f => self.map(usize::from(b & 0x0f), depth)?,
            0x90..=0x9f => self.array(usize::from(b & 0x0f), depth)?,
            0xa0..=0xbf => self.str(usize::from(b & 0x1f))?,
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len(1 << (b - 0xc4))?;
                Value::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (b - 0xc7))?;
                self.ext(n)?
            }
            0xca => Value::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Value::Int(i128::from(self.be(1 << (b - 0xcc))?)),
            0xd0..=0xd3 => {
                let n = 1usize << (b - 0xd0);
                let raw = self.be(n)?;
                // Sign-extend from n bytes.
                let shift = 64 - 8 * n as u32;
                Value::Int(i128::from(((raw << shift) as i64) >> shift))
            }
            0xd4..=0xd8 => self.ext(1 << (b - 0xd4))?,
            0xd9..=0xdb => {
                let n = self.len(1 << (b - 0xd9))?;
                self.str(n)?
            }
            0xdc | 0xdd => {
                let n = self.len(2 << (b - 0xdc))?;
                self.array(n, depth)?
            }
            0xde | 0xdf => {
                let n = self.len(2 << (b - 0xde))?;
                self.map(n, depth)?
            }
            0xe0..=0xff => Value::Int(i128::from(b as i8)),
            0xc1 => return Err(Error::Reserved(b, at)),
        })
    }

    fn str(&mut self, n: usize) -> Result<Value<'a>, Error> {
        let at = self.pos;
        std::str::from_utf8(self.take(n)?).map(Value::Str).map_err(|_| Error::Utf8(at))
    }

    fn ext(&mut self, n: usize) -> Result<Value<'a>, Error> {
        let code = self.take(1)?[0] as i8;
        Ok(Value::Ext(code, self.take(n)?))
    }

    /// Every element takes at least one byte: a count the rest of the input cannot hold is refused before
    /// anything is allocated for it.
    fn room(&self, n: usize) -> Result<(), Error> {
        if n > self.input.len() - self.pos { Err(Error::Truncated(self.pos)) } else { Ok(()) }
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value<'a>, Error> {
        self.room(n)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value<'a>, Error> {
        self.room(n.saturating_mul(2))?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            let v = self.value(depth + 1)?;
            entries.push((k, v));
        }
        Ok(Value::Map(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_kind_of_value() {
        // Bytes as the MessagePack specification encodes each value.
        assert_eq!(decode(&[0x05]), Ok(Value::Int(5)));
        assert_eq!(decode(&[0xff]), Ok(Value::Int(-1)));
        assert_eq!(decode(&[0xcc, 0xc8]), Ok(Value::Int(200)));
        assert_eq!(decode(&[0xd1, 0xfc, 0x18]), Ok(Value::Int(-1000)));
        assert_eq!(decode(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]), Ok(Value::Int(u64::MAX.into())));
        assert_eq!(decode(&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]), Ok(Value::Int(i64::MIN.into())));
        assert_eq!(decode(&[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]), Ok(Value::Float(1.5)));
        assert_eq!(decode(&[0xca, 0x3f, 0xc0, 0, 0]), Ok(Value::Float(1.5)));
        assert_eq!(decode(&[0xa3, b'a', b'b', b'c']), Ok(Value::Str("abc")));
        assert_eq!(decode(&[0xd9, 1, b'x']), Ok(Value::Str("x")));
        assert_eq!(decode(&[0xc4, 2, 1, 2]), Ok(Value::Bin(&[1, 2])));
        assert_eq!(decode(&[0xc0]), Ok(Value::Nil));
        assert_eq!(decode(&[0xc3]), Ok(Value::Bool(true)));
        assert_eq!(decode(&[0x92, 0x01, 0xc0]), Ok(Value::Array(vec![Value::Int(1), Value::Nil])));
        assert_eq!(decode(&[0xdc, 0, 1, 0x07]), Ok(Value::Array(vec![Value::Int(7)])));
        let m = decode(&[0x81, 0xa1, b'k', 0x02]).expect("a map");
        assert_eq!(m.get("k"), Some(&Value::Int(2)));
        assert_eq!(decode(&[0xd4, 0x01, 0xaa]), Ok(Value::Ext(1, &[0xaa])));
    }

    #[test]
    fn garbage_is_an_error() {
        assert_eq!(decode(&[]), Err(Error::Truncated(0)));
        assert_eq!(decode(&[0xc1]), Err(Error::Reserved(0xc1, 0)));
        assert_eq!(decode(&[0xa3, b'a']), Err(Error::Truncated(1)));
        assert_eq!(decode(&[0x01, 0x02]), Err(Error::Trailing(1)));
        assert_eq!(decode(&[0xa1, 0xff]), Err(Error::Utf8(1)));
        // A claimed 4-billion-element array in six bytes allocates nothing.
        assert_eq!(decode(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x00]), Err(Error::Truncated(5)));
        assert_eq!(decode(&[0x91; 100]), Err(Error::TooDeep));
    }
}
