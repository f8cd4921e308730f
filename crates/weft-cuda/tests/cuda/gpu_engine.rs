//! Engine end-to-end scenarios with GPU buffers, over the loopback fabric in
//! realtime mode with its adversarial profile (chunks of every WRITE land in
//! random order, jitter, loss + retransmit). The fabric moves bytes to and
//! from GPU memory through `CudaCopy`; every result is verified by copying
//! the GPU memory back. Skipped (with a message) without a GPU.

#![cfg(feature = "cuda")]

use crate::common::{gpu, gpu_kernels};
use rand::seq::SliceRandom;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft_cuda::{pattern_word, DeviceBuffer, Gpu};
use weft_engine::{DomainGroupSpec, DoneFlag, OnDone, TransferEngine};
use weft_loopback::{Fabric, FabricConfig};
use weft_testkit::pattern;
use weft_transport::{Device, HostBuffer, MrDesc, Pages, ScatterDst};

/// Waits for a completion flag; a generous hang guard, not a timing check.
fn wait(flag: &DoneFlag, what: &str, seed: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !flag.is_done() {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {what} never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    if let Some(Err(e)) = flag.result() {
        panic!("seed {seed}: {what} failed: {e}");
    }
}

/// A completion slot for `expect_imm_count` callbacks.
#[derive(Clone, Default)]
struct Sig(Arc<Mutex<Option<Result<(), String>>>>);

impl Sig {
    fn cb(&self) -> impl FnOnce(weft_engine::DoneResult) + Send + 'static {
        let s = self.0.clone();
        move |r| *s.lock().unwrap() = Some(r.map_err(|e| e.to_string()))
    }

    fn wait(&self, what: &str, seed: u64) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(r) = self.0.lock().unwrap().clone() {
                if let Err(e) = r {
                    panic!("seed {seed}: {what} failed: {e}");
                }
                return;
            }
            assert!(
                Instant::now() < deadline,
                "seed {seed}: {what} never completed"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

struct Pair {
    fabric: Fabric,
    a: TransferEngine,
    b: TransferEngine,
}

/// Two engines (hosts) of two NICs each on one realtime adversarial fabric,
/// each with one domain group serving cuda:0.
fn pair(g: &Gpu, seed: u64) -> Pair {
    let mut cfg = FabricConfig::adversarial(seed);
    cfg.device_copy = Some(Arc::new(g.copy_engine().unwrap()));
    let fabric = Fabric::new_realtime(cfg);
    let mk = |host| {
        TransferEngine::builder()
            .group(
                DomainGroupSpec::new(Arc::new(fabric.provider(host)), vec![0, 1])
                    .device(Device::Cuda(0)),
            )
            .build()
            .unwrap_or_else(|e| panic!("seed {seed}: engine: {e}"))
    };
    let (ha, hb) = (fabric.add_host(2), fabric.add_host(2));
    let (a, b) = (mk(ha), mk(hb));
    Pair { fabric, a, b }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.a.shutdown();
        self.b.shutdown();
        let _ = &self.fabric;
    }
}

fn reg(e: &TransferEngine, buf: &DeviceBuffer) -> (weft_engine::MrHandle, MrDesc) {
    // SAFETY: every buffer registered in these tests outlives its engine
    // (the `Pair` is declared after the buffers and shut down first).
    e.reg_mr(unsafe { buf.region() }).unwrap()
}

#[test]
fn gpu_single_paged_and_mixed_writes_over_loopback() {
    let Some(g) = gpu("gpu_single_paged_and_mixed_writes_over_loopback") else {
        return;
    };
    let seed = 0x5eed_0001;
    let mut rng = weft_testkit::seed::rng(seed);
    let len = (1 << 20) + 333;
    let src = g.alloc(len).unwrap();
    let dst = g.alloc(len).unwrap();
    let data = pattern(9, len);
    src.write(0, &data).unwrap();
    let host_src = pattern(77, len);
    // Declared before the `Pair`, so they outlive its engines.
    let host_src_buf = HostBuffer::new(len).unwrap();
    assert!(host_src_buf.write(0, &host_src));
    let host_dst = HostBuffer::new(len).unwrap();
    let p = pair(&g, seed);

    let (hs, _) = reg(&p.a, &src);
    let (_, dd) = reg(&p.b, &dst);
    let (hhs, _) = p.a.reg_mr(host_src_buf.region()).unwrap();
    let (_, hdd) = p.b.reg_mr(host_dst.region()).unwrap();
    let counts = p.a.imm_counts(0).unwrap();

    // 1. GPU -> GPU single write with an immediate.
    let imm = p.b.alloc_imm().unwrap();
    let armed = Sig::default();
    let n = counts.single_write(len as u64);
    p.b.expect_imm_count(imm, n, armed.cb()).unwrap();
    let (od, sent) = OnDone::flag();
    p.a.submit_single_write(len as u64, Some(imm), (&hs, 0), (&dd, 0), od)
        .unwrap();
    wait(&sent, "single write", seed);
    armed.wait("single write immediates", seed);
    assert!(
        dst.to_vec().unwrap() == data,
        "seed {seed}: GPU->GPU single write data mismatch"
    );

    // 2. Paged writes, KvCache style: 24 pages of 32 KiB, random page order.
    let page = 32 * 1024;
    let pages = 24u32;
    let kv_src = g.alloc(page * pages as usize).unwrap();
    let kv_dst = g.alloc(page * 2 * pages as usize).unwrap();
    let kv_data = pattern(3, page * pages as usize);
    kv_src.write(0, &kv_data).unwrap();
    let (hks, _) = reg(&p.a, &kv_src);
    let (_, dkd) = reg(&p.b, &kv_dst);
    let mut s_idx: Vec<u32> = (0..pages).collect();
    s_idx.shuffle(&mut rng);
    let mut d_idx: Vec<u32> = (0..2 * pages).collect();
    d_idx.shuffle(&mut rng);
    d_idx.truncate(pages as usize);
    let sp = Pages {
        indices: s_idx.clone(),
        stride: page as u64,
        offset: 0,
    };
    let dp = Pages {
        indices: d_idx.clone(),
        stride: page as u64,
        offset: 0,
    };
    let imm2 = p.b.alloc_imm().unwrap();
    let n2 = counts.paged_writes(page as u64, u64::from(pages));
    let armed2 = Sig::default();
    p.b.expect_imm_count(imm2, n2, armed2.cb()).unwrap();
    let (od2, sent2) = OnDone::flag();
    p.a.submit_paged_writes(page as u64, Some(imm2), (&hks, &sp), (&dkd, &dp), od2)
        .unwrap();
    wait(&sent2, "paged writes", seed);
    armed2.wait("paged immediates", seed);
    let got = kv_dst.to_vec().unwrap();
    for (i, (&s, &d)) in s_idx.iter().zip(&d_idx).enumerate() {
        let (s, d) = (s as usize * page, d as usize * page);
        assert!(
            got[d..d + page] == kv_data[s..s + page],
            "seed {seed}: page {i} mismatch"
        );
    }

    // 3. Host -> GPU and GPU -> host.
    let (od3, s3) = OnDone::flag();
    p.a.submit_single_write(len as u64, None, (&hhs, 0), (&dd, 0), od3)
        .unwrap();
    let (od4, s4) = OnDone::flag();
    p.a.submit_single_write(len as u64, None, (&hs, 0), (&hdd, 0), od4)
        .unwrap();
    wait(&s3, "host->GPU write", seed);
    wait(&s4, "GPU->host write", seed);
    assert!(
        dst.to_vec().unwrap() == host_src,
        "seed {seed}: host->GPU data mismatch"
    );
    assert!(
        host_dst.read(0, len).unwrap() == data,
        "seed {seed}: GPU->host data mismatch"
    );
    drop(p);
}

#[test]
fn gpu_scatter_and_barrier_over_loopback() {
    let Some(g) = gpu("gpu_scatter_and_barrier_over_loopback") else {
        return;
    };
    let seed = 0x5eed_0002;
    // Buffers first: they must outlive the engines that register them.
    let chunk = 200_000usize;
    let src = g.alloc(3 * chunk).unwrap();
    let data = pattern(5, 3 * chunk);
    src.write(0, &data).unwrap();
    let dsts: Vec<DeviceBuffer> = (0..3).map(|_| g.alloc(chunk + 4096).unwrap()).collect();
    let mut cfg = FabricConfig::adversarial(seed);
    cfg.device_copy = Some(Arc::new(g.copy_engine().unwrap()));
    let fabric = Fabric::new_realtime(cfg);
    let engines: Vec<TransferEngine> = (0..4)
        .map(|_| {
            let h = fabric.add_host(2);
            TransferEngine::builder()
                .group(
                    DomainGroupSpec::new(Arc::new(fabric.provider(h)), vec![0, 1])
                        .device(Device::Cuda(0)),
                )
                .build()
                .unwrap()
        })
        .collect();
    let (hs, _) = reg(&engines[0], &src);
    let descs: Vec<MrDesc> = dsts
        .iter()
        .zip(&engines[1..])
        .map(|(d, e)| reg(e, d).1)
        .collect();
    let addrs: Vec<_> = engines[1..].iter().map(|e| e.main_address()).collect();
    let pg = engines[0].add_peer_group(&addrs).unwrap();
    let counts = engines[0].imm_counts(0).unwrap();
    let imm = 7;
    let mut armed = Vec::new();
    for e in &engines[1..] {
        let f = Sig::default();
        let n =
            counts.scatter_dst(chunk as u64, weft_engine::ScatterMode::ByPeer) + counts.barrier();
        e.expect_imm_count(imm, n, f.cb()).unwrap();
        armed.push(f);
    }
    let sd: Vec<ScatterDst> = descs
        .iter()
        .enumerate()
        .map(|(j, d)| ScatterDst {
            len: chunk as u64,
            src_offset: (j * chunk) as u64,
            dst: d.clone(),
            dst_offset: 4096,
        })
        .collect();
    let (od, sent) = OnDone::flag();
    engines[0]
        .submit_scatter_mode(
            &pg,
            od,
            Some(imm),
            &hs,
            &sd,
            weft_engine::ScatterMode::ByPeer,
        )
        .unwrap();
    wait(&sent, "scatter", seed);
    let (od, bar) = OnDone::flag();
    engines[0].submit_barrier(&pg, od, imm, &descs).unwrap();
    wait(&bar, "barrier", seed);
    for (j, f) in armed.iter().enumerate() {
        f.wait(&format!("peer {j} immediates"), seed);
        let got = dsts[j].to_vec().unwrap();
        assert!(
            got[..4096].iter().all(|&b| b == 0),
            "seed {seed}: peer {j} wrote before offset"
        );
        assert!(
            got[4096..] == data[j * chunk..(j + 1) * chunk],
            "seed {seed}: peer {j} data mismatch"
        );
    }
    for e in &engines {
        e.shutdown();
    }
}

/// The KvCache flow with a GPU driving it: the prefiller's GPU "computes"
/// each layer (writes its KV pages with a kernel), then bumps a host-mapped
/// watcher word with `scalar_inc`; the engine's UVM watcher callback posts
/// that layer's paged writes (coalesced bumps post several layers); the
/// last layer is followed by a tail write. The decoder waits for
/// pages × layers + 1 immediates and checks its GPU pages. The second
/// request replays the same layers as a CUDA graph.
#[test]
fn kvcache_layers_driven_by_gpu_watcher() {
    let Some((g, k)) = gpu_kernels("kvcache_layers_driven_by_gpu_watcher") else {
        return;
    };
    let seed = 0x5eed_0003;
    let mut rng = weft_testkit::seed::rng(seed);
    let (layers, pages, page) = (12u64, 8u64, 16 * 1024usize);
    let layer_bytes = pages as usize * page;
    let kv = g.alloc(layers as usize * layer_bytes).unwrap();
    let tail = g.alloc(4096).unwrap();
    tail.write(0, &pattern(1, 4096)).unwrap();
    let dec_kv = g.alloc(layers as usize * layer_bytes * 2).unwrap();
    let dec_tail = g.alloc(4096).unwrap();
    let word = g.watch_word().unwrap();
    let stream = g.stream().unwrap();
    let p = pair(&g, seed);
    let (hkv, _) = reg(&p.a, &kv);
    let (htail, _) = reg(&p.a, &tail);
    let (_, dkv) = reg(&p.b, &dec_kv);
    let (_, dtail) = reg(&p.b, &dec_tail);
    let counts = p.a.imm_counts(0).unwrap();

    for (req, graph) in [(0u64, false), (1, true)] {
        // Decoder: random destination pages for each (layer, page).
        let mut slots: Vec<u32> = (0..(layers * pages * 2) as u32).collect();
        slots.shuffle(&mut rng);
        slots.truncate((layers * pages) as usize);
        let imm = p.b.alloc_imm().unwrap();
        let per_layer = counts.paged_writes(page as u64, pages);
        let total = layers * per_layer + counts.single_write(4096);
        let arrived = Sig::default();
        p.b.expect_imm_count(imm, total, arrived.cb()).unwrap();

        // Prefiller: the watcher callback posts layers (old, new].
        let base = req * layers;
        let errors = Arc::new(Mutex::new(Vec::<String>::new()));
        let posted = Arc::new(AtomicU64::new(0));
        let (e, hkv2, htail2, dkv2, dtail2) = (p.a.clone(), hkv, htail, dkv.clone(), dtail.clone());
        let (slots2, errs, posted2) = (slots.clone(), errors.clone(), posted.clone());
        let cb = move |old: u64, new: u64| {
            for v in old.max(base) + 1..=new.min(base + layers) {
                let l = v - base - 1;
                let sp = Pages {
                    indices: (0..pages as u32).map(|i| (l * pages) as u32 + i).collect(),
                    stride: page as u64,
                    offset: 0,
                };
                let dp = Pages {
                    indices: slots2[(l * pages) as usize..((l + 1) * pages) as usize].to_vec(),
                    stride: page as u64,
                    offset: 0,
                };
                let od = OnDone::callback({
                    let errs = errs.clone();
                    move |r| {
                        if let Err(e) = r {
                            errs.lock().unwrap().push(format!("layer {l}: {e}"));
                        }
                    }
                });
                if let Err(err) =
                    e.submit_paged_writes(page as u64, Some(imm), (&hkv2, &sp), (&dkv2, &dp), od)
                {
                    errs.lock()
                        .unwrap()
                        .push(format!("submit layer {l}: {err}"));
                }
                posted2.fetch_add(1, Ordering::SeqCst);
                if l + 1 == layers {
                    let r = e.submit_single_write(
                        4096,
                        Some(imm),
                        (&htail2, 0),
                        (&dtail2, 0),
                        OnDone::callback(|_| {}),
                    );
                    if let Err(err) = r {
                        errs.lock().unwrap().push(format!("submit tail: {err}"));
                    }
                }
            }
        };
        // SAFETY: `word` outlives the watcher (dropped at the end of this
        // iteration, before `word`).
        let watcher = unsafe { p.a.watch_word(word.host_ptr(), cb) };

        // The GPU computes layer l (fill its pages), then bumps the word.
        let layer_seed = |l: u64| 1000 * (req + 1) + l;
        let enqueue = |s: &weft_cuda::Stream| {
            for l in 0..layers {
                let off = l as usize * layer_bytes;
                k.fill_pattern(s, &kv, off, layer_bytes / 8, layer_seed(l))
                    .unwrap();
                // The graph request uses the relaxed bump: the fill kernel
                // before it on the stream has completed when it runs.
                if graph {
                    k.scalar_inc_relaxed(s, &word, 1).unwrap();
                } else {
                    k.scalar_inc(s, &word, 1).unwrap();
                }
            }
        };
        if graph {
            stream.begin_capture().unwrap();
            enqueue(&stream);
            let gr = stream.end_capture().unwrap();
            gr.launch(&stream).unwrap();
            stream.synchronize().unwrap();
        } else {
            enqueue(&stream);
            stream.synchronize().unwrap();
        }
        assert_eq!(word.value(), base + layers, "seed {seed}: request {req}");
        arrived.wait(&format!("request {req} immediates"), seed);
        drop(watcher);
        let errs = errors.lock().unwrap().clone();
        assert!(errs.is_empty(), "seed {seed}: request {req}: {errs:?}");
        assert_eq!(
            posted.load(Ordering::SeqCst),
            layers,
            "seed {seed}: request {req}"
        );

        let got = dec_kv.to_vec().unwrap();
        for l in 0..layers {
            for i in 0..pages {
                let slot = slots[(l * pages + i) as usize] as usize;
                let bytes = &got[slot * page..(slot + 1) * page];
                for (w, c) in bytes.chunks_exact(8).enumerate() {
                    let want = pattern_word(layer_seed(l), i * (page as u64 / 8) + w as u64);
                    let have = u64::from_le_bytes(c.try_into().unwrap());
                    assert_eq!(
                        have, want,
                        "seed {seed}: request {req} layer {l} page {i} word {w}"
                    );
                }
            }
        }
        assert!(
            dec_tail.to_vec().unwrap() == pattern(1, 4096),
            "seed {seed}: request {req} tail"
        );
        p.b.free_imm(imm);
    }
    drop(p);
}
