//! One report for the run, the same on every node: the coordinator's host collects every
//! worker's report and sends the merged whole back; each node prints it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::Transport;
use ravnest_runtime::tcp::TcpTransport;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::options::Options;
use super::setup::Setup;
use super::tap::Tap;
use crate::summary::{NodeReport, NodeRow, RunReport};
use ravnest_core::profile::RunFigures;

/// On the coordinator's host: the workers' reports (for at most 3 s), merged with this node's
/// into the run's summary, which every node still in the run (or that answered) is sent.
pub(super) async fn collect(
    opts: &Options,
    su: &Setup,
    tcp: &TcpTransport,
    mut mine: NodeReport,
    mut reports: mpsc::UnboundedReceiver<(Addr, Envelope)>,
    expected: Vec<NodeId>,
) -> RunReport {
    let s = &opts.scenario;
    let mut got: BTreeMap<NodeId, NodeReport> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(3);
    while !expected.iter().all(|id| got.contains_key(id)) {
        match tokio::time::timeout_at(deadline, reports.recv()).await {
            Ok(Some((Addr::Node(from), Envelope::Report(text)))) => {
                if let Ok(v) = serde_json::from_str::<NodeReport>(&text) {
                    got.insert(from, v);
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    let inputs = mine
        .coordinator
        .as_mut()
        .and_then(|c| c.profile_inputs.take());
    let profile_file = write_profile(opts, inputs, &mine, &got);
    if let Some(c) = mine.coordinator.as_mut() {
        c.profile_file = profile_file;
    }
    // The steps are in the profile now: the summary every node prints leaves them out.
    mine.steady_steps = Vec::new();
    for r in got.values_mut() {
        r.steady_steps = Vec::new();
    }
    let recipients: BTreeSet<NodeId> = expected.iter().chain(got.keys()).copied().collect();
    let nodes: Vec<NodeRow> = s
        .cluster
        .ids()
        .map(|id| NodeRow {
            node: s.cluster.nodes[id.index()].name.clone(),
            report: if id == su.me {
                Some(mine.clone())
            } else {
                got.remove(&id)
            },
        })
        .collect();
    let mut merged = RunReport {
        cluster: s.cluster.name.clone(),
        coordinator: Some(mine),
        nodes,
        failed: Vec::new(),
    };
    merged.measure_pipeline();
    let text = serde_json::to_string(&merged).unwrap_or_default();
    for &id in &recipients {
        let _ = tcp.send(
            Addr::Coordinator,
            Addr::Node(id),
            Envelope::Summary(text.clone()),
        );
    }
    let _ = tcp.drain(Duration::from_secs(3)).await;
    merged
}

/// Fit the run's profile from what each node recorded of its steady steps (`inputs`: the
/// coordinator's figures) and write it to `profile.toml` in the output folder: its path, or
/// `None` (no figures, or the file could not be written: said on stderr, the run goes on).
fn write_profile(
    opts: &Options,
    inputs: Option<RunFigures>,
    mine: &NodeReport,
    got: &BTreeMap<NodeId, NodeReport>,
) -> Option<String> {
    let mut inputs = inputs?;
    let by_name: BTreeMap<&str, &NodeReport> = got
        .values()
        .chain(std::iter::once(mine))
        .map(|r| (r.node.as_str(), r))
        .collect();
    inputs
        .nodes
        .retain_mut(|n| match by_name.get(n.name.as_str()) {
            Some(r) => {
                n.steps = r.steady_steps.clone();
                n.busy = r.steady_busy.unwrap_or(0.0);
                n.comm = r.steady_comm.unwrap_or(0.0);
                true
            }
            None => false,
        });
    let profile = ravnest_core::profile::fit(&inputs);
    let path = opts.out_dir.join("profile.toml");
    let tmp = opts.out_dir.join("profile.toml.tmp");
    let written =
        std::fs::write(&tmp, profile.to_toml()).and_then(|()| std::fs::rename(&tmp, &path));
    match written {
        Ok(()) => Some(path.display().to_string()),
        Err(e) => {
            eprintln!("cannot write the profile `{}`: {e}", path.display());
            None
        }
    }
}

/// On a worker: send this node's report, and wait (at most 10 s) for the run's summary.
pub(super) async fn fetch(
    su: &Setup,
    net: &Tap,
    mine: NodeReport,
    mut summary: mpsc::UnboundedReceiver<String>,
) -> Option<RunReport> {
    let _ = net.send(
        Addr::Node(su.me),
        Addr::Coordinator,
        Envelope::Report(serde_json::to_string(&mine).unwrap_or_default()),
    );
    match tokio::time::timeout(Duration::from_secs(10), summary.recv()).await {
        Ok(Some(text)) => serde_json::from_str::<RunReport>(&text).ok(),
        _ => None,
    }
}
