//! Capability measurement: what this node can actually do, measured on start.

use std::time::{Duration, Instant};

use candle_core::Tensor;

/// Matrix-product throughput (FLOP/s) of candle in f32 on the device this process computes on
/// (see [`crate::device`]), measured for about `budget`.
pub fn matmul_flops(budget: Duration) -> f64 {
    matmul_flops_in(budget, candle_core::DType::F32)
}

/// The same in `dtype` (bf16 or f16 on a GPU, where models would use them).
pub fn matmul_flops_in(budget: Duration, dtype: candle_core::DType) -> f64 {
    let dev = crate::device::current();
    // Big enough to keep a GPU busy; a CPU's figure settles at small sizes.
    let n = if dev.is_cpu() { 256usize } else { 4096 };
    let data: Vec<f32> = (0..n * n).map(|i| (i % 13) as f32 * 0.01).collect();
    let make = || Tensor::from_slice(&data, (n, n), &dev).and_then(|t| t.to_dtype(dtype));
    let (Ok(a), Ok(b)) = (make(), make()) else {
        return 0.0;
    };
    let _ = a.matmul(&b); // warm up
    crate::device::synchronize(&dev);
    let t = Instant::now();
    let mut reps = 0u64;
    while t.elapsed() < budget || reps < 3 {
        if a.matmul(&b).is_err() {
            return 0.0;
        }
        reps += 1;
        if !dev.is_cpu() && reps.is_multiple_of(8) {
            // Kernels are queued: the clock must see them run.
            crate::device::synchronize(&dev);
        }
    }
    crate::device::synchronize(&dev);
    2.0 * (n * n * n) as f64 * reps as f64 / t.elapsed().as_secs_f64()
}

/// What the binary does when this process's memory turns out tight (see [`memory_is_tight`]):
/// its allocator's business, so the binary sets it ([`on_tight_memory`]).
static ON_TIGHT_MEMORY: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Call `f` once when a node's plan needs more than half of its memory budget: an allocator
/// that keeps freed pages for speed should give them back at once from then on.
pub fn on_tight_memory(f: fn()) {
    let _ = ON_TIGHT_MEMORY.set(f);
}

/// This process's node needs more than half of its memory budget (the first call runs the
/// binary's [`on_tight_memory`] hook; later ones do nothing).
pub fn memory_is_tight() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(f) = ON_TIGHT_MEMORY.get() {
            f();
        }
    });
}

/// This process's resident memory now and its peak so far (Linux `VmRSS`, `VmHWM`), bytes.
pub fn resident_memory() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse().ok()
    };
    Some((kib("VmRSS:")? * 1024, kib("VmHWM:")? * 1024))
}

/// Memory available for training (Linux `MemAvailable`), if it can be read.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
