//! A gradient's work, owned, for the compute thread: the samples' rows in the run's order,
//! the forward and backward of the node's network over them (the hand-written CPU pass where
//! there is one), and an emulated slower device.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use ravnest_protocol::node::values::ComputeError;
use ravnest_runtime::seams::BucketSink;

use super::Stats;
use crate::data::Dataset;
use crate::gpt::StageInput;
use crate::net::Network;
use crate::state::{CandleModel, ModelState};

/// A step's compute, timed: real compute (forward and backward), of it the forward, and the
/// emulated slowdown's waits.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Timed {
    pub(super) real: Duration,
    pub(super) forward: Duration,
    pub(super) slept: Duration,
}

/// The part of a [`CandleCompute`](super::CandleCompute) a gradient needs, owned.
#[derive(Debug, Clone)]
pub(super) struct Job {
    pub(super) net: Network,
    pub(super) data: Arc<Dataset>,
    pub(super) seed: u64,
    pub(super) perm: Arc<Mutex<(u64, Vec<u32>)>>,
    pub(super) stats: Arc<Mutex<Stats>>,
    pub(super) spare: Arc<Mutex<Vec<Vec<f32>>>>,
    pub(super) state: Arc<ModelState>,
}

/// Buffers kept for reuse (gradient buckets, a stage's gradient sums).
pub(super) type Spare = Arc<Mutex<Vec<Vec<f32>>>>;

/// Gradient buffers kept for reuse, at most.
pub(super) const SPARE_BUFFERS: usize = 16;

impl Job {
    pub(super) fn row(&self, s: u64) -> usize {
        let n = self.data.len() as u64;
        let epoch = s / n;
        let mut p = self.perm.lock().unwrap();
        if p.0 != epoch {
            *p = (
                epoch,
                crate::data::epoch_order(self.seed, epoch, n as usize),
            );
        }
        p.1[(s % n) as usize] as usize
    }

    /// The samples' inputs and labels (a corpus's windows read from disk; their labels 0).
    pub(super) fn batch(&self, samples: Range<u64>) -> Result<(Vec<f32>, Vec<u32>), ComputeError> {
        let f = self.data.features;
        let mut x = Vec::with_capacity((samples.end - samples.start) as usize * f);
        let mut y = Vec::with_capacity((samples.end - samples.start) as usize);
        for s in samples {
            let r = self.row(s);
            self.data
                .row_into(r, &mut x)
                .map_err(|e| ComputeError::Backend(e.to_string()))?;
            y.push(self.data.y.get(r).copied().unwrap_or(0));
        }
        Ok((x, y))
    }

    pub(super) fn gradient_buckets(
        &self,
        samples: Range<u64>,
        model: &CandleModel,
        sink: &mut dyn FnMut(usize, Vec<f32>),
    ) -> Result<f64, ComputeError> {
        let (x, y) = self.batch(samples)?;
        let mut zeroed = |n: usize| self.zeroed(n);
        let dev = crate::device::current();
        let all = 0..self.state.layout.tensors.len();
        let vars = self.state.vars(model, all, &dev)?;
        let failed =
            |e: candle_core::Error| ComputeError::Backend(format!("candle forward/backward: {e}"));
        let loss = match &self.net {
            Network::Gpt(g) => {
                let p = by_layer(g, &vars);
                if dev.is_cpu() {
                    self.decoder_buckets(g, &p, &x, sink).map_err(failed)?
                } else {
                    // The whole gradient at once, then its buckets.
                    let mut buf = zeroed(self.state.layout.params);
                    let all = 0..g.planner_layers();
                    let (grads, _, loss) = g
                        .stage_backward_with(&dev, all, &p, StageInput::Tokens(&x), None, None)
                        .map_err(failed)?;
                    let mut at = 0;
                    for t in &grads {
                        let n = t.elem_count();
                        crate::state::read(t, |v| buf[at..at + n].copy_from_slice(v))?;
                        at += n;
                    }
                    for (k, r) in self.net.grad_buckets().into_iter().enumerate() {
                        sink(k, buf[r].to_vec());
                    }
                    loss
                }
            }
            net => net
                .loss_and_grad_buckets_held(&dev, &vars, &x, &y, sink, &mut zeroed)
                .map_err(failed)?,
        };
        let mut s = self.stats.lock().unwrap();
        s.last_loss = loss / y.len().max(1) as f64;
        s.samples += y.len() as u64;
        Ok(loss)
    }

