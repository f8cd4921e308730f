//! A private `etcd` server for a test: Debian's `etcd-server` (3.4 or
//! later) on 127.0.0.1, free ports, a temporary data directory.
//!
//! [`Etcd::start`] returns `None` after printing `SKIP: ...` when no `etcd`
//! binary is found (set `WEFT_ETCD` to its path to use another one), and
//! panics instead when `WEFT_REQUIRE_ETCD=1` (CI sets it), so a CI machine
//! without etcd fails rather than skipping silently. The server is killed
//! and its directory removed when the [`Etcd`] is dropped.
//!
//! ```no_run
//! let Some(etcd) = weft_testkit::etcd::Etcd::start() else { return };
//! let url = etcd.url(); // http://127.0.0.1:PORT
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The environment variable that turns a missing etcd into a failure.
pub const REQUIRE_ENV: &str = "WEFT_REQUIRE_ETCD";
/// The environment variable naming the etcd binary (default `etcd` on
/// `PATH`, then `/usr/bin/etcd`).
pub const BINARY_ENV: &str = "WEFT_ETCD";

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A running test etcd (see the module docs).
#[derive(Debug)]
pub struct Etcd {
    binary: PathBuf,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

fn find_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(BINARY_ENV) {
        // An explicit path that is not there counts as no etcd.
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

/// Whether `etcd` answers `GET /health` with 200 on `port`.
fn healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    resp.starts_with("HTTP/1.1 200") && resp.contains("true")
}

impl Etcd {
    /// Starts a single-member etcd; `None` (after printing why) when the
    /// binary is absent and [`REQUIRE_ENV`] is not `1`.
    pub fn start() -> Option<Etcd> {
        let Some(binary) = find_binary() else {
            let why = "no etcd binary (install Debian's etcd-server, or set WEFT_ETCD)";
            assert!(
                std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
                "{REQUIRE_ENV}=1 but {why}"
            );
            println!("SKIP: {why}");
            return None;
        };
        let dir = std::env::temp_dir().join(format!(
            "weft-etcd-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the etcd test directory");
        let mut e = Etcd {
            binary,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
        };
        e.launch();
        Some(e)
    }

    /// The client URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The data directory's parent (holds `data/` and `etcd.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Kills the server (SIGKILL) and reaps it; its data stays.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same ports and data directory and
    /// waits until it is healthy.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    /// Starts the server again on the same ports with its data directory
    /// wiped (an etcd that lost its state: every lease and key is gone).
    pub fn restart_wiped(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
        self.launch();
    }

    fn launch(&mut self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.join("etcd.log")).expect("create etcd.log");
        let child = Command::new(&self.binary)
            .arg("--name=weft-test")
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=weft-test={peer}"))
            .arg("--log-outputs=stderr")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.binary.display()));
        self.child = Some(child);
        let port = self.client_port;
        let log = self.dir.join("etcd.log");
        let start = std::time::Instant::now();
        while !healthy(port) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "etcd not healthy on port {port} after 30 s (log: {})",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
