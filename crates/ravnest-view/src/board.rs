//! The run as a live view sees it: a pure fold of the nodes' [`RunEvent`]s, each stamped with
//! the observer's clock (s since the run started). No I/O, no clock: the dashboard, the
//! metrics, `report.html` and the TensorBoard files all read the same [`Board`].

use std::collections::BTreeMap;

use ravnest_node::events::{Fact, LinkRow, NodeFigures, PlanRow, RunEvent};
use serde::Serialize;

/// What a node is doing, as its events tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Its process started; nothing measured yet.
    Starting,
    /// It measured itself; training has not reached it.
    Measuring,
    /// It applies steps.
    Training,
    /// Alive, and left out by the plan (batch 0: too slow to pay for its share).
    Standby,
    /// Declared lost by the coordinator, or its process ended before its report.
    Down,
    /// It sent its final report.
    Done,
}

/// One node on the board.
#[derive(Debug, Clone, Serialize)]
pub struct NodeView {
    /// Its name.
    pub name: String,
    /// What it computes on.
    pub device: String,
    /// Measured candle matmul, GFLOP/s.
    pub gflops: f64,
    /// Its samples/s on the model, alone.
    pub solo_samples_per_s: f64,
    /// Free memory, GiB.
    pub memory_gib: f64,
    /// Emulated slowdown (1: none).
    pub slowdown: f64,
    /// What it is doing.
    pub state: NodeState,
    /// The model version it holds.
    pub step: u64,
    /// Its last batch's loss.
    pub loss: Option<f64>,
    /// Its own samples/s over the last interval (steps it applied × its batch).
    pub samples_per_s: f64,
    /// Its counters so far.
    pub figures: NodeFigures,
    /// Its timeline: (from s, to s, compute fraction, comm fraction) per progress interval.
    #[serde(skip)]
    pub segments: Vec<(f64, f64, f64, f64)>,
    /// Intervals it was down: (from s, to s; `None`: still down).
    pub down: Vec<(f64, Option<f64>)>,
    #[serde(skip)]
    last: Option<(f64, NodeFigures)>,
}

impl NodeView {
    fn new(name: &str) -> NodeView {
        NodeView {
            name: name.to_string(),
            device: String::new(),
            gflops: 0.0,
            solo_samples_per_s: 0.0,
            memory_gib: 0.0,
            slowdown: 1.0,
            state: NodeState::Starting,
            step: 0,
            loss: None,
            samples_per_s: 0.0,
            figures: NodeFigures::default(),
            segments: Vec::new(),
            down: Vec::new(),
            last: None,
        }
    }

    fn go_down(&mut self, t: f64) {
        // (A node that reported is done: a loss declared as the run shuts down is not one.)
        if !matches!(self.state, NodeState::Down | NodeState::Done) {
            self.state = NodeState::Down;
            self.samples_per_s = 0.0;
            self.down.push((t, None));
        }
    }

    fn come_back(&mut self, t: f64) {
        if let Some(d) = self.down.last_mut().filter(|d| d.1.is_none()) {
            d.1 = Some(t);
        }
    }
}

/// What kind of thing happened, for colour and filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A node lost, a step aborted, a coordinator taking over.
    Fault,
    /// A plan.
    Plan,
    /// A node joined or came back.
    Join,
    /// A checkpoint written.
    Checkpoint,
    /// Anything else.
    Info,
}

/// One event of the cluster's.
#[derive(Debug, Clone, Serialize)]
pub struct EventRow {
    /// When, s since the run started (the observer's clock).
    pub t_s: f64,
    /// The node that said it.
    pub node: String,
    /// In words.
    pub what: String,
    /// Its kind.
    pub kind: EventKind,
}

/// A plan the run trained on.
#[derive(Debug, Clone, Serialize)]
pub struct PlanView {
    /// When, s.
    pub t_s: f64,
    /// Why: "the measured plan", or the event that led to it.
    pub reason: String,
    /// In words (the coordinator's line).
    pub what: String,
    /// Each node's share (the first plan's only: later plans are in words).
    pub rows: Vec<PlanRow>,
    /// The sync and its reason (the first plan's).
    pub sync: String,
}

