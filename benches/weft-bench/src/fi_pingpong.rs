//! Runs libfabric's own `fi_pingpong` (server and client on this machine)
//! and reads its result line, for the `pingpong` baseline.
//!
//! Both sides get `-p <provider> -e rdm -I <iters> -S <size>`; tcp also
//! `-d lo` (the domain weft's bench uses on one machine; retried without it
//! when the tool refuses it). The control port is a free one picked here.
//! The client's `usec/xfer` (half a round trip) and `MB/sec` are the result.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on one `fi_pingpong` run (it only catches hangs).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// An installed `fi_pingpong`.
#[derive(Debug, Clone)]
pub struct FiPingpong {
    bin: PathBuf,
}

/// One `fi_pingpong` result.
#[derive(Debug, Clone, Copy)]
pub struct FiResult {
    /// Half a round trip (µs): its `usec/xfer`.
    pub usec_per_xfer: f64,
    /// Its `MB/sec` (10^6 bytes/s, both directions).
    pub mb_per_s: f64,
}

impl FiPingpong {
    /// `spec`: a path, `auto` (PATH lookup) or `off`. `None` when off or
    /// not found.
    pub fn find(spec: &str) -> Option<FiPingpong> {
        match spec {
            "off" | "none" => None,
            "auto" | "" => std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join("fi_pingpong"))
                    .find(|c| c.is_file())
                    .map(|bin| FiPingpong { bin })
            }),
            path => Path::new(path).is_file().then(|| FiPingpong {
                bin: PathBuf::from(path),
            }),
        }
    }

    /// The binary.
    pub fn path(&self) -> &Path {
        &self.bin
    }

    /// One run of `size` bytes × `iters` on `provider`.
    pub fn run(&self, provider: &str, size: u64, iters: u64) -> Result<FiResult, String> {
        let domain = (provider == "tcp").then_some("lo");
        match self.run_with(provider, domain, size, iters) {
            Err(e) if domain.is_some() => self
                .run_with(provider, None, size, iters)
                .map_err(|e2| format!("{e}; without -d: {e2}")),
            r => r,
        }
    }

    fn cmd(&self, provider: &str, domain: Option<&str>, size: u64, iters: u64) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(["-p", provider, "-e", "rdm", "-I"])
            .arg(iters.to_string())
            .arg("-S")
            .arg(size.to_string());
        if let Some(d) = domain {
            c.args(["-d", d]);
        }
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn run_with(
        &self,
        provider: &str,
        domain: Option<&str>,
        size: u64,
        iters: u64,
    ) -> Result<FiResult, String> {
        let port = free_port()?;
        let server = self
            .cmd(provider, domain, size, iters)
            .arg("-B")
            .arg(port.to_string())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.bin.display()))?;
        let mut server = Reaped(server);
        let deadline = Instant::now() + RUN_LIMIT;
        let mut last_err = String::new();
        // The client fails at once while the server does not listen yet.
        for _ in 0..100 {
            if let Ok(Some(st)) = server.0.try_wait() {
                return Err(format!(
                    "fi_pingpong server exited ({st}): {}",
                    stderr_of(&mut server.0)
                ));
            }
            let client = self
                .cmd(provider, domain, size, iters)
                .arg("-P")
                .arg(port.to_string())
                .arg("127.0.0.1")
                .spawn()
                .map_err(|e| format!("starting {}: {e}", self.bin.display()))?;
            let mut client = Reaped(client);
            let (ok, out, err) = finish(&mut client.0, deadline)?;
            if ok {
                return parse(&out).ok_or_else(|| format!("no result line in {out:?}"));
            }
            last_err = err;
            if !last_err.contains("connect") {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!("fi_pingpong client failed: {}", last_err.trim()))
    }
}

/// Kills and reaps its child when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

fn stderr_of(c: &mut Child) -> String {
    let mut s = String::new();
    if let Some(e) = c.stderr.as_mut() {
        let _ = e.read_to_string(&mut s);
    }
    s.trim().to_string()
}

/// Waits for `c` (until `deadline`); returns success, stdout, stderr.
fn finish(c: &mut Child, deadline: Instant) -> Result<(bool, String, String), String> {
    let mut out = String::new();
    // Output is a few lines: reading to the end finishes with the process.
    let reader = c.stdout.take().map(|mut o| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = o.read_to_string(&mut s);
            s
        })
    });
    loop {
        match c.try_wait() {
            Ok(Some(st)) => {
                if let Some(r) = reader {
                    out = r.join().unwrap_or_default();
                }
                let err = stderr_of(c);
                return Ok((st.success(), out, err));
            }
            Ok(None) if Instant::now() > deadline => {
                let _ = c.kill();
                let _ = c.wait();
                return Err(format!("fi_pingpong ran past {RUN_LIMIT:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(format!("waiting for fi_pingpong: {e}")),
        }
    }
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("picking a port: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("picking a port: {e}"))
}

/// The last result line of `fi_pingpong`'s table:
/// `bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec`.
pub fn parse(out: &str) -> Option<FiResult> {
    let mut header = false;
    let mut res = None;
    for l in out.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.first() == Some(&"bytes") && f.contains(&"usec/xfer") {
            header = true;
            continue;
        }
        if header && f.len() >= 8 {
            if let (Ok(mb), Ok(us)) = (f[5].parse::<f64>(), f[6].parse::<f64>()) {
                res = Some(FiResult {
                    usec_per_xfer: us,
                    mb_per_s: mb,
                });
            }
        }
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_result_table() {
        let out =
            "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
                   64k     2k      =2k      250m        0.39s    677.68      96.71       0.01\n";
        let r = parse(out).expect("parsed");
        assert_eq!(r.usec_per_xfer, 96.71);
        assert_eq!(r.mb_per_s, 677.68);
        assert!(parse("no table here\n").is_none());
        assert!(parse("bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec\n").is_none());
    }
}
