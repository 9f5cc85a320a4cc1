//! A deterministic cluster in one thread, for tests: the real [`Coordinator`] and a real
//! [`NodeCore`] per node, the network a set of queues whose next delivery the test chooses,
//! time a counter, and compute a counter model (raft-rs's `harness/` shape). No tokio, no
//! clock: a run of thousands of steps takes milliseconds, and the same choices give the same
//! run.
//!
//! The counter model: a version's model is the number of steps applied to reach it. A step
//! from version `s` makes `s`'s model plus one, so a version whose model differs from its
//! number had a step applied twice, or skipped, on the way (a roll-back or a fetch that went
//! wrong). A step completes once every member of its sync group has entered it, as a
//! collective does; a lost member blocks it. A checkpoint restore gives the checkpoint's
//! version, a fetch the peer's model.
//!
//! Checked on every action ([`Cluster::act`] returns the first breach): no node runs a step
//! of an epoch at or past the first step of the epoch queued behind it, none starts a queued
//! epoch after passing its first step, and every step starts from a model equal to its
//! version.
//!
//! Fail-over ([`Cluster::hosted`]): the coordinator lives in a node's process, and dies with
//! it. Every node runs the real [`Watch`] as its process does (before its decisions see an
//! envelope; ticked with the time), the hosts send leases, a successor canvasses its pre-vote
//! among the nodes and takes over with [`Coordinator::take_over`], and nodes send to the host
//! they follow. A stale host that comes back steps down when it hears of the newer term (its
//! process exits, as the simulator's and a real one's do).

use std::collections::{BTreeMap, VecDeque};

use ravnest_core::NodeId;

use crate::coordinator::core::{Config, Coordinator, Effect, Input};
use crate::coordinator::succession::{Verdict, Watch};
use crate::msg::{Addr, Envelope};
use crate::node::core::{self, NodeCore};

/// How long the nodes' watches wait without a word from the coordinator (ms; the simulator
/// waits three heartbeat timeouts).
pub const SILENCE_MS: u64 = 3000;

/// The counter model: steps applied.
pub type Model = u64;

/// A node: its decisions, its queues, and the step it is in.
#[derive(Debug)]
pub struct Node {
    /// Cut off: what it sends and what is sent to it is lost, and it does nothing.
    pub alive: bool,
    /// Its decisions.
    pub core: NodeCore<Model>,
    /// The step it is in (entered its collective): (epoch, step).
    pub entered: Option<(u64, u64)>,
    /// Envelopes to it, in order, with their sender.
    pub inbox: VecDeque<(Addr, Envelope)>,
    /// Envelopes from it to the coordinator, in order.
    pub outbox: VecDeque<Envelope>,
    /// Every step it started: (epoch, step).
    pub ran: Vec<(u64, u64)>,
    /// Every checkpoint shard it wrote: version.
    pub shards: Vec<u64>,
    /// Its watch over the coordinator (fail-over only).
    pub watch: Option<Watch>,
    /// The host whose coordinator it sends to.
    pub follows: NodeId,
}

/// A coordinator and the node whose process runs it.
#[derive(Debug)]
pub struct Hosted {
    /// Its decisions.
    pub core: Coordinator,
    /// The node it lives with (`None`: it never dies).
    pub host: Option<NodeId>,
    /// Its term.
    pub term: u32,
}

/// What happens to one node during a run.
#[derive(Debug, Clone, Copy)]
pub struct Cut {
    /// After this many actions the node is cut off (as if dead: what it sends and what is sent
    /// to it is lost).
    pub at: usize,
    /// The node.
    pub who: usize,
    /// After this many more actions it is back, with whatever state it had.
    pub back_after: Option<usize>,
}

/// The coordinators, the nodes, the time, and everything the coordinators did.
#[derive(Debug)]
pub struct Cluster {
    /// Every coordinator started, by term (the last is the newest); one without fail-over.
    pub coordinators: Vec<Hosted>,
    /// What a successor is configured with.
    cfg: Config,
    /// The nodes, by id.
    pub nodes: Vec<Node>,
    /// Milliseconds since the start.
    pub now: u64,
    /// The coordinators' effects, in order, but for those of a coordinator a newer term
    /// superseded (a host cut off and back before it hears of its successor).
    pub log: Vec<Effect>,
    /// What superseded coordinators did: their envelopes still reach the nodes (which must
    /// ignore them), but their steps agreed are not the run's.
    pub stale: Vec<Effect>,
    /// Each take-over: where the log stood, and the steps the successor's replica said were
    /// agreed (steps its predecessor agreed later are made again).
    pub take_overs: Vec<(usize, u64)>,
    /// Each step's last completion: its epoch, the global batch, and the samples (offset,
    /// batch) of each node that owns samples in it (a worker, a pipeline's first stage).
    pub trained: BTreeMap<u64, Trained>,
    /// Each node's compute time per sample of its share, ns (the counter model's step: empty,
    /// every step of every node takes 1 ms).
    pub ns_per_sample: Vec<u64>,
}

