//! JSON as the Python writer (msgspec) reads and writes it: a validating scanner that finds a
//! value's exact bytes (msgspec's `Raw`), and an encoder writing values as msgspec's JSON
//! encoder does (no spaces, its string escapes, its float layout).

/// Nesting deeper than this is refused (a frame is the worker's, but bounded all the same).
pub const MAX_DEPTH: usize = 256;

#[derive(Debug)]
pub struct Bad;

pub type R<T> = Result<T, Bad>;

/// The bytes that end a string's plain run: a quote, a backslash, a control character.
static STOP: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 0x20 {
        t[c] = true;
        c += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// A cursor over one JSON text (already checked to be UTF-8).
pub struct Scan<'a> {
    pub b: &'a [u8],
    pub i: usize,
}

impl<'a> Scan<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Scan { b, i: 0 }
    }

    pub fn ws(&mut self) {
        while self.i < self.b.len() && matches!(self.b[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    pub fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    pub fn eat(&mut self, c: u8) -> R<()> {
        self.ws();
        if self.peek() == Some(c) {
            self.i += 1;
            Ok(())
        } else {
            Err(Bad)
        }
    }

    /// The end of the text: only whitespace left.
    pub fn end(&mut self) -> R<()> {
        self.ws();
        if self.i == self.b.len() {
            Ok(())
        } else {
            Err(Bad)
        }
    }

    /// An object's members, its `{` to its `}`: `each` gets the scanner, the member's value
    /// next (`each` consumes it), and the key's span and whether it holds escapes.
    pub fn members(
        &mut self,
        mut each: impl FnMut(&mut Self, (usize, usize, bool)) -> R<()>,
    ) -> R<()> {
        self.eat(b'{')?;
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            self.ws();
            let key = self.string()?;
            self.eat(b':')?;
            each(self, key)?;
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(Bad),
            }
        }
    }

    /// Skip one value (validated); returns its span.
    pub fn value(&mut self, depth: usize) -> R<(usize, usize)> {
        self.ws();
        let start = self.i;
        match self.peek().ok_or(Bad)? {
            b'{' => {
                if depth >= MAX_DEPTH {
                    return Err(Bad);
                }
                self.members(|s, _| s.value(depth + 1).map(|_| ()))?;
            }
            b'[' => {
                if depth >= MAX_DEPTH {
                    return Err(Bad);
                }
                self.i += 1;
                self.ws();
                if self.peek() == Some(b']') {
                    self.i += 1;
                } else {
                    loop {
                        self.value(depth + 1)?;
                        self.ws();
                        match self.peek() {
                            Some(b',') => self.i += 1,
                            Some(b']') => {
                                self.i += 1;
                                break;
                            }
                            _ => return Err(Bad),
                        }
                    }
                }
            }
            b'"' => {
                self.string()?;
            }
            b't' => self.word(b"true")?,
            b'f' => self.word(b"false")?,
            b'n' => self.word(b"null")?,
            _ => {
                self.number()?;
            }
        }
        Ok((start, self.i))
    }

    /// Skip one value of a trusted text (a frame the worker encoded, or decoded and checked,
    /// itself) without validating its grammar: strings to their closing quote (escapes
    /// stepped over), containers by their brackets' depth (at most [`MAX_DEPTH`]),
    /// scalars to the next delimiter; returns its span. The text must be UTF-8 already
    /// (checked whole by the caller): a span starts and ends at ASCII bytes. A well-formed
    /// value gets the span [`Scan::value`] gives; a malformed one some bounded span.
    pub fn skip(&mut self) -> R<(usize, usize)> {
        self.ws();
        let b = self.b;
        let start = self.i;
        let mut i = start;
        match *b.get(i).ok_or(Bad)? {
            b'{' | b'[' | b'"' => i = skip_nested(b, i)?,
            b'}' | b']' | b',' | b':' => return Err(Bad),
            _ => {
                while i < b.len()
                    && !matches!(b[i], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
                {
                    i += 1;
                }
            }
        }
        self.i = i;
        Ok((start, i))
    }

    fn word(&mut self, w: &[u8]) -> R<()> {
        if self.b[self.i..].starts_with(w) {
            self.i += w.len();
            Ok(())
        } else {
            Err(Bad)
        }
    }

    /// A string at the cursor: its span (quotes included) and whether it holds escapes.
    pub fn string(&mut self) -> R<(usize, usize, bool)> {
        if self.peek() != Some(b'"') {
            return Err(Bad);
        }
        let start = self.i;
        self.i += 1;
        let mut escaped = false;
        loop {
            // the plain run up to the next quote, backslash or control character
            let rest = self.b.get(self.i..).ok_or(Bad)?;
            let mut run = 0;
            let mut high = 0u8;
            while run < rest.len() && !STOP[rest[run] as usize] {
                high |= rest[run];
                run += 1;
            }
            if run == rest.len() {
                return Err(Bad);
            }
            let text = &rest[..run];
            if high >= 0x80 {
                // a run ends at an ASCII byte: whole characters, validated here (not the frame)
                std::str::from_utf8(text).map_err(|_| Bad)?;
            }
            self.i += run;
            let c = rest[run];
            match c {
                b'"' => {
                    self.i += 1;
                    return Ok((start, self.i, escaped));
                }
                b'\\' => {
                    escaped = true;
                    let e = *self.b.get(self.i + 1).ok_or(Bad)?;
                    match e {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 2,
                        b'u' => {
                            let hex = self.b.get(self.i + 2..self.i + 6).ok_or(Bad)?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return Err(Bad);
                            }
                            self.i += 6;
                        }
                        _ => return Err(Bad),
                    }
                }
                0..=0x1f => return Err(Bad),
                _ => self.i += 1,
            }
        }
    }

    /// A number at the cursor: its span and whether it is an integer (no `.`, no exponent).
    pub fn number(&mut self) -> R<(usize, usize, bool)> {
        let b = self.b;
        let start = self.i;
        let mut i = self.i;
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while matches!(b.get(i), Some(b'0'..=b'9')) {
                    i += 1;
                }
            }
            _ => return Err(Bad),
        }
        let mut int = true;
        if b.get(i) == Some(&b'.') {
            int = false;
            i += 1;
            if !matches!(b.get(i), Some(b'0'..=b'9')) {
                return Err(Bad);
            }
            while matches!(b.get(i), Some(b'0'..=b'9')) {
                i += 1;
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            int = false;
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if !matches!(b.get(i), Some(b'0'..=b'9')) {
                return Err(Bad);
            }
            while matches!(b.get(i), Some(b'0'..=b'9')) {
                i += 1;
            }
        }
        self.i = i;
        Ok((start, i, int))
    }
}

