//! The cluster: `[[node]]` tables (each `count` expanded), `[links]` and its pairs, the
//! `[cluster]` name, and the lookup of a node by name.

use std::collections::BTreeMap;

use toml::Spanned;

use super::ctx::Ctx;
use super::raw::{ClusterToml, LinksToml, NodeToml};
use super::suggest::{did_you_mean, nearest, with_help};
use super::types::{ConfigError, DEFAULT_LINK};
use crate::cluster::{Link, NodeId, NodeSpec};
use crate::device::{self, GIB};
use crate::model::Precision;

/// The access link of nodes that name none: `[links]`'s figures over [`DEFAULT_LINK`].
pub(super) fn resolve_default_link(
    ctx: &Ctx<'_>,
    links: Option<&LinksToml>,
) -> Result<Link, ConfigError> {
    let mut default_link = DEFAULT_LINK;
    if let Some(l) = links {
        if let Some(b) = &l.bandwidth_gbps {
            default_link.bandwidth_gbps = ctx.positive(b, "bandwidth_gbps")?;
        }
        if let Some(x) = &l.latency_ms {
            default_link.latency_ms = ctx.non_negative(x, "latency_ms")?;
        }
    }
    Ok(default_link)
}

/// What every `[[node]]` takes from the rest of the file.
pub(super) struct NodeDefaults {
    /// Training precision: decides a catalog device's throughput.
    pub(super) precision: Precision,
    /// Memory kept back on every node, GiB.
    pub(super) reserve_gib: f64,
    /// Access link of a node that names none.
    pub(super) link: Link,
}

/// The nodes of the file, each `count` expanded, in id order.
pub(super) struct Nodes {
    /// The nodes.
    pub(super) specs: Vec<NodeSpec>,
    /// Each node's `device` as written, by node index.
    pub(super) raw_devices: Vec<String>,
    /// Each node's `emulate_slowdown`, by node index.
    pub(super) slowdown: Vec<f64>,
    /// Node ids by name.
    pub(super) index: BTreeMap<String, NodeId>,
}

/// One `[[node]]` table's figures, before its `count` is expanded.
struct NodeFigures {
    dev: &'static device::DeviceSpec,
    count: u32,
    memory_gib: f64,
    flops: f64,
    emulate: f64,
    link: Link,
}

/// The `[[node]]` tables, checked and expanded.
pub(super) fn resolve_nodes(
    ctx: &Ctx<'_>,
    tables: &[Spanned<NodeToml>],
    defaults: &NodeDefaults,
) -> Result<Nodes, ConfigError> {
    if tables.is_empty() {
        return Err(with_help(
            ctx.err(None, "the cluster has no nodes"),
            Some("add at least one [[node]] table with `name` and `device`".into()),
        ));
    }
    let mut out = Nodes {
        specs: Vec::new(),
        raw_devices: Vec::new(),
        slowdown: Vec::new(),
        index: BTreeMap::new(),
    };
    for n in tables {
        let figures = node_figures(ctx, n, defaults)?;
        let n = n.get_ref();
        check_addresses(ctx, n, figures.count, &out.specs)?;
        push_nodes(ctx, n, &figures, defaults.reserve_gib, &mut out)?;
    }
    Ok(out)
}

