//! LAN discovery (`ravnest run --discover`) by mDNS, for real:
//!
//! - an announcement is heard back with its cluster, node, version and address;
//! - `--discover` for a cluster nobody announces fails with the clear error, within its bound;
//! - a node started with `--discover` is found by another process, which, with a wrong secret,
//!   fails as `--join` does, and with the right one joins the running cluster.
//!
//! mDNS is multicast: these tests must not send anything beyond this machine. Each runs again in
//! a network namespace of its own (`unshare -n`), where loopback is the only interface. Where no
//! namespace can be made (no `unshare`, no permission, not Linux), or multicast does not work in
//! it (our own announcement is not heard back), a test says why on stderr and passes;
//! `RAVNEST_REQUIRE_MDNS=1` makes that a failure.

mod common;
use common::free_ports;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ravnest_node::discover::{self, Announcer, DiscoverError};
use ravnest_runtime::tcp::PROTOCOL_VERSION;
use serde_json::Value;

/// Set in the run of a test inside its own network namespace.
const INNER: &str = "RAVNEST_TEST_NETNS";

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_ravnest")
}

/// A cluster name no other run uses.
fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}-{}-{nanos:08x}", std::process::id())
}

/// Why a test did not run, on stderr past the test harness's capture (or a failure, with
/// `RAVNEST_REQUIRE_MDNS` set).
fn skip(test: &str, why: &str) {
    assert!(
        std::env::var_os("RAVNEST_REQUIRE_MDNS").is_none(),
        "RAVNEST_REQUIRE_MDNS is set, but {test} cannot run: {why}"
    );
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// The `unshare` arguments that make a network namespace here: `-n` as root, `-rn` (a user
/// namespace too) for a user who may; or why neither does.
fn unshare_args() -> Result<&'static [&'static str], String> {
    let mut why = String::new();
    for args in [&["-n"][..], &["-rn"][..]] {
        match Command::new("unshare")
            .args(args)
            .args(["sh", "-c", "ip link set lo up"])
            .output()
        {
            Ok(o) if o.status.success() => return Ok(args),
            Ok(o) => why = String::from_utf8_lossy(&o.stderr).trim().to_string(),
            Err(e) => return Err(format!("cannot run `unshare`: {e}")),
        }
    }
    Err(why)
}

/// Run the test `name` again in a network namespace of its own with only loopback up, and
/// check that it passed there. True in that inner run (go on with the test); false in the
/// outer one, which is then done.
fn isolated(name: &str) -> bool {
    if std::env::var_os(INNER).is_some() {
        return true;
    }
    let args = match unshare_args() {
        Ok(a) => a,
        Err(why) => {
            skip(
                name,
                &format!("no network namespace of its own can be made here ({why})"),
            );
            return false;
        }
    };
    let out = Command::new("unshare")
        .args(args)
        .args(["sh", "-c", "ip link set lo up && exec \"$0\" \"$@\""])
        .arg(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(INNER, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    // The inner run's skip lines (and everything else, when it fails) reach the console.
    let _ = write!(std::io::stderr(), "{}", stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} failed in its network namespace:\n{stdout}\n{stderr}"
    );
    false
}

#[test]
fn an_announcement_is_heard_back() {
    const NAME: &str = "an_announcement_is_heard_back";
    if !isolated(NAME) {
        return;
    }
    let cluster = unique("t");
    let listen = "127.0.0.1:47999".parse().unwrap();
    let announced = match Announcer::start(&cluster, "a", listen, PROTOCOL_VERSION) {
        Ok(a) => a,
        Err(e) => return skip(NAME, &e.to_string()),
    };
    assert_eq!(
        announced.fullname(),
        format!("a @ {cluster}.{}", discover::SERVICE_TYPE)
    );
    let t0 = Instant::now();
    let heard = discover::browse(Some(&cluster), Duration::from_secs(5)).unwrap();
    if !heard.iter().any(|h| h.cluster == cluster) {
        return skip(
            NAME,
            "multicast does not work here: our own announcement was not heard back within 5 s",
        );
    }
    // Found, then GRACE for the others: well before the 5 s.
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    let choice =
        discover::select(&heard, Some(&cluster), "b", PROTOCOL_VERSION, t0.elapsed()).unwrap();
    assert_eq!(choice.cluster, cluster);
    assert_eq!(choice.candidates.len(), 1, "{choice:?}");
    assert_eq!(choice.candidates[0].node, "a");
    assert_eq!(choice.candidates[0].addrs, [listen]);
    // Gone once dropped: a fresh browse hears nothing of that cluster, and says so in time.
    drop(announced);
    let t0 = Instant::now();
    let heard = discover::browse(Some(&cluster), Duration::from_secs(1)).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let e = discover::select(&heard, Some(&cluster), "b", PROTOCOL_VERSION, t0.elapsed());
    assert!(
        matches!(e, Err(DiscoverError::NothingHeard { .. })),
        "{e:?}"
    );
}

#[test]
fn discover_fails_clearly_and_in_time_when_nobody_announces() {
    const NAME: &str = "discover_fails_clearly_and_in_time_when_nobody_announces";
    if !isolated(NAME) {
        return;
    }
    let cluster = unique("t");
    let t0 = Instant::now();
    let out = Command::new(exe())
        .args(["run", "--discover", "--cluster", &cluster, "--node", "b"])
        .args(["--discover-timeout", "1"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(
        e.contains(&format!(
            "--discover: no node of cluster `{cluster}` answered within 1 s"
        )),
        "{e}"
    );
    for what in [
        "same LAN",
        "multicast",
        "`[cluster] name`",
        "--join HOST:PORT",
    ] {
        assert!(e.contains(what), "no `{what}` in: {e}");
    }
    assert!(!e.contains("panicked"), "{e}");
}

/// Lines of JSON from a child's stdout, on a channel.
fn json_lines(child: &mut Child) -> std::sync::mpsc::Receiver<Value> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                let _ = tx.send(v);
            }
        }
    });
    rx
}

