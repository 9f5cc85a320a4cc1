//! What each node did, as it recorded it: a node does not share its counters, it records
//! what happens ([`Count`]: a step's compute, its communication, the version it made, a
//! dropped step, a gradient norm), and the book ([`Counters`]) folds the records into each
//! node's [`NodeCounters`] for whoever reports (the process's console and report, the
//! simulator's checkers, tests). The fold is [`NodeCounters::record`], a plain function.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use ravnest_core::{LayerRange, NodeId};
use ravnest_protocol::node::core::Made;
use ravnest_protocol::node::values::Values;

/// Steps of history kept per node (a few MB at most).
const HISTORY_MAX: usize = 1 << 18;
/// Gradient norms kept per node until a reporter takes them.
const NORMS_MAX: usize = 1 << 16;

/// One thing a node records.
#[derive(Debug, Clone, PartialEq)]
pub enum Count {
    /// The batch of its current assignment.
    Batch(u64),
    /// A step was dropped (its epoch ended, or its collective could not run).
    Aborted,
    /// `ns` of compute, over `span` (adjacent compute spans merge: a pipeline stage computes
    /// many short micro-batches).
    Compute {
        /// Nanoseconds.
        ns: u64,
        /// When.
        span: Span,
    },
    /// A step's communication after its compute (`comm_ns`, over `span`), and its all-reduce
    /// from the first bucket handed over to the last one applied (`allreduce_ns`).
    Comm {
        /// Nanoseconds not hidden.
        comm_ns: u64,
        /// Nanoseconds of the all-reduce.
        allreduce_ns: u64,
        /// When.
        span: Span,
    },
    /// A step made `version`.
    Made(Box<MadeCount>),
    /// Under clipping, a step's global gradient norm before clipping.
    GradNorm {
        /// The step.
        step: u64,
        /// The norm.
        norm: f64,
    },
}

/// What a node records of a version it made.
#[derive(Debug, Clone, PartialEq)]
pub struct MadeCount {
    /// The version.
    pub version: u64,
    /// The layers it holds of it (`None`: the whole model).
    pub layers: Option<LayerRange>,
    /// What it holds of it, when the nodes are observed.
    pub observed: Option<Observed>,
    /// The whole model, at the run's last version.
    pub final_model: Option<Vec<f32>>,
    /// Nanoseconds since the node started.
    pub at_ns: u64,
    /// The backend's phases so far.
    pub phases: crate::seams::PhaseNs,
}

impl MadeCount {
    /// What a node records of version `made.step + 1` it made on `values` (`observe`: with what
    /// it holds of it; `last`: the run's last version, whose whole model is kept), `at_ns`
    /// since it started, with the backend's `phases` so far.
    pub fn of<V: Values>(
        values: &V,
        made: &Made<V::Model>,
        (observe, last): (bool, bool),
        at_ns: u64,
        phases: crate::seams::PhaseNs,
    ) -> Self {
        let (version, layers) = (made.step + 1, made.layers);
        let observed = observe.then(|| {
            let slots = match layers {
                Some(l) => values.layer_slots(l),
                None => std::iter::once(0..values.model_len()).collect(),
            };
            let values = values.export(&made.model, layers).unwrap_or_default();
            Observed {
                version,
                slots,
                values,
            }
        });
        let final_model = (last && layers.is_none())
            .then(|| values.export(&made.model, None))
            .flatten();
        MadeCount {
            version,
            layers,
            observed,
            final_model,
            at_ns,
            phases,
        }
    }
}

/// The book of every node's counters: nodes record into it, reporters read it.
#[derive(Debug, Clone, Default)]
pub struct Counters(Arc<Mutex<BTreeMap<NodeId, NodeCounters>>>);

