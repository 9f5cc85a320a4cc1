//! A measured profile: what a real run (`ravnest run`) found each node and link to cost over
//! its steady-state steps, in a small TOML file (`profile.toml` in the run's output folder),
//! which `plan --profile` and `sim --profile` put over a scenario's cluster so that they
//! predict that run. Format: `docs/cluster-format.md`, "Measured profiles".
//!
//! Three parts, all pure (no I/O here; the run writes the file, the CLI reads it):
//! - [`fit`]: from the per-step figures each node recorded (batch, compute, exposed
//!   communication, time between steps) and the figures the run calibrated at its start, the
//!   profile: per node, seconds per sample and fixed seconds per step; per pair, the link
//!   figures that make the cost model's ring all-reduce take what the steady-state ring took;
//! - [`Profile::parse`]: read and check a file (errors give file, line and column);
//! - [`Profile::apply`]: put it over a [`Scenario`]'s cluster, matching nodes by name.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::cluster::Link;
use crate::config::{ConfigError, Scenario, nearest};
use crate::cost::ring_allreduce_s;

/// The profile format this build writes and reads.
pub const PROFILE_FORMAT: u32 = 1;

/// What a profile was measured on (the `[profile]` table), for reference and for checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    /// [`PROFILE_FORMAT`] of the writer.
    pub format: u32,
    /// The cluster's name.
    pub cluster: String,
    /// The model's name: a profile applies to this model only.
    pub model: String,
    /// Samples per step of the run.
    pub global_batch: u32,
    /// The steps the figures come from: `[first, end)` (the warm-up before is left out).
    pub steps: [u64; 2],
    /// The run's achieved samples/s over those steps.
    pub samples_per_s: f64,
    /// The ring all-reduce's exposed time per step, seconds (the mean over those steps of
    /// the least a working node waited after its compute: the node that finished last).
    pub ring_s: f64,
    /// Nodes in the ring over those steps (most steps).
    pub ring_nodes: u32,
}

/// One node's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeProfile {
    /// The node's name in the cluster file.
    pub name: String,
    /// Seconds of compute per sample of the whole model (forward and backward).
    pub secs_per_sample: f64,
    /// Seconds each step costs this node whatever its batch: its share's fixed compute
    /// (dispatch, allocations) and the time between steps (the update of the last bucket,
    /// recording the version, the report).
    pub step_overhead_s: f64,
    /// How much its step compute varied: the standard deviation of each step's compute ÷
    /// the mean at its batch (0: not measured). The simulator draws each step's compute with
    /// this spread, so that a step waits for the slowest of noisy nodes as the real one did.
    pub compute_spread: f64,
    /// Memory it registered, bytes (0: unknown, keep the scenario's).
    pub memory_bytes: u64,
    /// Its access link, as the plan shows it (its link to the coordinator's host).
    pub bandwidth_gbps: f64,
    /// One-way latency of that link, ms.
    pub latency_ms: f64,
    /// For reference: the steady steps it worked in (0: left out of them; its figures are
    /// then its calibration with the contention the working nodes saw).
    #[serde(default)]
    pub steps_measured: u64,
    /// For reference: its batch in the last epoch of the steps measured (0: left out).
    pub batch: u64,
    /// For reference: fraction of the steps' wall time it computed.
    pub busy: f64,
    /// For reference: fraction it waited for communication after its compute.
    pub comm: f64,
}

/// One pair's link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairProfile {
    /// One end (a node's name).
    pub a: String,
    /// The other end.
    pub b: String,
    /// Effective bandwidth, Gbit/s.
    pub bandwidth_gbps: f64,
    /// One-way latency, ms.
    pub latency_ms: f64,
}

/// A measured profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// What it was measured on.
    pub profile: Measured,
    /// Per node.
    #[serde(rename = "node", default)]
    pub nodes: Vec<NodeProfile>,
    /// Per pair.
    #[serde(rename = "link", default)]
    pub links: Vec<PairProfile>,
}

/// The same, as read: names and figures keep their place in the file for errors.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    profile: Spanned<Measured>,
    #[serde(default)]
    node: Vec<Spanned<NodeProfile>>,
    #[serde(default)]
    link: Vec<Spanned<PairProfile>>,
}

