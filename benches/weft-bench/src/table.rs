//! A plain-text table that fits a terminal: columns padded to their widest
//! cell, numbers right-aligned, and, when the whole is wider than the
//! limit, the widest text columns cut (with `…`) until it fits.

/// Columns, rows and which columns hold numbers.
#[derive(Debug, Clone, Default)]
pub struct Table {
    headers: Vec<String>,
    numeric: Vec<bool>,
    rows: Vec<Vec<String>>,
}

/// Narrowest a text column is cut to.
const MIN_TEXT: usize = 6;
/// Space between columns.
const GAP: usize = 2;

impl Table {
    /// A table with these columns; `numeric[i]` right-aligns column `i`
    /// and keeps it whole.
    pub fn new(headers: &[&str], numeric: &[bool]) -> Self {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            numeric: (0..headers.len())
                .map(|i| numeric.get(i).copied().unwrap_or(false))
                .collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (missing cells are empty, extra ones dropped).
    pub fn push(&mut self, mut row: Vec<String>) {
        row.resize(self.headers.len(), String::new());
        self.rows.push(row);
    }

    /// Column widths fitting `max_width` where the numbers allow it.
    fn widths(&self, max_width: usize) -> Vec<usize> {
        let len = |s: &String| s.chars().count();
        let mut w: Vec<usize> = self.headers.iter().map(len).collect();
        for row in &self.rows {
            for (i, c) in row.iter().enumerate() {
                w[i] = w[i].max(len(c));
            }
        }
        let total = |w: &[usize]| w.iter().sum::<usize>() + GAP * w.len().saturating_sub(1);
        while total(&w) > max_width {
            // Cut the widest text column by one; stop when none can shrink.
            let widest = (0..w.len())
                .filter(|&i| !self.numeric[i] && w[i] > MIN_TEXT)
                .max_by_key(|&i| (w[i], std::cmp::Reverse(i)));
            match widest {
                Some(i) => w[i] -= 1,
                None => break,
            }
        }
        w
    }

    /// The table as lines of at most `max_width` characters (when the
    /// numeric columns and the narrowest text columns fit in it).
    pub fn render(&self, max_width: usize) -> String {
        let w = self.widths(max_width);
        let mut out = String::new();
        let line = |out: &mut String, row: &[String]| {
            let mut s = String::new();
            for (i, c) in row.iter().enumerate() {
                let c = cut(c, w[i]);
                let pad = w[i].saturating_sub(c.chars().count());
                if self.numeric[i] {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(&c);
                } else {
                    s.push_str(&c);
                    s.push_str(&" ".repeat(pad));
                }
                s.push_str(&" ".repeat(GAP));
            }
            out.push_str(s.trim_end());
            out.push('\n');
        };
        line(&mut out, &self.headers);
        let sep: Vec<String> = w.iter().map(|n| "-".repeat(*n)).collect();
        line(&mut out, &sep);
        for row in &self.rows {
            line(&mut out, row);
        }
        out
    }
}

/// `s` cut to `n` characters, the last one `…` when anything was cut.
pub fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_string();
    }
    let mut c: String = s.chars().take(n.saturating_sub(1)).collect();
    c.push('…');
    c
}

/// `text` broken into lines of at most `max_width` characters at spaces
/// (a word longer than a line is cut).
pub fn wrap(text: &str, max_width: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let word = cut(word, max_width);
        let need = line.chars().count() + usize::from(!line.is_empty()) + word.chars().count();
        if need > max_width && !line.is_empty() {
            out.push_str(&line);
            out.push('\n');
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(&word);
    }
    if !line.is_empty() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_text_is_cut_to_fit_and_numbers_stay_whole() {
        let mut t = Table::new(&["name", "what", "value"], &[false, false, true]);
        t.push(vec!["a".repeat(80), "b".repeat(60), "123456.789".into()]);
        t.push(vec!["short".into(), "x".into(), "1".into()]);
        let out = t.render(60);
        for l in out.lines() {
            assert!(
                l.chars().count() <= 60,
                "{l:?} is {} wide",
                l.chars().count()
            );
        }
        assert!(out.contains("123456.789"), "{out}");
        assert!(out.contains('…'), "{out}");
        // Nothing is cut when it fits.
        let narrow = Table::new(&["a", "b"], &[false, true]);
        let mut n = narrow.clone();
        n.push(vec!["abc".into(), "1".into()]);
        assert_eq!(n.render(100), "a    b\n---  -\nabc  1\n");
    }

    #[test]
    fn wrap_keeps_lines_within_the_width() {
        let text = "one two three four five six seven eight nine ten eleven twelve";
        let out = wrap(text, 20);
        assert!(out.lines().all(|l| l.chars().count() <= 20), "{out}");
        assert_eq!(out.split_whitespace().collect::<Vec<_>>().join(" "), text);
        assert_eq!(wrap(&"x".repeat(30), 10), format!("{}…\n", "x".repeat(9)));
    }
}
