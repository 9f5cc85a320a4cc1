//! The coordinator actor: a thin shell over [`Coordinator`]. A message becomes an [`Input`]
//! with the current time; the [`Effect`]s that come back become sends, log lines and trace
//! entries. No decision is made here.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::NodeId;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::SharedLog;
use crate::seams::Transport;
use crate::trace::Trace;
use ravnest_protocol::coordinator::core::{Config, Coordinator, Effect, Input};
use ravnest_protocol::msg::{Addr, Envelope, Replica};

/// Read-only configuration of a coordinator actor.
#[derive(Debug)]
pub struct CoordinatorActor<T> {
    /// The network.
    pub transport: T,
    /// What the state machine is given.
    pub config: Config,
    /// How often the failure detector is consulted.
    pub tick: Duration,
    /// Start of time.
    pub t0: Instant,
    /// Trace.
    pub trace: Trace,
    /// Log.
    pub log: SharedLog,
    /// Fail-over: this coordinator succeeds a lost one (the new term's replica, and the lost
    /// coordinator's host).
    pub succeeds: Option<(Replica, NodeId)>,
}

/// Messages.
#[derive(Debug)]
pub enum CoordMsg {
    /// An envelope from the network.
    Net(Addr, Envelope),
    /// Consult the failure detector.
    Tick,
    /// The transport lost its connection to a node: evidence for the detector.
    PeerDown(NodeId),
    /// The user stopped the run (Ctrl-C, SIGTERM): end it early, cleanly.
    Stop,
}

/// Mutable state: the state machine, and who to tell when the run ends.
#[derive(Debug)]
pub struct CoordState {
    core: Coordinator,
    done: Option<oneshot::Sender<()>>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl<T: Transport> CoordinatorActor<T> {
    fn now_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    /// This coordinator's term (0 for the first; a successor's is its replica's).
    fn term(&self) -> u32 {
        self.succeeds.as_ref().map_or(0, |(r, _)| r.term)
    }

    fn execute(&self, st: &mut CoordState, effects: Vec<Effect>) {
        // A stale coordinator (a newer term started on this journal) still sends, as it does
        // not know, but records nothing: the run's log is the newer term's.
        let stale = self.log.fenced(self.term());
        for e in effects {
            if stale
                && !matches!(
                    e,
                    Effect::Send(..) | Effect::Checkpoint(_) | Effect::Finished
                )
            {
                continue;
            }
            match e {
                Effect::Send(to, env) => {
                    let _ = self.transport.send(Addr::Coordinator, Addr::Node(to), env);
                }
                Effect::Checkpoint(env) => {
                    if let Envelope::CheckpointBegin { step, .. } = &env
                        && !stale
                    {
                        self.log.checkpoint_opened(self.now_ns(), *step);
                    }
                    let _ = self
                        .transport
                        .send(Addr::Coordinator, Addr::Checkpoint, env);
                }
                Effect::Event(ev) => {
                    let t = self.now_ns();
                    self.trace.record(
                        t,
                        ev.kind(),
                        ev.node().map(Addr::Node),
                        Some(Addr::Coordinator),
                        0,
                    );
                    self.log.event(t, ev);
                }
                Effect::Agreed { step, digest } => {
                    self.log.agreed(self.now_ns(), step, digest);
                }
                Effect::RolledBack { to } => {
                    let keep = to.saturating_sub(self.config.start_step) as usize;
                    let mut log = self.log.lock().unwrap();
                    log.step_done_ns.truncate(keep);
                    log.last_step = to.checked_sub(1);
                }
                Effect::Finished => {
                    if !stale {
                        self.log.lock().unwrap().local_sgd = st.core.used_local_sgd();
                    }
                    if let Some(tx) = st.done.take() {
                        let _ = tx.send(());
                    }
                }
            }
        }
    }
}

impl<T: Transport> Actor for CoordinatorActor<T> {
    type Msg = CoordMsg;
    type State = CoordState;
    type Arguments = oneshot::Sender<()>;

    async fn pre_start(
        &self,
        myself: ActorRef<CoordMsg>,
        done: oneshot::Sender<()>,
    ) -> Result<CoordState, ActorProcessingErr> {
        self.transport.register(
            Addr::Coordinator,
            crate::seams::mailbox(myself.clone(), CoordMsg::Net),
        );
        let now_ms = self.t0.elapsed().as_millis() as u64;
        let mut st = CoordState {
            core: match &self.succeeds {
                Some((r, from)) => Coordinator::take_over(self.config.clone(), r, *from, now_ms),
                None => Coordinator::new(self.config.clone(), now_ms),
            },
            done: Some(done),
            ticker: Some(myself.send_interval(self.tick, || CoordMsg::Tick)),
        };
        let effects = st.core.start();
        self.execute(&mut st, effects);
        Ok(st)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<CoordMsg>,
        st: &mut CoordState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = st.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<CoordMsg>,
        msg: CoordMsg,
        st: &mut CoordState,
    ) -> Result<(), ActorProcessingErr> {
        // A node's step timings are for observers too (a live view of the other nodes).
        if let CoordMsg::Net(
            Addr::Node(from),
            Envelope::StepDone {
                step,
                compute_ns,
                comm_ns,
                ..
            },
        ) = &msg
            && !self.log.fenced(self.term())
        {
            self.log.stepped(*from, *step, *compute_ns, *comm_ns);
        }
        let input = match msg {
            CoordMsg::Tick => Input::Tick,
            CoordMsg::PeerDown(n) => Input::PeerDown(n),
            CoordMsg::Stop => Input::Stop,
            CoordMsg::Net(Addr::Node(from), env) => Input::Net(from, env),
            CoordMsg::Net(_, _) => return Ok(()),
        };
        let now_ms = self.t0.elapsed().as_millis() as u64;
        let effects = st.core.handle(now_ms, input);
        self.execute(st, effects);
        Ok(())
    }
}

/// The coordinator's leases (fail-over): [`Envelope::Lease`] of coordinator term `term`
/// hosted by `host`, from [`Addr::Coordinator`] to each of `nodes` every `period`, so that
/// every node, idle ones too, knows it is there, and a node that knows a newer term can tell
/// this one to step down ([`crate::seams::spawn_beats`]).
pub fn spawn_leases<T: Transport>(
    transport: T,
    nodes: Vec<NodeId>,
    period: Duration,
    (term, host): (u32, NodeId),
) -> tokio::task::JoinHandle<()> {
    let to = nodes.into_iter().map(Addr::Node).collect();
    let lease = Envelope::Lease { term, host };
    crate::seams::spawn_beats(transport, Addr::Coordinator, to, period, lease)
}
