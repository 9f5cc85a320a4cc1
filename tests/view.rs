//! The live view in a real browser: a 3-process run with `--dashboard` and `--tensorboard`;
//! during it, `/metrics` has a sample per node, `/events` streams board updates more than once
//! a second, and headless Chromium draws the page with every node and a loss curve (DOM, not
//! pixels); after it, `report.html` draws the same with no network, and the TensorBoard file
//! reads back (with TensorBoard's own reader where it is installed).
//!
//! Chromium comes from Debian (`apt-get install chromium`); without it the browser part is
//! skipped with a note, unless `RAVNEST_REQUIRE_CHROMIUM` is set (CI sets it).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::free_ports;

fn chromium() -> Option<PathBuf> {
    let found = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    if found.is_none() {
        assert!(
            std::env::var_os("RAVNEST_REQUIRE_CHROMIUM").is_none(),
            "RAVNEST_REQUIRE_CHROMIUM is set and Chromium is not installed"
        );
        eprintln!(
            "note: Chromium is not installed (apt-get install chromium): the browser checks are skipped"
        );
    }
    found
}

/// Headless Chromium on `url` with `what` (`--dump-dom`, or `--screenshot=FILE`).
fn browse(chrome: &Path, profile: &Path, url: &str, what: &str) -> String {
    let out = Command::new(chrome)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,1500",
            "--timeout=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(what)
        .arg(url)
        .stderr(Stdio::null())
        .output()
        .expect("start chromium");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What the DOM shows: node rows and the loss curve's points.
fn drawn(dom: &str) -> (usize, usize) {
    // (The page's script has the row's template, whose name is `${...}`.)
    let rows = dom
        .split("<tr class=\"node\" data-node=\"")
        .skip(1)
        .filter(|s| !s.starts_with('$'))
        .count();
    let points = dom
        .split("id=\"loss\" data-points=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (rows, points)
}

/// GET `path` from `port` over plain HTTP/1.1: the body.
fn get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut all = String::new();
    s.read_to_string(&mut all).ok()?;
    let (head, body) = all.split_once("\r\n\r\n")?;
    // axum answers small bodies whole, and chunked ones only for streams.
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    Some(body.to_string())
}

/// The board's steps in the `/events` stream's messages over `secs`.
fn stream_steps(port: u16, secs: f64) -> Vec<u64> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut r = BufReader::new(s);
    let t0 = Instant::now();
    let mut steps = Vec::new();
    let mut line = String::new();
    while t0.elapsed().as_secs_f64() < secs {
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => {
                if let Some(data) = line.strip_prefix("data: ") {
                    let v: serde_json::Value = serde_json::from_str(data.trim()).unwrap();
                    steps.push(v["step"].as_u64().unwrap());
                }
            }
            Err(_) => continue,
        }
    }
    steps
}

#[test]
fn the_dashboard_streams_and_serves_metrics_and_a_browser_draws_it_live_and_after() {
    let dir = tempfile_dir("view");
    let ports = free_ports(4);
    let mut t = String::from("[cluster]\nname = \"view\"\nsecret = \"view-secret\"\n\n");
    for (name, port, slow) in [
        ("a", ports[0], 1.0),
        ("b", ports[1], 1.0),
        ("c", ports[2], 2.0),
    ] {
        t += &format!(
            "[[node]]\nname = \"{name}\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{port}\"\nemulate_slowdown = {slow:.1}\n\n"
        );
    }
    t += "[model]\nkind = \"mlp\"\ndims = [64, 512, 512, 10]\n\n[training]\nglobal_batch = 384\noptimizer = \"sgd-momentum\"\nsync = \"ring\"\n\n[run]\nsteps = 1500\nlearning_rate = 0.05\nmomentum = 0.9\nseed = 1\ncheckpoint_every_steps = 500\n";
    let file = dir.join("cluster.toml");
    std::fs::write(&file, t).unwrap();
    let port = ports[3];
    let out = dir.join("out");
    let tb = dir.join("tb");
    let mut run = Command::new(env!("CARGO_BIN_EXE_ravnest"))
        .arg("run")
        .arg(&file)
        .arg("--dashboard")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--tensorboard")
        .arg(&tb)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Mid-run: past step 20, and not finished.
    let t0 = Instant::now();
    let metrics = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the run never got to step 20"
        );
        assert!(run.try_wait().unwrap().is_none(), "the run ended early");
        if let Some(m) = get(port, "/metrics")
            && m.lines()
                .find_map(|l| l.strip_prefix("ravnest_cluster_step "))
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|s| s > 20.0)
        {
            break m;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    for node in ["a", "b", "c"] {
        assert!(
            metrics.contains(&format!("ravnest_step{{node=\"{node}\"}}")),
            "no sample of node {node}:\n{metrics}"
        );
    }
    let steps = stream_steps(port, 4.0);
    eprintln!(
        "the stream sent {} board updates in 4 s: steps {steps:?}",
        steps.len()
    );
    assert!(
        steps.len() >= 4,
        "fewer than one update a second: {steps:?}"
    );
    assert!(
        steps.last() > steps.first(),
        "the steps did not move: {steps:?}"
    );
    let chrome = chromium();
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("view");
    std::fs::create_dir_all(&shots).unwrap();
    if let Some(c) = &chrome {
        let url = format!("http://127.0.0.1:{port}/");
        let (rows, points) = drawn(&browse(c, &dir.join("p1"), &url, "--dump-dom"));
        assert_eq!(rows, 3, "the live page drew {rows} nodes");
        assert!(points > 1, "the live page's loss curve has {points} points");
        let png = shots.join("live.png");
        browse(
            c,
            &dir.join("p2"),
            &url,
            &format!("--screenshot={}", png.display()),
        );
        assert!(png.exists());
    }
    assert!(run.wait().unwrap().success(), "the run failed");
    let report = out.join("report.html");
    let page = std::fs::read_to_string(&report).expect("report.html after the run");
    for remote in ["src=\"http", "href=\"http", "url(http", "@import"] {
        assert!(!page.contains(remote), "report.html loads `{remote}`");
    }
    if let Some(c) = &chrome {
        let url = format!("file://{}", report.display());
        let (rows, points) = drawn(&browse(c, &dir.join("p3"), &url, "--dump-dom"));
        assert_eq!(rows, 3, "the report drew {rows} nodes");
        assert!(points > 100, "the report's loss curve has {points} points");
        let png = shots.join("report.png");
        browse(
            c,
            &dir.join("p4"),
            &url,
            &format!("--screenshot={}", png.display()),
        );
        assert!(png.exists());
        eprintln!("screenshots: {}", shots.display());
    }
    tensorboard_reads_back(&tb);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The event file's records frame and checksum as TensorBoard's reader wants, and hold one
/// training loss per step; with TensorBoard installed, its own reader agrees.
fn tensorboard_reads_back(dir: &Path) {
    let file = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("tfevents"))
        .expect("an event file");
    let bytes = std::fs::read(&file).unwrap();
    let (mut at, mut records) = (0, 0);
    while at < bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(crc, ravnest_view::tfevents::masked_crc(&bytes[at..at + 8]));
        let data = &bytes[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(crc, ravnest_view::tfevents::masked_crc(data));
        at += 16 + len;
        records += 1;
    }
    assert!(records > 1500, "{records} records");
    let script = "import sys\nfrom tensorboard.backend.event_processing import event_accumulator as ea\na = ea.EventAccumulator(sys.argv[1]); a.Reload()\nl = a.Scalars('train/loss')\nprint(len(l), l[0].step, l[-1].step, a.Tags()['scalars'])\n";
    let has = Command::new("python3")
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        eprintln!("note: TensorBoard is not installed in this python: its reader is not tried");
        return;
    }
    let o = Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    eprintln!("TensorBoard read: {said}");
    let n: usize = said.split_whitespace().next().unwrap().parse().unwrap();
    assert_eq!(n, 1500, "{said}");
}

