//! Where a step's compute goes: the hand-written passes mark the end of their forward pass on
//! the thread that computes, and the backend reads the mark after the step to split its
//! compute time into forward and backward (the report's per-phase profile). A measurement
//! only: nothing decides on it.

use std::cell::Cell;
use std::time::Instant;

thread_local! {
    static FORWARD_END: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The forward pass of the step on this thread ends now.
pub fn forward_done() {
    FORWARD_END.with(|c| c.set(Some(Instant::now())));
}

/// The mark [`forward_done`] left on this thread since the last call, taken.
pub fn take_forward_end() -> Option<Instant> {
    FORWARD_END.with(Cell::take)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_is_taken_once_and_per_thread() {
        assert_eq!(take_forward_end(), None);
        forward_done();
        std::thread::spawn(|| assert_eq!(take_forward_end(), None))
            .join()
            .unwrap();
        assert!(take_forward_end().is_some());
        assert_eq!(take_forward_end(), None);
    }
}
