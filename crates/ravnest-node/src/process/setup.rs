//! A node process before it joins the run: which node it is, its device, data, network and
//! optimizer, the checkpoint folder's guard (and what `--resume` reads), and its own
//! measurement (candle matmul, the model's samples/s, free memory).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ravnest_core::{NodeId, Scenario};
use ravnest_protocol::msg::Capabilities;

use super::console::Say;
use super::data::gpt_of;
use super::options::{Options, RunError, coordinator_of};
use crate::events::RunEvent;
use ravnest_train::compute::CandleCompute;
use ravnest_train::data::Dataset;
use ravnest_train::net::Network;
use ravnest_train::optim::Optim;
use ravnest_train::store::CheckpointFiles;

/// The network a scenario trains on a dataset, checked against each other.
/// The model a run of `s` trains, for `run --dry-run`: a language model's from the file alone
/// (its corpus is not read); any other from its (small) dataset.
pub fn network_for_file(s: &Scenario, origin: &str) -> Result<ravnest_core::ModelSpec, RunError> {
    if let Some(m) = &s.run.model_from {
        return Ok(Network::Gpt(ravnest_train::gpt::Gpt::of(m.decoder)).model_spec());
    }
    if s.run.network == "gpt" {
        let (layers, hidden, heads, seq, vocab) = gpt_of(s, origin)?;
        let g = ravnest_train::gpt::Gpt::gpt2(
            layers as usize,
            hidden as usize,
            heads as usize,
            seq as usize,
            vocab as usize,
        );
        return Ok(Network::Gpt(g).model_spec());
    }
    let d = super::data::load_dataset(s, origin, None)?;
    network_for(s, origin, &d).map(|n| n.model_spec())
}

/// What a run of `s` computes in, as `run --dry-run` says it.
pub fn precision_line(s: &Scenario) -> String {
    use ravnest_core::Precision;
    let p = s.training.precision;
    let lm = s.run.network == "gpt" || s.run.model_from.is_some();
    match p {
        Precision::Fp32 => "precision: fp32\n".into(),
        Precision::Bf16 if lm => "precision: bf16 mixed precision with fp32 master weights and optimizer state: on a CPU emulated (each matrix product's factors and result rounded to bf16, its sums in f32; no faster there: a CPU has no bf16 units); a GPU node computes in fp32 (its bf16 path is not built yet), and the plan's memory and speed figures assume bf16\n".into(),
        _ => format!(
            "note: [training] precision = \"{}\": `run` computes {} in fp32 ({}); the plan's memory and speed figures assume {0}\n",
            p.as_str(),
            if lm { "this model" } else { "this network" },
            if lm { "fp16 needs loss scaling, built for no device yet" } else { "mixed precision is built for the transformers only" }
        ),
    }
}

/// How a node on `device` computes a transformer under `s`'s precision (`None`: fp32): bf16
/// is emulated on a CPU ([`ravnest_train::gpt::Numerics::Bf16`]).
fn numerics(
    s: &Scenario,
    device: ravnest_train::device::RunDevice,
) -> Option<ravnest_train::gpt::Numerics> {
    (s.training.precision == ravnest_core::Precision::Bf16
        && matches!(device, ravnest_train::device::RunDevice::Cpu))
    .then_some(ravnest_train::gpt::Numerics::Bf16)
}

