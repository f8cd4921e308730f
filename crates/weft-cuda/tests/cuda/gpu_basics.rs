//! GPU memory, the copy engine, watcher words, flags and kernels. Each test
//! skips with a message when no GPU is present.

#![cfg(feature = "cuda")]

use crate::common::{gpu, gpu_kernels};
use std::time::Duration;
use weft_cuda::{CudaError, Gpu, ProbeOrdering};
use weft_testkit::pattern;
use weft_transport::{Device, DeviceCopy, TransportError};

#[test]
fn probe_never_panics() {
    // Runs on any machine: either a driver is found or a typed error says why.
    match weft_cuda::probe() {
        Ok(info) => {
            assert!(info.driver_version >= 13000, "{info:?}");
            eprintln!("driver: {info:?}");
        }
        Err(e) => {
            assert!(matches!(e, CudaError::DriverUnavailable { .. }), "{e:?}");
            assert!(!e.to_string().is_empty());
        }
    }
    match Gpu::open(4096) {
        Err(CudaError::NoDevice { ordinal: 4096, .. })
        | Err(CudaError::DriverUnavailable { .. }) => {}
        other => panic!("opening cuda:4096 gave {other:?}"),
    }
}

#[test]
fn device_buffer_roundtrip_and_bounds() {
    let Some(g) = gpu("device_buffer_roundtrip_and_bounds") else {
        return;
    };
    let len = 1 << 20;
    let buf = g.alloc(len).unwrap();
    assert_eq!(buf.device(), Device::Cuda(0));
    assert!(
        buf.to_vec().unwrap().iter().all(|&b| b == 0),
        "fresh buffer not zeroed"
    );
    let data = pattern(7, len);
    buf.write(0, &data).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    buf.write(100, &[1, 2, 3]).unwrap();
    let mut out = [0u8; 5];
    buf.read(99, &mut out).unwrap();
    assert_eq!(out, [data[99], 1, 2, 3, data[103]]);
    assert!(matches!(
        buf.write(len - 2, &[0; 3]),
        Err(CudaError::InvalidArgument { .. })
    ));
    assert!(matches!(
        buf.read(usize::MAX, &mut out),
        Err(CudaError::InvalidArgument { .. })
    ));
    assert!(matches!(g.alloc(0), Err(CudaError::InvalidArgument { .. })));
    // SAFETY: `buf` outlives the region (it is not registered anywhere).
    let region = unsafe { buf.region() };
    assert_eq!(region.addr(), buf.device_ptr());
    assert_eq!(region.len(), len);
    assert_eq!(region.device(), Device::Cuda(0));
}

#[test]
fn cuda_copy_every_direction() {
    let Some(g) = gpu("cuda_copy_every_direction") else {
        return;
    };
    let cc = g.copy_engine().unwrap();
    let len = 3 * 4096 + 17;
    let a = g.alloc(len).unwrap();
    let b = g.alloc(len).unwrap();
    let src = pattern(42, len);
    let mut back = vec![0u8; len];
    let host = |v: &[u8]| v.as_ptr() as usize as u64;
    // H2D
    cc.copy(
        a.device_ptr(),
        Device::Cuda(0),
        host(&src),
        Device::Host,
        len as u64,
    )
    .unwrap();
    assert_eq!(a.to_vec().unwrap(), src);
    // D2D at an offset
    cc.copy(
        b.device_ptr() + 5,
        Device::Cuda(0),
        a.device_ptr(),
        Device::Cuda(0),
        (len - 5) as u64,
    )
    .unwrap();
    let bv = b.to_vec().unwrap();
    assert_eq!(&bv[..5], &[0; 5]);
    assert_eq!(&bv[5..], &src[..len - 5]);
    // D2H
    cc.copy(
        back.as_mut_ptr() as usize as u64,
        Device::Host,
        b.device_ptr(),
        Device::Cuda(0),
        len as u64,
    )
    .unwrap();
    assert_eq!(back, bv);
    // H2H
    let mut h2 = vec![0u8; 64];
    cc.copy(
        h2.as_mut_ptr() as usize as u64,
        Device::Host,
        host(&src),
        Device::Host,
        64,
    )
    .unwrap();
    assert_eq!(&h2[..], &src[..64]);
    // zero length is a no-op, another GPU is refused
    cc.copy(0, Device::Cuda(0), 0, Device::Host, 0).unwrap();
    let err = cc
        .copy(a.device_ptr(), Device::Cuda(1), host(&src), Device::Host, 8)
        .unwrap_err();
    assert!(matches!(err, TransportError::Unsupported { .. }), "{err:?}");
    // From many threads at once (the loopback fabric copies from its workers).
    let cc = std::sync::Arc::new(cc);
    let chunk = len / 4;
    std::thread::scope(|s| {
        for t in 0..4 {
            let (cc, a) = (cc.clone(), &a);
            s.spawn(move || {
                let p = pattern(u64::from(t as u8), chunk);
                for _ in 0..20 {
                    cc.copy(
                        a.device_ptr() + (t * chunk) as u64,
                        Device::Cuda(0),
                        host(&p),
                        Device::Host,
                        chunk as u64,
                    )
                    .unwrap();
                }
            });
        }
    });
    let av = a.to_vec().unwrap();
    for t in 0..4 {
        assert_eq!(
            &av[t * chunk..(t + 1) * chunk],
            &pattern(u64::from(t as u8), chunk)[..],
            "chunk {t}"
        );
    }
}

