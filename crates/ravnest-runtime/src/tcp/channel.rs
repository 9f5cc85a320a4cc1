//! The encrypted, authenticated channel a connection carries once its handshake is done
//! (unless [`TcpConfig::encrypt`](super::TcpConfig) is off): a Noise handshake on the same
//! socket, then every byte in both directions (frames one way, acknowledgements the other) in
//! sealed records.
//!
//! ```text
//! handshake = NNpsk0: dialer → listener  len:u16le msg[len]   (e, psk; 48 bytes)
//!                     listener → dialer  len:u16le msg[len]   (e, ee; 48 bytes)
//! record    = len:u16le sealed[len]      (len = plaintext + 16-byte tag, 16 ..= 65535)
//! ```
//!
//! The pattern has no static keys: both ends have already proved the cluster secret in the HMAC
//! handshake. The PSK is an HMAC of the secret with a fixed label, and the prologue is that
//! handshake's transcript (both ids, both nonces, both incarnations, the delivered count), so
//! the channel belongs to that one authenticated connection, and the fields its HMACs did not
//! cover are authenticated now. Fresh ephemeral keys per connection give forward secrecy.
//!
//! Records are a byte stream's envelopes: a frame spans as many records as it needs, and a
//! writer seals what it holds when it is flushed. Each direction numbers its records (the Noise
//! nonce is the count), so a record that is altered, replayed, reordered or dropped fails
//! authentication: the reader reports [`AUTH_FAILED`] and hands out nothing of it.
//!
//! No allocation per record: the writer seals into one reused buffer (straight from the
//! caller's bytes when a whole record is there), the reader decrypts straight into the
//! caller's buffer when it has room for the record (the tensor of a frame), else into one
//! reused buffer.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use super::conn::{Conn, ReadHalf, WriteHalf};
use hmac::Mac;
use snow::StatelessTransportState;
use tokio::io::{
    AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter, ReadBuf,
};

use super::agreed::{HandshakeError, HmacSha256, Transcript};
use super::config::HANDSHAKE_TIMEOUT;

/// The channel's Noise protocol. AES-256-GCM rather than ChaCha20-Poly1305: with snow's ring
/// backend it seals and opens 3-5x faster on CPUs with AES instructions (every x86 server of the
/// last decade, ARMv8 with its crypto extensions), and the channel carries whole gradients.
pub const NOISE_PROTOCOL: &str = "Noise_NNpsk0_25519_AESGCM_BLAKE2s";

/// Authentication tag per record.
const TAG: usize = 16;

/// Largest sealed record (Noise's limit on a transport message).
const MAX_SEALED: usize = 65535;

/// Most plaintext in one record.
pub(super) const MAX_PLAIN: usize = MAX_SEALED - TAG;

/// Largest record on the wire, length prefix included.
pub(super) const RECORD_SPAN: usize = 2 + MAX_SEALED;

/// Why a connection's reader gave up on it.
pub(super) const AUTH_FAILED: &str =
    "frame failed authentication (tampered or corrupted in flight)";

/// A finished channel's keys, shared by the connection's reader and writer (each keeps its own
/// direction's record count).
pub(super) type Keys = Arc<StatelessTransportState>;

/// The channel's pre-shared key: HMAC-SHA256 of a fixed label keyed by the cluster secret.
pub(super) fn psk(secret: &[u8]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(b"ravnest-noise-psk-v1");
    m.finalize().into_bytes().into()
}

