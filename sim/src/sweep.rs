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
    /// Where each seed moves the crash of the coordinator's host (fail-over cases).
    pub host_crash: HostCrash,
    /// The checkpoint rounds of seed 0's run: (opened, completed), virtual seconds.
    pub rounds: Vec<(f64, f64)>,
}

/// When a fail-over case crashes the coordinator's host, per seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCrash {
    /// The scenario's faults as written.
    AsWritten,
    /// In steady state: anywhere in the run (a restart of it follows, as written, after it).
    Steady,
    /// During a re-plan: the scenario's other crash moves anywhere, and the host crashes when
    /// that loss is about to be detected or is being re-planned.
    Replan,
    /// During a checkpoint: inside a checkpoint round of seed 0's run.
    Checkpoint,
    /// Not crashed but cut off: the scenario's partition that isolates the host moves anywhere
    /// in the run (for as long as written); the others take over, and the stale coordinator
    /// must step down once it heals.
    Isolated,
}

/// The index of the scenario's partition that cuts the coordinator's host off from others.
fn isolating(s: &Scenario) -> Option<usize> {
    let host = s.run.coordinator.unwrap_or(NodeId(0));
    s.faults.iter().position(|f| match f {
        Fault::Partition { groups, .. } => {
            let all: usize = groups.iter().map(Vec::len).sum();
            groups
                .iter()
                .any(|g| g.contains(&host) && g.len() * 2 < all)
        }
        _ => false,
    })
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
            host_crash: HostCrash::AsWritten,
            rounds: r.checkpoint_rounds_s,
        })
    }

    /// A fail-over case: each seed moves the crash of the coordinator's host as `how` says.
    /// Its span and checkpoint rounds are measured again without that crash, so that the
    /// seeds' crashes fall inside an undisturbed run.
    pub fn host_crash(mut self, how: HostCrash) -> SweepCase {
        self.host_crash = how;
        if how == HostCrash::AsWritten {
            return self;
        }
        let host = self.scenario.run.coordinator.unwrap_or(NodeId(0));
        let mut calm = self.scenario.clone();
        if let Some(i) = isolating(&calm).filter(|_| how == HostCrash::Isolated) {
            calm.faults.remove(i);
        }
        calm.faults.retain(|f| {
            !matches!(f, Fault::Crash { node, .. } | Fault::Restart { node, .. } if *node == host)
        });
        let mut o = SimOptions::for_scenario(&calm);
        o.seed = 0;
        o.steps = self.steps;
        if let Ok(r) = run(&calm, &o) {
            self.span_s = r.sim_time_s.max(1e-3);
            self.rounds = r.checkpoint_rounds_s;
        }
        self
    }
}

