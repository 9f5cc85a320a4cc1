//! The node's pure parts, which the runtime's node actor drives: its decisions as a state
//! machine ([`core`]: epochs, halts, versions kept and fetched, peers' requests, the
//! checkpoint duty; [`duty`]: a shard written in parts, paced by acknowledgements), where the
//! pieces of a clipped step's norm go ([`clip`]), the rules by which an epoch queues, starts
//! and runs ([`epochs`]), the model versions it keeps ([`versions`]), local SGD's outer rounds
//! ([`outer`]), a sharded step's ring layout ([`shard`]), a step's collectives as they come
//! back ([`step`]) and a pipeline stage's step ([`stage`]: its 1F1B order, what it sends, its
//! early inputs). Like the coordinator, they read no clock and do no I/O; a version's values
//! are the backend's handle, a type parameter here.

pub mod clip;
pub mod core;
pub mod duty;
pub mod epochs;
pub mod machine;
pub mod outer;
pub mod shard;
pub mod stage;
pub mod step;
pub mod values;
pub mod versions;