/// Kills its child when dropped (a failed assertion leaves no node running).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_node_found_by_discover_refuses_a_wrong_secret_and_lets_the_right_one_join() {
    const NAME: &str =
        "a_node_found_by_discover_refuses_a_wrong_secret_and_lets_the_right_one_join";
    if !isolated(NAME) {
        return;
    }
    let cluster = unique("t");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(&cluster);
    std::fs::create_dir_all(&dir).unwrap();
    // `a` trains alone after a second (min_nodes = 1), so that `b` joins a running cluster.
    let mut text = format!("[cluster]\nname = \"{cluster}\"\nsecret = \"right-secret\"\n\n");
    for (n, port) in ["a", "b"].into_iter().zip(free_ports(2)) {
        text += &format!(
            "[[node]]\nname = \"{n}\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{port}\"\n\n"
        );
    }
    text += "[model]\nkind = \"mlp\"\ndims = [64, 32, 10]\n\n[training]\nglobal_batch = 64\n\n[run]\nsteps = 1000000\nmin_nodes = 1\nregister_timeout_s = 1\nheartbeat_ms = 100\nheartbeat_timeout_ms = 2000\n";
    let file = dir.join("cluster.toml");
    std::fs::write(&file, text).unwrap();
    let mut a = Reaped(
        Command::new(exe())
            .args(["run", file.to_str().unwrap(), "--node", "a", "--discover"])
            .args(["--json", "--out", dir.join("a").to_str().unwrap()])
            .env_remove("RAVNEST_SECRET")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let events = json_lines(&mut a.0);

    let wrong = Command::new(exe())
        .args(["run", "--discover", "--cluster", &cluster, "--node", "b"])
        .args(["--discover-timeout", "30"])
        .env("RAVNEST_SECRET", "wrong-secret")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&wrong.stderr);
    if e.contains("answered within") {
        return skip(
            NAME,
            &format!("multicast does not work here: node `a` was not heard ({e})"),
        );
    }
    assert_eq!(wrong.status.code(), Some(2), "{e}");
    assert!(
        e.contains(&format!(
            "--discover: node `a` of cluster `{cluster}`: node at 127.0.0.1:"
        )) && e.contains("wrong cluster secret")
            && e.contains("set RAVNEST_SECRET to the cluster's secret"),
        "{e}"
    );

    let _b = Reaped(
        Command::new(exe())
            .args(["run", "--discover", "--cluster", &cluster, "--node", "b"])
            .args(["--json", "--out", dir.join("b").to_str().unwrap()])
            .env("RAVNEST_SECRET", "right-secret")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(v) = events.recv_timeout(left) else {
            break;
        };
        let joined = v["event"] == "cluster"
            && v["what"]
                .as_str()
                .is_some_and(|w| w.contains("node `b` joined"));
        seen.push(v);
        if joined {
            return;
        }
    }
    let whats: Vec<&Value> = seen.iter().map(|v| &v["what"]).collect();
    panic!("`b` did not join through --discover: {whats:?}");
}
