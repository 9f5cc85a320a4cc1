//! The flat model's layout: the network's tensors, where each sits in the flat form
//! (`[params | optimizer state | step count]`), and which ranges a layer range's shard is. Pure:
//! the backend's state ([`crate::state`]), its compute and the checkpoint store read it alike.

use std::ops::Range;

use ravnest_core::LayerRange;

use crate::net::Network;
use crate::optim::Optim;

/// One tensor of the network in the flat form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset of its parameters in the flat form.
    pub offset: usize,
    /// Elements.
    pub len: usize,
    /// The planner layer it belongs to (`None`: a network that is not split by layer).
    pub layer: Option<usize>,
}

/// The network's tensors and the flat form's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Every tensor, in flat order.
    pub tensors: Vec<TensorMeta>,
    /// Parameters in all.
    pub params: usize,
    /// Optimizer state tensors per parameter tensor.
    pub states: usize,
    /// Whether AdamW's step count ends the flat form.
    pub step_count: bool,
}

impl Layout {
    /// The layout of `net` trained with `optim`.
    pub fn of(net: &Network, optim: &Optim) -> Layout {
        let layer_of: Vec<Option<usize>> = match net {
            Network::Gpt(g) => (0..g.planner_layers())
                .flat_map(|l| std::iter::repeat_n(Some(l), g.layer_params(l).len()))
                .collect(),
            _ => Vec::new(),
        };
        let tensors: Vec<TensorMeta> = net
            .layout()
            .into_iter()
            .enumerate()
            .map(|(i, p)| TensorMeta {
                len: p.len(),
                name: p.name,
                shape: p.shape,
                offset: p.offset,
                layer: layer_of.get(i).copied().flatten(),
            })
            .collect();
        let params = tensors.iter().map(|t| t.len).sum();
        let states = optim.state_names().len();
        Layout {
            step_count: optim.state_len(params) > states * params,
            tensors,
            params,
            states,
        }
    }

    /// Values of the flat form.
    pub fn model_len(&self) -> usize {
        self.params * (1 + self.states) + usize::from(self.step_count)
    }

    /// Whether tensors belong to layers (a network that runs pipeline stages).
    pub fn layered(&self) -> bool {
        self.tensors.first().is_some_and(|t| t.layer.is_some())
    }

    /// The tensors of `layers` (`None`, or a network not split by layer: all of them); `None`
    /// when `layers` is not a range of the network's layers.
    pub fn indices(&self, layers: Option<LayerRange>) -> Option<Range<usize>> {
        let Some(l) = layers.filter(|_| self.layered()) else {
            return Some(0..self.tensors.len());
        };
        let r = l.range();
        let first = self.tensors.iter().position(|t| t.layer == Some(r.start))?;
        let end = self
            .tensors
            .iter()
            .rposition(|t| t.layer.is_some_and(|x| x + 1 == r.end))?
            + 1;
        (r.start < r.end && first < end).then_some(first..end)
    }

    /// Where the parameters of tensors `idx` sit in the flat form.
    pub fn param_range(&self, idx: &Range<usize>) -> Range<usize> {
        match (self.tensors.get(idx.start), idx.end.checked_sub(1)) {
            (Some(a), Some(z)) if idx.start < idx.end && z < self.tensors.len() => {
                let z = &self.tensors[z];
                a.offset..z.offset + z.len
            }
            _ => 0..0,
        }
    }

    /// The flat form's ranges that `layers` export, in export order: their parameters, the
    /// same range of each state tensor, then the step count.
    pub fn slots(&self, layers: Option<LayerRange>) -> Option<Vec<Range<usize>>> {
        let idx = self.indices(layers)?;
        if idx == (0..self.tensors.len()) {
            return Some(std::iter::once(0..self.model_len()).collect());
        }
        let r = self.param_range(&idx);
        let p = self.params;
        let mut out: Vec<Range<usize>> = (0..=self.states)
            .map(|k| k * p + r.start..k * p + r.end)
            .collect();
        if self.step_count {
            let t = (1 + self.states) * p;
            out.push(t..t + 1);
        }
        Some(out)
    }
}

/// The parts of the flat model (`[params | optimizer state | step count]`) that belong to
/// `layers`, in the order a shard of them travels: for the GPT, the layers' parameters, each of
/// their state tensors, and AdamW's step count; other networks are one slice. An empty range
/// past the end when `layers` are not the network's.
pub fn layer_slots(net: &Network, optim: &Optim, layers: LayerRange) -> Vec<Range<usize>> {
    let layout = Layout::of(net, optim);
    let len = layout.model_len();
    layout
        .slots(Some(layers))
        .unwrap_or_else(|| std::iter::once(len + 1..len + 1).collect())
}