/// A held-out evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct EvalRow {
    /// The step.
    pub step: u64,
    /// Mean loss.
    pub loss: f64,
    /// Accuracy.
    pub accuracy: f64,
    /// Perplexity (language models).
    pub perplexity: Option<f64>,
}

/// The run as the events tell it.
#[derive(Debug, Clone, Serialize)]
pub struct Board {
    /// The cluster's name.
    pub cluster: String,
    /// Steps the run is to train.
    pub steps: u64,
    /// The node hosting the coordinator (the file's, then whoever took over).
    pub host: String,
    /// Nodes, in the cluster file's order, then joiners as they appear.
    pub nodes: Vec<NodeView>,
    /// Measured links.
    pub links: Vec<LinkRow>,
    /// Plans, the first and each re-plan.
    pub plans: Vec<PlanView>,
    /// The cluster's events, oldest first (the latest [`MAX_EVENTS`]).
    pub events: Vec<EventRow>,
    /// Events left out at the front (beyond [`MAX_EVENTS`]).
    pub events_dropped: u64,
    /// Evaluations.
    pub evals: Vec<EvalRow>,
    /// The cluster's samples/s over time: (s, samples/s), as the node furthest on says
    /// (thinned to half when it passes [`MAX_POINTS`]; a snapshot thins it further).
    #[serde(skip)]
    pub throughput: Vec<(f64, f64)>,
    /// The furthest step any node holds.
    pub step: u64,
    /// When the last event came, s.
    pub now_s: f64,
    /// Whether the run's summary arrived (it is over).
    pub finished: bool,
    /// The loss curve is this process's node's share of each step only (a `--node` process:
    /// the other nodes' losses are in their own processes).
    pub partial_loss: bool,
    /// Each node's dashboard, where every node serves one (`--node --dashboard`): (node, URL),
    /// what the page offers when its stream stops (its process ended; the coordinator may be
    /// elsewhere now).
    pub dashboards: Vec<(String, String)>,
    /// Per step: first global sample → (samples, Σ loss): a step's loss over every node
    /// (a redone step's later figures replace its earlier ones, sample range by range).
    #[serde(skip)]
    pub losses: BTreeMap<u64, BTreeMap<u64, (u64, f64)>>,
    /// Per step, the global gradient norm before clipping.
    #[serde(skip)]
    pub grad_norms: BTreeMap<u64, f64>,
    /// Bumped on every change (the live stream sends a snapshot when it moved).
    #[serde(skip)]
    pub version: u64,
    /// Whether the journal's line of the first plan came (it repeats the host's plan).
    #[serde(skip)]
    first_plan_said: bool,
}

/// Events kept on the board (the whole list is in `events.jsonl`).
pub const MAX_EVENTS: usize = 500;

/// Points a node's timeline or the throughput keeps before it is thinned to half.
pub const MAX_POINTS: usize = 20_000;

impl Board {
    /// An empty board for a cluster with these nodes (its file's order) and steps.
    pub fn new(cluster: &str, nodes: &[String], host: &str, steps: u64) -> Board {
        Board {
            cluster: cluster.to_string(),
            steps,
            host: host.to_string(),
            nodes: nodes.iter().map(|n| NodeView::new(n)).collect(),
            links: Vec::new(),
            plans: Vec::new(),
            events: Vec::new(),
            events_dropped: 0,
            evals: Vec::new(),
            throughput: Vec::new(),
            step: 0,
            now_s: 0.0,
            finished: false,
            partial_loss: false,
            dashboards: Vec::new(),
            losses: BTreeMap::new(),
            grad_norms: BTreeMap::new(),
            version: 0,
            first_plan_said: false,
        }
    }

    /// The node called `name` (a joiner gets a row when it first says something).
    fn node(&mut self, name: &str) -> &mut NodeView {
        let i = match self.nodes.iter().position(|n| n.name == name) {
            Some(i) => i,
            None => {
                self.nodes.push(NodeView::new(name));
                self.nodes.len() - 1
            }
        };
        &mut self.nodes[i]
    }

