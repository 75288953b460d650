//! The `--record` writer process, native: `stadium-record-writer PIPE_FD COUNTS_FD SETTINGS_JSON`.
//!
//! It does what `python -m stadium._server.ledger.writer` does (that module's doc, and
//! docs/RECORDING.md): reads the worker's pipe (`ledger/pipe.py`'s stream), puts each
//! episode together, turns the ended ones into rows (`frames`, as `ledger/rows.py` does,
//! value for value), keeps those the filter keeps, and writes the shards (`.tmp`, then
//! renamed; closed when the first row is `flush_s` old or the rows' frames reach
//! `shard_bytes`). Its counts go to the worker through the shared memory at `COUNTS_FD`
//! (four doubles: recorded, dropped, write errors, 1 while recording). A shard write that
//! fails pauses the recording for 10 s (logged at most every 10 s). EOF or SIGTERM: what is
//! left in the pipe is read, the last shard written, exit 0. A malformed stream (a length
//! past the bounds, an unknown kind): the last shard written, a log line, exit 2.

mod filter;
mod frames;
mod json;
mod msgpack;
mod shard;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use filter::{Filter, Summary};
use frames::{Frames, Out, Step};
use shard::{Cost, Scalars, Shard, WriteError};

const HEAD: usize = 22;
const BEGIN: u8 = 1;
const STEP: u8 = 2;
const END: u8 = 3;
const END_REASONS: [&str; 4] = ["done", "truncated", "reset", "closed"];
const CLIPPED: u8 = 8;
const DROPPED: u8 = 16;
const PAUSE_S: f64 = 10.0;
const WAKE_MS: i32 = 200;
const READ_BYTES: usize = 1 << 20;
const NICE: i32 = 10;
/// glibc's malloc maps apart only blocks bigger than this, and keeps up to twice this freed
/// at the top of its heap: a shard's buffers, freed when it is written, serve the next one
/// (by default, each big block was mapped fresh, its pages faulted in and zeroed by the
/// kernel, and unmapped again: a fifth of the writer's time). An idle writer so keeps at
/// most ~32 MiB it could have given back.
const MALLOC_KEEP: libc::c_int = 16 << 20;
/// Ended episodes' buffers kept for the next episodes (their capacity kept): at most this
/// many bytes of them in all.
const SPARE_BYTES: usize = 16 << 20;
// the counts' fields
const C_RECORDED: usize = 0;
const C_DROPPED: usize = 1;
const C_WRITE_ERRORS: usize = 2;
const C_RECORDING: usize = 3;

static CLOSING: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    CLOSING.store(true, Ordering::Relaxed);
}

fn log(level: &str, msg: &str) {
    // Python logging's "%(asctime)s %(levelname)s %(name)s: %(message)s"
    let mut tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe {
        libc::gettimeofday(&mut tv, std::ptr::null_mut());
        libc::localtime_r(&tv.tv_sec, &mut tm);
    }
    eprintln!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02},{:03} {} stadium.record: {}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        tv.tv_usec / 1000,
        level,
        msg
    );
}

/// The settings the worker passes (record.py's `_start`): strings and numbers, `config.*`
/// flattened.
fn settings(text: &str) -> Result<HashMap<String, String>, String> {
    fn object(
        s: &mut json::Scan<'_>,
        prefix: &str,
        out: &mut HashMap<String, String>,
    ) -> json::R<()> {
        s.members(|s, (a, b, _)| {
            let key = format!("{}{}", prefix, json::unescape(&s.b[a..b])?);
            s.ws();
            if s.peek() == Some(b'{') {
                object(s, &format!("{}.", key), out)?;
            } else {
                let (a, b) = s.value(1)?;
                let v = &s.b[a..b];
                let v = if v.first() == Some(&b'"') {
                    json::unescape(v)?
                } else {
                    String::from_utf8_lossy(v).into_owned()
                };
                out.insert(key, v);
            }
            Ok(())
        })
    }
    let mut out = HashMap::new();
    let mut s = json::Scan::new(text.as_bytes());
    object(&mut s, "", &mut out).map_err(|_| "the settings are not a JSON object".to_owned())?;
    Ok(out)
}

/// The open episodes' hash of their recording ids: one multiply. The ids are the worker's
/// own counter, not a client's: std's SipHash (~3 % of this process's time) guarded nothing.
#[derive(Default)]
struct RidHasher(u64);

