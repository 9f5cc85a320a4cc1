//! A node actor's state and messages: what `actor` (message handling) and `step` (the steps)
//! share, so that neither imports the other.

use std::sync::{Arc, OnceLock};

use ractor::ActorRef;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

use crate::collective::{CollectiveMsg, Group, Outcome};
use crate::measure::links::Probes;
use crate::seams::Compute;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_protocol::node::machine::Machine;

/// Messages a node actor handles.
#[derive(Debug)]
pub enum NodeMsg {
    /// An envelope from the network.
    Net(Addr, Envelope),
    /// The node's collective actor finished (or abandoned) a collective: its outcome waits in
    /// [`NodeState::outcomes`] (where a step whose compute runs takes it at once).
    Collective,
    /// Go on with the next step (sent to itself after each step, so that messages that came
    /// in meanwhile, a halt or a new epoch, are seen first).
    Advance,
    /// Fail-over: consult the watch over the coordinator.
    Watch,
}

/// A node's mutable state on backend `C`.
#[derive(Debug)]
pub struct NodeState<C: Compute> {
    pub(super) me: Option<ActorRef<NodeMsg>>,
    /// The node's decisions and its step in progress ([`Machine`]: everything between the
    /// computes).
    pub(super) node: Machine<C>,
    /// When the step in progress spent its time.
    pub(super) clock: Clock,
    pub(super) collective: Option<ActorRef<CollectiveMsg>>,
    /// The collectives' outcomes, in the order they ended.
    pub(super) outcomes: Option<UnboundedReceiver<Outcome>>,
    /// The sync group of the current epoch.
    pub(super) group: Option<(u64, Arc<Group>)>,
    /// The link probes under way.
    pub(super) probes: Probes,
    /// Fail-over: the watch over the coordinator's tick, and its ticker.
    pub(super) watcher: Option<crate::succession::Tick>,
    pub(super) watch_ticker: Option<tokio::task::JoinHandle<()>>,
}

impl<C: Compute> NodeState<C> {
    /// A node's state around its machine.
    pub(super) fn new(node: Machine<C>) -> Self {
        NodeState {
            me: None,
            node,
            clock: Clock::default(),
            collective: None,
            outcomes: None,
            group: None,
            probes: Probes::default(),
            watcher: None,
            watch_ticker: None,
        }
    }
}

/// When the step in progress ended its compute, and when backward handed its first bucket to
/// the all-reduce (set on the compute thread): the time its collectives took.
#[derive(Debug, Default)]
pub(super) struct Clock {
    pub(super) computed: Option<Instant>,
    pub(super) first_bucket: Option<Arc<OnceLock<Instant>>>,
}
