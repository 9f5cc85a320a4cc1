//! Membership: nodes that join (a restart, or a new node given its id by the coordinator's
//! host), and nodes that ask to leave.

use super::{Coordinator, Envelope, Event, NodeId, configured};
impl Coordinator {
    pub(super) fn on_join(&mut self, node: NodeId) {
        self.emit(Event::Joined { node });
        self.initial.remove(&node);
        if self.involved().contains(&node) {
            // A worker that restarted has lost its state: the epoch cannot go on as planned.
            return self.lost_worker(node);
        }
        self.joiners.insert(node);
        if let Some(w) = &mut self.waiting {
            // Whatever it held may be stale or gone: it fetches the version like a joiner.
            w.holders.remove(&node);
            return self.stop_waiting();
        }
        self.admit_joiners();
    }

    /// The coordinator's host gave a node not in the cluster file the next id (`run --join`
    /// with a new name; [`Envelope::Reserve`]): it becomes node `id`, like the file's first
    /// node until it registers what it measured, and every node is told (`Member`), so that
    /// every process numbers the nodes alike. An id out of order, or a name already taken,
    /// is ignored.
    pub(super) fn reserve(&mut self, id: NodeId, name: &str, address: &str) {
        let taken = name.is_empty() || self.cfg.cluster.nodes.iter().any(|n| n.name == name);
        if taken || id.index() != self.cfg.cluster.nodes.len() {
            return;
        }
        let Some(like) = self.cfg.cluster.nodes.first().cloned() else {
            return;
        };
        self.cfg.cluster.nodes.push(ravnest_core::NodeSpec {
            name: name.to_string(),
            step_overhead_s: 0.0,
            address: Some(address.to_string()),
            listen: None,
            ..like
        });
        self.reserved.insert(id);
        self.assumed.insert(id, configured(&self.cfg, id));
        self.plan_cache = None;
        let member = Envelope::Member {
            id,
            name: name.to_string(),
            address: address.to_string(),
        };
        for n in self.detector.alive() {
            self.send(n, member.clone());
        }
        self.replicate(true);
    }

    /// A node given an id ([`Self::reserve`]) registers: it is watched from now on, with the
    /// speed and memory it measured (measurements correct the speed once it works). Its `Join`
    /// follows and makes it a joiner: it gets work at the next epoch.
    pub(super) fn admit(&mut self, now_ms: u64, id: NodeId, caps: &crate::msg::Capabilities) {
        let valid = caps.flops.is_finite() && caps.flops > 0.0 && caps.memory_bytes > 0;
        let Some(spec) = self.cfg.cluster.nodes.get_mut(id.index()) else {
            return;
        };
        if !valid || spec.name != caps.name {
            return;
        }
        spec.device = caps
            .device
            .split_whitespace()
            .next()
            .unwrap_or("cpu")
            .to_string();
        spec.memory_bytes = caps.memory_bytes;
        spec.flops = caps.flops;
        self.reserved.remove(&id);
        self.assumed.insert(id, configured(&self.cfg, id));
        self.plan_cache = None;
        self.detector.watch(id, now_ms);
        self.emit(Event::Admitted {
            node: id,
            name: caps.name.clone(),
            device: caps.device.clone(),
        });
        self.replicate(true);
    }

    /// A node asks to leave (Ctrl-C on its process): no halt, no loss. It is planned out at the
    /// next boundary no node has passed (a switch, as for a joiner), keeps running the steps of
    /// the epochs that still count on it, and is told to stop once none does.
    pub(super) fn on_leave(&mut self, node: NodeId) {
        if !self.leaving.insert(node) {
            return;
        }
        self.emit(Event::Leaving { node });
        self.joiners.remove(&node);
        self.retire_leavers();
        self.release_leavers();
    }

    /// Switch to an epoch without the leavers, when one still counts on them and no other change
    /// is pending.
    pub(super) fn release_leavers(&mut self) {
        if self.halting.is_some() || self.eras.len() != 1 {
            return;
        }
        let involved = self.involved();
        if self.leaving.iter().any(|n| involved.contains(n)) {
            self.switch();
        }
    }

    /// Leavers no running epoch counts on any more: told to stop, no longer watched.
    pub(super) fn retire_leavers(&mut self) {
        if self.halting.is_some() {
            return;
        }
        let involved = self.involved();
        let done: Vec<NodeId> = self
            .leaving
            .iter()
            .copied()
            .filter(|n| !involved.contains(n))
            .collect();
        for node in done {
            self.leaving.remove(&node);
            self.detector.unwatch(node);
            self.initial.remove(&node);
            self.left_out.remove(&node);
            self.send(node, Envelope::Finish);
            self.departed.insert(node);
            self.emit(Event::Left { node });
        }
    }

    /// Joined nodes take part from the next boundary no node has passed, once no other change
    /// is pending (one switch at a time: every node then has at most one epoch waiting).
    pub(super) fn admit_joiners(&mut self) {
        if self.halting.is_some() || self.eras.len() != 1 || self.joiners.is_empty() {
            return;
        }
        self.joiners.clear();
        self.switch();
    }
}
