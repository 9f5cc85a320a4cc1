//! The trace's digest of an envelope: FNV-1a over the fields that matter, so that the
//! simulator's golden trace hashes move only when what travels does.

use super::{CollId, CollMsg, Envelope, Fnv};
impl Envelope {
    /// A digest of the payload for the trace (FNV-1a over the fields that matter).
    pub fn digest(&self) -> u64 {
        let mut h = Fnv::default();
        let _ = self.digest_control(&mut h)
            || self.digest_training(&mut h)
            || self.digest_state(&mut h);
        h.finish()
    }

    /// Digest the fields of registration, probes, measurement, grants, halts and reports; false for any other envelope.
    fn digest_control(&self, h: &mut Fnv) -> bool {
        match self {
            Envelope::Heartbeat | Envelope::Join | Envelope::Finish | Envelope::Leave => {}
            Envelope::Register(c) => {
                h.u64(c.flops.to_bits());
                h.u64(c.memory_bytes);
            }
            Envelope::Probe { id, data, echo } => {
                h.u64(*id);
                h.u64(data.len() as u64);
                h.u64(u64::from(*echo));
            }
            Envelope::ProbePeers { peers } => {
                for p in peers {
                    h.u64(u64::from(p.0));
                }
            }
            Envelope::LinkReport { links } => {
                for (p, lat, bw) in links {
                    h.u64(u64::from(p.0));
                    h.u64(lat.to_bits());
                    h.u64(bw.to_bits());
                }
            }
            Envelope::Grant { epoch, until } => {
                h.u64(*epoch);
                h.u64(*until);
            }
            Envelope::StopAt { at, checkpoint } => {
                h.u64(*at);
                h.u64(u64::from(*checkpoint));
            }
            Envelope::Measure { batch, duration_ms } => {
                h.u64(*batch);
                h.u64(*duration_ms);
            }
            Envelope::Measured {
                samples_per_s,
                per_sample_s,
                overhead_s,
            } => {
                for x in [samples_per_s, per_sample_s, overhead_s] {
                    h.u64(x.to_bits());
                }
            }
            Envelope::Halt { epoch } => h.u64(*epoch),
            Envelope::Halted { epoch, held } => {
                h.u64(*epoch);
                for v in held {
                    h.u64(v.version);
                    h.u64(u64::from(v.synced));
                }
            }
            Envelope::Address { node, addr } => {
                h.u64(u64::from(node.0));
                h.bytes(addr.as_bytes());
            }
            Envelope::Report(text) | Envelope::Summary(text) => h.bytes(text.as_bytes()),
            Envelope::Member { id, name, address } | Envelope::Reserve { id, name, address } => {
                h.u64(u64::from(id.0));
                h.bytes(name.as_bytes());
                h.bytes(address.as_bytes());
            }
            Envelope::Lease { term, host } => {
                h.u64(u64::from(*term));
                h.u64(u64::from(host.0));
            }
            Envelope::PreVote { term } => h.u64(u64::from(*term)),
            Envelope::GradNorm {
                epoch,
                step,
                part,
                sq,
            } => {
                h.u64(*epoch);
                h.u64(*step);
                h.u64(u64::from(*part));
                h.u64(sq.to_bits());
            }
            Envelope::PreVoted { term, granted } => {
                h.u64(u64::from(*term));
                h.u64(u64::from(*granted));
            }
            Envelope::Succession(r) => {
                for x in [
                    u64::from(r.term),
                    u64::from(r.host.0),
                    r.epoch,
                    r.floor,
                    r.agreed,
                ] {
                    h.u64(x);
                }
                for m in r.members.iter().chain(&r.reserved) {
                    h.u64(u64::from(m.0));
                }
            }
            _ => return false,
        }
        true
    }

    /// Digest the fields of work, activations, collectives and step reports; false for any other envelope.
    fn digest_training(&self, h: &mut Fnv) -> bool {
        match self {
            Envelope::Work(w) => {
                for x in [w.epoch, w.step, w.until, w.offset, w.batch, w.global_batch] {
                    h.u64(x);
                }
                for n in &w.ring {
                    h.u64(u64::from(n.0));
                }
                if let Some(e) = w.outer_from {
                    h.u64(e);
                }
                if let Some(sw) = &w.stage {
                    for x in [
                        u64::from(sw.stage),
                        u64::from(sw.layers.start),
                        u64::from(sw.layers.end),
                        sw.micro_batch,
                    ] {
                        h.u64(x);
                    }
                }
            }
            Envelope::Activation {
                epoch,
                step,
                micro,
                data,
                ..
            }
            | Envelope::ActivationGrad {
                epoch,
                step,
                micro,
                data,
                ..
            } => {
                h.u64(*epoch);
                h.u64(*step);
                h.u64(u64::from(*micro));
                for x in data {
                    h.u64(u64::from(x.to_bits()));
                }
            }
            Envelope::StepFailed { epoch, reason } => {
                h.u64(*epoch);
                h.bytes(reason.as_bytes());
            }
            Envelope::Coll { msg, .. } => {
                let id: CollId = msg.id();
                h.u64(id.epoch);
                h.u64(id.step);
                h.u64(u64::from(id.bucket));
                if let CollMsg::Chunk(c) = msg {
                    h.u64(c.step as u64);
                    h.u64(c.chunk as u64);
                    h.u64(u64::from(c.seg));
                }
                for x in msg.data() {
                    h.u64(u64::from(x.to_bits()));
                }
            }
            Envelope::StepDone {
                epoch,
                step,
                digest,
                compute_ns,
                comm_ns,
            } => {
                h.u64(*epoch);
                h.u64(*step);
                h.u64(*digest);
                h.u64(*compute_ns);
                h.u64(*comm_ns);
            }
            _ => return false,
        }
        true
    }

    /// Digest the fields of checkpoints and model state; false for any other envelope.
    fn digest_state(&self, h: &mut Fnv) -> bool {
        match self {
            Envelope::CheckpointBegin { step, shards } => {
                h.u64(*step);
                for (layers, d) in shards {
                    h.u64(u64::from(layers.start));
                    h.u64(u64::from(layers.end));
                    h.u64(*d);
                }
            }
            Envelope::CheckpointAbandon { step } => h.u64(*step),
            Envelope::Shard {
                step,
                layers,
                digest,
                ..
            } => {
                h.u64(*step);
                h.u64(u64::from(layers.start));
                h.u64(u64::from(layers.end));
                h.u64(*digest);
            }
            Envelope::StateRequest {
                version,
                to,
                layers,
            } => {
                h.u64(*version);
                h.u64(u64::from(to.0));
                if let Some(layers) = layers {
                    h.u64(u64::from(layers.start));
                    h.u64(u64::from(layers.end));
                }
            }
            Envelope::State {
                version,
                model,
                layers,
                ..
            } => {
                h.u64(*version);
                if let Some(layers) = layers {
                    h.u64(u64::from(layers.start));
                    h.u64(u64::from(layers.end));
                }
                for x in model {
                    h.u64(u64::from(x.to_bits()));
                }
            }
            _ => return false,
        }
        true
    }
}
