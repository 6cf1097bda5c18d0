//! The dashboard on a long-running host's ledger: 10,000 trees and over
//! 100,000 events, built through the ledger API (the same writes a service
//! makes), served by the real `treewarden serve`.
//!
//! What is checked is the shape of the paging, which a timing alone could
//! not show: walking the `older` links visits every tree and every event
//! exactly once, in order, and the `newer` links walk back to the first
//! page; a page is found by a keyset bound, so a page deep in a big ledger
//! answers like the first page of a small one. The latency comparison is a
//! guard against a page that reads the whole ledger (a full read of 10,000
//! trees or 100,000 events is tens of times slower than a page), with room
//! for a loaded CI machine; the figures themselves come from `bench/run`.

use std::path::Path;
use std::time::{Duration, Instant};

use treewarden::ledger::{
    ExitRecord, IdentityRecord, Ledger, LedgerOptions, MemberRecord, NewTree, OwnerKind,
    OwnerRecord, Resources, SpawnRecord, TreeState,
};

use crate::serve::Server;

fn ident(pid: i32) -> IdentityRecord {
    IdentityRecord {
        pid,
        start_ticks: 1_000 + pid as u64,
        boot_id: "scale-test".into(),
    }
}

fn open_with_owner(path: &Path) -> (Ledger, treewarden::ledger::OwnerId) {
    let ledger = Ledger::open(path, LedgerOptions::default()).expect("ledger");
    let owner = ledger
        .register_owner(&OwnerRecord {
            identity: ident(1),
            kind: OwnerKind::Service,
        })
        .expect("owner");
    (ledger, owner)
}

/// One ended tree (number `t`) with `members` members, each seen and
/// exited: `3 + 2 * members` events.
fn add_tree(
    ledger: &Ledger,
    owner: treewarden::ledger::OwnerId,
    t: usize,
    members: usize,
    resources: Option<Resources>,
) {
    let base = 10_000 + (t as i32) * 10;
    let id = ledger
        .create_tree(&NewTree {
            label: Some(if t.is_multiple_of(2) { "even" } else { "odd" }.into()),
            boundary: treewarden::proc::BoundaryKind::Session,
            owner,
            argv: vec!["sh".into(), "-c".into(), format!("job {t}")],
            cwd: Some("/tmp".into()),
            grace_ms: Some(200),
            timeout_ms: None,
            limits: Default::default(),
            first_signal: None,
        })
        .expect("create");
    ledger
        .tree_spawned(
            id,
            &SpawnRecord {
                root: ident(base),
                pgid: base,
                sid: base,
                cgroup: None,
            },
        )
        .expect("spawned");
    let seen: Vec<MemberRecord> = (0..members as i32)
        .map(|m| MemberRecord {
            identity: ident(base + m),
            ppid: if m == 0 { 1 } else { base },
            pgid: base,
            sid: base,
            cgroup: None,
            uid: Some(0),
            exe: Some("/bin/sh".into()),
            cmdline: vec!["sh".into(), format!("member-{t}-{m}")],
            cwd: Some("/tmp".into()),
        })
        .collect();
    ledger.observe_members(id, &seen).expect("members");
    let exit = ExitRecord {
        code: Some(0),
        signal: None,
        cpu_usec: None,
    };
    let exits: Vec<(IdentityRecord, Option<ExitRecord>)> = seen
        .iter()
        .map(|m| (m.identity.clone(), Some(exit)))
        .collect();
    ledger.record_exits(id, &exits, "parent").expect("exits");
    ledger
        .end_tree_with(id, TreeState::Ended, Some(exit), resources)
        .expect("end");
}

/// Builds a ledger of `trees` ended trees with `members` members each.
/// Returns the number of events written.
fn build(path: &Path, trees: usize, members: usize) -> u64 {
    let (ledger, owner) = open_with_owner(path);
    for t in 0..trees {
        add_tree(&ledger, owner, t, members, None);
    }
    ledger
        .head()
        .expect("head")
        .map_or(0, |(seq, _)| seq as u64)
}

