//! One ended episode's frames turned into its row's values, as the Python writer
//! (`stadium/_server/ledger/rows.py`) turns them: the usual path (every step answered an
//! observation: a JSON session's values stored as the very bytes sent, a MessagePack
//! session's as JSON) and, for an episode with a failed step or frames the usual path
//! refuses, the plain-values path (each value decoded and written again as JSON).

use crate::json::{self, Bad, Scan, R};
use crate::msgpack::{self, Cur, Item};

/// A text of the row: a range of [`Out::arena`], or a null.
pub type Txt = Option<(usize, usize)>;

/// One step as the pipe brought it: its request frame at `start..mid` of its episode's
/// buffer, its reply at `mid..end` (24 bytes: written per step, read back at the episode's
/// end, a fifth of the memory the frames take).
pub struct Step {
    pub took: f64,
    pub start: u32,
    pub mid: u32,
    pub end: u32,
    pub failed: bool,
}

impl Step {
    fn action(&self) -> std::ops::Range<usize> {
        self.start as usize..self.mid as usize
    }

    fn reply(&self) -> std::ops::Range<usize> {
        self.mid as usize..self.end as usize
    }
}

const _: () = assert!(std::mem::size_of::<Step>() == 24);

/// An episode's frames: the reset reply and its steps, in one buffer.
pub struct Frames<'a> {
    pub json: bool,
    pub reset: &'a [u8],
    pub data: &'a [u8],
    pub steps: &'a [Step],
}

/// An episode's values (reused from one episode to the next).
#[derive(Default)]
pub struct Out {
    pub arena: Vec<u8>,
    pub actions: Vec<Txt>,
    pub observations: Vec<Txt>,
    pub rewards: Vec<Option<f64>>,
    pub dones: Vec<bool>,
    pub truncateds: Vec<bool>,
    pub infos: Vec<Txt>,
    pub errors: Vec<Txt>,
    pub step_s: Vec<f64>,
    pub reset_observation: Txt,
    pub reset_info: Txt,
    pub error: Option<String>,
    pub total: f64,
}

impl Out {
    fn clear(&mut self) {
        self.arena.clear();
        self.actions.clear();
        self.observations.clear();
        self.rewards.clear();
        self.dones.clear();
        self.truncateds.clear();
        self.infos.clear();
        self.errors.clear();
        self.step_s.clear();
        self.reset_observation = None;
        self.reset_info = None;
        self.error = None;
        self.total = 0.0;
    }

    pub fn text(&self, t: Txt) -> Option<&str> {
        // The arena holds only UTF-8: JSON spans cut at ASCII bytes of validated frames
        // (strings checked by `Scan::string`, the rest ASCII by the grammar), text written
        // here from `&str`s, MessagePack strings checked when read. Checked again in tests.
        t.map(|(a, b)| {
            let bytes = &self.arena[a..b];
            debug_assert!(std::str::from_utf8(bytes).is_ok());
            // SAFETY: UTF-8, as said above.
            unsafe { std::str::from_utf8_unchecked(bytes) }
        })
    }

    fn put(&mut self, bytes: &[u8]) -> Txt {
        let a = self.arena.len();
        self.arena.extend_from_slice(bytes);
        Some((a, self.arena.len()))
    }

    /// A value's span written as JSON into the arena: the very bytes (a JSON session's usual
    /// path), or decoded and written again.
    fn put_value(&mut self, frame: &[u8], span: (usize, usize), json: bool, raw: bool) -> R<Txt> {
        let a = self.arena.len();
        let v = &frame[span.0..span.1];
        if json {
            if raw {
                self.arena.extend_from_slice(v);
            } else {
                json::normalize(&mut self.arena, &mut Scan::new(v), 0)?;
            }
        } else {
            msgpack::span_json(&mut self.arena, v)?;
        }
        Ok(Some((a, self.arena.len())))
    }

