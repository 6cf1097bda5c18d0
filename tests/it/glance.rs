//! The operator's glance: the dashboard says what happened to each tree,
//! why and by whom, from the index and the tree page's first line. The
//! shapes are an on-call shift's (a clean exit, a non-zero exit, a timeout,
//! an API kill of an escaping TERM-ignoring tree, an owner SIGKILLed, a
//! spawn failure, an ambiguous tree), made for real against one `serve`;
//! what the pages say is compared with what each workload and the test
//! itself did (the exit codes it chose, the pids it printed, the token it
//! killed with).

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::time::Duration;

use regex::Regex;
use serde_json::{Value, json};

use crate::serve::Server;
use crate::util::{KillOnDrop, bin, pid_alive, printed_pids, signal, wait_until};

/// Each listed tree's outcome spelling, by id, from the index's rows.
fn outcomes_on(s: &Server, query: &str) -> BTreeMap<i64, String> {
    let r = s.get(&format!("/{query}"));
    assert_eq!(r.status(), 200, "GET /{query}");
    let html = r.text().expect("body");
    let row = Regex::new(r#"(?s)<tr>\s*<td><a href="/trees/(\d+)">.*?data-outcome="([a-z_]+)""#)
        .expect("re");
    row.captures_iter(&html)
        .map(|c| (c[1].parse().expect("id"), c[2].to_string()))
        .collect()
}

/// The tree page's verdict line, tags stripped.
fn verdict(s: &Server, id: i64) -> String {
    let html = s.get(&format!("/trees/{id}")).text().expect("body");
    let line = Regex::new(r#"(?s)<p class="verdict[^"]*" id="verdict">(.*?)</p>"#)
        .expect("re")
        .captures(&html)
        .map(|c| c[1].to_string())
        .unwrap_or_else(|| panic!("tree {id} has no verdict line: {html}"));
    let text = Regex::new(r"<[^>]+>").expect("re").replace_all(&line, "");
    text.replace("&#x27;", "'").replace("&quot;", "\"")
}

/// Waits for tree `id` to reach `state` through the API's long poll.
fn wait_state(s: &Server, id: i64, state: &str) {
    let reached = wait_until(Duration::from_secs(30), || {
        s.tree(id)["tree"]["state"] == state
    });
    assert!(reached, "tree {id} never {state}: {}", s.tree(id));
}

#[test]
fn each_outcome_is_shown_filtered_and_stated_first_on_its_tree_page() {
    let s = Server::start_with_env(&[], &[("TREEWARDEN_BUSY_TIMEOUT", "1s")]);
    let (_, oncall) = crate::session::make_token(&s, "admin", "oncall-alice");

    // A clean exit and a non-zero one: the codes the workload chose.
    let clean = s.spawn(&s.body("exit 0"));
    let nonzero = s.spawn(&s.body("exit 3"));
    // A timeout.
    let mut body = s.body("sleep 300");
    body["timeout"] = json!("300ms");
    let timed = s.spawn(&body);
    for id in [clean, nonzero, timed] {
        wait_state(&s, id, "ended");
    }

    // An escaping, TERM-ignoring tree killed through the API with the
    // on-call's token: every process it printed is force-killed.
    let killed = s.spawn(&s.body(
        "trap '' TERM; \
         setsid sh -c 'echo $$ >> forced.pids; exec sleep 300' & \
         sleep 300 & echo $! >> forced.pids; echo $$ >> forced.pids; wait",
    ));
    let forced_pids = printed_pids(&s.dir.path().join("forced.pids"), 3);
    assert!(
        wait_until(Duration::from_secs(20), || {
            let t = s.tree(killed);
            forced_pids.iter().all(|p| {
                t["members"]
                    .as_array()
                    .is_some_and(|ms| ms.iter().any(|m| m["pid"] == json!(p)))
            })
        }),
        "members not recorded: {}",
        s.tree(killed)
    );
    let r = reqwest::blocking::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .post(s.url(&format!("/api/trees/{killed}/kill?grace=100ms")))
        .bearer_auth(&oncall)
        .send()
        .expect("kill");
    assert_eq!(r.status(), 200);
    let kill: Value = r.json().expect("json");
    assert_eq!(kill["state"], "ended", "{kill}");
    assert!(
        forced_pids.iter().all(|p| !pid_alive(*p)),
        "{forced_pids:?}"
    );

    // An owner SIGKILLed: the tree goes with it.
    let mut owner = KillOnDrop(
        Command::new("sleep")
            .arg("300")
            .stdin(Stdio::null())
            .spawn()
            .expect("owner"),
    );
    let mut body = s.body("sleep 300");
    body["owner_pid"] = json!(owner.0.id());
    let orphaned = s.spawn(&body);
    assert!(wait_until(Duration::from_secs(20), || {
        s.tree(orphaned)["members"]
            .as_array()
            .is_some_and(|m| !m.is_empty())
    }));
    signal(owner.0.id(), rustix::process::Signal::KILL);
    let _ = owner.0.wait();
    wait_state(&s, orphaned, "ended");

    // A spawn failure: a program that is not executable.
    std::fs::write(s.dir.path().join("noexec"), b"#!/bin/sh\n").expect("file");
    let mut body = s.body("");
    body["argv"] = json!(["./noexec"]);
    let (status, answer) = s.post("/api/trees", Some(&body));
    assert_ne!(status, 201, "{answer}");
    let failed_spawn = *outcomes_on(&s, "?all=1&state=spawn_failed")
        .keys()
        .next()
        .unwrap_or_else(|| panic!("no spawn_failed tree after {status} {answer}"));

    // An ambiguous tree: its SIGKILL's authorization cannot be written (the
    // ledger's write lock is held), so the kill is skipped. Last: it closes
    // dispatch.
    let ambiguous = s.spawn(
        &s.body("trap '' TERM; sleep 300 & echo $! >> left.pids; echo $$ >> left.pids; wait"),
    );
    let left = printed_pids(&s.dir.path().join("left.pids"), 2);
    assert!(wait_until(Duration::from_secs(20), || {
        s.tree(ambiguous)["members"]
            .as_array()
            .is_some_and(|m| m.len() >= 2)
    }));
    let url = s.url(&format!("/api/trees/{ambiguous}/kill?grace=300ms"));
    let token = s.token.clone();
    let killing = std::thread::spawn(move || {
        reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client")
            .post(url)
            .bearer_auth(token)
            .send()
            .map(|r| r.status().as_u16())
    });
    let ledger = s.data_dir().join("ledger.db");
    let conn = rusqlite::Connection::open(&ledger).expect("ledger");
    assert!(
        wait_until(Duration::from_secs(20), || {
            conn.query_row(
                "SELECT count(*) FROM events WHERE tree = ?1 AND kind = 'signal.sent'",
                [ambiguous],
                |r| r.get::<_, i64>(0),
            )
            .unwrap_or(0)
                > 0
        }),
        "the first signal is recorded"
    );
    conn.execute_batch("BEGIN IMMEDIATE").expect("write lock");
    let marker = s
        .data_dir()
        .join("unsettled")
        .join(format!("tree-{ambiguous}"));
    let marked = wait_until(Duration::from_secs(30), || marker.exists());
    conn.execute_batch("ROLLBACK").expect("unlock");
    drop(conn);
    assert!(marked, "the skipped kill left its marker: {}", s.stderr());
    let _ = killing.join();
    wait_state(&s, ambiguous, "ambiguous");
    assert!(
        left.iter().all(|p| pid_alive(*p)),
        "the survivors live on as evidence"
    );

    // The banner's runbook link opens the section the service serves.
    let index = s.get("/?all=1&refresh=0").text().expect("index");
    assert!(
        index.contains("href=\"/runbook#treewardendispatchclosed\""),
        "{index}"
    );
    let runbook = s.get("/runbook");
    assert_eq!(runbook.status(), 200);
    let runbook = runbook.text().expect("runbook");
    assert!(
        runbook.contains("id=\"treewardendispatchclosed\""),
        "the served runbook has the section the banner names"
    );

    // The index: every tree with its own outcome.
    let expected: BTreeMap<i64, &str> = [
        (clean, "exited"),
        (nonzero, "failed"),
        (timed, "timed_out"),
        (killed, "killed"),
        (orphaned, "owner_gone"),
        (failed_spawn, "spawn_failed"),
        (ambiguous, "ambiguous"),
    ]
    .into_iter()
    .collect();
    let shown = outcomes_on(&s, "?all=1");
    for (id, outcome) in &expected {
        assert_eq!(
            shown.get(id).map(String::as_str),
            Some(*outcome),
            "tree {id} on the index: {shown:?}"
        );
    }
    // Each filter returns exactly the trees of its outcome.
    for outcome in expected.values() {
        let want: BTreeSet<i64> = expected
            .iter()
            .filter(|(_, o)| *o == outcome)
            .map(|(id, _)| *id)
            .collect();
        let got: BTreeSet<i64> = outcomes_on(&s, &format!("?outcome={outcome}"))
            .into_keys()
            .collect();
        assert_eq!(got, want, "?outcome={outcome}");
    }
    let forced: BTreeSet<i64> = outcomes_on(&s, "?outcome=forced").into_keys().collect();
    assert_eq!(forced, BTreeSet::from([killed]), "?outcome=forced");
    // A filter value that is not an outcome: 400, one line.
    let r = s.get("/?outcome=exploded");
    assert_eq!(r.status(), 400);

    // Each tree page's first line: outcome, actor, time and counts.
    let v = verdict(&s, clean);
    assert!(v.contains("Exited: its root exited 0"), "{v}");
    let v = verdict(&s, nonzero);
    assert!(v.contains("Failed: its root exited 3"), "{v}");
    let v = verdict(&s, timed);
    assert!(v.contains("Timed out (timeout after 300ms)"), "{v}");
    let v = verdict(&s, killed);
    assert!(
        v.contains("Killed by token") && v.contains("(oncall-alice)"),
        "{v}"
    );
    let n = forced_pids.len();
    assert!(
        v.contains(&format!("{n} force-killed under authorization #")),
        "{v} (the workload printed {n} pids)"
    );
    let v = verdict(&s, orphaned);
    assert!(
        v.contains(&format!("Owner gone (client pid {})", owner.0.id())),
        "{v}"
    );
    let v = verdict(&s, failed_spawn);
    assert!(v.starts_with("spawn_failed Spawn failed"), "{v}");
    let v = verdict(&s, ambiguous);
    assert!(
        v.contains(&format!("First step: treewarden kill {ambiguous}")),
        "{v}"
    );
    assert!(
        v.contains(&format!("{} processes not known to be gone", left.len())),
        "{v}"
    );
    // The survivors are marked alive in its process tree.
    let page = s.get(&format!("/trees/{ambiguous}")).text().expect("body");
    assert_eq!(
        page.matches("alive at the last look").count(),
        left.len(),
        "{page}"
    );

    // The trail for an incident: the important preset leaves out the
    // member noise and keeps the kill's authority; a text search finds the
    // on-call's token in the kill request; `until` before the first tree
    // shows nothing of it.
    let kinds_on = |query: &str| -> Vec<String> {
        let html = s.get(&format!("/events{query}")).text().expect("events");
        Regex::new(r"<td>([a-z_]+\.[a-z_]+)</td><td>")
            .expect("re")
            .captures_iter(&html)
            .map(|c| c[1].to_string())
            .collect()
    };
    let important = kinds_on("?important=1&live=0");
    assert!(
        important.contains(&"kill.authorized".to_string()),
        "{important:?}"
    );
    assert!(
        important.contains(&"kill.requested".to_string()),
        "{important:?}"
    );
    assert!(
        !important.iter().any(|k| k.starts_with("member.")),
        "{important:?}"
    );
    let everything = kinds_on("?live=0");
    assert!(
        everything.iter().any(|k| k.starts_with("member.")),
        "{everything:?}"
    );
    // The token's creation, the kill request, and the teardown's reasons
    // (which name who asked) carry the name; nothing else does.
    let mut found = kinds_on("?text=oncall-alice&live=0");
    found.sort();
    found.dedup();
    assert_eq!(
        found,
        [
            "kill.authorized",
            "kill.requested",
            "token.created",
            "tree.state"
        ],
        "text search"
    );
    let created = s.tree(clean)["tree"]["created_at"]
        .as_str()
        .expect("created_at")
        .to_string();
    let before = kinds_on(&format!("?until={created}&tree={clean}&live=0"));
    assert!(before.is_empty(), "{before:?}");
    let labelled = kinds_on("?label=tes&kind=tree.created&live=0");
    assert_eq!(
        labelled.len(),
        7,
        "every tree is labelled test: {labelled:?}"
    );
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let page = s.get("/events?live=0").text().expect("events");
    assert!(
        page.contains(&format!("on {}", host.trim())),
        "the host is named"
    );

    // What an on-call sees, in a real browser.
    pages_in_a_browser(
        &s,
        &[
            ("index", "/?all=1&refresh=0".to_string()),
            ("force-killed", format!("/trees/{killed}")),
            ("owner-gone", format!("/trees/{orphaned}")),
            ("ambiguous", format!("/trees/{ambiguous}")),
        ],
    );

    // The survivors, ended by their pids; the tree settled for the drop.
    for p in left {
        signal(p as u32, rustix::process::Signal::KILL);
    }
    let _ = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["resolve", &ambiguous.to_string(), "--note", "test over"])
        .output();
}

/// axe-core's script, as tests/setup installs it from tests/a11y's lock.
/// The `href` of the link `id` on `html`, its `&` read back from HTML
/// (`&amp;` as the template writes it, `&#38;` as askama escapes it).
fn export_link(html: &str, id: &str) -> String {
    Regex::new(&format!(r#"<a id="{id}" href="([^"]*)""#))
        .expect("re")
        .captures(html)
        .map(|c| c[1].replace("&amp;", "&").replace("&#38;", "&"))
        .unwrap_or_else(|| panic!("no link #{id} on {html}"))
}

#[test]
fn each_export_link_carries_its_pages_filter_and_downloads_what_verifies() {
    let s = Server::start(&[]);
    let (_, token) = crate::session::make_token(&s, "admin", "reviewer");
    let cookie = crate::session::session_cookie(&s, &token);
    let ours = s.spawn(&s.body("exit 3"));
    let other = s.spawn(&s.body("exit 0"));
    for id in [ours, other] {
        wait_state(&s, id, "ended");
    }
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    // What a browser does with the page and its link: the session cookie.
    let read = |path: &str| -> String {
        let r = http
            .get(s.url(path))
            .header("cookie", &cookie)
            .send()
            .expect("GET");
        assert_eq!(r.status(), 200, "GET {path}");
        r.text().expect("body")
    };
    let scratch = tempfile::tempdir().expect("temp dir");
    // The download verifies alone (`verify --export`, no ledger) as a
    // filtered export: its events, the ledger's seals aside.
    let download = |link: &str| -> Vec<Value> {
        let body = read(link);
        let file = scratch.path().join("export.ndjson");
        std::fs::write(&file, &body).expect("write the download");
        let out = Command::new(bin())
            .arg("--data-dir")
            .arg(scratch.path().join("none"))
            .args(["verify", "--export"])
            .arg(&file)
            .output()
            .expect("verify --export");
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{link}: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains("a filtered export"), "{link}: {said}");
        crate::util::parse_ndjson(&body)
            .into_iter()
            .filter(|l| l.get("seq").is_some() && l["kind"] != "ledger.seal")
            .collect()
    };
    let seqs = |events: &[Value]| -> Vec<i64> {
        events.iter().filter_map(|e| e["seq"].as_i64()).collect()
    };
    let of_ours: Vec<Value> = s.tree(ours)["events"]
        .as_array()
        .expect("the tree's events")
        .clone();

    // A tree's page: that tree's events, all of them, nothing else.
    let page = read(&format!("/trees/{ours}"));
    let link = export_link(&page, "export-ndjson");
    assert_eq!(link, format!("/api/export?format=ndjson&tree={ours}"));
    assert_eq!(seqs(&download(&link)), seqs(&of_ours), "{link}");
    assert_eq!(
        export_link(&page, "export-csv"),
        format!("/api/export?format=csv&tree={ours}")
    );

    // The events page filtered by tree, kind and time: the same filter.
    let page = read(&format!("/events?tree={ours}&kind=tree.&since=1h&live=0"));
    let link = export_link(&page, "export-ndjson");
    assert_eq!(
        link,
        format!("/api/export?format=ndjson&tree={ours}&kind=tree.&since=1h")
    );
    let want: Vec<Value> = of_ours
        .iter()
        .filter(|e| e["kind"].as_str().is_some_and(|k| k.starts_with("tree.")))
        .cloned()
        .collect();
    assert!(want.len() > 1, "{want:?}");
    assert_eq!(seqs(&download(&link)), seqs(&want), "{link}");
    assert!(!page.contains("export-leaves-out"), "it takes them all");
    let until = s.tree(other)["tree"]["created_at"]
        .as_str()
        .expect("created_at")
        .to_string();
    let page = read(&format!("/events?until={until}&live=0"));
    let link = export_link(&page, "export-ndjson");
    let got = download(&link);
    assert!(
        got.iter().all(|e| e["at"].as_str() < Some(until.as_str())),
        "{link}: {got:?}"
    );
    assert!(
        got.iter().any(|e| e["tree"] == ours) && !got.iter().any(|e| e["tree"] == other),
        "{link}: {got:?}"
    );

    // What the export cannot take is said, not carried; a field the page
    // could not read (its banner says so) is left out of the link too.
    let page = read("/events?label=tes&important=1&kind=kill.&live=0");
    assert_eq!(
        export_link(&page, "export-ndjson"),
        "/api/export?format=ndjson&kind=kill."
    );
    assert!(page.contains("not label, important)"), "{page}");
    let page = read("/events?tree=abc&live=0");
    assert_eq!(
        export_link(&page, "export-ndjson"),
        "/api/export?format=ndjson"
    );
    // The link reads with a session or a token, never without either.
    assert_eq!(
        s.get_anon(&format!("/api/export?format=ndjson&tree={ours}"))
            .status(),
        401
    );
}

fn axe_script() -> Option<String> {
    let at = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/a11y/node_modules/axe-core/axe.min.js");
    std::fs::read_to_string(at).ok()
}

/// A prerequisite is missing: "skipped: <why>", or a failure where every
/// lane is required (CI).
fn missing(why: &str) {
    assert!(
        std::env::var("TREEWARDEN_LANE_REQUIRED").as_deref() != Ok("1"),
        "required but missing: {why}"
    );
    crate::util::skip(why);
}

/// The pages an on-call reads, in Chromium: signed in through the real
/// form from a deep link (which it comes back to), each page checked by
/// axe-core (no serious or critical violation) and screenshotted into
/// target/artifacts/dashboard-<name>.png.
fn pages_in_a_browser(s: &Server, pages: &[(&str, String)]) {
    use crate::session::{Browser, CHROMIUM};
    use base64::Engine as _;
    if !std::path::Path::new(CHROMIUM).exists() {
        missing("the browser pages: chromium is not installed (Debian package chromium)");
        return;
    }
    let Some(axe) = axe_script() else {
        missing(
            "the accessibility check: axe-core is not installed (tests/setup puts it in target/a11y)",
        );
        return;
    };
    let mut b = Browser::start();
    b.page(
        "Emulation.setDeviceMetricsOverride",
        json!({"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": false}),
    );
    // A deep link, unauthenticated: the form, then back to the link.
    b.sign_in_through(s, &s.url(&pages[1].1));
    let artifacts = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/artifacts");
    std::fs::create_dir_all(&artifacts).expect("artifacts dir");
    for (name, path) in pages {
        let url = s.url(path);
        b.navigate(&url);
        b.wait_for(name, |h| h == url);
        b.page(
            "Runtime.evaluate",
            json!({"expression": axe, "returnByValue": true}),
        );
        let found = b.page(
            "Runtime.evaluate",
            json!({
                "expression": "axe.run(document, {resultTypes: ['violations']}).then(r => r.violations.map(v => ({id: v.id, impact: v.impact, nodes: v.nodes.length, help: v.help})))",
                "awaitPromise": true,
                "returnByValue": true,
            }),
        )["result"]["value"]
            .clone();
        let all = found.as_array().cloned().unwrap_or_default();
        let serious: Vec<&Value> = all
            .iter()
            .filter(|v| v["impact"] == "serious" || v["impact"] == "critical")
            .collect();
        assert!(serious.is_empty(), "{name}: {serious:?}");
        crate::util::say(&format!(
            "dashboard {name}: axe-core found {} violations, none serious or critical {:?}",
            all.len(),
            all.iter().map(|v| v["id"].to_string()).collect::<Vec<_>>()
        ));
        let shot = b.page(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true}),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("png data"))
            .expect("base64");
        std::fs::write(artifacts.join(format!("dashboard-{name}.png")), png).expect("screenshot");
    }
    let _ = b.call(None, "Browser.close", json!({}));
}
