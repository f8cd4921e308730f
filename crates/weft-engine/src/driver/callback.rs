//! The callback thread: runs transfer callbacks, receive callbacks (then
//! re-posts the buffer) and the excess handler, one message at a time, with
//! panics caught.

use super::{CbMsg, GroupShared};
use crate::config::ExcessHandler;
use crate::core::{Control, Event};
use crate::error::EngineError;
use crossbeam_channel::Receiver;
use std::cell::Cell;
use std::sync::Arc;

thread_local! {
    /// Set while this thread runs a user callback.
    pub(crate) static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Runs one callback-thread message on this thread.
// Reads a filled receive buffer (`RecvPool::bytes`).
#[allow(unsafe_code)]
pub(crate) fn run_msg(groups: &[Arc<GroupShared>], excess: &ExcessHandler, msg: CbMsg) {
    let outer = IN_CALLBACK.with(|c| c.replace(true));
    // A receive buffer is re-posted after its callback returned, even when
    // the callback panicked (the repost runs outside the unwind boundary).
    let mut repost = None;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match msg {
        CbMsg::Event(Event::Done(cb, r)) => cb(r),
        CbMsg::Event(Event::Recv { pool, idx, result }) => {
            repost = Some((pool.group, pool.id, idx));
            {
                let mut cb = pool.cb.lock();
                match result {
                    Ok(n) => {
                        // SAFETY: buffer `idx` completed and is re-posted
                        // only below, after the callback returned.
                        match unsafe { pool.bytes(idx, n) } {
                            Some(b) => cb(Ok(b)),
                            None => cb(Err(EngineError::InvalidArgument {
                                what: format!("receive of {n} bytes into buffer {idx}"),
                            })),
                        }
                    }
                    Err(e) => cb(Err(e)),
                }
            }
        }
        CbMsg::Excess(imm, n) => excess(imm, n),
        CbMsg::Stop => {}
    }));
    IN_CALLBACK.with(|c| c.set(outer));
    if r.is_err() {
        tracing::error!("a weft callback panicked");
    }
    if let Some((group, pool, idx)) = repost {
        if let Some(g) = groups.get(group) {
            let _ = g.ctrl.send(Control::Repost { pool, idx });
            g.wake();
        }
    }
}

/// The callback thread's main loop: until `Stop`, then what is queued.
pub(crate) fn callback_main(
    groups: &[Arc<GroupShared>],
    excess: &ExcessHandler,
    rx: &Receiver<CbMsg>,
) {
    while let Ok(msg) = rx.recv() {
        if matches!(msg, CbMsg::Stop) {
            // Run whatever is still queued, then exit.
            while let Ok(m) = rx.try_recv() {
                if !matches!(m, CbMsg::Stop) {
                    run_msg(groups, excess, m);
                }
            }
            break;
        }
        run_msg(groups, excess, msg);
    }
}
