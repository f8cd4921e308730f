//! The callback thread: runs transfer callbacks, receive callbacks (on
//! messages the worker already copied out of their receive buffers) and the
//! excess handler, one message at a time, with panics caught.

use super::CbMsg;
use crate::config::{ExcessHandler, Idle, IdleState, PollPolicy};
use crate::core::Event;
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
        CbMsg::Event(Event::Recv { pool, result }) => match result {
            Ok(m) => {
                // Kept outside the closure before the call, so a panicking
                // callback's message is recycled too.
                let (pool, m) = spent.insert((pool, m));
                (pool.cb.lock())(Ok(m))
            }
            Err(e) => (pool.cb.lock())(Err(e)),
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

/// The callback thread's main loop: until `Stop`, then what is queued.
/// Under [`PollPolicy::Adaptive`] it blocks on the channel as soon as it is
/// empty (a callback after idleness pays one thread wake-up); under `Busy`
/// it polls the channel without ever blocking, and under `SpinThenPark` it
/// polls for the policy's `spin` after the last message, then blocks.
pub(crate) fn callback_main(excess: &ExcessHandler, rx: &Receiver<CbMsg>, idle: Idle) {
    let mut st = IdleState::default();
    loop {
        let msg = if idle.poll == PollPolicy::Adaptive {
            match rx.recv() {
                Ok(m) => m,
                Err(_) => break,
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
