//! Without libfabric the provider fails with a clear LibraryUnavailable.

use weft_libfabric::LibfabricProvider;
use weft_transport::TransportError;

#[test]
fn missing_library_is_a_typed_error() {
    // This binary's only test: set before the library is first loaded.
    std::env::set_var("WEFT_LIBFABRIC_PATH", "/nonexistent/libfabric.so.1");
    match LibfabricProvider::new("tcp") {
        Err(TransportError::LibraryUnavailable { library, reason }) => {
            assert_eq!(library, "/nonexistent/libfabric.so.1");
            assert!(reason.contains("libfabric"), "{reason}");
        }
        other => panic!("expected LibraryUnavailable, got {other:?}"),
    }
}
