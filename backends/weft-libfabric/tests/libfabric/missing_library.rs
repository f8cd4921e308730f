//! Without libfabric the provider fails with a clear LibraryUnavailable.
//! The library is loaded once per process, so the check runs in a child
//! process of its own with `WEFT_LIBFABRIC_PATH` naming a missing file.

use weft_libfabric::LibfabricProvider;
use weft_testkit::child::{self, spawn_role};
use weft_transport::TransportError;

const MISSING: &str = "/nonexistent/libfabric.so.1";

#[test]
fn missing_library_entry() {
    let Some(_) = child::role() else { return };
    let line = match LibfabricProvider::new("tcp") {
        Err(TransportError::LibraryUnavailable { library, reason }) => {
            if library == MISSING && reason.contains("libfabric") {
                "ok".to_string()
            } else {
                format!("wrong error: library {library}, reason {reason}")
            }
        }
        other => format!("expected LibraryUnavailable, got {other:?}"),
    };
    child::send_line(&line).unwrap();
    std::process::exit(0);
}

#[test]
fn missing_library_is_a_typed_error() {
    let env = [("WEFT_LIBFABRIC_PATH", std::ffi::OsStr::new(MISSING))];
    let mut c = spawn_role("missing_library_entry", "check", &env).expect("spawn");
    let line = c
        .recv_line_timeout(std::time::Duration::from_secs(60))
        .expect("child line")
        .expect("child alive");
    assert_eq!(line, "ok");
    assert!(c.wait().expect("wait").success());
}
