//! The node actor's message handling: epochs arrive and switch at their first step, grants move
//! the horizon, a halt stops everything and reports the versions held, peers ask for versions.

use std::collections::BTreeSet;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::{LayerRange, NodeId};

use super::state::{Fetch, NodeMsg, NodeState};
use super::{NodeActor, Start, spawn_link_probes};
use crate::collective::{CollectiveActor, CollectiveMsg};
use crate::seams::{Compute, Transport};
use ravnest_protocol::msg::{Addr, Envelope, Work};
use ravnest_protocol::node::versions::{Keep, Version};

/// Requests for versions this node has not made yet, kept at most.
const REQUESTS_MAX: usize = 64;

/// A node's state, as this backend's node holds it.
type State<C> = NodeState<<C as Compute>::Model, <C as Compute>::StageGrad>;

impl<T: Transport, C: Compute> NodeActor<T, C> {
    pub(super) fn me(&self) -> Addr {
        Addr::Node(self.id)
    }

    pub(super) fn send(&self, to: Addr, env: Envelope) {
        // A send can only fail for an unknown address or a downed sender; both mean this node
        // is being torn down or the cluster changed under it, and the detector handles it.
        let _ = self.transport.send(self.me(), to, env);
    }

    pub(super) fn count(&self, f: impl FnOnce(&mut super::NodeCounters)) {
        f(self.counters.lock().unwrap().entry(self.id).or_default());
    }

    /// A new epoch. A node still running the previous one finishes that epoch's steps below
    /// the new one's first step, then switches; any other node switches now.
    async fn on_work(&self, st: &mut State<C>, w: Work) {
        if w.epoch <= st.epoch {
            return;
        }
        st.epoch = w.epoch;
        // Where this node is headed: the version it fetches, else the newest it holds.
        let latest = st
            .fetching
            .as_ref()
            .map(|f| f.version)
            .or(st.versions.latest());
        if super::epochs::queues(st.work.as_ref(), st.halted, latest, &w) {
            st.next_work = Some(w);
        } else {
            self.drop_step(st);
            st.next_work = None;
            st.halted = false;
            self.activate(st, w);
        }
        self.advance(st).await;
    }

    /// Abandon a step in progress (its epoch is over).
    fn drop_step(&self, st: &mut State<C>) {
        if st.running.take().is_some() || st.pipe.take().is_some() {
            self.count(|c| c.aborted += 1);
        }
    }

    /// Make `w` the epoch being run: from its first step's version, which this node holds, or
    /// fetches (whole, or the layers it lacks).
    pub(super) fn activate(&self, st: &mut State<C>, w: Work) {
        st.versions.truncate_after(w.step);
        st.fetching = None;
        st.early_pipe
            .retain(|e| e.epoch > w.epoch || (e.epoch == w.epoch && e.step >= w.step));
        if let Some(c) = &st.collective {
            let _ = c.cast(CollectiveMsg::Halt(w.epoch.saturating_sub(1)));
        }
        let fetch = match (&w.stage, &w.shard) {
            (Some(s), _) => s.fetch.clone(),
            (None, Some(s)) => s.fetch.clone(),
            (None, None) => Vec::new(),
        };
        // The only holder of its layers (a stage of a single pipeline, a sharded worker's part)
        // keeps one version.
        let alone = (w.stage.is_some() && w.ring.len() <= 1) || w.shard.is_some();
        st.versions.keep(if alone { Keep::One } else { Keep::Two });
        if !fetch.is_empty() {
            // The fetched layers go on top of what this node holds of that version.
            let model = st.versions.get(w.step).map(|v| v.model.clone());
            for &(peer, layers) in &fetch {
                self.ask_state(peer, w.step, Some(layers));
            }
            st.fetching = Some(Fetch {
                version: w.step,
                model,
                missing: fetch.iter().map(|f| f.1).collect(),
                whole: false,
            });
        } else if st.versions.get(w.step).is_none()
            && let Some(peer) = w.state_from
        {
            // What this node holds is older than the epoch's start: stale. Reporting it after a
            // halt would pull the whole cluster back to it.
            st.versions = Default::default();
            self.ask_state(peer, w.step, None);
            st.fetching = Some(Fetch {
                version: w.step,
                model: None,
                missing: BTreeSet::new(),
                whole: true,
            });
        }
        st.work = Some(w);
    }