/// Run the channel's Noise handshake on `s`, as the dialer (`initiator`) or the listener, bound
/// to the connection's `transcript`. The keys, or why not (`who` names the peer).
pub(super) async fn establish<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &[u8],
    transcript: &Transcript,
    initiator: bool,
    who: &str,
) -> Result<Keys, HandshakeError> {
    let failed = |what: String| HandshakeError::Io(format!("{who}: encrypted channel: {what}"));
    let psk = psk(secret);
    let prologue = transcript.prologue();
    let builder = snow::Builder::new(NOISE_PROTOCOL.parse().expect("a valid Noise protocol"))
        .psk(0, &psk)
        .and_then(|b| b.prologue(&prologue))
        .map_err(|e| failed(e.to_string()))?;
    let mut hs = if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    }
    .map_err(|e| failed(e.to_string()))?;
    let exchange = async {
        let mut msg = [0u8; 2 + 128];
        let mut payload = [0u8; 128];
        while !hs.is_handshake_finished() {
            if hs.is_my_turn() {
                let n = hs
                    .write_message(&[], &mut msg[2..])
                    .map_err(|e| failed(e.to_string()))?;
                msg[..2].copy_from_slice(&(n as u16).to_le_bytes());
                s.write_all(&msg[..2 + n])
                    .await
                    .map_err(|e| failed(e.to_string()))?;
            } else {
                let mut len = [0u8; 2];
                s.read_exact(&mut len)
                    .await
                    .map_err(|e| failed(e.to_string()))?;
                let len = usize::from(u16::from_le_bytes(len));
                if len > msg.len() {
                    return Err(failed(format!("a handshake message of {len} bytes")));
                }
                s.read_exact(&mut msg[..len])
                    .await
                    .map_err(|e| failed(e.to_string()))?;
                hs.read_message(&msg[..len], &mut payload).map_err(|_| {
                    failed("the handshake failed authentication (tampered in flight)".into())
                })?;
            }
        }
        Ok(())
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange).await {
        Ok(r) => r?,
        Err(_) => return Err(failed("handshake timed out".into())),
    }
    hs.into_stateless_transport_mode()
        .map(Arc::new)
        .map_err(|e| failed(e.to_string()))
}

fn auth_error() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, AUTH_FAILED)
}

fn seal_error(e: snow::Error) -> io::Error {
    io::Error::other(format!("cannot seal a record: {e}"))
}

/// Reads a channel: takes sealed records off `inner`, checks and opens them, and hands out
/// their bytes. A record that fails authentication ends it: that read and every later one is
/// an error ([`OpenReader::failed`] tells it apart from a closed connection).
pub(super) struct OpenReader<R> {
    inner: R,
    keys: Keys,
    /// Records opened so far (the next one's nonce).
    nonce: u64,
    /// Sealed bytes read and not yet opened: `sealed[start..end]`.
    sealed: Box<[u8]>,
    start: usize,
    end: usize,
    /// An opened record not yet handed out: `plain[at..ready]` (allocated once, when a read
    /// first asks for less than a record).
    plain: Vec<u8>,
    at: usize,
    ready: usize,
    failed: bool,
}

impl<R> OpenReader<R> {
    /// A reader that takes up to `capacity` sealed bytes from `inner` at a time (at least one
    /// whole record).
    pub(super) fn new(inner: R, keys: Keys, capacity: usize) -> OpenReader<R> {
        OpenReader {
            inner,
            keys,
            nonce: 0,
            sealed: vec![0u8; capacity.max(RECORD_SPAN)].into_boxed_slice(),
            start: 0,
            end: 0,
            plain: Vec::new(),
            at: 0,
            ready: 0,
            failed: false,
        }
    }

    /// Whether a record failed authentication.
    pub(super) fn failed(&self) -> bool {
        self.failed
    }

    /// Nothing read from the socket is waiting to be handed out.
    pub(super) fn is_drained(&self) -> bool {
        self.at == self.ready && self.start == self.end
    }

