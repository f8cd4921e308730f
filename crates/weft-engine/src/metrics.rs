//! Engine counters in Prometheus' text exposition format (version 0.0.4).
//!
//! [`TransferEngine::metrics_text`] renders one engine; [`Metrics`]
//! gathers several engines and an application's own counters into one
//! page (Prometheus wants each metric family once per page, so families are
//! collected first and rendered together).
//!
//! Families, all prefixed `weft_` (labels in parentheses):
//! * per NIC (`group`, `nic`, `nic_name`, `provider`): `wrs_posted_total`,
//!   `bytes_posted_total`, `wrs_completed_total`, `peers`;
//! * per peer (`group`, `nic`, `peer`, the NIC address in hex):
//!   `peer_wrs_posted_total`, `peer_bytes_posted_total`;
//! * per group (`group`): `transfers_ok_total`, `caller_posted_total`,
//!   `transfers_failed_total` (declared without a sample until a first
//!   failure)
//!   (and `kind`, [`EngineError::kind`](crate::EngineError::kind)),
//!   `queued`, `in_flight`, `pending_wrs`, `fd_sleeps_total`,
//!   `recv_dropped_total` (and `reason`: `stale` or `malformed`);
//! * per engine: `imm_excess_total`, `imm_dropped_total`;
//! * `data_path_info` (per NIC, value 1): the data path in use, with
//!   `provider`, `fabric`, `gpu_memory` (how GPU memory reaches the NIC:
//!   direct, staged or unsupported) and `progress` — what a user checks to
//!   prove which fabric really carried the bytes.
//!
//! Every sample also carries the labels given to [`Metrics::add_engine`]
//! (for example one naming the engine when a process has several).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::TransferEngine;

/// The kind of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricKind {
    /// Only ever goes up (resets when the process restarts).
    Counter,
    /// A current value.
    Gauge,
}

impl MetricKind {
    fn name(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
        }
    }
}

/// One sample before it is added: family name, help, kind, labels, value.
type Sample = (
    &'static str,
    &'static str,
    MetricKind,
    Vec<(String, String)>,
    f64,
);

#[derive(Debug)]
struct Family {
    help: String,
    kind: MetricKind,
    /// Rendered label sets and values, in the order added.
    samples: Vec<(String, f64)>,
}

/// A page of metrics: families gathered from engines and from the
/// application, rendered in Prometheus' text format by
/// [`Metrics::render`].
#[derive(Debug, Default)]
pub struct Metrics {
    families: BTreeMap<String, Family>,
}