/// A consistent copy of a freshly built ledger, for a server to start on.
/// Built in memory-backed storage where the host has it: the writes are
/// the service's own (two of them synchronous=FULL per tree), and what is
/// tested is the reading, not the disk's fsync.
fn seed(dir: &Path, trees: usize, members: usize) -> (std::path::PathBuf, u64) {
    let shm = tempfile::tempdir_in("/dev/shm").ok();
    let built = shm
        .as_ref()
        .map_or(dir, |d| d.path())
        .join(format!("built-{trees}.db"));
    let events = build(&built, trees, members);
    let copy = dir.join(format!("seed-{trees}.db"));
    Ledger::open(&built, LedgerOptions::default())
        .expect("reopen")
        .backup_to(&copy)
        .expect("backup");
    (copy, events)
}

/// The link of a page with this element id, decoded from the page's HTML
/// (`&` is the one escaped character: the queries hold numbers and words).
fn link(html: &str, id: &str) -> Option<String> {
    let at = html.find(&format!("<a id=\"{id}\" href=\""))?;
    let rest = &html[at + id.len() + 15..];
    Some(
        rest[..rest.find('"')?]
            .replace("&amp;", "&")
            .replace("&#38;", "&"),
    )
}

/// The numbers in the first column of each body row of a page's table:
/// tree ids on the index (`href="/trees/N"`), seqs on the events page.
fn keys(html: &str, marker: &str) -> Vec<i64> {
    html.match_indices(marker)
        .filter_map(|(at, _)| {
            let rest = &html[at + marker.len()..];
            let end = rest.find(|c: char| !c.is_ascii_digit())?;
            rest[..end].parse().ok()
        })
        .collect()
}

struct Walk {
    keys: Vec<i64>,
    pages: usize,
    /// The slowest and the median page, over every page walked.
    slowest: Duration,
    median: Duration,
}

/// Follows the `older` links from `first` to the last page, then the
/// `newer` links back, checking that they come back through the same pages.
fn walk(server: &Server, first: &str, marker: &str) -> Walk {
    let mut times = Vec::new();
    let mut fetch = |path: &str| -> String {
        let t = Instant::now();
        let (status, html) = server
            .http_get_with(path, "text/html")
            .unwrap_or_else(|| panic!("GET {path}"));
        times.push(t.elapsed());
        assert_eq!(status, 200, "GET {path}: {html}");
        html
    };
    let mut pages: Vec<Vec<i64>> = Vec::new();
    let mut path = first.to_string();
    let mut html = fetch(&path);
    loop {
        let page = keys(&html, marker);
        assert!(!page.is_empty(), "an empty page at {path}");
        pages.push(page);
        match link(&html, "older") {
            Some(q) => path = q,
            None => break,
        }
        assert!(pages.len() < 10_000, "the older links never end: {path}");
        html = fetch(&path);
    }
    // And back up: each newer page is the one walked before it.
    let mut back = pages.len() - 1;
    while back > 0 {
        let q = link(&html, "newer")
            .unwrap_or_else(|| panic!("the newer links stop {back} pages before the first"));
        back -= 1;
        html = fetch(&q);
        assert_eq!(keys(&html, marker), pages[back], "newer page at {q}");
    }
    // Past the first page walked, only what the service appended since the
    // walk began (its own events: a sweep of the seeded trees, say).
    if let Some(q) = link(&html, "newer") {
        let top = pages[0][0];
        let newer = keys(&fetch(&q), marker);
        assert!(
            newer.iter().all(|k| *k > top),
            "the newer link of the first page leads back into it: {q} {newer:?}"
        );
    }
    times.sort();
    Walk {
        pages: pages.len(),
        keys: pages.into_iter().flatten().collect(),
        slowest: *times.last().expect("a page"),
        median: times[times.len() / 2],
    }
}

