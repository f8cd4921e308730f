//! A minimal progress indicator on stderr (a rewritten line on a terminal,
//! nothing otherwise, so logs and CI output stay clean).

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Counts steps of a run and shows `[done/total] label` on stderr.
#[derive(Debug)]
pub struct Progress {
    total: usize,
    done: usize,
    tty: bool,
    enabled: bool,
    start: Instant,
}

impl Progress {
    /// A progress line for `total` steps; `enabled = false` silences it.
    pub fn new(total: usize, enabled: bool) -> Self {
        Progress {
            total,
            done: 0,
            tty: std::io::stderr().is_terminal(),
            enabled,
            start: Instant::now(),
        }
    }

    /// Adds `n` to the expected total.
    pub fn add_total(&mut self, n: usize) {
        self.total += n;
    }

    /// Starts a step called `label`.
    pub fn step(&mut self, label: &str) {
        self.done += 1;
        if self.enabled && self.tty {
            let mut e = std::io::stderr().lock();
            let _ = write!(
                e,
                "\r\x1b[K[{:>3}/{:<3} {:>5.1}s] {label}",
                self.done.min(self.total),
                self.total,
                self.start.elapsed().as_secs_f64()
            );
            let _ = e.flush();
        }
    }

    /// Clears the line.
    pub fn finish(&self) {
        if self.enabled && self.tty {
            let _ = write!(std::io::stderr(), "\r\x1b[K");
        }
    }
}
