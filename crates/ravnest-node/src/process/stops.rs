//! Stopping on request. A node process started by hand (`--node`) stops on SIGINT (Ctrl-C) or
//! SIGTERM; one started by the local launcher ignores both (a terminal's Ctrl-C and a service
//! manager's SIGTERM reach the whole process group) and stops when its launcher says so, with
//! SIGUSR1.
//!
//! What a stop does depends on where the process is: before training there is nothing to save
//! and it exits at once ([`STOPPED_EXIT`]); the coordinator's host ends the run early and
//! cleanly (the steps in flight finish, a checkpoint is written, the report and the `--resume`
//! command are printed, [`STOPPED_EXIT`]); a worker leaves the cluster. A second request exits
//! at once ([`INTERRUPTED_EXIT`]), after removing the parts of checkpoints no round will
//! complete.

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
    rx: watch::Receiver<u32>,
    phase: Arc<AtomicU8>,
    /// Started by the local launcher: its signals are the launcher's to handle.
    pub launched: bool,
    /// Checkpoint parts to remove on a second request (the coordinator's host).
    parts: Arc<std::sync::Mutex<Option<PathBuf>>>,
}

impl Stops {
    /// Listen for stop requests from now on (see the module's notes).
    pub fn install(launched: bool) -> std::io::Result<Stops> {
        let (tx, rx) = watch::channel(0u32);
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
                // The launcher's children stop on its word only; a process by hand on its own.
                if launched != (what == "the launcher's stop") {
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
                let _ = tx.send(n);
            }
        });
        Ok(Stops {
            rx,
            phase,
            launched,
            parts,
        })
    }

    /// Training began (or the process went back to waiting).
    pub fn enter(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::SeqCst);
    }

    /// On a second request, remove these checkpoint parts before exiting.
    pub fn clear_on_exit(&self, dir: PathBuf) {
        *self.parts.lock().unwrap() = Some(dir);
    }

    /// The next stop request (pending forever once no more can come).
    pub async fn requested(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
