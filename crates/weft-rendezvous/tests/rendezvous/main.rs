//! The integration tests of `weft-rendezvous`: one test binary, one module per area.

#[macro_use]
mod suite;
mod dir;
mod etcd;
mod etcd_restart;
mod hostile;
mod mem;
