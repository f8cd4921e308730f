//! What the KvCache GPU examples share: arguments, the cache on the GPU
//! ([`Side`]), the per-request prefill kernels ([`Prefill`]), the check of
//! a decoder's pages ([`verify`]) and the shapes measured.

#![allow(dead_code)]

use std::sync::Arc;
use weft_cuda::{pattern_word, DeviceBuffer, Gpu, Kernels, Stream, WatchWord};
use weft_kvcache::{CacheRegions, HeadOrder, KvLayout};

/// Bytes of a request's tail (logits / hidden state).
pub const TAIL: u64 = 8 * 1024;

/// A model's KV shape on one rank: `(name, layers, page bytes)` with one KV
/// head (or MLA latent) per rank and 128-token pages.
pub fn shape(name: &str) -> Result<(&'static str, u32, u64), String> {
    match name {
        // Qwen3-235B-A22B at TP4: 94 layers, 4 KV heads of 128 dims, fp16
        // K and V: 1 head per rank, 128 tokens x 128 x 2 B x (K, V)
        "qwen3" => Ok(("Qwen3-235B-like (TP4, 1 KV head/rank)", 94, 32 * 1024)),
        // DeepSeek-V3 MLA: 61 layers, one 576-dim latent (512 + 64 rope),
        // bf16, replicated on every rank: 128 tokens x 576 x 2 B
        "dsv3" => Ok(("DeepSeek-V3-like (MLA latent)", 61, 128 * 576 * 2)),
        other => Err(format!("--shape {other}: qwen3 or dsv3")),
    }
}

/// The layout of `pages` pages of a shape.
pub fn layout(layers: u32, page: u64, pages: u32) -> KvLayout {
    KvLayout {
        layers,
        kv_heads: 1,
        page_len: page,
        tail_len: TAIL,
        num_pages: pages,
        tail_slots: 1,
        order: HeadOrder::HeadsBeforePages,
    }
}

/// The nvlink backend with `gpu`'s peer memory (GPU memory written with
/// CUDA IPC copies between processes).
pub fn nvlink(gpu: &Gpu) -> Result<weft::Backend, String> {
    let pm: Arc<dyn weft::PeerMemory> = Arc::new(gpu.peer_memory().map_err(|e| e.to_string())?);
    let config = weft::ProviderConfig::default()
        .with_nics(2)
        .with_nvlink(weft::NvlinkOptions::default().with_peer_memory(pm));
    weft::provider_with(&weft::ProviderSpec::Nvlink, &config).map_err(|e| e.to_string())
}

pub fn required() -> bool {
    std::env::var_os("WEFT_CUDA_REQUIRE_GPU").is_some_and(|v| v == "1")
}

pub fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
}

pub struct Side {
    pub kv: DeviceBuffer,
    pub tail: DeviceBuffer,
}

impl Side {
    pub fn new(gpu: &Gpu, l: &KvLayout) -> Result<Self, String> {
        let kv = gpu.alloc(l.kv_bytes().map_err(|e| e.to_string())? as usize);
        let tail = gpu.alloc(l.tail_bytes().map_err(|e| e.to_string())? as usize);
        Ok(Side {
            kv: kv.map_err(|e| e.to_string())?,
            tail: tail.map_err(|e| e.to_string())?,
        })
    }

    pub fn regions(&self) -> CacheRegions {
        // SAFETY: the buffers outlive the decoder/prefiller that register
        // them (dropped after them at the end of `run`), and device memory
        // is only written by the NIC model and kernels.
        #[allow(unsafe_code)]
        unsafe {
            CacheRegions::whole(self.kv.region(), self.tail.region())
        }
    }
}

/// The per-request kernel sequence on `stream`.
pub struct Prefill<'a> {
    pub k: &'a Kernels,
    pub stream: &'a Stream,
    pub src: &'a Side,
    pub word: &'a WatchWord,
    pub flag: &'a weft_cuda::HostFlag,
    pub spin_out: &'a DeviceBuffer,
    pub layout: KvLayout,
}

impl Prefill<'_> {
    pub fn launch(&self, seed: u64, layer_ns: u64, bump: bool) -> Result<(), String> {
        let e = |e: weft_cuda::CudaError| e.to_string();
        let lb = self.layout.layer_bytes().map_err(|e| e.to_string())? as usize;
        for l in 0..self.layout.layers {
            let off = l as usize * lb;
            self.k
                .fill_pattern(self.stream, &self.src.kv, off, lb / 8, seed + u64::from(l))
                .map_err(e)?;
            if layer_ns > 0 {
                // the rest of the layer's compute: spin until the timeout
                self.k
                    .wait_flag_write(self.stream, self.flag, 1, layer_ns, self.spin_out, 0, 1, 32)
                    .map_err(e)?;
            }
            if bump {
                self.k.scalar_inc(self.stream, self.word, 1).map_err(e)?;
            }
        }
        self.k
            .fill_pattern(
                self.stream,
                &self.src.tail,
                0,
                (TAIL / 8) as usize,
                seed ^ 0x7a11,
            )
            .map_err(e)?;
        if bump {
            self.k.scalar_inc(self.stream, self.word, 1).map_err(e)?;
        }
        Ok(())
    }
}

pub fn verify(dst: &Side, l: &KvLayout, seed: u64) -> Result<(), String> {
    let kv = dst.kv.to_vec().map_err(|e| e.to_string())?;
    let lb = l.layer_bytes().map_err(|e| e.to_string())? as usize;
    for layer in 0..l.layers as usize {
        let s = seed + layer as u64;
        for (i, w) in kv[layer * lb..(layer + 1) * lb].chunks_exact(8).enumerate() {
            let got = u64::from_le_bytes(w.try_into().map_err(|_| "word")?);
            if got != pattern_word(s, i as u64) {
                return Err(format!("layer {layer} word {i} differs"));
            }
        }
    }
    let tail = dst.tail.to_vec().map_err(|e| e.to_string())?;
    for (i, w) in tail.chunks_exact(8).enumerate() {
        let got = u64::from_le_bytes(w.try_into().map_err(|_| "word")?);
        if got != pattern_word(seed ^ 0x7a11, i as u64) {
            return Err(format!("tail word {i} differs"));
        }
    }
    Ok(())
}