/// The bytes [`skip_nested`] looks at, among the 16 of a block: bit k for its k-th byte.
#[derive(Clone, Copy, PartialEq, Debug)]
struct Marks {
    quotes: u32,
    backslashes: u32,
    opens: u32,
    closes: u32,
}

impl Marks {
    fn any(&self) -> u32 {
        self.quotes | self.backslashes | self.opens | self.closes
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn marks(c: &[u8; 16]) -> Marks {
    use std::arch::x86_64::*;
    // SAFETY: SSE2 is part of x86_64; the load reads the 16 bytes of `c`, unaligned.
    unsafe {
        let v = _mm_loadu_si128(c.as_ptr() as *const __m128i);
        // `|0x20` maps `[` to `{` and `]` to `}` (and no other byte to either)
        let low = _mm_or_si128(v, _mm_set1_epi8(0x20));
        let bits =
            |x: __m128i, c: u8| _mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_set1_epi8(c as i8))) as u32;
        Marks {
            quotes: bits(v, b'"'),
            backslashes: bits(v, b'\\'),
            opens: bits(low, b'{'),
            closes: bits(low, b'}'),
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn marks(c: &[u8; 16]) -> Marks {
    marks_bytewise(c)
}

#[allow(dead_code)] // the other architectures' [`marks`], and its tests' reference
fn marks_bytewise(c: &[u8; 16]) -> Marks {
    let mut m = Marks {
        quotes: 0,
        backslashes: 0,
        opens: 0,
        closes: 0,
    };
    for (k, &x) in c.iter().enumerate() {
        match x {
            b'"' => m.quotes |= 1 << k,
            b'\\' => m.backslashes |= 1 << k,
            b'{' | b'[' => m.opens |= 1 << k,
            b'}' | b']' => m.closes |= 1 << k,
            _ => {}
        }
    }
    m
}

/// Bit k set when an odd number of `x`'s bits 0..=k are (the bytes a block's quotes enclose,
/// with its opening quotes).
#[inline(always)]
fn prefix_xor(mut x: u32) -> u32 {
    x ^= x << 1;
    x ^= x << 2;
    x ^= x << 4;
    x ^= x << 8;
    x & 0xffff
}

/// The index after the container or string that opens at `i` (a trusted text: strings to
/// their closing quote, escapes stepped over, not checked; containers by their brackets'
/// depth, at most [`MAX_DEPTH`], not matched), 16 bytes at a time. A block without a
/// backslash in which the value cannot end (fewer closing brackets outside strings than the
/// depth; for a string, no quote) is passed whole, its brackets and quotes counted; any
/// other block's marks are visited one by one, in order.
fn skip_nested(b: &[u8], mut i: usize) -> R<usize> {
    let mut depth = 0usize;
    let mut quoted = false;
    let mut escaped = false; // the block's first byte is escaped (a backslash ended the last)
    match b[i] {
        b'"' => quoted = true,
        _ => depth = 1, // `{` or `[`
    }
    i += 1;
    while i < b.len() {
        let n = (b.len() - i).min(16);
        let mk = match b.get(i..i + 16) {
            Some(block) => marks(block.try_into().unwrap()),
            None => {
                let mut block = [0u8; 16]; // past the text: zeros, no mark
                block[..n].copy_from_slice(&b[i..]);
                marks(&block)
            }
        };
        if !escaped && mk.backslashes == 0 {
            let enclosed = prefix_xor(mk.quotes); // its bit 15: the quotes' parity
            let inside = enclosed ^ if quoted { 0xffff } else { 0 };
            // counted only when some are: the baseline x86_64 has no popcnt instruction
            let count = |m: u32| if m == 0 { 0 } else { m.count_ones() as usize };
            let opens = count(mk.opens & !inside);
            let closes = count(mk.closes & !inside);
            let passed = if depth == 0 {
                quoted && mk.quotes == 0 // within the string the value is
            } else {
                closes < depth && depth + opens <= MAX_DEPTH
            };
            if passed {
                depth = depth + opens - closes;
                quoted ^= enclosed >> 15 == 1;
                i += n;
                continue;
            }
        }
        let mut m = mk.any();
        if escaped {
            m &= !1;
            escaped = false;
        }
        while m != 0 {
            let k = m.trailing_zeros();
            m &= m - 1;
            let j = i + k as usize;
            match b[j] {
                b'"' => {
                    quoted = !quoted;
                    if !quoted && depth == 0 {
                        return Ok(j + 1);
                    }
                }
                b'\\' if quoted => {
                    if k == 15 {
                        escaped = true;
                    } else {
                        m &= !(1 << (k + 1));
                    }
                }
                b'{' | b'[' if !quoted => {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        return Err(Bad);
                    }
                }
                b'}' | b']' if !quoted => {
                    // a text opening with a quote is a string: it ends at its quote, first
                    depth = depth.checked_sub(1).ok_or(Bad)?;
                    if depth == 0 {
                        return Ok(j + 1);
                    }
                }
                _ => {}
            }
        }
        i += n;
    }
    Err(Bad)
}

/// The text of a string token (its quotes included), escapes undone.
pub fn unescape(tok: &[u8]) -> R<String> {
    let inner = &tok[1..tok.len() - 1];
    if !inner.contains(&b'\\') {
        return std::str::from_utf8(inner)
            .map(str::to_owned)
            .map_err(|_| Bad);
    }
    let mut out = String::with_capacity(inner.len());
    let s = std::str::from_utf8(inner).map_err(|_| Bad)?;
    let mut chars = s.char_indices();
    while let Some((_, c)) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let (_, e) = chars.next().ok_or(Bad)?;
        match e {
            '"' => out.push('"'),
            '\\' => out.push('\\'),
            '/' => out.push('/'),
            'b' => out.push('\u{8}'),
            'f' => out.push('\u{c}'),
            'n' => out.push('\n'),
            'r' => out.push('\r'),
            't' => out.push('\t'),
            'u' => {
                let hi = hex4(&mut chars)?;
                if (0xD800..0xDC00).contains(&hi) {
                    // a surrogate pair: the low half must follow
                    let (_, a) = chars.next().ok_or(Bad)?;
                    let (_, b) = chars.next().ok_or(Bad)?;
                    if a != '\\' || b != 'u' {
                        return Err(Bad);
                    }
                    let lo = hex4(&mut chars)?;
                    if !(0xDC00..0xE000).contains(&lo) {
                        return Err(Bad);
                    }
                    let cp = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                    out.push(char::from_u32(cp).ok_or(Bad)?);
                } else {
                    out.push(char::from_u32(hi).ok_or(Bad)?);
                }
            }
            _ => return Err(Bad),
        }
    }
    Ok(out)
}

fn hex4(chars: &mut std::str::CharIndices<'_>) -> R<u32> {
    let mut v = 0u32;
    for _ in 0..4 {
        let (_, c) = chars.next().ok_or(Bad)?;
        v = v * 16 + c.to_digit(16).ok_or(Bad)?;
    }
    Ok(v)
}

/// Whether a string token equals `key` (escapes undone when there are any).
pub fn key_is(tok: &[u8], escaped: bool, key: &str) -> bool {
    if !escaped {
        &tok[1..tok.len() - 1] == key.as_bytes()
    } else {
        unescape(tok).map(|s| s == key).unwrap_or(false)
    }
}

// -- writing ---------------------------------------------------------------------------------

/// `s` as a JSON string, escaped as msgspec does (`"`, `\`, and control characters; the rest
/// as it is).
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let b = s.as_bytes();
    let mut from = 0;
    for (i, &c) in b.iter().enumerate() {
        let esc: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&b[from..i]);
        if esc.is_empty() {
            out.extend_from_slice(format!("\\u{:04x}", c).as_bytes());
        } else {
            out.extend_from_slice(esc);
        }
        from = i + 1;
    }
    out.extend_from_slice(&b[from..]);
    out.push(b'"');
}