fn at(text: &str, span: Option<&Range<usize>>) -> Option<(usize, usize)> {
    let start = span?.start.min(text.len());
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    Some((line, col))
}

fn error(origin: &str, at: Option<(usize, usize)>, message: String) -> ConfigError {
    ConfigError {
        origin: origin.to_string(),
        at,
        message,
        help: None,
    }
}

fn help(mut e: ConfigError, help: impl Into<String>) -> ConfigError {
    e.help = Some(help.into());
    e
}

impl Profile {
    /// Read and check a profile; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Profile, ConfigError> {
        let raw: RawProfile = toml::from_str(text).map_err(|e| {
            error(
                origin,
                at(text, e.span().as_ref()),
                e.message().trim().to_string(),
            )
        })?;
        let err = |span: Range<usize>, m: String| error(origin, at(text, Some(&span)), m);
        let m = &raw.profile;
        if m.get_ref().format != PROFILE_FORMAT {
            return Err(help(
                err(
                    m.span(),
                    format!(
                        "profile format {} (this build reads format {PROFILE_FORMAT})",
                        m.get_ref().format
                    ),
                ),
                "measure it again with this build's `ravnest run`",
            ));
        }
        let figures = [
            ("samples_per_s", m.get_ref().samples_per_s),
            ("ring_s", m.get_ref().ring_s),
        ];
        check(&figures, "[profile]").map_err(|e| err(m.span(), e))?;
        let mut seen = std::collections::BTreeSet::new();
        for n in &raw.node {
            let v = n.get_ref();
            let figures = [
                ("secs_per_sample", v.secs_per_sample),
                ("step_overhead_s", v.step_overhead_s),
                ("compute_spread", v.compute_spread),
                ("bandwidth_gbps", v.bandwidth_gbps),
                ("latency_ms", v.latency_ms),
                ("busy", v.busy),
                ("comm", v.comm),
            ];
            let what = format!("node `{}`", v.name);
            check(&figures, &what).map_err(|e| err(n.span(), e))?;
            // (Finite and not negative, checked above.)
            if v.secs_per_sample == 0.0 || v.bandwidth_gbps == 0.0 {
                return Err(err(
                    n.span(),
                    format!(
                        "{what}: `secs_per_sample` and `bandwidth_gbps` must be greater than 0"
                    ),
                ));
            }
            if !seen.insert(v.name.clone()) {
                return Err(err(n.span(), format!("{what} appears twice")));
            }
        }
        for l in &raw.link {
            let v = l.get_ref();
            let what = format!("link `{}`-`{}`", v.a, v.b);
            let figures = [
                ("bandwidth_gbps", v.bandwidth_gbps),
                ("latency_ms", v.latency_ms),
            ];
            check(&figures, &what).map_err(|e| err(l.span(), e))?;
            if v.bandwidth_gbps == 0.0 {
                return Err(err(
                    l.span(),
                    format!("{what}: `bandwidth_gbps` must be greater than 0"),
                ));
            }
            for end in [&v.a, &v.b] {
                if !seen.contains(end) {
                    return Err(err(
                        l.span(),
                        format!("{what}: `{end}` is not a node of this profile"),
                    ));
                }
            }
        }
        Ok(Profile {
            profile: raw.profile.into_inner(),
            nodes: raw.node.into_iter().map(Spanned::into_inner).collect(),
            links: raw.link.into_iter().map(Spanned::into_inner).collect(),
        })
    }

    /// The file's text, with a header saying what it is.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).unwrap_or_default();
        format!(
            "# A profile measured by `ravnest run` over its steady-state steps: give it to\n\
             # `ravnest plan --profile FILE` or `ravnest sim --profile FILE` (docs/cluster-format.md).\n\
             # Seconds per sample and fixed seconds per step are each node's compute as it ran;\n\
             # link bandwidths are those that make the ring take what it took.\n\n{body}"
        )
    }

    /// Put the profile over `s`'s cluster, matching nodes by name: each node it names gets its
    /// speed (seconds per sample as FLOP/s of `s`'s model), fixed cost per step, memory and
    /// access link; each pair it names, its link. `origin` names the profile in errors.
    /// Returns notes for the user (nodes it does not name keep their figures; a different
    /// global batch). A profile measured on another model is an error: its seconds per sample
    /// say nothing about this one.
    pub fn apply(&self, s: &mut Scenario, origin: &str) -> Result<Vec<String>, ConfigError> {
        let err = |m: String| error(origin, None, m);
        if self.profile.model != s.model.name {
            return Err(help(
                err(format!(
                    "measured on model `{}`, but the scenario trains `{}`",
                    self.profile.model, s.model.name
                )),
                "measure this scenario's model: `ravnest run FILE --out DIR` writes DIR/profile.toml",
            ));
        }
        let names: Vec<String> = s.cluster.nodes.iter().map(|n| n.name.clone()).collect();
        let find = |name: &str| -> Result<usize, ConfigError> {
            names.iter().position(|n| n == name).ok_or_else(|| {
                let e = err(format!(
                    "node `{name}` is not in the cluster `{}` (its nodes: {})",
                    s.cluster.name,
                    names.join(", ")
                ));
                match nearest(name, names.iter().map(String::as_str)) {
                    Some(n) => help(e, format!("did you mean `{n}`?")),
                    None => e,
                }
            })
        };
        let mut notes = Vec::new();
        if self.profile.global_batch != s.training.global_batch {
            notes.push(format!(
                "{origin}: measured at a global batch of {}, the scenario's is {}: fixed costs weigh differently at another batch",
                self.profile.global_batch, s.training.global_batch
            ));
        }
        let train_flops = s.model.train_flops_per_sample();
        let mut applied = vec![false; names.len()];
        for n in &self.nodes {
            let i = find(&n.name)?;
            applied[i] = true;
            let node = &mut s.cluster.nodes[i];
            node.flops = train_flops / n.secs_per_sample;
            node.step_overhead_s = n.step_overhead_s;
            node.compute_spread = n.compute_spread;
            if n.memory_bytes > 0 {
                node.memory_bytes = n.memory_bytes;
            }
            node.link = Link {
                bandwidth_gbps: n.bandwidth_gbps,
                latency_ms: n.latency_ms,
            };
        }
        for l in &self.links {
            let (a, b) = (find(&l.a)?, find(&l.b)?);
            let (a, b) = (
                crate::cluster::NodeId(a.min(b) as u32),
                crate::cluster::NodeId(a.max(b) as u32),
            );
            s.cluster.pair_links.insert(
                (a, b),
                Link {
                    bandwidth_gbps: l.bandwidth_gbps,
                    latency_ms: l.latency_ms,
                },
            );
        }
        for (name, done) in names.iter().zip(&applied) {
            if !done {
                notes.push(format!(
                    "{origin}: node `{name}` is not in the profile: it keeps the scenario's figures"
                ));
            }
        }
        Ok(notes)
    }
}