pub fn network_for(s: &Scenario, origin: &str, data: &Dataset) -> Result<Network, RunError> {
    if let Some(m) = &s.run.model_from {
        return Ok(Network::Gpt(ravnest_train::gpt::Gpt::of(m.decoder)));
    }
    match s.run.network.as_str() {
        "gpt" => {
            let (layers, hidden, heads, seq, vocab) = gpt_of(s, origin)?;
            Ok(Network::Gpt(ravnest_train::gpt::Gpt::gpt2(
                layers as usize,
                hidden as usize,
                heads as usize,
                seq as usize,
                vocab as usize,
            )))
        }
        "char" => Ok(Network::Char {
            context: data.features,
            vocab: data.classes,
            embed: ravnest_train::net::CHAR_EMBED,
            hidden: s.run.char_hidden as usize,
        }),
        "cnn" => {
            let side = data.side.ok_or_else(|| {
                RunError::Config(format!(
                    "{origin}: [run] network = \"cnn\" needs square images; {} has {} features",
                    data.name, data.features
                ))
            })?;
            Ok(Network::Cnn {
                side,
                classes: data.classes,
            })
        }
        _ => {
            // The [model]'s MLP widths, recovered from its layers (params = in·out + out).
            let mut dims = Vec::new();
            for l in &s.model.layers {
                let out = l.output_elems_per_sample;
                if out == 0 || l.params % out != 0 || !l.name.starts_with("fc") {
                    return Err(RunError::Config(format!(
                        "{origin}: `ravnest run` trains MLPs ([model] preset = \"mlp-digits\" or kind = \"mlp\") or, with [run] network = \"cnn\", a small CNN; model `{}` is neither",
                        s.model.name
                    )));
                }
                if dims.is_empty() {
                    dims.push((l.params / out - 1) as usize);
                }
                dims.push(out as usize);
            }
            if dims.first() != Some(&data.features) {
                return Err(RunError::Config(format!(
                    "{origin}: the model takes {} inputs but dataset {} has {} features per sample",
                    dims.first().copied().unwrap_or(0),
                    data.name,
                    data.features
                )));
            }
            if dims.last().copied().unwrap_or(0) < data.classes {
                return Err(RunError::Config(format!(
                    "{origin}: the model has {} outputs but dataset {} has {} classes",
                    dims.last().copied().unwrap_or(0),
                    data.name,
                    data.classes
                )));
            }
            Ok(Network::Mlp { dims })
        }
    }
}

/// The optimizer a scenario asks for.
pub fn optim_for(s: &Scenario) -> Optim {
    Optim {
        kind: s.training.optimizer,
        lr: s.run.learning_rate as f32,
        momentum: s.run.momentum as f32,
        weight_decay: s.run.weight_decay as f32,
        schedule: s.run.schedule(),
    }
}

/// What a node process has once it is ready to register.
pub(super) struct Setup {
    pub me: NodeId,
    /// Resident bytes before any model state was made.
    pub rss_before_model: u64,
    /// The peak resident bytes when training ended, where the process goes on to evaluate
    /// the model (the coordinator's host) and reads it before.
    pub trained_peak_rss: Arc<std::sync::OnceLock<u64>>,
    pub compute: Arc<CandleCompute>,
    pub test: Dataset,
    pub files: CheckpointFiles,
    pub caps: Capabilities,
    pub solo_samples_per_s: f64,
}

/// This process's node in the file, or which names there are.
pub(super) fn whoami(opts: &Options) -> Result<NodeId, RunError> {
    let names: Vec<&str> = opts
        .scenario
        .cluster
        .nodes
        .iter()
        .map(|n| n.name.as_str())
        .collect();
    names
        .iter()
        .position(|n| *n == opts.node)
        .map(|i| NodeId(i as u32))
        .ok_or_else(|| {
            RunError::Config(format!(
                "{}: no node named `{}` (nodes: {})",
                opts.origin,
                opts.node,
                names.join(", ")
            ))
        })
}

