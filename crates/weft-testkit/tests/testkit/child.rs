//! The child-process primitive, end to end: this test binary re-executes
//! itself.

use std::ffi::OsStr;
use std::time::Duration;
use weft_testkit::child;

#[test]
fn child_entry() {
    let Some(role) = child::role() else { return };
    let extra = std::env::var("WEFT_TESTKIT_EXTRA").unwrap_or_default();
    match role.as_str() {
        "echo" => {
            println!("a line the parent must skip");
            child::send_line(&format!("ready {role} {extra}")).unwrap();
            child::send_line("bye").unwrap();
            std::process::exit(3);
        }
        "serve" => {
            // The first line shares its line with libtest's `test ... `.
            child::send_line("ready").unwrap();
            while let Some(req) = child::recv_line().unwrap() {
                child::send_line(&format!("echo {req}")).unwrap();
            }
            child::send_line("stdin closed").unwrap();
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn handshake_and_exit_status() {
    let mut c = child::spawn_role(
        "child_entry",
        "echo",
        &[("WEFT_TESTKIT_EXTRA", OsStr::new("x1"))],
    )
    .unwrap();
    assert_eq!(c.recv_line().unwrap().as_deref(), Some("ready echo x1"));
    assert_eq!(c.recv_line().unwrap().as_deref(), Some("bye"));
    assert_eq!(c.recv_line().unwrap(), None);
    assert_eq!(c.wait().unwrap().code(), Some(3));
}

#[test]
fn lines_both_ways_and_signals() {
    let mut c = child::spawn_role("child_entry", "serve", &[]).unwrap();
    let long = Duration::from_secs(60);
    assert_eq!(c.recv_line_timeout(long).unwrap().as_deref(), Some("ready"));
    // Nothing sent yet: a zero timeout finds no line.
    let e = c.recv_line_timeout(Duration::ZERO).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    #[cfg(unix)]
    {
        c.signal(libc::SIGSTOP).unwrap();
        c.send_line("while stopped").unwrap();
        c.signal(libc::SIGCONT).unwrap();
        assert_eq!(
            c.recv_line_timeout(long).unwrap().as_deref(),
            Some("echo while stopped")
        );
    }
    c.send_line("one").unwrap();
    assert_eq!(c.recv_line().unwrap().as_deref(), Some("echo one"));
    c.close_stdin();
    assert!(c.send_line("too late").is_err());
    assert_eq!(c.recv_line().unwrap().as_deref(), Some("stdin closed"));
    assert!(c.wait().unwrap().success());
    #[cfg(unix)]
    assert!(c.signal(libc::SIGCONT).is_err(), "signal after exit");
}
