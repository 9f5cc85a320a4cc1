//! ravnest's protocol, pure: the messages nodes and the coordinator exchange ([`msg`]), the
//! digests every replica compares ([`digest`]), the coordinator as a state machine
//! (`Coordinator::handle(now, Input) -> Vec<Effect>`, [`coordinator`]), the node's epoch
//! rules ([`epochs`]) and the node's versions and sharded layout ([`node`]). No I/O, no clock, no async runtime: the actors that carry these over a
//! transport are ravnest-runtime's.

pub mod coordinator;
pub mod digest;
pub mod epochs;
pub mod msg;
pub mod node;
