//! Joining a running cluster from outside it: `run --join HOST:PORT[,...]` and `run --discover`
//! fetch the cluster file from a running node (authenticated by the secret), asking again while
//! a fail-over may be under way.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// `--join HOST:PORT[,HOST:PORT...]`: the cluster file from a running node, authenticated with
/// the secret in `RAVNEST_SECRET` (the default secret of files without one when unset), asked
/// for as node `me` (reached at `advertise`: a name the file lacks gets its place from the
/// coordinator's host). Returns (origin, text, steps, whether `me` is new to the cluster).
///
/// The addresses are asked in turn, the first that answers wins: a user who knows several
/// nodes names them all, and a lost one does not keep the joiner out. A node that does not
/// answer in time (a frozen or lost coordinator's host, while its successor takes over), or the
/// host it sent us to, is asked again until `patience` is spent: the joiner is admitted once
/// the successor is up. A wrong secret or a refusal ends it at once, and so does a port where
/// nothing listens when no address is left worth asking again.
pub fn fetch_cluster_file(
    addr: &str,
    me: &str,
    advertise: Option<&str>,
    patience: Duration,
) -> Result<Joined> {
    if addr.trim_start().starts_with('/') {
        return fetch_through_relay(addr.trim(), me, advertise, patience);
    }
    let seeds = join_addresses(addr)?;
    let deadline = Instant::now() + patience;
    let (doc, from) = 'asking: loop {
        let mut again = None;
        let mut last = None;
        let mut failed = Vec::new();
        for &sa in &seeds {
            match fetch_avoiding(sa, me, advertise, &mut failed) {
                Ok(got) => break 'asking got,
                Err(Retry::Again(e)) => again = Some(e),
                Err(Retry::Final(e @ ravnest_runtime::tcp::HandshakeError::Io(_)))
                    if seeds.len() > 1 =>
                {
                    last = Some(e)
                }
                Err(Retry::Final(e)) => return Err(explained(&format!("--join {addr}"), e)),
            }
        }
        match (again, last) {
            (Some(e), _) if Instant::now() + JOIN_RETRY < deadline => {
                eprintln!(
                    "--join {addr}: {e}; asking again in {} s (a fail-over may be under way; at most {} s in all: --wait)",
                    JOIN_RETRY.as_secs(),
                    patience.as_secs()
                );
                std::thread::sleep(JOIN_RETRY);
            }
            (Some(e), _) | (None, Some(e)) => {
                return Err(explained(&format!("--join {addr}"), e));
            }
            (None, None) => bail!("--join {addr}: no address to ask"),
        }
    };
    let (origin, text, steps) = ravnest_node::process::read_share_document(&doc)
        .with_context(|| format!("--join {addr}"))?;
    let newcomer = ravnest_node::process::is_newcomer_document(&doc, me);
    Ok(Joined {
        origin: format!("{origin} (from {from})"),
        text,
        steps,
        newcomer,
        host: ravnest_node::process::share_coordinator(&doc),
    })
}

