//! Result rows and their renderings: table, JSON, CSV and an SVG plot.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// A target a measurement is compared against.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Target {
    /// Human-readable form, e.g. `"<= 0.50 us"`.
    pub text: String,
    /// Whether the measurement meets it.
    pub met: bool,
}

impl Target {
    /// `measured <= bound`.
    pub fn at_most(measured: f64, bound: f64, unit: &str) -> Self {
        Target {
            text: format!("<= {} {unit}", fmt_num(bound)),
            met: measured <= bound,
        }
    }

    /// `measured >= bound`.
    pub fn at_least(measured: f64, bound: f64, unit: &str) -> Self {
        Target {
            text: format!(">= {} {unit}", fmt_num(bound)),
            met: measured >= bound,
        }
    }
}

/// Whether a row holds a measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum Status {
    /// Measured.
    Ok,
    /// The backend (or a feature it needs) is not available here.
    Unavailable(String),
    /// The measurement failed (an engine or backend error).
    Failed(String),
}

/// One measured quantity next to its baseline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Subcommand: `p2p`, `proxy` or `imm`.
    pub bench: String,
    /// What is measured, e.g. `single_write`, `paged_write`, `scatter`.
    pub case: String,
    /// Backend name (`loopback-null`, `libfabric:tcp`, ...).
    pub backend: String,
    /// NICs per domain group.
    pub nics: usize,
    /// The case's parameter, e.g. `64 KiB`, `10000 x 4 KiB`, `64 peers`.
    pub param: String,
    /// Bytes per transfer (x axis of the plot), where it applies.
    pub size_bytes: Option<u64>,
    /// Metric, e.g. `bandwidth`, `latency p50`, `ops`.
    pub metric: String,
    /// Unit of `measured` and `baseline`.
    pub unit: String,
    /// weft's value (median over the interleaved rounds).
    pub measured: Option<f64>,
    /// The baseline's value measured in the same run.
    pub baseline: Option<f64>,
    /// What the baseline is (`raw backend`, `queue hand-off floor`, ...).
    pub baseline_name: String,
    /// `measured / baseline`.
    pub ratio: Option<f64>,
    /// The target, where the issue sets one.
    pub target: Option<Target>,
    /// Measured, unavailable or failed.
    pub status: Status,
    /// Extra numbers (percentile breakdowns and the like).
    pub extra: BTreeMap<String, f64>,
}

impl Row {
    /// A measured row.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        bench: &str,
        case: &str,
        backend: &str,
        nics: usize,
        param: impl Into<String>,
        metric: &str,
        unit: &str,
        measured: f64,
        baseline: Option<(f64, &str)>,
    ) -> Self {
        let (b, bn) = match baseline {
            Some((v, n)) => (Some(v), n.to_string()),
            None => (None, String::new()),
        };
        Row {
            bench: bench.into(),
            case: case.into(),
            backend: backend.into(),
            nics,
            param: param.into(),
            size_bytes: None,
            metric: metric.into(),
            unit: unit.into(),
            measured: Some(measured),
            baseline: b,
            baseline_name: bn,
            ratio: b.and_then(|b| (b != 0.0).then_some(measured / b)),
            target: None,
            status: Status::Ok,
            extra: BTreeMap::new(),
        }
    }

    /// A row saying why nothing was measured.
    pub fn unavailable(bench: &str, case: &str, backend: &str, nics: usize, why: String) -> Self {
        Row {
            bench: bench.into(),
            case: case.into(),
            backend: backend.into(),
            nics,
            param: String::new(),
            size_bytes: None,
            metric: String::new(),
            unit: String::new(),
            measured: None,
            baseline: None,
            baseline_name: String::new(),
            ratio: None,
            target: None,
            status: Status::Unavailable(why),
            extra: BTreeMap::new(),
        }
    }

    /// A row saying the measurement failed.
    pub fn failed(bench: &str, case: &str, backend: &str, nics: usize, why: String) -> Self {
        Row {
            status: Status::Failed(why),
            ..Row::unavailable(bench, case, backend, nics, String::new())
        }
    }

    /// Sets the plot x value.
    pub fn size(mut self, bytes: u64) -> Self {
        self.size_bytes = Some(bytes);
        self
    }

    /// Sets the target.
    pub fn target(mut self, t: Target) -> Self {
        self.target = Some(t);
        self
    }

    /// Adds an extra number.
    pub fn extra(mut self, k: &str, v: f64) -> Self {
        self.extra.insert(k.into(), v);
        self
    }
}

/// One stage of the proxy host-path breakdown.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Breakdown {
    /// Backend.
    pub backend: String,
    /// Peers of the scatter.
    pub peers: usize,
    /// Stage, e.g. `submit -> first WR`.
    pub stage: String,
    /// Samples.
    pub n: usize,
    /// Median (µs).
    pub p50_us: f64,
    /// 99th percentile (µs).
    pub p99_us: f64,
    /// 99.9th percentile (µs).
    pub p999_us: f64,
}