/// Writes `v` as a label value: backslash, double quote and newline
/// escaped, as the format requires.
fn escape_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Whether `name` is a valid metric or label name (`[a-zA-Z_:][a-zA-Z0-9_:]*`;
/// labels may not use `:`, which is checked by the caller's choice of names).
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// The error of a metric or label name outside Prometheus' grammar.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid metric or label name {0:?} (want [a-zA-Z_:][a-zA-Z0-9_:]*)")]
pub struct InvalidMetricName(pub String);

impl Metrics {
    /// An empty page.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one sample of family `name` (created with `help` and `kind` on
    /// first use; later samples keep the first help and kind). `name` and
    /// every label name must match `[a-zA-Z_:][a-zA-Z0-9_:]*`; label values
    /// are free text.
    pub fn add(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricKind,
        labels: &[(&str, &str)],
        value: f64,
    ) -> Result<(), InvalidMetricName> {
        if let Some((bad, _)) = labels
            .iter()
            .find(|(l, _)| !valid_name(l) || l.contains(':') || l.starts_with("__"))
        {
            return Err(InvalidMetricName((*bad).to_string()));
        }
        for (i, (l, _)) in labels.iter().enumerate() {
            if labels[..i].iter().any(|(k, _)| k == l) {
                // A repeated label makes the whole page unparsable.
                return Err(InvalidMetricName(format!("{l} (given twice)")));
            }
        }
        let mut set = String::new();
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                set.push(',');
            }
            set.push_str(k);
            set.push_str("=\"");
            escape_into(&mut set, v);
            set.push('"');
        }
        self.declare(name, help, kind)?;
        if let Some(f) = self.families.get_mut(name) {
            f.samples.push((set, value));
        }
        Ok(())
    }

    /// Declares family `name` (its `# HELP` and `# TYPE` lines) without a
    /// sample, as for a counter of kinds none of which happened yet.
    pub fn declare(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricKind,
    ) -> Result<(), InvalidMetricName> {
        if !valid_name(name) {
            return Err(InvalidMetricName(name.to_string()));
        }
        self.families
            .entry(name.to_string())
            .or_insert_with(|| Family {
                help: help.replace('\\', "\\\\").replace('\n', "\\n"),
                kind,
                samples: Vec::new(),
            });
        Ok(())
    }

    /// Adds the counters of `engine` ([`TransferEngine::stats`] and its
    /// data-path report), each sample labelled with `labels` first.
    /// `labels` may not use the names the engine's samples use (`group`,
    /// `nic`, `nic_name`, `provider`, `fabric`, `gpu_memory`, `progress`,
    /// `peer`, `kind`, `reason`); two engines on one page need a label
    /// that tells them apart (as `weft.metrics_text()` adds `engine`).
    pub fn add_engine(
        &mut self,
        engine: &TransferEngine,
        labels: &[(&str, &str)],
    ) -> Result<(), InvalidMetricName> {
        use MetricKind::{Counter, Gauge};
        let stats = engine.stats();
        let report = engine.data_path_report();
        let with = |more: &[(&str, &str)]| -> Vec<(String, String)> {
            labels
                .iter()
                .chain(more)
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect()
        };
        // Samples are built as owned label lists, then added.
        let mut out: Vec<Sample> = Vec::new();
        out.push((
            "weft_imm_excess_total",
            "Immediates reported as never consumed.",
            Counter,
            with(&[]),
            stats.imm_excess as f64,
        ));
        out.push((
            "weft_imm_dropped_total",
            "Immediates outside the allocator's range that were not tracked.",
            Counter,
            with(&[]),
            stats.imm_dropped as f64,
        ));
        for n in &report.nics {
            let (g, i) = (n.group.to_string(), n.nic.to_string());
            out.push((
                "weft_data_path_info",
                "The data path of each NIC (value 1): provider, fabric, how GPU memory reaches it, progress.",
                Gauge,
                with(&[
                    ("group", &g),
                    ("nic", &i),
                    ("nic_name", &n.name),
                    ("provider", &n.path.provider),
                    ("fabric", &n.path.fabric),
                    ("gpu_memory", &n.path.device_memory.to_string()),
                    ("progress", &n.path.progress.to_string()),
                ]),
                1.0,
            ));
        }
        for (gi, gs) in stats.groups.iter().enumerate() {
            let g = gi.to_string();
            let group = with(&[("group", &g)]);
            let per_group: [(&str, &str, MetricKind, f64); 6] = [
                (
                    "weft_caller_posted_total",
                    "Requests the submitting thread posted itself, without the hand-off to the worker.",
                    Counter,
                    gs.caller_posted as f64,
                ),
                (
                    "weft_transfers_ok_total",
                    "Transfers that finished successfully.",
                    Counter,
                    gs.transfers_ok as f64,
                ),
                (
                    "weft_queued",
                    "Requests in the group's queue, not yet taken by its worker.",
                    Gauge,
                    gs.queued as f64,
                ),
                (
                    "weft_in_flight",
                    "Transfers taken by the worker and not yet resolved.",
                    Gauge,
                    gs.in_flight as f64,
                ),
                (
                    "weft_pending_wrs",
                    "Planned WRs waiting for send-queue room.",
                    Gauge,
                    gs.pending_wrs as f64,
                ),
                (
                    "weft_fd_sleeps_total",
                    "Times the idle worker slept in its NICs' wait fds.",
                    Counter,
                    gs.fd_sleeps as f64,
                ),
            ];
            for (name, help, kind, v) in per_group {
                out.push((name, help, kind, group.clone(), v));
            }
            const FAILED: &str = "weft_transfers_failed_total";
            const FAILED_HELP: &str = "Transfers that failed, by kind of error.";
            // Kinds appear with their first failure; until then the
            // family is declared with no sample.
            self.declare(FAILED, FAILED_HELP, Counter)?;
            for (k, n) in &gs.transfers_failed {
                out.push((
                    FAILED,
                    FAILED_HELP,
                    Counter,
                    with(&[("group", &g), ("kind", k)]),
                    *n as f64,
                ));
            }
            for (reason, v) in [("stale", gs.recv_stale), ("malformed", gs.recv_malformed)] {
                out.push((
                    "weft_recv_dropped_total",
                    "Received SENDs dropped: meant for another incarnation, or malformed.",
                    Counter,
                    with(&[("group", &g), ("reason", reason)]),
                    v as f64,
                ));
            }
            for (ni, ns) in gs.nics.iter().enumerate() {
                let i = ni.to_string();
                let nr = report.nics.iter().find(|r| r.group == gi && r.nic == ni);
                let name = nr.map_or("", |r| r.name.as_str());
                let provider = nr.map_or("", |r| r.path.provider.as_str());
                let nic = with(&[
                    ("group", &g),
                    ("nic", &i),
                    ("nic_name", name),
                    ("provider", provider),
                ]);
                for (mname, help, kind, v) in [
                    (
                        "weft_wrs_posted_total",
                        "WRs (WRITE pieces and SENDs) the NIC accepted.",
                        Counter,
                        ns.wrs_posted,
                    ),
                    (
                        "weft_bytes_posted_total",
                        "Payload bytes of the WRs the NIC accepted.",
                        Counter,
                        ns.bytes_posted,
                    ),
                    (
                        "weft_wrs_completed_total",
                        "WRs whose completion the worker handled.",
                        Counter,
                        ns.wrs_completed,
                    ),
                    ("weft_peers", "Peers the NIC has resolved.", Gauge, ns.peers),
                ] {
                    out.push((mname, help, kind, nic.clone(), v as f64));
                }
            }
            for p in &gs.peers {
                let (i, a) = (p.nic.to_string(), p.addr.to_string());
                let peer = with(&[("group", &g), ("nic", &i), ("peer", &a)]);
                out.push((
                    "weft_peer_wrs_posted_total",
                    "WRs a NIC accepted for one peer.",
                    Counter,
                    peer.clone(),
                    p.wrs_posted as f64,
                ));
                out.push((
                    "weft_peer_bytes_posted_total",
                    "Payload bytes a NIC accepted for one peer.",
                    Counter,
                    peer,
                    p.bytes_posted as f64,
                ));
            }
        }
        for (name, help, kind, labels, v) in out {
            let labels: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            self.add(name, help, kind, &labels, v)?;
        }
        Ok(())
    }

    /// The page in Prometheus' text format: families sorted by name, each
    /// with its `# HELP` and `# TYPE` line, samples in the order added.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for (name, f) in &self.families {
            let _ = writeln!(s, "# HELP {name} {}", f.help);
            let _ = writeln!(s, "# TYPE {name} {}", f.kind.name());
            for (labels, v) in &f.samples {
                s.push_str(name);
                if !labels.is_empty() {
                    s.push('{');
                    s.push_str(labels);
                    s.push('}');
                }
                s.push(' ');
                if v.is_finite() {
                    let _ = write!(s, "{v}");
                } else if v.is_nan() {
                    s.push_str("NaN");
                } else if *v > 0.0 {
                    s.push_str("+Inf");
                } else {
                    s.push_str("-Inf");
                }
                s.push('\n');
            }
        }
        s
    }
}

