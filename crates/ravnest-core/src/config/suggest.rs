//! "Did you mean": the nearest valid name to a misspelt one (edit distance), and hints made
//! from serde's "unknown field" and "unknown variant" messages.

use super::types::ConfigError;

/// `e` with `help` as its hint.
pub(super) fn with_help(mut e: ConfigError, help: Option<String>) -> ConfigError {
    e.help = help;
    e
}

/// Levenshtein distance, for "did you mean".
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate nearest to `word`, if it is near enough to be a plausible typo.
pub fn nearest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lw = word.to_lowercase();
    candidates
        .into_iter()
        .map(|c| (edit_distance(&lw, &c.to_lowercase()), c))
        .filter(|(d, c)| *d <= (c.len() / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// The nearest candidate to `word` (if one is near), then every valid name.
pub(super) fn did_you_mean<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str> + Clone,
) -> String {
    let all: Vec<&str> = candidates.clone().into_iter().collect();
    match nearest(word, candidates) {
        Some(n) => format!("did you mean `{n}`? valid: {}", all.join(", ")),
        None => format!("valid: {}", all.join(", ")),
    }
}

/// Turn serde's "unknown field `x`, expected one of `a`, `b`" into a suggestion.
pub(super) fn suggestion_from_serde(message: &str) -> Option<String> {
    let unknown = ["unknown field `", "unknown variant `"]
        .iter()
        .find_map(|p| message.split_once(p))?
        .1
        .split('`')
        .next()?
        .to_string();
    let expected = message.split_once("expected")?.1;
    let names: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    if names.is_empty() {
        return None;
    }
    Some(did_you_mean(&unknown, names))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device;

    #[test]
    fn distance_and_nearest() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(nearest("rtx3909", device::ids()), Some("rtx3090"));
        assert_eq!(nearest("zzzzzzzz", device::ids()), None);
    }

    #[test]
    fn serde_messages_become_suggestions() {
        let m = "unknown field `globl_batch`, expected one of `global_batch`, `micro_batch`";
        assert!(
            suggestion_from_serde(m)
                .unwrap()
                .starts_with("did you mean `global_batch`?")
        );
        let m = "unknown variant `adam`, expected one of `sgd`, `sgd-momentum`, `adamw`";
        assert!(
            suggestion_from_serde(m)
                .unwrap()
                .starts_with("did you mean `adamw`?")
        );
    }
}
