//! LAN discovery for `ravnest run --discover`, by mDNS (DNS-SD over multicast: RFC 6762, 6763).
//!
//! A node process announces itself as a [`SERVICE_TYPE`] service: its listening port, its
//! addresses, and three TXT properties: `cluster` (the file's `[cluster] name`), `node` (its
//! name) and `proto` (the wire protocol version). Never the secret: anyone on the LAN can read an
//! announcement, and all it tells them is where a node listens, which then asks whoever dials it
//! for proof of the secret, as on every connection.
//!
//! A process started with `--discover` and no file [`browse`]s for announcements for a bounded
//! time, [`select`]s the nodes of its cluster (a pure function, tested below), and fetches the
//! cluster file from the first of them that answers, exactly as `--join HOST:PORT` does.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::time::{Duration, Instant};

use mdns_sd::{ResolvedService, ScopedIp, ServiceDaemon, ServiceEvent, ServiceInfo};

/// The DNS-SD service type every ravnest node announces.
pub const SERVICE_TYPE: &str = "_ravnest._tcp.local.";

/// How long `--discover` listens for announcements by default (`--discover-timeout SECS`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Once a node of the wanted cluster has answered, how much longer [`browse`] listens for the
/// others (a responder answers within 120 ms; the rest is for a lost packet and a busy host).
pub const GRACE: Duration = Duration::from_millis(750);

/// How long dropping an [`Announcer`] waits for its goodbye to go out.
const GOODBYE_WAIT: Duration = Duration::from_secs(1);

/// When a node process announces itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Announce {
    /// When it listens on an address other machines can reach, i.e. not a loopback one (the
    /// default: a cluster on one machine's loopback says nothing to the LAN).
    #[default]
    Reachable,
    /// Whatever it listens on, loopback included (`ravnest run FILE --discover`).
    Always,
    /// Never (`--no-announce`, and the benchmarks).
    Never,
}

impl Announce {
    /// Whether a node listening on `listen` announces itself.
    pub fn wants(self, listen: IpAddr) -> bool {
        match self {
            Announce::Reachable => !listen.is_loopback(),
            Announce::Always => true,
            Announce::Never => false,
        }
    }
}

/// One node's announcement, as heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heard {
    /// Its cluster's name.
    pub cluster: String,
    /// Its node's name.
    pub node: String,
    /// The wire protocol version it speaks.
    pub proto: u32,
    /// Where it listens.
    pub addrs: Vec<SocketAddr>,
}

/// A node to fetch the cluster file from, and the addresses to try, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The node's name.
    pub node: String,
    /// Its addresses: IPv4 first, each family in ascending order.
    pub addrs: Vec<SocketAddr>,
}

/// What [`select`] chose: the cluster, and its nodes in the order to try them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The cluster's name (as asked, or the only one heard).
    pub cluster: String,
    /// Its nodes that speak our protocol: by name, the joining node's own name last.
    pub candidates: Vec<Candidate>,
}

/// Why discovery found nothing to join, or a node could not announce itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoverError {
    /// The mDNS daemon could not be started or used.
    #[error("cannot use mDNS on this machine: {0}")]
    Mdns(String),
    /// Nobody of the wanted cluster answered in time.
    #[error("{}", nothing_heard(.cluster.as_deref(), *.waited, .others))]
    NothingHeard {
        /// The cluster asked for (`None`: any).
        cluster: Option<String>,
        /// How long the browse listened.
        waited: Duration,
        /// The other clusters that answered, by name.
        others: Vec<String>,
    },
    /// Several clusters answered and none was named.
    #[error(
        "several ravnest clusters answer on this network: {}\n  help: name the one to join with --cluster NAME",
        .clusters.iter().map(|c| format!("`{c}`")).collect::<Vec<_>>().join(", ")
    )]
    Ambiguous {
        /// Their names.
        clusters: Vec<String>,
    },
    /// The cluster's nodes speak another protocol version.
    #[error(
        "the nodes of cluster `{cluster}` speak protocol version {theirs}, this ravnest speaks {ours}\n  help: run the same ravnest version on every machine"
    )]
    Version {
        /// The cluster.
        cluster: String,
        /// The (lowest) version its nodes announce.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// An announcement could not be made of these names.
    #[error("cannot announce node `{node}` of cluster `{cluster}` by mDNS: {why}")]
    Announce {
        /// The cluster.
        cluster: String,
        /// The node.
        node: String,
        /// Why.
        why: String,
    },
}