impl Profile {
    /// Each of `s`'s nodes' compute spread (by node index; 0 for a node the profile does not
    /// name): what the simulator draws step times with.
    pub fn compute_spread(&self, s: &Scenario) -> Vec<f64> {
        s.cluster
            .nodes
            .iter()
            .map(|n| {
                self.nodes
                    .iter()
                    .find(|p| p.name == n.name)
                    .map_or(0.0, |p| p.compute_spread)
            })
            .collect()
    }
}

/// Every figure finite and not negative, or what is wrong.
fn check(figures: &[(&str, f64)], what: &str) -> Result<(), String> {
    for (name, x) in figures {
        if !x.is_finite() {
            return Err(format!("{what}: `{name}` must be a finite number, got {x}"));
        }
        if *x < 0.0 {
            return Err(format!("{what}: `{name}` must not be negative, got {x}"));
        }
    }
    Ok(())
}

/// One step as a node recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepSample {
    /// The version the step made (step + 1).
    pub version: u64,
    /// Its batch.
    pub batch: u64,
    /// Seconds it computed.
    pub compute_s: f64,
    /// Seconds it waited for the step's collectives after its compute.
    pub comm_s: f64,
    /// Seconds since the node's previous step ended.
    pub period_s: f64,
}

/// What a run knows about one node at its end.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRun {
    /// Its name.
    pub name: String,
    /// (seconds per sample, fixed seconds per step) as calibrated at the start.
    pub calibrated: (f64, f64),
    /// Registered memory, bytes.
    pub memory_bytes: u64,
    /// Its access link as probed.
    pub link: Link,
    /// Its steady-state steps.
    pub steps: Vec<StepSample>,
    /// Its busy fraction over them.
    pub busy: f64,
    /// Its comm fraction over them.
    pub comm: f64,
}