    /// A zero-filled buffer of `n` values, a spare one reused where there is one.
    fn zeroed(&self, n: usize) -> Vec<f32> {
        let mut buf = self.spare.lock().unwrap().pop().unwrap_or_default();
        buf.clear();
        buf.resize(n, 0.0);
        buf
    }

    /// A decoder's gradient by the CPU's hand-written backward, written in place tensor by
    /// tensor; each bucket of [`Network::grad_buckets`] (layers from the head down) is copied
    /// out and handed to `sink` as soon as the lowest of its layers is done, so its
    /// all-reduce runs while the layers below compute. Returns the loss sum.
    fn decoder_buckets(
        &self,
        g: &crate::gpt::Gpt,
        p: &[Vec<candle_core::Var>],
        x: &[f32],
        sink: &mut dyn FnMut(usize, Vec<f32>),
    ) -> candle_core::Result<f64> {
        let buckets = self.net.grad_buckets();
        let mut buf = self.zeroed(self.state.layout.params);
        let mut slices: Vec<&mut [f32]> = Vec::new();
        let mut rest = buf.as_mut_slice();
        for t in &self.state.layout.tensors {
            let (mine, more) = rest.split_at_mut(t.len);
            slices.push(mine);
            rest = more;
        }
        // Where each layer starts in the flat gradient.
        let starts: Vec<usize> = p
            .iter()
            .scan(0, |at, l| {
                let here = *at;
                *at += l.iter().map(|v| v.elem_count()).sum::<usize>();
                Some(here)
            })
            .collect();
        let mut parts: Vec<Option<Vec<f32>>> = vec![None; buckets.len()];
        let mut done = |l: usize, grads: &[&mut [f32]]| {
            let at = starts[l];
            let Some(k) = buckets.iter().position(|r| r.contains(&at)) else {
                return;
            };
            let r = &buckets[k];
            let part = parts[k].get_or_insert_with(|| self.zeroed(r.len()));
            let mut o = at - r.start;
            for g in grads {
                part[o..o + g.len()].copy_from_slice(g);
                o += g.len();
            }
            if at == r.start
                && let Some(part) = parts[k].take()
            {
                sink(k, part);
            }
        };
        let ts = detached(p);
        let refs: Vec<&[Tensor]> = ts.iter().map(Vec::as_slice).collect();
        let all = 0..g.planner_layers();
        let input = StageInput::Tokens(x);
        let (_, loss) =
            g.fast_backward_each(all, &refs, input, None, None, &mut slices, &mut done)?;
        drop(slices);
        let mut pool = self.spare.lock().unwrap();
        if pool.len() < SPARE_BUFFERS {
            pool.push(buf);
        }
        Ok(loss)
    }

