//! The one way to start a run's actors: the simulator, `ravnest run` and the tests all go
//! through [`Launch`]. It holds what every actor of a process shares (the transport, the start
//! of time, the trace, the run's [`Journal`](crate::coordinator::Journal)) and spawns, on
//! request, the node actors under their supervisor, the checkpoint actor, and the coordinator.
//! Which of them a process starts is the caller's choice (the simulator starts all of them in
//! one process; a worker of `ravnest run` starts its node only).
//!
//! ```ignore
//! let launch = Launch::new(net.clone()).at(t0).traced(trace.clone());
//! let sup = launch.nodes(Nodes::new(compute, ids, model_bytes).heartbeat(period)).await?;
//! let ck = launch.checkpoints(store, 4).await?;
//! let (coord, done) = launch.coordinator(config, tick).await?;
//! done.await?;
//! ```

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef, SpawnErr};
use ravnest_core::NodeId;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::checkpoint::{CheckpointActor, CkMsg, Store};
use crate::coordinator::{CoordMsg, CoordinatorActor, SharedLog};
use crate::counters::Counters;
use crate::node::{NodeActor, Start};
use crate::seams::{Compute, Transport};
use crate::succession::Succession;
use crate::supervisor::{SupMsg, SupervisorActor};
use crate::trace::Trace;
use ravnest_protocol::coordinator::core::Config;
use ravnest_protocol::msg::Replica;

/// An actor could not be started.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the {what}: {source}")]
pub struct LaunchError {
    /// Which actor.
    pub what: &'static str,
    /// Why.
    #[source]
    pub source: SpawnErr,
}

/// What a process's actors share.
#[derive(Debug, Clone)]
pub struct Launch<T> {
    transport: T,
    t0: Instant,
    trace: Trace,
    log: SharedLog,
    term: u32,
}

/// The node actors a process runs, and how.
pub struct Nodes<C> {
    compute: Arc<C>,
    ids: Vec<NodeId>,
    grad_bytes: u64,
    model_bytes: u64,
    round_factor: f64,
    heartbeat: Duration,
    first_start: Start,
    counters: Counters,
    succession: Option<Succession>,
    observe: bool,
}

impl<C> std::fmt::Debug for Nodes<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nodes").field("ids", &self.ids).finish()
    }
}

impl<C> Nodes<C> {
    /// Nodes `ids` computing with `compute`, whose model (and gradient) is `model_bytes` long;
    /// 100 ms heartbeats, a fresh start, counters of their own.
    pub fn new(compute: Arc<C>, ids: Vec<NodeId>, model_bytes: u64) -> Self {
        Nodes {
            compute,
            ids,
            grad_bytes: model_bytes,
            model_bytes,
            round_factor: 1.0,
            heartbeat: Duration::from_millis(100),
            first_start: Start::Fresh,
            counters: Counters::default(),
            succession: None,
            observe: false,
        }
    }

    /// A gradient of another size than the model (a model with optimizer state in it).
    pub fn grad_bytes(mut self, bytes: u64) -> Self {
        self.grad_bytes = bytes;
        self
    }

    /// What a local-SGD round stands for per byte of gradient, beyond the values it exchanges
    /// (the simulator: the plan's parameters and optimizer state per gradient byte).
    pub fn round_factor(mut self, factor: f64) -> Self {
        self.round_factor = factor;
        self
    }

    /// Heartbeat period.
    pub fn heartbeat(mut self, period: Duration) -> Self {
        self.heartbeat = period;
        self
    }

    /// How the nodes start the first time.
    pub fn start(mut self, how: Start) -> Self {
        self.first_start = how;
        self
    }

    /// Fail-over: the nodes watch the coordinator and take over or follow as
    /// [`Succession`] says.
    pub fn succession(mut self, s: Succession) -> Self {
        self.succession = Some(s);
        self
    }

    /// Export each node's model into the counters after every step (tests and the
    /// simulator's checkers compare them; a copy per step, so never in a real run).
    pub fn observe(mut self) -> Self {
        self.observe = true;
        self
    }

    /// Counters shared with the caller (what each node did, its model).
    pub fn counters(mut self, counters: Counters) -> Self {
        self.counters = counters;
        self
    }
}

impl<T: Transport> Launch<T> {
    /// Actors on `transport`, time from now, their own trace and journal.
    pub fn new(transport: T) -> Self {
        Launch {
            transport,
            t0: Instant::now(),
            trace: Trace::default(),
            log: SharedLog::default(),
            term: 0,
        }
    }

