//! Planning time for 8, 64, 1,000 and 10,000 nodes: the ravnest planner next to the uniform
//! baseline in the same run (report the ratio, not a lone time). Goal on a 2-core machine:
//! 1,000 nodes under 100 ms, 10,000 under 2 s.
//!
//! `cargo bench --bench planner` measures; `cargo bench --bench planner -- --test` runs each
//! case once (CI). The planner *quality* table is `ravnest bench planners`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ravnest_core::{PlannerKind, Scenario, parse, plan};

/// A community cluster of `n` nodes: 40% RTX 3060, 30% 3090, 20% 4090, 10% A100 40GB.
fn cluster(n: usize, model: &str) -> Scenario {
    let counts = [
        n * 4 / 10,
        n * 3 / 10,
        n * 2 / 10,
        n - n * 4 / 10 - n * 3 / 10 - n * 2 / 10,
    ];
    let mut text = String::from("[links]\nbandwidth_gbps = 10.0\nlatency_ms = 0.5\n");
    for (dev, count) in ["rtx3060", "rtx3090", "rtx4090", "a100-40"]
        .iter()
        .zip(counts)
    {
        if count > 0 {
            text += &format!("[[node]]\nname = \"{dev}\"\ndevice = \"{dev}\"\ncount = {count}\n");
        }
    }
    text += &format!(
        "[model]\npreset = \"{model}\"\n[training]\nglobal_batch = {}\nmicro_batch = 4\nprecision = \"fp16\"\n",
        8 * n
    );
    parse(&text, "bench").expect("bench cluster parses")
}

fn planning(c: &mut Criterion) {
    for model in ["gpt2-small", "gpt-7b"] {
        let mut g = c.benchmark_group(format!("plan/{model}"));
        g.sample_size(10).measurement_time(Duration::from_secs(3));
        for n in [8usize, 64, 1000, 10_000] {
            let s = cluster(n, model);
            for kind in [PlannerKind::Ravnest, PlannerKind::Uniform] {
                g.bench_with_input(BenchmarkId::new(kind.as_str(), n), &s, |b, s| {
                    b.iter(|| black_box(plan(kind, &s.cluster, &s.model, &s.training)))
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, planning);
criterion_main!(benches);
