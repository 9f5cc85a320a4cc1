//! The node's decisions as a state machine: `NodeCore::handle(Input) -> Vec<Effect>`, the
//! shape of the coordinator's [`crate::coordinator::core::Coordinator`]. It owns what decides
//! which step runs and what a peer or the coordinator is told: the epoch being run and the one
//! queued behind it (their grants, their end, their checkpoint duty), a halt, the versions
//! kept, the version being fetched from peers, and the peers' requests for versions not made
//! yet.
//!
//! What it leaves to whoever drives it (the runtime's node actor, the cluster harness of the
//! coordinator's tests): the model itself (a version is the backend's handle `M`, never looked
//! into here), the compute, the collectives, and whether a step is in progress. The driver
//! hands it [`Input::Advance`] when it is idle; [`Effect::Run`] says which step to run, and
//! [`Input::Made`] brings the version the step made.
//!
//! Reads no clock and does no I/O: the same inputs give the same effects.

use std::collections::BTreeSet;

use ravnest_core::{LayerRange, NodeId};

use super::epochs;
use super::versions::{Keep, Version, Versions};
use crate::msg::{Addr, Envelope, Work};

/// Requests for versions this node has not made yet, kept at most.
pub const REQUESTS_MAX: usize = 64;

/// What the node is told.
#[derive(Debug)]
pub enum Input<M> {
    /// A new epoch's work.
    Work(Box<Work>),
    /// The epoch's steps below `until` may start.
    Grant {
        /// The epoch granted.
        epoch: u64,
        /// The new horizon.
        until: u64,
    },
    /// The user stopped the run: it ends at version `at`, checkpointed there if `checkpoint`.
    StopAt {
        /// The last version.
        at: u64,
        /// Whether the end is checkpointed.
        checkpoint: bool,
    },
    /// Stop every step of `epoch` and earlier, and say what is held.
    Halt {
        /// The halt's epoch.
        epoch: u64,
    },
    /// The halt again, after the coordinator restored a checkpoint: `restored` is it (version
    /// and model, as the driver read it; `None` where it could not), kept as a synchronized
    /// whole version that training goes back to.
    Restored {
        /// The halt's epoch.
        epoch: u64,
        /// The restored version.
        restored: Option<(u64, M)>,
    },
    /// A peer asks for version `version` (of `layers`).
    StateRequest {
        /// The version.
        version: u64,
        /// The peer.
        to: NodeId,
        /// Its layers (`None`: the whole model).
        layers: Option<LayerRange>,
    },
    /// A piece of the version being fetched arrived and was read into `model` (on top of
    /// [`NodeCore::fetch_base`]); the driver asks [`NodeCore::fetch_base`] first whether it is
    /// wanted.
    Fetched {
        /// The version.
        version: u64,
        /// The layers that came (`None`: the whole model).
        layers: Option<LayerRange>,
        /// The model with them.
        model: M,
    },
    /// The driver is idle (no step in progress): start the next step if the epoch allows it.
    Advance,
    /// A step made a version.
    Made(Made<M>),
}

/// A version a step made: version `step + 1`.
#[derive(Debug)]
pub struct Made<M> {
    /// The step's epoch.
    pub epoch: u64,
    /// The step.
    pub step: u64,
    /// The new version's model.
    pub model: M,
    /// Whether every replica agreed on it.
    pub synced: bool,
    /// What of it is current: [`NodeCore::made_layers`] of the step's layers.
    pub layers: Option<LayerRange>,
    /// Its digest (0 where it is not synchronized).
    pub digest: u64,
    /// The step's compute.
    pub compute_ns: u64,
    /// The step's communication after its compute.
    pub comm_ns: u64,
}

/// What the driver does.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Send an envelope from this node.
    Send(Addr, Envelope),
    /// Drop the step in progress, if there is one (its epoch is over).
    Abandon,
    /// Epoch `epoch` is the one being run from step `step`: collectives of earlier epochs end,
    /// and inputs kept for earlier steps go.
    Activated {
        /// The epoch.
        epoch: u64,
        /// Its first step.
        step: u64,
    },
    /// Halted: collectives of `epoch` and earlier end.
    Halted {
        /// The halt's epoch.
        epoch: u64,
    },
    /// Send version `version` (of `layers`) to the peer `to` ([`NodeCore::version`] holds it).
    Serve {
        /// The version.
        version: u64,
        /// The peer.
        to: NodeId,
        /// The layers (`None`: the whole model).
        layers: Option<LayerRange>,
    },
    /// Keep only `layers` of version `version` (a fetch completed on a stage): the driver
    /// narrows the model and puts it back with [`NodeCore::set_model`].
    Narrow {
        /// The version.
        version: u64,
        /// Its layers.
        layers: LayerRange,
    },
    /// Run step `step` of the epoch (from version `step`, which is held).
    Run {
        /// The step.
        step: u64,
    },
    /// Write the checkpoint shard of `layers` of version `version` (this node's duty, due now).
    WriteShard {
        /// The version.
        version: u64,
        /// The shard's layers.
        layers: LayerRange,
    },
}

