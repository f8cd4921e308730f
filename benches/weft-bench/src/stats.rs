//! Small statistics helpers.

use std::time::Duration;

/// Percentiles of a sample set, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Percentiles {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Mean.
    pub mean: f64,
}

/// Percentiles of `ns` (sorted in place). Empty input gives zeros.
pub fn percentiles(ns: &mut [f64]) -> Percentiles {
    if ns.is_empty() {
        return Percentiles::default();
    }
    ns.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| {
        let i = ((ns.len() as f64 - 1.0) * q).round() as usize;
        ns[i.min(ns.len() - 1)]
    };
    Percentiles {
        n: ns.len(),
        p50: at(0.50),
        p99: at(0.99),
        p999: at(0.999),
        mean: ns.iter().sum::<f64>() / ns.len() as f64,
    }
}

/// Nanoseconds as `f64`.
pub fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

/// Median of `v` (sorted in place); 0 for empty input.
pub fn median(v: &mut [f64]) -> f64 {
    percentiles(v).p50
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_known_set() {
        let mut v: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        let p = percentiles(&mut v);
        assert_eq!(p.n, 1000);
        assert_eq!(p.p50, 501.0);
        assert_eq!(p.p99, 990.0);
        assert_eq!(p.p999, 999.0);
        assert!((p.mean - 500.5).abs() < 1e-9);
        assert_eq!(percentiles(&mut []).n, 0);
    }
}
