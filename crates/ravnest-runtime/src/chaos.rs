//! A small TCP proxy that injects the faults of a real network between nodes: it forwards
//! connections to a node's listening address, and on command resets every open connection,
//! delays what it forwards, alters one byte of it, or cuts the node off (every connection to
//! it, or every connection a given node dials to it, reset and refused until healed). The
//! chaos suite puts one in front of every node (each node's `address` is its proxy, its
//! `listen` the real port).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// A fault-injecting forwarder to one address (a handle; dropping it stops the proxy).
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    delay_ms: Arc<AtomicU64>,
    /// Per direction (towards the target, back from it): bytes to forward before the one to
    /// alter, or `CLEAN`.
    corrupt: [Arc<AtomicU64>; 2],
    resets: watch::Sender<u64>,
    cut: watch::Sender<Cut>,
    accept: AbortHandle,
}

/// Which connections a proxy refuses (and resets when they are open).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Cut {
    /// Every connection: the node behind the proxy is cut off from everyone.
    all: bool,
    /// Connections whose dialer says this node id in its hello (bytes 8..12, sent in the
    /// clear before the handshake's keys).
    dialer: Option<u32>,
}

impl Cut {
    fn refuses(&self, dialer: Option<u32>) -> bool {
        self.all || (dialer.is_some() && dialer == self.dialer)
    }
}

/// The dialer's node id in the first bytes of a connection (a node's hello, `RVN1`), if it
/// is one.
fn dialer_of(first: &[u8; 12]) -> Option<u32> {
    (&first[..4] == b"RVN1").then(|| u32::from_le_bytes([first[8], first[9], first[10], first[11]]))
}

impl Proxy {
    /// Listen on `listen` (port 0 for any) and forward every connection to `target`.
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let delay_ms = Arc::new(AtomicU64::new(0));
        let corrupt = [
            Arc::new(AtomicU64::new(CLEAN)),
            Arc::new(AtomicU64::new(CLEAN)),
        ];
        let (resets, _) = watch::channel(0u64);
        let (cut, _) = watch::channel(Cut::default());
        let (d, r, c, k) = (
            delay_ms.clone(),
            resets.clone(),
            corrupt.clone(),
            cut.clone(),
        );
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let (d, mut reset, [there, back]) = (d.clone(), r.subscribe(), c.clone());
                let mut cut = k.subscribe();
                tokio::spawn(async move {
                    // The hello's first 12 bytes name the dialer; they are passed on as read.
                    let mut first = [0u8; 12];
                    let read = inbound.read_exact(&mut first);
                    let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), read).await else {
                        return;
                    };
                    let dialer = dialer_of(&first);
                    if cut.borrow_and_update().refuses(dialer) {
                        return;
                    }
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = (inbound.set_nodelay(true), outbound.set_nodelay(true));
                    if outbound.write_all(&first).await.is_err() {
                        return;
                    }
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    // Checked before every chunk too: a chunk read just as the cut comes
                    // must not pass before the cut's own task wakes (a loaded machine).
                    let (c1, c2) = (cut.clone(), cut.clone());
                    let there_cut = move || c1.borrow().refuses(dialer);
                    let back_cut = move || c2.borrow().refuses(dialer);
                    let cut_off = async move {
                        while cut.changed().await.is_ok() {
                            if cut.borrow().refuses(dialer) {
                                return;
                            }
                        }
                        std::future::pending::<()>().await
                    };
                    tokio::select! {
                        _ = pump(ri, wo, d.clone(), there, there_cut) => {}
                        _ = pump(ro, wi, d, back, back_cut) => {}
                        _ = reset.changed() => {}
                        _ = cut_off => {}
                    }
                    // Dropping both halves of both sockets closes them.
                });
            }
        });
        Ok(Proxy {
            addr,
            delay_ms,
            corrupt,
            resets,
            cut,
            accept: accept.abort_handle(),
        })
    }

    /// Where peers connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Close every connection open through the proxy now (new ones are forwarded again).
    pub fn reset(&self) {
        self.resets.send_modify(|n| *n += 1);
    }

    /// Cut the node behind this proxy off from everyone (`true`: every connection through it
    /// is reset and refused) or heal it (`false`).
    pub fn isolate(&self, on: bool) {
        self.cut.send_modify(|c| c.all = on);
    }

    /// Reset and refuse every connection that node `dialer` makes through this proxy (`None`:
    /// let it through again). With [`Proxy::isolate`] on the node's own proxy, this cuts
    /// `dialer` off both ways.
    pub fn refuse_dialer(&self, dialer: Option<u32>) {
        self.cut.send_modify(|c| c.dialer = dialer);
    }

    /// Hold every chunk forwarded from now on for `delay` before passing it on.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Proxy {
    /// Alter (invert) the byte forwarded towards the target `nth` bytes from now (0: the next
    /// one), over whatever connections carry it; once.
    pub fn corrupt_next(&self, nth: u64) {
        self.corrupt[0].store(nth, Ordering::SeqCst);
    }

    /// The same for the bytes coming back from the target.
    pub fn corrupt_next_back(&self, nth: u64) {
        self.corrupt[1].store(nth, Ordering::SeqCst);
    }

    /// Whether a byte is still to be altered (either way).
    pub fn corruption_pending(&self) -> bool {
        self.corrupt
            .iter()
            .any(|c| c.load(Ordering::SeqCst) != CLEAN)
    }
}

/// No byte to alter.
const CLEAN: u64 = u64::MAX;

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_ms: Arc<AtomicU64>,
    corrupt: Arc<AtomicU64>,
    cut: impl Fn() -> bool,
) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Count this chunk off the bytes still to pass; the one that falls in it is altered.
        let left = corrupt.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
            (c != CLEAN).then(|| c.checked_sub(n as u64).unwrap_or(CLEAN))
        });
        if let Ok(c) = left
            && c < n as u64
        {
            buf[c as usize] = !buf[c as usize];
        }
        let d = delay_ms.load(Ordering::Relaxed);
        if d > 0 {
            tokio::time::sleep(Duration::from_millis(d)).await;
        }
        if cut() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
