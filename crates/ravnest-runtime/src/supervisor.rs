//! The supervisor: owns the node actors of one process group (every node in the simulator; the
//! local node in `ravnest run`), spawns them linked to itself with their heartbeat tasks, kills
//! them on request (a crash), restarts them (a rejoin), and notices when one dies on its own
//! (a panic in a handler): its heartbeat stops, so the coordinator's detector declares it dead.
//! It does not restart a failed node by itself: a restart is a new incarnation that must rejoin,
//! which is the operator's (or the scenario's) decision.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use ravnest_core::NodeId;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::node::{NodeActor, NodeMsg, Start, spawn_heartbeat};
use crate::seams::{Compute, Transport};
use crate::trace::Trace;
use ravnest_protocol::msg::Addr;

/// Builds the node actor for an id (its configuration is the same at every incarnation).
pub type NodeFactory<T, C> = Arc<dyn Fn(NodeId) -> NodeActor<T, C> + Send + Sync>;

/// The supervisor's configuration.
pub struct SupervisorActor<T, C> {
    /// Makes a node actor.
    pub make_node: NodeFactory<T, C>,
    /// The network (heartbeats go through it).
    pub transport: T,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Nodes to start.
    pub nodes: Vec<NodeId>,
    /// How they start (fresh with the initial model, or without state).
    pub first_start: Start,
    /// Trace.
    pub trace: Trace,
    /// Start of time.
    pub t0: Instant,
}

impl<T, C> std::fmt::Debug for SupervisorActor<T, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorActor")
            .field("nodes", &self.nodes.len())
            .finish()
    }
}

/// Requests.
#[derive(Debug)]
pub enum SupMsg {
    /// Kill a node's process now (no goodbye, like SIGKILL).
    Crash(NodeId),
    /// Start a new incarnation of a node that is not running; it rejoins.
    Restart(NodeId),
}

/// Running node processes.
#[derive(Debug, Default)]
pub struct SupState {
    running: BTreeMap<NodeId, (ActorRef<NodeMsg>, JoinHandle<()>)>,
    by_actor: BTreeMap<ActorId, NodeId>,
}

impl<T: Transport, C: Compute> SupervisorActor<T, C> {
    async fn start(
        &self,
        myself: &ActorRef<SupMsg>,
        st: &mut SupState,
        id: NodeId,
        how: Start,
    ) -> Result<(), ActorProcessingErr> {
        let (r, _) =
            Actor::spawn_linked(None, (self.make_node)(id), how, myself.get_cell()).await?;
        st.by_actor.insert(r.get_id(), id);
        st.running.insert(
            id,
            (
                r,
                spawn_heartbeat(self.transport.clone(), id, self.heartbeat),
            ),
        );
        Ok(())
    }

    fn now_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }
}

impl<T: Transport, C: Compute> Actor for SupervisorActor<T, C> {
    type Msg = SupMsg;
    type State = SupState;
    type Arguments = ();

    async fn pre_start(
        &self,
        myself: ActorRef<SupMsg>,
        _: (),
    ) -> Result<SupState, ActorProcessingErr> {
        let mut st = SupState::default();
        for &id in &self.nodes {
            self.start(&myself, &mut st, id, self.first_start).await?;
        }
        Ok(st)
    }

    async fn handle(
        &self,
        myself: ActorRef<SupMsg>,
        msg: SupMsg,
        st: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupMsg::Crash(id) => {
                if let Some((r, hb)) = st.running.remove(&id) {
                    st.by_actor.remove(&r.get_id());
                    hb.abort();
                    r.kill();
                }
            }
            SupMsg::Restart(id) => {
                if !st.running.contains_key(&id) {
                    self.start(&myself, st, id, Start::Rejoin).await?;
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<SupMsg>,
        evt: SupervisionEvent,
        st: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        // The default would stop the supervisor when a child ends; a node dying is an event to
        // survive, not to propagate.
        if let SupervisionEvent::ActorTerminated(cell, _, _)
        | SupervisionEvent::ActorFailed(cell, _) = evt
            && let Some(id) = st.by_actor.remove(&cell.get_id())
        {
            // Not asked for: the node failed on its own. Silence its heartbeat so the
            // coordinator notices.
            if let Some((_, hb)) = st.running.remove(&id) {
                hb.abort();
            }
            self.trace
                .record(self.now_ns(), "node-failed", Some(Addr::Node(id)), None, 0);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SupMsg>,
        st: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        for (_, (r, hb)) in std::mem::take(&mut st.running) {
            hb.abort();
            r.stop(None);
        }
        Ok(())
    }
}