    /// Fold one event, seen at `t_s`.
    pub fn apply(&mut self, t_s: f64, e: &RunEvent) {
        self.version += 1;
        self.now_s = self.now_s.max(t_s);
        match e {
            RunEvent::Spawned { node, .. } => self.node(node).state = NodeState::Starting,
            RunEvent::Measured {
                node,
                device,
                matmul_gflops,
                samples_per_s,
                memory_gib,
                slowdown,
                ..
            } => {
                let n = self.node(node);
                n.device = device.clone();
                n.gflops = *matmul_gflops;
                n.solo_samples_per_s = *samples_per_s;
                n.memory_gib = *memory_gib;
                n.slowdown = *slowdown;
                if n.state == NodeState::Starting {
                    n.state = NodeState::Measuring;
                }
            }
            RunEvent::Links { node, links, .. } => {
                self.host = node.clone();
                self.links = links.clone();
            }
            RunEvent::Plan {
                node,
                text,
                nodes,
                sync,
            } => {
                self.host = node.clone();
                for r in nodes.iter().filter(|r| r.batch == 0) {
                    let n = self.node(&r.node);
                    if matches!(n.state, NodeState::Starting | NodeState::Measuring) {
                        n.state = NodeState::Standby;
                    }
                }
                self.plans.push(PlanView {
                    t_s,
                    reason: "the plan on measured figures".into(),
                    what: text.clone(),
                    rows: nodes.clone(),
                    sync: sync.clone(),
                });
            }
            RunEvent::Progress {
                node,
                step,
                loss,
                samples_per_s,
                own,
                ..
            } => self.progress(t_s, node, *step, *loss, *samples_per_s, own.as_ref()),
            RunEvent::Loss {
                step,
                first_sample,
                samples,
                loss_sum,
                ..
            } => {
                // A redone step's ranges replace those of its earlier try that they overlap
                // (another plan may split the same samples otherwise).
                let parts = self.losses.entry(*step).or_default();
                let end = first_sample + samples;
                parts.retain(|a, (n, _)| a + *n <= *first_sample || *a >= end);
                parts.insert(*first_sample, (*samples, *loss_sum));
            }
            RunEvent::GradNorm { step, norm, .. } => {
                self.grad_norms.insert(*step, *norm);
            }
            RunEvent::Eval {
                step,
                loss,
                accuracy,
                perplexity,
                ..
            } => self.evals.push(EvalRow {
                step: *step,
                loss: *loss,
                accuracy: *accuracy,
                perplexity: *perplexity,
            }),
            RunEvent::Cluster {
                node, what, fact, ..
            } => self.cluster_event(t_s, node, what, fact.as_ref()),
            RunEvent::Waiting { .. } => {}
            RunEvent::Report(r) => {
                let n = self.node(&r.node);
                n.come_back(t_s);
                n.state = NodeState::Done;
            }
            RunEvent::Summary(r) => {
                self.finished = true;
                if let Some((_, c)) = r.coordinator() {
                    self.step = self.step.max(c.steps);
                }
            }
        }
    }

    /// A node's process ended at `t_s`; without its report, it is down.
    pub fn ended(&mut self, t_s: f64, node: &str) {
        self.version += 1;
        self.now_s = self.now_s.max(t_s);
        self.node(node).go_down(t_s);
    }