/// Everything one run produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The command line that produced it.
    pub command: String,
    /// Quick mode.
    pub quick: bool,
    /// A description of the machine (CPU count, OS).
    pub machine: String,
    /// Wall time of the run in seconds.
    pub elapsed_s: f64,
    /// The rows, in run order.
    pub rows: Vec<Row>,
    /// The proxy breakdown (p50/p99/p99.9 per stage and peer count).
    pub proxy_breakdown: Vec<Breakdown>,
}

/// Formats a number with 3 significant digits-ish.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".into()
    } else if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

/// `1 KiB`, `64 MiB`, `100 B`.
pub fn fmt_bytes(b: u64) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(fmt_num).unwrap_or_else(|| "-".into())
}

impl Report {
    /// The human-readable table (what stdout shows).
    pub fn table(&self) -> String {
        let headers = [
            "bench", "case", "backend", "nics", "param", "metric", "unit", "weft", "baseline",
            "ratio", "target", "met",
        ];
        let mut cells: Vec<Vec<String>> = Vec::new();
        let mut notes = Vec::new();
        for r in &self.rows {
            let (met, weft) = match &r.status {
                Status::Ok => (
                    r.target
                        .as_ref()
                        .map(|t| if t.met { "yes" } else { "NO" }.to_string())
                        .unwrap_or_default(),
                    opt(r.measured),
                ),
                Status::Unavailable(why) => {
                    notes.push(format!(
                        "{} {} on {}: unavailable: {why}",
                        r.bench, r.case, r.backend
                    ));
                    (String::new(), "unavailable".into())
                }
                Status::Failed(why) => {
                    notes.push(format!(
                        "{} {} on {}: FAILED: {why}",
                        r.bench, r.case, r.backend
                    ));
                    (String::new(), "FAILED".into())
                }
            };
            let baseline = match (r.baseline, r.baseline_name.is_empty()) {
                (Some(b), false) => format!("{} ({})", fmt_num(b), r.baseline_name),
                (Some(b), true) => fmt_num(b),
                (None, _) => "-".into(),
            };
            cells.push(vec![
                r.bench.clone(),
                r.case.clone(),
                r.backend.clone(),
                r.nics.to_string(),
                r.param.clone(),
                r.metric.clone(),
                r.unit.clone(),
                weft,
                baseline,
                r.ratio
                    .map(|x| format!("{x:.2}"))
                    .unwrap_or_else(|| "-".into()),
                r.target
                    .as_ref()
                    .map(|t| t.text.clone())
                    .unwrap_or_default(),
                met,
            ]);
        }
        let mut w: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
        for row in &cells {
            for (i, c) in row.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, row: &[String]| {
            let mut s = String::new();
            for (i, c) in row.iter().enumerate() {
                let pad = w[i].saturating_sub(c.chars().count());
                // Numbers right-aligned, text left-aligned.
                if (7..=9).contains(&i) {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    s.push_str(&" ".repeat(pad));
                }
                s.push_str("  ");
            }
            out.push_str(s.trim_end());
            out.push('\n');
        };
        let hs: Vec<String> = headers.iter().map(|s| s.to_string()).collect();
        line(&mut out, &hs);
        let sep: Vec<String> = w.iter().map(|n| "-".repeat(*n)).collect();
        line(&mut out, &sep);
        for row in &cells {
            line(&mut out, row);
        }
        for n in notes {
            out.push_str(&n);
            out.push('\n');
        }
        if !self.proxy_breakdown.is_empty() {
            out.push('\n');
            out.push_str(&self.breakdown_table());
        }
        out
    }

    /// The proxy host-path breakdown as a table (µs).
    pub fn breakdown_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<14} {:>5}  {:<24} {:>7} {:>9} {:>9} {:>9}",
            "backend", "peers", "stage (us)", "n", "p50", "p99", "p99.9"
        );
        for b in &self.proxy_breakdown {
            let _ = writeln!(
                out,
                "{:<14} {:>5}  {:<24} {:>7} {:>9} {:>9} {:>9}",
                b.backend,
                b.peers,
                b.stage,
                b.n,
                fmt_num(b.p50_us),
                fmt_num(b.p99_us),
                fmt_num(b.p999_us)
            );
        }
        out
    }

    /// JSON (pretty).
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// CSV, one line per row.
    pub fn csv(&self) -> String {
        let mut out = String::from(
            "bench,case,backend,nics,param,size_bytes,metric,unit,weft,baseline,baseline_name,ratio,target,target_met,status,reason\n",
        );
        let q = |s: &str| {
            if s.contains([',', '"', '\n']) {
                format!("\"{}\"", s.replace('"', "\"\""))
            } else {
                s.to_string()
            }
        };
        let o = |v: Option<f64>| v.map(|x| format!("{x}")).unwrap_or_default();
        for r in &self.rows {
            let (status, reason) = match &r.status {
                Status::Ok => ("ok", String::new()),
                Status::Unavailable(w) => ("unavailable", w.clone()),
                Status::Failed(w) => ("failed", w.clone()),
            };
            let _ = writeln!(
                out,
                "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
                q(&r.bench),
                q(&r.case),
                q(&r.backend),
                r.nics,
                q(&r.param),
                r.size_bytes.map(|b| b.to_string()).unwrap_or_default(),
                q(&r.metric),
                q(&r.unit),
                o(r.measured),
                o(r.baseline),
                q(&r.baseline_name),
                o(r.ratio),
                q(r.target.as_ref().map(|t| t.text.as_str()).unwrap_or("")),
                r.target
                    .as_ref()
                    .map(|t| t.met.to_string())
                    .unwrap_or_default(),
                status,
                q(&reason),
            );
        }
        out
    }

    /// An SVG chart of bandwidth vs transfer size (log-x), one series per
    /// backend × NIC count for weft and for its raw baseline.
    pub fn svg(&self) -> String {
        // series name -> points (size, GB/s)
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        // Null-mode "bandwidth" moves no bytes: leave it out next to real
        // backends (it would flatten them), keep it when it is all we have.
        let real = self
            .rows
            .iter()
            .any(|r| r.bench == "p2p" && r.status == Status::Ok && r.backend != "loopback-null");
        for r in &self.rows {
            if real && r.backend == "loopback-null" {
                continue;
            }
            if r.status != Status::Ok || r.bench != "p2p" || r.case != "single_write" {
                continue;
            }
            if r.metric != "bandwidth" {
                continue;
            }
            let Some(x) = r.size_bytes else { continue };
            let key = format!("{} {}nic", r.backend, r.nics);
            if let Some(m) = r.measured {
                series
                    .entry(format!("weft {key}"))
                    .or_default()
                    .push((x as f64, m));
            }
            if let Some(b) = r.baseline {
                series
                    .entry(format!("raw {key}"))
                    .or_default()
                    .push((x as f64, b));
            }
        }
        svg_chart(
            "weft p2p single WRITE: bandwidth vs size",
            "transfer size (bytes, log scale)",
            "GB/s",
            &series,
        )
    }
}

