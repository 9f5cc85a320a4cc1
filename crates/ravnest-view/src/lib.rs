//! See a ravnest run: the [`board`] (a pure fold of the nodes' events), the live dashboard
//! ([`serve`]: the [`page`], server-sent events, Prometheus [`metrics`]), `report.html` after a
//! run or a simulation, and TensorBoard event files ([`tfevents`]).

pub mod board;
pub mod metrics;
pub mod page;
pub mod serve;
pub mod tfevents;

pub use board::Board;