/// A `[[node]]` table's device, count, memory, throughput, slowdown and link.
fn node_figures(
    ctx: &Ctx<'_>,
    n: &Spanned<NodeToml>,
    defaults: &NodeDefaults,
) -> Result<NodeFigures, ConfigError> {
    let n = n.get_ref();
    let dev_name = n.device.get_ref();
    let dev = device::lookup(dev_name).ok_or_else(|| {
        with_help(
            ctx.err(
                Some(&n.device.span()),
                format!("unknown device `{dev_name}`"),
            ),
            Some(device::hint(dev_name).unwrap_or_else(|| did_you_mean(dev_name, device::ids()))),
        )
    })?;
    let count = match &n.count {
        Some(c) => ctx.positive(c, "count")?,
        None => 1,
    };
    let memory_gib = match &n.memory_gib {
        Some(m) => ctx.positive(m, "memory_gib")?,
        None => dev.memory_gib,
    };
    // A node with no more than the reserve is no error: it has nothing usable, and the
    // planner leaves it out with the reason (one small node must not fail the whole cluster).
    let flops = match &n.tflops {
        Some(t) => ctx.positive(t, "tflops")? * 1e12,
        None => dev.effective_flops(defaults.precision).ok_or_else(|| {
            with_help(
                ctx.err(
                    Some(&n.device.span()),
                    format!(
                        "device `{}` has no {} support",
                        dev.id,
                        defaults.precision.as_str()
                    ),
                ),
                Some("use precision = \"fp32\" (or \"fp16\" on pre-Ampere GPUs), or set `tflops` for this node".into()),
            )
        })?,
    };
    let emulate = match &n.emulate_slowdown {
        Some(e) => ctx.positive(e, "emulate_slowdown")?,
        None => 1.0,
    };
    let mut link = defaults.link;
    if let Some(b) = &n.bandwidth_gbps {
        link.bandwidth_gbps = ctx.positive(b, "bandwidth_gbps")?;
    }
    if let Some(x) = &n.latency_ms {
        link.latency_ms = ctx.non_negative(x, "latency_ms")?;
    }
    Ok(NodeFigures {
        dev,
        count,
        memory_gib,
        flops,
        emulate,
        link,
    })
}

/// A `[[node]]` table's `listen` and `address`: one machine each, no address taken twice.
fn check_addresses(
    ctx: &Ctx<'_>,
    n: &NodeToml,
    count: u32,
    earlier: &[NodeSpec],
) -> Result<(), ConfigError> {
    if let Some(listen) = &n.listen
        && (n.address.is_none() || count > 1)
    {
        return Err(ctx.err(
            Some(&listen.span()),
            "`listen` (the local address to bind) goes with one node's `address` (the one peers dial)",
        ));
    }
    if let Some(address) = &n.address
        && count > 1
    {
        return Err(ctx.err(
            Some(&address.span()),
            "`address` names one machine; it cannot go with `count` > 1",
        ));
    }
    if let Some(address) = &n.address
        && let Some(other) = earlier
            .iter()
            .find(|o: &&NodeSpec| o.address.as_deref() == Some(address.get_ref().as_str()))
    {
        return Err(ctx.err(
            Some(&address.span()),
            format!(
                "node `{}` has the same address as node `{}` ({}): each node listens on its own",
                n.name.get_ref(),
                other.name,
                address.get_ref()
            ),
        ));
    }
    Ok(())
}

/// Add a `[[node]]` table's `count` nodes (`name`, or `name-0`, `name-1`, ..) to `out`.
fn push_nodes(
    ctx: &Ctx<'_>,
    n: &NodeToml,
    figures: &NodeFigures,
    reserve_gib: f64,
    out: &mut Nodes,
) -> Result<(), ConfigError> {
    let count = figures.count;
    let base = n.name.get_ref().trim();
    if base.is_empty() {
        return Err(ctx.err(Some(&n.name.span()), "node `name` is empty"));
    }
    for i in 0..count {
        let name = if count == 1 {
            base.to_string()
        } else {
            format!("{base}-{i}")
        };
        let id = NodeId(out.specs.len() as u32);
        if out.index.insert(name.clone(), id).is_some() {
            return Err(ctx.err(
                Some(&n.name.span()),
                format!("duplicate node name `{name}`"),
            ));
        }
        out.specs.push(NodeSpec {
            name,
            device: figures.dev.id.to_string(),
            memory_bytes: ((figures.memory_gib - reserve_gib).max(0.0) * GIB) as u64,
            flops: figures.flops / figures.emulate,
            link: figures.link,
            step_overhead_s: 0.0,
            compute_spread: 0.0,
            address: n.address.as_ref().map(|a| a.get_ref().clone()),
            listen: n.listen.as_ref().map(|a| a.get_ref().clone()),
        });
        out.slowdown.push(figures.emulate);
        out.raw_devices.push(n.device.get_ref().clone());
    }
    Ok(())
}

