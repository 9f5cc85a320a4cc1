//! A connection the transport's handshake and sessions run on: a TCP socket, or a libp2p
//! stream (direct or relayed; [`crate::p2p`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::p2p::P2pStream;

/// What a handshake reads and writes.
pub(super) trait Io: AsyncRead + AsyncWrite + Unpin {
    /// Where the other end is, for messages.
    fn peer(&self) -> Option<String>;
}

impl Io for TcpStream {
    fn peer(&self) -> Option<String> {
        self.peer_addr().ok().map(|a| a.to_string())
    }
}

impl Io for Conn {
    fn peer(&self) -> Option<String> {
        match self {
            Conn::Tcp(s) => s.peer(),
            Conn::P2p(_) => None,
        }
    }
}

/// One end's read half.
pub(super) type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
/// One end's write half.
pub(super) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// A connection to a peer.
#[derive(Debug)]
pub(super) enum Conn {
    Tcp(TcpStream),
    P2p(P2pStream),
}

impl Conn {
    /// Its two halves, each for one task.
    pub(super) fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Conn::Tcp(s) => {
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
            Conn::P2p(s) => {
                let (r, w) = tokio::io::split(s);
                (Box::new(r), Box::new(w))
            }
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Conn::P2p(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Conn::P2p(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Tcp(s) => Pin::new(s).poll_flush(cx),
            Conn::P2p(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Conn::P2p(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