/// The message of [`DiscoverError::NothingHeard`]: what was asked, and what to check.
fn nothing_heard(cluster: Option<&str>, waited: Duration, others: &[String]) -> String {
    let who = match cluster {
        Some(c) => format!("no node of cluster `{c}`"),
        None => "no ravnest node".to_string(),
    };
    let mut m = format!(
        "{who} answered within {} s (mDNS, service `{SERVICE_TYPE}`)\n  help: check that a node of {} is running (a node that listens on a loopback address announces itself only when started with --discover), that this machine is on the same LAN (mDNS does not cross routers or VPNs), that multicast is allowed (UDP port 5353, to 224.0.0.251 and ff02::fb, through the firewalls of both machines), and {}; or give a running node's address with --join HOST:PORT",
        secs(waited),
        if cluster.is_some() {
            "that cluster"
        } else {
            "the cluster"
        },
        if cluster.is_some() {
            "that the name is the `[cluster] name` of its file"
        } else {
            "name the cluster with --cluster NAME"
        }
    );
    if !others.is_empty() {
        let names: Vec<String> = others.iter().map(|c| format!("`{c}`")).collect();
        m += &format!("\n  heard instead: {}", names.join(", "));
    }
    m
}

/// Seconds for a message: `1`, `2.5`.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}

/// Choose, among the announcements `heard`, the nodes to fetch the cluster file from: those of
/// `cluster` (or of the only cluster heard, when `None`) that speak protocol `proto`, by name,
/// `me` (the joining node's stale announcement, if any) last; each with its addresses, IPv4
/// first. Errors say what was heard instead.
pub fn select(
    heard: &[Heard],
    cluster: Option<&str>,
    me: &str,
    proto: u32,
    waited: Duration,
) -> Result<Choice, DiscoverError> {
    let names: BTreeSet<&str> = heard
        .iter()
        .filter(|h| !h.addrs.is_empty())
        .map(|h| h.cluster.as_str())
        .collect();
    let cluster = match cluster {
        Some(c) => c,
        None => match names.len() {
            1 => names.first().copied().expect("one name"),
            0 => {
                return Err(DiscoverError::NothingHeard {
                    cluster: None,
                    waited,
                    others: Vec::new(),
                });
            }
            _ => {
                return Err(DiscoverError::Ambiguous {
                    clusters: names.iter().map(|c| c.to_string()).collect(),
                });
            }
        },
    };
    let ours: Vec<&Heard> = heard
        .iter()
        .filter(|h| h.cluster == cluster && !h.addrs.is_empty())
        .collect();
    if ours.is_empty() {
        return Err(DiscoverError::NothingHeard {
            cluster: Some(cluster.to_string()),
            waited,
            others: names.iter().map(|c| c.to_string()).collect(),
        });
    }
    let mut nodes: BTreeMap<(bool, &str), BTreeSet<SocketAddr>> = BTreeMap::new();
    for h in ours.iter().filter(|h| h.proto == proto) {
        nodes
            .entry((h.node == me, h.node.as_str()))
            .or_default()
            .extend(h.addrs.iter().copied());
    }
    if nodes.is_empty() {
        return Err(DiscoverError::Version {
            cluster: cluster.to_string(),
            theirs: ours.iter().map(|h| h.proto).min().unwrap_or(0),
            ours: proto,
        });
    }
    Ok(Choice {
        cluster: cluster.to_string(),
        // (A BTreeSet of SocketAddr orders V4 before V6, each by address then port.)
        candidates: nodes
            .into_iter()
            .map(|((_, node), addrs)| Candidate {
                node: node.to_string(),
                addrs: addrs.into_iter().collect(),
            })
            .collect(),
    })
}

/// Listen for announcements for at most `timeout`: every ravnest node heard, of any cluster.
/// Once a node of `cluster` (of any cluster, when `None`) has answered, listens [`GRACE`]
/// longer for the others, then stops.
pub fn browse(cluster: Option<&str>, timeout: Duration) -> Result<Vec<Heard>, DiscoverError> {
    let daemon = ServiceDaemon::new().map_err(mdns)?;
    let rx = daemon.browse(SERVICE_TYPE).map_err(mdns)?;
    let mut deadline = Instant::now() + timeout;
    let mut heard = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(ServiceEvent::ServiceResolved(r)) => {
                if let Some(h) = heard_of(&r) {
                    if cluster.is_none_or(|c| c == h.cluster) {
                        deadline = deadline.min(Instant::now() + GRACE);
                    }
                    heard.push(h);
                }
            }
            Ok(_) => {}
            Err(mdns_sd::RecvTimeoutError::Timeout) => break,
            Err(mdns_sd::RecvTimeoutError::Disconnected) => {
                return Err(DiscoverError::Mdns("the mDNS daemon stopped".into()));
            }
        }
    }
    let _ = daemon.stop_browse(SERVICE_TYPE);
    stop(&daemon);
    Ok(heard)
}

