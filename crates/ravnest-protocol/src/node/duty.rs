//! A checkpoint shard on its way to the checkpoint's host, part by part, paced by the host's
//! acknowledgements: a shard never sits whole in host memory on the node (each part is made
//! when it may go) nor in the transport's queue (which keeps a part until the peer
//! acknowledges it).
//!
//! At most [`AHEAD`] envelopes to the host are on their way when the next part goes. A host
//! that stops acknowledging (for [`PATIENCE_MS`] without one acknowledged) gets the rest
//! unpaced: the failure detector, not this wait, decides about it; and the node's watch over
//! the coordinator ticks between the node's messages, so this wait stays well under the
//! silence after which the coordinator is suspected.
//!
//! The driver asks [`ShardWriter::next`] with the time and the count of envelopes on their way,
//! sends the part it names, or waits (at most [`ShardWriter::patience_ms`]) for the transport to
//! say the count may have gone down. No clock, no I/O.

use std::ops::Range;

/// Envelopes to the checkpoint's host on their way at once (made, queued or unacknowledged)
/// when a part goes: 4 of [`crate::msg::SHARD_PART`] values, 4 MiB.
pub const AHEAD: usize = 4;

/// How long the writer waits without any part acknowledged before it sends the rest unpaced.
pub const PATIENCE_MS: u64 = 1000;

/// What the writer does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Send these values of the shard.
    Part(Range<usize>),
    /// Wait for an acknowledgement (at most [`ShardWriter::patience_ms`]), then ask again.
    Wait,
    /// Every part went.
    Done,
}

/// A shard of `total` values on its way in parts of `part` values.
#[derive(Debug, Clone)]
pub struct ShardWriter {
    total: usize,
    part: usize,
    offset: usize,
    /// What is left of the patience, in ms.
    patience_ms: u64,
    /// The wait under way: since when, and how many envelopes were on their way then.
    waiting: Option<(u64, usize)>,
}

impl ShardWriter {
    /// A shard of `total` values, in parts of `part` (at least 1).
    pub fn new(total: usize, part: usize) -> Self {
        ShardWriter {
            total,
            part: part.max(1),
            offset: 0,
            patience_ms: PATIENCE_MS,
            waiting: None,
        }
    }

    /// At `now_ms`, with `in_flight` envelopes to the host on their way (`None`: the transport
    /// cannot say, and nothing is paced): the next thing to do. A wait that saw the count go
    /// down gives the full patience back; one that did not spends it.
    pub fn next(&mut self, now_ms: u64, in_flight: Option<usize>) -> Next {
        if self.offset >= self.total {
            return Next::Done;
        }
        if let (Some((since, seen)), Some(n)) = (self.waiting.take(), in_flight) {
            self.patience_ms = if n < seen {
                PATIENCE_MS
            } else {
                self.patience_ms
                    .saturating_sub(now_ms.saturating_sub(since))
            };
        }
        match in_flight {
            Some(n) if n > AHEAD && self.patience_ms > 0 => {
                self.waiting = Some((now_ms, n));
                Next::Wait
            }
            _ => {
                let end = (self.offset + self.part).min(self.total);
                let r = self.offset..end;
                self.offset = end;
                Next::Part(r)
            }
        }
    }

    /// How long a wait may last now, in ms.
    pub fn patience_ms(&self) -> u64 {
        self.patience_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parts_go_while_few_are_on_their_way_and_cover_the_shard() {
        let mut w = ShardWriter::new(10, 4);
        assert_eq!(w.next(0, Some(0)), Next::Part(0..4));
        assert_eq!(w.next(0, Some(AHEAD)), Next::Part(4..8));
        assert_eq!(w.next(0, Some(AHEAD + 1)), Next::Wait);
        // Acknowledged: the next part goes, and the patience is whole again.
        assert_eq!(w.next(300, Some(AHEAD)), Next::Part(8..10));
        assert_eq!(w.patience_ms(), PATIENCE_MS);
        assert_eq!(w.next(300, Some(9)), Next::Done);
        // A transport that cannot count paces nothing.
        let mut w = ShardWriter::new(3, 1);
        for k in 0..3 {
            assert_eq!(w.next(0, None), Next::Part(k..k + 1));
        }
    }

    #[test]
    fn a_host_that_stops_acknowledging_gets_the_rest_after_the_patience() {
        let mut w = ShardWriter::new(4, 1);
        assert_eq!(w.next(0, Some(9)), Next::Wait);
        assert_eq!(w.next(600, Some(9)), Next::Wait, "400 ms of patience left");
        assert_eq!(w.patience_ms(), 400);
        // A wait that saw no acknowledgement spends the rest: the parts then go unpaced.
        assert_eq!(w.next(1000, Some(9)), Next::Part(0..1));
        assert_eq!(w.next(1000, Some(10)), Next::Part(1..2));
        assert_eq!(w.patience_ms(), 0);
    }

    proptest! {
        /// Whatever the counts and times: the parts cover the shard once, in order; a part
        /// goes only with at most AHEAD on their way, or once PATIENCE_MS of waits went by
        /// without the count going down; a wait happens only while patience is left.
        #[test]
        fn the_parts_cover_the_shard_and_respect_the_pacing(
            total in 0usize..40,
            part in 1usize..9,
            counts in proptest::collection::vec((0usize..9, 0u64..700), 1..60),
        ) {
            let mut w = ShardWriter::new(total, part);
            let (mut covered, mut now, mut spent) = (0, 0u64, 0u64);
            let mut wait: Option<(u64, usize)> = None;
            for (n, dt) in counts.iter().copied().cycle().take(400) {
                now += dt;
                if let Some((since, seen)) = wait.take() {
                    spent = if n < seen { 0 } else { spent + (now - since) };
                }
                match w.next(now, Some(n)) {
                    Next::Done => break,
                    Next::Wait => {
                        prop_assert!(n > AHEAD && spent < PATIENCE_MS);
                        wait = Some((now, n));
                    }
                    Next::Part(r) => {
                        prop_assert_eq!(r.start, covered);
                        prop_assert!(r.end > r.start && r.end - r.start <= part);
                        prop_assert!(n <= AHEAD || spent >= PATIENCE_MS);
                        covered = r.end;
                    }
                }
            }
            prop_assert!(covered <= total);
            if covered == total {
                prop_assert_eq!(w.next(now, Some(0)), Next::Done);
            }
        }
    }
}