    fn finish(&mut self) {
        // Python's `sum(finite rewards, 0.0)`: since 3.12, Neumaier's compensated sum
        let (mut sum, mut c) = (0.0f64, 0.0f64);
        for &x in self.rewards.iter().flatten().filter(|r| r.is_finite()) {
            let t = sum + x;
            if sum.abs() >= x.abs() {
                c += (sum - t) + x;
            } else {
                c += (x - t) + sum;
            }
            sum = t;
        }
        if c != 0.0 && c.is_finite() {
            sum += c;
        }
        self.total = sum;
    }
}

/// What a reply (or a request) holds: the spans of its `data`'s fields.
#[derive(Default, Clone, Copy)]
struct Fields {
    data: Option<(usize, usize)>,
    observation: Option<(usize, usize)>,
    reward: Option<(usize, usize)>,
    done: Option<(usize, usize)>,
    truncated: Option<(usize, usize)>,
    info: Option<(usize, usize)>,
}

const F_OBS: u8 = 1;
const F_REWARD: u8 = 2;
const F_DONE: u8 = 3;
const F_TRUNC: u8 = 4;
const F_INFO: u8 = 5;

fn field_of(name: &[u8], info_key: &str) -> Option<u8> {
    if name == info_key.as_bytes() {
        return Some(F_INFO);
    }
    match name {
        b"observation" => Some(F_OBS),
        b"reward" => Some(F_REWARD),
        b"done" => Some(F_DONE),
        b"truncated" => Some(F_TRUNC),
        _ => None,
    }
}

fn set(f: &mut Fields, which: u8, span: (usize, usize)) {
    match which {
        F_OBS => f.observation = Some(span),
        F_REWARD => f.reward = Some(span),
        F_DONE => f.done = Some(span),
        F_TRUNC => f.truncated = Some(span),
        F_INFO => f.info = Some(span),
        _ => {}
    }
}

/// A JSON object's members: each key, its value's span.
fn json_members(s: &mut Scan<'_>, mut each: impl FnMut(&[u8], bool, (usize, usize))) -> R<()> {
    s.members(|s, (a, b, esc)| {
        let span = s.skip()?;
        let text = s.b;
        each(&text[a..b], esc, span);
        Ok(())
    })
}

/// A JSON frame's top-level `data` and, when it is an object, its fields: the frame's
/// UTF-8 checked whole, then one pass over its top level and `data`'s members, their
/// values skipped, not validated ([`Scan::skip`]: the frames are the worker's own, a
/// reply it encoded or a request it decoded and checked; a malformed one still gives
/// bounded spans of UTF-8).
fn json_fields(frame: &[u8], info_key: &str, inner: bool) -> R<Fields> {
    std::str::from_utf8(frame).map_err(|_| Bad)?;
    let mut s = Scan::new(frame);
    let mut f = Fields::default();
    s.members(|s, (a, b, esc)| {
        s.ws();
        let is_data = json::key_is(&frame[a..b], esc, "data");
        let span = if is_data && inner && s.peek() == Some(b'{') {
            let start = s.i;
            let mut g = Fields::default();
            json_members(s, |tok, esc, span| {
                let which = if esc {
                    json::unescape(tok)
                        .ok()
                        .and_then(|k| field_of(k.as_bytes(), info_key))
                } else {
                    field_of(&tok[1..tok.len() - 1], info_key) // UTF-8: `Scan::string` checked it
                };
                if let Some(which) = which {
                    set(&mut g, which, span);
                }
            })?;
            f = g;
            (start, s.i)
        } else {
            s.skip()?
        };
        if is_data {
            if span.0 == span.1 || frame[span.0] != b'{' {
                let data = f.data;
                f = Fields {
                    data,
                    ..Fields::default()
                }; // a later non-object `data`
            }
            f.data = Some(span);
        }
        Ok(())
    })?;
    s.end()?;
    Ok(f)
}

