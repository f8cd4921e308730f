//! Heartbeats: when to send one to a peer and when a silent peer is dead.
//! Clock-free: every call takes `now`.

use crate::PeerLoss;
use std::time::{Duration, Instant};

/// Heartbeat settings, shared by decoders and prefillers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// Send a heartbeat to a peer that has been sent nothing for this long.
    pub interval: Duration,
    /// Declare a peer dead after hearing nothing from it for this long.
    pub timeout: Duration,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(1000),
        }
    }
}

/// What [`PeerClock::tick`] says to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Beat {
    /// Nothing due.
    Idle,
    /// Send a heartbeat now.
    Send,
    /// The peer just died.
    Dead(PeerLoss),
}

/// One peer's liveness.
#[derive(Debug, Clone)]
pub(crate) struct PeerClock {
    last_heard: Instant,
    last_sent: Instant,
    /// How it was lost and when it was found dead (`kill`'s `now`, or the
    /// tick that found it).
    dead: Option<(PeerLoss, Instant)>,
}

impl PeerClock {
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            last_heard: now,
            last_sent: now,
            dead: None,
        }
    }

    pub(crate) fn heard(&mut self, now: Instant) {
        self.last_heard = self.last_heard.max(now);
    }

    pub(crate) fn sent(&mut self, now: Instant) {
        self.last_sent = self.last_sent.max(now);
    }

    pub(crate) fn dead(&self) -> Option<&PeerLoss> {
        self.dead.as_ref().map(|(loss, _)| loss)
    }

    /// When it was found dead, if it was.
    pub(crate) fn died(&self) -> Option<Instant> {
        self.dead.as_ref().map(|(_, at)| *at)
    }

    /// Marks the peer dead at `now`; `false` if it already was.
    pub(crate) fn kill(&mut self, loss: PeerLoss, now: Instant) -> bool {
        if self.dead.is_some() {
            return false;
        }
        self.dead = Some((loss, now));
        true
    }

    pub(crate) fn tick(&mut self, now: Instant, hb: &Heartbeat) -> Beat {
        if self.dead.is_some() {
            return Beat::Idle;
        }
        let silent = now.saturating_duration_since(self.last_heard);
        if silent > hb.timeout {
            let loss = PeerLoss::HeartbeatTimeout { silent };
            self.dead = Some((loss.clone(), now));
            return Beat::Dead(loss);
        }
        if now.saturating_duration_since(self.last_sent) >= hb.interval {
            self.last_sent = now;
            return Beat::Send;
        }
        Beat::Idle
    }
}
