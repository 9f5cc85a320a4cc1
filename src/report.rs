//! Human-readable and JSON reports. Formatting only: every figure comes from the plan, the
//! simulation or the benchmark that made it.

mod bench;
mod catalog;
mod plan;
mod recovery;
mod sim;
mod text;

pub use bench::{BenchRow, SimBenchRow, bench_table, sim_bench_table};
pub use catalog::catalog_text;
pub use plan::{Comparisons, plan_json, plan_text};
pub use sim::{sim_compare, sim_text};
