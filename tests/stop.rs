//! Stopping a run on request, end to end (real processes, real TCP on loopback):
//!
//! - SIGINT or SIGTERM to a local run's own process (what a terminal, `timeout`, a service
//!   manager or a job scheduler sends) mid-training: the run ends after the steps in flight
//!   with a checkpoint there, prints its report and the exact `--resume` command, leaves no
//!   node process and no checkpoint parts, exits with `STOPPED_EXIT` (5); that command
//!   continues from the checkpoint it named;
//! - SIGINT or SIGTERM to the coordinator's process of a `--node` cluster: the same, on that
//!   process; the worker ends with the run;
//! - a second signal stops at once (exit 130), with nothing left behind.

mod common;
use common::free_ports;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_ravnest")
}

fn fresh_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Two CPU nodes on free ports training a small MLP for `steps`, a checkpoint every 20.
fn cluster_file(dir: &Path, steps: u64) -> PathBuf {
    slow_cluster_file(dir, steps, 1.0)
}

/// The same, both nodes emulating a device `slowdown` times slower.
fn slow_cluster_file(dir: &Path, steps: u64, slowdown: f64) -> PathBuf {
    let mut t = String::from("[cluster]\nname = \"stop\"\nsecret = \"stop-secret\"\n\n");
    for (name, port) in ["a", "b"].iter().zip(free_ports(2)) {
        t += &format!(
            "[[node]]\nname = \"{name}\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{port}\"\nemulate_slowdown = {slowdown:.1}\n\n"
        );
    }
    t += &format!(
        "[model]\nkind = \"mlp\"\ndims = [64, 256, 10]\n\n[training]\nglobal_batch = 256\noptimizer = \"sgd-momentum\"\nsync = \"ring\"\nredundancy = \"always\"\n\n[run]\nsteps = {steps}\nlearning_rate = 0.05\nmomentum = 0.9\nseed = 3\ncheckpoint_every_steps = 20\nheartbeat_ms = 100\nheartbeat_timeout_ms = 2000\n"
    );
    let p = dir.join("cluster.toml");
    std::fs::write(&p, t).unwrap();
    p
}

/// Start `ravnest ARGS` with its stdout and stderr in files under `dir` (named `tag`).
fn start(dir: &Path, tag: &str, args: &[&str]) -> Child {
    Command::new(exe())
        .args(args)
        .stdout(std::fs::File::create(dir.join(format!("{tag}.out"))).unwrap())
        .stderr(std::fs::File::create(dir.join(format!("{tag}.err"))).unwrap())
        .spawn()
        .unwrap()
}

/// What a process wrote on stdout and stderr.
fn said(dir: &Path, tag: &str) -> String {
    let read = |ext: &str| std::fs::read_to_string(dir.join(format!("{tag}.{ext}"))).unwrap();
    read("out") + &read("err")
}

