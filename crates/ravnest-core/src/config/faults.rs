//! The `[[fault]]` tables: the fault schedule that `sim` injects.

use std::collections::BTreeSet;
use std::ops::Range;

use toml::Spanned;

use super::ctx::Ctx;
use super::raw::{FAULT_KINDS, FaultToml};
use super::suggest::{did_you_mean, with_help};
use super::types::{ConfigError, DEFAULT_LINK, Fault};
use crate::cluster::{Link, NodeId};

/// One `[[fault]]` table, checked; `lookup_node` finds the nodes it names.
pub(super) fn resolve_fault(
    ctx: &Ctx<'_>,
    f: &Spanned<FaultToml>,
    lookup_node: &dyn Fn(&Spanned<String>) -> Result<NodeId, ConfigError>,
) -> Result<Fault, ConfigError> {
    let r = FaultReader {
        ctx,
        span: f.span(),
        f: f.get_ref(),
        kind: f.get_ref().kind.get_ref().as_str(),
        lookup_node,
    };
    let f = r.f;
    Ok(match r.kind {
        "crash" => Fault::Crash {
            node: r.need_node()?,
            at_s: r.need_f(&f.at_s, "at_s")?,
        },
        "restart" => Fault::Restart {
            node: r.need_node()?,
            at_s: r.need_f(&f.at_s, "at_s")?,
        },
        "slowdown" => r.slowdown()?,
        "reset" => {
            let (a, b) = r.need_pair()?;
            Fault::Reset {
                a,
                b,
                at_s: r.need_f(&f.at_s, "at_s")?,
            }
        }
        "link" => r.link()?,
        "partition" => r.partition()?,
        other => {
            return Err(with_help(
                ctx.err(
                    Some(&f.kind.span()),
                    format!("unknown fault kind `{other}`"),
                ),
                Some(did_you_mean(other, FAULT_KINDS.iter().copied())),
            ));
        }
    })
}

/// One `[[fault]]` table being read: its fields, its `kind`, and how to find its nodes.
struct FaultReader<'a> {
    ctx: &'a Ctx<'a>,
    /// The whole table, where a missing field is reported.
    span: Range<usize>,
    f: &'a FaultToml,
    kind: &'a str,
    lookup_node: &'a dyn Fn(&Spanned<String>) -> Result<NodeId, ConfigError>,
}

impl FaultReader<'_> {
    /// A required time (0 or more).
    fn need_f(&self, v: &Option<Spanned<f64>>, what: &str) -> Result<f64, ConfigError> {
        match v {
            Some(x) => self.ctx.non_negative(x, what),
            None => Err(self.ctx.err(
                Some(&self.span),
                format!("fault kind = \"{}\" needs `{what}`", self.kind),
            )),
        }
    }

    /// The required `node`.
    fn need_node(&self) -> Result<NodeId, ConfigError> {
        match &self.f.node {
            Some(n) => (self.lookup_node)(n),
            None => Err(self.ctx.err(
                Some(&self.span),
                format!("fault kind = \"{}\" needs `node`", self.kind),
            )),
        }
    }

    /// `between = [a, b]`: exactly two node names.
    fn need_pair(&self) -> Result<(NodeId, NodeId), ConfigError> {
        let Some(between) = &self.f.between else {
            return Err(self.ctx.err(
                Some(&self.span),
                format!("fault kind = \"{}\" needs `between = [a, b]`", self.kind),
            ));
        };
        if between.get_ref().len() != 2 {
            return Err(self.ctx.err(
                Some(&between.span()),
                "`between` takes exactly two node names",
            ));
        }
        Ok((
            (self.lookup_node)(&between.get_ref()[0])?,
            (self.lookup_node)(&between.get_ref()[1])?,
        ))
    }

    /// The required `from_s` .. `to_s`, `to_s` after `from_s`.
    fn window(&self) -> Result<(f64, f64), ConfigError> {
        let f = self.f;
        let (a, b) = (
            self.need_f(&f.from_s, "from_s")?,
            self.need_f(&f.to_s, "to_s")?,
        );
        if b <= a {
            return Err(self.ctx.err(
                Some(&f.to_s.as_ref().unwrap().span()),
                format!("`to_s` ({b}) must be after `from_s` ({a})"),
            ));
        }
        Ok((a, b))
    }

    /// `kind = "slowdown"`.
    fn slowdown(&self) -> Result<Fault, ConfigError> {
        let factor = match &self.f.factor {
            Some(x) => self.ctx.positive(x, "factor")?,
            None => {
                return Err(self
                    .ctx
                    .err(Some(&self.span), "fault kind = \"slowdown\" needs `factor`"));
            }
        };
        let node = self.need_node()?;
        let (from_s, to_s) = self.window()?;
        Ok(Fault::Slowdown {
            node,
            factor,
            from_s,
            to_s,
        })
    }

    /// `kind = "link"`.
    fn link(&self) -> Result<Fault, ConfigError> {
        let (a, b) = self.need_pair()?;
        let bandwidth_gbps = match &self.f.bandwidth_gbps {
            Some(x) => self.ctx.positive(x, "bandwidth_gbps")?,
            None => {
                return Err(self.ctx.err(
                    Some(&self.span),
                    "fault kind = \"link\" needs `bandwidth_gbps`",
                ));
            }
        };
        let latency_ms = match &self.f.latency_ms {
            Some(x) => self.ctx.non_negative(x, "latency_ms")?,
            None => DEFAULT_LINK.latency_ms,
        };
        let (from_s, to_s) = self.window()?;
        Ok(Fault::LinkDegraded {
            a,
            b,
            link: Link {
                bandwidth_gbps,
                latency_ms,
            },
            from_s,
            to_s,
        })
    }

    /// `kind = "partition"`: at least two disjoint groups.
    fn partition(&self) -> Result<Fault, ConfigError> {
        let Some(groups) = &self.f.groups else {
            return Err(self.ctx.err(
                Some(&self.span),
                "fault kind = \"partition\" needs `groups = [[..], [..]]`",
            ));
        };
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for g in groups.get_ref() {
            let mut ids = Vec::new();
            for n in g {
                let id = (self.lookup_node)(n)?;
                if !seen.insert(id) {
                    return Err(self.ctx.err(
                        Some(&n.span()),
                        format!("node `{}` is in two partition groups", n.get_ref()),
                    ));
                }
                ids.push(id);
            }
            out.push(ids);
        }
        if out.len() < 2 {
            return Err(self.ctx.err(
                Some(&groups.span()),
                "a partition needs at least two groups",
            ));
        }
        let (from_s, to_s) = self.window()?;
        Ok(Fault::Partition {
            groups: out,
            from_s,
            to_s,
        })
    }
}
