//! Every network gives the same results on a CUDA GPU as on the CPU (with the `cuda` feature,
//! on a machine with a GPU; elsewhere it says why it did not run): logits, loss and gradient
//! of one batch, and the weights after 20 SGD steps from the same start.
//!
//! Tolerance: relative 1e-4 on logits, loss and gradient norms (the GPU sums in another order,
//! with TF32 off for f32 products in candle), 1e-3 on the weights after 20 steps.
#![cfg(feature = "cuda")]

use candle_core::Device;
use ravnest_train::net::{CHAR_EMBED, Network};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("note: no CUDA device ({e}); the CPU/GPU comparison did not run");
            None
        }
    }
}

fn nets() -> Vec<Network> {
    vec![
        Network::Mlp {
            dims: vec![64, 256, 128, 10],
        },
        Network::Cnn {
            side: 8,
            classes: 10,
        },
        Network::Char {
            context: 8,
            vocab: 30,
            embed: CHAR_EMBED,
            hidden: 64,
        },
    ]
}

/// Inputs and labels for `rows` samples of `net`.
fn batch(net: &Network, rows: usize) -> (Vec<f32>, Vec<u32>) {
    let x = (0..rows * net.inputs())
        .map(|i| match net {
            Network::Char { vocab, .. } => ((i * 7 + 3) % vocab) as f32,
            _ => ((i * 37 % 101) as f32) / 101.0,
        })
        .collect();
    let classes = match net {
        Network::Mlp { dims } => *dims.last().unwrap(),
        Network::Cnn { classes, .. } => *classes,
        Network::Char { vocab, .. } => *vocab,
    };
    let y = (0..rows).map(|i| ((i * 5 + 1) % classes) as u32).collect();
    (x, y)
}

fn relative(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(p, q)| (f64::from(*p) - f64::from(*q)).powi(2))
        .sum();
    let n: f64 = b.iter().map(|q| f64::from(*q).powi(2)).sum();
    d.sqrt() / n.sqrt().max(1e-12)
}

#[test]
fn every_network_computes_the_same_on_the_gpu_as_on_the_cpu() {
    let Some(gpu) = gpu() else { return };
    for net in nets() {
        let model = net.init(7);
        let (x, y) = batch(&net, 64);
        let l_cpu = net.logits_on(&Device::Cpu, &model, &x, y.len()).unwrap();
        let l_gpu = net.logits_on(&gpu, &model, &x, y.len()).unwrap();
        let r = relative(&l_gpu, &l_cpu);
        assert!(r < 1e-4, "{net:?}: logits differ by {r:.2e}");
        let (loss_c, g_c) = net
            .loss_and_grad_sum_on(&Device::Cpu, &model, &x, &y)
            .unwrap();
        let (loss_g, g_g) = net.loss_and_grad_sum_on(&gpu, &model, &x, &y).unwrap();
        assert!(
            ((loss_g - loss_c) / loss_c).abs() < 1e-4,
            "{net:?}: loss {loss_c} vs {loss_g}"
        );
        let r = relative(&g_g, &g_c);
        assert!(r < 1e-4, "{net:?}: gradients differ by {r:.2e}");
        eprintln!("{net:?}: loss {loss_c:.5} (GPU {loss_g:.5}), gradient rel. diff {r:.1e}");
    }
}

#[test]
fn twenty_sgd_steps_on_the_gpu_end_where_the_cpu_does() {
    let Some(gpu) = gpu() else { return };
    for net in nets() {
        let (x, y) = batch(&net, 32);
        let train = |dev: &Device| {
            let mut w = net.init(3);
            for _ in 0..20 {
                let (_, g) = net.loss_and_grad_sum_on(dev, &w, &x, &y).unwrap();
                for (p, d) in w.iter_mut().zip(&g) {
                    *p -= 0.01 * d / y.len() as f32;
                }
            }
            w
        };
        let (c, g) = (train(&Device::Cpu), train(&gpu));
        let r = relative(&g, &c);
        assert!(
            r < 1e-3,
            "{net:?}: weights after 20 steps differ by {r:.2e}"
        );
    }
}

/// The optimizer a GPU node runs (candle operations) gives the bits the CPU's fused pass gives,
/// for every optimizer, so replicas on different device kinds stay bit-identical (the rule in
/// docs/layouts.md, "Replicas and digests").
#[test]
fn the_optimizer_gives_the_cpus_bits_on_the_gpu() {
    use ravnest_core::Optimizer;
    use ravnest_train::optim::Optim;
    use ravnest_train::state::optimizer_step_on;
    let Some(gpu) = gpu() else { return };
    let n = 4099;
    let w: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
        .collect();
    let g: Vec<f32> = (0..n)
        .map(|i| ((i * 13 % 97) as f32 - 48.0) / 90.0)
        .collect();
    for kind in [Optimizer::Sgd, Optimizer::SgdMomentum, Optimizer::Adamw] {
        let optim = Optim {
            kind,
            lr: 0.003,
            momentum: 0.9,
            weight_decay: 0.01,
            schedule: ravnest_core::recipe::Schedule::CONSTANT,
        };
        let state: Vec<Vec<f32>> = (0..optim.state_names().len())
            .map(|k| {
                (0..n)
                    .map(|i| ((i * (k + 3) % 17) as f32) / 170.0)
                    .collect()
            })
            .collect();
        for (scale, t) in [(1.0f32, 0.0f32), (0.25, 7.0), (1.0 / 48.0, 123.0)] {
            let cpu = optimizer_step_on(&Device::Cpu, &optim, &w, &state, &g, scale, t).unwrap();
            let on = optimizer_step_on(&gpu, &optim, &w, &state, &g, scale, t).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&cpu.0),
                bits(&on.0),
                "{kind:?} parameters, scale {scale}, t {t}"
            );
            for (a, b) in cpu.1.iter().zip(&on.1) {
                assert_eq!(bits(a), bits(b), "{kind:?} state, scale {scale}, t {t}");
            }
        }
        eprintln!("{kind:?}: the GPU's update has the CPU's bits");
    }
}

/// A GPT's stages on the GPU (candle's autograd) give the CPU's hand-written pass's loss and
/// gradients (relative 1e-4).
#[test]
fn a_gpt_stage_computes_the_same_on_the_gpu_as_on_the_cpu() {
    use ravnest_train::gpt::{Gpt, StageInput};
    let Some(gpu) = gpu() else { return };
    let g = Gpt::gpt2(2, 64, 4, 16, 64);
    let flat = g.init(3);
    let toks: Vec<f32> = (0..3 * (g.seq + 1))
        .map(|i| ((i * 7 + 1) % g.vocab) as f32)
        .collect();
    let all = 0..g.planner_layers();
    let (cpu_loss, cpu_grad) = g.loss_and_grad_sum(&Device::Cpu, &flat, &toks).unwrap();
    let p = g.weights(&gpu, &flat).unwrap();
    let (grads, _, gpu_loss) = g
        .stage_backward_with(&gpu, all, &p, StageInput::Tokens(&toks), None, None)
        .unwrap();
    let mut gpu_grad = Vec::new();
    for t in grads {
        gpu_grad.extend(t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    assert!(
        (cpu_loss - gpu_loss).abs() < 1e-4 * cpu_loss.abs(),
        "{cpu_loss} vs {gpu_loss}"
    );
    let r = relative(&gpu_grad, &cpu_grad);
    assert!(r < 1e-4, "gradient differs by {r:e}");
    eprintln!("gpt: loss {cpu_loss:.5} (cpu) vs {gpu_loss:.5} (gpu), gradient {r:.1e}");
}
