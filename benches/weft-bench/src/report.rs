//! Result rows and their renderings: table, JSON, CSV and a plot (SVG and
//! PNG, drawn with `plotters`).
//!
//! The table stays hand-formatted: its exact layout (two-space gaps, a dash
//! rule as wide as each column, numbers right-aligned, trailing blanks
//! trimmed) is what docs/benchmarks.md pastes, and table crates draw their
//! header rule across the padding between columns.

use crate::table::{wrap, Table};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// The widest line the stdout table prints.
pub const TERMINAL_WIDTH: usize = 100;

/// Title and axis labels of the bandwidth plot.
const PLOT_LABELS: (&str, &str, &str) = (
    "weft p2p single WRITE: bandwidth vs size",
    "transfer size (bytes, log scale)",
    "GB/s",
);

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
    /// Thread placement of both sides' rounds (`--pin`): `initiator 2
    /// target 4 …`, `unpinned`, or empty where the bench does not place
    /// threads.
    pub placement: String,
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
            placement: String::new(),
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
            placement: String::new(),
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

    /// Records the thread placement (see [`Row::placement`]).
    pub fn placed(mut self, placement: &str) -> Self {
        self.placement = placement.into();
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
    /// The human-readable table (what stdout shows), at most
    /// [`TERMINAL_WIDTH`] columns wide: long names are cut with `…`; the
    /// baselines' names and the targets' wording are in the CSV and JSON.
    pub fn table(&self) -> String {
        let mut t = Table::new(
            &[
                "bench", "case", "backend", "nics", "param", "metric", "weft", "base", "ratio",
                "met",
            ],
            &[
                false, false, false, true, false, false, true, true, true, false,
            ],
        );
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
                    (String::new(), "n/a".into())
                }
                Status::Failed(why) => {
                    notes.push(format!(
                        "{} {} on {}: FAILED: {why}",
                        r.bench, r.case, r.backend
                    ));
                    (String::new(), "FAILED".into())
                }
            };
            let metric = if r.unit.is_empty() {
                r.metric.clone()
            } else {
                format!("{} ({})", r.metric, r.unit)
            };
            t.push(vec![
                r.bench.clone(),
                r.case.clone(),
                r.backend.clone(),
                r.nics.to_string(),
                r.param.clone(),
                metric,
                weft,
                opt(r.baseline),
                r.ratio
                    .map(|x| format!("{x:.2}"))
                    .unwrap_or_else(|| "-".into()),
                met,
            ]);
        }
        let mut out = t.render(TERMINAL_WIDTH);
        // Where the threads ran, once per row group.
        let mut placed: Vec<String> = Vec::new();
        for r in self.rows.iter().filter(|r| !r.placement.is_empty()) {
            let n = format!(
                "threads of {} on {}, {} NIC(s): {}",
                r.bench, r.backend, r.nics, r.placement
            );
            if !placed.contains(&n) {
                placed.push(n);
            }
        }
        for n in notes.into_iter().chain(placed) {
            out.push_str(&wrap(&n, TERMINAL_WIDTH));
        }
        if !self.proxy_breakdown.is_empty() {
            out.push('\n');
            out.push_str(&self.breakdown_table());
        }
        out
    }

    /// The proxy host-path breakdown as a table (µs), at most
    /// [`TERMINAL_WIDTH`] columns wide.
    pub fn breakdown_table(&self) -> String {
        let mut t = Table::new(
            &["backend", "peers", "stage (us)", "n", "p50", "p99", "p99.9"],
            &[false, true, false, true, true, true, true],
        );
        for b in &self.proxy_breakdown {
            t.push(vec![
                b.backend.clone(),
                b.peers.to_string(),
                b.stage.clone(),
                b.n.to_string(),
                fmt_num(b.p50_us),
                fmt_num(b.p99_us),
                fmt_num(b.p999_us),
            ]);
        }
        t.render(TERMINAL_WIDTH)
    }

    /// JSON (pretty).
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// CSV, one line per row.
    pub fn csv(&self) -> String {
        let mut out = String::from(
            "bench,case,backend,nics,param,size_bytes,metric,unit,weft,baseline,baseline_name,ratio,target,target_met,status,reason,placement\n",
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
                "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
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
                q(&r.placement),
            );
        }
        out
    }

    /// The plotted series: name -> points (size, GB/s).
    fn bandwidth_series(&self) -> BTreeMap<String, Vec<(f64, f64)>> {
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
        series
    }

    /// An SVG chart of bandwidth vs transfer size (log-x), one series per
    /// backend × NIC count for weft and for its raw baseline.
    pub fn svg(&self) -> String {
        let (title, xlabel, ylabel) = PLOT_LABELS;
        svg_chart(title, xlabel, ylabel, &self.bandwidth_series())
    }

    /// The same chart as [`Report::svg`], as a PNG file at `path` (without
    /// its text; see [`png_chart`]).
    pub fn png(&self, path: &Path) -> Result<(), PlotError> {
        png_chart(path, &self.bandwidth_series())
    }
}