/// The samples a step trained in the epoch that last completed it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trained {
    /// The epoch.
    pub epoch: u64,
    /// The global batch.
    pub global_batch: u64,
    /// (offset, batch) of each node that owns samples.
    pub parts: Vec<(u64, u64)>,
}

impl Cluster {
    /// A cluster of `cfg`'s nodes, each holding the initial model (version 0), started; its
    /// coordinator never dies.
    pub fn new(cfg: Config) -> Self {
        Self::start(cfg, None)
    }

    /// The same, the coordinator hosted by node `host`'s process, with fail-over: it dies with
    /// the node, and a successor takes over.
    pub fn hosted(cfg: Config, host: NodeId) -> Self {
        let cfg = Config {
            host: Some(host),
            ..cfg
        };
        Self::start(cfg, Some(host))
    }

    fn start(cfg: Config, host: Option<NodeId>) -> Self {
        let n = cfg.cluster.nodes.len();
        let mut c = Cluster {
            coordinators: vec![Hosted {
                core: Coordinator::new(cfg.clone(), 0),
                host,
                term: 0,
            }],
            cfg,
            nodes: (0..n)
                .map(|i| Node {
                    alive: true,
                    core: NodeCore::fresh(NodeId(i as u32), 0, 0),
                    entered: None,
                    inbox: VecDeque::new(),
                    outbox: VecDeque::new(),
                    ran: Vec::new(),
                    shards: Vec::new(),
                    watch: host.map(|h| Watch::new(NodeId(i as u32), h, SILENCE_MS, 0)),
                    follows: host.unwrap_or(NodeId(0)),
                })
                .collect(),
            now: 0,
            stale: Vec::new(),
            ns_per_sample: Vec::new(),
            log: Vec::new(),
            take_overs: Vec::new(),
            trained: BTreeMap::new(),
        };
        let first = c.coordinators[0].core.start();
        c.route(0, first);
        c
    }

    /// The newest coordinator.
    pub fn coordinator(&self) -> &Coordinator {
        &self.coordinators[self.coordinators.len() - 1].core
    }

    /// Whether coordinator `k` runs: its host is alive.
    fn runs(&self, k: usize) -> bool {
        self.coordinators[k]
            .host
            .is_none_or(|h| self.nodes[h.index()].alive)
    }

    /// The coordinator node `i` sends to: the newest one its followed host runs, if it runs.
    fn followed(&self, i: usize) -> Option<usize> {
        let f = self.nodes[i].follows;
        let k = (0..self.coordinators.len())
            .rev()
            .find(|&k| self.coordinators[k].host.is_none_or(|h| h == f))?;
        self.runs(k).then_some(k)
    }

    /// How many actions [`Cluster::act`] chooses from.
    pub fn actions(&self) -> usize {
        2 * self.nodes.len() + 2
    }

    /// One action, `pick` modulo [`Cluster::actions`]: 0..n deliver the next envelope to node
    /// i; n..2n deliver node i's next one to the coordinator; 2n: steps complete where they
    /// can; 2n + 1: 100 ms pass (heartbeats from the live nodes, then a tick). Then every
    /// idle live node advances. `Err`: a node broke a rule.
    pub fn act(&mut self, pick: usize) -> Result<(), String> {
        let n = self.nodes.len();
        let pick = pick % self.actions();
        if pick < n {
            if let Some((from, env)) = self.nodes[pick].inbox.pop_front()
                && self.nodes[pick].alive
                && !self.watch(pick, from, &env)
            {
                self.deliver(pick, env)?;
            }
        } else if pick < 2 * n {
            let i = pick - n;
            if let Some(env) = self.nodes[i].outbox.pop_front()
                && self.nodes[i].alive
                && let Some(k) = self.followed(i)
            {
                let e = self.coordinators[k]
                    .core
                    .handle(self.now, Input::Net(NodeId(i as u32), env));
                self.route(k, e);
            }
        } else if pick == 2 * n {
            self.complete_steps()?;
        } else {
            self.pass_time();
        }
        for i in 0..n {
            if self.nodes[i].alive && self.nodes[i].entered.is_none() {
                self.advance(i)?;
            }
        }
        Ok(())
    }

