//! The seed sweep: many simulated runs of the fault scenarios, each seed with connection resets
//! of its own on top of the scenario's faults, every run checked by the simulator's checkers.
//! Which scenario, which resets and when are a pure function of the seed, so a failing seed
//! replays (`ravnest bench sim --seeds 1 --first SEED`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ravnest_core::config::Fault;
use ravnest_core::{NodeId, Scenario};

use crate::rng::Rng;
use crate::{SimOptions, run};

/// One scenario of the sweep: its text's name, the parsed file, and the steps to run.
#[derive(Debug, Clone)]
pub struct SweepCase {
    /// Scenario name.
    pub name: String,
    /// The scenario.
    pub scenario: Scenario,
    /// Steps per run.
    pub steps: u64,
    /// Virtual seconds an undisturbed run takes (resets are placed within it).
    pub span_s: f64,
}

impl SweepCase {
    /// A case, with its span measured by one run of seed 0.
    pub fn new(name: &str, scenario: Scenario, steps: u64) -> Result<SweepCase, String> {
        let mut o = SimOptions::for_scenario(&scenario);
        o.seed = 0;
        o.steps = steps;
        let r = run(&scenario, &o).map_err(|e| format!("{name}: {e}"))?;
        Ok(SweepCase {
            name: name.into(),
            scenario,
            steps,
            span_s: r.sim_time_s.max(1e-3),
        })
    }
}

/// What seed `seed` runs: the case (by index) and the resets added to its faults.
pub fn seed_plan(seed: u64, cases: &[SweepCase]) -> (usize, Vec<Fault>) {
    let mut r = Rng::derive(seed, &[0x5eed_5eed]);
    let case = (r.next_u64() % cases.len() as u64) as usize;
    let c = &cases[case];
    let n = c.scenario.cluster.nodes.len() as u64;
    let mut resets = Vec::new();
    if n >= 2 {
        for _ in 0..1 + r.next_u64() % 3 {
            let a = r.next_u64() % n;
            let b = (a + 1 + r.next_u64() % (n - 1)) % n;
            resets.push(Fault::Reset {
                a: NodeId(a as u32),
                b: NodeId(b as u32),
                at_s: c.span_s * (0.05 + 0.85 * r.unit()),
            });
        }
    }
    (case, resets)
}

/// A failed seed.
#[derive(Debug, Clone)]
pub struct SweepFailure {
    /// Seed.
    pub seed: u64,
    /// Scenario.
    pub scenario: String,
    /// What went wrong.
    pub what: String,
}

/// Outcome of a sweep.
#[derive(Debug, Clone, Default)]
pub struct SweepReport {
    /// Seeds run.
    pub seeds: u64,
    /// Runs per case name.
    pub per_case: Vec<(String, u64)>,
    /// Resets injected in all.
    pub resets: u64,
    /// Failed seeds (checker violations, or fewer steps than asked), by seed.
    pub failures: Vec<SweepFailure>,
}

/// Run seeds `first..first + count` over `cases` on `threads` threads.
pub fn sweep(cases: &[SweepCase], first: u64, count: u64, threads: usize) -> SweepReport {
    let next = AtomicU64::new(first);
    let out = Mutex::new((vec![0u64; cases.len()], 0u64, Vec::new()));
    std::thread::scope(|sc| {
        for _ in 0..threads.max(1) {
            sc.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= first + count {
                        break;
                    }
                    let (i, resets) = seed_plan(seed, cases);
                    let c = &cases[i];
                    let mut s = c.scenario.clone();
                    let added = resets.len() as u64;
                    let injected: Vec<String> = resets
                        .iter()
                        .map(|f| match f {
                            Fault::Reset { a, b, at_s } => format!(
                                "reset {}-{} at {at_s:.3} s",
                                s.cluster.node(*a).name,
                                s.cluster.node(*b).name
                            ),
                            other => format!("{other:?}"),
                        })
                        .collect();
                    s.faults.extend(resets);
                    let mut o = SimOptions::for_scenario(&s);
                    o.seed = seed;
                    o.steps = c.steps;
                    let failure = match run(&s, &o) {
                        Err(e) => Some(e.to_string()),
                        Ok(r) if !r.violations.is_empty() => Some(r.violations.join("; ")),
                        Ok(r) if r.steps_completed != c.steps => Some(format!(
                            "{} of {} steps completed",
                            r.steps_completed, c.steps
                        )),
                        Ok(_) => None,
                    };
                    let mut o = out.lock().unwrap();
                    o.0[i] += 1;
                    o.1 += added;
                    if let Some(what) = failure {
                        o.2.push(SweepFailure {
                            seed,
                            scenario: c.name.clone(),
                            what: format!("{what} (with {})", injected.join(", ")),
                        });
                    }
                }
            });
        }
    });
    let (runs, resets, mut failures) = out.into_inner().unwrap();
    failures.sort_by_key(|f: &SweepFailure| f.seed);
    SweepReport {
        seeds: count,
        per_case: cases.iter().map(|c| c.name.clone()).zip(runs).collect(),
        resets,
        failures,
    }
}