fn mdns(e: mdns_sd::Error) -> DiscoverError {
    DiscoverError::Mdns(e.to_string())
}

/// Stop a daemon, waiting a little for its thread to say it has.
fn stop(daemon: &ServiceDaemon) {
    if let Ok(rx) = daemon.shutdown() {
        let _ = rx.recv_timeout(GOODBYE_WAIT);
    }
}

/// A resolved service as a ravnest announcement (`None`: not one of ours, or incomplete).
fn heard_of(r: &ResolvedService) -> Option<Heard> {
    let txt = &r.txt_properties;
    let cluster = txt.get_property_val_str("cluster")?.to_string();
    let node = txt.get_property_val_str("node")?.to_string();
    let proto = txt.get_property_val_str("proto")?.parse().ok()?;
    let mut addrs: Vec<SocketAddr> = r
        .addresses
        .iter()
        .filter_map(|ip| socket_addr(ip, r.port))
        .collect();
    addrs.sort();
    Some(Heard {
        cluster,
        node,
        proto,
        addrs,
    })
}

/// An announced address and port as one to dial (a link-local IPv6 address with the scope of
/// the interface it was heard on).
fn socket_addr(ip: &ScopedIp, port: u16) -> Option<SocketAddr> {
    match ip {
        ScopedIp::V4(v4) => Some(SocketAddr::new(IpAddr::V4(*v4.addr()), port)),
        ScopedIp::V6(v6) => {
            let a = *v6.addr();
            let scope = if a.is_unicast_link_local() {
                v6.scope_id().index
            } else {
                0
            };
            Some(SocketAddr::V6(SocketAddrV6::new(a, port, 0, scope)))
        }
        _ => None,
    }
}

/// A node's announcement on the LAN, for as long as this value lives; dropping it says
/// goodbye (peers forget it at once instead of when its records expire).
pub struct Announcer {
    daemon: ServiceDaemon,
    fullname: String,
}

impl std::fmt::Debug for Announcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcer")
            .field("fullname", &self.fullname)
            .finish_non_exhaustive()
    }
}

impl Announcer {
    /// Announce node `node` of cluster `cluster`, listening on `listen`, speaking protocol
    /// `proto`. A specific `listen` address is announced as it is (a loopback one only on the
    /// loopback interface); an unspecified one (`0.0.0.0`) as every address of this machine,
    /// each on its own interface.
    pub fn start(
        cluster: &str,
        node: &str,
        listen: SocketAddr,
        proto: u32,
    ) -> Result<Announcer, DiscoverError> {
        let info = service_info(cluster, node, listen, proto)?;
        let fullname = info.get_fullname().to_string();
        let daemon = ServiceDaemon::new().map_err(mdns)?;
        if let Err(e) = daemon.register(info) {
            stop(&daemon);
            return Err(mdns(e));
        }
        Ok(Announcer { daemon, fullname })
    }

    /// The service instance's full DNS-SD name.
    pub fn fullname(&self) -> &str {
        &self.fullname
    }
}

impl Drop for Announcer {
    fn drop(&mut self) {
        if let Ok(rx) = self.daemon.unregister(&self.fullname) {
            let _ = rx.recv_timeout(GOODBYE_WAIT);
        }
        stop(&self.daemon);
    }
}

/// The service a node announces (see the module's documentation).
fn service_info(
    cluster: &str,
    node: &str,
    listen: SocketAddr,
    proto: u32,
) -> Result<ServiceInfo, DiscoverError> {
    let failed = |why: String| DiscoverError::Announce {
        cluster: cluster.to_string(),
        node: node.to_string(),
        why,
    };
    let proto = proto.to_string();
    let txt = [
        ("cluster", cluster),
        ("node", node),
        ("proto", proto.as_str()),
    ];
    let (instance, host) = names(cluster, node);
    let info = if listen.ip().is_unspecified() {
        ServiceInfo::new(SERVICE_TYPE, &instance, &host, (), listen.port(), &txt[..])
            .map(ServiceInfo::enable_addr_auto)
    } else {
        ServiceInfo::new(
            SERVICE_TYPE,
            &instance,
            &host,
            listen.ip(),
            listen.port(),
            &txt[..],
        )
    };
    info.map_err(|e| failed(e.to_string()))
}