    fn ask_state(&self, peer: NodeId, version: u64, layers: Option<LayerRange>) {
        self.send(
            Addr::Node(peer),
            Envelope::StateRequest {
                version,
                to: self.id,
                layers,
            },
        );
    }

    /// Start the next step if the epoch allows it: switch to the next epoch at its first step,
    /// stop at the grant or the run's end.
    pub(super) async fn advance(&self, st: &mut State<C>) {
        if st.running.is_some() || st.pipe.is_some() || st.fetching.is_some() || st.halted {
            return;
        }
        let Some(latest) = st.versions.latest() else {
            return;
        };
        if st
            .next_work
            .as_ref()
            .is_some_and(|n| super::epochs::starts(n, latest))
            && let Some(w) = st.next_work.take()
        {
            self.activate(st, w);
            if st.fetching.is_some() {
                return;
            }
        }
        let Some(w) = &st.work else { return };
        let s = st.versions.latest().unwrap_or(latest);
        if !super::epochs::runs(w, s) {
            return;
        }
        self.run_step(st, s).await;
    }

    /// This node's training step time as a function of its batch ([`super::calibrate`]),
    /// from its latest version (or the initial model), the optimizer applied to a scratch
    /// version.
    async fn calibrate(&self, st: &State<C>, batch: u64, duration_ms: u64) -> Envelope {
        let model = st
            .versions
            .latest()
            .and_then(|v| st.versions.get(v))
            .map(|v| v.model.clone());
        let bench = super::calibrate::Bench::new(self.compute.clone(), self.id, model);
        let c = super::calibrate::calibrate(&bench, batch, duration_ms).await;
        Envelope::Measured {
            samples_per_s: c.samples_per_s,
            per_sample_s: c.per_sample_s,
            overhead_s: c.overhead_s,
        }
    }

    /// The latest checkpoint, to restore layers held only by lost nodes from: keep it as a
    /// synchronized whole version (the newer ones are dropped: training goes back to it) and
    /// answer the halt again. Before the run's first checkpoint, the run's start is the one to
    /// go back to (the seeded model, or the checkpoint a resumed run started from).
    fn on_restored(&self, st: &mut State<C>, epoch: u64, checkpoint: Option<(u64, Vec<f32>)>) {
        let restored = match checkpoint {
            Some((version, values)) => self
                .compute
                .import(None, None, values)
                .ok()
                .map(|m| (version, m)),
            None => Some((self.compute.initial_version(), self.compute.initial(None))),
        };
        if let Some((version, model)) = restored {
            st.versions.truncate_after(version);
            st.versions.insert(
                version,
                Version {
                    model,
                    synced: true,
                    layers: None,
                },
            );
        }
        self.on_halt(st, epoch);
    }

    /// Stop every step of `epoch` and earlier, and tell the coordinator what is held.
    fn on_halt(&self, st: &mut State<C>, epoch: u64) {
        self.drop_step(st);
        st.halted = true;
        st.next_work = None;
        st.fetching = None;
        if let Some(c) = &st.collective {
            let _ = c.cast(CollectiveMsg::Halt(epoch));
        }
        self.send(
            Addr::Coordinator,
            Envelope::Halted {
                epoch,
                held: st.versions.held(),
            },
        );
    }

    fn on_grant(&self, st: &mut State<C>, epoch: u64, until: u64) {
        for w in [&mut st.work, &mut st.next_work].into_iter().flatten() {
            if w.epoch == epoch {
                w.until = w.until.max(until);
            }
        }
    }

    /// The user stopped the run: it ends at version `at` (no step at or past it was started:
    /// the coordinator chose the grant's horizon), checkpointed there with `checkpoint`.
    fn on_stop_at(st: &mut State<C>, at: u64, checkpoint: bool) {
        for w in [&mut st.work, &mut st.next_work].into_iter().flatten() {
            if w.end > at {
                w.end = at.max(w.step);
                w.until = w.until.min(w.end);
                if let Some(d) = w.checkpoint.as_mut() {
                    d.at_end |= checkpoint;
                }
            }
        }
    }

