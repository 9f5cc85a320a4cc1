//! Helpers the end-to-end tests share.

/// `n` distinct free ports, below the kernel's ephemeral range (see `spare_ports`: CI once gave
/// `a` and `slow` the same one, and once a port taken by an outgoing connection in between).
pub fn free_ports(n: usize) -> Vec<u16> {
    ravnest_runtime::tcp::spare_ports(n).unwrap()
}