/// A version being fetched from peers before an epoch can start here: the whole model
/// (`whole`), or some layers (`missing`) on top of this node's own copy (`model`).
#[derive(Debug)]
struct Fetch<M> {
    version: u64,
    model: Option<M>,
    missing: BTreeSet<LayerRange>,
    whole: bool,
}

/// A node's decisions (`M`: the backend's model handle).
#[derive(Debug)]
pub struct NodeCore<M> {
    id: NodeId,
    /// The newest epoch seen.
    epoch: u64,
    /// The epoch being run.
    work: Option<Work>,
    /// The next epoch, from a step this node has not reached yet.
    next_work: Option<Work>,
    /// Stopped by a halt until the next epoch arrives.
    halted: bool,
    versions: Versions<M>,
    fetching: Option<Fetch<M>>,
    /// Versions asked for before this node had them: (version, who, layers).
    requests: Vec<(u64, NodeId, Option<LayerRange>)>,
}

impl<M: Clone> NodeCore<M> {
    /// Node `id`, holding no version (it restarted, or waits for a peer's).
    pub fn new(id: NodeId) -> Self {
        NodeCore {
            id,
            epoch: 0,
            work: None,
            next_work: None,
            halted: false,
            versions: Versions::default(),
            fetching: None,
            requests: Vec::new(),
        }
    }

    /// Node `id` at the start of a run: `model` is version `version`, whole and agreed on.
    pub fn fresh(id: NodeId, version: u64, model: M) -> Self {
        let mut core = Self::new(id);
        core.versions.insert(
            version,
            Version {
                model,
                synced: true,
                layers: None,
            },
        );
        core
    }

    /// This node.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The epoch being run.
    pub fn work(&self) -> Option<&Work> {
        self.work.as_ref()
    }

    /// The epoch queued behind it.
    pub fn next_work(&self) -> Option<&Work> {
        self.next_work.as_ref()
    }

    /// Whether a halt stopped the node (until the next epoch).
    pub fn halted(&self) -> bool {
        self.halted
    }

    /// Whether the node waits for a version from peers.
    pub fn fetching(&self) -> bool {
        self.fetching.is_some()
    }

    /// The versions kept.
    pub fn versions(&self) -> &Versions<M> {
        &self.versions
    }

    /// Version `v`, if kept.
    pub fn version(&self, v: u64) -> Option<&Version<M>> {
        self.versions.get(v)
    }

    /// The newest version kept.
    pub fn latest(&self) -> Option<u64> {
        self.versions.latest()
    }

    /// Replace version `v`'s model (after [`Effect::Narrow`]).
    pub fn set_model(&mut self, v: u64, model: M) {
        if let Some(x) = self.versions.take(v) {
            self.versions.insert(v, Version { model, ..x });
        }
    }

    /// Take version `v` out: a node that keeps one version makes the next one from it in place.
    pub fn take(&mut self, v: u64) -> Option<M> {
        self.versions.take(v).map(|x| x.model)
    }

    /// The versions that making version `v` (`synced` or not) will forget, taken out now so
    /// that the step can reuse their memory.
    pub fn doomed_by(&mut self, v: u64, synced: bool) -> Vec<M> {
        self.versions.doomed_by(v, synced)
    }

    /// What a version made by a step over `layers` is current for: the step's layers, else a
    /// sharded worker's part (it holds every weight beside it), else the whole model.
    pub fn made_layers(&self, layers: Option<LayerRange>) -> Option<LayerRange> {
        let shard = self.work.as_ref().and_then(|w| w.shard.as_ref());
        layers.or(shard.map(|s| s.owned))
    }

    /// Whether version `v` is the run's last.
    pub fn is_last(&self, v: u64) -> bool {
        self.work.as_ref().is_some_and(|w| v == w.end)
    }

    /// Whether a piece of version `version` (`layers`) is wanted by the fetch in progress:
    /// `Some(base)`, where the piece goes on top of `base` (`None`: it is read on its own).
    pub fn fetch_base(&self, version: u64, layers: Option<LayerRange>) -> Option<Option<&M>> {
        let f = self.fetching.as_ref().filter(|f| f.version == version)?;
        match layers {
            None if f.whole => Some(None),
            Some(l) if !f.whole && f.missing.contains(&l) => Some(f.model.as_ref()),
            _ => None,
        }
    }

