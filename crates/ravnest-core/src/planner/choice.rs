//! Choosing between kinds of layout: each search keeps the best plan of one [`LayoutClass`]
//! ([`Best`]), and [`choose`] takes the one that minimizes the objective (step time plus the
//! priced recovery term) under the file's `redundancy`, keeping the others as the
//! alternatives the plan reports.

use crate::cluster::Redundancy;
use crate::units::secs;

use super::types::{Alternative, LayoutClass, Plan};

/// A kind of layout is searched no further than this many times the least objective found
/// before it among the kinds that can win over it ([`search_classes`]): the winner stays exact
/// (what is pruned is worse than a plan found), and the alternatives a plan reports are each
/// kind's best up to there. Searched to the end, the kinds that lose cost more than the
/// winner: ravnest's plan() of the 1,000 / 10,000-node bench clusters took 56 / 548 ms
/// (gpt2-small, data parallel wins) and 128 / 931 ms (gpt-7b, pipelines), against 35 / 319 and
/// 105 / 709 ms with this cap (0.5 / 5.9 and 73 / 624 ms when data parallel came first).
pub const ALTERNATIVES_WITHIN: f64 = 1.5;

/// The best plan found so far of one class: what a search keeps, and the bound it prunes by.
#[derive(Debug, Clone)]
pub(super) struct Best {
    class: LayoutClass,
    plan: Option<Plan>,
    /// No plan at or above this objective is kept.
    cap: f64,
}

impl Best {
    /// Nothing found yet of `class`.
    pub(super) fn new(class: LayoutClass) -> Self {
        Best {
            class,
            plan: None,
            cap: f64::INFINITY,
        }
    }

    /// The class this search keeps.
    pub(super) fn class(&self) -> LayoutClass {
        self.class
    }

    /// The objective a candidate must beat to be kept (the cap before the first).
    pub(super) fn bound(&self) -> f64 {
        self.plan.as_ref().map_or(self.cap, Plan::objective_s)
    }

    /// Keep `p` when it is of this class and better than the best so far.
    pub(super) fn offer(&mut self, p: Plan) {
        if LayoutClass::of(&p.layout) == self.class && p.objective_s() < self.bound() {
            self.plan = Some(p);
        }
    }

    /// The best plan found, by value.
    pub(super) fn into_plan(self) -> Option<Plan> {
        self.plan
    }
}

/// What [`search_classes`] found of one kind of layout.
#[derive(Debug)]
pub(super) struct Found {
    class: LayoutClass,
    plan: Option<Plan>,
    /// The objective it was searched up to (infinite: to the end).
    cap: f64,
}

impl Found {
    /// Whether a plan of its kind was found.
    pub(super) fn has_plan(&self) -> bool {
        self.plan.is_some()
    }
}

/// The best plan `search` finds of each kind of layout `classes` (in [`LayoutClass::ALL`]
/// order), each searched with its own bound: up to [`ALTERNATIVES_WITHIN`] times the least
/// objective found before it among the kinds of its rank or better ([`rank`]: only those can
/// keep it from being chosen).
pub(super) fn search_classes(
    classes: impl IntoIterator<Item = LayoutClass>,
    redundancy: Redundancy,
    mut search: impl FnMut(&mut Best),
) -> Vec<Found> {
    let mut found: Vec<Found> = Vec::new();
    for class in classes {
        let before = found
            .iter()
            .filter_map(|f| f.plan.as_ref())
            .filter(|p| rank(LayoutClass::of(&p.layout), redundancy) <= rank(class, redundancy))
            .map(Plan::objective_s)
            .fold(f64::INFINITY, f64::min);
        let mut best = Best::new(class);
        best.cap = before * ALTERNATIVES_WITHIN;
        search(&mut best);
        found.push(Found {
            class,
            cap: best.cap,
            plan: best.plan,
        });
    }
    found
}

/// What decides between two plans of the same rank: the objective (under `never` its
/// recovery term is not charged, so it is the step time).
fn score(p: &Plan) -> f64 {
    p.objective_s()
}

/// The rank of a class under `redundancy`: only the plans of the best rank that has one
/// compete. Under `always`, data parallel over two or more workers (every survivor of a loss,
/// or of a cut-off group, holds the whole model: the rule before issue 34), then two or more
/// pipeline replicas (every stage has a second copy), then one copy; otherwise all alike.
fn rank(class: LayoutClass, redundancy: Redundancy) -> u8 {
    match (redundancy, class) {
        (Redundancy::Always, LayoutClass::DataParallel) => 0,
        (Redundancy::Always, LayoutClass::Pipelines) => 1,
        (Redundancy::Always, _) => 2,
        _ => 0,
    }
}

/// The plan to make from the best plan of each class (in [`LayoutClass::ALL`] order, `None`
/// where nothing of that class fits), with the others as its alternatives: the least
/// objective among the plans of the best rank ([`rank`]: under `auto` and `never` every
/// class competes; under `always` the most redundant class that has a plan). Ties go to the
/// earlier class (data parallel, then two copies). `None` when no class has a plan.
pub(super) fn choose(found: Vec<Found>, redundancy: Redundancy) -> Option<Plan> {
    let unfound: Vec<LayoutClass> = found
        .iter()
        .filter(|f| f.plan.is_none() && f.cap.is_finite())
        .map(|f| f.class)
        .collect();
    let bests: Vec<Option<Plan>> = found.into_iter().map(|f| f.plan).collect();
    let class = |p: &Plan| LayoutClass::of(&p.layout);
    let top = bests
        .iter()
        .flatten()
        .map(|p| rank(class(p), redundancy))
        .min()?;
    let mut winner: Option<usize> = None;
    for (i, p) in bests.iter().enumerate() {
        let Some(p) = p else { continue };
        if rank(class(p), redundancy) != top {
            continue;
        }
        if winner.is_none_or(|w| score(p) < score(bests[w].as_ref().expect("chosen"))) {
            winner = Some(i);
        }
    }
    let mut plans = bests;
    let mut chosen = plans[winner?].take().expect("chosen");
    chosen.alternatives = plans
        .into_iter()
        .flatten()
        .map(|p| {
            let why = why_not(&chosen, &p, rank(class(&p), redundancy) == top, redundancy);
            Alternative {
                class: class(&p),
                layout: p.layout,
                step: p.step,
                recovery: p.recovery,
                why,
            }
        })
        .collect();
    chosen.not_within = unfound;
    Some(chosen)
}

/// Why `other` was not chosen over `chosen` (`ranked`: whether it had the chosen one's rank).
fn why_not(chosen: &Plan, other: &Plan, ranked: bool, redundancy: Redundancy) -> String {
    if !ranked {
        return match LayoutClass::of(&other.layout) {
            LayoutClass::Pipelines => "`redundancy = \"always\"` puts data parallel first: every \
                                       survivor of a loss holds the whole model"
                .into(),
            _ => "one copy: `redundancy = \"always\"` keeps two when a plan that fits has them"
                .into(),
        };
    }
    let (a, b) = (score(chosen), score(other));
    let what = match redundancy {
        Redundancy::Never => "slower per step",
        _ => "more per step",
    };
    if b > a {
        format!("{} {what}", secs(b - a))
    } else {
        "as good; the chosen kind comes first on a tie".into()
    }
}
