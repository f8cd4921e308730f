//! The heartbeat timer thread of a driver: calls `tick` every `period`
//! until stopped (a deadline wait on a channel, not a sleep loop: stopping
//! wakes it at once); and [`drive`], which feeds a role's core from its
//! receives and its heartbeat.

use crate::wire::{decode, Auth, Msg};
use crate::{KvConfig, KvError};
use crossbeam_channel::{RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft::{GroupAddress, TransferEngine};

/// A role's shared state (decoder, prefiller) as its drivers see it.
pub(crate) trait Role: Send + Sync + 'static {
    /// Steps the core with a message received claiming to be from `from`.
    fn on_msg(self: &Arc<Self>, from: &GroupAddress, auth: Auth, msg: Msg, now: Instant);
    /// Steps the core's heartbeat.
    fn tick(self: &Arc<Self>, now: Instant);
}

/// Posts `cfg`'s receives on `engine` that feed `role` (undecodable
/// messages and failed receives are logged as `name`'s), and starts its
/// heartbeat thread `thread`, ticking twice per heartbeat interval. Both
/// hold `role` weakly: they stop feeding it once it is dropped.
pub(crate) fn drive<R: Role>(
    engine: &TransferEngine,
    role: &Arc<R>,
    cfg: &KvConfig,
    name: &'static str,
    thread: &'static str,
) -> Result<Ticker, KvError> {
    let weak = Arc::downgrade(role);
    engine
        .submit_recvs(cfg.recv_len, cfg.recv_count, move |r| {
            let Some(role) = weak.upgrade() else { return };
            match r.map(decode) {
                Ok(Ok(f)) => role.on_msg(&f.from, f.auth, f.msg, Instant::now()),
                Ok(Err(e)) => tracing::warn!("{name}: {e}"),
                Err(e) => tracing::warn!("{name}: receive failed: {e}"),
            }
        })
        .map_err(KvError::engine("post receives"))?;
    let weak = Arc::downgrade(role);
    Ticker::start(thread, cfg.heartbeat.interval / 2, move |now| {
        match weak.upgrade() {
            Some(role) => {
                role.tick(now);
                true
            }
            None => false,
        }
    })
}

/// A running timer; dropping it stops and joins the thread.
pub(crate) struct Ticker {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    pub(crate) fn start(
        name: &'static str,
        period: Duration,
        mut tick: impl FnMut(Instant) -> bool + Send + 'static,
    ) -> Result<Self, KvError> {
        let (tx, rx) = crossbeam_channel::bounded::<()>(1);
        let period = period.max(Duration::from_micros(100));
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let mut next = Instant::now() + period;
                loop {
                    match rx.recv_deadline(next) {
                        Err(RecvTimeoutError::Timeout) => {
                            let now = Instant::now();
                            if !tick(now) {
                                return;
                            }
                            next = now + period;
                        }
                        _ => return,
                    }
                }
            })
            .map_err(|e| KvError::Spawn {
                name,
                error: e.to_string(),
            })?;
        Ok(Self {
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    pub(crate) fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop();
    }
}
