//! The heartbeat timer thread of a driver: calls `tick` every `period`
//! until stopped (a deadline wait on a channel, not a sleep loop: stopping
//! wakes it at once).

use crate::KvError;
use crossbeam_channel::{RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
