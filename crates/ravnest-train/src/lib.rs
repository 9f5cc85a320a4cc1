//! ravnest-train: real training for `ravnest run`. Candle networks ([`net`]), datasets
//! ([`data`]), our optimizers ([`optim`]), the [`compute::CandleCompute`] side of the runtime's
//! `Compute` seam, checkpoint files ([`store`]) and capability measurement ([`measure`]). A
//! node's process over them is `ravnest-node`'s.

pub mod compute;
pub mod corpus;
pub mod data;
pub mod device;
pub mod folder;
pub mod gpt;
pub mod layout;
mod load_error;
pub mod measure;
pub mod mlp;
pub mod net;
pub mod optim;
pub mod phases;
pub mod state;
pub mod store;
pub mod tok;
pub mod worker;
