//! The README's Rust quick start is `examples/quickstart.rs`, verbatim, so
//! the example users copy is the one that is compiled (and run by
//! `cargo run -p weft --example quickstart`).

#[test]
fn readme_quick_start_is_the_compiled_example() {
    let readme = include_str!("../../../README.md");
    let example = include_str!("../../examples/quickstart.rs");
    let block = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("README has a ```rust block");
    assert_eq!(
        block, example,
        "README's ```rust block differs from weft/examples/quickstart.rs: paste the file into it"
    );
}