/// Everything up to the measurement: device, data, network, compute, checkpoint files (and the
/// checkpoint `--resume` starts from).
pub(super) async fn setup(opts: &Options, say: &Say) -> Result<Setup, RunError> {
    let s = &opts.scenario;
    let me = whoami(opts)?;
    // The device first: everything this process computes is made there.
    let run_device = ravnest_train::device::of_node(s, me.index(), opts.device.as_deref())
        .and_then(|d| ravnest_train::device::select(d).map(|_| d))
        .map_err(|reason| RunError::Device {
            origin: opts.origin.clone(),
            node: opts.node.clone(),
            reason,
        })?;
    let loading = say.phase(&format!("loading the dataset `{}`", s.run.dataset));
    let (train, test) = tokio::task::block_in_place(|| {
        super::data::train_and_test(s, &opts.origin, &opts.out_dir.join("cache"))
    })?;
    drop(loading);
    let net = match (
        network_for(s, &opts.origin, &train)?,
        numerics(s, run_device),
    ) {
        (Network::Gpt(g), Some(n)) => Network::Gpt(g.computing(n)),
        (net, _) => net,
    };
    // What the process holds before any model state exists (the bar its peak is held to).
    let rss_before_model = ravnest_train::measure::resident_memory().map_or(0, |m| m.0);
    let optim = optim_for(s);
    let slowdown = s
        .run
        .emulate_slowdown
        .get(me.index())
        .copied()
        .unwrap_or(1.0);
    let mut compute = CandleCompute::new(net.clone(), Arc::new(train), optim, s.run.seed, slowdown);
    if let Some(m) = s.run.model_from.as_ref().filter(|m| m.pretrained) {
        // Only the headers now: each tensor is read when this node makes its layers.
        let folder = ravnest_train::folder::HfFolder::open(std::path::Path::new(&m.dir))?;
        if let Network::Gpt(g) = &net {
            folder.check(g)?;
        }
        compute = compute.with_pretrained(Arc::new(folder));
    }
    // A cluster file's `slowdown` faults for this node happen for real: seconds from the moment
    // training starts here. (Crashes, partitions and link faults are the simulator's.)
    for f in &s.faults {
        if let ravnest_core::config::Fault::Slowdown {
            node,
            factor,
            from_s,
            to_s,
        } = f
            && *node == me
        {
            compute.schedule.push((*from_s, *to_s, *factor));
        }
    }
    let files = CheckpointFiles {
        term: 0,
        dir: opts.out_dir.join("checkpoints"),
        net,
        optim,
        hf_source: s
            .run
            .model_from
            .as_ref()
            .map(|m| std::path::PathBuf::from(&m.dir)),
        meta: BTreeMap::from([
            ("seed".to_string(), s.run.seed.to_string()),
            ("dataset".to_string(), s.run.dataset.clone()),
            ("cluster".to_string(), s.cluster.name.clone()),
            ("ravnest".to_string(), env!("CARGO_PKG_VERSION").to_string()),
        ]),
    };
    if me == coordinator_of(s) {
        compute.resume = guard_checkpoints(opts, say, &files)?;
        if s.training.precision != ravnest_core::Precision::Fp32 {
            say.cluster(precision_line(s).trim_end().to_string());
        }
    }
    compute.micro_batch = u64::from(s.training.micro_batch).max(1);
    compute.max_grad_norm = s.run.max_grad_norm.map(|m| m as f32);
    // The memory budget before measuring: a model it cannot hold is measured by its layers.
    let memory = free_memory(s, me);
    compute.ledger.lock().unwrap().budget = memory;
    let compute = Arc::new(compute);
    let measuring =
        say.phase("measuring this node (matmul speed, the model's training step, free memory)");
    let (caps, solo) = measure(opts, say, me, &compute, run_device, slowdown, memory).await;
    drop(measuring);
    Ok(Setup {
        me,
        rss_before_model,
        trained_peak_rss: Arc::default(),
        compute,
        test,
        files,
        caps,
        solo_samples_per_s: solo,
    })
}

/// Free memory where the model lives (the GPU's, or the machine's), capped by the file's
/// figure (its `memory_gib` less the reserve): a node may emulate a smaller card than the
/// machine it runs on.
fn free_memory(s: &Scenario, me: NodeId) -> u64 {
    let configured = s.cluster.nodes[me.index()].memory_bytes;
    ravnest_train::device::free_memory(&ravnest_train::device::current())
        .or_else(ravnest_train::measure::available_memory)
        .map_or(configured, |m| m.min(configured))
}

