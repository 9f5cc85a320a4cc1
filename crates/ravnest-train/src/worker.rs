//! The compute thread: one per backend, started on first use, running CPU-bound jobs (candle's
//! forward and backward) one at a time, at a lower CPU priority than the rest of the process.
//!
//! Why a thread of its own, at a lower priority: a synchronous step ends with an all-reduce in
//! which every node forwards its peers' pieces. A node that finished early starts its next
//! step's compute at once; if that compute shared a priority with its network threads (or with
//! the network threads of the other processes on the same cores), the peers' pieces would wait
//! a scheduler time slice at every hop. Measured on the embedded default (3 processes on 2
//! cores): most of a step's waiting was that.

use std::sync::Mutex;
use std::sync::mpsc::{Sender, channel};

type Task = Box<dyn FnOnce() + Send>;

thread_local! {
    /// Set on a compute thread.
    static ON_COMPUTE_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Niceness of the compute thread (0 is normal, 19 the lowest priority). Lowering one's own
/// priority needs no privilege.
pub const COMPUTE_NICE: i32 = 10;

/// A lazily started compute thread.
#[derive(Debug, Default)]
pub struct ComputeThread {
    tx: Mutex<Option<Sender<Task>>>,
}

impl ComputeThread {
    fn sender(&self) -> Option<Sender<Task>> {
        let mut tx = self.tx.lock().unwrap();
        if tx.is_none() {
            let (send, recv) = channel::<Task>();
            let spawned = std::thread::Builder::new()
                .name("ravnest-compute".into())
                .spawn(move || {
                    lower_priority();
                    ON_COMPUTE_THREAD.with(|c| c.set(true));
                    while let Ok(task) = recv.recv() {
                        task();
                    }
                });
            if spawned.is_ok() {
                *tx = Some(send);
            }
        }
        tx.clone()
    }

    /// Run `f` on the compute thread and wait for it here, blocking (`f` runs here when this
    /// is the compute thread). For short work that should allocate where the compute does
    /// (the optimizer's new state: one thread's allocator then reuses what the last step
    /// freed). `None` if the thread is gone.
    pub fn run_here<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
        if ON_COMPUTE_THREAD.with(|c| c.get()) {
            return Some(f());
        }
        let (done, result) = std::sync::mpsc::channel();
        let task: Task = Box::new(move || {
            let _ = done.send(f());
        });
        self.sender()?.send(task).ok()?;
        result.recv().ok()
    }

    /// Run `f` on the compute thread and wait for its result without blocking the runtime;
    /// `None` if the thread is gone (it panicked).
    pub async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Option<R> {
        let (done, result) = tokio::sync::oneshot::channel();
        let task: Task = Box::new(move || {
            let _ = done.send(f());
        });
        self.sender()?.send(task).ok()?;
        result.await.ok()
    }
}

#[cfg(target_os = "linux")]
fn lower_priority() {
    // Linux keeps a nice value per thread: this one only. Failure leaves the default.
    let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), COMPUTE_NICE);
}

#[cfg(not(target_os = "linux"))]
fn lower_priority() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_jobs_in_order_off_the_caller() {
        let w = ComputeThread::default();
        let me = std::thread::current().id();
        let (a, other) = w
            .run(move || (1 + 2, std::thread::current().id() != me))
            .await
            .unwrap();
        assert_eq!(a, 3);
        assert!(other, "ran on the compute thread");
        assert_eq!(w.run(|| "again").await, Some("again"));
    }
}
