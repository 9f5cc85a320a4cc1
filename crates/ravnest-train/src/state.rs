//! What a node holds of the model, on its device: per tensor, the parameters (a candle `Var`)
//! and their optimizer state, made where they are first used.
//!
//! A [`CandleModel`] is one version of what a node holds: a map from tensor index to a shared
//! [`Cell`], and AdamW's step count. Versions share the cells they have in common; an update
//! replaces a tensor's cell in the version it is applied to and leaves every other version as
//! it was, so keeping a version never copies it and a tensor no version holds any more is freed
//! at once. A cell starts from a [`Source`] (the seeded initial weights, a flat model that
//! travelled, or a checkpoint on disk) and is made into device tensors the first time a step
//! uses it: a stage builds only its layers, and a node that serves layers it does not run (a
//! resumed checkpoint, a restored one) reads them from the source without ever building them.
//!
//! The flat form (the wire's and the checkpoints'): parameters of every tensor in layout order,
//! then each optimizer state tensor in the same order, then AdamW's step count. A stage's part
//! is its layers' ranges of each ([`Layout::slots`]), the step count included, so a stage
//! fetched by a node that does not start at layer 0 gets the step count it needs.
//!
//! What the state costs is counted as it happens ([`StateCounter`]): every slot adds its bytes
//! when it is made and takes them back when it is dropped, and a stage's gradient accumulator
//! does the same, so `held_state_mib` is a measurement, not a formula.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{Device, Storage, Tensor, Var};
use ravnest_core::LayerRange;
use ravnest_protocol::node::values::ComputeError;
use ravnest_runtime::seams::StateStats;

pub use crate::layout::{Layout, TensorMeta};
use crate::net::Network;
use crate::optim::Optim;

mod kernels;
pub use kernels::optimizer_step_on;
use kernels::*;

/// Bytes of model state alive, the most at once, and bytes copied by step work.
#[derive(Debug, Default)]
pub struct StateCounter {
    held: AtomicU64,
    peak: AtomicU64,
    copied: AtomicU64,
}

impl StateCounter {
    fn add(&self, bytes: u64) {
        let now = self.held.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Count `bytes` of model state copied by step work.
    pub fn copied(&self, bytes: u64) {
        self.copied.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The figures so far.
    pub fn stats(&self) -> StateStats {
        StateStats {
            held_bytes: self.held.load(Ordering::Relaxed),
            peak_bytes: self.peak.load(Ordering::Relaxed),
            copied_bytes: self.copied.load(Ordering::Relaxed),
        }
    }
}

/// Bytes held while this lives (a gradient accumulator, a slot).
#[derive(Debug)]
pub struct Held {
    bytes: u64,
    counter: Arc<StateCounter>,
}

impl Held {
    /// Count `bytes` as held until this is dropped.
    pub fn new(counter: &Arc<StateCounter>, bytes: u64) -> Held {
        counter.add(bytes);
        Held {
            bytes,
            counter: counter.clone(),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.counter.sub(self.bytes);
    }
}

/// One tensor, made: its parameters and its optimizer state, on the device.
#[derive(Debug)]
pub struct Slot {
    /// The parameters (an autograd variable: backward gives their gradient).
    pub param: Var,
    /// The optimizer state tensors ([`Optim::state_names`]).
    pub state: Vec<Tensor>,
    _held: Held,
}

/// Where a tensor's values come from until it is made.
#[derive(Debug, Clone)]
pub enum Source {
    /// The seeded initial weights; optimizer state zero.
    Seeded,
    /// A whole flat model in host memory (a restored checkpoint, a fetched whole model).
    Flat(Arc<Vec<f32>>),
    /// A checkpoint on disk, read tensor by tensor.
    Checkpoint(Arc<crate::store::CheckpointReader>),
}

/// A tensor of one or more versions: made, or still at its source.
#[derive(Debug)]
pub struct Cell {
    ready: OnceLock<Arc<Slot>>,
    source: Mutex<Option<Source>>,
    /// Only the parameters are held, not the optimizer state (another sharded worker's
    /// part).
    bare: bool,
}

impl Cell {
    fn at(source: Source) -> Arc<Cell> {
        Arc::new(Cell {
            ready: OnceLock::new(),
            source: Mutex::new(Some(source)),
            bare: false,
        })
    }

    fn made(slot: Slot) -> Arc<Cell> {
        let ready = OnceLock::new();
        let bare = slot.state.is_empty();
        let _ = ready.set(Arc::new(slot));
        Arc::new(Cell {
            ready,
            source: Mutex::new(None),
            bare,
        })
    }
}

/// One version of what a node holds ([`crate::compute::CandleCompute`]'s model).
#[derive(Debug, Clone)]
pub struct CandleModel {
    cells: BTreeMap<usize, Arc<Cell>>,
    /// AdamW's step count (steps applied so far).
    t: f32,
}

impl CandleModel {
    /// Tensors held (indices into [`Layout::tensors`]).
    pub fn tensors(&self) -> impl Iterator<Item = usize> + '_ {
        self.cells.keys().copied()
    }

    /// The optimizer's step count.
    pub fn step_count(&self) -> f32 {
        self.t
    }
}

/// Run `f` on a tensor's values: in place on the CPU, else (a GPU) through a host copy, which
/// is counted in `copied` when given.
fn with_values<R>(
    t: &Tensor,
    copied: Option<&StateCounter>,
    f: impl FnOnce(&[f32]) -> R,
) -> Result<R, ComputeError> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets())
            && let Ok(all) = cpu.as_slice::<f32>()
        {
            return Ok(f(&all[a..b]));
        }
    }
    let v: Vec<f32> = t
        .flatten_all()
        .and_then(|x| x.to_vec1())
        .map_err(|e| ComputeError::Backend(format!("reading a tensor: {e}")))?;
    if let Some(c) = copied {
        c.copied(4 * v.len() as u64);
    }
    Ok(f(&v))
}

