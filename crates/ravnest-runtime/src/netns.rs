//! Shaped links between real processes on one Linux machine: network namespaces joined by a
//! bridge, each node's egress limited by a token bucket (`tc qdisc ... tbf`). What `ravnest
//! bench slow-link` and the shaped-link tests run node processes in (`ip netns exec NS ...`).
//! Needs root and iproute2; [`ShapedNet::up`] says so where namespaces cannot be made.

use std::process::Command;

/// Why a shaped network could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NetnsError(String);

/// Run `ip ARGS`; its error output on failure.
pub fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| NetnsError(format!("cannot run `ip` (iproute2): {e}")))?;
    if !out.status.success() {
        return Err(NetnsError(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Network namespaces joined by a bridge, each node's egress shaped; removed on drop.
#[derive(Debug)]
pub struct ShapedNet {
    prefix: String,
    nodes: usize,
}

impl ShapedNet {
    /// `nodes` namespaces at [`ShapedNet::addr`] 0, 1, ... on one bridge (in a namespace of its
    /// own), each sending at most `rate_mbit` Mbit/s.
    pub fn up(nodes: usize, rate_mbit: f64) -> Result<ShapedNet, NetnsError> {
        let mut net = ShapedNet {
            prefix: format!("rvsl{}", std::process::id()),
            nodes: 0,
        };
        let sw = net.switch();
        ip(&["netns", "add", &sw]).map_err(|e| {
            NetnsError(format!(
                "network namespaces are needed (root, iproute2, Linux) and none could be made \
                 here: {e}"
            ))
        })?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        let rate = format!("{}kbit", (rate_mbit * 1000.0).round().max(8.0) as u64);
        for i in 0..nodes {
            let ns = net.ns(i);
            ip(&["netns", "add", &ns])?;
            net.nodes = i + 1;
            let (v, p) = (format!("{}v{i}", net.prefix), format!("{}p{i}", net.prefix));
            ip(&["link", "add", &v, "type", "veth", "peer", "name", &p])?;
            ip(&["link", "set", &v, "netns", &ns])?;
            ip(&["link", "set", &p, "netns", &sw])?;
            ip(&["-n", &ns, "link", "set", &v, "name", "eth0"])?;
            let addr = format!("{}/24", Self::addr(i));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &sw, "link", "set", &p, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &p, "up"])?;
            let tc = [
                "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                &rate, "burst", "32kb", "latency", "400ms",
            ];
            ip(&tc).map_err(|e| NetnsError(format!("cannot shape the link: {e}")))?;
        }
        Ok(net)
    }

    fn switch(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// Node `i`'s namespace (`ip netns exec` it).
    pub fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.prefix)
    }

    /// Node `i`'s address.
    pub fn addr(i: usize) -> String {
        format!("10.213.0.{}", i + 1)
    }
}

impl Drop for ShapedNet {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["netns", "del", &self.switch()]);
    }
}
