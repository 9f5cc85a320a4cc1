use super::*;
use proptest::prelude::*;
use ravnest_core::Optimizer;

fn slot(counter: &Arc<StateCounter>, w: &[f32], state: &[Vec<f32>]) -> Slot {
    let dev = Device::Cpu;
    Slot {
        param: Var::from_slice(w, w.len(), &dev).unwrap(),
        state: state
            .iter()
            .map(|s| Tensor::from_slice(s, s.len(), &dev).unwrap())
            .collect(),
        _held: Held::new(counter, 0),
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

proptest! {
    /// The optimizer as candle operations (what runs on a GPU) gives the same bits as the
    /// fused pass (what runs on the CPU), for every optimizer, any values, any scale and
    /// step count: each operation is one correctly rounded IEEE operation in the same
    /// order, so replicas on different devices stay bit-identical (docs/layouts.md,
    /// "Replicas and digests").
    #[test]
    fn the_device_optimizer_gives_the_fused_passs_bits(
        kind in 0usize..3,
        vals in prop::collection::vec(-4.0f32..4.0, 40),
        scale in prop::sample::select(vec![1.0f32, 0.25, 1.0 / 3.0, 1.0 / 48.0]),
        t in 0u32..50,
    ) {
        let kind = [Optimizer::Sgd, Optimizer::SgdMomentum, Optimizer::Adamw][kind];
        let optim = Optim { kind, lr: 0.003, momentum: 0.9, weight_decay: 0.01, schedule: ravnest_core::recipe::Schedule::CONSTANT };
        let n = 10;
        let states = optim.state_names().len();
        let w = &vals[..n];
        let g = &vals[n..2 * n];
        // Second moments are never negative.
        let state: Vec<Vec<f32>> = (0..states)
            .map(|k| vals[2 * n + 10 * k..2 * n + 10 * (k + 1)].iter().map(|x| if k == 1 { x.abs() } else { *x }).collect())
            .collect();
        let counter = Arc::new(StateCounter::default());
        let old = slot(&counter, w, &state);
        let (fw, fs) = fused(&optim, &old, Grad::Host(g), scale, t as f32).unwrap().unwrap();
        let (cw, cs) = composed(&optim, &old, Grad::Host(g), scale, t as f32, &Device::Cpu).unwrap();
        prop_assert_eq!(fw.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), bits(&cw));
        for (a, b) in fs.iter().zip(&cs) {
            prop_assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), bits(b));
        }
        // Written into a retired version's buffers, and in place: the same bits.
        let spare = slot(&counter, &vals[30..30 + n], &vec![vec![7.0; n]; states]);
        prop_assert!(step_into(&optim, &spare, Some(&old), Grad::Host(g), scale, t as f32).unwrap());
        let alone = slot(&counter, w, &state);
        prop_assert!(step_into(&optim, &alone, None, Grad::Host(g), scale, t as f32).unwrap());
        for into in [&spare, &alone] {
            prop_assert_eq!(fw.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), bits(into.param.as_tensor()));
            for (a, b) in fs.iter().zip(&into.state) {
                prop_assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), bits(b));
            }
        }
        // And the fused pass is the flat optimizer's step, bit for bit.
        let mut flat: Vec<f32> = w.to_vec();
        for s in &state {
            flat.extend(s);
        }
        if optim.state_len(n) > states * n {
            flat.push(t as f32);
        }
        let mean: Vec<f32> = g.iter().map(|x| x * scale).collect();
        optim.step_range(&mut flat, n, 0..n, &mean);
        prop_assert_eq!(&flat[..n], &fw[..]);
    }
}

#[test]
fn slots_of_a_stage_carry_the_step_count_and_tile_the_model() {
    let g = crate::gpt::Gpt::gpt2(2, 8, 2, 4, 16);
    let optim = Optim {
        kind: Optimizer::Adamw,
        lr: 1e-3,
        momentum: 0.9,
        weight_decay: 0.0,
        schedule: ravnest_core::recipe::Schedule::CONSTANT,
    };
    let l = Layout::of(&Network::Gpt(g), &optim);
    let len = l.model_len();
    assert_eq!(len, 3 * l.params + 1);
    let mut covered = vec![0u32; len];
    for (a, b) in [(0, 1), (1, 3), (3, 4)] {
        let slots = l.slots(Some(LayerRange::new(a, b))).unwrap();
        assert_eq!(slots.last(), Some(&(len - 1..len)), "layers {a}..{b}");
        for r in slots {
            for c in &mut covered[r] {
                *c += 1;
            }
        }
    }
    // Every value once, the step count with every stage.
    assert!(covered[..len - 1].iter().all(|&c| c == 1));
    assert_eq!(covered[len - 1], 3);
    assert_eq!(l.slots(None), Some(std::iter::once(0..len).collect()));
    assert_eq!(l.slots(Some(LayerRange::new(3, 9))), None);
}