    /// A peer asks for a version: send it, or keep the request until this node makes it.
    pub(super) fn on_state_request(
        &self,
        st: &mut State<C>,
        version: u64,
        to: NodeId,
        layers: Option<LayerRange>,
    ) {
        let Some(v) = st.versions.get(version) else {
            if st.versions.latest().is_none_or(|l| version > l) && st.requests.len() < REQUESTS_MAX
            {
                st.requests.push((version, to, layers));
            }
            return;
        };
        if let Some(part) = self.compute.export(&v.model, layers) {
            let len = self.compute.model_len().max(1) as u64;
            self.send(
                Addr::Node(to),
                Envelope::State {
                    version,
                    virtual_bytes: self.model_bytes * part.len() as u64 / len,
                    model: part,
                    layers,
                },
            );
        }
    }

    /// Serve the requests waiting for a version this node just made.
    pub(super) fn serve_requests(&self, st: &mut State<C>) {
        let Some(latest) = st.versions.latest() else {
            return;
        };
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut st.requests)
            .into_iter()
            .partition(|r| r.0 <= latest);
        st.requests = later;
        for (version, to, layers) in now {
            self.on_state_request(st, version, to, layers);
        }
    }

    /// A version (or some layers of one) from a peer.
    async fn on_state(
        &self,
        st: &mut State<C>,
        version: u64,
        model: Vec<f32>,
        layers: Option<LayerRange>,
    ) {
        let Some(f) = st.fetching.as_mut() else {
            return;
        };
        if f.version != version {
            return;
        }
        match layers {
            None if f.whole => match self.compute.import(None, None, model) {
                Ok(m) => f.model = Some(m),
                Err(_) => return,
            },
            Some(l) if !f.whole => {
                if !f.missing.contains(&l) {
                    return;
                }
                match self.compute.import(f.model.as_ref(), Some(l), model) {
                    Ok(m) => f.model = Some(m),
                    Err(_) => return,
                }
                f.missing.remove(&l);
                if !f.missing.is_empty() {
                    return;
                }
            }
            _ => return,
        }
        let Some(f) = st.fetching.take() else { return };
        // A sharded worker holds every weight, and its part's optimizer state whole.
        let shard = st
            .work
            .as_ref()
            .and_then(|w| w.shard.as_ref())
            .map(|s| s.owned);
        let new = st.work.as_ref().and_then(Work::layers).or(shard);
        // The layers this node held at that version are still valid in it (the fetched ones
        // were copied in beside them): keep saying so, so that a fetch from here that is lost
        // (a reset, a halt) can be made again after a resync instead of finding no holder.
        let layers = match (st.versions.get(f.version).map(|v| v.layers), new) {
            (Some(None), _) => None,
            (Some(Some(o)), Some(n)) if o.start <= n.end && n.start <= o.end => {
                Some(LayerRange::new(o.start.min(n.start), o.end.max(n.end)))
            }
            _ => new,
        };
        let Some(model) = f.model else { return };
        let model = match layers {
            Some(l) if shard.is_none() => self.compute.retain(&model, l),
            _ => model,
        };
        st.versions.truncate_after(f.version);
        st.versions.insert(
            f.version,
            Version {
                model,
                synced: true,
                layers,
            },
        );
        self.advance(st).await;
    }

    async fn on_net(&self, st: &mut State<C>, from: Addr, env: Envelope) {
        match env {
            // The watch takes replicas and leases from the inbox (see `Watcher`).
            Envelope::Work(w) => self.on_work(st, *w).await,
            Envelope::Grant { epoch, until } => {
                self.on_grant(st, epoch, until);
                self.advance(st).await;
            }
            Envelope::StopAt { at, checkpoint } => {
                Self::on_stop_at(st, at, checkpoint);
                self.advance(st).await;
            }
            Envelope::Halt { epoch } => self.on_halt(st, epoch),
            Envelope::Restored { epoch, checkpoint } => self.on_restored(st, epoch, checkpoint),
            Envelope::Measure { batch, duration_ms } => {
                let measured = self.calibrate(st, batch, duration_ms).await;
                self.send(Addr::Coordinator, measured);
            }
            Envelope::Coll { msg, .. } => {
                if let Some(c) = &st.collective {
                    let _ = c.cast(CollectiveMsg::Net(msg));
                }
            }
            Envelope::Activation {
                epoch,
                step,
                micro,
                data,
                ..
            } => {
                self.on_stage_input(st, epoch, step, false, micro, data)
                    .await
            }
            Envelope::ActivationGrad {
                epoch,
                step,
                micro,
                data,
                ..
            } => {
                self.on_stage_input(st, epoch, step, true, micro, data)
                    .await
            }
            Envelope::GradNorm {
                epoch,
                step,
                part,
                sq,
            } => self.on_grad_norm(st, epoch, step, part, sq).await,
            Envelope::StateRequest {
                version,
                to,
                layers,
            } => self.on_state_request(st, version, to, layers),
            Envelope::State {
                version,
                model,
                layers,
                ..
            } => self.on_state(st, version, model, layers).await,
            Envelope::ProbePeers { peers } => {
                // Ids unique to this node: its id in the high bits.
                let first = (u64::from(self.id.0) << 40) + st.probe_seq;
                st.probe_seq += 6 * peers.len() as u64 + 1;
                spawn_link_probes(
                    self.transport.clone(),
                    self.id,
                    peers,
                    st.probes.clone(),
                    first,
                );
            }
            Envelope::Probe {
                id, echo: false, ..
            } => {
                if let Some(tx) = st.probes.lock().unwrap().remove(&id) {
                    let _ = tx.send(());
                }
            }
            Envelope::Probe {
                id,
                data,
                echo: true,
            } => self.send(
                from,
                Envelope::Probe {
                    id,
                    data,
                    echo: false,
                },
            ),
            // Addressed to the coordinator or the checkpoint actor, not to a node: ignore.
            _ => {}
        }
    }
}

