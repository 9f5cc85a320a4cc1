//! Distributed = single node: three node actors over real TCP (loopback), with a deliberately
//! uneven batch split, train K steps of a candle network through the ring all-reduce (or the
//! parameter server); every replica's weights must equal K single-node steps on the whole
//! global batch within 1e-5. Run for the MLP and the character model over the ring, and for
//! the MLP through the parameter server.

use std::sync::Arc;
use std::time::Duration;

use ravnest_core::{NodeId, Optimizer};
use ravnest_protocol::coordinator::Event;
use ravnest_protocol::coordinator::core::{Config, Tuning};
use ravnest_runtime::counters::Counters;
use ravnest_runtime::tcp::LoopbackCluster;
use ravnest_runtime::{Launch, Nodes};
use ravnest_train::compute::CandleCompute;
use ravnest_train::data::Dataset;
use ravnest_train::net::Network;
use ravnest_train::optim::Optim;

const STEPS: u64 = 5;
const BATCH: u64 = 60;

fn cluster_text(sync: &str) -> String {
    // Three nodes of different speeds: the planner splits the batch unevenly.
    // Slow devices on fast links, so the ring pays for every node.
    let mut t = String::from("[links]\nbandwidth_gbps = 100.0\nlatency_ms = 0.001\n\n");
    for (name, tflops) in [("a", 0.003), ("b", 0.002), ("c", 0.001)] {
        t += &format!("[[node]]\nname = \"{name}\"\ndevice = \"cpu\"\ntflops = {tflops}\n\n");
    }
    t + &format!(
        "[model]\nkind = \"mlp\"\ndims = [64, 32, 10]\n\n[training]\nglobal_batch = {BATCH}\noptimizer = \"adamw\"\nsync = \"{sync}\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distributed_mlp_steps_equal_single_node_steps() {
    let data = Dataset::load("digits").unwrap();
    let net = Network::Mlp {
        dims: vec![64, 32, 10],
    };
    equivalence(net, data, "ring").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distributed_char_model_steps_equal_single_node_steps() {
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(20);
    let data = Dataset::text(&text, "fox.txt", 6).unwrap();
    let net = Network::Char {
        context: 6,
        vocab: data.classes,
        embed: 4,
        hidden: 16,
    };
    equivalence(net, data, "ring").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameter_server_steps_over_tcp_equal_single_node_steps() {
    let data = Dataset::load("digits").unwrap();
    let net = Network::Mlp {
        dims: vec![64, 32, 10],
    };
    equivalence(net, data, "param-server").await;
}

async fn equivalence(net: Network, data: Dataset, sync: &str) {
    let s = ravnest_core::parse(&cluster_text(sync), "equivalence").unwrap();
    let data = Arc::new(data.split().0);
    let optim = Optim {
        kind: Optimizer::Adamw,
        lr: 0.01,
        momentum: 0.9,
        weight_decay: 0.01,
        schedule: ravnest_core::recipe::Schedule::CONSTANT,
    };
    let compute = Arc::new(CandleCompute::new(net.clone(), data, optim, 11, 1.0));
    let net_tcp = LoopbackCluster::start(3, b"equivalence").await.unwrap();
    let t0 = tokio::time::Instant::now();
    let counters = Counters::default();
    let launch = Launch::new(net_tcp.clone()).at(t0);
    let ids = vec![NodeId(0), NodeId(1), NodeId(2)];
    let nodes = Nodes::new(compute.clone(), ids, 4 * compute.model_len() as u64)
        .grad_bytes(4 * compute.params() as u64)
        .heartbeat(Duration::from_millis(50))
        .observe()
        .counters(counters.clone());
    let sup = launch.nodes(nodes).await.unwrap();
    let model = net.model_spec();
    let config = Config {
        heartbeat_timeout_ms: 5000,
        tuning: Tuning {
            measure_min_batch: u64::MAX,
            ..Tuning::default()
        },
        ..Config::new(s.cluster.clone(), model, s.training.clone(), STEPS)
    };
    let (coord, done_rx) = launch
        .coordinator(config, Duration::from_millis(50))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), done_rx)
        .await
        .expect("training finished")
        .unwrap();
    coord.stop(None);
    sup.stop(None);
    let sent: Vec<u64> = net_tcp.nodes.values().map(|t| t.bytes_sent()).collect();
    for t in net_tcp.nodes.values() {
        t.shutdown();
    }
    // The traffic shows which collective ran: a ring spreads it evenly; a parameter server
    // sends every worker the update while each worker sends one gradient.
    let (lo, hi) = (
        *sent.iter().min().unwrap() as f64,
        *sent.iter().max().unwrap() as f64,
    );
    eprintln!("{sync}: bytes sent per node {sent:?}");
    if sync == "param-server" {
        assert!(
            hi > 1.5 * lo,
            "a server sends more than its workers: {sent:?}"
        );
    } else {
        assert!(hi < 1.5 * lo, "a ring spreads the traffic: {sent:?}");
    }

    let log = launch.journal().snapshot();
    let split = log
        .events
        .iter()
        .find_map(|(_, e)| match e {
            Event::Planned { workers, .. } => Some(workers.clone()),
            _ => None,
        })
        .unwrap();
    let batches: Vec<u64> = split.iter().map(|w| w.1).collect();
    assert_eq!(batches.len(), 3, "all three nodes work: {split:?}");
    assert!(
        batches[0] > batches[2],
        "the split follows speed: {split:?}"
    );

    // The single-node reference: K steps on the whole global batch.
    let mut reference = compute.initial_model();
    for k in 0..STEPS {
        let sum = compute.gradient_sum_now(k * BATCH..(k + 1) * BATCH, &reference);
        let mean: Vec<f32> = sum.iter().map(|g| g / BATCH as f32).collect();
        compute.step_now(&mut reference, &mean);
    }
    let counters = counters.snapshot();
    for (id, c) in counters.iter() {
        assert_eq!(c.version, STEPS, "node {id:?} version");
        let o = c.observed.as_ref().expect("observed");
        assert_eq!(
            o.slots,
            vec![0..reference.len()],
            "node {id:?} holds the whole model"
        );
        let worst = o
            .values
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst < 1e-5,
            "node {id:?}: max |distributed - single| = {worst}"
        );
        eprintln!("node {id:?}: max |distributed - single| = {worst:e} (split {split:?})");
    }
}