/// Wait until a checkpoint is in `out` (at most 3 minutes).
fn wait_for_checkpoint(out: &Path) {
    let deadline = Instant::now() + Duration::from_secs(180);
    while Instant::now() < deadline {
        let any = std::fs::read_dir(out.join("checkpoints")).is_ok_and(|rd| {
            rd.flatten().any(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with("step-") && n.ends_with(".json")
            })
        });
        if any {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("no checkpoint in {} within 3 minutes", out.display());
}

fn signal(child: &Child, sig: &str) {
    let sent = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// The exit code of `child`, which must end within a minute.
fn exit_code(child: &mut Child, what: &str) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what}: still running a minute after the signal");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Processes whose command line names `out` (a node process of this run), after a moment.
fn left_behind(out: &Path) -> Vec<String> {
    std::thread::sleep(Duration::from_millis(500));
    let o = Command::new("pgrep")
        .args(["-a", "-f", out.to_str().unwrap()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(String::from)
        .collect()
}

/// No checkpoint parts are left (no `.parts/`, or an empty one).
fn no_parts(out: &Path) -> bool {
    std::fs::read_dir(out.join("checkpoints/.parts")).map_or(true, |mut rd| rd.next().is_none())
}

/// The step of "the latest checkpoint is step N" in `text`, and the command after "continue
/// with: ".
fn named_checkpoint(text: &str) -> (u64, String) {
    let step = text
        .split("the latest checkpoint is step ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no latest checkpoint named in: {text}"));
    let cmd = text
        .split("continue with: ")
        .nth(1)
        .and_then(|r| r.lines().next())
        .unwrap_or_else(|| panic!("no --resume command in: {text}"))
        .to_string();
    (step, cmd)
}

#[test]
fn sigint_to_a_local_run_stops_it_cleanly_and_resume_continues_from_the_named_checkpoint() {
    stop_a_local_run("-INT");
}

#[test]
fn sigterm_to_a_local_run_stops_it_cleanly_and_resume_continues_from_the_named_checkpoint() {
    stop_a_local_run("-TERM");
}

/// `sig` to a local run's own process mid-training (see the module's notes).
fn stop_a_local_run(sig: &str) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = fresh_dir(&format!("stop-local{sig}"));
    let file = cluster_file(&dir, 100_000);
    let (f, out) = (file.to_str().unwrap(), dir.join("out"));
    let o = out.to_str().unwrap();
    let mut run = start(&dir, "run", &["run", f, "--out", o]);
    wait_for_checkpoint(&out);
    signal(&run, sig);
    let code = exit_code(&mut run, "the local run");
    let text = said(&dir, "run");
    assert_eq!(
        code,
        Some(ravnest_node::process::STOPPED_EXIT),
        "exit code; said: {text}"
    );
    assert!(left_behind(&out).is_empty(), "{:?}", left_behind(&out));
    assert!(no_parts(&out), "checkpoint parts left in {}", out.display());
    assert!(text.contains("trained steps 0.."), "no report: {text}");
    let (step, cmd) = named_checkpoint(&text);
    assert_eq!(cmd, format!("ravnest run {f} --out {o} --resume"), "{text}");
    assert!(
        out.join(format!("checkpoints/step-{step:08}.safetensors"))
            .exists(),
        "the named checkpoint {step} is not on disk"
    );
    // The command it printed, 10 steps further, continues from there.
    let o2 = Command::new(exe())
        .args(["run", f, "--out", o, "--resume", "--steps"])
        .arg((step + 10).to_string())
        .output()
        .unwrap();
    let text2 =
        String::from_utf8_lossy(&o2.stdout).into_owned() + &String::from_utf8_lossy(&o2.stderr);
    assert!(o2.status.success(), "{text2}");
    assert!(
        text2.contains(&format!("trained steps {step}..{}", step + 10))
            && text2.contains(&format!("resumed from the checkpoint of step {step}")),
        "{text2}"
    );
}

#[test]
fn sigterm_to_the_coordinator_process_stops_the_run_cleanly() {
    stop_the_coordinator("-TERM");
}

#[test]
fn sigint_to_the_coordinator_process_stops_the_run_cleanly() {
    stop_the_coordinator("-INT");
}

/// `sig` to the coordinator's process of a two-process `--node` cluster mid-training.
fn stop_the_coordinator(sig: &str) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = fresh_dir(&format!("stop-node{sig}"));
    let file = cluster_file(&dir, 100_000);
    let (f, out) = (file.to_str().unwrap(), dir.join("out"));
    let o = out.to_str().unwrap();
    let mut a = start(&dir, "a", &["run", f, "--node", "a", "--out", o]);
    let mut b = start(&dir, "b", &["run", f, "--node", "b", "--out", o]);
    wait_for_checkpoint(&out);
    signal(&a, sig);
    let code_a = exit_code(&mut a, "the coordinator");
    let code_b = exit_code(&mut b, "the worker");
    let text = said(&dir, "a");
    assert_eq!(
        code_a,
        Some(ravnest_node::process::STOPPED_EXIT),
        "the coordinator's exit code; said: {text}"
    );
    assert_eq!(code_b, Some(0), "the worker: {}", said(&dir, "b"));
    assert!(no_parts(&out));
    let (step, cmd) = named_checkpoint(&text);
    assert!(
        cmd.starts_with(&format!("ravnest run {f} --node a --out {o} --resume")),
        "{cmd}"
    );
    assert!(
        out.join(format!("checkpoints/step-{step:08}.safetensors"))
            .exists()
    );
    assert!(left_behind(&out).is_empty(), "{:?}", left_behind(&out));
}

#[test]
fn a_second_signal_stops_a_local_run_at_once() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = fresh_dir("stop-twice");
    // Slow steps: the clean stop the first signal starts takes long enough for the second
    // to arrive while it runs (a fast MLP finishes it before a second `kill` starts).
    let file = slow_cluster_file(&dir, 100_000, 300.0);
    let (f, out) = (file.to_str().unwrap(), dir.join("out"));
    let mut run = start(&dir, "run", &["run", f, "--out", out.to_str().unwrap()]);
    wait_for_checkpoint(&out);
    signal(&run, "-TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !said(&dir, "run").contains("stop requested") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    signal(&run, "-TERM");
    let code = exit_code(&mut run, "the local run");
    assert_eq!(
        code,
        Some(ravnest_node::process::INTERRUPTED_EXIT),
        "{}",
        said(&dir, "run")
    );
    assert!(left_behind(&out).is_empty(), "{:?}", left_behind(&out));
    assert!(no_parts(&out));
}

/// A worker whose file names a coordinator address where nothing listens fails within
/// `--wait` seconds of its start, naming the address, though its own start-up (a gpt2-small,
/// built and measured on the CPU) takes much longer than that.
#[test]
fn a_node_whose_coordinator_address_is_wrong_fails_within_wait_naming_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = fresh_dir("stop-wrong-address");
    let ports = free_ports(2);
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/eighty-days.txt");
    let text = format!(
        "[cluster]\nname = \"w\"\n\n[[node]]\nname = \"a\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{}\"\n\n[[node]]\nname = \"b\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{}\"\n\n[model]\npreset = \"gpt2-small\"\n\n[training]\nglobal_batch = 8\noptimizer = \"adamw\"\n\n[run]\nnetwork = \"gpt\"\ndataset = {:?}\nsteps = 10\n",
        ports[0],
        ports[1],
        data.to_str().unwrap()
    );
    let file = dir.join("cluster.toml");
    std::fs::write(&file, text).unwrap();
    let t0 = Instant::now();
    let o = Command::new(exe())
        .args(["run", file.to_str().unwrap(), "--node", "b", "--wait", "3"])
        .output()
        .unwrap();
    let took = t0.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("coordinator `a` at 127.0.0.1:{}", ports[0])),
        "{err}"
    );
    // 3 s and the process's own start and exit (a loaded machine: a few seconds more).
    assert!(took < Duration::from_secs(15), "took {took:?}: {err}");
}