impl<T: Transport, C: Compute> Actor for NodeActor<T, C> {
    type Msg = NodeMsg;
    type State = State<C>;
    type Arguments = Start;

    async fn pre_start(
        &self,
        myself: ActorRef<NodeMsg>,
        start: Start,
    ) -> Result<State<C>, ActorProcessingErr> {
        let outcomes = {
            let me = myself.clone();
            Arc::new(move |o| {
                let _ = me.cast(NodeMsg::Collective(o));
            })
        };
        let (collective, _) = Actor::spawn_linked(
            None,
            CollectiveActor {
                id: self.id,
                transport: self.transport.clone(),
                outcomes,
            },
            (),
            myself.get_cell(),
        )
        .await?;
        let watcher = self
            .succession
            .clone()
            .map(|sc| super::watcher::Watcher::new(self.id, self.transport.clone(), sc, self.t0));
        // Collective traffic goes straight to the collective actor; the watch over the
        // coordinator takes its part; the rest goes to the node.
        {
            let (node, coll, w) = (myself.clone(), collective.clone(), watcher.clone());
            self.transport.register(
                self.me(),
                Arc::new(move |from, env| match env {
                    Envelope::Coll { msg, .. } => {
                        let _ = coll.cast(CollectiveMsg::Net(msg));
                    }
                    env => {
                        if !w.as_ref().is_some_and(|w| w.on_envelope(from, &env)) {
                            let _ = node.cast(NodeMsg::Net(from, env));
                        }
                    }
                }),
            );
        }
        let mut st = State::<C> {
            me: Some(myself.clone()),
            collective: Some(collective),
            ..NodeState::default()
        };
        // The watch ticks between the node's messages: a gap (a long step) is its own stall,
        // not the coordinator's silence.
        if let Some(w) = watcher {
            st.watch_ticker = Some(myself.send_interval(w.period(), || NodeMsg::Watch));
            st.watcher = Some(super::watcher::Tick(Box::new(move || w.tick())));
        }
        match start {
            Start::Fresh => {
                let v = self.compute.initial_version();
                st.versions.insert(
                    v,
                    Version {
                        model: self.compute.initial(None),
                        synced: true,
                        layers: None,
                    },
                );
            }
            Start::Rejoin => self.send(Addr::Coordinator, Envelope::Join),
            Start::Empty => {}
        }
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        st: &mut State<C>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Net(from, env) => self.on_net(st, from, env).await,
            NodeMsg::Collective(outcome) => self.on_outcome(st, outcome).await,
            NodeMsg::Advance => self.advance(st).await,
            NodeMsg::Watch => {
                if let Some(tick) = &st.watcher {
                    (tick.0)();
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<NodeMsg>,
        st: &mut State<C>,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = st.watch_ticker.take() {
            t.abort();
        }
        Ok(())
    }
}
