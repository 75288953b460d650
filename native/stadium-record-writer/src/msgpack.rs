//! MessagePack as the Python writer reads it: a value's span, its scalar reading, and the
//! value written as JSON the way msgspec's JSON encoder writes what msgspec's MessagePack
//! decoder made of it (bytes as base64, an extension as `{"ext": code, "data": base64}`).

use crate::json::{write_b64, write_f64, write_str, Bad, MAX_DEPTH, R};

/// One decoded item's head.
pub enum Item<'a> {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Ext(i8, &'a [u8]),
    Array(usize),
    Map(usize),
}

pub struct Cur<'a> {
    pub b: &'a [u8],
    pub i: usize,
}

impl<'a> Cur<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Cur { b, i: 0 }
    }

    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.i.checked_add(n).ok_or(Bad)?;
        let s = self.b.get(self.i..end).ok_or(Bad)?;
        self.i = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> R<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |v, &c| v << 8 | c as u64))
    }

    fn len(&mut self, n: usize) -> R<usize> {
        let v = self.uint(n)? as usize;
        // every item takes a byte at least: a count past what is left is a lie
        if v > self.b.len() - self.i.min(self.b.len()) + 1 && v > 0 {
            return Err(Bad);
        }
        Ok(v)
    }

    fn bytes(&mut self, n: usize) -> R<&'a [u8]> {
        let n = self.uint(n)? as usize;
        self.take(n)
    }

    fn text(&mut self, n: usize) -> R<&'a str> {
        std::str::from_utf8(self.take(n)?).map_err(|_| Bad)
    }

    pub fn item(&mut self) -> R<Item<'a>> {
        let c = self.take(1)?[0];
        Ok(match c {
            0x00..=0x7f => Item::Int(c as i128),
            0x80..=0x8f => Item::Map((c & 0x0f) as usize),
            0x90..=0x9f => Item::Array((c & 0x0f) as usize),
            0xa0..=0xbf => Item::Str(self.text((c & 0x1f) as usize)?),
            0xc0 => Item::Nil,
            0xc2 => Item::Bool(false),
            0xc3 => Item::Bool(true),
            0xc4 => Item::Bin(self.bytes(1)?),
            0xc5 => Item::Bin(self.bytes(2)?),
            0xc6 => Item::Bin(self.bytes(4)?),
            0xc7..=0xc9 => {
                let n = self.uint(1 << (c - 0xc7))? as usize;
                let code = self.take(1)?[0] as i8;
                Item::Ext(code, self.take(n)?)
            }
            0xca => Item::Float(f32::from_bits(self.uint(4)? as u32) as f64),
            0xcb => Item::Float(f64::from_bits(self.uint(8)?)),
            0xcc => Item::Int(self.uint(1)? as i128),
            0xcd => Item::Int(self.uint(2)? as i128),
            0xce => Item::Int(self.uint(4)? as i128),
            0xcf => Item::Int(self.uint(8)? as i128),
            0xd0 => Item::Int(self.uint(1)? as u8 as i8 as i128),
            0xd1 => Item::Int(self.uint(2)? as u16 as i16 as i128),
            0xd2 => Item::Int(self.uint(4)? as u32 as i32 as i128),
            0xd3 => Item::Int(self.uint(8)? as i64 as i128),
            0xd4..=0xd8 => {
                let code = self.take(1)?[0] as i8;
                Item::Ext(code, self.take(1 << (c - 0xd4))?)
            }
            0xd9 => Item::Str(std::str::from_utf8(self.bytes(1)?).map_err(|_| Bad)?),
            0xda => Item::Str(std::str::from_utf8(self.bytes(2)?).map_err(|_| Bad)?),
            0xdb => Item::Str(std::str::from_utf8(self.bytes(4)?).map_err(|_| Bad)?),
            0xdc => Item::Array(self.len(2)?),
            0xdd => Item::Array(self.len(4)?),
            0xde => Item::Map(self.len(2)?),
            0xdf => Item::Map(self.len(4)?),
            0xe0..=0xff => Item::Int(c as i8 as i128),
            _ => return Err(Bad), // 0xc1: never used
        })
    }
}