    fn progress(
        &mut self,
        t: f64,
        node: &str,
        step: u64,
        loss: Option<f64>,
        cluster_rate: f64,
        own: Option<&NodeFigures>,
    ) {
        self.step = self.step.max(step);
        if step >= self.step && cluster_rate > 0.0 {
            self.throughput.push((t, cluster_rate));
            if self.throughput.len() > MAX_POINTS {
                self.throughput = thin(&self.throughput, MAX_POINTS / 2);
            }
        }
        let n = self.node(node);
        n.step = step;
        n.loss = loss.or(n.loss);
        let Some(own) = own else { return };
        if let Some((t0, before)) = &n.last {
            let dt = t - t0;
            if dt > 0.0 {
                let compute = ((own.compute_s - before.compute_s) / dt).clamp(0.0, 1.0);
                let comm = ((own.comm_s - before.comm_s) / dt).clamp(0.0, 1.0 - compute);
                push_segment(&mut n.segments, (*t0, t, compute, comm));
                let applied = own.steps_applied.saturating_sub(before.steps_applied);
                n.samples_per_s = (applied * own.batch) as f64 / dt;
            }
        }
        if own.steps_applied > n.figures.steps_applied && n.state != NodeState::Done {
            if n.state == NodeState::Down {
                n.come_back(t);
            }
            n.state = NodeState::Training;
        }
        n.figures = own.clone();
        n.last = Some((t, own.clone()));
    }

    fn cluster_event(&mut self, t: f64, node: &str, what: &str, fact: Option<&Fact>) {
        let kind = match fact {
            Some(Fact::Planned { .. }) => EventKind::Plan,
            Some(Fact::Lost { .. } | Fact::Aborted { .. } | Fact::TookOver { .. }) => {
                EventKind::Fault
            }
            Some(Fact::Joined { .. }) => EventKind::Join,
            Some(Fact::Checkpoint { .. }) => EventKind::Checkpoint,
            None => EventKind::Info,
        };
        match fact {
            Some(Fact::Lost { node }) => self.node(node).go_down(t),
            Some(Fact::Joined { node }) => {
                let n = self.node(node);
                n.come_back(t);
                if n.state == NodeState::Down {
                    n.state = NodeState::Measuring;
                }
            }
            // (Its predecessor is lost: that is why it took over.)
            Some(Fact::TookOver { node, from }) => {
                self.host = node.clone();
                self.node(from).go_down(t);
            }
            Some(Fact::Planned { nodes, .. }) => self.planned(t, what, nodes),
            _ => {}
        }
        self.events.push(EventRow {
            t_s: t,
            node: node.to_string(),
            what: what.to_string(),
            kind,
        });
        if self.events.len() > MAX_EVENTS {
            let cut = self.events.len() - MAX_EVENTS;
            self.events.drain(..cut);
            self.events_dropped += cut as u64;
        }
    }

    /// A plan (`what`, in words) that gives `nodes` work: the others are on standby (unless
    /// down or done); a re-plan is recorded with what happened since the previous plan.
    fn planned(&mut self, t: f64, what: &str, nodes: &[String]) {
        for n in &mut self.nodes {
            let out = !nodes.contains(&n.name);
            if out && matches!(n.state, NodeState::Training | NodeState::Measuring) {
                n.state = NodeState::Standby;
            } else if !out && n.state == NodeState::Standby {
                n.state = NodeState::Measuring;
            }
        }
        // (A checkpoint is not a reason.)
        let reason = self
            .events
            .iter()
            .rev()
            .take_while(|e| e.kind != EventKind::Plan)
            .find(|e| e.kind != EventKind::Checkpoint)
            .map_or_else(|| "a re-plan".to_string(), |e| e.what.clone());
        // The first plan is said twice (the host's plan, then the journal's): kept once.
        let said_twice = self.plans.len() == 1 && !self.first_plan_said;
        self.first_plan_said = true;
        if !said_twice {
            self.plans.push(PlanView {
                t_s: t,
                reason,
                what: what.to_string(),
                rows: Vec::new(),
                sync: String::new(),
            });
        }
    }

    /// Each step's loss over every node that trained it: (step, mean loss, samples).
    pub fn step_losses(&self) -> Vec<(u64, f64, u64)> {
        self.step_losses_in(0..u64::MAX)
    }

    /// The same for the steps in `steps`.
    pub fn step_losses_in(&self, steps: std::ops::Range<u64>) -> Vec<(u64, f64, u64)> {
        if steps.is_empty() {
            return Vec::new();
        }
        self.losses
            .range(steps)
            .map(|(s, parts)| {
                let (n, sum) = parts
                    .values()
                    .fold((0, 0.0), |(n, sum), (k, l)| (n + k, sum + l));
                (*s, sum / n.max(1) as f64, n)
            })
            .collect()
    }

