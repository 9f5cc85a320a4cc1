//! Machines that join a chaos run with `--join`: new ones (`Fault::TwoJoiners`) and killed
//! nodes restarted, and how the joiners' ends are judged.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Result, bail};
use ravnest_runtime::tcp;

use super::{NODES, SECRET, wait_for};

/// The names of the two machines a [`super::Fault::TwoJoiners`] adds.
pub(super) const JOINERS: [&str; 2] = ["new1", "new2"];

/// What a machine that joins is told (`--join A,B,...`): the cluster's addresses, node
/// `first`'s first (the one it asks through), node `not`'s left out (its own).
pub(super) fn seeds(addresses: &[SocketAddr], first: usize, not: usize) -> String {
    let order = std::iter::once(first).chain((0..addresses.len()).filter(|&i| i != first));
    order
        .filter(|&i| i != not)
        .map(|i| addresses[i].to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// A machine not in the cluster file joins with `--join` (through the nodes at `seeds`, asked
/// in turn), reached at a port of its own.
pub(super) fn newcomer(
    exe: &Path,
    dir: &Path,
    out: &Path,
    seeds: &str,
    name: &str,
) -> Result<Child> {
    let jlog = std::fs::File::create(dir.join(format!("{name}-join.log")))?;
    let events = std::fs::File::create(dir.join(format!("{name}-join.jsonl")))?;
    let port = tcp::spare_ports(1)?[0];
    Ok(Command::new(exe)
        .args(["run", "--join", seeds, "--node", name])
        .args(["--advertise", &format!("127.0.0.1:{port}")])
        .args(["--wait", "10", "--json", "--out"])
        .arg(out.join(name))
        .env("RAVNEST_SECRET", SECRET)
        .stdout(events)
        .stderr(jlog)
        .spawn()?)
}

/// Joiners end within 20 s of the run, never by a panic; one the coordinator admitted (it said
/// it joins) ends cleanly. Joiners that come once training is over are turned away, which is no
/// fault. Says how many were admitted.
pub(super) fn judge_newcomers(
    newcomers: Vec<(&str, Child)>,
    dir: &Path,
    log: &Path,
) -> Result<String> {
    if newcomers.is_empty() {
        return Ok(String::new());
    }
    let events = std::fs::read_to_string(log.with_extension("jsonl")).unwrap_or_default();
    let mut admitted = 0;
    let mut turned_away = Vec::new();
    for (name, mut child) in newcomers {
        let status = wait_for(&mut child, Duration::from_secs(20))?;
        let jlog = dir.join(format!("{name}-join.log"));
        let said = std::fs::read_to_string(&jlog).unwrap_or_default();
        if status.is_none() {
            bail!("the joiner `{name}` did not end; see {}", jlog.display());
        }
        if said.contains("panicked") {
            bail!("the joiner `{name}` panicked; see {}", jlog.display());
        }
        if events.contains(&format!("`{name}` (not in the cluster file) joins")) {
            if status.is_none_or(|s| !s.success()) {
                bail!(
                    "the joiner `{name}` was admitted but ended with {status:?}; see {}",
                    jlog.display()
                );
            }
            admitted += 1;
        } else if let Some(last) = said.lines().rev().find(|l| !l.trim().is_empty()) {
            turned_away.push(format!("`{name}`: {}", last.trim()));
        }
    }
    let why = if turned_away.is_empty() {
        String::new()
    } else {
        format!(" ({})", turned_away.join("; "))
    };
    Ok(format!("; {admitted} of 2 joiners admitted{why}"))
}

/// A killed node starts again with `--join` (the other nodes' addresses, the first node's
/// first; the secret).
pub(super) fn rejoin(
    exe: &Path,
    dir: &Path,
    out: &Path,
    seeds: &str,
    node: usize,
) -> Result<Child> {
    let jlog = std::fs::File::create(dir.join(format!("{}-rejoin.log", NODES[node])))?;
    Ok(Command::new(exe)
        .args(["run", "--join", seeds, "--node", NODES[node]])
        .args(["--json", "--out"])
        .arg(out)
        .env("RAVNEST_SECRET", SECRET)
        .stdout(Stdio::null())
        .stderr(jlog)
        .spawn()?)
}
