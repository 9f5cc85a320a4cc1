//! The transformer's own tests: shapes, stages chained, gradients, generation.

use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn tiny() -> Gpt {
    Gpt::gpt2(2, 16, 2, 6, 20)
}

fn tokens(g: &Gpt, rows: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..rows * (g.seq + 1))
        .map(|_| rng.random_range(0..g.vocab) as f32)
        .collect()
}

#[test]
fn parameter_counts_match_the_planners_gpt_layers() {
    let g = Gpt::gpt2(3, 32, 4, 8, 256);
    let spec = ravnest_core::model::gpt_spec("g", 3, 32, 4, 8, 256, false);
    let ranges = g.layer_ranges();
    assert_eq!(ranges.len(), spec.layers.len());
    for (r, l) in ranges.iter().zip(&spec.layers) {
        assert_eq!(r.len() as u64, l.params, "{}", l.name);
    }
}

#[test]
fn stages_chained_equal_the_whole_model_forward_and_backward() {
    let g = tiny();
    let dev = Device::Cpu;
    let model = g.init(3);
    let toks = tokens(&g, 3, 1);
    let (loss, grad) = g.loss_and_grad_sum(&dev, &model, &toks).unwrap();
    let r = g.layer_ranges();
    // Stages [0, 2) and [2, 4).
    let (a, b) = (r[0].start..r[1].end, r[2].start..r[3].end);
    let h = g
        .stage_forward(
            &dev,
            0..2,
            &model[a.clone()],
            StageInput::Tokens(&toks),
            None,
        )
        .unwrap();
    let out = g
        .stage_forward(
            &dev,
            2..4,
            &model[b.clone()],
            StageInput::Hidden(&h),
            Some(&toks),
        )
        .unwrap();
    assert!((f64::from(out[0]) - loss).abs() < 1e-4 * loss.abs().max(1.0));
    let (gb, gin, _) = g
        .stage_backward(
            &dev,
            2..4,
            &model[b.clone()],
            StageInput::Hidden(&h),
            Some(&toks),
            None,
        )
        .unwrap();
    let (ga, none, _) = g
        .stage_backward(
            &dev,
            0..2,
            &model[a.clone()],
            StageInput::Tokens(&toks),
            None,
            Some(&gin),
        )
        .unwrap();
    assert!(none.is_empty());
    for (x, y) in ga.iter().chain(&gb).zip(&grad) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
}

#[test]
fn the_gradient_matches_finite_differences() {
    let g = tiny();
    let dev = Device::Cpu;
    let model = g.init(5);
    let toks = tokens(&g, 2, 2);
    let (_, grad) = g.loss_and_grad_sum(&dev, &model, &toks).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for _ in 0..12 {
        let i = rng.random_range(0..model.len());
        let eps = 1e-2f32;
        let at = |d: f32| {
            let mut m = model.clone();
            m[i] += d;
            g.loss_and_grad_sum(&dev, &m, &toks).unwrap().0
        };
        let fd = (at(eps) - at(-eps)) / (2.0 * f64::from(eps));
        let tol = 2e-3 + 0.05 * fd.abs();
        assert!(
            (fd - f64::from(grad[i])).abs() < tol,
            "parameter {i}: finite difference {fd}, gradient {}",
            grad[i]
        );
    }
}