/// The id of the node a name refers to, or an error suggesting the nearest name.
pub(super) fn find_node(
    ctx: &Ctx<'_>,
    index: &BTreeMap<String, NodeId>,
    s: &Spanned<String>,
) -> Result<NodeId, ConfigError> {
    index.get(s.get_ref().as_str()).copied().ok_or_else(|| {
        with_help(
            ctx.err(Some(&s.span()), format!("unknown node `{}`", s.get_ref())),
            nearest(s.get_ref(), index.keys().map(String::as_str))
                .map(|n| format!("did you mean `{n}`?")),
        )
    })
}

/// The `[[links.pair]]` tables: links between two nodes, over the default link.
pub(super) fn resolve_pair_links(
    ctx: &Ctx<'_>,
    links: Option<&LinksToml>,
    default_link: Link,
    lookup_node: &dyn Fn(&Spanned<String>) -> Result<NodeId, ConfigError>,
) -> Result<BTreeMap<(NodeId, NodeId), Link>, ConfigError> {
    let mut pair_links = BTreeMap::new();
    if let Some(l) = links {
        for p in &l.pair {
            let p = p.get_ref();
            let ends = p.between.get_ref();
            if ends.len() != 2 {
                return Err(ctx.err(
                    Some(&p.between.span()),
                    format!("`between` takes exactly two node names, got {}", ends.len()),
                ));
            }
            let (a, b) = (lookup_node(&ends[0])?, lookup_node(&ends[1])?);
            if a == b {
                return Err(ctx.err(
                    Some(&p.between.span()),
                    "`between` names the same node twice",
                ));
            }
            let mut link = default_link;
            if let Some(x) = &p.bandwidth_gbps {
                link.bandwidth_gbps = ctx.positive(x, "bandwidth_gbps")?;
            }
            if let Some(x) = &p.latency_ms {
                link.latency_ms = ctx.non_negative(x, "latency_ms")?;
            }
            pair_links.insert((a.min(b), a.max(b)), link);
        }
    }
    Ok(pair_links)
}

/// `[cluster] transport` and `relays`: whether `run` goes over libp2p, and through which
/// relays. Relays imply libp2p; each must name its relay's peer id (the multiaddr itself is
/// parsed where libp2p is, by the node).
pub(super) fn network(
    ctx: &Ctx<'_>,
    cluster: Option<&ClusterToml>,
) -> Result<(bool, Vec<String>), ConfigError> {
    let Some(c) = cluster else {
        return Ok((false, Vec::new()));
    };
    let mut relays = Vec::new();
    for r in c.relays.iter().flatten() {
        let text = r.get_ref().trim();
        if !text.starts_with('/') || !text.contains("/p2p/") {
            return Err(ctx.err(
                Some(&r.span()),
                format!(
                    "`[cluster] relays`: `{text}` is not a relay's multiaddr; write it as \
                     `ravnest relay` prints it: /ip4/HOST/tcp/PORT/p2p/PEER_ID"
                ),
            ));
        }
        relays.push(text.to_string());
    }
    let p2p = match c.transport.as_ref() {
        None => !relays.is_empty(),
        Some(t) => match t.get_ref().as_str() {
            "p2p" => true,
            "tcp" if relays.is_empty() => false,
            "tcp" => {
                return Err(ctx.err(
                    Some(&t.span()),
                    "`[cluster] transport = \"tcp\"` cannot use `relays`: relays need \
                     `transport = \"p2p\"` (or no `transport`)",
                ));
            }
            other => {
                return Err(ctx.err(
                    Some(&t.span()),
                    format!("`[cluster] transport`: unknown `{other}`; known: tcp, p2p"),
                ));
            }
        },
    };
    Ok((p2p, relays))
}

/// `[cluster] name`, else the file name without its directory and `.toml`.
pub(super) fn cluster_name(ctx: &Ctx<'_>, cluster: Option<&ClusterToml>) -> String {
    cluster.and_then(|c| c.name.clone()).unwrap_or_else(|| {
        ctx.origin
            .rsplit('/')
            .next()
            .unwrap_or("cluster")
            .trim_end_matches(".toml")
            .to_string()
    })
}
