//! The optimizer's step on one tensor: fused over host values on the CPU, composed of candle
//! operations elsewhere, and the in-place writes they end with.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use ravnest_protocol::node::values::ComputeError;

use super::{Grad, Held, Slot, StateCounter, backend, with_values};
use crate::optim::Optim;

/// The optimizer in one pass over host values, where the tensors are on the CPU; `None`
/// elsewhere (a GPU: [`composed`]).
#[allow(clippy::type_complexity)]
pub(super) fn fused(
    optim: &Optim,
    old: &Slot,
    grad: Grad<'_>,
    scale: f32,
    t: f32,
) -> Result<Option<(Vec<f32>, Vec<Vec<f32>>)>, ComputeError> {
    let cpu = |t: &Tensor| t.device().is_cpu() && t.is_contiguous();
    if !cpu(old.param.as_tensor()) || !old.state.iter().all(cpu) {
        return Ok(None);
    }
    // The state tensors are read in place, one inside the other.
    let run = |g: &[f32]| -> Result<(Vec<f32>, Vec<Vec<f32>>), ComputeError> {
        with_values(old.param.as_tensor(), None, |w| match old.state.len() {
            0 => Ok(optim.update(w, &[], g, scale, t)),
            1 => with_values(&old.state[0], None, |a| optim.update(w, &[a], g, scale, t)),
            _ => with_values(&old.state[0], None, |a| {
                with_values(&old.state[1], None, |b| {
                    optim.update(w, &[a, b], g, scale, t)
                })
            })?,
        })?
    };
    match grad {
        Grad::Host(g) => run(g).map(Some),
        Grad::Device(g) if cpu(g) => with_values(g, None, |g| run(g))?.map(Some),
        Grad::Device(_) => Ok(None),
    }
}

/// One optimizer step of one tensor on `dev`, the way a node there takes it (the fused pass on
/// the CPU, candle operations elsewhere): (new parameters, new state). What `tests/cuda.rs`
/// holds to the CPU's bits on a GPU.
#[allow(clippy::type_complexity)]
pub fn optimizer_step_on(
    dev: &Device,
    optim: &Optim,
    w: &[f32],
    state: &[Vec<f32>],
    grad: &[f32],
    scale: f32,
    t: f32,
) -> Result<(Vec<f32>, Vec<Vec<f32>>), ComputeError> {
    let made = backend("making a tensor");
    let counter = Arc::new(StateCounter::default());
    let slot = Slot {
        param: Var::from_slice(w, w.len(), dev).map_err(&made)?,
        state: state
            .iter()
            .map(|s| Tensor::from_slice(s, s.len(), dev))
            .collect::<candle_core::Result<_>>()
            .map_err(&made)?,
        _held: Held::new(&counter, 0),
    };
    if let Some(r) = fused(optim, &slot, Grad::Host(grad), scale, t)? {
        return Ok(r);
    }
    let (w, s) = composed(optim, &slot, Grad::Host(grad), scale, t, dev)
        .map_err(backend("the optimizer"))?;
    let read = |t: &Tensor| t.to_vec1::<f32>().map_err(backend("reading a tensor"));
    Ok((read(&w)?, s.iter().map(read).collect::<Result<_, _>>()?))
}

/// `t`'s values replaced by `v`, in place, when `t` is contiguous f32 values of that length on
/// the CPU (false otherwise: nothing was changed).
pub(super) fn write_over(t: &Tensor, v: &[f32]) -> bool {
    if !t.device().is_cpu() || !t.is_contiguous() || t.elem_count() != v.len() {
        return false;
    }
    t.inplace_op1(&InPlace(&|d: &mut [f32]| d.copy_from_slice(v)))
        .is_ok()
}

/// A pass over a CPU tensor's values in place (candle's `InplaceOp1`).
pub(super) struct InPlace<'a>(&'a dyn Fn(&mut [f32]));

impl candle_core::InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "ravnest-optimizer"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        match (storage, layout.contiguous_offsets()) {
            (candle_core::CpuStorage::F32(v), Some((a, b))) => {
                (self.0)(&mut v[a..b]);
                Ok(())
            }
            _ => candle_core::bail!("an in-place update of a contiguous f32 tensor"),
        }
    }
}

