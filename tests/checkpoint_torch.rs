//! A ravnest checkpoint loads into the equivalent `torch.nn` module with the snippet in
//! `docs/checkpoints.md` (run as written), and gives the outputs candle gives for the same
//! weights and inputs. Runs where `torch` and `safetensors` import (`RAVNEST_PYTHON`, else
//! `python3`); skipped with a note elsewhere.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use ravnest_core::Optimizer;
use ravnest_train::net::Network;
use ravnest_train::optim::Optim;
use ravnest_train::store::CheckpointFiles;

fn python() -> String {
    std::env::var("RAVNEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The snippet after `<!-- snippet: NAME -->` in a doc, without its fences.
fn snippet(doc: &str, name: &str) -> String {
    let text = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(doc))
        .unwrap_or_else(|e| panic!("{doc}: {e}"));
    let marker = format!("<!-- snippet: {name} -->");
    let at = text
        .find(&marker)
        .unwrap_or_else(|| panic!("{doc} has no {marker}"));
    let body = &text[at + marker.len()..];
    let open = body.find("```python\n").expect("a python block") + "```python\n".len();
    let close = body[open..].find("\n```").expect("the block's end");
    body[open..open + close].to_string()
}

#[test]
fn checkpoints_load_into_torch_with_the_documented_snippet() {
    let py = python();
    let has_torch = Command::new(&py)
        .args(["-c", "import torch, safetensors"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_torch {
        eprintln!(
            "note: {py} cannot import torch and safetensors; the PyTorch load check was skipped (set RAVNEST_PYTHON)"
        );
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("checkpoint-torch");
    let _ = std::fs::remove_dir_all(&dir);
    let nets = [
        Network::Mlp {
            dims: vec![64, 32, 16, 10],
        },
        Network::Cnn {
            side: 8,
            classes: 10,
        },
        Network::Char {
            context: 4,
            vocab: 12,
            embed: ravnest_train::net::CHAR_EMBED,
            hidden: 32,
        },
    ];
    let mut cases = Vec::new();
    for (k, net) in nets.into_iter().enumerate() {
        let files = CheckpointFiles {
            hf_source: None,
            term: 0,
            dir: dir.join(format!("net{k}")),
            net: net.clone(),
            optim: Optim {
                kind: Optimizer::SgdMomentum,
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 0.0,
                schedule: ravnest_core::recipe::Schedule::CONSTANT,
            },
            meta: BTreeMap::from([("seed".to_string(), k.to_string())]),
        };
        let p = net.params();
        let mut flat = net.init(k as u64 + 1);
        flat.extend((0..files.optim.state_len(p)).map(|i| i as f32 * 1e-3));
        let path = files.write(3, &flat, "{}").unwrap();
        // Inputs: pixels in [0, 1), or character ids.
        let rows = 5;
        let x: Vec<f32> = (0..rows * net.inputs())
            .map(|i| match &net {
                Network::Char { vocab, .. } => ((i * 7 + 3) % vocab) as f32,
                _ => ((i * 37 % 101) as f32) / 101.0,
            })
            .collect();
        let y = net.logits(&flat[..p], &x, rows).unwrap();
        cases.push(serde_json::json!({
            "path": path.display().to_string(),
            "rows": rows,
            "x": x,
            "y": y,
        }));
    }
    let cases_file = dir.join("cases.json");
    std::fs::write(&cases_file, serde_json::to_string(&cases).unwrap()).unwrap();
    let program = format!(
        "{}\n\nimport sys\ncases = json.load(open(sys.argv[1]))\nfor c in cases:\n    m = ravnest_module(c['path'])\n    x = torch.tensor(c['x'], dtype=torch.float32).reshape(c['rows'], -1)\n    with torch.no_grad():\n        y = m(x).reshape(-1)\n    d = (y - torch.tensor(c['y'])).abs().max().item()\n    print(type(m).__name__, d)\n",
        snippet("docs/checkpoints.md", "load-checkpoint")
    );
    let o = Command::new(&py)
        .args(["-c", &program, cases_file.to_str().unwrap()])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    for l in lines {
        let (name, d) = l.split_once(' ').unwrap();
        let d: f64 = d.parse().unwrap();
        eprintln!("{name}: torch's outputs differ from candle's by at most {d:.1e}");
        assert!(d < 1e-4, "{name}: torch and candle differ by {d}");
    }
}