impl Counters {
    fn book(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, NodeCounters>> {
        // A reporter that panicked mid-read leaves the counters as they were.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Node `node` recorded `count`.
    pub fn record(&self, node: NodeId, count: Count) {
        self.book().entry(node).or_default().record(count);
    }

    /// Every node's counters, as they stand.
    pub fn snapshot(&self) -> BTreeMap<NodeId, NodeCounters> {
        self.book().clone()
    }

    /// `f` of node `node`'s counters, if it recorded anything.
    pub fn read<R>(&self, node: NodeId, f: impl FnOnce(&NodeCounters) -> R) -> Option<R> {
        self.book().get(&node).map(f)
    }

    /// The gradient norms recorded since the last call, every node's (whoever reports takes
    /// them).
    pub fn take_grad_norms(&self) -> Vec<(u64, f64)> {
        self.book()
            .values_mut()
            .flat_map(|c| std::mem::take(&mut c.grad_norms))
            .collect()
    }
}

/// What a node was doing during a [`Span`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// Computing a step.
    Compute,
    /// Waiting for a step's collectives after its compute (communication not hidden).
    Comm,
}

/// An interval of activity, ns since the start of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Start.
    pub start_ns: u64,
    /// End.
    pub end_ns: u64,
    /// Activity.
    pub kind: SpanKind,
}

/// A node's counters: the fold of what it recorded ([`NodeCounters::record`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeCounters {
    /// Ns spent computing.
    pub compute_ns: u64,
    /// Ns between the end of a step's compute and the end of its collectives: communication
    /// that backward did not hide.
    pub comm_ns: u64,
    /// Ns from a data-parallel step's first gradient bucket handed to the all-reduce to its
    /// last reduced bucket applied, summed over steps (what of it `comm_ns` does not count
    /// ran hidden behind the backward pass).
    pub allreduce_ns: u64,
    /// Steps this node applied.
    pub steps: u64,
    /// Samples per step of its current assignment.
    pub batch: u64,
    /// Steps abandoned under it (a halt).
    pub aborted: u64,
    /// The latest model version this node made.
    pub version: u64,
    /// The layers it holds of that version (`None`: the whole model).
    pub layers: Option<ravnest_core::LayerRange>,
    /// What the node holds of that version, exported after each step when the nodes were
    /// launched to be observed ([`crate::Nodes::observe`]: tests and the simulator's
    /// checkers); `None` otherwise (a real run never copies its model to report it).
    pub observed: Option<Observed>,
    /// The whole model at the run's last version, exported once there by a node that holds
    /// it whole (what a report evaluates when no final checkpoint could be read).
    pub final_model: Option<Vec<f32>>,
    /// Under clipping (`[run] max_grad_norm`), each step's global gradient norm before
    /// clipping, as this node computed it: (step, norm). Whoever reports takes them.
    pub grad_norms: Vec<(u64, f64)>,
    /// Activity intervals, in order (for timelines).
    pub spans: Vec<Span>,
    /// A mark after each step, so a report can leave out the first steps (warm-up) of a run,
    /// and a profile can tell each step's figures (differences of consecutive marks) at its
    /// batch.
    pub history: Vec<StepMark>,
}

/// Where a node's counters stood after one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepMark {
    /// The model version the step made.
    pub version: u64,
    /// [`NodeCounters::compute_ns`] so far.
    pub compute_ns: u64,
    /// [`NodeCounters::comm_ns`] so far.
    pub comm_ns: u64,
    /// Nanoseconds since the node started.
    pub at_ns: u64,
    /// The step's batch on this node.
    pub batch: u64,
    /// [`NodeCounters::allreduce_ns`] so far.
    pub allreduce_ns: u64,
    /// The backend's phases so far ([`crate::Compute::phase_ns`]).
    pub phases: crate::seams::PhaseNs,
}

impl NodeCounters {
    /// (busy, comm) fractions of the wall time between making version `from` and the last
    /// step, or `None` when that span is not in the history.
    pub fn steady_fractions(&self, from: u64) -> Option<(f64, f64)> {
        let start = self.history.iter().find(|h| h.version == from)?;
        let end = self.history.last()?;
        let wall = end.at_ns.checked_sub(start.at_ns).filter(|w| *w > 0)? as f64;
        Some((
            (end.compute_ns - start.compute_ns) as f64 / wall,
            (end.comm_ns - start.comm_ns) as f64 / wall,
        ))
    }
}

/// A node's model as an observer sees it: version `version`'s values at `slots` of the flat
/// model (parameters, then optimizer state), in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// The version.
    pub version: u64,
    /// Where the values sit in the flat model.
    pub slots: Vec<Range<usize>>,
    /// The values.
    pub values: Vec<f32>,
}

impl Observed {
    /// The values of flat-model range `r`, if the node holds all of it.
    pub fn range(&self, r: Range<usize>) -> Option<&[f32]> {
        let mut at = 0;
        for s in &self.slots {
            if s.start <= r.start && r.end <= s.end {
                let off = at + r.start - s.start;
                return self.values.get(off..off + r.len());
            }
            at += s.len();
        }
        None
    }
}