/// `--join /ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/NODE`: the cluster file from that node
/// through the relay (the line its coordinator's host prints at start), over libp2p; asked
/// again while the node does not answer, until `patience` is spent.
fn fetch_through_relay(
    addr: &str,
    me: &str,
    advertise: Option<&str>,
    patience: Duration,
) -> Result<Joined> {
    use ravnest_runtime::tcp::{Fetched, HandshakeError, JoinRequest};
    let to = ravnest_runtime::p2p::node_addr(addr).map_err(|e| anyhow::anyhow!("--join {e}"))?;
    let secret = std::env::var(ravnest_node::process::SECRET_ENV)
        .unwrap_or_else(|_| ravnest_node::process::DEFAULT_SECRET.to_string());
    let request = JoinRequest {
        name: me.to_string(),
        address: advertise.unwrap_or_default().to_string(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let deadline = Instant::now() + patience;
    let doc = loop {
        let fetched = rt.block_on(ravnest_runtime::tcp::fetch_cluster_file_p2p(
            &to,
            secret.as_bytes(),
            &request,
        ));
        match fetched {
            Ok(Fetched::File(doc)) => break doc,
            Ok(Fetched::Elsewhere(host)) => bail!(
                "--join {addr}: this node does not give new nodes their place; ask the coordinator's host (at {host}) with the `--join` line it printed at its start"
            ),
            Err(HandshakeError::Io(e)) if Instant::now() + JOIN_RETRY < deadline => {
                eprintln!(
                    "--join {addr}: {e}; asking again in {} s (at most {} s in all: --wait)",
                    JOIN_RETRY.as_secs(),
                    patience.as_secs()
                );
                std::thread::sleep(JOIN_RETRY);
            }
            Err(e) => return Err(explained(&format!("--join {addr}"), e)),
        }
    };
    let (origin, text, steps) = ravnest_node::process::read_share_document(&doc)
        .with_context(|| format!("--join {addr}"))?;
    let newcomer = ravnest_node::process::is_newcomer_document(&doc, me);
    Ok(Joined {
        origin: format!("{origin} (from {addr})"),
        text,
        steps,
        newcomer,
        host: ravnest_node::process::share_coordinator(&doc),
    })
}

/// The addresses of `--join` (comma separated), each resolved.
fn join_addresses(addr: &str) -> Result<Vec<SocketAddr>> {
    let seeds = addr
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|a| {
            std::net::ToSocketAddrs::to_socket_addrs(a)
                .ok()
                .and_then(|mut it| it.next())
                .with_context(|| format!("--join {addr}: `{a}` is not a reachable host:port"))
        })
        .collect::<Result<Vec<_>>>()?;
    if seeds.is_empty() {
        bail!("--join {addr}: give at least one HOST:PORT");
    }
    Ok(seeds)
}

/// A cluster file fetched from a running node (`--join`, `--discover`).
pub struct Joined {
    /// Where it came from.
    pub origin: String,
    /// Its text.
    pub text: String,
    /// The run's steps.
    pub steps: u64,
    /// The coordinator's host gave this node its place (a name the file lacked).
    pub newcomer: bool,
    /// The node that hosts the coordinator now, as the node that handed it out knew.
    pub host: Option<ravnest_core::NodeId>,
}

/// `--discover` without a file: listen for the announcements of `cluster` (of the only cluster
/// that answers, when `None`) for at most `wait`, then fetch the cluster file as `--join` does
/// from the first node that answers, in [`ravnest_node::discover::select`]'s order. A wrong
/// secret or another protocol version ends the search with the same error as `--join`; a node
/// that cannot be reached is skipped. Returns (origin, text, steps).
pub fn discover_cluster_file(
    cluster: Option<&str>,
    me: &str,
    advertise: Option<&str>,
    wait: Duration,
) -> Result<Joined> {
    use ravnest_node::discover;
    use ravnest_runtime::tcp::{HandshakeError, PROTOCOL_VERSION};
    let wanted = match cluster {
        Some(c) => format!("cluster `{c}`"),
        None => "a ravnest cluster".to_string(),
    };
    eprintln!(
        "--discover: listening for {wanted} on this machine's networks (mDNS, at most {} s)",
        wait.as_secs_f64()
    );
    let heard = discover::browse(cluster, wait).context("--discover")?;
    let choice =
        discover::select(&heard, cluster, me, PROTOCOL_VERSION, wait).context("--discover")?;
    let names: Vec<String> = choice
        .candidates
        .iter()
        .map(|c| format!("`{}`", c.node))
        .collect();
    eprintln!(
        "--discover: cluster `{}`: heard node {}",
        choice.cluster,
        names.join(", ")
    );
    let mut unreachable = Vec::new();
    for c in &choice.candidates {
        for &a in &c.addrs {
            // (The fetch's errors name the address.)
            let what = format!(
                "--discover: node `{}` of cluster `{}`",
                c.node, choice.cluster
            );
            match fetch_at(a, me, advertise) {
                Ok((doc, from)) => {
                    let (origin, text, steps) =
                        ravnest_node::process::read_share_document(&doc).context(what)?;
                    eprintln!(
                        "--discover: fetched the cluster file from node `{}` at {from}",
                        c.node
                    );
                    return Ok(Joined {
                        origin: format!("{origin} (from {from}, found by --discover)"),
                        text,
                        steps,
                        newcomer: ravnest_node::process::is_newcomer_document(&doc, me),
                        host: ravnest_node::process::share_coordinator(&doc),
                    });
                }
                Err(
                    Retry::Again(e @ (HandshakeError::Io(_) | HandshakeError::Unknown(_)))
                    | Retry::Final(e @ (HandshakeError::Io(_) | HandshakeError::Unknown(_))),
                ) => {
                    unreachable.push(e.to_string());
                }
                Err(Retry::Again(e) | Retry::Final(e)) => return Err(explained(&what, e)),
            }
        }
    }
    bail!(
        "--discover: cluster `{}`: no node that answered could be reached: {}\n  help: each node listens on the TCP port of its `address`: check the firewalls between this machine and them",
        choice.cluster,
        unreachable.join("; ")
    )
}

/// The cluster file's document asked for as node `me` (at `advertise`), from the node at `sa`
/// or the one it sends us to (the coordinator's host gives a new node its place), both sides
/// proving they hold the secret in `RAVNEST_SECRET` (the default secret of files without one
/// when unset). Returns the document and the address it came from.
fn fetch_at(
    sa: SocketAddr,
    me: &str,
    advertise: Option<&str>,
) -> std::result::Result<(String, SocketAddr), Retry> {
    fetch_avoiding(sa, me, advertise, &mut Vec::new())
}

/// [`fetch_at`], asking no address of `failed` (those that did not answer this round: a
/// frozen host each node sends us to is waited for once, not once per node), and adding
/// the one that fails.
fn fetch_avoiding(
    sa: SocketAddr,
    me: &str,
    advertise: Option<&str>,
    failed: &mut Vec<SocketAddr>,
) -> std::result::Result<(String, SocketAddr), Retry> {
    use ravnest_runtime::tcp::{Fetched, HandshakeError, JoinRequest};
    let secret = std::env::var(ravnest_node::process::SECRET_ENV)
        .unwrap_or_else(|_| ravnest_node::process::DEFAULT_SECRET.to_string());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Retry::Final(HandshakeError::Io(e.to_string())))?;
    let request = JoinRequest {
        name: me.to_string(),
        address: advertise.unwrap_or_default().to_string(),
    };
    let mut at = sa;
    // Sent on at most twice: a node to the coordinator's host, which answers itself.
    for hop in 0..3 {
        if failed.contains(&at) {
            return Err(Retry::Again(HandshakeError::Io(format!(
                "node at {at} did not answer (asked already)"
            ))));
        }
        let fetched = rt.block_on(ravnest_runtime::tcp::fetch_cluster_file(
            at,
            secret.as_bytes(),
            &request,
        ));
        match fetched {
            Ok(Fetched::File(doc)) => return Ok((doc, at)),
            Ok(Fetched::Elsewhere(next)) if next == at.to_string() => {
                return Err(Retry::Again(HandshakeError::Io(format!(
                    "node at {at} lets no node in yet (the cluster does not train yet, or its coordinator is moving)"
                ))));
            }
            Ok(Fetched::Elsewhere(next)) => {
                at = next.parse().map_err(|_| {
                    Retry::Final(HandshakeError::Io(format!(
                        "node at {at} sent us to `{next}`, not an address"
                    )))
                })?;
            }
            // The host we were sent to is gone (its successor may not be up yet), or a node
            // does not answer in time (frozen, or lost while a fail-over runs): again later.
            Err(HandshakeError::Io(e)) if hop > 0 || gone_for_now(&e) => {
                failed.push(at);
                return Err(Retry::Again(HandshakeError::Io(e)));
            }
            Err(e) => {
                failed.push(at);
                return Err(Retry::Final(e));
            }
        }
    }
    Err(Retry::Again(HandshakeError::Io(format!(
        "node at {sa}: sent on from node to node without an answer (the coordinator's host moves?)"
    ))))
}