/// A float as msgspec writes it: `null` when not finite; else the shortest digits that read
/// back the same, laid out plainly for a decimal exponent in [-5, 16) (`1.0`, `0.00001`,
/// `1000000000000000.0`), else as `1.5e16`, `1e-7`.
pub fn write_f64(out: &mut Vec<u8>, x: f64) {
    if !x.is_finite() {
        out.extend_from_slice(b"null");
        return;
    }
    let sci = format!("{:e}", x); // shortest round-trip digits: "-1.2345e-7"
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if neg {
        out.push(b'-');
    }
    if (-5..16).contains(&exp) {
        if exp < 0 {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', (-exp - 1) as usize));
            out.extend_from_slice(digits.as_bytes());
        } else {
            let point = exp as usize + 1;
            if digits.len() <= point {
                out.extend_from_slice(digits.as_bytes());
                out.extend(std::iter::repeat_n(b'0', point - digits.len()));
                out.extend_from_slice(b".0");
            } else {
                out.extend_from_slice(&digits.as_bytes()[..point]);
                out.push(b'.');
                out.extend_from_slice(&digits.as_bytes()[point..]);
            }
        }
    } else {
        out.extend_from_slice(mant.as_bytes());
        out.push(b'e');
        out.extend_from_slice(exp.to_string().as_bytes());
    }
}