impl Hasher for RidHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, rid: u32) {
        self.0 = (rid as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type ByRid<V> = HashMap<u32, V, BuildHasherDefault<RidHasher>>;

struct Open {
    id: Option<String>,
    started_at: f64,
    seed: Option<i64>,
    options: Option<String>,
    json: bool,
    reset: Vec<u8>,
    data: Vec<u8>,
    steps: Vec<Step>,
    failed: bool,
    bad: bool,
}

struct Writer {
    env: String,
    version: String,
    info_key: String,
    worker: i64,
    stem: String,
    directory: String,
    flush_s: f64,
    shard_bytes: i64,
    episode_limit: usize,
    filter: Option<Filter>,
    counts: *mut f64,
    open: ByRid<Open>,
    shard: Shard,
    size: i64,
    first: Instant,
    shards: u64,
    paused_until: Option<Instant>,
    last_warning: Option<Instant>,
    held_warnings: u64,
    out: Out,
    /// Ended episodes' buffers, emptied, for the next ones (no growth from nothing each).
    spare: Vec<(Vec<u8>, Vec<Step>)>,
    spare_bytes: usize,
}

impl Writer {
    fn count(&self, field: usize) -> f64 {
        unsafe { std::ptr::read_volatile(self.counts.add(field)) }
    }

    fn set_count(&self, field: usize, v: f64) {
        unsafe { std::ptr::write_volatile(self.counts.add(field), v) }
    }

    fn add_count(&self, field: usize, n: f64) {
        self.set_count(field, self.count(field) + n);
    }

    fn warn(&mut self, msg: String) {
        // at most one per PAUSE_S (stadium._util.throttle.Throttle)
        let now = Instant::now();
        if let Some(last) = self.last_warning {
            if now.duration_since(last).as_secs_f64() < PAUSE_S {
                self.held_warnings += 1;
                return;
            }
        }
        let held = self.held_warnings;
        self.last_warning = Some(now);
        self.held_warnings = 0;
        if held > 0 {
            log(
                "WARNING",
                &format!("{} ({} more since the last report)", msg, held),
            );
        } else {
            log("WARNING", &msg);
        }
    }

    fn recording(&mut self) -> bool {
        if let Some(until) = self.paused_until {
            if Instant::now() < until {
                return false;
            }
            self.paused_until = None;
            self.set_count(C_RECORDING, 1.0);
        }
        true
    }

    /// One message of the stream (`Err`: the stream is malformed).
    fn message(
        &mut self,
        kind: u8,
        rid: u32,
        flag: u8,
        number: f64,
        a: &[u8],
        b: &[u8],
    ) -> Result<(), String> {
        match kind {
            STEP => {
                let limit = self.episode_limit;
                if let Some(ep) = self.open.get_mut(&rid) {
                    if ep.data.len() + a.len() + b.len() > limit {
                        ep.bad = true; // past any bound the worker keeps: not recorded
                        return Ok(());
                    }
                    let start = ep.data.len();
                    ep.data.extend_from_slice(a);
                    ep.data.extend_from_slice(b);
                    // within u32: `episode_limit` is
                    ep.steps.push(Step {
                        took: number,
                        start: start as u32,
                        mid: (start + a.len()) as u32,
                        end: ep.data.len() as u32,
                        failed: flag != 0,
                    });
                    ep.failed |= flag != 0;
                }
            }
            BEGIN => {
                let (id, seed, options, bad) = match meta(a) {
                    Some((id, seed, options)) => (id, seed, options, false),
                    None => (None, None, None, true),
                };
                let (data, steps) = self.spare.pop().unwrap_or_default();
                self.spare_bytes -= spare_size(&data, &steps);
                let old = self.open.insert(
                    rid,
                    Open {
                        id,
                        started_at: number,
                        seed,
                        options,
                        json: flag != 0,
                        reset: b.to_vec(),
                        data,
                        steps,
                        failed: false,
                        bad,
                    },
                );
                if let Some(old) = old {
                    self.keep(old);
                }
            }
            END => {
                if (flag & 7) as usize >= END_REASONS.len() {
                    return Err(format!("an end of unknown kind ({})", flag & 7));
                }
                if let Some(ep) = self.open.remove(&rid) {
                    self.ended(&ep, flag, a);
                    self.keep(ep);
                }
            }
            _ => return Err(format!("a message of unknown kind ({})", kind)),
        }
        Ok(())
    }

    /// An episode's buffers emptied and kept for a later one (within the bounds above).
    fn keep(&mut self, ep: Open) {
        let (mut data, mut steps) = (ep.data, ep.steps);
        let size = spare_size(&data, &steps);
        if self.spare_bytes + size <= SPARE_BYTES {
            data.clear();
            steps.clear();
            self.spare.push((data, steps));
            self.spare_bytes += size;
        }
    }

    fn ended(&mut self, ep: &Open, flag: u8, cost: &[u8]) {
        if flag & DROPPED != 0 || !self.recording() {
            self.add_count(C_DROPPED, 1.0);
            return;
        }
        let cost = match decode_cost(cost) {
            Some(c) if !ep.bad => c,
            _ => {
                self.add_count(C_DROPPED, 1.0);
                let id = ep.id.clone().unwrap_or_default();
                self.warn(format!(
                    "--record: 1 episode(s) could not be recorded: {}: a frame that cannot be read",
                    id
                ));
                return;
            }
        };
        let frames = Frames {
            json: ep.json,
            reset: &ep.reset,
            data: &ep.data,
            steps: &ep.steps,
        };
        let mut out = std::mem::take(&mut self.out);
        let ok = (!ep.failed && frames::usual(&frames, &self.info_key, &mut out).is_ok())
            || frames::plain(&frames, &self.info_key, &mut out).is_ok();
        if !ok {
            self.out = out;
            self.add_count(C_DROPPED, 1.0);
            let id = ep.id.clone().unwrap_or_default();
            self.warn(format!(
                "--record: 1 episode(s) could not be recorded: {}: a frame that cannot be read",
                id
            ));
            return;
        }
        let end = END_REASONS[(flag & 7) as usize];
        let clipped = flag & CLIPPED != 0;
        let keep = match &self.filter {
            None => true,
            Some(f) => f.keep(&Summary {
                reward: out.total,
                steps: cost.steps as f64,
                wall_s: cost.wall_s,
                cpu_s: cost.cpu_s,
                bytes_in: cost.bytes_in as f64,
                bytes_out: cost.bytes_out as f64,
                error: out.error.is_some(),
                done: end == "done" || end == "truncated",
                truncated: end == "truncated",
                clipped,
            }),
        };
        if keep {
            if self.shard.rows == 0 {
                self.first = Instant::now();
            }
            self.shard.add(
                &Scalars {
                    env: &self.env,
                    env_version: &self.version,
                    episode_id: ep.id.as_deref(),
                    worker: self.worker,
                    started_at: ep.started_at,
                    seed: ep.seed,
                    options: ep.options.as_deref(),
                    end,
                    clipped,
                    cost: &cost,
                },
                &out,
            );
            self.size += cost.bytes_in + cost.bytes_out;
        }
        self.out = out;
        if self.shard.rows > 0 && self.size >= self.shard_bytes {
            self.write(); // the rows' frames reached the bound: closed at once
        }
    }

    fn due(&self, done: bool) -> bool {
        self.shard.rows > 0
            && (done
                || self.size >= self.shard_bytes
                || self.first.elapsed().as_secs_f64() >= self.flush_s)
    }

    fn write(&mut self) {
        self.shards += 1;
        let path = format!(
            "{}/{}-{:06}.parquet",
            self.directory, self.stem, self.shards
        );
        let tmp = format!("{}.tmp", path);
        let rows = self.shard.rows;
        self.size = 0;
        let result = std::fs::create_dir_all(&self.directory)
            .map_err(WriteError::Io)
            .and_then(|_| self.shard.write(&tmp))
            .and_then(|_| std::fs::rename(&tmp, &path).map_err(WriteError::Io));
        match result {
            Ok(()) => self.add_count(C_RECORDED, rows as f64),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                self.shard = Shard::new();
                self.add_count(C_WRITE_ERRORS, 1.0);
                self.add_count(C_DROPPED, rows as f64);
                self.set_count(C_RECORDING, 0.0);
                self.paused_until =
                    Some(Instant::now() + std::time::Duration::from_secs_f64(PAUSE_S));
                let why = match e {
                    WriteError::Io(io) => match io.raw_os_error() {
                        Some(n) => unsafe { std::ffi::CStr::from_ptr(libc::strerror(n)) }
                            .to_string_lossy()
                            .into_owned(),
                        None => io.to_string(),
                    },
                    WriteError::Other(s) => s,
                };
                self.warn(format!(
                    "--record: writing {} failed ({}): {} episode(s) dropped; not recording for {}s, then trying again",
                    path, why, rows, PAUSE_S
                ));
            }
        }
    }
}

/// The bytes an episode's buffers hold allocated.
fn spare_size(data: &Vec<u8>, steps: &Vec<Step>) -> usize {
    data.capacity() + steps.capacity() * std::mem::size_of::<Step>()
}

/// The BEGIN message's MessagePack `[episode id, seed, options]`; options as JSON text.
fn meta(b: &[u8]) -> Option<(Option<String>, Option<i64>, Option<String>)> {
    use msgpack::{Cur, Item};
    let mut c = Cur::new(b);
    match c.item().ok()? {
        Item::Array(3) => {}
        _ => return None,
    }
    let id = match c.item().ok()? {
        Item::Nil => None,
        Item::Str(s) => Some(s.to_owned()),
        _ => return None,
    };
    let seed = match c.item().ok()? {
        Item::Nil => None,
        Item::Int(v) => Some(i64::try_from(v).ok()?),
        _ => return None,
    };
    let (a, end) = msgpack::skip(&mut c, 1).ok()?;
    if end != b.len() {
        return None;
    }
    let o = &b[a..end];
    let options = if msgpack::is_nil(o) {
        None
    } else {
        match Cur::new(o).item().ok()? {
            Item::Map(_) => {}
            _ => return None,
        }
        let mut text = Vec::new();
        msgpack::span_json(&mut text, o).ok()?;
        Some(String::from_utf8(text).ok()?)
    };
    Some((id, seed, options))
}

/// The END message's MessagePack `EpisodeCost` (a map of its fields).
fn decode_cost(b: &[u8]) -> Option<Cost> {
    use msgpack::{Cur, Item};
    let mut c = Cur::new(b);
    let n = match c.item().ok()? {
        Item::Map(n) => n,
        _ => return None,
    };
    let mut cost = Cost {
        cpu_source: "loop".to_owned(),
        ..Cost::default()
    };
    let num = |it: Item<'_>| -> Option<f64> {
        match it {
            Item::Int(v) => Some(v as f64),
            Item::Float(x) => Some(x),
            _ => None,
        }
    };
    let int = |it: Item<'_>| -> Option<i64> {
        match it {
            Item::Int(v) => i64::try_from(v).ok(),
            _ => None,
        }
    };
    for _ in 0..n {
        let key = match c.item().ok()? {
            Item::Str(s) => s,
            _ => return None,
        };
        let v = c.item().ok()?;
        match key {
            "wall_s" => cost.wall_s = num(v)?,
            "cpu_s" => cost.cpu_s = num(v)?,
            "steps" => cost.steps = int(v)?,
            "bytes_in" => cost.bytes_in = int(v)?,
            "bytes_out" => cost.bytes_out = int(v)?,
            "peak_rss_bytes" => {
                cost.peak_rss_bytes = match v {
                    Item::Nil => None,
                    other => Some(int(other)?),
                }
            }
            "cpu_source" => match v {
                Item::Str(s) => cost.cpu_source = s.to_owned(),
                _ => return None,
            },
            _ => match v {
                Item::Array(_) | Item::Map(_) => return None,
                _ => {}
            },
        }
    }
    (c.i == b.len()).then_some(cost)
}

