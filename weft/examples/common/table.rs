//! The bandwidth table the cross-process examples print: per size, min /
//! median / max GB/s of two sides measured alternately, and the ratio of
//! the medians.

/// One row: `samples[0]` (the measured side) and `samples[1]` (the
/// baseline) in seconds for `bytes` bytes each, the first sample of each
/// a warm-up that is dropped.
pub fn row(size: usize, bytes: usize, samples: &mut [Vec<f64>; 2]) {
    let stats = |v: &mut Vec<f64>| {
        v.remove(0);
        let mut g: Vec<f64> = v.iter().map(|t| bytes as f64 / t / 1e9).collect();
        g.sort_by(|a, b| a.total_cmp(b));
        (g[0], g[g.len() / 2], g[g.len() - 1])
    };
    let a = stats(&mut samples[0]);
    let b = stats(&mut samples[1]);
    println!(
        "{:>10} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>7.2}",
        human(size),
        a.0,
        a.1,
        a.2,
        b.0,
        b.1,
        b.2,
        a.1 / b.1
    );
}

/// The header line, naming the two sides.
pub fn header(measured: &str, baseline: &str) {
    println!(
        "{:>10} {:>26} {:>26} {:>7}",
        "size",
        format!("{measured} GB/s min/med/max"),
        format!("{baseline} GB/s min/med/max"),
        "ratio"
    );
}

/// `--reps N` of the command line (default 7, at least 1).
pub fn reps(args: &[String]) -> usize {
    args.iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(7)
        .max(1)
}

/// Reads one line of hex from `r` into bytes.
pub fn read_hex(r: &mut impl std::io::BufRead) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let t = line.trim();
    Ok((0..t.len() / 2)
        .map(|i| u8::from_str_radix(&t[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()?)
}

fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 30 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n => format!("{} KiB", n >> 10),
    }
}
