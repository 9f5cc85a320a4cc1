//! The coordinator's actor: the pure state machine
//! ([`ravnest_protocol::coordinator::core::Coordinator`], in the protocol crate) that plans
//! epochs, watches heartbeats, agrees steps, halts and re-plans on a loss, and lets nodes join,
//! carried by a thin actor ([`actor::CoordinatorActor`]); and the run's [`Journal`].

pub mod actor;
use ravnest_protocol::coordinator::Event;

use std::collections::BTreeMap;
use std::sync::{Arc, LockResult, Mutex, MutexGuard};

use tokio::sync::mpsc;

pub use actor::{CoordMsg, CoordinatorActor, spawn_leases};

/// The coordinator's log: events with their times, and each step's agreement time.
#[derive(Debug, Clone, Default)]
pub struct RunLog {
    /// (ns since start, event).
    pub events: Vec<(u64, Event)>,
    /// Agreement time of each step, ns since start.
    pub step_done_ns: Vec<u64>,
    /// Whether the run used local SGD (replicas agree only after averaging rounds).
    pub local_sgd: bool,
    /// The model digest every replica reported, per synchronized version.
    pub synced_digest: BTreeMap<u64, u64>,
    /// The last step recorded as agreed: a successor coordinator (fail-over) that agrees it
    /// again into the same journal is not counted twice.
    pub last_step: Option<u64>,
    /// Checkpoint rounds opened: (model version, ns since start).
    pub checkpoint_opened: Vec<(u64, u64)>,
}

/// What a [`Journal`] tells its listeners, as it happens.
#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    /// An event was recorded at this time (ns since start).
    Event(u64, Event),
    /// A step was agreed; `steps` are agreed in all (since this run's start step).
    Agreed {
        /// Steps agreed so far.
        steps: usize,
    },
    /// A checkpoint round of model version `step` was opened.
    CheckpointOpened {
        /// The version.
        step: u64,
    },
    /// A node reported a finished step with its timings (`Envelope::StepDone`): what a live
    /// view draws of the nodes that are not this process's. Told, not recorded.
    Stepped {
        /// The node.
        node: ravnest_core::NodeId,
        /// The step.
        step: u64,
        /// Ns it computed its share.
        compute_ns: u64,
        /// Ns of communication its compute did not hide.
        comm_ns: u64,
    },
}

/// The run's log and who listens to it. The coordinator and the checkpoint actor record into
/// it; observers (the console relay, `events.jsonl`, shutdown, the simulator's progress line)
/// [`subscribe`](Journal::subscribe) and are told as it happens, instead of polling.
#[derive(Debug, Default)]
pub struct Journal {
    log: Mutex<RunLog>,
    listeners: Mutex<Vec<mpsc::UnboundedSender<Note>>>,
    /// The newest coordinator term that started on this journal: a coordinator (and its
    /// checkpoint actor) of an older one is stale, and what it records is left out. One
    /// process hosts one coordinator at a time in `ravnest run`, so this matters where a
    /// journal outlives a take-over: the simulator, where a stale coordinator goes on until a
    /// node tells it of the newer term.
    fence: std::sync::atomic::AtomicU32,
}

impl Journal {
    /// A coordinator of `term` starts on this journal: those of older terms are stale.
    pub fn raise_fence(&self, term: u32) {
        self.fence
            .fetch_max(term, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether a coordinator of `term` is stale here (a newer term started on this journal).
    pub fn fenced(&self, term: u32) -> bool {
        term < self.fence.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The log, locked (for reading, or for fields without listeners).
    pub fn lock(&self) -> LockResult<MutexGuard<'_, RunLog>> {
        self.log.lock()
    }

    /// A copy of the log as it is now.
    pub fn snapshot(&self) -> RunLog {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Tell every listener; forget those that stopped listening.
    fn tell(&self, note: Note) {
        let mut ls = self.listeners.lock().unwrap_or_else(|p| p.into_inner());
        ls.retain(|l| l.send(note.clone()).is_ok());
    }

    /// Record an event at `t_ns`.
    pub fn event(&self, t_ns: u64, e: Event) {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .events
            .push((t_ns, e.clone()));
        self.tell(Note::Event(t_ns, e));
    }

    /// Record that `step` was agreed at `t_ns`, with the digest every replica reported.
    pub fn agreed(&self, t_ns: u64, step: u64, digest: Option<u64>) {
        let steps = {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            if log.last_step.is_some_and(|l| step <= l) {
                // Agreed again (a successor redid it): counted once, and the version is the
                // one agreed last (another plan may sum the batch in another order).
                if let Some(d) = digest {
                    log.synced_digest.insert(step + 1, d);
                }
                return;
            }
            log.last_step = Some(step);
            log.step_done_ns.push(t_ns);
            if let Some(d) = digest {
                log.synced_digest.insert(step + 1, d);
            }
            log.step_done_ns.len()
        };
        self.tell(Note::Agreed { steps });
    }

    /// Tell listeners that `node` reported `step` done with these timings (nothing is kept).
    pub fn stepped(&self, node: ravnest_core::NodeId, step: u64, compute_ns: u64, comm_ns: u64) {
        self.tell(Note::Stepped {
            node,
            step,
            compute_ns,
            comm_ns,
        });
    }

    /// Record that the checkpoint round of version `step` was opened at `t_ns`.
    pub fn checkpoint_opened(&self, t_ns: u64, step: u64) {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .checkpoint_opened
            .push((step, t_ns));
        self.tell(Note::CheckpointOpened { step });
    }

    /// Listen from now on: every later event and agreement arrives on the receiver.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Note> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tx);
        rx
    }
}

/// Shared handle on the log.
pub type SharedLog = Arc<Journal>;
