//! The model state a node holds (`ravnest_train::state`), through the `Compute` seam: a stage
//! builds only its layers, versions share what they have in common and an update copies
//! nothing, and a stage fetched by a node that does not start at layer 0 keeps AdamW's step
//! count.

use std::sync::Arc;

use ravnest_core::{LayerRange, Optimizer};
use ravnest_protocol::node::values::Values;
use ravnest_runtime::Compute;
use ravnest_runtime::seams::StagePass;
use ravnest_train::compute::CandleCompute;
use ravnest_train::data::Dataset;
use ravnest_train::gpt::Gpt;
use ravnest_train::net::Network;
use ravnest_train::optim::Optim;

const GPT: Gpt = Gpt::gpt2(4, 32, 4, 8, 64);

fn backend() -> CandleCompute {
    let text: Vec<u8> = (0..4000u32).map(|i| (i * 7 % 61) as u8).collect();
    let data = Dataset::bytes(&text, "t", GPT.seq).unwrap();
    let optim = Optim {
        kind: Optimizer::Adamw,
        lr: 1e-2,
        momentum: 0.9,
        weight_decay: 0.01,
        schedule: ravnest_core::recipe::Schedule::CONSTANT,
    };
    CandleCompute::new(Network::Gpt(GPT), Arc::new(data), optim, 3, 1.0)
}

/// The whole gradient of `model` over `samples`, as the runtime hands it over (host, flat).
async fn gradient(
    c: &CandleCompute,
    model: &ravnest_train::state::CandleModel,
    samples: std::ops::Range<u64>,
) -> Vec<f32> {
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink: ravnest_runtime::seams::BucketSink = {
        let got = got.clone();
        Arc::new(move |_, g| *got.lock().unwrap() = g)
    };
    c.gradient_sum(ravnest_core::NodeId(0), 0, samples, model.clone(), sink)
        .await
        .unwrap();
    got.lock().unwrap().clone()
}

/// A node that holds layers 3..6 of version k, fetched from a peer (its own copy was
/// version 0), applies step k like the peer: the step count travelled with the layers. Before
/// the step count rode with every stage's slots, it rode with layer 0's only, and such a node
/// corrected AdamW's moments as if at step 1 (this test failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_stage_keeps_adamws_step_count() {
    let c = backend();
    let mut a = c.initial(None);
    for k in 0..3u64 {
        let g = gradient(&c, &a, k * 4..(k + 1) * 4).await;
        let mean: Vec<f32> = g.iter().map(|x| x / 4.0).collect();
        c.apply_update(&mut a, 0..c.params(), &mean).unwrap();
        c.end_update(&mut a);
    }
    let l = LayerRange::new(3, 6);
    let own = c.initial(None);
    let fetched = c.export(&a, Some(l)).unwrap();
    let mut b = c.retain(&c.import(Some(&own), Some(l), fetched).unwrap(), l);
    // Step 3 on both, with the same gradient.
    let g = gradient(&c, &a, 12..16).await;
    let mean: Vec<f32> = g.iter().map(|x| x / 4.0).collect();
    c.apply_update(&mut a, 0..c.params(), &mean).unwrap();
    c.end_update(&mut a);
    let r = c.param_range(l);
    c.apply_update(&mut b, r.clone(), &mean[r]).unwrap();
    c.end_update(&mut b);
    assert_eq!(
        c.export(&a, Some(l)).unwrap(),
        c.export(&b, Some(l)).unwrap(),
        "the fetched stage's step equals the whole model's"
    );
    assert_eq!(c.digest(&a, Some(l)), c.digest(&b, Some(l)));
}

/// A stage builds its own layers only; a version made from another shares every tensor the
/// update did not touch, leaves the other version as it was, and copies nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_holds_its_layers_and_an_update_copies_nothing() {
    let c = backend();
    let l = LayerRange::new(1, 3);
    let base = c.initial(Some(l));
    assert_eq!(
        c.state_stats().held_bytes,
        0,
        "nothing is made before it is used"
    );
    let input = vec![0.1; 2 * GPT.seq * GPT.hidden];
    let pass = StagePass {
        node: ravnest_core::NodeId(0),
        step: 0,
        samples: 0..2,
        layers: l,
        input: Some(&input),
        output: &[],
        grad_out: None,
    };
    let out = c.stage_forward(pass.clone(), &base).await.unwrap();
    assert_eq!(out.len(), 2 * GPT.seq * GPT.hidden);
    let per_param = 4 * 3; // parameters, m and v
    let r = c.param_range(l);
    assert_eq!(c.state_stats().held_bytes, (per_param * r.len()) as u64);
    let before = c.export(&base, Some(l)).unwrap();
    let grad_out = vec![0.01; out.len()];
    let backward = StagePass {
        output: &out,
        grad_out: Some(&grad_out),
        ..pass
    };
    let (grad, _) = c.stage_backward(backward, &base, None).await.unwrap();
    let mut next = base.clone();
    c.apply_stage_grad(&mut next, l, grad, 0.5).unwrap();
    assert_eq!(
        c.export(&base, Some(l)).unwrap(),
        before,
        "the old version is untouched"
    );
    assert_ne!(
        c.export(&next, Some(l)).unwrap(),
        before,
        "the new one moved"
    );
    assert_eq!(
        c.state_stats().copied_bytes,
        0,
        "nothing was copied on the CPU"
    );
    // Two versions of the stage, nothing else (the gradient is gone).
    assert_eq!(c.state_stats().held_bytes, (2 * per_param * r.len()) as u64);
    drop(base);
    assert_eq!(c.state_stats().held_bytes, (per_param * r.len()) as u64);
    assert!(
        c.export(&next, Some(LayerRange::new(0, 1))).is_none(),
        "layer 0 is not held"
    );
}

/// A shard travels in parts made one at a time (`export_range`): the parts, in order, are what
/// `export` gives, for tensors still at their seed and for trained ones, whatever the part size;
/// a range past the end is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_in_parts_is_the_shard() {
    let c = backend();
    let fresh = c.initial(None);
    let mut trained = c.initial(None);
    let g = gradient(&c, &trained, 0..4).await;
    let mean: Vec<f32> = g.iter().map(|x| x / 4.0).collect();
    c.apply_update(&mut trained, 0..c.params(), &mean).unwrap();
    c.end_update(&mut trained);
    for model in [&fresh, &trained] {
        for l in [
            None,
            Some(LayerRange::new(0, 2)),
            Some(LayerRange::new(3, 6)),
        ] {
            let whole = c.export(model, l).unwrap();
            for part in [997, 4096, whole.len()] {
                let mut joined = Vec::new();
                let mut at = 0;
                while at < whole.len() {
                    let end = (at + part).min(whole.len());
                    joined.extend(c.export_range(model, l, at..end).unwrap());
                    at = end;
                }
                assert_eq!(joined, whole, "layers {l:?} in parts of {part}");
            }
            assert!(c.export_range(model, l, 0..whole.len() + 1).is_none());
        }
    }
    let stage = c.initial(Some(LayerRange::new(3, 6)));
    assert!(
        c.export_range(&stage, Some(LayerRange::new(0, 2)), 0..1)
            .is_none()
    );
}
