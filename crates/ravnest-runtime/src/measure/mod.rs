//! What a node measures of itself, beside training: its compute ([`calibrate`]: its step time
//! as a function of its batch, from registration on and whenever the coordinator asks) and its
//! links to its peers ([`links`]). The coordinator plans with these figures. The node process
//! calibrates before its node actor exists; the actor runs both when asked.

pub mod calibrate;
pub mod links;
