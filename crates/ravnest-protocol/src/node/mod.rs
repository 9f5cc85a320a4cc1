//! The node's pure parts, which the runtime's node actor drives: the model versions it keeps
//! ([`versions`]) and a sharded step's ring layout ([`shard`]). Like the coordinator, they read
//! no clock and do no I/O; a version's values are the backend's handle, a type parameter here.

pub mod shard;
pub mod versions;
