//! An opt-in HTTP endpoint that serves a metrics page (Prometheus' text
//! format) to a scraper: [`MetricsServer`].
//!
//! One thread, one connection at a time: a scraper asks every few seconds.
//! Requests are untrusted input: the request head is read up to 8 KiB,
//! anything but `GET` is refused, and a client gets two seconds to send
//! its request (and each write of the answer what is left of them): one
//! that trickles or stalls is dropped, never waited on for longer.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest request head read (request line and headers).
const MAX_HEAD: usize = 8 * 1024;
/// How long a client may take to send its request or read the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Serves `GET /metrics` (and `GET /`) with the page a closure renders
/// (for example [`TransferEngine::metrics_text`](crate::TransferEngine::metrics_text)
/// or a [`Metrics`](crate::metrics::Metrics) gathering several engines).
/// Other paths get 404, other methods 405. Stops when dropped or
/// [`stopped`](MetricsServer::stop).
///
/// ```no_run
/// # fn demo(engine: weft::TransferEngine) -> std::io::Result<()> {
/// let server = weft::MetricsServer::start("127.0.0.1:9400", move || engine.metrics_text())?;
/// println!("scrape http://{}/metrics", server.local_addr());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port: see
    /// [`local_addr`](MetricsServer::local_addr)) and serves `page` from a
    /// thread named `weft-metrics`.
    pub fn start(
        addr: impl ToSocketAddrs,
        page: impl Fn() -> String + Send + 'static,
    ) -> io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("weft-metrics".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if flag.load(Ordering::Acquire) {
                        break;
                    }
                    match conn {
                        Ok(c) => {
                            if let Err(e) = answer(c, &page) {
                                tracing::debug!(error = %e, "metrics request dropped");
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "metrics accept failed");
                            // Out of fds and the like: do not spin.
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
            })?;
        Ok(MetricsServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and joins the thread (also done on drop).
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        let Some(t) = self.thread.take() else { return };
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept; connecting to an unspecified address
        // means the loopback one.
        let mut to = self.addr;
        if to.ip().is_unspecified() {
            to.set_ip(match to {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        // The connection wakes the accept; the thread then finishes the
        // client it serves (at most `CLIENT_TIMEOUT` plus one answer).
        if TcpStream::connect_timeout(&to, CLIENT_TIMEOUT).is_ok() {
            let _ = t.join();
        }
        // Otherwise the thread stays blocked in accept (it holds only the
        // listener and the closure) and ends with the process.
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.halt();
    }
}

/// What is left of `deadline`, as a socket timeout (an error once it has
/// passed: a client gets [`CLIENT_TIMEOUT`] in all, not per read).
fn left(deadline: Instant) -> io::Result<Option<Duration>> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "client too slow"));
    }
    Ok(Some(d))
}

/// Reads one request head and answers it, all within [`CLIENT_TIMEOUT`].
fn answer(mut c: TcpStream, page: &impl Fn() -> String) -> io::Result<()> {
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() >= MAX_HEAD {
            return reply(&mut c, deadline, "431 Request Header Fields Too Large", "");
        }
        c.set_read_timeout(left(deadline)?)?;
        let n = c.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics" | "/") => reply(&mut c, deadline, "200 OK", &page()),
        ("GET", _) => reply(
            &mut c,
            deadline,
            "404 Not Found",
            "not found: try /metrics\n",
        ),
        _ => reply(&mut c, deadline, "405 Method Not Allowed", "only GET\n"),
    }
}

fn reply(c: &mut TcpStream, deadline: Instant, status: &str, body: &str) -> io::Result<()> {
    // A reader that stalls gets what is left of its time per write.
    c.set_write_timeout(left(deadline)?)?;
    write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    c.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &[u8]) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(request).unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_the_page_and_refuses_the_rest() {
        let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = Arc::clone(&n);
        let s = MetricsServer::start("127.0.0.1:0", move || {
            format!("x_total {}\n", seen.fetch_add(1, Ordering::Relaxed))
        })
        .unwrap();
        let a = s.local_addr();
        let r = get(a, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("Content-Type: text/plain; version=0.0.4"), "{r}");
        assert!(r.ends_with("\r\n\r\nx_total 0\n"), "{r}");
        // Rendered afresh for every scrape.
        assert!(get(a, b"GET /?q=1 HTTP/1.0\r\n\r\n").ends_with("x_total 1\n"));
        assert!(get(a, b"GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get(a, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        assert!(get(a, b"\xff\xfe garbage\r\n\r\n").starts_with("HTTP/1.1 405"));
        // A head that never ends is cut at the limit.
        let long = vec![b'a'; MAX_HEAD];
        assert!(get(a, &long).starts_with("HTTP/1.1 431"));
        // A client that connects and says nothing, and one that trickles
        // a byte at a time, are dropped after the timeout in all; the next
        // one is served.
        let _silent = TcpStream::connect(a).unwrap();
        let mut slow = TcpStream::connect(a).unwrap();
        let t0 = Instant::now();
        let mut cut = false;
        for _ in 0..40 {
            if slow.write_all(b"G").is_err() {
                cut = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(150));
        }
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest);
        assert!(cut || rest.is_empty(), "a trickling client got an answer");
        assert!(t0.elapsed() < Duration::from_secs(30));
        assert!(get(a, b"GET /metrics HTTP/1.1\r\n\r\n").contains("x_total"));
        s.stop();
        assert!(TcpStream::connect(a).is_err(), "still listening after stop");
    }
}