    /// Handle one input.
    pub fn handle(&mut self, input: Input<M>) -> Vec<Effect> {
        let mut out = Vec::new();
        match input {
            Input::Work(w) => self.on_work(*w, &mut out),
            Input::Grant { epoch, until } => {
                for w in [&mut self.work, &mut self.next_work].into_iter().flatten() {
                    if w.epoch == epoch {
                        w.until = w.until.max(until);
                    }
                }
            }
            Input::StopAt { at, checkpoint } => self.on_stop_at(at, checkpoint),
            Input::Halt { epoch } => self.on_halt(epoch, &mut out),
            Input::Restored { epoch, restored } => {
                if let Some((version, model)) = restored {
                    self.versions.truncate_after(version);
                    self.versions.insert(
                        version,
                        Version {
                            model,
                            synced: true,
                            layers: None,
                        },
                    );
                }
                self.on_halt(epoch, &mut out);
            }
            Input::StateRequest {
                version,
                to,
                layers,
            } => self.on_state_request(version, to, layers, &mut out),
            Input::Fetched {
                version,
                layers,
                model,
            } => self.on_fetched(version, layers, model, &mut out),
            Input::Advance => self.advance(&mut out),
            Input::Made(m) => self.on_made(m, &mut out),
        }
        out
    }

    /// A new epoch. A node still running the previous one finishes that epoch's steps below
    /// the new one's first step, then switches; any other node switches now.
    fn on_work(&mut self, w: Work, out: &mut Vec<Effect>) {
        if w.epoch <= self.epoch {
            return;
        }
        self.epoch = w.epoch;
        // Where this node is headed: the version it fetches, else the newest it holds.
        let headed = self
            .fetching
            .as_ref()
            .map(|f| f.version)
            .or(self.versions.latest());
        if epochs::queues(self.work.as_ref(), self.halted, headed, &w) {
            self.next_work = Some(w);
        } else {
            out.push(Effect::Abandon);
            self.next_work = None;
            self.halted = false;
            self.activate(w, out);
        }
    }

    /// Make `w` the epoch being run: from its first step's version, which this node holds, or
    /// fetches (whole, or the layers it lacks).
    fn activate(&mut self, w: Work, out: &mut Vec<Effect>) {
        self.versions.truncate_after(w.step);
        self.fetching = None;
        out.push(Effect::Activated {
            epoch: w.epoch,
            step: w.step,
        });
        let fetch = match (&w.stage, &w.shard) {
            (Some(s), _) => s.fetch.clone(),
            (None, Some(s)) => s.fetch.clone(),
            (None, None) => Vec::new(),
        };
        // The only holder of its layers (a stage of a single pipeline, a sharded worker's part)
        // keeps one version.
        let alone = (w.stage.is_some() && w.ring.len() <= 1) || w.shard.is_some();
        self.versions
            .keep(if alone { Keep::One } else { Keep::Two });
        if !fetch.is_empty() {
            // The fetched layers go on top of what this node holds of that version.
            let model = self.versions.get(w.step).map(|v| v.model.clone());
            for &(peer, layers) in &fetch {
                out.push(self.ask_state(peer, w.step, Some(layers)));
            }
            self.fetching = Some(Fetch {
                version: w.step,
                model,
                missing: fetch.iter().map(|f| f.1).collect(),
                whole: false,
            });
        } else if self.versions.get(w.step).is_none()
            && let Some(peer) = w.state_from
        {
            // What this node holds is older than the epoch's start: stale. Reporting it after a
            // halt would pull the whole cluster back to it.
            self.versions = Versions::default();
            out.push(self.ask_state(peer, w.step, None));
            self.fetching = Some(Fetch {
                version: w.step,
                model: None,
                missing: BTreeSet::new(),
                whole: true,
            });
        }
        self.work = Some(w);
    }

    fn ask_state(&self, peer: NodeId, version: u64, layers: Option<LayerRange>) -> Effect {
        Effect::Send(
            Addr::Node(peer),
            Envelope::StateRequest {
                version,
                to: self.id,
                layers,
            },
        )
    }

    /// Start the next step if the epoch allows it: switch to the next epoch at its first step,
    /// stop at the grant or the run's end.
    fn advance(&mut self, out: &mut Vec<Effect>) {
        if self.fetching.is_some() || self.halted {
            return;
        }
        let Some(latest) = self.versions.latest() else {
            return;
        };
        if self
            .next_work
            .as_ref()
            .is_some_and(|n| epochs::starts(n, latest))
            && let Some(w) = self.next_work.take()
        {
            self.activate(w, out);
            if self.fetching.is_some() {
                return;
            }
        }
        let Some(w) = &self.work else { return };
        let s = self.versions.latest().unwrap_or(latest);
        if epochs::runs(w, s) {
            out.push(Effect::Run { step: s });
        }
    }

