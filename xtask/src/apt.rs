//! The machine's own apt configuration: which Debian archive (mirror) it
//! uses, so that `libfabric2` can fetch another suite from the same place
//! without the project naming any host.

/// Where apt reads its sources from.
const SOURCES_LIST: &str = "/etc/apt/sources.list";
/// Directory of further `*.list` and `*.sources` files.
const SOURCES_DIR: &str = "/etc/apt/sources.list.d";
/// The keyring Debian's own archive is signed with (used when a source
/// names none).
pub const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// One binary-package (`deb`) source of the apt configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The archive's URI (the first one, where a deb822 entry lists several).
    pub uri: String,
    /// Its suites, e.g. `bookworm`, `bookworm-updates`.
    pub suites: Vec<String>,
    /// `Signed-By` (a keyring path, or an inline key: the field's lines).
    pub signed_by: Option<Vec<String>>,
}

/// The `deb` sources configured on this machine, in apt's order
/// (`sources.list`, then `sources.list.d/` by file name).
pub fn configured() -> Vec<Source> {
    let mut out = Vec::new();
    if let Ok(text) = std::fs::read_to_string(SOURCES_LIST) {
        out.extend(parse_one_line(&text));
    }
    let mut files: Vec<_> = std::fs::read_dir(SOURCES_DIR)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        match f.extension().and_then(|e| e.to_str()) {
            Some("list") => out.extend(parse_one_line(&text)),
            Some("sources") => out.extend(parse_deb822(&text)),
            _ => {}
        }
    }
    out
}

/// This machine's release codename (`VERSION_CODENAME` in os-release).
pub fn codename() -> Option<String> {
    let text = std::fs::read_to_string("/etc/os-release").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim().trim_matches('"').to_string())
        .filter(|v| !v.is_empty())
}

/// The Debian archive among `sources`: the first source carrying the
/// release's own suite (`codename`, not `-updates`/`-security`), else the
/// first whose URI path ends in `/debian`.
pub fn debian_archive<'a>(sources: &'a [Source], codename: Option<&str>) -> Option<&'a Source> {
    codename
        .and_then(|c| sources.iter().find(|s| s.suites.iter().any(|x| x == c)))
        .or_else(|| {
            sources
                .iter()
                .find(|s| s.uri.trim_end_matches('/').ends_with("/debian"))
        })
}

/// A deb822 `.sources` file for `suite` (component `main`) of `archive`.
pub fn sources_file(archive: &Source, suite: &str) -> String {
    let signed_by = match &archive.signed_by {
        Some(lines) => lines.join("\n"),
        None => DEBIAN_KEYRING.to_string(),
    };
    format!(
        "Types: deb\nURIs: {}\nSuites: {suite}\nComponents: main\nSigned-By: {signed_by}\n",
        archive.uri
    )
}

/// The `deb` lines of a one-line-style `sources.list`.
pub fn parse_one_line(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line.split_whitespace().peekable();
        if words.next() != Some("deb") {
            continue;
        }
        let mut signed_by = None;
        if words.peek().is_some_and(|w| w.starts_with('[')) {
            for w in words.by_ref() {
                let opt = w.trim_start_matches('[').trim_end_matches(']');
                if let Some(v) = opt.strip_prefix("signed-by=") {
                    signed_by = Some(vec![v.to_string()]);
                }
                if w.ends_with(']') {
                    break;
                }
            }
        }
        let (Some(uri), Some(suite)) = (words.next(), words.next()) else {
            continue;
        };
        out.push(Source {
            uri: uri.to_string(),
            suites: vec![suite.to_string()],
            signed_by,
        });
    }
    out
}

/// The enabled `deb` entries of a deb822-style `.sources` file.
pub fn parse_deb822(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    // Each paragraph as (field, value lines).
    let mut para: Vec<(String, Vec<String>)> = Vec::new();
    let mut flush = |para: &mut Vec<(String, Vec<String>)>| {
        let field = |name: &str| {
            para.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        };
        let words = |name: &str| -> Vec<String> {
            field(name)
                .map(|v| v.join(" ").split_whitespace().map(String::from).collect())
                .unwrap_or_default()
        };
        let enabled = words("Enabled").first().is_none_or(|e| e != "no");
        if enabled && words("Types").iter().any(|t| t == "deb") {
            if let Some(uri) = words("URIs").into_iter().next() {
                out.push(Source {
                    uri,
                    suites: words("Suites"),
                    signed_by: field("Signed-By").cloned(),
                });
            }
        }
        para.clear();
    };
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        if line.trim().is_empty() {
            flush(&mut para);
        } else if line.starts_with([' ', '\t']) {
            if let Some((_, v)) = para.last_mut() {
                v.push(line.to_string());
            }
        } else if let Some((k, v)) = line.split_once(':') {
            para.push((k.trim().to_string(), vec![v.trim().to_string()]));
        }
    }
    flush(&mut para);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_picks_the_release_suite_not_security() {
        let text = "Types: deb\n# a comment\nURIs: http://mirror.invalid/debian\n\
                    Suites: bookworm bookworm-updates\nComponents: main\n\
                    Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
                    Types: deb\nURIs: http://mirror.invalid/debian-security\n\
                    Suites: bookworm-security\nComponents: main\n";
        let s = parse_deb822(text);
        assert_eq!(s.len(), 2);
        let a = debian_archive(&s, Some("bookworm")).expect("archive found");
        assert_eq!(a.uri, "http://mirror.invalid/debian");
        let f = sources_file(a, "trixie");
        assert!(f.contains("URIs: http://mirror.invalid/debian\nSuites: trixie\n"));
        assert!(f.contains("Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"));
    }

    #[test]
    fn deb822_keeps_inline_keys_and_skips_disabled() {
        let text = "Types: deb\nURIs: http://a.invalid/debian\nSuites: bookworm\n\
                    Enabled: no\n\nTypes: deb deb-src\nURIs: http://b.invalid/debian\n\
                    Suites: bookworm\nSigned-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n";
        let s = parse_deb822(text);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].uri, "http://b.invalid/debian");
        let f = sources_file(&s[0], "trixie");
        assert!(
            f.ends_with("Signed-By: \n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n"),
            "{f}"
        );
    }

    #[test]
    fn one_line_format_with_options() {
        let text = "# deb http://old.invalid/debian buster main\n\
                    deb-src http://src.invalid/debian bookworm main\n\
                    deb [arch=amd64 signed-by=/k.gpg] http://m.invalid/debian/ bookworm main\n";
        let s = parse_one_line(text);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].uri, "http://m.invalid/debian/");
        assert_eq!(s[0].signed_by.as_deref(), Some(&["/k.gpg".to_string()][..]));
        // Without a codename, the URI ending in /debian is the archive.
        assert_eq!(
            debian_archive(&s, None).map(|a| a.suites[0].as_str()),
            Some("bookworm")
        );
    }
}