/// Skip one whole value; returns its span (maps count two items a pair).
pub fn skip(c: &mut Cur<'_>, depth: usize) -> R<(usize, usize)> {
    let start = c.i;
    skip_in(c, depth)?;
    Ok((start, c.i))
}

fn skip_in(c: &mut Cur<'_>, depth: usize) -> R<()> {
    if depth >= MAX_DEPTH {
        return Err(Bad);
    }
    match c.item()? {
        Item::Array(n) => {
            for _ in 0..n {
                skip_in(c, depth + 1)?;
            }
        }
        Item::Map(n) => {
            for _ in 0..n {
                skip_in(c, depth + 1)?;
                skip_in(c, depth + 1)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The value at the cursor written as JSON (msgspec's decode, then its JSON encode).
pub fn to_json(out: &mut Vec<u8>, c: &mut Cur<'_>, depth: usize) -> R<()> {
    if depth >= MAX_DEPTH {
        return Err(Bad);
    }
    match c.item()? {
        Item::Nil => out.extend_from_slice(b"null"),
        Item::Bool(true) => out.extend_from_slice(b"true"),
        Item::Bool(false) => out.extend_from_slice(b"false"),
        Item::Int(v) => out.extend_from_slice(v.to_string().as_bytes()),
        Item::Float(x) => write_f64(out, x),
        Item::Str(s) => write_str(out, s),
        Item::Bin(b) => write_b64(out, b),
        Item::Ext(code, data) => {
            if code == -1 {
                return Err(Bad); // a timestamp: msgspec makes a datetime (not written here)
            }
            out.extend_from_slice(b"{\"ext\":");
            out.extend_from_slice(code.to_string().as_bytes());
            out.extend_from_slice(b",\"data\":");
            write_b64(out, data);
            out.push(b'}');
        }
        Item::Array(n) => {
            out.push(b'[');
            for k in 0..n {
                if k > 0 {
                    out.push(b',');
                }
                to_json(out, c, depth + 1)?;
            }
            out.push(b']');
        }
        Item::Map(n) => {
            out.push(b'{');
            for k in 0..n {
                if k > 0 {
                    out.push(b',');
                }
                match c.item()? {
                    Item::Str(s) => write_str(out, s),
                    Item::Int(v) => {
                        out.push(b'"');
                        out.extend_from_slice(v.to_string().as_bytes());
                        out.push(b'"');
                    }
                    _ => return Err(Bad), // a key JSON cannot hold
                }
                out.push(b':');
                to_json(out, c, depth + 1)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

/// A span written as JSON (the whole span must be one value).
pub fn span_json(out: &mut Vec<u8>, b: &[u8]) -> R<()> {
    let mut c = Cur::new(b);
    to_json(out, &mut c, 0)?;
    if c.i != b.len() {
        return Err(Bad);
    }
    Ok(())
}

/// A reward's value: a number's float, `None` otherwise.
pub fn reward(b: &[u8]) -> Option<f64> {
    match Cur::new(b).item() {
        Ok(Item::Int(v)) => Some(v as f64),
        Ok(Item::Float(x)) => Some(x),
        _ => None,
    }
}

/// Python's truth of the value (`bool(value)`).
pub fn truthy(b: &[u8]) -> bool {
    match Cur::new(b).item() {
        Ok(Item::Nil) | Err(_) => false,
        Ok(Item::Bool(v)) => v,
        Ok(Item::Int(v)) => v != 0,
        Ok(Item::Float(x)) => x != 0.0,
        Ok(Item::Str(s)) => !s.is_empty(),
        Ok(Item::Bin(b)) => !b.is_empty(),
        Ok(Item::Ext(..)) => true,
        Ok(Item::Array(n) | Item::Map(n)) => n > 0,
    }
}

/// Whether the span is nil.
pub fn is_nil(b: &[u8]) -> bool {
    b == [0xc0]
}
