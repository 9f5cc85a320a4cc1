//! Link measurement: round trips of a small and a large echo probe between this node and each
//! peer, best of three, reported to the coordinator (`ProbePeers` → `LinkReport`). A round
//! runs as a task beside the node actor, which hands it the echoes by id.

use std::ops::Range;
use std::time::Duration;

use ravnest_core::NodeId;
use tokio::time::Instant;

use crate::seams::Transport;
use ravnest_protocol::msg::{Addr, Envelope};

/// Where the echoes of a round of link probes go: the ids it uses, and its task's inbox.
pub(crate) type ProbeRound = (Range<u64>, tokio::sync::mpsc::UnboundedSender<u64>);

/// Elements of the small probe (latency) and of the large one (bandwidth: 1 MiB).
pub const PROBE_SMALL: usize = 16;
/// See [`PROBE_SMALL`].
pub const PROBE_LARGE: usize = 1 << 18;

/// A link's (latency ms, bandwidth Gbit/s) from the best round trips of a small and a large
/// echo probe ([`PROBE_SMALL`], [`PROBE_LARGE`] elements): latency is half the small round
/// trip; the large one carries 2 x 1 MiB more than the small one in its extra time.
pub fn link_from_round_trips(small_s: f64, large_s: f64) -> (f64, f64) {
    let extra_bits = 2.0 * 4.0 * (PROBE_LARGE - PROBE_SMALL) as f64 * 8.0;
    let gbps = (extra_bits / (large_s - small_s).max(1e-6) / 1e9).min(400.0);
    (small_s / 2.0 * 1e3, gbps)
}

/// Measure the links from `me` to `peers` (best of three round trips each, with the ids from
/// `first` on) and report them to the coordinator. Runs beside the actor, which hands it the
/// echoes by the round it returns.
fn spawn_link_probes<T: Transport>(
    transport: T,
    me: NodeId,
    peers: Vec<NodeId>,
    first: u64,
) -> ProbeRound {
    let ids = first..first + 6 * peers.len() as u64 + 1;
    let (tx, mut echoes) = tokio::sync::mpsc::unbounded_channel::<u64>();
    tokio::spawn(async move {
        let mut id = first;
        let mut links = Vec::new();
        for peer in peers {
            let mut best = [f64::INFINITY; 2];
            for (k, len) in [(0, PROBE_SMALL), (1, PROBE_LARGE)] {
                for _ in 0..3 {
                    id += 1;
                    let t = Instant::now();
                    let sent = transport.send(
                        Addr::Node(me),
                        Addr::Node(peer),
                        Envelope::Probe {
                            id,
                            data: vec![0.0; len],
                            echo: true,
                        },
                    );
                    // An echo of an earlier probe that timed out is passed over.
                    let echoed = async {
                        while let Some(got) = echoes.recv().await {
                            if got == id {
                                return true;
                            }
                        }
                        false
                    };
                    if sent.is_ok()
                        && matches!(
                            tokio::time::timeout(Duration::from_secs(5), echoed).await,
                            Ok(true)
                        )
                    {
                        best[k] = best[k].min(t.elapsed().as_secs_f64());
                    }
                }
            }
            if best.iter().all(|b| b.is_finite()) {
                let (lat, gbps) = link_from_round_trips(best[0], best[1]);
                links.push((peer, lat, gbps));
            }
        }
        let _ = transport.send(
            Addr::Node(me),
            Addr::Coordinator,
            Envelope::LinkReport { links },
        );
    });
    (ids, tx)
}

/// A node's link probes: the rounds it runs (each beside the node, handed its echoes by id),
/// and its echo of its peers' probes.
#[derive(Debug, Default)]
pub(crate) struct Probes {
    rounds: Vec<ProbeRound>,
    seq: u64,
}

impl Probes {
    /// An envelope to node `me` from `from`: a probe's is handled here (a round started on
    /// [`Envelope::ProbePeers`], a peer's probe echoed, an echo handed to its round); any
    /// other comes back.
    pub(crate) fn on_envelope<T: Transport>(
        &mut self,
        transport: &T,
        me: NodeId,
        from: Addr,
        env: Envelope,
    ) -> Result<(), Envelope> {
        match env {
            Envelope::ProbePeers { peers } => {
                // Ids unique to this node: its id in the high bits.
                let first = (u64::from(me.0) << 40) + self.seq;
                self.seq += 6 * peers.len() as u64 + 1;
                self.rounds.retain(|(_, tx)| !tx.is_closed());
                let round = spawn_link_probes(transport.clone(), me, peers, first);
                self.rounds.push(round);
            }
            Envelope::Probe {
                id, echo: false, ..
            } => {
                if let Some((_, tx)) = self.rounds.iter().find(|(ids, _)| ids.contains(&id)) {
                    let _ = tx.send(id);
                }
            }
            Envelope::Probe {
                id,
                data,
                echo: true,
            } => {
                let echo = Envelope::Probe {
                    id,
                    data,
                    echo: false,
                };
                let _ = transport.send(Addr::Node(me), from, echo);
            }
            env => return Err(env),
        }
        Ok(())
    }
}
