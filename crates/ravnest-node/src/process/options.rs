//! What a node process is asked to do, and what its parts share: the options, the error type,
//! which node coordinates, and small helpers. A leaf: it imports none of its siblings.

use std::path::PathBuf;
use std::time::Duration;

use ravnest_core::{NodeId, PlannerKind, Scenario};

/// Why a node process could not start or finish its run. Each message names the file, the node
/// or the field it is about.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The cluster file or the command line asks for something this run cannot do.
    #[error("{0}")]
    Config(String),
    /// The dataset could not be read.
    #[error(transparent)]
    Data(#[from] ravnest_train::data::DataError),
    /// The node's device cannot be used.
    #[error("{origin}: node `{node}`: {reason}")]
    Device {
        /// The cluster file.
        origin: String,
        /// The node.
        node: String,
        /// Why (in the message itself, not as a source: said once).
        reason: ravnest_train::device::DeviceError,
    },
    /// The checkpoint folder is not this run's to write, or cannot be cleared.
    #[error(transparent)]
    Guard(#[from] ravnest_train::store::GuardError),
    /// A checkpoint to resume from could not be read.
    #[error(transparent)]
    Checkpoint(#[from] ravnest_train::store::LoadError),
    /// The network or the runtime could not be set up.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// An actor could not be started.
    #[error(transparent)]
    Launch(#[from] ravnest_runtime::LaunchError),
    /// Too few nodes registered in time.
    #[error("{0}")]
    Registration(String),
    /// No plan fits the nodes that registered.
    #[error("{0}")]
    NoPlan(String),
    /// Training stopped before its last step.
    #[error("training stopped: {0}")]
    Stopped(String),
    /// A worker lost its coordinator.
    #[error("{0}")]
    CoordinatorLost(String),
    /// This process coordinated an older term and a newer one took over (it was cut off or
    /// frozen past the failure timeout): it stepped down and leaves the run, which goes on.
    #[error("{0}")]
    SteppedDown(String),
}

/// The exit code of a node process that stepped down as a stale coordinator
/// ([`RunError::SteppedDown`]): the local launcher counts it as a lost node, not a failure.
pub const STEPPED_DOWN_EXIT: i32 = 4;

/// What one process is asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cluster file, parsed.
    pub scenario: Scenario,
    /// Its name, for messages.
    pub origin: String,
    /// This process's node name.
    pub node: String,
    /// Where checkpoints go (on the coordinator's host).
    pub out_dir: PathBuf,
    /// Continue from the latest checkpoint in `out_dir`.
    pub resume: bool,
    /// Rejoin a running cluster (a restarted worker).
    pub join: bool,
    /// JSON lines on stdout instead of text on stderr.
    pub json: bool,
    /// How long the coordinator waits for every node to register.
    pub register_timeout: Duration,
    /// The planner (`uniform` is the equal-split baseline).
    pub planner: PlannerKind,
    /// Print nothing (benchmarks).
    pub quiet: bool,
    /// The cluster file as handed to a joiner (`ravnest run --join HOST:PORT`); see
    /// [`super::share_document`].
    pub share: Option<String>,
    /// Put this node's activity spans in its report (for `run --timeline`).
    pub spans: bool,
    /// The address peers dial for this node, when not the file's (`--advertise`); the
    /// coordinator's host passes it on.
    pub advertise: Option<String>,
    /// Delete the checkpoints already in `out_dir` (otherwise a run refuses to write over
    /// them, unless it resumes from them).
    pub overwrite: bool,
    /// Compute here instead of the node's `device` (`run --device cpu|cuda[:N]`).
    pub device: Option<String>,
    /// When to announce this node on the LAN by mDNS, for `run --discover` (see
    /// [`crate::discover`]).
    pub announce: crate::discover::Announce,
    /// A node not in the cluster file, joining a running cluster (`--join` with a new name):
    /// it registers its name, address and measurements, and is admitted as the next node.
    pub newcomer: bool,
    /// Watches every event this process says (`run --node --dashboard`).
    pub observe: Option<crate::events::Observer>,
}

/// The node whose host coordinates: the configured one, else the first.
pub(super) fn coordinator_of(s: &Scenario) -> NodeId {
    s.run.coordinator.unwrap_or(NodeId(0))
}

/// Aborts a task when dropped (when the function that started it returns, by any path).
pub(super) struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Steps a report leaves out as warm-up: a tenth of the run, at most 20.
pub fn warmup_steps(steps: u64) -> u64 {
    (steps / 10).min(20)
}

/// How long every node measures itself, together, before training.
pub const CALIBRATE_MS: u64 = 800;
