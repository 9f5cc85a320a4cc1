//! Helpers the end-to-end tests share.

/// `n` distinct free ports: every listener is held until all are chosen (ports taken one at a
/// time, each released before the next is asked for, can come back twice: CI once gave `a`
/// and `slow` the same one).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}
