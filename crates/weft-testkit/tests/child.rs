//! The child-process primitive, end to end: this test binary re-executes
//! itself.

use std::ffi::OsStr;
use weft_testkit::child;

#[test]
fn child_entry() {
    let Some(role) = child::role() else { return };
    let extra = std::env::var("WEFT_TESTKIT_EXTRA").unwrap_or_default();
    println!("a line the parent must skip");
    child::send_line(&format!("ready {role} {extra}")).unwrap();
    child::send_line("bye").unwrap();
    std::process::exit(3);
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
