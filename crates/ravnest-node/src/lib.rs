//! A ravnest node's process (`ravnest run --node NAME`): its setup, the transport it taps,
//! the coordinator's host (registrations, calibration, the coordinator and checkpoint actors,
//! fail-over and stepping down), joiners and LAN discovery, and the run's reports. Training
//! itself (the models, the state, checkpoint files) is `ravnest-train`'s, behind the Compute
//! seam; this crate holds no model code.

pub mod discover;
pub mod events;
pub mod process;
pub mod summary;
