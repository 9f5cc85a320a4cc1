//! The node's epoch rules, pure: when a new epoch waits for the running one to reach its first
//! step, when it starts, and which step an epoch lets a node run. [`super::core::NodeCore`]
//! decides by them.

use crate::msg::Work;

/// Whether a node that runs `current` (headed for version `headed`: the one it fetches, else
/// the newest it holds) finishes the running epoch's steps below `next`'s first step before it
/// switches (`true`: `next` is queued), rather than switching now (a halted node, one whose
/// grant stops short of `next`, or one already at or past its start).
pub fn queues(current: Option<&Work>, halted: bool, headed: Option<u64>, next: &Work) -> bool {
    !halted
        && current.is_some_and(|c| c.until >= next.step)
        && headed.is_some_and(|l| l < next.step)
}

/// Whether a queued epoch starts now: the node holds the version of its first step.
pub fn starts(next: &Work, latest: u64) -> bool {
    next.step <= latest
}

/// Whether the epoch `w` lets a node holding version `latest` run step `latest`: at or past
/// the epoch's first step, below its grant and below the epoch's end.
pub fn runs(w: &Work, latest: u64) -> bool {
    latest >= w.step && latest < w.until.min(w.end)
}