    /// The same launch for the coordinator's actors of `term` hosted by `host`'s process
    /// (the transport as that process sees it: [`Transport::at`]), on the same journal.
    pub fn hosted(&self, host: NodeId, term: u32) -> Launch<T> {
        Launch {
            transport: self.transport.at(host),
            term,
            ..self.clone()
        }
    }

    /// Time counted from `t0`.
    pub fn at(mut self, t0: Instant) -> Self {
        self.t0 = t0;
        self
    }

    /// Record into `trace`.
    pub fn traced(mut self, trace: Trace) -> Self {
        self.trace = trace;
        self
    }

    /// The transport the actors use.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The run's journal (events, agreed steps): read it, or subscribe to it.
    pub fn journal(&self) -> SharedLog {
        self.log.clone()
    }

    /// Start the node actors under a supervisor, each with its heartbeat.
    pub async fn nodes<C: Compute>(&self, n: Nodes<C>) -> Result<ActorRef<SupMsg>, LaunchError> {
        let make_node = {
            let (transport, t0) = (self.transport.clone(), self.t0);
            let (compute, counters) = (n.compute, n.counters);
            let (grad_bytes, model_bytes, round_factor) =
                (n.grad_bytes, n.model_bytes, n.round_factor);
            let (succession, observe) = (n.succession, n.observe);
            Arc::new(move |id: NodeId| NodeActor {
                id,
                transport: transport.at(id),
                compute: compute.clone(),
                grad_bytes,
                model_bytes,
                round_factor,
                counters: counters.clone(),
                t0,
                succession: succession.clone(),
                observe,
            })
        };
        let supervisor = SupervisorActor {
            make_node,
            transport: self.transport.clone(),
            heartbeat: n.heartbeat,
            nodes: n.ids,
            first_start: n.first_start,
            trace: self.trace.clone(),
            t0: self.t0,
        };
        let (sup, _) = Actor::spawn(None, supervisor, ())
            .await
            .map_err(|source| LaunchError {
                what: "node actors",
                source,
            })?;
        Ok(sup)
    }

    /// Start the checkpoint actor; complete checkpoints go to `store`.
    pub async fn checkpoints(
        &self,
        store: Arc<dyn Store>,
        bytes_per_elem: u64,
    ) -> Result<ActorRef<CkMsg>, LaunchError> {
        let actor = CheckpointActor {
            transport: self.transport.clone(),
            store,
            log: self.log.clone(),
            trace: self.trace.clone(),
            t0: self.t0,
            bytes_per_elem,
            term: self.term,
        };
        let (ck, _) = Actor::spawn(None, actor, ())
            .await
            .map_err(|source| LaunchError {
                what: "checkpoint actor",
                source,
            })?;
        Ok(ck)
    }

    /// Start the coordinator, consulting its failure detector every `tick`. The receiver
    /// fires when the run has finished.
    pub async fn coordinator(
        &self,
        config: Config,
        tick: Duration,
    ) -> Result<(ActorRef<CoordMsg>, oneshot::Receiver<()>), LaunchError> {
        self.spawn_coordinator(config, tick, None).await
    }

    /// Start a successor's coordinator (fail-over): of the term in `replica`, hosted here,
    /// after the one hosted by `predecessor` was lost. The receiver fires when the run has
    /// finished.
    pub async fn successor(
        &self,
        config: Config,
        replica: Replica,
        predecessor: NodeId,
        tick: Duration,
    ) -> Result<(ActorRef<CoordMsg>, oneshot::Receiver<()>), LaunchError> {
        self.spawn_coordinator(config, tick, Some((replica, predecessor)))
            .await
    }

    async fn spawn_coordinator(
        &self,
        config: Config,
        tick: Duration,
        succeeds: Option<(Replica, NodeId)>,
    ) -> Result<(ActorRef<CoordMsg>, oneshot::Receiver<()>), LaunchError> {
        let (done_tx, done_rx) = oneshot::channel();
        if let Some((r, _)) = &succeeds {
            self.log.raise_fence(r.term);
        }
        let actor = CoordinatorActor {
            transport: self.transport.clone(),
            config,
            tick,
            t0: self.t0,
            trace: self.trace.clone(),
            log: self.log.clone(),
            succeeds,
        };
        let (coord, _) =
            Actor::spawn(None, actor, done_tx)
                .await
                .map_err(|source| LaunchError {
                    what: "coordinator",
                    source,
                })?;
        Ok((coord, done_rx))
    }
}
