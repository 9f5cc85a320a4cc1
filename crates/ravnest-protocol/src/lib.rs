//! ravnest's protocol, pure: the messages nodes and the coordinator exchange ([`msg`]), the
//! digests every replica compares ([`digest`]), the coordinator as a state machine
//! (`Coordinator::handle(now, Input) -> Vec<Effect>`, [`coordinator`]) and the node as one
//! (`NodeCore::handle(Input) -> Vec<Effect>`, [`node`]). No I/O, no clock, no async runtime:
//! the actors that carry these over a transport are ravnest-runtime's.

pub mod coordinator;
pub mod digest;
pub mod msg;
pub mod node;

/// A deterministic cluster of the real coordinator and nodes' decisions, for tests.
#[cfg(test)]
mod harness;
