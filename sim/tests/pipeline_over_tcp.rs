//! The pipeline over real TCP: the same node, collective and coordinator actors as in the
//! simulator, on four loopback TCP transports (handshake, framing, the `Activation` and
//! `ActivationGrad` envelopes on the wire), computing with the simulator's layered toy model
//! at near-zero compute times. The stages must end with the layers single-node training gives.

use std::sync::Arc;
use std::time::Duration;

use ravnest_core::cost::Costs;
use ravnest_core::{LayerRange, NodeId};
use ravnest_protocol::coordinator::Event;
use ravnest_protocol::coordinator::core::{Config, Tuning};
use ravnest_runtime::counters::Counters;
use ravnest_runtime::tcp::LoopbackCluster;
use ravnest_runtime::{Compute, Launch, Nodes};
use ravnest_sim::compute::SimCompute;

const STEPS: u64 = 6;
const BATCH: u64 = 12;

#[test]
fn a_pipeline_trains_over_real_tcp() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // A 1.4B model on four 12 GB cards: it fits no card, so the plan is a pipeline.
        let text = format!(
            "[links]\nbandwidth_gbps = 10.0\nlatency_ms = 0.1\n[[node]]\nname = \"g\"\ndevice = \"rtx3060\"\ncount = 4\n[model]\npreset = \"gpt-1.3b\"\n[training]\nglobal_batch = {BATCH}\nmicro_batch = 2\noptimizer = \"sgd\"\nprecision = \"bf16\"\n"
        );
        let s = ravnest_core::parse(&text, "tcp-pipeline").unwrap();
        let costs = Costs::new(&s.cluster, &s.model, &s.training);
        let layer_flops: Vec<f64> = costs
            .all()
            .iter()
            .map(|l| costs.train_flops(LayerRange::new(l, l + 1)))
            .collect();
        let compute = Arc::new(SimCompute::new(vec![1e-6; 4], 5).layered(&layer_flops));
        let toy = compute.toy();
        let net = LoopbackCluster::start(4, b"tcp-pipeline").await.unwrap();
        let t0 = tokio::time::Instant::now();
        let counters = Counters::default();
        let launch = Launch::new(net.clone()).at(t0);
        let nodes = Nodes::new(compute.clone(), (0..4).map(NodeId).collect(), 1 << 20)
            .heartbeat(Duration::from_millis(50))
            .observe()
            .counters(counters.clone());
        let sup = launch.nodes(nodes).await.unwrap();
        let config = Config {
            heartbeat_timeout_ms: 5000,
            train_flops: costs.train_flops(costs.all()),
            allow_pipeline: compute.runs_stages(),
            tuning: Tuning {
                measure_min_batch: u64::MAX,
                ..Tuning::default()
            },
            ..Config::new(s.cluster.clone(), s.model.clone(), s.training.clone(), STEPS)
        };
        let (coord, done_rx) = launch
            .coordinator(config, Duration::from_millis(50))
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(60), done_rx)
            .await
            .expect("training finished within 60 s")
            .unwrap();
        coord.stop(None);
        sup.stop(None);
        let sent: Vec<u64> = net.nodes.values().map(|t| t.bytes_sent()).collect();
        for t in net.nodes.values() {
            t.shutdown();
        }
        let log = launch.journal().snapshot();
        for (_, e) in &log.events {
            assert!(
                !matches!(e, Event::Violation(_) | Event::Stalled(_)),
                "{e:?}"
            );
        }
        assert_eq!(log.step_done_ns.len() as u64, STEPS);
        assert!(sent.iter().all(|&b| b > 0), "every stage sent: {sent:?}");

        let reference = toy.reference_model(STEPS, BATCH);
        let counters = counters.snapshot();
        let mut covered = vec![false; reference.len()];
        for (id, c) in counters.iter() {
            let o = c.observed.as_ref().expect("observed");
            assert_eq!(c.version, STEPS, "node {id:?} version");
            assert_eq!(o.version, STEPS, "node {id:?} observed version");
            let [r] = &o.slots[..] else {
                panic!("node {id:?}: one slot per stage, got {:?}", o.slots)
            };
            assert!(
                r.len() < reference.len(),
                "node {id:?} holds only its stage's layers"
            );
            for (a, b) in o.values.iter().zip(&reference[r.clone()]) {
                assert!((a - b).abs() < 1e-5, "node {id:?}: {a} vs {b}");
            }
            covered[r.clone()].iter_mut().for_each(|x| *x = true);
        }
        assert!(covered.iter().all(|&c| c), "every layer is held by a stage");
    });
}
