//! The node actor's message handling: what arrives goes to the node's decisions
//! ([`NodeCore`]), and their effects are carried out here: envelopes sent, a step dropped or
//! started, collectives halted, versions served, narrowed and checkpointed.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::{LayerRange, NodeId};

use super::state::{NodeMsg, NodeState};
use super::{NodeActor, Start};
use crate::collective::{CollectiveActor, CollectiveMsg};
use crate::counters::Count;
use crate::measure::links::spawn_link_probes;
use crate::seams::{Compute, Transport};
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_protocol::node::core::{Effect, Input, NodeCore};
use ravnest_protocol::node::stage::StageInput;

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

    pub(super) fn record(&self, count: Count) {
        self.counters.record(self.id, count);
    }

    /// Hand the node's decisions an input and carry out what they say, but a step to run.
    async fn decide(&self, st: &mut State<C>, input: Input<C::Model>) {
        let effects = st.core.handle(input);
        self.perform(st, effects).await;
    }

    /// Carry out the decisions' effects; [`Effect::Run`] is [`NodeActor::advance`]'s.
    pub(super) async fn perform(&self, st: &mut State<C>, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::Send(to, env) => self.send(to, env),
                Effect::Abandon => {
                    if st.running.take().is_some() || st.pipe.take().is_some() {
                        self.record(Count::Aborted);
                    }
                }
                Effect::Activated { epoch, step } => {
                    st.early_pipe.activated(epoch, step);
                    if let Some(c) = &st.collective {
                        let _ = c.cast(CollectiveMsg::Halt(epoch.saturating_sub(1)));
                    }
                }
                Effect::Halted { epoch } => {
                    if let Some(c) = &st.collective {
                        let _ = c.cast(CollectiveMsg::Halt(epoch));
                    }
                }
                Effect::Serve {
                    version,
                    to,
                    layers,
                } => self.serve(st, version, to, layers),
                Effect::Narrow { version, layers } => {
                    if let Some(v) = st.core.version(version) {
                        let narrowed = self.compute.retain(&v.model, layers);
                        st.core.set_model(version, narrowed);
                    }
                }
                Effect::WriteShard { version, layers } => {
                    if let Some(v) = st.core.version(version) {
                        let model = v.model.clone();
                        self.write_shard(version, layers, &model).await;
                    }
                }
                // A step is run only where the node is idle: advance asks for it.
                Effect::Run { .. } => {}
            }
        }
    }

    /// Start the next step if the node is idle and its decisions allow one.
    pub(super) async fn advance(&self, st: &mut State<C>) {
        if st.running.is_some() || st.pipe.is_some() {
            return;
        }
        let effects = st.core.handle(Input::Advance);
        let run = effects.iter().find_map(|e| match e {
            Effect::Run { step } => Some(*step),
            _ => None,
        });
        self.perform(st, effects).await;
        if let Some(s) = run {
            self.run_step(st, s).await;
        }
    }

    /// This node's training step time as a function of its batch ([`crate::measure::calibrate`]),
    /// from its latest version (or the initial model), the optimizer applied to a scratch
    /// version.
    async fn calibrate(&self, st: &State<C>, batch: u64, duration_ms: u64) -> Envelope {
        let model = st
            .core
            .latest()
            .and_then(|v| st.core.version(v))
            .map(|v| v.model.clone());
        let mut bench = crate::measure::calibrate::Bench::new(self.compute.clone(), self.id, model);
        let c = crate::measure::calibrate::calibrate(&mut bench, batch, duration_ms).await;
        Envelope::Measured {
            samples_per_s: c.samples_per_s,
            per_sample_s: c.per_sample_s,
            overhead_s: c.overhead_s,
        }
    }

    /// The latest checkpoint, to restore layers held only by lost nodes from (before the
    /// run's first checkpoint, the run's start: the seeded model, or the checkpoint a resumed
    /// run started from), read for the node's decisions to go back to.
    async fn on_restored(
        &self,
        st: &mut State<C>,
        epoch: u64,
        checkpoint: Option<(u64, Vec<f32>)>,
    ) {
        let restored = match checkpoint {
            Some((version, values)) => self
                .compute
                .import(None, None, values)
                .ok()
                .map(|m| (version, m)),
            None => Some((self.compute.initial_version(), self.compute.initial(None))),
        };
        self.decide(st, Input::Restored { epoch, restored }).await;
    }

    /// Send version `version` (of `layers`) to peer `to`.
    fn serve(&self, st: &State<C>, version: u64, to: NodeId, layers: Option<LayerRange>) {
        let Some(v) = st.core.version(version) else {
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

    /// A version (or some layers of one) from a peer, read on top of what the fetch holds.
    async fn on_state(
        &self,
        st: &mut State<C>,
        version: u64,
        model: Vec<f32>,
        layers: Option<LayerRange>,
    ) {
        let Some(base) = st.core.fetch_base(version, layers) else {
            return;
        };
        let Ok(model) = self.compute.import(base, layers, model) else {
            return;
        };
        let input = Input::Fetched {
            version,
            layers,
            model,
        };
        self.decide(st, input).await;
        self.advance(st).await;
    }

    async fn on_net(&self, st: &mut State<C>, from: Addr, env: Envelope) {
        match env {
            // The watch takes replicas and leases from the inbox (see `Watcher`).
            Envelope::Work(w) => {
                self.decide(st, Input::Work(w)).await;
                self.advance(st).await;
            }
            Envelope::Grant { epoch, until } => {
                self.decide(st, Input::Grant { epoch, until }).await;
                self.advance(st).await;
            }
            Envelope::StopAt { at, checkpoint } => {
                self.decide(st, Input::StopAt { at, checkpoint }).await;
                self.advance(st).await;
            }
            Envelope::Halt { epoch } => self.decide(st, Input::Halt { epoch }).await,
            Envelope::Restored { epoch, checkpoint } => {
                self.on_restored(st, epoch, checkpoint).await
            }
            Envelope::Measure { batch, duration_ms } => {
                let measured = self.calibrate(st, batch, duration_ms).await;
                self.send(Addr::Coordinator, measured);
            }
            Envelope::Coll { msg, .. } => {
                if let Some(c) = &st.collective {
                    let _ = c.cast(CollectiveMsg::Net(msg));
                }
            }
            env @ (Envelope::Activation { .. } | Envelope::ActivationGrad { .. }) => {
                if let Ok(input) = StageInput::of(env) {
                    self.on_stage_input(st, input).await
                }
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
            } => {
                let input = Input::StateRequest {
                    version,
                    to,
                    layers,
                };
                self.decide(st, input).await
            }
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
                st.probes.retain(|(_, tx)| !tx.is_closed());
                let round = spawn_link_probes(self.transport.clone(), self.id, peers, first);
                st.probes.push(round);
            }
            Envelope::Probe {
                id, echo: false, ..
            } => {
                if let Some((_, tx)) = st.probes.iter().find(|(ids, _)| ids.contains(&id)) {
                    let _ = tx.send(id);
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
        let core = match start {
            Start::Fresh => NodeCore::fresh(
                self.id,
                self.compute.initial_version(),
                self.compute.initial(None),
            ),
            Start::Rejoin | Start::Empty => NodeCore::new(self.id),
        };
        let mut st = State::<C> {
            me: Some(myself.clone()),
            collective: Some(collective),
            ..NodeState::new(core)
        };
        // The watch ticks between the node's messages: a gap (a long step) is its own stall,
        // not the coordinator's silence.
        if let Some(w) = watcher {
            st.watch_ticker = Some(myself.send_interval(w.period(), || NodeMsg::Watch));
            st.watcher = Some(super::watcher::Tick(Box::new(move || w.tick())));
        }
        if start == Start::Rejoin {
            self.send(Addr::Coordinator, Envelope::Join);
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
