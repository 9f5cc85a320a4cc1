//! Free loopback ports for processes started later (tests, benches, the chaos suite).
//!
//! A port chosen by binding port 0 and letting go comes from the kernel's ephemeral range,
//! the same range every outgoing connection on the machine takes its local port from: in the
//! moment between letting go and the node process binding it, another connection can take it
//! ("Address already in use", seen in CI). Ports below that range are never given to outgoing
//! connections, so they are chosen there, each checked by binding it, all held until every one
//! is chosen (so no two are the same).

use std::net::TcpListener;

/// Where the kernel's ephemeral range starts (Linux's default when it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// `n` distinct loopback ports that were free a moment ago, below the ephemeral range where it
/// leaves room (from port 0's range otherwise).
pub fn spare_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let top = ephemeral_start();
    let low = 10_000u16;
    let mut held = Vec::new();
    let mut tries = 0;
    while held.len() < n && top > low + 1000 && tries < 50 * n {
        tries += 1;
        let port = rand::random_range(low..top);
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            held.push(l);
        }
    }
    while held.len() < n {
        held.push(TcpListener::bind("127.0.0.1:0")?);
    }
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_and_free() {
        let ports = spare_ports(8).unwrap();
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 8);
        for p in ports {
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