    /// The sealed length of the first buffered record, if it is all here.
    fn whole_record(&mut self) -> io::Result<Option<usize>> {
        let have = self.end - self.start;
        if have < 2 {
            return Ok(None);
        }
        let len = usize::from(u16::from_le_bytes([
            self.sealed[self.start],
            self.sealed[self.start + 1],
        ]));
        if len < TAG {
            // Shorter than its tag: it cannot be a record of this channel.
            self.failed = true;
            return Err(auth_error());
        }
        Ok((have >= 2 + len).then_some(len))
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for OpenReader<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        loop {
            if me.at < me.ready {
                let n = (me.ready - me.at).min(buf.remaining());
                buf.put_slice(&me.plain[me.at..me.at + n]);
                me.at += n;
                return Poll::Ready(Ok(()));
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if me.failed {
                return Poll::Ready(Err(auth_error()));
            }
            if let Some(len) = me.whole_record()? {
                let record = &me.sealed[me.start + 2..me.start + 2 + len];
                let plain = len - TAG;
                // Straight into the caller's buffer when the record fits (a tensor), else
                // into ours, handed out over the next reads.
                let direct = buf.remaining() >= plain;
                let opened = if direct {
                    let out = buf.initialize_unfilled_to(plain);
                    me.keys.read_message(me.nonce, record, out)
                } else {
                    if me.plain.len() < MAX_PLAIN {
                        me.plain.resize(MAX_PLAIN, 0);
                    }
                    me.keys.read_message(me.nonce, record, &mut me.plain)
                };
                let Ok(n) = opened else {
                    me.failed = true;
                    return Poll::Ready(Err(auth_error()));
                };
                me.nonce += 1;
                me.start += 2 + len;
                if me.start == me.end {
                    (me.start, me.end) = (0, 0);
                }
                if !direct {
                    (me.at, me.ready) = (0, n);
                } else if n > 0 {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            // Read more: first make room for a whole record after what is buffered.
            if me.sealed.len() - me.start < RECORD_SPAN {
                me.sealed.copy_within(me.start..me.end, 0);
                me.end -= me.start;
                me.start = 0;
            }
            let mut rb = ReadBuf::new(&mut me.sealed[me.end..]);
            ready!(Pin::new(&mut me.inner).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                return Poll::Ready(if me.start == me.end {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "stream ended mid-record",
                    ))
                });
            }
            me.end += n;
        }
    }
}

/// Writes a channel: takes bytes, seals them into records, and writes the records to `inner`.
/// A record is sealed when it is full or the writer is flushed.
pub(super) struct SealWriter<W> {
    inner: W,
    keys: Keys,
    /// Records sealed so far (the next one's nonce).
    nonce: u64,
    /// Bytes of the record being filled (at most `MAX_PLAIN`).
    stage: Vec<u8>,
    /// Sealed records: `out[..written]` went out, `out[written..filled]` is to write.
    out: Box<[u8]>,
    written: usize,
    filled: usize,
}

impl<W> SealWriter<W> {
    /// A writer that gathers up to `capacity` sealed bytes before writing them (at least one
    /// whole record).
    pub(super) fn new(inner: W, keys: Keys, capacity: usize) -> SealWriter<W> {
        SealWriter {
            inner,
            keys,
            nonce: 0,
            stage: Vec::with_capacity(capacity.min(MAX_PLAIN)),
            out: vec![0u8; capacity.max(RECORD_SPAN)].into_boxed_slice(),
            written: 0,
            filled: 0,
        }
    }
}

/// Seal `plain` as the record numbered `nonce` at `out[*filled..]`.
fn seal(
    keys: &StatelessTransportState,
    nonce: &mut u64,
    plain: &[u8],
    out: &mut [u8],
    filled: &mut usize,
) -> io::Result<()> {
    let at = *filled;
    let n = keys
        .write_message(*nonce, plain, &mut out[at + 2..at + 2 + plain.len() + TAG])
        .map_err(seal_error)?;
    out[at..at + 2].copy_from_slice(&(n as u16).to_le_bytes());
    *filled = at + 2 + n;
    *nonce += 1;
    Ok(())
}

impl<W: AsyncWrite + Unpin> SealWriter<W> {
    /// Write sealed records out until a whole record fits after them (`all`: until none is
    /// left).
    fn poll_out(&mut self, cx: &mut Context<'_>, all: bool) -> Poll<io::Result<()>> {
        while self.written < self.filled && (all || self.out.len() - self.filled < RECORD_SPAN) {
            let n = ready!(
                Pin::new(&mut self.inner).poll_write(cx, &self.out[self.written..self.filled])
            )?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        if self.written == self.filled {
            (self.written, self.filled) = (0, 0);
        }
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for SealWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        ready!(me.poll_out(cx, false))?;
        if me.stage.is_empty() && buf.len() >= MAX_PLAIN {
            // A whole record of the caller's bytes: sealed from where they are.
            seal(
                &me.keys,
                &mut me.nonce,
                &buf[..MAX_PLAIN],
                &mut me.out,
                &mut me.filled,
            )?;
            return Poll::Ready(Ok(MAX_PLAIN));
        }
        let n = (MAX_PLAIN - me.stage.len()).min(buf.len());
        me.stage.extend_from_slice(&buf[..n]);
        if me.stage.len() == MAX_PLAIN {
            seal(
                &me.keys,
                &mut me.nonce,
                &me.stage,
                &mut me.out,
                &mut me.filled,
            )?;
            me.stage.clear();
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if !me.stage.is_empty() {
            ready!(me.poll_out(cx, false))?;
            seal(
                &me.keys,
                &mut me.nonce,
                &me.stage,
                &mut me.out,
                &mut me.filled,
            )?;
            me.stage.clear();
        }
        ready!(me.poll_out(cx, true))?;
        Pin::new(&mut me.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.as_mut().poll_flush(cx))?;
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A connection's reading end: buffered plain bytes, or the channel.
pub(super) enum Rx {
    Plain(BufReader<ReadHalf>),
    Sealed(OpenReader<ReadHalf>),
}

impl Rx {
    /// Nothing read from the socket is waiting to be handed out.
    pub(super) fn is_drained(&self) -> bool {
        match self {
            Rx::Plain(r) => r.buffer().is_empty(),
            Rx::Sealed(r) => r.is_drained(),
        }
    }

    /// Whether the connection was given up because a record failed authentication.
    pub(super) fn auth_failed(&self) -> bool {
        matches!(self, Rx::Sealed(r) if r.failed())
    }
}

impl AsyncRead for Rx {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Rx::Plain(r) => Pin::new(r).poll_read(cx, buf),
            Rx::Sealed(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

/// A connection's writing end: buffered plain bytes, or the channel.
pub(super) enum Tx {
    Plain(BufWriter<WriteHalf>),
    Sealed(SealWriter<WriteHalf>),
}

impl AsyncWrite for Tx {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Tx::Plain(w) => Pin::new(w).poll_write(cx, buf),
            Tx::Sealed(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tx::Plain(w) => Pin::new(w).poll_flush(cx),
            Tx::Sealed(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tx::Plain(w) => Pin::new(w).poll_shutdown(cx),
            Tx::Sealed(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

/// Buffer sizes of one end of a connection: (reading, writing), in bytes.
pub(super) type Sizes = (usize, usize);

/// Split an authenticated connection into its ends: through the channel when it has `keys`
/// (buffers `sealed`), else plain (buffers `plain`).
pub(super) fn split(stream: Conn, keys: Option<Keys>, plain: Sizes, sealed: Sizes) -> (Rx, Tx) {
    let (r, w) = stream.into_split();
    match keys {
        None => (
            Rx::Plain(BufReader::with_capacity(plain.0, r)),
            Tx::Plain(BufWriter::with_capacity(plain.1, w)),
        ),
        Some(k) => (
            Rx::Sealed(OpenReader::new(r, k.clone(), sealed.0)),
            Tx::Sealed(SealWriter::new(w, k, sealed.1)),
        ),
    }
}

/// An authenticated connection to a node as its dialer holds it ([`super::dial_as`]): what is
/// written goes through the connection's channel, sealed as a node's frames are.
pub struct Channel {
    tx: Tx,
    _rx: Rx,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("sealed", &matches!(self.tx, Tx::Sealed(_)))
            .finish()
    }
}

impl Channel {
    pub(super) fn new(rx: Rx, tx: Tx) -> Channel {
        Channel { tx, _rx: rx }
    }
}

impl AsyncWrite for Channel {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tx).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tx).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tx).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn transcript(delivered: u64) -> Transcript {
        Transcript {
            dialer: 1,
            listener: 0,
            nc: [1; 32],
            ns: [2; 32],
            dialer_incarnation: 3,
            listener_incarnation: 4,
            delivered,
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// Both ends' channel handshake over an in-memory pipe, each end as its own task (an end
    /// that fails drops its side, as a connection would close).
    async fn handshake(
        dialer: (&[u8], Transcript),
        listener: (&[u8], Transcript),
    ) -> (Result<Keys, HandshakeError>, Result<Keys, HandshakeError>) {
        let (mut a, mut b) = tokio::io::duplex(1 << 12);
        let (sa, ta) = (dialer.0.to_vec(), dialer.1);
        let (sb, tb) = (listener.0.to_vec(), listener.1);
        let i = tokio::spawn(async move { establish(&mut a, &sa, &ta, true, "listener").await });
        let r = tokio::spawn(async move { establish(&mut b, &sb, &tb, false, "dialer").await });
        (i.await.unwrap(), r.await.unwrap())
    }

    fn keys() -> (Keys, Keys) {
        rt().block_on(async {
            let (i, r) = handshake((b"s", transcript(7)), (b"s", transcript(7))).await;
            (i.unwrap(), r.unwrap())
        })
    }

    /// `data` sealed by the dialer's writer, flushed after each of `cuts` (offsets).
    fn sealed(k: &Keys, data: &[u8], cuts: &[usize], capacity: usize) -> Vec<u8> {
        rt().block_on(async {
            let mut w = SealWriter::new(Vec::new(), k.clone(), capacity);
            let mut at = 0;
            for &c in cuts.iter().chain([&data.len()]) {
                let c = c.clamp(at, data.len());
                w.write_all(&data[at..c]).await.unwrap();
                w.flush().await.unwrap();
                at = c;
            }
            w.inner
        })
    }

    /// Read `wire` through the listener's reader in reads of `step` bytes: what it handed out
    /// and how it ended (`Ok` at a clean end).
    fn opened(k: &Keys, wire: &[u8], step: usize) -> (Vec<u8>, io::Result<()>, bool) {
        rt().block_on(async {
            let mut r = OpenReader::new(wire, k.clone(), RECORD_SPAN);
            let mut got = Vec::new();
            let mut buf = vec![0u8; step.max(1)];
            let end = loop {
                match r.read(&mut buf).await {
                    Ok(0) => break Ok(()),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => break Err(e),
                }
            };
            (got, end, r.failed())
        })
    }

    /// Each record's (start, length on the wire) in a sealed stream.
    fn records(wire: &[u8]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < wire.len() {
            let len = usize::from(u16::from_le_bytes([wire[at], wire[at + 1]]));
            out.push((at, 2 + len));
            at += 2 + len;
        }
        out
    }

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn bytes_round_trip_in_records_of_every_size() {
        let (i, r) = keys();
        let d = data(300_000);
        for cuts in [
            vec![],
            vec![0, 1, 9, 70_000],
            vec![65_519, 131_038, 131_039],
        ] {
            for cap in [0, 4 * RECORD_SPAN] {
                let wire = sealed(&i, &d, &cuts, cap);
                assert!(records(&wire).iter().all(|&(_, l)| l <= RECORD_SPAN));
                for step in [1, 8, 1000, MAX_PLAIN, 1 << 20] {
                    let (got, end, failed) = opened(&r, &wire, step);
                    assert!(end.is_ok() && !failed, "{end:?}");
                    assert!(got == d, "cuts {cuts:?} step {step}: {} bytes", got.len());
                }
            }
        }
    }

    #[test]
    fn the_two_directions_have_their_own_keys() {
        let (i, r) = keys();
        let wire = sealed(&i, b"to the listener", &[], 0);
        // The dialer cannot read what it sent (a record reflected back fails).
        let (got, end, failed) = opened(&i, &wire, 64);
        assert!(got.is_empty() && end.is_err() && failed);
        assert_eq!(opened(&r, &wire, 64).0, b"to the listener");
    }

    #[test]
    fn another_secret_or_transcript_fails_the_channel_handshake_on_both_ends() {
        rt().block_on(async {
            for (dialer, listener) in [
                ((&b"s"[..], transcript(7)), (&b"t"[..], transcript(7))),
                ((&b"s"[..], transcript(7)), (&b"s"[..], transcript(8))),
            ] {
                let (i, r) = handshake(dialer, listener).await;
                let (i, r) = (i.unwrap_err().to_string(), r.unwrap_err().to_string());
                assert!(r.contains("failed authentication"), "{r}");
                assert!(i.contains("encrypted channel"), "{i}");
            }
        });
        assert_ne!(psk(b"s"), psk(b"t"));
    }

    #[test]
    fn a_replayed_dropped_or_reordered_record_fails_and_nothing_of_it_is_handed_out() {
        let (i, r) = keys();
        let d = data(200_000);
        let wire = sealed(&i, &d, &[10, 20, 100_000], 0);
        let recs = records(&wire);
        assert!(recs.len() >= 5);
        let rec = |k: usize| &wire[recs[k].0..recs[k].0 + recs[k].1];
        let mut replayed = wire[..recs[2].0].to_vec();
        replayed.extend_from_slice(rec(1));
        replayed.extend_from_slice(&wire[recs[2].0..]);
        let mut dropped = wire[..recs[1].0].to_vec();
        dropped.extend_from_slice(&wire[recs[2].0..]);
        let mut swapped = wire[..recs[1].0].to_vec();
        swapped.extend_from_slice(rec(2));
        swapped.extend_from_slice(rec(1));
        swapped.extend_from_slice(&wire[recs[3].0..]);
        for (what, w, good) in [
            ("replayed", replayed, 20),
            ("dropped", dropped, 10),
            ("swapped", swapped, 10),
        ] {
            let (got, end, failed) = opened(&r, &w, 4096);
            assert!(failed, "{what}");
            assert_eq!(end.unwrap_err().to_string(), AUTH_FAILED);
            assert!(got == d[..good], "{what}: {} bytes", got.len());
        }
        // Cut mid-record: the stream ended, nothing failed authentication, and the cut
        // record's bytes never came out.
        let (got, end, failed) = opened(&r, &wire[..recs[4].0 + 100], 4096);
        assert_eq!(end.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        assert!(!failed);
        assert!(got == d[..100_000], "{} bytes", got.len());
    }

    proptest! {
        /// One byte altered anywhere: the reader fails (authentication, or a record cut short
        /// when a length grew), and what it handed out before is exactly the sent bytes up to
        /// the altered record: nothing altered ever comes out.
        #[test]
        fn one_altered_byte_never_comes_out(pos in any::<usize>(), flip in 1u8..=255, step in 1usize..70_000) {
            let (i, r) = &*KEYS;
            let d = data(150_000);
            let wire = sealed(i, &d, &[33, 70_000], 0);
            let mut bad = wire.clone();
            let at = pos % bad.len();
            bad[at] ^= flip;
            let (got, end, _) = opened(r, &bad, step);
            prop_assert!(end.is_err());
            prop_assert!(d.starts_with(&got));
            // Records before the altered one are intact and all handed out.
            let before: usize = records(&wire)
                .iter()
                .take_while(|&&(s, l)| s + l <= at)
                .map(|&(_, l)| l - 2 - TAG)
                .sum();
            prop_assert!(got.len() >= before);
        }

        /// Arbitrary bytes as a sealed stream: never a panic, never a byte handed out.
        #[test]
        fn garbage_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let (_, r) = &*KEYS;
            let (got, _, _) = opened(r, &bytes, 512);
            prop_assert!(got.is_empty());
        }
    }

    static KEYS: std::sync::LazyLock<(Keys, Keys)> = std::sync::LazyLock::new(keys);
}
