//! The chaos suite on real processes: `ravnest bench chaos` runs loopback clusters of three
//! node processes, each node behind a fault-injecting proxy, under seeded schedules of kill -9
//! and rejoin, kill -9 of the coordinator (fail-over), the coordinator frozen past the failure
//! timeout (fail-over, then the stale one steps down), frozen processes (SIGSTOP / SIGCONT),
//! a full disk at a checkpoint, two machines not in the file joining at once, connection resets
//! and delays, forged connections that claim a
//! live node, corrupted and oversized frames after authentication, and a port in use at the
//! start. Each run must end with the exit code its schedule calls for, lose no checkpoint, keep
//! its checkpoints' terms in order, and end with the model of a single-node run of the same
//! steps.
//!
//! `RAVNEST_CHAOS_SCHEDULES` (default 36) and `RAVNEST_CHAOS_SEED` (default 1) size it; a
//! failing schedule prints its seed and the command that replays it.

use std::process::Command;

#[test]
#[cfg(unix)]
fn seeded_fault_schedules_on_real_processes_hold() {
    let count = std::env::var("RAVNEST_CHAOS_SCHEDULES").unwrap_or_else(|_| "36".into());
    let seed = std::env::var("RAVNEST_CHAOS_SEED").unwrap_or_else(|_| "1".into());
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chaos");
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_ravnest"))
        .args([
            "bench",
            "chaos",
            "--schedules",
            &count,
            "--seed",
            &seed,
            "--keep",
        ])
        .arg(&dir)
        .output()
        .expect("ravnest runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "chaos schedules failed (seeds from {seed}):\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("{count} of {count} schedules held")),
        "{stdout}"
    );
}
