//! Time as an input. The domain's logic never reads the system clock
//! itself: each entry point (`open`, `poll`, the posts) makes one [`Clock`]
//! and passes it down, so one call sees one instant. The clock is read
//! lazily, at most once per call and only if something needs the time (an
//! engine polls a software provider continuously; most calls need none).

use std::time::Instant;

/// The time of one call into the domain.
#[derive(Debug)]
pub(super) struct Clock {
    now: Option<Instant>,
}

impl Clock {
    /// The system clock, read on first use.
    pub(super) fn system() -> Clock {
        Clock { now: None }
    }

    /// A clock fixed at `now`.
    #[cfg(test)]
    pub(super) fn at(now: Instant) -> Clock {
        Clock { now: Some(now) }
    }

    /// The call's instant (the system clock's on first use).
    pub(super) fn now(&mut self) -> Instant {
        *self.now.get_or_insert_with(Instant::now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_call_sees_one_instant() {
        let mut c = Clock::system();
        let first = c.now();
        assert_eq!(c.now(), first);
        let t = first + Duration::from_secs(5);
        assert_eq!(Clock::at(t).now(), t);
    }
}
