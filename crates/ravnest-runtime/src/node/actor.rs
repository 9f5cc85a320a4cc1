//! The node actor's message handling: what arrives goes to the node's machine
//! ([`Machine`]: its decisions and its step in progress), whose acts are carried out
//! ([`NodeActor::carry_out`]); a step it allows is run ([`NodeActor::run_step`]).

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::state::{NodeMsg, NodeState};
use super::{NodeActor, Start};
use crate::collective::{CollectiveActor, CollectiveMsg};
use crate::counters::Count;
use crate::measure::calibrate::measured;
use crate::seams::{Compute, Transport};
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_protocol::node::core::NodeCore;
use ravnest_protocol::node::machine::{Machine, Sizes, Then};

/// A node's state, as this backend's node holds it.
type State<C> = NodeState<C>;

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

    /// Start the next step if the node is idle and its decisions allow one.
    pub(super) async fn advance(&self, st: &mut State<C>) {
        let run = st.node.advance();
        self.carry_out(st).await;
        if let Some(s) = run {
            self.run_step(st, s).await;
        }
    }

    async fn on_net(&self, st: &mut State<C>, from: Addr, env: Envelope) {
        let Err(env) = st.probes.on_envelope(&self.transport, self.id, from, env) else {
            return;
        };
        // (The watch takes replicas and leases from the inbox: see `Watcher`.)
        let env = match st.node.on_envelope(env) {
            Ok(then) => {
                self.carry_out(st).await;
                return match then {
                    Then::Advance => self.advance(st).await,
                    Then::Pump => self.pump(st).await,
                    Then::Nothing => {}
                };
            }
            Err(env) => env,
        };
        match env {
            Envelope::Measure { batch, duration_ms } => {
                let core = st.node.core();
                let latest = core.latest().and_then(|v| core.version(v));
                let model = latest.map(|v| v.model.clone());
                let (compute, id) = (self.compute.clone(), self.id);
                let measured = measured(compute, id, model, batch, duration_ms).await;
                self.send(Addr::Coordinator, measured);
            }
            Envelope::Coll { msg, .. } => {
                if let Some(c) = &st.collective {
                    let _ = c.cast(CollectiveMsg::Net(msg));
                }
            }
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
        // Outcomes wait in a channel, the node told of each: a step whose compute runs applies
        // them as they come (see `NodeActor::sync_step`), not when its compute has ended.
        let (done, outcomes_rx) = tokio::sync::mpsc::unbounded_channel();
        let outcomes = {
            let me = myself.clone();
            Arc::new(move |o| {
                if done.send(o).is_ok() {
                    let _ = me.cast(NodeMsg::Collective);
                }
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
        let watcher = self.succession.clone().map(|sc| {
            crate::succession::Watcher::new(self.id, self.transport.clone(), sc, self.t0)
        });
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
        let sizes = Sizes {
            grad_bytes: self.grad_bytes,
            model_bytes: self.model_bytes,
            round_factor: self.round_factor,
        };
        let mut st = State::<C> {
            me: Some(myself.clone()),
            collective: Some(collective),
            outcomes: Some(outcomes_rx),
            ..NodeState::new(Machine::new(core, self.compute.clone(), sizes))
        };
        // The watch ticks between the node's messages: a gap (a long step) is its own stall,
        // not the coordinator's silence.
        if let Some(w) = watcher {
            st.watch_ticker = Some(myself.send_interval(w.period(), || NodeMsg::Watch));
            st.watcher = Some(crate::succession::Tick(Box::new(move || w.tick())));
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
            NodeMsg::Collective => {
                while let Some(o) = st.outcomes.as_mut().and_then(|r| r.try_recv().ok()) {
                    self.on_outcome(st, o).await;
                }
            }
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
