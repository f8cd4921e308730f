//! The progress indicator on stderr (an `indicatif` bar redrawn in place on
//! a terminal, nothing otherwise, so logs and CI output stay clean).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// Counts steps of a run and shows `[done/total elapsed] label` on stderr.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    total: usize,
    done: usize,
}

impl Progress {
    /// A progress line for `total` steps; `enabled = false` silences it.
    pub fn new(total: usize, enabled: bool) -> Self {
        // `stderr()` draws only when stderr is a terminal.
        let target = if enabled {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let style = ProgressStyle::with_template("[{pos:>3}/{len:<3} {secs}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner())
            .with_key("secs", |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{:>5.1}s", s.elapsed().as_secs_f64());
            });
        let bar = ProgressBar::with_draw_target(Some(total as u64), target).with_style(style);
        Progress {
            bar,
            total,
            done: 0,
        }
    }

    /// Adds `n` to the expected total.
    pub fn add_total(&mut self, n: usize) {
        self.total += n;
        self.bar.set_length(self.total as u64);
    }

    /// Starts a step called `label`.
    pub fn step(&mut self, label: &str) {
        self.done += 1;
        self.bar.set_position(self.done.min(self.total) as u64);
        self.bar.set_message(label.to_string());
    }

    /// Clears the line.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
