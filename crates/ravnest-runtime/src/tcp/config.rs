//! The TCP transport's configuration and the protocol's constants (a leaf: it imports no
//! other part of the transport).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ravnest_core::NodeId;

pub(super) const MAGIC: &[u8; 4] = b"RVN1";

/// A joiner asking for the cluster file (`ravnest run --join HOST:PORT`).
pub(super) const CONFIG_MAGIC: &[u8; 4] = b"RVCF";

/// Largest cluster file handed out.
pub(super) const MAX_CLUSTER_FILE: u32 = 4 << 20;

pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshake status bytes (listener → dialer).
pub(super) const OK: u8 = 0;

pub(super) const BAD_VERSION: u8 = 1;

pub(super) const UNKNOWN_NODE: u8 = 2;

pub(super) const BAD_SECRET: u8 = 3;

pub(super) const DUPLICATE: u8 = 4;

pub(super) const ENCRYPTION: u8 = 5;

/// A joiner's request for the cluster file is answered elsewhere (the coordinator's host).
pub(super) const MOVED: u8 = 6;

/// A joiner's request for the cluster file is refused, with the reason.
pub(super) const REFUSED: u8 = 7;

/// Largest part of a joiner's request (its name, its address).
pub(super) const MAX_JOIN_REQUEST: usize = 4096;

/// The dialer's answer: its HMAC, its incarnation, whether it encrypts.
pub(super) const ANSWER: usize = 32 + 8 + 1;

/// A connection from a node is live while something arrived on it this recently: a second
/// connection claiming the same node is then refused (it cannot be the node: that one is
/// talking to us). A restarted node's old connection is closed by its kernel at once; a silent
/// one is let go after this long.
pub const LIVE_MS: u64 = 3000;

/// A process's view of the cluster's network.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// This process's node.
    pub me: NodeId,
    /// Every node's address, the one peers dial (this node's included).
    pub peers: BTreeMap<NodeId, SocketAddr>,
    /// Where this node binds, if not its address in `peers` (behind NAT or a proxy).
    pub listen: Option<SocketAddr>,
    /// The node whose process hosts the coordinator and the checkpoint actor.
    pub coordinator: NodeId,
    /// The cluster secret (HMAC key).
    pub secret: Vec<u8>,
    /// Largest frame accepted.
    pub max_frame: u32,
    /// How long a dial is retried before queued envelopes are given up.
    pub connect_window: Duration,
    /// The cluster file this node hands to an authenticated joiner (`--join HOST:PORT`),
    /// if it shares one.
    pub cluster_file: Option<Arc<str>>,
    /// Encrypt and authenticate every byte after the handshake (a Noise channel bound to the
    /// connection, keyed from `secret`; see `tcp/channel.rs`). On unless the network is
    /// trusted; every node must agree (a mismatch is refused, naming it).
    pub encrypt: bool,
}

/// What a joiner asks for with the cluster file (`run --join`): who it is and where peers reach
/// it. A name the file lacks, with an address, asks for a place in the cluster (an id): only
/// the coordinator's host hands those out, in order, so two joiners never get the same one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JoinRequest {
    /// The node's name (empty: the file alone).
    pub name: String,
    /// The address peers dial it at (empty when it has none to give).
    pub address: String,
}

/// A node's answer to a [`JoinRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShareReply {
    /// The cluster file's document (with the joiner's place in it, when it asked for one).
    File(String),
    /// Ask the node at this address (the coordinator's host) instead.
    Elsewhere(String),
    /// Not now, and why.
    Refused(String),
}

/// How a node answers joiners (set by its process; without one, it hands out
/// `cluster_file` as it is).
pub type Sharer = Arc<dyn Fn(&JoinRequest) -> ShareReply + Send + Sync>;

/// Called with a peer that could not be reached within the connect window.
pub type PeerDownHook = Arc<dyn Fn(NodeId) + Send + Sync>;