/// A MessagePack frame's top-level `data` and, when it is a map, its fields (keys must be
/// strings: `strict` — the usual path's typed decoder — refuses others).
fn msgpack_fields(frame: &[u8], info_key: &str, inner: bool) -> R<Fields> {
    let mut c = Cur::new(frame);
    let mut f = Fields::default();
    let n = match c.item()? {
        Item::Map(n) => n,
        _ => return Err(Bad),
    };
    for _ in 0..n {
        let key = msgpack::skip(&mut c, 1)?;
        let span = msgpack::skip(&mut c, 1)?;
        if let Ok(Item::Str("data")) = Cur::new(&frame[key.0..key.1]).item() {
            f.data = Some(span);
        }
    }
    if c.i != frame.len() {
        return Err(Bad);
    }
    if inner {
        if let Some((a, b)) = f.data {
            let mut d = Cur::new(&frame[..b]);
            d.i = a;
            if let Item::Map(n) = d.item()? {
                for _ in 0..n {
                    let key = d.item()?;
                    let span = msgpack::skip(&mut d, 2)?;
                    if let Item::Str(k) = key {
                        if let Some(which) = field_of(k.as_bytes(), info_key) {
                            set(&mut f, which, span);
                        }
                    }
                }
            }
        }
    }
    Ok(f)
}

fn fields(frame: &[u8], json: bool, info_key: &str, inner: bool) -> R<Fields> {
    if json {
        json_fields(frame, info_key, inner)
    } else {
        msgpack_fields(frame, info_key, inner)
    }
}

fn is_object(frame: &[u8], span: (usize, usize), json: bool) -> bool {
    if json {
        frame[span.0] == b'{'
    } else {
        matches!(Cur::new(&frame[span.0..span.1]).item(), Ok(Item::Map(_)))
    }
}

fn is_null(v: &[u8], json: bool) -> bool {
    if json {
        v == b"null"
    } else {
        msgpack::is_nil(v)
    }
}

fn truthy(v: &[u8], json: bool) -> bool {
    if json {
        json::truthy(v)
    } else {
        msgpack::truthy(v)
    }
}

fn reward(v: &[u8], json: bool) -> Option<f64> {
    if json {
        json::reward(v)
    } else {
        msgpack::reward(v)
    }
}

/// A typed bool (the usual path's `done`, `truncated`): absent is false, not a bool refused.
fn strict_bool(v: Option<&[u8]>, json: bool) -> R<bool> {
    match v {
        None => Ok(false),
        Some(b"true") if json => Ok(true),
        Some(b"false") if json => Ok(false),
        Some([0xc3]) if !json => Ok(true),
        Some([0xc2]) if !json => Ok(false),
        Some(_) => Err(Bad),
    }
}

/// The usual path: every step answered an observation. Errors where msgspec's typed
/// decoders would (then the plain path is tried).
pub fn usual(ep: &Frames<'_>, info_key: &str, out: &mut Out) -> R<()> {
    out.clear();
    let json = ep.json;
    let reset = fields(ep.reset, json, info_key, true)?;
    match reset.data {
        Some(span) if is_object(ep.reset, span, json) => {}
        _ => return Err(Bad),
    }
    if let Some(span) = reset.observation {
        out.reset_observation = out.put_value(ep.reset, span, json, true)?;
    }
    if let Some(span) = reset.info {
        out.reset_info = out.put_value(ep.reset, span, json, true)?;
    }
    for st in ep.steps {
        let request = &ep.data[st.action()];
        let reply = &ep.data[st.reply()];
        let rq = fields(request, json, info_key, false)?;
        let f = fields(reply, json, info_key, true)?;
        match f.data {
            Some(span) if is_object(reply, span, json) => {}
            _ => return Err(Bad),
        }
        let action = match rq.data {
            Some(span) => out.put_value(request, span, json, true)?,
            None => out.put(b""),
        };
        out.actions.push(action);
        let obs = match f.observation {
            Some(span) => out.put_value(reply, span, json, true)?,
            None => None,
        };
        out.observations.push(obs);
        out.rewards
            .push(f.reward.and_then(|(a, b)| reward(&reply[a..b], json)));
        out.dones
            .push(strict_bool(f.done.map(|(a, b)| &reply[a..b]), json)?);
        out.truncateds
            .push(strict_bool(f.truncated.map(|(a, b)| &reply[a..b]), json)?);
        let info = match f.info {
            Some(span) => out.put_value(reply, span, json, true)?,
            None => None,
        };
        out.infos.push(info);
        out.errors.push(None);
        out.step_s.push(st.took);
    }
    out.finish();
    Ok(())
}

