//! The docs name only keys and flags the binary knows: every cluster-file key in docs/ and
//! README.md (in TOML blocks, by section; in prose as `[section] key` or `key = value`) is a
//! field the parser accepts in that section, a `profile.toml` block parses as a profile, and
//! every command-line flag on a `ravnest` command line (or on its own in backticks) is in the
//! `--help` of some command. A doc that names a key or flag the binary does not know fails.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_ravnest")
}

/// Every document: docs/*.md and README.md.
fn documents() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.push(root.join("README.md"));
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let t = std::fs::read_to_string(&p).unwrap();
            // A design for what is not built yet names its future keys and flags.
            let t = match t.find("<!-- docs-test: not built") {
                Some(i) => t[..i].to_string(),
                None => t,
            };
            (p, t)
        })
        .collect()
}

/// The keys the parser accepts in `section` (`""`: the top level; `node`, `links.pair`,
/// `model.layer` and `fault` are arrays of tables), read from its own error for an unknown one.
fn known_keys(section: &str) -> BTreeSet<String> {
    let arrays = ["node", "links.pair", "model.layer", "fault"];
    let header = match section {
        "" => String::new(),
        s if arrays.contains(&s) => format!("[[{s}]]\n"),
        s => format!("[{s}]\n"),
    };
    let text = format!("{header}zz_probe = 1\n");
    let err = match ravnest_core::parse(&text, "probe.toml") {
        Ok(_) => panic!("`zz_probe` accepted in [{section}]"),
        Err(e) => format!("{e:#}"),
    };
    let list = err
        .split("expected one of ")
        .nth(1)
        .or_else(|| err.split("expected ").nth(1))
        .unwrap_or_else(|| panic!("no list of fields in: {err}"));
    let list = list.lines().next().unwrap_or("");
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

/// The sections of a cluster file and their keys.
fn cluster_keys() -> BTreeMap<String, BTreeSet<String>> {
    [
        "",
        "cluster",
        "links",
        "links.pair",
        "node",
        "model",
        "model.layer",
        "training",
        "run",
        "sim",
        "fault",
    ]
    .iter()
    .map(|s| (s.to_string(), known_keys(s)))
    .collect()
}

/// A key at the start of `line` (`key = ...`), if one.
fn key_of(line: &str) -> Option<&str> {
    let (k, _) = line.trim_start().split_once('=')?;
    let k = k.trim();
    let ok = !k.is_empty()
        && k.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && k.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    ok.then_some(k)
}

/// `[x]` or `[[x]]` at the start of `line` (comments aside): the section's name.
fn header_of(line: &str) -> Option<&str> {
    let l = line.split('#').next().unwrap_or("").trim();
    let inner = l.strip_prefix("[[").and_then(|r| r.strip_suffix("]]"));
    let inner = inner.or_else(|| l.strip_prefix('[').and_then(|r| r.strip_suffix(']')))?;
    inner
        .chars()
        .all(|c| c.is_ascii_lowercase() || c == '_' || c == '.')
        .then_some(inner)
}

/// The fenced blocks of a document: (info string, first line number, lines).
fn blocks(text: &str) -> Vec<(String, usize, Vec<&str>)> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, Vec<&str>)> = None;
    for (i, line) in text.lines().enumerate() {
        if let Some(info) = line.trim_start().strip_prefix("```") {
            match open.take() {
                Some(b) => out.push(b),
                None => open = Some((info.trim().to_string(), i + 1, Vec::new())),
            }
        } else if let Some(b) = open.as_mut() {
            b.2.push(line);
        }
    }
    out
}

/// The inline code spans of the prose (outside fenced blocks), with their line numbers.
fn spans(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for (k, part) in line.split('`').enumerate() {
            if k % 2 == 1 {
                out.push((i + 1, part.to_string()));
            }
        }
    }
    out
}

