//! A small TCP proxy that injects the faults of a real network between nodes: it forwards
//! connections to a node's listening address, and on command resets every open connection or
//! delays what it forwards. The chaos suite puts one in front of every node (each node's
//! `address` is its proxy, its `listen` the real port).

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
    resets: watch::Sender<u64>,
    accept: AbortHandle,
}

impl Proxy {
    /// Listen on `listen` (port 0 for any) and forward every connection to `target`.
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (resets, _) = watch::channel(0u64);
        let (d, r) = (delay_ms.clone(), resets.clone());
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let (d, mut reset) = (d.clone(), r.subscribe());
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = (inbound.set_nodelay(true), outbound.set_nodelay(true));
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::select! {
                        _ = pump(ri, wo, d.clone()) => {}
                        _ = pump(ro, wi, d) => {}
                        _ = reset.changed() => {}
                    }
                    // Dropping both halves of both sockets closes them.
                });
            }
        });
        Ok(Proxy {
            addr,
            delay_ms,
            resets,
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

    /// Hold every chunk forwarded from now on for `delay` before passing it on.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }
}

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
) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let d = delay_ms.load(Ordering::Relaxed);
        if d > 0 {
            tokio::time::sleep(Duration::from_millis(d)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