impl TransferEngine {
    /// This engine's counters in Prometheus' text format (see
    /// [`Metrics`](crate::metrics::Metrics) for the families and labels).
    pub fn metrics_text(&self) -> String {
        let mut m = Metrics::new();
        // The engine's own names and labels are valid.
        let _ = m.add_engine(self, &[]);
        m.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_families_once_with_escaped_labels() {
        let mut m = Metrics::new();
        m.add(
            "b_total",
            "B.",
            MetricKind::Counter,
            &[("x", "a\"b\\c\nd")],
            3.0,
        )
        .unwrap();
        m.add("a", "A gauge.", MetricKind::Gauge, &[], 1.5).unwrap();
        m.add(
            "b_total",
            "ignored",
            MetricKind::Gauge,
            &[("x", "2")],
            f64::INFINITY,
        )
        .unwrap();
        assert!(m
            .add("c", "", MetricKind::Gauge, &[("x", "1"), ("x", "2")], 0.0)
            .is_err());
        assert!(m
            .add("c", "", MetricKind::Gauge, &[("__name__", "1")], 0.0)
            .is_err());
        assert_eq!(
            m.render(),
            "# HELP a A gauge.\n# TYPE a gauge\na 1.5\n\
             # HELP b_total B.\n# TYPE b_total counter\n\
             b_total{x=\"a\\\"b\\\\c\\nd\"} 3\nb_total{x=\"2\"} +Inf\n"
        );
    }

    #[test]
    fn refuses_names_outside_the_grammar() {
        let mut m = Metrics::new();
        for bad in ["", "1abc", "a-b", "a b"] {
            assert_eq!(
                m.add(bad, "", MetricKind::Gauge, &[], 0.0),
                Err(InvalidMetricName(bad.to_string()))
            );
        }
        assert!(m
            .add("ok", "", MetricKind::Gauge, &[("a:b", "v")], 0.0)
            .is_err());
        assert!(m
            .add("ok:sub", "", MetricKind::Gauge, &[("le", "v")], 0.0)
            .is_ok());
    }
}