/// A frame's `data` as the plain path reads it (`decode(frame).get("data") or {}`): its
/// fields, or none (a falsy `data`); refused when the frame is not an object or `data` a
/// truthy non-object.
fn plain_fields(frame: &[u8], json: bool, info_key: &str) -> R<Fields> {
    let f = fields(frame, json, info_key, true)?;
    if let Some((a, b)) = f.data {
        if !is_object(frame, (a, b), json) {
            if truthy(&frame[a..b], json) {
                return Err(Bad);
            }
            return Ok(Fields::default());
        }
    }
    Ok(f)
}

/// A decoded value as the plain path stores it: `None` (absent or null) as `if_none`.
fn plain_value(
    out: &mut Out,
    frame: &[u8],
    span: Option<(usize, usize)>,
    json: bool,
    none_is_text: bool,
) -> R<Txt> {
    match span {
        Some((a, b)) if !is_null(&frame[a..b], json) => out.put_value(frame, (a, b), json, false),
        _ if none_is_text => Ok(out.put(b"null")),
        _ => Ok(None),
    }
}

/// The plain path (an episode with a failed step, or frames the usual path refused): each
/// value decoded and written again, as rows.py's `_add_one` does.
pub fn plain(ep: &Frames<'_>, info_key: &str, out: &mut Out) -> R<()> {
    out.clear();
    let json = ep.json;
    let reset = plain_fields(ep.reset, json, info_key)?;
    out.reset_observation = plain_value(out, ep.reset, reset.observation, json, false)?;
    out.reset_info = plain_value(out, ep.reset, reset.info, json, false)?;
    for st in ep.steps {
        let request = &ep.data[st.action()];
        let rq = fields(request, json, info_key, false)?;
        let action = plain_value(out, request, rq.data, json, true)?;
        out.actions.push(action);
        if st.failed {
            // the error's text (UTF-8 from the worker; undecodable bytes replaced)
            let text = String::from_utf8_lossy(&ep.data[st.reply()]).into_owned();
            let text = text.as_str();
            out.observations.push(None);
            out.rewards.push(None);
            out.dones.push(false);
            out.truncateds.push(false);
            out.infos.push(None);
            let e = if text.is_empty() {
                None
            } else {
                out.put(text.as_bytes())
            };
            out.errors.push(e);
            if out.error.is_none() && !text.is_empty() {
                out.error = Some(text.to_owned());
            }
        } else {
            let reply = &ep.data[st.reply()];
            let f = plain_fields(reply, json, info_key)?;
            let obs = plain_value(out, reply, f.observation, json, true)?;
            out.observations.push(obs);
            out.rewards
                .push(f.reward.and_then(|(a, b)| reward(&reply[a..b], json)));
            out.dones
                .push(f.done.is_some_and(|(a, b)| truthy(&reply[a..b], json)));
            out.truncateds
                .push(f.truncated.is_some_and(|(a, b)| truthy(&reply[a..b], json)));
            let info = plain_value(out, reply, f.info, json, false)?;
            out.infos.push(info);
            out.errors.push(None);
        }
        out.step_s.push(st.took);
    }
    out.finish();
    Ok(())
}