/// What a run knows at its end, for [`fit`].
#[derive(Debug, Clone, PartialEq)]
pub struct RunFigures {
    /// The cluster's name.
    pub cluster: String,
    /// The model's name.
    pub model: String,
    /// Samples per step.
    pub global_batch: u32,
    /// Bytes of one gradient (what the ring reduces).
    pub grad_bytes: f64,
    /// The steps measured, `[first, end)`.
    pub steps: [u64; 2],
    /// Samples/s achieved over them.
    pub samples_per_s: f64,
    /// Per node.
    pub nodes: Vec<NodeRun>,
    /// Probed pair links (node names).
    pub pairs: Vec<(String, String, Link)>,
    /// The rings the coordinator measured while the run went on (nodes, seconds per step), in
    /// order: the warm-up's too, where a larger ring may have run before a node was left out.
    pub rings: Vec<(usize, f64)>,
}

fn mean(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some(0.5 * (v[n / 2 - 1] + v[n / 2])),
    }
}

/// A node's (k, spread, gap) over its steady steps with work: its compute ÷ its calibration's
/// prediction (ratio of the sums), the relative spread of its steps around their epoch's mean
/// (same batch), and the mean
/// time between steps that is neither compute nor communication.
fn node_figures(n: &NodeRun) -> Option<(f64, f64, f64)> {
    let (ps, fixed) = n.calibrated;
    let worked: Vec<&StepSample> = n.steps.iter().filter(|s| s.batch > 0).collect();
    let predicted = |s: &StepSample| fixed + s.batch as f64 * ps;
    // Means, not medians: throughput is total time, and a slow step costs what it costs.
    let total: f64 = worked.iter().map(|s| predicted(s)).sum();
    let k = Some(worked.iter().map(|s| s.compute_s).sum::<f64>() / total)
        .filter(|k| k.is_finite() && *k > 0.0)?;
    // The spread of steps around their epoch's mean (steps at the same batch): how much one
    // step differs from the next, not how contention moved between epochs (k covers that).
    let mut by_batch: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for s in &worked {
        by_batch.entry(s.batch).or_default().push(s.compute_s);
    }
    let deviations: Vec<f64> = by_batch
        .values()
        .filter_map(|c| {
            let m = mean(c.clone()).filter(|m| *m > 0.0)?;
            Some(c.iter().map(move |x| (x / m - 1.0).powi(2)))
        })
        .flatten()
        .collect();
    let spread = mean(deviations).map_or(0.0, f64::sqrt);
    let gap = mean(
        worked
            .iter()
            .map(|s| (s.period_s - s.compute_s - s.comm_s).max(0.0))
            .collect(),
    )
    .unwrap_or(0.0);
    Some((k, spread, gap))
}

fn worked_steps(n: &NodeRun) -> usize {
    n.steps.iter().filter(|s| s.batch > 0).count()
}

