//! KvCache counters and their Prometheus families: what a [`Decoder`] and a
//! [`Prefiller`] add to a [`weft::metrics::Metrics`] page next to their
//! engine's (`write_metrics`).
//!
//! Families (`weft_kvcache_` + role, `decoder` or `prefiller`):
//! `requests_total` (taken: a decoder's `request` calls that started, a
//! prefiller's requests handed to serving), `completed_total`,
//! `failed_total` (label `kind`: [`KvError::kind`]), `pending` (gauge),
//! `dropped_frames_total` (unauthentic, duplicate or replayed frames); the
//! decoder adds `free_pages` (gauge), the prefiller `reports_total`,
//! `steps_total`, `report_seconds_total` and `report_seconds_max` (host cost
//! of layer reports).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use weft::metrics::{InvalidMetricName, MetricKind, Metrics};

use crate::{Decoder, KvError, Prefiller};

/// Requests taken and how they ended.
#[derive(Debug, Default)]
pub struct Outcomes {
    started: AtomicU64,
    completed: AtomicU64,
    failed: Mutex<BTreeMap<&'static str, u64>>,
}

impl Outcomes {
    /// A request was taken.
    pub(crate) fn started(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    /// A request ended with `r`.
    pub(crate) fn ended<T>(&self, r: &Result<T, KvError>) {
        match r {
            Ok(_) => {
                self.completed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => *self.failed.lock().entry(e.kind()).or_default() += 1,
        }
    }

    /// Requests taken so far.
    pub fn taken(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    /// Requests that completed successfully.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Requests that failed, by [`KvError::kind`].
    pub fn failed(&self) -> BTreeMap<&'static str, u64> {
        self.failed.lock().clone()
    }

    fn write(
        &self,
        m: &mut Metrics,
        role: &str,
        labels: &[(&str, &str)],
    ) -> Result<(), InvalidMetricName> {
        use MetricKind::Counter;
        let name = |x: &str| format!("weft_kvcache_{role}_{x}");
        m.add(
            &name("requests_total"),
            "KvCache requests taken.",
            Counter,
            labels,
            self.taken() as f64,
        )?;
        m.add(
            &name("completed_total"),
            "KvCache requests that completed.",
            Counter,
            labels,
            self.completed() as f64,
        )?;
        let failed = name("failed_total");
        let help = "KvCache requests that failed, by kind of error.";
        m.declare(&failed, help, Counter)?;
        for (kind, n) in self.failed() {
            let mut l = labels.to_vec();
            l.push(("kind", kind));
            m.add(&failed, help, Counter, &l, n as f64)?;
        }
        Ok(())
    }
}

impl Decoder {
    /// Adds this decoder's counters to `m`, each sample labelled `labels`
    /// (see the `metrics` module for the families).
    pub fn write_metrics(
        &self,
        m: &mut Metrics,
        labels: &[(&str, &str)],
    ) -> Result<(), InvalidMetricName> {
        use MetricKind::{Counter, Gauge};
        self.outcomes().write(m, "decoder", labels)?;
        m.add(
            "weft_kvcache_decoder_pending",
            "KvCache requests in flight.",
            Gauge,
            labels,
            self.pending() as f64,
        )?;
        m.add(
            "weft_kvcache_decoder_free_pages",
            "Pages of the decoder's cache free for requests.",
            Gauge,
            labels,
            f64::from(self.free_pages()),
        )?;
        m.add(
            "weft_kvcache_decoder_dropped_frames_total",
            "Frames dropped: from strangers, unauthentic, duplicates or replays.",
            Counter,
            labels,
            self.dropped_frames() as f64,
        )
    }
}

impl Prefiller {
    /// Adds this prefiller's counters to `m`, each sample labelled
    /// `labels` (see the `metrics` module for the families).
    pub fn write_metrics(
        &self,
        m: &mut Metrics,
        labels: &[(&str, &str)],
    ) -> Result<(), InvalidMetricName> {
        use MetricKind::{Counter, Gauge};
        self.outcomes().write(m, "prefiller", labels)?;
        let s = self.stats();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (name, help, kind, v) in [
            (
                "weft_kvcache_prefiller_pending",
                "KvCache requests not yet finished (incoming or being served).",
                Gauge,
                self.pending() as f64,
            ),
            (
                "weft_kvcache_prefiller_dropped_frames_total",
                "Frames dropped: unauthentic, duplicates or replays.",
                Counter,
                self.dropped_frames() as f64,
            ),
            (
                "weft_kvcache_prefiller_reports_total",
                "Layer reports that posted something.",
                Counter,
                load(&s.reports) as f64,
            ),
            (
                "weft_kvcache_prefiller_steps_total",
                "Steps (layers, tails) posted.",
                Counter,
                load(&s.steps) as f64,
            ),
            (
                "weft_kvcache_prefiller_report_seconds_total",
                "Host time of the layer reports.",
                Counter,
                load(&s.report_ns) as f64 / 1e9,
            ),
            (
                "weft_kvcache_prefiller_report_seconds_max",
                "Longest layer report.",
                Gauge,
                load(&s.report_ns_max) as f64 / 1e9,
            ),
        ] {
            m.add(name, help, kind, labels, v)?;
        }
        Ok(())
    }
}
