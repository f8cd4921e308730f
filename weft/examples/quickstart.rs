//! Two engines on the built-in loopback fabric: one writes 1 MiB into the
//! other's memory with an immediate, and the receiver's ImmCounter says when
//! every byte has landed. Run: `cargo run -p weft --example quickstart`
use std::sync::{mpsc, Arc};
use weft::{DomainGroupSpec, HostBuffer, OnDone, Provider, TransferEngine};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const LEN: usize = 1 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    // Buffers first: they must outlive the engines that register them.
    let (src, dst) = (HostBuffer::new(LEN)?, HostBuffer::new(LEN)?);
    assert!(src.write(0, &data));

    // Two hosts on one simulated fabric (it chunks and reorders every WRITE).
    let backend = weft::provider("loopback")?;
    let engine = |host: Arc<dyn Provider>| {
        let group = DomainGroupSpec::new(host, vec![0]); // NIC 0 of that host
        TransferEngine::builder().group(group).build()
    };
    let (writer, reader) = (engine(backend.host()?)?, engine(backend.host()?)?);
    // Registrations deregister when dropped (here: before the buffers go).
    let src_mr = writer.register(src.region())?;
    let dst_mr = reader.register(dst.region())?; // its desc() is what a peer needs

    // The reader arms a round: it fires once every WRITE carrying `imm` has landed.
    let imm = reader.lease_imm()?; // returned to the allocator when dropped
    let count = reader.imm_counts(0)?.single_write(LEN as u64);
    let (tx, rx) = mpsc::channel();
    reader.expect_imm_count(imm.value(), count, move |r| {
        let _ = tx.send(r);
    })?;

    let (on_done, sent) = OnDone::flag();
    let (src_h, dst_desc) = (src_mr.handle(), dst_mr.desc());
    writer.submit_single_write(
        LEN as u64,
        Some(imm.value()),
        (&src_h, 0),
        (dst_desc, 0),
        on_done,
    )?;
    sent.wait()?; // delivered, as seen by the writer
    rx.recv()??; // the reader's round fired: every byte is in `dst`
    assert_eq!(dst.read(0, LEN), Some(data));
    println!("ok: {LEN} bytes written and checked, {count} immediate(s) counted");

    writer.shutdown();
    reader.shutdown();
    Ok(())
}