const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A log-x / linear-y line chart in plain SVG.
pub fn svg_chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
) -> String {
    let (w, h) = (900.0_f64, 560.0_f64);
    let (l, r, t, b) = (80.0, 260.0, 50.0, 60.0);
    let pts = series.values().flatten();
    let mut xmin = f64::INFINITY;
    let mut xmax = f64::NEG_INFINITY;
    let mut ymax = 0.0_f64;
    for &(x, y) in pts {
        if x > 0.0 && y.is_finite() {
            xmin = xmin.min(x);
            xmax = xmax.max(x);
            ymax = ymax.max(y);
        }
    }
    if !xmin.is_finite() {
        xmin = 64.0;
        xmax = 64.0 * 1024.0 * 1024.0;
    }
    if xmax <= xmin {
        xmax = xmin * 4.0;
    }
    if ymax <= 0.0 {
        ymax = 1.0;
    }
    let ymax = nice_ceil(ymax);
    let (lx0, lx1) = (xmin.log2(), xmax.log2());
    let px = |x: f64| l + (x.log2() - lx0) / (lx1 - lx0) * (w - l - r);
    let py = |y: f64| h - b - (y / ymax) * (h - t - b);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<text x="{}" y="25" font-size="16" text-anchor="middle">{}</text>"#,
        (w - r + l) / 2.0,
        esc(title)
    );
    // Axes.
    let _ = write!(
        s,
        r#"<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="black"/>"#,
        h - b,
        w - r,
        h - b,
        h - b
    );
    // X ticks at powers of 4.
    let mut e = lx0.floor() as i32;
    while f64::from(e) <= lx1 + 1e-9 {
        if e % 2 == 0 && f64::from(e) >= lx0 - 1e-9 {
            let x = px(2f64.powi(e));
            let _ = write!(
                s,
                r##"<line x1="{x:.1}" y1="{t}" x2="{x:.1}" y2="{}" stroke="#eee"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
                h - b,
                h - b + 18.0,
                fmt_bytes(1u64 << e.clamp(0, 62))
            );
        }
        e += 1;
    }
    // Y ticks.
    for i in 0..=5 {
        let v = ymax * f64::from(i) / 5.0;
        let y = py(v);
        let _ = write!(
            s,
            r##"<line x1="{l}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            w - r,
            l - 6.0,
            y + 4.0,
            fmt_num(v)
        );
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (w - r + l) / 2.0,
        h - 15.0,
        esc(xlabel)
    );
    let _ = write!(
        s,
        r#"<text x="20" y="{}" text-anchor="middle" transform="rotate(-90 20 {})">{}</text>"#,
        (h - b + t) / 2.0,
        (h - b + t) / 2.0,
        esc(ylabel)
    );
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let dash = if name.starts_with("raw") {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let mut pts = pts.clone();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = pts
            .iter()
            .filter(|(x, y)| *x > 0.0 && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="{}"/>"#,
            path.join(" ")
        );
        for p in &path {
            if let Some((x, y)) = p.split_once(',') {
                let _ = write!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{c}"/>"#);
            }
        }
        let ly = t + 10.0 + 20.0 * i as f64;
        let lx = w - r + 15.0;
        let _ = write!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
            lx + 25.0,
            lx + 30.0,
            ly + 4.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn nice_ceil(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * p >= v {
            return m * p;
        }
    }
    10.0 * p
}