/// Series colours (matplotlib's tab10), one per series in name order (as
/// before).
const COLORS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// Chart size in pixels.
const CHART_SIZE: (u32, u32) = (900, 560);

/// Why a chart could not be drawn.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// The drawing backend failed (e.g. the PNG file cannot be written).
    #[error("drawing the chart {target}: {reason}")]
    Draw {
        /// What was drawn (`SVG`, or the PNG's path).
        target: String,
        /// The backend's error.
        reason: String,
    },
}

/// A log-x / linear-y line chart as SVG (text as SVG text, so no font is
/// needed).
pub fn svg_chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
) -> String {
    let mut s = String::new();
    {
        let root = SVGBackend::with_string(&mut s, CHART_SIZE).into_drawing_area();
        if let Err(e) = draw_chart(&root, Some((title, xlabel, ylabel)), series) {
            // Nothing a caller can fix; the chart says what went wrong.
            return format!(
                "<svg xmlns=\"http://www.w3.org/2000/svg\"><text y=\"20\">{}</text></svg>\n",
                esc(&e.to_string())
            );
        }
    }
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// The same chart as a PNG file at `path`. Its text (title, axis labels,
/// legend) is left out: plotters draws bitmap text only with a font
/// backend, which this build does not carry; the SVG has it all.
pub fn png_chart(path: &Path, series: &BTreeMap<String, Vec<(f64, f64)>>) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        target: path.display().to_string(),
        reason: e.to_string(),
    };
    let root = BitMapBackend::new(path, CHART_SIZE).into_drawing_area();
    // Without a font backend plotters cannot draw bitmap text at all.
    draw_chart(&root, None, series).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Draws the chart: x is log2(size) with labels at powers of 4, weft series
/// thick with circles, raw baselines thin and lighter with crosses (plotters
/// draws no dashed polylines), legend on the upper left.
///
/// `text`: title, x and y labels; `None` draws no text at all (no caption,
/// tick labels or legend), for backends that cannot draw text.
fn draw_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    text: Option<(&str, &str, &str)>,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let mut xmin = f64::INFINITY;
    let mut xmax = f64::NEG_INFINITY;
    let mut ymax = 0.0_f64;
    for &(x, y) in series.values().flatten() {
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
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(root);
    if let Some((title, _, _)) = text {
        builder.caption(title, ("sans-serif", 16));
    }
    let mut chart = builder
        .margin(15)
        .margin_right(20)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(lx0..lx1, 0.0..ymax)?;
    // Ticks at even powers of two (powers of 4) in the range.
    let ticks = ((lx1 - lx0) / 2.0).floor().max(1.0) as usize + 1;
    let mut mesh = chart.configure_mesh();
    mesh.max_light_lines(0)
        .bold_line_style(RGBColor(0xee, 0xee, 0xee))
        .x_labels(ticks)
        .y_labels(6)
        .x_label_formatter(&|x| fmt_bytes(2f64.powf(x.round()).clamp(1.0, 2f64.powi(62)) as u64))
        .y_label_formatter(&|y| fmt_num(*y))
        // A frame instead of axis lines and tick marks (transparent ones are
        // not drawn): one path (SVG polyline) per series and nothing else.
        .axis_style(TRANSPARENT);
    match text {
        Some((_, xlabel, ylabel)) => mesh.x_desc(xlabel).y_desc(ylabel),
        // No axes: no tick labels.
        None => mesh.disable_axes(),
    };
    mesh.draw()?;
    chart.plotting_area().draw(&Rectangle::new(
        [(lx0, 0.0), (lx1, ymax)],
        BLACK.stroke_width(1),
    ))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let raw = name.starts_with("raw");
        let mut pts: Vec<(f64, f64)> = pts
            .iter()
            .filter(|(x, y)| *x > 0.0 && y.is_finite())
            .map(|&(x, y)| (x.log2(), y))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let line = if raw {
            c.mix(0.6).stroke_width(1)
        } else {
            c.stroke_width(2)
        };
        let drawn = chart.draw_series(LineSeries::new(pts.iter().copied(), line))?;
        if text.is_some() {
            drawn
                .label(name.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 1), (x + 20, y + 1)], c.filled()));
        }
        if raw {
            chart.draw_series(pts.iter().map(|&p| Cross::new(p, 3, c.stroke_width(1))))?;
        } else {
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
        }
    }
    if text.is_some() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()
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