/// `dst[i] = f(src[i], a[i], b[i])` over a CPU tensor's values, in place (`src`: another
/// tensor of the same length, or `dst`'s own values where `None`); one pass of zipped slices,
/// which the compiler vectorizes.
///
/// With more than one compute thread, the pass is split over them in pieces: each value is
/// computed as on one thread, so the bits are the same.
pub(super) fn map_into<F: Fn(f32, f32, f32) -> f32 + Sync>(
    dst: &Tensor,
    src: Option<&Tensor>,
    a: &[f32],
    b: &[f32],
    f: F,
) -> candle_core::Result<()> {
    use rayon::prelude::*;
    const GRAIN: usize = 1 << 15;
    let threaded = rayon::current_num_threads() > 1 && a.len() > GRAIN;
    type Piece<'a> = (((&'a mut [f32], Option<&'a [f32]>), &'a [f32]), &'a [f32]);
    let piece = |(((d, s), a), b): Piece<'_>| match s {
        None => {
            for ((d, a), b) in d.iter_mut().zip(a).zip(b) {
                *d = f(*d, *a, *b);
            }
        }
        Some(s) => {
            for (((d, s), a), b) in d.iter_mut().zip(s).zip(a).zip(b) {
                *d = f(*s, *a, *b);
            }
        }
    };
    let pass = |d: &mut [f32], s: Option<&[f32]>| {
        if !threaded {
            return piece((((d, s), a), b));
        }
        let n = d.len().min(a.len()).min(b.len());
        let n = n.min(s.map_or(n, <[f32]>::len));
        let (d, a, b) = (&mut d[..n], &a[..n], &b[..n]);
        match s {
            None => d
                .par_chunks_mut(GRAIN)
                .zip(a.par_chunks(GRAIN))
                .zip(b.par_chunks(GRAIN))
                .for_each(|((d, a), b)| piece((((d, None), a), b))),
            Some(s) => d
                .par_chunks_mut(GRAIN)
                .zip(s[..n].par_chunks(GRAIN))
                .zip(a.par_chunks(GRAIN))
                .zip(b.par_chunks(GRAIN))
                .for_each(|(((d, s), a), b)| piece((((d, Some(s)), a), b))),
        }
    };
    dst.inplace_op1(&InPlace(&|d: &mut [f32]| match src {
        None => pass(d, None),
        Some(s) => {
            let _ = with_values(s, None, |s| pass(d, Some(s)));
        }
    }))
}