/// Move the crash of the coordinator's host (and the faults around it) as the case says, from
/// the seed: a pure function of both.
pub fn retime_host_crash(seed: u64, c: &SweepCase, s: &mut Scenario) {
    let host = s.run.coordinator.unwrap_or(NodeId(0));
    if c.host_crash == HostCrash::Isolated {
        let mut r = Rng::derive(seed, &[0x15_01]);
        let at = c.span_s * (0.1 + 0.6 * r.unit());
        if let Some(Fault::Partition { from_s, to_s, .. }) =
            isolating(s).and_then(|i| s.faults.get_mut(i))
        {
            let lasts = *to_s - *from_s;
            (*from_s, *to_s) = (at, at + lasts);
        }
        return;
    }
    let Some(hi) = s
        .faults
        .iter()
        .position(|f| matches!(f, Fault::Crash { node, .. } if *node == host))
    else {
        return;
    };
    let mut r = Rng::derive(seed, &[0xc0_c0]);
    let at = match c.host_crash {
        HostCrash::AsWritten | HostCrash::Isolated => return,
        HostCrash::Steady => c.span_s * (0.1 + 0.6 * r.unit()),
        // The other crash moves; the simulator crashes the host when that loss is detected
        // (`host_crash_on_loss`).
        HostCrash::Replan => {
            let other = c.span_s * (0.1 + 0.5 * r.unit());
            for f in &mut s.faults {
                if let Fault::Crash { node, at_s } = f
                    && *node != host
                {
                    *at_s = other;
                }
            }
            s.faults
                .retain(|f| !matches!(f, Fault::Crash { node, .. } if *node == host));
            return;
        }
        // Crashed by the simulator inside a checkpoint round instead (`host_crash_in_round`).
        HostCrash::Checkpoint => {
            s.faults.retain(|f| !matches!(f, Fault::Crash { node, .. } | Fault::Restart { node, .. } if *node == host));
            return;
        }
    };
    let was = match &mut s.faults[hi] {
        Fault::Crash { at_s, .. } => std::mem::replace(at_s, at),
        _ => return,
    };
    for f in &mut s.faults {
        if let Fault::Restart { node, at_s } = f
            && *node == host
        {
            *at_s = at + (*at_s - was).max(1.0);
        }
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

/// For a case that crashes the coordinator's host during a checkpoint: which round (a
/// checkpoint version before the last) and how long after it opened (within the time its shards
/// take on the slowest link), from the seed.
pub fn host_crash_in_round(
    seed: u64,
    c: &SweepCase,
    o: &SimOptions,
) -> Option<(u64, std::time::Duration)> {
    if c.host_crash != HostCrash::Checkpoint || o.checkpoint_every == 0 {
        return None;
    }
    let mut r = Rng::derive(seed, &[0xc4_ec]);
    let rounds = (c.steps.saturating_sub(1) / o.checkpoint_every).max(1);
    let version = o.checkpoint_every * (1 + r.next_u64() % rounds);
    // The shortest round of seed 0's run bounds the delay.
    let shortest = c
        .rounds
        .iter()
        .map(|(open, close)| close - open)
        .filter(|d| *d > 0.0)
        .fold(f64::INFINITY, f64::min);
    let window = if shortest.is_finite() { shortest } else { 0.01 };
    Some((
        version,
        std::time::Duration::from_secs_f64(window * 0.9 * r.unit()),
    ))
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
    /// Crashes of the coordinator's host taken over, by what the coordinator was doing
    /// (`steady`, `re-plan`, `checkpoint`).
    pub take_overs: std::collections::BTreeMap<String, u64>,
}

/// Run seeds `first..first + count` over `cases` on `threads` threads.
pub fn sweep(cases: &[SweepCase], first: u64, count: u64, threads: usize) -> SweepReport {
    let next = AtomicU64::new(first);
    let out = Mutex::new((
        vec![0u64; cases.len()],
        0u64,
        Vec::new(),
        std::collections::BTreeMap::new(),
    ));
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
                    retime_host_crash(seed, c, &mut s);
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
                    o.host_crash_in_round = host_crash_in_round(seed, c, &o);
                    o.host_crash_on_loss = (c.host_crash == HostCrash::Replan).then(|| {
                        // Within the halt and re-plan that follow the loss (the nodes answer
                        // the halt within a round trip: about a millisecond here).
                        let mut r = Rng::derive(seed, &[0x10_55]);
                        std::time::Duration::from_secs_f64(0.001 * r.unit())
                    });
                    let result = run(&s, &o);
                    let phases: Vec<String> = result
                        .iter()
                        .flat_map(|r| &r.faults)
                        .filter_map(|f| f.taken_over.as_ref().map(|t| t.during.clone()))
                        .collect();
                    let failure = match result {
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
                    for p in phases {
                        *o.3.entry(p).or_insert(0) += 1;
                    }
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
    let (runs, resets, mut failures, take_overs) = out.into_inner().unwrap();
    failures.sort_by_key(|f: &SweepFailure| f.seed);
    SweepReport {
        seeds: count,
        per_case: cases.iter().map(|c| c.name.clone()).zip(runs).collect(),
        resets,
        failures,
        take_overs,
    }
}