/// On the coordinator's host (the only writer): never write over another run's checkpoints by
/// accident; with `--resume`, the checkpoint to start from.
fn guard_checkpoints(
    opts: &Options,
    say: &Say,
    files: &CheckpointFiles,
) -> Result<Option<ravnest_train::compute::Resume>, RunError> {
    if !opts.join && ravnest_train::store::guard(&files.dir, opts.resume, opts.overwrite)? {
        say.cluster(format!(
            "--overwrite: removed the previous checkpoints in {}",
            files.dir.display()
        ));
    }
    if !opts.resume {
        return Ok(None);
    }
    // The newest checkpoint whose values give the digests the replicas agreed on: a damaged
    // one is said and passed over, never trained on.
    match files.newest_intact()? {
        Some((step, refused)) => {
            for line in refused {
                say.cluster(format!("--resume: {line}"));
            }
            // Read tensor by tensor as the nodes need them: no node holds the whole model.
            let reader = ravnest_train::store::CheckpointReader::open(files, step)?;
            say.cluster(format!(
                "resuming from the checkpoint of step {step} ({})",
                files.path(step).display()
            ));
            Ok(Some(ravnest_train::compute::Resume {
                version: step,
                step_count: reader.step_count,
                source: ravnest_train::state::Source::Checkpoint(Arc::new(reader)),
            }))
        }
        None => Err(RunError::Config(format!(
            "--resume: no checkpoint in {} (its `latest` file is missing)",
            files.dir.display()
        ))),
    }
}

/// Measure: candle matmul, then the model itself on one global batch (emulated slowdown
/// included: that is what this node delivers), and free memory. Says what it measured.
async fn measure(
    opts: &Options,
    say: &Say,
    me: NodeId,
    compute: &Arc<CandleCompute>,
    run_device: ravnest_train::device::RunDevice,
    slowdown: f64,
    memory: u64,
) -> (Capabilities, f64) {
    let s = &opts.scenario;
    let gflops = tokio::task::block_in_place(|| {
        ravnest_train::measure::matmul_flops(Duration::from_millis(150))
    }) / 1e9;
    let dev = ravnest_train::device::current();
    // On a GPU, half precision too (what larger models train in).
    let bf16_gflops = (!dev.is_cpu()).then(|| {
        tokio::task::block_in_place(|| {
            ravnest_train::measure::matmul_flops_in(
                Duration::from_millis(150),
                candle_core::DType::BF16,
            )
        }) / 1e9
    });
    // The model's training step, or for a model this node cannot hold, a block standing for it.
    let mut bench = ravnest_runtime::measure::calibrate::Bench::new(compute.clone(), me, None);
    let b = u64::from(s.training.global_batch).clamp(1, 512);
    bench.step(b.min(8), 0).await;
    // The best of three: other processes on the machine may be measuring at the same time.
    // (The plan uses the in-situ figure every node measures at once after registering.)
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        best = best.min(bench.step(b, 0).await);
    }
    drop(bench);
    let solo = b as f64 / best.max(1e-9);
    let train_flops = compute.net.model_spec().train_flops_per_sample();
    let caps = Capabilities {
        flops: solo * train_flops,
        memory_bytes: memory,
        device: format!("{run_device} (candle matmul {gflops:.1} GFLOP/s, {solo:.0} samples/s)"),
        name: s.cluster.nodes[me.index()].name.clone(),
        address: s.cluster.nodes[me.index()].address.clone(),
    };
    say.say(&RunEvent::Measured {
        node: say.node.clone(),
        device: run_device.to_string(),
        matmul_gflops: gflops,
        matmul_bf16_gflops: bf16_gflops,
        samples_per_s: solo,
        memory_gib: memory as f64 / (1u64 << 30) as f64,
        slowdown,
    });
    (caps, solo)
}