#[test]
fn a_few_steps_of_sgd_lower_the_loss_and_generation_is_seeded() {
    let g = tiny();
    let dev = Device::Cpu;
    let mut model = g.init(1);
    // A repeating pattern is learnable.
    let toks: Vec<f32> = (0..4 * (g.seq + 1)).map(|i| (i % 5) as f32).collect();
    let first = g.loss_and_grad_sum(&dev, &model, &toks).unwrap().0;
    for _ in 0..60 {
        let (_, grad) = g.loss_and_grad_sum(&dev, &model, &toks).unwrap();
        for (w, d) in model.iter_mut().zip(&grad) {
            *w -= 0.1 * d;
        }
    }
    let last = g.loss_and_grad_sum(&dev, &model, &toks).unwrap().0;
    assert!(last < 0.5 * first, "{first} -> {last}");
    const SAMPLE: Sampling = Sampling {
        temperature: 1.0,
        top_k: 0,
        seed: 7,
    };
    let a = g.generate(&dev, &model, &[0, 1, 2], 8, SAMPLE).unwrap();
    let b = g.generate(&dev, &model, &[0, 1, 2], 8, SAMPLE).unwrap();
    assert_eq!(a, b);
    assert!(a.iter().all(|&t| (t as usize) < g.vocab));
}
#[test]
fn the_hugging_face_config_and_the_metadata_give_the_shape_back() {
    let g = tiny();
    assert_eq!(from_hf_config(&hf_config(&g)), Ok(g));
    let meta = crate::net::Network::Gpt(g).config_json();
    assert_eq!(from_model_json(&meta), Ok(g));
    let mut c = hf_config(&g);
    c["activation_function"] = "gelu".into();
    assert!(from_hf_config(&c).unwrap_err().contains("gelu_new"));
    let mut c = hf_config(&g);
    c["n_head"] = 3.into();
    assert!(
        from_hf_config(&c)
            .unwrap_err()
            .contains("3 heads do not divide")
    );
    let mlp = serde_json::json!({"kind": "mlp", "dims": [2, 3]});
    assert!(
        from_model_json(&mlp)
            .unwrap_err()
            .contains("`mlp` network, not of a GPT")
    );
    assert_eq!(
        decode_bytes(&[104, 105, 300, 0xe2, 0x82, 0xac]),
        "hi\u{fffd}€"
    );
}

/// The element-wise passes split over threads give the same bits as on one thread.
#[test]
fn element_wise_passes_are_the_same_bits_on_several_threads() {
    use super::ops;
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let (one, two) = (pool(1), pool(3));
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 500.0 - 2.0
            })
            .collect()
    };
    let (h, seq) = (96, 64);
    let a = values(h * 700);
    let b = values(h * 700);
    let g = values(h);
    let bias = values(h);
    let scores = values(seq * seq * 9);
    let qkv = values(3 * h * 25 * 7);
    let wide = values(3 * h);
    let run = |p: &rayon::ThreadPool| {
        p.install(|| {
            let ln = ops::layer_norm(&a, &g, &bias, h, 1e-5);
            let rms = ops::rms_norm(&a, &g, h, 1e-5);
            let (u, t) = ops::gelu(&a);
            let mut du = b.clone();
            ops::gelu_back(&mut du, &a, &t);
            let sw = ops::swiglu(&a, &b);
            let swb = ops::swiglu_back(&b, &a, &b, &sw.1);
            let mut att = scores.clone();
            ops::causal_softmax(&mut att, seq, 0.125);
            let mut datt = scores.clone();
            ops::causal_softmax_back(&mut datt, &att, seq, 0.125);
            // The norms' backward: rows in parallel, the gains' sums by columns.
            let (mut dx, mut dg, mut db) = (b.clone(), g.clone(), bias.clone());
            ops::layer_norm_back(&b, &ln.1, &ln.2, &g, &mut dx, &mut dg, &mut db);
            let (mut rdx, mut rdg) = (a.clone(), bias.clone());
            ops::rms_norm_back(&b, &rms.1, &rms.2, &g, &mut rdx, &mut rdg);
            // The moves between heads and rows (4 heads of 24, sequences of 25), rotary
            // positions, biases and the sum over rows.
            let (heads, d, s) = (4, 24, 25);
            let [q, k, mut v] = ops::split_heads(&qkv, &wide, s, heads, d);
            let mut merged = vec![0.0f32; 3 * h * s * 7];
            ops::merge_heads(&q, s, heads, d, &mut merged, 3 * h, h);
            let back = ops::split_to_heads(&a[..h * s * 7], s, heads, d);
            ops::rope(&mut v, s, d, &a[..s * d / 2], &b[..s * d / 2], true);
            let mut biased = a.clone();
            ops::add_bias(&mut biased, &bias);
            let mut sums = g.clone();
            ops::sum_rows(&b, &mut sums);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            [
                bits(&dx),
                bits(&dg),
                bits(&db),
                bits(&rdx),
                bits(&rdg),
                bits(&k),
                bits(&merged),
                bits(&back),
                bits(&v),
                bits(&biased),
                bits(&sums),
                bits(&ln.0),
                bits(&ln.1),
                bits(&ln.2),
                bits(&rms.0),
                bits(&rms.2),
                bits(&u),
                bits(&du),
                bits(&sw.0),
                bits(&swb.0),
                bits(&swb.1),
                bits(&att),
                bits(&datt),
            ]
        })
    };
    assert_eq!(run(&one), run(&two));
}
