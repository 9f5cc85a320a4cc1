//! The shipped scenarios, embedded so that `ravnest plan` and `ravnest bench planners` work from
//! any directory with no files to write first.

/// The default for `ravnest plan` without a file.
pub const DEFAULT: (&str, &str) = SHIPPED[2];

/// The default for `ravnest sim` without a file.
pub const SIM_DEFAULT: (&str, &str) = SHIPPED[0];

/// The default for `ravnest run` without a file: two local processes, one 3x slower.
pub const RUN_DEFAULT: (&str, &str) = SHIPPED[7];

/// (name, TOML text) of every file in `scenarios/`, in report order (the 1,000-node one last).
pub const SHIPPED: [(&str, &str); 16] = [
    ("flaky-3090", include_str!("../scenarios/flaky-3090.toml")),
    ("homogeneous", include_str!("../scenarios/homogeneous.toml")),
    (
        "mixed-4090-3060",
        include_str!("../scenarios/mixed-4090-3060.toml"),
    ),
    (
        "memory-limited",
        include_str!("../scenarios/memory-limited.toml"),
    ),
    ("slow-link", include_str!("../scenarios/slow-link.toml")),
    ("straggler", include_str!("../scenarios/straggler.toml")),
    ("partition", include_str!("../scenarios/partition.toml")),
    (
        "local-digits",
        include_str!("../scenarios/local-digits.toml"),
    ),
    ("local-text", include_str!("../scenarios/local-text.toml")),
    ("local-gpt", include_str!("../scenarios/local-gpt.toml")),
    (
        "pipeline-gpt-small",
        include_str!("../scenarios/pipeline-gpt-small.toml"),
    ),
    (
        "sharded-gpt-small",
        include_str!("../scenarios/sharded-gpt-small.toml"),
    ),
    (
        "coordinator-crash",
        include_str!("../scenarios/coordinator-crash.toml"),
    ),
    (
        "coordinator-crash-replan",
        include_str!("../scenarios/coordinator-crash-replan.toml"),
    ),
    (
        "stale-coordinator",
        include_str!("../scenarios/stale-coordinator.toml"),
    ),
    ("large-1000", include_str!("../scenarios/large-1000.toml")),
];