/// Standard base64 with padding (msgspec's bytes in JSON).
pub fn write_b64(out: &mut Vec<u8>, data: &[u8]) {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    out.push(b'"');
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        out.push(T[(n >> 18) as usize & 63]);
        out.push(T[(n >> 12) as usize & 63]);
        out.push(if c.len() > 1 {
            T[(n >> 6) as usize & 63]
        } else {
            b'='
        });
        out.push(if c.len() > 2 {
            T[n as usize & 63]
        } else {
            b'='
        });
    }
    out.push(b'"');
}

/// A JSON value (its span validated) written again as msgspec writes what it decoded:
/// whitespace gone, strings escaped its way, integers as their digits (`-0` is `0`), floats
/// through [`write_f64`].
pub fn normalize(out: &mut Vec<u8>, s: &mut Scan<'_>, depth: usize) -> R<()> {
    s.ws();
    match s.peek().ok_or(Bad)? {
        b'{' => {
            if depth >= MAX_DEPTH {
                return Err(Bad);
            }
            s.i += 1;
            out.push(b'{');
            s.ws();
            if s.peek() == Some(b'}') {
                s.i += 1;
            } else {
                let mut first = true;
                loop {
                    s.ws();
                    if !first {
                        out.push(b',');
                    }
                    first = false;
                    let (a, b, _) = s.string()?;
                    write_str(out, &unescape(&s.b[a..b])?);
                    s.eat(b':')?;
                    out.push(b':');
                    normalize(out, s, depth + 1)?;
                    s.ws();
                    match s.peek() {
                        Some(b',') => s.i += 1,
                        Some(b'}') => {
                            s.i += 1;
                            break;
                        }
                        _ => return Err(Bad),
                    }
                }
            }
            out.push(b'}');
        }
        b'[' => {
            if depth >= MAX_DEPTH {
                return Err(Bad);
            }
            s.i += 1;
            out.push(b'[');
            s.ws();
            if s.peek() == Some(b']') {
                s.i += 1;
            } else {
                let mut first = true;
                loop {
                    if !first {
                        out.push(b',');
                    }
                    first = false;
                    normalize(out, s, depth + 1)?;
                    s.ws();
                    match s.peek() {
                        Some(b',') => s.i += 1,
                        Some(b']') => {
                            s.i += 1;
                            break;
                        }
                        _ => return Err(Bad),
                    }
                }
            }
            out.push(b']');
        }
        b'"' => {
            let (a, b, esc) = s.string()?;
            if esc {
                write_str(out, &unescape(&s.b[a..b])?);
            } else {
                let t = std::str::from_utf8(&s.b[a + 1..b - 1]).map_err(|_| Bad)?;
                write_str(out, t);
            }
        }
        b't' | b'f' | b'n' => {
            let (a, b) = s.value(depth)?;
            out.extend_from_slice(&s.b[a..b]);
        }
        _ => {
            let (a, b, int) = s.number()?;
            let t = &s.b[a..b];
            if int {
                out.extend_from_slice(if t == b"-0" { b"0" } else { t });
            } else {
                write_f64(out, parse_f64(t)?);
            }
        }
    }
    Ok(())
}