/// Run `f` on a tensor's values (in place on the CPU, through a host copy elsewhere).
pub fn read<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R, ComputeError> {
    with_values(t, None, f)
}

fn backend(what: &str) -> impl Fn(candle_core::Error) -> ComputeError + '_ {
    move |e| ComputeError::Backend(format!("{what}: {e}"))
}

/// The model state of one backend: its layout, where tensors are made, and the counts.
#[derive(Debug)]
pub struct ModelState {
    /// The network.
    pub net: Network,
    /// The optimizer.
    pub optim: Optim,
    /// The flat form.
    pub layout: Layout,
    /// Seed of the initial weights.
    pub seed: u64,
    /// Bytes held and copied.
    pub counter: Arc<StateCounter>,
    /// A network that is not split by layer draws its initial weights in one stream.
    whole_init: OnceLock<Arc<Vec<f32>>>,
    /// The initial weights are a Hugging Face folder's (`[model] from`), read tensor by
    /// tensor as the node makes them; else the seeded ones.
    pub pretrained: Option<Arc<crate::folder::HfFolder>>,
    /// Buffers of a retired version, by tensor, for the running step's update to write into.
    spare: Mutex<BTreeMap<usize, Slot>>,
}

/// A gradient for [`ModelState::update`]: host values, or a tensor where the model is.
#[derive(Debug, Clone, Copy)]
pub enum Grad<'a> {
    /// Host values (an all-reduced bucket).
    Host(&'a [f32]),
    /// A tensor on the device (a stage's own gradient).
    Device(&'a Tensor),
}

impl ModelState {
    /// The state of `net` trained with `optim` from `seed`.
    pub fn new(net: Network, optim: Optim, seed: u64) -> ModelState {
        ModelState {
            layout: Layout::of(&net, &optim),
            net,
            optim,
            seed,
            counter: Arc::default(),
            whole_init: OnceLock::new(),
            pretrained: None,
            spare: Mutex::default(),
        }
    }

    /// A model holding `layers` (`None`: all), each tensor still at `source`, `t` steps in.
    pub fn at_source(&self, layers: Option<LayerRange>, source: &Source, t: f32) -> CandleModel {
        let idx = self.layout.indices(layers).unwrap_or(0..0);
        CandleModel {
            cells: idx.map(|i| (i, Cell::at(source.clone()))).collect(),
            t,
        }
    }

    /// A model holding nothing.
    pub fn empty(&self) -> CandleModel {
        CandleModel {
            cells: BTreeMap::new(),
            t: 0.0,
        }
    }

    /// `model` keeping only the tensors of `layers`.
    pub fn retain(&self, model: &CandleModel, layers: LayerRange) -> CandleModel {
        let Some(idx) = self.layout.indices(Some(layers)) else {
            return model.clone();
        };
        CandleModel {
            cells: model
                .cells
                .range(idx)
                .map(|(k, c)| (*k, c.clone()))
                .collect(),
            t: model.t,
        }
    }

    /// Sharded data parallel: `model` keeping the optimizer state of `owned`'s tensors only
    /// (every parameter stays, shared with `model`; nothing is copied).
    pub fn shard(&self, model: &CandleModel, owned: LayerRange) -> CandleModel {
        let own = self.layout.indices(Some(owned)).unwrap_or(0..0);
        let cells = model
            .cells
            .iter()
            .map(|(&i, c)| {
                if own.contains(&i) || c.bare {
                    return (i, c.clone());
                }
                let bare = match c.ready.get() {
                    Some(s) => Cell {
                        ready: OnceLock::from(Arc::new(Slot {
                            param: s.param.clone(),
                            state: Vec::new(),
                            _held: Held::new(&self.counter, 4 * s.param.elem_count() as u64),
                        })),
                        source: Mutex::new(None),
                        bare: true,
                    },
                    None => Cell {
                        ready: OnceLock::new(),
                        source: Mutex::new(c.source.lock().unwrap().clone()),
                        bare: true,
                    },
                };
                (i, Arc::new(bare))
            })
            .collect();
        CandleModel { cells, t: model.t }
    }

    /// Set the parameters `range` (whole tensors) of `model` from `values` (an all-gather's):
    /// new tensors in `model` (other versions keep theirs), each keeping its optimizer state
    /// where it has one.
    pub fn set_params(
        &self,
        model: &mut CandleModel,
        range: Range<usize>,
        values: &[f32],
        dev: &Device,
    ) -> Result<(), ComputeError> {
        self.each_tensor_in(range, values, "values", |i, v| {
            let m = &self.layout.tensors[i];
            let old = self.get(model, i, dev)?;
            // No other version shares this tensor: its values are written over, where they are.
            let alone = model
                .cells
                .get(&i)
                .is_some_and(|c| Arc::strong_count(c) == 1)
                && Arc::strong_count(&old) == 2;
            if alone && write_over(old.param.as_tensor(), v) {
                return Ok(());
            }
            let state = old.state.clone();
            drop(old);
            let param =
                Var::from_slice(v, m.shape.as_slice(), dev).map_err(backend("making a tensor"))?;
            model.cells.insert(i, Cell::made(self.made(param, state)?));
            Ok(())
        })
    }

    /// Call `f(i, its values)` for each tensor `i` whose parameters lie in `range`, its values
    /// cut from `values` (one per parameter of `range`, `what` they are, for messages); an
    /// error when their count is not the range's or `range` is not a run of whole tensors.
    fn each_tensor_in(
        &self,
        range: Range<usize>,
        values: &[f32],
        what: &str,
        mut f: impl FnMut(usize, &[f32]) -> Result<(), ComputeError>,
    ) -> Result<(), ComputeError> {
        if values.len() != range.len() {
            return Err(ComputeError::Shape(format!(
                "{} {what} for parameters {range:?}",
                values.len()
            )));
        }
        let mut covered = 0;
        for (i, m) in self.layout.tensors.iter().enumerate() {
            if m.offset < range.start || m.offset + m.len > range.end {
                continue;
            }
            f(
                i,
                &values[m.offset - range.start..m.offset - range.start + m.len],
            )?;
            covered += m.len;
        }
        if covered != range.len() {
            return Err(ComputeError::Shape(format!(
                "parameters {range:?} are not whole tensors"
            )));
        }
        Ok(())
    }

    /// Tensor `i`'s initial weights: the pretrained folder's, or the seeded ones.
    fn seeded(&self, i: usize) -> Result<Vec<f32>, ComputeError> {
        let m = &self.layout.tensors[i];
        if let Some(f) = &self.pretrained {
            return f.tensor(&m.name, m.len);
        }
        if let Network::Gpt(g) = &self.net {
            return Ok(g.init_tensor(self.seed, i));
        }
        let all = self
            .whole_init
            .get_or_init(|| Arc::new(self.net.init(self.seed)));
        Ok(all[m.offset..m.offset + m.len].to_vec())
    }

    /// Tensor `i`'s values at `source`: (parameters, each state tensor).
    fn values_at(
        &self,
        source: &Source,
        i: usize,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), ComputeError> {
        let m = &self.layout.tensors[i];
        let p = self.layout.params;
        match source {
            // Each state tensor its own zeroed allocation (`vec![v; k]` would clone one, and so
            // write every page of all but the first): untouched pages cost no memory until the
            // optimizer writes them.
            Source::Seeded => Ok((
                self.seeded(i)?,
                (0..self.layout.states).map(|_| vec![0.0; m.len]).collect(),
            )),
            Source::Flat(flat) => {
                let at = |k: usize| flat.get(k * p + m.offset..k * p + m.offset + m.len);
                let param = at(0).ok_or_else(|| {
                    ComputeError::Shape(format!(
                        "a flat model of {} values lacks `{}`",
                        flat.len(),
                        m.name
                    ))
                })?;
                let state = (1..=self.layout.states)
                    .map(|k| at(k).map(<[f32]>::to_vec).unwrap_or_default())
                    .collect();
                Ok((param.to_vec(), state))
            }
            Source::Checkpoint(r) => {
                let names = self.optim.state_names();
                let param = r.tensor(&m.name, m.len)?;
                let state = names
                    .iter()
                    .map(|s| r.tensor(&format!("{s}.{}", m.name), m.len))
                    .collect::<Result<_, _>>()?;
                Ok((param, state))
            }
        }
    }

    /// A slot made from values, counted.
    fn slot(
        &self,
        i: usize,
        param: Vec<f32>,
        state: Vec<Vec<f32>>,
        dev: &Device,
    ) -> Result<Slot, ComputeError> {
        let m = &self.layout.tensors[i];
        let shape = m.shape.as_slice();
        let param = Var::from_vec(param, shape, dev).map_err(backend("making a tensor"))?;
        let state = state
            .into_iter()
            .map(|s| Tensor::from_vec(s, shape, dev))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(backend("making a tensor"))?;
        self.made(param, state)
    }

    fn made(&self, param: Var, state: Vec<Tensor>) -> Result<Slot, ComputeError> {
        let bytes = 4 * param.elem_count() as u64 * (1 + state.len() as u64);
        Ok(Slot {
            param,
            state,
            _held: Held::new(&self.counter, bytes),
        })
    }

    /// Tensor `i` of `model`, made on `dev` if it was still at its source.
    pub fn get(
        &self,
        model: &CandleModel,
        i: usize,
        dev: &Device,
    ) -> Result<Arc<Slot>, ComputeError> {
        let cell = model.cells.get(&i).ok_or_else(|| {
            ComputeError::Shape(format!(
                "this node does not hold `{}`",
                self.layout.tensors.get(i).map_or("?", |t| t.name.as_str())
            ))
        })?;
        if let Some(s) = cell.ready.get() {
            return Ok(s.clone());
        }
        let mut source = cell.source.lock().unwrap();
        if let Some(s) = cell.ready.get() {
            return Ok(s.clone());
        }
        let src = source
            .clone()
            .ok_or_else(|| ComputeError::Backend("a tensor without values".into()))?;
        let (param, mut state) = self.values_at(&src, i)?;
        if cell.bare {
            state.clear();
        }
        let slot = Arc::new(self.slot(i, param, state, dev)?);
        let _ = cell.ready.set(slot.clone());
        // Made: the source (maybe a whole model in host memory) is not needed any more.
        *source = None;
        Ok(slot)
    }

    /// The parameter variables of tensors `idx` of `model`, made on `dev`.
    pub fn vars(
        &self,
        model: &CandleModel,
        idx: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Var>, ComputeError> {
        idx.map(|i| self.get(model, i, dev).map(|s| s.param.clone()))
            .collect()
    }

    /// Call `f(k, values)` for each part of tensor `i` in flat order (k = 0: parameters, then
    /// each state tensor), without making it where it is still at its source.
    fn each_part(
        &self,
        model: &CandleModel,
        i: usize,
        part: usize,
        copied: Option<&StateCounter>,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ComputeError> {
        let cell = model
            .cells
            .get(&i)
            .ok_or_else(|| ComputeError::Shape("a tensor this node does not hold".into()))?;
        if part > 0 && cell.bare {
            return Err(ComputeError::Shape(format!(
                "this node does not hold the optimizer state of `{}`",
                self.layout.tensors[i].name
            )));
        }
        if let Some(s) = cell.ready.get() {
            let t = if part == 0 {
                s.param.as_tensor()
            } else {
                s.state.get(part - 1).ok_or_else(|| {
                    ComputeError::Shape("optimizer state this node does not hold".into())
                })?
            };
            return with_values(t, copied, |v| f(v));
        }
        let src = cell.source.lock().unwrap().clone();
        match src {
            Some(src) => {
                let (param, state) = self.values_at(&src, i)?;
                f(if part == 0 { &param } else { &state[part - 1] });
                Ok(())
            }
            None => match cell.ready.get() {
                Some(_) => self.each_part(model, i, part, copied, f),
                None => Err(ComputeError::Backend("a tensor without values".into())),
            },
        }
    }

    /// Visit the values `layers` export, in export order.
    fn visit(
        &self,
        model: &CandleModel,
        layers: Option<LayerRange>,
        copied: Option<&StateCounter>,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ComputeError> {
        let idx = self
            .layout
            .indices(layers)
            .ok_or_else(|| ComputeError::Shape(format!("no layers {layers:?} in this network")))?;
        if idx.clone().any(|i| !model.cells.contains_key(&i)) {
            return Err(ComputeError::Shape(format!(
                "this node does not hold layers {layers:?}"
            )));
        }
        for part in 0..=self.layout.states {
            for i in idx.clone() {
                self.each_part(model, i, part, copied, f)?;
            }
        }
        if self.layout.step_count {
            f(&[model.t]);
        }
        Ok(())
    }

    /// The flat values of `layers` (what travels).
    pub fn export(&self, model: &CandleModel, layers: Option<LayerRange>) -> Option<Vec<f32>> {
        let len: usize = self.layout.slots(layers)?.iter().map(|r| r.len()).sum();
        let mut out = Vec::with_capacity(len);
        self.visit(model, layers, None, &mut |v| out.extend_from_slice(v))
            .ok()?;
        Some(out)
    }

    /// Values `range` of what [`ModelState::export`] gives: only the tensors that overlap it
    /// are read (a device tensor is copied to the host once per part it lies in). `None` when
    /// `model` lacks `layers` or `range` is outside them.
    pub fn export_range(
        &self,
        model: &CandleModel,
        layers: Option<LayerRange>,
        range: Range<usize>,
    ) -> Option<Vec<f32>> {
        let idx = self.layout.indices(layers)?;
        if idx.clone().any(|i| !model.cells.contains_key(&i)) {
            return None;
        }
        let mut out = Vec::with_capacity(range.len());
        let mut at = 0;
        for part in 0..=self.layout.states {
            for i in idx.clone() {
                let len = self.layout.tensors[i].len;
                let (lo, hi) = (range.start.max(at), range.end.min(at + len));
                if lo < hi {
                    self.each_part(model, i, part, None, &mut |v| {
                        out.extend_from_slice(&v[lo - at..hi - at])
                    })
                    .ok()?;
                }
                at += len;
            }
        }
        if self.layout.step_count {
            if range.start <= at && at < range.end {
                out.push(model.t);
            }
            at += 1;
        }
        (range.end <= at && out.len() == range.len()).then_some(out)
    }

    /// [`ravnest_protocol::digest::digest`] of what [`ModelState::export`] gives, read in place.
    pub fn digest(&self, model: &CandleModel, layers: Option<LayerRange>) -> u64 {
        let mut d = ravnest_protocol::digest::Digest::default();
        match self.visit(model, layers, Some(&self.counter), &mut |v| d.update(v)) {
            Ok(()) => d.finish(),
            Err(_) => 0,
        }
    }

    /// `base` (or nothing) with `layers` (`None`: all, kept at the source until used) set from
    /// their flat values.
    pub fn import(
        &self,
        base: Option<&CandleModel>,
        layers: Option<LayerRange>,
        values: Vec<f32>,
        dev: &Device,
    ) -> Result<CandleModel, ComputeError> {
        let slots = self
            .layout
            .slots(layers)
            .ok_or_else(|| ComputeError::Shape(format!("no layers {layers:?} in this network")))?;
        let want: usize = slots.iter().map(|r| r.len()).sum();
        if values.len() != want {
            return Err(ComputeError::Shape(format!(
                "{} values for layers {layers:?}, which have {want}",
                values.len()
            )));
        }
        let t = if self.layout.step_count {
            values[want - 1]
        } else {
            0.0
        };
        let idx = self.layout.indices(layers).unwrap_or(0..0);
        if idx == (0..self.layout.tensors.len()) {
            // The whole model: kept in host memory, made tensor by tensor where used.
            return Ok(self.at_source(None, &Source::Flat(Arc::new(values)), t));
        }
        let mut model = base.cloned().unwrap_or(CandleModel {
            cells: BTreeMap::new(),
            t,
        });
        model.t = t;
        let first = self.layout.param_range(&idx).start;
        let part_len = self.layout.param_range(&idx).len();
        for i in idx {
            let m = &self.layout.tensors[i];
            let at = |k: usize| {
                let o = k * part_len + m.offset - first;
                values[o..o + m.len].to_vec()
            };
            let state = (1..=self.layout.states).map(at).collect();
            let slot = self.slot(i, at(0), state, dev)?;
            model.cells.insert(i, Cell::made(slot));
        }
        Ok(model)
    }

    /// Apply the optimizer to tensor `i` of `model` with its gradient times `scale`: a new
    /// cell for it in `model` (other versions keep the old one).
    pub fn update(
        &self,
        model: &mut CandleModel,
        i: usize,
        grad: Grad<'_>,
        scale: f32,
        dev: &Device,
    ) -> Result<(), ComputeError> {
        let old = self.get(model, i, dev)?;
        // The rate of this step, and weight decay only where it applies.
        let optim = &self.optim.at(model.t, &self.layout.tensors[i].shape);
        // No other version shares this tensor (a stage's only version, taken to be updated):
        // in place, no new buffers.
        let alone = model
            .cells
            .get(&i)
            .is_some_and(|c| Arc::strong_count(c) == 1)
            && Arc::strong_count(&old) == 2;
        if alone && step_into(optim, &old, None, grad, scale, model.t)? {
            return Ok(());
        }
        // A retired version's buffers of this tensor, where there are: written over, no new
        // buffers.
        let spare = self.spare.lock().unwrap().remove(&i);
        if let Some(spare) = spare
            && spare.state.len() == old.state.len()
            && step_into(optim, &spare, Some(&old), grad, scale, model.t)?
        {
            drop(old);
            model.cells.insert(i, Cell::made(spare));
            return Ok(());
        }
        let new = match fused(optim, &old, grad, scale, model.t)? {
            Some((w, state)) => self.slot(i, w, state, dev)?,
            None => {
                let (w, state) = composed(optim, &old, grad, scale, model.t, dev)
                    .map_err(backend("the optimizer"))?;
                // A new variable copies its values (once, on the device).
                self.counter.copied(4 * w.elem_count() as u64);
                let w = Var::from_tensor(&w).map_err(backend("the optimizer"))?;
                self.made(w, state)?
            }
        };
        drop(old);
        model.cells.insert(i, Cell::made(new));
        Ok(())
    }

    /// Apply a step's host gradient of parameters `range` (a union of whole tensors), times
    /// `scale` (a sum's mean: the optimizer's pass multiplies, not a pass of its own).
    pub fn update_range(
        &self,
        model: &mut CandleModel,
        range: Range<usize>,
        grad: &[f32],
        scale: f32,
        dev: &Device,
    ) -> Result<(), ComputeError> {
        self.each_tensor_in(range, grad, "gradient values", |i, g| {
            self.update(model, i, Grad::Host(g), scale, dev)
        })
    }

    /// A step's update is done: AdamW's step count advances; spare buffers left unused go.
    pub fn end_update(&self, model: &mut CandleModel) {
        if self.layout.step_count {
            model.t += 1.0;
        }
        self.spare.lock().unwrap().clear();
    }

    /// A version no one needs any more: the tensors only it holds become the spare buffers
    /// that the running step's update writes into (one allocation and its page faults fewer
    /// per tensor per step). Tensors another version (or a reader) still shares are left be.
    pub fn retire(&self, old: CandleModel) {
        let mut spare = self.spare.lock().unwrap();
        for (i, cell) in old.cells {
            let Ok(cell) = Arc::try_unwrap(cell) else {
                continue;
            };
            if let Some(slot) = cell
                .ready
                .into_inner()
                .and_then(|s| Arc::try_unwrap(s).ok())
            {
                spare.insert(i, slot);
            }
        }
    }
}

#[cfg(test)]
mod tests;