    /// Re-plans after the first plan.
    pub fn replans(&self) -> usize {
        self.plans.len().saturating_sub(1)
    }

    /// Each node's timeline in `buckets` equal slices of `[0, now]`: per slice, the fractions
    /// (compute, comm, idle, down), what the live page and the report draw.
    pub fn timeline(&self, buckets: usize) -> Vec<Vec<[f32; 4]>> {
        let end = self.now_s.max(1e-9);
        let w = end / buckets as f64;
        self.nodes
            .iter()
            .map(|n| {
                let mut out = vec![[0f32; 4]; buckets];
                let mut add = |a: f64, b: f64, f: [f64; 4]| {
                    let (i0, i1) = ((a / w) as usize, ((b / w).ceil() as usize).min(buckets));
                    for (i, slot) in out.iter_mut().enumerate().take(i1).skip(i0) {
                        let lo = a.max(i as f64 * w);
                        let hi = b.min((i + 1) as f64 * w);
                        if hi > lo {
                            let share = (hi - lo) / w;
                            for k in 0..4 {
                                slot[k] += (f[k] * share) as f32;
                            }
                        }
                    }
                };
                for &(a, b, c, m) in &n.segments {
                    add(a, b, [c, m, (1.0 - c - m).max(0.0), 0.0]);
                }
                for &(a, b) in &n.down {
                    add(a, b.unwrap_or(end), [0.0, 0.0, 0.0, 1.0]);
                }
                for slot in &mut out {
                    // Down wins over what the last interval before it said.
                    if slot[3] > 0.0 {
                        let rest = (1.0 - slot[3]).max(0.0);
                        let s = slot[0] + slot[1] + slot[2];
                        if s > rest {
                            for x in slot.iter_mut().take(3) {
                                *x *= rest / s;
                            }
                        }
                    }
                }
                out
            })
            .collect()
    }

    /// The board as JSON for a page: series thinned to at most `points` each.
    pub fn snapshot(&self, points: usize) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        let losses: Vec<(u64, f64)> = self.step_losses().iter().map(|l| (l.0, l.1)).collect();
        v["loss"] = serde_json::json!(thin(&losses, points));
        v["throughput"] = serde_json::json!(thin(&self.throughput, points));
        let norms: Vec<(u64, f64)> = self.grad_norms.iter().map(|(s, n)| (*s, *n)).collect();
        v["grad_norm"] = serde_json::json!(thin(&norms, points));
        v["timeline"] = serde_json::json!(self.timeline(120));
        v["replans"] = serde_json::json!(self.replans());
        v
    }
}

/// Add a timeline interval; intervals under a quarter second are merged into the one before
/// (a host sees every node's every step), so a timeline keeps about four a second at most.
fn push_segment(segs: &mut Vec<(f64, f64, f64, f64)>, s: (f64, f64, f64, f64)) {
    if let Some(last) = segs.last_mut()
        && last.1 == s.0
        && last.1 - last.0 < 0.25
    {
        let (a, b) = (last.1 - last.0, s.1 - s.0);
        let w = a + b;
        if w > 0.0 {
            last.2 = (last.2 * a + s.2 * b) / w;
            last.3 = (last.3 * a + s.3 * b) / w;
        }
        last.1 = s.1;
        return;
    }
    segs.push(s);
}

/// At most `n` of `xs`, evenly spaced, the last always kept.
pub fn thin<T: Clone>(xs: &[T], n: usize) -> Vec<T> {
    if xs.len() <= n || n < 2 {
        return xs.to_vec();
    }
    let step = (xs.len() - 1) as f64 / (n - 1) as f64;
    (0..n)
        .map(|i| xs[((i as f64 * step).round() as usize).min(xs.len() - 1)].clone())
        .collect()
}

#[cfg(test)]
mod tests;