    /// 100 ms pass: the live nodes' heartbeats reach the coordinator each follows, the
    /// coordinators tick and send their leases, and the watches tick.
    fn pass_time(&mut self) {
        self.now += 100;
        for i in 0..self.nodes.len() {
            if self.nodes[i].alive
                && let Some(k) = self.followed(i)
            {
                let beat = Input::Net(NodeId(i as u32), Envelope::Heartbeat);
                let e = self.coordinators[k].core.handle(self.now, beat);
                self.route(k, e);
            }
        }
        for k in 0..self.coordinators.len() {
            if !self.runs(k) {
                continue;
            }
            let e = self.coordinators[k].core.handle(self.now, Input::Tick);
            self.route(k, e);
            let Some(host) = self.coordinators[k].host else {
                continue;
            };
            let lease = Envelope::Lease {
                term: self.coordinators[k].term,
                host,
            };
            for node in &mut self.nodes {
                // (One lease waiting per node is enough: the next says no more.)
                if !node.inbox.contains(&(Addr::Coordinator, lease.clone())) {
                    node.inbox.push_back((Addr::Coordinator, lease.clone()));
                }
            }
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i].alive
                && let Some(w) = self.nodes[i].watch.as_mut()
            {
                let v = w.tick(self.now);
                self.act_on(i, v);
            }
        }
    }

    /// Cut node `i` off (its queues are emptied), or bring it back.
    pub fn set_alive(&mut self, i: usize, alive: bool) {
        let n = &mut self.nodes[i];
        n.alive = alive;
        if !alive {
            n.inbox.clear();
            n.outbox.clear();
        }
    }

    /// Coordinator `k`'s effects: what it sends reaches the nodes' inboxes.
    fn route(&mut self, k: usize, effects: Vec<Effect>) {
        if !self.runs(k) {
            return;
        }
        let term = self.coordinators[k].term;
        let superseded = self.coordinators.iter().any(|c| c.term > term);
        for e in effects {
            if let Effect::Send(to, env) = &e {
                let inbox = &mut self.nodes[to.index()].inbox;
                inbox.push_back((Addr::Coordinator, env.clone()));
            }
            match superseded {
                true => self.stale.push(e),
                false => self.log.push(e),
            }
        }
    }

    /// An envelope for node `i`, before its decisions: its watch's part (true: consumed), as
    /// the node's process does it.
    fn watch(&mut self, i: usize, from: Addr, env: &Envelope) -> bool {
        let now = self.now;
        let Some(w) = self.nodes[i].watch.as_mut() else {
            return false;
        };
        let Some(heard) = w.on_envelope(from, env, now) else {
            return false;
        };
        if let Some((to, env)) = heard.reply {
            let me = Addr::Node(NodeId(i as u32));
            self.nodes[to.index()].inbox.push_back((me, env));
        }
        self.act_on(i, heard.verdict);
        true
    }

    /// Carry out node `i`'s watch's verdict, as its process does.
    fn act_on(&mut self, i: usize, v: Option<Verdict>) {
        let me = NodeId(i as u32);
        match v {
            Some(Verdict::Follow(h) | Verdict::Resumed(h)) => {
                self.nodes[i].follows = h;
                // A host of an older term hears of the newer one: it steps down, and its
                // process exits.
                let newest = self.coordinators.iter().map(|c| c.term).max();
                if self
                    .coordinators
                    .iter()
                    .any(|c| c.host == Some(me) && Some(c.term) < newest)
                    && h != me
                {
                    self.set_alive(i, false);
                }
            }
            Some(Verdict::TakeOver(r)) => {
                let from = self.nodes[i].follows;
                self.nodes[i].follows = me;
                self.take_overs.push((self.log.len(), r.agreed));
                let core = Coordinator::take_over(self.cfg.clone(), &r, from, self.now);
                self.coordinators.push(Hosted {
                    core,
                    host: Some(me),
                    term: r.term,
                });
                let k = self.coordinators.len() - 1;
                let first = self.coordinators[k].core.start();
                self.route(k, first);
            }
            Some(Verdict::Canvass { term, voters }) => {
                for v in voters {
                    let ask = (Addr::Node(me), Envelope::PreVote { term });
                    self.nodes[v.index()].inbox.push_back(ask);
                }
            }
            Some(Verdict::Awaits(_) | Verdict::CutOff(_) | Verdict::Lost(_)) | None => {}
        }
    }

    /// An envelope reaches node `i`'s decisions.
    fn deliver(&mut self, i: usize, env: Envelope) -> Result<(), String> {
        let input = match env {
            Envelope::Work(w) => core::Input::Work(w),
            Envelope::Grant { epoch, until } => core::Input::Grant { epoch, until },
            Envelope::StopAt { at, checkpoint } => core::Input::StopAt { at, checkpoint },
            Envelope::Halt { epoch } => core::Input::Halt { epoch },
            Envelope::Restored { epoch, checkpoint } => core::Input::Restored {
                epoch,
                restored: Some(checkpoint.map_or((0, 0), |(v, _)| (v, v))),
            },
            Envelope::StateRequest {
                version,
                to,
                layers,
            } => core::Input::StateRequest {
                version,
                to,
                layers,
            },
            Envelope::State {
                version,
                model,
                layers,
                ..
            } => {
                if self.nodes[i].core.fetch_base(version, layers).is_none() {
                    return Ok(());
                }
                core::Input::Fetched {
                    version,
                    layers,
                    model: model.first().map_or(0, |x| *x as u64),
                }
            }
            _ => return Ok(()),
        };
        let effects = self.nodes[i].core.handle(input);
        self.perform(i, effects)
    }

    /// Node `i` is idle: its decisions may start a step.
    fn advance(&mut self, i: usize) -> Result<(), String> {
        let before = self.nodes[i].core.latest();
        let effects = self.nodes[i].core.handle(core::Input::Advance);
        for e in &effects {
            if let core::Effect::Activated { epoch, step } = e
                && before.is_some_and(|l| l > *step)
            {
                return Err(format!(
                    "node {i} at {before:?} started epoch {epoch} from {step}, past its start"
                ));
            }
        }
        self.perform(i, effects)
    }

    /// Carry out node `i`'s effects.
    fn perform(&mut self, i: usize, effects: Vec<core::Effect>) -> Result<(), String> {
        for e in effects {
            match e {
                core::Effect::Send(Addr::Coordinator, env) => self.nodes[i].outbox.push_back(env),
                core::Effect::Send(Addr::Node(to), env) => {
                    let from = Addr::Node(NodeId(i as u32));
                    self.nodes[to.index()].inbox.push_back((from, env))
                }
                core::Effect::Send(..) => {}
                core::Effect::Abandon => self.nodes[i].entered = None,
                core::Effect::Serve {
                    version,
                    to,
                    layers,
                } => {
                    let Some(v) = self.nodes[i].core.version(version) else {
                        continue;
                    };
                    let state = Envelope::State {
                        version,
                        model: vec![v.model as f32],
                        layers,
                        virtual_bytes: 0,
                    };
                    let from = Addr::Node(NodeId(i as u32));
                    self.nodes[to.index()].inbox.push_back((from, state));
                }
                core::Effect::WriteShard { version, .. } => self.nodes[i].shards.push(version),
                core::Effect::Run { step } => self.run(i, step)?,
                core::Effect::Activated { .. }
                | core::Effect::Halted { .. }
                | core::Effect::Narrow { .. } => {}
            }
        }
        Ok(())
    }

    /// Node `i` enters step `step`.
    fn run(&mut self, i: usize, step: u64) -> Result<(), String> {
        let n = &mut self.nodes[i];
        let epoch = n.core.work().map_or(0, |w| w.epoch);
        if let Some(next) = n.core.next_work()
            && step >= next.step
        {
            return Err(format!(
                "node {i} ran step {step} of epoch {epoch}, at or past epoch {}'s start {}",
                next.epoch, next.step
            ));
        }
        let model = n.core.version(step).map(|v| v.model);
        if model != Some(step) {
            return Err(format!(
                "node {i} started step {step} from a model of {model:?} steps"
            ));
        }
        n.entered = Some((epoch, step));
        n.ran.push((epoch, step));
        Ok(())
    }

    /// A step completes on every member of its group once all of them entered it (the
    /// collective's barrier); a cut-off member blocks it.
    fn complete_steps(&mut self) -> Result<(), String> {
        let entered: Vec<((u64, u64), Vec<NodeId>)> = self
            .nodes
            .iter()
            .filter(|n| n.alive)
            .filter_map(|n| Some((n.entered?, n.core.work()?.ring.clone())))
            .collect();
        for (at, ring) in entered {
            let all = ring.iter().all(|m| {
                let n = &self.nodes[m.index()];
                n.alive && n.entered == Some(at)
            });
            if !all {
                continue;
            }
            for m in ring {
                let i = m.index();
                let n = &mut self.nodes[i];
                n.entered = None;
                if let Some(w) = n.core.work()
                    && w.batch > 0
                    && w.stage.as_ref().is_none_or(|s| s.stage == 0)
                {
                    let t = self.trained.entry(at.1).or_default();
                    if t.epoch != at.0 {
                        *t = Trained {
                            epoch: at.0,
                            global_batch: w.global_batch,
                            parts: Vec::new(),
                        };
                    }
                    t.parts.push((w.offset, w.batch));
                }
                let compute_ns = match (self.ns_per_sample.get(i), n.core.work()) {
                    (Some(ns), Some(w)) => ns * w.batch,
                    _ => 1_000_000,
                };
                let Some(model) = n.core.version(at.1).map(|v| v.model + 1) else {
                    return Err(format!("node {i} lost version {} during its step", at.1));
                };
                let made = core::Made {
                    epoch: at.0,
                    step: at.1,
                    model,
                    synced: true,
                    layers: None,
                    digest: Self::digest(model),
                    compute_ns,
                    comm_ns: 0,
                };
                let effects = n.core.handle(core::Input::Made(made));
                self.perform(i, effects)?;
            }
        }
        Ok(())
    }

    /// Every sample of each agreed step `s` (`[s·B, (s+1)·B)`) trained exactly once by the
    /// epoch that last completed it; `Err` names the first step that breaks it.
    pub fn trained_once(&self, agreed: &[u64]) -> Result<(), String> {
        for s in agreed {
            let Some(t) = self.trained.get(s) else {
                return Err(format!("step {s} agreed but never completed"));
            };
            let mut ids: Vec<u64> = t
                .parts
                .iter()
                .flat_map(|&(offset, batch)| {
                    crate::digest::sample_range(*s, t.global_batch, offset, batch)
                })
                .collect();
            ids.sort_unstable();
            let want: Vec<u64> = (s * t.global_batch..(s + 1) * t.global_batch).collect();
            if ids != want {
                return Err(format!(
                    "step {s} of epoch {} trained {} samples for its {}: {:?}",
                    t.epoch,
                    ids.len(),
                    t.global_batch,
                    t.parts
                ));
            }
        }
        Ok(())
    }

    /// The digest of the counter model `model`.
    pub fn digest(model: Model) -> u64 {
        1000 + model
    }

    /// Run `choices` (then action k for k past them) until the coordinator finishes, node
    /// `cut` cut off (and maybe back) on the way. `Err`: a node broke a rule, or the run did
    /// not finish in 200,000 actions.
    pub fn drive(&mut self, choices: &[usize], cut: Option<Cut>) -> Result<(), String> {
        for k in 0..200_000usize {
            if self.coordinator().is_finished() {
                return Ok(());
            }
            if let Some(c) = cut {
                if k == c.at {
                    self.set_alive(c.who, false);
                }
                if c.back_after.is_some_and(|d| k == c.at + d) {
                    self.set_alive(c.who, true);
                }
            }
            self.act(choices.get(k).copied().unwrap_or(k))?;
        }
        if std::env::var_os("MODEL_DEBUG").is_some() {
            self.dump();
        }
        Err("the run did not finish".into())
    }

    fn dump(&self) {
        for e in &self.log {
            if !matches!(e, Effect::Send(_, Envelope::Grant { .. })) {
                eprintln!("{e:?}");
            }
        }
        for (i, n) in self.nodes.iter().enumerate() {
            eprintln!(
                "node {i}: alive {} work {:?} next {:?} halted {} held {:?} entered {:?} fetching {} inbox {} outbox {}",
                n.alive,
                n.core
                    .work()
                    .map(|w| (w.epoch, w.step, w.until, w.ring.clone(), w.state_from)),
                n.core.next_work().map(|w| (w.epoch, w.step, w.until)),
                n.core.halted(),
                n.core.versions().held(),
                n.entered,
                n.core.fetching(),
                n.inbox.len(),
                n.outbox.len()
            );
        }
    }
}
