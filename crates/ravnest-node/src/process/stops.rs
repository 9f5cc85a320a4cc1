//! Stopping on request: SIGINT (Ctrl-C) or SIGTERM to a node process, or SIGUSR1 from the
//! local launcher (whose children run in their own process group: a terminal's Ctrl-C reaches
//! the launcher only, which tells every child).
//!
//! What a stop does depends on where the process is: before training there is nothing to save
//! and it exits at once ([`STOPPED_EXIT`]); the coordinator's host ends the run early and
//! cleanly (the steps in flight finish, a checkpoint is written, the report and the `--resume`
//! command are printed, [`STOPPED_EXIT`]); a worker leaves the cluster (not on the launcher's
//! word: the coordinator ends the run for it). A second request exits at once
//! ([`INTERRUPTED_EXIT`]), after removing the parts of checkpoints no round will complete; the
//! launcher's word after a signal of the process's own (a service manager's SIGTERM to every
//! process) is not a second request.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// The exit code of a run stopped on request (Ctrl-C, SIGTERM) that ended cleanly: its report
/// printed, its latest checkpoint named with the `--resume` command that continues from it.
pub const STOPPED_EXIT: i32 = 5;

/// The exit code after a second stop request (it exits at once, as a shell's 128 + SIGINT).
pub const INTERRUPTED_EXIT: i32 = 130;

/// Where the process is, for what a stop request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Setting up, measuring, waiting for nodes: nothing to save; a stop exits now.
    Starting = 0,
    /// Training: the coordinator's host ends the run cleanly, a worker leaves.
    Training = 1,
}

/// The stop requests of this process, as they come.
#[derive(Debug, Clone)]
pub struct Stops {
    /// Requests so far, and whether the latest was the launcher's.
    rx: watch::Receiver<(u32, bool)>,
    phase: Arc<AtomicU8>,
    /// Checkpoint parts to remove on a second request (the coordinator's host).
    parts: Arc<std::sync::Mutex<Option<PathBuf>>>,
}

impl Stops {
    /// Listen for stop requests from now on (see the module's notes).
    pub fn install(launched: bool) -> std::io::Result<Stops> {
        let (tx, rx) = watch::channel((0u32, false));
        let phase = Arc::new(AtomicU8::new(Phase::Starting as u8));
        let parts: Arc<std::sync::Mutex<Option<PathBuf>>> = Arc::default();
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut usr1 = signal(SignalKind::user_defined1())?;
        let (p, dir) = (phase.clone(), parts.clone());
        tokio::spawn(async move {
            let mut n = 0u32;
            loop {
                let what = tokio::select! {
                    _ = int.recv() => "Ctrl-C",
                    _ = term.recv() => "SIGTERM",
                    _ = usr1.recv() => "the launcher's stop",
                };
                let launcher = what == "the launcher's stop";
                // Only a launched process hears its launcher, and only as a first request.
                if launcher && (!launched || n > 0) {
                    continue;
                }
                n += 1;
                if p.load(Ordering::SeqCst) == Phase::Starting as u8 {
                    eprintln!("{what}: stopped before training began; nothing to save");
                    std::process::exit(STOPPED_EXIT);
                }
                if n >= 2 {
                    if let Some(d) = dir.lock().unwrap().as_ref() {
                        let _ = std::fs::remove_dir_all(d);
                    }
                    eprintln!(
                        "{what} again: stopping at once (the latest checkpoint stays the latest; continue with --resume)"
                    );
                    std::process::exit(INTERRUPTED_EXIT);
                }
                let _ = tx.send((n, launcher));
            }
        });
        Ok(Stops { rx, phase, parts })
    }

    /// Training began (or the process went back to waiting).
    pub fn enter(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::SeqCst);
    }

    /// On a second request, remove these checkpoint parts before exiting.
    pub fn clear_on_exit(&self, dir: PathBuf) {
        *self.parts.lock().unwrap() = Some(dir);
    }

    /// The next stop request (pending forever once no more can come): whether it is the
    /// launcher's word (not a signal of this process's own).
    pub async fn requested(&mut self) -> bool {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        self.rx.borrow().1
    }
}
