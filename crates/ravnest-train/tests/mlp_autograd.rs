//! The hand-written MLP step (`ravnest_train::mlp`) against candle autograd through
//! `ravnest_train::net` (a test of its own, so that `mlp` does not import `net`).

use ravnest_core::LayerRange;
use ravnest_train::mlp::*;
use ravnest_train::net::Network;

fn slots(net: &Network, n: usize) -> Vec<LayerSlots> {
    let layout = net.layout();
    let find = |name: String| {
        let p = layout.iter().find(|p| p.name == name).unwrap();
        p.offset..p.offset + p.len()
    };
    let at = |name: String| layout.iter().position(|p| p.name == name).unwrap();
    (0..n)
        .map(|i| LayerSlots {
            bias: find(format!("fc{i}.bias")),
            weight: find(format!("fc{i}.weight")),
            bias_at: at(format!("fc{i}.bias")),
            weight_at: at(format!("fc{i}.weight")),
        })
        .collect()
}

/// The network's tensors of the flat model `w`, on the CPU.
fn tensors(net: &Network, w: &[f32]) -> Vec<candle_core::Tensor> {
    net.layout()
        .iter()
        .map(|p| {
            candle_core::Tensor::from_slice(
                &w[p.offset..p.offset + p.len()],
                p.shape.as_slice(),
                &candle_core::Device::Cpu,
            )
            .unwrap()
        })
        .collect()
}

/// The hand-written step gives candle autograd's loss and gradient, bucket by bucket, for
/// several shapes and bucket sizes.
#[test]
fn equals_candle_autograd() {
    for (dims, min) in [
        (vec![7, 5, 3], 0),
        (vec![6, 9, 4, 3], 0),
        (vec![6, 9, 4, 3], 1 << 20),
        (vec![8, 16, 16, 5], 40),
    ] {
        let net = Network::Mlp { dims: dims.clone() };
        let w = net.init(9);
        let b = 5;
        let x: Vec<f32> = (0..b * dims[0])
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let y: Vec<u32> = (0..b).map(|i| (i % dims[dims.len() - 1]) as u32).collect();
        let (want_loss, want) = net.loss_and_grad_sum(&w, &x, &y).unwrap();
        let s = slots(&net, dims.len() - 1);
        let bk = buckets(&s, min);
        let mut got = vec![f32::NAN; w.len()];
        let mut order = Vec::new();
        let shape = Shape {
            dims: &dims,
            slots: &s,
            buckets: &bk,
        };
        let loss = loss_and_grad(
            &shape,
            &tensors(&net, &w),
            &x,
            &y,
            &mut |k, v| {
                order.push(k);
                got[bk[k].1.clone()].copy_from_slice(&v);
            },
            &mut |n| vec![0.0; n],
        )
        .unwrap();
        assert_eq!(order, (0..bk.len()).collect::<Vec<_>>(), "{dims:?}");
        assert!((loss - want_loss).abs() < 1e-4 * want_loss.abs().max(1.0));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() < 1e-4 * b.abs().max(1.0),
                "{dims:?} min {min}: element {i}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn buckets_tile_the_model_last_layer_first() {
    let net = Network::Mlp {
        dims: vec![64, 512, 512, 10],
    };
    let s = slots(&net, 3);
    let bk = buckets(&s, 1 << 16);
    // fc2 (5,130 values) rides with fc1; fc0 (33,280) is the last bucket.
    assert_eq!(bk.len(), 2);
    assert_eq!(bk[0].0, LayerRange::new(1, 3));
    assert_eq!(bk[1].0, LayerRange::new(0, 1));
    assert_eq!(bk[1].1.start, 0);
    assert_eq!(bk[0].1.start, bk[1].1.end);
    assert_eq!(bk[0].1.end, net.params());
}