impl NodeCounters {
    /// Fold one record in.
    pub fn record(&mut self, count: Count) {
        match count {
            Count::Batch(b) => self.batch = b,
            Count::Aborted => self.aborted += 1,
            Count::Compute { ns, span } => {
                self.compute_ns += ns;
                match self.spans.last_mut() {
                    Some(last) if last.kind == span.kind && last.end_ns == span.start_ns => {
                        last.end_ns = span.end_ns;
                    }
                    _ => self.spans.push(span),
                }
            }
            Count::Comm {
                comm_ns,
                allreduce_ns,
                span,
            } => {
                self.comm_ns += comm_ns;
                self.allreduce_ns += allreduce_ns;
                self.spans.push(span);
            }
            Count::Made(m) => {
                self.version = m.version;
                self.layers = m.layers;
                if m.observed.is_some() {
                    self.observed = m.observed;
                }
                if m.final_model.is_some() {
                    self.final_model = m.final_model;
                }
                self.steps += 1;
                if self.history.len() < HISTORY_MAX {
                    self.history.push(StepMark {
                        version: m.version,
                        compute_ns: self.compute_ns,
                        comm_ns: self.comm_ns,
                        at_ns: m.at_ns,
                        batch: self.batch,
                        allreduce_ns: self.allreduce_ns,
                        phases: m.phases,
                    });
                }
            }
            Count::GradNorm { step, norm } => {
                if self.grad_norms.len() < NORMS_MAX {
                    self.grad_norms.push((step, norm));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start_ns: u64, end_ns: u64, kind: SpanKind) -> Span {
        Span {
            start_ns,
            end_ns,
            kind,
        }
    }

    fn made(version: u64, at_ns: u64) -> Count {
        Count::Made(Box::new(MadeCount {
            version,
            layers: None,
            observed: None,
            final_model: None,
            at_ns,
            phases: Default::default(),
        }))
    }

    #[test]
    fn records_fold_into_totals_spans_and_a_mark_per_step() {
        let mut c = NodeCounters::default();
        c.record(Count::Batch(8));
        c.record(Count::Compute {
            ns: 5,
            span: span(0, 5, SpanKind::Compute),
        });
        // Adjacent compute merges; a gap does not.
        c.record(Count::Compute {
            ns: 5,
            span: span(5, 10, SpanKind::Compute),
        });
        c.record(Count::Comm {
            comm_ns: 2,
            allreduce_ns: 7,
            span: span(10, 12, SpanKind::Comm),
        });
        c.record(made(1, 12));
        c.record(Count::Compute {
            ns: 3,
            span: span(20, 23, SpanKind::Compute),
        });
        c.record(made(2, 23));
        c.record(Count::Aborted);
        assert_eq!(
            c.spans,
            [
                span(0, 10, SpanKind::Compute),
                span(10, 12, SpanKind::Comm),
                span(20, 23, SpanKind::Compute)
            ]
        );
        assert_eq!((c.compute_ns, c.comm_ns, c.allreduce_ns), (13, 2, 7));
        assert_eq!((c.steps, c.version, c.aborted, c.batch), (2, 2, 1, 8));
        let marks: Vec<(u64, u64, u64)> = c
            .history
            .iter()
            .map(|h| (h.version, h.compute_ns, h.at_ns))
            .collect();
        assert_eq!(marks, [(1, 10, 12), (2, 13, 23)]);
        assert_eq!(c.steady_fractions(1), Some((3.0 / 11.0, 0.0)));
    }

    #[test]
    fn the_book_keeps_each_nodes_counters_and_hands_the_norms_over_once() {
        let book = Counters::default();
        book.record(NodeId(0), Count::GradNorm { step: 0, norm: 1.5 });
        book.record(NodeId(1), Count::GradNorm { step: 0, norm: 1.5 });
        book.record(NodeId(1), made(1, 4));
        assert_eq!(book.read(NodeId(1), |c| c.steps), Some(1));
        assert_eq!(book.read(NodeId(2), |c| c.steps), None);
        assert_eq!(book.take_grad_norms().len(), 2);
        assert!(book.take_grad_norms().is_empty());
        assert_eq!(book.snapshot().len(), 2);
    }
}
