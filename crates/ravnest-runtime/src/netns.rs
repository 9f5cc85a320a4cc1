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

/// The error when the first namespace cannot be made: the machine does not allow them.
fn no_namespaces(e: NetnsError) -> NetnsError {
    NetnsError(format!(
        "network namespaces are needed (root, iproute2, Linux) and none could be made here: {e}"
    ))
}

/// A bridge `br0`, up, in namespace `ns`: the switch the other namespaces' cables plug into.
fn bridge(ns: &str) -> Result<(), NetnsError> {
    ip(&["-n", ns, "link", "add", "br0", "type", "bridge"])?;
    ip(&["-n", ns, "link", "set", "br0", "up"])
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
        ip(&["netns", "add", &sw]).map_err(no_namespaces)?;
        bridge(&sw)?;
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
            tbf(&ns, rate_mbit).map_err(|e| NetnsError(format!("cannot shape the link: {e}")))?;
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

/// How a home router maps its hosts' connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nat {
    /// Masquerading that keeps a connection's source port where it can (what most home routers
    /// do): a pair behind two of these can punch a hole.
    Easy,
    /// A new random port for every connection (`MASQUERADE --random-fully`): the port a relay
    /// sees is not the one a peer would reach, so no hole can be punched.
    Symmetric,
}

/// The internet in a box: a public network (a switch in a namespace of its own, addresses
/// [`NatNet::public_addr`]) with hosts on it, and home networks each behind a router of its
/// own that masquerades its host's connections ([`Nat`]) and drops what comes in unasked, as a
/// home router does. A home host reaches the public network; nothing public reaches a home
/// host unless that host's own connection opened the way. Links on the public network carry
/// `delay_ms` of latency each way. Removed on drop. Needs root, iproute2 and iptables.
#[derive(Debug)]
pub struct NatNet {
    prefix: String,
    made: Vec<String>,
}

