use super::*;

#[test]
fn a_stage_over_its_memory_budget_is_refused_with_the_figures() {
    let g = crate::gpt::Gpt::gpt2(2, 32, 2, 8, 256);
    let data = Dataset::bytes(&[b'a'; 400], "t", 8).unwrap();
    let optim = Optim {
        kind: ravnest_core::Optimizer::Adamw,
        lr: 1e-3,
        momentum: 0.9,
        weight_decay: 0.0,
        schedule: ravnest_core::recipe::Schedule::CONSTANT,
    };
    let c = CandleCompute::new(Network::Gpt(g), Arc::new(data), optim, 1, 1.0);
    let all = LayerRange::new(0, 4);
    // No budget: counted, never refused.
    c.count(all, 4, 0).unwrap();
    let peak = c.ledger.lock().unwrap().peak;
    assert!(peak > 16 * g.params() as u64, "{peak}");
    c.ledger.lock().unwrap().budget = peak;
    c.count(all, 4, 0).unwrap();
    let e = c.count(all, 4, 1).unwrap_err().to_string();
    assert!(
        e.contains("memory budget exceeded") && e.contains("memory_gib"),
        "{e}"
    );
    // One layer needs less than the whole model.
    c.count(LayerRange::new(1, 2), 4, 0).unwrap();
}
