//! The one stall rule: a watcher that ticks at least every `limit` ms and sees a longer gap
//! between two of its ticks was itself stalled (frozen, swapped out, a busy machine), so that
//! gap is nobody's silence: the time it last heard from what it watches moves later by it.
//! The failure detector, each node's watch over the coordinator and a worker's process watch
//! all follow it, each with its own limit.

/// A watcher's clock of its own stalls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StallClock {
    /// A gap longer than this is a stall; `None`: no gap is (every gap counts as silence).
    limit_ms: Option<u64>,
    last_tick_ms: Option<u64>,
}

impl StallClock {
    /// A clock that counts gaps over `limit_ms` as stalls (`None`: none), started at its first
    /// tick.
    pub fn new(limit_ms: Option<u64>) -> StallClock {
        StallClock {
            limit_ms,
            last_tick_ms: None,
        }
    }

    /// Start the clock at `now_ms` if no tick started it yet: a stall between then and the
    /// first tick counts too.
    pub fn start(&mut self, now_ms: u64) {
        self.last_tick_ms.get_or_insert(now_ms);
    }

    /// A tick at `now_ms`: how long the watcher was stalled since its last tick (the whole
    /// gap when it is over the limit, else 0).
    pub fn tick(&mut self, now_ms: u64) -> u64 {
        let gap = self
            .last_tick_ms
            .replace(now_ms)
            .map_or(0, |t| now_ms.saturating_sub(t));
        if self.limit_ms.is_some_and(|limit| gap > limit) {
            gap
        } else {
            0
        }
    }
}

/// When something was last heard from, as the stall rule counts it: `heard_ms` moved later by
/// the watcher's own `stalled_ms`, never past `now_ms`.
pub fn credited(heard_ms: u64, stalled_ms: u64, now_ms: u64) -> u64 {
    if stalled_ms == 0 {
        heard_ms
    } else {
        (heard_ms + stalled_ms).min(now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_over_the_limit_is_a_stall_and_moves_the_last_word_later() {
        let mut c = StallClock::new(Some(100));
        assert_eq!(c.tick(1000), 0, "the first tick starts the clock");
        assert_eq!(c.tick(1090), 0);
        assert_eq!(c.tick(1500), 410);
        assert_eq!(credited(1000, 410, 1500), 1410);
        assert_eq!(credited(1200, 410, 1500), 1500, "never past now");
        assert_eq!(credited(1000, 0, 1500), 1000);
        let mut never = StallClock::new(None);
        never.tick(0);
        assert_eq!(never.tick(1_000_000), 0);
        let mut started = StallClock::new(Some(100));
        started.start(0);
        started.start(50);
        assert_eq!(
            started.tick(5000),
            5000,
            "a stall before the first tick counts"
        );
    }
}