#[test]
fn every_cluster_file_key_in_the_docs_is_one_the_parser_knows() {
    let known = cluster_keys();
    // Keys in prose may be a profile's too (`steps_measured = 0`): those of the profile
    // blocks, which must parse as profiles.
    let profile_keys: BTreeSet<String> = documents()
        .iter()
        .flat_map(|(_, t)| blocks(t))
        .filter(|(info, _, lines)| {
            info == "toml" && lines.iter().any(|l| header_of(l) == Some("profile"))
        })
        .flat_map(|(_, _, lines)| {
            lines
                .iter()
                .filter_map(|l| key_of(l.split('#').next().unwrap_or("")).map(String::from))
                .collect::<Vec<_>>()
        })
        .collect();
    let all: BTreeSet<&String> = known.values().flatten().chain(&profile_keys).collect();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (path, text) in documents() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for (info, first, lines) in blocks(&text) {
            if info != "toml" {
                continue;
            }
            let body = lines.join("\n");
            if lines.iter().any(|l| header_of(l) == Some("profile")) {
                // The measured profile (`profile.toml`): its own format, parsed as one.
                if let Err(e) = ravnest_core::profile::Profile::parse(&body, &name) {
                    wrong.push(format!(
                        "{name}:{first}: the profile block does not parse: {e}"
                    ));
                }
                checked += 1;
                continue;
            }
            let mut section = String::new();
            for (k, line) in lines.iter().enumerate() {
                if let Some(h) = header_of(line) {
                    if !known.contains_key(h) {
                        wrong.push(format!("{name}:{}: unknown section [{h}]", first + k + 1));
                    }
                    section = h.to_string();
                } else if let Some(key) = key_of(line.split('#').next().unwrap_or("")) {
                    checked += 1;
                    if !known.get(&section).is_some_and(|s| s.contains(key)) {
                        wrong.push(format!(
                            "{name}:{}: `{key}` is not a key of [{section}]",
                            first + k + 1
                        ));
                    }
                }
            }
        }
        for (line, span) in spans(&text) {
            // `[run] eval_every_steps`, `[training] precision = "bf16"`
            if let Some(rest) = span.strip_prefix('[')
                && let Some((section, after)) = rest.split_once(']')
                && let Some(key) = after
                    .split_whitespace()
                    .next()
                    .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
                && known.contains_key(section)
            {
                checked += 1;
                if !known[section].contains(key) {
                    wrong.push(format!(
                        "{name}:{line}: `{key}` is not a key of [{section}]"
                    ));
                }
            } else if let Some(key) =
                key_of(&span).filter(|k| k.contains('_') || all.iter().any(|a| a == k))
            {
                // `memory_gib = 24`: a key of some section.
                checked += 1;
                if !all.iter().any(|a| *a == key) {
                    wrong.push(format!(
                        "{name}:{line}: `{key}` is not a key of any section"
                    ));
                }
            }
        }
    }
    assert!(checked > 100, "only {checked} keys found in the docs");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Every `--help` text: the program's, and each command's and sub-command's.
fn help_texts() -> String {
    let help = |args: &[&str]| {
        let o = Command::new(exe()).args(args).output().unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let commands = |text: &str| -> Vec<String> {
        text.split("Commands:")
            .nth(1)
            .map(|r| {
                r.lines()
                    .skip(1)
                    .take_while(|l| l.starts_with("  "))
                    .filter_map(|l| l.split_whitespace().next().map(String::from))
                    .filter(|c| c != "help")
                    .collect()
            })
            .unwrap_or_default()
    };
    let top = help(&["--help"]);
    let mut all = top.clone();
    for c in commands(&top) {
        let sub = help(&[&c, "--help"]);
        for s in commands(&sub) {
            all += &help(&[&c, &s, "--help"]);
        }
        all += &sub;
    }
    all
}

/// The `--flags` of `text` (a command line or a code span).
fn flags(text: &str) -> Vec<String> {
    text.split(|c: char| c.is_whitespace() || "`()[]|,;=\"'".contains(c))
        .filter_map(|w| w.strip_prefix("--"))
        .filter(|f| {
            f.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && f.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
        .map(|f| format!("--{}", f.trim_end_matches('-')))
        .collect()
}

/// The part of a line that is `ravnest`'s own command line: after `ravnest ` (or `cargo run
/// ... -- `), none for other programs.
fn ravnest_part(line: &str) -> Option<&str> {
    if let Some(i) = line.find("cargo ") {
        return line[i..].split_once(" -- ").map(|(_, r)| r);
    }
    // A comparison with another launcher names its flags.
    if line.contains("torchrun") || line.contains("--nnodes") {
        return None;
    }
    let i = line.find("ravnest ")?;
    Some(&line[i + "ravnest ".len()..])
}

/// Whether line `n` (from 1) of `text` compares ravnest with torchrun (and names its flags).
fn torchrun_line(text: &str, n: usize) -> bool {
    let lines: Vec<&str> = text.lines().collect();
    lines[n.saturating_sub(4)..(n + 1).min(lines.len())]
        .iter()
        .any(|l| l.contains("torchrun"))
}

#[test]
fn every_command_line_flag_in_the_docs_is_in_the_help() {
    let help = help_texts();
    let known = |f: &str| {
        help.contains(&format!("{f} "))
            || help.contains(&format!("{f}\n"))
            || help.contains(&format!("{f}="))
            || help.contains(&format!("{f},"))
            || help.contains(&format!("{f}]"))
    };
    let mut wrong = BTreeSet::new();
    let mut checked = 0;
    for (path, text) in documents() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut lines: Vec<(usize, String)> = Vec::new();
        for (_, first, body) in blocks(&text) {
            for (k, l) in body.iter().enumerate() {
                lines.push((first + k + 1, l.to_string()));
            }
        }
        lines.extend(spans(&text));
        for (line, l) in lines {
            // A flag alone in backticks is ravnest's (`--resume`); on a command line, only
            // ravnest's own part counts (not cargo's, pip's or torchrun's).
            let part = if l.trim_start().starts_with("--")
                && !l.contains(' ')
                && !torchrun_line(&text, line)
            {
                Some(l.as_str())
            } else {
                ravnest_part(&l)
            };
            for f in part.map(flags).unwrap_or_default() {
                checked += 1;
                if !known(&f) {
                    wrong.insert(format!("{name}:{line}: `{f}` is in no command's --help"));
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} flags found in the docs");
    assert!(
        wrong.is_empty(),
        "{}",
        wrong.into_iter().collect::<Vec<_>>().join("\n")
    );
}
