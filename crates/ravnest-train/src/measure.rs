//! Capability measurement: what this node can actually do, measured on start.

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

/// Dense f32 matmul throughput of candle on this machine (FLOP/s), over about `budget`.
pub fn matmul_flops(budget: Duration) -> f64 {
    let n = 256usize;
    let dev = Device::Cpu;
    let data: Vec<f32> = (0..n * n).map(|i| (i % 13) as f32 * 0.01).collect();
    let (Ok(a), Ok(b)) = (
        Tensor::from_slice(&data, (n, n), &dev),
        Tensor::from_slice(&data, (n, n), &dev),
    ) else {
        return 0.0;
    };
    let _ = a.matmul(&b); // warm up
    let t = Instant::now();
    let mut reps = 0u64;
    while t.elapsed() < budget || reps < 3 {
        if a.matmul(&b).is_err() {
            return 0.0;
        }
        reps += 1;
    }
    2.0 * (n * n * n) as f64 * reps as f64 / t.elapsed().as_secs_f64()
}

/// Memory available for training (Linux `MemAvailable`), if it can be read.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