/// `(w, m, v)[i] = f(w[i], m[i], v[i], g[i])` over three CPU tensors' values in place (read
/// from `src`'s three where given, else from `dst`'s own), in one pass; on several threads in
/// pieces, each value computed as on one thread (the same bits).
fn map3_into<F>(
    dst: [&Tensor; 3],
    src: Option<[&Tensor; 3]>,
    g: &[f32],
    f: F,
) -> candle_core::Result<()>
where
    F: Fn(f32, f32, f32, f32) -> (f32, f32, f32) + Sync,
{
    use rayon::prelude::*;
    const GRAIN: usize = 1 << 14;
    let other = |t: &&Tensor| t.elem_count() != g.len();
    if dst.iter().any(other) || src.is_some_and(|s| s.iter().any(other)) {
        candle_core::bail!("an optimizer pass over tensors of other lengths than its gradient");
    }
    type Src<'a> = Option<[&'a [f32]; 3]>;
    // One piece: `at` is where its values start.
    let piece = |at: usize, w: &mut [f32], m: &mut [f32], v: &mut [f32], s: Src<'_>| {
        let g = &g[at..at + w.len()];
        match s {
            None => {
                for (((w, m), v), g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                    (*w, *m, *v) = f(*w, *m, *v, *g);
                }
            }
            Some([sw, sm, sv]) => {
                let n = w.len();
                let (sw, sm, sv) = (&sw[at..at + n], &sm[at..at + n], &sv[at..at + n]);
                let out = w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut());
                for ((((w, m), v), g), ((x, y), z)) in out.zip(g).zip(sw.iter().zip(sm).zip(sv)) {
                    (*w, *m, *v) = f(*x, *y, *z, *g);
                }
            }
        }
    };
    let pass = |w: &mut [f32], m: &mut [f32], v: &mut [f32], s: Src<'_>| {
        if rayon::current_num_threads() > 1 && g.len() > 2 * GRAIN {
            w.par_chunks_mut(GRAIN)
                .zip(m.par_chunks_mut(GRAIN))
                .zip(v.par_chunks_mut(GRAIN))
                .enumerate()
                .for_each(|(k, ((w, m), v))| piece(k * GRAIN, w, m, v, s));
        } else {
            piece(0, w, m, v, s);
        }
    };
    let failed = std::cell::Cell::new(None);
    let [tw, tm, tv] = dst;
    // Each in-place op lends its values to a `Fn`; the inner ones borrow the outer ones'.
    tm.inplace_op1(&InPlace(&|m: &mut [f32]| {
        let m = RefCell::new(m);
        let r = tv.inplace_op1(&InPlace(&|v: &mut [f32]| {
            let v = RefCell::new(v);
            let r = tw.inplace_op1(&InPlace(&|w: &mut [f32]| {
                let (mut m, mut v) = (m.borrow_mut(), v.borrow_mut());
                let Some([a, b, c]) = src else {
                    return pass(w, &mut m, &mut v, None);
                };
                let r = with_values(a, None, |a| {
                    with_values(b, None, |b| {
                        with_values(c, None, |c| pass(w, &mut m, &mut v, Some([a, b, c])))
                    })
                });
                if let Err(e) = r.and_then(|r| r).and_then(|r| r) {
                    failed.set(Some(candle_core::Error::Msg(e.to_string())));
                }
            }));
            if let Err(e) = r {
                failed.set(Some(e));
            }
        }));
        if let Err(e) = r {
            failed.set(Some(e));
        }
    }))?;
    match failed.into_inner() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The optimizer's step of tensor `src` written into `dst`'s buffers (`src` itself where
/// `None`: in place), when both are contiguous f32 values on the CPU of one shape and nothing
/// else shares `dst` (false otherwise: nothing was changed). The same operations, in the same
/// order, as [`Optim::update`] (each state tensor first, then the parameters from the new
/// state), so the bits are the fused pass's.
pub(super) fn step_into(
    optim: &Optim,
    dst: &Slot,
    src: Option<&Slot>,
    grad: Grad<'_>,
    scale: f32,
    t: f32,
) -> Result<bool, ComputeError> {
    let cpu = |t: &Tensor| t.device().is_cpu() && t.is_contiguous();
    let fits = |s: &Slot| {
        cpu(s.param.as_tensor())
            && s.state.len() == dst.state.len()
            && s.state.iter().all(cpu)
            && s.param.elem_count() == dst.param.elem_count()
    };
    if !fits(dst) || !src.is_none_or(fits) {
        return Ok(false);
    }
    let from = |k: Option<usize>| {
        src.map(|s| match k {
            None => s.param.as_tensor(),
            Some(k) => &s.state[k],
        })
    };
    let run = |g: &[f32]| -> candle_core::Result<()> {
        if g.len() != dst.param.elem_count() {
            candle_core::bail!("{} gradient values for {}", g.len(), dst.param.elem_count());
        }
        let w = dst.param.as_tensor();
        let lr = optim.lr;
        match optim.kind {
            ravnest_core::Optimizer::Sgd => {
                map_into(w, from(None), g, g, |w, g, _| w - lr * (g * scale))
            }
            ravnest_core::Optimizer::SgdMomentum => {
                let mu = optim.momentum;
                map_into(&dst.state[0], from(Some(0)), g, g, |v, g, _| {
                    mu * v + g * scale
                })?;
                with_values(&dst.state[0], None, |v| {
                    map_into(w, from(None), v, v, |w, v, _| w - lr * v)
                })
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?
            }
            ravnest_core::Optimizer::Adamw => {
                let [b1, nb1, b2, nb2, c1, c2, eps] = optim.adamw_constants(t);
                let wd = optim.weight_decay;
                // The state first, then the parameter from the new state, as `Optim::update`
                // computes them: one pass over the four arrays instead of three passes.
                let step = |w: f32, m: f32, v: f32, g: f32| {
                    let m = b1 * m + nb1 * (g * scale);
                    let gs = g * scale;
                    let v = b2 * v + nb2 * gs * gs;
                    let update = (m / c1) / ((v / c2).sqrt() + eps);
                    (w - lr * (update + wd * w), m, v)
                };
                let src = src.map(|s| [s.param.as_tensor(), &s.state[0], &s.state[1]]);
                map3_into([w, &dst.state[0], &dst.state[1]], src, g, step)
            }
        }
    };
    match grad {
        Grad::Host(g) => run(g),
        Grad::Device(g) if cpu(g) => with_values(g, None, |g| run(g))?,
        Grad::Device(_) => return Ok(false),
    }
    .map_err(backend("the optimizer in place"))?;
    Ok(true)
}

/// The optimizer as candle operations on the device, each one correctly rounded IEEE
/// arithmetic (mul, add, sub, div, sqrt) in the order [`Optim::update`] computes them, the
/// constants made once on the host: the same bits as the fused pass (tested on the CPU).
pub(super) fn composed(
    optim: &Optim,
    old: &Slot,
    grad: Grad<'_>,
    scale: f32,
    t: f32,
    dev: &Device,
) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
    let w = old.param.as_tensor();
    let k = |x: f32| Tensor::new(x, dev);
    let g = match grad {
        Grad::Host(g) => Tensor::from_slice(g, w.shape(), dev)?,
        Grad::Device(g) => g.clone(),
    };
    let g = g.broadcast_mul(&k(scale)?)?;
    let lr = k(optim.lr)?;
    match optim.kind {
        ravnest_core::Optimizer::Sgd => Ok((w.sub(&g.broadcast_mul(&lr)?)?, Vec::new())),
        ravnest_core::Optimizer::SgdMomentum => {
            let v = old.state[0].broadcast_mul(&k(optim.momentum)?)?.add(&g)?;
            let w = w.sub(&v.broadcast_mul(&lr)?)?;
            Ok((w, vec![v]))
        }
        ravnest_core::Optimizer::Adamw => {
            let [b1, nb1, b2, nb2, c1, c2, eps] = optim.adamw_constants(t);
            let m = old.state[0]
                .broadcast_mul(&k(b1)?)?
                .add(&g.broadcast_mul(&k(nb1)?)?)?;
            let v = old.state[1]
                .broadcast_mul(&k(b2)?)?
                .add(&g.broadcast_mul(&k(nb2)?)?.mul(&g)?)?;
            let update = m
                .broadcast_div(&k(c1)?)?
                .div(&v.broadcast_div(&k(c2)?)?.sqrt()?.broadcast_add(&k(eps)?)?)?;
            let decay = w.broadcast_mul(&k(optim.weight_decay)?)?;
            let w = w.sub(&update.add(&decay)?.broadcast_mul(&lr)?)?;
            Ok((w, vec![m, v]))
        }
    }
}
