//! `stadium._server.ledger._recordbuf.StepBuffer`: the buffer a worker's event loop copies
//! its recorded episodes' messages into, for its `--record` writer process
//! (`src/stadium/_server/ledger/buffer.py` has the Python class it stands in for, method for
//! method, and says why: a recorded step copied here costs ~0.1 µs of the loop, ~0.35 µs in
//! Python).
//!
//! The bytes are `ledger/pipe.py`'s stream. Only `step`'s usual case is here: a step whose
//! two frames are `bytes` and fit under `room` with what is buffered is appended as a STEP
//! message (header and both frames) at once; any other step goes to the `slow` callable (the
//! recorder's Python path: bounds, broken episodes, the flush timer), called with the
//! same arguments. The other messages are appended by Python (`+=`). Everything runs under
//! the GIL, on the loop's thread.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// pipe.py's STEP kind and its header's size (`<BIBdII`).
const STEP: u8 = 2;
const HEAD: usize = 22;
/// Capacity kept between flushes (a burst's is given back once it is written).
const KEEP: usize = 1 << 20;

#[pyclass(module = "stadium._server.ledger._recordbuf")]
struct StepBuffer {
    data: Vec<u8>,
    /// A step's frames take the usual path while the buffer and they stay under this
    /// (0: every step takes `slow`).
    #[pyo3(get, set)]
    room: usize,
    slow: PyObject,
}

fn frame<'a>(obj: &'a Bound<'_, PyAny>) -> Option<&'a [u8]> {
    obj.downcast::<PyBytes>().ok().map(|b| b.as_bytes())
}

#[pymethods]
impl StepBuffer {
    #[new]
    fn new(room: usize, slow: PyObject) -> Self {
        StepBuffer {
            data: Vec::new(),
            room,
            slow,
        }
    }

    /// A step of recorded episode `rid`: its request frame, its reply frame, its seconds.
    fn step(
        slf: &Bound<'_, Self>,
        rid: u32,
        request: &Bound<'_, PyAny>,
        reply: &Bound<'_, PyAny>,
        took: f64,
    ) -> PyResult<()> {
        if let (Some(a), Some(b)) = (frame(request), frame(reply)) {
            let mut me = slf.borrow_mut();
            if me.data.len() + a.len() + b.len() < me.room {
                let d = &mut me.data;
                d.reserve(HEAD + a.len() + b.len());
                d.push(STEP);
                d.extend_from_slice(&rid.to_le_bytes());
                d.push(0);
                d.extend_from_slice(&took.to_le_bytes());
                d.extend_from_slice(&(a.len() as u32).to_le_bytes());
                d.extend_from_slice(&(b.len() as u32).to_le_bytes());
                d.extend_from_slice(a);
                d.extend_from_slice(b);
                return Ok(());
            }
        }
        // not borrowed while Python runs: the slow path appends to this buffer itself
        let slow = slf.borrow().slow.clone_ref(slf.py());
        slow.call1(slf.py(), (rid, request, reply, took))?;
        Ok(())
    }

    /// Append `bytes` (another message, or part of one).
    fn __iadd__(&mut self, other: &Bound<'_, PyAny>) -> PyResult<()> {
        match frame(other) {
            Some(b) => {
                self.data.extend_from_slice(b);
                Ok(())
            }
            None => Err(PyTypeError::new_err("StepBuffer += takes bytes")),
        }
    }

    /// What is buffered, as `bytes` (a copy: for tests).
    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new_bound(py, &self.data)
    }

    fn __len__(&self) -> usize {
        self.data.len()
    }

    /// Forget what is buffered (the writer is gone).
    fn clear(&mut self) {
        self.data.clear();
        self.data.shrink_to(KEEP);
    }

    /// Write what is buffered to `fd` with one `write(2)` (non-blocking: as much as the
    /// pipe takes) and drop what was written; the count written. An error raises the
    /// `OSError` it is (`BlockingIOError` when the pipe is full).
    fn write(&mut self, fd: i32) -> PyResult<usize> {
        if self.data.is_empty() {
            return Ok(0);
        }
        let n = unsafe { libc::write(fd, self.data.as_ptr().cast(), self.data.len()) };
        if n < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        let n = n as usize;
        self.data.drain(..n);
        if self.data.capacity() > KEEP && self.data.len() < KEEP / 2 {
            self.data.shrink_to(KEEP);
        }
        Ok(n)
    }
}

#[pymodule]
fn _recordbuf(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StepBuffer>()?;
    Ok(())
}