#[test]
fn scalar_inc_direct_and_in_graph() {
    let Some((g, k)) = gpu_kernels("scalar_inc_direct_and_in_graph") else {
        return;
    };
    let word = g.watch_word().unwrap();
    assert_eq!(word.value(), 0);
    let s = g.stream().unwrap();
    for i in 0..10 {
        if i % 2 == 0 {
            k.scalar_inc(&s, &word, 3).unwrap();
        } else {
            k.scalar_inc_relaxed(&s, &word, 3).unwrap();
        }
    }
    s.synchronize().unwrap();
    assert_eq!(word.value(), 30);
    // Capture 4 bumps (as a prefiller would per layer) and replay 25 times.
    s.begin_capture().unwrap();
    for d in 1..=4 {
        if d % 2 == 0 {
            k.scalar_inc_relaxed(&s, &word, d).unwrap();
        } else {
            k.scalar_inc(&s, &word, d).unwrap();
        }
    }
    let graph = s.end_capture().unwrap();
    assert_eq!(word.value(), 30, "capture must not execute");
    // A host thread watches the word while the graph runs: values only grow.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let seen = std::thread::scope(|sc| {
        let (w, stop) = (word.clone(), &stop);
        let h = sc.spawn(move || {
            let mut seen = vec![w.value()];
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                let v = w.value();
                if v != *seen.last().unwrap() {
                    seen.push(v);
                }
            }
            seen.push(w.value());
            seen
        });
        for _ in 0..25 {
            graph.launch(&s).unwrap();
        }
        s.synchronize().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Release);
        h.join().unwrap()
    });
    assert_eq!(word.value(), 30 + 25 * 10);
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]),
        "not monotonic: {seen:?}"
    );
    assert_eq!(*seen.last().unwrap(), 280);
    // The graph keeps the word alive even if our handle goes away.
    let host = word.host_ptr();
    drop(word);
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    // SAFETY: the graph holds a clone of the word, so the memory is alive.
    let after = unsafe { host.as_ref() }.load(std::sync::atomic::Ordering::Acquire);
    assert_eq!(after, 290);
}

#[test]
fn kernel_waits_for_host_flag() {
    let Some((g, k)) = gpu_kernels("kernel_waits_for_host_flag") else {
        return;
    };
    let flag = g.host_flag().unwrap();
    let out = g.alloc(4 * 64 * 8).unwrap();
    let done = g.watch_word().unwrap();
    let s = g.stream().unwrap();
    k.wait_flag_write(&s, &flag, 5, 30_000_000_000, &out, 1000, 4, 64)
        .unwrap();
    k.scalar_inc(&s, &done, 1).unwrap();
    // Raising to a value below the target must not release the kernel.
    flag.raise(4);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        done.value(),
        0,
        "kernel finished before the flag reached its target"
    );
    assert!(
        out.to_vec().unwrap().iter().all(|&b| b == 0),
        "kernel wrote before the flag"
    );
    flag.raise(5);
    s.synchronize().unwrap();
    assert_eq!(done.value(), 1);
    let v = out.to_vec().unwrap();
    for (tid, c) in v.chunks_exact(8).enumerate() {
        let x = u64::from_le_bytes(c.try_into().unwrap());
        assert_eq!(x, 1000 + tid as u64, "thread {tid}");
    }
    // Timeout path: never raised to 99, so every thread reports u64::MAX.
    k.wait_flag_write(&s, &flag, 99, 1_000_000, &out, 0, 2, 32)
        .unwrap();
    s.synchronize().unwrap();
    let v = out.to_vec().unwrap();
    assert!(v[..64 * 8]
        .chunks_exact(8)
        .all(|c| u64::from_le_bytes(c.try_into().unwrap()) == u64::MAX));
    // Argument checks.
    assert!(k
        .wait_flag_write(&s, &flag, 1, 0, &out, 0, 1, 2048)
        .is_err());
    assert!(k
        .wait_flag_write(&s, &flag, 1, 0, &out, 100, 64, 0)
        .is_err());
    assert!(k
        .wait_flag_write(&s, &flag, 1, 0, &out, 0, 1000, 1000)
        .is_err());
}

#[test]
fn gated_inc_handshake_direct_and_in_graph() {
    let Some((g, k)) = gpu_kernels("gated_inc_handshake_direct_and_in_graph") else {
        return;
    };
    let (gate, armed, word) = (
        g.host_flag().unwrap(),
        g.host_flag().unwrap(),
        g.watch_word().unwrap(),
    );
    let s = g.stream().unwrap();
    s.begin_capture().unwrap();
    k.gated_inc(
        &s,
        &gate,
        &armed,
        &word,
        1,
        10_000_000_000,
        ProbeOrdering::STRONG,
    )
    .unwrap();
    let graph = s.end_capture().unwrap();
    for i in 1..=50u64 {
        if i % 2 == 0 {
            graph.launch(&s).unwrap();
        } else {
            k.gated_inc(
                &s,
                &gate,
                &armed,
                &word,
                1,
                10_000_000_000,
                ProbeOrdering::STRONG,
            )
            .unwrap();
        }
        while armed.value() < i {
            std::hint::spin_loop();
        }
        assert_eq!(word.value(), i - 1, "bumped before the gate opened");
        gate.raise(i);
        while word.value() < i {
            std::hint::spin_loop();
        }
        assert_eq!(word.value(), i);
    }
    s.synchronize().unwrap();
}
