//! Held-out evaluation during a run (`[run] eval_every_steps`). The model of an evaluation step
//! is read from that step's checkpoint (the coordinator takes one at every evaluation step:
//! whatever the layout, a pipeline's stages and a sharded run's parts come together there)
//! and evaluated on the held-out data by the coordinator's host, on a thread of its own, so
//! that the coordinator's messages are never held up by it.

use std::sync::Arc;

use ravnest_protocol::coordinator::Event;
use ravnest_runtime::coordinator::Note;
use ravnest_train::data::Dataset;
use ravnest_train::net::Network;
use ravnest_train::store::CheckpointFiles;
use tokio::sync::mpsc;

use crate::events::RunEvent;

/// Held-out samples an evaluation reads, at most (a language model's windows).
pub(super) const EVAL_SAMPLES: usize = 256;

/// The model of one step on the held-out data.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Evaluation {
    pub step: u64,
    /// Cross-entropy per token (language models) or per sample, nats.
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
    /// Whether the model predicts tokens (its perplexity means something).
    pub language: bool,
}

impl Evaluation {
    /// (step, loss, accuracy), as the report lists them.
    pub fn figures(&self) -> (u64, f64, f64) {
        (self.step, self.loss, self.accuracy)
    }

    /// As the run says it.
    pub fn event(&self, node: &str) -> RunEvent {
        RunEvent::Eval {
            node: node.to_string(),
            step: self.step,
            loss: self.loss,
            accuracy: self.accuracy,
            samples: self.samples,
            perplexity: self.language.then(|| self.loss.exp()),
        }
    }
}

/// The model `weights` of `net` on the first held-out samples of `test`: (mean loss, accuracy,
/// samples), or why not.
pub(crate) fn evaluate(
    net: &Network,
    weights: &[f32],
    test: &Dataset,
) -> Result<(f64, f64, u64), String> {
    let dev = ravnest_train::device::current();
    let rows = test.len().min(EVAL_SAMPLES);
    let x = test.rows(0..rows).map_err(|e| e.to_string())?;
    if let Network::Gpt(g) = net {
        let (loss, accuracy) = g
            .evaluate(&dev, weights, &x, 16)
            .map_err(|e| e.to_string())?;
        return Ok((loss, accuracy, rows as u64));
    }
    let y = &test.y[..rows];
    let logits = net
        .logits_on(&dev, weights, &x, rows)
        .map_err(|e| e.to_string())?;
    let classes = logits.len() / rows.max(1);
    let (mut loss, mut right) = (0.0f64, 0usize);
    for (row, &label) in logits.chunks_exact(classes).zip(y) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
        loss += sum.ln() - f64::from(row[label as usize] - max);
        let best = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i);
        right += usize::from(best == label as usize);
    }
    let n = rows.max(1) as f64;
    Ok((loss / n, right as f64 / n, rows as u64))
}

/// Evaluations as their checkpoints land.
pub(super) struct Evaluator {
    every: u64,
    files: Arc<CheckpointFiles>,
    test: Arc<Dataset>,
    tx: mpsc::UnboundedSender<Result<Evaluation, String>>,
    rx: mpsc::UnboundedReceiver<Result<Evaluation, String>>,
    pending: usize,
    /// The steps evaluated, in order.
    pub done: Vec<Evaluation>,
}

impl Evaluator {
    /// Evaluating every `every` steps (0: never) from `files`' checkpoints on `test`.
    pub fn new(every: u64, files: Arc<CheckpointFiles>, test: Arc<Dataset>) -> Evaluator {
        let (tx, rx) = mpsc::unbounded_channel();
        Evaluator {
            every,
            files,
            test,
            tx,
            rx,
            pending: 0,
            done: Vec::new(),
        }
    }

    /// A journal note: the checkpoint of an evaluation step is written, so evaluate it.
    pub fn note(&mut self, n: &Note) {
        let Note::Event(_, Event::CheckpointComplete { step, .. }) = n else {
            return;
        };
        let step = *step;
        if self.every == 0 || !step.is_multiple_of(self.every) || step == 0 {
            return;
        }
        let (files, test, tx) = (self.files.clone(), self.test.clone(), self.tx.clone());
        self.pending += 1;
        std::thread::spawn(move || {
            let r = files
                .load_weights(step)
                .map_err(|e| e.to_string())
                .and_then(|w| evaluate(&files.net, &w, &test))
                .map(|(loss, accuracy, samples)| Evaluation {
                    step,
                    loss,
                    accuracy,
                    samples,
                    language: matches!(files.net, Network::Gpt(_)),
                });
            let _ = tx.send(r);
        });
    }

    /// The next evaluation done (waits while one is running; never resolves when none is).
    pub async fn next(&mut self) -> Result<Evaluation, String> {
        if self.pending == 0 {
            std::future::pending::<()>().await;
        }
        let r = self
            .rx
            .recv()
            .await
            .unwrap_or_else(|| Err("the evaluation thread is gone".into()));
        self.pending -= 1;
        if let Ok(e) = &r {
            self.done.push(e.clone());
        }
        r
    }

    /// Whether evaluations are still running.
    pub fn busy(&self) -> bool {
        self.pending > 0
    }
}
