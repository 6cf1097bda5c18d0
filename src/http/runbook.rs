//! `GET /runbook`: docs/RUNBOOK.md as compiled into this binary, rendered as
//! one page whose sections carry the anchors the alerts' `runbook_url`
//! names (`/runbook#treewardendispatchclosed`), so an alert, a banner or a
//! tree page links to the instructions of the very version that runs.

use axum::response::Html;

const RUNBOOK: &str = include_str!("../../docs/RUNBOOK.md");

/// A heading's anchor as GitHub spells it: lower case, spaces to dashes,
/// every character but letters, digits, `-` and `_` left out.
pub fn anchor(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The runbook as HTML, each heading with its anchor.
pub fn render(markdown: &str) -> String {
    use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};
    let mut events: Vec<Event<'_>> = Parser::new_ext(markdown, Options::ENABLE_TABLES).collect();
    let mut at = 0;
    while at < events.len() {
        if let Event::Start(Tag::Heading { id: None, .. }) = &events[at] {
            let mut text = String::new();
            for e in &events[at + 1..] {
                match e {
                    Event::End(TagEnd::Heading(_)) => break,
                    Event::Text(t) | Event::Code(t) => text.push_str(t),
                    _ => {}
                }
            }
            if let Event::Start(Tag::Heading { id, .. }) = &mut events[at] {
                *id = Some(anchor(&text).into());
            }
        }
        at += 1;
    }
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, events.into_iter());
    html
}

/// `GET /runbook`.
pub async fn runbook(
    axum::Extension(principal): axum::Extension<super::auth::Principal>,
) -> Result<Html<String>, super::error::ApiError> {
    principal.must_see_all("the runbook")?;
    Ok(Html(format!(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>treewarden — runbook</title>\n<style>body{{font:15px/1.5 system-ui,sans-serif;\
         max-width:60em;margin:1.5em auto;padding:0 1em;color:#1d2330}}code,pre{{font-family:\
         ui-monospace,monospace;font-size:13px}}pre{{background:#f6f7f9;padding:.7em;overflow:auto}}\
         th,td{{text-align:left;padding:.3em .6em;border-bottom:1px solid #e3e6ec;vertical-align:top}}\
         </style>\n</head>\n<body>\n<p><a href=\"/\">← trees</a></p>\n{}</body>\n</html>\n",
        render(RUNBOOK)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_alert_of_the_rules_has_its_anchor_in_the_served_runbook() {
        let html = render(RUNBOOK);
        let rules = include_str!("../../deploy/prometheus/treewarden-rules.yml");
        let mut alerts = 0;
        for line in rules.lines() {
            if let Some(name) = line.trim().strip_prefix("- alert: ") {
                alerts += 1;
                let id = format!("id=\"{}\"", anchor(name));
                assert!(html.contains(&id), "{name}: no {id} in the served runbook");
            }
        }
        assert!(alerts >= 10, "{alerts} alerts read");
        assert_eq!(anchor("Where to look"), "where-to-look");
        assert_eq!(anchor("`ls` shows (END)!"), "ls-shows-end");
    }
}
