//! What the handshake and the encrypted channel both speak of: the handshake's errors, its
//! MAC, and the transcript the channel is bound to. A leaf both read, so that neither module
//! imports the other's internals in a circle (`handshake` builds on `channel`).

use hmac::Hmac;
use sha2::Sha256;

use super::PROTOCOL_VERSION;

/// HMAC-SHA256, the handshake's MAC.
pub(super) type HmacSha256 = Hmac<Sha256>;

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The other side does not hold the same cluster secret.
    #[error(
        "{0}: wrong cluster secret (check RAVNEST_SECRET or `[cluster] secret` on both sides; or another cluster owns that port)"
    )]
    Secret(String),
    /// Protocol versions differ.
    #[error("{peer}: protocol version {theirs}, this node speaks {ours}")]
    Version {
        /// Who.
        peer: String,
        /// Their version.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// The peer is not a node of this cluster.
    #[error("{0}: not a node of this cluster")]
    Unknown(String),
    /// A connection from that node is already open and live.
    #[error("{0}: that node is already connected (a second connection claiming it is refused)")]
    Duplicate(String),
    /// One end encrypts its connections and the other does not.
    #[error(
        "{0}: encryption is on at one end and off at the other (`TcpConfig::encrypt` must be the same on every node)"
    )]
    Encryption(String),
    /// Not a ravnest peer, or the connection failed.
    #[error("{0}")]
    Io(String),
}

/// What both ends of a connection agreed on in its handshake. The encrypted channel that follows
/// is bound to it (it is the channel's Noise prologue): the channel belongs to this connection
/// only, and what the HMACs do not cover (incarnations, the delivered count) is authenticated by
/// the channel's handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Transcript {
    pub(super) dialer: u32,
    pub(super) listener: u32,
    /// The dialer's nonce.
    pub(super) nc: [u8; 32],
    /// The listener's nonce.
    pub(super) ns: [u8; 32],
    pub(super) dialer_incarnation: u64,
    pub(super) listener_incarnation: u64,
    /// Frames of the dialer's session the listener had delivered.
    pub(super) delivered: u64,
}

impl Transcript {
    /// The bytes both ends feed the channel's handshake as its prologue.
    pub(super) fn prologue(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(128);
        p.extend_from_slice(b"ravnest-channel");
        p.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        p.extend_from_slice(&self.dialer.to_le_bytes());
        p.extend_from_slice(&self.listener.to_le_bytes());
        p.extend_from_slice(&self.nc);
        p.extend_from_slice(&self.ns);
        p.extend_from_slice(&self.dialer_incarnation.to_le_bytes());
        p.extend_from_slice(&self.listener_incarnation.to_le_bytes());
        p.extend_from_slice(&self.delivered.to_le_bytes());
        p
    }
}
