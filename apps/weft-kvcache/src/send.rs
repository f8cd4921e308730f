//! SENDs of protocol messages. A SEND the receiver had no buffer for
//! (receiver not ready: the peer is alive, only slow to re-post) is retried
//! a few times before the peer is given up; any other failure reports at
//! once.

use std::sync::Arc;
use weft::{EngineError, GroupAddress, OnDone, TransferEngine, TransportError};

/// Attempts of one message (the first send and its retries).
pub(crate) const SEND_ATTEMPTS: u32 = 8;

/// Sends `bytes` to `to`; `on_fail` gets the error once the message is
/// given up (from the engine's callback thread, or this one).
pub(crate) fn send(
    engine: &Arc<TransferEngine>,
    to: &GroupAddress,
    bytes: Vec<u8>,
    on_fail: impl FnOnce(EngineError) + Send + 'static,
) {
    attempt(
        engine.clone(),
        to.clone(),
        Arc::new(bytes),
        SEND_ATTEMPTS,
        Box::new(on_fail),
    );
}

fn attempt(
    engine: Arc<TransferEngine>,
    to: GroupAddress,
    bytes: Arc<Vec<u8>>,
    left: u32,
    on_fail: Box<dyn FnOnce(EngineError) + Send>,
) {
    let weak = Arc::downgrade(&engine);
    let (to2, b2) = (to.clone(), bytes.clone());
    let fail = Arc::new(parking_lot::Mutex::new(Some(on_fail)));
    let fail2 = fail.clone();
    let on_done = OnDone::callback(move |r| {
        let Err(e) = r else { return };
        let Some(f) = fail2.lock().take() else { return };
        let rnr = matches!(e.transport(), Some(TransportError::ReceiverNotReady { .. }));
        match weak.upgrade() {
            Some(engine) if rnr && left > 1 => {
                tracing::debug!(peer = ?to2, left, "kvcache: receiver not ready, resending");
                attempt(engine, to2, b2, left - 1, f);
            }
            _ => f(e),
        }
    });
    if let Err(e) = engine.submit_send(&to, &bytes, on_done) {
        if let Some(f) = fail.lock().take() {
            f(e);
        }
    }
}