    /// The gradient with an emulated slower device: each bucket is handed over (k − 1) times
    /// its compute time later, as a device k times slower would (a precise thread sleep:
    /// tokio's timer has 1 ms granularity, a large error on steps of a few ms).
    pub(super) fn emulated(
        &self,
        samples: Range<u64>,
        model: &CandleModel,
        slowdown: f64,
        ready: &BucketSink,
    ) -> (Result<f64, ComputeError>, Timed) {
        let slow = slowdown.max(1.0) - 1.0;
        let start = Instant::now();
        // The thread's CPU time is read only where a wait is emulated.
        let cpu = || if slow > 0.0 { thread_cpu() } else { None };
        let mut since = (start, cpu());
        let mut t = Timed::default();
        crate::phases::take_forward_end();
        // Count the compute since `since`, then wait (k − 1) times as long.
        let emulate = |(wall, cpu): (Instant, Option<Duration>), t: &mut Timed| {
            let took = wall.elapsed();
            t.real += took;
            if slow > 0.0 {
                let s = Instant::now();
                std::thread::sleep(work_time(took, cpu).mul_f64(slow));
                t.slept += s.elapsed();
            }
        };
        let r = self.gradient_buckets(samples, model, &mut |k, v| {
            emulate(since, &mut t);
            since = (Instant::now(), cpu());
            ready(k, v);
        });
        emulate(since, &mut t);
        // The forward ends before the first bucket, so before any emulated wait.
        t.forward = crate::phases::take_forward_end()
            .map_or(Duration::ZERO, |end| end.saturating_duration_since(start));
        (r, t)
    }
}

/// This thread's time on a CPU so far (Linux's `/proc/thread-self/schedstat`); `None` where
/// that cannot be read.
pub(crate) fn thread_cpu() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// The time a compute on this thread that started at CPU time `cpu` (and took `wall`) worked,
/// for an emulated slower device to wait k − 1 times as long: a device k times slower takes k
/// times the work, not k times the moments the host's scheduler gave the core to another
/// process (on a shared machine those made the emulated device three times as noisy as the
/// others). Its CPU time, where the compute runs on this one thread and that can be read;
/// else `wall`.
pub(crate) fn work_time(wall: Duration, cpu: Option<Duration>) -> Duration {
    if rayon::current_num_threads() > 1 {
        return wall;
    }
    match (cpu, thread_cpu()) {
        (Some(a), Some(b)) if b >= a => (b - a).min(wall),
        _ => wall,
    }
}

/// The tensors of variables grouped by layer, detached (what the hand-written CPU pass reads:
/// no autograd graph is built on them).
pub(super) fn detached(p: &[Vec<candle_core::Var>]) -> Vec<Vec<Tensor>> {
    p.iter()
        .map(|l| l.iter().map(|v| v.as_tensor().detach()).collect())
        .collect()
}

/// A GPT's parameter variables (the whole model's, in flat order) grouped by layer.
pub(super) fn by_layer(
    g: &crate::gpt::Gpt,
    vars: &[candle_core::Var],
) -> Vec<Vec<candle_core::Var>> {
    let mut rest = vars;
    (0..g.planner_layers())
        .map(|l| {
            let n = g.layer_params(l).len().min(rest.len());
            let (this, more) = rest.split_at(n);
            rest = more;
            this.to_vec()
        })
        .collect()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::time::{Duration, Instant};

    use super::{thread_cpu, work_time};

    /// On one compute thread, an emulated device's work is its CPU time: a wait (the scheduler
    /// giving the core away, here a sleep) is not work; spinning is, never more than the wall.
    #[test]
    fn a_wait_is_not_work_and_work_is_at_most_the_wall_time() {
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        one.install(|| {
            let (t, cpu) = (Instant::now(), thread_cpu());
            assert!(cpu.is_some(), "/proc/thread-self/schedstat is read");
            std::thread::sleep(Duration::from_millis(40));
            let waited = work_time(t.elapsed(), cpu);
            assert!(
                waited < Duration::from_millis(20),
                "{waited:?} of a 40 ms sleep"
            );
            let (t, cpu) = (Instant::now(), thread_cpu());
            let mut x = 0u64;
            while t.elapsed() < Duration::from_millis(40) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            let (wall, worked) = (t.elapsed(), work_time(t.elapsed(), cpu));
            assert!(
                worked <= wall && worked > Duration::ZERO,
                "{worked:?} of {wall:?}"
            );
        });
        // Where the compute has several threads, its one thread's CPU time is not its work.
        let two = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        two.install(|| {
            let cpu = thread_cpu();
            let wall = Duration::from_millis(7);
            assert_eq!(work_time(wall, cpu), wall);
        });
    }
}
