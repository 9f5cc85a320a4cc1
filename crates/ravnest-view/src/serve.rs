//! The dashboard's server (`run --dashboard`): the page at `/` (with the board as it is), the board as JSON at `/state`,
//! a snapshot as a server-sent event (`event: board`) at `/events` whenever the board moved
//! (checked four times a second; at least one a second while the run goes), and Prometheus'
//! text at `/metrics`. It runs on a thread of its own with a one-thread runtime, so the run it
//! watches does not share its executor.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{Html, IntoResponse};
use axum::routing::get;

use crate::board::Board;

/// The board the server reads and the run writes.
pub type Shared = Arc<Mutex<Board>>;

/// Points per series in a snapshot.
const POINTS: usize = 600;

fn snapshot(b: &Shared) -> serde_json::Value {
    b.lock().unwrap_or_else(|p| p.into_inner()).snapshot(POINTS)
}

fn router(board: Shared) -> Router {
    let (b0, b1, b2, b3) = (board.clone(), board.clone(), board.clone(), board);
    Router::new()
        .route(
            "/",
            get(move || async move { Html(crate::page::live(&snapshot(&b0))) }),
        )
        .route(
            "/state",
            get(move || async move {
                let json = serde_json::to_string(&snapshot(&b1)).unwrap_or_default();
                ([(header::CONTENT_TYPE, "application/json")], json).into_response()
            }),
        )
        .route(
            "/metrics",
            get(move || async move {
                let text = crate::metrics::render(&b2.lock().unwrap_or_else(|p| p.into_inner()));
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    text,
                )
                    .into_response()
            }),
        )
        .route("/events", get(move || async move { events(b3) }))
}

/// The stream: a snapshot when the board moved, else a comment every 15 s to keep proxies open.
fn events(
    board: Shared,
) -> Sse<impl futures_util::Stream<Item = Result<Event, std::convert::Infallible>>> {
    let stream = futures_util::stream::unfold((board, u64::MAX), |(b, seen)| async move {
        let mut quiet = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let version = b.lock().unwrap_or_else(|p| p.into_inner()).version;
            if version != seen {
                let data = serde_json::to_string(&snapshot(&b)).unwrap_or_default();
                let e = Event::default().event("board").data(data);
                return Some((Ok(e), (b, version)));
            }
            quiet += 1;
            if quiet >= 60 {
                return Some((Ok(Event::default().comment("idle")), (b, seen)));
            }
        }
    });
    Sse::new(stream)
}

/// A running dashboard.
#[derive(Debug)]
pub struct Dashboard {
    /// Where it listens.
    pub addr: SocketAddr,
}

/// Serve `board` on `addr` ("host:port"; port 0: any free one) from a thread of its own.
pub fn start(addr: &str, board: Shared) -> std::io::Result<Dashboard> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("dashboard".into())
        .spawn(move || {
            rt.block_on(async move {
                let Ok(l) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let _ = axum::serve(l, router(board)).await;
            })
        })?;
    Ok(Dashboard { addr: local })
}
