//! The frames' streams: a libp2p behaviour that opens a [`PROTOCOL`] stream on the connection
//! the driver picks (not any connection to the peer: one that stopped answering must not be
//! picked again), hands over the streams peers open, and wraps each stream so that it fails at
//! once when its connection is given up ([`Doom`]), instead of waiting on a dead TCP
//! connection for the kernel's retries (a quarter of an hour).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use futures::task::AtomicWaker;
use libp2p::core::upgrade::ReadyUpgrade;
use libp2p::core::{Endpoint, Multiaddr, transport::PortUse};
use libp2p::swarm::handler::{
    ConnectionEvent, DialUpgradeError, FullyNegotiatedInbound, FullyNegotiatedOutbound,
};
use libp2p::swarm::{
    ConnectionDenied, ConnectionHandler, ConnectionHandlerEvent, ConnectionId, FromSwarm,
    NetworkBehaviour, NotifyHandler, SubstreamProtocol, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm,
};
use libp2p::{PeerId, StreamProtocol};
use tokio::sync::{mpsc, oneshot};

use super::PROTOCOL;

/// Where an opened stream goes (or why none could be opened).
pub(super) type Opener = oneshot::Sender<Result<Doomed, String>>;

/// A connection given up: its streams fail from then on.
#[derive(Debug, Default)]
pub(super) struct Doom {
    given_up: AtomicBool,
    /// The wakers of the streams on it (each stream its own: one waiting to read on one
    /// stream must be woken as surely as one writing on another).
    streams: Mutex<Vec<Weak<Wakers>>>,
}

/// What one stream waits on.
#[derive(Debug, Default)]
struct Wakers {
    reader: AtomicWaker,
    writer: AtomicWaker,
}

impl Doom {
    /// Give the connection up: every stream on it fails now.
    pub(super) fn fall(&self) {
        self.given_up.store(true, Ordering::SeqCst);
        for w in self.streams.lock().unwrap().drain(..) {
            if let Some(w) = w.upgrade() {
                w.reader.wake();
                w.writer.wake();
            }
        }
    }

    /// A new stream's wakers, woken when the connection is given up.
    fn watch(&self) -> Arc<Wakers> {
        let w = Arc::new(Wakers::default());
        let mut streams = self.streams.lock().unwrap();
        streams.retain(|s| s.strong_count() > 0);
        streams.push(Arc::downgrade(&w));
        w
    }
}

/// A stream that fails once its connection is given up.
#[derive(Debug)]
pub struct Doomed {
    inner: libp2p::Stream,
    doom: Arc<Doom>,
    wakers: Arc<Wakers>,
}

impl Doomed {
    fn check(&self, waker: &AtomicWaker, w: &Waker) -> io::Result<()> {
        waker.register(w);
        if self.doom.given_up.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "its connection stopped answering",
            ));
        }
        Ok(())
    }
}

impl futures::AsyncRead for Doomed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        self.check(&self.wakers.reader, cx.waker())?;
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl futures::AsyncWrite for Doomed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check(&self.wakers.writer, cx.waker())?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check(&self.wakers.writer, cx.waker())?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.check(&self.wakers.writer, cx.waker())?;
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

/// Opens asked for, each on one connection; streams peers opened.
pub(super) struct Frames {
    pending: VecDeque<(PeerId, ConnectionId, Opener)>,
    inbound: mpsc::UnboundedSender<(PeerId, Doomed)>,
    dooms: std::collections::HashMap<ConnectionId, Arc<Doom>>,
    waker: Option<Waker>,
}

impl Frames {
    pub(super) fn new(inbound: mpsc::UnboundedSender<(PeerId, Doomed)>) -> Frames {
        Frames {
            pending: VecDeque::new(),
            inbound,
            dooms: Default::default(),
            waker: None,
        }
    }

    /// Open a stream to `peer` on connection `conn`.
    pub(super) fn open(&mut self, peer: PeerId, conn: ConnectionId, done: Opener) {
        self.pending.push_back((peer, conn, done));
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// Give connection `conn` up: its streams fail now.
    pub(super) fn give_up(&mut self, conn: ConnectionId) {
        if let Some(d) = self.dooms.get(&conn) {
            d.fall();
        }
    }

    fn handler(&mut self, peer: PeerId, conn: ConnectionId) -> Handler {
        let doom = self.dooms.entry(conn).or_default().clone();
        Handler {
            peer,
            doom,
            inbound: self.inbound.clone(),
            queued: VecDeque::new(),
        }
    }
}

impl NetworkBehaviour for Frames {
    type ConnectionHandler = Handler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        conn: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(self.handler(peer, conn))
    }

    fn handle_established_outbound_connection(
        &mut self,
        conn: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(self.handler(peer, conn))
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        if let FromSwarm::ConnectionClosed(c) = event
            && let Some(d) = self.dooms.remove(&c.connection_id)
        {
            d.fall();
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<ToSwarm<Infallible, THandlerInEvent<Self>>> {
        if let Some((peer_id, conn, done)) = self.pending.pop_front() {
            return Poll::Ready(ToSwarm::NotifyHandler {
                peer_id,
                handler: NotifyHandler::One(conn),
                event: done,
            });
        }
        self.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// One connection's side: opens what it is asked to, hands over what the peer opens.
pub(super) struct Handler {
    peer: PeerId,
    doom: Arc<Doom>,
    inbound: mpsc::UnboundedSender<(PeerId, Doomed)>,
    queued: VecDeque<Opener>,
}

impl Handler {
    fn doomed(&self, inner: libp2p::Stream) -> Doomed {
        Doomed {
            inner,
            wakers: self.doom.watch(),
            doom: self.doom.clone(),
        }
    }
}

impl ConnectionHandler for Handler {
    type FromBehaviour = Opener;
    type ToBehaviour = Infallible;
    type InboundProtocol = ReadyUpgrade<StreamProtocol>;
    type OutboundProtocol = ReadyUpgrade<StreamProtocol>;
    type InboundOpenInfo = ();
    type OutboundOpenInfo = Opener;

    fn listen_protocol(&self) -> SubstreamProtocol<Self::InboundProtocol, ()> {
        SubstreamProtocol::new(ReadyUpgrade::new(PROTOCOL), ())
    }

    fn poll(
        &mut self,
        _: &mut Context<'_>,
    ) -> Poll<ConnectionHandlerEvent<Self::OutboundProtocol, Opener, Infallible>> {
        match self.queued.pop_front() {
            Some(done) => Poll::Ready(ConnectionHandlerEvent::OutboundSubstreamRequest {
                protocol: SubstreamProtocol::new(ReadyUpgrade::new(PROTOCOL), done),
            }),
            None => Poll::Pending,
        }
    }

    fn on_behaviour_event(&mut self, done: Opener) {
        self.queued.push_back(done);
    }

    fn on_connection_event(
        &mut self,
        event: ConnectionEvent<Self::InboundProtocol, Self::OutboundProtocol, (), Opener>,
    ) {
        match event {
            ConnectionEvent::FullyNegotiatedInbound(FullyNegotiatedInbound {
                protocol: s, ..
            }) => {
                let _ = self.inbound.send((self.peer, self.doomed(s)));
            }
            ConnectionEvent::FullyNegotiatedOutbound(FullyNegotiatedOutbound {
                protocol: s,
                info: done,
            }) => {
                let _ = done.send(Ok(self.doomed(s)));
            }
            ConnectionEvent::DialUpgradeError(DialUpgradeError { info: done, error }) => {
                let _ = done.send(Err(format!("cannot open a stream: {error}")));
            }
            _ => {}
        }
    }
}
