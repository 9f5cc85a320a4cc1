//! The page: one HTML file with its script and styles inline (no network at view time). It
//! comes with the board embedded and draws it at once; live, it then follows the server-sent
//! events of `/events`; as `report.html` it is the whole run, with nothing else to load.

const PAGE: &str = include_str!("page.html");
const SLOT: &str = "/*SNAPSHOT*/null/*END*/";
const LIVE: &str = "/*LIVE*/false/*END*/";

/// The live page, with the board as it is now.
pub fn live(snapshot: &serde_json::Value) -> String {
    // (The marker is replaced before the board goes in: no string of the board can take it.)
    embed(&PAGE.replacen(LIVE, "true", 1), snapshot)
}

/// The page with `snapshot` embedded: a file that shows the run with nothing else.
pub fn report(snapshot: &serde_json::Value) -> String {
    embed(PAGE, snapshot)
}

fn embed(page: &str, snapshot: &serde_json::Value) -> String {
    // JSON is a JavaScript expression; every `<` is written `\u003c` so that no string in it
    // closes the script element or opens a comment in it (a node named `</script>` or
    // `<!--<script` stays a name).
    let json = serde_json::to_string(snapshot)
        .unwrap_or_else(|_| "null".into())
        .replace('<', "\\u003c")
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029");
    page.replacen(SLOT, &json, 1)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_report_embeds_the_board_and_loads_nothing() {
        let page = super::report(&serde_json::json!({"cluster": "</script><!--<script>x"}));
        assert!(!page.contains(super::SLOT));
        assert!(page.contains(r#"{"cluster":"\u003c/script>\u003c!--\u003cscript>x"}"#));
        let live = super::live(&serde_json::json!({"cluster": super::LIVE}));
        assert!(
            live.contains("const LIVE = true;"),
            "the marker in a string took it"
        );
        assert_eq!(page.matches("</script>").count(), 1);
        for needle in ["src=\"http", "href=\"http", "@import", "url(http"] {
            assert!(!page.contains(needle), "{needle}");
        }
    }
}