fn fail(msg: &str) -> ! {
    log("ERROR", &format!("--record writer: {}", msg));
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        fail("usage: stadium-record-writer PIPE_FD COUNTS_FD SETTINGS_JSON");
    }
    let fd: libc::c_int = args[1]
        .parse()
        .unwrap_or_else(|_| fail("PIPE_FD is not a number"));
    let counts_fd: libc::c_int = args[2]
        .parse()
        .unwrap_or_else(|_| fail("COUNTS_FD is not a number"));
    let set = settings(&args[3]).unwrap_or_else(|e| fail(&e));
    let get = |k: &str| {
        set.get(k)
            .cloned()
            .unwrap_or_else(|| fail(&format!("the settings lack {}", k)))
    };
    let num = |k: &str| {
        get(k)
            .parse::<f64>()
            .unwrap_or_else(|_| fail(&format!("the setting {} is not a number", k)))
    };
    if !get("config.redact").is_empty() {
        fail("--record-redact runs the operator's Python: the Python writer serves it");
    }
    let filter = Filter::parse(&get("config.filter")).unwrap_or_else(|e| fail(&e));
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MALLOC_KEEP);
        libc::mallopt(libc::M_TRIM_THRESHOLD, MALLOC_KEEP * 2);
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_term as extern "C" fn(libc::c_int) as usize;
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGTERM as libc::c_ulong,
            0,
            0,
            0,
        );
        *libc::__errno_location() = 0;
        libc::nice(NICE);
        // any core, not only its worker's (ledger/writer.py's doc)
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        let n = libc::sysconf(libc::_SC_NPROCESSORS_CONF).max(1) as usize;
        for cpu in 0..n.min(libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(cpu, &mut all);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &all);
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    let counts = unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            32,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            counts_fd,
            0,
        );
        if p == libc::MAP_FAILED {
            fail("cannot map the counts");
        }
        libc::close(counts_fd);
        p as *mut f64
    };
    let worker: i64 = get("worker")
        .parse()
        .unwrap_or_else(|_| fail("the worker is not a pid"));
    let queue_bytes = num("config.queue_bytes") as usize;
    let episode_bytes = num("config.episode_bytes") as usize;
    let mut w = Writer {
        env: get("env"),
        version: get("version"),
        info_key: get("info_key"),
        worker,
        stem: get("stem"),
        directory: get("config.directory"),
        flush_s: num("config.flush_s"),
        shard_bytes: num("config.shard_bytes") as i64,
        // the worker keeps an episode's frames under episode_bytes (one step past it at most)
        // (and its offsets fit a `Step`'s u32s)
        episode_limit: episode_bytes
            .saturating_mul(2)
            .saturating_add(queue_bytes)
            .min(u32::MAX as usize),
        filter,
        counts,
        open: ByRid::default(),
        shard: Shard::new(),
        size: 0,
        first: Instant::now(),
        shards: 0,
        paused_until: None,
        last_warning: None,
        held_warnings: 0,
        out: Out::default(),
        spare: Vec::new(),
        spare_bytes: 0,
    };
    w.set_count(C_RECORDING, 1.0);
    if unsafe { libc::getppid() } as i64 != worker {
        CLOSING.store(true, Ordering::Relaxed); // the worker died before PR_SET_PDEATHSIG
    }
    // one message never exceeds what the worker buffers
    let max_message = queue_bytes.saturating_add(HEAD);
    let mut buf: Vec<u8> = vec![0; READ_BYTES * 2];
    let mut filled = 0usize;
    let mut pos = 0usize;
    let mut done = false;
    let mut malformed: Option<String> = None;
    while !done {
        let closing = CLOSING.load(Ordering::Relaxed);
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ready = unsafe { libc::poll(&mut pfd, 1, if closing { 100 } else { WAKE_MS }) };
        if ready > 0 {
            // `buf[pos..filled]`: bytes read, not yet parsed; zeroed once, when it grows
            if pos > 0 && (pos * 2 >= filled || filled + READ_BYTES > buf.len()) {
                buf.copy_within(pos..filled, 0);
                filled -= pos;
                pos = 0;
            }
            if filled + READ_BYTES > buf.len() {
                buf.resize(filled + READ_BYTES, 0);
            }
            let n = unsafe {
                libc::read(
                    fd,
                    buf[filled..].as_mut_ptr() as *mut libc::c_void,
                    READ_BYTES,
                )
            };
            if n > 0 {
                filled += n as usize;
            } else {
                let err = std::io::Error::last_os_error();
                if n == 0 || !matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) {
                    done = true; // EOF: the worker closed the pipe
                }
            }
            // the complete messages
            while filled - pos >= HEAD {
                let h = &buf[pos..pos + HEAD];
                let kind = h[0];
                let rid = u32::from_le_bytes([h[1], h[2], h[3], h[4]]);
                let flag = h[5];
                let number = f64::from_le_bytes(h[6..14].try_into().unwrap());
                let a = u32::from_le_bytes(h[14..18].try_into().unwrap()) as usize;
                let b = u32::from_le_bytes(h[18..22].try_into().unwrap()) as usize;
                if a + b > max_message {
                    malformed = Some(format!(
                        "a message of {} bytes (the bound is {})",
                        a + b,
                        max_message
                    ));
                    break;
                }
                let stop = pos + HEAD + a + b;
                if stop > filled {
                    break;
                }
                let (x, y) = (pos + HEAD, pos + HEAD + a);
                if let Err(e) = w.message(kind, rid, flag, number, &buf[x..y], &buf[y..stop]) {
                    malformed = Some(e);
                    break;
                }
                pos = stop;
            }
            if malformed.is_some() {
                done = true;
            }
        } else if closing {
            done = true; // nothing more in the pipe
        } else if ready < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                malformed = Some(format!("the pipe cannot be polled ({})", err));
                done = true;
            }
        }
        if w.due(done) {
            w.write();
        }
    }
    w.set_count(C_RECORDING, 0.0);
    if let Some(why) = malformed {
        fail(&format!(
            "the recording stream is malformed: {}; not recording",
            why
        ));
    }
}
