//! The backend conformance suite: one set of tests run unchanged against every weft backend
