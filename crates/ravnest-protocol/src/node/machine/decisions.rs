//! The node's decisions as the machine carries them out: an envelope or an input into the
//! [`NodeCore`](crate::node::core::NodeCore), and its effects that need the backend's values (a version served, narrowed,
//! fetched, restored) done here; the rest become acts.

use ravnest_core::{LayerRange, NodeId};

use super::{Act, Machine, Then};
use crate::msg::{Addr, Envelope};
use crate::node::core::{Effect, Input};
use crate::node::stage::StageInput;
use crate::node::values::Values;

impl<V: Values> Machine<V> {
    /// Hand the node's decisions an input; what they decide becomes acts (a step to run is
    /// [`Machine::advance`]'s).
    pub fn handle(&mut self, input: Input<V::Model>) {
        let effects = self.core.handle(input);
        self.effects(effects);
    }

    /// The driver is idle: the step to run next, if the decisions allow one (see
    /// [`Machine::begin`]).
    pub fn advance(&mut self) -> Option<u64> {
        if self.busy() {
            return None;
        }
        let effects = self.core.handle(Input::Advance);
        self.effects(effects)
    }

    /// An envelope for this node: what it means to its decisions or its step, and what the
    /// driver does next ([`Then`]); one that is not theirs (a calibration, a collective's
    /// message, a probe, one addressed elsewhere) comes back.
    pub fn on_envelope(&mut self, env: Envelope) -> Result<Then, Envelope> {
        let input = match env {
            Envelope::Work(w) => Input::Work(w),
            Envelope::Grant { epoch, until } => Input::Grant { epoch, until },
            Envelope::StopAt { at, checkpoint } => Input::StopAt { at, checkpoint },
            Envelope::Halt { epoch } => {
                self.handle(Input::Halt { epoch });
                return Ok(Then::Nothing);
            }
            Envelope::StateRequest {
                version,
                to,
                layers,
            } => {
                self.handle(Input::StateRequest {
                    version,
                    to,
                    layers,
                });
                return Ok(Then::Nothing);
            }
            Envelope::Restored { epoch, checkpoint } => {
                self.restored(epoch, checkpoint);
                return Ok(Then::Nothing);
            }
            Envelope::State {
                version,
                model,
                layers,
                ..
            } => {
                self.fetched(version, model, layers);
                return Ok(Then::Advance);
            }
            Envelope::GradNorm {
                epoch,
                step,
                part,
                sq,
            } => {
                self.grad_norm((epoch, step), part, sq);
                return Ok(Then::Nothing);
            }
            env @ (Envelope::Activation { .. } | Envelope::ActivationGrad { .. }) => {
                let fed = StageInput::of(env).is_ok_and(|input| self.stage_input(input));
                return Ok(if fed { Then::Pump } else { Then::Nothing });
            }
            env => return Err(env),
        };
        self.handle(input);
        Ok(Then::Advance)
    }

    /// Carry out the decisions' effects that need the values; the rest become acts. The step
    /// to run, if they say one.
    fn effects(&mut self, effects: Vec<Effect>) -> Option<u64> {
        let mut run = None;
        for e in effects {
            match e {
                Effect::Send(to, env) => self.acts.push(Act::Send(to, env)),
                Effect::Abandon => {
                    if self.abandon() {
                        self.acts.push(Act::Aborted);
                    }
                }
                Effect::Activated { epoch, step } => {
                    self.early.activated(epoch, step);
                    self.acts.push(Act::Halt(epoch.saturating_sub(1)));
                }
                Effect::Halted { epoch } => self.acts.push(Act::Halt(epoch)),
                Effect::Serve {
                    version,
                    to,
                    layers,
                } => self.serve(version, to, layers),
                Effect::Narrow { version, layers } => {
                    if let Some(v) = self.core.version(version) {
                        let narrowed = self.values.retain(&v.model, layers);
                        self.core.set_model(version, narrowed);
                    }
                }
                Effect::WriteShard { version, layers } => {
                    self.acts.push(Act::WriteShard { version, layers })
                }
                Effect::Run { step } => run = Some(step),
            }
        }
        run
    }

    /// Send version `version` (of `layers`) to peer `to`.
    fn serve(&mut self, version: u64, to: NodeId, layers: Option<LayerRange>) {
        let Some(v) = self.core.version(version) else {
            return;
        };
        if let Some(part) = self.values.export(&v.model, layers) {
            let len = self.values.model_len().max(1) as u64;
            let env = Envelope::State {
                version,
                virtual_bytes: self.sizes.model_bytes * part.len() as u64 / len,
                model: part,
                layers,
            };
            self.acts.push(Act::Send(Addr::Node(to), env));
        }
    }

    /// A version (or `layers` of one) from a peer, read on top of what the fetch holds.
    pub fn fetched(&mut self, version: u64, values: Vec<f32>, layers: Option<LayerRange>) {
        let Some(base) = self.core.fetch_base(version, layers) else {
            return;
        };
        let Ok(model) = self.values.import(base, layers, values) else {
            return;
        };
        self.handle(Input::Fetched {
            version,
            layers,
            model,
        });
    }

    /// The latest checkpoint (version, values), to restore layers held only by lost nodes
    /// from; `None`: the run's start (the seeded model, or the checkpoint a resumed run started
    /// from).
    pub fn restored(&mut self, epoch: u64, checkpoint: Option<(u64, Vec<f32>)>) {
        let restored = match checkpoint {
            Some((version, values)) => self
                .values
                .import(None, None, values)
                .ok()
                .map(|m| (version, m)),
            None => Some((self.values.initial_version(), self.values.initial(None))),
        };
        self.handle(Input::Restored { epoch, restored });
    }
}
