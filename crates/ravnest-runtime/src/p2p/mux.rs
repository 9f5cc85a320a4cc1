//! yamux with large data frames: the multiplexer under every libp2p connection ravnest makes.
//!
//! libp2p's own yamux upgrade sends data in frames of 16 KiB and offers no way to change it
//! without falling back to the older yamux 0.12. Each frame is one hand-off from the stream to
//! the connection's task and one on the other side; at a gigabyte per second that is 60,000
//! wake-ups a second, and on a loopback ring it cost a fifth of the bandwidth. Here frames are
//! [`FRAME`] bytes (one stream window: yamux never sends past the peer's credit, and every
//! yamux accepts frames up to a mebibyte), which is the whole change: the protocol on the wire
//! is the same `/yamux/1.0.0`, and peers with libp2p's default upgrade interoperate.

use std::collections::VecDeque;
use std::io;
use std::iter;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use futures::future;
use futures::{AsyncRead, AsyncWrite};
use libp2p::core::muxing::{StreamMuxer, StreamMuxerEvent};
use libp2p::core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade, UpgradeInfo};

/// The largest data frame sent: yamux's initial stream window, 256 KiB.
pub(super) const FRAME: usize = 256 * 1024;

/// Inbound streams kept for the swarm before it asks for them (libp2p's yamux keeps 256 too).
const MAX_WAITING: usize = 256;

/// The upgrade: yamux 0.13 with [`FRAME`]-sized data frames.
#[derive(Debug, Clone)]
pub(super) struct Yamux(yamux::Config);

impl Yamux {
    pub(super) fn new() -> Yamux {
        let mut cfg = yamux::Config::default();
        cfg.set_split_send_size(FRAME);
        // As libp2p's own upgrade: no reading a stream after its connection closed.
        cfg.set_read_after_close(false);
        Yamux(cfg)
    }

    fn start<C>(self, io: C, mode: yamux::Mode) -> future::Ready<Result<Muxer<C>, io::Error>>
    where
        C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        future::ready(Ok(Muxer {
            conn: yamux::Connection::new(io, self.0, mode),
            waiting: VecDeque::new(),
            waker: None,
        }))
    }
}

impl UpgradeInfo for Yamux {
    type Info = &'static str;
    type InfoIter = iter::Once<Self::Info>;

    fn protocol_info(&self) -> Self::InfoIter {
        iter::once("/yamux/1.0.0")
    }
}

impl<C> InboundConnectionUpgrade<C> for Yamux
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = Muxer<C>;
    type Error = io::Error;
    type Future = future::Ready<Result<Muxer<C>, io::Error>>;

    fn upgrade_inbound(self, io: C, _: Self::Info) -> Self::Future {
        self.start(io, yamux::Mode::Server)
    }
}

impl<C> OutboundConnectionUpgrade<C> for Yamux
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = Muxer<C>;
    type Error = io::Error;
    type Future = future::Ready<Result<Muxer<C>, io::Error>>;

    fn upgrade_outbound(self, io: C, _: Self::Info) -> Self::Future {
        self.start(io, yamux::Mode::Client)
    }
}

/// One connection's yamux, as libp2p's swarm drives a multiplexer.
#[derive(Debug)]
pub(super) struct Muxer<C> {
    conn: yamux::Connection<C>,
    /// Streams the peer opened that the swarm has not taken yet.
    waiting: VecDeque<yamux::Stream>,
    /// The swarm's task waiting in `poll_inbound`.
    waker: Option<Waker>,
}

impl<C> Muxer<C>
where
    C: AsyncRead + AsyncWrite + Unpin + 'static,
{
    /// Drives the connection until the peer opens a stream (or the connection ends).
    fn next_inbound(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<yamux::Stream, yamux::ConnectionError>> {
        match self.conn.poll_next_inbound(cx) {
            Poll::Ready(Some(r)) => Poll::Ready(r),
            Poll::Ready(None) => Poll::Ready(Err(yamux::ConnectionError::Closed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<C> StreamMuxer for Muxer<C>
where
    C: AsyncRead + AsyncWrite + Unpin + 'static,
{
    type Substream = yamux::Stream;
    type Error = yamux::ConnectionError;

    fn poll_inbound(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<yamux::Stream, Self::Error>> {
        let this = self.get_mut();
        if let Some(s) = this.waiting.pop_front() {
            return Poll::Ready(Ok(s));
        }
        if let Poll::Ready(r) = this.next_inbound(cx) {
            return Poll::Ready(r);
        }
        this.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn poll_outbound(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<yamux::Stream, Self::Error>> {
        self.get_mut().conn.poll_new_outbound(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.get_mut().conn.poll_close(cx)
    }

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<StreamMuxerEvent, Self::Error>> {
        let this = self.get_mut();
        let stream = match this.next_inbound(cx) {
            Poll::Ready(r) => r?,
            Poll::Pending => return Poll::Pending,
        };
        // A peer that opens streams faster than they are taken loses the excess, as with
        // libp2p's upgrade.
        if this.waiting.len() < MAX_WAITING {
            this.waiting.push_back(stream);
            if let Some(w) = this.waker.take() {
                w.wake();
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
