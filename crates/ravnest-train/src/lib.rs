//! ravnest-train: real training for `ravnest run`. Candle networks ([`net`]), datasets
//! ([`data`]), our optimizers ([`optim`]), the [`compute::CandleCompute`] side of the runtime's
//! `Compute` seam, checkpoint files ([`store`]), capability measurement ([`measure`]), a node
//! process ([`process`]) and LAN discovery by mDNS ([`discover`]).

pub mod compute;
pub mod data;
pub mod device;
pub mod discover;
pub mod events;
pub mod gpt;
pub mod layout;
pub mod measure;
pub mod mlp;
pub mod net;
pub mod optim;
pub mod process;
pub mod state;
pub mod store;
pub mod summary;
pub mod worker;