#[test]
fn the_dashboard_pages_through_ten_thousand_trees_and_a_hundred_thousand_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = Instant::now();
    let (big, big_events) = seed(dir.path(), 10_000, 4);
    crate::util::say(&format!(
        "built 10,000 trees / {big_events} events in {:?}",
        t.elapsed()
    ));
    assert!(big_events >= 100_000, "{big_events} events");
    let (small, small_events) = seed(dir.path(), 100, 4);

    let tree_marker = "<td><a href=\"/trees/";
    let event_marker = "<tr><td>";
    let mut medians = Vec::new();
    for (ledger, trees, events) in [(&small, 100, small_events), (&big, 10_000, big_events)] {
        let server = Server::start_seeded(ledger, &["--scan-interval", "1s"]);
        let w = walk(&server, "/?all=1", tree_marker);
        let want: Vec<i64> = (1..=trees).rev().collect();
        assert_eq!(w.keys, want, "every tree once, newest first");
        let e = walk(&server, "/events", event_marker);
        // Only the seqs the generated ledger holds (the service appends its
        // own start-up events above them).
        let walked: Vec<i64> = e
            .keys
            .iter()
            .copied()
            .filter(|s| *s <= events as i64)
            .collect();
        let want: Vec<i64> = (1..=events as i64).rev().collect();
        assert_eq!(walked, want, "every event once, newest first");
        crate::util::say(&format!(
            "{trees} trees: {} index pages (median {:?}, slowest {:?}); {} event pages (median {:?}, slowest {:?})",
            w.pages, w.median, w.slowest, e.pages, e.median, e.slowest
        ));
        medians.push((w.median, e.median));
    }
    let (small_m, big_m) = (medians[0], medians[1]);
    // A keyset page costs the same in either ledger; a full read of the big
    // one would cost tens of times more. 3x and 20 ms of room for CI noise.
    let room = |small: Duration| small * 3 + Duration::from_millis(20);
    assert!(
        big_m.0 <= room(small_m.0),
        "index page: {big_m:?} vs {small_m:?}"
    );
    assert!(
        big_m.1 <= room(small_m.1),
        "events page: {big_m:?} vs {small_m:?}"
    );
}

#[test]
fn a_page_beyond_the_ends_links_back_and_both_bounds_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ledger, _) = seed(dir.path(), 30, 1);
    let server = Server::start_seeded(&ledger, &["--scan-interval", "1s"]);
    // Below the oldest tree: nothing to show, a way back up.
    let (status, html) = server
        .http_get_with("/?all=1&before=1", "text/html")
        .expect("GET");
    assert_eq!(status, 200);
    assert!(keys(&html, "<td><a href=\"/trees/").is_empty(), "{html}");
    assert!(link(&html, "older").is_none(), "{html}");
    let up = link(&html, "newer").expect("a link back");
    let (_, html) = server.http_get_with(&up, "text/html").expect("GET");
    assert_eq!(
        keys(&html, "<td><a href=\"/trees/"),
        (1..=30).rev().collect::<Vec<_>>()
    );
    // The newest page read through `after`: no newer page beyond it.
    let (_, html) = server
        .http_get_with("/?all=1&after=0", "text/html")
        .expect("GET");
    assert!(link(&html, "newer").is_none(), "{html}");
    let (status, _) = server
        .http_get_with("/?all=1&before=5&after=2", "text/html")
        .expect("GET");
    assert_eq!(status, 400);
    let (status, _) = server
        .http_get_with("/events?before=5&after=2", "text/html")
        .expect("GET");
    assert_eq!(status, 400);
    // The API's list pages the same way: at most `limit`, a `next` link.
    let mut path = "/api/trees?all=1&limit=12".to_string();
    let mut ids: Vec<i64> = Vec::new();
    let mut pages = 0;
    loop {
        let r = server.get(&path);
        assert_eq!(r.status(), 200, "{path}");
        let next = r
            .headers()
            .get("link")
            .and_then(|v| v.to_str().ok())
            .map(|l| {
                l.trim_start_matches('<')
                    .split('>')
                    .next()
                    .unwrap_or("")
                    .to_string()
            });
        let page: Vec<serde_json::Value> = r.json().expect("json");
        assert!(page.len() <= 12);
        ids.extend(page.iter().filter_map(|t| t["id"].as_i64()));
        pages += 1;
        match next {
            Some(n) => path = n,
            None => break,
        }
        assert!(pages < 10, "the next links never end");
    }
    assert_eq!(ids, (1..=30).rev().collect::<Vec<_>>());
    assert_eq!(pages, 3);
    for bad in ["limit=0", "limit=1001", "before=0"] {
        assert_eq!(
            server.get(&format!("/api/trees?all=1&{bad}")).status(),
            400,
            "{bad}"
        );
    }
}

