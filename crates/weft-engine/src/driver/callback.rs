//! The callback thread: runs transfer callbacks, receive callbacks (on
//! messages the worker already copied out of their receive buffers) and the
//! excess handler, one message at a time, with panics caught.

use super::CbMsg;
use crate::config::{ExcessHandler, Idle, IdleState, PollPolicy};
use crate::core::Event;
use crate::mem::RecvSink;
use crossbeam_channel::{Receiver, TryRecvError};
use std::cell::Cell;

thread_local! {
    /// Set while this thread runs a user callback.
    pub(crate) static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Runs one callback-thread message on this thread.
pub(crate) fn run_msg(excess: &ExcessHandler, msg: CbMsg) {
    let outer = IN_CALLBACK.with(|c| c.replace(true));
    // A received message goes back to its pool after its callback returned,
    // even when the callback panicked (outside the unwind boundary).
    let mut spent = None;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match msg {
        CbMsg::Event(Event::Done(cb, r)) => cb(r),
        CbMsg::Event(Event::RoundDone(cb, r, round)) => {
            cb(r);
            drop(round);
        }
        CbMsg::Event(Event::Recv { pool, result, from }) => match result {
            Ok(m) => {
                // Kept outside the closure before the call, so a panicking
                // callback's message is recycled too.
                let (pool, m) = spent.insert((pool, m));
                match &pool.sink {
                    RecvSink::Callback(cb) => (cb.lock())(Ok(m)),
                    RecvSink::CallbackFrom(cb) => (cb.lock())(Ok((m, from.as_ref()))),
                    RecvSink::Queue(_) => {}
                }
            }
            Err(e) => match &pool.sink {
                RecvSink::Callback(cb) => (cb.lock())(Err(e)),
                RecvSink::CallbackFrom(cb) => (cb.lock())(Err(e)),
                RecvSink::Queue(_) => {}
            },
        },
        CbMsg::Excess(imm, n) => excess(imm, n),
        CbMsg::Stop => {}
    }));
    IN_CALLBACK.with(|c| c.set(outer));
    if r.is_err() {
        tracing::error!("a weft callback panicked");
    }
    if let Some((pool, msg)) = spent {
        pool.recycle(msg);
    }
}

/// How long the callback thread keeps polling (yielding) for the next
/// message after one ran, under [`PollPolicy::Adaptive`], before it blocks.
const LINGER: std::time::Duration = std::time::Duration::from_micros(LINGER_US);
const LINGER_US: u64 = 50;

/// The next message, blocking on `rx` only once [`LINGER`] passed since
/// the last one (`last`); `None` when the channel is closed.
fn next_adaptive(rx: &Receiver<CbMsg>, last: &mut Option<std::time::Instant>) -> Option<CbMsg> {
    if let Some(since) = *last {
        loop {
            match rx.try_recv() {
                Ok(m) => {
                    *last = Some(std::time::Instant::now());
                    return Some(m);
                }
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) if since.elapsed() >= LINGER => break,
                Err(TryRecvError::Empty) => std::thread::yield_now(),
            }
        }
    }
    let m = rx.recv().ok()?;
    *last = Some(std::time::Instant::now());
    Some(m)
}

/// The callback thread's main loop: until `Stop`, then what is queued.
/// Under [`PollPolicy::Adaptive`] it keeps polling (yielding) for
/// [`LINGER`] after each message and then blocks on the channel (a callback
/// after idleness pays one thread wake-up; one soon after the last does
/// not); under `Busy`
/// it polls the channel without ever blocking, and under `SpinThenPark` it
/// polls for the policy's `spin` after the last message, then blocks.
pub(crate) fn callback_main(excess: &ExcessHandler, rx: &Receiver<CbMsg>, idle: Idle) {
    let mut st = IdleState::default();
    let mut last = None;
    loop {
        let msg = if idle.poll == PollPolicy::Adaptive {
            match next_adaptive(rx, &mut last) {
                Some(m) => m,
                None => break,
            }
        } else {
            match rx.try_recv() {
                Ok(m) => {
                    st.reset();
                    m
                }
                Err(TryRecvError::Empty) => {
                    if idle.step(&mut st).is_some() {
                        // Past the spin bound: block until the next message.
                        match rx.recv() {
                            Ok(m) => {
                                st.reset();
                                m
                            }
                            Err(_) => break,
                        }
                    } else {
                        continue;
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            }
        };
        if matches!(msg, CbMsg::Stop) {
            // Run whatever is still queued, then exit.
            while let Ok(m) = rx.try_recv() {
                if !matches!(m, CbMsg::Stop) {
                    run_msg(excess, m);
                }
            }
            break;
        }
        run_msg(excess, msg);
    }
}