fn tempfile_dir(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `--node` processes: the coordinator's host's dashboard draws every node from their step
/// reports (a worker's shows itself), and the host writes `report.html` at the end.
#[test]
fn a_node_process_that_hosts_the_coordinator_serves_the_clusters_view_and_writes_the_report() {
    let dir = tempfile_dir("view-nodes");
    let ports = free_ports(5);
    let mut t = String::from("[cluster]\nname = \"viewn\"\nsecret = \"view-secret\"\n\n");
    for (name, port) in [("a", ports[0]), ("b", ports[1]), ("c", ports[2])] {
        t += &format!(
            "[[node]]\nname = \"{name}\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{port}\"\n\n"
        );
    }
    t += "[model]\nkind = \"mlp\"\ndims = [64, 512, 512, 10]\n\n[training]\nglobal_batch = 384\noptimizer = \"sgd-momentum\"\nsync = \"ring\"\nredundancy = \"always\"\n\n[run]\nsteps = 800\nlearning_rate = 0.05\nmomentum = 0.9\nseed = 1\ncheckpoint_every_steps = 400\n";
    let file = dir.join("cluster.toml");
    std::fs::write(&file, t).unwrap();
    let (host_port, worker_port) = (ports[3], ports[4]);
    // (Node `c` serves no dashboard.)
    let start = |node: &str, port: Option<u16>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ravnest"));
        c.arg("run")
            .arg(&file)
            .args(["--node", node, "--out"])
            .arg(dir.join(node));
        if let Some(port) = port {
            c.arg("--dashboard").arg(format!("127.0.0.1:{port}"));
        }
        c.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut nodes = vec![
        start("a", Some(host_port)),
        start("b", Some(worker_port)),
        start("c", None),
    ];
    let applied = |m: &str, node: &str| {
        m.lines()
            .find_map(|l| {
                l.strip_prefix(&format!("ravnest_steps_applied_total{{node=\"{node}\"}} "))
            })
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let t0 = Instant::now();
    let m = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no node got to step 20"
        );
        // (The host's own node, and the others from their step reports: a node the plan
        // leaves out for its measured speed, on a busy machine, applies none.)
        if let Some(m) = get(host_port, "/metrics")
            && applied(&m, "a") > 20.0
            && applied(&m, "b") + applied(&m, "c") > 20.0
        {
            break m;
        }
        assert!(
            nodes.iter_mut().all(|c| c.try_wait().unwrap().is_none()),
            "a node ended early"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    eprintln!(
        "the host's /metrics: steps applied a {} b {} c {}",
        applied(&m, "a"),
        applied(&m, "b"),
        applied(&m, "c")
    );
    for node in ["a", "b", "c"] {
        assert!(
            m.contains(&format!("ravnest_up{{node=\"{node}\"}} 1")),
            "{m}"
        );
    }
    // A worker's page is its own node's.
    let w = get(worker_port, "/metrics").unwrap();
    assert!(applied(&w, "a") == 0.0 && applied(&w, "c") == 0.0, "{w}");
    for mut c in nodes {
        assert!(c.wait().unwrap().success());
    }
    let page =
        std::fs::read_to_string(dir.join("a").join("report.html")).expect("the host's report.html");
    assert!(page.contains("\"partial_loss\":true"));
    assert!(
        !dir.join("b").join("report.html").exists(),
        "a worker wrote a report"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