    /// The user stopped the run: it ends at version `at` (no step at or past it was started:
    /// the coordinator chose the grant's horizon), checkpointed there with `checkpoint`.
    fn on_stop_at(&mut self, at: u64, checkpoint: bool) {
        for w in [&mut self.work, &mut self.next_work].into_iter().flatten() {
            if w.end > at {
                w.end = at.max(w.step);
                w.until = w.until.min(w.end);
                if let Some(d) = w.checkpoint.as_mut() {
                    d.at_end |= checkpoint;
                }
            }
        }
    }

    /// Stop every step of `epoch` and earlier, and tell the coordinator what is held.
    fn on_halt(&mut self, epoch: u64, out: &mut Vec<Effect>) {
        out.push(Effect::Abandon);
        self.halted = true;
        self.next_work = None;
        self.fetching = None;
        out.push(Effect::Halted { epoch });
        out.push(Effect::Send(
            Addr::Coordinator,
            Envelope::Halted {
                epoch,
                held: self.versions.held(),
            },
        ));
    }

    /// A peer asks for a version: send it, or keep the request until this node makes it.
    fn on_state_request(
        &mut self,
        version: u64,
        to: NodeId,
        layers: Option<LayerRange>,
        out: &mut Vec<Effect>,
    ) {
        if self.versions.get(version).is_some() {
            out.push(Effect::Serve {
                version,
                to,
                layers,
            });
        } else if self.versions.latest().is_none_or(|l| version > l)
            && self.requests.len() < REQUESTS_MAX
        {
            self.requests.push((version, to, layers));
        }
    }

    /// Serve the requests waiting for a version this node just made.
    fn serve_requests(&mut self, out: &mut Vec<Effect>) {
        let Some(latest) = self.versions.latest() else {
            return;
        };
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.requests)
            .into_iter()
            .partition(|r| r.0 <= latest);
        self.requests = later;
        for (version, to, layers) in now {
            self.on_state_request(version, to, layers, out);
        }
    }

    /// A piece of the version being fetched; the fetch completes with its last one.
    fn on_fetched(
        &mut self,
        version: u64,
        layers: Option<LayerRange>,
        model: M,
        out: &mut Vec<Effect>,
    ) {
        if self.fetch_base(version, layers).is_none() {
            return;
        }
        let Some(f) = self.fetching.as_mut() else {
            return;
        };
        f.model = Some(model);
        if let Some(l) = layers {
            f.missing.remove(&l);
            if !f.missing.is_empty() {
                return;
            }
        }
        let Some(f) = self.fetching.take() else {
            return;
        };
        // A sharded worker holds every weight, and its part's optimizer state whole.
        let shard = self
            .work
            .as_ref()
            .and_then(|w| w.shard.as_ref())
            .map(|s| s.owned);
        let new = self.work.as_ref().and_then(Work::layers).or(shard);
        // The layers this node held at that version are still valid in it (the fetched ones
        // were copied in beside them): keep saying so, so that a fetch from here that is lost
        // (a reset, a halt) can be made again after a resync instead of finding no holder.
        let layers = match (self.versions.get(f.version).map(|v| v.layers), new) {
            (Some(None), _) => None,
            (Some(Some(o)), Some(n)) if o.start <= n.end && n.start <= o.end => {
                Some(LayerRange::new(o.start.min(n.start), o.end.max(n.end)))
            }
            _ => new,
        };
        let Some(model) = f.model else { return };
        self.versions.truncate_after(f.version);
        self.versions.insert(
            f.version,
            Version {
                model,
                synced: true,
                layers,
            },
        );
        if let Some(l) = layers
            && shard.is_none()
        {
            out.push(Effect::Narrow {
                version: f.version,
                layers: l,
            });
        }
    }

    /// Keep the version a step made, report it, write a checkpoint shard when one is due, and
    /// serve the peers waiting for it.
    fn on_made(&mut self, m: Made<M>, out: &mut Vec<Effect>) {
        let v = m.step + 1;
        self.versions.insert(
            v,
            Version {
                model: m.model,
                synced: m.synced,
                layers: m.layers,
            },
        );
        out.push(Effect::Send(
            Addr::Coordinator,
            Envelope::StepDone {
                epoch: m.epoch,
                step: m.step,
                digest: m.digest,
                compute_ns: m.compute_ns,
                comm_ns: m.comm_ns,
            },
        ));
        if m.synced
            && let Some(w) = self.work.as_mut()
            && let Some(duty) = w.checkpoint.as_mut()
        {
            let due = duty.due(v, w.end);
            duty.advance(v, w.end);
            if due {
                out.push(Effect::WriteShard {
                    version: v,
                    layers: duty.layers,
                });
            }
        }
        self.serve_requests(out);
    }
}

#[cfg(test)]
mod tests;