/// The simulator draws each node's step compute independently and uniformly around its mean,
/// with the node's measured spread; a step waits for the slowest node. Real noise on a shared
/// machine is neither: mostly steady steps with rare long ones, partly shared between the
/// nodes (the same busy cores), so the slowest of two nodes waits far less than independent
/// uniform noise of the same spread predicts (13% too slow a prediction on the embedded
/// default). The factor on every node's spread that makes the predicted mean of the slowest
/// node's compute, over the steps several nodes worked, what it was; 1 when no step had two.
fn spread_factor(r: &RunFigures, measured: &[Option<(f64, f64, f64)>]) -> f64 {
    // Per node: its mean compute per batch, and its spread.
    let means: Vec<std::collections::BTreeMap<u64, f64>> = r
        .nodes
        .iter()
        .map(|n| {
            let mut by: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
            for s in n.steps.iter().filter(|s| s.batch > 0) {
                let e = by.entry(s.batch).or_default();
                *e = (e.0 + s.compute_s, e.1 + 1.0);
            }
            by.into_iter().map(|(b, (sum, k))| (b, sum / k)).collect()
        })
        .collect();
    // Per version with at least two measured nodes: each node's (compute, mean, spread).
    let mut by_version: std::collections::BTreeMap<u64, Vec<(f64, f64, f64)>> = Default::default();
    for (i, n) in r.nodes.iter().enumerate() {
        let Some((_, spread, _)) = measured[i] else {
            continue;
        };
        for s in n.steps.iter().filter(|s| s.batch > 0) {
            let m = means[i].get(&s.batch).copied().unwrap_or(s.compute_s);
            by_version
                .entry(s.version)
                .or_default()
                .push((s.compute_s, m, spread));
        }
    }
    let steps: Vec<&Vec<(f64, f64, f64)>> = by_version.values().filter(|v| v.len() >= 2).collect();
    if steps.is_empty() {
        return 1.0;
    }
    let actual: f64 = steps
        .iter()
        .map(|v| v.iter().map(|x| x.0).fold(0.0, f64::max))
        .sum();
    let predicted = |alpha: f64| -> f64 {
        steps
            .iter()
            .map(|v| {
                let spans: Vec<(f64, f64)> = v
                    .iter()
                    .map(|&(_, m, spread)| {
                        let w = crate::cost::sim_width(alpha * spread);
                        (m * (1.0 - w / 2.0), m * (1.0 + w / 2.0))
                    })
                    .collect();
                expected_max_uniform(&spans)
            })
            .sum()
    };
    let (mut lo, mut hi) = (0.0, 2.0);
    if predicted(lo) >= actual {
        return 0.0;
    }
    if predicted(hi) <= actual {
        return hi;
    }
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if predicted(mid) < actual {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// The mean of the largest of independent uniform variables on `spans` (`(lo, hi)`, a point
/// when equal): the largest lower bound plus the integral above it of P(max > t).
pub fn expected_max_uniform(spans: &[(f64, f64)]) -> f64 {
    let floor = spans.iter().map(|s| s.0).fold(f64::NEG_INFINITY, f64::max);
    let top = spans.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    if top.is_nan() || top <= floor {
        return floor.max(top);
    }
    const N: usize = 256;
    let dt = (top - floor) / N as f64;
    let mut sum = 0.0;
    for k in 0..N {
        let t = floor + (k as f64 + 0.5) * dt;
        let all_below: f64 = spans
            .iter()
            .map(|&(lo, hi)| {
                if hi > lo {
                    ((t - lo) / (hi - lo)).clamp(0.0, 1.0)
                } else {
                    1.0
                }
            })
            .product();
        sum += (1.0 - all_below) * dt;
    }
    floor + sum
}

/// The profile of a run.
///
/// Means throughout, not medians: throughput is total time over steps, and on a shared
/// machine one step in ten takes twice as long and still counts.
/// - A node's compute: its start-up calibration (fixed + per-sample, measured with every node
///   computing at once) times its steady steps' measured ÷ calibrated compute (ratio of the
///   sums): the contention and caches of the real steps, with the calibration's split
///   between fixed and per-sample cost (one batch per epoch cannot separate them); and the
///   spread of its steps around that (a step waits for the slowest node, so noise costs).
/// - Its fixed cost also gets the mean time between its steps that is neither compute nor
///   communication: that is paid every step whatever the batch.
/// - A node left out of every steady step gets its calibration times the working nodes' mean
///   contention factor (and their spread and gap): idle on a shared machine, it measured its
///   speed before the others' communication competed for the cores.
/// - The ring: per step, the least exposed communication of the nodes that worked (the node
///   that finished last waits only for the ring itself); its mean is the ring's time. The
///   probed links are scaled by one factor so that the cost model's ring over them takes that
///   long (loopback probes see 15 Gbit/s; a ring of encrypted, reduced chunks on a busy CPU
///   moves far less).
pub fn fit(r: &RunFigures) -> Profile {
    // Per node that worked in the steady steps: (k, spread, gap); `None` for one that did not,
    // or that worked in too few of them to say (a node planned out after a few steps).
    let most = r.nodes.iter().map(worked_steps).max().unwrap_or(0);
    let mut measured: Vec<Option<(f64, f64, f64)>> = r
        .nodes
        .iter()
        .map(|n| {
            (4 * worked_steps(n) >= most)
                .then(|| node_figures(n))
                .flatten()
        })
        .collect();
    // Each spread times the factor that makes independent noise cost what the real steps'
    // noise cost (it is neither independent nor uniform: see `spread_factor`).
    let alpha = spread_factor(r, &measured);
    for m in measured.iter_mut().flatten() {
        m.1 *= alpha;
    }
    let worked: Vec<(f64, f64, f64)> = measured.iter().flatten().copied().collect();
    // A node that did no steady step (left out of the plan) is charged the contention the
    // others saw: on a shared machine it is not faster than its calibration by being idle.
    let typical = (
        mean(worked.iter().map(|m| m.0).collect()).unwrap_or(1.0),
        mean(worked.iter().map(|m| m.1).collect()).unwrap_or(0.0),
        mean(worked.iter().map(|m| m.2).collect()).unwrap_or(0.0),
    );
    let mut nodes = Vec::new();
    for (n, m) in r.nodes.iter().zip(&measured) {
        let (ps, fixed) = n.calibrated;
        let (k, spread, gap) = m.unwrap_or(typical);
        // Its access link: the fastest of its probed pairs (a node is not probed to itself,
        // so the coordinator's host has only its file's figure otherwise).
        let link = r
            .pairs
            .iter()
            .filter(|p| p.0 == n.name || p.1 == n.name)
            .map(|p| p.2)
            .reduce(|a, b| Link {
                bandwidth_gbps: a.bandwidth_gbps.max(b.bandwidth_gbps),
                latency_ms: a.latency_ms.min(b.latency_ms),
            })
            .unwrap_or(n.link);
        nodes.push(NodeProfile {
            name: n.name.clone(),
            secs_per_sample: k * ps,
            step_overhead_s: k * fixed + gap,
            compute_spread: spread,
            memory_bytes: n.memory_bytes,
            bandwidth_gbps: link.bandwidth_gbps,
            latency_ms: link.latency_ms,
            steps_measured: n.steps.iter().filter(|s| s.batch > 0).count() as u64,
            batch: n.steps.last().map_or(0, |s| s.batch),
            busy: n.busy,
            comm: n.comm,
        });
    }
    // The ring per step: the least exposed wait among the nodes that worked in it.
    let mut by_version: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for n in &r.nodes {
        for s in n.steps.iter().filter(|s| s.batch > 0) {
            by_version.entry(s.version).or_default().push(s.comm_s);
        }
    }
    let synced: Vec<&Vec<f64>> = by_version.values().filter(|c| c.len() >= 2).collect();
    let ring_s = mean(
        synced
            .iter()
            .map(|c| c.iter().copied().fold(f64::INFINITY, f64::min))
            .collect(),
    )
    .unwrap_or(0.0);
    let ring_nodes =
        median(synced.iter().map(|c| c.len() as f64).collect()).unwrap_or(0.0) as usize;
    let scale = bandwidth_scale(r, ring_nodes, ring_s);
    // Measured on rings of two sizes: their bandwidth and per-hop latency both, so that the
    // ring the steady steps did not run costs what it cost.
    let hop = two_ring_fit(r, (ring_nodes, ring_s));
    let scale = hop.map_or(scale, |h| h.0);
    for n in &mut nodes {
        n.bandwidth_gbps *= scale;
        if let Some((_, latency_ms)) = hop {
            n.latency_ms = n.latency_ms.max(latency_ms);
        }
    }
    Profile {
        profile: Measured {
            format: PROFILE_FORMAT,
            cluster: r.cluster.clone(),
            model: r.model.clone(),
            global_batch: r.global_batch,
            steps: r.steps,
            samples_per_s: r.samples_per_s,
            ring_s,
            ring_nodes: ring_nodes as u32,
        },
        nodes,
        links: r
            .pairs
            .iter()
            .map(|(a, b, l)| PairProfile {
                a: a.clone(),
                b: b.clone(),
                bandwidth_gbps: l.bandwidth_gbps * scale,
                latency_ms: hop.map_or(l.latency_ms, |h| l.latency_ms.max(h.1)),
            })
            .collect(),
    }
}

/// The ring of `steady` (nodes, seconds) and the last ring of another size the coordinator
/// measured: the (bandwidth factor, latency in ms) that make the cost model's rings of both
/// sizes take what they took, a ring of n costing 2(n - 1)/n of the gradient at the bandwidth
/// plus 2(n - 1) hops of the latency. On one shared machine a hop costs more than its probe
/// says (each process waits for a core), and a 3-node ring took twice a 2-node one where the
/// bandwidth alone says 1.3x. `None` with one size measured, or when the two do not fit
/// (a larger ring no slower).
fn two_ring_fit(r: &RunFigures, steady: (usize, f64)) -> Option<(f64, f64)> {
    let (n1, t1) = steady;
    let &(n2, t2) = r.rings.iter().rev().find(|x| x.0 != n1 && x.0 >= 2)?;
    if n1 < 2 || t1.is_nan() || t1 <= 0.0 || t2.is_nan() || t2 <= 0.0 {
        return None;
    }
    // t = a X + b L: X the gradient's seconds at the bandwidth, L a hop's seconds.
    let ab = |n: usize| (2.0 * (n as f64 - 1.0) / n as f64, 2.0 * (n as f64 - 1.0));
    let ((a1, b1), (a2, b2)) = (ab(n1), ab(n2));
    let det = a1 * b2 - a2 * b1;
    let x = (t1 * b2 - t2 * b1) / det;
    let l = (a1 * t2 - a2 * t1) / det;
    if !(x.is_finite() && l.is_finite() && x > 0.0 && l > 0.0) {
        return None;
    }
    let bottleneck = r
        .pairs
        .iter()
        .map(|p| p.2.bandwidth_gbps)
        .fold(f64::INFINITY, f64::min);
    let bandwidth_gbps = r.grad_bytes * 8.0 / x / 1e9;
    let scale = (bandwidth_gbps / bottleneck).min(1.0);
    (scale.is_finite() && scale > 0.0).then_some((scale, l * 1e3))
}

/// The factor on every probed bandwidth that makes the cost model's ring of `n` nodes over
/// the slowest probed link between the nodes that worked take `ring_s`; 1 when the probes already explain it (or nothing
/// was measured). Never above 1: a ring is not faster than its links' probes.
fn bandwidth_scale(r: &RunFigures, n: usize, ring_s: f64) -> f64 {
    // The ring's links are those between nodes that worked in the steady steps (a node left
    // out was in no ring, and its slow probe says nothing about the ring's speed).
    let worked = |name: &str| {
        r.nodes
            .iter()
            .any(|x| x.name == name && x.steps.iter().any(|s| s.batch > 0))
    };
    let mut links: Vec<Link> = r
        .pairs
        .iter()
        .filter(|p| worked(&p.0) && worked(&p.1))
        .map(|p| p.2)
        .collect();
    if links.is_empty() {
        links = r.pairs.iter().map(|p| p.2).collect();
    }
    ring_bandwidth_scale(&links, n, r.grad_bytes, ring_s)
}

/// The factor on the bandwidths of `links` (a ring's) that makes the cost model's ring of `n`
/// nodes over the slowest of them, moving `grad_bytes`, take `ring_s`; 1 when they already
/// explain it (or nothing was measured). Never above 1: a ring is not faster than its links.
/// A run's profile and the coordinator's re-plans on a measured ring use it alike.
pub fn ring_bandwidth_scale(links: &[Link], n: usize, grad_bytes: f64, ring_s: f64) -> f64 {
    if n < 2 || ring_s.is_nan() || ring_s <= 0.0 || links.is_empty() {
        return 1.0;
    }
    let bottleneck = links
        .iter()
        .map(|l| l.bandwidth_gbps)
        .fold(f64::INFINITY, f64::min);
    let latency = links.iter().map(|l| l.latency_ms).fold(0.0, f64::max);
    let probed = ring_allreduce_s(n, grad_bytes, bottleneck, latency);
    let latency_part = ring_allreduce_s(n, 0.0, bottleneck, latency);
    if ring_s <= probed || ring_s <= latency_part {
        return 1.0;
    }
    (probed - latency_part) / (ring_s - latency_part)
}

#[cfg(test)]
mod tests;