impl NatNet {
    /// `public` hosts on the public network, and one home host behind a router per entry of
    /// `homes`.
    pub fn up(public: usize, homes: &[Nat], delay_ms: u32) -> Result<NatNet, NetnsError> {
        let mut net = NatNet {
            prefix: format!("rvnat{}", std::process::id() % 100_000),
            made: Vec::new(),
        };
        let wan = net.add("wan").map_err(no_namespaces)?;
        bridge(&wan)?;
        for i in 0..public {
            let ns = net.add(&format!("p{i}"))?;
            net.cable(&ns, "eth0", &wan, &format!("p{i}"), delay_ms)?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Self::public_addr(i)),
                "dev",
                "eth0",
            ])?;
        }
        for (h, nat) in homes.iter().enumerate() {
            let router = net.add(&format!("r{h}"))?;
            let home = net.add(&format!("h{h}"))?;
            net.cable(&router, "eth0", &wan, &format!("r{h}"), delay_ms)?;
            ip(&[
                "-n",
                &router,
                "addr",
                "add",
                &format!("203.0.113.{}/24", 100 + h),
                "dev",
                "eth0",
            ])?;
            // The home side: the router's eth1 to the host's eth0.
            let (a, b) = (format!("{}a{h}", net.prefix), format!("{}b{h}", net.prefix));
            ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
            ip(&["link", "set", &a, "netns", &router])?;
            ip(&["link", "set", &b, "netns", &home])?;
            ip(&["-n", &router, "link", "set", &a, "name", "eth1"])?;
            ip(&["-n", &home, "link", "set", &b, "name", "eth0"])?;
            let lan = format!("192.168.{}", h + 1);
            ip(&[
                "-n",
                &router,
                "addr",
                "add",
                &format!("{lan}.1/24"),
                "dev",
                "eth1",
            ])?;
            ip(&[
                "-n",
                &home,
                "addr",
                "add",
                &format!("{}/24", Self::home_addr(h)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &router, "link", "set", "eth1", "up"])?;
            ip(&["-n", &home, "link", "set", "eth0", "up"])?;
            ip(&[
                "-n",
                &home,
                "route",
                "add",
                "default",
                "via",
                &format!("{lan}.1"),
            ])?;
            exec(&router, &["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])?;
            let mut masq = vec![
                "iptables",
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-o",
                "eth0",
                "-j",
            ];
            masq.push("MASQUERADE");
            if *nat == Nat::Symmetric {
                masq.push("--random-fully");
            }
            exec(&router, &masq)?;
            // Unasked packets from outside are dropped (not answered with a reset).
            let ok = [
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            ];
            for chain in ["FORWARD", "INPUT"] {
                let mut accept = vec!["iptables", "-A", chain, "-i", "eth0"];
                accept.extend(ok);
                exec(&router, &accept)?;
                exec(
                    &router,
                    &["iptables", "-A", chain, "-i", "eth0", "-j", "DROP"],
                )?;
            }
        }
        Ok(net)
    }

    /// Make a namespace (removed on drop) with its loopback up.
    fn add(&mut self, name: &str) -> Result<String, NetnsError> {
        let ns = format!("{}{name}", self.prefix);
        ip(&["netns", "add", &ns])?;
        self.made.push(ns.clone());
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// A cable from `ns`'s `dev` to the public switch, with `delay_ms` each way.
    fn cable(
        &self,
        ns: &str,
        dev: &str,
        wan: &str,
        tag: &str,
        delay_ms: u32,
    ) -> Result<(), NetnsError> {
        let (v, p) = (
            format!("{}v{tag}", self.prefix),
            format!("{}s{tag}", self.prefix),
        );
        ip(&["link", "add", &v, "type", "veth", "peer", "name", &p])?;
        ip(&["link", "set", &v, "netns", ns])?;
        ip(&["link", "set", &p, "netns", wan])?;
        ip(&["-n", ns, "link", "set", &v, "name", dev])?;
        ip(&["-n", ns, "link", "set", dev, "up"])?;
        ip(&["-n", wan, "link", "set", &p, "master", "br0"])?;
        ip(&["-n", wan, "link", "set", &p, "up"])?;
        if delay_ms > 0 {
            let d = format!("{delay_ms}ms");
            for (n, d_) in [(ns, dev), (wan, p.as_str())] {
                exec(
                    n,
                    &[
                        "tc", "qdisc", "add", "dev", d_, "root", "netem", "delay", &d,
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// Public host `i`'s namespace.
    pub fn public_ns(&self, i: usize) -> String {
        format!("{}p{i}", self.prefix)
    }

    /// Public host `i`'s address.
    pub fn public_addr(i: usize) -> String {
        format!("203.0.113.{}", 10 + i)
    }

    /// Home host `h`'s namespace (behind router `h`).
    pub fn home_ns(&self, h: usize) -> String {
        format!("{}h{h}", self.prefix)
    }

    /// Home host `h`'s address on its home network (not reachable from outside it).
    pub fn home_addr(h: usize) -> String {
        format!("192.168.{}.2", h + 1)
    }

    /// Give home router `h` another public address (as an ISP does to a home line): what its
    /// hosts' connections were masqueraded to is gone with the old one.
    pub fn renumber(&self, h: usize) -> Result<(), NetnsError> {
        // The old one goes first: a second address on the subnet would be a secondary one,
        // which Linux removes with the primary.
        let router = format!("{}r{h}", self.prefix);
        let old = format!("203.0.113.{}/24", 100 + h);
        ip(&["-n", &router, "addr", "del", &old, "dev", "eth0"])?;
        let new = format!("203.0.113.{}/24", 150 + h);
        ip(&["-n", &router, "addr", "add", &new, "dev", "eth0"])
    }

    /// Limit public host `i`'s sending to `rate_mbit` Mbit/s (a token bucket under its delay).
    pub fn shape_public(&self, i: usize, rate_mbit: f64) -> Result<(), NetnsError> {
        let ns = self.public_ns(i);
        exec(&ns, &["tc", "qdisc", "del", "dev", "eth0", "root"]).ok();
        tbf(&ns, rate_mbit)
    }
}

/// Limit what namespace `ns` sends on its `eth0` to `rate_mbit` Mbit/s (a token bucket).
fn tbf(ns: &str, rate_mbit: f64) -> Result<(), NetnsError> {
    let rate = format!("{}kbit", (rate_mbit * 1000.0).round().max(8.0) as u64);
    let cmd = [
        "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", &rate, "burst", "32kb",
        "latency", "400ms",
    ];
    exec(ns, &cmd)
}

/// Run `cmd` in namespace `ns`; its error output on failure.
fn exec(ns: &str, cmd: &[&str]) -> Result<(), NetnsError> {
    let mut args = vec!["netns", "exec", ns];
    args.extend_from_slice(cmd);
    ip(&args)
}

impl Drop for NatNet {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