#[test]
fn the_index_filters_by_creation_time_and_shows_each_trees_owner_and_consumption() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("built.db");
    let (ledger, owner) = open_with_owner(&path);
    for t in 0..5 {
        add_tree(&ledger, owner, t, 1, None);
    }
    // A moment strictly between tree 5's events and tree 6's (the ledger
    // writes milliseconds).
    let t0 = std::time::SystemTime::now() + Duration::from_millis(2);
    crate::util::wait_until(Duration::from_secs(1), || {
        std::time::SystemTime::now() > t0 + Duration::from_millis(2)
    });
    let used = Resources {
        cpu_usec: Some(1_500),
        memory_peak_bytes: Some(3 * 1_048_576),
        ..Resources::default()
    };
    for t in 5..10 {
        add_tree(&ledger, owner, t, 1, (t == 9).then_some(used));
    }
    let seed = dir.path().join("seed.db");
    ledger.backup_to(&seed).expect("backup");
    drop(ledger);
    let server = Server::start_seeded(&seed, &["--scan-interval", "1s"]);
    let since = humantime::format_rfc3339_millis(t0).to_string();
    let page = |q: &str| -> String {
        let (status, html) = server.http_get_with(q, "text/html").expect("GET");
        assert_eq!(status, 200, "{q}: {html}");
        html
    };
    let html = page(&format!("/?all=1&since={since}"));
    assert_eq!(
        keys(&html, "<td><a href=\"/trees/"),
        [10, 9, 8, 7, 6],
        "{html}"
    );
    // The filter is kept in the form and in the page links.
    assert!(html.contains(&format!("value=\"{since}\"")), "{html}");
    let html = page("/?all=1&since=2000-01-01T00:00:00Z");
    assert_eq!(keys(&html, "<td><a href=\"/trees/").len(), 10);
    let future =
        humantime::format_rfc3339_millis(std::time::SystemTime::now() + Duration::from_secs(3600));
    let html = page(&format!("/?all=1&since={future}"));
    assert!(keys(&html, "<td><a href=\"/trees/").is_empty(), "{html}");
    let (status, _) = server
        .http_get_with("/?all=1&since=yesterday-ish", "text/html")
        .expect("GET");
    assert_eq!(status, 400);
    // Owner and consumption per tree: tree 10 is the one given resources.
    let html = page("/?all=1");
    let row = |id: i64| -> String {
        let at = html
            .find(&format!("<td><a href=\"/trees/{id}\">"))
            .expect("row");
        html[at..at + html[at..].find("</tr>").expect("row end")].to_string()
    };
    assert!(row(10).contains("service 1"), "{}", row(10));
    assert!(
        row(10).contains("cpu 1.5 ms, memory peak 3.0 MiB"),
        "{}",
        row(10)
    );
    assert!(!row(9).contains("cpu"), "{}", row(9));
    // An ended tree's owner is shown without a liveness claim.
    assert!(!row(10).contains("(alive)") && !row(10).contains("(gone)"));
}