/// Whether a node's failure to answer may pass: it did not answer in time (frozen, busy), or
/// it went away mid-answer (a coordinator's host stepping down). Nothing listening, or not a
/// ravnest node, will not.
fn gone_for_now(e: &str) -> bool {
    e.ends_with("handshake timed out") || e.ends_with("early eof") || e.contains("reset by peer")
}

/// Between two asks of a joiner whose cluster did not answer.
const JOIN_RETRY: Duration = Duration::from_secs(1);

/// Why a fetch of the cluster file failed: worth asking again later, or not.
enum Retry {
    Again(ravnest_runtime::tcp::HandshakeError),
    Final(ravnest_runtime::tcp::HandshakeError),
}

/// A fetch's error, with what to do about a wrong secret.
fn explained(what: &str, e: ravnest_runtime::tcp::HandshakeError) -> anyhow::Error {
    let hint = if matches!(e, ravnest_runtime::tcp::HandshakeError::Secret(_)) {
        " (set RAVNEST_SECRET to the cluster's secret)"
    } else {
        ""
    };
    anyhow::anyhow!("{what}: {e}{hint}")
}

#[cfg(test)]
mod tests {
    use super::{gone_for_now, join_addresses};

    /// `--join` takes one address or several, comma separated (spaces allowed), each resolved;
    /// an empty list or a word that is not an address is named.
    #[test]
    fn join_takes_several_addresses() {
        let a = join_addresses("127.0.0.1:1, 127.0.0.1:2,127.0.0.1:3").unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[1].port(), 2);
        assert_eq!(join_addresses("127.0.0.1:9").unwrap().len(), 1);
        let e = join_addresses(" , ").unwrap_err().to_string();
        assert!(e.contains("at least one HOST:PORT"), "{e}");
        let e = join_addresses("127.0.0.1:1,nonsense")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`nonsense` is not a reachable host:port"), "{e}");
    }

    /// A node that did not answer in time, or went away mid-answer, may answer later; a port
    /// where nothing listens, or a program that is not a ravnest node, will not.
    #[test]
    fn a_joiner_asks_again_only_where_an_answer_may_come() {
        assert!(gone_for_now("node at 127.0.0.1:1: handshake timed out"));
        assert!(gone_for_now("node at 127.0.0.1:1: early eof"));
        assert!(gone_for_now(
            "node at 127.0.0.1:1: Connection reset by peer (os error 104)"
        ));
        assert!(!gone_for_now(
            "node at 127.0.0.1:1: Connection refused (os error 111)"
        ));
        assert!(!gone_for_now("node at 127.0.0.1:1: not a ravnest node"));
    }
}
