"""How weft processes find each other: rendezvous stores, sessions and
namespaces (the same records as Rust's ``weft::rendezvous``, so Python and
Rust processes of one job see each other).

A process opens a store, holds a ``Session`` (a lease kept alive in the
background: what it publishes disappears when it closes or dies), publishes
its engine and regions in a ``Namespace``, and waits for or watches the
others::

    store = weft.rendezvous.open_store("dir:/tmp/job")      # or "etcd:http://10.0.0.5:2379"
    with weft.rendezvous.Session(store, ttl=10) as session:
        ns = weft.rendezvous.Namespace(store, "job-1")
        ns.publish_engine(session, "decode-0", engine)
        ns.publish_mr(session, "decode-0", "kv", reg.desc)
        peer = ns.wait_peer("prefill-0", timeout=60)        # a PeerRecord
        desc = ns.wait_mr("prefill-0", "kv", timeout=60)    # an MrDesc
        engine.submit_send(peer.address(), b"hello")

Store specs: ``mem`` (this process), ``dir:<path>`` (processes of one host),
``etcd:http://host:2379[,...]``. Records read from a store are untrusted: a
record that does not decode is skipped (``Namespace.skipped_records``) or
raises ``RendezvousError``.
"""

from __future__ import annotations

from ._weft import (
    Namespace,
    PeerEvent,
    PeerRecord,
    PeerWatch,
    Session,
    Store,
    open_store,
)

__all__ = ["Namespace", "PeerEvent", "PeerRecord", "PeerWatch", "Session", "Store", "open_store"]