/// The DNS-SD instance name of a node (`NODE @ CLUSTER`, readable in `avahi-browse`; cut to
/// the 63 bytes of a DNS label, with a hash of both names when cut) and the host name its
/// address records go under (`ravnest-HASH.local.`).
pub fn names(cluster: &str, node: &str) -> (String, String) {
    let hash = fnv1a(&[cluster.as_bytes(), &[0], node.as_bytes()]);
    let full = format!("{node} @ {cluster}");
    let instance = if full.len() <= 63 {
        full
    } else {
        let tag = format!(" #{:08x}", hash as u32);
        let mut end = 63 - tag.len();
        while !full.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}{tag}", &full[..end])
    };
    (instance, format!("ravnest-{hash:016x}.local."))
}

/// FNV-1a, 64 bits: a hash that stays the same across runs and builds.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heard(cluster: &str, node: &str, proto: u32, addrs: &[&str]) -> Heard {
        Heard {
            cluster: cluster.into(),
            node: node.into(),
            proto,
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    const W: Duration = Duration::from_secs(5);

    #[test]
    fn the_lowest_node_name_comes_first_and_its_ipv4_addresses_first() {
        let h = [
            heard("lab", "c", 5, &["10.0.0.3:47701"]),
            heard("lab", "a", 5, &["[fd00::1]:47701", "10.0.0.1:47701"]),
            heard("lab", "b", 5, &["10.0.0.2:47701"]),
        ];
        let c = select(&h, Some("lab"), "z", 5, W).unwrap();
        assert_eq!(c.cluster, "lab");
        let order: Vec<&str> = c.candidates.iter().map(|c| c.node.as_str()).collect();
        assert_eq!(order, ["a", "b", "c"]);
        assert_eq!(
            c.candidates[0].addrs,
            [
                "10.0.0.1:47701".parse::<SocketAddr>().unwrap(),
                "[fd00::1]:47701".parse().unwrap()
            ]
        );
    }

    #[test]
    fn the_order_does_not_depend_on_the_order_heard() {
        let mut h = vec![
            heard("lab", "b", 5, &["10.0.0.2:1"]),
            heard("lab", "a", 5, &["10.0.0.1:1"]),
            heard("other", "a", 5, &["10.0.0.9:1"]),
        ];
        let first = select(&h, Some("lab"), "x", 5, W).unwrap();
        h.reverse();
        assert_eq!(select(&h, Some("lab"), "x", 5, W).unwrap(), first);
    }

    #[test]
    fn the_joining_node_own_stale_announcement_is_tried_last() {
        let h = [
            heard("lab", "a", 5, &["10.0.0.1:1"]),
            heard("lab", "b", 5, &["10.0.0.2:1"]),
        ];
        let c = select(&h, Some("lab"), "a", 5, W).unwrap();
        let order: Vec<&str> = c.candidates.iter().map(|c| c.node.as_str()).collect();
        assert_eq!(order, ["b", "a"]);
    }

    #[test]
    fn announcements_of_one_node_merge_their_addresses() {
        let h = [
            heard("lab", "a", 5, &["10.0.0.1:1"]),
            heard("lab", "a", 5, &["192.168.1.4:1", "10.0.0.1:1"]),
        ];
        let c = select(&h, Some("lab"), "b", 5, W).unwrap();
        assert_eq!(c.candidates.len(), 1);
        assert_eq!(c.candidates[0].addrs.len(), 2);
    }

    #[test]
    fn another_clusters_nodes_are_not_candidates_and_are_named_when_ours_is_silent() {
        let h = [heard("other", "a", 5, &["10.0.0.1:1"])];
        let e = select(&h, Some("lab"), "b", 5, Duration::from_secs(1)).unwrap_err();
        assert_eq!(
            e,
            DiscoverError::NothingHeard {
                cluster: Some("lab".into()),
                waited: Duration::from_secs(1),
                others: vec!["other".into()],
            }
        );
        let m = e.to_string();
        assert!(
            m.contains("no node of cluster `lab` answered within 1 s"),
            "{m}"
        );
        assert!(m.contains("same LAN") && m.contains("multicast"), "{m}");
        assert!(
            m.contains("`[cluster] name`") && m.contains("--join"),
            "{m}"
        );
        assert!(m.contains("heard instead: `other`"), "{m}");
    }

    #[test]
    fn without_a_cluster_name_the_only_cluster_heard_is_chosen() {
        let h = [
            heard("lab", "b", 5, &["10.0.0.2:1"]),
            heard("lab", "a", 5, &["10.0.0.1:1"]),
        ];
        let c = select(&h, None, "c", 5, W).unwrap();
        assert_eq!(c.cluster, "lab");
        assert_eq!(c.candidates[0].node, "a");
    }

    #[test]
    fn without_a_cluster_name_several_clusters_are_refused_by_name() {
        let h = [
            heard("zeta", "a", 5, &["10.0.0.2:1"]),
            heard("lab", "a", 5, &["10.0.0.1:1"]),
        ];
        let e = select(&h, None, "c", 5, W).unwrap_err();
        assert_eq!(
            e,
            DiscoverError::Ambiguous {
                clusters: vec!["lab".into(), "zeta".into()]
            }
        );
        assert!(e.to_string().contains("--cluster NAME"), "{e}");
    }

    #[test]
    fn nothing_heard_at_all_says_so() {
        let e = select(&[], None, "a", 5, Duration::from_millis(2500)).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("no ravnest node answered within 2.5 s"),
            "{e}"
        );
        let e = select(&[], Some("lab"), "a", 5, W).unwrap_err();
        assert!(!e.to_string().contains("heard instead"), "{e}");
    }

    #[test]
    fn nodes_of_another_protocol_version_are_left_out_or_named() {
        let h = [
            heard("lab", "a", 4, &["10.0.0.1:1"]),
            heard("lab", "b", 5, &["10.0.0.2:1"]),
        ];
        let c = select(&h, Some("lab"), "x", 5, W).unwrap();
        assert_eq!(c.candidates.len(), 1);
        assert_eq!(c.candidates[0].node, "b");
        let e = select(&h[..1], Some("lab"), "x", 5, W).unwrap_err();
        assert_eq!(
            e,
            DiscoverError::Version {
                cluster: "lab".into(),
                theirs: 4,
                ours: 5
            }
        );
    }

    #[test]
    fn an_announcement_without_addresses_is_ignored() {
        let h = [heard("lab", "a", 5, &[])];
        assert!(matches!(
            select(&h, Some("lab"), "x", 5, W),
            Err(DiscoverError::NothingHeard { .. })
        ));
        assert!(matches!(
            select(&h, None, "x", 5, W),
            Err(DiscoverError::NothingHeard { cluster: None, .. })
        ));
    }

    #[test]
    fn instance_names_are_readable_fit_a_label_and_stay_distinct() {
        let (i, host) = names("lab", "a");
        assert_eq!(i, "a @ lab");
        assert!(host.starts_with("ravnest-") && host.ends_with(".local."));
        assert_eq!(names("lab", "a"), (i.clone(), host.clone()));
        let long = "é".repeat(40);
        let (x, hx) = names(&long, "a");
        let (y, hy) = names(&long, "b");
        assert!(x.len() <= 63 && y.len() <= 63, "{x} {y}");
        assert_ne!(x, y);
        assert_ne!(hx, hy);
        assert_ne!(names("ab", "c").1, names("a", "bc").1);
    }

    #[test]
    fn the_announcement_carries_the_names_and_version_but_never_a_secret() {
        let info = service_info("lab", "a", "10.0.0.1:47701".parse().unwrap(), 5).unwrap();
        let keys: BTreeSet<String> = info
            .get_properties()
            .iter()
            .map(|p| p.key().to_string())
            .collect();
        assert_eq!(
            keys,
            BTreeSet::from(["cluster".into(), "node".into(), "proto".into()])
        );
        assert_eq!(info.get_property_val_str("cluster"), Some("lab"));
        assert_eq!(info.get_property_val_str("node"), Some("a"));
        assert_eq!(info.get_property_val_str("proto"), Some("5"));
        assert_eq!(info.get_port(), 47701);
        assert!(!info.is_addr_auto());
        let any = service_info("lab", "a", "0.0.0.0:47701".parse().unwrap(), 5).unwrap();
        assert!(any.is_addr_auto());
    }

    #[test]
    fn announcing_follows_the_listen_address_unless_told() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let lan: IpAddr = "10.0.0.1".parse().unwrap();
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        assert!(!Announce::Reachable.wants(lo));
        assert!(Announce::Reachable.wants(lan) && Announce::Reachable.wants(any));
        assert!(Announce::Always.wants(lo));
        assert!(!Announce::Never.wants(lan));
    }
}
