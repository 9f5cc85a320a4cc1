use super::*;

/// The `ravnest` command lines in the shell blocks of README.md and docs/*.md, as argument
/// lists (environment assignments, comments and `cargo run --release --` left out).
fn documented_commands() -> Vec<(String, Vec<String>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut in_sh = false;
        for (i, line) in text.lines().enumerate() {
            let t = line.trim();
            if t.starts_with("```") {
                in_sh = !in_sh && (t == "```sh" || t == "```bash");
                continue;
            }
            if !in_sh {
                continue;
            }
            let code = match t.find(" #") {
                Some(k) => &t[..k],
                None => t,
            };
            // `cargo run --release [--features F] -- ARGS` is `ravnest ARGS`.
            let code = match code.find("cargo run").map(|i| code.split_at(i)) {
                Some((env, cargo)) => match cargo.split_once(" -- ") {
                    Some((_, args)) => format!("{env}ravnest {args}"),
                    None => continue,
                },
                None => code.to_string(),
            };
            let words: Vec<&str> = code
                .split_whitespace()
                .skip_while(|w| w.contains('=') && !w.starts_with('-'))
                .collect();
            if words.first() != Some(&"ravnest") {
                continue;
            }
            let at = format!("{}:{}", f.display(), i + 1);
            out.push((at, words.iter().map(|w| w.to_string()).collect()));
        }
    }
    out
}

#[test]
fn every_documented_command_parses() {
    let commands = documented_commands();
    assert!(commands.len() >= 20, "{commands:?}");
    for (at, args) in &commands {
        if let Err(e) = Cli::try_parse_from(args) {
            panic!("{at}: `{}` does not parse:\n{e}", args.join(" "));
        }
    }
}

#[test]
fn every_subcommand_has_an_example_in_its_help() {
    use clap::CommandFactory;
    let cli = Cli::command();
    let mut all: Vec<&clap::Command> = cli.get_subcommands().collect();
    let nested: Vec<&clap::Command> = all.iter().flat_map(|c| c.get_subcommands()).collect();
    all.extend(nested);
    for sub in all {
        let help = sub
            .get_after_help()
            .map(|h| h.to_string())
            .unwrap_or_default()
            + &sub
                .get_long_about()
                .map(|h| h.to_string())
                .unwrap_or_default();
        assert!(
            help.contains("Example") && help.contains("ravnest "),
            "`ravnest {} --help` has no example",
            sub.get_name()
        );
    }
}