pub fn parse_f64(t: &[u8]) -> R<f64> {
    std::str::from_utf8(t)
        .map_err(|_| Bad)?
        .parse::<f64>()
        .map_err(|_| Bad)
}

/// A reward's value from its span: a number's float (`None` for anything else: a bool, a
/// string, null).
pub fn reward(t: &[u8]) -> Option<f64> {
    match t.first() {
        Some(b'-' | b'0'..=b'9') => parse_f64(t).ok(),
        _ => None,
    }
}

/// Python's truth of a JSON value from its span (`bool(value)`).
pub fn truthy(t: &[u8]) -> bool {
    match t.first() {
        None => false,
        Some(b'n' | b'f') => false,
        Some(b't') => true,
        Some(b'"') => t.len() > 2,
        Some(b'[' | b'{') => {
            let inner = &t[1..t.len() - 1];
            inner
                .iter()
                .any(|c| !matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
        }
        _ => parse_f64(t).map(|x| x != 0.0).unwrap_or(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(x: f64) -> String {
        let mut o = Vec::new();
        write_f64(&mut o, x);
        String::from_utf8(o).unwrap()
    }

    #[test]
    fn floats_as_msgspec() {
        assert_eq!(f(1.0), "1.0");
        assert_eq!(f(0.1), "0.1");
        assert_eq!(f(1e15), "1000000000000000.0");
        assert_eq!(f(1e16), "1e16");
        assert_eq!(f(1.5e-5), "0.000015");
        assert_eq!(f(1e-6), "1e-6");
        assert_eq!(f(-0.0), "-0.0");
        assert_eq!(f(1.2345678901234568e16), "1.2345678901234568e16");
        assert_eq!(f(123456789.123), "123456789.123");
        assert_eq!(f(5e-324), "5e-324");
        assert_eq!(f(f64::NAN), "null");
    }

    #[test]
    fn strings_as_msgspec() {
        let mut o = Vec::new();
        write_str(&mut o, "a\"\\ \u{0}\u{1f}\u{7f} é /\u{8}\u{c}\n\r\t");
        assert_eq!(
            String::from_utf8(o).unwrap(),
            "\"a\\\"\\\\ \\u0000\\u001f\u{7f} é /\\b\\f\\n\\r\\t\""
        );
        let mut o = Vec::new();
        write_b64(&mut o, b"\x00\xff");
        assert_eq!(o, b"\"AP8=\"");
    }

    #[test]
    fn normalizes() {
        let mut o = Vec::new();
        let mut s = Scan::new(b" { \"a\" : [1, -0, 1e2, \"\\u00e9\\n\", true, null] } ");
        normalize(&mut o, &mut s, 0).unwrap();
        assert_eq!(
            String::from_utf8(o).unwrap(),
            "{\"a\":[1,0,100.0,\"é\\n\",true,null]}"
        );
    }

    #[test]
    fn refuses_bad_text() {
        for bad in [&b"{"[..], b"[1,]", b"\"\\x\"", b"01", b"1.", b"tru"] {
            let mut s = Scan::new(bad);
            assert!(s.value(0).and_then(|_| s.end()).is_err(), "{:?}", bad);
        }
    }

    #[test]
    fn skips_as_value_spans() {
        let good: [&[u8]; 7] = [
            b"{\"a\":[1,{\"b\":\"}]\\\"x\"}],\"c\":null} ,",
            b" [ 1 , \"\\u00e9]\" ] ]",
            b"\"a\\\\\"}",
            b"-1.5e3,",
            b"true}",
            b"{}",
            b"[[[]]]",
        ];
        for text in good {
            let (mut a, mut b) = (Scan::new(text), Scan::new(text));
            assert_eq!(
                a.value(0).ok(),
                b.skip().ok(),
                "{:?}",
                std::str::from_utf8(text)
            );
        }
        for bad in [&b"{"[..], b"\"ab", b"", b"[\"]"] {
            assert!(Scan::new(bad).skip().is_err(), "{:?}", bad);
        }
        let deep = vec![b'['; MAX_DEPTH + 1];
        assert!(Scan::new(&deep).skip().is_err());
    }
    /// The skip of before [`skip_nested`] (byte by byte): the reference it is held to.
    fn skip_bytewise(b: &[u8]) -> R<(usize, usize)> {
        let nest = |c: u8| matches!(c, b'"' | b'{' | b'[' | b'}' | b']');
        let string = |b: &[u8], mut i: usize| -> R<usize> {
            i += 1;
            loop {
                while i < b.len() && !matches!(b[i], b'"' | b'\\') {
                    i += 1;
                }
                match *b.get(i).ok_or(Bad)? {
                    b'"' => return Ok(i + 1),
                    _ => i += 2,
                }
            }
        };
        let mut s = Scan::new(b);
        s.ws();
        let start = s.i;
        let mut i = start;
        match *b.get(i).ok_or(Bad)? {
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    while i < b.len() && !nest(b[i]) {
                        i += 1;
                    }
                    match *b.get(i).ok_or(Bad)? {
                        b'"' => {
                            i = string(b, i)?;
                            continue;
                        }
                        b'{' | b'[' => {
                            depth += 1;
                            if depth > MAX_DEPTH {
                                return Err(Bad);
                            }
                        }
                        _ => {
                            depth -= 1;
                            if depth == 0 {
                                return Ok((start, i + 1));
                            }
                        }
                    }
                    i += 1;
                }
            }
            b'"' => i = string(b, i)?,
            b'}' | b']' | b',' | b':' => return Err(Bad),
            _ => {
                while i < b.len()
                    && !matches!(b[i], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
                {
                    i += 1;
                }
            }
        }
        Ok((start, i))
    }

    #[test]
    fn skips_as_before_on_any_text() {
        // texts of the bytes that matter, of every length across a block or two, drawn by a
        // fixed xorshift: the block-wise skip gives the spans (and refusals) of the old one
        let dense = b"{}[]\"\\a:, \xc3";
        let sparse = b"{}[]\"\\a:, \xc3aaaaaaaaaaaaaaaaaaaa";
        let mut x = 0x9e3779b97f4a7c15u64;
        for round in 0..400_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (alphabet, len) = if round % 2 == 0 {
                (&dense[..], (x % 40) as usize)
            } else {
                (&sparse[..], (x % 120) as usize)
            };
            let mut text = Vec::with_capacity(len);
            let mut y = x;
            for _ in 0..len {
                y ^= y << 13;
                y ^= y >> 7;
                y ^= y << 17;
                text.push(alphabet[(y % alphabet.len() as u64) as usize]);
            }
            if !text.is_empty() && x & 1 == 0 {
                text[0] = b"{[\""[(x >> 8) as usize % 3];
            }
            let mine = Scan::new(&text).skip();
            assert_eq!(mine.ok(), skip_bytewise(&text).ok(), "{:?}", text);
        }
        let mut block = [0u8; 16];
        for x in 0..=255u8 {
            block[x as usize % 16] = x;
            assert_eq!(marks(&block), marks_bytewise(&block), "{}", x);
        }
    }
}
