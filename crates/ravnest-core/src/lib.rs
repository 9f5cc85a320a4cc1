//! ravnest-core: the pure heart of ravnest.
//!
//! Cluster and model descriptions, the device catalog, the cost model and the planners. This
//! crate does no I/O, reads no clock and creates no randomness: every function here is a plain
//! function of its inputs, so it can be property-tested exhaustively and run unchanged inside
//! the deterministic simulator. Parsing of `cluster.toml` takes text, not paths; the binary
//! reads files.

pub mod checkpoint;
pub mod cluster;
mod coll_types;
pub mod collective;
pub mod config;
pub mod cost;
pub mod decoder;
pub mod detector;
pub mod device;
pub mod layers;
pub mod model;
pub mod outer;
pub mod pack;
pub mod pipeline;
pub mod planner;
pub mod profile;
pub mod ps;
pub mod recipe;
pub mod ring;
pub mod ring2d;
pub mod stall;
pub mod units;

pub use cluster::{
    ClusterSpec, LayoutChoice, Link, NodeId, NodeSpec, Redundancy, SyncPreference, TrainingSpec,
};
pub use config::{ConfigError, Scenario, parse, parse_with};
pub use layers::LayerRange;
pub use model::{ModelSpec, Optimizer, Precision};
pub use planner::{
    Plan, PlanError, PlanOptions, PlannerKind, plan, plan_scenario, plan_with, policy,
};
